//! Replicas that decide one burst on one stale view: the default cost scorer
//! spreads it instead of mirroring one replica's choices on every other, and
//! a decider alone (or one whose requests come one at a time) decides as it
//! always did.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;
/// Blocks of the root every prompt starts with (one 512-token block).
const ROOT: usize = 32;

fn rule(n: u32) -> (Rule, ContractId) {
    let c = ContractId::new("herd/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i))
        .collect();
    let cfg = RuleConfig::kv_exact("herd", Topology::Converged, eps, BS, c.clone());
    (Rule::new(cfg, None).unwrap(), c)
}

/// The shared root, then `len` blocks of its own.
fn prompt(id: u64, len: usize) -> Vec<BlockKey> {
    (0..ROOT as u64)
        .map(BlockKey)
        .chain((0..len as u64).map(|i| BlockKey((id + 1) * 1_000_000 + i)))
        .collect()
}

/// Every endpoint holds the root.
fn inventory(n: u32) -> KeySetInventory {
    let mut inv = KeySetInventory::new(n as usize);
    for e in 0..n {
        inv.store(e as usize, (0..ROOT as u64).map(BlockKey));
    }
    inv
}

/// A load table that names its deciders.
struct View<'a> {
    table: &'a LoadTable,
    deciders: Deciders,
}

impl Load for View<'_> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.table.load(endpoint)
    }
    fn deciders(&self) -> Deciders {
        self.deciders
    }
}

fn target<L: Load + ?Sized>(
    r: &Rule,
    c: &ContractId,
    keys: &[BlockKey],
    inv: &KeySetInventory,
    load: &L,
    now: Duration,
) -> u32 {
    let req = Request::new(PromptInput::Keys {
        keys,
        contract: c,
        prompt_tokens: keys.len() as u32 * BS,
    });
    r.decide(&req, inv, load, &AlwaysAvailable, now)
        .target()
        .unwrap()
        .endpoint
        .0
}

/// `bursts` past bursts of `per_burst` requests 10 ms apart (on an empty
/// view), so the rule has learnt how bursty its traffic is.
fn prime(r: &Rule, c: &ContractId, inv: &KeySetInventory, bursts: u64, per_burst: u64) {
    let table = LoadTable::new(inv_len(inv));
    for b in 0..bursts {
        for i in 0..per_burst {
            let keys = prompt(900_000 + b * 100 + i, 400);
            target(r, c, &keys, inv, &table, Duration::from_millis(10 * b));
        }
    }
}

fn inv_len(inv: &KeySetInventory) -> usize {
    kvroute_ingest::InventoryView::endpoint_count(inv)
}

/// Four replicas sharing their load (real trackers and [`RemoteLoad`]s),
/// each handed two requests of one burst at the same instant: every replica
/// sees only its own part of the burst. All eight go to different endpoints
/// — a replica's choices are not mirrored by the others — and the same
/// inputs give the same choices.
#[test]
fn replicas_deciding_one_burst_on_one_stale_view_spread_it() {
    let run = || {
        let n = 8;
        let inv = inventory(n);
        let replicas: Vec<_> = (0..4u64)
            .map(|k| {
                let (r, c) = rule(n);
                let tracker = Arc::new(LoadTracker::with_sync(n as usize, k + 1));
                let remote = RemoteLoad::new(
                    RemoteConfig {
                        endpoints: n as usize,
                        max_origins: 8,
                        ttl: Duration::from_secs(3600),
                    },
                    k + 1,
                );
                (r, c, tracker, remote)
            })
            .collect();
        // History: bursts of three requests per replica; every replica
        // hears every other (one charge and release each).
        let mut deltas = Vec::new();
        for (r, c, tracker, _) in &replicas {
            prime(r, c, &inv, 20, 3);
            let g = tracker.charge(
                Target {
                    endpoint: EndpointId(0),
                    decode: None,
                },
                1,
            );
            drop(g);
            tracker.drain_deltas(&mut deltas);
        }
        let now = Duration::from_secs(1);
        for d in &deltas {
            for (_, _, _, remote) in &replicas {
                remote.apply(d, now);
            }
        }
        // The burst: no delta travels while it is decided.
        let mut picks = Vec::new();
        let mut guards = Vec::new();
        for (k, (r, c, tracker, remote)) in replicas.iter().enumerate() {
            for i in 0..2 {
                let keys = prompt(k as u64 * 10 + i, 400);
                let view = remote.view(&**tracker, now);
                assert_eq!(view.deciders().count, 4);
                let e = target(r, c, &keys, &inv, &view, now);
                guards.push(tracker.charge(
                    Target {
                        endpoint: EndpointId(e),
                        decode: None,
                    },
                    400 * BS,
                ));
                picks.push(e);
            }
        }
        picks
    };
    let picks = run();
    let mut distinct = picks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 8, "{picks:?}");
    assert_eq!(run(), picks, "same inputs, same decisions");
}

