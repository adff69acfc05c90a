//! Why a decision went where it did: the [`Explanation`] a [`crate::Decision`]
//! records when its host asks ([`crate::Decision::set_explain`]), and the
//! cached-token account ([`TokenAccount`], [`LostCause`]) every decision
//! keeps.
//!
//! An explanation lists every rule endpoint as the last pick saw it (its
//! cached prefix, confirmed and predicted, its load, the engine's report,
//! why it was not a candidate), every pick (the first and each retry: the
//! ladder step that chose, the miss, the endpoint that failed), and what the
//! scorer says of its pick through [`crate::Scorer::explain`] (the cost
//! scorer: its terms per candidate, the bounded-load cap, the cheapest and
//! the longest-prefix candidate, the affinity bound). A decision that was
//! not asked records none of it and allocates nothing for it.
//!
//! ```
//! use std::time::Duration;
//! use kvroute_core::BlockKey;
//! use kvroute_select::*;
//! let c = ContractId::new("example/bs4");
//! let eps = vec![Endpoint::new("a:1", Role::Both).with_inventory_slot(0),
//!                Endpoint::new("b:1", Role::Both).with_inventory_slot(1)];
//! let rule = Rule::new(RuleConfig::kv_exact("r", Topology::Converged, eps, 4, c.clone()), None).unwrap();
//! let mut inv = KeySetInventory::new(2);
//! inv.store(1, [BlockKey(7), BlockKey(8)]);
//! let keys = [BlockKey(7), BlockKey(8)];
//! let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: 8 });
//! let mut d = Decision::new();
//! d.set_explain(true);
//! rule.decide_into(&mut d, &req, &inv, &LoadTable::new(2), &AlwaysAvailable, Duration::ZERO);
//! let x = d.explanation().unwrap();
//! assert_eq!(x.picks[0].tier, Source::KvExact);
//! assert_eq!(x.endpoints[1].confirmed_prefix_blocks, 2);
//! let terms = x.endpoints[1].terms.unwrap(); // the cost scorer's
//! assert_eq!((terms.cached_tokens, terms.prefill_tokens), (8.0, 0.0));
//! assert_eq!(x.account.reachable, 8);
//! ```

mod account;

use kvroute_core::EndpointId;

use crate::counters::MissReason;
use crate::decision::{Leg, Source};
use crate::endpoint::Role;
use crate::health::Availability;
use crate::load::EngineReport;
use crate::pool::LoadBound;

pub(crate) use account::{settle, unexamined, Reach};
pub use account::{LostCause, TokenAccount};

/// One decision explained: what every endpoint looked like, each pick, and
/// what the scorer said. Filled by [`crate::Rule::decide_into`] and
/// [`crate::Rule::retry`] for a decision with
/// [`crate::Decision::set_explain`]; its buffers are reused across
/// decisions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Explanation {
    /// Prompt length in tokens (0 when unknown).
    pub prompt_tokens: u32,
    /// Tokens per block of the rule.
    pub block_size: u32,
    /// The prompt's block keys.
    pub keys: u32,
    /// Why no keys were computed, when none were (the prompt was not
    /// tokenized, not JSON, ...).
    pub key_miss: Option<MissReason>,
    /// Every rule endpoint, in rule order, as the last pick saw it.
    pub endpoints: Vec<EndpointExplain>,
    /// The first pick and every retry, in order.
    pub picks: Vec<PickStep>,
    /// What the scorer said of the last KV-exact pick (`None`: no KV-exact
    /// pick, or a scorer that does not explain).
    pub scorer: Option<ScoreSummary>,
    /// The decision's cached-token account as of its last pick.
    pub account: TokenAccount,
}

impl Explanation {
    /// Clears every field, keeping the buffers.
    pub(crate) fn reset(&mut self, n: usize) {
        self.prompt_tokens = 0;
        self.block_size = 0;
        self.keys = 0;
        self.key_miss = None;
        self.endpoints.clear();
        self.endpoints.resize(n, EndpointExplain::default());
        for (i, e) in self.endpoints.iter_mut().enumerate() {
            e.endpoint = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
        }
        self.picks.clear();
        self.scorer = None;
        self.account = TokenAccount::default();
    }

    /// The pick that produced the current target (the last one).
    #[must_use]
    pub fn last_pick(&self) -> Option<&PickStep> {
        self.picks.last()
    }

