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

/// How KV-exact ranks endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Scorer {
    /// Reference behaviour: the most prompt blocks found anywhere in the
    /// inventory; ties go to the first endpoint.
    #[default]
    OverlapCount,
    /// The longest run of found blocks from block 0 — what the engine's prefix
    /// cache can reuse; ties go to the first endpoint.
    LongestPrefix,
    /// Least predicted work: uncached prefill tokens (tier-weighted) plus queued
    /// work, among endpoints under the bounded-load cap.
    LoadAware(LoadAwareConfig),
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
}

impl Scorer {
    fn overlap_figure(&self, o: &Overlap) -> u32 {
        match self {
            Scorer::OverlapCount => o.blocks,
            Scorer::LongestPrefix | Scorer::LoadAware(_) => o.prefix,
        }
    }

    pub(crate) fn pick(&self, pool: &Pool<'_>, s: &KvScoring<'_>) -> KvPick {
        let figure = |i: usize| s.overlaps.get(i).map_or(0, |o| self.overlap_figure(o));
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
                let held_elsewhere = s.overlaps.iter().any(|o| self.overlap_figure(o) > 0);
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
