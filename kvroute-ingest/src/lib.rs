//! # kvroute-ingest
//!
//! Engine-neutral KV events, the sequence-window state machine, per-endpoint
//! inventories and the index that scoring reads. Sans-IO: no sockets, clocks or
//! threads; transports live in `kvroute-engines` and the host.
//!
//! One [`EndpointIngest`] per endpoint judges its engine's batches (sequence
//! window, restarts, key mode, contract attestation) and writes the
//! endpoint's slot of a [`SharedIndex`]; selection scores prompts against
//! the index through [`InventoryView`].
//!
//! ```
//! use kvroute_core::{BlockKey, EndpointId};
//! use kvroute_ingest::{BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig,
//!     InventoryView, Keying, KvEvent, Overlap, SharedIndex};
//!
//! let index = SharedIndex::new(1, IndexConfig::default());
//! let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
//! let stored = |seq, keys: &[u64]| EventBatch {
//!     seq,
//!     events: vec![KvEvent::Stored(BlockStored {
//!         keys: keys.iter().map(|&k| BlockKey(k)).collect(),
//!         block_size: 16,
//!         ..BlockStored::default()
//!     })],
//!     ..EventBatch::default()
//! };
//! let prompt = [BlockKey(1), BlockKey(2), BlockKey(3)];
//! let mut out = [Overlap::default()];
//!
//! let _ = ingest.apply_batch(&stored(0, &[1, 2]), &index);
//! // Batches 1..=9 were lost: a gap inside the window keeps the inventory.
//! let _ = ingest.apply_batch(&stored(10, &[3]), &index);
//! index.score(&prompt, &mut out);
//! assert_eq!(out[0].prefix, 3);
//!
//! // A gap beyond the window (64 batches by default): whatever was lost may
//! // have removed blocks, so the inventory starts again from this batch.
//! let _ = ingest.apply_batch(&stored(500, &[1]), &index);
//! index.score(&prompt, &mut out);
//! assert_eq!((out[0].prefix, out[0].blocks), (1, 1));
//! assert_eq!(ingest.counters().clears, 1);
//! ```
//!
//! An inventory holds either the engine's own keys or kvroute's re-keyed ones
//! ([`KeyMode`], the one key-mode type of every kvroute crate). Hosts build
//! each endpoint's [`Keying`] with [`Keying::for_contract`] from the rule's
//! contract, the same contract the prompt side hashes with, so both sides
//! agree by construction.
//!
//! Feature `fuzzing` adds the entry points of the cargo-fuzz targets in
//! `fuzz/` and their reference model (not a stable API).
#![deny(missing_docs)]
// `deny`, not `forbid`: one `allow` exists, the software prefetch hint in
// `index::prefetch` (an intrinsic that is `unsafe` to call but cannot fault).
#![deny(unsafe_code)]
#![warn(unreachable_pub)]

mod attest;
mod event;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod index;
mod ingest;
mod rekey;
mod seq;
mod view;

pub use attest::{
    AttestCounters, ContractAttestor, ContractStatus, KeyAttestor, ParentLink, Unverifiable,
};
pub use event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
pub use index::{
    EndpointInventory, IndexConfig, IndexError, SharedIndex, WriteStats, BUDGET_BYTES_PER_KEY,
    DEFAULT_CAPACITY,
};
pub use ingest::{
    Completeness, EndpointIngest, IngestConfig, IngestCounters, Keying, Outcome, ScoredGroup,
    DEFAULT_REKEY_ENTRIES,
};
pub use rekey::{BlockRekeyer, XxhChainRekeyer};
pub use seq::{
    ClearReason, DropReason, ReplayEnd, RestartPolicy, SeqAction, SeqCounters, SeqWindow,
    SeqWindowConfig, DEFAULT_MAX_JUMP, DEFAULT_MAX_SEQ,
};
pub use view::{HealthCell, InventoryHealth, InventoryView, Overlap, UNIFORM_RUN};

/// The key mode of an inventory (re-exported from `kvroute-core`, the one
/// definition every kvroute crate uses); [`Keying::mode`] gives it.
pub use kvroute_core::KeyMode;
