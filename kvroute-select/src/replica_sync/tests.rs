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

/// A tracker with a wake-up callback stays unwind safe, as one without:
/// code that catches panics can share it. A callback that panics does not
/// cut a charge or release short: no request stays counted.
#[test]
fn a_tracker_with_a_wake_is_unwind_safe_and_outlives_a_panicking_one() {
    fn unwind_safe<T: std::panic::UnwindSafe + std::panic::RefUnwindSafe>(_: &T) {}
    let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let w = Arc::clone(&woken);
    let tracker = LoadTracker::with_sync(1, 1)
        .wake_on_change(move || w.store(true, std::sync::atomic::Ordering::Relaxed));
    unwind_safe(&tracker);
    unwind_safe(&LoadTracker::new(1));

    let t = Arc::new(LoadTracker::with_sync(2, 1).wake_on_change(|| panic!("the host's bug")));
    let g = t.charge(target(0, None), 100);
    assert_eq!(t.load(EndpointId(0)).in_flight, 1);
    assert_eq!(drain(&t).len(), 1, "the change is pending");
    drop(g);
    assert_eq!(t.load(EndpointId(0)), EndpointLoad::default());
}

/// The host is woken once per drain, by the first change after it,
/// whatever changes (a charge, a first byte, an end) and however many
/// endpoints; a tracker without sync never calls it.
#[test]
fn a_change_wakes_the_host_once_until_the_next_drain() {
    use std::sync::atomic::AtomicUsize;
    let woken = Arc::new(AtomicUsize::new(0));
    let w = Arc::clone(&woken);
    let t = Arc::new(LoadTracker::with_sync(3, 7).wake_on_change(move || {
        w.fetch_add(1, Ordering::Relaxed);
    }));
    let wakes = || woken.load(Ordering::Relaxed);
    assert_eq!(wakes(), 0, "nothing changed yet");
    let mut a = t.charge(target(0, Some(2)), 300);
    let b = t.charge(target(1, None), 10);
    assert_eq!(wakes(), 1, "one wake for three endpoints");
    assert_eq!(drain(&t).len(), 3);
    a.first_byte();
    assert_eq!(wakes(), 2, "a first byte after the drain");
    drop(b);
    assert_eq!(wakes(), 2, "the host is awake already");
    assert_eq!(drain(&t).len(), 2);
    assert!(drain(&t).is_empty());
    assert_eq!(wakes(), 2, "a drain of nothing wakes nothing");
    drop(a);
    assert_eq!(wakes(), 3, "an end after the drain");
    let w = Arc::clone(&woken);
    let plain = Arc::new(LoadTracker::new(1).wake_on_change(move || {
        w.fetch_add(1, Ordering::Relaxed);
    }));
    drop(plain.charge(target(0, None), 1));
    assert_eq!(wakes(), 3, "no outbox, no wake");
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

/// A corrupt or forged delta with an absurd charged counter or queue is
/// refused and counted; without the bound the monotonic charged counter
/// would stay pinned at its maximum, and no later charge would ever show.
#[test]
fn an_implausible_delta_is_refused_and_the_charged_counter_keeps_counting() {
    let r = table(2, 4);
    let now = Duration::from_secs(1);
    let at = |seq, queued, charged| LoadDelta {
        queued_prefill_tokens: queued,
        charged_prefill_tokens: charged,
        ..delta(9, seq, 0, 1)
    };
    assert_eq!(r.apply(&at(1, 100, 100), now), Applied::Applied);
    assert_eq!(r.remote_charged(EndpointId(0)), 100);
    assert_eq!(r.apply(&at(2, 100, u64::MAX), now), Applied::Implausible);
    // A forged queue from an origin never heard of does not make it a
    // decider either.
    let stranger = LoadDelta {
        origin: 10,
        ..at(1, u64::MAX, 0)
    };
    assert_eq!(r.apply(&stranger, now), Applied::Implausible);
    assert_eq!(r.deciders(now).count, 2);
    assert_eq!(r.counters().implausible, 2);
    // The origin's real news goes on counting.
    assert_eq!(r.apply(&at(3, 50, 350), now), Applied::Applied);
    assert_eq!(r.remote_charged(EndpointId(0)), 350);
    assert_eq!(r.remote(EndpointId(0), now).queued_prefill_tokens, 50);
    // Gone quiet for a TTL while its origin speaks of another endpoint,
    // the entry is still checked against what it counted: a forged counter
    // is refused, not taken as a fresh start.
    let other = LoadDelta {
        endpoint: EndpointId(1),
        ..at(4, 0, 0)
    };
    assert_eq!(
        r.apply(&other, now + Duration::from_millis(1500)),
        Applied::Applied
    );
    let later = now + Duration::from_millis(2500);
    assert_eq!(r.apply(&at(5, 0, u64::MAX), later), Applied::Implausible);
    assert_eq!(r.apply(&at(6, 0, u64::MAX), later), Applied::Implausible);
    assert_eq!(r.remote_charged(EndpointId(0)), 350);
}

/// A forged counter on an entry first heard of (no count to check it
/// against) adds at most its queue; the real counter, lower, then counts
/// afresh instead of staying below the forged one for good.
#[test]
fn a_counter_that_goes_back_counts_afresh() {
    let r = table(2, 4);
    let now = Duration::from_secs(1);
    let at = |origin, seq, queued, charged| LoadDelta {
        queued_prefill_tokens: queued,
        charged_prefill_tokens: charged,
        ..delta(origin, seq, 1, 1)
    };
    assert_eq!(r.apply(&at(9, 1, 64, u64::MAX), now), Applied::Applied);
    assert_eq!(r.remote_charged(EndpointId(1)), 64);
    assert_eq!(r.apply(&at(9, 2, 32, 1000), now), Applied::Applied);
    assert_eq!(r.remote_charged(EndpointId(1)), 64 + 32);
    assert_eq!(r.apply(&at(9, 3, 32, 1100), now), Applied::Applied);
    assert_eq!(r.remote_charged(EndpointId(1)), 64 + 32 + 100);
}

fn delta(origin: u64, seq: u64, endpoint: u32, in_flight: u32) -> LoadDelta {
    LoadDelta {
        origin,
        seq,
        endpoint: EndpointId(endpoint),
        requests: 0,
        prefill_tokens: 0,
        in_flight,
        queued_prefill_tokens: 0,
        charged_prefill_tokens: 0,
    }
}

/// An origin that goes on speaking of other endpoints but no longer of
/// one (it removed it, or reused its slot for another URL): its last word
/// there stops counting a TTL after it was said, as a silent origin's does.
#[test]
fn an_entry_its_origin_stopped_announcing_expires_while_the_origin_lives() {
    let r = table(2, 4);
    let s = Duration::from_secs;
    assert_eq!(r.apply(&delta(9, 1, 0, 3), s(1)), Applied::Applied);
    assert_eq!(r.apply(&delta(9, 2, 1, 1), s(1)), Applied::Applied);
    // Heartbeats name endpoint 1 only from now on.
    for (i, t) in (2..=6).enumerate() {
        assert_eq!(
            r.apply(&delta(9, 3 + i as u64, 1, 1), s(t)),
            Applied::Applied
        );
    }
    assert_eq!(r.remote(EndpointId(0), s(3)).in_flight, 3);
    assert_eq!(r.remote(EndpointId(0), s(4)).in_flight, 0);
    assert_eq!(r.remote(EndpointId(1), s(6)).in_flight, 1);
    assert_eq!(r.deciders(s(6)).count, 2);
    // News for it starts a fresh entry.
    assert_eq!(r.apply(&delta(9, 20, 0, 2), s(6)), Applied::Applied);
    assert_eq!(r.remote(EndpointId(0), s(6)).in_flight, 2);
}

/// One message with the largest sequence number (corrupt or forged) for a
/// live origin's endpoint: the origin's real deltas there are stale against
/// it, but it counts only for a TTL, and the real ones count after it.
#[test]
fn a_forged_huge_sequence_number_counts_for_one_ttl_only() {
    let r = table(2, 4);
    let ms = Duration::from_millis;
    r.apply(&delta(9, 1, 0, 0), ms(0));
    r.apply(&delta(9, 2, 1, 0), ms(0));
    assert_eq!(
        r.apply(&delta(9, u64::MAX, 0, 1000), ms(500)),
        Applied::Applied
    );
    let mut seq = 3;
    let mut last = 0;
    for t in (1000..=8000).step_by(1000) {
        for e in 0..2 {
            r.apply(&delta(9, seq, e, 0), ms(t));
            seq += 1;
        }
        last = r.remote(EndpointId(0), ms(t)).in_flight;
        if t <= 2500 {
            assert_eq!(last, 1000, "at {t} ms");
        }
    }
    assert_eq!(last, 0);
    assert_eq!(r.deciders(ms(8000)).count, 2);
}

/// A restarted replica that kept its origin id (its sequence numbers start
/// again) is heard once its old entries and the forgotten origin's last
/// sequence number have each been kept for a TTL.
#[test]
fn a_restarted_origin_with_the_same_id_is_heard_after_two_ttls() {
    let r = table(1, 4);
    let ms = Duration::from_millis;
    assert_eq!(r.apply(&delta(9, 100, 0, 5), ms(0)), Applied::Applied);
    // The old process is gone; the new one announces one request in
    // flight every 500 ms, numbering from 1.
    let mut heard_at = None;
    for (i, t) in (500..=10_000).step_by(500).enumerate() {
        r.expire(ms(t));
        r.apply(&delta(9, 1 + i as u64, 0, 1), ms(t));
        if heard_at.is_none() && r.remote(EndpointId(0), ms(t)).in_flight == 1 {
            heard_at = Some(t);
        }
    }
    let heard_at = heard_at.expect("the restarted origin is never heard");
    // Forgotten at 2.5 s (the first message after its TTL), its last
    // sequence number kept until 4.5 s: heard at the next message.
    assert_eq!(heard_at, 5000);
    assert_eq!(r.remote(EndpointId(0), ms(10_000)).in_flight, 1);
}

/// An entry that went quiet for a TTL and is then named again by its
/// origin, whose charged counter went on: the charged tokens count once
/// (the entry's queue is not taken for new work a second time).
#[test]
fn an_entry_named_again_after_going_quiet_counts_its_charged_tokens_once() {
    let r = table(2, 4);
    let s = Duration::from_secs;
    let with = |seq: u64, e: u32, queued: u64, charged: u64| LoadDelta {
        queued_prefill_tokens: queued,
        charged_prefill_tokens: charged,
        ..delta(9, seq, e, 1)
    };
    r.apply(&with(1, 0, 500, 1500), s(1));
    assert_eq!(r.remote_charged(EndpointId(0)), 500);
    // Only endpoint 1 is named for 4 s (a 2 s TTL); then endpoint 0 again,
    // 300 more tokens charged there meanwhile.
    for t in 2..=5 {
        r.apply(&with(t, 1, 0, 0), s(t));
    }
    r.apply(&with(6, 0, 800, 1800), s(5));
    assert_eq!(r.remote_charged(EndpointId(0)), 800);
    assert_eq!(r.remote(EndpointId(0), s(5)).queued_prefill_tokens, 800);
}

/// A new endpoint in a slot announces the charged tokens of its own
/// requests, not the slot's history: the others keep their counters per
/// endpoint, and the slot's whole counter under the new endpoint's name
/// would read as that much work charged there at once.
#[test]
fn a_reused_slot_announces_its_new_endpoints_charges_only() {
    let t = Arc::new(LoadTracker::with_sync(2, 1));
    drop(t.charge(target(0, None), 1_000_000));
    assert_eq!(drain(&t)[0].charged_prefill_tokens, 1_000_000);
    t.retire(EndpointId(0));
    drop(t.charge(target(0, None), 100));
    let d = drain(&t);
    assert_eq!(d[0].charged_prefill_tokens, 100);
    // The tracker's own counter goes on (its drain model reads the slot).
    assert_eq!(t.charged_tokens(EndpointId(0)), 1_000_100);
}

/// A forged message naming a live replica as retiring with sequence number
/// 2^64 − 1 holds for one TTL, not for as long as the replica lives: its
/// real news, older by number, takes over once the forgery is older than
/// the TTL.
#[test]
fn a_forged_retiring_flag_holds_for_one_ttl_only() {
    let r = table(2, 4);
    let s = Duration::from_secs;
    assert_eq!(r.apply(&delta(9, 1, 0, 1), s(1)), Applied::Applied);
    r.set_retiring(9, false, 1, s(1));
    assert_eq!(r.deciders(s(1)).count, 2);
    // The forgery: news for another endpoint, numbered 2^64 − 1.
    assert_eq!(r.apply(&delta(9, u64::MAX, 1, 0), s(1)), Applied::Applied);
    r.set_retiring(9, true, u64::MAX, s(1));
    assert_eq!(r.deciders(s(1)).count, 1);
    // The replica's own news, every second.
    for t in 2..=5 {
        assert_eq!(r.apply(&delta(9, t, 0, 1), s(t)), Applied::Applied);
        r.set_retiring(9, false, t, s(t));
        let want = if t <= 3 { 1 } else { 2 };
        assert_eq!(r.deciders(s(t)).count, want, "at {t} s");
    }
}
