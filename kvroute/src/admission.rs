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
//! The state is a pair of counters behind one lock (exact: no transient
//! over-admission or spurious refusal between the two), and a [`Notify`] that
//! wakes waiters when a permit is released. Nothing here reads a clock or
//! spawns: the caller passes the give-up future ([`TokenizeAdmission::admit_within`]),
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

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

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
    released: Notify,
    admitted: AtomicU64,
    admitted_after_wait: AtomicU64,
    overloaded: AtomicU64,
}

/// Room for one tokenization; gives it back when dropped (also when the task
/// holding it panics or the client goes away mid-tokenization).
#[derive(Debug)]
pub struct TokenizePermit {
    admission: Arc<TokenizeAdmission>,
    bytes: usize,
}

impl Drop for TokenizePermit {
    fn drop(&mut self) {
        {
            let mut f = self.admission.in_flight.lock();
            f.count = f.count.saturating_sub(1);
            f.bytes = f.bytes.saturating_sub(self.bytes);
        }
        self.admission.released.notify_waiters();
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
            released: Notify::new(),
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
        let (count, total) = {
            let mut f = self.in_flight.lock();
            if f.count >= self.limits.max_count || f.bytes + bytes > self.limits.max_bytes {
                return None;
            }
            f.count += 1;
            f.bytes += bytes;
            (f.count, f.bytes)
        };
        {
            let mut p = self.peak.lock();
            p.0 = p.0.max(count);
            p.1 = p.1.max(total);
        }
        self.admitted.fetch_add(1, Ordering::Relaxed);
        Some(TokenizePermit {
            admission: Arc::clone(self),
            bytes,
        })
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
    /// `give_up` completes; then `None`, counted as overloaded. Waiters are
    /// not queued in order: each release lets every waiter retry, so a large
    /// body can lose to smaller ones until its `give_up` (which bounds the
    /// wait).
    pub async fn admit_within<G: Future<Output = ()>>(
        self: &Arc<Self>,
        len: usize,
        give_up: G,
    ) -> Option<TokenizePermit> {
        if let Some(p) = self.try_take(len) {
            return Some(p);
        }
        let mut give_up = std::pin::pin!(give_up);
        // Each pass ends in a release or the deadline, so the loop is bounded
        // by `give_up`.
        loop {
            let mut released = std::pin::pin!(self.released.notified());
            // Registered before the retry: a release between the retry and the
            // await still wakes this waiter.
            released.as_mut().enable();
            if let Some(p) = self.try_take(len) {
                self.admitted_after_wait.fetch_add(1, Ordering::Relaxed);
                return Some(p);
            }
            // A release is checked before the deadline: room freed at the
            // deadline's instant is still taken.
            let gave_up = std::future::poll_fn(|cx| {
                if released.as_mut().poll(cx).is_ready() {
                    return std::task::Poll::Ready(false);
                }
                give_up.as_mut().poll(cx).map(|()| true)
            })
            .await;
            if gave_up {
                self.overloaded.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        }
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
        let (in_flight, bytes_in_flight) = {
            let f = self.in_flight.lock();
            (f.count, f.bytes)
        };
        let (peak_in_flight, peak_bytes_in_flight) = *self.peak.lock();
        AdmissionSnapshot {
            max_concurrent: self.limits.max_count,
            max_bytes_in_flight: self.limits.max_bytes,
            in_flight,
            bytes_in_flight,
            peak_in_flight,
            peak_bytes_in_flight,
            admitted: self.admitted.load(Ordering::Relaxed),
            admitted_after_wait: self.admitted_after_wait.load(Ordering::Relaxed),
            overloaded: self.overloaded.load(Ordering::Relaxed),
        }
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

    proptest! {
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
