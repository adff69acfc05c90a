//! The default KV-exact policy: the cost formula, no collapse on a shared
//! first block, ties by load and per prompt (never endpoint order), traffic
//! back to an empty endpoint, predicted entries, and the load tracker's guards
//! under random connect failures, retries and drops.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;

fn rule(n: u32, cfg_fn: impl FnOnce(&mut RuleConfig)) -> (Rule, ContractId) {
    let c = ContractId::new("cost/bs16");
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i))
        .collect();
    let mut cfg = RuleConfig::kv_exact("cost", Topology::Converged, eps, BS, c.clone());
    cfg_fn(&mut cfg);
    (Rule::new(cfg, None).unwrap(), c)
}

fn req<'a>(keys: &'a [BlockKey], c: &'a ContractId, tokens: u32) -> Request<'a> {
    Request::new(PromptInput::Keys {
        keys,
        contract: c,
        prompt_tokens: tokens,
    })
}

/// One decision with every endpoint available.
fn decide<V, L>(r: &Rule, req: Request<'_>, view: &V, load: &L, now: Duration) -> Decision
where
    V: kvroute_ingest::InventoryView + ?Sized,
    L: Load + ?Sized,
{
    r.decide(&req, view, load, &AlwaysAvailable, now)
}

fn chain(seed: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64)
        .map(|i| BlockKey(seed * 1_000_000 + i))
        .collect()
}

#[test]
fn the_default_rule_is_the_cost_scorer_with_least_load_fallback() {
    let (r, _) = rule(2, |_| {});
    assert_eq!(
        (&*r.config().scorer as &dyn std::any::Any).downcast_ref::<CostScorer>(),
        Some(&CostScorer::default())
    );
    assert_eq!(r.config().fallback, SelectorKind::LeastPrefill);
    assert!(r.config().predicted.capacity > 0);
}

/// The switch point follows the documented formula exactly: EP0 holds a
/// 20-block prefix of a 400-token prompt (saves 320 tokens); with prefill
/// weight 2 it keeps the request while its predicted time to first token
/// `queued_0 + 2·80 ≤ 2·400`, EP1's. Requests in flight on EP0 raise its cost
/// (λ = 16 each) but never move the prompt off its cached prefix: the
/// affinity test weighs times to first token only.
#[test]
fn cached_prefix_is_weighed_against_queued_prefill_as_the_formula_says() {
    let cfg = CostConfig {
        affinity_slack: 0.0,
        affinity_tokens: 0.0,
        load_factor: f64::INFINITY,
        prefill_weight: 2.0,
        decode_tokens_per_request: 16.0,
        ..CostConfig::default()
    };
    let (r, c) = rule(2, |x| {
        x.scorer = Arc::new(CostScorer(cfg));
        x.predicted.capacity = 0;
    });
    let keys = chain(1, 25);
    let mut inv = KeySetInventory::new(2);
    inv.store(0, keys[..20].iter().copied());
    let decide = |queued0: u64, in_flight0: u32| {
        let mut load = LoadTable::new(2);
        load.set(
            EndpointId(0),
            EndpointLoad {
                in_flight: in_flight0,
                queued_prefill_tokens: queued0,
            },
        );
        let d = decide(&r, req(&keys, &c, 400), &inv, &load, Duration::ZERO);
        d.target().unwrap().endpoint.0
    };
    // ttft0 = q + 160, ttft1 = 800; cost0 = ttft0 + 16·r, cost1 = 800.
    assert_eq!(decide(0, 0), 0);
    assert_eq!(decide(639, 0), 0);
    assert_eq!(decide(641, 0), 1);
    assert_eq!(decide(620, 1), 0); // cost 796 < 800
    assert_eq!(decide(630, 1), 0); // cost 806 > 800, but ttft 790 ≤ 800: affinity
    assert_eq!(decide(630, 40), 0); // cost 1430: still affinity
    assert_eq!(decide(641, 1), 1); // ttft 801 > 800
}

