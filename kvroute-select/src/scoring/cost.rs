//! The default KV-exact scorer: least predicted time to first token under a
//! bounded-load cap, with affinity for the longest cached prefix.

use std::time::Duration;

use super::{Candidate, ScoreInput, ScorePick, Scorer};
use crate::counters::MissReason;
use crate::explain::{CapSummary, ScoreExplain, ScoreSummary, ScoreTerms, Verdict};
use crate::pool::LoadBound;

/// Parameters of the default KV-exact scorer, [`CostScorer`].
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
/// cost_e   = ttft_e + (decode_tokens_per_request · in_flight_e + evict_e) / capacity_e
/// winner   = argmin cost_e among endpoints under the cap, except: the
///            longest-prefix endpoint L, when no other candidate holds as
///            long a prefix, is kept while
///            ttft_L ≤ (1 + affinity_slack) · ttft_winner + affinity_tokens
///            (each plus evict_e while a cache has room: see "Cache room")
/// ```
///
/// * Only the **longest cached prefix** is credited: vLLM and SGLang reuse
///   the prefix up to the first missing block, so a block matched after it
///   saves nothing. Predicted entries extend it (as device-resident blocks).
/// * The **in-flight term** ranks endpoints for new work but is not part of
///   the affinity test: a running request delays no new prompt's first token
///   on an engine that schedules prefill first, yet it holds KV blocks and a
///   running slot, and a conversation's request returns with its next turn to
///   where its cache is. So a fresh conversation goes where fewer run, and no
///   prompt is moved off the endpoint caching most of it for that reason.
/// * **Affinity** keeps the longest-prefix endpoint while its predicted time
///   to first token is within `affinity_slack` (relative) plus
///   `affinity_tokens` (absolute) of the winner's: a move re-prefills the
///   history elsewhere and keeps two copies, and a chat turn's own prefill is
///   a few dozen tokens, so a relative slack alone would let small queue
///   differences spread one conversation over the fleet. A longest prefix
///   that several candidates hold is replicated (a shared system prompt),
///   not one conversation's history: the least cost decides, which already
///   counts the prefill an endpoint without it would add. Kept anyway, it
///   locks out an engine that missed the prompt at the start: every fresh
///   conversation stays on the engines holding it until their queues
///   outweigh it plus the slack.
/// * **Cache room.** While some candidate's cache has room for the blocks
///   this request would write there (its uncached blocks, against the
///   engine's reported capacity less the blocks its inventory holds,
///   [`crate::Candidate::gpu_room`]), a placement that would evict cached
///   blocks costs `eviction_weight` per evicted token, in the cost and in
///   the affinity test:
///
///   ```text
///   evict_e = eviction_weight · max(0, written_blocks_e − room_e) · block_size
///   keep L while ttft_L + evict_L ≤ (1 + affinity_slack) · (ttft_w + evict_w) + affinity_tokens
///   ```
///
///   Without it, fresh conversations over a shared root go to the few
///   endpoints that hold the root while the fleet has idle caches, fill
///   theirs and evict conversations they would have served from cache (on
///   a lightly loaded fleet of 128 engines, a hit ratio of 0.58 of the
///   pooled bound). A conversation's next turn writes little and stays
///   with its history. With no room anywhere (a busy fleet's caches are
///   full) or no capacity reported, the term is 0 and nothing changes.
/// * The **bounded-load cap** admits an endpoint while its in-flight count,
///   less `load_headroom`, stays within
///   `⌈load_factor · (Σ in-flight + 1) · capacity / Σ capacity⌉`, as CHWBL
///   bounds load; when no endpoint is under it,
///   all compete. A prompt whose first block is held everywhere (a shared
///   system prompt) saves the same on every endpoint, so the queue terms
///   decide and nothing collapses onto one endpoint.
/// * **Ties** (costs within `tie_tokens`) go to the less utilised endpoint,
///   then rotate as round robin does — never to endpoint order.
/// * **Other deciders.** With gateway replicas ([`crate::Load::deciders`]:
///   `R > 1` deciders, this one of rank `k`), the requests the others place
///   at this instant are not in the view: replicas that decide one burst on
///   one view would otherwise rank the endpoints alike and pile onto the same
///   ones (the herd effect of routing on stale load; Mitzenmacher, "How
///   useful is old information?", IEEE TPDS 2000). Randomising near-ties
///   only makes the collisions random (Dahlin, "Interpreting stale load
///   information", IEEE TPDS 2000, shows the same for sampling proportional
///   to the expected spare capacity). Instead the deciders split the
///   endpoints into `R` zones by index (`⌊e·R/n⌋`; with fewer endpoints than
///   deciders, endpoint `d mod n` for decider `d`), and each adds to every
///   endpoint outside its own zone the prefill its owner is expected to be
///   placing there right now:
///
///   ```text
///   unseen_e = (burst − 1)⁺ · prefill / min(|zone(owner(e))|, ⌈burst − 1⌉)   (0 in its own zone)
///   ```
///
///   The owner sends its burst to its cheapest endpoints, one request each
///   while they stay cheapest — the same endpoints every decider finds
///   cheapest — so the expected load is spread over at most one endpoint
///   per request, not over the whole zone (on a large fleet that would make
///   it too small to keep the others off one zone's few idle endpoints).
///
///   where `burst` is the mean number of this rule's decisions per burst
///   (decisions within `burst_window` of a burst's first) and `prefill` the
///   mean prefill tokens one charged ([`crate::BurstStats`]) — a random
///   front end hands every replica the same stream, so each expects the
///   others to be as busy as itself. A burst thus fills each decider's own
///   zone first and spills over only where a zone is really fuller, which
///   the deciders compute alike without talking; with requests one at a
///   time (`burst` 1) nothing is added and the decision is the one a single
///   decider makes. `unseen_e` counts as queued prefill everywhere (the cost
///   and the affinity test).
///
///   A decider whose own zone is fuller than that spills, and so do the
///   others whose zones are: on one view they would all spill into the same
///   zone, the one every view finds cheapest. So each decider ranks the
///   other zones in an order of its own (a fixed pseudo-random order per
///   rank; with two deciders there is one other zone and nothing to order)
///   and adds to the cost, not to the predicted time to first token, of an
///   endpoint outside its zone
///
///   ```text
///   spill_e = (burst − 1)⁺ · prefill · u(k, owner(e)),   u uniform in [0, 1)
///   ```
///
///   Deciders spilling at the same instant then spread over the zones
///   within that margin of the cheapest, while the affinity test (which
///   keeps a prompt where its cache is) is unchanged.
///
///   Where the deciders take turns within a burst
///   ([`crate::Deciders::ordered`]; [`crate::burst_turn`]), the lower
///   ranks have decided their part and it is in the view, and the higher
///   ranks will see this decision: nothing is unseen, and the decision is
///   the one a single decider makes. A request with a home is decided at
///   once ([`crate::Deciders::home`]), at the instant the others decide
///   theirs: most stay at their homes, so nothing is unseen and whether it
///   leaves its own is decided as a single decider decides it; but those
///   that leave a busy home would all go to the endpoints every view finds
///   cheapest. So the spill-over order applies (to the cost, not the
///   predicted time to first token), except on the endpoints holding this
///   request's longest prefix: leaving, each decider prefers its own zone,
///   then the others in its own order.
/// * **`burst_window`**: decisions closer than this to a burst's first are
///   one burst: the time another replica's decision takes to reach this
///   one's view (its replica sync interval plus one message).
/// * **`drain_queue`**: `queued_prefill_tokens_e` is read as what is still
///   ahead of this request, not what was sent. The tracker holds a request's
///   uncached tokens until its first token, so without draining an endpoint
///   about to finish a long prompt looks as busy as one that has just
///   started it. The rule keeps a virtual backlog per endpoint — charges add
///   their tokens, time drains them at the endpoint's measured prefill rate,
///   never more than the tracker holds — where the rate comes from the
///   charges it sees and, where the load view carries them, from the engines'
///   own prefill counters ([`crate::Load::prefill_progress`]), whichever is
///   higher (both can only underestimate). With replicas the view's charge
///   counter ([`crate::Load::charged_prefill_tokens`]) includes every
///   replica's, so each times the whole queue. When the view carries work no
///   counter accounts for (more than 5 % of what it reads), the tracker's
///   figure is used as is.
///
/// The measurements behind the defaults, and when to change them, are in the
/// routing-policy page of the documentation (`docs/routing.md`). Each
/// diversion (a winner other than the longest-prefix endpoint) is logged at
/// DEBUG with both endpoints' cost terms (`RUST_LOG=kvroute_select=debug`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostConfig {
    /// Value of one cached token by tier ([`kvroute_core::Medium::index`]: GPU,
    /// CPU, disk, external); slower tiers save less prefill.
    pub tier_weights: [f64; 4],
    /// Prefill-token equivalent of one request in flight, for ranking
    /// endpoints; not part of the affinity test.
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
    /// Bounded-load factor `c ≥ 1`; `f64::INFINITY` disables the cap.
    pub load_factor: f64,
    /// Costs closer than this (prefill-token equivalents) count as a tie.
    pub tie_tokens: f64,
    /// Requests an endpoint may hold above the cap: at low load a factor
    /// alone forbids an endpoint a second request while others have one,
    /// which costs cache affinity and buys no latency.
    pub load_headroom: u32,
    /// Read `queued_prefill_tokens_e` as the part still ahead of a new
    /// request (the rule drains each endpoint's queue at its measured
    /// prefill rate). Off: the tracker's figure, in which the prompt being
    /// prefilled counts in full until its first token.
    pub drain_queue: bool,
    /// Decisions within this time of a burst's first count as one burst
    /// (see "Other deciders" above).
    pub burst_window: Duration,
    /// Prefill-token equivalent of one cached token a placement evicts
    /// while another candidate has room for the request (see "Cache room"
    /// above); 0 turns the term off.
    pub eviction_weight: f64,
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
            burst_window: Duration::from_millis(4),
            eviction_weight: 1.0,
        }
    }
}

