//! A rule's own decisions seen as bursts: how many it makes per instant and
//! how much prefill each charges, for a scorer that reads
//! [`crate::ScoreInput::burst`].

use std::time::Duration;

use crate::scoring::BurstStats;

/// Weight of the newest sample in the running means once warm (1/32: about
/// the last 32 bursts or decisions count).
const WEIGHT: f64 = 1.0 / 32.0;

/// Decisions of one rule grouped into bursts: a burst starts at a decision
/// and holds every decision within `window` of that start.
#[derive(Debug, Default)]
pub(crate) struct BurstTracker {
    /// When the current burst started, and its decisions so far.
    current: Option<(Duration, u32)>,
    stats: BurstStats,
    bursts: u64,
    decisions: u64,
}

/// A running mean: the plain mean of the first samples, then an exponential
/// one (so the first bursts count fully instead of starting from 0).
fn update(mean: &mut f64, seen: u64, sample: f64) {
    #[allow(clippy::cast_precision_loss)]
    let w = (1.0 / seen.max(1) as f64).max(WEIGHT);
    *mean += w * (sample - *mean);
}

impl BurstTracker {
    /// Counts a decision at `now` and returns the statistics of the bursts
    /// that ended before it (the current one is still growing). Hosts read
    /// `now` before the decision's own work (tokenizing, scoring), so
    /// concurrent decisions arrive a little out of time order: one within
    /// `window` of the burst's start on either side belongs to it.
    pub(crate) fn decision(&mut self, now: Duration, window: Duration) -> BurstStats {
        match self.current {
            Some((start, n)) if now.abs_diff(start) <= window => {
                self.current = Some((start, n.saturating_add(1)));
            }
            previous => {
                if let Some((_, n)) = previous {
                    self.bursts += 1;
                    update(&mut self.stats.decisions, self.bursts, f64::from(n));
                }
                self.current = Some((now, 1));
            }
        }
        self.stats
    }

    /// The statistics of the bursts that ended so far.
    pub(crate) fn stats(&self) -> BurstStats {
        self.stats
    }

    /// Records the predicted prefill tokens a decision charged.
    pub(crate) fn charged(&mut self, tokens: u32) {
        self.decisions += 1;
        update(
            &mut self.stats.prefill_tokens,
            self.decisions,
            f64::from(tokens),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_within_the_window_are_one_burst() {
        let mut b = BurstTracker::default();
        let w = Duration::from_millis(4);
        let ms = Duration::from_millis;
        // Bursts of 3, 1 and 2 decisions.
        for t in [0, 1, 3, 100, 200, 204] {
            b.decision(ms(t), w);
            b.charged(1000);
        }
        let s = b.decision(ms(300), w);
        assert!((s.decisions - 2.0).abs() < 1e-9, "{s:?}");
        assert!((s.prefill_tokens - 1000.0).abs() < 1e-9);
        // A burst is timed from its first decision, not its last.
        let mut b = BurstTracker::default();
        for t in [0, 3, 6, 9] {
            b.decision(ms(t), w);
        }
        let s = b.decision(ms(50), w);
        assert!((s.decisions - 2.0).abs() < 1e-9, "{s:?}");
        // Decisions a little out of time order (each read its clock before
        // tokenizing): still one burst.
        let mut b = BurstTracker::default();
        for t in [3, 2, 4] {
            b.decision(ms(t), w);
        }
        let s = b.decision(ms(100), w);
        assert!((s.decisions - 3.0).abs() < 1e-9, "{s:?}");
    }
}
