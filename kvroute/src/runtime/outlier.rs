//! The router's outlier detection: the library's sans-IO
//! [`OutlierDetector`] fed by every attempt [`crate::Pick::await_headers`]
//! waits on and by the engine load poller, read by the load view (an ejected
//! endpoint is not available), and the wake-up of attempts waiting on an
//! endpoint when it is ejected.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{AttemptId, EngineEvidence, OutlierConfig, OutlierDetector, OutlierStatus};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::Shared;

/// How long [`crate::Pick::await_headers`] waits for an upstream's response
/// headers before giving up on the attempt (a gateway timeout, counted
/// against the endpoint by outlier detection, and retryable: nothing reached
/// the client yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderTimeouts {
    /// Any request. A non-streamed engine sends its headers with the whole
    /// answer, so this must exceed the longest non-streamed generation.
    /// `None`: as long as the host's own client waits.
    pub response: Option<Duration>,
    /// A streamed request (`"stream": true`): engines send its headers as
    /// soon as they accept it, before generating. `None`: `response`.
    pub streamed: Option<Duration>,
}

impl Default for HeaderTimeouts {
    /// `kvroute serve`'s: 120 s for any request, 10 s for a streamed one.
    fn default() -> Self {
        Self {
            response: Some(Duration::from_secs(120)),
            streamed: Some(Duration::from_secs(10)),
        }
    }
}

/// Why [`crate::Pick::await_headers`] stopped waiting for response headers.
/// In every case nothing reached the client: another endpoint may be tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Stall {
    /// No headers within [`HeaderTimeouts::response`].
    #[error("no response headers within {0:?}")]
    HeaderTimeout(Duration),
    /// A streamed request got no headers within [`HeaderTimeouts::streamed`].
    #[error("streamed request: no response headers within {0:?}")]
    StreamHeaderTimeout(Duration),
    /// Outlier detection took the endpoint out of rotation while the request
    /// waited on it.
    #[error("endpoint ejected by outlier detection while the request waited")]
    Ejected,
}

pub(crate) struct Outliers {
    detector: Mutex<OutlierDetector>,
    /// Per slot, the end of its ejection in clock nanoseconds (0: none): what
    /// every decision reads, without the detector's lock.
    until: Box<[AtomicU64]>,
    timeouts: HeaderTimeouts,
    /// Bumped on every ejection: attempts waiting anywhere check theirs.
    ejections: watch::Sender<u64>,
}

fn nanos(t: Duration) -> u64 {
    u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
}

impl Outliers {
    pub(crate) fn new(endpoints: usize, config: OutlierConfig, timeouts: HeaderTimeouts) -> Self {
        let mut detector = OutlierDetector::new(endpoints, config);
        for i in 0..endpoints {
            detector.set_present(super::id(i), false, Duration::ZERO);
        }
        Self {
            detector: Mutex::new(detector),
            until: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            timeouts,
            ejections: watch::channel(0).0,
        }
    }

    /// Copies `endpoint`'s ejection from the detector into the lock-free view.
    fn mirror(&self, det: &OutlierDetector, endpoint: EndpointId, now: Duration) {
        if let Some(u) = self.until.get(endpoint.index()) {
            let s = det.status(endpoint, now);
            let end = if s.ejected {
                nanos(now.saturating_add(s.ejected_for)).max(1)
            } else {
                0
            };
            u.store(end, Ordering::Release);
        }
    }

    pub(crate) fn timeouts(&self) -> HeaderTimeouts {
        self.timeouts
    }

    pub(crate) fn stall_after(&self) -> Duration {
        self.detector.lock().config().stall_after
    }

    pub(crate) fn set_present(&self, endpoint: EndpointId, present: bool, now: Duration) {
        let mut det = self.detector.lock();
        det.set_present(endpoint, present, now);
        self.mirror(&det, endpoint, now);
    }

    pub(crate) fn is_ejected(&self, endpoint: EndpointId, now: Duration) -> bool {
        self.until
            .get(endpoint.index())
            .is_some_and(|u| nanos(now) < u.load(Ordering::Acquire))
    }

    pub(crate) fn status(&self, endpoint: EndpointId, now: Duration) -> OutlierStatus {
        self.detector.lock().status(endpoint, now)
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.ejections.subscribe()
    }

