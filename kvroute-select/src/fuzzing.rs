//! Fuzz entry points (used by `fuzz/fuzz_targets/select_ladder.rs`, the corpus
//! replay test and the property tests). The assertions here are the oracle:
//! they state the ladder's invariants.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::InventoryView;

use crate::{
    Availability, Choice, ContractId, CostConfig, CostScorer, Decision, Endpoint, EndpointLoad,
    Health, KeySetInventory, Leg, LoadAwareConfig, LoadAwareScorer, LoadTable, LongestPrefixScorer,
    MissReason, OverlapCountScorer, PromptInput, Request, Role, Rule, RuleConfig, SelectorKind,
    Source, Topology,
};

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
}

/// Availability per endpoint, read from fuzz bytes.
struct FuzzHealth(Vec<Availability>);

impl Health for FuzzHealth {
    fn availability(&self, endpoint: EndpointId, _now: Duration) -> Availability {
        self.0.get(endpoint.index()).copied().unwrap_or_default()
    }
}

/// Builds a random rule, inventory, loads and health from `data`, decides, retries
/// a few times, and checks the ladder's invariants after every step.
pub fn select_ladder(data: &[u8]) {
    let mut b = Bytes(data);
    let n = 1 + usize::from(b.next() % 10);
    let topology = if b.next() & 1 == 0 {
        Topology::Converged
    } else {
        Topology::PrefillDecode
    };
    let mut endpoints = Vec::with_capacity(n);
    let mut slot = 0u32;
    for i in 0..n {
        let role = match b.next() % 3 {
            0 => Role::Prefill,
            1 => Role::Decode,
            _ => Role::Both,
        };
        let mut e = Endpoint::new(format!("ep{i}"), role)
            .with_weight(u32::from(b.next() % 4))
            .with_capacity(u32::from(b.next() % 4));
        if b.next() & 1 == 1 {
            e = e.with_inventory_slot(slot);
            slot += 1;
        }
        endpoints.push(e);
    }
    if topology == Topology::PrefillDecode {
        // Guarantee the P/D precondition so the rule builds.
        if let Some(e) = endpoints.first_mut() {
            e.role = Role::Prefill;
        }
        if let Some(e) = endpoints.last_mut() {
            e.role = if n == 1 { Role::Both } else { Role::Decode };
        }
    }
    let contract = ContractId::new("fuzz");
    let mut cfg = RuleConfig::kv_exact("fuzz", topology, endpoints, 4, contract.clone());
    cfg.choice = match b.next() % 4 {
        0 => Choice::RoundRobin,
        1 => Choice::ContentAffinity,
        _ => Choice::KvExact,
    };
    cfg.scorer = match b.next() % 4 {
        0 => Arc::new(OverlapCountScorer),
        1 => Arc::new(LongestPrefixScorer),
        2 => Arc::new(LoadAwareScorer(LoadAwareConfig {
            epsilon: f64::from(b.next() % 8) / 4.0,
            ..LoadAwareConfig::default()
        })),
        _ => Arc::new(CostScorer(CostConfig {
            load_factor: 1.0 + f64::from(b.next() % 8) / 4.0,
            affinity_slack: f64::from(b.next() % 4) / 4.0,
            ..CostConfig::default()
        })),
    };
    cfg.fallback = match b.next() % 7 {
        0 => SelectorKind::RoundRobin,
        1 => SelectorKind::LeastLoad,
        6 => SelectorKind::LeastPrefill,
        2 => SelectorKind::PowerOfTwoChoices,
        3 => SelectorKind::Chwbl,
        4 => SelectorKind::Random,
        _ => SelectorKind::Weighted,
    };
    cfg.thresholds.min_overlap_blocks = 1 + u32::from(b.next() % 3);
    cfg.thresholds.max_retries = u32::from(b.next() % 8);
    cfg.seed = u64::from(b.next());
    // Samples of 1 or 2 on pools of up to 10 (sampled from 5 endpoints on),
    // from the seed's byte: the committed seeds decode as they were saved.
    cfg.thresholds.sample_size = u32::try_from(cfg.seed % 3).unwrap_or(0);
    let Ok(rule) = Rule::new(cfg, None) else {
        return;
    };

    let universe: Vec<BlockKey> = (1..=12u64).map(BlockKey).collect();
    let mut inv = KeySetInventory::new(slot as usize);
    for s in 0..slot as usize {
        let mask = u16::from_le_bytes([b.next(), b.next()]);
        inv.store(
            s,
            universe
                .iter()
                .enumerate()
                .filter(|(k, _)| mask >> k & 1 == 1)
                .map(|(_, k)| *k),
        );
    }
    let prompt_len = usize::from(b.next() % 9);
    let keys: Vec<BlockKey> = (0..prompt_len)
        .map(|_| BlockKey(1 + u64::from(b.next() % 14)))
        .collect();
    let mut load = LoadTable::new(n);
    let mut health = Vec::with_capacity(n);
    for i in 0..n {
        let id = EndpointId(u32::try_from(i).unwrap_or(0));
        load.set(
            id,
            EndpointLoad {
                in_flight: u32::from(b.next() % 8),
                queued_prefill_tokens: u64::from(b.next()) * 16,
            },
        );
        health.push(match b.next() % 6 {
            0 => Availability::AdminDown,
            1 => Availability::BreakerOpen,
            _ => Availability::Available,
        });
    }
    let health = FuzzHealth(health);
    let other = ContractId::new("other");
    let prompt = match b.next() % 8 {
        0 => PromptInput::Missing(MissReason::NotJson),
        1 => PromptInput::Keys {
            keys: &keys,
            contract: &other,
            prompt_tokens: 4,
        },
        _ => PromptInput::Keys {
            keys: &keys,
            contract: &contract,
            prompt_tokens: u32::try_from(keys.len() * 4).unwrap_or(0),
        },
    };
    let text = "the shared system preamble of every request in this fuzz case";
    let mut request = Request::new(prompt);
    if b.next() & 1 == 1 {
        request = request.with_session("session");
    }
    if b.next() & 1 == 1 {
        request = request.with_text(text);
    }
    let now = Duration::from_secs(u64::from(b.next()));

    let mut d = rule.decide(&request, &inv, &load, &health, now);
    check(&rule, &d, &inv, &load, &health, now, true);
    for _ in 0..(b.next() % 6) {
        let leg = if b.next() & 1 == 0 {
            Leg::Endpoint
        } else {
            Leg::Decode
        };
        let before = d.target();
        let kv_before = d.source() == Source::KvExact;
        let next = rule.retry(&mut d, leg, &request, &load, &health, now);
        if let (Some(prev), Some(next)) = (before, next) {
            if leg == Leg::Endpoint {
                assert_ne!(
                    prev.endpoint, next.endpoint,
                    "retry returned the failed endpoint"
                );
                if kv_before {
                    assert_eq!(d.source(), Source::KvExact, "a KV retry left the tier");
                }
            }
        }
        check(&rule, &d, &inv, &load, &health, now, false);
    }
    let _ = rule.record_receipt(&d, u32::from(b.next()));
}

