//! Replica decision sharing against a simple reference model: real
//! [`LoadTracker`]s (one per origin replica) charge, answer, retarget and
//! release requests; their outboxes are drained into a "network" from which
//! messages are delivered in any order, duplicated, late, or never; time
//! jumps expire silent origins. After every step the [`RemoteLoad`] table must
//! agree with a model that keeps, per origin and endpoint, the totals of the
//! newest message, and counts an origin only within its TTL of the last news.
//! At the end a resync of every origin must make the table equal the trackers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{
    Applied, EndpointLoad, Load, LoadDelta, LoadGuard, LoadTracker, RemoteConfig, RemoteLoad,
    Target,
};
use proptest::prelude::*;

const ENDPOINTS: usize = 3;
const ORIGINS: usize = 3;
const OWN: u64 = 50;
const TTL: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
enum Op {
    Charge {
        origin: usize,
        endpoint: u32,
        decode: Option<u32>,
        tokens: u32,
    },
    FirstByte(usize),
    PrefillLegDone(usize),
    Retarget {
        guard: usize,
        endpoint: u32,
        tokens: u32,
    },
    Release(usize),
    Drain(usize),
    Resync(usize),
    /// Deliver the message at this index of everything sent so far (again,
    /// possibly: duplicates; any index: reordering).
    Deliver(usize),
    Advance(u64),
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    let o = 0..ORIGINS;
    let e = 0..ENDPOINTS as u32 + 1; // one id beyond the table
    prop_oneof![
        3 => (o.clone(), e.clone(), proptest::option::of(0..ENDPOINTS as u32), 0u32..2000)
            .prop_map(|(origin, endpoint, decode, tokens)| Op::Charge { origin, endpoint, decode, tokens }),
        1 => any::<usize>().prop_map(Op::FirstByte),
        1 => any::<usize>().prop_map(Op::PrefillLegDone),
        1 => (any::<usize>(), e, 0u32..2000)
            .prop_map(|(guard, endpoint, tokens)| Op::Retarget { guard, endpoint, tokens }),
        2 => any::<usize>().prop_map(Op::Release),
        3 => o.clone().prop_map(Op::Drain),
        1 => o.prop_map(Op::Resync),
        5 => any::<usize>().prop_map(Op::Deliver),
        2 => (0u64..1500).prop_map(Op::Advance),
        1 => Just(Op::Expire),
    ]
}

/// The reference: per origin, the newest message's totals per endpoint.
#[derive(Default)]
struct ModelOrigin {
    alive: bool,
    last_heard: Duration,
    /// Highest sequence number applied (kept after expiry).
    max_seq: u64,
    entries: BTreeMap<u32, (u64, EndpointLoad)>,
}

#[derive(Default)]
struct Model {
    origins: BTreeMap<u64, ModelOrigin>,
}

impl Model {
    fn apply(&mut self, d: &LoadDelta, now: Duration) -> Applied {
        if d.origin == OWN {
            return Applied::Own;
        }
        if d.endpoint.index() >= ENDPOINTS {
            return Applied::UnknownEndpoint;
        }
        let o = self.origins.entry(d.origin).or_default();
        if !o.alive {
            if d.seq <= o.max_seq {
                return Applied::Stale;
            }
            o.alive = true;
            o.last_heard = now;
            o.entries.clear();
        }
        let seq = o.entries.get(&d.endpoint.0).map_or(0, |x| x.0);
        if d.seq <= seq {
            return Applied::Stale;
        }
        o.entries.insert(
            d.endpoint.0,
            (
                d.seq,
                EndpointLoad {
                    in_flight: d.in_flight,
                    queued_prefill_tokens: d.queued_prefill_tokens,
                },
            ),
        );
        o.last_heard = o.last_heard.max(now);
        o.max_seq = o.max_seq.max(d.seq);
        Applied::Applied
    }

    fn live(o: &ModelOrigin, now: Duration) -> bool {
        o.alive && now.saturating_sub(o.last_heard) <= TTL
    }

    fn expire(&mut self, now: Duration) -> usize {
        let mut n = 0;
        for o in self.origins.values_mut() {
            if o.alive && !Self::live(o, now) {
                o.alive = false;
                n += 1;
            }
        }
        n
    }

    fn load(&self, e: u32, now: Duration) -> EndpointLoad {
        let mut sum = EndpointLoad::default();
        for o in self.origins.values().filter(|o| Self::live(o, now)) {
            if let Some((_, l)) = o.entries.get(&e) {
                sum.in_flight += l.in_flight;
                sum.queued_prefill_tokens += l.queued_prefill_tokens;
            }
        }
        sum
    }
}

