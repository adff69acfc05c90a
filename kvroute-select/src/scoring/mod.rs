//! KV-exact scoring: how a prompt's overlap with each endpoint's inventory,
//! and each endpoint's load, become a winner.
//!
//! A scorer is one implementation of the public [`Scorer`] trait. The rule
//! hands it a [`ScoreInput`] — the eligible endpoints ([`Candidate`]s) with
//! their cached prefix (engine-reported and predicted), their load and the
//! engine's own report — and it answers with a [`ScorePick`]: a winner or a
//! [`MissReason`] (then the rule's fallback selector decides). The built-in
//! scorers are [`CostScorer`] (the default), [`LongestPrefixScorer`],
//! [`OverlapCountScorer`] and [`LoadAwareScorer`]; [`ScorerKind`] names them
//! for configuration files.
//!
//! A host's own policy implements the trait and runs wherever a rule runs:
//! the facade's `KvRouter`, the gateway (registered by name) and the
//! simulator.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute_select::{MissReason, ScoreInput, ScorePick, Scorer};
//!
//! /// The endpoint holding the longest prefix, ties to the fewest requests.
//! #[derive(Debug)]
//! struct Greedy;
//!
//! impl Scorer for Greedy {
//!     fn name(&self) -> &str { "greedy" }
//!     fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
//!         let (best, figure) = match input.gate(|c| c.prefix()) {
//!             Ok(b) => b,
//!             Err(miss) => return ScorePick::Miss(miss),
//!         };
//!         let winner = input
//!             .candidates()
//!             .filter(|c| c.prefix() == figure)
//!             .min_by_key(|c| c.load.in_flight)
//!             .map_or(best, |c| c.index);
//!         ScorePick::Winner { index: winner, predicted_blocks: figure, diverted: false }
//!     }
//! }
//! let scorer: Arc<dyn Scorer> = Arc::new(Greedy);
//! assert_eq!(scorer.name(), "greedy");
//! # let _ = MissReason::ZeroOverlap;
//! ```

mod builtin;
mod cost;

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::BlockKey;
use kvroute_ingest::Overlap;

use crate::counters::MissReason;
use crate::endpoint::Endpoint;
use crate::explain::ScoreExplain;
use crate::load::{EndpointLoad, EngineReport};
use crate::pool::{LoadBound, Pool};

pub use builtin::{LoadAwareConfig, LoadAwareScorer, LongestPrefixScorer, OverlapCountScorer};
pub use cost::{CostConfig, CostScorer};

/// A KV-exact scoring policy: picks the endpoint a prompt goes to from each
/// eligible endpoint's cached prefix and load.
///
/// Decisions of one rule call [`Scorer::pick`] concurrently (`&self`); a
/// policy that keeps state (an approximate prefix tree, a random generator)
/// keeps it behind its own lock. `pick` is on every request's path: it should
/// not allocate once its buffers have grown.
pub trait Scorer: Any + Send + Sync + fmt::Debug {
    /// The name configuration files and metrics use (`cost`, ...).
    fn name(&self) -> &str;

    /// Picks the winner among [`ScoreInput::candidates`], or says why
    /// KV-exact does not decide this request (the rule's fallback selector
    /// then does). On a retry ([`ScoreInput::retry`]) the rule expects a
    /// winner whenever a candidate is left: the request stays in the tier.
    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick;

    /// Whether it reads [`Overlap::blocks`] (blocks found at any position of
    /// the prompt); otherwise the index computes only the cached prefix,
    /// which stops at the first missing block.
    fn reads_any_position(&self) -> bool {
        false
    }

    /// Whether [`EndpointLoad::queued_prefill_tokens`] should be the part
    /// still ahead of a new request: the rule then drains each endpoint's
    /// queue at its measured prefill rate (see [`CostConfig::drain_queue`]).
    fn drains_queue(&self) -> bool {
        false
    }

    /// Whether it reads [`ScoreInput::burst`], and the window within which
    /// the rule's decisions count as one burst (decisions of other deciders
    /// within it are not in the load view yet). `None` (the default): the
    /// rule keeps no burst statistics.
    fn burst_window(&self) -> Option<Duration> {
        None
    }

