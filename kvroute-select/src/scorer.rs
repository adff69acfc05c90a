//! KV-exact scorers: how a prompt's overlap with each inventory becomes a winner.

use kvroute_ingest::Overlap;

use crate::counters::MissReason;
use crate::pool::Pool;

/// Load-aware scoring parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadAwareConfig {
    /// Bounded-load slack ε: no endpoint takes a request that would put it above
    /// `⌈(1+ε)·mean⌉` (capacity-weighted) unless every eligible endpoint would be.
    pub epsilon: f64,
    /// Value of one cached block token by tier, indexed by
    /// [`kvroute_core::Medium::index`] (GPU, CPU, disk, external): reloading from
    /// slower tiers saves less prefill work.
    pub tier_weights: [f64; 4],
    /// Prefill tokens one in-flight request is assumed to cost.
    pub tokens_per_in_flight: f64,
    /// Weight of the host-reported queued prefill tokens.
    pub queued_weight: f64,
}

impl Default for LoadAwareConfig {
    fn default() -> Self {
        Self {
            epsilon: 0.25,
            tier_weights: [1.0, 0.6, 0.3, 0.2],
            tokens_per_in_flight: 512.0,
            queued_weight: 1.0,
        }
    }
}

/// Parameters of the default KV-exact scorer, [`Scorer::Cost`].
///
/// The scorer predicts each eligible endpoint's time to first token for this
/// request, in prefill-token equivalents, adds a term for the requests it
/// already carries, and picks the smallest:
///
/// ```text
/// cached_e = Σ_tier prefix_blocks_e,tier · block_size · tier_weight_tier   (≤ prompt_tokens)
/// ttft_e   = ( queued_prefill_tokens_e                                   // work already waiting there
///            + prefill_weight · (prompt_tokens − cached_e)               // this request's own prefill there
///            ) / capacity_e
/// cost_e   = ttft_e + decode_tokens_per_request · in_flight_e / capacity_e
/// winner   = argmin cost_e, except: the longest-prefix endpoint L is kept while
///            ttft_L ≤ (1 + affinity_slack) · ttft_winner + affinity_tokens
/// ```
///
/// The request's own uncached prefill counts `prefill_weight` (default 1)
/// times: `ttft_e` is this request's predicted time to first token, the wait
/// for what is ahead of it plus its own prefill. The work it leaves behind is
/// not charged again: the next decision sees it as that endpoint's queue. A
/// weight of 2 (an earlier default) charged it twice, which was a stand-in
/// for queue figures that could not be trusted; with the drained queue it
/// trades this request's latency for cache reuse it does not get (`kvroute
/// sim`, RAG, 8 workers, 262 144 tokens per worker: TTFT p99 306 ms at weight
/// 2 against round robin's 305, 280 ms at weight 1).
///
/// The in-flight term is not a delay of this request's first token (an
/// engine that schedules prefill ahead of decode, as vLLM's chunked prefill
/// does, lets a new prompt pass the running requests), but each request in
/// flight holds KV blocks and a running slot, and a conversation's request
/// comes back with its next turn to where its cache is: an endpoint carrying
/// more of them is about to receive more work. So the term ranks endpoints
/// for new work — where a prefix saves the same everywhere (a fresh
/// conversation over a shared system prompt) it spreads conversations by how
/// many each endpoint carries — while the affinity test compares predicted
/// times to first token only, so it never moves a prompt off the endpoint
/// caching most of it (a move re-prefills the history elsewhere and keeps
/// two copies). In `kvroute sim`'s multi-turn workload (8 workers, seeds 1–3)
/// 128 tokens per request instead of 16 raised the hit ratio from
/// 66.4–67.5 % to 70.2–71.8 % and cut TTFT p99 from 252–253 to 228–242 ms at
/// 262 144 tokens per worker (73.6–75.5 % → 76.2–76.5 %, 150–172 → 114–120 ms
/// at 4 194 304), past NVIDIA Dynamo's cost function in the same runs
/// (68.0–69.4 % / 232–244 ms, 69.8–70.3 % / 151–154 ms); the other workloads
/// moved by less than a point. When the term was also part of the affinity
/// test, 128 moved 285 later turns of `scripts/bench_smg.sh`'s multi-turn
/// chats to other engines (requests there live ~5 ms, mostly decode).
/// The price of affinity: requests arriving at the same instant with a new
/// shared prefix co-locate only while waiting behind each other costs less
/// than the affinity slack (in the test
/// `the_default_slack_keeps_a_small_simultaneous_burst_together`, four
/// 42-block prompts sharing 40 new blocks stay on one endpoint with the
/// default `affinity_tokens`, and share two without it).
///
/// Only the *longest cached prefix* is credited (`prefix`, not the any-position
/// count): vLLM and SGLang reuse the prefix up to the first missing block, so a
/// block matched after it saves nothing. Among the endpoints the bounded-load
/// cap admits (no endpoint above `⌈load_factor · mean⌉` in-flight requests,
/// capacity-weighted, plus `load_headroom` requests, as CHWBL bounds load),
/// the least cost wins; costs within `tie_tokens` are ties, which go to the
/// less loaded endpoint, then rotate as round robin does — never to endpoint
/// order. Affinity: the longest-prefix endpoint is kept when its predicted
/// time to first token is within `affinity_slack` of the winner's (relative)
/// plus `affinity_tokens` (absolute), so small queue differences do not
/// spread one conversation's cache over the fleet. The absolute part matters
/// for short requests: a chat turn's own prefill is a few dozen uncached
/// tokens, so a relative slack alone lets a few dozen tokens of queue move
/// the conversation, and each move re-prefills history on the new endpoint
/// and duplicates it in a second cache (in `scripts/bench_smg.sh`'s
/// multi-turn cells, 70–118 later turns moved at concurrency 32 without it,
/// against SGLang Model Gateway's 3–13).
///
/// The defaults `affinity_tokens` 128 and `load_headroom` 4 (were 64 and 2):
/// with the in-flight term out of the affinity test, the later turns
/// `scripts/bench_smg.sh` still moved went for queue differences of 100–250
/// tokens (2–5 ms of the mock's prefill) against 3–11 blocks of history, and
/// at concurrency 8 the cap itself moved them (a home holding 5 of 8
/// requests, most of them decoding, which delays no first token). With both,
/// kvroute caches at least as much as SGLang Model Gateway in that benchmark
/// (`BENCHMARKS.md`, tenth session; before, less in 7 of its 8 cells), and
/// the simulator gained too
/// (multi-turn at 4 194 304 tokens: TTFT p99 115 → 98 ms; every
/// `scripts/sim_targets.py` case passes; 4 replicas stay within 5 % of one in
/// 18 of 18 cells).
///
/// Each diversion (a winner other than the longest-prefix endpoint) is
/// logged at DEBUG with both endpoints' cost terms (`RUST_LOG=kvroute_select=debug`).
///
/// A prompt whose first block is held everywhere (a shared system prompt)
/// saves the same on every endpoint, so the queue terms decide: no collapse.
/// An endpoint with an empty inventory (restarted, newly added) carries no
/// queue, so load pulls requests to it.
///
/// `queued_prefill_tokens_e` is what is still ahead of this request, not what
/// was sent: the tracker holds a request's predicted uncached tokens until
/// its first token, so an endpoint about to finish a long prompt looks as
/// busy as one that has just started it, and a least-cost choice on that
/// figure lands requests behind a full prefill while another endpoint is a
/// few milliseconds from idle (in `kvroute sim`'s RAG workload, the slowest
/// 1 % waited 144 ms on average where 28 ms was available). With
/// `drain_queue` the rule keeps a virtual backlog per endpoint — charges add
/// their tokens, time drains them at the endpoint's prefill rate, never more
/// than the tracker holds and zero once it holds nothing — and the rate is
/// measured, so nothing about the engine is configured: from the tracker
/// between decisions and, where the view carries them
/// ([`crate::Load::prefill_progress`]: vLLM's prefill-time and computed-token
/// histograms, polled), from the engines' own counters; the larger of the two
/// wins, since both can only underestimate. The counters matter for
/// non-streamed requests, whose first byte is their last: the tracker then
/// holds a prompt through its decode, and its rate alone is diluted by decode
/// time (in `scripts/bench_smg.sh`'s non-streamed multi-turn cells that made
/// the home endpoint of a conversation look busy while its engine had no
/// prefill queued, and the scorer moved later turns away). Until a second of
/// busy prefill has been measured the tracker's figure is used unchanged. With gateway replicas the drain needs
/// every replica's charges: replica sync's deltas carry each replica's
/// charged-token counter ([`crate::Load::charged_prefill_tokens`]) and the
/// host calls [`crate::Rule::observe_load`] when they arrive, so each
/// replica times the whole queue (`kvroute sim`, RAG, 8 workers, 4 replicas
/// behind a random front end: TTFT p99 289 / 275 ms at 262 144 / 4 194 304
/// tokens per worker against one replica's 280 / 270; before, 304 / 284
/// with the counters read only at decisions, 334 / 302 with the drain
/// standing aside). Whenever the view carries work no counter accounts for
/// (more than 5 % of what it reads), the tracker's figure is used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostConfig {
    /// Value of one cached token by tier ([`kvroute_core::Medium::index`]: GPU,
    /// CPU, disk, external); slower tiers save less prefill.
    pub tier_weights: [f64; 4],
    /// Prefill-token equivalent of one request in flight, for ranking
    /// endpoints (it holds KV blocks and a running slot, and a conversation's
    /// request returns with its next turn); not part of the affinity test.
    pub decode_tokens_per_request: f64,
    /// Weight of the request's own uncached prefill against the queue (≥ 1;
    /// 1: the cost is this request's predicted time to first token).
    pub prefill_weight: f64,
    /// Keep the longest-prefix endpoint while its predicted time to first
    /// token is at most `(1 + affinity_slack)` times the winner's plus
    /// `affinity_tokens`.
    pub affinity_slack: f64,
    /// Absolute part of the affinity slack, prefill-token equivalents.
    pub affinity_tokens: f64,
    /// Bounded-load factor `c ≥ 1`: an endpoint may take a request while its
    /// in-flight count stays within `⌈c · (Σ in-flight + 1) · cap / Σ cap⌉`.
    /// `f64::INFINITY` disables the cap.
    pub load_factor: f64,
    /// Costs closer than this (prefill-token equivalents) count as a tie, so
    /// near-equal endpoints take turns as under round robin instead of the
    /// noise in queue estimates deciding.
    pub tie_tokens: f64,
    /// Requests an endpoint may hold above that cap: at low load a factor
    /// alone forbids an endpoint a second request while others have one,
    /// which costs cache affinity and buys no latency.
    pub load_headroom: u32,
    /// Read `queued_prefill_tokens_e` as the part still ahead of a new
    /// request: the rule drains each endpoint's queue at the prefill rate it
    /// measures from the tracker (see below). Off: the tracker's figure, in
    /// which the prompt being prefilled counts in full until its first token.
    pub drain_queue: bool,
}

