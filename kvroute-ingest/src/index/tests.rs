//! `store_chain` into a bounded tier against `store` of the same keys: the
//! inventory, its eviction order and the counters must not depend on which
//! path (grouped under several shard locks, or key by key) a call took. And
//! the insertion ring's 4-byte fingerprints: keys crafted to share one keep
//! the counters exact and the bound held.

use kvroute_core::mix::fmix64 as mix;
use kvroute_core::{BlockKey, EndpointId, Medium};
use proptest::prelude::*;

use super::shard::{entry_hash, key_with_hash};
use super::{IndexConfig, SharedIndex, WriteStats};

#[derive(Clone, Debug)]
enum Op {
    /// Keys `from..from + len` of the endpoint's chain, as one event.
    Store {
        ep: u32,
        from: u64,
        len: u64,
    },
    Remove {
        ep: u32,
        key: u64,
    },
    Clear {
        ep: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..3, 0u64..120, 1u64..48).prop_map(|(ep, from, len)| Op::Store { ep, from, len }),
        2 => (0u32..3, 0u64..160).prop_map(|(ep, key)| Op::Remove { ep, key }),
        1 => (0u32..3).prop_map(|ep| Op::Clear { ep }),
    ]
}

/// Chain keys of endpoint `ep` (a few shared between endpoints, so
/// duplicates and second holders occur).
fn key(ep: u32, i: u64) -> u64 {
    let owner = if i.is_multiple_of(7) {
        9
    } else {
        u64::from(ep)
    };
    mix(owner << 32 | i) | 1
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bounded_store_chain_equals_store(
        ops in proptest::collection::vec(op(), 1..80),
        capacity in 1usize..200,
        shards in prop_oneof![Just(1usize), 2usize..70],
    ) {
        let config = IndexConfig { capacity_per_endpoint: capacity, shards };
        let (chained, plain) = (SharedIndex::new(3, config.clone()), SharedIndex::new(3, config));
        for op in &ops {
            let (a, b): (WriteStats, WriteStats) = match *op {
                Op::Store { ep, from, len } => {
                    let keys: Vec<BlockKey> = (from..from + len).map(|i| BlockKey(key(ep, i))).collect();
                    let parent = from.checked_sub(1).map(|p| BlockKey(key(ep, p)));
                    (
                        chained.store_chain(EndpointId(ep), Medium::Gpu, parent, &keys).unwrap(),
                        plain.store(EndpointId(ep), Medium::Gpu, &keys).unwrap(),
                    )
                }
                Op::Remove { ep, key: i } => {
                    let k = [BlockKey(key(ep, i))];
                    (
                        chained.remove(EndpointId(ep), Medium::Gpu, &k).unwrap(),
                        plain.remove(EndpointId(ep), Medium::Gpu, &k).unwrap(),
                    )
                }
                Op::Clear { ep } => (
                    chained.clear_endpoint(EndpointId(ep)).unwrap(),
                    plain.clear_endpoint(EndpointId(ep)).unwrap(),
                ),
            };
            prop_assert_eq!(a, b, "{:?}", op);
            for ep in 0..3 {
                let e = EndpointId(ep);
                prop_assert_eq!(chained.inventory(e), plain.inventory(e));
                prop_assert_eq!(chained.keys(e, Medium::Gpu), plain.keys(e, Medium::Gpu));
                for k in chained.keys(e, Medium::Gpu) {
                    prop_assert_eq!(chained.refcount(e, k, Medium::Gpu), plain.refcount(e, k, Medium::Gpu));
                }
            }
        }
        // The rings hold the same order: shrinking evicts the same keys.
        for ep in 0..3 {
            let e = EndpointId(ep);
            for bound in [capacity / 2, 1, 0] {
                prop_assert_eq!(
                    chained.set_capacity(e, Medium::Gpu, bound).unwrap(),
                    plain.set_capacity(e, Medium::Gpu, bound).unwrap()
                );
                prop_assert_eq!(chained.keys(e, Medium::Gpu), plain.keys(e, Medium::Gpu));
            }
        }
    }
}

/// `n` keys of one shard whose table hashes share their top 32 bits (so
/// their ring fingerprints are equal whatever the shard count), group `g`.
fn colliding(index: &SharedIndex, g: u64, n: usize) -> Vec<u64> {
    let top = mix(g + 1) & 0xffff_ffff_0000_0000;
    let mut out = Vec::new();
    let mut shard = None;
    for low in 1..u64::from(u32::MAX) {
        if out.len() == n {
            break;
        }
        let key = key_with_hash(top | mix(low) >> 32);
        let s = index.shard_of(BlockKey(key));
        if *shard.get_or_insert(s) == s {
            out.push(key);
        }
    }
    out
}

