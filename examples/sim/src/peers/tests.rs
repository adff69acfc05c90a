use super::dynamo::sample_index;
use super::smg::tree_depth;
use super::*;
use crate::trace::block_keys;
use proptest::prelude::*;

/// One key per id: the simulator's real key derivation with 512-token
/// blocks, so `ids` sharing a prefix share exactly those keys.
fn keys(ids: &[u64]) -> Vec<BlockKey> {
    let mut out = Vec::new();
    let tokens = u32::try_from(ids.len() * 512).unwrap_or(u32::MAX);
    block_keys(ids, tokens, 512, &mut out);
    assert_eq!(out.len(), ids.len());
    out
}

/// Chained keys for `n` blocks of 16 tokens (ids offset by `base`).
fn prompt(base: u64, n: u64) -> Vec<BlockKey> {
    keys(&(base..base + n).collect::<Vec<_>>())
}

fn req(keys: &[BlockKey], block_size: u32) -> PeerRequest<'_> {
    PeerRequest {
        keys,
        prompt_tokens: u32::try_from(keys.len()).unwrap_or(0) * block_size,
        block_size,
    }
}

fn counts(policy: &mut dyn PeerPolicy, r: &PeerRequest<'_>, w: &[WorkerView]) -> Vec<u32> {
    let mut c = vec![0; w.len()];
    for t in 0..600 {
        c[policy.pick(r, w, t)] += 1;
    }
    c
}

// --- Dynamo ---

#[test]
fn dynamo_reproduces_the_documented_example() {
    // Dynamo's docs: worker 1 = 8 prefill + 10 decode = 18, worker 2 =
    // 5 + 5 = 10 (chosen), worker 3 = 2 + 9 = 11.
    let k = prompt(1, 10);
    let r = req(&k, 16);
    let workers = [
        WorkerView {
            prefix_blocks: 2,
            ..WorkerView::default()
        },
        WorkerView {
            prefix_blocks: 5,
            active_prefix_blocks: 5,
            ..WorkerView::default()
        },
        WorkerView {
            prefix_blocks: 8,
            active_prefix_blocks: 8,
            active_blocks: 7,
            ..WorkerView::default()
        },
    ];
    let mut d = DynamoCost::new(3, 1);
    let mut c = Vec::new();
    d.costs(&r, &workers, &mut c);
    assert_eq!(c, vec![18.0, 10.0, 11.0]);
    assert_eq!(d.pick(&r, &workers, 0), 1);
}

#[test]
fn dynamo_charges_queued_prefill_and_the_weights() {
    // 160-token prompt, 10 blocks of 16. Worker 0 holds 6 blocks but has
    // 320 tokens (20 blocks) of prefill queued; worker 1 holds nothing.
    let k = prompt(100, 10);
    let r = req(&k, 16);
    let workers = [
        WorkerView {
            prefix_blocks: 6,
            queued_prefill_tokens: 320,
            active_blocks: 4,
            in_flight: 2,
            ..WorkerView::default()
        },
        WorkerView {
            active_blocks: 4,
            in_flight: 1,
            ..WorkerView::default()
        },
    ];
    let mut c = Vec::new();
    // (320 + 160) / 16 − 6 = 24 prefill, 4 + 10 decode.
    DynamoCost::new(2, 0).costs(&r, &workers, &mut c);
    assert_eq!(c, vec![38.0, 24.0]);
    // prefill_load_scale 2 doubles only the prefill term.
    DynamoCost::new(2, 0)
        .with_prefill_load_scale(2.0)
        .costs(&r, &workers, &mut c);
    assert_eq!(c, vec![62.0, 34.0]);
    // Half credit: 30 − 3 = 27 prefill.
    DynamoCost::new(2, 0)
        .with_overlap_score_credit(0.5)
        .costs(&r, &workers, &mut c);
    assert_eq!(c, vec![41.0, 24.0]);
    // overlap_score_weight 0 ignores the cache and the prefill load.
    DynamoCost::new(2, 0)
        .with_overlap_score_weight(0.0)
        .costs(&r, &workers, &mut c);
    assert_eq!(c, vec![14.0, 14.0]);
    // 3 blocks per request in flight.
    DynamoCost::new(2, 0)
        .with_decode_active_request_weight(3.0)
        .costs(&r, &workers, &mut c);
    assert_eq!(c, vec![44.0, 27.0]);
    // Decay 1: worker 0 is 20 blocks above the least loaded, the
    // request is 10 blocks, so credit × 1 / (1 + 2) = 2 blocks.
    DynamoCost::new(2, 0)
        .with_overlap_score_credit_decay(1.0)
        .costs(&r, &workers, &mut c);
    assert_eq!(c, vec![42.0, 24.0]);
}

