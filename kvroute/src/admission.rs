//! Admission control for prompt tokenization: a bound on the tokenizations
//! running at once and on the request bytes they hold.
//!
//! Tokenizing is a router's costliest per-request work in memory, not only
//! in CPU: the `tokenizers` crate keeps offsets and alignments per character,
//! so one 1 M-character prompt peaks near 280 MB (measured in RELIABILITY.md,
//! attack 8). Without a bound, N parallel long prompts cost N times that: the
//! blocking pool alone does not bound it (tokio allows 512 blocking threads).
//! A request that finds no room either skips KV routing at once (it is still
//! routed by the rule's fallback and counted as a `tokenize_overloaded` miss)
//! or waits up to a bound first ([`TokenizeOverload`]).
//!
//! [`crate::KvRouter`] applies one of these to every [`crate::KvRouter::pick`]
//! (knobs on [`crate::KvRouterBuilder`]); a host that tokenizes by itself can
//! use the type directly.
//!
//! The state is a pair of counters and the queue of waiting requests behind
//! one lock (exact: no transient over-admission or spurious refusal between
//! the two). A release hands its room to the waiters it fits, in arrival
//! order, and wakes only those: under overload a release costs one wake-up,
//! not one per waiting request. A waiter that gives up is marked, not
//! searched for, and the marked ones are swept out once they are half the
//! queue: a burst of give-ups (every client of an overload timing out
//! together) costs time linear in the waiters, not quadratic, under the lock. Nothing here reads a clock or spawns: the
//! caller passes the give-up future ([`TokenizeAdmission::admit_within`]),
//! so the same type serves tests, the facade and any other host.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute::admission::{AdmissionLimits, TokenizeAdmission};
//!
//! let adm = Arc::new(TokenizeAdmission::new(AdmissionLimits { max_count: 2, max_bytes: 100 }));
//! let a = adm.admit_now(60).expect("room");
//! // 60 + 60 > 100 bytes: refused (and counted) although a slot is free.
//! assert!(adm.admit_now(60).is_none());
//! drop(a); // the permit gives its room back
//! let b = adm.admit_now(60).expect("room again");
//! let s = adm.snapshot();
//! assert_eq!((s.in_flight, s.bytes_in_flight, s.admitted, s.overloaded), (1, 60, 2, 1));
//! # drop(b);
//! ```
//!
//! The reference model the bounds are checked against: the property test in
//! this module.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// What a request does when tokenization is at its bound (the gateway's
/// `limits.tokenize_overload`; [`crate::KvRouterBuilder::tokenize_overload`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizeOverload {
    /// Skip KV routing at once: the rule's fallback picks the endpoint and the
    /// request counts as a `tokenize_overloaded` miss.
    Skip,
    /// Wait up to a bound for room (the gateway's `limits.tokenize_wait_ms`;
    /// [`crate::KvRouterBuilder::tokenize_wait`]), then skip. The default: with
    /// the count bound at the CPU count, a burst of ordinary prompts would
    /// otherwise lose KV routing for want of a few milliseconds.
    #[default]
    Wait,
}

/// The configured bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Tokenizations running at once.
    pub max_count: usize,
    /// Request-body bytes being parsed and tokenized at once. A body larger
    /// than this is charged this much, so it runs only alone.
    pub max_bytes: usize,
}

#[derive(Debug, Default)]
struct InFlight {
    count: usize,
    bytes: usize,
    /// Requests waiting for room, in arrival order, including those that
    /// gave up since the last sweep (their channel is closed).
    waiters: VecDeque<Waiter>,
    /// Waiters in `waiters` that gave up.
    abandoned: usize,
}

/// Gave-up waiters tolerated in the queue before a sweep, below half of it.
const SWEEP_FLOOR: usize = 32;

impl InFlight {
    /// Requests waiting now.
    fn waiting(&self) -> usize {
        self.waiters.len() - self.abandoned.min(self.waiters.len())
    }
}

