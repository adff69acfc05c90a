//! Behaviour of each ladder tier, miss reasons and evidence.

mod common;

use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use std::sync::Arc;

use kvroute_select::*;

const T0: Duration = Duration::from_secs(1000);

/// The ladder's reference configuration: argmax overlap, round robin on a
/// miss, no predicted entries — so each decision depends only on the
/// inventory and loads given (the default cost scorer and predicted entries
/// have their own tests in `cost_policy.rs`).
fn reference(mut cfg: RuleConfig) -> RuleConfig {
    cfg.scorer = Arc::new(OverlapCountScorer);
    cfg.fallback = SelectorKind::RoundRobin;
    cfg.predicted.capacity = 0;
    cfg
}

fn converged(n: u32, contract: &ContractId) -> RuleConfig {
    let eps = (0..n)
        .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i))
        .collect();
    reference(RuleConfig::kv_exact(
        "t",
        Topology::Converged,
        eps,
        16,
        contract.clone(),
    ))
}

fn pd(contract: &ContractId) -> RuleConfig {
    let eps = vec![
        Endpoint::new("p0", Role::Prefill).with_inventory_slot(0),
        Endpoint::new("d0", Role::Decode),
        Endpoint::new("p1", Role::Prefill).with_inventory_slot(1),
        Endpoint::new("d1", Role::Decode),
    ];
    reference(RuleConfig::kv_exact(
        "pd",
        Topology::PrefillDecode,
        eps,
        16,
        contract.clone(),
    ))
}

fn keys_req<'a>(keys: &'a [BlockKey], c: &'a ContractId) -> Request<'a> {
    Request::new(PromptInput::Keys {
        keys,
        contract: c,
        prompt_tokens: keys.len() as u32 * 16,
    })
}

#[test]
fn every_miss_reason_before_scoring_is_counted_and_falls_back() {
    let c = ContractId::new("c");
    let (_, hasher, golden) = common::vllm_sha256_cbor_unset_seed();
    let rule = Rule::new(converged(3, &c), None).unwrap();
    let inv = KeySetInventory::new(3);
    let (load, h) = (LoadTable::new(3), AlwaysAvailable);
    let other = ContractId::new("other");
    let keys = [BlockKey(1)];
    let cases: Vec<(Request<'_>, MissReason)> = vec![
        (
            Request::new(PromptInput::Missing(MissReason::NotJson)),
            MissReason::NotJson,
        ),
        (
            Request::new(PromptInput::Missing(MissReason::NoModel)),
            MissReason::NoModel,
        ),
        (
            Request::new(PromptInput::Missing(MissReason::NoTokenizer)),
            MissReason::NoTokenizer,
        ),
        (
            Request::new(PromptInput::Missing(MissReason::TokenizeError)),
            MissReason::TokenizeError,
        ),
        (
            Request::new(PromptInput::Missing(MissReason::EmptyPrompt)),
            MissReason::EmptyPrompt,
        ),
        (
            Request::new(PromptInput::Tokens(&[])),
            MissReason::EmptyPrompt,
        ),
        (
            Request::new(PromptInput::Tokens(&golden.tokens)),
            MissReason::NoHasher,
        ),
        (
            Request::new(PromptInput::Keys {
                keys: &keys,
                contract: &other,
                prompt_tokens: 16,
            }),
            MissReason::ContractMismatch,
        ),
        (
            Request::new(PromptInput::Keys {
                keys: &[],
                contract: &c,
                prompt_tokens: 3,
            }),
            MissReason::NoKeys,
        ),
        (keys_req(&keys, &c), MissReason::ZeroOverlap),
    ];
    let mut seen = Vec::new();
    for (req, reason) in &cases {
        let d = rule.decide(req, &inv, &load, &h, T0);
        assert_eq!(d.miss(), Some(*reason));
        assert_eq!(d.source(), Source::Fallback(SelectorKind::RoundRobin));
        seen.push(d.target().unwrap().endpoint.0);
    }
    // Round robin over the three endpoints.
    assert_eq!(&seen[..4], &[0, 1, 2, 0]);
    let snap = rule.counters().snapshot();
    for (_, reason) in &cases {
        let expected = cases.iter().filter(|(_, r)| r == reason).count() as u64;
        assert_eq!(snap.misses_for(*reason), expected, "{reason:?}");
    }
    assert_eq!(snap.fallbacks, cases.len() as u64);

    // No inventory: a view with no slots, or endpoints without slots.
    let d = rule.decide(
        &keys_req(&keys, &c),
        &KeySetInventory::new(0),
        &load,
        &h,
        T0,
    );
    assert_eq!(d.miss(), Some(MissReason::NoInventory));
    // Contract checks at build time.
    let err = Rule::new(converged(2, &c), Some(hasher)).unwrap_err();
    assert!(matches!(err, RuleError::ContractMismatch { .. }));
}