#[test]
fn dynamo_prefill_term_never_goes_negative() {
    let k = prompt(7, 4);
    let r = PeerRequest {
        keys: &k,
        prompt_tokens: 40, // shorter than the 4 keyed blocks claim
        block_size: 16,
    };
    let w = [WorkerView {
        prefix_blocks: 4,
        active_prefix_blocks: 4,
        ..WorkerView::default()
    }];
    let mut c = Vec::new();
    DynamoCost::new(1, 0).costs(&r, &w, &mut c);
    assert_eq!(c, vec![0.0]);
}

#[test]
fn dynamo_breaks_ties_at_random_and_per_seed() {
    let k = prompt(1, 4);
    let r = req(&k, 16);
    let w = [WorkerView::default(); 4];
    let c = counts(&mut DynamoCost::new(4, 9), &r, &w);
    // 600 picks over 4 equal workers: each near 150, none starved.
    assert!(c.iter().all(|&n| (100..200).contains(&n)), "{c:?}");
    let seq = |seed| {
        let mut d = DynamoCost::new(4, seed);
        (0..64).map(|t| d.pick(&r, &w, t)).collect::<Vec<_>>()
    };
    assert_eq!(seq(5), seq(5));
    assert_ne!(seq(5), seq(6));
}

#[test]
fn dynamo_softmax_matches_hand_computed_probabilities() {
    let mut p = Vec::new();
    softmax_probabilities(&[10.0, 20.0], 1.0, &mut p);
    let e = (-1.0f64).exp();
    assert!((p[0] - 1.0 / (1.0 + e)).abs() < 1e-12);
    assert!((p[1] - e / (1.0 + e)).abs() < 1e-12);
    softmax_probabilities(&[3.0, 3.0, 3.0], 0.5, &mut p);
    assert_eq!(p, vec![1.0 / 3.0; 3]);
    assert_eq!(sample_index(&[0.25, 0.75], 0.25), 0);
    assert_eq!(sample_index(&[0.25, 0.75], 0.2501), 1);
    assert_eq!(sample_index(&[0.25, 0.7], 0.99), 1);
}

#[test]
fn dynamo_temperature_spreads_picks_over_costlier_workers() {
    let k = prompt(1, 8);
    let r = req(&k, 16);
    let w = [
        WorkerView {
            prefix_blocks: 8,
            ..WorkerView::default()
        },
        WorkerView::default(),
    ];
    let greedy = counts(&mut DynamoCost::new(2, 3), &r, &w);
    assert_eq!(greedy, vec![600, 0]);
    // Costs 8 and 16: p1 = e^-1 / (1 + e^-1) ≈ 0.27 at T = 1.
    let warm = counts(
        &mut DynamoCost::new(2, 3).with_router_temperature(1.0),
        &r,
        &w,
    );
    assert!((110..220).contains(&warm[1]), "{warm:?}");
}

// --- SMG ---

fn idle(n: usize) -> Vec<WorkerView> {
    vec![WorkerView::default(); n]
}

