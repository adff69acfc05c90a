//! The explanation and the cached-token account against a simple reference
//! model of the cost scorer and the account's definitions: random fleets
//! (prefixes held, loads, capacities, availability), random cost
//! parameters, random connect failures and receipts. For every decision the
//! model's winner, cheapest and longest candidates, terms and account equal
//! the decision's; the rule's counters sum the settled accounts, and
//! `reachable = achieved + Σ lost` holds per endpoint.

mod common;
use common::Avail;

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;
use proptest::prelude::*;

const BS: u32 = 16;

#[derive(Clone, Debug)]
struct Ep {
    held: u32,
    in_flight: u32,
    queued: u64,
    capacity: u32,
    up: bool,
}

#[derive(Clone, Debug)]
struct Req {
    /// Prompt blocks and extra tokens in a partial last block.
    blocks: u32,
    extra: u32,
    eps: Vec<Ep>,
    /// Connect failures before the answer.
    failures: u32,
    /// Delivered cached tokens, as a fraction of the prompt.
    delivered: f64,
}

#[derive(Clone, Copy, Debug)]
struct Params {
    load_factor: f64,
    headroom: u32,
    slack: f64,
    affinity_tokens: f64,
    min_blocks: u32,
}

/// The model's view of one candidate, computed as `docs/routing.md` says.
#[derive(Clone, Copy, Debug)]
struct ModelTerms {
    ttft: f64,
    cost: f64,
    under: bool,
}

struct ModelPick {
    winner: usize,
    cheapest: usize,
    longest: usize,
    /// Longest credited prefix under the cap, blocks.
    admitted: u32,
    terms: Vec<Option<ModelTerms>>,
}

fn model_terms(e: &Ep, prompt: u32, under: bool) -> ModelTerms {
    let cached = (f64::from(e.held) * f64::from(BS) * 1.0).min(f64::from(prompt));
    let own = 1.0 * (f64::from(prompt) - cached).max(0.0);
    let queued = e.queued as f64 + 0.0;
    let decode = 128.0 * f64::from(e.in_flight);
    let cap = f64::from(e.capacity);
    ModelTerms {
        ttft: (queued + own) / cap,
        cost: (queued + own + decode) / cap,
        under,
    }
}

/// The cost scorer's pick over `cand` (indices), as documented: cheapest
/// under the bounded-load cap (ties: lower utilisation, then the rotating
/// turn), the longest prefix under the cap, when one candidate alone holds
/// it, kept within the affinity slack.
fn model_cost(p: &Params, r: &Req, cand: &[usize], turn: u64) -> Option<ModelPick> {
    let prompt = r.blocks * BS + r.extra;
    let n = r.eps.len() as u64;
    let total_if: u64 = cand.iter().map(|i| u64::from(r.eps[*i].in_flight)).sum();
    let total_cap: u64 = cand
        .iter()
        .map(|i| u64::from(r.eps[*i].capacity))
        .sum::<u64>()
        .max(1);
    let factor = if p.load_factor.is_finite() && p.load_factor >= 1.0 {
        p.load_factor
    } else {
        1.0
    };
    let limit =
        |cap: u32| (factor * ((total_if as f64 + 1.0) * f64::from(cap) / total_cap as f64)).ceil();
    let admits =
        |e: &Ep| f64::from(e.in_flight.saturating_sub(p.headroom)) + 1.0 <= limit(e.capacity);
    let any = p.load_factor.is_finite() && cand.iter().any(|i| admits(&r.eps[*i]));
    let mut terms = vec![None; r.eps.len()];
    let mut best: Option<(usize, ModelTerms, f64, u64)> = None;
    let mut longest: Option<(usize, ModelTerms, u32)> = None;
    for &i in cand {
        let e = &r.eps[i];
        let under = !any || admits(e);
        let t = model_terms(e, prompt, under);
        terms[i] = Some(t);
        if !under {
            continue;
        }
        let util = f64::from(e.in_flight) / f64::from(e.capacity);
        let rank = (i as u64 + n - turn % n) % n;
        let better = best.is_none_or(|(_, bt, bu, br)| {
            t.cost < bt.cost || (t.cost == bt.cost && (util < bu || (util == bu && rank < br)))
        });
        if better {
            best = Some((i, t, util, rank));
        }
        if longest.is_none_or(|(_, lt, lp)| e.held > lp || (e.held == lp && t.cost < lt.cost)) {
            longest = Some((i, t, e.held));
        }
    }
    let (cheapest, bt, _, _) = best?;
    let (li, lt, lp) = longest?;
    // Held by more than one candidate under the cap: replicated, not kept.
    let holders = cand
        .iter()
        .filter(|i| terms[**i].is_some_and(|t: ModelTerms| t.under) && r.eps[**i].held == lp)
        .count();
    let keep = lp > r.eps[cheapest].held
        && holders == 1
        && lt.ttft <= bt.ttft * (1.0 + p.slack) + p.affinity_tokens;
    Some(ModelPick {
        winner: if keep { li } else { cheapest },
        cheapest,
        longest: li,
        admitted: lp,
        terms,
    })
}

