//! Transports that carry engine KV events to kvroute: thin I/O shells around the
//! sans-IO decoders and the ingest state machine.
//!
//! | engine | transport | type | feature |
//! |---|---|---|---|
//! | vLLM, SGLang | ZeroMQ PUB → our SUB, `[topic, seq, payload]`; ROUTER replay | `ZmqSubscriber`, `request_replay` | `zmq` |
//! | TensorRT-LLM | `POST /kv_cache_events` (destructive drain) | `TrtllmPoller` | `trtllm-http` |
//! | engine load (all) | `GET /metrics` → [`crate::parse_load`] on an interval | `LoadPoller` | `trtllm-http` |
//! | llama.cpp | none: no KV event contract → [`TransportError::Unsupported`] | [`require_kv_events`] | — |
//!
//! Which transport an engine uses, and how one endpoint of it is followed, is
//! the engine's ([`crate::engine::Engine::followers`]); this module is what
//! the engines are built from.
//!
//! The transports only move bytes: they own sockets, reconnects, replay and timers,
//! and hand each frame to a [`FrameSink`] (ZeroMQ) or [`DrainSink`] (HTTP), which
//! decodes and applies it. Nothing here starts a runtime: every transport is an
//! `async fn` the host spawns on its own tokio runtime, stopped by a shutdown
//! future the host supplies. Every transport keeps [`SubscriberMetrics`].

mod decoding_sink;
mod endpoint;
mod index_ingest;
mod metrics;
mod sink;
mod trtllm_sink;

#[cfg(feature = "zmq")]
mod replay;
#[cfg(feature = "zmq")]
mod zmq_subscriber;

#[cfg(feature = "trtllm-http")]
mod load_poller;
#[cfg(feature = "trtllm-http")]
mod trtllm_poller;

pub use decoding_sink::{DecodingSink, IngestOutcome, SeqIngest};
pub use endpoint::{
    offset_endpoint_port, replay_address, resolved_bind_addresses, BindTarget, EndpointError,
    SocketRole, ZmqEndpoint,
};
pub use index_ingest::{IndexIngest, SharedIngest};
pub use metrics::{MetricsSnapshot, SubscriberMetrics};
#[cfg(feature = "zmq")]
pub use replay::request_replay;
pub use sink::{
    DrainReport, DrainSink, Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction,
};
#[cfg(feature = "zmq")]
pub use zmq_subscriber::{
    ZmqSubscriber, ZmqSubscriberConfig, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_MESSAGE_BYTES,
    MAX_MESSAGE_PARTS,
};

pub use trtllm_sink::{BatchApplier, TrtllmSink};

use crate::engine::Engine;

#[cfg(feature = "trtllm-http")]
pub use load_poller::{
    LoadPollError, LoadPollSnapshot, LoadPoller, LoadPollerConfig, LoadPollerMetrics,
};
#[cfg(feature = "trtllm-http")]
pub use trtllm_poller::{TrtllmPoller, TrtllmPollerConfig};

/// Errors of the transport layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The engine cannot serve the requested routing mode.
    #[error("{engine} does not support {feature}: {reason}; {suggestion}")]
    Unsupported {
        /// The engine asked about (its configuration name).
        engine: String,
        /// What was asked for.
        feature: &'static str,
        /// Why it cannot work.
        reason: &'static str,
        /// What to configure instead.
        suggestion: &'static str,
    },
    /// An endpoint string could not be used.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// What a host gave to follow one endpoint cannot be followed
    /// ([`crate::engine::Follow`]).
    #[error("{field}: {reason}")]
    Follow {
        /// The [`crate::engine::Follow`] field at fault (`url`, `events`,
        /// `replay`, `dp_ranks`, `block_size`).
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The transport an engine needs is not compiled into this build.
    #[error("{engine}: this build has no {transport} (enable the `{feature}` feature)")]
    NotCompiled {
        /// The engine's configuration name.
        engine: String,
        /// The missing transport.
        transport: &'static str,
        /// The cargo feature that brings it.
        feature: &'static str,
    },
    /// An HTTP client could not be built.
    #[error("{engine}: cannot build the HTTP client: {reason}")]
    Client {
        /// The engine's configuration name.
        engine: String,
        /// Why.
        reason: String,
    },
}

/// Checks that `engine` publishes the KV events KV-exact routing needs
/// ([`Engine::kv_events`]).
///
/// llama.cpp keeps a prompt cache per slot but has no event stream (no ZeroMQ
/// publisher, no drain endpoint) and no block-hash contract, so an inventory of
/// its cache cannot be followed: asking for KV-exact on it is a configuration
/// error, reported with the alternative that works (content affinity).
///
/// ```
/// use kvroute_engines::engine::{LLAMA_CPP, VLLM};
/// use kvroute_engines::transport::{require_kv_events, TransportError};
///
/// assert!(require_kv_events(&VLLM).is_ok());
/// let err = require_kv_events(&LLAMA_CPP).unwrap_err();
/// assert!(matches!(err, TransportError::Unsupported { .. }));
/// assert!(err.to_string().contains("content affinity"));
/// ```
///
/// # Errors
/// The engine's [`TransportError::Unsupported`].
pub fn require_kv_events(engine: &dyn Engine) -> Result<(), TransportError> {
    engine.kv_events()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{LLAMA_CPP, SGLANG, TRTLLM, VLLM};

    #[test]
    fn llama_cpp_kv_exact_is_a_clear_unsupported_error() {
        let err = require_kv_events(&LLAMA_CPP).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("llama.cpp does not support KV-exact routing"));
        assert!(msg.contains("no KV-cache events"));
        assert!(msg.contains("content affinity"));
    }

    #[test]
    fn event_publishing_engines_are_accepted() {
        for engine in [&VLLM as &dyn Engine, &SGLANG, &TRTLLM] {
            assert!(require_kv_events(engine).is_ok(), "{}", engine.name());
        }
    }
}
