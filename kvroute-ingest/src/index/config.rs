//! The index's configuration, errors and write counters.

use kvroute_core::EndpointId;

#[cfg(doc)]
use super::SharedIndex;

/// Default [`IndexConfig::capacity_per_endpoint`]: 2^20 blocks per (endpoint,
/// tier) — above the GPU block count of common engine deployments (an 80 GB GPU
/// holds ~10^5 blocks of 16 tokens for a 7–8 B model), at most
/// ≈ [`BUDGET_BYTES_PER_KEY`] × 2^20 ≈ 100 MiB per endpoint and tier.
pub const DEFAULT_CAPACITY: usize = 1 << 20;

/// Upper bound of heap bytes per block of capacity used by
/// [`SharedIndex::memory_budget`]: a 12-byte table entry in its 64-byte
/// bucket of five at the lowest load a table region keeps before it
/// shrinks (a quarter of 85 %: ≈ 60 bytes per live key, as hashbrown's
/// 13-byte slots at the same bound), a duplicate-count entry, and the
/// insertion ring with its compaction slack.
pub const BUDGET_BYTES_PER_KEY: usize = 96;

/// Configuration of a [`SharedIndex`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Most keys one endpoint may hold in one tier, for every slot until
    /// [`SharedIndex::set_capacity`] changes it; a store beyond it evicts the
    /// oldest inserted key of that tier. [`DEFAULT_CAPACITY`] by default;
    /// [`usize::MAX`] means unbounded: no insertion ring is kept, which saves
    /// 4 bytes per (endpoint, key) pair (see [`SharedIndex`]).
    pub capacity_per_endpoint: usize,
    /// Lock shards per bank of 64 endpoints (rounded up to a power of two).
    pub shards: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            capacity_per_endpoint: DEFAULT_CAPACITY,
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
    /// Keys present, per tier (indexed by [`Medium::index`](kvroute_core::Medium::index)).
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
