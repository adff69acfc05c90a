//! The peers' routing policies, re-implemented from their documentation and
//! source for the simulator, so that `kvroute sim run` compares kvroute's
//! default against what NVIDIA Dynamo, SGLang Model Gateway (SMG) and llm-d do
//! with the same fleet and the same workload.
//!
//! Each policy sees, per worker, a [`WorkerView`] (what the KV-event index and
//! the router's own bookkeeping know at decision time) and the prompt's block
//! keys ([`PeerRequest`]); it returns a worker index. They are pure state
//! machines: time comes in as `now_us`, randomness from a [`StdRng`] seeded at
//! construction, and no pick allocates once the scratch buffers have grown to
//! the fleet's size (SMG's approximate tree grows with what it was sent and is
//! cut back to its size bound at each eviction run).
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
//!   that is [`WorkerView::active_prefix_blocks`] (0 when the host does not
//!   know it, which charges all the prompt's blocks). Host/disk/shared-cache
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
//! * **llm-d** scrapes the queue and KV-usage gauges on an interval; the view
//!   here is exact at decision time, which flatters it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use kvroute_core::BlockKey;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use kvroute_engine_model::cache::KeyHasher;

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
    /// KV blocks held by the worker's running requests.
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

/// A peer's routing policy.
pub trait PeerPolicy {
    /// Name in reports: `dynamo-cost`, `smg-cache-aware`, `llmd-weighted`.
    fn name(&self) -> &'static str;
    /// Chooses a worker: always an index `< workers.len()` when `workers` is
    /// non-empty (0 when it is empty, which the caller must not route).
    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], now_us: u64) -> usize;
    /// A request routed to `worker` finished (hook for policies that keep
    /// their own load; the views already carry the router's in-flight count).
    fn on_finish(&mut self, _worker: usize, _now_us: u64) {}
}

/// Index of the smallest cost, ties chosen uniformly at random (reservoir
/// sampling, as Dynamo's `minimum_cost_index`). NaN costs never win; all-NaN
/// gives 0.
fn argmin_random_ties(costs: &[f64], rng: &mut StdRng) -> usize {
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
fn argmax_random_ties(scores: &[f64], rng: &mut StdRng) -> usize {
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
fn f(x: u64) -> f64 {
    x as f64
}

// ---------------------------------------------------------------------------
// Dynamo
// ---------------------------------------------------------------------------

/// NVIDIA Dynamo's KV-router cost function (see the [module docs](self)).
#[derive(Debug)]
pub struct DynamoCost {
    overlap_score_credit: f64,
    prefill_load_scale: f64,
    overlap_score_credit_decay: f64,
    decode_active_request_weight: f64,
    router_temperature: f64,
    rng: StdRng,
    costs: Vec<f64>,
    probabilities: Vec<f64>,
}

impl DynamoCost {
    /// Dynamo's defaults: credit 1, prefill scale 1, no decay, no per-request
    /// decode weight, temperature 0 (argmin).
    #[must_use]
    pub fn new(workers: usize, seed: u64) -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            overlap_score_credit_decay: 0.0,
            decode_active_request_weight: 0.0,
            router_temperature: 0.0,
            rng: StdRng::seed_from_u64(seed),
            costs: Vec::with_capacity(workers),
            probabilities: Vec::with_capacity(workers),
        }
    }

    /// `overlap_score_credit` (0..=1): fraction of a cached block credited
    /// against the prefill load; 0 ignores the cache.
    #[must_use]
    pub fn with_overlap_score_credit(mut self, credit: f64) -> Self {
        self.overlap_score_credit = credit;
        self
    }

    /// `prefill_load_scale`: weight of the prefill term after the credit.
    #[must_use]
    pub fn with_prefill_load_scale(mut self, scale: f64) -> Self {
        self.prefill_load_scale = scale;
        self
    }

    /// The deprecated `overlap_score_weight`, mapped as Dynamo maps it: it
    /// becomes `prefill_load_scale`, and 0 also zeroes the overlap credit.
    #[must_use]
    pub fn with_overlap_score_weight(mut self, weight: f64) -> Self {
        self.prefill_load_scale = weight;
        if weight == 0.0 {
            self.overlap_score_credit = 0.0;
        }
        self
    }

    /// `overlap_score_credit_decay`: shrinks the credit of workers whose
    /// queued prefill exceeds the least-loaded one's, relative to this
    /// request's size.
    #[must_use]
    pub fn with_overlap_score_credit_decay(mut self, decay: f64) -> Self {
        self.overlap_score_credit_decay = decay;
        self
    }

    /// `decode_active_request_weight`: blocks charged per request in flight.
    #[must_use]
    pub fn with_decode_active_request_weight(mut self, weight: f64) -> Self {
        self.decode_active_request_weight = weight;
        self
    }

    /// `router_temperature`: 0 picks the least cost; above 0 samples a
    /// softmax of the min-max-normalised negated costs.
    #[must_use]
    pub fn with_router_temperature(mut self, temperature: f64) -> Self {
        self.router_temperature = temperature;
        self
    }

    /// Fills `out` with each worker's cost (the logit Dynamo minimises).
    pub fn costs(&self, req: &PeerRequest<'_>, workers: &[WorkerView], out: &mut Vec<f64>) {
        out.clear();
        let bs = f64::from(req.block_size.max(1));
        let isl = f64::from(req.prompt_tokens);
        let request_blocks = f64::from(req.prompt_tokens.div_ceil(req.block_size.max(1)).max(1));
        let prompt_blocks = req.keys.len() as u64;
        let min_queued = workers
            .iter()
            .map(|w| w.queued_prefill_tokens)
            .min()
            .unwrap_or(0);
        for w in workers {
            let raw_prefill_blocks = (f(w.queued_prefill_tokens) + isl) / bs;
            let decay = if self.overlap_score_credit_decay > 0.0 {
                let excess = f(w.queued_prefill_tokens.saturating_sub(min_queued)) / bs;
                1.0 / (1.0 + self.overlap_score_credit_decay * excess / request_blocks)
            } else {
                1.0
            };
            let credit = self.overlap_score_credit * decay * f64::from(w.prefix_blocks);
            let prefill = self.prefill_load_scale * (raw_prefill_blocks - credit).max(0.0);
            let new_blocks = prompt_blocks.saturating_sub(u64::from(w.active_prefix_blocks));
            let decode = f(w.active_blocks.saturating_add(new_blocks));
            let requests = self.decode_active_request_weight * f64::from(w.in_flight);
            out.push(prefill + decode + requests);
        }
    }
}

