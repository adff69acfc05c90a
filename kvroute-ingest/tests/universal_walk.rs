//! The prefix walk of pools whose banks are full of one shared root: the
//! walk starts each bank past the keys every endpoint of it holds (the
//! index's table of such keys, kept by its writers). Against a naive model
//! of every (endpoint, tier, key) store count, after every step of random
//! writes: whole banks storing a root, single endpoints removing, storing
//! again, storing twice and removing once, moving a key to another tier,
//! being cleared — over two or three banks, the last big enough to be
//! tracked or not, and any shard count.

use std::collections::BTreeMap;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex, UNIFORM_RUN};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Every endpoint stores keys `from..from + len` (GPU), as a chain or
    /// key by key.
    StoreAll { from: u64, len: u64, chain: bool },
    /// One endpoint stores keys in a tier.
    Store {
        ep: u32,
        tier: usize,
        from: u64,
        len: u64,
    },
    /// One endpoint removes keys from a tier.
    Remove {
        ep: u32,
        tier: usize,
        from: u64,
        len: u64,
    },
    /// One endpoint is cleared.
    Clear { ep: u32 },
}

fn op(n: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..4, 1u64..12, any::<bool>()).prop_map(|(from, len, chain)| Op::StoreAll { from, len, chain }),
        3 => (0..n, prop_oneof![4 => Just(0usize), 1 => 0usize..4], 0u64..12, 1u64..6)
            .prop_map(|(ep, tier, from, len)| Op::Store { ep, tier, from, len }),
        3 => (0..n, prop_oneof![4 => Just(0usize), 1 => 0usize..4], 0u64..12, 1u64..4)
            .prop_map(|(ep, tier, from, len)| Op::Remove { ep, tier, from, len }),
        1 => (0..n).prop_map(|ep| Op::Clear { ep }),
    ]
}

fn case() -> impl Strategy<Value = (u32, usize, Vec<Op>)> {
    // Two full banks and a third of 0–40 endpoints (tracked from 16 on).
    (128u32..168, prop_oneof![Just(1usize), Just(4), 1usize..300]).prop_flat_map(|(n, shards)| {
        (
            Just(n),
            Just(shards),
            proptest::collection::vec(op(n), 1..24),
        )
    })
}