/// The invariants every decision state satisfies.
pub fn check<V: InventoryView + ?Sized>(
    rule: &Rule,
    d: &Decision,
    _view: &V,
    load: &LoadTable,
    health: &dyn Health,
    now: Duration,
    first: bool,
) {
    use crate::Load;
    let Some(t) = d.target() else {
        assert_eq!(d.source(), Source::Exhausted);
        return;
    };
    let eps = rule.endpoints();
    let pd = rule.config().topology == Topology::PrefillDecode;
    let eligible = |i: EndpointId| {
        eps.get(i.index())
            .is_some_and(|e| !pd || e.role.can_prefill())
            && !d.is_excluded(i)
            && health.availability(i, now).is_available()
    };
    assert!(eligible(t.endpoint), "ineligible endpoint chosen: {t:?}");
    match (pd, t.decode) {
        (true, Some(dec)) => {
            assert!(eps.get(dec.index()).is_some_and(|e| e.role.can_decode()));
            assert!(health.availability(dec, now).is_available());
        }
        (false, None) => {}
        other => panic!("decode leg does not match topology: {other:?}"),
    }
    if d.source() == Source::KvExact {
        // A sampled decision chose among the endpoints it scored.
        let sampled = d.sampled();
        let ids = (0..eps.len())
            .filter(|i| sampled.is_empty() || sampled.iter().any(|s| *s as usize == *i))
            .filter_map(|i| u32::try_from(i).ok().map(EndpointId));
        let figure = |i: EndpointId| {
            let o = d.overlaps().get(i.index()).copied().unwrap_or_default();
            if rule.config().scorer.reads_any_position() {
                o.blocks
            } else {
                let spec = d.speculative_prefix().get(i.index()).copied().unwrap_or(0);
                o.prefix.max(spec)
            }
        };
        if !sampled.is_empty() {
            // A sample keeps every endpoint holding more than the prefix
            // most of the pool holds.
            let all: Vec<u32> = (0..eps.len())
                .filter_map(|i| u32::try_from(i).ok().map(EndpointId))
                .map(figure)
                .collect();
            let majority = all
                .iter()
                .find(|f| all.iter().filter(|g| g == f).count() * 2 > all.len());
            let Some(&m) = majority else {
                panic!("sampled without a majority: {all:?}");
            };
            for (i, f) in all.iter().enumerate() {
                if *f > m {
                    assert!(
                        sampled.iter().any(|s| *s as usize == i),
                        "{i} holds {f} > {m}"
                    );
                }
            }
        }
        let scorer: &dyn std::any::Any = &*rule.config().scorer;
        let load_aware = scorer.downcast_ref::<LoadAwareScorer>().map(|s| s.0);
        let cost = scorer.downcast_ref::<CostScorer>().map(|s| s.0);
        match (load_aware, cost) {
            (None, None) => {
                let best = ids.filter(|i| eligible(*i)).map(figure).max().unwrap_or(0);
                assert_eq!(figure(t.endpoint), best, "KV winner is not the argmax");
                if first {
                    assert!(best >= rule.config().thresholds.min_overlap_blocks.max(1));
                }
            }
            _ => {
                let (factor, headroom) = match (load_aware, cost) {
                    (Some(cfg), _) => (1.0 + cfg.epsilon.max(0.0), 0),
                    (_, Some(cfg)) => (cfg.load_factor, cfg.load_headroom),
                    _ => (1.0, 0),
                };
                let (mut total, mut cap) = (0u64, 0u64);
                let cands: Vec<EndpointId> = ids.filter(|i| eligible(*i)).collect();
                for i in &cands {
                    total += u64::from(load.load(*i).in_flight);
                    cap += u64::from(eps[i.index()].capacity.max(1));
                }
                let bound = crate::LoadBound {
                    total_in_flight: total,
                    total_capacity: cap.max(1),
                    factor: factor.max(1.0),
                };
                let admits = |i: EndpointId| {
                    !factor.is_finite()
                        || bound.admits(
                            load.load(i).in_flight.saturating_sub(headroom),
                            eps[i.index()].capacity.max(1),
                        )
                };
                if !admits(t.endpoint) {
                    assert!(
                        !cands.iter().any(|i| admits(*i)),
                        "load cap violated while others were under it"
                    );
                }
            }
        }
    }
}

