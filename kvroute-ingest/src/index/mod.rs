//! The shared inventory index ([`SharedIndex`], whose docs hold the layout,
//! semantics and an example).
//!
//! * this module: the index's shape (banks, shards, endpoint slots), its
//!   construction, capacity bounds and key fingerprints;
//! * `config`: its configuration, errors and write counters;
//! * `write`: stores, removes, eviction and clearing; `chain`: the lock
//!   groups and run bookkeeping of chain stores;
//! * `query`: per-endpoint lookups and sizes;
//! * `score`: scoring a prompt against every endpoint (the read path);
//!   `universal`: the keys every endpoint of a bank holds, where the prefix
//!   walk of each bank starts.

mod chain;
mod config;
mod prefetch;
mod query;
mod ring;
mod runs;
mod score;
mod shard;
mod sliced;
mod table;
#[cfg(test)]
mod tests;
mod universal;
mod write;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use parking_lot::{Mutex, RwLock};

pub use config::{
    EndpointInventory, IndexConfig, IndexError, WriteStats, BUDGET_BYTES_PER_KEY, DEFAULT_CAPACITY,
};
use prefetch::LineHint;
use ring::Ring;
use runs::RunTable;
pub(crate) use shard::KeyMap;
use shard::{entry_hash, Shard};

/// Endpoints per bank (bits of a holder mask).
const BANK_WIDTH: usize = 64;
// A bank's entries are one run of `score_prefix_uniform`.
const _: () = assert!(BANK_WIDTH == crate::view::UNIFORM_RUN);
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

/// An endpoint's keys, with the cell its GPU-tier count is published to:
/// every write to the keys publishes it when its guard drops, so decisions
/// read it without the lock ([`SharedIndex::gpu_blocks`]). The cells sit in
/// one array of their own: a decision reads every endpoint's, and one cache
/// line then serves eight endpoints.
#[derive(Clone, Copy)]
struct EndpointSlot<'a> {
    keys: &'a Mutex<EndpointKeys>,
    gpu_blocks: &'a AtomicU64,
}

impl EndpointSlot<'_> {
    fn lock(&self) -> SlotGuard<'_> {
        SlotGuard {
            keys: self.keys.lock(),
            gpu_blocks: self.gpu_blocks,
        }
    }
}

/// [`EndpointSlot`]'s lock: publishes the GPU tier's count when it drops.
struct SlotGuard<'a> {
    keys: parking_lot::MutexGuard<'a, EndpointKeys>,
    gpu_blocks: &'a AtomicU64,
}

impl std::ops::Deref for SlotGuard<'_> {
    type Target = EndpointKeys;
    fn deref(&self) -> &EndpointKeys {
        &self.keys
    }
}