/// The default KV-exact scorer (`cost`): see [`CostConfig`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostScorer(pub CostConfig);

impl Scorer for CostScorer {
    fn name(&self) -> &str {
        "cost"
    }

    fn drains_queue(&self) -> bool {
        self.0.drain_queue
    }

    fn burst_window(&self) -> Option<Duration> {
        Some(self.0.burst_window)
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        match gate(input, self.0.load_factor) {
            Ok(g) => pick_cost(&self.0, input, g, None),
            Err(miss) => ScorePick::Miss(miss),
        }
    }

    fn explain(&self, input: &ScoreInput<'_>, out: &mut ScoreExplain<'_>) {
        if let Ok(g) = gate(input, self.0.load_factor) {
            pick_cost(&self.0, input, g, Some(out));
        }
    }
}

/// [`ScoreInput::gate`] on the credited prefix and the sums of the
/// bounded-load cap, in one pass over the candidates (on a large fleet
/// every pass over it counts).
struct Gate {
    /// The longest credited prefix among the candidates.
    best: u32,
    bound: LoadBound,
    /// Some candidate's cache has room for the blocks this request would
    /// write there (see "Cache room" in [`CostConfig`]).
    room_somewhere: bool,
}

fn gate(input: &ScoreInput<'_>, load_factor: f64) -> Result<Gate, MissReason> {
    let (mut best, mut any, mut room_somewhere) = (0u32, false, false);
    let (mut in_flight, mut capacity) = (0u64, 0u64);
    for c in input.candidates() {
        any = true;
        let prefix = c.prefix();
        best = best.max(prefix);
        in_flight += u64::from(c.load.in_flight);
        capacity += u64::from(c.capacity());
        room_somewhere |= c
            .gpu_room()
            .is_some_and(|room| written_blocks(input, prefix) <= room);
    }
    if !any {
        return Err(MissReason::AllCandidatesFiltered);
    }
    if !input.retry && (best == 0 || best < input.min_blocks) {
        // The miss's exact reason (which the common gate tells apart).
        input.gate(Candidate::prefix)?;
    }
    Ok(Gate {
        best,
        bound: LoadBound::new(in_flight, capacity, load_factor),
        room_somewhere,
    })
}