/// A large fleet where few endpoints look cheap: 64 endpoints, the four in
/// replica 0's zone idle, every other endpoint with half a request's prefill
/// queued. Four replicas each decide three requests of one burst on that
/// view, seeing only their own. A replica expects another's burst on that
/// one's cheapest endpoints — one request each — not spread over its whole
/// zone, so nobody else reaches for the idle four: no endpoint gets two.
#[test]
fn a_burst_on_a_large_fleet_does_not_converge_on_the_few_cheap_endpoints() {
    let n = 64u32;
    let inv = inventory(n);
    let p = u64::from(400 * BS);
    let mut per_endpoint = vec![0u32; n as usize];
    for k in 0..4u32 {
        let (r, c) = rule(n);
        prime(&r, &c, &inv, 20, 3);
        let mut table = LoadTable::new(n as usize);
        for e in 4..n {
            table.set(
                EndpointId(e),
                EndpointLoad {
                    in_flight: 0,
                    queued_prefill_tokens: p / 2,
                },
            );
        }
        for i in 0..3u64 {
            let keys = prompt(u64::from(k) * 10 + i, 400);
            let view = View {
                table: &table,
                deciders: Deciders {
                    count: 4,
                    rank: k,
                    ordered: false,
                    home: false,
                },
            };
            let e = target(&r, &c, &keys, &inv, &view, Duration::from_secs(1));
            per_endpoint[e as usize] += 1;
            let l = table.load(EndpointId(e));
            table.set(
                EndpointId(e),
                EndpointLoad {
                    in_flight: l.in_flight + 1,
                    queued_prefill_tokens: l.queued_prefill_tokens + p,
                },
            );
        }
    }
    let most = per_endpoint.iter().max().copied().unwrap_or(0);
    assert_eq!(most, 1, "requests per endpoint: {per_endpoint:?}");
}

/// Deciders whose own zones are full spill one burst at the same instant:
/// each spills in its own order of the other zones, so they do not all land
/// on the zone that every view finds cheapest (here two empty endpoints the
/// view cannot tell apart; without the order every decider takes the same).
#[test]
fn deciders_spilling_at_once_go_to_different_zones() {
    let (n, deciders) = (8u32, 8u32);
    let inv = inventory(n);
    let p = u64::from(400 * BS);
    let mut table = LoadTable::new(n as usize);
    for e in (0..n).filter(|e| *e != 3 && *e != 4) {
        table.set(
            EndpointId(e),
            EndpointLoad {
                in_flight: 2,
                queued_prefill_tokens: 4 * p,
            },
        );
    }
    let mut picks = Vec::new();
    for k in (0..deciders).filter(|k| *k != 3 && *k != 4) {
        let (r, c) = rule(n);
        prime(&r, &c, &inv, 20, 3);
        let view = View {
            table: &table,
            deciders: Deciders {
                count: deciders,
                rank: k,
                ordered: false,
                home: false,
            },
        };
        picks.push(target(
            &r,
            &c,
            &prompt(u64::from(k), 400),
            &inv,
            &view,
            Duration::from_secs(1),
        ));
    }
    assert!(picks.iter().all(|e| *e == 3 || *e == 4), "{picks:?}");
    let to_3 = picks.iter().filter(|e| **e == 3).count();
    assert!(
        (1..=5).contains(&to_3),
        "six spilling deciders split over both, not all on one: {picks:?}"
    );
}

