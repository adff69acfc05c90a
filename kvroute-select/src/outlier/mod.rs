//! Outlier detection: takes out of rotation an endpoint whose requests get no
//! response headers while the rest of the pool answers — an engine that
//! passes its health probe but holds every request it accepts.
//!
//! A sans-IO state machine (time is an argument, as for the
//! [`crate::CircuitBreaker`]); the host feeds it what it sees of each request
//! attempt and of each engine's own load report, and reads which endpoints
//! are ejected. Two ways in, in the spirit of Envoy's outlier detection:
//!
//! * **stall**: an endpoint's oldest attempt has waited
//!   [`OutlierConfig::stall_after`] without response headers, another
//!   endpoint in rotation answered a request after that attempt was sent,
//!   and the engine's own load reports accuse it: since the attempt was sent
//!   (plus [`OutlierConfig::report_grace`]) its load report hung or could not
//!   be fetched, or counted fewer running and waiting requests than the host
//!   is waiting on there — and no report in that time counted them all. An
//!   engine that is busy generating long non-streamed answers reports them
//!   running, so it is never ejected this way, however long it takes. An
//!   endpoint without load reports is never ejected this way either;
//! * **timeouts**: [`OutlierConfig::consecutive_timeouts`] gateway timeouts
//!   (the host gave up waiting for headers) with no answer in between.
//!
//! An ejection never takes out the last endpoint in rotation. It lasts
//! [`OutlierConfig::base_ejection`] times the number of ejections since the
//! endpoint last answered, at most [`OutlierConfig::max_ejection`]; the
//! endpoint is then back in rotation, and an answer from it (headers for any
//! attempt) resets the multiplier and ends an ejection at once. The time an
//! attempt has waited counts from when its endpoint was last back in
//! rotation, so each return is judged on fresh evidence.
//!
//! ```
//! use std::time::Duration;
//! use kvroute_core::EndpointId;
//! use kvroute_select::{EngineEvidence, OutlierConfig, OutlierDetector};
//!
//! let s = Duration::from_secs;
//! let mut d = OutlierDetector::new(2, OutlierConfig::default());
//! let (hole, good) = (EndpointId(0), EndpointId(1));
//! let stuck = d.sent(hole, s(0)).unwrap();
//! let ok = d.sent(good, s(1)).unwrap();
//! d.answered(good, ok, s(1));
//! // The engine's load report hangs as its requests do.
//! d.evidence(hole, s(3), EngineEvidence::Unreachable);
//! assert!(d.evaluate(s(4)).is_empty(), "not stalled long enough yet");
//! assert_eq!(d.evaluate(s(5)), vec![hole]);
//! assert!(d.is_ejected(hole, s(5)));
//! d.abandoned(hole, stuck); // the host retries it elsewhere
//! assert!(!d.is_ejected(hole, s(15)), "back after the base ejection");
//! ```

use std::time::Duration;

use kvroute_core::EndpointId;

#[cfg(feature = "fuzzing")]
pub(crate) mod model;

/// Outlier-detection tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutlierConfig {
    /// How long an attempt may wait for response headers before it is a
    /// stall: with the evidence described in the module docs its endpoint is
    /// ejected then. `Duration::ZERO` turns stall ejection off.
    pub stall_after: Duration,
    /// How long after an attempt is sent its engine's load report must count
    /// it (request transfer, tokenization before the scheduler admits it);
    /// reports taken earlier neither accuse nor vouch for it.
    pub report_grace: Duration,
    /// Gateway timeouts in a row, without an answer in between, that eject;
    /// 0 turns it off.
    pub consecutive_timeouts: u32,
    /// Length of a first ejection; the n-th in a row (no answer in between)
    /// lasts n times this.
    pub base_ejection: Duration,
    /// Longest ejection.
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    /// Stalls after 5 s (2 s report grace), 3 consecutive timeouts, 10 s
    /// first ejection, 300 s at most.
    fn default() -> Self {
        Self {
            stall_after: Duration::from_secs(5),
            report_grace: Duration::from_secs(2),
            consecutive_timeouts: 3,
            base_ejection: Duration::from_secs(10),
            max_ejection: Duration::from_secs(300),
        }
    }
}

