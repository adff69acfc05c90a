//! A router's side of replica sharing: its origin id, the other replicas'
//! load table, the outbox drain and the task that publishes and expires.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_select::{Applied, LoadDelta, RemoteConfig, RemoteLoad};
use parking_lot::Mutex;

use super::replicas::{
    encode, origin_of, send_bound, Counting, EndpointDelta, ReplicaBatch, ReplicaConfig,
    ReplicaCounters, ReplicaError, ReplicaSubscription,
};
use super::slots::{at_epoch, slots_of};
use super::view::RouterView;
use super::{id, Shared};

/// The tracker's outbox as a batch, endpoints named by `urls` (slot order),
/// of the slots `sent` allows.
fn batch_of(
    tracker: &kvroute_select::LoadTracker,
    urls: &[Arc<str>],
    sent: &[bool],
    (origin, retiring): (u64, bool),
) -> Option<ReplicaBatch> {
    let mut deltas = Vec::new();
    tracker.drain_deltas(&mut deltas);
    let endpoints: Vec<EndpointDelta> = deltas
        .iter()
        .filter_map(|d| {
            let url = urls.get(d.endpoint.index())?;
            if url.is_empty() || !sent.get(d.endpoint.index()).copied().unwrap_or(false) {
                return None;
            }
            Some(EndpointDelta {
                url: url.to_string(),
                seq: d.seq,
                in_flight: d.in_flight,
                queued_prefill_tokens: d.queued_prefill_tokens,
                requests: d.requests,
                prefill_tokens: d.prefill_tokens,
                charged_prefill_tokens: d.charged_prefill_tokens,
            })
        })
        .collect();
    (!endpoints.is_empty()).then_some(ReplicaBatch {
        origin,
        endpoints,
        retiring,
    })
}

/// Which slots' load goes out: every present endpoint's; a removed one's
/// (its last address) only when its requests changed (so the others see
/// them end) or, in a `full` drain, while some are still running or their
/// end is not announced yet (a full drain takes every pending change) — and
/// never when a present slot has the same address: the removed slot's
/// stale totals would overwrite the present endpoint's on the others (a
/// full drain sends slots in order, and a re-added endpoint takes a lower
/// slot than the one it left).
fn sent_slots(
    shared: &Shared,
    generation: &super::slots::Generation,
    tracker: &kvroute_select::LoadTracker,
    full: bool,
) -> Vec<bool> {
    let n = generation.urls.len();
    let current: Vec<bool> = (0..n).map(|i| generation.current(shared, i)).collect();
    if current.iter().all(|c| *c) {
        return current;
    }
    // Addresses compare as the others map them to slots: a trailing `/`
    // is no part of one.
    let present: std::collections::HashSet<&str> = generation
        .urls
        .iter()
        .zip(&current)
        .filter(|(_, c)| **c)
        .map(|(u, _)| u.trim_end_matches('/'))
        .collect();
    (0..n)
        .map(|i| {
            current[i]
                || (!present.contains(generation.urls[i].trim_end_matches('/'))
                    && (!full
                        || kvroute_select::Load::load(tracker, id(i)).in_flight > 0
                        || tracker.unannounced(id(i))))
        })
        .collect()
}

pub(crate) struct ReplicaState {
    config: ReplicaConfig,
    pool: String,
    origin: u64,
    remote: RemoteLoad,
    counting: Counting,
    /// When every endpoint was last sent, and the transport's reconnect
    /// count then.
    last_full: Mutex<(Option<Duration>, u64)>,
    subscription: Mutex<Option<ReplicaSubscription>>,
    /// Load changed with nothing waiting to be sent (the tracker's
    /// [`kvroute_select::LoadTracker::wake_on_change`]), or a decision in its
    /// turn: wakes the publishing task, which sends at once unless it sent
    /// within the last `sync_interval`. Between changes it sleeps.
    changed: Arc<tokio::sync::Notify>,
    /// A decision of a burst decided in turns ([`kvroute_select::Turn::in_turn`]:
    /// in its turn, or with a home at once) is waiting to be sent: it goes
    /// at once even within `sync_interval` of the last message, since the
    /// next rank decides one stagger later and must see it.
    in_turn: Arc<AtomicBool>,
}

