//! The discrete-event loop: one policy, one workload, a fleet of workers,
//! routed by the library's own runtime.
//!
//! Everything a live gateway does is in the loop, with the real code:
//!
//! * each worker is the mock engine's [`Worker`] (prefix cache with LRU, serial
//!   batched prefill, per-token decode, concurrency limit, FIFO queue);
//! * each gateway replica is a [`KvRouter`] — the runtime `kvroute serve` hosts
//!   per rule and an embedder calls — built without background work
//!   ([`kvroute::KvRouterBuilder::build`]) on a [`ManualClock`] the loop
//!   moves, with the policy as its rule;
//! * every worker interaction that changes its cache emits one [`EventBatch`]
//!   with the worker's next sequence number; it reaches every replica's
//!   inventory ([`KvRouter::ingest_at`]: sequence window and all) after an
//!   optional delay, or is lost with a given probability (the sequence number
//!   is spent, so the window sees the gap);
//! * each request is decided by [`KvRouter::pick_keys`]; its [`kvroute::Pick`]
//!   holds the load charge from the decision until the request finishes, and
//!   its first token ends the charge of its queued prefill, as a response's
//!   first byte does live;
//! * with several gateway replicas (`replicas > 1`) a seeded random front end
//!   spreads requests over them; each replica sees the others through the
//!   engines' own running/waiting counts, polled every `load_poll_us`
//!   ([`KvRouter::report_engine_load_at`]), and — with `replica_sync_us > 0` —
//!   through each other's load: each replica's batch
//!   ([`KvRouter::drain_replica_batch`]) reaches the others
//!   ([`KvRouter::apply_replica_batch`]) `replica_sync_us` later;
//! * the peers' policies ([`super::peers`]) are scorers of the same runtime;
//!   they read the engines' gauges every `peer_poll_us` (their own scrape
//!   interval), or exactly at each decision with `peer_poll_us = 0`.
//!
//! Time is simulated microseconds; nothing reads a clock. Events at the same
//! instant run in a fixed order — request completions, first tokens, event
//! deliveries, then arrivals — and every random choice comes from seeded
//! generators, so one seed gives one result.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute::engine::Engine;
use kvroute::{
    Backend, EngineLoadConfig, HostTransport, IndexConfig, KvRouter, ManualClock, Pick,
    ReplicaBatch, ReplicaConfig,
};
use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{EventBatch, KvEvent, RestartPolicy, SeqWindowConfig};
use kvroute_select::{EngineReport, LoadBound, Source, Turn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::bounds::ratio;
pub use super::bounds::{ideal_hit_ratio, pooled_hit_ratio};
use super::peers::ActiveSequences;
use super::policy::{PolicySpec, Tuning, SIM_CONTRACT};
use super::report::{
    EventReport, LoadReport, PolicyReport, PolicySamples, ReplicaSyncReport, RoutingReport, Summary,
};
use super::trace::{block_keys, Workload};
use kvroute_engine_model::{Admission, RequestSpec, Worker, WorkerConfig};

/// How the fleet is built and fed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FleetConfig {
    /// Number of workers.
    pub workers: usize,
    /// Every worker's model (block size, capacity, concurrency, cost).
    pub worker: WorkerConfig,
    /// KV events reach the index this long after the worker emitted them.
    pub event_delay_us: u64,
    /// Probability that an event batch is lost on the way.
    pub event_loss: f64,
    /// Sequence window of every endpoint's ingest (missed batches that keep the
    /// inventory).
    pub seq_window: u64,
    /// Seed of the rule's pseudo-random selectors and of event loss.
    pub seed: u64,
    /// Closed loop: keep this many requests outstanding, ignoring timestamps.
    pub concurrency: Option<u32>,
    /// Policy knobs.
    pub tuning: Tuning,
    /// Gateway replicas behind a random front end (≥ 1).
    pub replicas: usize,
    /// Engine-reported load is polled this often (0: never; replicas then see
    /// only their own requests).
    pub load_poll_us: u64,
    /// Replicas share their load with each other, each batch arriving this
    /// long after the change (0: they do not share).
    pub replica_sync_us: u64,
    /// Replicas take turns within a burst, rank k holding a request k times
    /// this long ([`ReplicaConfig::stagger`]; 0: no turns).
    pub replica_stagger_us: u64,
    /// Within a burst, a request without a home waits this long so the
    /// burst's requests with one are placed first
    /// ([`kvroute::KvRouterBuilder::burst_order`]; 0: off).
    pub burst_order_us: u64,
    /// The peers' policies read the engines' gauges this often instead of
    /// every `load_poll_us` — their own scrape interval (llm-d's endpoint
    /// picker refreshes every 50 ms by default). 0: exactly at each
    /// decision, including what other replicas placed at the same instant,
    /// which no scrape can see.
    pub peer_poll_us: u64,
}

