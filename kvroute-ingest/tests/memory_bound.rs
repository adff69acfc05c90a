//! Peer-driven memory is bounded by configuration.
//! A flood of random stores (and removes, tier moves, re-stores) from several
//! endpoints and DP ranks, in engine-key and re-key mode, never takes
//! `SharedIndex::memory_bytes()` above `SharedIndex::memory_budget()`, nor the
//! ingest's own maps above their bounds. Figures are printed with `--nocapture`
//! (BENCHMARKS.md); nothing here is timed.

use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::XxhChainRekeyer;
use kvroute_ingest::{
    BlockRemoved, BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying,
    KvEvent, SharedIndex,
};

/// A small deterministic generator (no clock, no global state).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let x = self.0;
        x ^ (x >> 29)
    }
}

const ENDPOINTS: usize = 4;
const CAPACITY: usize = 4096;
const REKEY_ENTRIES: usize = 8192;
const BATCHES: u64 = 2_000;
const KEYS_PER_STORE: usize = 16;

fn flood(mode: &str) {
    let index = SharedIndex::new(
        ENDPOINTS,
        IndexConfig {
            capacity_per_endpoint: CAPACITY,
            ..IndexConfig::default()
        },
    );
    let budget = index.memory_budget().expect("every slot is bounded");
    let config = IngestConfig {
        max_rekey_entries: REKEY_ENTRIES,
        ..IngestConfig::default()
    };
    let mut ingests: Vec<EndpointIngest> = (0..ENDPOINTS)
        .map(|e| {
            let key_mode = match mode {
                "rekey" => Keying::Rekey(Arc::new(XxhChainRekeyer { seed: 1337 })),
                _ => Keying::Engine,
            };
            EndpointIngest::new(EndpointId(e as u32), config.clone(), key_mode)
        })
        .collect();
    let mut rng = Lcg(0x5eed);
    let mut peak_index = 0usize;
    let mut peak_ingest = 0usize;
    let mut stored_keys = 0u64;
    for seq in 0..BATCHES {
        for (e, ingest) in ingests.iter_mut().enumerate() {
            let mut events = Vec::new();
            for _ in 0..4 {
                let keys: Vec<BlockKey> =
                    (0..KEYS_PER_STORE).map(|_| BlockKey(rng.next())).collect();
                let medium = if rng.next().is_multiple_of(4) {
                    Medium::Cpu
                } else {
                    Medium::Gpu
                };
                stored_keys += keys.len() as u64;
                events.push(KvEvent::Stored(BlockStored {
                    token_ids: (0..(KEYS_PER_STORE * 4) as u32)
                        .map(|_| rng.next() as u32)
                        .collect(),
                    keys: keys.clone(),
                    block_size: 4,
                    medium,
                    ..BlockStored::default()
                }));
                // Remove a few of them again (reference counts, ring churn).
                if rng.next().is_multiple_of(3) {
                    events.push(KvEvent::Removed(BlockRemoved {
                        keys: keys[..4].to_vec(),
                        medium,
                        group: 0,
                    }));
                }
            }
            let batch = EventBatch {
                seq,
                dp_rank: Some((e % 2) as u32),
                events,
                ..EventBatch::default()
            };
            let outcome = ingest.apply_batch(&batch, &index);
            assert!(outcome.action.applies());
        }
        if seq % 500 == 0 || seq == BATCHES - 1 {
            let used = index.memory_bytes();
            peak_index = peak_index.max(used);
            assert!(
                used <= budget,
                "{mode}: index memory {used} B above its budget {budget} B at batch {seq}"
            );
            for ingest in &ingests {
                let own = ingest.memory_bytes();
                peak_ingest = peak_ingest.max(own);
                // Re-key map entries (24 B + control byte at load ≥ 7/16) up to
                // its bound (the inventory's keys over all tiers + 1024), plus
                // scratch.
                let bound = (4 * CAPACITY + 1024).max(REKEY_ENTRIES) * 64 + (1 << 16);
                assert!(
                    own <= bound,
                    "{mode}: ingest memory {own} B above {bound} B"
                );
            }
            for e in 0..ENDPOINTS {
                let inv = index.inventory(EndpointId(e as u32));
                for m in [Medium::Gpu, Medium::Cpu] {
                    assert!(inv.keys_by_medium[m.index()] <= CAPACITY as u64, "{inv:?}");
                }
            }
        }
    }
    let evictions: u64 = (0..ENDPOINTS)
        .map(|e| index.inventory(EndpointId(e as u32)).evictions)
        .sum();
    assert!(evictions > 0, "the flood must exceed the capacity");
    println!(
        "memory flood ({mode}): {ENDPOINTS} endpoints x capacity {CAPACITY}/tier, {stored_keys} \
         random keys stored, {evictions} evicted; index peak {peak_index} B (budget {budget} B, \
         {:.1} B per block of capacity); ingest maps peak {peak_ingest} B",
        peak_index as f64 / (ENDPOINTS * CAPACITY * 2) as f64
    );
}