impl std::ops::DerefMut for SlotGuard<'_> {
    fn deref_mut(&mut self) -> &mut EndpointKeys {
        &mut self.keys
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let live = self.keys.live.get(Medium::Gpu.index()).copied();
        self.gpu_blocks
            .store(live.unwrap_or(0), std::sync::atomic::Ordering::Release);
    }
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
/// A key every endpoint of a bank holds in the GPU tier is also recorded, with
/// the banks where that is so, in one index-wide table (banks of at least 16
/// endpoints, the first 64 banks). The prefix walk reads a prompt's leading
/// keys there once and starts each bank past the ones all its endpoints hold:
/// a system prompt cached on every engine of a 1 024-endpoint fleet costs one
/// lookup per key, not sixteen. The shards' writers keep the table as a key's
/// holders in a bank become all of them or stop being so.
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
///   absent key is counted and ignored. (vLLM's reports of blocks a request
///   found cached are shaped like stores but are no new copies:
///   [`crate::EndpointIngest`] does not pass them on.)
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
/// size (64 endpoints, 1 M to 6.4 M pairs; tables that all grow at the
/// same size make the figure follow the swing, 19.8 to 26.3 with rings). With
/// fewer shards ([`IndexConfig::shards`]) fewer phases average out: one
/// shard follows the swing. Shared keys cost one entry for all their
/// holders. The table of keys a whole bank holds has an entry (about 17
/// bytes) only per such key. [`SharedIndex::memory_bytes`] reports the figure for a metrics
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
/// so no cycle of waits can form. The whole-bank table has one lock: a
/// writer takes it (inside a shard's write lock) only when a key's holders in
/// a bank become all of them or stop being so; a prefix walk reads it once,
/// holding no shard lock.
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
    /// Each endpoint's GPU-tier count as its last write published it.
    gpu_blocks: Box<[AtomicU64]>,
    /// Every endpoint's bound per tier until set otherwise
    /// ([`IndexConfig::capacity_per_endpoint`]).
    default_capacity: u64,
    /// Bits of a shard index (the shard count's log2).
    shard_bits: u32,
    /// Keys every endpoint of a bank holds, per bank (see `universal`).
    universal: Arc<universal::Universal>,
    /// The banks `universal` tracks.
    tracked: u64,
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
        let universal = Arc::new(universal::Universal::default());
        let mut tracked = 0u64;
        let banks = (0..bank_count)
            .map(|b| {
                let in_bank = endpoints.saturating_sub(b * BANK_WIDTH).min(BANK_WIDTH);
                let active = if in_bank == BANK_WIDTH {
                    u64::MAX
                } else {
                    (1u64 << in_bank) - 1
                };
                let track =
                    in_bank >= universal::TRACKED_MIN as usize && b < universal::TRACKED_BANKS;
                if track {
                    tracked |= 1u64 << b;
                }
                let full = || {
                    track.then(|| shard::Full {
                        mask: active,
                        bank: b,
                        table: Arc::clone(&universal),
                    })
                };
                Bank {
                    shards: (0..shards)
                        .map(|s| {
                            PaddedShard(
                                RwLock::new(Shard::new(s as u32, full())),
                                LineHint::default(),
                            )
                        })
                        .collect(),
                    hidden: AtomicU64::new(0),
                    active,
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
            gpu_blocks: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            default_capacity: capacity,
            shard_bits: shards.trailing_zeros(),
            universal,
            tracked,
        }
    }

    /// The engine's own report of its KV capacity in tier `medium`, `blocks`,
    /// as endpoint `e`'s bound: never above the configured bound
    /// ([`IndexConfig::capacity_per_endpoint`]: a peer's figure must not lift
    /// the memory bound, nor a huge one remove it), and a report of 0 (an
    /// engine starting up, or a level it does not have) leaves the bound as
    /// it is. Returns the bound set, `None` when the report was ignored.
    ///
    /// ```
    /// use kvroute_core::{EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, SharedIndex};
    ///
    /// let cfg = IndexConfig { capacity_per_endpoint: 1000, ..IndexConfig::default() };
    /// let index = SharedIndex::new(1, cfg);
    /// let e = EndpointId(0);
    /// assert_eq!(index.set_reported_capacity(e, Medium::Gpu, u64::MAX).unwrap(), Some(1000));
    /// assert_eq!(index.set_reported_capacity(e, Medium::Gpu, 0).unwrap(), None);
    /// assert_eq!(index.set_reported_capacity(e, Medium::Gpu, 64).unwrap(), Some(64));
    /// assert_eq!(index.capacity(e, Medium::Gpu), Some(64));
    /// ```
    ///
    /// # Errors
    /// `e` is outside the index.
    pub fn set_reported_capacity(
        &self,
        e: EndpointId,
        medium: Medium,
        blocks: u64,
    ) -> Result<Option<usize>, IndexError> {
        if blocks == 0 {
            self.locate(e)?;
            return Ok(None);
        }
        let bound = blocks.min(self.default_capacity);
        let bound = usize::try_from(bound).unwrap_or(usize::MAX);
        self.set_capacity(e, medium, bound)?;
        Ok(Some(bound))
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

    /// Endpoint `e`'s bounds back to the index's defaults in every tier
    /// ([`IndexConfig::capacity_per_endpoint`]): a slot given to a new
    /// endpoint does not keep the bound its previous engine reported.
    ///
    /// ```
    /// use kvroute_core::{EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, SharedIndex};
    ///
    /// let index = SharedIndex::new(1, IndexConfig::default());
    /// let default = index.capacity(EndpointId(0), Medium::Gpu);
    /// index.set_capacity(EndpointId(0), Medium::Gpu, 8)?;
    /// index.reset_capacity(EndpointId(0))?;
    /// assert_eq!(index.capacity(EndpointId(0), Medium::Gpu), default);
    /// # Ok::<(), kvroute_ingest::IndexError>(())
    /// ```
    ///
    /// # Errors
    /// [`IndexError`] for an endpoint outside the index.
    pub fn reset_capacity(&self, e: EndpointId) -> Result<WriteStats, IndexError> {
        // `usize::MAX` (unbounded) when the default is.
        let blocks = usize::try_from(self.default_capacity).unwrap_or(usize::MAX);
        let mut stats = WriteStats::default();
        for medium in Medium::ALL {
            stats += self.set_capacity(e, medium, blocks)?;
        }
        Ok(stats)
    }

    /// Blocks endpoint `e`'s GPU tier holds (0 for no such slot). Read
    /// without a lock: what the last write published.
    ///
    /// ```
    /// use kvroute_core::{BlockKey, EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, SharedIndex};
    ///
    /// let index = SharedIndex::new(1, IndexConfig::default());
    /// index.store(EndpointId(0), Medium::Gpu, &[BlockKey(1), BlockKey(2)])?;
    /// index.store(EndpointId(0), Medium::Cpu, &[BlockKey(3)])?;
    /// assert_eq!(index.gpu_blocks(EndpointId(0)), 2);
    /// # Ok::<(), kvroute_ingest::IndexError>(())
    /// ```
    #[must_use]
    pub fn gpu_blocks(&self, e: EndpointId) -> u64 {
        self.gpu_blocks
            .get(e.index())
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::Acquire))
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
            + self.endpoints.len()
                * (std::mem::size_of::<Mutex<EndpointKeys>>() + std::mem::size_of::<AtomicU64>());
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

    fn locate(&self, e: EndpointId) -> Result<(&Bank, u32, EndpointSlot<'_>), IndexError> {
        let err = || IndexError::UnknownEndpoint {
            endpoint: e,
            slots: self.endpoints.len(),
        };
        let slot = EndpointSlot {
            keys: self.endpoints.get(e.index()).ok_or_else(err)?,
            gpu_blocks: self.gpu_blocks.get(e.index()).ok_or_else(err)?,
        };
        let bank = self.banks.get(e.index() / BANK_WIDTH).ok_or_else(err)?;
        Ok((bank, (e.index() % BANK_WIDTH) as u32, slot))
    }

    #[inline]
    fn shard<'a>(&self, bank: &'a Bank, key: u64) -> &'a RwLock<Shard> {
        // The index is < shards by construction of `shard_bits`.
        &bank.shards[self.shard_index(key) & (bank.shards.len() - 1)].0
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
}
