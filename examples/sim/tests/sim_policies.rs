//! Policy comparisons through the real rule, ingest and worker model: KV-exact
//! beats round robin where prompts share prefixes, nothing beats one infinite
//! cache, the bounded scorer respects its bound, and lost events cost hits.

mod support;

use kvroute_sim as sim;

use sim::fleet::FleetConfig;
use sim::policy::Policy;
use sim::report::{PolicyReport, SimReport};
use sim::workload::{generate, GenConfig, Kind};
use sim::RunPlan;

const BLOCK: u32 = 64;

fn fleet() -> FleetConfig {
    FleetConfig {
        event_delay_us: 0,
        seed: 11,
        load_poll_us: 0,
        ..support::fleet(8, BLOCK, 262_144)
    }
}

fn run(kind: Kind, requests: usize, fleet: FleetConfig, policies: &[Policy]) -> SimReport {
    let w = generate(&GenConfig {
        kind,
        requests,
        seed: 5,
        rate: 40.0,
    });
    let plan = RunPlan {
        fleet,
        policies: policies.to_vec(),
        time_scale: 1.0,
        arrival_spread_us: 0,
    };
    sim::simulate_all(w, kind.name(), &plan).unwrap()
}

fn get(r: &SimReport, p: Policy) -> &PolicyReport {
    r.policies.iter().find(|x| x.policy == p.name()).unwrap()
}

#[test]
fn kv_exact_beats_round_robin_on_tenants_and_ideal_bounds_everyone() {
    let r = run(Kind::Tenants, 2000, fleet(), &Policy::ALL);
    let rr = get(&r, Policy::RoundRobin).prefix_hit_ratio;
    for p in [
        Policy::KvOverlap,
        Policy::KvPrefix,
        Policy::KvBounded,
        Policy::KvExact,
    ] {
        let hit = get(&r, p).prefix_hit_ratio;
        assert!(hit > rr + 0.1, "{}: {hit} vs rr {rr}", p.name());
    }
    for p in &r.policies {
        assert_eq!(p.served, 2000, "{}", p.policy);
        assert!(
            p.prefix_hit_ratio <= r.workload.ideal_prefix_hit_ratio,
            "{} {} > ideal {}",
            p.policy,
            p.prefix_hit_ratio,
            r.workload.ideal_prefix_hit_ratio
        );
        assert!(p.ttft_ms.p50 <= p.ttft_ms.p99 && p.ttft_ms.p99 <= p.e2e_ms.p99);
    }
}

#[test]
fn ideal_bounds_every_policy_on_conversations() {
    let r = run(Kind::Multiturn, 1500, fleet(), &Policy::ALL);
    for p in &r.policies {
        assert!(
            p.prefix_hit_ratio <= r.workload.ideal_prefix_hit_ratio,
            "{}",
            p.policy
        );
    }
    // Every conversation shares the system prompt: argmax overlap piles onto the
    // first worker that holds it, the bounded scorer does not.
    let overlap = get(&r, Policy::KvOverlap);
    let bounded = get(&r, Policy::KvBounded);
    assert!(
        overlap.load.routed_max_over_mean > 4.0,
        "{:?}",
        overlap.load
    );
    assert!(
        bounded.load.routed_max_over_mean < 1.5,
        "{:?}",
        bounded.load
    );
}

#[test]
fn bounded_scorer_keeps_its_load_bound() {
    let mut f = fleet();
    f.tuning.epsilon = 0.25;
    // Least-load fallback: then every placement, scored or not, is under the cap
    // (the round-robin fallback for prompts nobody holds is not load-bounded).
    f.tuning.bounded_fallback = kvroute_select::SelectorKind::LeastLoad;
    let r = run(
        Kind::Tenants,
        2000,
        f,
        &[Policy::KvOverlap, Policy::KvBounded],
    );
    let bounded = get(&r, Policy::KvBounded);
    // The cap ⌈1.25·mean⌉ always admits the least-loaded worker, so no
    // placement may exceed it.
    assert_eq!(bounded.load.over_bound_fraction, 0.0, "{:?}", bounded.load);
    assert!(
        bounded.load.max_over_mean_in_flight <= 1.25 + 0.25,
        "{:?}",
        bounded.load
    );
    // The same metric is not vacuous: plain argmax breaks the bound.
    let overlap = get(&r, Policy::KvOverlap);
    assert!(overlap.load.over_bound_fraction > 0.0, "{:?}", overlap.load);
    assert!(bounded.routing.load_diversions > 0);
}

