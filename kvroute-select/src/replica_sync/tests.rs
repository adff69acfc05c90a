use std::sync::Arc;

use super::*;
use crate::decision::Target;

fn target(e: u32, d: Option<u32>) -> Target {
    Target {
        endpoint: EndpointId(e),
        decode: d.map(EndpointId),
    }
}

fn table(endpoints: usize, max_origins: usize) -> RemoteLoad {
    RemoteLoad::new(
        RemoteConfig {
            endpoints,
            max_origins,
            ttl: Duration::from_secs(2),
        },
        99,
    )
}

fn drain(t: &LoadTracker) -> Vec<LoadDelta> {
    let mut v = Vec::new();
    t.drain_deltas(&mut v);
    v
}

#[test]
fn every_guard_transition_is_announced() {
    let t = Arc::new(LoadTracker::with_sync(3, 7));
    let mut g = t.charge(target(0, Some(2)), 300);
    let d = drain(&t);
    assert_eq!(d.len(), 2);
    assert_eq!(
        (d[0].endpoint, d[0].requests, d[0].prefill_tokens),
        (EndpointId(0), 1, 300)
    );
    assert_eq!(
        (d[1].endpoint, d[1].requests, d[1].in_flight),
        (EndpointId(2), 1, 1)
    );
    assert!(d[0].seq < d[1].seq);
    g.prefill_leg_done();
    let d = drain(&t);
    assert_eq!(d.len(), 1);
    assert_eq!(
        (d[0].requests, d[0].prefill_tokens, d[0].in_flight),
        (-1, -300, 0)
    );
    g.retarget(target(1, None), 40);
    let d = drain(&t);
    let by: Vec<_> = d
        .iter()
        .map(|x| (x.endpoint.0, x.requests, x.prefill_tokens))
        .collect();
    assert_eq!(by, vec![(1, 1, 40), (2, -1, 0)]);
    g.first_byte();
    assert_eq!(drain(&t)[0].prefill_tokens, -40);
    drop(g);
    assert_eq!(drain(&t)[0].in_flight, 0);
    assert!(drain(&t).is_empty(), "nothing changed");
}

#[test]
fn outbox_coalesces_instead_of_dropping() {
    let t = Arc::new(LoadTracker::with_sync(1, 7));
    let guards: Vec<_> = (0..10).map(|_| t.charge(target(0, None), 5)).collect();
    let d = drain(&t);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].requests, d[0].prefill_tokens), (10, 50));
    assert_eq!(t.outbox_counters().coalesced, 9);
    drop(guards);
    let d = drain(&t);
    assert_eq!((d[0].requests, d[0].in_flight), (-10, 0));
}

#[test]
fn a_change_that_cancels_out_sends_nothing_but_resync_sends_all() {
    let t = Arc::new(LoadTracker::with_sync(2, 7));
    drop(t.charge(target(0, None), 0));
    assert!(drain(&t).is_empty());
    // Prefill tokens charged and done between two drains still go out:
    // peers' drain models learn the work from the charged counter.
    drop(t.charge(target(0, None), 5));
    let d = drain(&t);
    assert_eq!(d.len(), 1);
    assert_eq!(
        (d[0].queued_prefill_tokens, d[0].charged_prefill_tokens),
        (0, 5)
    );
    t.resync();
    let d = drain(&t);
    assert_eq!(d.len(), 2);
    assert!(d.iter().all(|x| x.requests == 0 && x.in_flight == 0));
}

#[test]
fn plain_tracker_has_no_outbox() {
    let t = Arc::new(LoadTracker::new(1));
    let _g = t.charge(target(0, None), 5);
    assert!(drain(&t).is_empty());
    assert_eq!(t.origin(), None);
}

#[test]
fn duplicates_and_reordering_are_ignored() {
    let t = Arc::new(LoadTracker::with_sync(1, 1));
    let r = table(1, 4);
    let g1 = t.charge(target(0, None), 10);
    let first = drain(&t);
    let g2 = t.charge(target(0, None), 10);
    let second = drain(&t);
    let now = Duration::from_secs(1);
    assert_eq!(r.apply(&second[0], now), Applied::Applied);
    assert_eq!(r.apply(&first[0], now), Applied::Stale);
    assert_eq!(r.apply(&second[0], now), Applied::Stale);
    assert_eq!(r.remote(EndpointId(0), now).in_flight, 2);
    drop((g1, g2));
    assert_eq!(r.counters().stale, 2);
}