/// A request waiting in [`TokenizeAdmission::admit_within`]: a release that
/// makes room for its charge sends it the permit.
#[derive(Debug)]
struct Waiter {
    bytes: usize,
    grant: oneshot::Sender<TokenizePermit>,
}

/// Counters and gauges of one [`TokenizeAdmission`] (what a host exports:
/// the gateway's `/metrics` and `/admin/counters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AdmissionSnapshot {
    /// The configured bound on concurrent tokenizations.
    pub max_concurrent: usize,
    /// The configured bound on bytes in flight.
    pub max_bytes_in_flight: usize,
    /// Tokenizations running now.
    pub in_flight: usize,
    /// Bytes charged by the running tokenizations.
    pub bytes_in_flight: usize,
    /// Requests waiting for room now ([`TokenizeOverload::Wait`]).
    pub waiting: usize,
    /// Most tokenizations ever running at once.
    pub peak_in_flight: usize,
    /// Most bytes ever charged at once.
    pub peak_bytes_in_flight: usize,
    /// Requests admitted (at once or after waiting).
    pub admitted: u64,
    /// Of those, admitted only after waiting for a release.
    pub admitted_after_wait: u64,
    /// Requests that found no room (in time) and skipped KV routing.
    pub overloaded: u64,
}

/// Bounds concurrent tokenizations and their bytes; hands out
/// [`TokenizePermit`]s released on drop.
#[derive(Debug)]
pub struct TokenizeAdmission {
    limits: AdmissionLimits,
    in_flight: Mutex<InFlight>,
    peak: Mutex<(usize, usize)>,
    admitted: AtomicU64,
    admitted_after_wait: AtomicU64,
    overloaded: AtomicU64,
}

/// Room for one tokenization; gives it back when dropped (also when the task
/// holding it panics or the client goes away mid-tokenization).
#[derive(Debug)]
pub struct TokenizePermit {
    /// `None` once its room went back (a grant nobody received).
    admission: Option<Arc<TokenizeAdmission>>,
    bytes: usize,
}

impl Drop for TokenizePermit {
    fn drop(&mut self) {
        let Some(admission) = self.admission.take() else {
            return;
        };
        let mut f = admission.in_flight.lock();
        f.count = f.count.saturating_sub(1);
        f.bytes = f.bytes.saturating_sub(self.bytes);
        admission.grant_waiters(&mut f);
    }
}