fn tokens(r: &Req, blocks: u32) -> u64 {
    u64::from((blocks * BS).min(r.blocks * BS + r.extra))
}

fn params() -> impl Strategy<Value = Params> {
    (
        prop_oneof![Just(1.0), Just(1.25), Just(2.0), Just(f64::INFINITY)],
        0u32..3,
        prop_oneof![Just(0.0), Just(0.1), Just(0.5)],
        prop_oneof![Just(0.0), Just(128.0)],
        1u32..3,
    )
        .prop_map(
            |(load_factor, headroom, slack, affinity_tokens, min_blocks)| Params {
                load_factor,
                headroom,
                slack,
                affinity_tokens,
                min_blocks,
            },
        )
}

fn request(n: usize) -> impl Strategy<Value = Req> {
    (1u32..12, 0u32..16, 0u32..3, 0.0f64..1.2).prop_flat_map(
        move |(blocks, extra, failures, delivered)| {
            proptest::collection::vec(
                (
                    0..=blocks,
                    0u32..8,
                    prop_oneof![Just(0u64), 0u64..3000],
                    1u32..4,
                    proptest::bool::weighted(0.85),
                )
                    .prop_map(|(held, in_flight, queued, capacity, up)| Ep {
                        held,
                        in_flight,
                        queued,
                        capacity,
                        up,
                    }),
                n,
            )
            .prop_map(move |eps| Req {
                blocks,
                extra,
                eps,
                failures,
                delivered,
            })
        },
    )
}

