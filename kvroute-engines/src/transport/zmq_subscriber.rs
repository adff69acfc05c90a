use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::endpoint::{
    resolved_bind_addresses, BindTarget, EndpointError, SocketRole, ZmqEndpoint,
};
use super::metrics::{RateMeter, SubscriberMetrics};
use super::replay::request_replay;
use super::sink::{Frame, FrameSink, FrameSource, ReplayOutcome, SinkAction};
use crate::events::LiveMessage;

/// Configuration of one [`ZmqSubscriber`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ZmqSubscriberConfig {
    /// Where the engine publishes, and whether we connect or bind.
    pub endpoint: ZmqEndpoint,
    /// Topic filter (exact match; the engines' default is the empty topic).
    pub topic: String,
    /// The engine's ROUTER replay socket (`tcp://host:port`, already rank-offset);
    /// `None` when the engine runs without `replay_endpoint`.
    pub replay_endpoint: Option<String>,
    /// Upper bound of one dial (TCP connect + ZMTP handshake).
    pub dial_timeout: Duration,
    /// First retry interval after a failed dial or bind; doubles up to `retry_max`.
    pub retry_initial: Duration,
    /// Largest retry interval.
    pub retry_max: Duration,
    /// Upper bound of one replay exchange.
    pub replay_timeout: Duration,
    /// Largest message (all frames together) received. The socket refuses a
    /// frame or multipart message declaring more before buffering it and drops
    /// the peer (`oversized_peers_dropped`); so per peer connection at most
    /// about this much is ever buffered. See the [`ZmqSubscriber`] docs.
    pub max_message_bytes: usize,
    /// A peer that connects to a bound subscriber must finish the ZMTP
    /// handshake within this, or its connection is closed (a silent peer
    /// would otherwise hold a descriptor forever).
    pub handshake_timeout: Duration,
}

/// Default [`ZmqSubscriberConfig::max_message_bytes`]: 16 MiB, ~6000× a typical
/// vLLM batch (2.7 KB) and ~20× the batch of one 128K-token prefill at block size 16
/// (8192 blocks of 16 token ids ≈ 0.75 MB).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Default [`ZmqSubscriberConfig::handshake_timeout`]: generous for an engine
/// across a slow network (the handshake is two 64-byte greetings and two short
/// READY commands), short enough that silent connections do not accumulate.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most parts a received message may have: live batches have 3
/// (`[topic, seq, payload]`), replay replies 4. Without a part limit a peer
/// could send empty parts flagged MORE forever under any byte limit.
pub const MAX_MESSAGE_PARTS: usize = 16;

/// Socket options every subscriber and replay socket uses: the receive
/// limits of the [`ZmqSubscriber`] docs and the dial timeout.
pub(crate) fn socket_options(max_message_bytes: usize, dial_timeout: Duration) -> SocketOptions {
    let mut options = SocketOptions::default();
    options
        .connect_timeout(dial_timeout)
        .accept_handshake_timeout(DEFAULT_HANDSHAKE_TIMEOUT)
        .max_frame_size(max_message_bytes)
        .max_message_size(max_message_bytes)
        .max_message_parts(MAX_MESSAGE_PARTS);
    options
}