/// Blocks a candidate holding `prefix` of the prompt's blocks would write
/// into its cache for this request (the prompt's uncached blocks).
fn written_blocks(input: &ScoreInput<'_>, prefix: u32) -> u64 {
    let blocks = input.prompt_tokens.div_ceil(input.block_size.max(1));
    u64::from(blocks.saturating_sub(prefix))
}

/// The cached tokens of the last candidate's prefix: on a large fleet most
/// candidates hold the same prefix (a shared root, or nothing).
#[derive(Default)]
struct CachedMemo {
    key: Option<(u32, [u32; 4])>,
    tokens: f64,
}

impl CachedMemo {
    fn get(
        &mut self,
        tier_weights: &[f64; 4],
        input: &ScoreInput<'_>,
        c: &Candidate<'_>,
        prefix: u32,
    ) -> f64 {
        let key = Some((prefix, c.overlap.prefix_by_medium));
        if self.key != key {
            self.key = key;
            self.tokens = cached_tokens(tier_weights, input, c, prefix);
        }
        self.tokens
    }
}

/// Tokens of the prompt candidate `c` holds in its first `prefix` blocks,
/// tier-weighted (predicted entries count as device-resident).
fn cached_tokens(
    tier_weights: &[f64; 4],
    input: &ScoreInput<'_>,
    c: &Candidate<'_>,
    prefix: u32,
) -> f64 {
    let o = c.overlap;
    let bs = f64::from(input.block_size);
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
    cached.min(f64::from(input.prompt_tokens))
}