#[test]
fn filtered_holders_are_a_distinct_miss_and_threshold_applies() {
    let c = ContractId::new("c");
    let mut cfg = converged(3, &c);
    cfg.thresholds.min_overlap_blocks = 2;
    let rule = Rule::new(cfg, None).unwrap();
    let mut inv = KeySetInventory::new(3);
    inv.store(1, [BlockKey(1), BlockKey(2)]);
    inv.store(2, [BlockKey(1)]);
    let load = LoadTable::new(3);
    let mut health = HealthTable::new(3, BreakerConfig::default());
    let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &health, T0);
    assert_eq!(
        (d.source(), d.target().unwrap().endpoint),
        (Source::KvExact, EndpointId(1))
    );

    health.set_admin(EndpointId(1), AdminState::Down);
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &health, T0);
    assert_eq!(d.miss(), Some(MissReason::BelowThreshold)); // EP2 holds 1 < 2
    assert_ne!(d.target().unwrap().endpoint, EndpointId(1));

    health.set_admin(EndpointId(2), AdminState::Down);
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &health, T0);
    assert_eq!(d.miss(), Some(MissReason::AllCandidatesFiltered));
    assert_eq!(d.target().unwrap().endpoint, EndpointId(0));
}

/// A retry's pick is the same decision: the tier counters (hits, predicted
/// blocks, fallbacks) count each decision once, whatever its retries pick.
#[test]
fn retries_count_no_second_hit_or_fallback() {
    let c = ContractId::new("c");
    let rule = Rule::new(converged(3, &c), None).unwrap();
    let mut inv = KeySetInventory::new(3);
    inv.store(0, [BlockKey(1), BlockKey(2)]);
    inv.store(1, [BlockKey(1)]);
    let load = LoadTable::new(3);
    let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
    let req = keys_req(&keys, &c);
    let mut d = rule.decide(&req, &inv, &load, &AlwaysAvailable, T0);
    assert_eq!(d.target().unwrap().endpoint, EndpointId(0));
    let t = rule
        .retry(&mut d, Leg::Endpoint, &req, &load, &AlwaysAvailable, T0)
        .unwrap();
    assert_eq!((d.source(), t.endpoint), (Source::KvExact, EndpointId(1)));
    let s = rule.counters().snapshot();
    let hits: u64 = s.endpoints.iter().map(|e| e.hits).sum();
    assert_eq!(
        (s.decisions, hits, s.predicted_blocks, s.retries),
        (1, 1, 2, 1)
    );
    // A fallback decision retried (round robin): one fallback.
    let miss = Request::new(PromptInput::Missing(MissReason::NoModel));
    let mut d = rule.decide(&miss, &inv, &load, &AlwaysAvailable, T0);
    rule.retry(&mut d, Leg::Endpoint, &miss, &load, &AlwaysAvailable, T0)
        .unwrap();
    assert_eq!(rule.counters().snapshot().fallbacks, 1);
}

/// A rule rebuilt (an endpoint joined or left) carries its round-robin turn
/// on: it does not start again at the first endpoint.
#[test]
fn a_rebuilt_rule_carries_its_round_robin_turn() {
    let c = ContractId::new("c");
    let mut cfg = converged(3, &c);
    cfg.choice = Choice::RoundRobin;
    let rule = Rule::new(cfg.clone(), None).unwrap();
    let (inv, load) = (KeySetInventory::new(3), LoadTable::new(3));
    let req = Request::new(PromptInput::Missing(MissReason::NoModel));
    let pick = |rule: &Rule| {
        rule.decide(&req, &inv, &load, &AlwaysAvailable, T0)
            .target()
            .unwrap()
            .endpoint
    };
    assert_eq!((pick(&rule), pick(&rule)), (EndpointId(0), EndpointId(1)));
    let rebuilt = rule.rebuild(cfg, None).unwrap();
    assert_eq!(pick(&rebuilt), EndpointId(2));
}