/// The replicas rank themselves by origin id, each differently.
#[test]
fn replicas_rank_themselves_apart() {
    let n = 2;
    let trackers: Vec<_> = (1..=3u64)
        .map(|o| Arc::new(LoadTracker::with_sync(n, o)))
        .collect();
    let remotes: Vec<_> = (1..=3u64)
        .map(|o| {
            RemoteLoad::new(
                RemoteConfig {
                    endpoints: n,
                    ..RemoteConfig::default()
                },
                o,
            )
        })
        .collect();
    let now = Duration::from_secs(1);
    let mut deltas = Vec::new();
    for t in &trackers {
        drop(t.charge(
            Target {
                endpoint: EndpointId(1),
                decode: None,
            },
            10,
        ));
        t.drain_deltas(&mut deltas);
    }
    for d in &deltas {
        for r in &remotes {
            r.apply(d, now);
        }
    }
    let mut ranks: Vec<u32> = remotes
        .iter()
        .zip(&trackers)
        .map(|(r, t)| {
            let d = r.view(&**t, now).deciders();
            assert_eq!(d.count, 3);
            d.rank
        })
        .collect();
    ranks.sort_unstable();
    assert_eq!(ranks, [0, 1, 2]);
    assert_eq!(
        LoadTable::new(n).deciders(),
        Deciders::ALONE,
        "a plain view routes alone"
    );
}

/// Replicas started together count their turns alike: on an idle view each
/// one's first decision is an exact tie (every endpoint holds the root, none
/// is loaded), or the first pick of its fallback or round robin. Each rank
/// starts its rotations `n / count` endpoints from the previous rank's and
/// draws a random sequence of its own, so the first requests of a burst
/// split over four replicas do not all land on one endpoint; rank 0 decides
/// as a decider alone, from the first endpoint.
#[test]
fn replicas_started_together_start_their_rotations_apart() {
    let n = 8u32;
    let inv = inventory(n);
    let table = LoadTable::new(n as usize);
    // A fresh rule (its turns at 0) deciding its first request.
    let first = |choice: Choice, fallback: SelectorKind, deciders: Deciders| {
        let (r, c) = rule(n);
        let mut cfg = r.config().clone();
        cfg.choice = choice;
        cfg.fallback = fallback;
        let r = Rule::new(cfg, None).unwrap();
        let view = View {
            table: &table,
            deciders,
        };
        // Held by every endpoint (a tie), or by none (the fallback).
        let tie = choice == Choice::KvExact && fallback == SelectorKind::LeastPrefill;
        let keys = if tie {
            prompt(1, 4)
        } else {
            (7_000..7_040).map(BlockKey).collect()
        };
        let req = Request::new(PromptInput::Keys {
            keys: &keys,
            contract: &c,
            prompt_tokens: keys.len() as u32 * BS,
        });
        let d = r.decide(&req, &inv, &view, &AlwaysAvailable, Duration::from_secs(1));
        let source = match choice {
            _ if tie => Source::KvExact,
            Choice::RoundRobin => Source::Fallback(SelectorKind::RoundRobin),
            _ => Source::Fallback(fallback),
        };
        assert_eq!(d.source(), source, "{choice:?} / {fallback:?}");
        d.target().unwrap().endpoint.0
    };
    let rank = |rank| Deciders {
        count: 4,
        rank,
        ..Deciders::ALONE
    };
    for (choice, fallback, rotates) in [
        (Choice::KvExact, SelectorKind::LeastPrefill, true),
        (Choice::RoundRobin, SelectorKind::LeastPrefill, true),
        (Choice::KvExact, SelectorKind::LeastLoad, true),
        (Choice::KvExact, SelectorKind::RoundRobin, true),
        (Choice::KvExact, SelectorKind::Random, false),
        (Choice::KvExact, SelectorKind::PowerOfTwoChoices, false),
    ] {
        let what = format!("{choice:?} / {fallback:?}");
        let alone = first(choice, fallback, Deciders::ALONE);
        let picks: Vec<u32> = (0..4).map(|k| first(choice, fallback, rank(k))).collect();
        assert_eq!(picks[0], alone, "{what}: rank 0 decides as a decider alone");
        if rotates {
            assert_eq!(alone, 0, "{what}: alone, from the first endpoint");
            assert_eq!(picks, [0, 2, 4, 6], "{what}: ranks start n / count apart");
        } else {
            assert!(picks.iter().any(|&p| p != alone), "{what}: {picks:?}");
        }
    }
}

