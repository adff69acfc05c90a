//! A decision's explanation says, field by field, what the decision did —
//! in cases where the bounded-load cap, the affinity slack, a stale
//! inventory, a contract mismatch, a connect failure, the hit threshold, P/D
//! session affinity, an unexplaining scorer and tokenization overload each
//! decide — and its cached-token account, settled by the receipt, adds up
//! and reaches the rule's counters.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::*;

const BS: u32 = 16;
/// 20 blocks.
const PROMPT: u32 = 320;

fn rule_with(
    roles: &[Role],
    cost: CostConfig,
    f: impl FnOnce(&mut RuleConfig),
) -> (Rule, ContractId) {
    let c = ContractId::new("explain/bs16");
    let eps = roles
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let e = Endpoint::new(format!("ep{i}"), *r);
            if r.can_prefill() {
                e.with_inventory_slot(i as u32)
            } else {
                e
            }
        })
        .collect();
    let mut cfg = RuleConfig::kv_exact("explain", Topology::Converged, eps, BS, c.clone());
    // The queue as the load view gives it (no drain model), so the rows
    // can be checked against the inputs.
    cfg.scorer = Arc::new(CostScorer(CostConfig {
        drain_queue: false,
        ..cost
    }));
    cfg.predicted.capacity = 0;
    f(&mut cfg);
    (Rule::new(cfg, None).unwrap(), c)
}

fn rule(n: usize, cost: CostConfig) -> (Rule, ContractId) {
    rule_with(&vec![Role::Both; n], cost, |_| {})
}

fn prompt_keys() -> Vec<BlockKey> {
    (0..u64::from(PROMPT / BS))
        .map(|i| BlockKey(7_000 + i))
        .collect()
}

fn holding(n: usize, held: &[usize]) -> KeySetInventory {
    let keys = prompt_keys();
    let mut inv = KeySetInventory::new(n);
    for (slot, blocks) in held.iter().enumerate() {
        inv.store(slot, keys[..*blocks].iter().copied());
    }
    inv
}

fn loads(l: &[(u32, u64)]) -> LoadTable {
    let mut t = LoadTable::new(l.len());
    for (i, (in_flight, queued)) in l.iter().enumerate() {
        t.set(
            EndpointId(i as u32),
            EndpointLoad {
                in_flight: *in_flight,
                queued_prefill_tokens: *queued,
            },
        );
    }
    t
}

/// Decides with the explanation asked for.
fn explained<V: kvroute_ingest::InventoryView, H: Health>(
    r: &Rule,
    c: &ContractId,
    inv: &V,
    load: &LoadTable,
    health: &H,
) -> Decision {
    let keys = prompt_keys();
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: c,
        prompt_tokens: PROMPT,
    });
    let mut d = Decision::new();
    d.set_explain(true);
    r.decide_into(&mut d, &req, inv, load, health, Duration::ZERO);
    d
}

/// The account's parts add up: before a receipt to the prediction, after
/// one to what was achieved.
fn assert_sums(a: &TokenAccount) {
    let kept = if a.settled { a.achieved } else { a.predicted };
    assert_eq!(a.reachable, kept + a.lost_total(), "{a:?}");
}

fn lost(a: &TokenAccount) -> Vec<(&'static str, u64)> {
    LostCause::ALL
        .iter()
        .filter(|c| a.lost_to(**c) > 0)
        .map(|c| (c.as_str(), a.lost_to(*c)))
        .collect()
}

/// The generic rows are the decision's inputs: the inventory's prefix, the
/// load view, the configuration.
fn assert_rows(x: &Explanation, held: &[usize], load: &[(u32, u64)]) {
    assert_eq!(x.endpoints.len(), held.len());
    for (i, row) in x.endpoints.iter().enumerate() {
        assert_eq!(row.endpoint, EndpointId(i as u32));
        assert_eq!(row.confirmed_prefix_blocks, held[i] as u32, "ep{i}");
        assert_eq!(row.predicted_prefix_blocks, 0, "ep{i}");
        assert_eq!(row.in_flight, load[i].0, "ep{i}");
        assert_eq!(row.queued_prefill_tokens, load[i].1, "ep{i}");
        assert_eq!(row.capacity, 1);
        assert!(!row.contract_mismatch);
    }
    assert_eq!(
        (x.prompt_tokens, x.block_size, x.keys),
        (PROMPT, BS, PROMPT / BS)
    );
}