/// What an engine's own load report says while the host waits on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineEvidence {
    /// The report was read: `busy` requests running or waiting there, from
    /// every client (other gateway replicas' too).
    Report {
        /// Running plus waiting requests.
        busy: u32,
    },
    /// The report could not be fetched: it timed out or the connection
    /// failed (the engine does not answer that either). A report the engine
    /// answers with an error status or an unreadable body is no evidence:
    /// the host passes nothing for it.
    Unreachable,
}

/// One attempt the detector follows (from [`OutlierDetector::sent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttemptId(u64);

/// Why an endpoint was ejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EjectionCause {
    /// An attempt stalled and the engine's reports accused it.
    Stalled,
    /// Consecutive gateway timeouts.
    Timeouts,
}

/// One endpoint's outlier state, as a host shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutlierStatus {
    /// Out of rotation now.
    pub ejected: bool,
    /// Time left of the current ejection.
    pub ejected_for: Duration,
    /// Ejections so far.
    pub ejections: u64,
    /// Ejections for stalls so far.
    pub stall_ejections: u64,
    /// Attempts waiting for headers there.
    pub waiting: usize,
    /// Gateway timeouts since its last answer.
    pub consecutive_timeouts: u32,
}

#[derive(Clone, Debug, Default)]
struct EndpointState {
    present: bool,
    /// The host routes nothing to it for reasons of its own (drained,
    /// breaker open): it does not count among the others in rotation an
    /// ejection must leave ([`OutlierDetector::set_available`]).
    unavailable: bool,
    /// Attempts waiting for headers: (id, sent at), in the order sent.
    waiting: Vec<(u64, Duration)>,
    consecutive_timeouts: u32,
    last_answer: Option<Duration>,
    /// Latest report that counted every attempt it should have.
    last_vouch: Option<Duration>,
    /// Latest evidence against it.
    last_accuse: Option<Duration>,
    ejected_until: Option<Duration>,
    /// When it was last back in rotation.
    back_at: Duration,
    /// Ejections since its last answer.
    streak: u32,
    ejections: u64,
    stall_ejections: u64,
}

impl EndpointState {
    fn ejected(&self, now: Duration) -> bool {
        self.ejected_until.is_some_and(|u| now < u)
    }

    /// An ejection that is over leaves the endpoint back in rotation from
    /// its end.
    fn settle(&mut self, now: Duration) {
        if let Some(until) = self.ejected_until {
            if until <= now {
                self.ejected_until = None;
                self.back_at = self.back_at.max(until);
            }
        }
    }

    fn oldest_waiting(&self) -> Option<Duration> {
        self.waiting.iter().map(|(_, t)| *t).min()
    }

    fn remove(&mut self, id: AttemptId) -> bool {
        match self.waiting.iter().position(|(i, _)| *i == id.0) {
            Some(p) => {
                self.waiting.remove(p);
                true
            }
            None => false,
        }
    }
}

/// The outlier state machine of one pool of endpoints (see the module docs).
#[derive(Clone, Debug)]
pub struct OutlierDetector {
    config: OutlierConfig,
    endpoints: Vec<EndpointState>,
    next_attempt: u64,
}

