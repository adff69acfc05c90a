//! A slot's circuit breaker, whose closed state decisions read without its
//! lock: every decision asks every endpoint, and a breaker is almost always
//! closed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvroute_select::{BreakerConfig, BreakerState, CircuitBreaker};
use parking_lot::Mutex;

/// [`CircuitBreaker`] behind a lock, with its "opened" flag published.
#[derive(Debug)]
pub(crate) struct SlotBreaker {
    inner: Mutex<CircuitBreaker>,
    /// The breaker has opened and not closed since (open or half-open).
    opened: AtomicBool,
}

impl SlotBreaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            inner: Mutex::new(CircuitBreaker::new(config)),
            opened: AtomicBool::new(false),
        }
    }

    /// State at `now`; a closed breaker costs one atomic load.
    pub(crate) fn state(&self, now: Duration) -> BreakerState {
        if !self.opened.load(Ordering::Acquire) {
            return BreakerState::Closed;
        }
        self.inner.lock().state(now)
    }

    pub(crate) fn on_success(&self) {
        self.update(Duration::ZERO, CircuitBreaker::on_success);
    }

    pub(crate) fn on_failure(&self, now: Duration) {
        self.update(now, |b| b.on_failure(now));
    }

    /// A fresh closed breaker (a reused slot's).
    pub(crate) fn reset(&self, config: BreakerConfig) {
        self.update(Duration::ZERO, |b| *b = CircuitBreaker::new(config));
    }

    fn update(&self, now: Duration, f: impl FnOnce(&mut CircuitBreaker)) {
        let mut b = self.inner.lock();
        f(&mut b);
        // Closed exactly when it has not opened (the state does not depend
        // on `now` then).
        self.opened
            .store(b.state(now) != BreakerState::Closed, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_follows_the_breaker() {
        let config = BreakerConfig {
            failure_threshold: 2,
            cool_down: Duration::from_secs(5),
        };
        let b = SlotBreaker::new(config);
        let s = Duration::from_secs;
        b.on_failure(s(1));
        assert_eq!(b.state(s(1)), BreakerState::Closed);
        b.on_failure(s(2));
        assert_eq!(b.state(s(2)), BreakerState::Open);
        assert_eq!(b.state(s(8)), BreakerState::HalfOpen);
        b.on_success();
        assert_eq!(b.state(s(8)), BreakerState::Closed);
        b.on_failure(s(9));
        b.on_failure(s(9));
        assert_eq!(b.state(s(9)), BreakerState::Open);
        b.reset(config);
        assert_eq!(b.state(s(9)), BreakerState::Closed);
    }
}
