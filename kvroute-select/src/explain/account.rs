//! The cached-token account of one decision: of the prompt tokens some
//! eligible endpoint held (reachable), how many the request reused
//! (achieved) and where the rest went (lost, by [`LostCause`]).
//!
//! Every figure is in prompt tokens of whole credited blocks (at most the
//! prompt). A decision's steps each give up a part, so the parts add up:
//!
//! ```text
//! reachable  = best credited prefix among the first pick's candidates
//! failover   = reachable − best among the last pick's candidates
//! load_cap   = that best − the longest prefix the scorer's cap admitted
//! affinity_slack / scorer / below_threshold / pd_affinity
//!            = what the chosen step gave up below that
//! predicted  = the chosen endpoint's credited prefix
//! stale_inventory / contract_mismatch = predicted − delivered (receipt)
//! achieved   = delivered, up to predicted
//! reachable  = achieved + Σ lost            (once a receipt settled it)
//! ```

use crate::counters::MissReason;
use crate::decision::Source;

/// Why cached tokens a decision could have reused were not (the
/// `cause` label of `kvroute_lost_cached_tokens_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LostCause {
    /// The scorer's bounded-load cap refused every candidate holding more:
    /// the best credited prefix among the candidates less the longest one
    /// the cap admitted.
    LoadCap,
    /// The scorer took a candidate holding less than the longest one under
    /// its cap, because that one's predicted time to first token was beyond
    /// the affinity slack of the cheapest.
    AffinitySlack,
    /// A scorer that does not explain its pick took a candidate holding less
    /// than the best (e.g. `overlap_count`, `load_aware`).
    Scorer,
    /// The best credited prefix was shorter than the rule's
    /// `min_overlap_blocks`: the fallback chose.
    BelowThreshold,
    /// P/D session or prefix-trie affinity chose, before or instead of
    /// KV-exact.
    PdAffinity,
    /// Connect failures (or endpoints that became unavailable) before the
    /// last pick took out candidates holding more than what was left.
    Failover,
    /// The chosen endpoint was credited with cached tokens its receipt did
    /// not deliver: blocks evicted or events not yet applied, predicted
    /// entries the engine never confirmed.
    StaleInventory,
    /// As stale inventory, on an endpoint whose keys provably differ from
    /// the rule's: its inventory reports a contract mismatch, or its drift
    /// alarm is raised.
    ContractMismatch,
    /// The prompt was not tokenized because the host's tokenization
    /// capacity was used up, so nothing is known of its cache: counted at
    /// the receipt, as the engine's prompt tokens (whole blocks) it did not
    /// deliver from cache — an upper bound, also added to reachable.
    TokenizeOverload,
}

impl LostCause {
    /// Number of causes (size of per-cause arrays).
    pub const COUNT: usize = 9;

    /// Every cause, in [`LostCause::index`] order.
    pub const ALL: [LostCause; Self::COUNT] = [
        LostCause::LoadCap,
        LostCause::AffinitySlack,
        LostCause::Scorer,
        LostCause::BelowThreshold,
        LostCause::PdAffinity,
        LostCause::Failover,
        LostCause::StaleInventory,
        LostCause::ContractMismatch,
        LostCause::TokenizeOverload,
    ];

    /// Stable array index.
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The snake_case label of metrics and the admin API.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            LostCause::LoadCap => "load_cap",
            LostCause::AffinitySlack => "affinity_slack",
            LostCause::Scorer => "scorer",
            LostCause::BelowThreshold => "below_threshold",
            LostCause::PdAffinity => "pd_affinity",
            LostCause::Failover => "failover",
            LostCause::StaleInventory => "stale_inventory",
            LostCause::ContractMismatch => "contract_mismatch",
            LostCause::TokenizeOverload => "tokenize_overload",
        }
    }
}

/// One decision's cached-token account, in prompt tokens (see the module
/// text). Before a receipt settles it, `reachable = predicted + Σ lost`;
/// after, `reachable = achieved + Σ lost`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenAccount {
    /// The best credited prefix among the first pick's candidates.
    pub reachable: u64,
    /// The chosen endpoint's credited prefix, up to what was reachable.
    pub predicted: u64,
    /// Delivered (the receipt's cached tokens), up to `predicted`; 0 until
    /// settled.
    pub achieved: u64,
    /// Lost tokens by cause, indexed by [`LostCause::index`].
    pub lost: [u64; LostCause::COUNT],
    /// A receipt settled the prediction.
    pub settled: bool,
}

impl TokenAccount {
    /// Tokens lost to `cause`.
    #[must_use]
    pub fn lost_to(&self, cause: LostCause) -> u64 {
        self.lost.get(cause.index()).copied().unwrap_or(0)
    }

    /// Tokens lost to every cause.
    #[must_use]
    pub fn lost_total(&self) -> u64 {
        self.lost.iter().sum()
    }

    fn add(&mut self, cause: LostCause, tokens: u64) {
        if let Some(x) = self.lost.get_mut(cause.index()) {
            *x += tokens;
        }
    }
}

