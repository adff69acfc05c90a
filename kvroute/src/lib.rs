//! # kvroute
//!
//! KV-cache-aware routing for an LLM proxy you already have (axum, hyper,
//! tower, pingora, ...): each request goes to the inference engine that
//! already holds the longest cached prefix of its prompt, proven by the
//! engines' own KV events and confirmed by their `cached_tokens` receipts.
//!
//! This crate is the router's runtime: the one that `kvroute serve` hosts
//! per rule, that the simulator drives on a simulated clock, and that an
//! embedder builds in its own proxy. It assembles the four `kvroute-*`
//! crates — the engines' events and prompts (`kvroute-engines`), the
//! inventories (`kvroute-ingest`), hashing (`kvroute-core`) and selection
//! (`kvroute-select`), which may not depend on each other — into one
//! [`KvRouter`]: endpoints and their followers, tokenizers and admission,
//! load accounting, health probes and engine load polling, replicas,
//! receipts, counters. [`KvRouterBuilder::spawn`] runs the background work
//! on the caller's tokio runtime; [`KvRouterBuilder::build`] runs none
//! (time from a [`Clock`], events and load reports applied by the host).
//!
//! ## Thirty lines
//!
//! ```no_run
//! use bytes::Bytes;
//! use kvroute::{ApiKind, Backend, KvRouter};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // What the engines run: `vllm serve Qwen/Qwen3-8B --block-size 16
//! //   --prefix-caching-hash-algo sha256_cbor` with PYTHONHASHSEED=0 and
//! //   `--kv-events-config '{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", ...}'`.
//! let router = KvRouter::builder("vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?)
//!     .model("Qwen/Qwen3-8B", "/models/qwen3")
//!     .endpoint(Backend::vllm("http://10.0.0.7:8000").events("tcp://*:5557").replay("tcp://*:5558"))
//!     .endpoint(Backend::vllm("http://10.0.0.8:8000").events("tcp://*:5557").replay("tcp://*:5558"))
//!     .spawn()?; // subscribers run on the caller's tokio runtime
//!
//! // Per request:
//! let body = Bytes::from_static(br#"{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]}"#);
//! let mut pick = router.pick(ApiKind::Chat, &body).await?;
//! let upstream_body = pick.upstream_body(&body); // streamed requests: usage included
//! loop {
//!     let url = format!("{}/v1/chat/completions", pick.url());
//!     # let connect_failed = false;
//!     // ... send `upstream_body` to `url` with your HTTP client ...
//!     if connect_failed {
//!         if pick.retry().is_none() { break } // the next-best endpoint, or give up
//!         continue;
//!     }
//!     // ... then wrap the response body: receipt recorded, load released at its end:
//!     // let body = pick.into_body(response.headers(), response.into_body());
//!     break;
//! }
//! # Ok(()) }
//! ```
//!
//! Everything is derived from the contract and the endpoint list, nothing
//! stated twice: prompt keys, block size and key mode from the contract (a
//! `rekey:` contract re-keys stored blocks on the ingest side too), the
//! contract attestor for engine keys, one inventory slot and one load slot
//! per endpoint, one subscriber per DP rank (a TensorRT-LLM endpoint gets its
//! drain poller), tokenization on the blocking pool within
//! [`KvRouterBuilder::max_prompt_chars`] / [`KvRouterBuilder::max_prompt_tokens`]
//! per request and [`admission`] across requests (at most
//! [`KvRouterBuilder::max_concurrent_tokenizations`] at once, holding at most
//! [`KvRouterBuilder::max_tokenize_bytes_in_flight`]; beyond, a counted
//! `tokenize_overloaded` miss routed by the fallback).
//!
//! ## Pieces
//!
//! * [`KvRouter`] / [`KvRouterBuilder`] / [`Backend`]: the router; runtime
//!   endpoint changes with [`KvRouter::apply`]`(`[`Change`]`)`, as tower's
//!   `Discover` changes: only the changed endpoint's subscribers and
//!   inventory slot are touched.
//! * [`Pick`]: one request's decision, its [`kvroute_select::LoadGuard`]
//!   (tower `PendingRequests` semantics: counted from the decision until the
//!   response body ends or is dropped), [`Pick::retry`] with exclusion, and
//!   [`Pick::into_body`].
//! * [`admission`]: the bound on concurrent tokenizations and their bytes
//!   (used by every [`KvRouter::pick`]; usable by a host that tokenizes
//!   itself).
//! * [`receipt`]: the usage scanner (JSON and SSE), [`receipt::ReceiptBody`]
//!   (an `http_body::Body`) and [`receipt::ReceiptTracker`] (the same for
//!   hosts handed the body in chunks), and [`receipt::include_usage`].
//! * `tower` feature: [`tower::KvRouteLayer`] — buffer the body, decide,
//!   forward (each attempt under `Pick::await_headers`), retry, receipt body.
//! * [`prompt`]: the per-request prompt step ([`prompt::prepare`],
//!   [`prompt::prepare_admitted`]) for hosts that drive selection themselves,
//!   as the example gateway does; a prompt-pipeline failure
//!   ([`kvroute_engines::prompt::PromptError`]) is counted as its
//!   [`MissReason`] ([`kvroute_engines::prompt::PromptError::reason`]).
//! * Why a request went where it did: [`KvRouter::pick_explained`] records
//!   the decision's [`Explanation`] (every endpoint's cached prefix and
//!   load, each ladder step, the cost scorer's terms, cap and verdict;
//!   [`Pick::take_explanation`]); a plain pick records none and allocates
//!   nothing for it. Every decision keeps its cached-token account
//!   ([`TokenAccount`]: reachable, predicted, and lost by [`LostCause`]),
//!   which the receipt settles ([`Pick::settle`], [`Pick::into_body_settled`])
//!   into the per-endpoint counters that `metrics` exports as
//!   `kvroute_reachable_cached_tokens_total`,
//!   `kvroute_achieved_cached_tokens_total` and
//!   `kvroute_lost_cached_tokens_total{cause}`.
//!
//! * Extension points: an [`Engine`] (its events, window and dialects) in
//!   a [`Backend`], a [`Scorer`] in [`KvRouterBuilder::scorer`]; their
//!   argument types ([`ScoreInput`], [`Candidate`], [`ScorePick`],
//!   [`TransportError`], [`MetricsDialect`], [`LoraAdapter`]) are
//!   re-exported here, so an extension needs no other kvroute crate.
//!
//! ## Features
//!
//! `zmq` (default; vLLM, SGLang), `trtllm-http` (default; TensorRT-LLM
//! drains, engine load polling, health probes), `tower` (default;
//! [`tower::KvRouteLayer`]), `nats` (replica load sharing over NATS:
//! `nats::NatsReplicas`), `metrics` (the routers' metrics in a
//! prometheus-client registry: `metrics::Routers`). A vLLM-only host:
//! `kvroute = { version = "0.1", default-features = false, features = ["zmq"] }`.
//!
//! ## pingora
//!
//! A pingora `ProxyHttp` maps onto the same calls (`CTX` holds the body
//! buffer and the `Option<Pick>`); `examples/embed_pingora` is this table
//! compiled and tested:
//!
//! | `ProxyHttp` phase | kvroute |
//! |---|---|
//! | `request_filter` | read the body (bounded: pingora 0.9 runs `request_body_filter` only after `upstream_peer`); `ctx.pick = Some(router.pick(api, &body).await?)` |
//! | `upstream_peer` | `HttpPeer::new(addr_of(pick.url()), false, host)` |
//! | `fail_to_connect` | `if ctx.pick.retry().is_some() { e.set_retry(true) }`: pingora calls `upstream_peer` again and gets the next-best endpoint |
//! | `connected_to_upstream` | [`Pick::connected`] |
//! | `upstream_request_filter` / `request_body_filter` | `Content-Length` of [`Pick::upstream_body`], then that body (pingora resends its retry buffer there on each attempt; the example keeps it filled) |
//! | `response_filter` | `ctx.receipt = ctx.pick.take().map(\|p\| p.into_receipt(&resp.headers))` ([`Pick::into_receipt`]) |
//! | `response_body_filter` | [`receipt::ReceiptTracker::on_chunk`] each chunk, [`receipt::ReceiptTracker::on_end`] at `end_of_stream`: the receipt is recorded and the load charge released; dropped with the context before that (an error, a disconnect), it records nothing and releases the charge |
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod admission;
mod backend;
mod clock;
pub mod headers;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "nats")]
pub mod nats;
pub mod prompt;
pub mod receipt;
mod runtime;
#[cfg(feature = "tower")]
pub mod tower;

