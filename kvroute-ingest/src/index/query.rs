//! Per-endpoint lookups and sizes (diagnostics, admin and metrics).

use std::sync::atomic::Ordering;

use kvroute_core::{BlockKey, EndpointId, Medium};
use parking_lot::Mutex;

use super::ring::Ring;
use super::{EndpointInventory, EndpointKeys, PaddedShard, SharedIndex};

impl SharedIndex {
    /// True when endpoint `e` holds `key` in tier `medium`.
    #[must_use]
    pub fn contains(&self, e: EndpointId, key: BlockKey, medium: Medium) -> bool {
        self.refcount(e, key, medium) > 0
    }

    /// Outstanding stores of `key` for endpoint `e` in tier `medium` (0 = absent).
    #[must_use]
    pub fn refcount(&self, e: EndpointId, key: BlockKey, medium: Medium) -> u32 {
        let Ok((bank, bit, _)) = self.locate(e) else {
            return 0;
        };
        if bank.hidden.load(Ordering::Acquire) & (1u64 << bit) != 0 {
            return 0;
        }
        self.shard(bank, key.0)
            .read()
            .refcount(medium.index(), key.0, bit)
    }

    /// The keys endpoint `e` holds in tier `medium`, sorted (diagnostics; O(keys
    /// of the endpoint's bank): it scans the bank's tables).
    #[must_use]
    pub fn keys(&self, e: EndpointId, medium: Medium) -> Vec<BlockKey> {
        let Ok((bank, bit, slot)) = self.locate(e) else {
            return Vec::new();
        };
        let tier = medium.index();
        // Held so the endpoint's writer cannot interleave with the scan.
        let _slot = slot.lock();
        let mut raw = Vec::new();
        for shard in bank.shards.iter() {
            shard.0.read().collect_keys(tier, bit, &mut raw);
        }
        raw.sort_unstable();
        raw.dedup();
        raw.into_iter().map(BlockKey).collect()
    }

    /// Size and eviction count of endpoint `e`'s inventory.
    #[must_use]
    pub fn inventory(&self, e: EndpointId) -> EndpointInventory {
        let Ok((_, _, slot)) = self.locate(e) else {
            return EndpointInventory::default();
        };
        let slot = slot.lock();
        EndpointInventory {
            keys_by_medium: slot.live,
            evictions: slot.evictions,
        }
    }

    /// Approximate heap bytes held by the index: hash tables, rings, duplicate
    /// counts. Takes each lock briefly; meant for a metrics gauge.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        let tables: usize = self
            .banks
            .iter()
            .flat_map(|b| b.shards.iter())
            .map(|s| s.0.read().allocation_bytes() + std::mem::size_of::<PaddedShard>())
            .sum::<usize>()
            + self
                .banks
                .iter()
                .map(|b| b.runs.allocation_bytes())
                .sum::<usize>()
            + self.universal.allocation_bytes();
        let rings: usize = self
            .endpoints
            .iter()
            .map(|s| {
                s.lock()
                    .rings
                    .iter()
                    .map(Ring::allocation_bytes)
                    .sum::<usize>()
                    + std::mem::size_of::<Mutex<EndpointKeys>>()
                    // Its published GPU-tier count.
                    + std::mem::size_of::<std::sync::atomic::AtomicU64>()
            })
            .sum();
        tables + rings
    }
}