impl Default for CostConfig {
    fn default() -> Self {
        Self {
            tier_weights: [1.0, 0.6, 0.3, 0.2],
            decode_tokens_per_request: 128.0,
            prefill_weight: 1.0,
            affinity_slack: 0.1,
            affinity_tokens: 128.0,
            load_factor: 1.25,
            load_headroom: 4,
            tie_tokens: 0.0,
            drain_queue: true,
        }
    }
}

/// How KV-exact ranks endpoints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scorer {
    /// The default: least predicted time to first token (queued prefill work
    /// plus this request's uncached prefill), under a bounded-load cap; see
    /// [`CostConfig`].
    Cost(CostConfig),
    /// Reference behaviour: the most prompt blocks found anywhere in the
    /// inventory; ties go to the first endpoint.
    OverlapCount,
    /// The longest run of found blocks from block 0 — what the engine's prefix
    /// cache can reuse; ties go to the first endpoint.
    LongestPrefix,
    /// Least predicted work: uncached prefill tokens (tier-weighted) plus queued
    /// work, among endpoints under the bounded-load cap.
    LoadAware(LoadAwareConfig),
}

impl Default for Scorer {
    fn default() -> Self {
        Scorer::Cost(CostConfig::default())
    }
}

/// The KV tier's answer for one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvPick {
    Winner {
        index: usize,
        /// The scorer's overlap figure for the winner (blocks or prefix).
        predicted_blocks: u32,
        /// The winner is not the best-overlap endpoint because of load.
        diverted: bool,
    },
    Miss(MissReason),
}

