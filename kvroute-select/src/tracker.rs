//! In-flight accounting with tower's `load::PendingRequests` semantics: a
//! request counts on its endpoint from the moment the decision is made until
//! its [`LoadGuard`] is dropped — when the response body ends, errors, or the
//! client goes away — never from when the upstream's headers arrive (a
//! non-streamed answer sends its headers when it is already finished, so a
//! header-based count never sees the request at all).
//!
//! Per endpoint the tracker keeps two atomics: requests in flight, and
//! *predicted outstanding prefill tokens* — the uncached prompt tokens each
//! decision predicted for its endpoint, held until the host reports the first
//! response byte ([`LoadGuard::first_byte`]) or the P/D prefill leg's answer
//! ([`LoadGuard::prefill_leg_done`]). Both are what [`Load`] returns, so the
//! scorers, the fallback selectors and the P/D decode pick all read the same
//! true signal.
//!
//! Lock-free: `&self` from any number of tasks; sans-IO: no clock, no runtime.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute_core::EndpointId;
//! use kvroute_select::{Load, LoadTracker, Target};
//!
//! let tracker = Arc::new(LoadTracker::new(2));
//! let target = Target { endpoint: EndpointId(1), decode: None };
//! let mut guard = tracker.charge(target, 900);
//! assert_eq!(tracker.load(EndpointId(1)).in_flight, 1);
//! assert_eq!(tracker.load(EndpointId(1)).queued_prefill_tokens, 900);
//! guard.first_byte(); // prefill done: the request now only decodes
//! assert_eq!(tracker.load(EndpointId(1)).queued_prefill_tokens, 0);
//! drop(guard); // body ended, errored or was dropped
//! assert_eq!(tracker.load(EndpointId(1)).in_flight, 0);
//! ```

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_core::EndpointId;

use crate::decision::Target;
use crate::load::{EndpointLoad, Load};

#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) in_flight: AtomicU32,
    pub(crate) prefill_tokens: AtomicU64,
    /// Prefill tokens ever charged (monotonic): lets a drain model tell new
    /// work from finished work, which the net figure above cannot.
    pub(crate) charged_tokens: AtomicU64,
    started: AtomicU64,
    /// Replica sync: the slot changed since the outbox was last drained.
    pub(crate) dirty: AtomicBool,
    /// Replica sync: the totals the last drained delta announced.
    pub(crate) sent_in_flight: AtomicU32,
    pub(crate) sent_tokens: AtomicU64,
    pub(crate) sent_charged: AtomicU64,
}

/// Per-endpoint requests in flight and predicted outstanding prefill tokens,
/// indexed by the rule's [`EndpointId`]s. Share it as `Arc<LoadTracker>`; every
/// request holds one [`LoadGuard`].
///
/// Built with [`LoadTracker::with_sync`] it also keeps an outbox of
/// [`crate::LoadDelta`]s for the other gateway replicas (see
/// [`crate::replica_sync`]).
#[derive(Debug)]
pub struct LoadTracker {
    pub(crate) slots: Box<[Slot]>,
    pub(crate) sync: Option<crate::replica_sync::Outbox>,
}

impl LoadTracker {
    /// A tracker for `endpoints` endpoints, all idle.
    #[must_use]
    pub fn new(endpoints: usize) -> Self {
        Self {
            slots: (0..endpoints).map(|_| Slot::default()).collect(),
            sync: None,
        }
    }

    /// Endpoints tracked.
    #[must_use]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the tracker has no endpoint.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Requests ever charged to `endpoint` (a monotonic counter).
    #[must_use]
    pub fn started(&self, endpoint: EndpointId) -> u64 {
        self.slots
            .get(endpoint.index())
            .map_or(0, |s| s.started.load(Ordering::Relaxed))
    }

    /// Predicted prefill tokens ever charged to `endpoint` (a monotonic
    /// counter; what [`Load::charged_prefill_tokens`] reports).
    #[must_use]
    pub fn charged_tokens(&self, endpoint: EndpointId) -> u64 {
        self.slots
            .get(endpoint.index())
            .map_or(0, |s| s.charged_tokens.load(Ordering::Relaxed))
    }

    /// Charges a request to `target`: one in flight on its endpoint (and on its
    /// decode endpoint in P/D) and `prefill_tokens` predicted uncached tokens on
    /// the endpoint that prefills. The returned guard releases them.
    #[must_use = "the charge is released when the guard is dropped"]
    pub fn charge(self: &Arc<Self>, target: Target, prefill_tokens: u32) -> LoadGuard {
        let mut guard = LoadGuard {
            tracker: Arc::clone(self),
            main: None,
            decode: None,
            prefill_tokens: 0,
        };
        guard.set(target, prefill_tokens);
        guard
    }