    pub(crate) fn sent(&self, endpoint: EndpointId, now: Duration) -> Option<AttemptId> {
        self.detector.lock().sent(endpoint, now)
    }

    pub(crate) fn abandoned(&self, endpoint: EndpointId, attempt: AttemptId) {
        self.detector.lock().abandoned(endpoint, attempt);
    }
}

/// The attempt got its headers. (Other endpoints' stalls are judged when
/// their engines report or their attempts reach the stall age; an answer
/// alone never completes the evidence.)
pub(crate) fn answered(shared: &Shared, endpoint: EndpointId, attempt: AttemptId, now: Duration) {
    let o = &shared.outliers;
    let mut det = o.detector.lock();
    det.answered(endpoint, attempt, now);
    o.mirror(&det, endpoint, now);
}

/// Tells the detector which endpoints the router routes to for reasons of
/// its own (present, not drained, breaker not open): an ejection must leave
/// one of them in rotation, not only endpoints nothing is sent to.
fn refresh_available(shared: &Shared, det: &mut OutlierDetector, now: Duration) {
    for (i, s) in shared.slots.iter().enumerate() {
        let available = s.present.load(Ordering::Acquire)
            && !s.admin_down.load(Ordering::Acquire)
            && kvroute_select::Availability::from_states(
                kvroute_select::AdminState::Up,
                s.breaker.state(now),
            )
            .is_available();
        det.set_available(EndpointId(u32::try_from(i).unwrap_or(u32::MAX)), available);
    }
}

/// The host gave up waiting for the attempt's headers.
pub(crate) fn timed_out(shared: &Shared, endpoint: EndpointId, attempt: AttemptId, now: Duration) {
    let o = &shared.outliers;
    let ejected = {
        let mut det = o.detector.lock();
        refresh_available(shared, &mut det, now);
        let ejected = det.timed_out(endpoint, attempt, now);
        o.mirror(&det, endpoint, now);
        ejected
    };
    if ejected {
        announce(shared, &[endpoint], "consecutive response-header timeouts");
    }
}

/// What the endpoint's engine load report said.
pub(crate) fn evidence(shared: &Shared, endpoint: EndpointId, now: Duration, ev: EngineEvidence) {
    shared.outliers.detector.lock().evidence(endpoint, now, ev);
    evaluate(shared, now);
}

/// Ejects what stalls at `now`.
pub(crate) fn evaluate(shared: &Shared, now: Duration) {
    let o = &shared.outliers;
    let ejected = {
        let mut det = o.detector.lock();
        refresh_available(shared, &mut det, now);
        let ejected = det.evaluate(now);
        for e in &ejected {
            o.mirror(&det, *e, now);
        }
        ejected
    };
    if !ejected.is_empty() {
        announce(
            shared,
            &ejected,
            "requests wait for headers while the other endpoints answer, and the engine's load report does not count them",
        );
    }
}

fn announce(shared: &Shared, ejected: &[EndpointId], why: &'static str) {
    let gen = shared.current();
    for e in ejected {
        let url = gen.urls.get(e.index()).map_or("", |u| &**u);
        let until = shared.outliers.status(*e, shared.now()).ejected_for;
        tracing::warn!(rule = %shared.settings.name, endpoint = url, reason = why,
            ejected_for = ?until, "endpoint out of rotation (outlier detection)");
    }
    shared
        .outliers
        .ejections
        .send_modify(|n| *n = n.wrapping_add(1));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::test_support::host_router;

    /// Two endpoints, one drained by the operator: the other timing out is
    /// the last the router routes to and is not ejected (every request
    /// would get 503 otherwise); with both up it is.
    #[test]
    fn a_drained_endpoint_does_not_count_as_the_rotation_left() {
        for drained in [true, false] {
            let router = host_router(2)
                .outlier_detection(OutlierConfig {
                    consecutive_timeouts: 3,
                    ..OutlierConfig::default()
                })
                .build()
                .expect("router");
            let shared = &router.shared;
            assert!(router.set_admin_down("http://e0", drained));
            let e1 = EndpointId(1);
            let now = shared.now();
            for _ in 0..3 {
                let a = shared.outliers.sent(e1, now).expect("attempt");
                timed_out(shared, e1, a, now);
            }
            assert_eq!(
                shared.outliers.is_ejected(e1, now),
                !drained,
                "drained: {drained}"
            );
        }
    }
}
