//! Idle and stalled connections.
//!
//! * **Idle HTTP/2.** hyper closes an idle HTTP/1 keep-alive connection
//!   itself (its header timeout runs while it waits for the next request),
//!   but has no idle limit for HTTP/2, whose keep-alive pings a live client
//!   answers forever: connections that spoke once and then sat idle would
//!   hold slots of the connection cap, which sheds only silent ones, until
//!   none were left. So an HTTP/2 connection with no request in flight for
//!   the same timeout (`limits.header_read_timeout_ms`) gets a GOAWAY and is
//!   closed, counted in `kvroute_connections_idle_closed_total`.
//! * **HTTP/2 flow-control stalls.** A client that stops reading a streamed
//!   HTTP/2 response stops granting window: hyper then holds the chunk it
//!   took and stops polling the body, no socket write waits (so the IO's
//!   write-stall timer never starts) and the upstream idle timer, which
//!   runs inside the body's poll, never fires. The response body here
//!   remembers when it last handed hyper a chunk without being polled
//!   since; a connection whose response has waited so for the write-stall
//!   timeout (`limits.upstream_idle_timeout_ms`) is closed, which drops its
//!   upstream request and load charge (`kvroute_connections_write_stalls_total`).
//! * **A connection that does not close after its GOAWAY.** A response hyper
//!   has handed over in full (its body ended, so its request no longer
//!   counts) can still sit in HTTP/2's send queue while the client grants no
//!   window, and the connection then never finishes closing. One closed
//!   gracefully (idle, or the server stopping) that still has not ended
//!   after the write-stall timeout with no request in flight is dropped,
//!   counted as a write stall.
//! * **Counting idle closes.** The idle timer can fire just as hyper accepts
//!   a request the service has not seen yet; such a connection is answered
//!   and closed, but it was not idle. `idle_closed` counts a connection when
//!   it ends after an idle GOAWAY with no request begun since.
//!
//! A request is in flight from the moment hyper hands it to the service until
//! its response body has been sent or dropped ([`Tracked`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use tokio::sync::Notify;

/// Requests in flight on one connection, and its protocol once known.
#[derive(Clone, Debug, Default)]
pub struct Activity(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    active: AtomicUsize,
    /// Requests ever begun on the connection.
    started: AtomicU64,
    /// Told when a request starts or ends, and when the preface completes.
    changed: Notify,
    h2: AtomicBool,
    /// Since when (µs after `origin`) a response body has handed out a
    /// chunk and not been polled again; [`NOT_HELD`] when none has.
    held_since_us: AtomicU64,
    origin: tokio::time::Instant,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            active: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            changed: Notify::new(),
            h2: AtomicBool::new(false),
            held_since_us: AtomicU64::new(NOT_HELD),
            origin: tokio::time::Instant::now(),
        }
    }
}

const NOT_HELD: u64 = u64::MAX;

impl Inner {
    fn now_us(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(NOT_HELD - 1)
    }
}

impl Activity {
    /// The client sent the complete HTTP/2 preface.
    pub fn mark_h2(&self) {
        self.0.h2.store(true, Ordering::Release);
        self.0.changed.notify_waiters();
    }

    /// A request starts; it ends when the guard drops.
    #[must_use]
    pub fn begin(&self) -> Active {
        self.0.active.fetch_add(1, Ordering::AcqRel);
        self.0.started.fetch_add(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
        Active(Arc::clone(&self.0))
    }

    /// Requests in flight now.
    fn active(&self) -> usize {
        self.0.active.load(Ordering::Acquire)
    }

    /// Requests ever begun.
    fn started(&self) -> u64 {
        self.0.started.load(Ordering::Acquire)
    }

    /// Resolves once an HTTP/2 connection has had no request in flight for
    /// `idle`; never for HTTP/1 (hyper's header timeout covers it).
    pub async fn idle_h2(&self, idle: Duration) {
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read: every change after the
            // read (a request starting or ending, the preface completing)
            // wakes this wait.
            changed.as_mut().enable();
            let idle_now =
                self.0.h2.load(Ordering::Acquire) && self.0.active.load(Ordering::Acquire) == 0;
            if !idle_now {
                changed.await;
                continue;
            }
            tokio::select! {
                // A change at the instant the timeout expires wins.
                biased;
                () = &mut changed => {}
                () = tokio::time::sleep(idle) => return,
            }
        }
    }