/// A policy that could not run.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The runtime refused the configuration.
    #[error("building the {policy} router: {source}")]
    Router {
        /// Policy name.
        policy: String,
        /// Why.
        source: kvroute::BuildError,
    },
}

const FINISH: u8 = 0;
const FIRST_TOKEN: u8 = 1;
const POLL: u8 = 2;
/// A request held for its replica's turn is decided.
const HOLD: u8 = 3;

/// How long request `r` was held for its replica's turn, µs.
fn hold_us(turns: &[Turn], r: usize) -> u64 {
    turns
        .get(r)
        .map_or(0, |t| u64::try_from(t.hold.as_micros()).unwrap_or(u64::MAX))
}

/// (time µs, kind, insertion order, worker, request) — min-heap order.
type Timed = Reverse<(u64, u8, u64, u32, u32)>;

/// The simulated engine: its events come from the loop (no transport), and
/// its window policy is the fleet's.
#[derive(Debug)]
struct SimEngine {
    window: SeqWindowConfig,
}

impl Engine for SimEngine {
    fn name(&self) -> &str {
        "sim"
    }

    fn events_carry_tokens(&self) -> bool {
        false
    }

    fn window(&self, _follow: &kvroute::engine::Follow) -> SeqWindowConfig {
        self.window
    }
}

/// The endpoint URL of worker `w`.
fn worker_url(w: usize) -> String {
    format!("http://sim-worker-{w}")
}

fn id(w: usize) -> EndpointId {
    EndpointId(u32::try_from(w).unwrap_or(u32::MAX))
}

/// Builds replica `k`'s router for `policy`.
fn router(
    policy: &PolicySpec,
    cfg: &FleetConfig,
    k: usize,
    clock: &Arc<ManualClock>,
    active: &Arc<Mutex<ActiveSequences>>,
) -> Result<KvRouter, FleetError> {
    let n = cfg.workers.max(1);
    let block_size = cfg.worker.block_size.max(1);
    let seed = cfg.seed.wrapping_add(k as u64);
    let engine: Arc<dyn Engine> = Arc::new(SimEngine {
        window: SeqWindowConfig {
            window: cfg.seq_window,
            on_restart: RestartPolicy::Clear,
            ..SeqWindowConfig::default()
        },
    });
    let mut b = policy
        .router(SIM_CONTRACT, n, block_size, seed, cfg.tuning, active)
        .clock(Arc::clone(clock) as Arc<dyn kvroute::Clock>)
        .index(IndexConfig {
            capacity_per_endpoint: IndexConfig::default()
                .capacity_per_endpoint
                .max(cfg.worker.capacity_blocks as usize * 2),
            // One thread: no lock contention to spread.
            shards: 1,
        })
        .engine_load(EngineLoadConfig {
            // Simulated engines never stop reporting.
            max_age: Duration::from_secs(3600),
            ..EngineLoadConfig::default()
        });
    b = b.burst_order(Duration::from_micros(cfg.burst_order_us));
    if cfg.replica_sync_us > 0 && cfg.replicas > 1 {
        let mut r = ReplicaConfig::new(Arc::new(HostTransport));
        // Simulated replicas never crash: a TTL beyond any run.
        r.ttl = Duration::from_secs(1 << 30);
        r.max_origins = cfg.replicas;
        // Ranks by replica index: the same in every run of a seed.
        r.origin = Some(k as u64 + 1);
        r.stagger = Duration::from_micros(cfg.replica_stagger_us);
        b = b.replicas(r);
    }
    for w in 0..n {
        let backend = Backend::new(Arc::clone(&engine), worker_url(w));
        b = b.endpoint(if policy.uses_inventory() {
            backend.host_events()
        } else {
            backend
        });
    }
    b.build().map_err(|source| FleetError::Router {
        policy: policy.name(),
        source,
    })
}