pub use backend::Backend;
pub use clock::{Clock, ManualClock, SystemClock};
pub use runtime::{
    BuildError, Change, EndpointDelta, EndpointStatus, EngineLoadConfig, FollowerStatus,
    HeaderTimeouts, HostTransport, KvRouter, KvRouterBuilder, LoadPolls, NoEndpoint, Pick,
    ProbeConfig, Readiness, ReplicaBatch, ReplicaConfig, ReplicaCounters, ReplicaError,
    ReplicaSink, ReplicaSubscription, ReplicaTransport, Stall, TokenizerState,
};

pub use kvroute_core::{HashContract, LoraAdapter, UnknownName};
pub use kvroute_engines::engine::{self, Engine};
pub use kvroute_engines::transport::TransportError;
pub use kvroute_engines::{ApiKind, MetricsDialect};
pub use kvroute_ingest::IndexConfig;
pub use kvroute_select::{
    BreakerConfig, Candidate, Choice, CostConfig, CostScorer, Decision, Explanation, Leg,
    LoadGuard, LostCause, MissReason, OutlierConfig, OutlierStatus, Role, ScoreInput, ScorePick,
    Scorer, ScorerKind, ScorerRef, SelectorKind, Settlement, Source, Target, Thresholds,
    TokenAccount, Topology, Turn,
};