#[test]
fn silent_origin_expires_and_late_duplicates_do_not_revive_it() {
    let t = Arc::new(LoadTracker::with_sync(1, 1));
    let r = table(1, 4);
    let _g = t.charge(target(0, None), 10);
    let d = drain(&t);
    r.apply(&d[0], Duration::from_secs(1));
    assert_eq!(r.remote(EndpointId(0), Duration::from_secs(3)).in_flight, 1);
    // 2 s TTL: silent since 1 s, gone after 3 s.
    assert_eq!(
        r.remote(EndpointId(0), Duration::from_millis(3001))
            .in_flight,
        0
    );
    assert_eq!(r.apply(&d[0], Duration::from_secs(4)), Applied::Stale);
    assert_eq!(r.remote(EndpointId(0), Duration::from_secs(4)).in_flight, 0);
    // The late duplicate found it silent past the TTL: forgotten then.
    assert_eq!(r.counters().expired, 1);
    assert_eq!(r.expire(Duration::from_secs(4)), 0);
    assert_eq!(r.counters().origins, 0);
    // Expired and forgotten: a late duplicate still does not bring it back.
    assert_eq!(r.apply(&d[0], Duration::from_secs(5)), Applied::Stale);
    assert_eq!(r.remote(EndpointId(0), Duration::from_secs(5)).in_flight, 0);
}

#[test]
fn charged_counters_travel_and_stay_monotonic() {
    let one = Arc::new(LoadTracker::with_sync(1, 1));
    let r = table(1, 4);
    let now = Duration::from_secs(1);
    // Charged before the table heard of the origin: its history does
    // not count, only what is queued when it is first heard of.
    drop(one.charge(target(0, None), 1000));
    let mut g = one.charge(target(0, None), 300);
    assert_eq!(one.charged_tokens(EndpointId(0)), 1300);
    for d in drain(&one) {
        r.apply(&d, now);
    }
    assert_eq!(r.remote_charged(EndpointId(0)), 300);
    // A request charged and released between two drains leaves the
    // totals as they were; the delta still goes out, the counter grows.
    drop(one.charge(target(0, None), 100));
    let d = drain(&one);
    assert_eq!(d.len(), 1);
    assert_eq!(
        (
            d[0].in_flight,
            d[0].queued_prefill_tokens,
            d[0].charged_prefill_tokens
        ),
        (1, 300, 1400)
    );
    r.apply(&d[0], now);
    assert_eq!(r.remote_charged(EndpointId(0)), 400);
    g.first_byte();
    let _g2 = one.charge(target(0, None), 200);
    for d in drain(&one) {
        r.apply(&d, now);
    }
    assert_eq!(r.remote_charged(EndpointId(0)), 600);
    let local = LoadTracker::new(1);
    assert_eq!(
        r.view(&local, now).charged_prefill_tokens(EndpointId(0)),
        Some(600)
    );
    // The origin falls silent and is forgotten: its share stays.
    assert_eq!(r.expire(Duration::from_secs(10)), 1);
    assert_eq!(r.remote_charged(EndpointId(0)), 600);
    // A view over a load that does not count reports nothing.
    let plain = crate::LoadTable::new(1);
    assert_eq!(
        r.view(&plain, now).charged_prefill_tokens(EndpointId(0)),
        None
    );
}

