//! The shared inventory index: every endpoint's block keys in one structure that
//! scores a prompt against all endpoints in one pass.
//!
//! # Layout
//!
//! Endpoints are dense slots `0..n`, grouped in *banks* of 64. A bank is a set of
//! lock-sharded hash maps, one per storage tier, from block key to a `u64` mask of
//! the bank's endpoints that hold the key in that tier. A key held by many
//! endpoints costs one map entry, not one per endpoint. Scoring looks each prompt
//! key up once per bank (so ≤ 64 endpoints is one lookup per key; hundreds of
//! endpoints still work, with one lookup per key per bank) and adds the masks into
//! bit-sliced counters.
//!
//! # Semantics
//!
//! * **Reference counts.** Each (endpoint, tier, key) carries a count of stores not
//!   yet matched by a remove. A second store of a present key changes neither
//!   scoring nor capacity (membership is idempotent) but raises the count; a remove
//!   lowers it, and the key leaves only when it reaches zero. This is what vLLM
//!   means when two requests cache the same block: it emits two identical
//!   `BlockStored` and, when one physical copy is evicted, one `BlockRemoved`
//!   while the other copy is still cached
//!   (`golden/vllm-events/v0.33.0/stream/05_duplicate_store_single_remove.json`).
//!   Dropping the key on the first remove would under-report. A remove of an
//!   absent key is counted and ignored.
//! * **Tiers are independent.** A key can be present in several tiers of one
//!   endpoint; a remove from the CPU tier leaves the GPU copy.
//! * **Capacity** is bounded per (endpoint, tier) by
//!   [`IndexConfig::capacity_per_endpoint`]. Each endpoint keeps an insertion ring
//!   per tier (one entry each time a key becomes present); when a store exceeds
//!   the bound, entries are popped from the front until one names a key that is
//!   still present, and that key is evicted whatever its reference count. A key
//!   that was removed and stored again may therefore be evicted at its earlier
//!   ring position: eviction is "oldest insertion first" on that ring, not an
//!   exact LRU. Evictions are counted.
//! * **Clearing** an endpoint hides it from readers at once (one atomic store of a
//!   per-bank mask), then purges its keys by walking its rings, taking each shard
//!   lock for a single key. Readers never wait for more than one key's update; the
//!   clearing writer pays O(keys of that endpoint), which its own stores prepaid.
//!   No other endpoint is touched.
//!
//! # Concurrency
//!
//! Readers (`score`) take a shard read lock per key lookup; writers take a shard
//! write lock per key. One writer per endpoint is expected (the endpoint's
//! ingest); each endpoint's rings sit behind their own mutex, which readers never
//! take, so misuse is safe, only serialised.
//!
//! ```
//! use kvroute_core::{BlockKey, EndpointId, Medium};
//! use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
//!
//! let index = SharedIndex::new(2, IndexConfig::default());
//! let keys = [BlockKey(10), BlockKey(11), BlockKey(12)];
//! index.store(EndpointId(0), Medium::Gpu, &keys[..2])?;
//! index.store(EndpointId(1), Medium::Gpu, &keys[1..])?;
//!
//! let mut out = [Overlap::default(); 2];
//! index.score(&keys, &mut out);
//! assert_eq!((out[0].blocks, out[0].prefix), (2, 2));
//! assert_eq!((out[1].blocks, out[1].prefix), (2, 0));
//! # Ok::<(), kvroute_ingest::IndexError>(())
//! ```

mod shard;
mod sliced;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_core::{BlockKey, EndpointId, Medium};
use parking_lot::{Mutex, RwLock};

use crate::view::{InventoryView, Overlap};
use shard::mix;
pub(crate) use shard::KeyMap;
use shard::{RemoveEffect, Shard, StoreEffect};
use sliced::SlicedCounters;

/// Endpoints per bank (bits of a holder mask).
const BANK_WIDTH: usize = 64;