/// What a decision keeps for its account: tokens of credited prefixes at
/// its picks. Cheap enough to keep for every decision.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Reach {
    /// The best credited prefix among the first pick's candidates.
    pub(crate) first: u32,
    /// The best credited prefix among the last pick's candidates.
    pub(crate) last: u32,
    /// The longest credited prefix the scorer's cap admitted at the last
    /// KV-exact pick, when the scorer said.
    pub(crate) admitted: Option<u32>,
    /// The chosen endpoint's credited prefix.
    pub(crate) chosen: u32,
    /// The last KV-exact pick's winner is not the longest-prefix candidate
    /// because of load.
    pub(crate) diverted: bool,
}

impl Reach {
    /// The account as the last pick left it (nothing settled).
    pub(crate) fn selection(&self, source: Source, miss: Option<MissReason>) -> TokenAccount {
        let reachable = self.first;
        let last = self.last.min(reachable);
        let chosen = self.chosen.min(last);
        let mut a = TokenAccount {
            reachable: u64::from(reachable),
            predicted: u64::from(chosen),
            ..TokenAccount::default()
        };
        a.add(LostCause::Failover, u64::from(reachable - last));
        let gap = last - chosen;
        match source {
            Source::KvExact => match self.admitted {
                Some(admitted) => {
                    let admitted = admitted.clamp(chosen, last);
                    a.add(LostCause::LoadCap, u64::from(last - admitted));
                    a.add(LostCause::AffinitySlack, u64::from(admitted - chosen));
                }
                None => a.add(LostCause::Scorer, u64::from(gap)),
            },
            Source::SessionAffinity | Source::TrieAffinity => {
                a.add(LostCause::PdAffinity, u64::from(gap));
            }
            // Every candidate failed: what was left held nothing usable.
            Source::Exhausted => a.add(LostCause::Failover, u64::from(gap)),
            Source::Fallback(_) => {
                let cause = match miss {
                    Some(MissReason::BelowThreshold) => LostCause::BelowThreshold,
                    _ => LostCause::Scorer,
                };
                a.add(cause, u64::from(gap));
            }
        }
        a
    }
}

/// Settles `selection` with a receipt of `delivered` cached tokens; the
/// shortfall is a contract mismatch when `mismatch`, else stale inventory.
pub(crate) fn settle(mut selection: TokenAccount, delivered: u32, mismatch: bool) -> TokenAccount {
    let achieved = selection.predicted.min(u64::from(delivered));
    let short = selection.predicted - achieved;
    selection.achieved = achieved;
    selection.add(
        if mismatch {
            LostCause::ContractMismatch
        } else {
            LostCause::StaleInventory
        },
        short,
    );
    selection.settled = true;
    selection
}

/// The account of a request routed untokenized: reachable is bounded by
/// the engine's prompt length in whole blocks.
pub(crate) fn unexamined(bound: u32, delivered: u32) -> TokenAccount {
    let achieved = delivered.min(bound);
    let mut a = TokenAccount {
        reachable: u64::from(bound),
        predicted: 0,
        achieved: u64::from(achieved),
        settled: true,
        ..TokenAccount::default()
    };
    a.add(LostCause::TokenizeOverload, u64::from(bound - achieved));
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::SelectorKind;

    fn sums(a: &TokenAccount) {
        let kept = if a.settled { a.achieved } else { a.predicted };
        assert_eq!(a.reachable, kept + a.lost_total(), "{a:?}");
    }

    #[test]
    fn each_step_takes_its_part() {
        let r = Reach {
            first: 100,
            last: 80,
            admitted: Some(60),
            chosen: 40,
            diverted: true,
        };
        let a = r.selection(Source::KvExact, None);
        assert_eq!(a.lost_to(LostCause::Failover), 20);
        assert_eq!(a.lost_to(LostCause::LoadCap), 20);
        assert_eq!(a.lost_to(LostCause::AffinitySlack), 20);
        assert_eq!(a.predicted, 40);
        sums(&a);
        let s = settle(a, 30, false);
        assert_eq!((s.achieved, s.lost_to(LostCause::StaleInventory)), (30, 10));
        sums(&s);
        let m = settle(a, 50, true);
        assert_eq!(
            (m.achieved, m.lost_to(LostCause::ContractMismatch)),
            (40, 0)
        );
        sums(&m);
        let t = r.selection(
            Source::Fallback(SelectorKind::RoundRobin),
            Some(MissReason::BelowThreshold),
        );
        assert_eq!(t.lost_to(LostCause::BelowThreshold), 40);
        let p = r.selection(Source::SessionAffinity, None);
        assert_eq!(p.lost_to(LostCause::PdAffinity), 40);
        let u = unexamined(64, 16);
        assert_eq!(
            (
                u.reachable,
                u.achieved,
                u.lost_to(LostCause::TokenizeOverload)
            ),
            (64, 16, 48)
        );
        sums(&u);
    }

    #[test]
    fn out_of_order_figures_are_clamped() {
        // A pick may see more than the first did (an endpoint came back).
        let r = Reach {
            first: 10,
            last: 30,
            admitted: Some(5),
            chosen: 30,
            diverted: false,
        };
        let a = r.selection(Source::KvExact, None);
        assert_eq!((a.reachable, a.predicted, a.lost_total()), (10, 10, 0));
        sums(&a);
    }

    #[test]
    fn labels_are_distinct() {
        for (i, c) in LostCause::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert_eq!(
                LostCause::ALL
                    .iter()
                    .filter(|d| d.as_str() == c.as_str())
                    .count(),
                1
            );
        }
    }
}