impl ReplicaState {
    pub(crate) fn new(config: ReplicaConfig, endpoints: usize, name: &str) -> Self {
        let origin = origin_of(&config);
        Self {
            pool: config.pool.clone().unwrap_or_else(|| name.to_owned()),
            remote: RemoteLoad::new(
                RemoteConfig {
                    endpoints,
                    max_origins: config.max_origins,
                    ttl: config.ttl,
                },
                origin,
            ),
            origin,
            config,
            counting: Counting::default(),
            last_full: Mutex::new((None, 0)),
            subscription: Mutex::new(None),
            changed: Arc::new(tokio::sync::Notify::new()),
            in_turn: Arc::new(AtomicBool::new(false)),
        }
    }

    /// What the load tracker calls when an endpoint's load changes with
    /// nothing waiting to be sent: wakes the publishing task.
    pub(crate) fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let changed = Arc::clone(&self.changed);
        move || changed.notify_one()
    }

    /// A decision of a burst decided in turns was charged: the publishing
    /// task sends it at once even within `sync_interval` of the last
    /// message, since the higher ranks decide one stagger later and must
    /// see it. Atomic operations only; no lock, never blocks.
    pub(crate) fn decided_in_turn(&self) {
        self.in_turn.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    pub(crate) fn origin(&self) -> u64 {
        self.origin
    }

    pub(crate) fn remote(&self) -> &RemoteLoad {
        &self.remote
    }

    pub(crate) fn stagger(&self) -> Duration {
        self.config.stagger
    }

    pub(crate) fn counters(&self) -> ReplicaCounters {
        self.counting.snapshot(&self.remote.counters())
    }

    /// How long the publishing task sleeps without changes: it still sends
    /// heartbeats on time, notices a reconnection within 100 ms (its resend
    /// goes out then) and frees expired replicas' entries.
    fn idle_interval(&self) -> Duration {
        self.config
            .heartbeat
            .min(Duration::from_millis(100))
            .max(Duration::from_micros(100))
    }

    /// The least time between two messages (but those of decisions in
    /// their turn): `sync_interval`, at most `heartbeat` (heartbeats must
    /// keep their period), at least 100 µs, and at most a day (`MAX` means
    /// "never" and must not overflow the clock).
    fn send_interval(&self) -> Duration {
        self.config
            .sync_interval
            .min(self.config.heartbeat)
            .clamp(Duration::from_micros(100), Duration::from_secs(86_400))
    }

    /// The outbox as a batch (every endpoint when `full`).
    pub(crate) fn drain(&self, shared: &Shared, full: bool) -> Option<ReplicaBatch> {
        if full {
            shared.tracker.resync();
        }
        let generation = shared.current();
        let sent = sent_slots(shared, &generation, &shared.tracker, full);
        batch_of(
            &shared.tracker,
            &generation.urls,
            &sent,
            (self.origin, false),
        )
    }

    /// The router is going away (dropped, or its rule replaced) while
    /// requests it routed may still be in flight: a task keeps publishing
    /// their ends until none is left (or the others would forget this
    /// replica anyway), so the other replicas' view returns to what it is.
    pub(crate) fn retire(&self, shared: &Shared) {
        let Some(handle) = &shared.handle else {
            return;
        };
        let tracker = Arc::clone(&shared.tracker);
        let generation = shared.current();
        let urls = generation.urls.clone();
        // The slots whose load goes out until idle: a removed slot's ends
        // too (its requests' releases mark it changed).
        let sent = sent_slots(shared, &generation, &tracker, false);
        let (origin, transport, pool) = (
            self.origin,
            Arc::clone(&self.config.transport),
            self.pool.clone(),
        );
        let (interval, max_bytes) = (self.send_interval(), self.config.max_message_bytes);
        let (changed, check) = (Arc::clone(&self.changed), self.idle_interval());
        // A TTL of "never" (`Duration::MAX`) must not overflow the clock:
        // a day of publishing ends are plenty.
        let deadline =
            tokio::time::Instant::now() + self.config.ttl.min(Duration::from_secs(86_400));
        handle.spawn(async move {
            loop {
                // Once idle, the last message carries every endpoint's
                // totals: a release lowers its count before it marks its
                // endpoint changed, so a drain of changed endpoints alone,
                // racing the last release, could miss its end for good.
                let idle = (0..tracker.len())
                    .all(|i| kvroute_select::Load::load(&*tracker, id(i)).in_flight == 0);
                if idle {
                    tracker.resync();
                }
                // Marked retiring: the others count these requests but no
                // longer this router among the deciders.
                if let Some(batch) = batch_of(&tracker, &urls, &sent, (origin, true)) {
                    for msg in encode(&batch, send_bound(max_bytes, &*transport)).0 {
                        transport.publish(&pool, msg);
                    }
                }
                if idle || tokio::time::Instant::now() >= deadline {
                    return;
                }
                // Until the next end (the tracker still wakes on changes),
                // checked every `check` too; then one message per interval.
                let _ = tokio::time::timeout(check, changed.notified()).await;
                tokio::time::sleep(interval).await;
            }
        });
    }

    /// Applies another replica's batch (one message received).
    pub(crate) fn apply(&self, shared: &Shared, batch: &ReplicaBatch) {
        Counting::add(&self.counting.received, 1);
        self.apply_batch(shared, batch);
    }

    fn apply_batch(&self, shared: &Shared, batch: &ReplicaBatch) {
        if batch.origin == self.origin {
            Counting::add(&self.counting.own, 1);
            return;
        }
        // One look at the membership per batch, not per delta: a batch names
        // up to every endpoint, and the receiving task must keep up.
        let urls: Vec<&str> = batch.endpoints.iter().map(|e| e.url.as_str()).collect();
        let slots = slots_of(shared, &urls);
        self.apply_resolved(shared, batch, slots);
    }

    /// [`Self::apply_batch`] past the lookup: `slots` holds each delta's
    /// slot and its epoch when the batch's URLs were looked up.
    fn apply_resolved(
        &self,
        shared: &Shared,
        batch: &ReplicaBatch,
        slots: Vec<Option<(usize, u64)>>,
    ) {
        let now = shared.now();
        let (mut applied, mut newest) = (0, 0);
        for (e, slot) in batch.endpoints.iter().zip(slots) {
            let Some((slot, epoch)) = slot else {
                Counting::add(&self.counting.unknown_endpoint, 1);
                continue;
            };
            let delta = LoadDelta {
                origin: batch.origin,
                seq: e.seq,
                endpoint: id(slot),
                requests: e.requests,
                prefill_tokens: e.prefill_tokens,
                in_flight: e.in_flight,
                queued_prefill_tokens: e.queued_prefill_tokens,
                charged_prefill_tokens: e.charged_prefill_tokens,
            };
            // Only while the endpoint stays in its slot: a removal racing
            // this batch clears the slot's remote load after moving the
            // epoch on, so nothing of the leaving endpoint's is written after.
            let result = at_epoch(shared, slot, epoch, |_, _| self.remote.apply(&delta, now))
                .unwrap_or(Applied::UnknownEndpoint);
            let counter = match result {
                Applied::Applied => {
                    applied += 1;
                    newest = newest.max(e.seq);
                    &self.counting.applied
                }
                Applied::Stale => &self.counting.stale,
                Applied::Own => &self.counting.own,
                Applied::UnknownEndpoint => &self.counting.unknown_endpoint,
                Applied::OriginsFull => &self.counting.origins_full,
                Applied::Implausible => &self.counting.implausible,
            };
            Counting::add(counter, 1);
        }
        // After its deltas (an origin this batch made known is marked too),
        // and only for news: a batch of stale or refused deltas says nothing
        // of the origin now.
        if applied > 0 {
            self.remote
                .set_retiring(batch.origin, batch.retiring, newest, now);
            // The drain model times the other replica's charges from their
            // arrival.
            let view = RouterView::new(shared, now);
            shared.current().rule.observe_load(&view, now);
        }
    }

    /// One received message: bounded, decoded, applied; never an error.
    fn receive(&self, shared: &Shared, payload: &Bytes) {
        Counting::add(&self.counting.received, 1);
        if payload.len() > self.config.max_message_bytes {
            Counting::add(&self.counting.oversized, 1);
            return;
        }
        match serde_json::from_slice::<ReplicaBatch>(payload) {
            Ok(batch) => self.apply_batch(shared, &batch),
            Err(e) => {
                Counting::add(&self.counting.undecodable, 1);
                tracing::debug!(error = %e, "undecodable replica message ignored");
            }
        }
    }

    /// Publishes the outbox (every endpoint once per heartbeat) and expires
    /// silent replicas; whether anything was sent. `at_once`: woken by a
    /// change after a quiet interval.
    fn tick(&self, shared: &Shared, at_once: bool) -> bool {
        let now = shared.now();
        let full = {
            let mut last = self.last_full.lock();
            let reconnects = self.config.transport.reconnects();
            let resync = reconnects != last.1 && self.config.transport.connected();
            let due = last
                .0
                .is_none_or(|t| now.saturating_sub(t) >= self.config.heartbeat)
                || resync;
            if due {
                // A reconnection not yet usable stays pending.
                let seen = if self.config.transport.connected() {
                    reconnects
                } else {
                    last.1
                };
                *last = (Some(now), seen);
            }
            due
        };
        let batch = self.drain(shared, full);
        if let Some(batch) = &batch {
            let bound = send_bound(self.config.max_message_bytes, &*self.config.transport);
            let (msgs, unsendable) = encode(batch, bound);
            let deltas = batch.endpoints.len() as u64 - unsendable;
            Counting::add(&self.counting.unsendable, unsendable);
            for msg in msgs {
                self.config.transport.publish(&self.pool, msg);
                Counting::add(&self.counting.sent_batches, 1);
                if at_once {
                    Counting::add(&self.counting.sent_at_once, 1);
                }
            }
            Counting::add(&self.counting.sent_deltas, deltas);
        }
        self.remote.expire(now);
        batch.is_some()
    }

    /// How long until the next heartbeat is due (zero if it is).
    fn heartbeat_due(&self, shared: &Shared) -> Duration {
        let last = self.last_full.lock().0;
        last.map_or(Duration::ZERO, |t| {
            self.config
                .heartbeat
                .saturating_sub(shared.now().saturating_sub(t))
        })
    }

    /// Subscribes to the pool and starts the publishing task; both end with
    /// the router.
    pub(crate) fn start(
        &self,
        shared: &Arc<Shared>,
        handle: &tokio::runtime::Handle,
    ) -> Result<(), ReplicaError> {
        let weak = Arc::downgrade(shared);
        let sink = Arc::new(move |payload: Bytes| {
            if let Some(shared) = weak.upgrade() {
                if let Some(r) = &shared.replicas {
                    r.receive(&shared, &payload);
                }
            }
        });
        *self.subscription.lock() = Some(self.config.transport.subscribe(&self.pool, sink)?);
        let weak = Arc::downgrade(shared);
        let interval = self.send_interval();
        let idle = self.idle_interval();
        let stopped = shared.stopped();
        let changed = Arc::clone(&self.changed);
        let in_turn = Arc::clone(&self.in_turn);
        handle.spawn(async move {
            tokio::pin!(stopped);
            // Leading edge: a change after a quiet interval goes out at once;
            // one within an interval of the last message is held until the
            // interval is over, and that message carries everything changed
            // meanwhile. At most one message of changes per interval, except
            // for decisions made in their turn: at most one more per turn
            // (a heartbeat or a reconnection's resend may come sooner).
            // Without changes the task wakes only every `idle` (heartbeats,
            // a reconnection's resend, expiry), not every interval: an idle
            // replica costs next to nothing.
            let now = tokio::time::Instant::now();
            let (mut quiet_from, mut next_check, mut held) = (now, now, false);
            loop {
                let wake_at = if held { quiet_from } else { next_check };
                // Biased: a change waiting is seen before a due check, so a
                // change within the interval is held, not sent by the check.
                let at_once = tokio::select! {
                    biased;
                    () = &mut stopped => return,
                    () = changed.notified() => {
                        let turn = in_turn.swap(false, Ordering::AcqRel);
                        if !turn && tokio::time::Instant::now() < quiet_from {
                            held = true;
                            continue;
                        }
                        // Requests of one turn wake on the same timer tick:
                        // let those already runnable decide first, so the
                        // message carries the turn, not its first decision.
                        tokio::task::yield_now().await;
                        true
                    }
                    () = tokio::time::sleep_until(wake_at) => false,
                };
                held = false;
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                if let Some(r) = &shared.replicas {
                    Counting::add(&r.counting.wakes, 1);
                    let sent = r.tick(&shared, at_once);
                    let now = tokio::time::Instant::now();
                    if sent {
                        quiet_from = now + interval;
                    }
                    // The next heartbeat on time, not up to `idle` late.
                    next_check = now + idle.min(r.heartbeat_due(&shared));
                }
            }
        });
        tracing::info!(pool = %self.pool, origin = self.origin, transport = ?self.config.transport,
            "replica load sharing started");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::test_support::{host_router, HostEngine, Loopback};
    use crate::{Backend, Change, EndpointDelta, HostTransport, ReplicaBatch, ReplicaConfig};

    /// Endpoint e2 leaves and e9 takes its slot.
    fn replace_e2_with_e9(router: &crate::KvRouter) {
        replace(router, "http://e2", "http://e9");
    }

    /// The endpoint at `old` leaves and one at `new` is added (in the
    /// lowest free slot).
    fn replace(router: &crate::KvRouter, old: &str, new: &str) {
        router
            .apply(Change::Remove(old.to_owned()))
            .expect("remove");
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        router
            .apply(Change::Insert(
                Backend::new(engine, new.to_owned()).host_events(),
            ))
            .expect("insert");
    }

    /// Replica 2's batch: 5 requests and 4 096 queued tokens on `url`.
    fn peer(seq: u64, url: &str) -> ReplicaBatch {
        ReplicaBatch {
            origin: 2,
            retiring: false,
            endpoints: vec![EndpointDelta {
                url: url.to_owned(),
                seq,
                in_flight: 5,
                queued_prefill_tokens: 4096,
                charged_prefill_tokens: 4096,
                ..EndpointDelta::default()
            }],
        }
    }

    /// An endpoint leaves and another takes its slot: the load other
    /// replicas had announced on the first is not counted on the second
    /// (their deltas for the old URL are refused from then on, so it would
    /// stay there for as long as they live).
    #[test]
    fn a_new_endpoint_in_a_reused_slot_starts_without_the_others_load() {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(1);
        let router = host_router(4).replicas(r).build().expect("router");
        router.apply_replica_batch(&peer(1, "http://e2"));
        let before = router.endpoint_status("http://e2").expect("e2");
        assert_eq!(before.remote.map(|l| l.in_flight), Some(5));
        replace_e2_with_e9(&router);
        let after = router.endpoint_status("http://e9").expect("e9");
        assert_eq!(after.slot, before.slot);
        assert_eq!(after.remote.map(|l| l.in_flight), Some(0));
        assert_eq!(after.load.in_flight, 0);
        // The peer still speaking of the old URL changes nothing here.
        router.apply_replica_batch(&peer(2, "http://e2"));
        let again = router.endpoint_status("http://e9").expect("e9");
        assert_eq!(again.remote.map(|l| l.in_flight), Some(0));
        let c = router.replica_counters().expect("counters");
        assert_eq!((c.applied, c.unknown_endpoint), (1, 1));
        // Once it names the new one, its load there counts.
        router.apply_replica_batch(&peer(3, "http://e9"));
        let named = router.endpoint_status("http://e9").expect("e9");
        assert_eq!(named.remote.map(|l| l.in_flight), Some(5));
    }

    /// A new endpoint in a reused slot does not carry the requests its
    /// predecessor still runs, neither as its own load nor as announced to
    /// the other replicas, and their end takes nothing off its own; the
    /// same address back in its slot keeps them (they run on what answers
    /// there).
    #[test]
    fn a_new_endpoint_in_a_reused_slot_starts_without_the_old_requests() {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(1);
        let router = host_router(4).replicas(r).build().expect("router");
        let shared = &router.shared;
        let target = kvroute_select::Target {
            endpoint: kvroute_core::EndpointId(2),
            decode: None,
        };
        let old = shared.tracker.charge(target, 64);
        replace_e2_with_e9(&router);
        let status = router.endpoint_status("http://e9").expect("e9");
        assert_eq!(status.slot, 2);
        assert_eq!(status.load, kvroute_select::EndpointLoad::default());
        let new = shared.tracker.charge(target, 32);
        drop(old);
        let load = router.endpoint_status("http://e9").expect("e9").load;
        assert_eq!((load.in_flight, load.queued_prefill_tokens), (1, 32));
        assert_eq!(mentions(router.drain_replica_batch(true), "http://e9"), [1]);
        // e9 leaves with its request running and comes back to its slot.
        replace(&router, "http://e9", "http://e9");
        let back = router.endpoint_status("http://e9").expect("e9");
        assert_eq!((back.slot, back.load.in_flight), (2, 1));
        drop(new);
        let end = router.endpoint_status("http://e9").expect("e9").load;
        assert_eq!(end, kvroute_select::EndpointLoad::default());
    }

    /// An endpoint that moves to another slot (it left with another, and
    /// came back into the lowest free slot) takes its charged tokens along,
    /// not the slot's history: the others count the counter per URL, and
    /// the slot's whole counter under its name would read as a million
    /// tokens of work charged there at once, and done.
    #[test]
    fn an_endpoint_moved_to_another_slot_announces_no_phantom_charges() {
        let router = |origin| {
            let mut r = ReplicaConfig::new(Arc::new(HostTransport));
            r.origin = Some(origin);
            host_router(4).replicas(r).build().expect("router")
        };
        let (a, b) = (router(1), router(2));
        let target = |slot| kvroute_select::Target {
            endpoint: kvroute_core::EndpointId(slot),
            decode: None,
        };
        drop(a.shared.tracker.charge(target(0), 1_000_000));
        drop(a.shared.tracker.charge(target(2), 100));
        let charged_at_b = || {
            let slot = b.endpoint_status("http://e2").expect("e2").slot;
            let replicas = b.shared.replicas.as_ref().expect("replicas");
            replicas
                .remote()
                .remote_charged(kvroute_core::EndpointId(u32::try_from(slot).expect("slot")))
        };
        b.apply_replica_batch(&a.drain_replica_batch(true).expect("batch"));
        // First heard of: only its queue (none) counts.
        assert_eq!(charged_at_b(), 0);
        for url in ["http://e0", "http://e2"] {
            a.apply(Change::Remove(url.to_owned())).expect("remove");
        }
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        a.apply(Change::Insert(
            Backend::new(engine, "http://e2".to_owned()).host_events(),
        ))
        .expect("insert");
        assert_eq!(a.endpoint_status("http://e2").expect("e2").slot, 0);
        drop(a.shared.tracker.charge(target(0), 30));
        b.apply_replica_batch(&a.drain_replica_batch(true).expect("batch"));
        // At most the 30 charged since (a counter that went back counts
        // afresh, from its queue).
        assert!(charged_at_b() <= 30, "{}", charged_at_b());
    }

    /// The load of `url` in `batch`, one entry per mention.
    fn mentions(batch: Option<ReplicaBatch>, url: &str) -> Vec<u32> {
        batch
            .map(|b| {
                b.endpoints
                    .iter()
                    .filter(|e| e.url.trim_end_matches('/') == url)
                    .map(|e| e.in_flight)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// An endpoint that leaves and comes back takes a lower slot than the
    /// one it left when another left in between: full drains name it once,
    /// with its present slot's load — not the old slot's stale totals after
    /// it, which the others would take as newer. Also when it comes back
    /// written with a trailing `/` (the same address to the others).
    #[test]
    fn a_returning_endpoint_is_announced_from_its_present_slot_only() {
        for back in ["http://e2", "http://e2/"] {
            returning_endpoint(back);
        }
    }

    fn returning_endpoint(back: &str) {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(1);
        let router = host_router(4).replicas(r).build().expect("router");
        let shared = &router.shared;
        let target = |slot| kvroute_select::Target {
            endpoint: kvroute_core::EndpointId(slot),
            decode: None,
        };
        // A request still running on e2 when it leaves.
        let old = shared.tracker.charge(target(2), 64);
        for url in ["http://e2", "http://e1"] {
            router
                .apply(Change::Remove(url.to_owned()))
                .expect("remove");
        }
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        // Set as the field (the constructor trims a trailing `/`).
        let mut backend = Backend::new(engine, "http://e2").host_events();
        backend.url = back.to_owned();
        router.apply(Change::Insert(backend)).expect("insert");
        assert_eq!(router.endpoint_status(back).expect("e2").slot, 1);
        let _new = shared.tracker.charge(target(1), 64);
        let _new2 = shared.tracker.charge(target(1), 64);
        for _ in 0..2 {
            assert_eq!(mentions(router.drain_replica_batch(true), "http://e2"), [2]);
        }
        drop(old);
        assert_eq!(mentions(router.drain_replica_batch(true), "http://e2"), [2]);
    }

    /// A removed endpoint nobody took the address of: requests it took that
    /// are still running are announced until they end, and the end once,
    /// whether the drain that finds it is a plain one or a heartbeat (a full
    /// drain); then nothing (the others removed it too, or drop it on their
    /// TTL).
    #[test]
    fn a_removed_endpoint_is_announced_until_its_requests_end() {
        for heartbeat in [false, true] {
            let mut r = ReplicaConfig::new(Arc::new(HostTransport));
            r.origin = Some(1);
            let router = host_router(4).replicas(r).build().expect("router");
            let guard = router.shared.tracker.charge(
                kvroute_select::Target {
                    endpoint: kvroute_core::EndpointId(3),
                    decode: None,
                },
                64,
            );
            router
                .apply(Change::Remove("http://e3".to_owned()))
                .expect("remove");
            assert_eq!(mentions(router.drain_replica_batch(true), "http://e3"), [1]);
            drop(guard);
            assert_eq!(
                mentions(router.drain_replica_batch(heartbeat), "http://e3"),
                [0],
                "heartbeat: {heartbeat}"
            );
            assert!(mentions(router.drain_replica_batch(true), "http://e3").is_empty());
        }
    }

    /// A batch whose URLs were looked up just before the endpoint left
    /// writes nothing on the newcomer in its slot: the removal clears the
    /// slot's remote load, and a delta applied after it would stay there
    /// for the remote TTL.
    #[test]
    fn a_batch_looked_up_before_its_endpoint_left_never_reaches_the_newcomer() {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(1);
        let router = host_router(4).replicas(r).build().expect("router");
        let batch = peer(1, "http://e2");
        let shared = &router.shared;
        let resolved = super::slots_of(shared, &["http://e2"]);
        replace_e2_with_e9(&router);
        let replicas = shared.replicas.as_ref().expect("replicas");
        replicas.apply_resolved(shared, &batch, resolved);
        let newcomer = router.endpoint_status("http://e9").expect("e9");
        assert_eq!(newcomer.remote.map(|l| l.in_flight), Some(0));
        let c = router.replica_counters().expect("counters");
        assert_eq!((c.applied, c.unknown_endpoint), (0, 1));
    }

    /// A peer that says it decides no more (a replaced or dropped router)
    /// still has its load counted, but is not one of the deciders.
    #[test]
    fn a_retiring_peer_counts_its_load_but_not_as_a_decider() {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        r.origin = Some(1);
        let router = host_router(4).replicas(r).build().expect("router");
        let replicas = router.shared.replicas.as_ref().expect("replicas");
        let now = router.shared.now();
        router.apply_replica_batch(&peer(1, "http://e2"));
        assert_eq!(replicas.remote().deciders(now).count, 2);
        let retiring = ReplicaBatch {
            retiring: true,
            ..peer(2, "http://e2")
        };
        router.apply_replica_batch(&retiring);
        let status = router.endpoint_status("http://e2").expect("e2");
        assert_eq!(status.remote.map(|l| l.in_flight), Some(5));
        assert_eq!(replicas.remote().deciders(now).count, 1);
        // A message with no news (stale) says nothing of the origin now.
        router.apply_replica_batch(&peer(2, "http://e2"));
        assert_eq!(replicas.remote().deciders(now).count, 1);
        // News that does not say retiring (an origin id reused by a new
        // router) counts it again.
        router.apply_replica_batch(&peer(3, "http://e2"));
        assert_eq!(replicas.remote().deciders(now).count, 2);
    }

    /// A router dropped while a request it routed runs announces the
    /// request's end, marked retiring.
    #[tokio::test]
    async fn a_dropped_router_announces_its_requests_end_as_retiring() {
        let t = Arc::new(Loopback::default());
        let router = looped(&t, Duration::from_millis(2), Duration::from_secs(1));
        let guard = router.shared.tracker.charge(
            kvroute_select::Target {
                endpoint: kvroute_core::EndpointId(0),
                decode: None,
            },
            64,
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let before = t.sent.lock().len();
        drop(router);
        drop(guard);
        let (mut after, mut ended) = (Vec::new(), false);
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            after = t.sent.lock()[before..]
                .iter()
                .map(|m| serde_json::from_slice::<ReplicaBatch>(m).expect("batch"))
                .collect();
            ended = after.iter().any(|b| {
                b.endpoints
                    .iter()
                    .any(|e| e.url == "http://e0" && e.in_flight == 0)
            });
            if ended {
                break;
            }
        }
        assert!(ended, "the end was announced: {after:?}");
        assert!(after.iter().all(|b| b.retiring), "{after:?}");
    }

    fn looped(t: &Arc<Loopback>, sync_interval: Duration, heartbeat: Duration) -> crate::KvRouter {
        let mut r = ReplicaConfig::new(Arc::clone(t) as Arc<dyn crate::ReplicaTransport>);
        r.origin = Some(1);
        r.sync_interval = sync_interval;
        r.heartbeat = heartbeat;
        r.max_message_bytes = 4096;
        host_router(2).replicas(r).spawn().expect("router")
    }

    /// Every message that reaches the router counts as received, the
    /// ones refused for their size or their content too.
    #[tokio::test]
    async fn oversized_and_undecodable_messages_count_as_received() {
        let t = Arc::new(Loopback::default());
        let router = looped(&t, Duration::from_millis(2), Duration::from_secs(1));
        let sink = t.sink.lock().clone().expect("subscribed");
        sink(bytes::Bytes::from_static(b"{not json"));
        sink(bytes::Bytes::from(vec![b' '; 5000]));
        let ok = serde_json::to_vec(&ReplicaBatch {
            origin: 2,
            retiring: false,
            endpoints: vec![EndpointDelta {
                url: "http://e0".to_owned(),
                seq: 1,
                in_flight: 1,
                ..EndpointDelta::default()
            }],
        })
        .expect("json");
        sink(bytes::Bytes::from(ok));
        let c = router.replica_counters().expect("counters");
        assert_eq!(
            (c.received, c.undecodable, c.oversized, c.applied),
            (3, 1, 1, 1)
        );
    }

    /// The publishing task wakes at least every heartbeat, whatever the
    /// sync interval (`MAX`, "never", included): heartbeats keep this
    /// replica alive at the others.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn heartbeats_keep_their_period_under_a_longer_sync_interval() {
        let t = Arc::new(Loopback::default());
        let _router = looped(&t, Duration::MAX, Duration::from_millis(50));
        let mut n = 0;
        // Bounded wait, not a speed check: without heartbeats on their
        // period only the first message ever goes out.
        for _ in 0..1000 {
            n = t.sent.lock().len();
            if n >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(n >= 3, "{n} messages in 10 s at a 50 ms heartbeat");
    }

    /// Without traffic the publishing task sleeps: it wakes every 100 ms
    /// to check (heartbeats, reconnections, expiry), not every 1 ms sync
    /// interval, and a request's start and end each wake it and go out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_replica_sleeps_between_changes() {
        let t = Arc::new(Loopback::default());
        let start = std::time::Instant::now();
        let router = looped(&t, Duration::from_millis(1), Duration::from_secs(3600));
        tokio::time::sleep(Duration::from_millis(400)).await;
        let wakes = router.replica_counters().expect("counters").wakes;
        // At most one per 100 ms elapsed, plus the first; a slow machine
        // only lowers the count. A task ticking every sync interval wakes
        // about 180 times here.
        let bound = start.elapsed().as_millis() as u64 / 100 + 2;
        assert!(wakes <= bound, "{wakes} wakes, at most {bound} expected");
        let last = || -> Option<u32> {
            let sent = t.sent.lock();
            let batch: ReplicaBatch = serde_json::from_slice(sent.last()?).ok()?;
            batch
                .endpoints
                .iter()
                .find(|e| e.url == "http://e0")
                .map(|e| e.in_flight)
        };
        // Sent at once, woken by the change (the idle checks would send
        // it too, but never at once).
        let at_once = || router.replica_counters().expect("counters").sent_at_once;
        let before = at_once();
        let guard = router.charge_unrouted("http://e0").expect("e0");
        let mut ends = Some(guard);
        for (k, in_flight) in [1, 0].into_iter().enumerate() {
            // Bounded wait, not a speed check.
            for _ in 0..1000 {
                if last() == Some(in_flight) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(last(), Some(in_flight));
            assert_eq!(at_once(), before + k as u64 + 1, "not sent on its wake");
            // Past the 1 ms sync interval: the end is not held.
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(ends.take());
        }
    }
}
