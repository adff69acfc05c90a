//! The early-stopping prefix walk (`InventoryView::score_prefix`) against the
//! full walk (`score`) and a naive per-endpoint scan, on random inventories:
//! prefixes that end inside and across the walk's growing chunks (1, 4, 16, 64,
//! 256 keys), holes, keys in several tiers, endpoints in three banks, any shard
//! count, and an endpoint hidden mid-clear.

use std::collections::BTreeSet;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
use proptest::prelude::*;

/// One endpoint's inventory: the prompt's keys `0..len` except `holes`, each in
/// a tier chosen by `tiers` (cycled), plus `extra` keys anywhere.
#[derive(Clone, Debug)]
struct Inventory {
    endpoint: u32,
    len: u64,
    holes: Vec<u64>,
    tiers: Vec<usize>,
    extra: Vec<u64>,
}

fn inventory() -> impl Strategy<Value = Inventory> {
    (
        0u32..140,
        prop_oneof![0u64..8, 0u64..90, 0u64..700],
        proptest::collection::vec(0u64..700, 0..3),
        proptest::collection::vec(prop_oneof![4 => Just(0usize), 1 => 0usize..4], 1..6),
        proptest::collection::vec(0u64..800, 0..40),
    )
        .prop_map(|(endpoint, len, holes, tiers, extra)| Inventory {
            endpoint,
            len,
            holes,
            tiers,
            extra,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn early_stop_prefix_equals_the_full_walk(
        inventories in proptest::collection::vec(inventory(), 0..10),
        prompt_len in prop_oneof![0usize..6, 0usize..100, 0usize..720],
        // A key nobody holds spliced into the prompt (or none).
        foreign_at in proptest::option::of(0usize..720),
        shards in 1usize..300,
        hide in proptest::option::of(0u32..140),
    ) {
        let index = SharedIndex::new(140, IndexConfig { shards, ..IndexConfig::default() });
        let mut held: BTreeSet<(u32, usize, u64)> = BTreeSet::new();
        for inv in &inventories {
            for k in 0..inv.len {
                if inv.holes.contains(&k) {
                    continue;
                }
                let tier = inv.tiers[(k as usize) % inv.tiers.len()];
                index.store(EndpointId(inv.endpoint), Medium::ALL[tier], &[BlockKey(k)]).unwrap();
                held.insert((inv.endpoint, tier, k));
            }
            for k in &inv.extra {
                index.store(EndpointId(inv.endpoint), Medium::Gpu, &[BlockKey(*k)]).unwrap();
                held.insert((inv.endpoint, 0, *k));
            }
        }
        if let Some(e) = hide {
            // A cleared endpoint must read as empty on both walks.
            index.clear_endpoint(EndpointId(e)).unwrap();
            held.retain(|(ep, _, _)| *ep != e);
        }
        let mut prompt: Vec<u64> = (0..prompt_len as u64).collect();
        if let Some(at) = foreign_at.filter(|at| *at <= prompt.len()) {
            prompt.insert(at, u64::MAX - 1);
        }
        let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();

        let mut full = vec![Overlap::default(); 140];
        index.score(&keys, &mut full);
        // Stale values must be overwritten, never merged.
        let mut early = vec![Overlap { blocks: 9, prefix: 9, prefix_by_medium: [9; 4] }; 140];
        index.score_prefix(&keys, &mut early);

        for ep in 0..140u32 {
            let (f, p) = (full[ep as usize], early[ep as usize]);
            prop_assert_eq!(p.prefix, f.prefix, "endpoint {}", ep);
            prop_assert_eq!(p.prefix_by_medium, f.prefix_by_medium, "endpoint {}", ep);
            prop_assert!(p.prefix <= p.blocks && p.blocks <= f.blocks, "endpoint {}: {:?} vs {:?}", ep, p, f);

            // And against the naive scan: the run of held keys from block 0,
            // each counted in the fastest tier holding it.
            let mut want = [0u32; 4];
            for k in &prompt {
                match (0..4).find(|t| held.contains(&(ep, *t, *k))) {
                    Some(t) => want[t] += 1,
                    None => break,
                }
            }
            prop_assert_eq!(p.prefix_by_medium, want, "endpoint {}", ep);
            prop_assert_eq!(p.prefix, want.iter().sum::<u32>());
        }
    }
}

/// Entries beyond `endpoint_count()` are left untouched, as `score` does.
#[test]
fn extra_output_entries_are_left_alone() {
    let index = SharedIndex::new(2, IndexConfig::default());
    index
        .store(EndpointId(1), Medium::Gpu, &[BlockKey(1), BlockKey(2)])
        .unwrap();
    let marker = Overlap {
        blocks: 7,
        prefix: 7,
        prefix_by_medium: [7; 4],
    };
    let mut out = [marker; 3];
    index.score_prefix(&[BlockKey(1), BlockKey(2), BlockKey(3)], &mut out);
    assert_eq!(out[0], Overlap::default());
    assert_eq!((out[1].prefix, out[1].prefix_by_medium[0]), (2, 2));
    assert_eq!(out[2], marker);
}