/// Runs `workload` through a fleet routed by `policy`.
///
/// # Errors
/// [`FleetError`] when the router cannot be built.
pub fn simulate(
    workload: &Workload,
    cfg: &FleetConfig,
    policy: impl Into<PolicySpec>,
) -> Result<PolicyReport, FleetError> {
    let policy = policy.into();
    let n = cfg.workers.max(1);
    let clock = Arc::new(ManualClock::default());
    let active = Arc::new(Mutex::new(ActiveSequences::new(n)));
    let replicas = (0..cfg.replicas.max(1))
        .map(|k| router(&policy, cfg, k, &clock, &active))
        .collect::<Result<Vec<_>, FleetError>>()?;
    let requests = workload.len();
    let mut sim = Sim {
        cfg,
        block_size: cfg.worker.block_size.max(1),
        workload,
        policy,
        clock,
        active,
        replicas,
        workers: (0..n).map(|_| Worker::new(cfg.worker)).collect(),
        picks: (0..requests).map(|_| None).collect(),
        front: StdRng::seed_from_u64(cfg.seed ^ 0x0066_726f_6e74),
        timed: BinaryHeap::new(),
        timed_seq: 0,
        deliveries: VecDeque::new(),
        sync: VecDeque::new(),
        sync_sent: ReplicaSyncReport::default(),
        next_seq: vec![0; n],
        rng: StdRng::seed_from_u64(cfg.seed ^ 0x6c6f_7373),
        events: Vec::new(),
        spare_events: Vec::new(),
        admissions: Vec::new(),
        keys: Vec::new(),
        ttft_us: vec![u64::MAX; requests],
        turns: vec![Turn::NONE; requests],
        e2e_us: vec![u64::MAX; requests],
        cached: vec![0; requests],
        predicted: vec![0; requests],
        request_replica: vec![0; requests],
        routed: vec![0; n],
        placements: Vec::with_capacity(requests),
        in_flight_area: vec![0; n],
        over_bound: 0,
        batches: 0,
        lost: 0,
        rejected: 0,
        first_arrival: None,
        last_finish: 0,
    };
    sim.run();
    Ok(sim.report())
}