impl ZmqSubscriberConfig {
    /// Defaults: empty topic, no replay, 250 ms dial timeout, retries from 10 ms
    /// doubling to 200 ms (a refused dial is a cheap SYN/RST on the engine host, and
    /// every millisecond the engine is up before we resubscribe is lost stream),
    /// 2 s replay timeout, [`DEFAULT_MAX_MESSAGE_BYTES`],
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`].
    #[must_use]
    pub fn new(endpoint: ZmqEndpoint) -> Self {
        Self {
            endpoint,
            topic: String::new(),
            replay_endpoint: None,
            dial_timeout: Duration::from_millis(250),
            retry_initial: Duration::from_millis(10),
            retry_max: Duration::from_millis(200),
            replay_timeout: Duration::from_secs(2),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }

    /// Sets the handshake timeout of accepted peers.
    #[must_use]
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Sets the largest accepted message size in bytes.
    #[must_use]
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// Sets the topic filter.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Sets the replay endpoint.
    #[must_use]
    pub fn replay_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// Sets the retry interval bounds.
    #[must_use]
    pub fn retry(mut self, initial: Duration, max: Duration) -> Self {
        self.retry_initial = initial;
        self.retry_max = max.max(initial);
        self
    }

    /// Sets the dial timeout.
    #[must_use]
    pub fn dial_timeout(mut self, timeout: Duration) -> Self {
        self.dial_timeout = timeout;
        self
    }

    /// Sets the replay timeout.
    #[must_use]
    pub fn replay_timeout(mut self, timeout: Duration) -> Self {
        self.replay_timeout = timeout;
        self
    }
}

/// Follows one engine's KV-event stream: one ZeroMQ SUB subscriber per engine
/// endpoint and data-parallel rank.
///
/// It owns the socket lifecycle and nothing else: dial or bind as the engine
/// demands ([`ZmqEndpoint`]), retry a failed first dial on an interval (a rule can
/// exist before its engine is up), reconnect after a disconnect with its own short
/// backoff, bootstrap through the engine's replay socket whenever the sink asks
/// (on connect, after a detected restart), and hand every `[topic, seq, payload]`
/// message to a [`FrameSink`].
///
/// Why our own reconnect loop: the `zeromq` crate reconnects a SUB by itself, but
/// starts at 100 ms and backs off to 30 s, and a PUB drops whatever it publishes
/// before the new subscription reaches it. Tearing the socket down on disconnect
/// lets us redial at once, tell the sink (so it can ask for a replay of what was
/// missed) and count the event. `tests/interop_restart.rs` measures both.
///
/// Bad frames (malformed, oversized, undecodable) are counted exactly in the
/// metrics, but their warnings are rate-limited per subscriber (`BadFrameLog`):
/// a peer spraying garbage must not turn into a log flood.
///
/// # Bind or connect
///
/// The role comes from the engine's own endpoint ([`ZmqEndpoint::for_engine`]):
/// an engine that binds (a wildcard host such as `tcp://*:5557`, an IPv6
/// literal, `ipc://`) is dialled at the rule's engine host; an engine that
/// connects (any other `tcp://host:port`) is waited for on that host. A bound
/// subscriber listens on exactly what the address names: an IP literal as
/// written, a host name on each address it resolves to when the socket binds
/// (`tcp://localhost:P` → 127.0.0.1 and/or ::1, never 0.0.0.0), and every
/// interface only for a wildcard the address spells out (`tcp://*:P`,
/// `tcp://0.0.0.0:P`). The bound addresses are logged at `info`.
///
/// # Receive limits
///
/// `max_message_bytes` is enforced twice. The socket refuses a frame whose
/// header declares more than the limit, a multipart message whose parts would
/// add up to more, or one with more than [`MAX_MESSAGE_PARTS`] parts, on the
/// declared length before anything is buffered (`kvroute-zeromq`, this crate's
/// ZeroMQ dependency: zeromq 0.7.0 with the limits of
/// `vendor/kvroute-zeromq/PATCHES.md`): that peer's connection is closed and counted
/// in `oversized_peers_dropped` (and `oversized_frames`). A connected
/// subscriber then redials its engine; a bound one keeps listening. Messages
/// that fit are checked again here, exactly, before they reach the sink.
/// A peer that connects to a bound subscriber and does not complete the ZMTP
/// handshake within `handshake_timeout` (default 5 s) is disconnected.
///
/// ```no_run
/// use kvroute_engines::transport::{
///     Frame, FrameReport, FrameSink, SinkAction, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
/// };
///
/// struct Print;
/// impl FrameSink for Print {
///     fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
///         println!("seq {} ({} bytes)", frame.seq, frame.payload.len());
///         FrameReport::default()
///     }
///     fn on_connected(&mut self) -> SinkAction {
///         SinkAction::Replay { from_seq: 0 }
///     }
/// }
///
/// # async fn host() {
/// let config = ZmqSubscriberConfig::new(ZmqEndpoint::connect("tcp://10.0.0.7:5557"))
///     .replay_endpoint("tcp://10.0.0.7:5558");
/// let subscriber = ZmqSubscriber::new(config);
/// let metrics = subscriber.metrics();
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// // The host spawns it on its own runtime and keeps `stop` to end it.
/// let task = tokio::spawn(subscriber.run(Print, async move { let _ = stopped.await; }));
/// # let _ = (metrics, stop, task);
/// # }
/// ```
#[derive(Debug)]
pub struct ZmqSubscriber {
    config: ZmqSubscriberConfig,
    metrics: Arc<SubscriberMetrics>,
}

/// Per-connection state.
#[derive(Debug, Default)]
struct Connection {
    /// Live frames with seq in this range (first, last) were already delivered
    /// by a replay. Below its first they were not: a replay answering one
    /// forged high number must not swallow the live stream.
    replayed: Option<(u64, u64)>,
    /// Peers currently connected (a bound socket may see an old and a new engine
    /// process overlap).
    peers: u32,
}

enum Exit {
    Shutdown,
    Redial,
}

/// Why a dial or bind failed (logged, counted in `dial_failures`, retried).
#[derive(Debug, thiserror::Error)]
enum EstablishError {
    #[error(transparent)]
    Zmq(#[from] zeromq::ZmqError),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("resolving {host:?}: {source}")]
    Resolve {
        host: String,
        source: std::io::Error,
    },
}

impl ZmqSubscriber {
    /// A subscriber that has not started yet.
    #[must_use]
    pub fn new(config: ZmqSubscriberConfig) -> Self {
        Self {
            config,
            metrics: Arc::new(SubscriberMetrics::default()),
        }
    }