    /// Heap bytes the explanation holds (its buffers' capacity): what a host
    /// keeping explanations counts against its memory bound.
    #[must_use]
    pub fn heap_bytes(&self) -> usize {
        self.endpoints.capacity() * std::mem::size_of::<EndpointExplain>()
            + self.picks.capacity() * std::mem::size_of::<PickStep>()
    }
}

/// One endpoint as a pick saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointExplain {
    /// Its rule endpoint id.
    pub endpoint: EndpointId,
    /// Its role.
    pub role: Role,
    /// Its capacity (at least 1).
    pub capacity: u32,
    /// Why it was not a candidate of the last pick; `None`: it was one.
    pub ineligible: Option<Ineligible>,
    /// Prompt blocks from block 0 its engine reported holding.
    pub confirmed_prefix_blocks: u32,
    /// Prompt blocks found anywhere in its inventory (read by scorers that
    /// count blocks at any position; else equal to the prefix).
    pub confirmed_blocks: u32,
    /// Prefix blocks credited by predicted entries (this rule's recent
    /// decisions whose engine events have not arrived yet).
    pub predicted_prefix_blocks: u32,
    /// Its inventory reports a mismatched hash contract.
    pub contract_mismatch: bool,
    /// Requests in flight as the load view saw them.
    pub in_flight: u32,
    /// Queued prefill tokens as the scorer read them (drained at the
    /// measured prefill rate when the scorer asks for that).
    pub queued_prefill_tokens: u64,
    /// The engine's own last load report, when the host polls it.
    pub reported: Option<EngineReport>,
    /// The scorer's terms for it (`None`: not a candidate, no KV-exact pick,
    /// or a scorer that does not explain).
    pub terms: Option<ScoreTerms>,
}

impl EndpointExplain {
    /// The credited prefix: confirmed or predicted, whichever is longer.
    #[must_use]
    pub fn prefix_blocks(&self) -> u32 {
        self.confirmed_prefix_blocks
            .max(self.predicted_prefix_blocks)
    }
}

/// Why an endpoint was not a candidate of a pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ineligible {
    /// A connect attempt of this request failed on it.
    ConnectFailed,
    /// A P/D rule's decode-only endpoint (never the prefill leg).
    DecodeOnly,
    /// Not available: administratively down, behind an open breaker, or
    /// ejected by outlier detection.
    Unavailable(Availability),
    /// Left out of a sampled decision on a large pool: it holds no more of
    /// the prompt than most of the pool, and the random sample of such
    /// endpoints did not draw it ([`crate::Thresholds::sample_size`]).
    NotSampled,
}

impl Ineligible {
    /// The snake_case word the admin API shows.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Ineligible::ConnectFailed => "connect_failed",
            Ineligible::DecodeOnly => "decode_only",
            Ineligible::Unavailable(Availability::AdminDown) => "admin_down",
            Ineligible::Unavailable(Availability::BreakerOpen) => "breaker_open",
            Ineligible::Unavailable(Availability::Ejected) => "ejected",
            Ineligible::Unavailable(Availability::Available) => "unavailable",
            Ineligible::NotSampled => "not_sampled",
        }
    }
}

/// One pick of a decision: the first one, or a retry after a connect
/// failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PickStep {
    /// The ladder step that chose ([`Source::Exhausted`]: none was left).
    pub tier: Source,
    /// Why KV-exact did not decide, when it was tried and missed.
    pub miss: Option<MissReason>,
    /// The endpoint chosen (the prefill endpoint in P/D).
    pub endpoint: Option<EndpointId>,
    /// The P/D decode endpoint chosen.
    pub decode: Option<EndpointId>,
    /// For a retry: the endpoint whose connect failed, and which leg.
    pub failed: Option<(EndpointId, Leg)>,
    /// The scorer's overlap figure for the chosen endpoint (0 outside
    /// KV-exact).
    pub predicted_blocks: u32,
    /// The scorer's winner is not the longest-prefix candidate because of
    /// load.
    pub diverted: bool,
}