/// Softmax probabilities of Dynamo's sampler: `p_i ∝ exp(−(c_i − min) /
/// ((max − min) × T))`, uniform when every cost is equal.
pub fn softmax_probabilities(costs: &[f64], temperature: f64, out: &mut Vec<f64>) {
    out.clear();
    if costs.is_empty() {
        return;
    }
    let (lo, hi) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
            (lo.min(c), hi.max(c))
        });
    #[allow(clippy::cast_precision_loss)]
    let n = costs.len() as f64;
    let range = hi - lo;
    if range <= 0.0 || !range.is_finite() || temperature <= 0.0 || !temperature.is_finite() {
        out.resize(costs.len(), 1.0 / n);
        return;
    }
    out.extend(
        costs
            .iter()
            .map(|&c| (-(c - lo) / (range * temperature)).exp()),
    );
    let sum: f64 = out.iter().sum();
    for p in out.iter_mut() {
        *p /= sum;
    }
}

/// The first index whose cumulative probability reaches `sample` (the last one
/// if rounding leaves the sum short).
fn sample_index(probabilities: &[f64], sample: f64) -> usize {
    let mut cumulative = 0.0;
    for (i, p) in probabilities.iter().enumerate() {
        cumulative += p;
        if sample <= cumulative {
            return i;
        }
    }
    probabilities.len().saturating_sub(1)
}

impl PeerPolicy for DynamoCost {
    fn name(&self) -> &'static str {
        "dynamo-cost"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], _now_us: u64) -> usize {
        let mut costs = std::mem::take(&mut self.costs);
        self.costs(req, workers, &mut costs);
        let chosen = if self.router_temperature > 0.0 {
            softmax_probabilities(&costs, self.router_temperature, &mut self.probabilities);
            let u: f64 = self.rng.gen();
            sample_index(&self.probabilities, u)
        } else {
            argmin_random_ties(&costs, &mut self.rng)
        };
        self.costs = costs;
        chosen
    }
}

// ---------------------------------------------------------------------------
// SMG cache_aware
// ---------------------------------------------------------------------------

type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<KeyHasher>>;

/// One block of one worker's approximate tree.
#[derive(Clone, Copy, Debug)]
struct TreeNode {
    /// The previous block of the prompts that reached this one (None at the
    /// first block).
    parent: Option<BlockKey>,
    /// Children present in this worker's tree; 0 makes the node a leaf.
    children: u32,
    /// Insert counter value of the last insert through this node (LRU order).
    stamp: u64,
}

/// How many leading `keys` one worker's tree holds, and the stamp of the
/// deepest of them.
fn tree_depth(tree: &KeyMap<TreeNode>, keys: &[BlockKey]) -> (usize, u64) {
    let mut depth = 0;
    let mut stamp = 0;
    for k in keys {
        match tree.get(k) {
            Some(node) => {
                depth += 1;
                stamp = node.stamp;
            }
            None => break,
        }
    }
    (depth, stamp)
}

/// SGLang Model Gateway's `cache_aware` policy over an approximate per-worker
/// prefix tree (see the [module docs](self)).
#[derive(Debug)]
pub struct SmgCacheAware {
    cache_threshold: f32,
    balance_abs_threshold: u32,
    balance_rel_threshold: f32,
    balance_token_usage_threshold: f64,
    overload_token_usage_threshold: f64,
    eviction_interval_us: u64,
    max_tree_tokens: u64,
    /// One tree per worker: what the router sent there.
    trees: Vec<KeyMap<TreeNode>>,
    /// Requests routed to each worker so far (SMG's `processed`, the second
    /// key of its least-loaded tie-break).
    processed: Vec<u64>,
    epoch: u64,
    next_eviction_us: Option<u64>,
    evictions: u64,
    heap: BinaryHeap<Reverse<(u64, u64)>>,
}

/// SMG's default `--max-tree-size` in characters.
pub const SMG_MAX_TREE_CHARS: u64 = 1 << 26;
/// Characters per token assumed to turn SMG's character bound into tokens.
pub const CHARS_PER_TOKEN: u64 = 4;

