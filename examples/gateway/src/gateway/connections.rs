//! Connection hygiene of the gateway's listeners.
//!
//! - **First-byte deadline.** hyper's header timeout starts only once the HTTP/1
//!   connection exists, and `hyper_util`'s auto builder creates it only after it
//!   has read enough bytes to tell HTTP/1 from the HTTP/2 preface — with no
//!   timeout of its own. So a client that connects and never sends a byte (or
//!   sends `P` and stops) held a task and a descriptor forever. Here a new
//!   connection must send its first byte, and identify its protocol, within
//!   `limits.first_byte_timeout_ms` of being accepted; after that hyper's own
//!   header timeout (HTTP/1, also between keep-alive requests) takes over.
//! - **A cap on open connections** (`limits.max_connections` for the proxy,
//!   [`ADMIN_MAX_CONNECTIONS`] for the admin API), clamped to the process's
//!   descriptor limit ([`effective_cap`]: room for one upstream connection per
//!   client connection). At the cap a new connection first sheds the oldest
//!   connection that has not sent a byte yet (silent connections are what an
//!   attacker holds; a client that sent a request is never shed); if none is
//!   silent, the new one is refused with `503` and `Connection: close`.
//! - **Accept errors** (`EMFILE`, `ENFILE`, …) are counted, logged at most once
//!   per [`ACCEPT_LOG_INTERVAL`] with the count in between, and back off from
//!   10 ms doubling to 1 s instead of spinning.
//!
//! Every outcome is counted in [`ConnectionMetrics`] (exported on `/metrics`).

use std::collections::VecDeque;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// Open-connection cap of the admin listener (not configurable: a handful of
/// operators and one scraper; it keeps the admin API reachable while the proxy
/// listener is flooded).
pub const ADMIN_MAX_CONNECTIONS: usize = 64;

/// At most one accept-error warning per this interval; the others are counted.
pub const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// How long a connection arriving at the cap waits for the permit of the
/// silent connection it shed.
const SHED_WAIT: Duration = Duration::from_millis(200);

/// Refusals answered at once (the rest are closed without an answer): each
/// holds a descriptor for at most [`REFUSAL_LINGER`].
const MAX_REFUSALS_IN_FLIGHT: usize = 64;

/// How long a refused connection is kept to deliver its `503`.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The HTTP/2 connection preface; a client is identified once its bytes diverge
/// from it (HTTP/1) or it is complete (HTTP/2).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: text/plain\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 34\r\n\
\r\n\
kvroute: connection limit reached\n";

/// Connection counters of one listener.
#[derive(Debug, Default)]
pub struct ConnectionMetrics {
    /// Connections currently open (gauge).
    pub open: AtomicU64,
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Closed because no first byte (or no complete protocol preface) arrived
    /// within the first-byte timeout.
    pub first_byte_timeouts: AtomicU64,
    /// Silent connections closed to admit a new one at the cap.
    pub shed_idle: AtomicU64,
    /// New connections refused at the cap (503, or closed when too many
    /// refusals are in flight).
    pub refused: AtomicU64,
    /// `accept()` failures (e.g. `EMFILE`).
    pub accept_errors: AtomicU64,
    /// Closed because the client accepted no bytes of a response for the
    /// write-stall timeout (it stopped reading).
    pub write_stalls: AtomicU64,
    /// HTTP/2 connections closed after the idle timeout with no request in
    /// flight ([`super::idle`]).
    pub idle_closed: AtomicU64,
}

/// The soft and hard `RLIMIT_NOFILE` of this process, from `/proc/self/limits`
/// (`None` where it cannot be read).
#[must_use]
pub fn fd_limits() -> Option<(u64, Option<u64>)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut values = line.trim_start_matches("Max open files").split_whitespace();
    let soft = values.next()?.parse().ok()?;
    let hard = values.next().and_then(|v| v.parse().ok());
    Some((soft, hard))
}

/// Descriptors kept out of the connection budget: listeners, subscribers and
/// their sockets, tokenizer files, probes, the admin listener's connections.
pub const FD_RESERVE: u64 = 256;

/// The connection cap actually enforced: `configured`, lowered so that every
/// client connection can also hold one upstream connection (a request in
/// flight) within the soft descriptor limit, after [`FD_RESERVE`]:
/// `(soft − 256) / 2`. At the cap the process cannot run out of descriptors
/// (no `EMFILE` on accept).
#[must_use]
pub fn effective_cap(configured: usize, soft_fd_limit: Option<u64>) -> usize {
    let Some(soft) = soft_fd_limit else {
        return configured.max(1);
    };
    let room = usize::try_from(soft.saturating_sub(FD_RESERVE) / 2).unwrap_or(usize::MAX);
    configured.min(room).max(1)
}

/// Who may hold one of the `cap` connection slots, and which silent connection
/// to shed first.
pub struct Admission {
    permits: Arc<Semaphore>,
    refusals: Arc<Semaphore>,
    /// Connections that have not sent a byte yet, oldest first. A connection
    /// that got its first byte drops its receiver; its entry is skipped (and
    /// pruned) lazily.
    silent: Mutex<VecDeque<oneshot::Sender<()>>>,
    cap: usize,
}