    /// Its metrics, live while it runs.
    #[must_use]
    pub fn metrics(&self) -> Arc<SubscriberMetrics> {
        Arc::clone(&self.metrics)
    }

    /// Runs until `shutdown` completes, then returns the sink.
    ///
    /// Never gives up on its own: dial failures, disconnects and bad frames are
    /// retried, counted and logged.
    pub async fn run<S, F>(self, mut sink: S, shutdown: F) -> S
    where
        S: FrameSink,
        F: Future<Output = ()>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = self.config.retry_initial;
        let mut rate = RateMeter::new(std::time::Instant::now());
        let mut bad_log = BadFrameLog::new(BAD_FRAME_BURST, BAD_FRAME_INTERVAL);
        loop {
            let mut socket = self.socket();
            let mut monitor = socket.monitor();
            let established = tokio::select! {
                () = &mut shutdown => return sink,
                r = self.establish(&mut socket) => r,
            };
            if let Err(e) = established {
                self.metrics.dial_failed();
                tracing::debug!(endpoint = %self.config.endpoint.address, error = %e,
                    retry_in = ?backoff, "zmq subscriber: dial/bind failed");
                drop(socket);
                tokio::select! {
                    () = &mut shutdown => return sink,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(self.config.retry_max);
                continue;
            }
            backoff = self.config.retry_initial;
            let mut conn = Connection::default();
            if self.config.endpoint.role == SocketRole::Connect {
                self.peer_connected(&mut sink, &mut conn).await;
            }
            let mut tick = tokio::time::interval(RateMeter::WINDOW);
            let exit = loop {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break Exit::Shutdown,
                    event = monitor.next() => match event {
                        Some(SocketEvent::Accepted(..)) => self.peer_connected(&mut sink, &mut conn).await,
                        Some(SocketEvent::AcceptFailed(e)) => {
                            // A peer refused during the handshake (e.g. an
                            // oversized READY command) never became a peer.
                            if e.is_limit_exceeded() {
                                self.peer_refused(&e, &mut bad_log);
                            } else {
                                tracing::debug!(endpoint = %self.config.endpoint.address,
                                    error = %e, "zmq subscriber: handshake failed");
                            }
                        }
                        Some(SocketEvent::Disconnected(_)) => {
                            conn.peers = conn.peers.saturating_sub(1);
                            if conn.peers == 0 {
                                self.metrics.set_connected(false);
                                sink.on_disconnected();
                                conn.replayed = None;
                            }
                            if self.config.endpoint.role == SocketRole::Connect {
                                break Exit::Redial;
                            }
                        }
                        Some(_) => {}
                        None => break Exit::Redial,
                    },
                    message = socket.recv() => match message {
                        Ok(message) => self.live_message(&message, &mut sink, &mut conn, &mut bad_log).await,
                        Err(e) => {
                            if e.is_limit_exceeded() {
                                self.peer_refused(&e, &mut bad_log);
                            } else {
                                tracing::debug!(error = %e, "zmq subscriber: receive error");
                            }
                            if self.config.endpoint.role == SocketRole::Connect {
                                if conn.peers > 0 {
                                    self.metrics.set_connected(false);
                                    sink.on_disconnected();
                                }
                                break Exit::Redial;
                            }
                        }
                    },
                    _ = tick.tick() => {
                        let now = Instant::now();
                        rate.tick(&self.metrics, now);
                        if let Some(summary) = bad_log.flush(now) {
                            summary.log(&self.config.endpoint.address);
                        }
                    }
                }
            };
            drop(socket);
            if let Exit::Shutdown = exit {
                self.metrics.set_connected(false);
                return sink;
            }
            tracing::info!(endpoint = %self.config.endpoint.address, "zmq subscriber: peer gone, redialing");
        }
    }

