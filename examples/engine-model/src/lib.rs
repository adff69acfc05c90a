//! The engine worker model shared by `kvroute mock-engine` and the fleet
//! simulator: one implementation of "what an engine does with a request".
//!
//! Sans-IO and deterministic: no clocks, threads or sockets. Time is passed in as
//! microseconds; KV events go to an outbox in the engine-neutral
//! [`kvroute_ingest::KvEvent`] form, which the caller encodes (vLLM / SGLang wire)
//! or feeds straight into an ingest path.
//!
//! * [`PrefixCache`]: block-level prefix cache, finite capacity, LRU eviction of
//!   unreferenced blocks (vLLM `BlockPool` semantics).
//! * [`CostModel`]: prefill ∝ uncached tokens in batched steps, decode per token.
//! * [`Worker`]: queue + concurrency limit + cache + cost model.
//!
//! Per request the work is O(blocks) with no allocation in steady state beyond the
//! events themselves (buffers are recycled).

#![deny(missing_docs)]

pub mod cache;
pub mod cost;
pub mod worker;

pub use cache::{AllocRequest, Allocation, OutOfBlocks, PrefixCache};
pub use cost::CostModel;
pub use worker::{Admission, RequestSpec, SubmitError, Worker, WorkerConfig};