impl Admission {
    /// Room for `cap` open connections.
    #[must_use]
    pub fn new(cap: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(cap)),
            refusals: Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT)),
            silent: Mutex::new(VecDeque::new()),
            cap,
        }
    }

    /// A slot for a new connection: a free one, or the one of the oldest
    /// silent connection (shed); `None` when every open connection has spoken.
    pub async fn admit(&self, metrics: &ConnectionMetrics) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() {
            return Some(permit);
        }
        if !self.shed_oldest() {
            return None;
        }
        metrics.shed_idle.fetch_add(1, Relaxed);
        tokio::time::timeout(SHED_WAIT, Arc::clone(&self.permits).acquire_owned())
            .await
            .ok()
            .and_then(Result::ok)
    }

    /// Registers a just-accepted connection as silent (call in accept order:
    /// the queue order decides who is shed first); the receiver fires when it
    /// is shed. Dropping the receiver (first byte seen) unregisters it.
    pub fn register_silent(&self) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut silent = self.silent.lock();
        if silent.len() >= 2 * self.cap {
            silent.retain(|s| !s.is_closed());
        }
        silent.push_back(tx);
        rx
    }

    fn shed_oldest(&self) -> bool {
        let mut silent = self.silent.lock();
        while let Some(tx) = silent.pop_front() {
            if tx.send(()).is_ok() {
                return true;
            }
        }
        false
    }

    /// Answers a connection refused at the cap with a `503` (best effort,
    /// bounded in count and time), or just closes it.
    pub fn refuse(&self, stream: TcpStream, metrics: &ConnectionMetrics) {
        metrics.refused.fetch_add(1, Relaxed);
        let Ok(slot) = Arc::clone(&self.refusals).try_acquire_owned() else {
            return;
        };
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tokio::time::timeout(REFUSAL_LINGER, refuse_politely(stream)).await;
        });
    }
}

async fn refuse_politely(mut stream: TcpStream) -> io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(REFUSAL).await?;
    stream.shutdown().await?;
    // Read what the client sent so closing does not reset the connection
    // before it has read the answer.
    let mut sink = [0u8; 4096];
    while stream.read(&mut sink).await? > 0 {}
    Ok(())
}

/// Why a connection ended before reaching hyper.
#[derive(Debug, PartialEq, Eq)]
pub enum Prelude {
    /// It sent a byte: serve it.
    Spoke,
    /// No byte within the timeout.
    TimedOut,
    /// Shed at the cap, or the listener stops.
    Closed,
}

/// Waits for a new connection's first byte, at most until `deadline`;
/// `shed` is its [`Admission::register_silent`] receiver.
pub async fn first_byte(
    stream: &TcpStream,
    shed: oneshot::Receiver<()>,
    deadline: tokio::time::Instant,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Prelude {
    // `peek`, not `readable`: readiness may be reported before any byte is
    // there (a false positive tokio documents), which would let a silent
    // connection through.
    let mut byte = [0u8; 1];
    // Shed first: a connection shed for a newcomer (whose admission waits
    // for this slot) gives it up even if its first byte arrived meanwhile.
    tokio::select! {
        biased;
        _ = shed => Prelude::Closed,
        _ = stop.changed() => Prelude::Closed,
        r = stream.peek(&mut byte) => match r {
            Ok(n) if n > 0 => Prelude::Spoke,
            _ => Prelude::Closed,
        },
        () = tokio::time::sleep_until(deadline) => Prelude::TimedOut,
    }
}

/// A client stream that must identify its protocol (first byte differing from
/// the HTTP/2 preface, or the complete preface) before a deadline, and must
/// keep accepting what the gateway writes: a write that makes no progress for
/// the write-stall timeout (a client that stopped reading, its TCP window
/// shut) fails, so the connection, its upstream request and its load charge
/// are released instead of held until the peer's TCP gives up. hyper stops
/// polling the response body while its writes wait, so no body-side timer
/// would see it.
pub struct PrefaceDeadline {
    inner: TcpStream,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    seen: usize,
    metrics: Arc<ConnectionMetrics>,
    write_stall: std::time::Duration,
    /// Since when writes have made no progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Told when the HTTP/2 preface is complete.
    activity: Option<super::idle::Activity>,
}

impl PrefaceDeadline {
    /// Wraps `inner`; the deadline is absolute (from accept).
    #[must_use]
    pub fn new(
        inner: TcpStream,
        deadline: tokio::time::Instant,
        metrics: Arc<ConnectionMetrics>,
    ) -> Self {
        Self {
            inner,
            deadline: Some(Box::pin(tokio::time::sleep_until(deadline))),
            seen: 0,
            metrics,
            write_stall: std::time::Duration::MAX,
            stalled: None,
            activity: None,
        }
    }

    /// Marks `activity` as HTTP/2 once the client's preface is complete.
    #[must_use]
    pub fn with_activity(mut self, activity: super::idle::Activity) -> Self {
        self.activity = Some(activity);
        self
    }

    /// Fails writes that make no progress for `stall`.
    #[must_use]
    pub fn with_write_stall(mut self, stall: std::time::Duration) -> Self {
        self.write_stall = stall;
        self
    }

    /// A write's outcome: progress clears the stall; waiting starts it, and
    /// waiting past the timeout fails.
    fn judge_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let Some(at) = tokio::time::Instant::now().checked_add(self.write_stall) else {
            return r; // no limit
        };
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
        if stalled.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            self.metrics.write_stalls.fetch_add(1, Relaxed);
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client accepted no bytes within the write-stall timeout",
            )));
        }
        r
    }

    fn observe(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if H2_PREFACE.get(self.seen) != Some(&b) {
                self.deadline = None; // HTTP/1: hyper's header timeout applies
                return;
            }
            self.seen += 1;
            if self.seen == H2_PREFACE.len() {
                self.deadline = None;
                if let Some(a) = &self.activity {
                    a.mark_h2();
                }
                return;
            }
        }
    }
}