/// Where a prefix saves the same everywhere (a fresh conversation over a
/// system prompt every endpoint holds), the in-flight term ranks endpoints:
/// an endpoint carrying more requests loses to one with a little more queued
/// prefill, which a time-to-first-token rule alone would not do.
#[test]
fn requests_in_flight_rank_endpoints_for_new_work() {
    let (r, c) = rule(2, |x| x.predicted.capacity = 0);
    let keys = chain(3, 25);
    let mut inv = KeySetInventory::new(2);
    inv.store(0, keys[..10].iter().copied());
    inv.store(1, keys[..10].iter().copied());
    let lambda = CostConfig::default().decode_tokens_per_request;
    assert!(lambda >= 64.0, "default in-flight weight {lambda}");
    let mut load = LoadTable::new(2);
    load.set(
        EndpointId(0),
        EndpointLoad {
            in_flight: 3,
            queued_prefill_tokens: 0,
        },
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let queued1 = (2.0 * lambda) as u64; // less than 3 requests' worth
    load.set(
        EndpointId(1),
        EndpointLoad {
            in_flight: 0,
            queued_prefill_tokens: queued1,
        },
    );
    let d = decide(&r, req(&keys, &c, 400), &inv, &load, Duration::ZERO);
    assert_eq!(d.target().unwrap().endpoint, EndpointId(1));
}

/// Only the longest prefix saves work: blocks found after the first miss
/// count for nothing.
#[test]
fn blocks_after_the_first_miss_save_nothing() {
    let (r, c) = rule(2, |x| x.predicted.capacity = 0);
    let keys = chain(2, 10);
    let mut inv = KeySetInventory::new(2);
    // EP0: blocks 1..10 (block 0 missing); EP1: block 0 and 1 only.
    inv.store(0, keys[1..].iter().copied());
    inv.store(1, keys[..2].iter().copied());
    let load = LoadTable::new(2);
    let d = decide(&r, req(&keys, &c, 160), &inv, &load, Duration::ZERO);
    assert_eq!(d.target().unwrap().endpoint, EndpointId(1));
    assert_eq!(d.predicted_blocks(), 2);
}

/// Every prompt starts with the same block (a shared system prompt held by
/// every endpoint): argmax overlap sends everything to one endpoint, the cost
/// scorer spreads by load.
#[test]
fn a_block_every_prompt_shares_does_not_collapse_the_fleet() {
    let run = |scorer: ScorerRef| {
        let (r, c) = rule(4, |x| {
            x.scorer = scorer;
            x.predicted.capacity = 0;
        });
        let shared = BlockKey(42);
        let mut inv = KeySetInventory::new(4);
        for s in 0..4 {
            inv.store(s, [shared]);
        }
        let tracker = Arc::new(LoadTracker::new(4));
        let mut guards = std::collections::VecDeque::new();
        let mut per = [0u32; 4];
        for i in 0..400u64 {
            let mut keys = vec![shared];
            keys.extend(chain(100 + i, 30));
            let d = decide(&r, req(&keys, &c, 31 * BS), &inv, &*tracker, Duration::ZERO);
            let t = d.target().unwrap();
            per[t.endpoint.index()] += 1;
            guards.push_back(tracker.charge(t, d.predicted_prefill_tokens(BS)));
            if guards.len() > 16 {
                guards.pop_front();
            }
        }
        per
    };
    let argmax = run(Arc::new(OverlapCountScorer));
    assert_eq!(argmax[0], 400, "reference argmax collapses: {argmax:?}");
    let cost = run(Arc::new(CostScorer::default()));
    let (max, min) = (*cost.iter().max().unwrap(), *cost.iter().min().unwrap());
    assert!(max <= 110 && min >= 90, "cost scorer spreads: {cost:?}");
}

/// Equal costs go to the less loaded endpoint, then rotate as round robin
/// does: a fresh fleet does not put every new prefix on endpoint 0.
#[test]
fn ties_go_by_load_then_rotate_never_endpoint_order() {
    let (r, c) = rule(4, |x| x.predicted.capacity = 0);
    let mut inv = KeySetInventory::new(4);
    let shared = BlockKey(7);
    for s in 0..4 {
        inv.store(s, [shared]);
    }
    let mut load = LoadTable::new(4);
    let mut seen = [0u32; 4];
    for i in 0..64u64 {
        let mut keys = vec![shared];
        keys.extend(chain(500 + i, 4));
        let d = decide(&r, req(&keys, &c, 80), &inv, &load, Duration::ZERO);
        seen[d.target().unwrap().endpoint.index()] += 1;
    }
    assert_eq!(seen, [16; 4], "rotation: {seen:?}");
    // Load breaks the tie first: endpoints 0..2 busy, 3 idle.
    for e in 0..3 {
        load.set(
            EndpointId(e),
            EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: 0,
            },
        );
    }
    let cfg = CostConfig {
        decode_tokens_per_request: 0.0,
        ..CostConfig::default()
    };
    let (r, c) = rule(4, |x| {
        x.scorer = Arc::new(CostScorer(cfg));
        x.predicted.capacity = 0;
    });
    for i in 0..16u64 {
        let mut keys = vec![shared];
        keys.extend(chain(900 + i, 4));
        let d = decide(&r, req(&keys, &c, 80), &inv, &load, Duration::ZERO);
        assert_eq!(d.target().unwrap().endpoint, EndpointId(3));
    }
}