/// The cost formula of `docs/routing.md`, for one candidate with equal
/// capacities and one tier.
fn terms(
    cfg: &CostConfig,
    prefix: usize,
    (in_flight, queued): (u32, u64),
    under_cap: bool,
) -> ScoreTerms {
    let cached = (prefix as f64 * f64::from(BS)).min(f64::from(PROMPT));
    let prefill = cfg.prefill_weight * (f64::from(PROMPT) - cached);
    let queued = queued as f64;
    let in_flight_tokens = cfg.decode_tokens_per_request * f64::from(in_flight);
    ScoreTerms {
        cached_tokens: cached,
        prefill_tokens: prefill,
        queued_tokens: queued,
        unseen_tokens: 0.0,
        spill_tokens: 0.0,
        evict_tokens: 0.0,
        in_flight_tokens,
        ttft: queued + prefill,
        cost: queued + prefill + in_flight_tokens,
        under_cap,
    }
}

/// The cap decides: the endpoint holding 16 blocks carries 10 requests, over
/// `⌈1.25 · 11 / 3⌉ = 5`, so the 8-block endpoint wins and 8 blocks are lost
/// to the cap.
#[test]
fn the_load_cap_decides_and_the_explanation_says_so() {
    let cfg = CostConfig {
        load_headroom: 0,
        ..CostConfig::default()
    };
    let (r, c) = rule(3, cfg);
    let held = [16, 8, 0];
    let load = [(10, 0), (0, 0), (0, 0)];
    let d = explained(&r, &c, &holding(3, &held), &loads(&load), &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(1)));
    let x = d.explanation().unwrap();
    assert_rows(x, &held, &load);
    for (i, row) in x.endpoints.iter().enumerate() {
        assert_eq!(row.ineligible, None);
        assert_eq!(
            row.terms,
            Some(terms(&cfg, held[i], load[i], i != 0)),
            "ep{i}"
        );
    }
    let s = x.scorer.unwrap();
    let cap = s.cap.unwrap();
    assert_eq!(
        cap.bound,
        LoadBound {
            total_in_flight: 10,
            total_capacity: 3,
            factor: 1.25
        }
    );
    assert_eq!(cap.bound.limit(1), 5.0);
    assert!(cap.applied);
    assert_eq!((cap.refused, cap.headroom), (1, 0));
    assert_eq!(s.admitted_prefix_blocks, Some(8));
    assert_eq!((s.cheapest, s.longest), (Some(1), Some(1)));
    assert_eq!(s.verdict, Some(Verdict::Cheapest));
    assert_eq!(s.affinity_bound, Some(192.0 * 1.1 + 128.0));
    assert_eq!(
        x.picks,
        [PickStep {
            tier: Source::KvExact,
            miss: None,
            endpoint: Some(EndpointId(1)),
            decode: None,
            failed: None,
            predicted_blocks: 8,
            diverted: true,
        }]
    );
    let a = d.account();
    assert_eq!(x.account, a);
    assert_eq!((a.reachable, a.predicted), (256, 128));
    assert_eq!(lost(&a), [("load_cap", 128)]);
    assert_sums(&a);
    // The engine delivers what was predicted.
    let s = r.settle(&d, 128, Some(PROMPT));
    assert!(s.counted);
    let a = s.account.unwrap();
    assert_eq!((a.achieved, a.lost_total()), (128, 128));
    assert_sums(&a);
    let ev = r.counters().snapshot().endpoints[1];
    assert_eq!((ev.reachable_tokens, ev.achieved_tokens), (256, 128));
    assert_eq!(ev.lost_to(LostCause::LoadCap), 128);
}

/// The slack decides: the 16-block endpoint has 2000 tokens queued, its
/// time to first token (2064) is beyond `1.1 · 256 + 128` of the 4-block
/// one's, so the prompt moves and 12 blocks are lost to the slack; with 200
/// queued (264) it stays.
#[test]
fn the_affinity_slack_decides_either_way() {
    let cfg = CostConfig {
        load_factor: f64::INFINITY,
        ..CostConfig::default()
    };
    let (r, c) = rule(2, cfg);
    let held = [16, 4];
    let load = [(0, 2000), (0, 0)];
    let d = explained(&r, &c, &holding(2, &held), &loads(&load), &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(1)));
    let x = d.explanation().unwrap();
    assert_rows(x, &held, &load);
    for (i, row) in x.endpoints.iter().enumerate() {
        assert_eq!(
            row.terms,
            Some(terms(&cfg, held[i], load[i], true)),
            "ep{i}"
        );
    }
    let s = x.scorer.unwrap();
    assert_eq!(s.cap, None);
    assert_eq!((s.cheapest, s.longest), (Some(1), Some(0)));
    assert_eq!(s.admitted_prefix_blocks, Some(16));
    assert_eq!(s.verdict, Some(Verdict::Diverted));
    let bound = s.affinity_bound.unwrap();
    assert_eq!(bound, 256.0 * 1.1 + 128.0);
    assert!(x.endpoints[0].terms.unwrap().ttft > bound);
    assert!(x.picks[0].diverted);
    let a = d.account();
    assert_eq!((a.reachable, a.predicted), (256, 64));
    assert_eq!(lost(&a), [("affinity_slack", 192)]);
    assert_eq!(r.counters().snapshot().load_diversions, 1);

    let load = [(0, 200), (0, 0)];
    let d = explained(&r, &c, &holding(2, &held), &loads(&load), &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(0)));
    let s = d.explanation().unwrap().scorer.unwrap();
    assert_eq!(s.verdict, Some(Verdict::AffinityKept));
    assert_eq!((s.cheapest, s.longest), (Some(1), Some(0)));
    assert!(d.explanation().unwrap().endpoints[0].terms.unwrap().ttft <= s.affinity_bound.unwrap());
    assert!(!d.explanation().unwrap().picks[0].diverted);
    assert_eq!(lost(&d.account()), []);
    assert_eq!(d.account().predicted, 256);
}

