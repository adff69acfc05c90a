//! How long an engine takes: prefill ∝ uncached prompt tokens (in batched steps),
//! decode ∝ output tokens.

/// Timing parameters of one worker, in microseconds.
///
/// Prefill runs through a single per-worker pipeline (the engine's batch): a
/// request's uncached tokens are processed in steps of at most
/// `max_batched_tokens`, each step costing `prefill_step_us` plus
/// `prefill_us_per_token` per token. Decode produces one token every
/// `decode_us_per_token` per running request, independently of the others up to
/// the worker's concurrency limit.
///
/// ```
/// # use kvroute_engine_model::CostModel;
/// let cost = CostModel { prefill_step_us: 1000.0, prefill_us_per_token: 10.0,
///                        max_batched_tokens: 100, decode_us_per_token: 5000.0 };
/// assert_eq!(cost.prefill_us(250), 3 * 1000 + 2500); // 3 steps
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one prefill step.
    pub prefill_step_us: f64,
    /// Cost per uncached prompt token.
    pub prefill_us_per_token: f64,
    /// Batching budget: prompt tokens one step can take (≥ 1).
    pub max_batched_tokens: u32,
    /// Time per generated token.
    pub decode_us_per_token: f64,
}

impl Default for CostModel {
    /// Loosely a mid-size model on one GPU: ~20k prefill tokens/s, 50 tokens/s decode.
    fn default() -> Self {
        Self {
            prefill_step_us: 2_000.0,
            prefill_us_per_token: 50.0,
            max_batched_tokens: 8192,
            decode_us_per_token: 20_000.0,
        }
    }
}

impl CostModel {
    /// Prefill time for `uncached` tokens. At least one step: a full hit still
    /// recomputes the last prompt token.
    #[must_use]
    pub fn prefill_us(&self, uncached: u32) -> u64 {
        let budget = self.max_batched_tokens.max(1);
        let steps = uncached.div_ceil(budget).max(1);
        to_us(
            f64::from(steps) * self.prefill_step_us
                + f64::from(uncached) * self.prefill_us_per_token,
        )
    }

    /// Time for `tokens` decode steps.
    #[must_use]
    pub fn decode_us(&self, tokens: u32) -> u64 {
        to_us(f64::from(tokens) * self.decode_us_per_token)
    }
}

fn to_us(v: f64) -> u64 {
    if v.is_finite() && v > 0.0 {
        // Saturating float → int cast is what we want for absurd configurations.
        v.round() as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_counts_steps_and_tokens() {
        let c = CostModel {
            prefill_step_us: 1000.0,
            prefill_us_per_token: 10.0,
            max_batched_tokens: 100,
            decode_us_per_token: 5000.0,
        };
        assert_eq!(c.prefill_us(0), 1000);
        assert_eq!(c.prefill_us(100), 2000);
        assert_eq!(c.prefill_us(101), 2000 + 1010);
        assert_eq!(c.decode_us(3), 15_000);
    }
}