fn case() -> impl Strategy<Value = (Params, Vec<Req>)> {
    (params(), 2usize..6)
        .prop_flat_map(|(p, n)| (Just(p), proptest::collection::vec(request(n), 1..5)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn explanation_and_account_match_the_reference_model((p, reqs) in case()) {
        let n = reqs[0].eps.len();
        let c = ContractId::new("model/bs16");
        let eps = reqs[0]
            .eps
            .iter()
            .enumerate()
            .map(|(i, e)| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i as u32).with_capacity(e.capacity))
            .collect();
        let mut cfg = RuleConfig::kv_exact("model", Topology::Converged, eps, BS, c.clone());
        cfg.scorer = Arc::new(CostScorer(CostConfig {
            load_factor: p.load_factor,
            load_headroom: p.headroom,
            affinity_slack: p.slack,
            affinity_tokens: p.affinity_tokens,
            drain_queue: false,
            ..CostConfig::default()
        }));
        cfg.predicted.capacity = 0;
        cfg.thresholds.min_overlap_blocks = p.min_blocks;
        let rule = Rule::new(cfg, None).unwrap();
        // Capacities are the rule's: the first request's.
        let caps: Vec<u32> = reqs[0].eps.iter().map(|e| e.capacity).collect();
        let mut turn = 0u64;
        let mut expected = vec![(0u64, 0u64, [0u64; LostCause::COUNT]); n];
        let mut d = Decision::new();
        d.set_explain(true);
        for r in &reqs {
            let mut r = r.clone();
            for (e, cap) in r.eps.iter_mut().zip(&caps) {
                e.capacity = *cap;
            }
            let prompt = r.blocks * BS + r.extra;
            let keys: Vec<BlockKey> = (0..u64::from(r.blocks)).map(|i| BlockKey(500 + i)).collect();
            let mut inv = KeySetInventory::new(n);
            let mut load = LoadTable::new(n);
            for (i, e) in r.eps.iter().enumerate() {
                inv.store(i, keys[..e.held as usize].iter().copied());
                load.set(EndpointId(i as u32), EndpointLoad { in_flight: e.in_flight, queued_prefill_tokens: e.queued });
            }
            let health = Avail(r.eps.iter().map(|e| e.up).collect());
            let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: prompt });
            rule.decide_into(&mut d, &req, &inv, &load, &health, Duration::ZERO);
            let mut excluded = vec![false; n];
            // The model, pick by pick.
            let mut reach_first = None;
            let mut kv_before = false;
            let mut model_target: Option<usize>;
            let mut model_pick: Option<ModelPick>;
            let mut miss: Option<MissReason>;
            let mut retries = 0;
            loop {
                let cand: Vec<usize> = (0..n).filter(|i| r.eps[*i].up && !excluded[*i]).collect();
                let reach = cand.iter().map(|i| tokens(&r, r.eps[*i].held)).max().unwrap_or(0);
                let reach_first = *reach_first.get_or_insert(reach);
                let top = cand.iter().map(|i| r.eps[*i].held).max();
                let kv_try = if kv_before {
                    // A retry after a KV-exact pick stays in the tier: no gate.
                    (!cand.is_empty()).then_some(())
                } else {
                    match top {
                        Some(t) if t >= p.min_blocks => Some(()),
                        _ => None,
                    }
                };
                miss = match (kv_before, top) {
                    (true, _) => None,
                    (false, None) => Some(MissReason::AllCandidatesFiltered),
                    (false, Some(0)) => Some(if r.eps.iter().any(|e| e.held > 0) { MissReason::AllCandidatesFiltered } else { MissReason::ZeroOverlap }),
                    (false, Some(t)) if t < p.min_blocks => Some(MissReason::BelowThreshold),
                    _ => None,
                };
                model_pick = kv_try.and_then(|()| model_cost(&p, &r, &cand, turn));
                turn += 1;
                let target = d.target().map(|t| t.endpoint.index());
                let x = d.explanation().unwrap();
                match &model_pick {
                    Some(m) => {
                        prop_assert_eq!(target, Some(m.winner));
                        prop_assert_eq!(d.source(), Source::KvExact);
                        let s = x.scorer.unwrap();
                        prop_assert_eq!(s.cheapest, Some(m.cheapest));
                        prop_assert_eq!(s.longest, Some(m.longest));
                        prop_assert_eq!(s.admitted_prefix_blocks, Some(m.admitted));
                        let verdict = if m.admitted <= r.eps[m.cheapest].held {
                            Verdict::Cheapest
                        } else if m.winner == m.longest {
                            Verdict::AffinityKept
                        } else {
                            Verdict::Diverted
                        };
                        prop_assert_eq!(s.verdict, Some(verdict));
                        for (i, row) in x.endpoints.iter().enumerate() {
                            let t = row.terms.map(|t| (t.ttft, t.cost, t.under_cap));
                            prop_assert_eq!(t, m.terms[i].map(|t| (t.ttft, t.cost, t.under)), "ep{}", i);
                        }
                        kv_before = true;
                    }
                    None => {
                        prop_assert!(d.source() != Source::KvExact);
                        prop_assert_eq!(x.scorer, None);
                        prop_assert!(x.endpoints.iter().all(|e| e.terms.is_none()));
                        if let Some(t) = target {
                            prop_assert!(cand.contains(&t));
                        }
                    }
                }
                model_target = target;
                // Generic rows: the inputs, and why a row is not a candidate.
                for (i, row) in x.endpoints.iter().enumerate() {
                    prop_assert_eq!(row.confirmed_prefix_blocks, r.eps[i].held);
                    prop_assert_eq!(row.in_flight, r.eps[i].in_flight);
                    prop_assert_eq!(row.queued_prefill_tokens, r.eps[i].queued);
                    prop_assert_eq!(row.capacity, caps[i]);
                    let why = if excluded[i] {
                        Some(Ineligible::ConnectFailed)
                    } else if !r.eps[i].up {
                        Some(Ineligible::Unavailable(Availability::AdminDown))
                    } else {
                        None
                    };
                    prop_assert_eq!(row.ineligible, why, "ep{}", i);
                }
                prop_assert_eq!(x.picks.len(), retries + 1);
                prop_assert_eq!(x.picks.last().unwrap().endpoint.map(|e| e.index()), target);
                // The account as of this pick.
                let a = d.account();
                prop_assert_eq!(x.account, a);
                if let Some(t) = target {
                    let last = reach.min(reach_first);
                    let chosen = tokens(&r, r.eps[t].held).min(last);
                    let mut lost = [0u64; LostCause::COUNT];
                    lost[LostCause::Failover.index()] = reach_first - last;
                    match &model_pick {
                        Some(m) => {
                            let adm = tokens(&r, m.admitted).clamp(chosen, last);
                            if chosen < last {
                                lost[LostCause::LoadCap.index()] = last - adm;
                                lost[LostCause::AffinitySlack.index()] = adm - chosen;
                            }
                        }
                        None => {
                            let cause = if miss == Some(MissReason::BelowThreshold) { LostCause::BelowThreshold } else { LostCause::Scorer };
                            lost[cause.index()] = last - chosen;
                        }
                    }
                    prop_assert_eq!(a.reachable, reach_first);
                    prop_assert_eq!(a.predicted, chosen);
                    prop_assert_eq!(a.lost, lost);
                    prop_assert_eq!(a.reachable, a.predicted + a.lost_total());
                }
                if retries as u32 >= r.failures || target.is_none() {
                    break;
                }
                excluded[target.unwrap_or(0)] = true;
                retries += 1;
                let next = rule.retry(&mut d, Leg::Endpoint, &req, &load, &health, Duration::ZERO);
                prop_assert_eq!(next, d.target());
                if next.is_none() {
                    // Nothing left: the last step is exhausted.
                    let x = d.explanation().unwrap();
                    prop_assert_eq!(x.picks.last().unwrap().tier, Source::Exhausted);
                    // That pick took its turn too.
                    turn += 1;
                    model_target = None;
                    break;
                }
            }
            let Some(t) = model_target else { continue };
            let delivered = (r.delivered * f64::from(prompt)) as u32;
            let delivered = delivered.min(prompt);
            let before = d.account();
            let s = rule.settle(&d, delivered, Some(prompt));
            prop_assert!(s.counted);
            let a = s.account.unwrap();
            let achieved = before.predicted.min(u64::from(delivered));
            prop_assert_eq!(a.achieved, achieved);
            prop_assert_eq!(a.lost_to(LostCause::StaleInventory), before.predicted - achieved);
            prop_assert_eq!(a.reachable, a.achieved + a.lost_total());
            let e = &mut expected[t];
            e.0 += a.reachable;
            e.1 += a.achieved;
            for (x, y) in e.2.iter_mut().zip(a.lost) {
                *x += y;
            }
        }
        let snap = rule.counters().snapshot();
        for (i, (reach, achieved, lost)) in expected.iter().enumerate() {
            let ev = &snap.endpoints[i];
            prop_assert_eq!((ev.reachable_tokens, ev.achieved_tokens, ev.lost_tokens), (*reach, *achieved, *lost), "ep{}", i);
            prop_assert_eq!(ev.reachable_tokens, ev.achieved_tokens + ev.lost_tokens.iter().sum::<u64>());
        }
    }
}
