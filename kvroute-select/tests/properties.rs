//! Property tests of the ladder's invariants against simple reference models.

use std::collections::HashSet;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use std::sync::Arc;

use kvroute_select::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random rules, inventories, loads, health and retry sequences: the chosen
    /// endpoint is never excluded / down / open; never a decode endpoint as
    /// prefill; KV winners are the argmax; the load cap holds; retries never
    /// return the failed endpoint. (The oracle lives in `fuzzing::check`.)
    #[test]
    fn ladder_invariants_hold(data in proptest::collection::vec(any::<u8>(), 0..96)) {
        kvroute_select::fuzzing::select_ladder(&data);
    }

    /// Overlap-count KV-exact equals a naive model: count set membership per
    /// endpoint, argmax over eligible, first endpoint on ties; and a fresh rule
    /// fed the same inputs decides the same (determinism).
    #[test]
    fn overlap_argmax_matches_reference_model(
        inventories in proptest::collection::vec(proptest::collection::hash_set(0u64..20, 0..12), 1..8),
        prompt in proptest::collection::vec(0u64..24, 1..12),
        down in proptest::collection::vec(any::<bool>(), 8),
    ) {
        let n = inventories.len();
        let c = ContractId::new("c");
        let eps = (0..n as u32).map(|i| Endpoint::new(format!("e{i}"), Role::Both).with_inventory_slot(i)).collect();
        let mut cfg = RuleConfig::kv_exact("p", Topology::Converged, eps, 16, c.clone());
        cfg.scorer = Arc::new(OverlapCountScorer);
        let mut inv = KeySetInventory::new(n);
        let mut health = HealthTable::new(n, BreakerConfig::default());
        for (i, set) in inventories.iter().enumerate() {
            inv.store(i, set.iter().map(|k| BlockKey(*k)));
            if down[i] {
                health.set_admin(EndpointId(i as u32), AdminState::Down);
            }
        }
        let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
        let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: 16 * keys.len() as u32 });
        let load = LoadTable::new(n);
        let now = Duration::ZERO;
        let rule_a = Rule::new(cfg.clone(), None).unwrap();
        let rule_b = Rule::new(cfg, None).unwrap();
        let d = rule_a.decide(&req, &inv, &load, &health, now);
        let d2 = rule_b.decide(&req, &inv, &load, &health, now);
        prop_assert_eq!(d.target(), d2.target());
        prop_assert_eq!(d.source(), d2.source());

        let model: Vec<u32> = inventories.iter().map(|s| prompt.iter().filter(|k| s.contains(k)).count() as u32).collect();
        let best = (0..n).filter(|i| !down[*i]).max_by(|a, b| model[*a].cmp(&model[*b]).then(b.cmp(a)));
        match best {
            Some(i) if model[i] > 0 => {
                prop_assert_eq!(d.source(), Source::KvExact);
                prop_assert_eq!(d.target().map(|t| t.endpoint), Some(EndpointId(i as u32)));
                prop_assert_eq!(d.predicted_blocks(), model[i]);
            }
            Some(_) => prop_assert!(matches!(d.miss(), Some(MissReason::ZeroOverlap | MissReason::AllCandidatesFiltered))),
            None => prop_assert_eq!(d.target(), None),
        }
    }

    /// A `Decision` reused through `decide_into` (and dirtied by a rule of
    /// another size in between) decides and retries exactly like a fresh
    /// `decide` on an identical rule, request after request.
    #[test]
    fn reused_decision_decides_like_a_fresh_one(
        inventories in proptest::collection::vec(proptest::collection::hash_set(0u64..16, 0..10), 2..7),
        prompts in proptest::collection::vec(proptest::collection::vec(0u64..20, 0..10), 1..12),
        pd in any::<bool>(),
        retries in 0usize..3,
    ) {
        let n = inventories.len();
        let c = ContractId::new("c");
        let role = |i: usize| match (pd, i % 2) {
            (false, _) => Role::Both,
            (true, 0) => Role::Prefill,
            (true, _) => Role::Decode,
        };
        let eps = (0..n).map(|i| Endpoint::new(format!("e{i}"), role(i)).with_inventory_slot(i as u32)).collect();
        let topology = if pd { Topology::PrefillDecode } else { Topology::Converged };
        let cfg = RuleConfig::kv_exact("p", topology, eps, 16, c.clone());
        let fresh_rule = Rule::new(cfg.clone(), None).unwrap();
        let reused_rule = Rule::new(cfg, None).unwrap();
        let other_eps = (0..n + 3).map(|i| Endpoint::new(format!("o{i}"), Role::Both).with_inventory_slot(i as u32)).collect();
        let other = Rule::new(RuleConfig::kv_exact("o", Topology::Converged, other_eps, 16, c.clone()), None).unwrap();
        let mut inv = KeySetInventory::new(n + 3);
        for (i, set) in inventories.iter().enumerate() {
            inv.store(i, set.iter().map(|k| BlockKey(*k)));
        }
        let load = LoadTable::new(n + 3);
        let now = Duration::ZERO;
        let mut reused = Decision::new();
        for prompt in &prompts {
            let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
            let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: 16 * keys.len() as u32 });
            other.decide_into(&mut reused, &req, &inv, &load, &AlwaysAvailable, now);
            let mut fresh = fresh_rule.decide(&req, &inv, &load, &AlwaysAvailable, now);
            reused_rule.decide_into(&mut reused, &req, &inv, &load, &AlwaysAvailable, now);
            for step in 0..=retries {
                prop_assert_eq!(fresh.target(), reused.target());
                prop_assert_eq!(fresh.source(), reused.source());
                prop_assert_eq!(fresh.miss(), reused.miss());
                prop_assert_eq!(fresh.predicted_blocks(), reused.predicted_blocks());
                prop_assert_eq!(fresh.keys(), reused.keys());
                prop_assert_eq!(fresh.overlaps(), reused.overlaps());
                prop_assert_eq!(fresh.retries(), reused.retries());
                if step < retries {
                    let leg = if step % 2 == 1 { Leg::Decode } else { Leg::Endpoint };
                    let a = fresh_rule.retry(&mut fresh, leg, &req, &load, &AlwaysAvailable, now);
                    let b = reused_rule.retry(&mut reused, leg, &req, &load, &AlwaysAvailable, now);
                    prop_assert_eq!(a, b);
                }
            }
        }
        prop_assert_eq!(fresh_rule.counters().snapshot().misses, reused_rule.counters().snapshot().misses);
    }

    /// Retrying until exhaustion visits every eligible endpoint exactly once and
    /// never an excluded one, in non-increasing overlap order after a KV pick.
    #[test]
    fn retries_walk_down_the_overlap_ranking(
        inventories in proptest::collection::vec(proptest::collection::hash_set(0u64..8, 0..8), 2..7),
    ) {
        let n = inventories.len();
        let c = ContractId::new("c");
        let eps = (0..n as u32).map(|i| Endpoint::new(format!("e{i}"), Role::Both).with_inventory_slot(i)).collect();
        let mut cfg = RuleConfig::kv_exact("p", Topology::Converged, eps, 16, c.clone());
        cfg.scorer = Arc::new(OverlapCountScorer);
        cfg.thresholds.max_retries = 100;
        let rule = Rule::new(cfg, None).unwrap();
        let mut inv = KeySetInventory::new(n);
        for (i, set) in inventories.iter().enumerate() {
            inv.store(i, set.iter().map(|k| BlockKey(*k)));
        }
        let keys: Vec<BlockKey> = (0..8).map(BlockKey).collect();
        let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: 128 });
        let load = LoadTable::new(n);
        let mut d = rule.decide(&req, &inv, &load, &AlwaysAvailable, Duration::ZERO);
        let kv = d.source() == Source::KvExact;
        let mut visited = HashSet::new();
        let mut last = u32::MAX;
        while let Some(t) = d.target() {
            prop_assert!(visited.insert(t.endpoint), "endpoint revisited");
            if kv {
                let o = d.overlaps()[t.endpoint.index()].blocks;
                prop_assert!(o <= last);
                last = o;
            }
            rule.retry(&mut d, Leg::Endpoint, &req, &load, &AlwaysAvailable, Duration::ZERO);
        }
        prop_assert_eq!(visited.len(), n);
    }

    /// The bounded map behind sessions never exceeds its capacity.
    #[test]
    fn session_memory_is_bounded(sessions in proptest::collection::vec(0u16..500, 1..300), cap in 1usize..32) {
        let c = ContractId::new("c");
        let eps = vec![Endpoint::new("p", Role::Prefill), Endpoint::new("d", Role::Decode)];
        let mut cfg = RuleConfig::kv_exact("p", Topology::PrefillDecode, eps, 16, c);
        cfg.affinity.session_capacity = cap;
        cfg.affinity.trie_capacity = cap;
        cfg.affinity.trie_chunk_bytes = 2;
        let rule = Rule::new(cfg, None).unwrap();
        let inv = KeySetInventory::new(0);
        let load = LoadTable::new(2);
        for (t, s) in sessions.iter().enumerate() {
            let id = format!("s{s}");
            let text = format!("{s:05}{s:05}{t}");
            let req = Request::new(PromptInput::Missing(MissBeforeKeys::NoModel)).with_session(&id).with_text(&text);
            let _ = rule.decide(&req, &inv, &load, &AlwaysAvailable, Duration::from_millis(t as u64));
            prop_assert!(rule.session_count() <= cap);
            prop_assert!(rule.trie_nodes() <= cap);
        }
    }
}
