//! The discrete-event loop: one policy, one workload, a fleet of workers.
//!
//! Everything the live gateway does is in the loop, with the real code:
//!
//! * each worker is the mock engine's [`Worker`] (prefix cache with LRU, serial
//!   batched prefill, per-token decode, concurrency limit, FIFO queue);
//! * every worker interaction that changes its cache emits one [`EventBatch`]
//!   with the worker's next sequence number; it goes through that worker's
//!   [`EndpointIngest`] (sequence window and all) into one [`SharedIndex`],
//!   after an optional delay, or is lost with a given probability (the sequence
//!   number is spent, so the window sees the gap);
//! * each request is routed by [`Rule::decide`] over that index, with the
//!   library's own [`LoadTracker`] as the load view — the same accounting the
//!   gateway uses: a request counts from its decision until it finishes, and
//!   its predicted uncached prompt tokens count as queued prefill until its
//!   first token;
//! * with several gateway replicas (`replicas > 1`) a seeded random front end
//!   spreads requests over them; each replica has its own rule, tracker and
//!   predicted entries, and sees the others only through the engines' own
//!   running/waiting counts, polled every `load_poll_us` ([`ReportedLoad`]),
//!   and — with `replica_sync_us > 0` — through each other's decisions: every
//!   change of a replica's tracker is drained from its outbox as
//!   [`LoadDelta`]s that reach the other replicas' [`RemoteLoad`] tables
//!   `replica_sync_us` later;
//! * the peers' policies ([`super::peers`]) route from the same index and loads.
//!
//! Time is simulated microseconds; nothing reads a clock. Events at the same
//! instant run in a fixed order — request completions, first tokens, event
//! deliveries, then arrivals — and every random choice comes from seeded
//! generators, so one seed gives one result.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent, SharedIndex,
};
use kvroute_ingest::{RestartPolicy, SeqWindowConfig};
use kvroute_select::{
    AlwaysAvailable, ContractId, Decision, EndpointLoad, EngineReport, Load, LoadBound, LoadDelta,
    LoadGuard, LoadTracker, PromptInput, RemoteConfig, RemoteLoad, ReportedLoad, Request, Rule,
    Source,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::policy::{Policy, Tuning, SIM_CONTRACT};
use super::report::{EventReport, LoadReport, PolicyReport, RoutingReport, Summary};
use super::trace::{block_keys, Workload};
use kvroute_engine_model::cache::KeyHasher;
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
    /// Replicas share their decisions ([`kvroute_select::LoadDelta`]s) with
    /// each other, each delta arriving this long after the change (0: they
    /// do not share).
    pub replica_sync_us: u64,
}

/// A policy that could not run.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The rule refused the configuration.
    #[error("building the {policy} rule: {source}")]
    Rule {
        /// Policy name.
        policy: &'static str,
        /// Why.
        source: kvroute_select::RuleError,
    },
}

const FINISH: u8 = 0;
const FIRST_TOKEN: u8 = 1;
const POLL: u8 = 2;

/// (time µs, kind, insertion order, worker, request) — min-heap order.
type Timed = Reverse<(u64, u8, u64, u32, u32)>;

/// Fraction of prompt tokens one infinite shared cache would serve: every
/// request finds every block of every earlier request (with the same "last
/// token is recomputed" cap the workers apply).
#[must_use]
pub fn ideal_hit_ratio(workload: &Workload, block_size: u32) -> f64 {
    let mut seen: HashSet<u64, BuildHasherDefault<KeyHasher>> = HashSet::default();
    let mut keys = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    let bs = block_size.max(1);
    for r in workload.requests() {
        block_keys(workload.ids(r), r.input_tokens, bs, &mut keys);
        let limit = (r.input_tokens.saturating_sub(1) / bs) as usize;
        let prefix = keys.iter().take_while(|k| seen.contains(&k.0)).count();
        hit += (prefix.min(limit) as u64 * u64::from(bs)).min(u64::from(r.input_tokens));
        total += u64::from(r.input_tokens);
        seen.extend(keys.iter().map(|k| k.0));
    }
    ratio(hit, total)
}