/// A restarted endpoint (empty inventory) gets traffic back once the others'
/// queues outweigh what their caches save, or they reach the bounded-load cap.
#[test]
fn an_empty_endpoint_gets_traffic_back_under_load() {
    let (r, c) = rule(3, |x| x.predicted.capacity = 0);
    let keys = chain(3, 32);
    let mut inv = KeySetInventory::new(3);
    inv.store(0, keys.iter().copied());
    inv.store(1, keys.iter().copied());
    let tracker = Arc::new(LoadTracker::new(3));
    let mut guards = Vec::new();
    let mut to_empty = 0u32;
    let requests = 120u32;
    for _ in 0..requests {
        let d = decide(
            &r,
            req(&keys, &c, 32 * BS + 8),
            &inv,
            &*tracker,
            Duration::ZERO,
        );
        let t = d.target().unwrap();
        if t.endpoint == EndpointId(2) {
            to_empty += 1;
        }
        guards.push(tracker.charge(t, d.predicted_prefill_tokens(BS)));
    }
    // Requests never finish and no time passes, so the holders stay the
    // faster start (their cache saves ~500 tokens a request, their queues
    // grow by 8); the bounded-load cap still hands the empty endpoint its
    // share once they run ahead: neither holder may pass
    // ⌈1.25 · (N + 1) / 3⌉ + headroom, so the empty one gets at least
    // N − 2 · (that bound) of N requests.
    let headroom = CostConfig::default().load_headroom;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let bound = (1.25 * f64::from(requests) / 3.0).ceil() as u32 + headroom;
    let floor = requests.saturating_sub(2 * bound);
    assert!(floor >= 10, "the bound leaves {floor}");
    assert!(
        to_empty >= floor,
        "restarted endpoint got {to_empty} of {requests}, the cap guarantees {floor}"
    );
}

/// A burst sharing a new prefix co-locates before any `BlockStored` arrives;
/// predictions are not evidence and expire.
/// Every endpoint already runs `base` long requests (decoding): the fleet is
/// busy enough that the bounded-load cap leaves room for a burst.
struct Busy<'a> {
    tracker: &'a LoadTracker,
    base: u32,
}

impl Load for Busy<'_> {
    fn load(&self, e: EndpointId) -> EndpointLoad {
        let mut l = self.tracker.load(e);
        l.in_flight += self.base;
        l
    }
}

///
/// The four requests arrive at the same instant, so every one of them on the
/// first endpoint waits behind the others' prefill: at prefill weight 2
/// (this request's time to first token plus the prefill it duplicates
/// elsewhere) all four co-locate; at the default weight 1 (time to first
/// token alone) the third finds an idle endpoint 12 % cheaper and takes it, so
/// the burst shares two endpoints, not four (see
/// `the_default_weight_shares_a_simultaneous_burst_over_two_endpoints`).
#[test]
fn predicted_entries_co_locate_a_burst_and_expire() {
    let (r, c) = rule(4, |x| {
        x.scorer = Arc::new(CostScorer(CostConfig {
            prefill_weight: 2.0,
            ..CostConfig::default()
        }));
    });
    let inv = KeySetInventory::new(4); // no engine has reported anything yet
    let tracker = Arc::new(LoadTracker::new(4));
    let busy = Busy {
        tracker: &tracker,
        base: 8,
    };
    let prefix = chain(4, 40);
    let mut first = None;
    let mut guards = Vec::new();
    for i in 0..4u64 {
        let mut keys = prefix.clone();
        keys.extend(chain(4000 + i, 2));
        let d = decide(&r, req(&keys, &c, 42 * BS), &inv, &busy, Duration::ZERO);
        let t = d.target().unwrap();
        if i > 0 {
            assert_eq!(Some(t.endpoint), first, "burst request {i} left the prefix");
            assert_eq!(d.source(), Source::KvExact);
            assert_eq!(d.speculative_prefix()[t.endpoint.index()], 40);
            // Not evidence: nothing is predicted to be delivered.
            assert_eq!(d.predicted_cached_tokens(BS), 0);
            assert_eq!(d.predicted_prefill_tokens(BS), 2 * BS);
        }
        first.get_or_insert(t.endpoint);
        guards.push(tracker.charge(t, d.predicted_prefill_tokens(BS)));
    }
    // After the TTL nothing is credited any more.
    let ttl = r.config().predicted.ttl;
    let d = decide(&r, req(&prefix, &c, 40 * BS), &inv, &busy, ttl);
    assert!(d.speculative_prefix().iter().all(|x| *x == 0));
    // Disabled: the burst is spread by load instead.
    let (r, c) = rule(4, |x| x.predicted.capacity = 0);
    let tracker = Arc::new(LoadTracker::new(4));
    let mut used = std::collections::HashSet::new();
    let mut guards = Vec::new();
    for i in 0..4u64 {
        let mut keys = prefix.clone();
        keys.extend(chain(5000 + i, 2));
        let d = decide(&r, req(&keys, &c, 42 * BS), &inv, &*tracker, Duration::ZERO);
        let t = d.target().unwrap();
        used.insert(t.endpoint);
        guards.push(tracker.charge(t, d.predicted_prefill_tokens(BS)));
    }
    assert!(used.len() > 1);
}