/// [`CostConfig`]'s terms for one endpoint, in prefill-token equivalents per
/// unit of capacity.
#[derive(Clone, Copy, Debug, Default)]
struct CostTerms {
    /// Predicted time to first token: the queue ahead plus this request's own
    /// uncached prefill there.
    ttft: f64,
    /// What ranks endpoints: `ttft` plus the in-flight term.
    cost: f64,
    /// Cached tokens the placement would evict while another candidate has
    /// room (weighted): part of `cost` and of the affinity test.
    evict: f64,
}

/// Prefill tokens the other deciders are expected to be placing on each
/// endpoint at this instant (see "Other deciders" in [`CostConfig`]): the
/// decision's constants, so each endpoint costs a division or two.
struct Unseen {
    /// Deciders `r` (0: nothing unseen anywhere).
    deciders: usize,
    /// This decider's rank.
    rank: usize,
    /// Endpoints `n`.
    endpoints: usize,
    /// `(burst − 1)⁺ · prefill`: what one other decider places per burst.
    per_decider: f64,
    /// `⌈burst − 1⌉` (at least 1): endpoints one decider's burst lands on.
    burst_spread: usize,
    /// A request with a home decided in turn ([`crate::Deciders::home`]):
    /// the spill-over order only, nothing unseen.
    homed: bool,
    /// Endpoints holding at least this prefix (such a request's home) get
    /// neither term.
    home_prefix: u32,
}

impl Unseen {
    fn new(input: &ScoreInput<'_>, best_prefix: u32) -> Self {
        let r = input.deciders.count as usize;
        let per_decider =
            (input.burst.decisions - 1.0).max(0.0) * input.burst.prefill_tokens.max(0.0);
        let n = input.endpoint_count();
        // Deciding in turn a request without a home, the lower ranks' part
        // of the burst is in the view and the higher ranks will see this
        // decision: nothing unseen. A request with a home is decided at
        // once, while the others decide theirs, each at its home or, when
        // it leaves a busy one, on the endpoints every view finds cheapest:
        // the spill-over order keeps those apart.
        let homed = input.deciders.ordered && input.deciders.home;
        let on = r > 1 && per_decider > 0.0 && n > 0 && (!input.deciders.ordered || homed);
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let burst_spread = (input.burst.decisions - 1.0).ceil().max(1.0) as usize;
        Self {
            deciders: if on { r } else { 0 },
            rank: input.deciders.rank as usize % r.max(1),
            endpoints: n,
            per_decider,
            burst_spread,
            homed,
            home_prefix: if homed && best_prefix > 0 {
                best_prefix
            } else {
                u32::MAX
            },
        }
    }