    /// Explains a pick: writes into `out` what [`Scorer::pick`] decided
    /// from the same `input` — its summary (the cap, the longest prefix the
    /// cap admitted, the cheapest and longest candidates, the verdict) and,
    /// when [`ScoreExplain::wants_terms`], each candidate's terms. The rule
    /// calls it after a pick when the host asked for the decision's
    /// explanation, and when the winner holds less than the best candidate
    /// (to split the tokens given up between the cap and the affinity
    /// slack). The default says nothing: the explanation then carries the
    /// candidates' generic fields only, and such a shortfall is counted as
    /// [`crate::LostCause::Scorer`].
    fn explain(&self, input: &ScoreInput<'_>, out: &mut ScoreExplain<'_>) {
        let _ = (input, out);
    }
}

/// A rule's own decisions seen as bursts ([`Scorer::burst_window`]): what a
/// scorer may expect each other decider to be placing at the same instant,
/// since a front end spreads one stream of requests over the deciders alike.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BurstStats {
    /// Mean decisions per burst (1 when they come one at a time; 0 until a
    /// burst has ended).
    pub decisions: f64,
    /// Mean predicted prefill tokens one decision charged.
    pub prefill_tokens: f64,
}

/// A shared scorer, as rules hold it.
pub type ScorerRef = Arc<dyn Scorer>;

/// What a scorer answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScorePick {
    /// Route to the candidate with this rule endpoint index.
    Winner {
        /// Rule endpoint index ([`Candidate::index`]).
        index: usize,
        /// The overlap figure credited to the winner (prefix blocks, or
        /// blocks found anywhere for a scorer that reads those): what the
        /// decision reports as predicted.
        predicted_blocks: u32,
        /// The winner is not the longest-prefix endpoint because of load
        /// (counted as a load diversion).
        diverted: bool,
    },
    /// KV-exact does not decide this request.
    Miss(MissReason),
}

/// One eligible endpoint as a scorer sees it.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    /// Its rule endpoint index (what [`ScorePick::Winner`] names).
    pub index: usize,
    /// Its configuration (weight, capacity, role).
    pub endpoint: &'a Endpoint,
    /// The prompt's overlap with its engine-reported inventory.
    pub overlap: Overlap,
    /// Prefix blocks credited by predicted entries (this rule's recent
    /// decisions whose engine events have not arrived yet); 0 when none.
    pub predicted_prefix: u32,
    /// Its load as the host sees it (in flight; queued prefill, drained
    /// when the scorer asks for it).
    pub load: EndpointLoad,
    /// The engine's own last report (running, waiting, KV usage, capacity),
    /// when the host polls it.
    pub report: Option<EngineReport>,
    /// Blocks its inventory holds in the engine's GPU cache, when the view
    /// counts them.
    pub gpu_blocks: Option<u64>,
}

impl Candidate<'_> {
    /// Free blocks in its GPU cache — the engine's reported capacity
    /// ([`EngineReport::kv_capacity_blocks`]) less the blocks its inventory
    /// holds — when both are known: new content beyond this evicts cached
    /// blocks.
    #[must_use]
    pub fn gpu_room(&self) -> Option<u64> {
        let capacity = self.report?.kv_capacity_blocks?;
        Some(capacity.saturating_sub(self.gpu_blocks?))
    }

    /// The cached prefix to credit: the engine-reported prefix or the
    /// predicted one, whichever is longer.
    #[must_use]
    pub fn prefix(&self) -> u32 {
        self.overlap.prefix.max(self.predicted_prefix)
    }

    /// Its capacity (relative weight of its resources, at least 1).
    #[must_use]
    pub fn capacity(&self) -> u32 {
        self.endpoint.capacity_or_one()
    }
}

/// Everything a scorer reads for one decision step. Borrowed from the
/// decision's buffers: building it allocates nothing.
#[derive(Clone, Copy)]
pub struct ScoreInput<'a> {
    pub(crate) pool: Pool<'a>,
    pub(crate) overlaps: &'a [Overlap],
    pub(crate) speculative: &'a [u32],
    pub(crate) reports: &'a [Option<EngineReport>],
    pub(crate) gpu_blocks: &'a [Option<u64>],
    pub(crate) keys: &'a [BlockKey],
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Fewest overlapping blocks that count as a hit (first pick only).
    pub min_blocks: u32,
    /// A retry inside the tier after a connect failure: rank every eligible
    /// endpoint, zero overlap included, and never leave the tier.
    pub retry: bool,
    /// The rule's turn counter: advances once per decision, so exact ties
    /// can take turns as under round robin instead of going to endpoint
    /// order. Deciders started together count their turns alike: the cost
    /// scorer parts them among the tied endpoints by their
    /// [`ScoreInput::deciders`] rank ([`crate::Deciders::rotate`] does it
    /// for a scorer of a host's own).
    pub turn: u64,
    /// Who routes over these endpoints ([`crate::Load::deciders`]).
    pub deciders: crate::Deciders,
    /// The rule's burst statistics when the scorer asks for them
    /// ([`Scorer::burst_window`]); zero otherwise.
    pub burst: BurstStats,
    /// The host's time.
    pub now: Duration,
}