#[test]
fn crafted_keys_share_a_fingerprint() {
    let index = SharedIndex::new(1, IndexConfig::default());
    let keys = colliding(&index, 3, 4);
    assert_eq!(keys.len(), 4);
    assert_eq!(
        entry_hash(key_with_hash(0x1234_5678_9abc_def0)),
        0x1234_5678_9abc_def0
    );
    let fp = index.fingerprint(keys[0]);
    for k in &keys {
        assert_eq!(index.fingerprint(*k), fp, "{k:#x}");
    }
    let (shard, ..) = index.split_fingerprint(fp);
    assert_eq!(shard, index.shard_of(BlockKey(keys[0])));
}

#[derive(Clone, Debug)]
enum RingOp {
    Store { ep: u32, key: usize },
    Remove { ep: u32, key: usize },
    Clear { ep: u32 },
    Bound { ep: u32, cap: usize },
}

fn ring_op() -> impl Strategy<Value = RingOp> {
    prop_oneof![
        8 => (0u32..2, 0usize..24).prop_map(|(ep, key)| RingOp::Store { ep, key }),
        3 => (0u32..2, 0usize..24).prop_map(|(ep, key)| RingOp::Remove { ep, key }),
        1 => (0u32..2).prop_map(|ep| RingOp::Clear { ep }),
        1 => (0u32..2, 0usize..10).prop_map(|(ep, cap)| RingOp::Bound { ep, cap }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Keys in groups of four sharing one fingerprint, two endpoints, a small
    /// bound: which key of a group a ring entry evicts is not defined, but
    /// the counters stay exact (live keys = what `keys` lists = stored −
    /// removed − evicted − cleared), the bound holds, no key outlives its
    /// ring entries (bounding to 0 empties the endpoint, whatever the
    /// churn) and one endpoint's fingerprints never touch the other's keys.
    #[test]
    fn colliding_fingerprints_keep_counts_and_bound(
        ops in proptest::collection::vec(ring_op(), 1..160),
        cap in 1usize..8,
        shards in prop_oneof![Just(1usize), Just(4usize), Just(64usize)],
    ) {
        let index = SharedIndex::new(2, IndexConfig { capacity_per_endpoint: cap, shards });
        let universe: Vec<u64> = (0..6).flat_map(|g| colliding(&index, g, 4)).collect();
        prop_assert_eq!(universe.len(), 24);
        let mut caps = [cap as u64; 2];
        let mut net = [0i64; 2];
        for op in &ops {
            match *op {
                RingOp::Store { ep, key } => {
                    let w = index.store(EndpointId(ep), Medium::Gpu, &[BlockKey(universe[key])]).unwrap();
                    net[ep as usize] += w.inserted as i64 - w.evicted as i64;
                }
                RingOp::Remove { ep, key } => {
                    let w = index.remove(EndpointId(ep), Medium::Gpu, &[BlockKey(universe[key])]).unwrap();
                    net[ep as usize] -= w.removed as i64;
                }
                RingOp::Clear { ep } => {
                    let w = index.clear_endpoint(EndpointId(ep)).unwrap();
                    net[ep as usize] -= w.cleared as i64;
                }
                RingOp::Bound { ep, cap } => {
                    let w = index.set_capacity(EndpointId(ep), Medium::Gpu, cap).unwrap();
                    caps[ep as usize] = cap as u64;
                    net[ep as usize] -= w.evicted as i64;
                }
            }
            for ep in 0..2u32 {
                let e = EndpointId(ep);
                let live = index.inventory(e).keys_by_medium[0];
                prop_assert_eq!(live as i64, net[ep as usize], "{:?}", op);
                prop_assert_eq!(index.keys(e, Medium::Gpu).len() as u64, live, "{:?}", op);
                // What decisions read without the lock is the count.
                prop_assert_eq!(index.gpu_blocks(e), live, "{:?}", op);
                prop_assert!(live <= caps[ep as usize], "{:?}: {} > {}", op, live, caps[ep as usize]);
            }
        }
        // Every key present still has a ring entry that reaches it.
        for ep in 0..2u32 {
            let other = index.keys(EndpointId(1 - ep), Medium::Gpu);
            index.set_capacity(EndpointId(ep), Medium::Gpu, 0).unwrap();
            prop_assert!(index.keys(EndpointId(ep), Medium::Gpu).is_empty());
            prop_assert_eq!(index.inventory(EndpointId(ep)).keys_by_medium[0], 0);
            prop_assert_eq!(index.keys(EndpointId(1 - ep), Medium::Gpu), other);
        }
    }
}

/// A ring entry is 4 bytes, in chunks: a bounded index holds 4 bytes per
/// key more than an unbounded one, plus under one chunk of slack.
#[test]
fn the_ring_costs_four_bytes_per_key() {
    const KEYS: u64 = 200_000;
    let keys: Vec<BlockKey> = (0..KEYS).map(|i| BlockKey(mix(i + 1))).collect();
    let unbounded = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            shards: 64,
        },
    );
    let bounded = SharedIndex::new(1, IndexConfig::default());
    unbounded.store(EndpointId(0), Medium::Gpu, &keys).unwrap();
    bounded.store(EndpointId(0), Medium::Gpu, &keys).unwrap();
    let ring = bounded.memory_bytes() - unbounded.memory_bytes();
    let per_key = ring as f64 / KEYS as f64;
    assert!((4.0..=4.1).contains(&per_key), "{per_key} B per key");
}