/// A stale inventory decides: the index still lists 16 blocks the engine
/// evicted, so that endpoint wins, and the receipt's 2 blocks settle the
/// other 14 as stale inventory.
#[test]
fn a_stale_inventory_decides_and_the_receipt_shows_it() {
    let (r, c) = rule(2, CostConfig::default());
    let held = [16, 2];
    let load = [(0, 0), (0, 0)];
    let d = explained(&r, &c, &holding(2, &held), &loads(&load), &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(0)));
    let x = d.explanation().unwrap();
    assert_rows(x, &held, &load);
    assert_eq!(x.scorer.unwrap().verdict, Some(Verdict::Cheapest));
    assert_eq!(lost(&x.account), []);
    assert_eq!(x.account.predicted, 256);
    let s = r.settle(&d, 32, Some(PROMPT));
    let a = s.account.unwrap();
    assert!(a.settled);
    assert_eq!((a.reachable, a.achieved), (256, 32));
    assert_eq!(lost(&a), [("stale_inventory", 224)]);
    assert_sums(&a);
    let snap = r.counters().snapshot();
    assert_eq!(snap.endpoints[0].lost_to(LostCause::StaleInventory), 224);
    assert_eq!(snap.reachable_tokens(), 256);
    assert_eq!(snap.achieved_tokens(), 32);
    // The receipt evidence beside it: predicted (confirmed) and delivered.
    assert_eq!(
        (
            snap.endpoints[0].predicted_tokens,
            snap.endpoints[0].delivered_tokens
        ),
        (256, 32)
    );
}

/// Predicted entries credit an endpoint before its engine's events arrive;
/// a receipt that delivers nothing settles them as stale inventory.
#[test]
fn unconfirmed_predicted_entries_are_stale_when_not_delivered() {
    let (r, c) = rule_with(&[Role::Both, Role::Both], CostConfig::default(), |cfg| {
        cfg.predicted = PredictedConfig::default();
    });
    let inv = holding(2, &[0, 0]);
    let load = loads(&[(0, 0), (0, 0)]);
    let first = explained(&r, &c, &inv, &load, &AlwaysAvailable);
    let e = first.target().unwrap().endpoint.index();
    assert_eq!(first.account().reachable, 0);
    let second = explained(&r, &c, &inv, &load, &AlwaysAvailable);
    assert_eq!(second.target().unwrap().endpoint.index(), e);
    let x = second.explanation().unwrap();
    assert_eq!(x.endpoints[e].predicted_prefix_blocks, PROMPT / BS);
    assert_eq!(x.endpoints[e].confirmed_prefix_blocks, 0);
    assert_eq!(x.endpoints[e].prefix_blocks(), PROMPT / BS);
    assert_eq!(x.account.reachable, u64::from(PROMPT));
    let a = r.settle(&second, 0, None).account.unwrap();
    assert_eq!(lost(&a), [("stale_inventory", u64::from(PROMPT))]);
}