#[test]
fn smg_follows_its_tree_then_least_load() {
    let a = prompt(1, 10);
    let b = prompt(50, 10);
    let w = idle(3);
    let mut s = SmgCacheAware::new(3, 0);
    // Empty tree: least loaded, ties by routed count then index.
    assert_eq!(s.pick(&req(&a, 16), &w, 0), 0);
    // Same prompt: full match on worker 0.
    assert_eq!(s.pick(&req(&a, 16), &w, 1), 0);
    // New prompt: no match, worker 0 has routed 2 → worker 1.
    assert_eq!(s.pick(&req(&b, 16), &w, 2), 1);
    assert_eq!(s.pick(&req(&b, 16), &w, 3), 1);
    // A third prompt goes to worker 2 (routed 0).
    assert_eq!(s.pick(&req(&prompt(90, 3), 16), &w, 4), 2);
    assert_eq!(s.tree_blocks(0), 10);
    assert_eq!(s.tree_blocks(1), 10);
    assert_eq!(s.tree_blocks(2), 3);
}

#[test]
fn smg_match_must_exceed_the_threshold() {
    // Worker 0's tree holds the first 3 of 10 blocks: rate 0.3, not > 0.3.
    let full = prompt(1, 10);
    let mut s = SmgCacheAware::new(2, 0);
    let w = idle(2);
    assert_eq!(s.pick(&req(&full[..3], 16), &w, 0), 0);
    // Worker 0 routed 1, so least load is worker 1.
    assert_eq!(s.pick(&req(&full, 16), &w, 1), 1);
    // With 4 of the 10 blocks in worker 0's tree the rate is 0.4.
    let mut s = SmgCacheAware::new(2, 0);
    assert_eq!(s.pick(&req(&full[..4], 16), &w, 0), 0);
    // 0.4 > 0.3: worker 0 again, although it routed more.
    assert_eq!(s.pick(&req(&full, 16), &w, 1), 0);
}

#[test]
fn smg_switches_to_least_load_when_imbalanced() {
    let a = prompt(1, 10);
    let mut s = SmgCacheAware::new(2, 0);
    assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
    let load = |x: u32, y: u32| {
        [
            WorkerView {
                in_flight: x,
                ..WorkerView::default()
            },
            WorkerView {
                in_flight: y,
                ..WorkerView::default()
            },
        ]
    };
    // Spread 90 > 64 and 100 > 10 × 1.5: imbalanced → worker 1.
    assert_eq!(s.pick(&req(&a, 16), &load(100, 10), 1), 1);
    // Both workers now hold it; ties on depth go to the latest insert (1).
    // Spread exactly 64 is balanced: the cache decides, not the least
    // loaded (worker 0).
    assert_eq!(s.pick(&req(&a, 16), &load(10, 74), 2), 1);
    // Spread 65 > 64 but 265 < 200 × 1.5: balanced; worker 1 still latest.
    assert_eq!(s.pick(&req(&a, 16), &load(200, 265), 3), 1);
    // Spread 65 > 64 and 165 > 100 × 1.5: imbalanced → worker 0.
    assert_eq!(s.pick(&req(&a, 16), &load(100, 165), 4), 0);
}

#[test]
fn smg_kv_usage_triggers_are_off_by_default_and_work_when_set() {
    let a = prompt(1, 10);
    let hot = [
        WorkerView {
            kv_usage: 0.95,
            ..WorkerView::default()
        },
        WorkerView {
            kv_usage: 0.1,
            in_flight: 3,
            ..WorkerView::default()
        },
    ];
    let mut s = SmgCacheAware::new(2, 0);
    assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
    assert_eq!(s.pick(&req(&a, 16), &hot, 1), 0);
    let mut s = SmgCacheAware::new(2, 0).with_balance_token_usage_threshold(0.5);
    assert_eq!(s.pick(&req(&a, 16), &idle(2), 0), 0);
    // Spread 0.85 > 0.5 → least in flight: worker 1 (3 < 5), not the
    // cache owner.
    let hot_busy = [
        WorkerView {
            in_flight: 5,
            ..hot[0]
        },
        hot[1],
    ];
    assert_eq!(s.pick(&req(&a, 16), &hot_busy, 1), 1);
}