impl SmgCacheAware {
    /// SMG's CLI defaults (what `smg --policy cache_aware` runs with).
    /// Deterministic: SMG's HTTP path draws no random number once its tree
    /// exists, so `seed` is unused.
    #[must_use]
    pub fn new(workers: usize, _seed: u64) -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            balance_token_usage_threshold: 1.0,
            overload_token_usage_threshold: 1.0,
            eviction_interval_us: 120_000_000,
            max_tree_tokens: SMG_MAX_TREE_CHARS / CHARS_PER_TOKEN,
            trees: (0..workers).map(|_| KeyMap::default()).collect(),
            processed: vec![0; workers],
            epoch: 0,
            next_eviction_us: None,
            evictions: 0,
            heap: BinaryHeap::new(),
        }
    }

    /// `cache_threshold`: match rate above which the deepest match wins.
    #[must_use]
    pub fn with_cache_threshold(mut self, threshold: f32) -> Self {
        self.cache_threshold = threshold;
        self
    }

    /// `balance_abs_threshold`: in-flight spread (max − min) above which,
    /// together with the relative one, load decides.
    #[must_use]
    pub fn with_balance_abs_threshold(mut self, threshold: u32) -> Self {
        self.balance_abs_threshold = threshold;
        self
    }

    /// `balance_rel_threshold`: max > min × this, together with the absolute
    /// one, means imbalanced.
    #[must_use]
    pub fn with_balance_rel_threshold(mut self, threshold: f32) -> Self {
        self.balance_rel_threshold = threshold;
        self
    }

    /// `balance_token_usage_threshold`: KV-usage spread above which load
    /// decides (≥ 1 disables).
    #[must_use]
    pub fn with_balance_token_usage_threshold(mut self, threshold: f64) -> Self {
        self.balance_token_usage_threshold = threshold;
        self
    }

    /// `overload_token_usage_threshold`: KV usage of the hottest worker above
    /// which load decides (≥ 1 disables).
    #[must_use]
    pub fn with_overload_token_usage_threshold(mut self, threshold: f64) -> Self {
        self.overload_token_usage_threshold = threshold;
        self
    }

    /// `eviction_interval`, in µs; 0 never evicts.
    #[must_use]
    pub fn with_eviction_interval_us(mut self, interval_us: u64) -> Self {
        self.eviction_interval_us = interval_us;
        self
    }

    /// `max_tree_size`, in tokens per worker (SMG counts characters).
    #[must_use]
    pub fn with_max_tree_tokens(mut self, tokens: u64) -> Self {
        self.max_tree_tokens = tokens;
        self
    }

    /// Blocks in `worker`'s approximate tree.
    #[must_use]
    pub fn tree_blocks(&self, worker: usize) -> usize {
        self.trees.get(worker).map_or(0, HashMap::len)
    }

    /// Eviction runs so far.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn ensure_workers(&mut self, n: usize) {
        if self.trees.len() < n {
            self.trees.resize_with(n, KeyMap::default);
            self.processed.resize(n, 0);
        }
    }

    /// Deepest match of `keys` over the first `n` trees: (blocks, worker).
    /// Among workers at the same depth the most recently stamped one wins.
    fn longest_match(&self, keys: &[BlockKey], n: usize) -> (usize, Option<usize>) {
        let mut best: (usize, Option<usize>, u64) = (0, None, 0);
        for (w, tree) in self.trees.iter().take(n).enumerate() {
            let (depth, stamp) = tree_depth(tree, keys);
            if depth > 0 && (depth > best.0 || (depth == best.0 && stamp > best.2)) {
                best = (depth, Some(w), stamp);
            }
        }
        (best.0, best.1)
    }

    fn insert(&mut self, worker: usize, keys: &[BlockKey]) {
        self.epoch += 1;
        let stamp = self.epoch;
        let Some(tree) = self.trees.get_mut(worker) else {
            return;
        };
        let mut parent: Option<BlockKey> = None;
        for &k in keys {
            let mut created = false;
            tree.entry(k)
                .and_modify(|n| n.stamp = stamp)
                .or_insert_with(|| {
                    created = true;
                    TreeNode {
                        parent,
                        children: 0,
                        stamp,
                    }
                });
            if created {
                if let Some(p) = parent.and_then(|p| tree.get_mut(&p)) {
                    p.children += 1;
                }
            }
            parent = Some(k);
        }
    }

    /// SMG's `evict_tenant_by_size`: each tree above `max_blocks` loses its
    /// least recently used leaves until it fits.
    fn evict(&mut self, max_blocks: usize) {
        self.evictions += 1;
        for tree in &mut self.trees {
            if tree.len() <= max_blocks {
                continue;
            }
            self.heap.clear();
            self.heap.extend(
                tree.iter()
                    .filter(|(_, n)| n.children == 0)
                    .map(|(k, n)| Reverse((n.stamp, k.0))),
            );
            while tree.len() > max_blocks {
                let Some(Reverse((_, key))) = self.heap.pop() else {
                    break;
                };
                let Some(node) = tree.remove(&BlockKey(key)) else {
                    continue;
                };
                if let Some(p) = node.parent {
                    if let Some(pn) = tree.get_mut(&p) {
                        pn.children = pn.children.saturating_sub(1);
                        if pn.children == 0 {
                            self.heap.push(Reverse((pn.stamp, p.0)));
                        }
                    }
                }
            }
        }
    }

    fn maybe_evict(&mut self, block_size: u32, now_us: u64) {
        if self.eviction_interval_us == 0 {
            return;
        }
        match self.next_eviction_us {
            None => self.next_eviction_us = Some(now_us.saturating_add(self.eviction_interval_us)),
            Some(due) if now_us >= due => {
                let max_blocks = self.max_tree_tokens / u64::from(block_size.max(1));
                self.evict(usize::try_from(max_blocks).unwrap_or(usize::MAX));
                self.next_eviction_us = Some(now_us.saturating_add(self.eviction_interval_us));
            }
            Some(_) => {}
        }
    }

    fn is_imbalanced(&self, workers: &[WorkerView]) -> bool {
        let (min_usage, max_usage) = workers
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), w| {
                (lo.min(w.kv_usage), hi.max(w.kv_usage))
            });
        if max_usage > self.overload_token_usage_threshold
            || max_usage - min_usage > self.balance_token_usage_threshold
        {
            return true;
        }
        let (min, max) = workers.iter().fold((u32::MAX, 0), |(lo, hi), w| {
            (lo.min(w.in_flight), hi.max(w.in_flight))
        });
        // SMG compares the relative spread in f32.
        #[allow(clippy::cast_precision_loss)]
        let rel = (max as f32) > (min as f32) * self.balance_rel_threshold;
        max.saturating_sub(min) > self.balance_abs_threshold && rel
    }

    /// Least in flight, then fewest routed so far, then lowest index.
    fn min_load(&self, workers: &[WorkerView]) -> usize {
        workers
            .iter()
            .enumerate()
            .min_by_key(|&(i, w)| (w.in_flight, self.processed[i], i))
            .map_or(0, |(i, _)| i)
    }
}