/// Configuration of a [`SharedIndex`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most keys one endpoint may hold in one tier; a store beyond it evicts the
    /// oldest inserted key of that tier.
    pub capacity_per_endpoint: usize,
    /// Lock shards per bank of 64 endpoints (rounded up to a power of two).
    pub shards: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            capacity_per_endpoint: 1 << 21,
            shards: 64,
        }
    }
}

/// Errors of the index write API.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum IndexError {
    /// The endpoint id is not below [`SharedIndex::endpoint_slots`].
    #[error("endpoint {endpoint} is outside the index ({slots} endpoint slots)")]
    UnknownEndpoint {
        /// The id given.
        endpoint: EndpointId,
        /// Number of slots in the index.
        slots: usize,
    },
}

/// What one write call did, for counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Keys that became present.
    pub inserted: u64,
    /// Stores of keys already present (reference count raised).
    pub duplicate_stores: u64,
    /// Keys whose last reference was removed.
    pub removed: u64,
    /// Removes that only lowered a reference count.
    pub still_referenced: u64,
    /// Removes of keys that were not present.
    pub remove_absent: u64,
    /// Keys evicted by the capacity bound.
    pub evicted: u64,
    /// Keys dropped by a clear.
    pub cleared: u64,
}

impl std::ops::AddAssign for WriteStats {
    fn add_assign(&mut self, o: Self) {
        self.inserted += o.inserted;
        self.duplicate_stores += o.duplicate_stores;
        self.removed += o.removed;
        self.still_referenced += o.still_referenced;
        self.remove_absent += o.remove_absent;
        self.evicted += o.evicted;
        self.cleared += o.cleared;
    }
}

/// Size of one endpoint's inventory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInventory {
    /// Keys present, per tier (indexed by [`Medium::index`]).
    pub keys_by_medium: [u64; 4],
    /// Keys evicted by the capacity bound since the index was built.
    pub evictions: u64,
}

impl EndpointInventory {
    /// Keys present over all tiers (a key in two tiers counts twice).
    #[must_use]
    pub fn total(&self) -> u64 {
        self.keys_by_medium.iter().sum()
    }
}

#[repr(align(64))]
struct PaddedShard(RwLock<Shard>);

struct Bank {
    shards: Box<[PaddedShard]>,
    /// Endpoints being cleared: readers treat them as empty.
    hidden: AtomicU64,
    /// Endpoints that exist in this bank.
    active: u64,
}

#[derive(Default)]
struct EndpointKeys {
    rings: [VecDeque<u64>; 4],
    live: [u64; 4],
    evictions: u64,
}

/// The inventories of a fixed set of endpoint slots, shared between one writer
/// per endpoint and any number of scoring readers (wrap it in an `Arc`).
///
/// See the [module docs](self) for semantics and an example.
pub struct SharedIndex {
    banks: Box<[Bank]>,
    endpoints: Box<[Mutex<EndpointKeys>]>,
    shard_shift: u32,
    capacity: u64,
}