    fn socket(&self) -> SubSocket {
        let mut options = socket_options(self.config.max_message_bytes, self.config.dial_timeout);
        options.accept_handshake_timeout(self.config.handshake_timeout);
        SubSocket::with_options(options)
    }

    async fn establish(&self, socket: &mut SubSocket) -> Result<(), EstablishError> {
        socket.subscribe(&self.config.topic).await?;
        match self.config.endpoint.role {
            SocketRole::Connect => Ok(socket.connect(&self.config.endpoint.address).await?),
            SocketRole::Bind => {
                let addresses = self.bind_addresses().await?;
                for address in &addresses {
                    socket.bind(address).await?;
                }
                tracing::info!(endpoint = %self.config.endpoint.address, bound = ?addresses,
                    "zmq subscriber: listening");
                Ok(())
            }
        }
    }

    /// What a bound subscriber listens on: see the [`ZmqSubscriber`] docs.
    async fn bind_addresses(&self) -> Result<Vec<String>, EstablishError> {
        match self.config.endpoint.bind_target()? {
            BindTarget::Exact(address) | BindTarget::Wildcard(address) => Ok(vec![address]),
            BindTarget::Name { host, port } => {
                let resolved = tokio::net::lookup_host((host.as_str(), port))
                    .await
                    .map_err(|source| EstablishError::Resolve {
                        host: host.clone(),
                        source,
                    })?;
                Ok(resolved_bind_addresses(
                    &host,
                    port,
                    resolved.map(|a| a.ip()),
                )?)
            }
        }
    }

    /// A peer the socket closed for exceeding the receive limits.
    fn peer_refused(&self, error: &zeromq::ZmqError, bad_log: &mut BadFrameLog) {
        self.metrics.oversized_peer_dropped();
        let endpoint = &self.config.endpoint.address;
        if bad_log.admit(BadFrame::Oversized, Instant::now(), endpoint) {
            tracing::warn!(%endpoint, %error, limit = self.config.max_message_bytes,
                "zmq subscriber: peer dropped for an oversized frame or message (nothing buffered)");
        }
    }