/// Fraction of prompt tokens one LRU cache holding the whole fleet's capacity
/// (`capacity_blocks` blocks) would serve, requests in arrival order: the
/// best any placement over that many blocks can do without knowing the future
/// (a fleet partitions the capacity; duplicating a prefix on two workers
/// spends it twice).
#[must_use]
pub fn pooled_hit_ratio(workload: &Workload, block_size: u32, capacity_blocks: u64) -> f64 {
    let mut lru = Lru::new(capacity_blocks);
    let mut keys = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    let bs = block_size.max(1);
    for r in workload.requests() {
        block_keys(workload.ids(r), r.input_tokens, bs, &mut keys);
        let limit = (r.input_tokens.saturating_sub(1) / bs) as usize;
        let prefix = keys.iter().take_while(|k| lru.contains(k.0)).count();
        hit += (prefix.min(limit) as u64 * u64::from(bs)).min(u64::from(r.input_tokens));
        total += u64::from(r.input_tokens);
        for k in &keys {
            lru.touch(k.0);
        }
    }
    ratio(hit, total)
}

/// A least-recently-used set of keys: every touch appends `(key, stamp)` to a
/// queue; a queue record is live while the map still holds its stamp.
struct Lru {
    map: std::collections::HashMap<u64, u64, BuildHasherDefault<KeyHasher>>,
    order: VecDeque<(u64, u64)>,
    capacity: u64,
    stamp: u64,
}