/// Compaction keeps one ring entry per key present, also for keys sharing a
/// fingerprint: four colliding keys stay while churn of a fifth key grows
/// the ring past its slack (compactions run), and bounding the endpoint to
/// 0 afterwards still reaches all four.
#[test]
fn compaction_keeps_an_entry_per_colliding_key() {
    let index = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: 64,
            shards: 64,
        },
    );
    let e = EndpointId(0);
    let group: Vec<BlockKey> = colliding(&index, 9, 4).into_iter().map(BlockKey).collect();
    index.store(e, Medium::Gpu, &group).unwrap();
    let churn = [BlockKey(mix(77))];
    let idle = index.memory_bytes();
    for _ in 0..5_000 {
        index.store(e, Medium::Gpu, &churn).unwrap();
        index.remove(e, Medium::Gpu, &churn).unwrap();
    }
    assert!(
        index.memory_bytes() < idle + 3 * super::RING_SLACK * 4,
        "compactions kept the ring short"
    );
    assert_eq!(index.keys(e, Medium::Gpu), {
        let mut g = group.clone();
        g.sort_unstable();
        g
    });
    let w = index.set_capacity(e, Medium::Gpu, 0).unwrap();
    assert_eq!(w.evicted, 4);
    assert!(index.keys(e, Medium::Gpu).is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A `store_chain` lock group against a set: it write-locks exactly the
    /// distinct shards it was given, in ascending order, finds each one's
    /// guard (position table up to 64 shards, search above), none for any
    /// other shard, and releases them all when dropped.
    #[test]
    fn a_lock_group_holds_exactly_its_shards(
        shard_bits in 0u32..8,
        picks in proptest::collection::vec(any::<usize>(), 0..=super::LOCK_GROUP + 1),
    ) {
        let shards = 1usize << shard_bits;
        let index = SharedIndex::new(64, IndexConfig { capacity_per_endpoint: 16, shards });
        let bank = &index.banks[0];
        let picks: Vec<usize> = picks.iter().map(|p| p % shards).collect();
        let want: std::collections::BTreeSet<usize> = picks.iter().copied().collect();
        {
            let mut locks = super::chain::GroupLocks::lock(bank, picks.iter().copied());
            let held: Vec<usize> = locks.shards[..locks.count].to_vec();
            prop_assert_eq!(held, want.iter().copied().collect::<Vec<_>>());
            for s in 0..shards {
                prop_assert_eq!(locks.get(s).is_some(), want.contains(&s), "shard {}", s);
                prop_assert_eq!(locks.get_mut(s).is_some(), want.contains(&s), "shard {}", s);
                prop_assert_eq!(bank.shards[s].0.is_locked_exclusive(), want.contains(&s));
            }
        }
        for s in 0..shards {
            prop_assert!(!bank.shards[s].0.is_locked(), "shard {} released", s);
        }
    }
}