/// Drives the outlier detector and its naive model
/// (`crate::outlier::model`) with operations read from `data` on a clock
/// that only moves forward, and asserts after every step that they agree
/// (ejections returned, who is ejected and until when, counts) and that no
/// ejection left the pool without an endpoint in rotation.
pub fn outlier(data: &[u8]) {
    use crate::outlier::model::Model;
    use crate::{EngineEvidence, OutlierConfig, OutlierDetector};

    let mut b = Bytes(data);
    let n = 1 + usize::from(b.next() % 4);
    let ms = |x: u8, scale: u64| Duration::from_millis(u64::from(x) * scale);
    let base = ms(1 + b.next() % 8, 500);
    let config = OutlierConfig {
        stall_after: ms(b.next() % 9, 500),
        report_grace: ms(b.next() % 5, 250),
        consecutive_timeouts: u32::from(b.next() % 5),
        base_ejection: base,
        max_ejection: base.saturating_mul(u32::from(1 + b.next() % 4)),
    };
    let mut det = OutlierDetector::new(n, config);
    let mut model = Model::new(n, config);
    // (endpoint, the detector's handle, the model's handle)
    let mut attempts: Vec<(usize, crate::AttemptId, usize)> = Vec::new();
    let mut now = Duration::ZERO;
    let id = |e: usize| EndpointId(u32::try_from(e).unwrap_or(u32::MAX));
    for _ in 0..400 {
        if b.0.is_empty() {
            break;
        }
        let op = b.next();
        now += ms(b.next() % 16, 125);
        let e = usize::from(b.next()) % n;
        match op % 8 {
            0 | 1 => {
                let d = det.sent(id(e), now);
                let m = model.sent(e, now);
                if let (Some(d), Some(m)) = (d, m) {
                    attempts.push((e, d, m));
                }
            }
            2..=4 if !attempts.is_empty() => {
                let k = usize::from(b.next()) % attempts.len();
                let (e, d, m) = attempts.swap_remove(k);
                match op % 8 {
                    2 => {
                        det.answered(id(e), d, now);
                        model.answered(m, now);
                    }
                    3 => {
                        det.abandoned(id(e), d);
                        model.abandoned(m, now);
                    }
                    _ => {
                        let ours = det.timed_out(id(e), d, now);
                        assert_eq!(ours, model.timed_out(m, now), "timeout ejection at {now:?}");
                        if ours {
                            assert_rotation(&det, &model, n, now);
                        }
                    }
                }
            }
            5 => {
                let ev = match b.next() % 4 {
                    0 => EngineEvidence::Unreachable,
                    k => EngineEvidence::Report {
                        busy: u32::from(k - 1) * u32::from(b.next() % 3),
                    },
                };
                det.evidence(id(e), now, ev);
                model.evidence(e, now, ev);
            }
            6 if b.next() % 8 == 0 => {
                let k = b.next();
                if k & 4 == 0 {
                    let present = k % 3 != 0;
                    det.set_present(id(e), present, now);
                    model.set_present(e, present, now);
                } else {
                    // Drained or breaker open, or back.
                    let available = k % 3 != 0;
                    det.set_available(id(e), available);
                    model.set_available(e, available);
                }
            }
            _ => {
                let ours = det.evaluate(now);
                let theirs: Vec<EndpointId> = model.evaluate(now).into_iter().map(id).collect();
                assert_eq!(ours, theirs, "stall ejections at {now:?}");
                if !ours.is_empty() {
                    assert_rotation(&det, &model, n, now);
                }
            }
        }
        for e in 0..n {
            let s = det.status(id(e), now);
            assert_eq!(
                s.ejected,
                model.is_ejected(e, now),
                "endpoint {e} at {now:?}"
            );
            assert_eq!(det.is_ejected(id(e), now), s.ejected);
            if let Some(until) = model.ejected_until(e, now) {
                assert_eq!(s.ejected_for, until - now, "endpoint {e} at {now:?}");
            }
            assert_eq!((s.ejections, s.stall_ejections), model.ejections(e));
            assert_eq!(s.waiting, model.waiting_count(e), "endpoint {e}");
            assert_eq!(s.consecutive_timeouts, model.consecutive_timeouts(e));
            if let Some(next) = det.next_stall_check(now) {
                assert!(next > now);
            }
        }
    }
}