impl PeerPolicy for SmgCacheAware {
    fn name(&self) -> &'static str {
        "smg-cache-aware"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], now_us: u64) -> usize {
        let n = workers.len();
        if n == 0 {
            return 0;
        }
        self.ensure_workers(n);
        self.maybe_evict(req.block_size, now_us);
        let chosen = if self.is_imbalanced(workers) {
            self.min_load(workers)
        } else {
            let (matched, owner) = self.longest_match(req.keys, n);
            let matched_tokens = matched as u64 * u64::from(req.block_size);
            #[allow(clippy::cast_precision_loss)]
            let rate = if req.prompt_tokens == 0 {
                0.0
            } else {
                matched_tokens as f32 / req.prompt_tokens as f32
            };
            match owner {
                Some(w) if rate > self.cache_threshold => w,
                _ => self.min_load(workers),
            }
        };
        self.insert(chosen, req.keys);
        self.processed[chosen] += 1;
        chosen
    }
}

// ---------------------------------------------------------------------------
// llm-d
// ---------------------------------------------------------------------------

/// llm-d's inference scheduler with the precise prefix-cache, queue and
/// KV-utilisation scorers and the max-score picker (see the [module
/// docs](self)).
#[derive(Debug)]
pub struct LlmdWeighted {
    prefix_weight: f64,
    queue_weight: f64,
    kv_cache_weight: f64,
    rng: StdRng,
    scores: Vec<f64>,
}

impl LlmdWeighted {
    /// The weights of llm-d's shipped precise-prefix-cache configuration:
    /// prefix 2, queue 1, KV utilisation 1.
    #[must_use]
    pub fn new(workers: usize, seed: u64) -> Self {
        Self {
            prefix_weight: 2.0,
            queue_weight: 1.0,
            kv_cache_weight: 1.0,
            rng: StdRng::seed_from_u64(seed),
            scores: Vec::with_capacity(workers),
        }
    }

    /// All three weights at once (the EPP's built-in default profile is
    /// prefix 3, queue 2, KV utilisation 2).
    #[must_use]
    pub fn with_weights(mut self, prefix: f64, queue: f64, kv_cache: f64) -> Self {
        self.prefix_weight = prefix;
        self.queue_weight = queue;
        self.kv_cache_weight = kv_cache;
        self
    }

    /// Weight of the precise prefix-cache scorer.
    #[must_use]
    pub fn with_prefix_weight(mut self, weight: f64) -> Self {
        self.prefix_weight = weight;
        self
    }

    /// Weight of the queue scorer.
    #[must_use]
    pub fn with_queue_weight(mut self, weight: f64) -> Self {
        self.queue_weight = weight;
        self
    }

    /// Weight of the KV-cache-utilisation scorer.
    #[must_use]
    pub fn with_kv_cache_weight(mut self, weight: f64) -> Self {
        self.kv_cache_weight = weight;
        self
    }

    /// Fills `out` with each worker's weighted score (higher is better).
    pub fn scores(&self, req: &PeerRequest<'_>, workers: &[WorkerView], out: &mut Vec<f64>) {
        out.clear();
        let (min_q, max_q) = workers.iter().fold((u32::MAX, 0), |(lo, hi), w| {
            (lo.min(w.waiting), hi.max(w.waiting))
        });
        let total_blocks = req.keys.len() as u64;
        for w in workers {
            let prefix = if total_blocks == 0 {
                0.0
            } else {
                (f64::from(w.prefix_blocks) / f(total_blocks)).min(1.0)
            };
            let queue = if max_q == min_q {
                1.0
            } else {
                f64::from(max_q - w.waiting) / f64::from(max_q - min_q)
            };
            let kv = 1.0 - w.kv_usage;
            out.push(
                self.prefix_weight * prefix + self.queue_weight * queue + self.kv_cache_weight * kv,
            );
        }
    }
}