    async fn peer_connected<S: FrameSink>(&self, sink: &mut S, conn: &mut Connection) {
        conn.peers += 1;
        self.metrics.set_connected(true);
        tracing::info!(endpoint = %self.config.endpoint.address, "zmq subscriber: connected");
        let action = sink.on_connected();
        self.act(action, sink, conn).await;
    }

    async fn live_message<S: FrameSink>(
        &self,
        message: &ZmqMessage,
        sink: &mut S,
        conn: &mut Connection,
        bad_log: &mut BadFrameLog,
    ) {
        let endpoint = &self.config.endpoint.address;
        let size: usize = message.iter().map(|f| f.len()).sum();
        if size > self.config.max_message_bytes {
            let seq = readable_seq(message);
            self.metrics.oversized(seq);
            if bad_log.admit(BadFrame::Oversized, Instant::now(), endpoint) {
                tracing::warn!(%endpoint, ?seq, size, limit = self.config.max_message_bytes,
                    "zmq subscriber: oversized message dropped");
            }
            return;
        }
        let (3, Some(topic), Some(seq), Some(payload)) = (
            message.len(),
            message.get(0),
            message.get(1),
            message.get(2),
        ) else {
            let seq = readable_seq(message);
            self.metrics.malformed(seq);
            if bad_log.admit(BadFrame::Malformed, Instant::now(), endpoint) {
                tracing::warn!(%endpoint, ?seq, frames = message.len(),
                    "zmq subscriber: message without [topic, seq, payload] dropped");
            }
            return;
        };
        let parsed = LiveMessage::parse(&[topic.as_ref(), seq.as_ref(), payload.as_ref()]);
        let Ok(LiveMessage {
            topic,
            seq,
            payload,
        }) = parsed
        else {
            let seq = readable_seq(message);
            self.metrics.malformed(seq);
            if bad_log.admit(BadFrame::Malformed, Instant::now(), endpoint) {
                tracing::warn!(%endpoint, ?seq, seq_bytes = message.get(1).map_or(0, |f| f.len()),
                    "zmq subscriber: malformed message dropped");
            }
            return;
        };
        if topic != self.config.topic.as_bytes() {
            self.metrics.other_topic();
            return;
        }
        if conn
            .replayed
            .is_some_and(|(first, last)| first <= seq && seq <= last)
        {
            self.metrics.replay_duplicate();
            return;
        }
        // The first live frame past the replay ends the dedupe window: a later
        // smaller seq is a restart, not a duplicate.
        conn.replayed = None;
        let report = sink.on_frame(Frame {
            topic,
            seq,
            payload,
            source: FrameSource::Live,
        });
        self.metrics.frame(seq, FrameSource::Live, &report);
        self.metrics.decoded(sink.decode_stats());
        if report.decode_error && bad_log.admit(BadFrame::Undecodable, Instant::now(), endpoint) {
            tracing::warn!(%endpoint, seq, len = payload.len(),
                "zmq subscriber: undecodable KV event payload dropped");
        }
        self.act(report.action, sink, conn).await;
    }

