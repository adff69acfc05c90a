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
//!   gateway's own load view in a [`LoadTable`]: requests in flight, and
//!   queued prefill tokens = Σ over requests not yet at their first token of
//!   (prompt tokens − cached tokens the index predicted for the chosen worker),
//!   all of which a gateway knows from its own decisions and streams.
//!
//! Time is simulated microseconds; nothing reads a clock. Events at the same
//! instant run in a fixed order — request completions, first tokens, event
//! deliveries, then arrivals — and every random choice comes from seeded
//! generators, so one seed gives one result.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::hash::BuildHasherDefault;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::seq::{RestartPolicy, SeqWindowConfig};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, KeyMode, KvEvent, SharedIndex,
};
use kvroute_select::{
    AlwaysAvailable, ContractId, Decision, LoadBound, LoadTable, PromptInput, Request, Rule, Source,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::policy::{Policy, Tuning, SIM_CONTRACT};
use super::report::{EventReport, LoadReport, PolicyReport, RoutingReport, Summary};
use super::trace::{block_keys, Workload};
use crate::engine_model::cache::KeyHasher;
use crate::engine_model::{Admission, RequestSpec, Worker, WorkerConfig};

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

/// (time µs, kind, insertion order, worker, prompt tokens) — min-heap order.
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
    let rule_cfg = policy.rule_config(n, block_size, cfg.seed, cfg.tuning);
    let rule = Rule::new(rule_cfg, None).map_err(|source| FleetError::Rule {
        policy: policy.name(),
        source,
    })?;
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
        rule,
        index: SharedIndex::new(n, index_cfg),
        ingests: (0..n)
            .map(|i| {
                let id = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
                EndpointIngest::new(id, ingest_cfg.clone(), KeyMode::Engine)
            })
            .collect(),
        workers: (0..n).map(|_| Worker::new(cfg.worker)).collect(),
        loads: LoadTable::new(n),
        in_flight: vec![0; n],
        queued: vec![0; n],
        timed: BinaryHeap::new(),
        timed_seq: 0,
        deliveries: VecDeque::new(),
        next_seq: vec![0; n],
        rng: StdRng::seed_from_u64(cfg.seed ^ 0x6c6f_7373),
        events: Vec::new(),
        spare_events: Vec::new(),
        admissions: Vec::new(),
        keys: Vec::new(),
        decision: Decision::new(),
        ttft_us: vec![u64::MAX; requests],
        e2e_us: vec![u64::MAX; requests],
        cached: vec![0; requests],
        predicted: vec![0; requests],
        prefill_tokens: vec![0; requests],
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

struct Sim<'a> {
    cfg: &'a FleetConfig,
    block_size: u32,
    workload: &'a Workload,
    policy: Policy,
    contract: ContractId,
    rule: Rule,
    index: SharedIndex,
    ingests: Vec<EndpointIngest>,
    workers: Vec<Worker<u32>>,
    loads: LoadTable,
    in_flight: Vec<u32>,
    queued: Vec<u64>,
    timed: BinaryHeap<Timed>,
    timed_seq: u64,
    deliveries: VecDeque<(u64, usize, EventBatch)>,
    next_seq: Vec<u64>,
    rng: StdRng,
    events: Vec<KvEvent>,
    spare_events: Vec<Vec<KvEvent>>,
    admissions: Vec<Admission<u32>>,
    keys: Vec<BlockKey>,
    /// Reused by every routing decision (no per-request allocation).
    decision: Decision,
    ttft_us: Vec<u64>,
    e2e_us: Vec<u64>,
    cached: Vec<u32>,
    predicted: Vec<u32>,
    prefill_tokens: Vec<u32>,
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
            let Some(t) = [timed, delivery, arrival].into_iter().flatten().min() else {
                break;
            };
            if timed == Some(t) {
                let Some(Reverse((t, kind, _, w, tokens))) = self.timed.pop() else {
                    break;
                };
                let w = w as usize;
                if kind == FINISH {
                    self.finish(w, t);
                    if self.cfg.concurrency.is_some() {
                        ready.push_back(t);
                    }
                } else {
                    self.first_token(w, tokens);
                }
            } else if delivery == Some(t) {
                if let Some((_, w, batch)) = self.deliveries.pop_front() {
                    self.apply(w, batch);
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

    fn set_load(&mut self, w: usize) {
        let (Some(&in_flight), Some(&queued)) = (self.in_flight.get(w), self.queued.get(w)) else {
            return;
        };
        if let Some(l) = self
            .loads
            .get_mut(EndpointId(u32::try_from(w).unwrap_or(u32::MAX)))
        {
            l.in_flight = in_flight;
            l.queued_prefill_tokens = queued;
        }
    }

    fn finish(&mut self, w: usize, t: u64) {
        if let Some(worker) = self.workers.get_mut(w) {
            worker.advance(t);
        }
        if let Some(x) = self.in_flight.get_mut(w) {
            *x = x.saturating_sub(1);
        }
        self.set_load(w);
        self.last_finish = self.last_finish.max(t);
        self.after_step(w, t);
    }

    fn first_token(&mut self, w: usize, tokens: u32) {
        if let Some(q) = self.queued.get_mut(w) {
            *q = q.saturating_sub(u64::from(tokens));
        }
        self.set_load(w);
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
        let request = Request::new(PromptInput::Keys {
            keys: &self.keys,
            contract: &self.contract,
            prompt_tokens: req.input_tokens,
        });
        let now = Duration::from_micros(t);
        self.rule.decide_into(
            &mut self.decision,
            &request,
            &self.index,
            &self.loads,
            &AlwaysAvailable,
            now,
        );
        let decision = &self.decision;
        let Some(target) = decision.target() else {
            self.rejected += 1;
            return false;
        };
        let w = target.endpoint.index();
        let predicted = decision.predicted_cached_tokens(self.block_size);
        if decision.source() == Source::KvExact {
            if let Some(p) = self.predicted.get_mut(r) {
                *p = predicted;
            }
        }
        // The gateway's estimate of the prefill work this request queues.
        let prefill = req.input_tokens.saturating_sub(predicted);
        if let Some(q) = self.prefill_tokens.get_mut(r) {
            *q = prefill;
        }
        self.check_bound(w);
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
        if let Some(x) = self.in_flight.get_mut(w) {
            *x += 1;
        }
        if let Some(q) = self.queued.get_mut(w) {
            *q += u64::from(prefill);
        }
        if let Some(x) = self.routed.get_mut(w) {
            *x += 1;
        }
        self.set_load(w);
        self.after_step(w, t);
        true
    }

    /// Counts a placement that takes worker `w` above the bounded-load limit
    /// `⌈(1+ε)·(Σ in-flight + 1)/n⌉` (the same limit `kv-bounded` enforces).
    fn check_bound(&mut self, w: usize) {
        let bound = LoadBound {
            total_in_flight: self.in_flight.iter().map(|x| u64::from(*x)).sum(),
            total_capacity: self.in_flight.len() as u64,
            factor: 1.0 + self.cfg.tuning.epsilon.max(0.0),
        };
        let mine = self.in_flight.get(w).copied().unwrap_or(0);
        if !bound.admits(mine, 1) {
            self.over_bound += 1;
        }
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
            let tokens = self.prefill_tokens.get(r).copied().unwrap_or(0);
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
                tokens,
            )));
            self.timed_seq += 1;
            self.timed
                .push(Reverse((a.finish_us, FINISH, self.timed_seq, wid, 0)));
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
        let counters = self.rule.counters().snapshot();
        let mut seq = kvroute_ingest::seq::SeqCounters::default();
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
            requests_with_hit: ratio(with_hit, served),
            ttft_ms: Summary::of_us(&mut ttft),
            e2e_ms: Summary::of_us(&mut e2e),
            throughput_rps: served as f64 / makespan_s,
            output_tokens_per_s: output as f64 / makespan_s,
            makespan_s,
            load: LoadReport::new(&avg_in_flight, &self.routed, self.over_bound, served),
            routing: RoutingReport {
                kv_hits: counters.endpoints.iter().map(|e| e.hits).sum(),
                fallbacks: counters.fallbacks,
                load_diversions: counters.load_diversions,
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
