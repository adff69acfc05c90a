//! # kvroute-ingest
//!
//! Engine-neutral KV events, the sequence-window state machine, per-endpoint
//! inventories and the index that scoring reads. Sans-IO: no sockets, clocks or
//! threads; transports live in `kvroute-engines` and the host.
#![deny(missing_docs)]

pub mod event;
pub mod view;

pub use event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
pub use view::{InventoryView, Overlap};