    /// Endpoint `e`'s unseen tokens, and the spill-over order's term (see
    /// "Other deciders" in [`CostConfig`]).
    fn at(&self, e: usize, prefix: u32) -> (f64, f64) {
        let (r, n, k) = (self.deciders, self.endpoints, self.rank);
        if r == 0 || e >= n || prefix >= self.home_prefix {
            return (0.0, 0.0);
        }
        if n >= r {
            // Zone d holds endpoints ⌈d·n/r⌉ ..< ⌈(d+1)·n/r⌉.
            let owner = e.saturating_mul(r) / n;
            if owner == k {
                return (0.0, 0.0);
            }
            let size = ((owner + 1) * n).div_ceil(r) - (owner * n).div_ceil(r);
            // The owner's burst lands on its cheapest endpoints, which are
            // the cheapest for every decider alike: spread over at most one
            // endpoint per request, not over its whole zone.
            let spread = size.min(self.burst_spread);
            #[allow(clippy::cast_precision_loss)]
            let unseen = self.per_decider / spread.max(1) as f64;
            // With one other zone there is no order to spill in.
            let spill = if r > 2 {
                self.per_decider * spill_order(k, owner)
            } else {
                0.0
            };
            if self.homed {
                return (0.0, spill);
            }
            return (unseen, spill);
        }
        if self.homed {
            return (0.0, 0.0);
        }
        // Decider d's zone is endpoint d mod n.
        let owners = (r - 1 - e) / n + 1;
        let others = owners - usize::from(k % n == e);
        #[allow(clippy::cast_precision_loss)]
        let others = others as f64;
        (self.per_decider * others, 0.0)
    }
}

/// Where decider `rank` puts zone `owner` in its order of zones to spill
/// into, in `[0, 1)`: a fixed pseudo-random order per decider, so deciders
/// that spill at the same instant out of full zones of their own go to
/// different zones, not all to the one every view finds cheapest (see
/// "Other deciders" in [`CostConfig`]).
fn spill_order(rank: usize, owner: usize) -> f64 {
    let seed = (rank as u64) << 32 | owner as u64;
    let h = kvroute_core::mix::fmix64(seed ^ 0x9e37_79b9_7f4a_7c15);
    #[allow(clippy::cast_precision_loss)]
    let unit = (h >> 11) as f64 / (1u64 << 53) as f64;
    unit
}

/// The cost model's per-decision constants.
/// `ROOM`: some candidate has room for the request and the cache-room term
/// applies.
struct Model<'c, const ROOM: bool> {
    cfg: &'c CostConfig,
    unseen: Unseen,
    cached: CachedMemo,
    prompt: f64,
}

impl<'c, const ROOM: bool> Model<'c, ROOM> {
    fn new(cfg: &'c CostConfig, input: &ScoreInput<'_>, best_prefix: u32) -> Self {
        Self {
            cfg,
            unseen: Unseen::new(input, best_prefix),
            cached: CachedMemo::default(),
            prompt: f64::from(input.prompt_tokens),
        }
    }