/// The default slack: a burst of four simultaneous requests sharing a new
/// prefix stays on one endpoint (predicted entries credit it, and waiting
/// behind three 42-block prefills costs less than the relative slack plus
/// `affinity_tokens`); with no absolute slack it shares two, and without
/// predicted entries it spreads by load.
#[test]
fn the_default_slack_keeps_a_small_simultaneous_burst_together() {
    let run = |predicted: bool, affinity_tokens: f64| {
        let (r, c) = rule(4, |x| {
            if !predicted {
                x.predicted.capacity = 0;
            }
            x.scorer = Arc::new(CostScorer(CostConfig {
                affinity_tokens,
                ..CostConfig::default()
            }));
        });
        let inv = KeySetInventory::new(4);
        let tracker = Arc::new(LoadTracker::new(4));
        let busy = Busy {
            tracker: &tracker,
            base: 8,
        };
        let prefix = chain(4, 40);
        let mut used = std::collections::HashSet::new();
        let mut guards = Vec::new();
        for i in 0..4u64 {
            let mut keys = prefix.clone();
            keys.extend(chain(6000 + i, 2));
            let d = decide(&r, req(&keys, &c, 42 * BS), &inv, &busy, Duration::ZERO);
            let t = d.target().unwrap();
            used.insert(t.endpoint);
            guards.push(tracker.charge(t, d.predicted_prefill_tokens(BS)));
        }
        used.len()
    };
    let default = CostConfig::default().affinity_tokens;
    assert_eq!(run(true, default), 1);
    assert_eq!(run(true, 0.0), 2);
    assert_eq!(run(false, default), 4);
}

/// A receipt above the prompt's length is refused and counted.
#[test]
fn implausible_receipts_are_refused() {
    let (r, c) = rule(2, |_| {});
    let keys = chain(6, 2);
    let mut inv = KeySetInventory::new(2);
    inv.store(0, keys.iter().copied());
    let d = decide(
        &r,
        req(&keys, &c, 40),
        &inv,
        &LoadTable::new(2),
        Duration::ZERO,
    );
    assert!(!r.record_receipt(&d, 4_294_967_295));
    r.record_receipt(&d, 32);
    let s = r.counters().snapshot();
    assert_eq!(s.implausible_receipts, 1);
    assert_eq!(s.endpoints[0].receipts, 1);
}

