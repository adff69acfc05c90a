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
//! When a new endpoint takes a slot, [`LoadTracker::retire`] starts the
//! slot over: requests of the endpoint that left which are still running
//! are no longer its load, and their end takes nothing off the newcomer's.
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

/// Bits of the prefill-token word that hold the count; the bits above hold
/// the low bits of the slot's epoch (2^44 tokens is far beyond any queue).
const TOKEN_BITS: u32 = 44;
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;

/// The epoch's tag in the prefill-token word.
#[inline]
fn token_tag(epoch: u32) -> u64 {
    u64::from(epoch) & (u64::MAX >> TOKEN_BITS)
}

/// One slot's counters. The two live counters carry the slot's *epoch*
/// in their high bits: [`LoadTracker::retire`] moves the slot to a new
/// epoch with both counters at zero, and a change made for an older epoch
/// (a request of the slot's previous endpoint ending) leaves them as they
/// are. Epoch and count change in one atomic operation, so no release can
/// reach a newer epoch's count.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    /// Epoch (high 32 bits) and requests in flight (low 32 bits).
    requests: AtomicU64,
    /// Epoch tag (high bits) and predicted outstanding prefill tokens
    /// (low [`TOKEN_BITS`] bits).
    tokens: AtomicU64,
    /// Prefill tokens ever charged (monotonic): lets a drain model tell new
    /// work from finished work, which the net figure above cannot.
    pub(crate) charged_tokens: AtomicU64,
    /// `charged_tokens` when the slot's present endpoint took it: replica
    /// sync announces the counter from there, since the other replicas
    /// count it per endpoint address, not per slot.
    pub(crate) charged_base: AtomicU64,
    started: AtomicU64,
    /// Replica sync: the slot changed since the outbox was last drained.
    pub(crate) dirty: AtomicBool,
    /// Replica sync: the totals the last drained delta announced.
    pub(crate) sent_in_flight: AtomicU32,
    pub(crate) sent_tokens: AtomicU64,
    pub(crate) sent_charged: AtomicU64,
}

impl Slot {
    /// Requests in flight in the current epoch.
    #[inline]
    pub(crate) fn in_flight(&self) -> u32 {
        (self.requests.load(Ordering::Acquire) & u64::from(u32::MAX)) as u32
    }

    /// Predicted outstanding prefill tokens in the current epoch.
    #[inline]
    pub(crate) fn prefill_tokens(&self) -> u64 {
        self.tokens.load(Ordering::Acquire) & TOKEN_MASK
    }