#[test]
fn open_breaker_filters_until_half_open() {
    let c = ContractId::new("c");
    let rule = Rule::new(converged(2, &c), None).unwrap();
    let mut inv = KeySetInventory::new(2);
    inv.store(0, [BlockKey(5)]);
    let load = LoadTable::new(2);
    let cfg = BreakerConfig {
        failure_threshold: 2,
        cool_down: Duration::from_secs(30),
    };
    let mut health = HealthTable::new(2, cfg);
    let keys = [BlockKey(5)];
    health.record_failure(EndpointId(0), T0);
    health.record_failure(EndpointId(0), T0);
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &health, T0);
    assert_eq!(d.target().unwrap().endpoint, EndpointId(1));
    assert_eq!(d.miss(), Some(MissReason::AllCandidatesFiltered));
    let later = T0 + Duration::from_secs(30);
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &health, later);
    assert_eq!(
        (d.source(), d.target().unwrap().endpoint),
        (Source::KvExact, EndpointId(0))
    );
}

#[test]
fn pd_session_affinity_then_trie_then_kv() {
    let c = ContractId::new("c");
    let mut cfg = pd(&c);
    cfg.affinity.session_ttl = Duration::from_secs(60);
    cfg.affinity.trie_chunk_bytes = 8;
    let rule = Rule::new(cfg, None).unwrap();
    let mut inv = KeySetInventory::new(2);
    let mut load = LoadTable::new(4);
    let h = AlwaysAvailable;
    let keys = [BlockKey(9)];
    // First: no inventory overlap → min load. Make p0 busy so p1 wins.
    load.set(
        EndpointId(0),
        EndpointLoad {
            in_flight: 3,
            queued_prefill_tokens: 0,
        },
    );
    let req = keys_req(&keys, &c).with_session("alice");
    let d = rule.decide(&req, &inv, &load, &h, T0);
    assert_eq!(d.target().unwrap().endpoint, EndpointId(2));
    // Now p0 holds the block, but alice's session sticks to p1.
    inv.store(0, keys);
    let d = rule.decide(&req, &inv, &load, &h, T0 + Duration::from_secs(10));
    assert_eq!(
        (d.source(), d.target().unwrap().endpoint),
        (Source::SessionAffinity, EndpointId(2))
    );
    // After the TTL the session is forgotten and KV-exact decides.
    let d = rule.decide(&req, &inv, &load, &h, T0 + Duration::from_secs(200));
    assert_eq!(
        (d.source(), d.target().unwrap().endpoint),
        (Source::KvExact, EndpointId(0))
    );
    assert_eq!(rule.session_count(), 1);

    // Trie: text sent to p1 once; a request sharing most of the text follows it.
    let text_a = "You are a helpful assistant. Answer briefly. Question: what is KV?";
    let text_b = "You are a helpful assistant. Answer briefly. Question: why route?";
    let none: [BlockKey; 0] = [];
    load.set(
        EndpointId(0),
        EndpointLoad {
            in_flight: 0,
            queued_prefill_tokens: 0,
        },
    );
    load.set(
        EndpointId(2),
        EndpointLoad {
            in_flight: 0,
            queued_prefill_tokens: 0,
        },
    );
    let later = T0 + Duration::from_secs(300);
    let first = rule.decide(
        &keys_req(&none, &c).with_text(text_a),
        &inv,
        &load,
        &h,
        later,
    );
    let first_ep = first.target().unwrap().endpoint;
    let second = rule.decide(
        &keys_req(&none, &c).with_text(text_b),
        &inv,
        &load,
        &h,
        later,
    );
    assert_eq!(second.source(), Source::TrieAffinity);
    assert_eq!(second.target().unwrap().endpoint, first_ep);
    assert!(rule.trie_nodes() > 0);
    let snap = rule.counters().snapshot();
    assert_eq!((snap.session_affinity, snap.trie_affinity), (1, 1));
}

#[test]
fn pd_decode_is_least_loaded_and_decode_failure_keeps_prefill() {
    let c = ContractId::new("c");
    let rule = Rule::new(pd(&c), None).unwrap();
    let inv = KeySetInventory::new(2);
    let mut load = LoadTable::new(4);
    load.set(
        EndpointId(1),
        EndpointLoad {
            in_flight: 5,
            queued_prefill_tokens: 0,
        },
    );
    let req = Request::new(PromptInput::Missing(MissReason::NoModel));
    let mut d = rule.decide(&req, &inv, &load, &AlwaysAvailable, T0);
    let t = d.target().unwrap();
    assert_eq!(t.decode, Some(EndpointId(3)));
    let t2 = rule
        .retry(&mut d, Leg::Decode, &req, &load, &AlwaysAvailable, T0)
        .unwrap();
    assert_eq!((t2.endpoint, t2.decode), (t.endpoint, Some(EndpointId(1))));
    assert_eq!(
        rule.retry(&mut d, Leg::Decode, &req, &load, &AlwaysAvailable, T0),
        None
    );
}