fn keys(from: u64, len: u64) -> Vec<BlockKey> {
    (from..from + len)
        .map(|k| BlockKey(k * 0x9e37_79b9 + 1))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_walk_past_full_banks_equals_the_model((n, shards, ops) in case()) {
        let index = SharedIndex::new(n as usize, IndexConfig { shards, ..IndexConfig::default() });
        // (endpoint, tier, key) → stores not matched by a remove.
        let mut model: BTreeMap<(u32, usize, u64), u32> = BTreeMap::new();
        let prompt = keys(0, 16);
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::StoreAll { from, len, chain } => {
                    let ks = keys(*from, *len);
                    for ep in 0..n {
                        if *chain {
                            index.store_chain(EndpointId(ep), Medium::Gpu, None, &ks).unwrap();
                        } else {
                            index.store(EndpointId(ep), Medium::Gpu, &ks).unwrap();
                        }
                        for k in &ks {
                            *model.entry((ep, 0, k.0)).or_insert(0) += 1;
                        }
                    }
                }
                Op::Store { ep, tier, from, len } => {
                    let ks = keys(*from, *len);
                    index.store(EndpointId(*ep), Medium::ALL[*tier], &ks).unwrap();
                    for k in &ks {
                        *model.entry((*ep, *tier, k.0)).or_insert(0) += 1;
                    }
                }
                Op::Remove { ep, tier, from, len } => {
                    let ks = keys(*from, *len);
                    index.remove(EndpointId(*ep), Medium::ALL[*tier], &ks).unwrap();
                    for k in &ks {
                        if let Some(c) = model.get_mut(&(*ep, *tier, k.0)) {
                            *c -= 1;
                            if *c == 0 {
                                model.remove(&(*ep, *tier, k.0));
                            }
                        }
                    }
                }
                Op::Clear { ep } => {
                    index.clear_endpoint(EndpointId(*ep)).unwrap();
                    model.retain(|(e, _, _), _| e != ep);
                }
            }
            let mut out = vec![Overlap { blocks: 9, prefix: 9, prefix_by_medium: [9; 4] }; n as usize];
            index.score_prefix(&prompt, &mut out);
            // The same walk marking the banks it scored all alike: the same
            // overlaps, and a marked bank holds one value throughout.
            let mut marked = vec![Overlap { blocks: 7, prefix: 7, prefix_by_medium: [7; 4] }; n as usize];
            let mut uniform = vec![true; UNIFORM_RUN];
            index.score_prefix_uniform(&prompt, &mut marked, &mut uniform);
            prop_assert_eq!(&marked, &out);
            for (b, run) in out.chunks(UNIFORM_RUN).enumerate() {
                if uniform[b] {
                    prop_assert!(run.iter().all(|o| *o == run[0]), "step {}: bank {} marked uniform", step, b);
                }
            }
            prop_assert!(uniform[n.div_ceil(UNIFORM_RUN as u32) as usize..].iter().all(|u| !*u));
            for ep in 0..n {
                let mut want = [0u32; 4];
                for k in &prompt {
                    match (0..4).find(|t| model.contains_key(&(ep, *t, k.0))) {
                        Some(t) => want[t] += 1,
                        None => break,
                    }
                }
                let got = out[ep as usize];
                prop_assert_eq!(got.prefix_by_medium, want, "step {} ({:?}), endpoint {}", step, op, ep);
                prop_assert_eq!(got.prefix, want.iter().sum::<u32>());
            }
        }
    }
}

/// A 1 024-endpoint pool sharing a 32-block root, one endpoint holding the
/// whole prompt: every endpoint gets the root, the home the whole prompt;
/// an endpoint losing a root block, and one being cleared, read right.
#[test]
fn a_shared_root_over_sixteen_banks() {
    let n = 1024u32;
    let index = SharedIndex::new(n as usize, IndexConfig::default());
    let prompt = keys(0, 512);
    for ep in 0..n {
        let held = if ep == 700 { 512 } else { 32 };
        index
            .store_chain(EndpointId(ep), Medium::Gpu, None, &prompt[..held])
            .unwrap();
    }
    let mut out = vec![Overlap::default(); n as usize];
    let mut uniform = [false; 16];
    index.score_prefix_uniform(&prompt, &mut out, &mut uniform);
    for (ep, o) in out.iter().enumerate() {
        let want = if ep == 700 { 512 } else { 32 };
        assert_eq!(
            (o.prefix, o.prefix_by_medium[0]),
            (want, want),
            "endpoint {ep}"
        );
    }
    // Every bank but the home's scored its endpoints alike.
    let home = 700 / UNIFORM_RUN;
    for (b, u) in uniform.iter().enumerate() {
        assert_eq!(*u, b != home, "bank {b}");
    }
    index
        .remove(EndpointId(5), Medium::Gpu, &prompt[10..11])
        .unwrap();
    index.clear_endpoint(EndpointId(900)).unwrap();
    index.score_prefix(&prompt, &mut out);
    assert_eq!(out[5].prefix, 10);
    assert_eq!(out[900].prefix, 0);
    assert_eq!(out[6].prefix, 32);
    assert_eq!(out[700].prefix, 512);
    // Stored again, the root is whole once more.
    index
        .store(EndpointId(5), Medium::Gpu, &prompt[10..11])
        .unwrap();
    index
        .store_chain(EndpointId(900), Medium::Gpu, None, &prompt[..32])
        .unwrap();
    index.score_prefix(&prompt, &mut out);
    assert!(out.iter().all(|o| o.prefix >= 32));
}