impl TokenizeAdmission {
    /// An admission with these bounds (a zero bound is raised to 1: the
    /// configuration refuses zeros, and 0 would refuse every request).
    #[must_use]
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits: AdmissionLimits {
                max_count: limits.max_count.max(1),
                max_bytes: limits.max_bytes.max(1),
            },
            in_flight: Mutex::new(InFlight::default()),
            peak: Mutex::new((0, 0)),
            admitted: AtomicU64::new(0),
            admitted_after_wait: AtomicU64::new(0),
            overloaded: AtomicU64::new(0),
        }
    }

    /// The bytes a body of `len` bytes is charged.
    #[must_use]
    pub fn charge(&self, len: usize) -> usize {
        len.min(self.limits.max_bytes)
    }

    /// A permit if there is room now, without counting a refusal (the
    /// caller has another way in).
    pub(crate) fn try_take(self: &Arc<Self>, len: usize) -> Option<TokenizePermit> {
        let bytes = self.charge(len);
        let mut f = self.in_flight.lock();
        self.take_locked(&mut f, bytes)
    }

    /// Charges `bytes` (already [`Self::charge`]d) if they fit, under the lock.
    fn take_locked(self: &Arc<Self>, f: &mut InFlight, bytes: usize) -> Option<TokenizePermit> {
        if f.count >= self.limits.max_count || f.bytes + bytes > self.limits.max_bytes {
            return None;
        }
        f.count += 1;
        f.bytes += bytes;
        {
            let mut p = self.peak.lock();
            p.0 = p.0.max(f.count);
            p.1 = p.1.max(f.bytes);
        }
        self.admitted.fetch_add(1, Ordering::Relaxed);
        Some(TokenizePermit {
            admission: Some(Arc::clone(self)),
            bytes,
        })
    }

    /// After a release, under the lock: hands a permit to each waiter, in
    /// arrival order, whose charge now fits (a smaller one behind a larger
    /// one that does not fit goes first), and drops the waiters that went
    /// away. Only the waiters granted are woken.
    fn grant_waiters(self: &Arc<Self>, f: &mut InFlight) {
        let mut i = 0;
        while i < f.waiters.len() && f.count < self.limits.max_count {
            let (closed, bytes) = match f.waiters.get(i) {
                Some(w) => (w.grant.is_closed(), w.bytes),
                None => break,
            };
            if closed {
                f.waiters.remove(i);
                f.abandoned = f.abandoned.saturating_sub(1);
                continue;
            }
            if f.bytes + bytes > self.limits.max_bytes {
                i += 1;
                continue;
            }
            // Out of the queue before the permit exists: no permit is ever
            // dropped here, under the lock its drop takes.
            let Some(w) = f.waiters.remove(i) else {
                break;
            };
            let Some(permit) = self.take_locked(f, w.bytes) else {
                break;
            };
            match w.grant.send(permit) {
                Ok(()) => {
                    self.admitted_after_wait.fetch_add(1, Ordering::Relaxed);
                }
                Err(mut unreceived) => {
                    // The waiter went away just now: its room goes back here,
                    // under the lock this drop would otherwise take again.
                    unreceived.admission = None;
                    f.count = f.count.saturating_sub(1);
                    f.bytes = f.bytes.saturating_sub(bytes);
                    self.admitted.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// A permit for a body of `len` bytes if there is room now; otherwise
    /// `None`, counted as overloaded.
    pub fn admit_now(self: &Arc<Self>, len: usize) -> Option<TokenizePermit> {
        let p = self.try_take(len);
        if p.is_none() {
            self.overloaded.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    /// A permit for a body of `len` bytes, waiting for releases until
    /// `give_up` completes; then `None`, counted as overloaded. Waiters queue
    /// in arrival order, and a release hands its room to those it fits: a
    /// larger body waiting ahead does not hold back a smaller one that fits,
    /// so it can wait until its `give_up` (which bounds the wait).
    pub async fn admit_within<G: Future<Output = ()>>(
        self: &Arc<Self>,
        len: usize,
        give_up: G,
    ) -> Option<TokenizePermit> {
        let bytes = self.charge(len);
        let granted = {
            let mut f = self.in_flight.lock();
            if let Some(p) = self.take_locked(&mut f, bytes) {
                return Some(p);
            }
            let (tx, rx) = oneshot::channel();
            f.waiters.push_back(Waiter { bytes, grant: tx });
            rx
        };
        // Leaves the queue however the wait ends (a dropped future included).
        let mut queued = Queued {
            admission: self,
            granted: Some(granted),
        };
        let mut give_up = std::pin::pin!(give_up);
        // A grant is checked before the deadline: room freed at the
        // deadline's instant is still taken.
        let got = std::future::poll_fn(|cx| {
            if let Some(granted) = queued.granted.as_mut() {
                if let std::task::Poll::Ready(got) = std::pin::Pin::new(granted).poll(cx) {
                    return std::task::Poll::Ready(got.ok());
                }
            }
            give_up.as_mut().poll(cx).map(|()| None)
        })
        .await;
        if got.is_some() {
            queued.granted = None;
            return got;
        }
        // Granted while giving up: the permit is in the channel.
        let got = queued.leave(true);
        if got.is_none() {
            self.overloaded.fetch_add(1, Ordering::Relaxed);
        }
        got
    }

    /// A permit for a body of `len` bytes under `overload`: at once or not at
    /// all ([`TokenizeOverload::Skip`]), or waiting up to `wait`
    /// ([`TokenizeOverload::Wait`]) — what every host applies per request.
    pub async fn admit(
        self: &Arc<Self>,
        len: usize,
        overload: TokenizeOverload,
        wait: std::time::Duration,
    ) -> Option<TokenizePermit> {
        match overload {
            TokenizeOverload::Skip => self.admit_now(len),
            TokenizeOverload::Wait => self.admit_within(len, tokio::time::sleep(wait)).await,
        }
    }

    /// Current counters and gauges.
    #[must_use]
    pub fn snapshot(&self) -> AdmissionSnapshot {
        let (in_flight, bytes_in_flight, waiting) = {
            let f = self.in_flight.lock();
            (f.count, f.bytes, f.waiting())
        };
        let (peak_in_flight, peak_bytes_in_flight) = *self.peak.lock();
        AdmissionSnapshot {
            max_concurrent: self.limits.max_count,
            max_bytes_in_flight: self.limits.max_bytes,
            in_flight,
            bytes_in_flight,
            waiting,
            peak_in_flight,
            peak_bytes_in_flight,
            admitted: self.admitted.load(Ordering::Relaxed),
            admitted_after_wait: self.admitted_after_wait.load(Ordering::Relaxed),
            overloaded: self.overloaded.load(Ordering::Relaxed),
        }
    }
}

/// A waiter's place in the queue (the receiving end of its grant), left
/// when dropped.
struct Queued<'a> {
    admission: &'a Arc<TokenizeAdmission>,
    /// `None` once the wait is over.
    granted: Option<oneshot::Receiver<TokenizePermit>>,
}

impl Queued<'_> {
    /// Ends the wait: the permit a release granted meanwhile if `keep`
    /// (otherwise its room goes back and its grant is not counted),
    /// else the waiter is marked as gone. Under the lock grants are sent,
    /// so the channel is read and closed with nothing in flight.
    fn leave(&mut self, keep: bool) -> Option<TokenizePermit> {
        let mut granted = self.granted.take()?;
        let a = self.admission;
        let mut f = a.in_flight.lock();
        match granted.try_recv() {
            Ok(permit) if keep => Some(permit),
            Ok(mut permit) => {
                // Granted, never received (the future was dropped): the
                // room goes to the next waiters, and the grant is not
                // counted as an admission.
                permit.admission = None;
                f.count = f.count.saturating_sub(1);
                f.bytes = f.bytes.saturating_sub(permit.bytes);
                a.admitted.fetch_sub(1, Ordering::Relaxed);
                a.admitted_after_wait.fetch_sub(1, Ordering::Relaxed);
                a.grant_waiters(&mut f);
                None
            }
            Err(oneshot::error::TryRecvError::Closed) => None,
            Err(oneshot::error::TryRecvError::Empty) => {
                // Still queued: closing the channel marks the waiter, which
                // releases skip and sweeps remove.
                drop(granted);
                f.abandoned += 1;
                if f.abandoned > SWEEP_FLOOR && f.abandoned * 2 > f.waiters.len() {
                    f.waiters.retain(|w| !w.grant.is_closed());
                    f.abandoned = 0;
                }
                None
            }
        }
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let _ = self.leave(false);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn adm(max_count: usize, max_bytes: usize) -> Arc<TokenizeAdmission> {
        Arc::new(TokenizeAdmission::new(AdmissionLimits {
            max_count,
            max_bytes,
        }))
    }

    #[test]
    fn count_and_bytes_both_bound_and_drop_releases() {
        let a = adm(2, 100);
        let p1 = a.admit_now(40).unwrap();
        let p2 = a.admit_now(40).unwrap();
        // Count bound: 80 bytes would fit, a third permit does not.
        assert!(a.admit_now(1).is_none());
        drop(p2);
        // Byte bound: 40 + 70 > 100 with one slot free.
        assert!(a.admit_now(70).is_none());
        let p3 = a.admit_now(60).unwrap();
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.bytes_in_flight), (2, 100));
        assert_eq!((s.admitted, s.overloaded), (3, 2));
        drop((p1, p3));
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.bytes_in_flight), (0, 0));
        assert_eq!((s.peak_in_flight, s.peak_bytes_in_flight), (2, 100));
    }

    #[test]
    fn a_body_over_the_byte_bound_runs_alone() {
        let a = adm(4, 100);
        let big = a.admit_now(1_000).unwrap();
        assert_eq!(big.bytes, 100);
        assert!(a.admit_now(1).is_none());
        drop(big);
        let small = a.admit_now(1).unwrap();
        // … and not beside anything else.
        assert!(a.admit_now(1_000).is_none());
        drop(small);
    }

    #[tokio::test]
    async fn a_waiter_gets_the_released_room_and_gives_up_on_time() {
        let a = adm(1, 100);
        let held = a.admit_now(10).unwrap();
        // Nothing is released: the give-up future ends the wait.
        let none = a.admit_within(10, std::future::ready(())).await;
        assert!(none.is_none());
        assert_eq!(a.snapshot().overloaded, 1);
        let a2 = Arc::clone(&a);
        let waiter = tokio::spawn(async move {
            a2.admit_within(10, tokio::time::sleep(Duration::from_secs(60)))
                .await
                .map(|p| p.bytes)
        });
        // The waiter is parked on the lock-held count; releasing wakes it.
        tokio::task::yield_now().await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Some(10));
        let s = a.snapshot();
        assert_eq!(s.overloaded, 1);
        assert_eq!((s.admitted, s.admitted_after_wait), (2, 1));
        assert_eq!(s.in_flight, 0);
    }

    /// A future that counts how often it is polled.
    struct Polls<F> {
        inner: std::pin::Pin<Box<F>>,
        polls: Arc<AtomicU64>,
    }

    impl<F: Future> Future for Polls<F> {
        type Output = F::Output;
        fn poll(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<F::Output> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            self.inner.as_mut().poll(cx)
        }
    }

    /// Under overload a release wakes the waiter it admits, not every
    /// waiter (each would retry, and all but one fail again); a smaller body
    /// that fits goes ahead of a larger one that does not; a waiter that gives
    /// up leaves the queue, and one dropped while waiting gives nothing back
    /// twice.
    #[tokio::test]
    async fn a_release_wakes_only_the_waiters_it_admits() {
        let a = adm(1, 100);
        let held = a.admit_now(10).unwrap();
        let polls = Arc::new(AtomicU64::new(0));
        let mut waiters = Vec::new();
        for i in 0..50 {
            let (a2, polls) = (Arc::clone(&a), Arc::clone(&polls));
            waiters.push(tokio::spawn(Polls {
                // The permit is held (returned), so one release admits one.
                inner: Box::pin(async move {
                    a2.admit_within(10 + i, tokio::time::sleep(Duration::from_secs(60)))
                        .await
                }),
                polls,
            }));
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let parked = polls.load(Ordering::Relaxed);
        assert_eq!(parked, 50, "each waiter polled once, then parked");
        drop(held);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(polls.load(Ordering::Relaxed) - parked, 1, "one wake-up");
        let first = waiters.remove(0).await.unwrap();
        assert_eq!(
            first.as_ref().map(|p| p.bytes),
            Some(10),
            "the first waiter"
        );
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.admitted_after_wait), (1, 1));
        assert_eq!(a.in_flight.lock().waiting(), 49);
        // Waiters that go away leave the queue; the room they never got is
        // not given back twice.
        for w in &waiters {
            w.abort();
        }
        for w in waiters {
            let _ = w.await;
        }
        assert_eq!(a.in_flight.lock().waiting(), 0);
        drop(first);
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.bytes_in_flight), (0, 0));
        let again = a.admit_now(100).expect("all the room is free");
        drop(again);
    }

    /// A waiter granted room but dropped before it ran (its client went
    /// away): the room goes back, to the next waiter if one fits, and the
    /// grant counts as no admission.
    #[test]
    fn a_grant_nobody_received_is_not_an_admission() {
        let a = adm(1, 100);
        let held = a.admit_now(10).unwrap();
        let a2 = Arc::clone(&a);
        let mut gone: Waiting =
            Box::pin(async move { a2.admit_within(10, std::future::pending()).await });
        assert!(poll_once(&mut gone).is_none());
        let a3 = Arc::clone(&a);
        let mut next: Waiting =
            Box::pin(async move { a3.admit_within(20, std::future::pending()).await });
        assert!(poll_once(&mut next).is_none());
        // The release grants the first waiter, which is dropped unpolled.
        drop(held);
        drop(gone);
        let s = a.snapshot();
        assert_eq!((s.admitted, s.admitted_after_wait), (2, 1), "{s:?}");
        let permit = poll_once(&mut next).flatten().expect("the room passed on");
        assert_eq!(permit.bytes, 20);
        drop(permit);
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.bytes_in_flight, s.waiting), (0, 0, 0));
    }

    /// Every waiter of an overload giving up at once: each leaves in
    /// constant time (marked, swept in bulk), and the queue never holds
    /// more than the waiters still waiting plus a bounded number of marks.
    #[test]
    fn a_burst_of_give_ups_is_swept() {
        let a = adm(1, 100);
        let held = a.admit_now(10).unwrap();
        let mut waiting: Vec<Waiting> = (0..1_000)
            .map(|_| {
                let a2 = Arc::clone(&a);
                let mut w: Waiting =
                    Box::pin(async move { a2.admit_within(10, std::future::pending()).await });
                assert!(poll_once(&mut w).is_none());
                w
            })
            .collect();
        assert_eq!(a.snapshot().waiting, 1_000);
        while waiting.len() > 10 {
            drop(waiting.pop());
            let f = a.in_flight.lock();
            assert_eq!(f.waiting(), waiting.len());
            assert!(
                f.waiters.len() <= (2 * waiting.len()).max(waiting.len() + SWEEP_FLOOR),
                "{} queued for {} waiting",
                f.waiters.len(),
                waiting.len()
            );
        }
        // The ten left are served in arrival order as room comes back.
        drop(held);
        let first = poll_once(&mut waiting[0]).flatten().expect("granted");
        assert!(poll_once(&mut waiting[1]).is_none());
        drop(first);
        let second = poll_once(&mut waiting[1]).flatten().expect("granted");
        let s = a.snapshot();
        assert_eq!((s.waiting, s.admitted_after_wait), (8, 2), "{s:?}");
        drop(second);
    }

    #[tokio::test]
    async fn a_smaller_body_that_fits_goes_ahead_of_a_larger_one() {
        let a = adm(3, 100);
        let (first, second) = (a.admit_now(50).unwrap(), a.admit_now(40).unwrap());
        let (a1, a2) = (Arc::clone(&a), Arc::clone(&a));
        let large = tokio::spawn(async move {
            a1.admit_within(70, tokio::time::sleep(Duration::from_secs(60)))
                .await
                .map(|p| p.bytes)
        });
        tokio::task::yield_now().await;
        let small = tokio::spawn(async move {
            a2.admit_within(30, tokio::time::sleep(Duration::from_secs(60)))
                .await
                .map(|p| p.bytes)
        });
        tokio::task::yield_now().await;
        // 40 back: 50 + 70 does not fit, 50 + 30 does.
        drop(second);
        assert_eq!(small.await.unwrap(), Some(30));
        assert!(!large.is_finished());
        drop(first);
        assert_eq!(large.await.unwrap(), Some(70));
        let s = a.snapshot();
        assert_eq!((s.in_flight, s.admitted_after_wait), (0, 2));
        assert_eq!(a.in_flight.lock().waiting(), 0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Admit(usize),
        Release(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..150).prop_map(Op::Admit),
            (0usize..8).prop_map(Op::Release),
        ]
    }

    #[derive(Clone, Debug)]
    enum QueueOp {
        Admit(usize),
        Wait(usize),
        /// A permit released, then every waiter polled.
        Release(usize),
        /// A permit released, no waiter polled: a waiter granted room may
        /// then go away before it ever runs.
        ReleaseQuietly(usize),
        Leave(usize),
    }

    fn queue_op() -> impl Strategy<Value = QueueOp> {
        prop_oneof![
            (0usize..150).prop_map(QueueOp::Admit),
            (0usize..150).prop_map(QueueOp::Wait),
            (0usize..8).prop_map(QueueOp::Release),
            (0usize..8).prop_map(QueueOp::ReleaseQuietly),
            (0usize..8).prop_map(QueueOp::Leave),
        ]
    }

    type Waiting = std::pin::Pin<Box<dyn Future<Output = Option<TokenizePermit>>>>;

    /// Polls a waiter once (its give-up never comes).
    fn poll_once(w: &mut Waiting) -> Option<Option<TokenizePermit>> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match w.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(p) => Some(p),
            std::task::Poll::Pending => None,
        }
    }

    /// The reference queue: charges held (granted or not yet received) and
    /// waiting, in arrival order, and the admissions counted.
    #[derive(Default)]
    struct QueueModel {
        max_count: usize,
        max_bytes: usize,
        held: Vec<(usize, usize)>,
        queue: Vec<(usize, usize)>,
        /// Granted, not yet received by its waiter.
        granted: Vec<usize>,
        admitted: u64,
        after_wait: u64,
    }

    impl QueueModel {
        fn fits(&self, charge: usize) -> bool {
            self.held.len() < self.max_count
                && self.held.iter().map(|h| h.1).sum::<usize>() + charge <= self.max_bytes
        }

        /// Grants, in arrival order, every waiter whose charge now fits.
        fn grant(&mut self) {
            let mut k = 0;
            while k < self.queue.len() {
                if self.fits(self.queue[k].1) {
                    let w = self.queue.remove(k);
                    self.granted.push(w.0);
                    self.held.push(w);
                    self.admitted += 1;
                    self.after_wait += 1;
                } else {
                    k += 1;
                }
            }
        }
    }

    proptest! {
        /// Waiters against a reference model (a FIFO of waiting charges): a
        /// release admits, in arrival order, every waiter whose charge then
        /// fits, and no other; a waiter that leaves is never admitted, and
        /// one that leaves after a grant it never received gives the room
        /// on and counts as no admission; the gauges and counters equal the
        /// model's.
        #[test]
        fn waiters_match_a_reference_queue(
            max_count in 1usize..4,
            max_bytes in 1usize..200,
            ops in proptest::collection::vec(queue_op(), 0..80),
        ) {
            let a = adm(max_count, max_bytes);
            // (model id, permit) received; (model id, future) waiting.
            let mut held: Vec<(usize, TokenizePermit)> = Vec::new();
            let mut waiting: Vec<(usize, Waiting)> = Vec::new();
            let mut m = QueueModel { max_count, max_bytes, ..QueueModel::default() };
            let mut refused = 0u64;
            for (id, o) in ops.into_iter().enumerate() {
                match o {
                    QueueOp::Admit(len) => {
                        let charge = len.min(max_bytes);
                        let got = a.admit_now(len);
                        prop_assert_eq!(got.is_some(), m.fits(charge));
                        match got {
                            Some(p) => {
                                held.push((id, p));
                                m.held.push((id, charge));
                                m.admitted += 1;
                            }
                            None => refused += 1,
                        }
                    }
                    QueueOp::Wait(len) => {
                        let charge = len.min(max_bytes);
                        let a2 = Arc::clone(&a);
                        let mut w: Waiting =
                            Box::pin(async move { a2.admit_within(len, std::future::pending()).await });
                        let now = m.fits(charge);
                        match poll_once(&mut w) {
                            Some(Some(p)) => {
                                prop_assert!(m.fits(charge));
                                held.push((id, p));
                                m.held.push((id, charge));
                                m.admitted += 1;
                            }
                            Some(None) => prop_assert!(false, "gave up without a give-up"),
                            None => {
                                prop_assert!(!now);
                                waiting.push((id, w));
                                m.queue.push((id, charge));
                            }
                        }
                    }
                    QueueOp::Release(i) | QueueOp::ReleaseQuietly(i) => {
                        if !held.is_empty() {
                            let i = i % held.len();
                            let (gone, permit) = held.swap_remove(i);
                            drop(permit);
                            m.held.retain(|h| h.0 != gone);
                            m.grant();
                            if matches!(o, QueueOp::Release(_)) {
                                let mut k = 0;
                                while k < waiting.len() {
                                    match poll_once(&mut waiting[k].1) {
                                        Some(Some(p)) => {
                                            let (id, _) = waiting.remove(k);
                                            m.granted.retain(|g| *g != id);
                                            held.push((id, p));
                                        }
                                        Some(None) => prop_assert!(false, "gave up without a give-up"),
                                        None => k += 1,
                                    }
                                }
                            }
                        }
                    }
                    QueueOp::Leave(i) => {
                        if !waiting.is_empty() {
                            let i = i % waiting.len();
                            let (id, w) = waiting.remove(i);
                            drop(w);
                            if m.granted.contains(&id) {
                                m.granted.retain(|g| *g != id);
                                m.held.retain(|h| h.0 != id);
                                m.admitted -= 1;
                                m.after_wait -= 1;
                                m.grant();
                            } else {
                                m.queue.retain(|q| q.0 != id);
                            }
                        }
                    }
                }
                let mut got: Vec<usize> = held.iter().map(|h| h.0).chain(m.granted.iter().copied()).collect();
                let mut want: Vec<usize> = m.held.iter().map(|h| h.0).collect();
                got.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(got, want);
                let s = a.snapshot();
                prop_assert_eq!(s.in_flight, m.held.len());
                prop_assert_eq!(s.bytes_in_flight, m.held.iter().map(|h| h.1).sum::<usize>());
                prop_assert_eq!(s.waiting, m.queue.len());
                prop_assert_eq!((s.admitted, s.admitted_after_wait), (m.admitted, m.after_wait));
                prop_assert_eq!(s.overloaded, refused);
            }
        }

        /// Against a reference model (a list of charged sizes): admitted iff
        /// the count and the charged bytes stay within bounds; the gauges
        /// always equal the model's sums; every refusal is counted.
        #[test]
        fn matches_a_reference_model(
            max_count in 1usize..5,
            max_bytes in 1usize..200,
            ops in proptest::collection::vec(op(), 0..60),
        ) {
            let a = adm(max_count, max_bytes);
            let mut held: Vec<TokenizePermit> = Vec::new();
            let mut model: Vec<usize> = Vec::new();
            let mut refused = 0u64;
            let mut admitted = 0u64;
            for o in ops {
                match o {
                    Op::Admit(len) => {
                        let charge = len.min(max_bytes);
                        let fits = model.len() < max_count
                            && model.iter().sum::<usize>() + charge <= max_bytes;
                        let got = a.admit_now(len);
                        prop_assert_eq!(got.is_some(), fits);
                        if let Some(p) = got {
                            prop_assert_eq!(p.bytes, charge);
                            held.push(p);
                            model.push(charge);
                            admitted += 1;
                        } else {
                            refused += 1;
                        }
                    }
                    Op::Release(i) => {
                        if !held.is_empty() {
                            let i = i % held.len();
                            drop(held.swap_remove(i));
                            model.swap_remove(i);
                        }
                    }
                }
                let s = a.snapshot();
                prop_assert_eq!(s.in_flight, model.len());
                prop_assert_eq!(s.bytes_in_flight, model.iter().sum::<usize>());
                prop_assert!(s.peak_in_flight <= max_count);
                prop_assert!(s.peak_bytes_in_flight <= max_bytes);
                prop_assert_eq!((s.admitted, s.overloaded), (admitted, refused));
            }
        }
    }
}