impl Lru {
    fn new(capacity: u64) -> Self {
        Self {
            map: std::collections::HashMap::default(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            stamp: 0,
        }
    }

    fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    fn touch(&mut self, key: u64) {
        self.stamp += 1;
        self.map.insert(key, self.stamp);
        self.order.push_back((key, self.stamp));
        while self.map.len() as u64 > self.capacity {
            let Some((k, st)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k) == Some(&st) {
                self.map.remove(&k);
            }
        }
        if self.order.len() > self.map.len() * 2 + 1024 {
            let map = &self.map;
            self.order.retain(|(k, st)| map.get(k) == Some(st));
        }
    }
}

#[allow(clippy::cast_precision_loss)]
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Runs `workload` through a fleet routed by `policy`.
///
/// # Errors
/// [`FleetError`] when the rule cannot be built.
pub fn simulate(
    workload: &Workload,
    cfg: &FleetConfig,
    policy: Policy,
) -> Result<PolicyReport, FleetError> {
    let n = cfg.workers.max(1);
    let block_size = cfg.worker.block_size.max(1);
    let replicas = (0..cfg.replicas.max(1))
        .map(|k| {
            let seed = cfg.seed.wrapping_add(k as u64);
            let rule_cfg = policy.rule_config(n, block_size, seed, cfg.tuning);
            let rule = Rule::new(rule_cfg, None).map_err(|source| FleetError::Rule {
                policy: policy.name(),
                source,
            })?;
            // Origin ids start at 1 (0 is nobody's).
            let origin = k as u64 + 1;
            let tracker = if cfg.replica_sync_us > 0 && cfg.replicas > 1 {
                LoadTracker::with_sync(n, origin)
            } else {
                LoadTracker::new(n)
            };
            Ok(Replica {
                rule,
                tracker: Arc::new(tracker),
                reported: ReportedLoad::new(n, Duration::from_secs(3600)),
                // Simulated replicas never crash: a TTL beyond any run.
                remote: RemoteLoad::new(
                    RemoteConfig {
                        endpoints: n,
                        max_origins: cfg.replicas,
                        ttl: Duration::from_secs(1 << 30),
                    },
                    origin,
                ),
            })
        })
        .collect::<Result<Vec<_>, FleetError>>()?;
    let index_cfg = IndexConfig {
        capacity_per_endpoint: IndexConfig::default()
            .capacity_per_endpoint
            .max(cfg.worker.capacity_blocks as usize * 2),
        // One thread: no lock contention to spread.
        shards: 1,
    };
    let ingest_cfg = IngestConfig {
        window: SeqWindowConfig {
            window: cfg.seq_window,
            on_restart: RestartPolicy::Clear,
            ..SeqWindowConfig::default()
        },
        ..IngestConfig::default()
    };
    let requests = workload.len();
    let mut sim = Sim {
        cfg,
        block_size,
        workload,
        policy,
        contract: ContractId::new(SIM_CONTRACT),
        replicas,
        index: SharedIndex::new(n, index_cfg),
        ingests: (0..n)
            .map(|i| {
                let id = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
                EndpointIngest::new(id, ingest_cfg.clone(), Keying::Engine)
            })
            .collect(),
        workers: (0..n).map(|_| Worker::new(cfg.worker)).collect(),
        guards: (0..requests).map(|_| None).collect(),
        front: StdRng::seed_from_u64(cfg.seed ^ 0x0066_726f_6e74),
        timed: BinaryHeap::new(),
        timed_seq: 0,
        deliveries: VecDeque::new(),
        sync: VecDeque::new(),
        sync_buf: Vec::new(),
        next_seq: vec![0; n],
        rng: StdRng::seed_from_u64(cfg.seed ^ 0x6c6f_7373),
        events: Vec::new(),
        spare_events: Vec::new(),
        admissions: Vec::new(),
        keys: Vec::new(),
        decision: Decision::new(),
        gauges: Vec::new(),
        ttft_us: vec![u64::MAX; requests],
        e2e_us: vec![u64::MAX; requests],
        cached: vec![0; requests],
        predicted: vec![0; requests],
        request_replica: vec![0; requests],
        routed: vec![0; n],
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

/// Whether placing one more request on worker `w` takes it above the
/// bounded-load limit `⌈(1+ε)·(Σ in-flight + 1)/n⌉` (the `kv-bounded` cap),
/// over the true in-flight counts: every replica's tracker summed (with one
/// replica, what it sees; with several, what none of them sees alone).
fn over_bound(replicas: &[Replica], n: usize, epsilon: f64, w: usize) -> bool {
    let load = |i: usize| {
        let id = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
        replicas
            .iter()
            .map(|r| r.tracker.load(id).in_flight)
            .fold(0u32, u32::saturating_add)
    };
    let bound = LoadBound {
        total_in_flight: (0..n).map(|i| u64::from(load(i))).sum(),
        total_capacity: n as u64,
        factor: 1.0 + epsilon.max(0.0),
    };
    !bound.admits(load(w), 1)
}

/// One gateway replica: its own rule (counters, selector turns, predicted
/// entries), its own in-flight tracker and its view of the engines' reports.
struct Replica {
    rule: Rule,
    tracker: Arc<LoadTracker>,
    reported: ReportedLoad,
    /// The other replicas' decisions, as their deltas announced them.
    remote: RemoteLoad,
}

/// What a replica routes by: its own tracker plus the other replicas'
/// announced load, corrected by engine reports when they are polled (the
/// reports are taken against the same local + remote sum, so nothing is
/// counted twice; see [`kvroute_select::replica_sync`]).
struct ReplicaLoad<'a> {
    rep: &'a Replica,
    polled: bool,
    now: Duration,
    /// Each worker's state at this instant (running, waiting, KV usage and
    /// capacity), for the peers' policies, which read the engines' gauges.
    gauges: &'a [EngineReport],
}

impl Load for ReplicaLoad<'_> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        let mine = self.rep.remote.view(&*self.rep.tracker, self.now);
        if self.polled {
            self.rep.reported.view(&mine, self.now).load(endpoint)
        } else {
            mine.load(endpoint)
        }
    }

    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        self.rep
            .remote
            .view(&*self.rep.tracker, self.now)
            .charged_prefill_tokens(endpoint)
    }

    fn report(&self, endpoint: EndpointId) -> Option<EngineReport> {
        self.gauges.get(endpoint.index()).copied()
    }

    fn deciders(&self) -> kvroute_select::Deciders {
        self.rep
            .remote
            .view(&*self.rep.tracker, self.now)
            .deciders()
    }
}

