//! Decision and delivery evidence, as atomics the host reads (the gateway
//! exports them as Prometheus metrics).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvroute_core::EndpointId;
pub use kvroute_core::MissReason;

use crate::explain::{LostCause, TokenAccount};

/// Delivery evidence of one endpoint.
#[derive(Debug, Default)]
pub(crate) struct ReceiptCounters {
    receipts: AtomicU64,
    predicted_tokens: AtomicU64,
    delivered_tokens: AtomicU64,
    zero_delivery_streak: AtomicU64,
    drift_alarm: AtomicBool,
    reachable_tokens: AtomicU64,
    achieved_tokens: AtomicU64,
    lost_tokens: [AtomicU64; LostCause::COUNT],
}

/// Per-rule counters. All updates are relaxed atomics: they are evidence, not
/// synchronisation.
#[derive(Debug)]
pub struct RuleCounters {
    decisions: AtomicU64,
    hits: Vec<AtomicU64>,
    misses: [AtomicU64; MissReason::COUNT],
    session_affinity: AtomicU64,
    trie_affinity: AtomicU64,
    fallbacks: AtomicU64,
    retries: AtomicU64,
    exhausted: AtomicU64,
    implausible_receipts: AtomicU64,
    load_diversions: AtomicU64,
    predicted_blocks: AtomicU64,
    held: AtomicU64,
    held_us: AtomicU64,
    receipts: Vec<ReceiptCounters>,
    drift_alarms_raised: AtomicU64,
}

/// A plain copy of one endpoint's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointEvidence {
    /// KV-exact decisions for this endpoint with a non-zero predicted overlap.
    pub hits: u64,
    /// Completion receipts reported for this endpoint.
    pub receipts: u64,
    /// Σ predicted cached tokens over those receipts.
    pub predicted_tokens: u64,
    /// Σ cached tokens the backend reported over those receipts.
    pub delivered_tokens: u64,
    /// Consecutive receipts that predicted a hit and delivered zero cached tokens.
    pub zero_delivery_streak: u64,
    /// The streak reached the rule's drift threshold: keys probably no longer
    /// match the engine's (contract drift).
    pub drift_alarm: bool,
    /// Σ cached tokens reachable over the decisions these receipts settled
    /// ([`TokenAccount::reachable`]; attributed to the endpoint the request
    /// went to).
    pub reachable_tokens: u64,
    /// Σ of them the engine delivered ([`TokenAccount::achieved`]).
    pub achieved_tokens: u64,
    /// Σ of them lost, by cause ([`LostCause::index`]):
    /// `reachable_tokens = achieved_tokens + Σ lost_tokens`.
    pub lost_tokens: [u64; LostCause::COUNT],
}

impl EndpointEvidence {
    /// Tokens lost to `cause`.
    #[must_use]
    pub fn lost_to(&self, cause: LostCause) -> u64 {
        self.lost_tokens.get(cause.index()).copied().unwrap_or(0)
    }

    /// Delivered / predicted cached tokens, `None` before any prediction.
    #[must_use]
    pub fn accuracy(&self) -> Option<f64> {
        #[allow(clippy::cast_precision_loss)]
        (self.predicted_tokens > 0)
            .then(|| self.delivered_tokens as f64 / self.predicted_tokens as f64)
    }
}

/// A plain copy of a rule's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CountersSnapshot {
    /// Decisions started.
    pub decisions: u64,
    /// Misses by reason, indexed by [`MissReason::index`].
    pub misses: [u64; MissReason::COUNT],
    /// Decisions made by P/D session affinity.
    pub session_affinity: u64,
    /// Decisions made by the P/D prefix trie.
    pub trie_affinity: u64,
    /// Decisions made by the fallback (selector or P/D minimum load).
    pub fallbacks: u64,
    /// Retries after a connect failure.
    pub retries: u64,
    /// Decisions or retries that found no eligible endpoint.
    pub exhausted: u64,
    /// Receipts refused because they claimed more cached tokens than the
    /// prompt has (a broken or hostile upstream); see
    /// [`crate::Rule::record_usage`].
    pub implausible_receipts: u64,
    /// Load-aware picks that passed over a better-overlap endpoint.
    pub load_diversions: u64,
    /// Σ predicted overlap blocks over KV-exact picks.
    pub predicted_blocks: u64,
    /// Requests the host held for their turn in a burst
    /// ([`crate::burst_turn`], recorded by [`RuleCounters::held`]).
    pub held: u64,
    /// Those holds summed, microseconds.
    pub held_us: u64,
    /// Drift alarms raised so far.
    pub drift_alarms_raised: u64,
    /// Per endpoint, in rule order.
    pub endpoints: Vec<EndpointEvidence>,
}

