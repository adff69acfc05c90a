//! Model-based property tests: random op streams (stores, removes, moves, clears;
//! duplicate, gapped and regressed sequence numbers; reconnects, bootstraps,
//! replay ends; three endpoints over two index banks; several DP ranks) against
//! the naive reference model in `kvroute_ingest::fuzzing`, compared after every
//! step. Plus the capacity bound against a FIFO model.

use std::collections::VecDeque;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn random_streams_match_the_reference_model(data in proptest::collection::vec(any::<u8>(), 0..800)) {
        kvroute_ingest::fuzzing::seq_window(&data);
    }

    #[test]
    fn capacity_evicts_oldest_inserted_first(
        cap in 1usize..12,
        keys in proptest::collection::vec(0u64..40, 0..200),
    ) {
        let index = SharedIndex::new(2, IndexConfig { capacity_per_endpoint: cap, shards: 4 });
        let mut fifo: VecDeque<u64> = VecDeque::new();
        let mut evicted = 0u64;
        for k in &keys {
            index.store(EndpointId(1), Medium::Gpu, &[BlockKey(*k)]).unwrap();
            if !fifo.contains(k) {
                fifo.push_back(*k);
                if fifo.len() > cap {
                    fifo.pop_front();
                    evicted += 1;
                }
            }
            let mut want: Vec<BlockKey> = fifo.iter().map(|k| BlockKey(*k)).collect();
            want.sort_unstable();
            prop_assert_eq!(index.keys(EndpointId(1), Medium::Gpu), want);
            prop_assert!(index.keys(EndpointId(0), Medium::Gpu).is_empty());
        }
        prop_assert_eq!(index.inventory(EndpointId(1)).evictions, evicted);
    }

    #[test]
    fn clearing_one_endpoint_touches_no_other(
        a in proptest::collection::vec(0u64..64, 0..64),
        b in proptest::collection::vec(0u64..64, 0..64),
        endpoint_b in 1u32..130,
    ) {
        let index = SharedIndex::new(130, IndexConfig::default());
        let ka: Vec<BlockKey> = a.iter().map(|k| BlockKey(*k)).collect();
        let kb: Vec<BlockKey> = b.iter().map(|k| BlockKey(*k)).collect();
        index.store(EndpointId(0), Medium::Gpu, &ka).unwrap();
        index.store(EndpointId(endpoint_b), Medium::Cpu, &kb).unwrap();
        let mut before = vec![Overlap::default(); index.endpoint_count()];
        index.score(&kb, &mut before);
        index.clear_endpoint(EndpointId(0)).unwrap();
        let mut after = vec![Overlap::default(); index.endpoint_count()];
        index.score(&kb, &mut after);
        prop_assert_eq!(after[endpoint_b as usize], before[endpoint_b as usize]);
        prop_assert_eq!(after[0], Overlap::default());
        prop_assert!(index.keys(EndpointId(0), Medium::Gpu).is_empty());
    }

    #[test]
    fn long_prompts_score_like_a_naive_scan(
        stores in proptest::collection::vec((0u32..3, 0usize..3, proptest::collection::vec(0u64..90, 0..120)), 0..12),
        prompt in proptest::collection::vec(0u64..100, 0..700),
        shards in 1usize..300,
    ) {
        // Prompts longer than one shard-grouped chunk, endpoints in two banks,
        // keys shared by up to three endpoints and tiers, any shard count.
        let slots = [0u32, 5, 64];
        let index = SharedIndex::new(65, IndexConfig { shards, ..IndexConfig::default() });
        let mut held: std::collections::BTreeSet<(u32, usize, u64)> = Default::default();
        for (e, tier, keys) in &stores {
            let ep = slots[*e as usize];
            let ks: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
            index.store(EndpointId(ep), Medium::ALL[*tier], &ks).unwrap();
            held.extend(keys.iter().map(|k| (ep, *tier, *k)));
        }
        let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
        let mut out = vec![Overlap::default(); 65];
        index.score(&keys, &mut out);
        for (ep, got) in out.iter().enumerate() {
            let ep = ep as u32;
            let mut want = Overlap::default();
            let mut in_prefix = true;
            for k in &prompt {
                let fastest = (0..4).find(|t| held.contains(&(ep, *t, *k)));
                want.blocks += u32::from(fastest.is_some());
                match (in_prefix, fastest) {
                    (true, Some(t)) => {
                        want.prefix += 1;
                        want.prefix_by_medium[t] += 1;
                    }
                    _ => in_prefix = false,
                }
            }
            prop_assert_eq!(*got, want, "endpoint {}", ep);
        }
    }
}