#[test]
fn a_store_flood_stays_within_the_memory_budget_in_engine_key_mode() {
    flood("engine");
}

#[test]
fn a_store_flood_stays_within_the_memory_budget_in_rekey_mode() {
    flood("rekey");
}

/// The default index has a memory budget: a peer's stores beyond it are
/// evicted, not all kept.
#[test]
fn the_default_index_is_bounded() {
    let index = SharedIndex::new(3, IndexConfig::default());
    let budget = index.memory_budget().expect("bounded by default");
    assert_eq!(
        index.capacity(EndpointId(0), Medium::Gpu),
        Some(kvroute_ingest::DEFAULT_CAPACITY as u64)
    );
    println!("default budget for 3 endpoints: {budget} B");
    // The engine's own figure replaces the default, evicting at once.
    let keys: Vec<BlockKey> = (0..100).map(BlockKey).collect();
    index.store(EndpointId(1), Medium::Gpu, &keys).unwrap();
    let w = index.set_capacity(EndpointId(1), Medium::Gpu, 10).unwrap();
    assert_eq!(w.evicted, 90);
    assert_eq!(index.inventory(EndpointId(1)).keys_by_medium[0], 10);
    // The oldest inserted went first.
    assert!(!index.contains(EndpointId(1), BlockKey(0), Medium::Gpu));
    assert!(index.contains(EndpointId(1), BlockKey(99), Medium::Gpu));
    // Bounding a slot that was unbounded builds its ring from the keys present.
    let unbounded = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            ..IndexConfig::default()
        },
    );
    assert_eq!(unbounded.memory_budget(), None);
    unbounded.store(EndpointId(0), Medium::Gpu, &keys).unwrap();
    let w = unbounded
        .set_capacity(EndpointId(0), Medium::Gpu, 40)
        .unwrap();
    assert_eq!(w.evicted, 60);
    unbounded
        .store(EndpointId(0), Medium::Gpu, &[BlockKey(1000)])
        .unwrap();
    assert_eq!(unbounded.inventory(EndpointId(0)).keys_by_medium[0], 40);
}

/// A publisher that stores the same tokens again and again under fresh engine
/// keys (one internal key, ever more engine keys) cannot grow the re-key map
/// past its bound: the endpoint is reset and counted instead.
#[test]
fn many_engine_keys_for_one_block_reset_instead_of_growing() {
    let index = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: 256,
            ..IndexConfig::default()
        },
    );
    let config = IngestConfig {
        max_rekey_entries: 512,
        ..IngestConfig::default()
    };
    let mut ingest = EndpointIngest::new(
        EndpointId(0),
        config,
        Keying::Rekey(Arc::new(XxhChainRekeyer { seed: 1337 })),
    );
    let mut rng = Lcg(7);
    let mut peak = 0;
    for seq in 0..20_000u64 {
        let batch = EventBatch {
            seq,
            events: vec![KvEvent::Stored(BlockStored {
                keys: vec![BlockKey(rng.next())],
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        };
        let _ = ingest.apply_batch(&batch, &index);
        peak = peak.max(ingest.memory_bytes());
    }
    let resets = ingest.counters().rekey_map_full;
    println!("re-key map under 20000 engine keys for one block: peak {peak} B, {resets} resets");
    assert!(resets > 0);
    // Bound: (4 tiers x 256 + 1024) entries.
    assert!(peak <= (4 * 256 + 1024) * 64 + (1 << 16), "{peak}");
}

/// A peer that knows the (public) shard hash fills one shard's table to the
/// endpoint's capacity, lets those keys be evicted by filling the next shard,
/// and so on. Tables shrink once three quarters are free, so the index stays
/// within its budget (without shrinking, every shard kept its largest size:
/// 64 shards × capacity).
#[test]
fn shard_targeted_floods_stay_within_the_budget() {
    const CAP: usize = 2048;
    let index = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: CAP,
            shards: 64,
        },
    );
    let budget = index.memory_budget().unwrap();
    let mut candidate = 0u64;
    let mut peak = 0;
    for shard in 0..64 {
        let mut keys = Vec::with_capacity(CAP);
        while keys.len() < CAP {
            candidate += 1;
            if index.shard_of(BlockKey(candidate)) == shard {
                keys.push(BlockKey(candidate));
            }
        }
        index.store(EndpointId(0), Medium::Gpu, &keys).unwrap();
        let used = index.memory_bytes();
        peak = peak.max(used);
        assert!(
            used <= budget,
            "after shard {shard}: {used} B above the budget {budget} B"
        );
    }
    println!("shard-targeted flood, capacity {CAP}, 64 shards: peak {peak} B, budget {budget} B");
}
