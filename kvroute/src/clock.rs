//! Where the runtime's time comes from: the host's monotonic clock, or a
//! clock the host advances itself (the simulator's simulated time, tests).
//!
//! Selection, load accounting and replica expiry all read time through one
//! [`Clock`], so a simulated fleet runs exactly the code a live one does.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic time source: the time since some fixed epoch.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Time since the clock's epoch; never decreases.
    fn now(&self) -> Duration;
}

/// The host's monotonic clock (`Instant`), from its creation.
#[derive(Debug)]
pub struct SystemClock {
    epoch: Instant,
}

impl SystemClock {
    /// A clock whose epoch is now.
    #[must_use]
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }
}

/// A clock the host moves: [`ManualClock::set`] and
/// [`ManualClock::advance`] (microsecond resolution; never goes back).
///
/// ```
/// use std::time::Duration;
/// use kvroute::{Clock, ManualClock};
/// let clock = ManualClock::default();
/// clock.set(Duration::from_millis(5));
/// clock.set(Duration::from_millis(1)); // ignored: time never goes back
/// assert_eq!(clock.now(), Duration::from_millis(5));
/// ```
#[derive(Debug, Default)]
pub struct ManualClock {
    micros: AtomicU64,
}

impl ManualClock {
    /// Moves the clock to `now` (earlier times are ignored).
    pub fn set(&self, now: Duration) {
        let us = u64::try_from(now.as_micros()).unwrap_or(u64::MAX);
        self.micros.fetch_max(us, Ordering::AcqRel);
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        let _ = self
            .micros
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                Some(m.saturating_add(us))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Acquire))
    }
}
