//! The peers' routing policies, re-implemented from their documentation and
//! source for the simulator, so that `kvroute sim run` compares kvroute's
//! default against what NVIDIA Dynamo, SGLang Model Gateway (SMG) and llm-d do
//! with the same fleet and the same workload.
//!
//! Each policy is a [`kvroute_select::Scorer`] (through [`PeerScorer`]), so it
//! runs inside a real rule wherever kvroute's own scorers run. It sees, per
//! eligible worker, a [`WorkerView`] — what the KV-event index, the router's
//! own bookkeeping and the engine's report know at decision time, built from
//! the rule's [`Candidate`]s — and the prompt's block keys ([`PeerRequest`]);
//! it returns a worker. They are pure state machines: time comes in as
//! `now_us`, randomness from a [`StdRng`] seeded at construction, and no pick
//! allocates once the scratch buffers have grown to the fleet's size (SMG's
//! approximate tree grows with what it was sent and is cut back to its size
//! bound at each eviction run).
//!
//! | policy | peer, version read | formula | parameters (default) |
//! |---|---|---|---|
//! | `dynamo-cost` ([`DynamoCost`]) | NVIDIA Dynamo KV router: `lib/kv-router/src/scheduling/selector/default.rs` and `scheduling/config.rs` (2026 tree, `KvRouterConfig`), the `overlap_score_weight` form in `lib/llm/src/kv_router/scheduler.rs` + `sequence.rs` and `docs/architecture/kv_cache_routing.md` ("cost = overlap_score_weight × prefill_blocks + decode_blocks") | per worker, lower is better: `prefill_load_scale × max(0, (queued_prefill_tokens + prompt_tokens) / block_size − overlap_score_credit × decay × prefix_blocks) + active_blocks + (prompt_blocks − active_prefix_blocks) + decode_active_request_weight × in_flight`, with `decay = 1 / (1 + overlap_score_credit_decay × (queued − min queued) / block_size / request_blocks)`; temperature 0 → argmin, ties uniformly at random; temperature > 0 → softmax sampling of `−(cost − min) / ((max − min) × T)` | `overlap_score_credit` 1.0, `prefill_load_scale` 1.0 (the deprecated `overlap_score_weight` sets it), `overlap_score_credit_decay` 0.0, `decode_active_request_weight` 0.0, `router_temperature` 0.0 |
//! | `smg-cache-aware` ([`SmgCacheAware`]) | SGLang Model Gateway (lightseekorg/smg v1.9.0 snapshot `73da68c`): `model_gateway/src/policies/cache_aware.rs`, CLI defaults in `model_gateway/src/main.rs`, tree in `crates/kv_index/src/string_tree.rs` | loads = requests the router has in flight per worker; **imbalanced** when `max − min > balance_abs_threshold` **and** `max > min × balance_rel_threshold` (or a KV-usage trigger, off by default) → the least-loaded worker; else match the prompt in the router's own approximate prefix tree (built only from what it routed, no KV events): if `matched / prompt > cache_threshold` → the worker owning the deepest match, else the least-loaded worker; least-loaded ties go to fewer requests routed so far, then the lower index; the chosen worker's tree always gets the prompt | `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold` 1.5, `eviction_interval` 120 s, `max_tree_size` 2²⁶ characters (here 2²⁴ tokens), `balance_token_usage_threshold` 1.0 and `overload_token_usage_threshold` 1.0 (disabled) |
//! | `llmd-weighted` ([`LlmdWeighted`]) | llm-d inference scheduler (`llm-d/llm-d-inference-scheduler` snapshot `520af47`, v0.8.0): `deploy/config/epp-precise-prefix-cache-config.yaml`, scorers in `pkg/epp/framework/plugins/scheduling/scorer/{preciseprefixcache,queuedepth,kvcacheutilization}`, `picker/maxscore/picker.go` | `2 × prefix + 1 × queue + 1 × kv`, with `prefix = min(1, prefix_blocks / prompt_blocks)` (precise, from KV events), `queue = (max_waiting − waiting) / (max_waiting − min_waiting)` (1 when all equal), `kv = 1 − kv_usage`; argmax, ties uniformly at random (their picker shuffles, then sorts stably) | `prefix_weight` 2.0, `queue_weight` 1.0, `kv_cache_weight` 1.0 (the shipped precise-prefix config; the built-in default profile with the approximate prefix scorer uses 3 / 2 / 2, see [`LlmdWeighted::with_weights`]) |
//!
//! What differs from the real thing, and why:
//!
//! * **Dynamo** tracks, in the router, the blocks of the requests it has in
//!   flight and dedups the request's blocks against them (`new_blocks`); here
//!   that is [`ActiveSequences`], which the simulator feeds as Dynamo's router
//!   does (a request's prompt blocks from its decision to its end, shared
//!   blocks once, no generated blocks), shared by all replicas at once (its
//!   `router_replica_sync` on, and lossless). Host/disk/shared-cache
//!   tiers, the router-side queue (`router_queue_threshold`) and per-request
//!   overrides are left out: the simulated fleet has one device tier and no
//!   router queue.
//! * **SMG** over HTTP matches raw prompt *characters* in a radix tree; here
//!   the tree is over block keys (one node per block, chained keys name whole
//!   prefixes), the match rate is `matched_blocks × block_size /
//!   prompt_tokens`, and `max_tree_size` is in tokens, converted from SMG's
//!   2²⁶ characters at ~4 characters per token. SMG stamps recency on the last
//!   node of an insert and picks "the" tenant of the deepest node from a
//!   cache; here every node on the path takes the insert's stamp and the
//!   deepest node's most recently stamped worker wins. Eviction is SMG's:
//!   every `eviction_interval`, each worker's tree above the bound loses its
//!   least recently used leaves until it fits (between runs it may exceed the
//!   bound, as SMG's does).
//! * **Engine gauges** (waiting requests, KV usage and capacity) reach the
//!   peers as their scrapers read them: every `--peer-poll-ms` (50 ms, llm-d
//!   endpoint picker's default `--refresh-metrics-interval`), so
//!   between two scrapes a queue looks unchanged — llm-d's queue scorer then
//!   sends every fresh prompt of a burst to the same engine, as it would
//!   live. `--peer-poll-ms 0` gives them every engine's gauges exactly at
//!   each decision, including what other replicas placed at that instant,
//!   which no scrape can see. The router-side counts (Dynamo's queued
//!   prefill and active blocks, SGLang's in-flight requests) are shared
//!   between replicas as kvroute's are, which favours the peers: by default
//!   Dynamo's routers do not share theirs (`router_replica_sync` off) and
//!   each SMG gateway counts only what it sent.