    /// Candidate `c`'s terms, in prefill-token equivalents per unit of
    /// capacity, and the same as the explanation shows them. Inlined: a
    /// call returning both through memory stalls on reading them back.
    #[inline(always)]
    fn terms(
        &mut self,
        input: &ScoreInput<'_>,
        c: &Candidate<'_>,
        prefix: u32,
        under_cap: bool,
    ) -> (CostTerms, ScoreTerms) {
        let cfg = self.cfg;
        let (load, capacity) = (c.load, c.capacity());
        let cached = self.cached.get(&cfg.tier_weights, input, c, prefix);
        let uncached = (self.prompt - cached).max(0.0);
        let (unseen, spill) = self.unseen.at(c.index, prefix);
        #[allow(clippy::cast_precision_loss)]
        let queued = load.queued_prefill_tokens as f64 + unseen;
        let decode = cfg.decode_tokens_per_request.max(0.0) * f64::from(load.in_flight);
        let own = cfg.prefill_weight.max(1.0) * uncached;
        let cap = f64::from(capacity.max(1));
        let evict = if ROOM {
            c.gpu_room().map_or(0.0, |room| {
                let over = written_blocks(input, prefix).saturating_sub(room);
                #[allow(clippy::cast_precision_loss)]
                let tokens = (over * u64::from(input.block_size)) as f64;
                cfg.eviction_weight * tokens
            })
        } else {
            0.0
        };
        let terms = CostTerms {
            ttft: (queued + own) / cap,
            cost: (queued + own + decode + spill + evict) / cap,
            evict: evict / cap,
        };
        let explained = ScoreTerms {
            cached_tokens: cached,
            prefill_tokens: own,
            queued_tokens: queued,
            unseen_tokens: unseen,
            spill_tokens: spill,
            evict_tokens: evict,
            in_flight_tokens: decode,
            ttft: terms.ttft,
            cost: terms.cost,
            under_cap,
        };
        (terms, explained)
    }
}

/// Ties kept at most ([`Ties`]).
const TIES_KEPT: usize = 64;

/// The candidates tied with the best one (cost within `tie_tokens`, same
/// utilisation) when several deciders decide on one view at once
/// ([`crate::Deciders`]; in its turn a decider sees the lower ranks'
/// placements and breaks ties as one alone does): alone the tie
/// nearest after the rule's turn wins; deciders started together count
/// their turns alike, so each takes the tie `rank · k / count` places on
/// among the `k` ties instead (rank 0 the one a decider alone takes), and
/// replicas spread their first ties over the tied endpoints, however few
/// and wherever they are. At most [`TIES_KEPT`] are kept, those of the
/// lowest tie ranks (so the one a decider alone takes among them), enough
/// to part every decider of a fleet.
#[derive(Clone, Copy)]
struct Ties {
    /// (tie rank, index, terms, prefix).
    kept: [(usize, usize, CostTerms, u32); TIES_KEPT],
    len: usize,
}

impl Default for Ties {
    fn default() -> Self {
        Self {
            kept: [(0, 0, CostTerms::default(), 0); TIES_KEPT],
            len: 0,
        }
    }
}

impl Ties {
    fn clear(&mut self) {
        self.len = 0;
    }

    fn push(&mut self, rank: usize, index: usize, terms: CostTerms, prefix: u32) {
        if let Some(slot) = self.kept.get_mut(self.len) {
            *slot = (rank, index, terms, prefix);
            self.len += 1;
            return;
        }
        // Full: the new one replaces the highest rank kept, if it is lower.
        if let Some(slot) = self.kept.iter_mut().max_by_key(|(r, ..)| *r) {
            if rank < slot.0 {
                *slot = (rank, index, terms, prefix);
            }
        }
    }

    /// This decider's tie: (index, terms, prefix); `None` for one tie.
    fn pick(&mut self, deciders: crate::load::Deciders) -> Option<(usize, CostTerms, u32)> {
        let kept = self.kept.get_mut(..self.len)?;
        if kept.len() < 2 {
            return None;
        }
        kept.sort_unstable_by_key(|&(rank, ..)| rank);
        let k = u64::try_from(kept.len()).ok()?;
        let at = usize::try_from(deciders.rotate(0, k)).ok()?;
        kept.get(at)
            .map(|&(_, i, terms, prefix)| (i, terms, prefix))
    }
}