    async fn act<S: FrameSink>(&self, action: SinkAction, sink: &mut S, conn: &mut Connection) {
        let mut action = action;
        // A replay's end may prove a restart and ask for one more replay (from
        // 0); a third request in a row is not followed.
        for _ in 0..2 {
            let SinkAction::Replay { from_seq } = action else {
                return;
            };
            let outcome = match &self.config.replay_endpoint {
                Some(endpoint) => {
                    request_replay(
                        endpoint,
                        self.config.topic.as_bytes(),
                        from_seq,
                        self.config.replay_timeout,
                        self.config.max_message_bytes,
                        sink,
                        &self.metrics,
                    )
                    .await
                }
                // Every replay request gets exactly one `on_replay_done`, so a
                // sink that entered a replaying state leaves it.
                None => ReplayOutcome {
                    requested_from: from_seq,
                    ..ReplayOutcome::default()
                },
            };
            tracing::debug!(?outcome, "zmq subscriber: replay done");
            if let (Some(first), Some(last)) = (outcome.first_seq, outcome.last_seq) {
                conn.replayed = Some((first, last));
            }
            let report = sink.on_replay_done(&outcome);
            self.metrics.replay_end(&report);
            // A replay the sink asked for while replaying (a replayed batch
            // proved a restart) comes next, whatever the sink's end says.
            action = outcome
                .restart_from
                .map_or(report.action, |from_seq| SinkAction::Replay { from_seq });
        }
    }
}

/// Bad-frame warnings logged one by one per [`BAD_FRAME_INTERVAL`]; the rest of
/// that interval are summarised in one line.
const BAD_FRAME_BURST: u32 = 10;

/// Length of one bad-frame logging window.
const BAD_FRAME_INTERVAL: Duration = Duration::from_secs(10);

/// Why a message was dropped (the summary counts each kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BadFrame {
    Malformed = 0,
    Oversized = 1,
    Undecodable = 2,
}

/// Warnings a [`BadFrameLog`] held back during one window, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Suppressed {
    malformed: u64,
    oversized: u64,
    undecodable: u64,
    /// How long the window ran.
    over: Duration,
}

impl Suppressed {
    fn total(&self) -> u64 {
        self.malformed + self.oversized + self.undecodable
    }

    fn log(&self, endpoint: &str) {
        tracing::warn!(%endpoint, suppressed = self.total(), malformed = self.malformed,
            oversized = self.oversized, undecodable = self.undecodable, over = ?self.over,
            "zmq subscriber: further bad-message warnings suppressed (counted in the metrics)");
    }
}

/// Rate limit of one subscriber's bad-frame warnings: in each window of
/// `interval` the first `burst` are logged, the others only counted; the count
/// is logged in one summary line once the window is over (at the next bad frame
/// or the next [`BadFrameLog::flush`], whichever comes first). The metrics count
/// every frame regardless — this only decides what reaches the log.
#[derive(Debug)]
struct BadFrameLog {
    burst: u32,
    interval: Duration,
    window_start: Option<Instant>,
    logged: u32,
    held: [u64; 3],
}

impl BadFrameLog {
    fn new(burst: u32, interval: Duration) -> Self {
        Self {
            burst,
            interval,
            window_start: None,
            logged: 0,
            held: [0; 3],
        }
    }

    /// Records one bad frame at `now`: `true` when its warning should be logged.
    /// A summary of the previous window, if it held any back, is logged first.
    fn admit(&mut self, kind: BadFrame, now: Instant, endpoint: &str) -> bool {
        if let Some(summary) = self.flush(now) {
            summary.log(endpoint);
        }
        if self.window_start.is_none() {
            self.window_start = Some(now);
        }
        if self.logged < self.burst {
            self.logged += 1;
            return true;
        }
        if let Some(n) = self.held.get_mut(kind as usize) {
            *n = n.saturating_add(1);
        }
        false
    }

    /// Ends the window if `interval` has passed since it began, returning what it
    /// held back (`None` when the window is still open or held nothing).
    fn flush(&mut self, now: Instant) -> Option<Suppressed> {
        let start = self.window_start?;
        let over = now.saturating_duration_since(start);
        if over < self.interval {
            return None;
        }
        let [malformed, oversized, undecodable] = std::mem::take(&mut self.held);
        self.window_start = None;
        self.logged = 0;
        let summary = Suppressed {
            malformed,
            oversized,
            undecodable,
            over,
        };
        (summary.total() > 0).then_some(summary)
    }
}