/// The cost terms a scorer computed for one candidate
/// ([`crate::CostConfig`]'s formula), in prefill-token equivalents.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoreTerms {
    /// Prompt tokens credited as cached (tier-weighted, at most the prompt).
    pub cached_tokens: f64,
    /// This request's own prefill there: `prefill_weight · (prompt − cached)`.
    pub prefill_tokens: f64,
    /// Queued prefill tokens ahead of it, the other deciders' expected
    /// placements included.
    pub queued_tokens: f64,
    /// Of `queued_tokens`, what the other deciders are expected to be
    /// placing at this instant.
    pub unseen_tokens: f64,
    /// Where this decider puts the endpoint's zone in its order of zones to
    /// spill a burst into (with other deciders; 0 in its own zone). Ranks
    /// candidates only: not part of `ttft`.
    pub spill_tokens: f64,
    /// Cached tokens this placement would evict (weighted by
    /// `eviction_weight`) while another candidate has room for the request;
    /// 0 when no candidate has. Part of `cost` and of the affinity test,
    /// not of `ttft`.
    pub evict_tokens: f64,
    /// The in-flight term: `decode_tokens_per_request · in_flight`.
    pub in_flight_tokens: f64,
    /// Predicted time to first token: `(queued + prefill) / capacity`.
    pub ttft: f64,
    /// What ranks candidates: `(queued + prefill + in_flight + spill +
    /// evict) / capacity`.
    pub cost: f64,
    /// The bounded-load cap admitted it (or no cap applied).
    pub under_cap: bool,
}

/// A scorer's bounded-load cap at one pick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CapSummary {
    /// The bound over the candidates.
    pub bound: LoadBound,
    /// Requests an endpoint may hold above the bound.
    pub headroom: u32,
    /// Some candidate was under the cap, so the cap applied (when none is,
    /// every candidate competes).
    pub applied: bool,
    /// Candidates the cap refused.
    pub refused: u32,
}

/// How the cost scorer chose its winner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The cheapest candidate also holds the longest prefix under the cap.
    Cheapest,
    /// The longest-prefix candidate won although another was cheaper: its
    /// predicted time to first token was within the affinity slack.
    AffinityKept,
    /// The cheapest candidate won over the longest-prefix one, whose
    /// predicted time to first token was beyond the affinity slack.
    Diverted,
}

impl Verdict {
    /// The snake_case word the admin API shows.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Cheapest => "cheapest",
            Verdict::AffinityKept => "affinity_kept",
            Verdict::Diverted => "diverted",
        }
    }
}

/// What a scorer says of one pick ([`crate::Scorer::explain`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoreSummary {
    /// The bounded-load cap, if the scorer applies one.
    pub cap: Option<CapSummary>,
    /// The longest credited prefix (blocks) among the candidates its cap
    /// admitted: the most the scorer could have chosen. The rest of a
    /// shorter pick is counted as lost to the cap; what the scorer gave up
    /// below it, to affinity slack.
    pub admitted_prefix_blocks: Option<u32>,
    /// The cheapest candidate (rule endpoint index).
    pub cheapest: Option<usize>,
    /// The longest-prefix candidate under the cap.
    pub longest: Option<usize>,
    /// The predicted time to first token the longest-prefix candidate had
    /// to stay within to be kept: `(1 + affinity_slack) · ttft_cheapest +
    /// affinity_tokens`.
    pub affinity_bound: Option<f64>,
    /// How the winner was chosen.
    pub verdict: Option<Verdict>,
}

/// Where [`crate::Scorer::explain`] writes: the pick's summary and, when the
/// host asked for the whole explanation, each candidate's terms.
#[derive(Debug)]
pub struct ScoreExplain<'a> {
    pub(crate) summary: ScoreSummary,
    pub(crate) rows: Option<&'a mut [EndpointExplain]>,
}

impl<'a> ScoreExplain<'a> {
    /// A sink for the summary only (what the decision's account needs).
    #[must_use]
    pub fn summary_only() -> Self {
        Self {
            summary: ScoreSummary::default(),
            rows: None,
        }
    }

    /// A sink that also takes each candidate's terms into `rows` (indexed
    /// by rule endpoint).
    #[must_use]
    pub fn with_rows(rows: &'a mut [EndpointExplain]) -> Self {
        Self {
            summary: ScoreSummary::default(),
            rows: Some(rows),
        }
    }

    /// Whether the host asked for per-candidate terms (a scorer may skip
    /// computing them otherwise).
    #[must_use]
    pub fn wants_terms(&self) -> bool {
        self.rows.is_some()
    }

    /// Records candidate `index`'s terms (ignored when terms were not asked
    /// for or `index` is out of range).
    pub fn set_terms(&mut self, index: usize, terms: ScoreTerms) {
        if let Some(r) = self.rows.as_deref_mut().and_then(|r| r.get_mut(index)) {
            r.terms = Some(terms);
        }
    }

    /// The summary to fill.
    pub fn summary_mut(&mut self) -> &mut ScoreSummary {
        &mut self.summary
    }

    /// The summary as filled so far.
    #[must_use]
    pub fn summary(&self) -> &ScoreSummary {
        &self.summary
    }
}
