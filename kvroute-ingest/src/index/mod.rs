//! The shared inventory index ([`SharedIndex`], whose docs hold the layout,
//! semantics and an example).

mod prefetch;
mod ring;
mod runs;
mod shard;
mod sliced;
mod table;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_core::{BlockKey, EndpointId, Medium};
use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use crate::view::{InventoryView, Overlap};
use prefetch::{prefetch_line, LineHint};
use ring::Ring;
use runs::{RunHint, RunTable, MAX_RUN};
pub(crate) use shard::KeyMap;
use shard::{entry_hash, RemoveEffect, Shard, StoreEffect};
use sliced::SlicedCounters;

/// Endpoints per bank (bits of a holder mask).
const BANK_WIDTH: usize = 64;
/// `capacity` value meaning "no bound".
const UNBOUNDED: u64 = u64::MAX;
/// Keys purged per write-lock acquisition when clearing without a ring.
const PURGE_BATCH: usize = 128;
/// Prompt keys looked up per shard-grouped pass (stack buffers, no allocation).
const SCORE_CHUNK: usize = 256;
/// Lookups the prefix walk makes one key at a time before it switches to
/// shard-sorted chunks. A chunk costs a counting sort and a lookup of every
/// key up to its end, even past the end of the match; one key at a time costs
/// a shard lock per key, which only adds up on long matches shared by many
/// endpoints (measured: 33 single lookups 0.9 µs against 2.1 µs with chunks
/// from key 16 on, `examples/bench-dynamo`, *shared*).
const DIRECT_LOOKUPS: usize = 128;
/// Keys of one `store_chain` call inserted under one set of shard locks.
const LOCK_GROUP: usize = 32;
/// Lines prefetched per key ahead of a store: its home and the ones after.
const PREFETCH_LINES: usize = 4;
/// Buckets of the per-chunk counting sort by shard.
const SORT_BUCKETS: usize = 256;
/// Ring entries beyond twice the live keys tolerated before a compaction.
const RING_SLACK: usize = 1024;

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

/// A shard's lock, and where its GPU table's lines are for writers that do
/// not hold it yet (see [`prefetch`]). `repr(C)`: the lock and the shard
/// first, where readers find them, the hint after.
#[repr(C, align(64))]
struct PaddedShard(RwLock<Shard>, LineHint);

struct Bank {
    shards: Box<[PaddedShard]>,
    /// Endpoints being cleared: readers treat them as empty.
    hidden: AtomicU64,
    /// Endpoints that exist in this bank.
    active: u64,
    /// Chain runs of the bank's endpoints (GPU tier).
    runs: RunTable,
}

struct EndpointKeys {
    /// Insertion order as key fingerprints (see [`SharedIndex::fingerprint`]).
    rings: [Ring; 4],
    live: [u64; 4],
    /// Bound per tier ([`UNBOUNDED`]: none, and no ring).
    capacity: [u64; 4],
    evictions: u64,
    /// Last keys of recent chain stores, so a store naming one as its parent
    /// continues that run (one block per event while decoding).
    tails: [Tail; TAILS],
    next_tail: usize,
}

/// Chain stores remembered per endpoint (interleaved requests each extend
/// their own run).
const TAILS: usize = 8;

/// The last key of a chain store and what it may continue.
#[derive(Clone, Copy, Default)]
struct Tail {
    key: u64,
    /// `Some(run)`: the key ends that run; `None`: the key was stored alone
    /// and may head a run.
    run: Option<u32>,
    used: bool,
}

impl EndpointKeys {
    fn new(capacity: u64) -> Self {
        Self {
            rings: Default::default(),
            live: [0; 4],
            capacity: [capacity; 4],
            evictions: 0,
            tails: [Tail::default(); TAILS],
            next_tail: 0,
        }
    }

    fn find_tail(&self, key: u64) -> Option<Tail> {
        self.tails.iter().find(|t| t.used && t.key == key).copied()
    }

    fn push_tail(&mut self, key: u64, run: Option<u32>) {
        if let Some(t) = self.tails.iter_mut().find(|t| t.used && t.key == key) {
            t.run = run;
            return;
        }
        if let Some(t) = self.tails.get_mut(self.next_tail % TAILS) {
            *t = Tail {
                key,
                run,
                used: true,
            };
        }
        self.next_tail = (self.next_tail + 1) % TAILS;
    }

    #[inline]
    fn bounded(&self, tier: usize) -> bool {
        self.capacity.get(tier).is_some_and(|c| *c != UNBOUNDED)
    }
}