    /// Adds `requests` (at least one) and `tokens` to the current epoch;
    /// returns that epoch.
    fn add(&self, requests: u32, tokens: u64) -> u32 {
        let prev = self
            .requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                let count = ((w & u64::from(u32::MAX)) as u32).saturating_add(requests);
                Some((w & !u64::from(u32::MAX)) | u64::from(count))
            })
            .unwrap_or_else(|w| w);
        let epoch = (prev >> 32) as u32;
        if tokens > 0 {
            // A retire between the two updates moved the tag on: the
            // tokens are not added, and the guard's release of them will
            // not match either.
            self.update_tokens(epoch, |t| t.saturating_add(tokens).min(TOKEN_MASK));
        }
        epoch
    }

    /// Takes `requests` and `tokens` off `epoch`'s counts, if the slot is
    /// still in that epoch.
    fn sub(&self, epoch: u32, requests: u32, tokens: u64) {
        if requests > 0 {
            let _ = self
                .requests
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                    // Every subtraction pairs with an earlier addition by
                    // the same guard, so the count never wraps; saturate
                    // anyway so a host bug cannot turn a load into 4 billion.
                    ((w >> 32) as u32 == epoch).then(|| {
                        let count = ((w & u64::from(u32::MAX)) as u32).saturating_sub(requests);
                        (w & !u64::from(u32::MAX)) | u64::from(count)
                    })
                });
        }
        if tokens > 0 {
            self.update_tokens(epoch, |t| t.saturating_sub(tokens));
        }
    }

    fn update_tokens(&self, epoch: u32, f: impl Fn(u64) -> u64) {
        let tag = token_tag(epoch);
        let _ = self
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w >> TOKEN_BITS == tag).then(|| (tag << TOKEN_BITS) | f(w & TOKEN_MASK))
            });
    }

    /// Moves the slot to the next epoch with nothing in flight. The token
    /// word moves first: a charge racing the retire reads its epoch from
    /// the request word, so it is either wholly in the old epoch or wholly
    /// in the new one.
    fn retire(&self) {
        self.charged_base.store(
            self.charged_tokens.load(Ordering::Acquire),
            Ordering::Release,
        );
        let next = ((self.requests.load(Ordering::Acquire) >> 32) as u32).wrapping_add(1);
        self.tokens
            .store(token_tag(next) << TOKEN_BITS, Ordering::Release);
        self.requests
            .store(u64::from(next) << 32, Ordering::Release);
    }
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

    /// Charges `requests` (at least one) and `tokens` to `e`'s current
    /// epoch; the leg that will release them.
    fn add(&self, e: EndpointId, requests: u32, tokens: u64) -> Leg {
        let epoch = match self.slots.get(e.index()) {
            Some(s) => {
                let epoch = s.add(requests, tokens);
                s.started.fetch_add(u64::from(requests), Ordering::Relaxed);
                if tokens > 0 {
                    s.charged_tokens.fetch_add(tokens, Ordering::Relaxed);
                }
                self.touched(s);
                epoch
            }
            None => 0,
        };
        Leg { endpoint: e, epoch }
    }

    /// Replica sync: marks the slot for the next outbox drain.
    fn touched(&self, s: &Slot) {
        if let Some(outbox) = &self.sync {
            outbox.touched(!s.dirty.swap(true, Ordering::AcqRel));
        }
    }

    fn sub(&self, leg: Leg, requests: u32, tokens: u64) {
        if let Some(s) = self.slots.get(leg.endpoint.index()) {
            s.sub(leg.epoch, requests, tokens);
            self.touched(s);
        }
    }

    /// A new endpoint takes `endpoint`'s slot: the slot starts with nothing
    /// in flight, and the requests of its previous endpoint that are still
    /// running release nothing when they end (they were never the new
    /// endpoint's load). The monotonic counters ([`LoadTracker::started`],
    /// [`LoadTracker::charged_tokens`]) go on counting; the charged counter
    /// the slot's [`crate::LoadDelta`]s announce starts again from 0, as
    /// the other replicas count it per endpoint.
    ///
    /// Call it for one slot at a time (hosts serialise their endpoint
    /// changes): two retires of one slot racing may share an epoch.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvroute_core::EndpointId;
    /// use kvroute_select::{Load, LoadTracker, Target};
    ///
    /// let tracker = Arc::new(LoadTracker::new(1));
    /// let target = Target { endpoint: EndpointId(0), decode: None };
    /// let old = tracker.charge(target, 500);
    /// tracker.retire(EndpointId(0));
    /// let new = tracker.charge(target, 200);
    /// drop(old);
    /// assert_eq!(tracker.load(EndpointId(0)).in_flight, 1);
    /// assert_eq!(tracker.load(EndpointId(0)).queued_prefill_tokens, 200);
    /// # drop(new);
    /// ```
    pub fn retire(&self, endpoint: EndpointId) {
        if let Some(s) = self.slots.get(endpoint.index()) {
            s.retire();
            self.touched(s);
        }
    }
}

/// One leg of a request's charge: the endpoint and the slot epoch it was
/// charged in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Leg {
    endpoint: EndpointId,
    epoch: u32,
}

impl Load for LoadTracker {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.slots
            .get(endpoint.index())
            .map_or_else(EndpointLoad::default, |s| EndpointLoad {
                in_flight: s.in_flight(),
                queued_prefill_tokens: s.prefill_tokens(),
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
    main: Option<Leg>,
    decode: Option<Leg>,
    /// Prefill tokens still charged to `main`.
    prefill_tokens: u64,
}

impl LoadGuard {
    fn set(&mut self, target: Target, prefill_tokens: u32) {
        self.prefill_tokens = u64::from(prefill_tokens);
        self.main = Some(
            self.tracker
                .add(target.endpoint, 1, u64::from(prefill_tokens)),
        );
        self.decode = target
            .decode
            .filter(|d| *d != target.endpoint)
            .map(|d| self.tracker.add(d, 1, 0));
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
        self.decode = Some(decode)
            .filter(|d| Some(*d) != self.endpoint())
            .map(|d| self.tracker.add(d, 1, 0));
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
        self.main.map(|l| l.endpoint)
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