/// The tie may be among a few endpoints only: two of eight hold the whole
/// prompt, idle alike. Each replica takes its own of the two (rank `k` of
/// `count` the tie `k · 2 / count`), wherever the two sit among the eight.
#[test]
fn replicas_part_a_tie_among_a_few_endpoints() {
    let n = 8u32;
    let keys = prompt(9, 8);
    let table = LoadTable::new(n as usize);
    for holders in [[0u32, 1], [3, 4], [6, 7], [1, 6]] {
        let mut inv = inventory(n);
        for h in holders {
            inv.store(h as usize, keys.iter().copied());
        }
        let first = |deciders| {
            let (r, c) = rule(n);
            let view = View {
                table: &table,
                deciders,
            };
            target(&r, &c, &keys, &inv, &view, Duration::from_secs(1))
        };
        let rank = |count, rank| Deciders {
            count,
            rank,
            ..Deciders::ALONE
        };
        let alone = first(Deciders::ALONE);
        assert!(holders.contains(&alone), "{holders:?}: {alone}");
        let two: Vec<u32> = (0..2).map(|k| first(rank(2, k))).collect();
        assert_eq!(two[0], alone, "{holders:?}");
        let mut sorted = two.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, holders, "{holders:?}: two replicas took {two:?}");
        let four: Vec<u32> = (0..4).map(|k| first(rank(4, k))).collect();
        assert_eq!(four[0], alone, "{holders:?}");
        assert_eq!(four[0], four[1], "{holders:?}: {four:?}");
        assert_eq!(four[2], four[3], "{holders:?}: {four:?}");
        assert_ne!(four[0], four[2], "{holders:?}: {four:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A decider alone decides the same whatever its burst history, and so
    /// does one among several whose requests come one at a time: the
    /// mechanism adds nothing where nothing is concurrent.
    #[test]
    fn alone_or_unhurried_decisions_are_unchanged(
        loads in proptest::collection::vec((0u32..6, 0u64..20_000), 6),
        prefixes in proptest::collection::vec(0usize..40, 6),
        replicas in 2u32..9,
        rank in 0u32..9,
    ) {
        let n = 6u32;
        let mut inv = inventory(n);
        let keys = prompt(7, 40);
        for (e, p) in prefixes.iter().enumerate() {
            inv.store(e, keys[..ROOT + p].iter().copied());
        }
        let mut table = LoadTable::new(n as usize);
        for (e, (f, q)) in loads.iter().enumerate() {
            table.set(EndpointId(e as u32), EndpointLoad { in_flight: *f, queued_prefill_tokens: *q });
        }
        let now = Duration::from_secs(5);
        let (fresh, c) = rule(n);
        let reference = target(&fresh, &c, &keys, &inv, &table, now);
        let (bursty, c) = rule(n);
        prime(&bursty, &c, &inventory(n), 20, 4);
        let alone = View { table: &table, deciders: Deciders::ALONE };
        prop_assert_eq!(target(&bursty, &c, &keys, &inv, &alone, now), reference);
        let (calm, c) = rule(n);
        prime(&calm, &c, &inventory(n), 20, 1);
        let many = View { table: &table, deciders: Deciders { count: replicas, rank: rank % replicas, ordered: false, home: false } };
        prop_assert_eq!(target(&calm, &c, &keys, &inv, &many, now), reference);
    }

    /// Reference model of the zones: deciders split the endpoints into
    /// zones (`⌊e·R/n⌋` with at least as many endpoints as deciders,
    /// endpoint `d mod n` for decider `d` otherwise) and expect each other
    /// decider's burst on its cheapest endpoints, one request each (a burst
    /// of three: two others, so at most two endpoints of a zone share the
    /// load). On an idle fleet where every
    /// endpoint holds the prompt's root, a bursty decider's pick is an
    /// endpoint where that expected load is least — its own zone's.
    #[test]
    fn a_bursty_decider_picks_where_the_others_are_expected_least(
        n in 1u32..12,
        replicas in 2u32..10,
        rank in 0u32..10,
    ) {
        let rank = rank % replicas;
        let inv = inventory(n);
        let (r, c) = rule(n);
        prime(&r, &c, &inv, 20, 3);
        let table = LoadTable::new(n as usize);
        let view = View { table: &table, deciders: Deciders { count: replicas, rank, ordered: false, home: false } };
        let e = target(&r, &c, &prompt(3, 200), &inv, &view, Duration::from_secs(9));
        let zone = |d: u32| -> Vec<u32> {
            if n >= replicas {
                (0..n).filter(|e| e * replicas / n == d).collect()
            } else {
                vec![d % n]
            }
        };
        let expected = |e: u32| -> f64 {
            (0..replicas)
                .filter(|d| *d != rank)
                .map(|d| {
                    let z = zone(d);
                    if z.contains(&e) { 1.0 / z.len().min(2) as f64 } else { 0.0 }
                })
                .sum()
        };
        let least = (0..n).map(expected).fold(f64::INFINITY, f64::min);
        prop_assert!((expected(e) - least).abs() < 1e-9, "endpoint {} expects {}, least {}", e, expected(e), least);
        if n >= replicas {
            prop_assert_eq!(e * replicas / n, rank);
        }
    }
}

/// A decider in its turn ([`Deciders::ordered`]): the last of four decides
/// after the other three placed their part of the burst (one request each,
/// on the first endpoint of their zones), and sees it. The idle endpoints
/// left in those zones are what one gateway would pick; deciding at the
/// same instant as the others, the decider also expects their placements
/// still to come there, and stays in its own busier zone.
#[test]
fn a_decider_taking_its_turn_counts_the_lower_ranks_placements_once() {
    let n = 8u32;
    let inv = inventory(n);
    let p = u64::from(400 * BS);
    let mut table = LoadTable::new(n as usize);
    for e in [0, 2, 4, 6, 7] {
        table.set(
            EndpointId(e),
            EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: p,
            },
        );
    }
    let decide = |ordered: bool| {
        let (r, c) = rule(n);
        prime(&r, &c, &inv, 20, 3);
        let view = View {
            table: &table,
            deciders: Deciders {
                count: 4,
                rank: 3,
                ordered,
                home: false,
            },
        };
        target(
            &r,
            &c,
            &prompt(77, 400),
            &inv,
            &view,
            Duration::from_secs(1),
        )
    };
    let turn = decide(true);
    assert!([1, 3, 5].contains(&turn), "taking turns: {turn}");
    let at_once = decide(false);
    assert!([6, 7].contains(&at_once), "deciding at once: {at_once}");
}

