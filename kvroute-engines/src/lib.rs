//! # kvroute-engines
//!
//! What each inference engine needs from kvroute, engine by engine: its KV
//! event wire formats (vLLM / SGLang msgpack over ZeroMQ, TensorRT-LLM JSON
//! drained over HTTP), the transports that follow them into an inventory, the
//! OpenAI request → token-id pipeline that reproduces what the engine
//! prefills (tokenizer, chat template, vLLM's validators), and the engines'
//! load reports (`/metrics`).
//!
//! | module | what | I/O |
//! |---|---|---|
//! | [`engine`] | each engine as one value ([`engine::Engine`]): names, KV support, window policy, transport, metrics and prompt dialects, token-id prompts; the [`engine::Registry`] hosts look engines up in | none (its followers are tasks the host spawns) |
//! | [`events`] | sans-IO decoders: engine payload → [`kvroute_ingest::EventBatch`] | none |
//! | [`transport`] | `transport::ZmqSubscriber` (`zmq`), `transport::TrtllmPoller` (`trtllm-http`), and the sinks that decode and apply ([`transport::DecodingSink`]`<`[`transport::IndexIngest`]`>`) | tokio, on the host's runtime |
//! | [`prompt`] | body → the engine's token ids ([`prompt::TokenizerPool`], [`prompt::prompt_tokens_limited`]) | reads the model directory |
//! | [`parse_load`] | engine `/metrics` text → running / waiting / capacity | none |
//!
//! Hosts never match on the engine: they look it up by its configuration
//! name ([`engine::by_name`], or a [`engine::Registry`] extended with their
//! own engines) and ask it. Nothing here starts a runtime or a thread:
//! transports are `async fn`s the host spawns, stopped by a future it
//! supplies. Most hosts use the `kvroute`
//! facade crate, which wires these pieces from one contract and one list of
//! endpoints; this crate is for hosts that wire them themselves.
//!
//! ## Features
//!
//! * `zmq` (default): the ZeroMQ subscriber and replay client (vLLM, SGLang).
//! * `trtllm-http` (default): the TensorRT-LLM drain poller and the `/metrics`
//!   load poller (pulls an HTTP client).
//! * `parity`: `events::golden` and `prompt::golden`, the checkers of the
//!   golden wire and chat files (the gateway's `kvroute parity` command).
//! * `fuzzing`: the entry points of the cargo-fuzz targets in `fuzz/`; not a
//!   stable API.
//!
//! A vLLM- or SGLang-only host needs no HTTP client:
//! `kvroute-engines = { version = "0.1", default-features = false, features = ["zmq"] }`.
//!
//! ## From an engine's event to a scored prompt
//!
//! One vLLM 0.33 `KVEventBatch` (a real capture from `golden/`) goes through
//! the same sink a `transport::ZmqSubscriber` feeds, into the index scoring
//! reads; the prompt's keys, recomputed from its token ids under the engine's
//! hash contract, find both stored blocks.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute_core::{EndpointId, HashContract, RequestExtras};
//! use kvroute_engines::engine;
//! use kvroute_engines::transport::{DecodingSink, Frame, FrameSink, FrameSource, IndexIngest};
//! use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, InventoryView, Keying, Overlap, SharedIndex};
//!
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/vllm-events/v0.33.0/stream");
//! let payload = std::fs::read(dir.join("01_store_prompt_two_blocks.msgpack"))?;
//! let case: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("01_store_prompt_two_blocks.json"))?)?;
//! let prompt: Vec<u32> = serde_json::from_value(case["token_ids_of_request"].clone())?;
//!
//! // The engine's contract: `--prefix-caching-hash-algo sha256_cbor`, PYTHONHASHSEED=0, block 16.
//! let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?;
//! let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
//! let config = IngestConfig { expected_block_size: Some(16), ..IngestConfig::default() };
//! // The inventory is keyed as the contract says (here: the engine's own keys).
//! let ingest = EndpointIngest::new(EndpointId(0), config, Keying::for_contract(&contract));
//! // DP rank 0's stream, without a replay socket, decoded as the engine named in configuration.
//! let vllm = engine::by_name("vllm")?;
//! let mut sink = DecodingSink::for_engine(&*vllm, IndexIngest::new(ingest, Arc::clone(&index), Some(0), false))?;
//!
//! // A subscriber does this for every message; `vllm.followers(&follow, &target)`
//! // builds the subscribers of one endpoint with these sinks.
//! let report = sink.on_frame(Frame { topic: b"", seq: 0, payload: &payload, source: FrameSource::Live });
//! assert_eq!(report.events_applied, 1);
//!
//! let mut keys = Vec::new();
//! contract.hasher()?.hash_prompt(&prompt, &RequestExtras::NONE, &mut keys)?;
//! let mut out = [Overlap::default()];
//! index.score(&keys, &mut out);
//! assert_eq!(out[0].prefix, 2); // 40 tokens: two full blocks of 16, both cached
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod engine;
pub mod events;
mod load_report;
pub mod prompt;

pub mod transport;

mod names;
pub use names::UnknownName;

/// The counted reason of a miss ([`prompt::PromptError::reason`]).
pub use kvroute_core::MissReason;

/// The OpenAI API a request body was posted to (chat or completions).
pub use prompt::ApiKind;

#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub use load_report::fuzzing as load_report_fuzzing;
/// How long an idle HTTP connection to an engine is kept for reuse: below
/// the 5 s after which the engines' uvicorn servers close an idle
/// keep-alive connection (vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, SGLang's
/// `SGLANG_TIMEOUT_KEEP_ALIVE`). A connection kept longer can be closed by
/// the engine just as a request is written on it, which then fails with no
/// answer (not safely retried: the engine may have read it).
pub const ENGINE_HTTP_IDLE: std::time::Duration = std::time::Duration::from_secs(4);

pub use load_report::{
    parse_load, EngineLoadReport, LoadReportError, MetricsDialect, MAX_METRICS_BODY_BYTES,
    MAX_RANKS,
};
