//! # kvroute-ingest
//!
//! Engine-neutral KV events, the sequence-window state machine, per-endpoint
//! inventories and the index that scoring reads. Sans-IO: no sockets, clocks or
//! threads; transports live in `kvroute-engines` and the host.
#![deny(missing_docs)]

pub mod attest;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
pub mod index;
pub mod ingest;
pub mod rekey;
pub mod seq;
pub mod view;

pub use attest::{ContractAttestor, ContractStatus, KeyAttestor};
pub use event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
pub use index::{EndpointInventory, IndexConfig, IndexError, SharedIndex, WriteStats};
pub use ingest::{
    Completeness, EndpointIngest, IngestConfig, IngestCounters, KeyMode, Outcome,
    DEFAULT_REKEY_ENTRIES,
};
pub use view::{InventoryHealth, InventoryView, Overlap};