/// Inputs shared by every scorer.
pub(crate) struct KvScoring<'a> {
    pub(crate) overlaps: &'a [Overlap],
    pub(crate) prompt_tokens: u32,
    pub(crate) block_size: u32,
    /// Minimum overlap to count as a hit (first pick only).
    pub(crate) min_blocks: u32,
    /// Retry inside the tier: rank every eligible endpoint, zero overlap
    /// included, never leave the tier.
    pub(crate) sticky: bool,
    /// Prefix blocks credited by predicted entries (recent decisions whose
    /// engine events have not arrived yet), per endpoint; empty when none.
    pub(crate) speculative: &'a [u32],
    /// Rotates exact ties: the rule's turn counter, so equal endpoints take
    /// turns as under round robin (the most regular spread), never endpoint
    /// order.
    pub(crate) tie_turn: u64,
}

impl Scorer {
    fn overlap_figure(&self, o: &Overlap) -> u32 {
        match self {
            Scorer::OverlapCount => o.blocks,
            Scorer::LongestPrefix | Scorer::LoadAware(_) | Scorer::Cost(_) => o.prefix,
        }
    }

    /// True when the scorer reads the any-position count
    /// ([`Overlap::blocks`]); the others read only the prefix, which the
    /// view's early-stopping [`InventoryView::score_prefix`] computes.
    ///
    /// [`InventoryView::score_prefix`]: kvroute_ingest::InventoryView::score_prefix
    pub(crate) fn reads_any_position(&self) -> bool {
        matches!(self, Scorer::OverlapCount)
    }