/// Two endpoints that both prefill and decode: a leg that failed on one
/// takes it out of the other leg too for the retry (a host that refused a
/// connection is no better a decode endpoint than a prefill one).
#[test]
fn a_failed_leg_takes_its_endpoint_out_of_the_other_leg() {
    let c = ContractId::new("c");
    let eps = vec![
        Endpoint::new("a", Role::Both).with_inventory_slot(0),
        Endpoint::new("b", Role::Both).with_inventory_slot(1),
    ];
    let rule = Rule::new(
        reference(RuleConfig::kv_exact(
            "pd",
            Topology::PrefillDecode,
            eps,
            16,
            c.clone(),
        )),
        None,
    )
    .unwrap();
    let inv = KeySetInventory::new(2);
    let req = Request::new(PromptInput::Missing(MissReason::NoModel));
    for busy in [0u32, 1] {
        // The other endpoint is busier: least-loaded decode would be the
        // failed one.
        let mut load = LoadTable::new(2);
        load.set(
            EndpointId(1 - busy),
            EndpointLoad {
                in_flight: 9,
                queued_prefill_tokens: 0,
            },
        );
        for failed in [Leg::Endpoint, Leg::Decode] {
            let mut d = rule.decide(&req, &inv, &load, &AlwaysAvailable, T0);
            let t = d.target().unwrap();
            let gone = match failed {
                Leg::Endpoint => t.endpoint,
                Leg::Decode => t.decode.unwrap(),
            };
            if let Some(t2) = rule.retry(&mut d, failed, &req, &load, &AlwaysAvailable, T0) {
                // A decode retry keeps the prefill leg that answered.
                if failed == Leg::Endpoint {
                    assert_ne!(t2.endpoint, gone, "{failed:?}: {t:?} -> {t2:?}");
                }
                assert_ne!(t2.decode, Some(gone), "{failed:?}: {t:?} -> {t2:?}");
            }
        }
    }
}

/// Every request shares block 1; the first request put it on EP0 only. Requests
/// never complete during the burst, so load only grows.
fn burst(scorer: ScorerRef) -> Vec<u32> {
    let c = ContractId::new("c");
    let mut cfg = converged(4, &c);
    cfg.scorer = scorer;
    let rule = Rule::new(cfg, None).unwrap();
    let mut inv = KeySetInventory::new(4);
    inv.store(0, [BlockKey(1)]);
    let mut load = LoadTable::new(4);
    for i in 0..200u64 {
        let keys = [BlockKey(1), BlockKey(1000 + i)];
        let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &AlwaysAvailable, T0);
        let ep = d.target().unwrap().endpoint;
        load.get_mut(ep).unwrap().in_flight += 1;
    }
    (0..4u32)
        .map(|i| load.load(EndpointId(i)).in_flight)
        .collect()
}

#[test]
fn load_aware_scorer_does_not_hot_spot_a_shared_block() {
    let argmax = burst(Arc::new(OverlapCountScorer));
    assert_eq!(
        argmax,
        vec![200, 0, 0, 0],
        "reference scorer piles everything on the holder"
    );
    let eps = 0.25;
    let balanced = burst(Arc::new(LoadAwareScorer(LoadAwareConfig {
        epsilon: eps,
        ..LoadAwareConfig::default()
    })));
    let total: u32 = balanced.iter().sum();
    let cap = ((1.0 + eps) * f64::from(total) / 4.0).ceil() as u32;
    assert!(
        balanced.iter().all(|l| *l <= cap),
        "{balanced:?} exceeds {cap}"
    );
    // Affinity still matters: the holder takes its full bounded share.
    assert_eq!(balanced[0], *balanced.iter().max().unwrap());
}