#[test]
fn smg_eviction_keeps_each_tree_within_its_bound_lru_first() {
    // Bound 10 blocks of 16 tokens, evicting every second; one worker.
    let mut s = SmgCacheAware::new(1, 0)
        .with_max_tree_tokens(160)
        .with_eviction_interval_us(1_000_000);
    let w = idle(1);
    let prompts: Vec<_> = (0..5).map(|i| prompt(1000 * (i + 1), 4)).collect();
    for (t, p) in prompts.iter().enumerate() {
        s.pick(&req(p, 16), &w, t as u64);
    }
    assert_eq!(s.tree_blocks(0), 20);
    assert_eq!(s.evictions(), 0);
    // Due at 1 s: the pick at 1 s evicts first, then inserts its prompt.
    let latest = prompt(9000, 2);
    s.pick(&req(&latest, 16), &w, 1_000_000);
    assert_eq!(s.evictions(), 1);
    assert_eq!(s.tree_blocks(0), 12);
    // Least recently used first, leaf first: prompts 0 and 1 went, then
    // the last two blocks of prompt 2; prompts 3 and 4 are whole.
    let depth = |p: &[BlockKey]| s.longest_match(p, 1).0;
    assert_eq!(depth(&prompts[4]), 4);
    assert_eq!(depth(&prompts[3]), 4);
    assert_eq!(depth(&prompts[2]), 2);
    assert_eq!(depth(&prompts[1]), 0);
    assert_eq!(depth(&prompts[0]), 0);
}

#[test]
fn smg_evicts_leaves_before_their_shared_prefix() {
    // Three prompts share a 3-block system prefix; bound 5 blocks.
    let mut s = SmgCacheAware::new(1, 0)
        .with_max_tree_tokens(5 * 16)
        .with_eviction_interval_us(10);
    let w = idle(1);
    let p1 = keys(&[1, 2, 3, 10, 11]);
    let p2 = keys(&[1, 2, 3, 20, 21]);
    let p3 = keys(&[1, 2, 3, 30]);
    for (t, p) in [&p1, &p2, &p3].into_iter().enumerate() {
        s.pick(&req(p, 512), &w, t as u64);
    }
    assert_eq!(s.tree_blocks(0), 8);
    s.evict(6);
    // p1's two-block tail (least recent) goes; the shared prefix stays.
    assert_eq!(s.tree_blocks(0), 6);
    assert_eq!(s.longest_match(&p1, 1).0, 3);
    s.evict(4);
    assert_eq!(s.tree_blocks(0), 4);
    assert_eq!(s.longest_match(&p3, 1).0, 4);
    assert_eq!(s.longest_match(&p2, 1).0, 3);
}

#[test]
fn smg_is_deterministic() {
    let run = |seed| {
        let mut s = SmgCacheAware::new(4, seed);
        let w = idle(4);
        (0..40u64)
            .map(|i| s.pick(&req(&prompt(i % 7, 6), 16), &w, i))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(2));
}