    /// Resolves once a response body has held a chunk hyper took without
    /// polling it again for `stall` (checked every quarter of it).
    pub async fn stalled(&self, stall: Duration) {
        let every = (stall / 4).max(Duration::from_millis(10));
        let stall_us = u64::try_from(stall.as_micros()).unwrap_or(NOT_HELD);
        loop {
            tokio::time::sleep(every).await;
            let since = self.0.held_since_us.load(Ordering::Acquire);
            if since != NOT_HELD && self.0.now_us().saturating_sub(since) >= stall_us {
                return;
            }
        }
    }
}

/// Serves `conn` until it ends. It is closed gracefully (a GOAWAY; HTTP/1
/// closes after its current response) once `stop` turns true or, over
/// HTTP/2, after `idle` with no request in flight; it is dropped, which
/// cancels its requests and so ends their upstream requests and load
/// charges, once a response has held a taken chunk for `write_stall`, or
/// when, closed gracefully, it has had no request in flight and still not
/// ended for `write_stall`.
pub async fn drive<C>(
    conn: C,
    activity: &Activity,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    metrics: &super::connections::ConnectionMetrics,
    idle: Duration,
    write_stall: Duration,
) where
    C: hyper_util::server::graceful::GracefulConnection,
    C::Error: std::fmt::Display,
{
    tokio::pin!(conn);
    let idle = activity.idle_h2(idle);
    tokio::pin!(idle);
    let stalled = activity.stalled(write_stall);
    tokio::pin!(stalled);
    let mut closing = false;
    // Requests begun when the idle GOAWAY went out.
    let mut idle_goaway: Option<u64> = None;
    // Armed when the connection starts closing.
    let linger = tokio::time::sleep(write_stall);
    tokio::pin!(linger);
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                if idle_goaway.is_some_and(|n| n == activity.started()) {
                    metrics.idle_closed.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            _ = stop.wait_for(|stopped| *stopped), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
                linger.as_mut().reset(tokio::time::Instant::now() + write_stall);
            }
            () = &mut idle, if !closing => {
                idle_goaway = Some(activity.started());
                conn.as_mut().graceful_shutdown();
                closing = true;
                linger.as_mut().reset(tokio::time::Instant::now() + write_stall);
            }
            () = &mut linger, if closing => {
                if activity.active() == 0 {
                    metrics.write_stalls.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("connection still open a write-stall timeout after its GOAWAY, \
                        with no request in flight; dropped");
                    return;
                }
                // Requests still running: their own stall check covers them.
                linger.as_mut().reset(tokio::time::Instant::now() + write_stall);
            }
            () = &mut stalled => {
                metrics.write_stalls.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("client took no response bytes for the write-stall timeout; connection closed");
                return;
            }
        }
    }
}

/// One request in flight (see [`Activity::begin`]).
#[derive(Debug)]
pub struct Active(Arc<Inner>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.held_since_us.store(NOT_HELD, Ordering::Release);
        self.0.active.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// A service whose requests count in an [`Activity`] until their response
/// bodies end or are dropped.
#[derive(Clone, Debug)]
pub struct Tracked<S> {
    inner: S,
    activity: Activity,
}

impl<S> Tracked<S> {
    /// Wraps `inner`, counting its requests in `activity`.
    pub fn new(inner: S, activity: Activity) -> Self {
        Self { inner, activity }
    }
}

impl<S, B> tower::Service<http::Request<B>> for Tracked<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let active = self.activity.begin();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let response = fut.await?;
            // The guard lives in the body: dropped when hyper has sent the
            // body's end, or gives the body up.
            Ok(response.map(|body| Body::new(InFlight { body, active })))
        })
    }
}

/// A response body in flight: keeps its request counted and notes when it
/// hands out a chunk and is not polled again (see the module docs).
struct InFlight {
    body: Body,
    active: Active,
}

impl hyper::body::Body for InFlight {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let inner = &self.active.0;
        inner.held_since_us.store(NOT_HELD, Ordering::Release);
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &polled {
            let inner = &self.active.0;
            inner.held_since_us.store(inner.now_us(), Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real time, lower bounds only: a correct wait never resolves early.
    #[tokio::test]
    async fn an_idle_h2_connection_resolves_after_the_timeout_and_http1_never() {
        let a = Activity::default();
        let idle = Duration::from_millis(200);
        // HTTP/1: never.
        assert!(
            tokio::time::timeout(Duration::from_millis(600), a.idle_h2(idle))
                .await
                .is_err()
        );
        a.mark_h2();
        let guard = a.begin();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.idle_h2(idle).await })
        };
        // A request in flight for three timeouts: not idle.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!waiter.is_finished());
        drop(guard);
        // A request starting and ending inside the window restarts it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(a.begin());
        let last_change = tokio::time::Instant::now();
        waiter.await.unwrap();
        assert!(last_change.elapsed() >= idle, "{:?}", last_change.elapsed());
    }
}