/// The inventories of a fixed set of endpoint slots, shared between one writer
/// per endpoint and any number of scoring readers (wrap it in an `Arc`).
///
/// The shared inventory index: every endpoint's block keys in one structure that
/// scores a prompt against all endpoints in one pass.
///
/// # Layout
///
/// Endpoints are dense slots `0..n`, grouped in *banks* of 64. A bank is a set of
/// lock-sharded hash maps, one per storage tier, from block key to a `u64` mask of
/// the bank's endpoints that hold the key in that tier. A key held by many
/// endpoints costs one map entry, not one per endpoint. Scoring looks each prompt
/// key up once per bank (so ≤ 64 endpoints is one lookup per key; hundreds of
/// endpoints still work, with one lookup per key per bank) and adds the masks into
/// bit-sliced counters.
///
/// # Semantics
///
/// * **Reference counts.** Each (endpoint, tier, key) carries a count of stores not
///   yet matched by a remove. A second store of a present key changes neither
///   scoring nor capacity (membership is idempotent) but raises the count; a remove
///   lowers it, and the key leaves only when it reaches zero. This is what vLLM
///   means when two requests cache the same block: it emits two identical
///   `BlockStored` and, when one physical copy is evicted, one `BlockRemoved`
///   while the other copy is still cached
///   (`golden/vllm-events/v0.33.0/stream/05_duplicate_store_single_remove.json`).
///   Dropping the key on the first remove would under-report. A remove of an
///   absent key is counted and ignored.
/// * **Tiers are independent.** A key can be present in several tiers of one
///   endpoint; a remove from the CPU tier leaves the GPU copy.
/// * **Capacity** is bounded per (endpoint, tier), by default at
///   [`DEFAULT_CAPACITY`] blocks: engines report their own evictions
///   (`BlockRemoved`), so a correct stream never reaches an engine-sized bound,
///   but a peer that only stores (lost removes, or a hostile publisher) must not
///   grow kvroute's memory. Set the engine's real figure per endpoint with
///   [`SharedIndex::set_capacity`] when it is known (TensorRT-LLM's `created`
///   event, vLLM/SGLang `num_gpu_blocks`); [`IndexConfig::capacity_per_endpoint`]
///   is the starting bound of every slot ([`usize::MAX`]: unbounded). Each
///   bounded (endpoint, tier) keeps an insertion ring (one entry each time a key
///   becomes present); when a store exceeds the bound, entries are popped from
///   the front until one names a key that is still present, and that key is
///   evicted whatever its reference count. A key that was removed and stored again may therefore be evicted at
///   its earlier ring position: eviction is "oldest insertion first" on that
///   ring, not an exact LRU. Evictions are counted. A ring entry is a 4-byte
///   fingerprint of the key (`fingerprint`: two keys of one endpoint
///   sharing one — rare, see there — may be evicted in each other's order),
///   kept in 4 KiB chunks, so the ring costs 4 bytes per (endpoint, key)
///   pair, which is why unbounded indexes keep none.
/// * **Clearing** an endpoint hides it from readers at once (one atomic store of a
///   per-bank mask), then purges its keys 128 at a time under a shard's write
///   lock. With a ring it takes the keys from the ring, grouped by shard;
///   without one it scans the bank's shards, collecting the endpoint's keys
///   under a shard's read lock (readers proceed). Either way a reader
///   waits for at most one small batch of updates; the clearing writer pays
///   O(keys of the endpoint) with a ring, O(keys of the bank) without. No other
///   endpoint's inventory changes.
///
/// # Memory
///
/// A table entry is 12 bytes (key + a 32-bit holder code listing up to four
/// holders inline; keys held by more endpoints spill a 64-bit mask to a side
/// vector), five to a 64-byte bucket, so a key held by one endpoint costs
/// 12.8 bytes divided by the load factor of its table. A table grows by
/// half when it reaches 85 % full, so one table's load swings between 57
/// and 85 %; but the sizes a shard's tables take are offset from other
/// shards' (a growth lattice with a phase per shard), so at any inventory
/// size the 64 shards' loads are spread over the swing and the index stays
/// near its mean: ~19 bytes per unshared key, 23.0–23.4 per (endpoint,
/// key) pair with the insertion ring of a bounded tier, at every inventory
/// size (64 endpoints, 1 M to 6.4 M pairs; when every table grew at the
/// same size the figure followed the swing, 19.8 to 26.3 with rings). With
/// fewer shards ([`IndexConfig::shards`]) fewer phases average out: one
/// shard follows the swing. Shared keys cost one entry for all their
/// holders. [`SharedIndex::memory_bytes`] reports the figure for a metrics
/// gauge; a process's resident memory also holds what its allocator keeps
/// of freed tables (glibc after loading 64 × 100 K blocks: ~0.8 byte per
/// pair more).
///
/// # Concurrency
///
/// Readers (`score`) group the prompt's keys by shard and take each shard's read
/// lock once per call (per 256 keys); the prefix walk takes one per key it
/// looks up alone. Writers take a shard write lock per key, except
/// [`SharedIndex::store_chain`] into an unbounded tier (or a bounded one the
/// call cannot fill, so nothing is evicted), which write-locks the
/// shards of each group of 32 keys together, in ascending shard order (one
/// fence per group instead of per key lets the inserts' cache misses
/// overlap). One writer per endpoint is expected (the endpoint's ingest);
/// each endpoint's rings sit behind their own mutex, which readers never
/// take, so misuse is safe, only serialised. Readers never hold two shard
/// locks at once and writers that hold several took them in ascending order,
/// so no cycle of waits can form.
///
/// # Chain runs
///
/// [`SharedIndex::store_chain`] also records, per bank, runs of up to 32
/// consecutive chained keys one endpoint alone holds in the GPU tier (16
/// bytes per run, at most 2^18 − 1 runs and about 5 MiB per bank); the prefix
/// walk credits a whole valid run after one lookup when only its owner still
/// matches. Any change that could make a run's claim false (a member
/// removed, evicted, cleared or stored by a second endpoint) voids it.
///
/// ```
/// use kvroute_core::{BlockKey, EndpointId, Medium};
/// use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
///
/// let index = SharedIndex::new(2, IndexConfig::default());
/// let keys = [BlockKey(10), BlockKey(11), BlockKey(12)];
/// index.store(EndpointId(0), Medium::Gpu, &keys[..2])?;
/// index.store(EndpointId(1), Medium::Gpu, &keys[1..])?;
///
/// let mut out = [Overlap::default(); 2];
/// index.score(&keys, &mut out);
/// assert_eq!((out[0].blocks, out[0].prefix), (2, 2));
/// assert_eq!((out[1].blocks, out[1].prefix), (2, 0));
/// # Ok::<(), kvroute_ingest::IndexError>(())
/// ```
pub struct SharedIndex {
    banks: Box<[Bank]>,
    endpoints: Box<[Mutex<EndpointKeys>]>,
    /// Bits of a shard index (the shard count's log2).
    shard_bits: u32,
}