mod active;
mod dynamo;
mod llmd;
mod smg;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex};

use kvroute_core::BlockKey;
use kvroute_select::{Candidate, ScoreInput, ScorePick, Scorer};
use rand::rngs::StdRng;
use rand::Rng;

pub use active::ActiveSequences;
pub use dynamo::{softmax_probabilities, DynamoCost};
pub use llmd::LlmdWeighted;
pub use smg::{SmgCacheAware, CHARS_PER_TOKEN, SMG_MAX_TREE_CHARS};

/// What a policy sees of one worker at decision time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerView {
    /// Longest cached prefix of this prompt, in blocks, per the KV-event index
    /// (what Dynamo's and llm-d's event indexes give).
    pub prefix_blocks: u32,
    /// Longest prefix of this prompt, in blocks, held by requests this router
    /// has running on the worker (Dynamo's router dedups the request's blocks
    /// against these); 0 when unknown.
    pub active_prefix_blocks: u32,
    /// Requests the router sent and that have not finished.
    pub in_flight: u32,
    /// Requests queued at the engine, not yet running.
    pub waiting: u32,
    /// Prompt tokens admitted but not yet prefilled.
    pub queued_prefill_tokens: u64,
    /// KV blocks held by the worker's requests in flight.
    pub active_blocks: u64,
    /// KV-cache usage, 0..=1.
    pub kv_usage: f64,
    /// KV capacity of the worker, in blocks.
    pub capacity_blocks: u64,
}

/// The request as the peers see it.
#[derive(Clone, Copy, Debug)]
pub struct PeerRequest<'a> {
    /// Keys of the prompt's full blocks, in order (chained: each names its
    /// whole prefix).
    pub keys: &'a [BlockKey],
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens per block.
    pub block_size: u32,
}

/// A peer's routing policy over worker views (wrapped as a
/// [`kvroute_select::Scorer`] by [`PeerScorer`]).
pub(crate) trait PeerPolicy: Send + std::fmt::Debug {
    /// Name in reports: `dynamo-cost`, `smg-cache-aware`, `llmd-weighted`.
    fn name(&self) -> &'static str;
    /// Chooses a worker: always an index `< workers.len()` when `workers` is
    /// non-empty (0 when it is empty, which the caller must not route).
    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], now_us: u64) -> usize;
}

/// A peer's policy as a kvroute scorer: each decision builds the eligible
/// workers' [`WorkerView`]s from the rule's candidates and asks the policy.
///
/// The view's `waiting`, `kv_usage` and `capacity_blocks` come from the
/// engine's report on the candidate ([`Candidate::report`]); without one they
/// read 0. `active_blocks` and `active_prefix_blocks` come from Dynamo's
/// [`ActiveSequences`] for `dynamo-cost`, else `active_blocks` is the
/// report's KV usage in blocks. Predicted entries are not credited (the
/// peers have none): `prefix_blocks` is the engine-reported prefix.
#[derive(Debug)]
pub struct PeerScorer {
    name: &'static str,
    state: Mutex<PeerState>,
    /// Dynamo's router-side active blocks, fed by the host.
    active: Option<Arc<Mutex<ActiveSequences>>>,
}