    pub(crate) fn pick(&self, pool: &Pool<'_>, s: &KvScoring<'_>) -> KvPick {
        let figure = |i: usize| {
            let indexed = s.overlaps.get(i).map_or(0, |o| self.overlap_figure(o));
            match self {
                // Predicted entries only extend prefixes, which only the
                // prefix-based scorers read.
                Scorer::OverlapCount => indexed,
                _ => indexed.max(s.speculative.get(i).copied().unwrap_or(0)),
            }
        };
        // Argmax of the overlap figure, first endpoint on ties.
        let mut best: Option<(usize, u32)> = None;
        for (i, _, _) in pool.candidates() {
            let f = figure(i);
            if best.is_none_or(|(_, bf)| f > bf) {
                best = Some((i, f));
            }
        }
        let Some((best_index, best_figure)) = best else {
            return KvPick::Miss(MissReason::AllCandidatesFiltered);
        };
        if !s.sticky {
            if best_figure == 0 {
                let held_elsewhere = (0..s.overlaps.len()).any(|i| figure(i) > 0);
                return KvPick::Miss(if held_elsewhere {
                    MissReason::AllCandidatesFiltered
                } else {
                    MissReason::ZeroOverlap
                });
            }
            if best_figure < s.min_blocks {
                return KvPick::Miss(MissReason::BelowThreshold);
            }
        }
        match self {
            Scorer::OverlapCount | Scorer::LongestPrefix => KvPick::Winner {
                index: best_index,
                predicted_blocks: best_figure,
                diverted: false,
            },
            Scorer::Cost(cfg) => pick_cost(cfg, pool, s, &figure, best_figure),
            Scorer::LoadAware(cfg) => {
                let bound = pool.bound(1.0 + cfg.epsilon.max(0.0));
                let mut pick: Option<(usize, f64, bool)> = None;
                for (i, e, l) in pool.candidates() {
                    let admitted = bound.admits(l.in_flight, e.capacity_or_one());
                    let c = cost(cfg, s, i, l, e.capacity_or_one());
                    let better = match pick {
                        None => true,
                        // An admitted endpoint always beats one over the cap.
                        Some((_, bc, badm)) => (admitted && !badm) || (admitted == badm && c < bc),
                    };
                    if better {
                        pick = Some((i, c, admitted));
                    }
                }
                match pick {
                    Some((index, _, _)) => KvPick::Winner {
                        index,
                        predicted_blocks: figure(index),
                        diverted: figure(index) < best_figure,
                    },
                    None => KvPick::Miss(MissReason::AllCandidatesFiltered),
                }
            }
        }
    }
}

