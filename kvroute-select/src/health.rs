//! Endpoint health: administrative state and a sans-IO circuit breaker.
//!
//! Time is an argument (`now`, a [`Duration`] since any host-chosen epoch), never
//! read from a clock, so every transition is reproducible in tests.

use std::time::Duration;

use kvroute_core::EndpointId;

/// Operator switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AdminState {
    /// Eligible for traffic.
    #[default]
    Up,
    /// Drained by the operator.
    Down,
}

/// Circuit-breaker state as seen at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BreakerState {
    /// Traffic flows.
    #[default]
    Closed,
    /// Too many consecutive failures; no traffic until the cool-down ends.
    Open,
    /// Cool-down over; traffic is allowed to probe the endpoint.
    HalfOpen,
}

/// Whether selection may send a request to an endpoint, and if not why.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Availability {
    /// Eligible.
    #[default]
    Available,
    /// Administratively down.
    AdminDown,
    /// Behind an open circuit breaker.
    BreakerOpen,
    /// Taken out of rotation by outlier detection ([`crate::OutlierDetector`]).
    Ejected,
}

impl Availability {
    /// Derives availability from the two host-side states.
    #[must_use]
    pub const fn from_states(admin: AdminState, breaker: BreakerState) -> Self {
        match (admin, breaker) {
            (AdminState::Down, _) => Availability::AdminDown,
            (AdminState::Up, BreakerState::Open) => Availability::BreakerOpen,
            _ => Availability::Available,
        }
    }

    /// `true` for [`Availability::Available`].
    #[must_use]
    pub const fn is_available(self) -> bool {
        matches!(self, Availability::Available)
    }
}

/// Host-supplied health of a rule's endpoints.
pub trait Health {
    /// Availability of `endpoint` at `now`.
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability;
}

/// Every endpoint always available — for hosts without health checks and tests.
#[derive(Clone, Copy, Debug, Default)]
pub struct AlwaysAvailable;

impl Health for AlwaysAvailable {
    fn availability(&self, _endpoint: EndpointId, _now: Duration) -> Availability {
        Availability::Available
    }
}

impl<H: Health + ?Sized> Health for &H {
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability {
        (**self).availability(endpoint, now)
    }
}

/// Circuit-breaker tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (0 behaves as 1).
    pub failure_threshold: u32,
    /// How long an open breaker stays open before letting a probe through.
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    /// `kvroute serve`'s: 3 consecutive failures, 5 s open.
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            cool_down: Duration::from_secs(5),
        }
    }
}

/// A consecutive-failure circuit breaker.
///
/// Closed → (`failure_threshold` consecutive failures) → Open → (cool-down
/// elapsed) → HalfOpen → success closes it, a failure re-opens it for another
/// cool-down.
///
/// ```
/// use std::time::Duration;
/// use kvroute_select::{BreakerConfig, BreakerState, CircuitBreaker};
/// let cfg = BreakerConfig { failure_threshold: 2, cool_down: Duration::from_secs(5) };
/// let mut b = CircuitBreaker::new(cfg);
/// let t = Duration::from_secs(100);
/// b.on_failure(t);
/// assert_eq!(b.state(t), BreakerState::Closed);
/// b.on_failure(t);
/// assert_eq!(b.state(t), BreakerState::Open);
/// assert_eq!(b.state(t + Duration::from_secs(5)), BreakerState::HalfOpen);
/// b.on_success();
/// assert_eq!(b.state(t + Duration::from_secs(5)), BreakerState::Closed);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CircuitBreaker {
    config: BreakerConfig,
    consecutive_failures: u32,
    opened_at: Option<Duration>,
}

impl CircuitBreaker {
    /// A closed breaker.
    #[must_use]
    pub const fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            consecutive_failures: 0,
            opened_at: None,
        }
    }

    /// State at `now`.
    #[must_use]
    pub fn state(&self, now: Duration) -> BreakerState {
        match self.opened_at {
            None => BreakerState::Closed,
            Some(at) if now.saturating_sub(at) >= self.config.cool_down => BreakerState::HalfOpen,
            Some(_) => BreakerState::Open,
        }
    }

    /// A request reached the endpoint and got an answer.
    pub fn on_success(&mut self) {
        self.consecutive_failures = 0;
        self.opened_at = None;
    }

    /// A request failed (connect refused, reset, timeout) at `now`.
    pub fn on_failure(&mut self, now: Duration) {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let half_open = self.state(now) == BreakerState::HalfOpen;
        if half_open || self.consecutive_failures >= self.config.failure_threshold.max(1) {
            self.opened_at = Some(now);
        }
    }

    /// Consecutive failures seen since the last success.
    #[must_use]
    pub const fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }
}

/// Admin state and a breaker per endpoint: a ready-made [`Health`].
#[derive(Clone, Debug)]
pub struct HealthTable {
    entries: Vec<(AdminState, CircuitBreaker)>,
}

impl HealthTable {
    /// `endpoints` endpoints, all up with closed breakers.
    #[must_use]
    pub fn new(endpoints: usize, config: BreakerConfig) -> Self {
        Self {
            entries: vec![(AdminState::Up, CircuitBreaker::new(config)); endpoints],
        }
    }

    /// Sets the admin state (ignored for unknown ids).
    pub fn set_admin(&mut self, endpoint: EndpointId, state: AdminState) {
        if let Some(e) = self.entries.get_mut(endpoint.index()) {
            e.0 = state;
        }
    }

    /// Records a failure against the endpoint's breaker.
    pub fn record_failure(&mut self, endpoint: EndpointId, now: Duration) {
        if let Some(e) = self.entries.get_mut(endpoint.index()) {
            e.1.on_failure(now);
        }
    }

    /// Records a success against the endpoint's breaker.
    pub fn record_success(&mut self, endpoint: EndpointId) {
        if let Some(e) = self.entries.get_mut(endpoint.index()) {
            e.1.on_success();
        }
    }

    /// The breaker of one endpoint.
    #[must_use]
    pub fn breaker(&self, endpoint: EndpointId) -> Option<&CircuitBreaker> {
        self.entries.get(endpoint.index()).map(|e| &e.1)
    }
}

impl Health for HealthTable {
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability {
        match self.entries.get(endpoint.index()) {
            Some((admin, breaker)) => Availability::from_states(*admin, breaker.state(now)),
            None => Availability::Available,
        }
    }
}