struct Sim<'a> {
    cfg: &'a FleetConfig,
    block_size: u32,
    workload: &'a Workload,
    policy: PolicySpec,
    clock: Arc<ManualClock>,
    /// Dynamo's router-side blocks in flight (`dynamo-cost` stages its picks
    /// there; the loop commits them to their requests and frees them at the
    /// end), one record for every replica.
    active: Arc<Mutex<ActiveSequences>>,
    /// One router per gateway replica.
    replicas: Vec<KvRouter>,
    workers: Vec<Worker<u32>>,
    /// Each request's pick (its decision and load charge), from decision
    /// to finish.
    picks: Vec<Option<Pick>>,
    front: StdRng,
    timed: BinaryHeap<Timed>,
    timed_seq: u64,
    deliveries: VecDeque<(u64, usize, EventBatch)>,
    /// Replica batches in flight: (arrival µs, sending replica, batch); one
    /// fixed delay, so FIFO is time order.
    sync: VecDeque<(u64, usize, ReplicaBatch)>,
    /// Replica messages sent, their endpoint entries and their bytes as the
    /// NATS transport encodes them.
    sync_sent: ReplicaSyncReport,
    next_seq: Vec<u64>,
    rng: StdRng,
    events: Vec<KvEvent>,
    spare_events: Vec<Vec<KvEvent>>,
    admissions: Vec<Admission<u32>>,
    keys: Vec<BlockKey>,
    ttft_us: Vec<u64>,
    /// Each request's turn within a burst (its hold counts in its TTFT).
    turns: Vec<Turn>,
    e2e_us: Vec<u64>,
    cached: Vec<u32>,
    predicted: Vec<u32>,
    /// The replica each request went to.
    request_replica: Vec<u32>,
    routed: Vec<u64>,
    /// Every placement: (arrival µs, worker), for the report's samples.
    placements: Vec<(u64, u32)>,
    in_flight_area: Vec<u128>,
    over_bound: u64,
    batches: u64,
    lost: u64,
    rejected: u64,
    first_arrival: Option<u64>,
    last_finish: u64,
}