impl PeerPolicy for LlmdWeighted {
    fn name(&self) -> &'static str {
        "llmd-weighted"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], _now_us: u64) -> usize {
        let mut scores = std::mem::take(&mut self.scores);
        self.scores(req, workers, &mut scores);
        let chosen = argmax_random_ties(&scores, &mut self.rng);
        self.scores = scores;
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::block_keys;
    use proptest::prelude::*;

    /// One key per id: the simulator's real key derivation with 512-token
    /// blocks, so `ids` sharing a prefix share exactly those keys.
    fn keys(ids: &[u64]) -> Vec<BlockKey> {
        let mut out = Vec::new();
        let tokens = u32::try_from(ids.len() * 512).unwrap_or(u32::MAX);
        block_keys(ids, tokens, 512, &mut out);
        assert_eq!(out.len(), ids.len());
        out
    }

    /// Chained keys for `n` blocks of 16 tokens (ids offset by `base`).
    fn prompt(base: u64, n: u64) -> Vec<BlockKey> {
        keys(&(base..base + n).collect::<Vec<_>>())
    }

    fn req(keys: &[BlockKey], block_size: u32) -> PeerRequest<'_> {
        PeerRequest {
            keys,
            prompt_tokens: u32::try_from(keys.len()).unwrap_or(0) * block_size,
            block_size,
        }
    }

    fn counts(policy: &mut dyn PeerPolicy, r: &PeerRequest<'_>, w: &[WorkerView]) -> Vec<u32> {
        let mut c = vec![0; w.len()];
        for t in 0..600 {
            c[policy.pick(r, w, t)] += 1;
        }
        c
    }

    // --- Dynamo ---

    #[test]
    fn dynamo_reproduces_the_documented_example() {
        // Dynamo's docs: worker 1 = 8 prefill + 10 decode = 18, worker 2 =
        // 5 + 5 = 10 (chosen), worker 3 = 2 + 9 = 11.
        let k = prompt(1, 10);
        let r = req(&k, 16);
        let workers = [
            WorkerView {
                prefix_blocks: 2,
                ..WorkerView::default()
            },
            WorkerView {
                prefix_blocks: 5,
                active_prefix_blocks: 5,
                ..WorkerView::default()
            },
            WorkerView {
                prefix_blocks: 8,
                active_prefix_blocks: 8,
                active_blocks: 7,
                ..WorkerView::default()
            },
        ];
        let mut d = DynamoCost::new(3, 1);
        let mut c = Vec::new();
        d.costs(&r, &workers, &mut c);
        assert_eq!(c, vec![18.0, 10.0, 11.0]);
        assert_eq!(d.pick(&r, &workers, 0), 1);
    }

    #[test]
    fn dynamo_charges_queued_prefill_and_the_weights() {
        // 160-token prompt, 10 blocks of 16. Worker 0 holds 6 blocks but has
        // 320 tokens (20 blocks) of prefill queued; worker 1 holds nothing.
        let k = prompt(100, 10);
        let r = req(&k, 16);
        let workers = [
            WorkerView {
                prefix_blocks: 6,
                queued_prefill_tokens: 320,
                active_blocks: 4,
                in_flight: 2,
                ..WorkerView::default()
            },
            WorkerView {
                active_blocks: 4,
                in_flight: 1,
                ..WorkerView::default()
            },
        ];
        let mut c = Vec::new();
        // (320 + 160) / 16 − 6 = 24 prefill, 4 + 10 decode.
        DynamoCost::new(2, 0).costs(&r, &workers, &mut c);
        assert_eq!(c, vec![38.0, 24.0]);
        // prefill_load_scale 2 doubles only the prefill term.
        DynamoCost::new(2, 0)
            .with_prefill_load_scale(2.0)
            .costs(&r, &workers, &mut c);
        assert_eq!(c, vec![62.0, 34.0]);
        // Half credit: 30 − 3 = 27 prefill.
        DynamoCost::new(2, 0)
            .with_overlap_score_credit(0.5)
            .costs(&r, &workers, &mut c);
        assert_eq!(c, vec![41.0, 24.0]);
        // overlap_score_weight 0 ignores the cache and the prefill load.
        DynamoCost::new(2, 0)
            .with_overlap_score_weight(0.0)
            .costs(&r, &workers, &mut c);
        assert_eq!(c, vec![14.0, 14.0]);
        // 3 blocks per request in flight.
        DynamoCost::new(2, 0)
            .with_decode_active_request_weight(3.0)
            .costs(&r, &workers, &mut c);
        assert_eq!(c, vec![44.0, 27.0]);
        // Decay 1: worker 0 is 20 blocks above the least loaded, the
        // request is 10 blocks, so credit × 1 / (1 + 2) = 2 blocks.
        DynamoCost::new(2, 0)
            .with_overlap_score_credit_decay(1.0)
            .costs(&r, &workers, &mut c);
        assert_eq!(c, vec![42.0, 24.0]);
    }

    #[test]
    fn dynamo_prefill_term_never_goes_negative() {
        let k = prompt(7, 4);
        let r = PeerRequest {
            keys: &k,
            prompt_tokens: 40, // shorter than the 4 keyed blocks claim
            block_size: 16,
        };
        let w = [WorkerView {
            prefix_blocks: 4,
            active_prefix_blocks: 4,
            ..WorkerView::default()
        }];
        let mut c = Vec::new();
        DynamoCost::new(1, 0).costs(&r, &w, &mut c);
        assert_eq!(c, vec![0.0]);
    }

    #[test]
    fn dynamo_breaks_ties_at_random_and_per_seed() {
        let k = prompt(1, 4);
        let r = req(&k, 16);
        let w = [WorkerView::default(); 4];
        let c = counts(&mut DynamoCost::new(4, 9), &r, &w);
        // 600 picks over 4 equal workers: each near 150, none starved.
        assert!(c.iter().all(|&n| (100..200).contains(&n)), "{c:?}");
        let seq = |seed| {
            let mut d = DynamoCost::new(4, seed);
            (0..64).map(|t| d.pick(&r, &w, t)).collect::<Vec<_>>()
        };
        assert_eq!(seq(5), seq(5));
        assert_ne!(seq(5), seq(6));
    }

    #[test]
    fn dynamo_softmax_matches_hand_computed_probabilities() {
        let mut p = Vec::new();
        softmax_probabilities(&[10.0, 20.0], 1.0, &mut p);
        let e = (-1.0f64).exp();
        assert!((p[0] - 1.0 / (1.0 + e)).abs() < 1e-12);
        assert!((p[1] - e / (1.0 + e)).abs() < 1e-12);
        softmax_probabilities(&[3.0, 3.0, 3.0], 0.5, &mut p);
        assert_eq!(p, vec![1.0 / 3.0; 3]);
        assert_eq!(sample_index(&[0.25, 0.75], 0.25), 0);
        assert_eq!(sample_index(&[0.25, 0.75], 0.2501), 1);
        assert_eq!(sample_index(&[0.25, 0.7], 0.99), 1);
    }

    #[test]
    fn dynamo_temperature_spreads_picks_over_costlier_workers() {
        let k = prompt(1, 8);
        let r = req(&k, 16);
        let w = [
            WorkerView {
                prefix_blocks: 8,
                ..WorkerView::default()
            },
            WorkerView::default(),
        ];
        let greedy = counts(&mut DynamoCost::new(2, 3), &r, &w);
        assert_eq!(greedy, vec![600, 0]);
        // Costs 8 and 16: p1 = e^-1 / (1 + e^-1) ≈ 0.27 at T = 1.
        let warm = counts(
            &mut DynamoCost::new(2, 3).with_router_temperature(1.0),
            &r,
            &w,
        );
        assert!((110..220).contains(&warm[1]), "{warm:?}");
    }

    // --- SMG ---

    fn idle(n: usize) -> Vec<WorkerView> {
        vec![WorkerView::default(); n]
    }

    #[test]
    fn smg_follows_its_tree_then_least_load() {
        let a = prompt(1, 10);
        let b = prompt(50, 10);
        let w = idle(3);
        let mut s = SmgCacheAware::new(3, 0);
        // Empty tree: least loaded, ties by routed count then index.
        assert_eq!(s.pick(&req(&a, 16), &w, 0), 0);
        // Same prompt: full match on worker 0.
        assert_eq!(s.pick(&req(&a, 16), &w, 1), 0);
        // New prompt: no match, worker 0 has routed 2 → worker 1.
        assert_eq!(s.pick(&req(&b, 16), &w, 2), 1);
        assert_eq!(s.pick(&req(&b, 16), &w, 3), 1);
        // A third prompt goes to worker 2 (routed 0).
        assert_eq!(s.pick(&req(&prompt(90, 3), 16), &w, 4), 2);
        assert_eq!(s.tree_blocks(0), 10);
        assert_eq!(s.tree_blocks(1), 10);
        assert_eq!(s.tree_blocks(2), 3);
    }

    #[test]
    fn smg_match_must_exceed_the_threshold() {
        // Worker 0's tree holds the first 3 of 10 blocks: rate 0.3, not > 0.3.
        let full = prompt(1, 10);
        let mut s = SmgCacheAware::new(2, 0);
        let w = idle(2);
        assert_eq!(s.pick(&req(&full[..3], 16), &w, 0), 0);
        // Worker 0 routed 1, so least load is worker 1.
        assert_eq!(s.pick(&req(&full, 16), &w, 1), 1);
        // With 4 of the 10 blocks in worker 0's tree the rate is 0.4.
        let mut s = SmgCacheAware::new(2, 0);
        assert_eq!(s.pick(&req(&full[..4], 16), &w, 0), 0);
        // 0.4 > 0.3: worker 0 again, although it routed more.
        assert_eq!(s.pick(&req(&full, 16), &w, 1), 0);
    }

    #[test]
    fn smg_switches_to_least_load_when_imbalanced() {
        let a = prompt(1, 10);
        let mut s = SmgCacheAware::new(2, 0);
        assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
        let load = |x: u32, y: u32| {
            [
                WorkerView {
                    in_flight: x,
                    ..WorkerView::default()
                },
                WorkerView {
                    in_flight: y,
                    ..WorkerView::default()
                },
            ]
        };
        // Spread 90 > 64 and 100 > 10 × 1.5: imbalanced → worker 1.
        assert_eq!(s.pick(&req(&a, 16), &load(100, 10), 1), 1);
        // Both workers now hold it; ties on depth go to the latest insert (1).
        // Spread exactly 64 is balanced: the cache decides, not the least
        // loaded (worker 0).
        assert_eq!(s.pick(&req(&a, 16), &load(10, 74), 2), 1);
        // Spread 65 > 64 but 265 < 200 × 1.5: balanced; worker 1 still latest.
        assert_eq!(s.pick(&req(&a, 16), &load(200, 265), 3), 1);
        // Spread 65 > 64 and 165 > 100 × 1.5: imbalanced → worker 0.
        assert_eq!(s.pick(&req(&a, 16), &load(100, 165), 4), 0);
    }

    #[test]
    fn smg_kv_usage_triggers_are_off_by_default_and_work_when_set() {
        let a = prompt(1, 10);
        let hot = [
            WorkerView {
                kv_usage: 0.95,
                ..WorkerView::default()
            },
            WorkerView {
                kv_usage: 0.1,
                in_flight: 3,
                ..WorkerView::default()
            },
        ];
        let mut s = SmgCacheAware::new(2, 0);
        assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
        assert_eq!(s.pick(&req(&a, 16), &hot, 1), 0);
        let mut s = SmgCacheAware::new(2, 0).with_balance_token_usage_threshold(0.5);
        assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
        // Spread 0.85 > 0.5 → least in flight: worker 1 (3 < 5), not the
        // cache owner.
        let hot_busy = [
            WorkerView {
                in_flight: 5,
                ..hot[0]
            },
            hot[1],
        ];
        assert_eq!(s.pick(&req(&a, 16), &hot_busy, 1), 1);
    }

    #[test]
    fn smg_eviction_keeps_each_tree_within_its_bound_lru_first() {
        // Bound 10 blocks of 16 tokens, evicting every second; one worker.
        let mut s = SmgCacheAware::new(1, 0)
            .with_max_tree_tokens(160)
            .with_eviction_interval_us(1_000_000);
        let w = idle(1);
        let prompts: Vec<_> = (0..5).map(|i| prompt(1000 * (i + 1), 4)).collect();
        for (t, p) in prompts.iter().enumerate() {
            s.pick(&req(p, 16), &w, t as u64);
        }
        assert_eq!(s.tree_blocks(0), 20);
        assert_eq!(s.evictions(), 0);
        // Due at 1 s: the pick at 1 s evicts first, then inserts its prompt.
        let latest = prompt(9000, 2);
        s.pick(&req(&latest, 16), &w, 1_000_000);
        assert_eq!(s.evictions(), 1);
        assert_eq!(s.tree_blocks(0), 12);
        // Least recently used first, leaf first: prompts 0 and 1 went, then
        // the last two blocks of prompt 2; prompts 3 and 4 are whole.
        let depth = |p: &[BlockKey]| s.longest_match(p, 1).0;
        assert_eq!(depth(&prompts[4]), 4);
        assert_eq!(depth(&prompts[3]), 4);
        assert_eq!(depth(&prompts[2]), 2);
        assert_eq!(depth(&prompts[1]), 0);
        assert_eq!(depth(&prompts[0]), 0);
    }

    #[test]
    fn smg_evicts_leaves_before_their_shared_prefix() {
        // Three prompts share a 3-block system prefix; bound 5 blocks.
        let mut s = SmgCacheAware::new(1, 0)
            .with_max_tree_tokens(5 * 16)
            .with_eviction_interval_us(10);
        let w = idle(1);
        let p1 = keys(&[1, 2, 3, 10, 11]);
        let p2 = keys(&[1, 2, 3, 20, 21]);
        let p3 = keys(&[1, 2, 3, 30]);
        for (t, p) in [&p1, &p2, &p3].into_iter().enumerate() {
            s.pick(&req(p, 512), &w, t as u64);
        }
        assert_eq!(s.tree_blocks(0), 8);
        s.evict(6);
        // p1's two-block tail (least recent) goes; the shared prefix stays.
        assert_eq!(s.tree_blocks(0), 6);
        assert_eq!(s.longest_match(&p1, 1).0, 3);
        s.evict(4);
        assert_eq!(s.tree_blocks(0), 4);
        assert_eq!(s.longest_match(&p3, 1).0, 4);
        assert_eq!(s.longest_match(&p2, 1).0, 3);
    }

    #[test]
    fn smg_is_deterministic() {
        let run = |seed| {
            let mut s = SmgCacheAware::new(4, seed);
            let w = idle(4);
            (0..40u64)
                .map(|i| s.pick(&req(&prompt(i % 7, 6), 16), &w, i))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(2));
    }

    proptest! {
        /// The tree's match equals a reference: the longest common prefix of
        /// the prompt with any prompt inserted on that worker (no eviction).
        #[test]
        fn smg_tree_matches_reference(
            inserts in proptest::collection::vec(
                (0usize..3, proptest::collection::vec(0u64..3, 0..6)),
                0..30,
            ),
            probe in proptest::collection::vec(0u64..3, 0..6),
        ) {
            let mut s = SmgCacheAware::new(3, 0).with_eviction_interval_us(0);
            let mut reference: Vec<Vec<Vec<u64>>> = vec![Vec::new(); 3];
            for (w, ids) in &inserts {
                s.insert(*w, &keys(ids));
                reference[*w].push(ids.clone());
            }
            let pk = keys(&probe);
            let mut deepest = 0;
            for (tree, seqs) in s.trees.iter().zip(&reference) {
                let mut distinct = std::collections::HashSet::new();
                for ids in seqs {
                    for n in 1..=ids.len() {
                        distinct.insert(ids[..n].to_vec());
                    }
                }
                prop_assert_eq!(tree.len(), distinct.len());
                let want = seqs
                    .iter()
                    .map(|ids| ids.iter().zip(&probe).take_while(|(a, b)| a == b).count())
                    .max()
                    .unwrap_or(0);
                prop_assert_eq!(tree_depth(tree, &pk).0, want);
                deepest = deepest.max(want);
            }
            let (m, owner) = s.longest_match(&pk, 3);
            prop_assert_eq!(m, deepest);
            prop_assert_eq!(owner.is_some(), deepest > 0);
            if let Some(w) = owner {
                prop_assert_eq!(tree_depth(&s.trees[w], &pk).0, deepest);
            }
        }

        /// Eviction never leaves a tree above its bound and never orphans a
        /// node (every parent of a kept node is kept).
        #[test]
        fn smg_eviction_bound_holds(
            inserts in proptest::collection::vec(proptest::collection::vec(0u64..4, 1..8), 1..40),
            bound in 1usize..12,
        ) {
            let mut s = SmgCacheAware::new(1, 0);
            for ids in &inserts {
                s.insert(0, &keys(ids));
            }
            s.evict(bound);
            prop_assert!(s.tree_blocks(0) <= bound);
            for node in s.trees[0].values() {
                if let Some(p) = node.parent {
                    prop_assert!(s.trees[0].contains_key(&p));
                }
            }
            let leaves_ok = s.trees[0].iter().all(|(k, n)| {
                let kids = s.trees[0].values().filter(|c| c.parent == Some(*k)).count();
                kids == n.children as usize
            });
            prop_assert!(leaves_ok);
        }

        /// Every policy returns a valid index for any views.
        #[test]
        fn picks_are_always_valid(
            views in proptest::collection::vec(
                (0u32..20, 0u32..200, 0u32..50, 0u64..5000, 0u64..500, 0.0f64..=1.0),
                1..9,
            ),
            ids in proptest::collection::vec(0u64..5, 0..12),
            temperature in 0.0f64..2.0,
            seed in 0u64..1000,
        ) {
            let w: Vec<WorkerView> = views
                .iter()
                .map(|&(p, f, q, t, a, u)| WorkerView {
                    prefix_blocks: p,
                    active_prefix_blocks: p / 2,
                    in_flight: f,
                    waiting: q,
                    queued_prefill_tokens: t,
                    active_blocks: a,
                    kv_usage: u,
                    capacity_blocks: 1000,
                })
                .collect();
            let k = keys(&ids);
            let r = req(&k, 16);
            let mut policies: Vec<Box<dyn PeerPolicy>> = vec![
                Box::new(DynamoCost::new(w.len(), seed).with_router_temperature(temperature)),
                Box::new(SmgCacheAware::new(w.len(), seed)),
                Box::new(LlmdWeighted::new(w.len(), seed)),
            ];
            for p in &mut policies {
                for t in 0..5 {
                    prop_assert!(p.pick(&r, &w, t) < w.len());
                }
            }
        }
    }

    // --- llm-d ---

    #[test]
    fn llmd_scores_match_hand_computation() {
        let k = prompt(1, 10);
        let r = req(&k, 16);
        let w = [
            WorkerView {
                prefix_blocks: 10,
                waiting: 4,
                kv_usage: 0.9,
                ..WorkerView::default()
            },
            WorkerView {
                prefix_blocks: 5,
                waiting: 0,
                kv_usage: 0.5,
                ..WorkerView::default()
            },
            WorkerView {
                prefix_blocks: 0,
                waiting: 2,
                kv_usage: 0.25,
                ..WorkerView::default()
            },
        ];
        let mut l = LlmdWeighted::new(3, 0);
        let mut s = Vec::new();
        l.scores(&r, &w, &mut s);
        // 2·1 + 0 + 0.1; 2·0.5 + 1 + 0.5; 0 + 0.5 + 0.75.
        let want = [2.1, 2.5, 1.25];
        for (g, e) in s.iter().zip(want) {
            assert!((g - e).abs() < 1e-12, "{s:?}");
        }
        assert_eq!(l.pick(&r, &w, 0), 1);
        // Weights 3 / 2 / 2: 3 + 0 + 0.2; 1.5 + 2 + 1; 0 + 1 + 1.5.
        let l = LlmdWeighted::new(3, 0).with_weights(3.0, 2.0, 2.0);
        l.scores(&r, &w, &mut s);
        for (g, e) in s.iter().zip([3.2, 4.5, 2.5]) {
            assert!((g - e).abs() < 1e-12, "{s:?}");
        }
        // Prefix alone decides when the others weigh nothing.
        let mut l = LlmdWeighted::new(3, 0)
            .with_queue_weight(0.0)
            .with_kv_cache_weight(0.0);
        assert_eq!(l.pick(&r, &w, 0), 0);
        let mut l = LlmdWeighted::new(3, 0).with_prefix_weight(0.0);
        assert_eq!(l.pick(&r, &w, 0), 1);
    }

    #[test]
    fn llmd_equal_queues_and_empty_prompts_are_neutral() {
        let r = req(&[], 16);
        let w = [
            WorkerView {
                prefix_blocks: 3,
                waiting: 7,
                kv_usage: 0.5,
                ..WorkerView::default()
            },
            WorkerView {
                waiting: 7,
                kv_usage: 0.5,
                ..WorkerView::default()
            },
        ];
        let mut s = Vec::new();
        LlmdWeighted::new(2, 0).scores(&r, &w, &mut s);
        assert_eq!(s, vec![1.5, 1.5]);
    }

    #[test]
    fn llmd_breaks_ties_at_random_and_per_seed() {
        let k = prompt(1, 4);
        let r = req(&k, 16);
        let w = [WorkerView::default(); 3];
        let c = counts(&mut LlmdWeighted::new(3, 4), &r, &w);
        assert!(c.iter().all(|&n| (140..260).contains(&n)), "{c:?}");
        let seq = |seed| {
            let mut l = LlmdWeighted::new(3, seed);
            (0..64).map(|t| l.pick(&r, &w, t)).collect::<Vec<_>>()
        };
        assert_eq!(seq(8), seq(8));
        assert_ne!(seq(8), seq(9));
    }

    #[test]
    fn names_are_the_report_names() {
        assert_eq!(DynamoCost::new(1, 0).name(), "dynamo-cost");
        assert_eq!(SmgCacheAware::new(1, 0).name(), "smg-cache-aware");
        assert_eq!(LlmdWeighted::new(1, 0).name(), "llmd-weighted");
    }
}