impl CountersSnapshot {
    /// Misses for one reason.
    #[must_use]
    pub fn misses_for(&self, reason: MissReason) -> u64 {
        self.misses.get(reason.index()).copied().unwrap_or(0)
    }

    /// Hits for one endpoint.
    #[must_use]
    pub fn hits_for(&self, endpoint: EndpointId) -> u64 {
        self.endpoints.get(endpoint.index()).map_or(0, |e| e.hits)
    }

    /// Σ reachable cached tokens over every endpoint's settled decisions.
    #[must_use]
    pub fn reachable_tokens(&self) -> u64 {
        self.endpoints.iter().map(|e| e.reachable_tokens).sum()
    }

    /// Σ achieved cached tokens over every endpoint's settled decisions.
    #[must_use]
    pub fn achieved_tokens(&self) -> u64 {
        self.endpoints.iter().map(|e| e.achieved_tokens).sum()
    }

    /// Σ cached tokens lost to `cause` over every endpoint.
    #[must_use]
    pub fn lost_tokens(&self, cause: LostCause) -> u64 {
        self.endpoints.iter().map(|e| e.lost_to(cause)).sum()
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl RuleCounters {
    pub(crate) fn new(endpoints: usize) -> Self {
        Self {
            decisions: AtomicU64::new(0),
            hits: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            misses: std::array::from_fn(|_| AtomicU64::new(0)),
            session_affinity: AtomicU64::new(0),
            trie_affinity: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            exhausted: AtomicU64::new(0),
            implausible_receipts: AtomicU64::new(0),
            load_diversions: AtomicU64::new(0),
            predicted_blocks: AtomicU64::new(0),
            held: AtomicU64::new(0),
            held_us: AtomicU64::new(0),
            receipts: (0..endpoints).map(|_| ReceiptCounters::default()).collect(),
            drift_alarms_raised: AtomicU64::new(0),
        }
    }

    pub(crate) fn decision(&self) {
        bump(&self.decisions);
    }

    pub(crate) fn miss(&self, reason: MissReason) {
        if let Some(c) = self.misses.get(reason.index()) {
            bump(c);
        }
    }

    pub(crate) fn hit(&self, endpoint: usize, predicted_blocks: u32, diverted: bool) {
        self.predicted_blocks
            .fetch_add(u64::from(predicted_blocks), Ordering::Relaxed);
        if predicted_blocks > 0 {
            if let Some(c) = self.hits.get(endpoint) {
                bump(c);
            }
        }
        if diverted {
            bump(&self.load_diversions);
        }
    }

    pub(crate) fn session_affinity(&self) {
        bump(&self.session_affinity);
    }

    pub(crate) fn trie_affinity(&self) {
        bump(&self.trie_affinity);
    }

    pub(crate) fn fallback(&self) {
        bump(&self.fallbacks);
    }

    pub(crate) fn retry(&self) {
        bump(&self.retries);
    }

    pub(crate) fn implausible_receipt(&self) {
        bump(&self.implausible_receipts);
    }

    pub(crate) fn exhausted(&self) {
        bump(&self.exhausted);
    }

    /// The host held a request `hold` for its turn in a burst
    /// ([`crate::burst_turn`]) before deciding it.
    pub fn held(&self, hold: std::time::Duration) {
        bump(&self.held);
        let us = u64::try_from(hold.as_micros()).unwrap_or(u64::MAX);
        self.held_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The endpoint left its slot: its hits and delivery evidence start
    /// over for the slot's next endpoint.
    pub(crate) fn forget_endpoint(&self, endpoint: usize) {
        if let Some(h) = self.hits.get(endpoint) {
            h.store(0, Ordering::Relaxed);
        }
        let Some(r) = self.receipts.get(endpoint) else {
            return;
        };
        for c in [
            &r.receipts,
            &r.predicted_tokens,
            &r.delivered_tokens,
            &r.zero_delivery_streak,
            &r.reachable_tokens,
            &r.achieved_tokens,
        ]
        .into_iter()
        .chain(&r.lost_tokens)
        {
            c.store(0, Ordering::Relaxed);
        }
        r.drift_alarm.store(false, Ordering::Relaxed);
    }

    /// Records a backend receipt; returns whether this receipt raised the alarm.
    pub(crate) fn receipt(
        &self,
        endpoint: usize,
        predicted_tokens: u64,
        delivered_tokens: u64,
        drift_after: u64,
    ) -> bool {
        let Some(r) = self.receipts.get(endpoint) else {
            return false;
        };
        bump(&r.receipts);
        r.predicted_tokens
            .fetch_add(predicted_tokens, Ordering::Relaxed);
        r.delivered_tokens
            .fetch_add(delivered_tokens, Ordering::Relaxed);
        if delivered_tokens > 0 {
            r.zero_delivery_streak.store(0, Ordering::Relaxed);
            r.drift_alarm.store(false, Ordering::Relaxed);
            return false;
        }
        if predicted_tokens == 0 {
            return false;
        }
        let streak = r.zero_delivery_streak.fetch_add(1, Ordering::Relaxed) + 1;
        if streak >= drift_after.max(1) && !r.drift_alarm.swap(true, Ordering::Relaxed) {
            bump(&self.drift_alarms_raised);
            return true;
        }
        false
    }

    /// Counts a settled decision's cached-token account against `endpoint`.
    pub(crate) fn account(&self, endpoint: usize, a: &TokenAccount) {
        let Some(r) = self.receipts.get(endpoint) else {
            return;
        };
        r.reachable_tokens.fetch_add(a.reachable, Ordering::Relaxed);
        r.achieved_tokens.fetch_add(a.achieved, Ordering::Relaxed);
        for (c, n) in r.lost_tokens.iter().zip(a.lost) {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// Whether endpoint `endpoint`'s drift alarm is raised.
    #[must_use]
    pub fn drift_alarm(&self, endpoint: EndpointId) -> bool {
        self.receipts
            .get(endpoint.index())
            .is_some_and(|r| r.drift_alarm.load(Ordering::Relaxed))
    }

    /// Copies every counter.
    #[must_use]
    pub fn snapshot(&self) -> CountersSnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersSnapshot {
            decisions: load(&self.decisions),
            misses: std::array::from_fn(|i| self.misses.get(i).map_or(0, load)),
            session_affinity: load(&self.session_affinity),
            trie_affinity: load(&self.trie_affinity),
            fallbacks: load(&self.fallbacks),
            retries: load(&self.retries),
            exhausted: load(&self.exhausted),
            implausible_receipts: load(&self.implausible_receipts),
            load_diversions: load(&self.load_diversions),
            predicted_blocks: load(&self.predicted_blocks),
            held: load(&self.held),
            held_us: load(&self.held_us),
            drift_alarms_raised: load(&self.drift_alarms_raised),
            endpoints: self
                .hits
                .iter()
                .zip(&self.receipts)
                .map(|(h, r)| EndpointEvidence {
                    hits: load(h),
                    receipts: load(&r.receipts),
                    predicted_tokens: load(&r.predicted_tokens),
                    delivered_tokens: load(&r.delivered_tokens),
                    zero_delivery_streak: load(&r.zero_delivery_streak),
                    drift_alarm: r.drift_alarm.load(Ordering::Relaxed),
                    reachable_tokens: load(&r.reachable_tokens),
                    achieved_tokens: load(&r.achieved_tokens),
                    lost_tokens: std::array::from_fn(|i| r.lost_tokens.get(i).map_or(0, load)),
                })
                .collect(),
        }
    }
}