#[test]
fn lost_events_cost_hits_and_the_window_decides_how_many() {
    let base = run(Kind::Tenants, 2000, fleet(), &[Policy::KvOverlap]);
    let clean = get(&base, Policy::KvOverlap);
    assert_eq!(clean.events.lost, 0);
    assert_eq!(clean.events.clears, 0);

    // Window 0: every lost batch is a gap beyond the window → the endpoint clears.
    let mut f = fleet();
    f.event_loss = 0.2;
    f.seq_window = 0;
    let lossy = run(Kind::Tenants, 2000, f, &[Policy::KvOverlap]);
    let lossy = get(&lossy, Policy::KvOverlap);
    assert!(lossy.events.lost > 0);
    assert!(lossy.events.gaps_cleared > 0);
    assert!(
        lossy.prefix_hit_ratio < clean.prefix_hit_ratio,
        "{} vs {}",
        lossy.prefix_hit_ratio,
        clean.prefix_hit_ratio
    );

    // Default window: the gaps are absorbed, the inventory is kept.
    let mut f = fleet();
    f.event_loss = 0.2;
    let kept = run(Kind::Tenants, 2000, f, &[Policy::KvOverlap]);
    let kept = get(&kept, Policy::KvOverlap);
    assert!(kept.events.gaps_kept > 0);
    assert_eq!(kept.events.gaps_cleared, 0);
    assert!(kept.prefix_hit_ratio > lossy.prefix_hit_ratio);
}

#[test]
fn with_every_event_lost_kv_exact_is_its_round_robin_fallback() {
    let mut f = fleet();
    f.event_loss = 1.0;
    let r = run(
        Kind::Tenants,
        1000,
        f,
        &[Policy::RoundRobin, Policy::KvOverlap],
    );
    let rr = get(&r, Policy::RoundRobin);
    let kv = get(&r, Policy::KvOverlap);
    assert_eq!(kv.routing.kv_hits, 0);
    assert_eq!(kv.routing.fallbacks, 1000);
    assert_eq!(kv.prefix_hit_ratio, rr.prefix_hit_ratio);
    assert_eq!(kv.ttft_ms, rr.ttft_ms);
}

#[test]
fn closed_loop_keeps_the_concurrency() {
    let mut f = fleet();
    f.concurrency = Some(16);
    let r = run(Kind::Nosharing, 800, f, &[Policy::LeastLoad]);
    let p = get(&r, Policy::LeastLoad);
    assert_eq!(p.served, 800);
    let total_in_flight = p.load.mean_in_flight * 8.0;
    assert!(
        total_in_flight <= 16.0 + 1e-9 && total_in_flight > 12.0,
        "{total_in_flight}"
    );
}

/// Four gateway replicas behind a random front end, each with its own
/// tracker and predicted entries, seeing the others only through polled
/// engine reports: the hit ratio of one replica holds.
#[test]
fn replicas_keep_the_hit_ratio_of_one() {
    let one = run(Kind::Tenants, 1500, fleet(), &[Policy::KvExact]);
    let mut f = fleet();
    f.replicas = 4;
    f.load_poll_us = 100_000;
    let four = run(Kind::Tenants, 1500, f, &[Policy::KvExact]);
    let (a, b) = (get(&one, Policy::KvExact), get(&four, Policy::KvExact));
    assert_eq!(b.served, 1500);
    assert!(
        b.prefix_hit_ratio >= 0.95 * a.prefix_hit_ratio,
        "{} vs {}",
        b.prefix_hit_ratio,
        a.prefix_hit_ratio
    );
    assert!(b.load.max_over_mean_in_flight <= 1.3, "{:?}", b.load);
}
