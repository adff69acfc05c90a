//! What a decision reads: the router's load view (its own charges, the
//! other replicas' announced load, the engines' own reports), endpoint
//! health (presence, admin state, breaker) and the inventory index.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{InventoryHealth, InventoryView, Overlap};
use kvroute_select::{
    AdminState, Availability, Deciders, EndpointLoad, EngineReport, Health, Load, PrefillProgress,
    Turn,
};

use super::slots::Generation;
use super::Shared;

/// The router's view at one instant.
pub(crate) struct RouterView<'a> {
    shared: &'a Shared,
    now: Duration,
    /// Without the engines' reports: every replica's own accounting only
    /// (what a report is compared with, so nothing is counted twice).
    replicas_only: bool,
    /// The local view's mean queued prefill per request, which every
    /// endpoint's engine-report correction reads: once per view, not once
    /// per endpoint (that made a decision quadratic in the endpoints).
    mean_prefill: std::cell::Cell<Option<u64>>,
    /// The decision's turn within a burst ([`Turn::NONE`] outside one).
    turn: Turn,
    /// The generation deciding: a slot whose endpoint is not the one it
    /// names there (removed, or reused since) is not available to it.
    gen: Option<&'a Generation>,
}

impl<'a> RouterView<'a> {
    pub(crate) fn new(shared: &'a Shared, now: Duration) -> Self {
        Self {
            shared,
            now,
            replicas_only: false,
            mean_prefill: std::cell::Cell::new(None),
            turn: Turn::NONE,
            gen: None,
        }
    }

    /// The view for a decision of `gen`'s rule: a slot holds the endpoint
    /// that rule names there, or it is unavailable.
    pub(crate) fn of(mut self, gen: &'a Generation) -> Self {
        self.gen = Some(gen);
        self
    }

    /// The view for a decision made in `turn` ([`kvroute_select::Turn`]).
    pub(crate) fn in_turn(mut self, turn: Turn) -> Self {
        self.turn = turn;
        self
    }

    pub(crate) fn replicas_only(shared: &'a Shared, now: Duration) -> Self {
        Self {
            shared,
            now,
            replicas_only: true,
            mean_prefill: std::cell::Cell::new(None),
            turn: Turn::NONE,
            gen: None,
        }
    }
}

impl Load for RouterView<'_> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.load_and_report(endpoint).0
    }

    /// One read of the endpoint's report cell for both (a decision asks
    /// for both of every endpoint).
    fn load_and_report(&self, endpoint: EndpointId) -> (EndpointLoad, Option<EngineReport>) {
        let s = self.shared;
        let tracker = &*s.tracker;
        match (&s.replicas, self.replicas_only) {
            (Some(r), true) => (r.remote().view(tracker, self.now).load(endpoint), None),
            (Some(r), false) => {
                let local = r.remote().view(tracker, self.now);
                s.reported
                    .view_sharing_mean(&local, self.now, &self.mean_prefill)
                    .load_and_report(endpoint)
            }
            (None, true) => (tracker.load(endpoint), None),
            (None, false) => s
                .reported
                .view_sharing_mean(tracker, self.now, &self.mean_prefill)
                .load_and_report(endpoint),
        }
    }

    /// The live replicas sharing this pool and this one's rank among them
    /// (the cost scorer spreads a burst by it).
    fn deciders(&self) -> Deciders {
        self.shared.replicas.as_ref().map_or(Deciders::ALONE, |r| {
            r.remote().deciders(self.now).in_turn(self.turn)
        })
    }

    /// Every replica's charges (the cost scorer's drain times them).
    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        let local = self.shared.tracker.charged_tokens(endpoint);
        Some(self.shared.replicas.as_ref().map_or(local, |r| {
            local.saturating_add(r.remote().remote_charged(endpoint))
        }))
    }

    fn prefill_progress(&self, endpoint: EndpointId) -> Option<PrefillProgress> {
        self.report(endpoint).and_then(|r| r.prefill)
    }

    fn report(&self, endpoint: EndpointId) -> Option<EngineReport> {
        if self.replicas_only {
            return None;
        }
        self.shared.reported.report(endpoint, self.now)
    }
}