/// Right after an ejection some present endpoint is still in rotation.
fn assert_rotation(
    det: &crate::OutlierDetector,
    model: &crate::outlier::model::Model,
    n: usize,
    now: Duration,
) {
    let id = |e: usize| EndpointId(u32::try_from(e).unwrap_or(u32::MAX));
    assert!(
        (0..n).any(|e| model.present(e) && model.available(e) && !det.is_ejected(id(e), now)),
        "every endpoint the host routes to ejected at {now:?}"
    );
}

/// Drives a [`crate::RemoteLoad`] table and its naive model
/// (`crate::replica_sync::model`) with what other replicas send, read from
/// `data`: real [`crate::LoadTracker`]s charge, answer, retarget and release
/// requests and their outboxes are drained into a network that delivers any
/// message, any number of times, in any order, or never; forged deltas
/// (sequence number 0 or huge, unknown endpoints, this replica's own origin,
/// more origins than the table has room for) join them; time jumps,
/// expiry sweeps, endpoints leaving the rule and new ones taking their
/// slots at an origin. After every step the table and the model agree on what
/// each delta did, every endpoint's remote load and charged tokens, the
/// deciders and the counters. Without forged deltas, a final resync of every
/// tracker makes the table exactly the trackers' totals.
pub fn replica_sync(data: &[u8]) {
    use crate::replica_sync::model::Model;
    use crate::{Load, LoadDelta, LoadGuard, LoadTracker, RemoteConfig, RemoteLoad, Target};

    let mut b = Bytes(data);
    let n = 1 + usize::from(b.next() % 3);
    let max_origins = 1 + usize::from(b.next() % 4);
    let ttl = Duration::from_millis(500 * (1 + u64::from(b.next() % 4)));
    // Origin ids 1..=max_origins + 1, this table's own among them: at most
    // `max_origins` others, within the model's scope.
    let ids = max_origins as u64 + 1;
    let own = 1 + u64::from(b.next()) % ids;
    let cfg = RemoteConfig {
        endpoints: n,
        max_origins,
        ttl,
    };
    let table = RemoteLoad::new(cfg, own);
    let mut model = Model::new(cfg, own);
    let trackers: Vec<Arc<LoadTracker>> = (1..=1 + u64::from(b.next()) % ids.min(3))
        .map(|id| Arc::new(LoadTracker::with_sync(n, id)))
        .collect();
    let mut guards: Vec<LoadGuard> = Vec::new();
    let mut sent: Vec<LoadDelta> = Vec::new();
    let mut forged = false;
    let mut last_charged = vec![0u64; n + 1];
    let mut now = Duration::from_secs(1);
    let id = |e: u8| EndpointId(u32::from(e) % (n as u32 + 1)); // one beyond the table
    let pick = |len: usize, x: u8| (len > 0).then(|| usize::from(x) % len);
    for _ in 0..400 {
        if b.0.is_empty() {
            break;
        }
        let op = b.next();
        let x = b.next();
        match op % 13 {
            0 | 1 => {
                let t = &trackers[usize::from(x) % trackers.len()];
                let decode = (b.next() & 1 == 1).then(|| id(b.next()));
                let target = Target {
                    endpoint: id(b.next()),
                    decode,
                };
                guards.push(t.charge(target, u32::from(b.next()) * 16));
            }
            2 => {
                if let Some(i) = pick(guards.len(), x) {
                    guards[i].first_byte();
                }
            }
            3 => {
                if let Some(i) = pick(guards.len(), x) {
                    guards[i].prefill_leg_done();
                }
            }
            4 => {
                if let Some(i) = pick(guards.len(), x) {
                    let target = Target {
                        endpoint: id(b.next()),
                        decode: None,
                    };
                    guards[i].retarget(target, u32::from(b.next()) * 16);
                }
            }
            5 => {
                if let Some(i) = pick(guards.len(), x) {
                    drop(guards.swap_remove(i));
                }
            }
            6 => {
                trackers[usize::from(x) % trackers.len()].drain_deltas(&mut sent);
            }
            7 => trackers[usize::from(x) % trackers.len()].resync(),
            8 | 9 => {
                if let Some(i) = pick(sent.len(), x) {
                    let d = sent[i];
                    // Receiving tasks race: a delivery may be stamped a
                    // little before one already applied.
                    let at = if op & 0x80 != 0 {
                        now.saturating_sub(Duration::from_millis(50 * u64::from(x % 4)))
                    } else {
                        now
                    };
                    assert_eq!(table.apply(&d, at), model.apply(&d, at), "{d:?} at {at:?}");
                }
            }
            10 => {
                if x & 1 == 0 {
                    now += Duration::from_millis(125 * u64::from(x % 16));
                } else if x & 2 == 0 {
                    assert_eq!(table.expire(now), model.expire(now), "expired at {now:?}");
                } else {
                    // The endpoint left the rule (its slot may be reused);
                    // at one origin a new endpoint takes the slot.
                    let e = id(b.next());
                    table.clear_endpoint(e);
                    model.clear_endpoint(e.index());
                    if x & 4 != 0 {
                        trackers[usize::from(x >> 3) % trackers.len()].retire(e);
                    }
                }
            }
            11 => {
                // An origin's news says whether it still decides (an id
                // never heard of changes nothing).
                let origin = 1 + u64::from(x >> 1) % (ids + 1);
                let seq = u64::from(b.next());
                table.set_retiring(origin, x & 1 == 1, seq, now);
                model.set_retiring(origin, x & 1 == 1, seq, now);
            }
            _ => {
                // Forged: anything a misbehaving publisher could send.
                forged = true;
                let seq = match b.next() % 4 {
                    0 => 0,
                    1 => u64::MAX,
                    _ => u64::from(b.next()),
                };
                sent.push(LoadDelta {
                    origin: 1 + u64::from(x) % ids,
                    seq,
                    endpoint: id(b.next()),
                    requests: 0,
                    prefill_tokens: 0,
                    in_flight: u32::from(b.next()),
                    // Now and then beyond MAX_DELTA_TOKENS (refused).
                    queued_prefill_tokens: match b.next() {
                        255 => u64::MAX,
                        v => u64::from(v) * 100,
                    },
                    charged_prefill_tokens: match b.next() {
                        255 => u64::MAX,
                        254 => crate::replica_sync::MAX_DELTA_TOKENS + 1,
                        v => u64::from(v) * 1000,
                    },
                });
            }
        }
        for e in 0..=n as u32 {
            let ep = EndpointId(e);
            assert_eq!(
                table.remote(ep, now),
                model.remote(e as usize, now),
                "endpoint {e}"
            );
            let charged = table.remote_charged(ep);
            assert_eq!(
                charged,
                model.remote_charged(e as usize),
                "charged at endpoint {e}"
            );
            // A monotonic counter: peers' drain models read its increments.
            if let Some(prev) = last_charged.get_mut(e as usize) {
                assert!(charged >= *prev, "charged went back at endpoint {e}");
                *prev = charged;
            }
        }
        assert_eq!(table.deciders(now), model.deciders(now), "deciders");
        assert_eq!(table.counters(), model.counters(), "counters");
    }
    if forged {
        return;
    }
    // Every tracker resyncs and its messages arrive: the table is exact.
    let mut last = Vec::new();
    for t in &trackers {
        t.resync();
        t.drain_deltas(&mut last);
    }
    for d in &last {
        assert_eq!(table.apply(d, now), model.apply(d, now), "{d:?}");
    }
    for e in 0..n as u32 {
        let ep = EndpointId(e);
        let mut want = EndpointLoad::default();
        for t in trackers.iter().filter(|t| t.origin() != Some(own)) {
            let l = t.load(ep);
            want.in_flight += l.in_flight;
            want.queued_prefill_tokens += l.queued_prefill_tokens;
        }
        assert_eq!(table.remote(ep, now), want, "endpoint {e} after a resync");
    }
    drop(guards);
}