#[test]
fn load_aware_prefers_gpu_tier_and_short_queues() {
    struct Tiered;
    impl kvroute_ingest::InventoryView for Tiered {
        fn endpoint_count(&self) -> usize {
            2
        }
        fn score(&self, keys: &[BlockKey], out: &mut [kvroute_ingest::Overlap]) {
            let n = keys.len() as u32;
            out[0] = kvroute_ingest::Overlap {
                blocks: n,
                prefix: n,
                prefix_by_medium: [0, 0, n, 0],
            };
            out[1] = kvroute_ingest::Overlap {
                blocks: n,
                prefix: n,
                prefix_by_medium: [n, 0, 0, 0],
            };
        }
    }
    let c = ContractId::new("c");
    let mut cfg = converged(2, &c);
    cfg.scorer = Arc::new(LoadAwareScorer(LoadAwareConfig::default()));
    let rule = Rule::new(cfg, None).unwrap();
    let keys = [BlockKey(1), BlockKey(2)];
    let mut load = LoadTable::new(2);
    let d = rule.decide(&keys_req(&keys, &c), &Tiered, &load, &AlwaysAvailable, T0);
    assert_eq!(
        d.target().unwrap().endpoint,
        EndpointId(1),
        "GPU-resident beats disk-resident"
    );
    load.set(
        EndpointId(1),
        EndpointLoad {
            in_flight: 0,
            queued_prefill_tokens: 10_000,
        },
    );
    let d = rule.decide(&keys_req(&keys, &c), &Tiered, &load, &AlwaysAvailable, T0);
    assert_eq!(
        d.target().unwrap().endpoint,
        EndpointId(0),
        "a long queue outweighs the tier"
    );
}

#[test]
fn chwbl_is_sticky_per_key_and_bounded() {
    let c = ContractId::new("c");
    let mut cfg = converged(5, &c);
    cfg.choice = Choice::ContentAffinity;
    let rule = Rule::new(cfg, None).unwrap();
    let inv = KeySetInventory::new(5);
    let mut load = LoadTable::new(5);
    let tokens: Vec<u32> = (0..300).collect();
    let req = Request::new(PromptInput::Tokens(&tokens));
    let first = rule
        .decide(&req, &inv, &load, &AlwaysAvailable, T0)
        .target()
        .unwrap()
        .endpoint;
    for _ in 0..5 {
        let d = rule.decide(&req, &inv, &load, &AlwaysAvailable, T0);
        assert_eq!(d.target().unwrap().endpoint, first);
        assert_eq!(d.source(), Source::Fallback(SelectorKind::Chwbl));
    }
    // Different prompts spread over the ring.
    let spread: std::collections::HashSet<u32> = (0..64u32)
        .map(|s| {
            let t: Vec<u32> = (s * 1000..s * 1000 + 10).collect();
            rule.decide(
                &Request::new(PromptInput::Tokens(&t)),
                &inv,
                &load,
                &AlwaysAvailable,
                T0,
            )
            .target()
            .unwrap()
            .endpoint
            .0
        })
        .collect();
    assert!(spread.len() >= 3, "{spread:?}");
    // Overload the key's endpoint beyond c × mean: the key moves.
    load.set(
        first,
        EndpointLoad {
            in_flight: 10,
            queued_prefill_tokens: 0,
        },
    );
    let moved = rule
        .decide(&req, &inv, &load, &AlwaysAvailable, T0)
        .target()
        .unwrap()
        .endpoint;
    assert_ne!(moved, first);
}

#[test]
fn weighted_selector_never_picks_zero_weight_when_others_weigh() {
    let c = ContractId::new("c");
    let mut cfg = converged(3, &c);
    cfg.fallback = SelectorKind::Weighted;
    cfg.endpoints[1].weight = 0;
    cfg.endpoints[2].weight = 3;
    let rule = Rule::new(cfg, None).unwrap();
    let inv = KeySetInventory::new(3);
    let load = LoadTable::new(3);
    let mut counts = [0u32; 3];
    for _ in 0..400 {
        let d = rule.decide(
            &Request::new(PromptInput::Missing(MissReason::NoModel)),
            &inv,
            &load,
            &AlwaysAvailable,
            T0,
        );
        counts[d.target().unwrap().endpoint.index()] += 1;
    }
    assert_eq!(counts[1], 0);
    assert!(counts[2] > 2 * counts[0], "{counts:?}");
}