struct Sim<'a> {
    cfg: &'a FleetConfig,
    block_size: u32,
    workload: &'a Workload,
    policy: Policy,
    contract: ContractId,
    replicas: Vec<Replica>,
    index: SharedIndex,
    ingests: Vec<EndpointIngest>,
    workers: Vec<Worker<u32>>,
    /// Each request's charge on its replica's tracker, from decision to finish.
    guards: Vec<Option<LoadGuard>>,
    front: StdRng,
    timed: BinaryHeap<Timed>,
    timed_seq: u64,
    deliveries: VecDeque<(u64, usize, EventBatch)>,
    /// Replica sync in flight: (arrival µs, sending replica, delta); one
    /// fixed delay, so FIFO is time order.
    sync: VecDeque<(u64, usize, LoadDelta)>,
    sync_buf: Vec<LoadDelta>,
    next_seq: Vec<u64>,
    rng: StdRng,
    events: Vec<KvEvent>,
    spare_events: Vec<Vec<KvEvent>>,
    admissions: Vec<Admission<u32>>,
    keys: Vec<BlockKey>,
    /// Reused by every routing decision (no per-request allocation).
    decision: Decision,
    /// The workers' gauges at the current decision (peer policies only).
    gauges: Vec<EngineReport>,
    ttft_us: Vec<u64>,
    e2e_us: Vec<u64>,
    cached: Vec<u32>,
    predicted: Vec<u32>,
    /// The replica each request went to.
    request_replica: Vec<u32>,
    routed: Vec<u64>,
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
        if self.cfg.load_poll_us > 0 {
            self.push_timed(self.cfg.load_poll_us, POLL, 0, 0);
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
                    _ => {
                        self.poll(t);
                        self.push_timed(t + self.cfg.load_poll_us, POLL, 0, 0);
                    }
                }
            } else if delivery == Some(t) {
                if let Some((_, w, batch)) = self.deliveries.pop_front() {
                    self.apply(w, batch);
                }
            } else if synced == Some(t) {
                if let Some((_, from, delta)) = self.sync.pop_front() {
                    let now = Duration::from_micros(t);
                    let polled = self.cfg.load_poll_us > 0;
                    let more_now = self.sync.front().is_some_and(|d| d.0 == t && d.1 == from);
                    for (k, rep) in self.replicas.iter().enumerate() {
                        if k != from {
                            rep.remote.apply(&delta, now);
                            // Once per batch: the drain model times the
                            // other replica's charges from their arrival.
                            if !more_now {
                                let view = ReplicaLoad {
                                    rep,
                                    polled,
                                    now,
                                    gauges: &[],
                                };
                                rep.rule.observe_load(&view, now);
                            }
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
        let Some(rep) = self.replicas.get(k) else {
            return;
        };
        self.sync_buf.clear();
        rep.tracker.drain_deltas(&mut self.sync_buf);
        let at = t.saturating_add(self.cfg.replica_sync_us);
        self.sync
            .extend(self.sync_buf.drain(..).map(|d| (at, k, d)));
    }

    fn push_timed(&mut self, t: u64, kind: u8, w: u32, r: u32) {
        self.timed_seq += 1;
        self.timed.push(Reverse((t, kind, self.timed_seq, w, r)));
    }

    /// Every replica reads every engine's running / waiting counts, as the
    /// gateway's metrics poller does.
    fn poll(&mut self, t: u64) {
        let now = Duration::from_micros(t);
        for (w, worker) in self.workers.iter_mut().enumerate() {
            worker.advance(t);
            let report = EngineReport {
                running: worker.running(),
                waiting: u32::try_from(worker.waiting()).unwrap_or(u32::MAX),
                kv_usage: None,
                // Simulated requests end their prefill charge at their first
                // token, so the tracker's rate needs no engine counters.
                prefill: None,
                kv_capacity_blocks: None,
            };
            let id = EndpointId(u32::try_from(w).unwrap_or(u32::MAX));
            for rep in &self.replicas {
                let mine = rep.remote.view(&*rep.tracker, now).load(id);
                rep.reported.update(id, report, mine, now);
            }
        }
    }

    fn finish(&mut self, w: usize, r: usize, t: u64) {
        if let Some(worker) = self.workers.get_mut(w) {
            worker.advance(t);
        }
        // The response ended: the request stops counting.
        if let Some(g) = self.guards.get_mut(r) {
            *g = None;
        }
        self.share(self.replica_index(r), t);
        self.last_finish = self.last_finish.max(t);
        self.after_step(w, t);
    }

    /// The replica the front end sent request `r` to (recorded at routing).
    fn replica_index(&self, r: usize) -> usize {
        if self.replicas.len() <= 1 {
            return 0;
        }
        self.request_replica.get(r).copied().unwrap_or(0) as usize
    }

    fn first_token(&mut self, r: usize) {
        if let Some(Some(g)) = self.guards.get_mut(r) {
            g.first_byte();
        }
    }

    /// Routes request `r` arriving at `t`; false if no worker could take it.
    fn route(&mut self, r: usize, t: u64) -> bool {
        let Some(req) = self.workload.requests().get(r).copied() else {
            return false;
        };
        self.first_arrival.get_or_insert(t);
        block_keys(
            self.workload.ids(&req),
            req.input_tokens,
            self.block_size,
            &mut self.keys,
        );
        let k = if self.replicas.len() > 1 {
            self.front.gen_range(0..self.replicas.len())
        } else {
            0
        };
        if let Some(x) = self.request_replica.get_mut(r) {
            *x = u32::try_from(k).unwrap_or(0);
        }
        let now = Duration::from_micros(t);
        let Some(rep) = self.replicas.get_mut(k) else {
            return false;
        };
        let polled = self.cfg.load_poll_us > 0;
        if self.policy.is_peer() {
            // The peers read the engines' gauges at decision time.
            self.gauges.clear();
            for worker in &mut self.workers {
                worker.advance(t);
                let cap = u64::from(worker.config().capacity_blocks.max(1));
                let used = u64::from(worker.cache().used_blocks());
                #[allow(clippy::cast_precision_loss)]
                self.gauges.push(EngineReport {
                    running: worker.running(),
                    waiting: u32::try_from(worker.waiting()).unwrap_or(u32::MAX),
                    kv_usage: Some(used as f64 / cap as f64),
                    prefill: None,
                    kv_capacity_blocks: Some(cap),
                });
            }
        }
        let request = Request::new(PromptInput::Keys {
            keys: &self.keys,
            contract: &self.contract,
            prompt_tokens: req.input_tokens,
        });
        let view = ReplicaLoad {
            rep: &*rep,
            polled,
            now,
            gauges: &self.gauges,
        };
        rep.rule.decide_into(
            &mut self.decision,
            &request,
            &self.index,
            &view,
            &AlwaysAvailable,
            now,
        );
        let decision = &self.decision;
        let Some(target) = decision.target() else {
            self.rejected += 1;
            return false;
        };
        let predicted = if decision.source() == Source::KvExact {
            decision.predicted_cached_tokens(self.block_size)
        } else {
            0
        };
        let prefill = decision.predicted_prefill_tokens(self.block_size);
        let w = target.endpoint.index();
        if let Some(p) = self.predicted.get_mut(r) {
            *p = predicted;
        }
        if over_bound(
            &self.replicas,
            self.workers.len(),
            self.cfg.tuning.epsilon,
            w,
        ) {
            self.over_bound += 1;
        }
        let Some(rep) = self.replicas.get(k) else {
            return false;
        };
        let guard = rep.tracker.charge(target, prefill);
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
        if let Some(g) = self.guards.get_mut(r) {
            *g = Some(guard);
        }
        self.share(k, t);
        if let Some(x) = self.routed.get_mut(w) {
            *x += 1;
        }
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
            if let Some(x) = self.ttft_us.get_mut(r) {
                *x = a.first_token_us - a.submitted_us;
            }
            if let Some(x) = self.e2e_us.get_mut(r) {
                *x = a.finish_us - a.submitted_us;
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

    /// Feeds one batch through worker `w`'s ingest; returns the emptied event
    /// buffer for reuse.
    fn apply(&mut self, w: usize, batch: EventBatch) -> Vec<KvEvent> {
        if let Some(ingest) = self.ingests.get_mut(w) {
            let _ = ingest.apply_batch(&batch, &self.index);
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
            let c = rep.rule.counters().snapshot();
            kv_hits += c.endpoints.iter().map(|e| e.hits).sum::<u64>();
            fallbacks += c.fallbacks;
            load_diversions += c.load_diversions;
        }
        let mut seq = kvroute_ingest::SeqCounters::default();
        let mut clears = 0;
        for ingest in &self.ingests {
            seq += ingest.seq_counters();
            clears += ingest.counters().clears;
        }
        #[allow(clippy::cast_precision_loss)]
        PolicyReport {
            policy: self.policy.name().to_owned(),
            requests: reqs.len() as u64,
            served,
            rejected: self.rejected,
            prefix_hit_ratio: ratio(cached, prompt),
            hit_over_pooled: 0.0,
            requests_with_hit: ratio(with_hit, served),
            ttft_ms: Summary::of_us(&mut ttft),
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
        }
    }
}