#[test]
fn bounded_origins_own_and_unknown_endpoints() {
    let r = table(2, 2);
    let now = Duration::from_secs(1);
    let delta = |origin, endpoint| LoadDelta {
        origin,
        seq: 1,
        endpoint: EndpointId(endpoint),
        requests: 1,
        prefill_tokens: 0,
        in_flight: 1,
        queued_prefill_tokens: 0,
        charged_prefill_tokens: 0,
    };
    assert_eq!(r.apply(&delta(1, 0), now), Applied::Applied);
    assert_eq!(r.apply(&delta(2, 0), now), Applied::Applied);
    assert_eq!(r.apply(&delta(3, 0), now), Applied::OriginsFull);
    assert_eq!(r.apply(&delta(99, 0), now), Applied::Own);
    assert_eq!(r.apply(&delta(1, 5), now), Applied::UnknownEndpoint);
    // Once the first two fall silent, a new origin takes a place.
    let later = now + Duration::from_secs(3);
    assert_eq!(r.apply(&delta(3, 1), later), Applied::Applied);
    let c = r.counters();
    assert_eq!(
        (
            c.applied,
            c.origins_full,
            c.own,
            c.unknown_endpoint,
            c.expired,
            c.origins
        ),
        (3, 1, 1, 1, 2, 1)
    );
}

/// A replica partitioned away for longer than the TTL, in a table no expiry
/// sweep ran on, sends news for one endpoint when it is back: only that news
/// counts, not its old load on the endpoints it has not spoken of since.
#[test]
fn an_origin_back_after_its_ttl_counts_only_its_news() {
    let t = Arc::new(LoadTracker::with_sync(2, 1));
    let r = table(2, 4);
    let _a = t.charge(target(0, None), 10);
    let b = t.charge(target(1, None), 20);
    for d in drain(&t) {
        assert_eq!(r.apply(&d, Duration::from_secs(1)), Applied::Applied);
    }
    assert_eq!(r.remote(EndpointId(1), Duration::from_secs(1)).in_flight, 1);
    // Silent for 4 s (2 s TTL); its request on endpoint 1 ended meanwhile
    // and that message was lost; it speaks of endpoint 0 again.
    drop(b);
    let _lost = drain(&t);
    let _c = t.charge(target(0, None), 30);
    let now = Duration::from_secs(5);
    for d in drain(&t).iter().filter(|d| d.endpoint == EndpointId(0)) {
        assert_eq!(r.apply(d, now), Applied::Applied);
    }
    assert_eq!(r.remote(EndpointId(0), now).in_flight, 2);
    assert_eq!(r.remote(EndpointId(1), now).in_flight, 0);
    assert_eq!(r.counters().expired, 1);
}

/// An endpoint leaves the rule and another takes its slot: nothing the
/// other replicas said about the first counts on the second, and the
/// slot's charged counter never goes back.
#[test]
fn a_cleared_endpoint_forgets_every_origins_load_there() {
    let one = Arc::new(LoadTracker::with_sync(2, 1));
    let two = Arc::new(LoadTracker::with_sync(2, 2));
    let r = table(2, 4);
    let now = Duration::from_secs(1);
    let _g = [
        one.charge(target(0, None), 100),
        one.charge(target(1, None), 50),
        two.charge(target(0, None), 200),
    ];
    for d in drain(&one).iter().chain(&drain(&two)) {
        r.apply(d, now);
    }
    assert_eq!(r.remote(EndpointId(0), now).in_flight, 2);
    assert_eq!(r.remote_charged(EndpointId(0)), 300);
    r.clear_endpoint(EndpointId(0));
    assert_eq!(r.remote(EndpointId(0), now), EndpointLoad::default());
    assert_eq!(r.remote_charged(EndpointId(0)), 300);
    // The other endpoint and the origins themselves are untouched.
    assert_eq!(r.remote(EndpointId(1), now).in_flight, 1);
    assert_eq!(r.deciders(now).count, 3);
    // The slot's new endpoint is first heard of: what is queued counts.
    let fresh = LoadDelta {
        origin: 1,
        seq: 100,
        endpoint: EndpointId(0),
        requests: 1,
        prefill_tokens: 40,
        in_flight: 1,
        queued_prefill_tokens: 40,
        charged_prefill_tokens: 1000,
    };
    assert_eq!(r.apply(&fresh, now), Applied::Applied);
    assert_eq!(r.remote(EndpointId(0), now).in_flight, 1);
    assert_eq!(r.remote_charged(EndpointId(0)), 340);
    // Out of range: nothing happens.
    r.clear_endpoint(EndpointId(7));
}