impl std::fmt::Debug for SharedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedIndex")
            .field("endpoints", &self.endpoints.len())
            .field("banks", &self.banks.len())
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl SharedIndex {
    /// An empty index with `endpoints` slots (`EndpointId(0..endpoints)`).
    #[must_use]
    pub fn new(endpoints: usize, config: IndexConfig) -> Self {
        let shards = config.shards.clamp(1, 1 << 16).next_power_of_two();
        let bank_count = endpoints.div_ceil(BANK_WIDTH);
        let banks = (0..bank_count)
            .map(|b| {
                let in_bank = endpoints.saturating_sub(b * BANK_WIDTH).min(BANK_WIDTH);
                Bank {
                    shards: (0..shards)
                        .map(|_| PaddedShard(RwLock::new(Shard::default())))
                        .collect(),
                    hidden: AtomicU64::new(0),
                    active: if in_bank == BANK_WIDTH {
                        u64::MAX
                    } else {
                        (1u64 << in_bank) - 1
                    },
                }
            })
            .collect();
        Self {
            banks,
            endpoints: (0..endpoints).map(|_| Mutex::default()).collect(),
            shard_shift: 64 - shards.trailing_zeros(),
            capacity: config.capacity_per_endpoint as u64,
        }
    }

    /// Number of endpoint slots.
    #[must_use]
    pub fn endpoint_slots(&self) -> usize {
        self.endpoints.len()
    }

    fn locate(&self, e: EndpointId) -> Result<(&Bank, u32, &Mutex<EndpointKeys>), IndexError> {
        let err = || IndexError::UnknownEndpoint {
            endpoint: e,
            slots: self.endpoints.len(),
        };
        let slot = self.endpoints.get(e.index()).ok_or_else(err)?;
        let bank = self.banks.get(e.index() / BANK_WIDTH).ok_or_else(err)?;
        Ok((bank, (e.index() % BANK_WIDTH) as u32, slot))
    }

    #[inline]
    fn shard<'a>(&self, bank: &'a Bank, key: u64) -> &'a RwLock<Shard> {
        let i = if self.shard_shift >= 64 {
            0
        } else {
            (mix(key.rotate_left(17)) >> self.shard_shift) as usize
        };
        // `i` < shards by construction of `shard_shift`.
        &bank.shards[i % bank.shards.len()].0
    }

    /// Stores `keys` for endpoint `e` in tier `medium`.
    pub fn store(
        &self,
        e: EndpointId,
        medium: Medium,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut guard = slot.lock();
        let slot: &mut EndpointKeys = &mut guard;
        let mut stats = WriteStats::default();
        for key in keys {
            // Bound first: a guard in the match scrutinee would live through the
            // arms, and eviction takes shard locks.
            let effect = self.shard(bank, key.0).write().store(tier, key.0, bit);
            match effect {
                StoreEffect::Inserted => {
                    stats.inserted += 1;
                    if let (Some(ring), Some(live)) =
                        (slot.rings.get_mut(tier), slot.live.get_mut(tier))
                    {
                        ring.push_back(key.0);
                        *live += 1;
                    }
                    if slot.live.get(tier).is_some_and(|l| *l > self.capacity) {
                        stats.evicted += self.evict_one(bank, bit, tier, slot);
                    }
                }
                StoreEffect::Duplicate => stats.duplicate_stores += 1,
            }
        }
        Ok(stats)
    }

    fn evict_one(&self, bank: &Bank, bit: u32, tier: usize, slot: &mut EndpointKeys) -> u64 {
        let Some(ring) = slot.rings.get_mut(tier) else {
            return 0;
        };
        while let Some(key) = ring.pop_front() {
            let purged = self.shard(bank, key).write().purge(tier, key, bit);
            if purged {
                if let Some(live) = slot.live.get_mut(tier) {
                    *live -= 1;
                }
                slot.evictions += 1;
                return 1;
            }
        }
        0
    }

    /// Removes one reference of each of `keys` for endpoint `e` in tier `medium`.
    pub fn remove(
        &self,
        e: EndpointId,
        medium: Medium,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut slot = slot.lock();
        let mut stats = WriteStats::default();
        for key in keys {
            let effect = self.shard(bank, key.0).write().remove(tier, key.0, bit);
            match effect {
                RemoveEffect::Removed => {
                    stats.removed += 1;
                    if let Some(live) = slot.live.get_mut(tier) {
                        *live -= 1;
                    }
                }
                RemoveEffect::Decremented => stats.still_referenced += 1,
                RemoveEffect::Absent => stats.remove_absent += 1,
            }
        }
        self.maybe_compact(bank, bit, tier, &mut slot);
        Ok(stats)
    }

    /// Removes the ring entries of keys no longer present (and repeated entries)
    /// once they outnumber the live keys, so churn cannot grow a ring unboundedly.
    fn maybe_compact(&self, bank: &Bank, bit: u32, tier: usize, slot: &mut EndpointKeys) {
        let live = slot.live.get(tier).copied().unwrap_or(0);
        let Some(ring) = slot.rings.get_mut(tier) else {
            return;
        };
        if (ring.len() as u64) <= live.saturating_mul(2) + 1024 {
            return;
        }
        let mut seen = hashbrown::HashSet::with_capacity(live as usize);
        ring.retain(|k| self.shard(bank, *k).read().contains(tier, *k, bit) && seen.insert(*k));
        ring.shrink_to_fit();
    }

    /// Empties endpoint `e` (all tiers). Readers see it empty immediately.
    pub fn clear_endpoint(&self, e: EndpointId) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let flag = 1u64 << bit;
        let mut slot = slot.lock();
        bank.hidden.fetch_or(flag, Ordering::AcqRel);
        let mut stats = WriteStats::default();
        for tier in 0..4 {
            let Some(ring) = slot.rings.get_mut(tier).map(std::mem::take) else {
                continue;
            };
            for key in &ring {
                if self.shard(bank, *key).write().purge(tier, *key, bit) {
                    stats.cleared += 1;
                }
            }
            if let Some(live) = slot.live.get_mut(tier) {
                *live = 0;
            }
        }
        bank.hidden.fetch_and(!flag, Ordering::AcqRel);
        Ok(stats)
    }

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

    /// The keys endpoint `e` holds in tier `medium`, sorted (diagnostics; O(keys)).
    #[must_use]
    pub fn keys(&self, e: EndpointId, medium: Medium) -> Vec<BlockKey> {
        let Ok((bank, bit, slot)) = self.locate(e) else {
            return Vec::new();
        };
        let tier = medium.index();
        let slot = slot.lock();
        let mut out: Vec<BlockKey> = slot
            .rings
            .get(tier)
            .into_iter()
            .flatten()
            .filter(|k| self.shard(bank, **k).read().contains(tier, **k, bit))
            .map(|k| BlockKey(*k))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
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
            .sum();
        let rings: usize = self
            .endpoints
            .iter()
            .map(|s| {
                s.lock()
                    .rings
                    .iter()
                    .map(|r| r.capacity() * std::mem::size_of::<u64>())
                    .sum::<usize>()
                    + std::mem::size_of::<Mutex<EndpointKeys>>()
            })
            .sum();
        tables + rings
    }

    fn score_bank(&self, bank: &Bank, keys: &[BlockKey], out: &mut [Overlap]) {
        let active = bank.active & !bank.hidden.load(Ordering::Acquire);
        let mut blocks = SlicedCounters::ZERO;
        let mut by_tier = [SlicedCounters::ZERO; 4];
        let mut alive = active;
        if active != 0 {
            for key in keys {
                let [gpu, cpu, disk, ext] = self.shard(bank, key.0).read().masks(key.0);
                let any = (gpu | cpu | disk | ext) & active;
                blocks.add(any);
                alive &= any;
                if alive != 0 {
                    // Each prefix block counts once, in the fastest tier holding it.
                    by_tier[0].add(gpu & alive);
                    by_tier[1].add(cpu & alive & !gpu);
                    by_tier[2].add(disk & alive & !(gpu | cpu));
                    by_tier[3].add(ext & alive & !(gpu | cpu | disk));
                }
            }
        }
        for (bit, slot) in out.iter_mut().enumerate().take(BANK_WIDTH) {
            let bit = bit as u32;
            let mut overlap = Overlap {
                blocks: blocks.get(bit),
                ..Overlap::default()
            };
            for (dst, src) in overlap.prefix_by_medium.iter_mut().zip(&by_tier) {
                *dst = src.get(bit);
            }
            overlap.prefix = overlap.prefix_by_medium.iter().sum();
            *slot = overlap;
        }
    }
}

impl InventoryView for SharedIndex {
    fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        let n = self.endpoints.len().min(out.len());
        let out = out.get_mut(..n).unwrap_or_default();
        for (bank, chunk) in self.banks.iter().zip(out.chunks_mut(BANK_WIDTH)) {
            self.score_bank(bank, keys, chunk);
        }
    }
}