/// The bounded-load cap's limit for the last capacity asked about: fleets
/// are mostly of one size, and the limit costs a division and a rounding.
struct LimitMemo {
    bound: LoadBound,
    capacity: u32,
    limit: f64,
}

impl LimitMemo {
    fn new(bound: LoadBound) -> Self {
        Self {
            bound,
            capacity: 0,
            limit: 0.0,
        }
    }

    /// Whether an endpoint holding `in_flight` requests of `capacity` may
    /// take one more ([`LoadBound::admits`]).
    fn admits(&mut self, in_flight: u32, capacity: u32) -> bool {
        let capacity = capacity.max(1);
        if capacity != self.capacity {
            self.capacity = capacity;
            self.limit = self.bound.limit(capacity);
        }
        f64::from(in_flight) + 1.0 <= self.limit
    }
}

/// The cost scorer's pick; with `out`, also its terms and summary (the same
/// computation, so the explanation is what the pick did).
fn pick_cost(
    cfg: &CostConfig,
    input: &ScoreInput<'_>,
    gate: Gate,
    out: Option<&mut ScoreExplain<'_>>,
) -> ScorePick {
    // Busy fleets' caches are full: their decisions run the loop without
    // the cache-room term at all (it is 0 there).
    if gate.room_somewhere && cfg.eviction_weight > 0.0 {
        pick_cost_with::<true>(cfg, input, gate, out)
    } else {
        pick_cost_with::<false>(cfg, input, gate, out)
    }
}

