//! The read side that selection consumes: overlap of a prompt's keys with each
//! endpoint's inventory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use kvroute_core::{BlockKey, Medium};

/// How much of one prompt an endpoint holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Number of the prompt's keys found in the endpoint's inventory (any position,
    /// any tier) — the reference "overlap count".
    pub blocks: u32,
    /// Length of the run of found keys starting at key 0 — what the engine's prefix
    /// cache can actually reuse.
    pub prefix: u32,
    /// Of the `prefix` blocks, how many sit in each tier (indexed by
    /// [`Medium::index`]).
    pub prefix_by_medium: [u32; 4],
}

impl Overlap {
    /// Prefix blocks held in `medium`.
    #[must_use]
    pub fn prefix_in(&self, medium: Medium) -> u32 {
        self.prefix_by_medium[medium.index()]
    }
}

/// Entries per run of [`InventoryView::score_prefix_uniform`].
pub const UNIFORM_RUN: usize = 64;

/// Anything that can score a prompt's block keys against a set of endpoint
/// inventories in one pass.
///
/// Endpoints are the dense ids `0..endpoint_count()`; the index owner maps them to
/// rule endpoints.
pub trait InventoryView {
    /// Number of endpoint slots; `score` writes this many entries.
    fn endpoint_count(&self) -> usize;

    /// Fills `out[e]` with the overlap of `keys` (prompt order, block 0 first) with
    /// endpoint `e`'s inventory, for every `e` below `endpoint_count()`
    /// (an endpoint holding none of them gets [`Overlap::default`]: callers
    /// reuse `out` without clearing it). `out.len()` must be at least
    /// `endpoint_count()`; extra entries are left untouched.
    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]);

    /// Like [`score`](Self::score), but only `prefix` and `prefix_by_medium`
    /// are exact; `blocks` is only a lower bound of the any-position count
    /// (at least `prefix`).
    ///
    /// This is what a scorer that credits the longest cached prefix needs
    /// (vLLM and SGLang reuse only that), and it lets a view stop walking the
    /// prompt at the first key that no endpoint still matching from block 0
    /// holds, instead of looking up every key for every endpoint. The default
    /// runs the full [`score`](Self::score).
    fn score_prefix(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.score(keys, out);
    }

    /// [`score_prefix`](Self::score_prefix), also telling which runs of
    /// [`UNIFORM_RUN`] entries hold a single overlap: `uniform[r] == true`
    /// promises that entries `r * UNIFORM_RUN ..` up to the next run (or
    /// `endpoint_count()`) are all equal. `false` promises nothing, and is
    /// what the default writes. A caller over a large pool (candidate
    /// sampling) then looks at each such run once instead of at every
    /// entry. Entries of `uniform` beyond the runs are set to `false`.
    ///
    /// ```
    /// use kvroute_core::{BlockKey, EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex, UNIFORM_RUN};
    ///
    /// let index = SharedIndex::new(2 * UNIFORM_RUN, IndexConfig::default());
    /// let keys = [BlockKey(1), BlockKey(2)];
    /// index.store(EndpointId(3), Medium::Gpu, &keys).unwrap();
    /// let mut out = vec![Overlap::default(); 2 * UNIFORM_RUN];
    /// let mut uniform = [false; 2];
    /// index.score_prefix_uniform(&keys, &mut out, &mut uniform);
    /// // Endpoint 3 holds the prompt; the second run holds nothing anywhere.
    /// assert_eq!(uniform, [false, true]);
    /// assert_eq!(out[3].prefix, 2);
    /// ```
    fn score_prefix_uniform(&self, keys: &[BlockKey], out: &mut [Overlap], uniform: &mut [bool]) {
        self.score_prefix(keys, out);
        uniform.fill(false);
    }

    /// How far endpoint `endpoint`'s inventory can be trusted. The default (for
    /// views without attestation or sequence tracking) claims nothing.
    ///
    /// Scoring is not changed by it: a partial inventory under-reports (a block
    /// it lacks only costs a lost optimisation), so its hits are still real;
    /// a mismatched contract makes every lookup of that endpoint miss, and
    /// selection can count such misses as `contract_mismatch` instead of
    /// `zero_overlap`.
    fn health(&self, _endpoint: usize) -> InventoryHealth {
        InventoryHealth::default()
    }

    /// Blocks endpoint `endpoint`'s inventory holds in the engine's GPU
    /// cache, or `None` (the default) when the view does not count them.
    /// With the engine's capacity, a scorer reads how much room its cache
    /// has left for new content before it evicts.
    fn gpu_blocks(&self, _endpoint: usize) -> Option<u64> {
        None
    }
}

/// What an inventory knows about its own completeness and hash contract
/// ([`InventoryView::health`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InventoryHealth {
    /// The engine's keys provably differ from the prompt side's (attestation
    /// or block-size check failed): its inventory can never match a prompt.
    pub contract_mismatch: bool,
    /// Batches of the engine's current process whose effects the inventory is
    /// known to lack (0: complete as far as the sequence numbers tell).
    pub missing_batches: u64,
    /// Clears of the endpoint's inventory so far (restart, gap, reset,
    /// `AllBlocksCleared`): when it changes, anything predicted from the old
    /// inventory (e.g. blocks a recent decision expected the engine to cache)
    /// is void.
    pub clears: u64,
}

impl InventoryHealth {
    /// True when batches are known missing.
    #[must_use]
    pub fn partial(&self) -> bool {
        self.missing_batches > 0
    }
}

/// An endpoint's [`InventoryHealth`] as its ingest last published it
/// ([`crate::EndpointIngest::health_cell`]), readable without the ingest's
/// lock: a decision reads every endpoint's, and must not wait while an event
/// batch is being applied.
///
/// ```
/// use kvroute_core::EndpointId;
/// use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};
/// let index = SharedIndex::new(1, IndexConfig::default());
/// let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
/// let cell = ingest.health_cell().clone();
/// ingest.clear(&index);
/// assert_eq!(cell.get(), ingest.inventory_health());
/// assert_eq!(cell.get().clears, 1);
/// ```
#[derive(Debug, Default)]
pub struct HealthCell {
    contract_mismatch: AtomicBool,
    missing_batches: AtomicU64,
    clears: AtomicU64,
}

impl HealthCell {
    /// The health last published.
    #[must_use]
    pub fn get(&self) -> InventoryHealth {
        InventoryHealth {
            contract_mismatch: self.contract_mismatch.load(Ordering::Acquire),
            missing_batches: self.missing_batches.load(Ordering::Acquire),
            clears: self.clears.load(Ordering::Acquire),
        }
    }

    /// Publishes `h` (an ingest does after every change; a host resets a
    /// cell it reuses for another endpoint).
    pub fn set(&self, h: InventoryHealth) {
        self.contract_mismatch
            .store(h.contract_mismatch, Ordering::Release);
        self.missing_batches
            .store(h.missing_batches, Ordering::Release);
        self.clears.store(h.clears, Ordering::Release);
    }
}