proptest! {
    /// The tree's match equals a reference: the longest common prefix of
    /// the prompt with any prompt inserted on that worker (no eviction).
    #[test]
    fn smg_tree_matches_reference(
        inserts in proptest::collection::vec(
            (0usize..3, proptest::collection::vec(0u64..3, 0..6)),
            0..30,
        ),
        probe in proptest::collection::vec(0u64..3, 0..6),
    ) {
        let mut s = SmgCacheAware::new(3, 0).with_eviction_interval_us(0);
        let mut reference: Vec<Vec<Vec<u64>>> = vec![Vec::new(); 3];
        for (w, ids) in &inserts {
            s.insert(*w, &keys(ids));
            reference[*w].push(ids.clone());
        }
        let pk = keys(&probe);
        let mut deepest = 0;
        for (tree, seqs) in s.trees.iter().zip(&reference) {
            let mut distinct = std::collections::HashSet::new();
            for ids in seqs {
                for n in 1..=ids.len() {
                    distinct.insert(ids[..n].to_vec());
                }
            }
            prop_assert_eq!(tree.len(), distinct.len());
            let want = seqs
                .iter()
                .map(|ids| ids.iter().zip(&probe).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0);
            prop_assert_eq!(tree_depth(tree, &pk).0, want);
            deepest = deepest.max(want);
        }
        let (m, owner) = s.longest_match(&pk, 3);
        prop_assert_eq!(m, deepest);
        prop_assert_eq!(owner.is_some(), deepest > 0);
        if let Some(w) = owner {
            prop_assert_eq!(tree_depth(&s.trees[w], &pk).0, deepest);
        }
    }

    /// Eviction never leaves a tree above its bound and never orphans a
    /// node (every parent of a kept node is kept).
    #[test]
    fn smg_eviction_bound_holds(
        inserts in proptest::collection::vec(proptest::collection::vec(0u64..4, 1..8), 1..40),
        bound in 1usize..12,
    ) {
        let mut s = SmgCacheAware::new(1, 0);
        for ids in &inserts {
            s.insert(0, &keys(ids));
        }
        s.evict(bound);
        prop_assert!(s.tree_blocks(0) <= bound);
        for node in s.trees[0].values() {
            if let Some(p) = node.parent {
                prop_assert!(s.trees[0].contains_key(&p));
            }
        }
        let leaves_ok = s.trees[0].iter().all(|(k, n)| {
            let kids = s.trees[0].values().filter(|c| c.parent == Some(*k)).count();
            kids == n.children as usize
        });
        prop_assert!(leaves_ok);
    }

    /// Every policy returns a valid index for any views.
    #[test]
    fn picks_are_always_valid(
        views in proptest::collection::vec(
            (0u32..20, 0u32..200, 0u32..50, 0u64..5000, 0u64..500, 0.0f64..=1.0),
            1..9,
        ),
        ids in proptest::collection::vec(0u64..5, 0..12),
        temperature in 0.0f64..2.0,
        seed in 0u64..1000,
    ) {
        let w: Vec<WorkerView> = views
            .iter()
            .map(|&(p, f, q, t, a, u)| WorkerView {
                prefix_blocks: p,
                active_prefix_blocks: p / 2,
                in_flight: f,
                waiting: q,
                queued_prefill_tokens: t,
                active_blocks: a,
                kv_usage: u,
                capacity_blocks: 1000,
            })
            .collect();
        let k = keys(&ids);
        let r = req(&k, 16);
        let mut policies: Vec<Box<dyn PeerPolicy>> = vec![
            Box::new(DynamoCost::new(w.len(), seed).with_router_temperature(temperature)),
            Box::new(SmgCacheAware::new(w.len(), seed)),
            Box::new(LlmdWeighted::new(w.len(), seed)),
        ];
        for p in &mut policies {
            for t in 0..5 {
                prop_assert!(p.pick(&r, &w, t) < w.len());
            }
        }
    }
}

// --- llm-d ---

#[test]
fn llmd_scores_match_hand_computation() {
    let k = prompt(1, 10);
    let r = req(&k, 16);
    let w = [
        WorkerView {
            prefix_blocks: 10,
            waiting: 4,
            kv_usage: 0.9,
            ..WorkerView::default()
        },
        WorkerView {
            prefix_blocks: 5,
            waiting: 0,
            kv_usage: 0.5,
            ..WorkerView::default()
        },
        WorkerView {
            prefix_blocks: 0,
            waiting: 2,
            kv_usage: 0.25,
            ..WorkerView::default()
        },
    ];
    let mut l = LlmdWeighted::new(3, 0);
    let mut s = Vec::new();
    l.scores(&r, &w, &mut s);
    // 2·1 + 0 + 0.1; 2·0.5 + 1 + 0.5; 0 + 0.5 + 0.75.
    let want = [2.1, 2.5, 1.25];
    for (g, e) in s.iter().zip(want) {
        assert!((g - e).abs() < 1e-12, "{s:?}");
    }
    assert_eq!(l.pick(&r, &w, 0), 1);
    // Weights 3 / 2 / 2: 3 + 0 + 0.2; 1.5 + 2 + 1; 0 + 1 + 1.5.
    let l = LlmdWeighted::new(3, 0).with_weights(3.0, 2.0, 2.0);
    l.scores(&r, &w, &mut s);
    for (g, e) in s.iter().zip([3.2, 4.5, 2.5]) {
        assert!((g - e).abs() < 1e-12, "{s:?}");
    }
    // Prefix alone decides when the others weigh nothing.
    let mut l = LlmdWeighted::new(3, 0)
        .with_queue_weight(0.0)
        .with_kv_cache_weight(0.0);
    assert_eq!(l.pick(&r, &w, 0), 0);
    let mut l = LlmdWeighted::new(3, 0).with_prefix_weight(0.0);
    assert_eq!(l.pick(&r, &w, 0), 1);
}