    fn add(&self, e: EndpointId, requests: u32, tokens: u64) {
        if let Some(s) = self.slots.get(e.index()) {
            if requests > 0 {
                s.in_flight.fetch_add(requests, Ordering::Relaxed);
                s.started.fetch_add(u64::from(requests), Ordering::Relaxed);
            }
            if tokens > 0 {
                s.prefill_tokens.fetch_add(tokens, Ordering::Relaxed);
                s.charged_tokens.fetch_add(tokens, Ordering::Relaxed);
            }
            self.touched(s);
        }
    }

    /// Replica sync: marks the slot for the next outbox drain.
    fn touched(&self, s: &Slot) {
        if let Some(outbox) = &self.sync {
            if s.dirty.swap(true, Ordering::AcqRel) {
                outbox.coalesced.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn sub(&self, e: EndpointId, requests: u32, tokens: u64) {
        if let Some(s) = self.slots.get(e.index()) {
            // Every subtraction pairs with an earlier addition by the same
            // guard, so the counters never wrap; saturate anyway so a host bug
            // cannot turn a load into 4 billion.
            if requests > 0 {
                let _ = s
                    .in_flight
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                        Some(v.saturating_sub(requests))
                    });
            }
            if tokens > 0 {
                let _ = s
                    .prefill_tokens
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                        Some(v.saturating_sub(tokens))
                    });
            }
            self.touched(s);
        }
    }
}

impl Load for LoadTracker {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.slots
            .get(endpoint.index())
            .map_or_else(EndpointLoad::default, |s| EndpointLoad {
                in_flight: s.in_flight.load(Ordering::Relaxed),
                queued_prefill_tokens: s.prefill_tokens.load(Ordering::Relaxed),
            })
    }

    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        Some(self.charged_tokens(endpoint))
    }
}

/// One request's charge on a [`LoadTracker`]. Dropping it releases whatever
/// is still charged — so a body that ends, errors or is dropped by a
/// disconnecting client all end the request the same way.
#[derive(Debug)]
pub struct LoadGuard {
    tracker: Arc<LoadTracker>,
    /// The endpoint that receives the request (prefill endpoint in P/D).
    main: Option<EndpointId>,
    decode: Option<EndpointId>,
    /// Prefill tokens still charged to `main`.
    prefill_tokens: u64,
}

impl LoadGuard {
    fn set(&mut self, target: Target, prefill_tokens: u32) {
        self.main = Some(target.endpoint);
        self.decode = target.decode.filter(|d| *d != target.endpoint);
        self.prefill_tokens = u64::from(prefill_tokens);
        self.tracker
            .add(target.endpoint, 1, u64::from(prefill_tokens));
        if let Some(d) = self.decode {
            self.tracker.add(d, 1, 0);
        }
    }

    fn release_all(&mut self) {
        if let Some(m) = self.main.take() {
            self.tracker.sub(m, 1, self.prefill_tokens);
        }
        self.prefill_tokens = 0;
        if let Some(d) = self.decode.take() {
            self.tracker.sub(d, 1, 0);
        }
    }

    /// Moves the charge to a new target (a retry after a connect failure):
    /// the old endpoints are released, the new ones charged.
    pub fn retarget(&mut self, target: Target, prefill_tokens: u32) {
        self.release_all();
        self.set(target, prefill_tokens);
    }

    /// P/D: the decode leg will not run (the prefill endpoint refused the
    /// request, and its answer is the response): the decode endpoint is
    /// released; the prefill endpoint stays charged until the guard drops.
    pub fn release_decode(&mut self) {
        if let Some(d) = self.decode.take() {
            self.tracker.sub(d, 1, 0);
        }
    }

    /// P/D: the decode leg moves to `decode` (a retry after the decode
    /// endpoint failed); the prefill leg's charge, or its end, is left as it
    /// is — the prefill it stands for is not run again.
    pub fn retarget_decode(&mut self, decode: EndpointId) {
        if let Some(d) = self.decode.take() {
            self.tracker.sub(d, 1, 0);
        }
        // As `set`: an endpoint charged as the prefill leg is not charged
        // twice.
        self.decode = Some(decode).filter(|d| Some(*d) != self.main);
        if let Some(d) = self.decode {
            self.tracker.add(d, 1, 0);
        }
    }

    /// The first response byte arrived: the endpoint finished this request's
    /// prefill, so its predicted prefill tokens stop counting (the request
    /// stays in flight while it decodes).
    pub fn first_byte(&mut self) {
        if let Some(m) = self.main {
            self.tracker.sub(m, 0, self.prefill_tokens);
        }
        self.prefill_tokens = 0;
    }

    /// P/D: the prefill endpoint answered its leg; it carries nothing more of
    /// this request (the decode endpoint stays charged until the guard drops).
    /// On a converged target this is [`LoadGuard::first_byte`].
    pub fn prefill_leg_done(&mut self) {
        if self.decode.is_none() {
            self.first_byte();
            return;
        }
        if let Some(m) = self.main.take() {
            self.tracker.sub(m, 1, self.prefill_tokens);
        }
        self.prefill_tokens = 0;
    }