/// Requests with a home decided at once in turn ([`Deciders::home`]): each
/// of four replicas decides one at the same instant, none seeing the
/// others'. One that leaves a busy home goes where its view finds it
/// cheapest, alike on every replica: with nothing to tell them apart, the
/// four would meet on one idle endpoint. The spill-over order sends each
/// to its own zone. A home busy by less than the prompt's uncached prefill
/// keeps its request, as it does for a gateway alone: nothing unseen is
/// expected anywhere.
#[test]
fn requests_with_a_home_leaving_it_at_one_instant_go_to_different_endpoints() {
    let n = 8u32;
    let mut inv = inventory(n);
    let keys = prompt(77, 400);
    // Endpoint 0 (rank 0's zone) holds the whole prompt.
    inv.store(0, keys.iter().copied());
    let decide = |home_queue: u64, deciders: Deciders| {
        let mut table = LoadTable::new(n as usize);
        table.set(
            EndpointId(0),
            EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: home_queue,
            },
        );
        let (r, c) = rule(n);
        prime(&r, &c, &inv, 20, 3);
        let view = View {
            table: &table,
            deciders,
        };
        target(&r, &c, &keys, &inv, &view, Duration::from_secs(1))
    };
    let in_turn = |rank: u32, home: bool| Deciders {
        count: 4,
        rank,
        ordered: true,
        home,
    };
    // Busy: 50 000 tokens queued against 6 400 uncached elsewhere.
    let busy = 50_000;
    let picks: Vec<u32> = (0..4).map(|k| decide(busy, in_turn(k, true))).collect();
    for (k, &e) in picks.iter().enumerate() {
        assert_eq!(
            e as usize * 4 / n as usize,
            k,
            "rank {k} left its home for {e}"
        );
    }
    // Decided in turn, expecting nothing of the others (whose placements a
    // replica in its turn sees), every replica picks the same one here, as
    // one gateway alone would.
    let alike: Vec<u32> = (0..4).map(|k| decide(busy, in_turn(k, false))).collect();
    assert!(alike.iter().all(|&e| e == alike[0] && e != 0), "{alike:?}");
    // Busy by less than the uncached prefill: every replica keeps it home,
    // as a gateway alone does.
    assert_eq!(decide(3_000, Deciders::ALONE), 0);
    for k in 0..4 {
        assert_eq!(decide(3_000, in_turn(k, true)), 0, "rank {k}");
    }
}