#[derive(Debug)]
struct PeerState {
    policy: Box<dyn PeerPolicy>,
    views: Vec<WorkerView>,
    index: Vec<usize>,
}

impl PeerScorer {
    /// NVIDIA Dynamo's cost function with its defaults, its active blocks
    /// read from `active`: each pick is staged there, and the host commits
    /// it to its request and frees it when the request ends
    /// ([`ActiveSequences`]).
    #[must_use]
    pub fn dynamo(workers: usize, seed: u64, active: Arc<Mutex<ActiveSequences>>) -> Self {
        let mut s = Self::new(Box::new(DynamoCost::new(workers, seed)));
        s.active = Some(active);
        s
    }

    /// SGLang Model Gateway's `cache_aware` with its defaults.
    #[must_use]
    pub fn smg(workers: usize, seed: u64) -> Self {
        Self::new(Box::new(SmgCacheAware::new(workers, seed)))
    }

    /// llm-d's weighted scorers with its shipped weights.
    #[must_use]
    pub fn llmd(workers: usize, seed: u64) -> Self {
        Self::new(Box::new(LlmdWeighted::new(workers, seed)))
    }

    fn new(policy: Box<dyn PeerPolicy>) -> Self {
        Self {
            name: policy.name(),
            state: Mutex::new(PeerState {
                policy,
                views: Vec::new(),
                index: Vec::new(),
            }),
            active: None,
        }
    }
}

/// What a peer sees of one candidate.
fn view_of(c: &Candidate<'_>) -> WorkerView {
    let report = c.report.unwrap_or_default();
    let capacity_blocks = report.kv_capacity_blocks.unwrap_or(0);
    let kv_usage = report.kv_usage.unwrap_or(0.0);
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let active_blocks = (kv_usage * capacity_blocks as f64).round() as u64;
    WorkerView {
        prefix_blocks: c.overlap.prefix,
        active_prefix_blocks: 0,
        in_flight: c.load.in_flight,
        waiting: report.waiting,
        queued_prefill_tokens: c.load.queued_prefill_tokens,
        active_blocks,
        kv_usage,
        capacity_blocks,
    }
}

impl Scorer for PeerScorer {
    fn name(&self) -> &str {
        self.name
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        let mut guard = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let PeerState {
            policy,
            views,
            index,
        } = &mut *guard;
        views.clear();
        index.clear();
        let mut active = self
            .active
            .as_ref()
            .map(|a| a.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        for c in input.candidates() {
            let mut v = view_of(&c);
            if let Some(a) = active.as_deref() {
                v.active_blocks = a.active_blocks(c.index);
                v.active_prefix_blocks = a.active_prefix(c.index, input.keys());
            }
            views.push(v);
            index.push(c.index);
        }
        if views.is_empty() {
            return ScorePick::Miss(kvroute_select::MissReason::AllCandidatesFiltered);
        }
        let req = PeerRequest {
            keys: input.keys(),
            prompt_tokens: input.prompt_tokens,
            block_size: input.block_size,
        };
        #[allow(clippy::cast_possible_truncation)]
        let now_us = input.now.as_micros() as u64;
        let w = policy.pick(&req, views, now_us).min(views.len() - 1);
        let chosen = index.get(w).copied().unwrap_or(0);
        if let Some(a) = active.as_deref_mut() {
            a.stage(chosen, input.keys());
        }
        ScorePick::Winner {
            index: chosen,
            predicted_blocks: views.get(w).map_or(0, |v| v.prefix_blocks),
            diverted: false,
        }
    }
}

/// Index of the smallest cost, ties chosen uniformly at random (reservoir
/// sampling, as Dynamo's `minimum_cost_index`). NaN costs never win; all-NaN
/// gives 0.
pub(crate) fn argmin_random_ties(costs: &[f64], rng: &mut StdRng) -> usize {
    let mut best = 0;
    let mut best_cost = f64::INFINITY;
    let mut ties = 0u32;
    for (i, &c) in costs.iter().enumerate() {
        if c < best_cost {
            best = i;
            best_cost = c;
            ties = 1;
        } else if c == best_cost {
            ties += 1;
            if rng.gen_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// Index of the largest score, ties uniformly at random (the distribution of
/// llm-d's shuffle-then-stable-sort). NaN scores never win; all-NaN gives 0.
pub(crate) fn argmax_random_ties(scores: &[f64], rng: &mut StdRng) -> usize {
    let mut best = 0;
    let mut best_score = f64::NEG_INFINITY;
    let mut ties = 0u32;
    for (i, &s) in scores.iter().enumerate() {
        if s > best_score {
            best = i;
            best_score = s;
            ties = 1;
        } else if s == best_score {
            ties += 1;
            if rng.gen_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

#[allow(clippy::cast_precision_loss)]
pub(crate) fn f(x: u64) -> f64 {
    x as f64
}