/// Frame 1 as a sequence number when it is the 8-byte big-endian field.
fn readable_seq(message: &ZmqMessage) -> Option<u64> {
    let bytes: [u8; 8] = message.get(1)?.as_ref().try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_frame_log_logs_a_burst_then_one_summary_per_window() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut log = BadFrameLog::new(3, 10 * sec);
        let kinds = [
            BadFrame::Malformed,
            BadFrame::Oversized,
            BadFrame::Undecodable,
        ];
        // A flood of 100 frames within the first window: 3 logged, 97 held.
        let mut logged = 0;
        let mut held = [0u64; 3];
        for i in 0..100u32 {
            let kind = kinds[i as usize % 3];
            if log.admit(kind, t0 + Duration::from_millis(u64::from(i)), "ep") {
                logged += 1;
            } else {
                held[kind as usize] += 1;
            }
        }
        assert_eq!(logged, 3);
        assert_eq!(held.iter().sum::<u64>(), 97);
        // Nothing to summarise while the window is open.
        assert_eq!(log.flush(t0 + 9 * sec), None);
        // The window ends: one summary with exact per-kind counts.
        let summary = log.flush(t0 + 10 * sec).expect("summary");
        assert_eq!(
            [summary.malformed, summary.oversized, summary.undecodable],
            held
        );
        assert_eq!(summary.total(), 97);
        assert_eq!(summary.over, 10 * sec);
        // Said once.
        assert_eq!(log.flush(t0 + 20 * sec), None);
        // A new window logs a fresh burst.
        assert!(log.admit(BadFrame::Malformed, t0 + 30 * sec, "ep"));
    }

    #[test]
    fn bad_frame_log_without_overflow_has_nothing_to_summarise() {
        let t0 = Instant::now();
        let mut log = BadFrameLog::new(5, Duration::from_secs(1));
        for i in 0..5 {
            assert!(log.admit(BadFrame::Undecodable, t0 + Duration::from_millis(i), "ep"));
        }
        assert_eq!(log.flush(t0 + Duration::from_secs(2)), None);
    }

    proptest::proptest! {
        /// Against a model: every bad frame is either logged or counted in
        /// exactly one summary, and at most `burst` are logged per window.
        #[test]
        fn every_bad_frame_is_logged_or_summarised(
            burst in 0u32..5,
            steps in proptest::collection::vec((0u64..4000, 0usize..3, proptest::bool::ANY), 0..200),
        ) {
            let kinds = [BadFrame::Malformed, BadFrame::Oversized, BadFrame::Undecodable];
            let interval = Duration::from_millis(1000);
            let t0 = Instant::now();
            let mut log = BadFrameLog::new(burst, interval);
            let (mut now, mut logged, mut summarised, mut frames) = (t0, 0u64, 0u64, 0u64);
            let mut window: Option<(Instant, u32)> = None;
            for (advance_ms, kind, is_tick) in steps {
                now += Duration::from_millis(advance_ms);
                if is_tick {
                    if let Some(s) = log.flush(now) {
                        summarised += s.total();
                    }
                    continue;
                }
                frames += 1;
                // Model: windows start at the first bad frame after the last one ended.
                let in_window = match window {
                    Some((start, n)) if now.duration_since(start) < interval => Some((start, n)),
                    _ => None,
                };
                let (start, n) = in_window.unwrap_or((now, 0));
                let expect_log = n < burst;
                window = Some((start, if expect_log { n + 1 } else { n }));
                let before = log.held.iter().sum::<u64>();
                let flushed = log.window_start.is_some_and(|s| now.duration_since(s) >= interval);
                if flushed {
                    summarised += before;
                }
                proptest::prop_assert_eq!(log.admit(kinds[kind], now, "ep"), expect_log);
                if expect_log {
                    logged += 1;
                }
            }
            if let Some(s) = log.flush(now + interval) {
                summarised += s.total();
            }
            proptest::prop_assert_eq!(logged + summarised, frames);
        }
    }
}
