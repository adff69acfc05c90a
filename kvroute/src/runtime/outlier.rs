//! The router's outlier detection: the library's sans-IO
//! [`OutlierDetector`] fed by every attempt [`crate::Pick::await_headers`]
//! waits on and by the engine load poller, read by the load view (an ejected
//! endpoint is not available), and the wake-up of attempts waiting on an
//! endpoint when it is ejected.

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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeaderTimeouts {
    /// Any request. A non-streamed engine sends its headers with the whole
    /// answer, so this must exceed the longest non-streamed generation.
    /// `None`: as long as the host's own client waits.
    pub response: Option<Duration>,
    /// A streamed request (`"stream": true`): engines send its headers as
    /// soon as they accept it, before generating. `None`: `response`.
    pub streamed: Option<Duration>,
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
    timeouts: HeaderTimeouts,
    /// Bumped on every ejection: attempts waiting anywhere check theirs.
    ejections: watch::Sender<u64>,
}

impl Outliers {
    pub(crate) fn new(endpoints: usize, config: OutlierConfig, timeouts: HeaderTimeouts) -> Self {
        let mut detector = OutlierDetector::new(endpoints, config);
        for i in 0..endpoints {
            detector.set_present(super::id(i), false, Duration::ZERO);
        }
        Self {
            detector: Mutex::new(detector),
            timeouts,
            ejections: watch::channel(0).0,
        }
    }

    pub(crate) fn timeouts(&self) -> HeaderTimeouts {
        self.timeouts
    }

    pub(crate) fn stall_after(&self) -> Duration {
        self.detector.lock().config().stall_after
    }

    pub(crate) fn set_present(&self, endpoint: EndpointId, present: bool, now: Duration) {
        self.detector.lock().set_present(endpoint, present, now);
    }

    pub(crate) fn is_ejected(&self, endpoint: EndpointId, now: Duration) -> bool {
        self.detector.lock().is_ejected(endpoint, now)
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

/// The attempt got its headers: an answer is also what other endpoints'
/// stalls are measured against.
pub(crate) fn answered(shared: &Shared, endpoint: EndpointId, attempt: AttemptId, now: Duration) {
    shared
        .outliers
        .detector
        .lock()
        .answered(endpoint, attempt, now);
    evaluate(shared, now);
}

/// The host gave up waiting for the attempt's headers.
pub(crate) fn timed_out(shared: &Shared, endpoint: EndpointId, attempt: AttemptId, now: Duration) {
    let ejected = shared
        .outliers
        .detector
        .lock()
        .timed_out(endpoint, attempt, now);
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
    let ejected = shared.outliers.detector.lock().evaluate(now);
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