/// A replica takes turns only while its decisions come in bursts, other
/// replicas are live, turns are configured and the request's cache does not
/// decide where it goes: it holds the request rank times the stagger (plus
/// one stagger of ordering, so the burst's requests with a home go first)
/// and decides it in turn. The ranks come from the load table's live
/// origins.
#[test]
fn a_replica_takes_turns_of_rank_times_the_stagger_only_in_bursts() {
    let stagger = Duration::from_millis(1);
    let fresh = || 0.0;
    let now = Duration::from_secs(1);
    let bursty = BurstStats {
        decisions: 3.0,
        prefill_tokens: 2000.0,
    };
    let one_at_a_time = BurstStats {
        decisions: 1.1,
        prefill_tokens: 2000.0,
    };
    let cfg = |order: Duration, stagger: Duration| TurnConfig { order, stagger };
    let turns = cfg(Duration::ZERO, stagger);
    let table = |own: u64| {
        let remote = RemoteLoad::new(
            RemoteConfig {
                endpoints: 2,
                ..RemoteConfig::default()
            },
            own,
        );
        // Two other live replicas, ids 1 and 5.
        for origin in [1u64, 5] {
            let t = Arc::new(LoadTracker::with_sync(2, origin));
            let _g = t.charge(
                Target {
                    endpoint: EndpointId(0),
                    decode: None,
                },
                10,
            );
            let mut deltas = Vec::new();
            t.drain_deltas(&mut deltas);
            for d in &deltas {
                remote.apply(d, now);
            }
        }
        remote
    };
    let held = |hold: Duration| Turn {
        hold,
        in_turn: true,
        home: false,
    };
    let home = Turn {
        hold: Duration::ZERO,
        in_turn: true,
        home: true,
    };
    let turn = |own: u64, cfg: TurnConfig, burst: BurstStats, home: f64| {
        burst_turn(cfg, burst, || table(own).deciders(now), || home)
    };
    // Id 3 ranks 1 among {1, 3, 5}; id 7 ranks 2; id 0 ranks 0 and decides
    // in turn at once.
    assert_eq!(turn(3, turns, bursty, 0.0), held(stagger));
    assert_eq!(turn(7, turns, bursty, 0.0), held(2 * stagger));
    assert_eq!(turn(0, turns, bursty, 0.0), held(Duration::ZERO));
    // Ordering on: every rank one stagger later, after the requests with a
    // home.
    let ordered = cfg(Duration::from_micros(300), stagger);
    assert_eq!(turn(0, ordered, bursty, 0.0), held(stagger));
    assert_eq!(turn(7, ordered, bursty, 0.0), held(3 * stagger));
    // Outside bursts, or without turns or ordering: decided at once and
    // not in turn.
    assert_eq!(turn(7, turns, one_at_a_time, 0.0), Turn::NONE);
    assert_eq!(
        turn(7, cfg(Duration::ZERO, Duration::ZERO), bursty, 0.0),
        Turn::NONE
    );
    // A request with a home (one endpoint holds most of what the others
    // lack: it goes there whatever the others place) is decided at once,
    // as part of the ordered burst: meanwhile the others place only their
    // own requests with a home.
    assert_eq!(turn(7, turns, bursty, 0.8), home);
    assert_eq!(turn(7, ordered, bursty, 0.8), home);
    assert_eq!(turn(7, turns, bursty, 0.3), held(2 * stagger));
    // A view for a decision in turn reports the deciders as ordered.
    let t = table(7);
    let local = LoadTable::new(2);
    assert!(!t.view(&local, now).deciders().ordered);
    let turn = burst_turn(turns, bursty, || t.deciders(now), fresh);
    let d = t.view(&local, now).in_turn(turn).deciders();
    assert!(d.ordered && !d.home);
    // ... and, for a request with a home, that it has one.
    let turn = burst_turn(turns, bursty, || t.deciders(now), || 0.8);
    let d = t.view(&local, now).in_turn(turn).deciders();
    assert!(d.ordered && d.home);
}