fn pick<T>(v: &[T], i: usize) -> Option<usize> {
    (!v.is_empty()).then(|| i % v.len())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn remote_load_follows_the_reference_model(ops in proptest::collection::vec(op(), 1..160)) {
        let trackers: Vec<Arc<LoadTracker>> = (0..ORIGINS)
            .map(|k| Arc::new(LoadTracker::with_sync(ENDPOINTS, k as u64 + 1)))
            .collect();
        let table = RemoteLoad::new(
            RemoteConfig { endpoints: ENDPOINTS, max_origins: 8, ttl: TTL, stagger: Duration::ZERO },
            OWN,
        );
        let mut model = Model::default();
        let mut guards: Vec<LoadGuard> = Vec::new();
        // A message from this replica itself, as a misconfigured peer list echoes it.
        let mut sent: Vec<LoadDelta> = vec![LoadDelta {
            origin: OWN, seq: 1, endpoint: EndpointId(0), requests: 1,
            prefill_tokens: 0, in_flight: 1, queued_prefill_tokens: 0,
            charged_prefill_tokens: 0,
        }];
        let mut now = Duration::from_secs(1);
        for op in ops {
            match op {
                Op::Charge { origin, endpoint, decode, tokens } => {
                    let t = Target { endpoint: EndpointId(endpoint), decode: decode.map(EndpointId) };
                    guards.push(trackers[origin].charge(t, tokens));
                }
                Op::FirstByte(i) => if let Some(i) = pick(&guards, i) { guards[i].first_byte() },
                Op::PrefillLegDone(i) => if let Some(i) = pick(&guards, i) { guards[i].prefill_leg_done() },
                Op::Retarget { guard, endpoint, tokens } => if let Some(i) = pick(&guards, guard) {
                    guards[i].retarget(Target { endpoint: EndpointId(endpoint), decode: None }, tokens);
                },
                Op::Release(i) => if let Some(i) = pick(&guards, i) { drop(guards.swap_remove(i)) },
                Op::Drain(k) => { trackers[k].drain_deltas(&mut sent); }
                Op::Resync(k) => trackers[k].resync(),
                Op::Deliver(i) => if let Some(i) = pick(&sent, i) {
                    let d = sent[i];
                    let want = model.apply(&d, now);
                    prop_assert_eq!(table.apply(&d, now), want, "{:?}", d);
                },
                Op::Advance(ms) => now += Duration::from_millis(ms),
                Op::Expire => prop_assert_eq!(table.expire(now), model.expire(now)),
            }
            for e in 0..ENDPOINTS as u32 + 1 {
                prop_assert_eq!(table.remote(EndpointId(e), now), model.load(e, now), "endpoint {}", e);
            }
        }
        // Every origin resyncs and its messages arrive: the table is exact.
        for t in &trackers {
            t.resync();
            let mut out = Vec::new();
            t.drain_deltas(&mut out);
            prop_assert_eq!(out.len(), ENDPOINTS);
            for d in &out {
                prop_assert_eq!(table.apply(d, now), Applied::Applied);
            }
        }
        let idle = LoadTracker::new(ENDPOINTS);
        let view = table.view(&idle, now);
        for e in 0..ENDPOINTS as u32 {
            let mut want = EndpointLoad::default();
            for t in &trackers {
                let l = t.load(EndpointId(e));
                want.in_flight += l.in_flight;
                want.queued_prefill_tokens += l.queued_prefill_tokens;
            }
            prop_assert_eq!(view.load(EndpointId(e)), want);
        }
        // Everyone falls silent: nothing sticks.
        let later = now + TTL + Duration::from_millis(1);
        for e in 0..ENDPOINTS as u32 {
            prop_assert_eq!(table.remote(EndpointId(e), later), EndpointLoad::default());
        }
        drop(guards);
    }
}

/// Engine reports compose over local + remote without counting a request
/// twice: requests the engine already counted at the poll stay counted once,
/// requests any replica decided since are added once.
#[test]
fn engine_reports_over_local_and_remote_count_each_request_once() {
    use kvroute_select::{EngineReport, ReportedLoad};
    let e = EndpointId(0);
    let target = Target {
        endpoint: e,
        decode: None,
    };
    let me = Arc::new(LoadTracker::with_sync(1, 1));
    let peer = Arc::new(LoadTracker::with_sync(1, 2));
    let remote = RemoteLoad::new(
        RemoteConfig {
            endpoints: 1,
            ..RemoteConfig::default()
        },
        1,
    );
    let reported = ReportedLoad::new(1, Duration::from_secs(5));
    let now = Duration::from_secs(1);
    let sync = |remote: &RemoteLoad| {
        let mut out = Vec::new();
        peer.drain_deltas(&mut out);
        for d in &out {
            remote.apply(d, now);
        }
    };
    let _a = me.charge(target, 100);
    let _b = peer.charge(target, 100);
    sync(&remote);
    // The engine runs both plus one from a replica that does not sync.
    let at_poll = remote.view(&*me, now).load(e);
    assert_eq!(at_poll.in_flight, 2);
    reported.update(
        e,
        EngineReport {
            running: 3,
            ..EngineReport::default()
        },
        at_poll,
        now,
    );
    let view = |remote: &RemoteLoad| {
        let mine = remote.view(&*me, now);
        reported.view(&mine, now).load(e).in_flight
    };
    assert_eq!(view(&remote), 3);
    // One more from the peer after the poll: counted once.
    let _c = peer.charge(target, 100);
    sync(&remote);
    assert_eq!(view(&remote), 4);
}