#[test]
fn llmd_equal_queues_and_empty_prompts_are_neutral() {
    let r = req(&[], 16);
    let w = [
        WorkerView {
            prefix_blocks: 3,
            waiting: 7,
            kv_usage: 0.5,
            ..WorkerView::default()
        },
        WorkerView {
            waiting: 7,
            kv_usage: 0.5,
            ..WorkerView::default()
        },
    ];
    let mut s = Vec::new();
    LlmdWeighted::new(2, 0).scores(&r, &w, &mut s);
    assert_eq!(s, vec![1.5, 1.5]);
}

#[test]
fn llmd_breaks_ties_at_random_and_per_seed() {
    let k = prompt(1, 4);
    let r = req(&k, 16);
    let w = [WorkerView::default(); 3];
    let c = counts(&mut LlmdWeighted::new(3, 4), &r, &w);
    assert!(c.iter().all(|&n| (140..260).contains(&n)), "{c:?}");
    let seq = |seed| {
        let mut l = LlmdWeighted::new(3, seed);
        (0..64).map(|t| l.pick(&r, &w, t)).collect::<Vec<_>>()
    };
    assert_eq!(seq(8), seq(8));
    assert_ne!(seq(8), seq(9));
}

#[test]
fn names_are_the_report_names() {
    assert_eq!(DynamoCost::new(1, 0).name(), "dynamo-cost");
    assert_eq!(SmgCacheAware::new(1, 0).name(), "smg-cache-aware");
    assert_eq!(LlmdWeighted::new(1, 0).name(), "llmd-weighted");
}

/// Through a real rule: a worker whose request in flight holds the whole
/// prompt (cached there too) wins over an idle worker with nothing cached —
/// its blocks are already active, so the request adds none — and the pick is
/// staged for the host to commit. Charging the prompt's blocks again (no
/// dedup) ties the two.
#[test]
fn the_dynamo_scorer_dedups_against_its_active_sequences_and_stages_picks() {
    use kvroute_select::{
        AlwaysAvailable, ContractId, Endpoint, KeySetInventory, LoadTable, PromptInput, Request,
        Role, Rule, RuleConfig, Topology,
    };
    use std::time::Duration;
    let k = prompt(1, 8);
    let contract = ContractId::new("sim/bs16");
    let endpoints = (0..2)
        .map(|i| Endpoint::new(format!("10.0.0.{i}:8000"), Role::Both).with_inventory_slot(i))
        .collect();
    let active = Arc::new(Mutex::new(ActiveSequences::new(2)));
    let mut cfg = RuleConfig::kv_exact("d", Topology::Converged, endpoints, 16, contract.clone());
    cfg.scorer = Arc::new(PeerScorer::dynamo(2, 7, Arc::clone(&active)));
    cfg.predicted.capacity = 0;
    let rule = Rule::new(cfg, None).unwrap();
    let mut inv = KeySetInventory::new(2);
    inv.store(0, k.iter().copied());
    // Worker 0 runs a request of the same prompt.
    active.lock().unwrap().stage(0, &k);
    assert!(active.lock().unwrap().commit(1));
    let load = LoadTable::new(2);
    for round in 0..20 {
        let r = Request::new(PromptInput::Keys {
            keys: &k,
            contract: &contract,
            prompt_tokens: 8 * 16,
        });
        let d = rule.decide(&r, &inv, &load, &AlwaysAvailable, Duration::ZERO);
        assert_eq!(
            d.target().map(|t| t.endpoint.index()),
            Some(0),
            "round {round}"
        );
        // Staged, not counted until committed.
        assert_eq!(active.lock().unwrap().active_blocks(0), 8);
        active.lock().unwrap().discard();
    }
    // Freed: nothing active; the same decision staged and committed counts.
    active.lock().unwrap().free(1);
    assert_eq!(active.lock().unwrap().active_blocks(0), 0);
}