impl AsyncRead for PrefaceDeadline {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if this.deadline.is_some() {
                    let new = buf.filled()[before..].to_vec();
                    this.observe(&new);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if let Some(deadline) = this.deadline.as_mut() {
                    if deadline.as_mut().poll(cx).is_ready() {
                        this.deadline = None;
                        this.metrics.first_byte_timeouts.fetch_add(1, Relaxed);
                        return Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no protocol preface before the first-byte timeout",
                        )));
                    }
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl AsyncWrite for PrefaceDeadline {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.judge_write(cx, r)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.judge_write(cx, r)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.judge_write(cx, r)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Rate limit of accept-error warnings: the first error of a window is logged,
/// the rest counted and reported with the next logged one.
#[derive(Debug, Default)]
pub struct AcceptErrorLog {
    window_start: Option<Instant>,
    suppressed: u64,
}

impl AcceptErrorLog {
    /// Records one error at `now`; `Some(suppressed since the last line)` when
    /// this one should be logged.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        match self.window_start {
            Some(start) if now.saturating_duration_since(start) < ACCEPT_LOG_INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.window_start = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// Back-off after accept errors: 10 ms doubling to 1 s, reset by a success.
#[derive(Debug)]
pub struct AcceptBackoff(Duration);

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self(Self::INITIAL)
    }
}

impl AcceptBackoff {
    const INITIAL: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    /// The pause before the next accept, doubling for the one after.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(Self::MAX);
        d
    }

    /// A successful accept.
    pub fn reset(&mut self) {
        self.0 = Self::INITIAL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_leaves_descriptor_headroom() {
        assert_eq!(effective_cap(10_000, Some(20_000)), 9_872);
        assert_eq!(effective_cap(5_000, Some(20_000)), 5_000);
        assert_eq!(effective_cap(10_000, Some(1024)), 384);
        assert_eq!(effective_cap(10_000, Some(100)), 1);
        assert_eq!(effective_cap(50, None), 50);
        assert_eq!(effective_cap(10_000, Some(1 << 20)), 10_000);
    }

    #[test]
    fn accept_errors_are_logged_once_per_window_with_the_count() {
        let t0 = Instant::now();
        let mut log = AcceptErrorLog::default();
        assert_eq!(log.admit(t0), Some(0));
        for i in 1..=35 {
            assert_eq!(log.admit(t0 + Duration::from_millis(i * 28)), None);
        }
        assert_eq!(log.admit(t0 + ACCEPT_LOG_INTERVAL), Some(35));
        assert_eq!(log.admit(t0 + ACCEPT_LOG_INTERVAL), None);
    }

    #[test]
    fn backoff_doubles_to_a_second_and_resets() {
        let mut b = AcceptBackoff::default();
        let seq: Vec<u64> = (0..9).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(seq, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(10));
    }

    #[test]
    fn the_preface_guard_disarms_on_http1_or_a_full_preface() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let _c = TcpStream::connect(addr).await.unwrap();
            let (s, _) = l.accept().await.unwrap();
            let m = Arc::new(ConnectionMetrics::default());
            let far = tokio::time::Instant::now() + Duration::from_secs(60);
            let mut g = PrefaceDeadline::new(s, far, Arc::clone(&m));
            g.observe(b"PRI * HT");
            assert!(g.deadline.is_some(), "a preface prefix keeps the deadline");
            g.observe(b"TP/2.0\r\n\r\nSM\r\n\r\n");
            assert!(g.deadline.is_none(), "the full preface disarms it");
            let (s2, _) = {
                let _c2 = TcpStream::connect(addr).await.unwrap();
                l.accept().await.unwrap()
            };
            let mut g = PrefaceDeadline::new(s2, far, m);
            g.observe(b"PUT / HTTP/1.1\r\n");
            assert!(g.deadline.is_none(), "a byte off the preface is HTTP/1");
        });
    }
}