/// The cost scorer's reference model: among endpoints under the bounded-load
/// cap, the least cost wins; the longest prefix, when one candidate alone
/// holds it, is kept within the slack.
fn model_pick(
    prefixes: &[u32],
    loads: &[EndpointLoad],
    prompt_tokens: u32,
    cfg: &CostConfig,
) -> (Option<u32>, f64) {
    let n = prefixes.len();
    let total: u64 = loads.iter().map(|l| u64::from(l.in_flight)).sum();
    let limit = (cfg.load_factor * (total as f64 + 1.0) / n as f64).ceil();
    let admitted: Vec<usize> = (0..n)
        .filter(|i| f64::from(loads[*i].in_flight.saturating_sub(cfg.load_headroom)) + 1.0 <= limit)
        .collect();
    let cands: Vec<usize> = if admitted.is_empty() {
        (0..n).collect()
    } else {
        admitted
    };
    let ttft = |i: usize| {
        let cached = (f64::from(prefixes[i]) * f64::from(BS)).min(f64::from(prompt_tokens));
        loads[i].queued_prefill_tokens as f64
            + cfg.prefill_weight * (f64::from(prompt_tokens) - cached)
    };
    let cost = |i: usize| ttft(i) + cfg.decode_tokens_per_request * f64::from(loads[i].in_flight);
    let best = cands.iter().map(|&i| cost(i)).fold(f64::INFINITY, f64::min);
    // The winner's time to first token: among equal least costs the scorer
    // breaks ties by load and turn, so take every least-cost endpoint's.
    let best_ttfts: Vec<f64> = cands
        .iter()
        .filter(|&&i| (cost(i) - best).abs() < 1e-9)
        .map(|&i| ttft(i))
        .collect();
    let longest = cands.iter().map(|&i| prefixes[i]).max().unwrap_or(0);
    let (best_of_longest, longest_ttft) = cands
        .iter()
        .filter(|&&i| prefixes[i] == longest)
        .map(|&i| (cost(i), ttft(i)))
        .fold((f64::INFINITY, f64::INFINITY), |a, b| {
            if b.0 < a.0 {
                b
            } else {
                a
            }
        });
    // A longest prefix several candidates hold is replicated (a shared
    // system prompt), not one conversation's history: the least cost wins.
    let holders = cands.iter().filter(|&&i| prefixes[i] == longest).count();
    if holders > 1 {
        return (None, best);
    }
    let keeps = |t: f64| longest_ttft <= t * (1.0 + cfg.affinity_slack) + cfg.affinity_tokens;
    if best_ttfts.iter().all(|&t| keeps(t)) {
        (Some(longest), best_of_longest)
    } else if best_ttfts.iter().any(|&t| keeps(t)) {
        // Depends on which least-cost endpoint the tie-break picks.
        (None, f64::NAN)
    } else {
        (None, best)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cost_winner_matches_the_reference_model(
        prefixes in proptest::collection::vec(0u32..12, 2..7),
        loads in proptest::collection::vec((0u32..6, 0u64..400), 7),
        slack in 0u32..4,
        slack_tokens in 0u32..3,
        factor in 0u32..6,
    ) {
        let n = prefixes.len();
        let cfg = CostConfig {
            affinity_slack: f64::from(slack) / 4.0,
            affinity_tokens: f64::from(slack_tokens) * 48.0,
            load_factor: 1.0 + f64::from(factor) / 4.0,
            ..CostConfig::default()
        };
        let (r, c) = rule(n as u32, |x| {
            x.scorer = Arc::new(CostScorer(cfg));
            x.predicted.capacity = 0;
        });
        let keys = chain(9, 12);
        let mut inv = KeySetInventory::new(n);
        for (i, p) in prefixes.iter().enumerate() {
            inv.store(i, keys[..*p as usize].iter().copied());
        }
        let mut table = LoadTable::new(n);
        let loads: Vec<EndpointLoad> = loads[..n]
            .iter()
            .map(|(f, q)| EndpointLoad { in_flight: *f, queued_prefill_tokens: *q })
            .collect();
        for (i, l) in loads.iter().enumerate() {
            table.set(EndpointId(i as u32), *l);
        }
        let prompt_tokens = 12 * BS + 5;
        let d = decide(&r, req(&keys, &c, prompt_tokens), &inv, &table, Duration::ZERO);
        let t = d.target().unwrap().endpoint.index();
        if prefixes.iter().all(|p| *p == 0) {
            prop_assert_eq!(d.miss(), Some(MissReason::ZeroOverlap));
        } else {
            prop_assert_eq!(d.source(), Source::KvExact);
            let (p, cost) = model_pick(&prefixes, &loads, prompt_tokens, &cfg);
            if let Some(p) = p {
                prop_assert_eq!(prefixes[t], p, "loads {:?}", loads);
            }
            let chosen = {
                let cached = (f64::from(prefixes[t]) * f64::from(BS)).min(f64::from(prompt_tokens));
                loads[t].queued_prefill_tokens as f64
                    + cfg.prefill_weight * (f64::from(prompt_tokens) - cached)
                    + cfg.decode_tokens_per_request * f64::from(loads[t].in_flight)
            };
            if !cost.is_nan() {
                prop_assert!((chosen - cost).abs() < 1e-9, "chosen {} model {}", chosen, cost);
            }
        }
    }

    /// Guards balance whatever happens to the request: connect failures and
    /// retries move the charge (decode retries the decode leg alone), first
    /// bytes release prefill tokens, drops release everything; at the end
    /// every counter is zero.
    #[test]
    fn tracker_guards_balance_under_failures_retries_and_drops(
        ops in proptest::collection::vec((0u8..6, 0u32..4, 0u32..4, 0u32..500), 1..200),
    ) {
        let tracker = Arc::new(LoadTracker::new(4));
        let mut live: Vec<LoadGuard> = Vec::new();
        // Model: per endpoint (in_flight, prefill tokens) of each live guard.
        let mut model: Vec<Option<(Target, u64, bool)>> = Vec::new();
        for (op, a, b, tokens) in ops {
            let target = Target {
                endpoint: EndpointId(a),
                decode: (op % 2 == 1 && a != b).then_some(EndpointId(b)),
            };
            match op {
                0 | 1 => {
                    live.push(tracker.charge(target, tokens));
                    model.push(Some((target, u64::from(tokens), false)));
                }
                2 if !live.is_empty() => {
                    let k = tokens as usize % live.len();
                    live[k].retarget(target, tokens);
                    model[k] = Some((target, u64::from(tokens), false));
                }
                3 if !live.is_empty() => {
                    let k = tokens as usize % live.len();
                    live[k].first_byte();
                    if let Some((t, _, done)) = model[k] {
                        model[k] = Some((t, 0, done));
                    }
                }
                5 if !live.is_empty() && b % 2 == 0 => {
                    // A decode retry: only the decode leg moves.
                    let k = tokens as usize % live.len();
                    live[k].retarget_decode(EndpointId(a));
                    if let Some((t, tok, done)) = model[k] {
                        // Not onto the endpoint charged as the prefill leg.
                        let decode = (t.endpoint.0 != a || done).then_some(EndpointId(a));
                        model[k] = Some((Target { decode, ..t }, tok, done));
                    }
                }
                4 if !live.is_empty() => {
                    let k = tokens as usize % live.len();
                    live[k].prefill_leg_done();
                    if let Some((t, _, _)) = model[k] {
                        model[k] = Some((t, 0, t.decode.is_some()));
                    }
                }
                _ if !live.is_empty() => {
                    let k = tokens as usize % live.len();
                    drop(live.swap_remove(k));
                    model.swap_remove(k);
                }
                _ => {}
            }
            for e in 0..4u32 {
                let (mut f, mut q) = (0u32, 0u64);
                for (t, tok, main_done) in model.iter().flatten() {
                    if t.endpoint.0 == e && !main_done {
                        f += 1;
                        q += tok;
                    }
                    if t.decode.map(|d| d.0) == Some(e) {
                        f += 1;
                    }
                }
                let got = tracker.load(EndpointId(e));
                prop_assert_eq!((got.in_flight, got.queued_prefill_tokens), (f, q));
            }
        }
        drop(live);
        for e in 0..4u32 {
            prop_assert_eq!(tracker.load(EndpointId(e)), EndpointLoad::default());
        }
    }
}

/// An inventory whose every endpoint reports a mismatched hash contract
/// (attestation failed: the engines hash differently from the rule).
struct Mismatched(KeySetInventory);

impl kvroute_ingest::InventoryView for Mismatched {
    fn endpoint_count(&self) -> usize {
        self.0.endpoint_count()
    }
    fn score(&self, keys: &[BlockKey], out: &mut [kvroute_ingest::Overlap]) {
        self.0.score(keys, out);
    }
    fn health(&self, _: usize) -> kvroute_ingest::InventoryHealth {
        kvroute_ingest::InventoryHealth {
            contract_mismatch: true,
            ..Default::default()
        }
    }
}

/// Under a wrong contract every miss is `contract_mismatch`, and
/// predicted entries never turn into claimed hits the engines cannot deliver.
#[test]
fn a_mismatched_contract_counts_contract_mismatch_and_predicts_nothing() {
    use kvroute_ingest::InventoryView as _;
    let (r, c) = rule(3, |_| {});
    let view = Mismatched(KeySetInventory::new(3));
    assert_eq!(view.endpoint_count(), 3);
    let tracker = Arc::new(LoadTracker::new(3));
    let keys = chain(12, 8);
    for _ in 0..5 {
        let d = decide(&r, req(&keys, &c, 8 * BS), &view, &*tracker, Duration::ZERO);
        assert_eq!(d.miss(), Some(MissReason::ContractMismatch));
        assert!(d.speculative_prefix().iter().all(|x| *x == 0));
    }
    let s = r.counters().snapshot();
    assert_eq!(s.misses_for(MissReason::ContractMismatch), 5);
    assert_eq!(s.endpoints.iter().map(|e| e.hits).sum::<u64>(), 0);
}

/// An inventory that reports how often each endpoint's cache was cleared.
struct Cleared {
    inner: KeySetInventory,
    clears: std::cell::Cell<u64>,
}

impl kvroute_ingest::InventoryView for Cleared {
    fn endpoint_count(&self) -> usize {
        self.inner.endpoint_count()
    }
    fn score(&self, keys: &[BlockKey], out: &mut [kvroute_ingest::Overlap]) {
        self.inner.score(keys, out);
    }
    fn health(&self, _: usize) -> kvroute_ingest::InventoryHealth {
        kvroute_ingest::InventoryHealth {
            clears: self.clears.get(),
            ..Default::default()
        }
    }
}

/// A restart (the engine's inventory cleared) voids what was predicted for
/// it: the old prompt is no longer credited there.
#[test]
fn an_inventory_clear_voids_earlier_predictions() {
    use kvroute_ingest::InventoryView as _;
    let (r, c) = rule(2, |_| {});
    let view = Cleared {
        inner: KeySetInventory::new(2),
        clears: std::cell::Cell::new(0),
    };
    assert_eq!(view.endpoint_count(), 2);
    let keys = chain(13, 6);
    let load = LoadTable::new(2);
    let first = decide(&r, req(&keys, &c, 6 * BS), &view, &load, Duration::ZERO);
    let e = first.target().unwrap().endpoint.index();
    let again = decide(&r, req(&keys, &c, 6 * BS), &view, &load, Duration::ZERO);
    assert_eq!(again.speculative_prefix()[e], 6);
    view.clears.set(1);
    let after = decide(&r, req(&keys, &c, 6 * BS), &view, &load, Duration::ZERO);
    assert!(
        after.speculative_prefix().iter().all(|x| *x == 0),
        "{:?}",
        after.speculative_prefix()
    );
    assert_eq!(after.miss(), Some(MissReason::ZeroOverlap));
}

/// The same burst decided on several threads at once: each decision must
/// see the predicted entries and queued prefill of the decisions that
/// finished before it, so the burst co-locates as it does one decision after
/// another (a decision that read the predicted entries before another
/// recorded its own, then chose, split the burst: a tenant's first requests
/// at a gateway's start each went to a different engine and each missed).
#[test]
fn a_burst_decided_on_several_threads_at_once_co_locates() {
    let (r, c) = rule(4, |_| {});
    let inv = KeySetInventory::new(4);
    let tracker = LoadTracker::new(4);
    let busy = Busy {
        tracker: &tracker,
        base: 8,
    };
    let threads = 4;
    let mut split = 0;
    for round in 0..300u64 {
        let prefix = chain(10_000 + round, 40);
        let barrier = std::sync::Barrier::new(threads);
        let targets: Vec<EndpointId> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads as u64)
                .map(|i| {
                    let (r, c, inv, busy, barrier, prefix) =
                        (&r, &c, &inv, &busy, &barrier, &prefix);
                    s.spawn(move || {
                        let mut keys = prefix.clone();
                        keys.extend(chain(900_000 + round * 8 + i, 2));
                        barrier.wait();
                        let d = decide(r, req(&keys, c, 42 * BS), inv, busy, Duration::ZERO);
                        d.target().unwrap().endpoint
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let used: std::collections::HashSet<_> = targets.iter().collect();
        if used.len() > 1 {
            split += 1;
        }
    }
    assert_eq!(split, 0, "{split} of 300 simultaneous bursts split");
}

/// A shared system prompt two endpoints hold is not one conversation's
/// history: a fresh conversation goes to the cheapest endpoint even when
/// that one must prefill the prompt, instead of being kept on a holder by
/// the affinity slack. (Kept, an engine that missed the prompt at the start
/// gets no fresh conversation until the holders' queues outweigh it.) A
/// history only one endpoint holds is kept under the same loads.
#[test]
fn a_prefix_several_endpoints_hold_gets_no_affinity() {
    let (r, c) = rule(3, |x| x.predicted.capacity = 0);
    let root = chain(20, 4);
    let mut keys = root.clone();
    keys.extend(chain(21, 36));
    let busy = |n: u32| {
        let mut load = LoadTable::new(3);
        for e in 0..n {
            load.set(
                EndpointId(e),
                EndpointLoad {
                    in_flight: 3,
                    queued_prefill_tokens: 0,
                },
            );
        }
        load
    };
    // Holders: ttft 576 (within the slack of the idle endpoint's 640), cost
    // 576 + 3 × 128 = 960 against 640.
    let mut shared = KeySetInventory::new(3);
    shared.store(0, root.iter().copied());
    shared.store(1, root.iter().copied());
    let d = decide(
        &r,
        req(&keys, &c, 40 * BS),
        &shared,
        &busy(2),
        Duration::ZERO,
    );
    assert_eq!(d.target().unwrap().endpoint.0, 2);
    // One holder of the same prefix: its history, kept.
    let mut alone = KeySetInventory::new(3);
    alone.store(0, root.iter().copied());
    let d = decide(
        &r,
        req(&keys, &c, 40 * BS),
        &alone,
        &busy(1),
        Duration::ZERO,
    );
    assert_eq!(d.target().unwrap().endpoint.0, 0);
}

/// An endpoint that left (its id to be reused) leaves nothing behind in the
/// rule: its predicted entries no longer credit the id, and its delivery
/// evidence and drift alarm start over; the other endpoint's are kept.
#[test]
fn a_forgotten_endpoint_leaves_no_predictions_or_evidence_behind() {
    let (r, c) = rule(2, |x| x.thresholds.drift_alarm_after = 2);
    let keys = chain(21, 6);
    let load = LoadTable::new(2);
    // Predicted entries: the second decision is credited with the first's.
    let cold = KeySetInventory::new(2);
    let first = decide(&r, req(&keys, &c, 6 * BS), &cold, &load, Duration::ZERO);
    let e = first.target().unwrap().endpoint;
    let again = decide(&r, req(&keys, &c, 6 * BS), &cold, &load, Duration::ZERO);
    assert_eq!(again.speculative_prefix()[e.index()], 6);
    // Receipts of zero cached tokens where a hit was predicted raise the
    // drift alarm on `e`, and some evidence accrues on the other endpoint.
    let mut held = KeySetInventory::new(2);
    held.store(e.index(), keys.iter().copied());
    let other_keys = chain(77, 4);
    held.store(1 - e.index(), other_keys.iter().copied());
    for _ in 0..2 {
        let d = decide(&r, req(&keys, &c, 6 * BS), &held, &load, Duration::ZERO);
        assert_eq!(d.target().unwrap().endpoint, e);
        assert!(r.settle(&d, 0, None).counted);
    }
    let d = decide(
        &r,
        req(&other_keys, &c, 4 * BS),
        &held,
        &load,
        Duration::ZERO,
    );
    assert!(r.settle(&d, 4 * BS, None).counted);
    let before = r.counters().snapshot();
    assert!(before.endpoints[e.index()].drift_alarm);
    assert!(before.endpoints[1 - e.index()].receipts > 0);

    r.forget_endpoint(e);
    let after = r.counters().snapshot();
    assert_eq!(after.endpoints[e.index()], EndpointEvidence::default());
    assert_eq!(
        after.endpoints[1 - e.index()],
        before.endpoints[1 - e.index()]
    );
    let d = decide(&r, req(&keys, &c, 6 * BS), &cold, &load, Duration::ZERO);
    assert_eq!(
        d.speculative_prefix().get(e.index()).copied().unwrap_or(0),
        0,
        "{:?}",
        d.speculative_prefix()
    );
}

/// An endpoint without an inventory (its engine's events are not followed)
/// claims nothing about its cache, and predictions still credit it: the
/// second request of a burst follows the first there.
#[test]
fn an_endpoint_without_an_inventory_is_still_credited_its_predictions() {
    let c = ContractId::new("cost/bs16");
    // Endpoint 0 has no inventory slot; endpoint 1 reads slot 0.
    let eps = vec![
        Endpoint::new("ep0", Role::Both),
        Endpoint::new("ep1", Role::Both).with_inventory_slot(0),
    ];
    let cfg = RuleConfig::kv_exact("cost", Topology::Converged, eps, BS, c.clone());
    let r = Rule::new(cfg, None).unwrap();
    let inv = KeySetInventory::new(1);
    let mut load = LoadTable::new(2);
    // Endpoint 1 busy: the first request (cached nowhere) goes to 0.
    load.set(
        EndpointId(1),
        EndpointLoad {
            in_flight: 4,
            queued_prefill_tokens: 4096,
        },
    );
    let keys = chain(11, 8);
    let first = decide(&r, req(&keys, &c, 8 * BS), &inv, &load, Duration::ZERO);
    assert_eq!(first.target().map(|t| t.endpoint), Some(EndpointId(0)));
    let second = decide(&r, req(&keys, &c, 8 * BS), &inv, &load, Duration::ZERO);
    assert_eq!(
        second.speculative_prefix()[0],
        8,
        "the burst's first request's prediction"
    );
    assert_eq!(second.target().map(|t| t.endpoint), Some(EndpointId(0)));
}