impl Health for RouterView<'_> {
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability {
        let Some(s) = self.shared.slots.get(endpoint.index()) else {
            return Availability::AdminDown;
        };
        if !s.present.load(Ordering::Acquire) || s.admin_down.load(Ordering::Acquire) {
            return Availability::AdminDown;
        }
        if self
            .gen
            .is_some_and(|g| !g.current(self.shared, endpoint.index()))
        {
            return Availability::AdminDown;
        }
        match Availability::from_states(AdminState::Up, s.breaker.state(now)) {
            Availability::Available if self.shared.outliers.is_ejected(endpoint, now) => {
                Availability::Ejected
            }
            a => a,
        }
    }
}

impl InventoryView for RouterView<'_> {
    fn endpoint_count(&self) -> usize {
        self.shared.index.endpoint_count()
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.shared.index.score(keys, out);
    }

    fn score_prefix(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.shared.index.score_prefix(keys, out);
    }

    fn score_prefix_uniform(&self, keys: &[BlockKey], out: &mut [Overlap], uniform: &mut [bool]) {
        self.shared.index.score_prefix_uniform(keys, out, uniform);
    }

    fn health(&self, endpoint: usize) -> InventoryHealth {
        let Some(s) = self.shared.slots.get(endpoint) else {
            return InventoryHealth::default();
        };
        // The published cell, not the ingest's lock: an event batch being
        // applied holds that for as long as its writes take.
        s.health.get()
    }

    fn gpu_blocks(&self, endpoint: usize) -> Option<u64> {
        InventoryView::gpu_blocks(&*self.shared.index, endpoint)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::Arc;

    use kvroute_core::{BlockKey, EndpointId};
    use kvroute_ingest::{BlockStored, EventBatch, KvEvent};

    use super::super::test_support::host_router;

    /// A decision reads each endpoint's inventory health from the cell its
    /// ingest publishes, so it does not wait while an event batch holds the
    /// ingest's lock (here: held by the test until the decision is done).
    #[test]
    fn a_decision_does_not_wait_for_an_ingest_applying_a_batch() {
        let b = host_router(2);
        let router = Arc::new(b.build().expect("router"));
        let keys: Vec<BlockKey> = (1..=4).map(BlockKey).collect();
        let batch = EventBatch {
            seq: 0,
            timestamp: 0.0,
            dp_rank: None,
            events: vec![KvEvent::Stored(BlockStored {
                keys: keys.clone(),
                block_size: 4,
                ..BlockStored::default()
            })],
        };
        assert!(router.ingest_at(EndpointId(1), &batch));
        let slot = router.shared.slots.get(1).expect("slot 1");
        let ingest = slot.ingest.read().clone().expect("an ingest");
        let held = ingest.lock();
        let (tx, rx) = mpsc::channel();
        let deciding = Arc::clone(&router);
        let decider = std::thread::spawn(move || {
            let pick = deciding.pick_keys(&keys, 16).map(|p| p.endpoint_id());
            let _ = tx.send(pick);
        });
        let picked = rx.recv_timeout(std::time::Duration::from_secs(30));
        drop(held);
        decider.join().expect("decider");
        assert_eq!(
            picked
                .expect("the decision waited for the ingest's lock")
                .ok()
                .flatten(),
            Some(EndpointId(1))
        );
    }

    /// Every endpoint whose engine reports requests this router did not send
    /// needs the router's mean queued prefill per request, a pass over every
    /// endpoint: one view computes it once for all endpoints (once per
    /// endpoint would make a decision quadratic in the endpoints).
    #[test]
    fn one_view_computes_the_mean_prefill_per_request_once() {
        use kvroute_select::{EngineReport, Load};

        let b = host_router(3);
        let router = b.build().expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        // This router's own request on endpoint 0 gives the mean its value.
        let mine = router.pick_keys(&keys, 32).expect("pick");
        let busy = mine.endpoint_id().expect("an endpoint");
        for e in 0..3u32 {
            let report = EngineReport {
                running: 2,
                ..EngineReport::default()
            };
            router.report_engine_load_at(EndpointId(e), report);
        }
        let shared = &router.shared;
        let view = super::RouterView::new(shared, shared.now());
        let quiet = EndpointId((busy.0 + 1) % 3);
        let first = view.load(quiet);
        assert!(first.queued_prefill_tokens > 0, "{first:?}");
        let kept = view.mean_prefill.get();
        assert!(kept.is_some(), "the view did not keep the mean");
        // The mean already computed serves the next endpoint and the fused read.
        let other = EndpointId((busy.0 + 2) % 3);
        assert_eq!(view.load_and_report(other).0, view.load(other));
        assert_eq!(view.mean_prefill.get(), kept);
        drop(mine);
    }
}