/// [`pick_cost`] with (`ROOM`) or without the cache-room term.
fn pick_cost_with<const ROOM: bool>(
    cfg: &CostConfig,
    input: &ScoreInput<'_>,
    gate: Gate,
    mut out: Option<&mut ScoreExplain<'_>>,
) -> ScorePick {
    let (best_figure, bound) = (gate.best, gate.bound);
    let capped = cfg.load_factor.is_finite();
    let mut limit = LimitMemo::new(bound);
    let mut admits =
        |in_flight: u32, cap: u32| limit.admits(in_flight.saturating_sub(cfg.load_headroom), cap);
    let admitted_any = capped
        && input
            .candidates()
            .any(|c| admits(c.load.in_flight, c.capacity()));
    let mut model = Model::<ROOM>::new(cfg, input, best_figure);
    let n = input.endpoint_count().max(1);
    let turn = usize::try_from(input.turn % n as u64).unwrap_or(0);
    let band = cfg.tie_tokens.max(0.0);
    // (index, terms, utilisation, tie rank, prefix)
    let mut best: Option<(usize, CostTerms, f64, usize, u32)> = None;
    // Among several deciders, the candidates tied with the best (see
    // `Ties`); alone the nearest after the turn wins, as kept in `best`.
    let mut ties = input.deciders.at_once().then(Ties::default);
    let mut longest: Option<(usize, CostTerms, u32)> = None;
    // Candidates holding the longest prefix: more than one means it is
    // replicated (a shared system prompt), not one conversation's history.
    let mut holders = 0u32;
    let mut refused = 0u32;
    for c in input.candidates() {
        let (i, l, cap) = (c.index, c.load, c.capacity());
        let under = !admitted_any || admits(l.in_flight, cap);
        let prefix = c.prefix();
        if !under {
            refused += 1;
            if let Some(o) = out.as_deref_mut().filter(|o| o.wants_terms()) {
                o.set_terms(i, model.terms(input, &c, prefix, false).1);
            }
            continue;
        }
        let (terms, explained) = model.terms(input, &c, prefix, true);
        if let Some(o) = out.as_deref_mut() {
            o.set_terms(i, explained);
        }
        let cost = terms.cost;
        let util = f64::from(l.in_flight) / f64::from(cap);
        // Places after the turn's endpoint, so exact ties rotate.
        let rank = if i >= turn { i - turn } else { i + n - turn };
        let (better, tied) = match best {
            None => (true, false),
            Some((_, bt, bu, br, _)) => {
                let bc = bt.cost;
                let tied = (cost - bc).abs() <= band && util == bu;
                let better = cost < bc - band
                    || ((cost - bc).abs() <= band && (util < bu || (tied && rank < br)));
                (better, tied)
            }
        };
        if let Some(t) = ties.as_mut() {
            if better && !tied {
                t.clear();
            }
            if better || tied {
                t.push(rank, i, terms, prefix);
            }
        }
        if better {
            best = Some((i, terms, util, rank, prefix));
        }
        match longest {
            Some((_, _, lp)) if prefix == lp => holders += 1,
            Some((_, _, lp)) if prefix < lp => {}
            _ => holders = 1,
        }
        let longer = match longest {
            None => true,
            Some((_, lt, lp)) => prefix > lp || (prefix == lp && cost < lt.cost),
        };
        if longer {
            longest = Some((i, terms, prefix));
        }
    }
    let Some((mut index, mut best_terms, _, _, mut prefix)) = best else {
        return ScorePick::Miss(MissReason::AllCandidatesFiltered);
    };
    if let Some((i, terms, p)) = ties.as_mut().and_then(|t| t.pick(input.deciders)) {
        (index, best_terms, prefix) = (i, terms, p);
    }
    let cheapest = index;
    let slack = cfg.affinity_tokens.max(0.0);
    // Affinity weighs predicted time to first token, and the cached tokens
    // a placement evicts while another candidate has room (see above).
    let affinity_bound =
        (best_terms.ttft + best_terms.evict) * (1.0 + cfg.affinity_slack.max(0.0)) + slack;
    let mut verdict = Verdict::Cheapest;
    if let Some((li, lt, lp)) = longest {
        let (lc, best_cost) = (lt.ttft + lt.evict, best_terms.ttft);
        if lp > prefix && holders == 1 && lc <= affinity_bound {
            index = li;
            prefix = lp;
            verdict = Verdict::AffinityKept;
        } else if lp > prefix {
            verdict = Verdict::Diverted;
            if tracing::enabled!(tracing::Level::DEBUG) {
                // Why a prompt left the endpoint holding most of it: the cost
                // terms of both, for diagnosing diversions.
                let (hl, bl) = (input.pool.load_of(li), input.pool.load_of(index));
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
                    prompt_tokens = input.prompt_tokens,
                    "cost scorer diverted"
                );
            }
        }
    }
    if let Some(o) = out {
        *o.summary_mut() = ScoreSummary {
            cap: capped.then_some(CapSummary {
                bound,
                headroom: cfg.load_headroom,
                applied: admitted_any,
                refused,
            }),
            admitted_prefix_blocks: longest.map(|(_, _, lp)| lp),
            cheapest: Some(cheapest),
            longest: longest.map(|(li, _, _)| li),
            affinity_bound: Some(affinity_bound),
            verdict: Some(verdict),
        };
    }
    ScorePick::Winner {
        index,
        predicted_blocks: prefix,
        diverted: prefix < best_figure,
    }
}

#[cfg(test)]
mod tests {
    use super::{CostTerms, Ties};
    use crate::load::Deciders;

    /// More ties than are kept, met in endpoint order while the turn sits
    /// past the first 64: the kept ones are the lowest tie ranks, so rank 0
    /// takes the tie a decider alone takes, and the others part after it.
    #[test]
    fn the_lowest_tie_ranks_are_kept() {
        let (n, turn) = (100usize, 70usize);
        let mut ties = Ties::default();
        for i in 0..n {
            let rank = (i + n - turn) % n;
            ties.push(rank, i, CostTerms::default(), 0);
        }
        let pick = |rank| {
            let mut t = ties;
            let d = Deciders {
                count: 4,
                rank,
                ..Deciders::ALONE
            };
            t.pick(d).map(|(i, ..)| i)
        };
        assert_eq!(pick(0), Some(turn), "the tie a decider alone takes");
        // 64 kept: ranks 0..63, endpoints 70..99 then 0..33.
        assert_eq!(pick(1), Some(86));
        assert_eq!(pick(2), Some(2));
        assert_eq!(pick(3), Some(18));
    }
}