impl Sim<'_> {
    fn run(&mut self) {
        let total = self.workload.len();
        let mut next = 0usize;
        // Closed loop: launch times of the next requests.
        let mut ready: VecDeque<u64> = VecDeque::new();
        if let Some(c) = self.cfg.concurrency {
            ready.extend(std::iter::repeat_n(0, (c.max(1) as usize).min(total)));
        }
        let poll_us = self.poll_us();
        if poll_us > 0 {
            self.push_timed(poll_us, POLL, 0, 0);
        }
        loop {
            let arrival = if next >= total {
                None
            } else if self.cfg.concurrency.is_some() {
                ready.front().copied()
            } else {
                self.workload.requests().get(next).map(|r| r.arrival_us)
            };
            let timed = self.timed.peek().map(|Reverse(e)| e.0);
            let delivery = self.deliveries.front().map(|d| d.0);
            let synced = self.sync.front().map(|d| d.0);
            // Polls and replica sync alone never keep the loop going.
            let only_polls = arrival.is_none()
                && delivery.is_none()
                && self.timed.iter().all(|Reverse(e)| e.1 == POLL);
            if only_polls {
                break;
            }
            let Some(t) = [timed, delivery, synced, arrival]
                .into_iter()
                .flatten()
                .min()
            else {
                break;
            };
            self.clock.set(Duration::from_micros(t));
            if timed == Some(t) {
                let Some(Reverse((t, kind, _, w, r))) = self.timed.pop() else {
                    break;
                };
                let (w, r) = (w as usize, r as usize);
                match kind {
                    FINISH => {
                        self.finish(w, r, t);
                        if self.cfg.concurrency.is_some() {
                            ready.push_back(t);
                        }
                    }
                    FIRST_TOKEN => {
                        self.first_token(r);
                        self.share(self.replica_index(r), t);
                    }
                    HOLD => {
                        let decided = self.hash(r) && self.decide(r, w, t);
                        if !decided && self.cfg.concurrency.is_some() {
                            ready.push_back(t);
                        }
                    }
                    _ => {
                        self.poll(t);
                        self.push_timed(t + poll_us, POLL, 0, 0);
                    }
                }
            } else if delivery == Some(t) {
                if let Some((_, w, batch)) = self.deliveries.pop_front() {
                    self.apply(w, batch);
                }
            } else if synced == Some(t) {
                if let Some((_, from, batch)) = self.sync.pop_front() {
                    for (k, rep) in self.replicas.iter().enumerate() {
                        if k != from {
                            rep.apply_replica_batch(&batch);
                        }
                    }
                }
            } else {
                ready.pop_front();
                let served = self.route(next, t);
                next += 1;
                if !served && self.cfg.concurrency.is_some() {
                    ready.push_back(t);
                }
            }
        }
    }

    /// Sends replica `k`'s outbox to the other replicas, arriving
    /// `replica_sync_us` from `t`.
    fn share(&mut self, k: usize, t: u64) {
        if self.cfg.replica_sync_us == 0 || self.replicas.len() <= 1 {
            return;
        }
        let Some(batch) = self
            .replicas
            .get(k)
            .and_then(|r| r.drain_replica_batch(false))
        else {
            return;
        };
        self.sync_sent.messages += 1;
        self.sync_sent.endpoint_entries += batch.endpoints.len() as u64;
        self.sync_sent.bytes += serde_json::to_vec(&batch).map_or(0, |b| b.len() as u64);
        self.sync
            .push_back((t.saturating_add(self.cfg.replica_sync_us), k, batch));
    }

    fn push_timed(&mut self, t: u64, kind: u8, w: u32, r: u32) {
        self.timed_seq += 1;
        self.timed.push(Reverse((t, kind, self.timed_seq, w, r)));
    }

    /// How often the replicas read the engines' gauges (0: never).
    fn poll_us(&self) -> u64 {
        if self.policy.is_peer() && self.cfg.peer_poll_us > 0 {
            self.cfg.peer_poll_us
        } else {
            self.cfg.load_poll_us
        }
    }

    /// What worker `w` reports of itself at `t` (what a metrics poll reads).
    fn gauge(worker: &mut Worker<u32>, t: u64) -> EngineReport {
        worker.advance(t);
        let cap = u64::from(worker.config().capacity_blocks.max(1));
        // As vLLM's `kv_cache_usage_perc`: cached blocks no running request
        // holds are free (evictable at once), not used.
        let cache = worker.cache();
        let used = u64::from(cache.used_blocks().saturating_sub(cache.evictable_blocks()));
        #[allow(clippy::cast_precision_loss)]
        EngineReport {
            running: worker.running(),
            waiting: u32::try_from(worker.waiting()).unwrap_or(u32::MAX),
            kv_usage: Some(used as f64 / cap as f64),
            // Simulated requests end their prefill charge at their first
            // token, so the tracker's rate needs no engine counters.
            prefill: None,
            kv_capacity_blocks: Some(cap),
        }
    }

    /// Every replica reads every engine's report, as the runtime's metrics
    /// poller does.
    fn poll(&mut self, t: u64) {
        for (w, worker) in self.workers.iter_mut().enumerate() {
            let report = Self::gauge(worker, t);
            for rep in &self.replicas {
                rep.report_engine_load_at(id(w), report);
            }
        }
    }

    fn finish(&mut self, w: usize, r: usize, t: u64) {
        if let Some(worker) = self.workers.get_mut(w) {
            worker.advance(t);
        }
        // The response ended: the request stops counting.
        if let Some(p) = self.picks.get_mut(r) {
            *p = None;
        }
        self.active_sequences().free(r as u64);
        self.share(self.replica_index(r), t);
        self.last_finish = self.last_finish.max(t);
        self.after_step(w, t);
    }

    fn active_sequences(&self) -> std::sync::MutexGuard<'_, ActiveSequences> {
        self.active
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The replica the front end sent request `r` to (recorded at routing).
    fn replica_index(&self, r: usize) -> usize {
        if self.replicas.len() <= 1 {
            return 0;
        }
        self.request_replica.get(r).copied().unwrap_or(0) as usize
    }

    fn first_token(&mut self, r: usize) {
        if let Some(Some(p)) = self.picks.get_mut(r) {
            p.first_byte();
        }
    }

    /// Whether the request just charged to worker `w` took it above the
    /// bounded-load limit `⌈(1+ε)·(Σ in-flight + 1)/n⌉` (the `kv-bounded`
    /// cap), over the true in-flight counts before it: every replica's own
    /// counts summed (with one replica, what it sees; with several, what
    /// none of them sees alone).
    fn over_bound(&self, w: usize) -> bool {
        let load = |i: usize| {
            let all = self
                .replicas
                .iter()
                .map(|r| r.in_flight_at(id(i)))
                .fold(0u32, u32::saturating_add);
            if i == w {
                all.saturating_sub(1)
            } else {
                all
            }
        };
        let n = self.workers.len();
        let bound = LoadBound {
            total_in_flight: (0..n).map(|i| u64::from(load(i))).sum(),
            total_capacity: n as u64,
            factor: 1.0 + self.cfg.tuning.epsilon.max(0.0),
        };
        !bound.admits(load(w), 1)
    }

    /// Routes request `r` arriving at `t`; false if no worker could take it.
    fn route(&mut self, r: usize, t: u64) -> bool {
        if !self.hash(r) {
            return false;
        }
        self.first_arrival.get_or_insert(t);
        let k = if self.replicas.len() > 1 {
            self.front.gen_range(0..self.replicas.len())
        } else {
            0
        };
        if let Some(x) = self.request_replica.get_mut(r) {
            *x = u32::try_from(k).unwrap_or(0);
        }
        // This replica's turn in a burst: decided later, timed from now.
        let keys = &self.keys;
        let turn = self
            .replicas
            .get(k)
            .map_or(Turn::NONE, |rep| rep.turn(Some(keys)));
        if let Some(x) = self.turns.get_mut(r) {
            *x = turn;
        }
        let hold = hold_us(&self.turns, r);
        if hold > 0 {
            self.push_timed(
                t.saturating_add(hold),
                HOLD,
                u32::try_from(k).unwrap_or(u32::MAX),
                u32::try_from(r).unwrap_or(u32::MAX),
            );
            return true;
        }
        self.decide(r, k, t)
    }

    /// Hashes request `r`'s prompt into `self.keys`; false if there is no
    /// such request.
    fn hash(&mut self, r: usize) -> bool {
        let Some(req) = self.workload.requests().get(r).copied() else {
            return false;
        };
        block_keys(
            self.workload.ids(&req),
            req.input_tokens,
            self.block_size,
            &mut self.keys,
        );
        true
    }

    /// Decides request `r`, whose keys are in `self.keys`, on replica `k`
    /// at `t` and submits it; Dynamo's record keeps the decision only if the
    /// request was submitted.
    fn decide(&mut self, r: usize, k: usize, t: u64) -> bool {
        let placed = self.place(r, k, t);
        let mut active = self.active_sequences();
        if placed {
            active.commit(r as u64);
        } else {
            active.discard();
        }
        placed
    }

    /// [`Self::decide`] without Dynamo's record.
    fn place(&mut self, r: usize, k: usize, t: u64) -> bool {
        let Some(req) = self.workload.requests().get(r).copied() else {
            return false;
        };
        if self.policy.is_peer() && self.cfg.peer_poll_us == 0 {
            // Exact gauges at decision time (`peer_poll_us` 0).
            for (w, worker) in self.workers.iter_mut().enumerate() {
                let report = Self::gauge(worker, t);
                if let Some(rep) = self.replicas.get(k) {
                    rep.report_engine_load_at(id(w), report);
                }
            }
        }
        let Some(rep) = self.replicas.get(k) else {
            return false;
        };
        let turn = self.turns.get(r).copied().unwrap_or(Turn::NONE);
        let Ok(pick) = rep.pick_keys_in_turn(&self.keys, req.input_tokens, turn) else {
            self.rejected += 1;
            return false;
        };
        let decision = pick.decision();
        let Some(target) = decision.target() else {
            self.rejected += 1;
            return false;
        };
        let predicted = if decision.source() == Source::KvExact {
            decision.predicted_cached_tokens(self.block_size)
        } else {
            0
        };
        let w = target.endpoint.index();
        if let Some(p) = self.predicted.get_mut(r) {
            *p = predicted;
        }
        if self.over_bound(w) {
            self.over_bound += 1;
        }
        let spec = RequestSpec {
            keys: &self.keys,
            tokens: &[],
            prompt_tokens: req.input_tokens,
            output_tokens: req.output_tokens,
            kv_transferred: false,
            cache_salt: None,
        };
        let tag = u32::try_from(r).unwrap_or(u32::MAX);
        let submitted = self
            .workers
            .get_mut(w)
            .is_some_and(|worker| worker.submit(t, tag, &spec).is_ok());
        if !submitted {
            self.rejected += 1;
            return false;
        }
        if let Some(p) = self.picks.get_mut(r) {
            *p = Some(pick);
        }
        self.share(k, t);
        if let Some(x) = self.routed.get_mut(w) {
            *x += 1;
        }
        self.placements
            .push((t, u32::try_from(w).unwrap_or(u32::MAX)));
        self.after_step(w, t);
        true
    }

    /// Records the worker's admissions and publishes its KV events.
    fn after_step(&mut self, w: usize, t: u64) {
        let Some(worker) = self.workers.get_mut(w) else {
            return;
        };
        self.admissions.extend(worker.drain_admissions());
        let wid = u32::try_from(w).unwrap_or(u32::MAX);
        for a in self.admissions.drain(..) {
            let r = a.tag as usize;
            let tag = a.tag;
            // Timed from arrival: a replica's turn is part of the wait.
            let held = hold_us(&self.turns, r);
            if let Some(x) = self.ttft_us.get_mut(r) {
                *x = a.first_token_us - a.submitted_us + held;
            }
            if let Some(x) = self.e2e_us.get_mut(r) {
                *x = a.finish_us - a.submitted_us + held;
            }
            if let Some(x) = self.cached.get_mut(r) {
                *x = a.cached_tokens;
            }
            if let Some(x) = self.in_flight_area.get_mut(w) {
                *x += u128::from(a.finish_us - a.submitted_us);
            }
            self.timed_seq += 1;
            self.timed.push(Reverse((
                a.first_token_us,
                FIRST_TOKEN,
                self.timed_seq,
                wid,
                tag,
            )));
            self.timed_seq += 1;
            self.timed
                .push(Reverse((a.finish_us, FINISH, self.timed_seq, wid, tag)));
        }
        self.publish(w, t);
    }

    fn publish(&mut self, w: usize, t: u64) {
        let Some(worker) = self.workers.get_mut(w) else {
            return;
        };
        worker.take_events_into(&mut self.events);
        if self.events.is_empty() {
            return;
        }
        let Some(seq) = self.next_seq.get_mut(w) else {
            return;
        };
        let batch_seq = *seq;
        *seq += 1;
        self.batches += 1;
        if self.cfg.event_loss > 0.0 && self.rng.gen_bool(self.cfg.event_loss.min(1.0)) {
            self.lost += 1;
            self.events.clear();
            return;
        }
        #[allow(clippy::cast_precision_loss)]
        let timestamp = t as f64 / 1e6;
        if self.cfg.event_delay_us == 0 {
            let batch = EventBatch {
                seq: batch_seq,
                timestamp,
                dp_rank: None,
                events: std::mem::take(&mut self.events),
            };
            self.events = self.apply(w, batch);
        } else {
            let spare = self.spare_events.pop().unwrap_or_default();
            let events = std::mem::replace(&mut self.events, spare);
            self.deliveries.push_back((
                t.saturating_add(self.cfg.event_delay_us),
                w,
                EventBatch {
                    seq: batch_seq,
                    timestamp,
                    dp_rank: None,
                    events,
                },
            ));
        }
    }

    /// Feeds one batch of worker `w` to every replica's inventory; returns
    /// the emptied event buffer for reuse.
    fn apply(&mut self, w: usize, batch: EventBatch) -> Vec<KvEvent> {
        if self.policy.uses_inventory() {
            for rep in &self.replicas {
                rep.ingest_at(id(w), &batch);
            }
        }
        let mut events = batch.events;
        events.clear();
        if self.cfg.event_delay_us > 0 {
            self.spare_events.push(events);
            return Vec::new();
        }
        events
    }

    fn report(&self) -> PolicyReport {
        let mut ttft: Vec<u64> = self
            .ttft_us
            .iter()
            .copied()
            .filter(|x| *x != u64::MAX)
            .collect();
        let mut e2e: Vec<u64> = self
            .e2e_us
            .iter()
            .copied()
            .filter(|x| *x != u64::MAX)
            .collect();
        let served = ttft.len() as u64;
        let reqs = self.workload.requests();
        let (mut prompt, mut cached, mut with_hit, mut output) = (0u64, 0u64, 0u64, 0u64);
        let (mut predicted, mut delivered_when_predicted) = (0u64, 0u64);
        for (i, r) in reqs.iter().enumerate() {
            if self.ttft_us.get(i).is_none_or(|x| *x == u64::MAX) {
                continue;
            }
            let c = u64::from(self.cached.get(i).copied().unwrap_or(0));
            let p = u64::from(self.predicted.get(i).copied().unwrap_or(0));
            prompt += u64::from(r.input_tokens);
            output += u64::from(r.output_tokens.max(1));
            cached += c;
            with_hit += u64::from(c > 0);
            if p > 0 {
                predicted += p;
                delivered_when_predicted += c.min(p);
            }
        }
        let makespan_us = self
            .last_finish
            .saturating_sub(self.first_arrival.unwrap_or(0))
            .max(1);
        #[allow(clippy::cast_precision_loss)]
        let makespan_s = makespan_us as f64 / 1e6;
        #[allow(clippy::cast_precision_loss)]
        let avg_in_flight: Vec<f64> = self
            .in_flight_area
            .iter()
            .map(|a| *a as f64 / makespan_us as f64)
            .collect();
        let (mut kv_hits, mut fallbacks, mut load_diversions) = (0, 0, 0);
        for rep in &self.replicas {
            let c = rep.counters();
            kv_hits += c.endpoints.iter().map(|e| e.hits).sum::<u64>();
            fallbacks += c.fallbacks;
            load_diversions += c.load_diversions;
        }
        // Every replica follows every worker: the first one's ingest counts
        // stand for all.
        let mut seq = kvroute_ingest::SeqCounters::default();
        let mut clears = 0;
        if let Some(rep) = self.replicas.first() {
            for s in rep.endpoint_statuses() {
                seq += s.seq;
                clears += s.inventory_clears;
            }
        }
        let ttft_ms = Summary::of_us(&mut ttft);
        #[allow(clippy::cast_precision_loss)]
        PolicyReport {
            policy: self.policy.name(),
            requests: reqs.len() as u64,
            served,
            rejected: self.rejected,
            prefix_hit_ratio: ratio(cached, prompt),
            hit_over_pooled: 0.0,
            requests_with_hit: ratio(with_hit, served),
            ttft_ms,
            e2e_ms: Summary::of_us(&mut e2e),
            throughput_rps: served as f64 / makespan_s,
            output_tokens_per_s: output as f64 / makespan_s,
            makespan_s,
            load: LoadReport::new(&avg_in_flight, &self.routed, self.over_bound, served),
            routing: RoutingReport {
                kv_hits,
                fallbacks,
                load_diversions,
                predicted_cached_tokens: predicted,
                delivered_of_predicted: delivered_when_predicted,
                prediction_accuracy: (predicted > 0)
                    .then(|| ratio(delivered_when_predicted, predicted)),
            },
            events: EventReport {
                batches: self.batches,
                lost: self.lost,
                gaps_kept: seq.gaps_kept,
                gaps_cleared: seq.gaps_cleared,
                clears,
            },
            replica_sync: ReplicaSyncReport {
                per_decision_bytes: if served > 0 {
                    self.sync_sent.bytes as f64 / served as f64
                } else {
                    0.0
                },
                ..self.sync_sent
            },
            samples: PolicySamples {
                // Sorted by `Summary::of_us`.
                ttft_us: ttft,
                routed: self.placements.clone(),
            },
        }
    }
}