    /// The endpoint this guard charges as the main (prefill) leg, if still charged.
    #[must_use]
    pub fn endpoint(&self) -> Option<EndpointId> {
        self.main
    }

    /// Prefill tokens still charged.
    #[must_use]
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(e: u32, d: Option<u32>) -> Target {
        Target {
            endpoint: EndpointId(e),
            decode: d.map(EndpointId),
        }
    }

    #[test]
    fn pd_charges_both_legs_and_releases_prefill_first() {
        let tr = Arc::new(LoadTracker::new(3));
        let mut g = tr.charge(t(0, Some(2)), 100);
        assert_eq!(tr.load(EndpointId(0)).in_flight, 1);
        assert_eq!(tr.load(EndpointId(0)).queued_prefill_tokens, 100);
        assert_eq!(tr.load(EndpointId(2)).in_flight, 1);
        assert_eq!(tr.load(EndpointId(2)).queued_prefill_tokens, 0);
        g.prefill_leg_done();
        assert_eq!(tr.load(EndpointId(0)), EndpointLoad::default());
        assert_eq!(tr.load(EndpointId(2)).in_flight, 1);
        drop(g);
        assert_eq!(tr.load(EndpointId(2)).in_flight, 0);
    }

    /// The prefill endpoint refused a P/D request: its answer is the
    /// response, the decode endpoint never gets the request and is released
    /// at once; the prefill endpoint carries it until the guard drops.
    #[test]
    fn a_refused_prefill_leg_releases_the_decode_endpoint() {
        let tr = Arc::new(LoadTracker::new(3));
        let mut g = tr.charge(t(0, Some(2)), 100);
        g.release_decode();
        assert_eq!(tr.load(EndpointId(2)), EndpointLoad::default());
        assert_eq!(tr.load(EndpointId(0)).in_flight, 1);
        // Converged from here: the first byte ends the prefill work, the
        // drop the request.
        g.prefill_leg_done();
        assert_eq!(tr.load(EndpointId(0)).in_flight, 1);
        assert_eq!(tr.load(EndpointId(0)).queued_prefill_tokens, 0);
        drop(g);
        assert_eq!(tr.load(EndpointId(0)), EndpointLoad::default());
    }

    #[test]
    fn retarget_moves_the_charge() {
        let tr = Arc::new(LoadTracker::new(2));
        let mut g = tr.charge(t(0, None), 50);
        g.retarget(t(1, None), 70);
        assert_eq!(tr.load(EndpointId(0)), EndpointLoad::default());
        assert_eq!(tr.load(EndpointId(1)).queued_prefill_tokens, 70);
        assert_eq!(tr.started(EndpointId(0)), 1);
        assert_eq!(tr.started(EndpointId(1)), 1);
        // The charged counters only grow: releases and first bytes do not
        // take work back.
        g.first_byte();
        drop(g);
        assert_eq!(tr.charged_tokens(EndpointId(0)), 50);
        assert_eq!(tr.charged_prefill_tokens(EndpointId(1)), Some(70));
    }

    /// A decode retry after the prefill leg answered moves the decode
    /// charge alone: the prefill endpoint is not charged again, and its
    /// charged counter does not count the prefill twice.
    #[test]
    fn a_decode_retry_moves_only_the_decode_charge() {
        let tr = Arc::new(LoadTracker::new(4));
        let mut g = tr.charge(t(0, Some(2)), 100);
        g.prefill_leg_done();
        g.retarget_decode(EndpointId(3));
        assert_eq!(tr.load(EndpointId(0)), EndpointLoad::default());
        assert_eq!(tr.load(EndpointId(2)).in_flight, 0);
        assert_eq!(tr.load(EndpointId(3)).in_flight, 1);
        assert_eq!(tr.charged_tokens(EndpointId(0)), 100);
        assert_eq!(tr.started(EndpointId(0)), 1);
        // Before the prefill leg answered, its charge stays where it is.
        let mut h = tr.charge(t(1, Some(2)), 40);
        h.retarget_decode(EndpointId(3));
        assert_eq!(tr.load(EndpointId(1)).queued_prefill_tokens, 40);
        assert_eq!(tr.load(EndpointId(3)).in_flight, 2);
        assert_eq!(tr.charged_tokens(EndpointId(1)), 40);
        drop((g, h));
        for e in 0..4 {
            assert_eq!(tr.load(EndpointId(e)), EndpointLoad::default());
        }
    }

    #[test]
    fn unknown_endpoints_are_ignored() {
        let tr = Arc::new(LoadTracker::new(1));
        let g = tr.charge(t(5, Some(7)), 10);
        assert_eq!(tr.load(EndpointId(5)), EndpointLoad::default());
        drop(g);
        assert_eq!(tr.load(EndpointId(0)), EndpointLoad::default());
    }
}