impl std::fmt::Debug for SharedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedIndex")
            .field("endpoints", &self.endpoints.len())
            .field("banks", &self.banks.len())
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
                        .map(|s| {
                            PaddedShard(RwLock::new(Shard::new(s as u32)), LineHint::default())
                        })
                        .collect(),
                    hidden: AtomicU64::new(0),
                    active: if in_bank == BANK_WIDTH {
                        u64::MAX
                    } else {
                        (1u64 << in_bank) - 1
                    },
                    runs: RunTable::default(),
                }
            })
            .collect();
        let capacity = u64::try_from(config.capacity_per_endpoint).unwrap_or(UNBOUNDED);
        Self {
            banks,
            endpoints: (0..endpoints)
                .map(|_| Mutex::new(EndpointKeys::new(capacity)))
                .collect(),
            shard_bits: shards.trailing_zeros(),
        }
    }

    /// Sets endpoint `e`'s bound in tier `medium` to `blocks` ([`usize::MAX`]:
    /// unbounded), e.g. from the engine's reported KV capacity. Lowering it
    /// evicts the oldest inserted keys at once; bounding a tier that was
    /// unbounded first builds its ring from the keys present (in key order).
    pub fn set_capacity(
        &self,
        e: EndpointId,
        medium: Medium,
        blocks: usize,
    ) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let capacity = u64::try_from(blocks).unwrap_or(UNBOUNDED);
        let mut guard = slot.lock();
        let slot: &mut EndpointKeys = &mut guard;
        let was_bounded = slot.bounded(tier);
        if let Some(c) = slot.capacity.get_mut(tier) {
            *c = capacity;
        }
        let mut stats = WriteStats::default();
        if capacity == UNBOUNDED {
            if let Some(ring) = slot.rings.get_mut(tier) {
                *ring = Ring::default();
            }
            return Ok(stats);
        }
        if !was_bounded {
            let mut keys = Vec::new();
            for shard in bank.shards.iter() {
                shard.0.read().collect_keys(tier, bit, &mut keys);
            }
            keys.sort_unstable();
            keys.dedup();
            if let Some(ring) = slot.rings.get_mut(tier) {
                *ring = keys.iter().map(|k| self.fingerprint(*k)).collect();
            }
        }
        while slot.live.get(tier).is_some_and(|l| *l > capacity) {
            let evicted = self.evict_one(bank, bit, tier, slot);
            if evicted == 0 {
                break;
            }
            stats.evicted += evicted;
        }
        Ok(stats)
    }

    /// Endpoint `e`'s bound in tier `medium` (`None`: unbounded or no such slot).
    #[must_use]
    pub fn capacity(&self, e: EndpointId, medium: Medium) -> Option<u64> {
        let (_, _, slot) = self.locate(e).ok()?;
        let slot = slot.lock();
        slot.capacity
            .get(medium.index())
            .copied()
            .filter(|c| *c != UNBOUNDED)
    }

    /// The most heap bytes the index may hold under its current bounds
    /// ([`BUDGET_BYTES_PER_KEY`] per block of capacity, plus fixed per-shard
    /// (its four tables' regions at their smallest, which never shrink),
    /// per-slot and per-bank overhead — the run table of a bank is bounded
    /// at about 5 MiB — and each ring's compaction slack); `None` while any
    /// (endpoint, tier) is unbounded. [`Self::memory_bytes`] stays below it
    /// whatever the peers send (tested under a flood of random stores).
    #[must_use]
    pub fn memory_budget(&self) -> Option<usize> {
        let fixed = self.banks.len()
            * (self.banks.first().map_or(0, |b| b.shards.len())
                * (std::mem::size_of::<PaddedShard>() + 4 * table::SMALLEST_BYTES)
                + RunTable::max_bytes())
            + self.endpoints.len() * std::mem::size_of::<Mutex<EndpointKeys>>();
        let mut total = fixed;
        for slot in self.endpoints.iter() {
            let slot = slot.lock();
            for c in slot.capacity {
                if c == UNBOUNDED {
                    return None;
                }
                let c = usize::try_from(c).ok()?;
                total = total
                    .checked_add(c.checked_mul(BUDGET_BYTES_PER_KEY)?)?
                    // Ring slack before a compaction, and a last chunk's unused part.
                    .checked_add(2 * RING_SLACK * std::mem::size_of::<u32>())?;
            }
        }
        Some(total)
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
        // The index is < shards by construction of `shard_bits`.
        &bank.shards[self.shard_index(key) & (bank.shards.len() - 1)].0
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
            let effect = self.shard(bank, key.0).write().store(
                tier,
                key.0,
                entry_hash(key.0),
                bit,
                &bank.runs,
                None,
            );
            match effect {
                StoreEffect::Inserted | StoreEffect::InsertedSole => {
                    stats.inserted += 1;
                    self.account_insert(bank, bit, tier, slot, key.0, &mut stats);
                }
                StoreEffect::Duplicate => stats.duplicate_stores += 1,
            }
        }
        Ok(stats)
    }

    /// Stores `keys`, consecutive blocks of one chain (each key a hash of its
    /// block and of the key before it; `parent` is the key before `keys[0]`,
    /// if known), for endpoint `e` in tier `medium`.
    ///
    /// The inventory changes exactly as with [`Self::store`]. In the GPU tier
    /// the index also records *runs*: consecutive keys that this endpoint
    /// alone holds, up to 32 per run, continued across calls whose `parent`
    /// ends a run (an engine storing one block per event while decoding).
    /// [`InventoryView::score_prefix`] then verifies a whole run with one
    /// lookup when only this endpoint still matches. A run is void as soon
    /// as any member leaves (remove, eviction, clear) or gains a second
    /// holder; the walk then looks its keys up one by one.
    ///
    /// Only pass real chain segments (the blocks of one engine
    /// `BlockStored`, in order): a run's claim rests on equal chained keys
    /// having equal histories, so keys that are not chained would let a
    /// prompt be credited with the keys between two members.
    ///
    /// ```
    /// use kvroute_core::{BlockKey, EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
    ///
    /// let index = SharedIndex::new(1, IndexConfig::default());
    /// let chain: Vec<BlockKey> = (1..=40u64).map(|k| BlockKey(k * 0x9e37_79b9)).collect();
    /// index.store_chain(EndpointId(0), Medium::Gpu, None, &chain[..24])?;
    /// index.store_chain(EndpointId(0), Medium::Gpu, Some(chain[23]), &chain[24..])?;
    /// let mut out = [Overlap::default()];
    /// index.score_prefix(&chain, &mut out);
    /// assert_eq!(out[0].prefix, 40);
    /// # Ok::<(), kvroute_ingest::IndexError>(())
    /// ```
    pub fn store_chain(
        &self,
        e: EndpointId,
        medium: Medium,
        parent: Option<BlockKey>,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        if medium != Medium::Gpu {
            return self.store(e, medium, keys);
        }
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut guard = slot.lock();
        let slot: &mut EndpointKeys = &mut guard;
        let mut stats = WriteStats::default();
        let n = u32::try_from(keys.len()).unwrap_or(u32::MAX - 2);
        let mut chain = ChainWriter::default();
        if let Some(p) = parent {
            match slot.find_tail(p.0) {
                Some(Tail { run: Some(run), .. }) => {
                    // The reservation covers every key of the call plus one
                    // held until the run is published.
                    if let Some(len) = bank.runs.try_extend(run, bit, p.0, n + 1) {
                        chain.cur = Some(OpenRun {
                            run,
                            len,
                            end: p.0,
                            left: n + 1,
                        });
                    }
                }
                Some(Tail { run: None, .. }) => chain.pending = Some(p.0),
                None => {}
            }
        }
        // A bounded tier takes the grouped path too when the call cannot
        // reach the bound (every key new): nothing is evicted, so the ring
        // gets the same entries in the same order as key by key. Engines
        // report their own evictions, so a correct stream stays on it.
        let room = slot
            .capacity
            .get(tier)
            .copied()
            .unwrap_or(UNBOUNDED)
            .saturating_sub(slot.live.get(tier).copied().unwrap_or(0));
        let grouped = !slot.bounded(tier) || u64::try_from(keys.len()).is_ok_and(|n| n <= room);
        if grouped {
            self.store_chain_grouped(bank, bit, tier, slot, keys, &mut chain, &mut stats);
            self.maybe_compact(bank, bit, tier, slot);
        }
        let per_key = if grouped { &[] } else { keys };
        for (i, key) in per_key.iter().enumerate() {
            let remaining = n.saturating_sub(u32::try_from(i).unwrap_or(u32::MAX));
            let (effect, head) = {
                let mut g = self.shard(bank, key.0).write();
                let candidate = chain.candidate();
                let effect = g.store(tier, key.0, entry_hash(key.0), bit, &bank.runs, candidate);
                let head = if effect == StoreEffect::InsertedSole && candidate.is_some() {
                    chain.joined(key.0);
                    None
                } else if effect == StoreEffect::InsertedSole {
                    chain.join(&mut g, &bank.runs, key.0, bit, remaining)
                } else {
                    chain.close(&bank.runs);
                    chain.pending = None;
                    None
                };
                (effect, head)
            };
            if let Some(head) = head {
                // The key before this one heads the run; it lives in another
                // shard, locked only after this one is released.
                if self
                    .shard(bank, head)
                    .write()
                    .attach_run(head, bit, chain.run_id())
                {
                    chain.head_attached();
                }
            }
            match effect {
                StoreEffect::Inserted | StoreEffect::InsertedSole => {
                    stats.inserted += 1;
                    self.account_insert(bank, bit, tier, slot, key.0, &mut stats);
                }
                StoreEffect::Duplicate => stats.duplicate_stores += 1,
            }
        }
        let last = keys.last().map(|k| k.0);
        match chain.cur.take() {
            Some(c) => {
                bank.runs.finish(c.run, c.end, c.len, c.left);
                slot.push_tail(c.end, Some(c.run));
            }
            None => {
                if let (Some(p), Some(l)) = (chain.pending, last) {
                    if p == l {
                        slot.push_tail(l, None);
                    }
                }
            }
        }
        Ok(stats)
    }

    /// The grouped part of [`Self::store_chain`] (an unbounded tier, or a
    /// bounded one the call cannot fill): keys in groups of
    /// [`LOCK_GROUP`], each group's shards write-locked together (in
    /// ascending order, so writers cannot deadlock; readers hold one lock at
    /// a time) and released together. Each shard lock is a full fence that
    /// waits for the previous insert's cache misses; with one lock per key
    /// the inserts run one after the other, under a group's locks they
    /// overlap.
    #[allow(clippy::too_many_arguments)]
    fn store_chain_grouped(
        &self,
        bank: &Bank,
        bit: u32,
        tier: usize,
        slot: &mut EndpointKeys,
        keys: &[BlockKey],
        chain: &mut ChainWriter,
        stats: &mut WriteStats,
    ) {
        let n = u32::try_from(keys.len()).unwrap_or(u32::MAX - 2);
        let bounded = slot.bounded(tier);
        let mut done = 0u32;
        for group in keys.chunks(LOCK_GROUP) {
            // One hash per key names its shard, its home bucket and its
            // ring fingerprint.
            let mut hashes = [0u64; LOCK_GROUP];
            for (h, key) in hashes.iter_mut().zip(group) {
                *h = entry_hash(key.0);
            }
            let hashes = hashes.get(..group.len()).unwrap_or_default();
            // The lines' misses start before the locks, whose fences would
            // otherwise wait for them one group at a time.
            self.prefetch_hashes(bank, hashes);
            // A run started at the group's first key is headed by the pending
            // key, whose shard is locked with the group's.
            let pending = chain.pending.map(|p| self.shard_index(p));
            let mut locks = GroupLocks::lock(
                bank,
                hashes.iter().map(|h| self.shard_of_hash(*h)).chain(pending),
            );
            // Every line's address first (arithmetic only), then one plain
            // load each in a tight loop: all of the group's misses are in
            // flight at once, and the inserts find their lines cached.
            let mut lines: [[Option<&u32>; 2]; LOCK_GROUP] = [[None; 2]; LOCK_GROUP];
            for (h, line) in hashes.iter().zip(&mut lines) {
                if let Some(g) = locks.get(self.shard_of_hash(*h)) {
                    *line = g.home_lines(tier, *h);
                }
            }
            let mut touched = 0u32;
            for line in lines.iter().take(group.len()).flatten().flatten() {
                touched ^= **line;
            }
            // Kept: the touches exist for their loads alone.
            std::hint::black_box(touched);
            for (key, h) in group.iter().zip(hashes) {
                let remaining = n.saturating_sub(done);
                done += 1;
                let Some(g) = locks.get_mut(self.shard_of_hash(*h)) else {
                    continue;
                };
                let candidate = chain.candidate();
                let effect = g.store(tier, key.0, *h, bit, &bank.runs, candidate);
                if effect == StoreEffect::InsertedSole && candidate.is_some() {
                    chain.joined(key.0);
                } else if effect == StoreEffect::InsertedSole {
                    if let Some(head) = chain.join(g, &bank.runs, key.0, bit, remaining) {
                        let run = chain.run_id();
                        let attached = locks
                            .get_mut(self.shard_index(head))
                            .is_some_and(|h| h.attach_run(head, bit, run));
                        if attached {
                            chain.head_attached();
                        }
                    }
                } else {
                    chain.close(&bank.runs);
                    chain.pending = None;
                }
                match effect {
                    StoreEffect::Inserted | StoreEffect::InsertedSole => {
                        stats.inserted += 1;
                        if let Some(live) = slot.live.get_mut(tier) {
                            *live += 1;
                        }
                        if bounded {
                            if let Some(ring) = slot.rings.get_mut(tier) {
                                ring.push_back(self.fingerprint_of_hash(*h));
                            }
                        }
                    }
                    StoreEffect::Duplicate => stats.duplicate_stores += 1,
                }
            }
            locks.publish_hints(bank);
        }
    }

    /// Prefetches the GPU-table lines the keys whose [`entry_hash`]es are
    /// `hashes` will be inserted into, from their shards' [`LineHint`]s,
    /// without their locks (see [`prefetch`]).
    #[inline]
    fn prefetch_hashes(&self, bank: &Bank, hashes: &[u64]) {
        let mask = bank.shards.len() - 1;
        for h in hashes {
            if let Some(shard) = bank.shards.get(self.shard_of_hash(*h) & mask) {
                for addr in table::hinted_lines::<PREFETCH_LINES>(shard.1.get(), *h)
                    .into_iter()
                    .flatten()
                {
                    prefetch_line(addr);
                }
            }
        }
    }

    /// Live count, ring and bound after `key` became present.
    fn account_insert(
        &self,
        bank: &Bank,
        bit: u32,
        tier: usize,
        slot: &mut EndpointKeys,
        key: u64,
        stats: &mut WriteStats,
    ) {
        if let Some(live) = slot.live.get_mut(tier) {
            *live += 1;
        }
        if !slot.bounded(tier) {
            return;
        }
        if let Some(ring) = slot.rings.get_mut(tier) {
            ring.push_back(self.fingerprint(key));
        }
        let cap = slot.capacity.get(tier).copied().unwrap_or(UNBOUNDED);
        if slot.live.get(tier).is_some_and(|l| *l > cap) {
            stats.evicted += self.evict_one(bank, bit, tier, slot);
        }
        // Repeated store/remove churn of present keys grows the ring
        // without removes to trigger a compaction.
        self.maybe_compact(bank, bit, tier, slot);
    }

    fn evict_one(&self, bank: &Bank, bit: u32, tier: usize, slot: &mut EndpointKeys) -> u64 {
        let Some(ring) = slot.rings.get_mut(tier) else {
            return 0;
        };
        while let Some(fp) = ring.pop_front() {
            let (shard, tag, tag_bits) = self.split_fingerprint(fp);
            let purged = {
                let mut g = bank.shards[shard & (bank.shards.len() - 1)].0.write();
                g.key_by_tag(tier, tag, tag_bits, bit, 0)
                    .is_some_and(|key| g.purge(tier, key, bit, &bank.runs))
            };
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
            let effect = self
                .shard(bank, key.0)
                .write()
                .remove(tier, key.0, bit, &bank.runs);
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
        if !slot.bounded(tier) {
            return;
        }
        let live = slot.live.get(tier).copied().unwrap_or(0);
        let Some(ring) = slot.rings.get_mut(tier) else {
            return;
        };
        if (ring.len() as u64) <= live.saturating_mul(2) + RING_SLACK as u64 {
            return;
        }
        // Per fingerprint: entries kept so far, and this endpoint's keys
        // present with it (usually one or none). The oldest entries of a
        // fingerprint stay, as many as there are such keys.
        let mut seen: KeyMap<(u32, u32)> = KeyMap::default();
        seen.reserve(usize::try_from(live).unwrap_or(0));
        ring.retain(|fp| {
            let (kept, present) = seen.entry(u64::from(fp)).or_insert_with(|| {
                let (shard, tag, tag_bits) = self.split_fingerprint(fp);
                let present = bank.shards[shard & (bank.shards.len() - 1)]
                    .0
                    .read()
                    .count_by_tag(tier, tag, tag_bits, bit);
                (0, present)
            });
            if *kept < *present {
                *kept += 1;
                true
            } else {
                false
            }
        });
    }

    /// Empties endpoint `e` (all tiers). Readers see it empty immediately.
    pub fn clear_endpoint(&self, e: EndpointId) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let flag = 1u64 << bit;
        let mut slot = slot.lock();
        bank.hidden.fetch_or(flag, Ordering::AcqRel);
        let mut stats = WriteStats::default();
        let mut batch = Vec::new();
        for tier in 0..4 {
            if slot.live.get(tier).is_some_and(|l| *l == 0) {
                continue;
            }
            let bounded = slot.bounded(tier);
            let ring = slot.rings.get_mut(tier).map(std::mem::take);
            match ring {
                Some(ring) if bounded => {
                    // Grouped by shard so each write lock covers a batch of keys.
                    let mut by_shard: Vec<(usize, u32)> = ring
                        .iter()
                        .map(|fp| (self.split_fingerprint(fp).0, fp))
                        .collect();
                    drop(ring);
                    by_shard.sort_unstable();
                    for group in by_shard.chunk_by(|a, b| a.0 == b.0) {
                        let Some((index, _)) = group.first() else {
                            continue;
                        };
                        let shard = &bank.shards[*index & (bank.shards.len() - 1)].0;
                        for fps in group.chunks(PURGE_BATCH) {
                            let mut guard = shard.write();
                            for (_, fp) in fps {
                                let (_, tag, tag_bits) = self.split_fingerprint(*fp);
                                if let Some(key) = guard.key_by_tag(tier, tag, tag_bits, bit, 0) {
                                    stats.cleared +=
                                        u64::from(guard.purge(tier, key, bit, &bank.runs));
                                }
                            }
                        }
                    }
                }
                _ => {
                    for shard in bank.shards.iter() {
                        stats.cleared += purge_scanned(&shard.0, tier, bit, &mut batch, &bank.runs);
                    }
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
                .sum::<usize>();
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
            })
            .sum();
        tables + rings
    }

    /// The lock shard `key` lands in (tests of adversarial key choice; not a
    /// stable API).
    #[doc(hidden)]
    #[must_use]
    pub fn shard_of(&self, key: BlockKey) -> usize {
        self.shard_index(key.0)
    }

    /// A ring entry for `key`: its shard index in the top bits, then the top
    /// bits of its table hash — 4 bytes instead of the key's 8. Eviction and
    /// clearing find the key again by scanning the entries that hash may
    /// lie in (its home bucket and overflow chain) for one this endpoint
    /// holds with the same top bits ([`Shard::key_by_tag`]). Two keys of one
    /// endpoint can share a fingerprint only by sharing a home bucket and the
    /// following hash bits (a pair of a bucket's keys about once in
    /// 2^(32 − shard bits − log2 of the table's buckets)); each of their
    /// ring entries then evicts either, so eviction order between the two
    /// is undefined, and nothing else changes: every fingerprint still
    /// evicts or clears one key, and compaction keeps one entry per
    /// matching key.
    #[inline]
    fn fingerprint(&self, key: u64) -> u32 {
        self.fingerprint_of_hash(entry_hash(key))
    }

    /// [`Self::fingerprint`] of the key whose [`entry_hash`] is `hash`.
    #[inline]
    fn fingerprint_of_hash(&self, hash: u64) -> u32 {
        let shard = self.shard_of_hash(hash);
        let s = self.shard_bits;
        let tag_bits = 32 - s;
        let tag = (hash >> (64 - tag_bits)) as u32;
        if s == 0 {
            tag
        } else {
            ((shard as u32) << tag_bits) | tag
        }
    }

    /// A fingerprint's shard, hash tag and the tag's width in bits.
    #[inline]
    fn split_fingerprint(&self, fp: u32) -> (usize, u32, u32) {
        let s = self.shard_bits;
        let tag_bits = 32 - s;
        if s == 0 {
            (0, fp, 32)
        } else {
            (
                (fp >> tag_bits) as usize,
                fp & ((1 << tag_bits) - 1),
                tag_bits,
            )
        }
    }

    #[inline]
    fn shard_index(&self, key: u64) -> usize {
        self.shard_of_hash(entry_hash(key))
    }

    /// The shard of the key whose [`entry_hash`] is `hash`: its low bits,
    /// as a table's home bucket and a fingerprint's tag take the high ones.
    /// One hash per key serves the shard, the bucket and the fingerprint.
    #[inline]
    fn shard_of_hash(&self, hash: u64) -> usize {
        (hash as usize) & ((1usize << self.shard_bits) - 1)
    }

    /// Looks up the tier masks of `chunk` in `bank`, taking each shard's read lock
    /// once: keys are bucketed by shard (a counting sort on the stack) and visited
    /// shard by shard; `masks[i]` receives key `i`'s masks, and `hints[i]`
    /// (if given) its run's jump data (`len` 0: none).
    fn lookup_chunk(
        &self,
        bank: &Bank,
        chunk: &[BlockKey],
        masks: &mut [[u64; 4]; SCORE_CHUNK],
        mut hints: Option<&mut [RunHint; SCORE_CHUNK]>,
    ) {
        let mut shard_of = [0u16; SCORE_CHUNK];
        let mut hashes = [0u64; SCORE_CHUNK];
        let mut starts = [0u16; SORT_BUCKETS + 1];
        for ((slot, h), key) in shard_of.iter_mut().zip(&mut hashes).zip(chunk) {
            *h = entry_hash(key.0);
            // Above SORT_BUCKETS shards, several shards share a bucket; the walk
            // below then re-locks when the shard changes, which stays correct.
            *slot = (self.shard_of_hash(*h) % (1 << 16)) as u16;
            if let Some(c) = starts.get_mut(usize::from(*slot) % SORT_BUCKETS + 1) {
                *c += 1;
            }
        }
        for b in 1..starts.len() {
            let prev = starts.get(b - 1).copied().unwrap_or(0);
            if let Some(c) = starts.get_mut(b) {
                *c += prev;
            }
        }
        let mut order = [0u16; SCORE_CHUNK];
        for (i, s) in shard_of.iter().enumerate().take(chunk.len()) {
            if let Some(next) = starts.get_mut(usize::from(*s) % SORT_BUCKETS) {
                if let Some(o) = order.get_mut(usize::from(*next)) {
                    *o = i as u16;
                }
                *next += 1;
            }
        }
        let mut held: Option<(u16, parking_lot::RwLockReadGuard<'_, Shard>)> = None;
        for &i in order.iter().take(chunk.len()) {
            let i = usize::from(i);
            let (Some(key), Some(h), Some(s), Some(dst)) = (
                chunk.get(i),
                hashes.get(i),
                shard_of.get(i),
                masks.get_mut(i),
            ) else {
                continue;
            };
            let guard = match &mut held {
                Some((cur, guard)) if *cur == *s => guard,
                _ => {
                    drop(held.take());
                    let lock = &bank.shards[usize::from(*s) & (bank.shards.len() - 1)].0;
                    &mut held.insert((*s, lock.read())).1
                }
            };
            match hints.as_deref_mut().and_then(|h| h.get_mut(i)) {
                Some(hint) => {
                    let (m, run) = guard.masks_and_run(*h, key.0);
                    *dst = m;
                    // Read under the shard lock: the entry naming the run
                    // keeps its slot from being reused meanwhile.
                    *hint = run
                        .and_then(|(r, owner)| bank.runs.hint(r, owner))
                        .unwrap_or_default();
                }
                None => *dst = guard.masks(*h, key.0),
            }
        }
    }

    /// One key looked up alone: its masks and run jump data.
    #[inline]
    fn lookup_one(&self, bank: &Bank, key: u64) -> ([u64; 4], RunHint) {
        let hash = entry_hash(key);
        let guard = bank.shards[self.shard_of_hash(hash) & (bank.shards.len() - 1)]
            .0
            .read();
        let (masks, run) = guard.masks_and_run(hash, key);
        let hint = run
            .and_then(|(r, owner)| bank.runs.hint(r, owner))
            .unwrap_or_default();
        (masks, hint)
    }

    /// The prefix-only walk of one bank ([`InventoryView::score_prefix`]).
    ///
    /// Keys are visited in prompt order: [`DIRECT_LOOKUPS`] lookups one key at
    /// a time (a prompt nobody holds costs one), then shard-sorted chunks of
    /// [`SCORE_CHUNK`] keys, so a long match shared by many endpoints takes
    /// each shard lock about once per chunk. Once a single endpoint still
    /// matches and the key names one of its valid runs, the walk jumps to
    /// the run's last member if the prompt holds it further on (see
    /// [`SharedIndex::store_chain`]), then looks the next key up alone. The
    /// walk ends when no endpoint of the bank still matches from block 0.
    fn score_bank_prefix(&self, bank: &Bank, keys: &[BlockKey], out: &mut [Overlap]) {
        let n = out.len().min(BANK_WIDTH);
        let out = out.get_mut(..n).unwrap_or_default();
        let mut walk = PrefixWalk::new(bank.active & !bank.hidden.load(Ordering::Acquire), out);
        let mut at = 0;
        let mut failed = u32::MAX;
        let mut lookups = 0;
        while walk.alive != 0 && at < keys.len() && lookups < DIRECT_LOOKUPS {
            lookups += 1;
            match self.direct_step(bank, keys, at, &mut walk, &mut failed) {
                Some(next) => at = next,
                None => break,
            }
        }
        if walk.alive != 0 && at < keys.len() {
            self.prefix_chunks(bank, keys, at, &mut walk, &mut failed);
        }
        walk.finish(keys.len());
    }

    /// Visits key `at` alone; the next position to visit, or `None` once no
    /// endpoint is left.
    #[inline]
    fn direct_step(
        &self,
        bank: &Bank,
        keys: &[BlockKey],
        at: usize,
        walk: &mut PrefixWalk<'_>,
        failed: &mut u32,
    ) -> Option<usize> {
        let key = keys.get(at)?;
        let (masks, hint) = self.lookup_one(bank, key.0);
        if !walk.visit(at, masks) {
            return None;
        }
        Some(jump_target(keys, at, &hint, walk.alive, failed).unwrap_or(at) + 1)
    }

    /// The chunked part of [`Self::score_bank_prefix`], from key `start` on; its
    /// own frame so the short walks never initialise the lookup buffers.
    #[inline(never)]
    fn prefix_chunks(
        &self,
        bank: &Bank,
        keys: &[BlockKey],
        start: usize,
        walk: &mut PrefixWalk<'_>,
        failed: &mut u32,
    ) {
        let mut masks = [[0u64; 4]; SCORE_CHUNK];
        let mut hints = [RunHint::default(); SCORE_CHUNK];
        let mut start = start;
        'walk: while walk.alive != 0 && start < keys.len() {
            let end = start.saturating_add(SCORE_CHUNK).min(keys.len());
            let chunk = keys.get(start..end).unwrap_or_default();
            self.lookup_chunk(bank, chunk, &mut masks, Some(&mut hints));
            let mut j = 0;
            while j < chunk.len() {
                let (Some(m), Some(h)) = (masks.get(j), hints.get(j)) else {
                    break;
                };
                if !walk.visit(start + j, *m) {
                    break 'walk;
                }
                let Some(last) = jump_target(keys, start + j, h, walk.alive, failed) else {
                    j += 1;
                    continue;
                };
                if last + 1 < end {
                    j = last + 1 - start;
                    continue;
                }
                // Past this chunk: the key after a run usually heads the
                // next one, so look keys up alone while jumps keep coming.
                let mut next = last + 1;
                while walk.alive != 0 && next < keys.len() {
                    let before = next;
                    match self.direct_step(bank, keys, next, walk, failed) {
                        Some(after) => next = after,
                        None => break 'walk,
                    }
                    if next == before + 1 {
                        break;
                    }
                }
                start = next;
                continue 'walk;
            }
            start = end;
        }
    }

    fn score_bank(&self, bank: &Bank, keys: &[BlockKey], out: &mut [Overlap]) {
        let active = bank.active & !bank.hidden.load(Ordering::Acquire);
        let mut blocks = SlicedCounters::ZERO;
        let mut by_tier = [SlicedCounters::ZERO; 4];
        let mut alive = active;
        if active != 0 {
            let mut masks = [[0u64; 4]; SCORE_CHUNK];
            for chunk in keys.chunks(SCORE_CHUNK) {
                self.lookup_chunk(bank, chunk, &mut masks, None);
                for &[gpu, cpu, disk, ext] in masks.iter().take(chunk.len()) {
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
        }
        let mut block_counts = [0u32; BANK_WIDTH];
        blocks.spread(&mut block_counts);
        let mut tier_counts = [[0u32; BANK_WIDTH]; 4];
        for (counter, dst) in by_tier.iter().zip(&mut tier_counts) {
            counter.spread(dst);
        }
        for (bit, slot) in out.iter_mut().enumerate().take(BANK_WIDTH) {
            let mut overlap = Overlap {
                blocks: block_counts.get(bit).copied().unwrap_or(0),
                ..Overlap::default()
            };
            for (dst, src) in overlap.prefix_by_medium.iter_mut().zip(&tier_counts) {
                *dst = src.get(bit).copied().unwrap_or(0);
            }
            overlap.prefix = overlap.prefix_by_medium.iter().sum();
            *slot = overlap;
        }
    }
}

/// [`GroupLocks::position`] of a shard the group does not hold.
const NOT_LOCKED: u8 = u8::MAX;

/// The write guards of one `store_chain` lock group: its distinct shards,
/// locked in ascending order (the order every writer holding several
/// takes them in), released together when dropped.
struct GroupLocks<'a> {
    /// The distinct shards, ascending.
    shards: [usize; LOCK_GROUP + 1],
    count: usize,
    /// For a bank of at most 64 shards, each shard's guard position
    /// ([`NOT_LOCKED`]: none), so finding a key's guard is one load, not a
    /// search.
    position: Option<[u8; 64]>,
    guards: [Option<RwLockWriteGuard<'a, Shard>>; LOCK_GROUP + 1],
}

impl<'a> GroupLocks<'a> {
    /// Write-locks the distinct shards among `shards` (at most
    /// `LOCK_GROUP + 1`; more are ignored).
    fn lock(bank: &'a Bank, shards: impl Iterator<Item = usize>) -> Self {
        let mut out = Self {
            shards: [0; LOCK_GROUP + 1],
            count: 0,
            position: None,
            guards: std::array::from_fn(|_| None),
        };
        let mask = bank.shards.len() - 1;
        if bank.shards.len() <= 64 {
            // Ascending and distinct from a bit set: no sort.
            let mut set = 0u64;
            for s in shards.take(LOCK_GROUP + 1) {
                set |= 1u64 << (s & mask & 63);
            }
            let mut position = [NOT_LOCKED; 64];
            let mut rest = set;
            while rest != 0 {
                let s = rest.trailing_zeros() as usize;
                if let (Some(dst), Some(p)) = (out.shards.get_mut(out.count), position.get_mut(s)) {
                    *dst = s;
                    *p = out.count as u8;
                }
                rest &= rest - 1;
                out.count += 1;
            }
            out.position = Some(position);
        } else {
            for s in shards.take(LOCK_GROUP + 1) {
                if let Some(dst) = out.shards.get_mut(out.count) {
                    *dst = s & mask;
                    out.count += 1;
                }
            }
            let all = out.shards.get_mut(..out.count).unwrap_or_default();
            all.sort_unstable();
            let mut unique = 0;
            for i in 0..all.len() {
                let s = all.get(i).copied();
                if unique == 0 || s != all.get(unique - 1).copied() {
                    if let (Some(dst), Some(s)) = (all.get_mut(unique), s) {
                        *dst = s;
                    }
                    unique += 1;
                }
            }
            out.count = unique;
        }
        let locked = out.shards.get(..out.count).unwrap_or_default();
        for (g, s) in out.guards.iter_mut().zip(locked) {
            *g = bank.shards.get(*s).map(|shard| shard.0.write());
        }
        out
    }

    /// Where `shard`'s guard is, if the group holds it.
    #[inline]
    fn position(&self, shard: usize) -> Option<usize> {
        match &self.position {
            Some(position) => position
                .get(shard)
                .filter(|p| **p != NOT_LOCKED)
                .map(|p| usize::from(*p)),
            None => self
                .shards
                .get(..self.count)
                .and_then(|s| s.binary_search(&shard).ok()),
        }
    }

    /// Publishes each held shard's [`LineHint`] (its table may have been
    /// rebuilt under the group's lock).
    fn publish_hints(&self, bank: &Bank) {
        let held = self.shards.get(..self.count).unwrap_or_default();
        for (s, g) in held.iter().zip(&self.guards) {
            if let (Some(shard), Some(g)) = (bank.shards.get(*s), g) {
                shard.1.publish(g.line_hint());
            }
        }
    }

    #[inline]
    fn get(&self, shard: usize) -> Option<&Shard> {
        self.position(shard)
            .and_then(|i| self.guards.get(i))
            .and_then(Option::as_deref)
    }

    #[inline]
    fn get_mut(&mut self, shard: usize) -> Option<&mut Shard> {
        self.position(shard)
            .and_then(|i| self.guards.get_mut(i))
            .and_then(Option::as_deref_mut)
    }
}

/// A run being written by one `store_chain` call.
#[derive(Clone, Copy)]
struct OpenRun {
    run: u32,
    /// Members attached so far (published ones included).
    len: u32,
    /// Last member.
    end: u64,
    /// Reserved member references not used yet (at least one until
    /// published, so the slot cannot be freed and reused under the writer).
    left: u32,
}

/// Run bookkeeping of one `store_chain` call.
#[derive(Default)]
struct ChainWriter {
    cur: Option<OpenRun>,
    /// The previous key, stored by this endpoint alone and in no run: it can
    /// head a run if the next key joins it.
    pending: Option<u64>,
}

impl ChainWriter {
    /// `key` (whose shard `g` is locked) was just inserted with this endpoint
    /// as its only holder: attach it to the open run, or start one headed by
    /// the pending key (returned: the caller attaches it after releasing `g`).
    fn join(
        &mut self,
        g: &mut Shard,
        runs: &RunTable,
        key: u64,
        bit: u32,
        remaining: u32,
    ) -> Option<u64> {
        if let Some(c) = &mut self.cur {
            if c.len < MAX_RUN && c.left > 1 && g.attach_run(key, bit, c.run) {
                c.len += 1;
                c.end = key;
                c.left -= 1;
                return None;
            }
        }
        self.close(runs);
        let Some(head) = self.pending.take() else {
            self.pending = Some(key);
            return None;
        };
        // This key and the rest of the call, the head, one held back.
        let reserve = remaining.saturating_add(2);
        let Some(run) = runs.alloc(bit, reserve) else {
            self.pending = Some(key);
            return None;
        };
        let mut open = OpenRun {
            run,
            len: 0,
            end: key,
            left: reserve,
        };
        if g.attach_run(key, bit, run) {
            open.len = 1;
            open.left -= 1;
        }
        self.cur = Some(open);
        Some(head)
    }

    /// The open run a key new to the table can join as it is inserted.
    fn candidate(&self) -> Option<u32> {
        self.cur
            .filter(|c| c.len < MAX_RUN && c.left > 1)
            .map(|c| c.run)
    }

    /// The key inserted with [`Self::candidate`]'s run named.
    fn joined(&mut self, key: u64) {
        if let Some(c) = &mut self.cur {
            c.len += 1;
            c.end = key;
            c.left -= 1;
        }
    }

    fn run_id(&self) -> u32 {
        self.cur.map_or(u32::MAX, |c| c.run)
    }

    fn head_attached(&mut self) {
        if let Some(c) = &mut self.cur {
            c.len += 1;
            c.left = c.left.saturating_sub(1);
        }
    }

    /// Publishes the open run, if any.
    fn close(&mut self, runs: &RunTable) {
        if let Some(c) = self.cur.take() {
            runs.finish(c.run, c.end, c.len, c.left);
        }
    }
}

/// State of one bank's prefix walk; writes each endpoint's overlap into `out`
/// the moment its run ends (its figures are final then), so nothing
/// per endpoint is kept or initialised beyond the output itself.
struct PrefixWalk<'o> {
    /// Endpoints holding every key visited so far.
    alive: u64,
    /// Endpoints whose slot has been written.
    written: u64,
    /// Prefix blocks whose fastest tier is CPU, disk, external; created on
    /// the first such block (most inventories are GPU-only).
    slow: Option<[SlicedCounters; 3]>,
    out: &'o mut [Overlap],
}

impl<'o> PrefixWalk<'o> {
    fn new(alive: u64, out: &'o mut [Overlap]) -> Self {
        Self {
            alive,
            written: 0,
            slow: None,
            out,
        }
    }

    /// Writes the overlaps of the endpoints in `mask`, whose runs are `at` long.
    fn end(&mut self, mask: u64, at: usize) {
        let p = u32::try_from(at).unwrap_or(u32::MAX);
        self.written |= mask;
        if self.slow.is_none() {
            // GPU-only: one value for every endpoint of the mask; a whole
            // bank ending at once (a miss) is a plain fill.
            let value = Overlap {
                blocks: p,
                prefix: p,
                prefix_by_medium: [p, 0, 0, 0],
            };
            let n = self.out.len();
            let all = if n >= BANK_WIDTH {
                u64::MAX
            } else {
                (1u64 << n) - 1
            };
            if mask & all == all {
                if p == 0 {
                    // A miss everywhere: a constant fill (a memset) instead
                    // of six stores per endpoint.
                    self.out.fill(Overlap::default());
                } else {
                    self.out.fill(value);
                }
                return;
            }
            let mut rest = mask;
            while rest != 0 {
                if let Some(slot) = self.out.get_mut(rest.trailing_zeros() as usize) {
                    *slot = value;
                }
                rest &= rest - 1;
            }
            return;
        }
        let mut rest = mask;
        while rest != 0 {
            let bit = rest.trailing_zeros();
            rest &= rest - 1;
            let Some(slot) = self.out.get_mut(bit as usize) else {
                continue;
            };
            let [cpu, disk, ext] = match &self.slow {
                Some(slow) => slow.each_ref().map(|c| c.get(bit)),
                None => [0; 3],
            };
            *slot = Overlap {
                blocks: p,
                prefix: p,
                // Each prefix block sits in exactly one "fastest tier": the
                // GPU share is what the slower tiers do not account for.
                prefix_by_medium: [p.saturating_sub(cpu + disk + ext), cpu, disk, ext],
            };
        }
    }

    /// Takes key `at`'s tier masks; false once no endpoint is left.
    #[inline]
    fn visit(&mut self, at: usize, [gpu, cpu, disk, ext]: [u64; 4]) -> bool {
        let alive = self.alive;
        let held = (gpu | cpu | disk | ext) & alive;
        if held != alive {
            self.end(alive & !held, at);
            self.alive = held;
            if held == 0 {
                return false;
            }
        }
        if (cpu | disk | ext) & held != 0 {
            let [c, d, x] = self.slow.get_or_insert([SlicedCounters::ZERO; 3]);
            c.add(cpu & held & !gpu);
            d.add(disk & held & !(gpu | cpu));
            x.add(ext & held & !(gpu | cpu | disk));
        }
        true
    }

    /// Ends the walk of a prompt of `len` keys: the endpoints still matching
    /// hold all of it; those never matching get the empty overlap.
    fn finish(mut self, len: usize) {
        if self.alive != 0 {
            self.end(self.alive, len);
        }
        let written = self.written;
        let n = self.out.len();
        let all = if n >= BANK_WIDTH {
            u64::MAX
        } else {
            (1u64 << n) - 1
        };
        if written & all == all {
            return;
        }
        for (bit, slot) in self.out.iter_mut().enumerate() {
            if written & (1u64 << bit) == 0 {
                *slot = Overlap::default();
            }
        }
    }
}

/// The last position the walk may credit after visiting key `at`: the
/// position of the run's last member if only the run's owner still matches
/// and the prompt holds that key within the run's length (equal chained
/// keys have equal histories, so every key between is a member). `None`
/// (and `failed` set, so later members do not rescan) when the prompt leaves
/// the run first.
#[inline]
fn jump_target(
    keys: &[BlockKey],
    at: usize,
    hint: &RunHint,
    alive: u64,
    failed: &mut u32,
) -> Option<usize> {
    if hint.len < 2 || alive != 1u64 << (hint.owner & 63) || hint.run == *failed {
        return None;
    }
    let window = keys.get(at + 1..)?;
    let window = window.get(..window.len().min(hint.len as usize - 1))?;
    match window.iter().position(|k| k.0 == hint.end) {
        Some(p) => Some(at + 1 + p),
        None => {
            *failed = hint.run;
            None
        }
    }
}

/// Purges endpoint `bit`'s keys of `tier` from one shard: the keys are collected
/// under the read lock (readers keep going), then dropped [`PURGE_BATCH`] at a
/// time under the write lock, so a reader waits for at most one batch.
fn purge_scanned(
    shard: &RwLock<Shard>,
    tier: usize,
    bit: u32,
    batch: &mut Vec<u64>,
    runs: &RunTable,
) -> u64 {
    batch.clear();
    shard.read().collect_keys(tier, bit, batch);
    let mut purged = 0;
    for keys in batch.chunks(PURGE_BATCH) {
        let mut guard = shard.write();
        for key in keys {
            purged += u64::from(guard.purge(tier, *key, bit, runs));
        }
    }
    purged
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

    fn score_prefix(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        let n = self.endpoints.len().min(out.len());
        let out = out.get_mut(..n).unwrap_or_default();
        for (bank, chunk) in self.banks.iter().zip(out.chunks_mut(BANK_WIDTH)) {
            self.score_bank_prefix(bank, keys, chunk);
        }
    }
}