/// Tokens of the prompt endpoint `i` holds, tier-weighted (predicted entries
/// count as device-resident).
fn cached_tokens(tier_weights: &[f64; 4], s: &KvScoring<'_>, i: usize, prefix: u32) -> f64 {
    let o = s.overlaps.get(i).copied().unwrap_or_default();
    let bs = f64::from(s.block_size);
    let by_medium: u32 = o.prefix_by_medium.iter().sum();
    // Views that do not split by tier report everything as device-resident;
    // so do the blocks only predicted entries credit.
    let untiered = prefix.saturating_sub(by_medium.min(prefix));
    let mut cached = f64::from(untiered) * bs * tier_weights[0];
    let mut left = prefix.saturating_sub(untiered);
    for (n, w) in o.prefix_by_medium.iter().zip(tier_weights) {
        let n = (*n).min(left);
        left -= n;
        cached += f64::from(n) * bs * w;
    }
    cached.min(f64::from(s.prompt_tokens))
}

/// [`CostConfig`]'s terms for endpoint `i`, in prefill-token equivalents per
/// unit of capacity.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CostTerms {
    /// Predicted time to first token: the queue ahead plus this request's own
    /// uncached prefill there.
    pub(crate) ttft: f64,
    /// What ranks endpoints: `ttft` plus the in-flight term.
    pub(crate) cost: f64,
}

pub(crate) fn predicted_cost(
    cfg: &CostConfig,
    s: &KvScoring<'_>,
    i: usize,
    prefix: u32,
    load: crate::load::EndpointLoad,
    capacity: u32,
) -> CostTerms {
    let uncached =
        (f64::from(s.prompt_tokens) - cached_tokens(&cfg.tier_weights, s, i, prefix)).max(0.0);
    #[allow(clippy::cast_precision_loss)]
    let queued = load.queued_prefill_tokens as f64;
    let decode = cfg.decode_tokens_per_request.max(0.0) * f64::from(load.in_flight);
    let own = cfg.prefill_weight.max(1.0) * uncached;
    let cap = f64::from(capacity.max(1));
    CostTerms {
        ttft: (queued + own) / cap,
        cost: (queued + own + decode) / cap,
    }
}