impl fmt::Debug for ScoreInput<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScoreInput")
            .field("candidates", &self.candidates().count())
            .field("prompt_tokens", &self.prompt_tokens)
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

impl<'a> ScoreInput<'a> {
    /// The eligible endpoints, in endpoint order. On a large pool these are
    /// the endpoints a sampled decision scores ([`crate::Thresholds::sample_size`]:
    /// every endpoint the pool's common cached prefix does not dominate, and
    /// a random sample of the rest) unless the scorer reads blocks held
    /// anywhere ([`Scorer::reads_any_position`]).
    pub fn candidates(&self) -> impl Iterator<Item = Candidate<'a>> + '_ {
        self.pool
            .candidates()
            .map(|(i, e, l)| self.candidate_at(i, e, l))
    }

    fn candidate_at(
        &self,
        index: usize,
        endpoint: &'a Endpoint,
        load: EndpointLoad,
    ) -> Candidate<'a> {
        Candidate {
            index,
            endpoint,
            overlap: self.overlaps.get(index).copied().unwrap_or_default(),
            predicted_prefix: self.speculative.get(index).copied().unwrap_or(0),
            load,
            report: self.reports.get(index).copied().flatten(),
            gpu_blocks: self.gpu_blocks.get(index).copied().flatten(),
        }
    }

    /// The eligible endpoint with rule index `index`.
    #[must_use]
    pub fn candidate(&self, index: usize) -> Option<Candidate<'a>> {
        if !self.pool.eligible.get(index).copied().unwrap_or(false) {
            return None;
        }
        let e = self.pool.endpoints.get(index)?;
        Some(self.candidate_at(index, e, self.pool.load_of(index)))
    }

    /// The prompt's block keys (chained: each names its whole prefix).
    #[must_use]
    pub fn keys(&self) -> &'a [BlockKey] {
        self.keys
    }

    /// The rule's endpoint count (eligible or not).
    #[must_use]
    pub fn endpoint_count(&self) -> usize {
        self.pool.endpoints.len()
    }

    /// The bounded-load limit over the candidates with factor `c` (as CHWBL
    /// bounds load): an endpoint may take one more request while it stays
    /// within `⌈c · (Σ in-flight + 1) · capacity / Σ capacity⌉`.
    #[must_use]
    pub fn bound(&self, c: f64) -> LoadBound {
        self.pool.bound(c)
    }

    /// The common hit test: the candidate with the largest `figure` (the
    /// first on ties) and that figure — or, on a first pick, the miss when
    /// the best figure is zero ([`MissReason::ZeroOverlap`], or
    /// [`MissReason::AllCandidatesFiltered`] when only ineligible endpoints
    /// hold the prompt) or below [`ScoreInput::min_blocks`]
    /// ([`MissReason::BelowThreshold`]).
    ///
    /// # Errors
    /// The miss, as above; [`MissReason::AllCandidatesFiltered`] when there
    /// is no candidate.
    pub fn gate(&self, figure: impl Fn(&Candidate<'a>) -> u32) -> Result<(usize, u32), MissReason> {
        let mut best: Option<(usize, u32)> = None;
        for c in self.candidates() {
            let f = figure(&c);
            if best.is_none_or(|(_, bf)| f > bf) {
                best = Some((c.index, f));
            }
        }
        let Some((index, top)) = best else {
            return Err(MissReason::AllCandidatesFiltered);
        };
        if !self.retry {
            if top == 0 {
                let held_elsewhere = self
                    .pool
                    .endpoints
                    .iter()
                    .enumerate()
                    .any(|(i, e)| figure(&self.candidate_at(i, e, self.pool.load_of(i))) > 0);
                return Err(if held_elsewhere {
                    MissReason::AllCandidatesFiltered
                } else {
                    MissReason::ZeroOverlap
                });
            }
            if top < self.min_blocks {
                return Err(MissReason::BelowThreshold);
            }
        }
        Ok((index, top))
    }
}