impl OutlierDetector {
    /// A detector for endpoints `0..endpoints`, all present and in rotation.
    #[must_use]
    pub fn new(endpoints: usize, config: OutlierConfig) -> Self {
        Self {
            config,
            endpoints: (0..endpoints)
                .map(|_| EndpointState {
                    present: true,
                    ..EndpointState::default()
                })
                .collect(),
            next_attempt: 0,
        }
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &OutlierConfig {
        &self.config
    }

    /// An endpoint joined (`true`) or left the pool: its state starts over
    /// either way (its waiting attempts are forgotten). Only present
    /// endpoints count as the pool that answers.
    pub fn set_present(&mut self, endpoint: EndpointId, present: bool, now: Duration) {
        if let Some(e) = self.endpoints.get_mut(endpoint.index()) {
            *e = EndpointState {
                present,
                back_at: now,
                ..EndpointState::default()
            };
        }
    }

    /// Whether the host routes to `endpoint` for reasons of its own (not
    /// drained, breaker not open; `true` until said otherwise, and again
    /// when it rejoins). An ejection never leaves no endpoint in rotation,
    /// and one the host does not route to is not in rotation: hosts call
    /// this before [`Self::timed_out`] and [`Self::evaluate`].
    pub fn set_available(&mut self, endpoint: EndpointId, available: bool) {
        if let Some(e) = self.endpoints.get_mut(endpoint.index()) {
            e.unavailable = !available;
        }
    }

    /// An attempt was sent to `endpoint` at `now` and waits for response
    /// headers; `None` for an endpoint outside the pool.
    pub fn sent(&mut self, endpoint: EndpointId, now: Duration) -> Option<AttemptId> {
        let e = self.endpoints.get_mut(endpoint.index())?;
        let id = self.next_attempt;
        self.next_attempt = self.next_attempt.wrapping_add(1);
        e.waiting.push((id, now));
        Some(AttemptId(id))
    }

    /// The attempt got its response headers at `now` (any status: the
    /// engine answers): the endpoint's timeouts and ejection multiplier
    /// reset, and an ejection ends.
    pub fn answered(&mut self, endpoint: EndpointId, attempt: AttemptId, now: Duration) {
        let Some(e) = self.endpoints.get_mut(endpoint.index()) else {
            return;
        };
        if !e.remove(attempt) {
            return;
        }
        e.settle(now);
        e.consecutive_timeouts = 0;
        e.streak = 0;
        e.last_answer = Some(e.last_answer.map_or(now, |t| t.max(now)));
        if e.ejected(now) {
            e.ejected_until = None;
            e.back_at = now;
        }
    }

    /// The attempt ended without headers and without a timeout (connection
    /// refused, the client went away, the host gave up on an ejected
    /// endpoint): no evidence either way.
    pub fn abandoned(&mut self, endpoint: EndpointId, attempt: AttemptId) {
        if let Some(e) = self.endpoints.get_mut(endpoint.index()) {
            e.remove(attempt);
        }
    }

    /// The host stopped waiting for the attempt's headers at `now` (its
    /// response-header or first-byte timeout): a gateway timeout. `true`
    /// when this ejected the endpoint.
    pub fn timed_out(&mut self, endpoint: EndpointId, attempt: AttemptId, now: Duration) -> bool {
        let threshold = self.config.consecutive_timeouts;
        let Some(e) = self.endpoints.get_mut(endpoint.index()) else {
            return false;
        };
        if !e.remove(attempt) {
            return false;
        }
        e.settle(now);
        e.consecutive_timeouts = e.consecutive_timeouts.saturating_add(1);
        let due = threshold > 0 && e.consecutive_timeouts >= threshold && !e.ejected(now);
        if due && self.others_in_rotation(endpoint.index(), now, None) {
            self.eject(endpoint.index(), now, EjectionCause::Timeouts);
            return true;
        }
        false
    }

    /// What `endpoint`'s engine reported at `now` (see [`EngineEvidence`]).
    /// It counts only while attempts there are older than the report grace.
    pub fn evidence(&mut self, endpoint: EndpointId, now: Duration, evidence: EngineEvidence) {
        let grace = self.config.report_grace;
        let Some(e) = self.endpoints.get_mut(endpoint.index()) else {
            return;
        };
        let due = e
            .waiting
            .iter()
            .filter(|(_, sent)| sent.saturating_add(grace) <= now)
            .count();
        if due == 0 {
            return;
        }
        let vouches = match evidence {
            EngineEvidence::Report { busy } => usize::try_from(busy).unwrap_or(usize::MAX) >= due,
            EngineEvidence::Unreachable => false,
        };
        let slot = if vouches {
            &mut e.last_vouch
        } else {
            &mut e.last_accuse
        };
        *slot = Some(slot.map_or(now, |t| t.max(now)));
    }

    /// Ends ejections that are over and ejects, in endpoint order, every
    /// endpoint that stalls at `now`; returns those it ejected.
    pub fn evaluate(&mut self, now: Duration) -> Vec<EndpointId> {
        for e in &mut self.endpoints {
            e.settle(now);
        }
        let mut out = Vec::new();
        if self.config.stall_after.is_zero() {
            return out;
        }
        for i in 0..self.endpoints.len() {
            let Some(since) = self.stalled_since(i, now) else {
                continue;
            };
            if self.others_in_rotation(i, now, Some(since)) {
                self.eject(i, now, EjectionCause::Stalled);
                out.push(EndpointId(u32::try_from(i).unwrap_or(u32::MAX)));
            }
        }
        out
    }

    /// When `i`'s oldest attempt (counted from its return to rotation) began
    /// a stall its engine's reports accuse, if it did.
    fn stalled_since(&self, i: usize, now: Duration) -> Option<Duration> {
        let e = self.endpoints.get(i)?;
        if !e.present || e.ejected(now) {
            return None;
        }
        let since = e.oldest_waiting()?.max(e.back_at);
        if now < since.saturating_add(self.config.stall_after) {
            return None;
        }
        let mark = since.saturating_add(self.config.report_grace);
        let accused = e.last_accuse.is_some_and(|t| t >= mark);
        let vouched = e.last_vouch.is_some_and(|t| t >= mark);
        (accused && !vouched).then_some(since)
    }

    /// Another present endpoint is in rotation at `now` (and, with
    /// `answered_after`, answered a request after that instant).
    fn others_in_rotation(
        &self,
        i: usize,
        now: Duration,
        answered_after: Option<Duration>,
    ) -> bool {
        self.endpoints.iter().enumerate().any(|(j, f)| {
            j != i
                && f.present
                && !f.unavailable
                && !f.ejected(now)
                && answered_after.is_none_or(|t| f.last_answer.is_some_and(|a| a > t))
        })
    }

    fn eject(&mut self, i: usize, now: Duration, cause: EjectionCause) {
        let (base, max) = (self.config.base_ejection, self.config.max_ejection);
        let Some(e) = self.endpoints.get_mut(i) else {
            return;
        };
        e.streak = e.streak.saturating_add(1);
        e.ejected_until = Some(now.saturating_add(base.saturating_mul(e.streak).min(max)));
        e.ejections = e.ejections.saturating_add(1);
        e.consecutive_timeouts = 0;
        if cause == EjectionCause::Stalled {
            e.stall_ejections = e.stall_ejections.saturating_add(1);
        }
    }

    /// Whether `endpoint` is out of rotation at `now`.
    #[must_use]
    pub fn is_ejected(&self, endpoint: EndpointId, now: Duration) -> bool {
        self.endpoints
            .get(endpoint.index())
            .is_some_and(|e| e.ejected(now))
    }

    /// `endpoint`'s state at `now`.
    #[must_use]
    pub fn status(&self, endpoint: EndpointId, now: Duration) -> OutlierStatus {
        let Some(e) = self.endpoints.get(endpoint.index()) else {
            return OutlierStatus::default();
        };
        OutlierStatus {
            ejected: e.ejected(now),
            ejected_for: e
                .ejected_until
                .map_or(Duration::ZERO, |u| u.saturating_sub(now)),
            ejections: e.ejections,
            stall_ejections: e.stall_ejections,
            waiting: e.waiting.len(),
            consecutive_timeouts: e.consecutive_timeouts,
        }
    }

    /// The earliest instant after `now` at which [`OutlierDetector::evaluate`]
    /// may eject an endpoint that it would not eject at `now` without new
    /// input (an attempt reaching the stall age); `None` when no attempt
    /// waits.
    #[must_use]
    pub fn next_stall_check(&self, now: Duration) -> Option<Duration> {
        if self.config.stall_after.is_zero() {
            return None;
        }
        self.endpoints
            .iter()
            .filter(|e| e.present)
            .filter_map(|e| {
                let since = e.oldest_waiting()?.max(e.back_at);
                let since = e.ejected_until.map_or(since, |u| since.max(u));
                Some(since.saturating_add(self.config.stall_after))
            })
            .filter(|t| *t > now)
            .min()
    }
}