fn pick_cost(
    cfg: &CostConfig,
    pool: &Pool<'_>,
    s: &KvScoring<'_>,
    figure: &dyn Fn(usize) -> u32,
    best_figure: u32,
) -> KvPick {
    let capped = cfg.load_factor.is_finite();
    let bound = pool.bound(cfg.load_factor);
    let admits =
        |in_flight: u32, cap: u32| bound.admits(in_flight.saturating_sub(cfg.load_headroom), cap);
    let admitted_any = capped
        && pool
            .candidates()
            .any(|(_, e, l)| admits(l.in_flight, e.capacity_or_one()));
    // (index, terms, utilisation, tie rank, prefix)
    let mut best: Option<(usize, CostTerms, f64, u64, u32)> = None;
    let mut longest: Option<(usize, CostTerms, u32)> = None;
    for (i, e, l) in pool.candidates() {
        let cap = e.capacity_or_one();
        if admitted_any && !admits(l.in_flight, cap) {
            continue;
        }
        let prefix = figure(i);
        let terms = predicted_cost(cfg, s, i, prefix, l, cap);
        let c = terms.cost;
        let util = f64::from(l.in_flight) / f64::from(cap);
        let n = pool.endpoints.len().max(1) as u64;
        let rank = (i as u64 + n - s.tie_turn % n) % n;
        let better = match best {
            None => true,
            Some((_, bt, bu, br, _)) => {
                let bc = bt.cost;
                let band = cfg.tie_tokens.max(0.0);
                c < bc - band
                    || ((c - bc).abs() <= band && (util < bu || (util == bu && rank < br)))
            }
        };
        if better {
            best = Some((i, terms, util, rank, prefix));
        }
        let longer = match longest {
            None => true,
            Some((_, lt, lp)) => prefix > lp || (prefix == lp && c < lt.cost),
        };
        if longer {
            longest = Some((i, terms, prefix));
        }
    }
    let Some((mut index, best_terms, _, _, mut prefix)) = best else {
        return KvPick::Miss(MissReason::AllCandidatesFiltered);
    };
    if let Some((li, lt, lp)) = longest {
        let slack = cfg.affinity_tokens.max(0.0);
        // Affinity weighs predicted time to first token only: the in-flight
        // term ranks endpoints for new work but delays no first token, so it
        // never moves a prompt off the endpoint caching most of it.
        let (lc, best_cost) = (lt.ttft, best_terms.ttft);
        if lp > prefix && lc <= best_cost * (1.0 + cfg.affinity_slack.max(0.0)) + slack {
            index = li;
            prefix = lp;
        } else if lp > prefix && tracing::enabled!(tracing::Level::DEBUG) {
            // Why a prompt left the endpoint holding most of it: the cost
            // terms of both, for diagnosing diversions.
            let (hl, bl) = (pool.load_of(li), pool.load_of(index));
            tracing::debug!(
                longest = li,
                longest_prefix = lp,
                longest_ttft = lc,
                longest_queued = hl.queued_prefill_tokens,
                longest_in_flight = hl.in_flight,
                chosen = index,
                chosen_prefix = prefix,
                chosen_ttft = best_cost,
                chosen_queued = bl.queued_prefill_tokens,
                chosen_in_flight = bl.in_flight,
                prompt_tokens = s.prompt_tokens,
                "cost scorer diverted"
            );
        }
    }
    KvPick::Winner {
        index,
        predicted_blocks: prefix,
        diverted: prefix < best_figure,
    }
}

/// Predicted work if endpoint `i` takes the request, in prefill tokens.
fn cost(
    cfg: &LoadAwareConfig,
    s: &KvScoring<'_>,
    i: usize,
    load: crate::load::EndpointLoad,
    capacity: u32,
) -> f64 {
    let o = s.overlaps.get(i).copied().unwrap_or_default();
    let bs = f64::from(s.block_size);
    let by_medium: u32 = o.prefix_by_medium.iter().sum();
    // Views that do not split by tier report everything as device-resident.
    let untiered = o.prefix.saturating_sub(by_medium);
    let mut cached = f64::from(untiered) * bs * cfg.tier_weights[0];
    for (n, w) in o.prefix_by_medium.iter().zip(cfg.tier_weights) {
        cached += f64::from(*n) * bs * w;
    }
    let uncached = (f64::from(s.prompt_tokens) - cached).max(0.0);
    #[allow(clippy::cast_precision_loss)]
    let queued = cfg.queued_weight * load.queued_prefill_tokens as f64
        + cfg.tokens_per_in_flight * f64::from(load.in_flight);
    uncached + queued / f64::from(capacity.max(1))
}