/// Once an endpoint's drift alarm is raised, what it does not deliver is a
/// contract mismatch, not stale inventory.
#[test]
fn shortfalls_behind_a_drift_alarm_are_contract_mismatches() {
    let (r, c) = rule_with(&[Role::Both], CostConfig::default(), |cfg| {
        cfg.thresholds.drift_alarm_after = 1;
    });
    let inv = holding(1, &[20]);
    let load = loads(&[(0, 0)]);
    let d = explained(&r, &c, &inv, &load, &AlwaysAvailable);
    let first = r.settle(&d, 0, None);
    assert!(first.drift_alarm_raised);
    assert_eq!(lost(&first.account.unwrap()), [("stale_inventory", 320)]);
    let d = explained(&r, &c, &inv, &load, &AlwaysAvailable);
    let second = r.settle(&d, 0, None).account.unwrap();
    assert_eq!(lost(&second), [("contract_mismatch", 320)]);
    let ev = r.counters().snapshot().endpoints[0];
    assert_eq!(ev.reachable_tokens, 640);
    assert_eq!(ev.achieved_tokens + ev.lost_tokens.iter().sum::<u64>(), 640);
}

/// A connect failure takes out the 16-block endpoint: the retry's pick, its
/// failed endpoint and the row's reason are in the explanation, and 8 blocks
/// are lost to failover.
#[test]
fn failover_is_explained_per_pick() {
    let (r, c) = rule(3, CostConfig::default());
    let held = [16, 8, 0];
    let load = loads(&[(0, 0), (0, 0), (0, 0)]);
    let mut d = explained(&r, &c, &holding(3, &held), &load, &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(0)));
    let keys = prompt_keys();
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &c,
        prompt_tokens: PROMPT,
    });
    let next = r.retry(
        &mut d,
        Leg::Endpoint,
        &req,
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    assert_eq!(next.map(|t| t.endpoint), Some(EndpointId(1)));
    let x = d.explanation().unwrap();
    assert_eq!(x.picks.len(), 2);
    assert_eq!(x.picks[0].endpoint, Some(EndpointId(0)));
    assert_eq!(x.picks[1].failed, Some((EndpointId(0), Leg::Endpoint)));
    assert_eq!(x.picks[1].endpoint, Some(EndpointId(1)));
    assert_eq!(x.picks[1].tier, Source::KvExact);
    assert_eq!(x.endpoints[0].ineligible, Some(Ineligible::ConnectFailed));
    assert_eq!(x.endpoints[0].terms, None);
    assert_eq!(x.endpoints[1].ineligible, None);
    assert_eq!(lost(&x.account), [("failover", 128)]);
    let a = r.settle(&d, 128, None).account.unwrap();
    assert_eq!((a.reachable, a.achieved), (256, 128));
    assert_sums(&a);
}

/// Below `min_overlap_blocks` the fallback decides: what the best endpoint
/// held beyond the chosen one is lost to the threshold; an endpoint that is
/// down is not a candidate and says why.
#[test]
fn the_threshold_and_availability_are_explained() {
    let (r, c) = rule_with(&[Role::Both; 3], CostConfig::default(), |cfg| {
        cfg.thresholds.min_overlap_blocks = 10;
    });
    let mut health = HealthTable::new(3, BreakerConfig::default());
    health.set_admin(EndpointId(0), AdminState::Down);
    let held = [20, 8, 0];
    let load = loads(&[(0, 0), (0, 0), (0, 0)]);
    let d = explained(&r, &c, &holding(3, &held), &load, &health);
    assert_eq!(d.miss(), Some(MissReason::BelowThreshold));
    let x = d.explanation().unwrap();
    assert_eq!(
        x.endpoints[0].ineligible,
        Some(Ineligible::Unavailable(Availability::AdminDown))
    );
    assert_eq!(x.endpoints[0].ineligible.unwrap().as_str(), "admin_down");
    assert_eq!(x.picks[0].miss, Some(MissReason::BelowThreshold));
    assert!(matches!(x.picks[0].tier, Source::Fallback(_)));
    assert_eq!(x.scorer, None);
    let t = d.target().unwrap().endpoint.index();
    let chosen = u64::from(held[t] as u32 * BS);
    assert_eq!(
        x.account.reachable, 128,
        "the endpoint that is down does not count"
    );
    assert_eq!(
        lost(&x.account),
        [("below_threshold", 128 - chosen)]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect::<Vec<_>>()
    );
    assert_sums(&x.account);
}