/// Readers score and look keys up while one writer takes another
/// endpoint's inventory through every table region's growth steps (from
/// one bucket to thousands), removes a third of it (regions shrink) and
/// clears it, three times, with a bound the writer reaches (evictions) and
/// without one: the endpoint nobody writes is always found whole, in both
/// walks, and the growing one never shows more than it holds.
#[test]
fn readers_see_every_key_while_regions_grow_and_shrink() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use crate::view::{InventoryView, Overlap};

    for capacity in [usize::MAX, 150_000] {
        let index = Arc::new(SharedIndex::new(
            2,
            IndexConfig {
                capacity_per_endpoint: capacity,
                ..IndexConfig::default()
            },
        ));
        let stable: Vec<BlockKey> = (0..600).map(|i| BlockKey(key(1, i))).collect();
        index
            .store_chain(EndpointId(1), Medium::Gpu, None, &stable)
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (index, stop, stable) = (index.clone(), stop.clone(), stable.clone());
                std::thread::spawn(move || {
                    let mut out = vec![Overlap::default(); 2];
                    let mut rounds = 0u32;
                    while !stop.load(Ordering::Relaxed) || rounds == 0 {
                        if r == 0 {
                            index.score(&stable, &mut out);
                        } else {
                            index.score_prefix(&stable, &mut out);
                        }
                        assert_eq!((out[1].blocks, out[1].prefix), (600, 600));
                        assert!(out[0].blocks <= 600);
                        let k = stable[rounds as usize % stable.len()];
                        assert!(index.contains(EndpointId(1), k, Medium::Gpu));
                        rounds += 1;
                    }
                    rounds
                })
            })
            .collect();
        let growing: Vec<BlockKey> = (0..200_000).map(|i| BlockKey(mix(i) | 1)).collect();
        for _ in 0..3 {
            for (i, event) in growing.chunks(16).enumerate() {
                let parent = (i * 16).checked_sub(1).map(|p| growing[p]);
                index
                    .store_chain(EndpointId(0), Medium::Gpu, parent, event)
                    .unwrap();
            }
            let held = index.inventory(EndpointId(0)).keys_by_medium[0];
            assert_eq!(held, growing.len().min(capacity) as u64);
            let third: Vec<BlockKey> = growing.iter().step_by(3).copied().collect();
            index.remove(EndpointId(0), Medium::Gpu, &third).unwrap();
            for k in third.iter().take(2000) {
                assert!(!index.contains(EndpointId(0), *k, Medium::Gpu));
            }
            if capacity == usize::MAX {
                for k in growing.iter().skip(1).step_by(3).take(2000) {
                    assert!(index.contains(EndpointId(0), *k, Medium::Gpu));
                }
            }
            index.clear_endpoint(EndpointId(0)).unwrap();
            assert_eq!(index.inventory(EndpointId(0)).total(), 0);
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
        assert_eq!(index.keys(EndpointId(1), Medium::Gpu).len(), 600);
    }
}

/// After chain stores, every shard's prefetch hint names its GPU table's
/// buffer as it is (a table rebuilt by a store publishes its new one), so
/// the next store's prefetches reach the lines it inserts into.
#[test]
fn chain_stores_publish_each_shards_table() {
    let index = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            shards: 8,
        },
    );
    let keys: Vec<BlockKey> = (0..5_000u64).map(|i| BlockKey(key(0, i))).collect();
    for (i, event) in keys.chunks(16).enumerate() {
        let parent = (i * 16).checked_sub(1).and_then(|p| keys.get(p)).copied();
        index
            .store_chain(EndpointId(0), Medium::Gpu, parent, event)
            .unwrap();
        for shard in index.banks[0].shards.iter() {
            assert_eq!(shard.1.get(), shard.0.read().line_hint(), "after event {i}");
        }
    }
    let (base, buckets) = index.banks[0].shards[0].1.get();
    assert!(base != 0 && buckets > 0);
}

/// Keys crafted against the unkeyed `fmix64` to share one shard and one
/// home bucket (inverting it is public knowledge) spread like any others:
/// the index hashes under a per-process secret, so a hostile publisher
/// cannot make one shard's probes walk all of its keys.
#[test]
fn keys_crafted_against_the_plain_mix_do_not_collide() {
    fn unmix(mut h: u64) -> u64 {
        fn inverse(c: u64) -> u64 {
            let mut y = c;
            for _ in 0..6 {
                y = y.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(y)));
            }
            y
        }
        h ^= h >> 33;
        h = h.wrapping_mul(inverse(0xc4ce_b9fe_1a85_ec53));
        h ^= h >> 33;
        h = h.wrapping_mul(inverse(0xff51_afd7_ed55_8ccd));
        h ^ (h >> 33)
    }
    let index = SharedIndex::new(1, IndexConfig::default());
    let crafted: Vec<u64> = (0..512u64).map(|i| unmix(0xabc << 40 | i << 6)).collect();
    assert!(crafted
        .iter()
        .all(|k| mix(*k) >> 40 == 0xabc && mix(*k) & 63 == 0));
    let shards: std::collections::HashSet<usize> = crafted
        .iter()
        .map(|k| index.shard_of(BlockKey(*k)))
        .collect();
    let homes: std::collections::HashSet<u64> =
        crafted.iter().map(|k| entry_hash(*k) >> 40).collect();
    assert!(shards.len() > 1, "all in shard {shards:?}");
    assert!(homes.len() > 500, "{} distinct top bits", homes.len());
}
