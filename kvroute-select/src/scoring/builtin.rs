//! The simpler built-in scorers: longest prefix, overlap count and the
//! load-aware scorer.

use super::{Candidate, ScoreInput, ScorePick, Scorer};
use crate::counters::MissReason;

/// The longest run of cached blocks from block 0 — what the engine's prefix
/// cache can reuse; ties go to the first endpoint (`longest_prefix`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongestPrefixScorer;

impl Scorer for LongestPrefixScorer {
    fn name(&self) -> &str {
        "longest_prefix"
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        winner(input.gate(Candidate::prefix))
    }
}

/// Reference behaviour: the most prompt blocks found anywhere in the
/// inventory; ties go to the first endpoint (`overlap_count`). Predicted
/// entries, which only extend prefixes, are not read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlapCountScorer;

impl Scorer for OverlapCountScorer {
    fn name(&self) -> &str {
        "overlap_count"
    }

    fn reads_any_position(&self) -> bool {
        true
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        winner(input.gate(|c| c.overlap.blocks))
    }
}

fn winner(gate: Result<(usize, u32), MissReason>) -> ScorePick {
    match gate {
        Ok((index, predicted_blocks)) => ScorePick::Winner {
            index,
            predicted_blocks,
            diverted: false,
        },
        Err(miss) => ScorePick::Miss(miss),
    }
}

/// Load-aware scoring parameters ([`LoadAwareScorer`]).
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

/// Least predicted work: uncached prefill tokens (tier-weighted) plus queued
/// work, among endpoints under the bounded-load cap (`load_aware`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadAwareScorer(pub LoadAwareConfig);

impl Scorer for LoadAwareScorer {
    fn name(&self) -> &str {
        "load_aware"
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        let cfg = &self.0;
        let best_figure = match input.gate(Candidate::prefix) {
            Ok((_, f)) => f,
            Err(miss) => return ScorePick::Miss(miss),
        };
        let bound = input.bound(1.0 + cfg.epsilon.max(0.0));
        let mut pick: Option<(usize, f64, bool, u32)> = None;
        for c in input.candidates() {
            let admitted = bound.admits(c.load.in_flight, c.capacity());
            let cost = work(cfg, input, &c);
            let better = match pick {
                None => true,
                // An admitted endpoint always beats one over the cap.
                Some((_, bc, badm, _)) => (admitted && !badm) || (admitted == badm && cost < bc),
            };
            if better {
                pick = Some((c.index, cost, admitted, c.prefix()));
            }
        }
        match pick {
            Some((index, _, _, figure)) => ScorePick::Winner {
                index,
                predicted_blocks: figure,
                diverted: figure < best_figure,
            },
            None => ScorePick::Miss(MissReason::AllCandidatesFiltered),
        }
    }
}

/// Predicted work if candidate `c` takes the request, in prefill tokens.
fn work(cfg: &LoadAwareConfig, input: &ScoreInput<'_>, c: &Candidate<'_>) -> f64 {
    let o = c.overlap;
    let bs = f64::from(input.block_size);
    let by_medium: u32 = o.prefix_by_medium.iter().sum();
    // Views that do not split by tier report everything as device-resident.
    let untiered = o.prefix.saturating_sub(by_medium);
    let mut cached = f64::from(untiered) * bs * cfg.tier_weights[0];
    for (n, w) in o.prefix_by_medium.iter().zip(cfg.tier_weights) {
        cached += f64::from(*n) * bs * w;
    }
    let uncached = (f64::from(input.prompt_tokens) - cached).max(0.0);
    #[allow(clippy::cast_precision_loss)]
    let queued = cfg.queued_weight * c.load.queued_prefill_tokens as f64
        + cfg.tokens_per_in_flight * f64::from(c.load.in_flight);
    uncached + queued / f64::from(c.capacity().max(1))
}