#[test]
fn receipts_give_accuracy_and_a_drift_alarm() {
    let c = ContractId::new("c");
    let mut cfg = converged(2, &c);
    cfg.thresholds.drift_alarm_after = 3;
    let rule = Rule::new(cfg, None).unwrap();
    let mut inv = KeySetInventory::new(2);
    inv.store(0, [BlockKey(1), BlockKey(2)]);
    let load = LoadTable::new(2);
    let keys = [BlockKey(1), BlockKey(2), BlockKey(3)];
    let d = rule.decide(&keys_req(&keys, &c), &inv, &load, &AlwaysAvailable, T0);
    assert_eq!(d.predicted_cached_tokens(16), 32);
    assert!(!rule.record_receipt(&d, 32));
    assert!(!rule.record_receipt(&d, 0));
    assert!(!rule.record_receipt(&d, 0));
    assert!(
        rule.record_receipt(&d, 0),
        "third zero in a row raises the alarm"
    );
    assert!(!rule.record_receipt(&d, 0), "raised once");
    assert!(rule.counters().drift_alarm(EndpointId(0)));
    let ev = rule.counters().snapshot().endpoints[0];
    assert_eq!(
        (ev.receipts, ev.predicted_tokens, ev.delivered_tokens),
        (5, 160, 32)
    );
    assert_eq!(ev.accuracy(), Some(0.2));
    rule.record_receipt(&d, 16);
    assert!(!rule.counters().drift_alarm(EndpointId(0)));
    assert_eq!(rule.counters().snapshot().drift_alarms_raised, 1);
}

#[test]
fn retries_are_bounded() {
    let c = ContractId::new("c");
    let mut cfg = converged(6, &c);
    cfg.thresholds.max_retries = 2;
    let rule = Rule::new(cfg, None).unwrap();
    let inv = KeySetInventory::new(6);
    let load = LoadTable::new(6);
    let req = Request::new(PromptInput::Missing(MissReason::NoModel));
    let mut d = rule.decide(&req, &inv, &load, &AlwaysAvailable, T0);
    let mut seen = vec![d.target().unwrap().endpoint];
    for _ in 0..2 {
        let t = rule
            .retry(&mut d, Leg::Endpoint, &req, &load, &AlwaysAvailable, T0)
            .unwrap();
        assert!(!seen.contains(&t.endpoint));
        seen.push(t.endpoint);
    }
    assert_eq!(
        rule.retry(&mut d, Leg::Endpoint, &req, &load, &AlwaysAvailable, T0),
        None
    );
    assert_eq!(d.source(), Source::Exhausted);
}

/// In P/D the approximate trie must not shadow an exact KV hit on
/// another prefill endpoint (default); the seed's order stays selectable.
#[test]
fn pd_exact_hit_beats_an_approximate_trie_match_by_default() {
    let c = ContractId::new("c");
    let text = "You are a helpful assistant. Answer briefly. Question: what is KV routing?";
    let keys = [BlockKey(31), BlockKey(32)];
    let run = |trie_before_kv: bool| {
        let mut cfg = pd(&c);
        cfg.affinity.trie_chunk_bytes = 8;
        cfg.affinity.trie_before_kv = trie_before_kv;
        let rule = Rule::new(cfg, None).unwrap();
        let mut inv = KeySetInventory::new(2);
        let load = LoadTable::new(4);
        // p1 prefilled this text once (no KV events yet: the trie learns it).
        let none: [BlockKey; 0] = [];
        let mut busy = LoadTable::new(4);
        busy.set(
            EndpointId(0),
            EndpointLoad {
                in_flight: 5,
                queued_prefill_tokens: 0,
            },
        );
        let d = rule.decide(
            &keys_req(&none, &c).with_text(text),
            &inv,
            &busy,
            &AlwaysAvailable,
            T0,
        );
        assert_eq!(d.target().unwrap().endpoint, EndpointId(2));
        // Now p0's engine reports it holds the prompt's blocks exactly.
        inv.store(0, keys);
        let d = rule.decide(
            &keys_req(&keys, &c).with_text(text),
            &inv,
            &load,
            &AlwaysAvailable,
            T0,
        );
        (
            d.source(),
            d.target().unwrap().endpoint,
            rule.counters().snapshot(),
        )
    };
    let (source, ep, snap) = run(false);
    assert_eq!((source, ep), (Source::KvExact, EndpointId(0)));
    assert_eq!(snap.hits_for(EndpointId(0)), 1);
    let (source, ep, _) = run(true);
    assert_eq!((source, ep), (Source::TrieAffinity, EndpointId(2)));
}