/// P/D: session affinity keeps a conversation where it was although another
/// prefill endpoint holds more; the decode-only endpoint is never a
/// candidate.
#[test]
fn pd_affinity_and_decode_only_rows() {
    let (r, c) = rule_with(
        &[Role::Prefill, Role::Prefill, Role::Decode],
        CostConfig::default(),
        |cfg| {
            cfg.topology = Topology::PrefillDecode;
        },
    );
    let keys = prompt_keys();
    let load = loads(&[(0, 0), (0, 0), (0, 0)]);
    let mut d = Decision::new();
    d.set_explain(true);
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &c,
        prompt_tokens: PROMPT,
    })
    .with_session("s");
    r.decide_into(
        &mut d,
        &req,
        &holding(3, &[0, 0, 0]),
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    let first = d.target().unwrap().endpoint.index();
    let other = 1 - first;
    let mut held = [0, 0, 0];
    held[other] = 12;
    r.decide_into(
        &mut d,
        &req,
        &holding(3, &held),
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    assert_eq!(d.source(), Source::SessionAffinity);
    assert_eq!(d.target().unwrap().endpoint.index(), first);
    let x = d.explanation().unwrap();
    assert_eq!(x.endpoints[2].ineligible, Some(Ineligible::DecodeOnly));
    assert_eq!(x.picks[0].decode, Some(EndpointId(2)));
    assert_eq!(lost(&x.account), [("pd_affinity", 192)]);
}

/// A host's scorer that does not explain: the rows carry the generic fields,
/// no terms, and what it gave up is counted to the scorer.
#[test]
fn a_scorer_without_explain_is_explained_generically() {
    #[derive(Debug)]
    struct FewestInFlight;
    impl Scorer for FewestInFlight {
        fn name(&self) -> &str {
            "fewest_in_flight"
        }
        fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
            let Some(c) = input.candidates().min_by_key(|c| c.load.in_flight) else {
                return ScorePick::Miss(MissReason::AllCandidatesFiltered);
            };
            ScorePick::Winner {
                index: c.index,
                predicted_blocks: c.prefix(),
                diverted: false,
            }
        }
    }
    let (r, c) = rule_with(&[Role::Both; 2], CostConfig::default(), |cfg| {
        cfg.scorer = Arc::new(FewestInFlight);
    });
    let held = [16, 4];
    let load = [(3, 0), (1, 0)];
    let d = explained(&r, &c, &holding(2, &held), &loads(&load), &AlwaysAvailable);
    assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(1)));
    let x = d.explanation().unwrap();
    assert_rows(x, &held, &load);
    assert!(x.endpoints.iter().all(|e| e.terms.is_none()));
    assert_eq!(x.scorer, None);
    assert_eq!(lost(&x.account), [("scorer", 192)]);
}

/// An untokenized prompt: the engine's prompt length, in whole blocks,
/// bounds what was reachable.
#[test]
fn tokenize_overload_is_bounded_by_the_engines_prompt() {
    let (r, _) = rule(2, CostConfig::default());
    let req = Request::new(PromptInput::Missing(MissReason::TokenizeOverloaded));
    let mut d = Decision::new();
    d.set_explain(true);
    r.decide_into(
        &mut d,
        &req,
        &holding(2, &[0, 0]),
        &loads(&[(0, 0), (0, 0)]),
        &AlwaysAvailable,
        Duration::ZERO,
    );
    let x = d.explanation().unwrap();
    assert_eq!(x.key_miss, Some(MissReason::TokenizeOverloaded));
    assert_eq!(x.picks[0].miss, Some(MissReason::TokenizeOverloaded));
    assert_eq!(x.account.reachable, 0);
    let a = r.settle(&d, 32, Some(100)).account.unwrap();
    assert_eq!((a.reachable, a.achieved), (96, 32));
    assert_eq!(lost(&a), [("tokenize_overload", 64)]);
    // No engine prompt count: nothing to bound it by.
    let a = r.settle(&d, 32, None).account.unwrap();
    assert_eq!((a.reachable, a.achieved, a.lost_total()), (0, 0, 0));
}

/// A decision that was not asked has no explanation; one reused keeps
/// explaining, and explains only its own decision.
#[test]
fn explanations_are_opt_in_and_per_decision() {
    let (r, c) = rule(2, CostConfig::default());
    let keys = prompt_keys();
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &c,
        prompt_tokens: PROMPT,
    });
    let load = loads(&[(0, 0), (0, 0)]);
    let d = r.decide(
        &req,
        &holding(2, &[4, 0]),
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    assert!(d.explanation().is_none());
    assert!(!d.explains());
    assert_eq!(d.account().reachable, 64);
    let mut d = Decision::new();
    d.set_explain(true);
    r.decide_into(
        &mut d,
        &req,
        &holding(2, &[4, 0]),
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    r.decide_into(
        &mut d,
        &req,
        &holding(2, &[0, 8]),
        &load,
        &AlwaysAvailable,
        Duration::ZERO,
    );
    let x = d.explanation().unwrap();
    assert_eq!(x.picks.len(), 1);
    assert_eq!(x.endpoints[0].confirmed_prefix_blocks, 0);
    assert_eq!(x.endpoints[1].confirmed_prefix_blocks, 8);
    assert!(x.heap_bytes() > 0);
    d.set_explain(false);
    assert!(d.explanation().is_none());
}
