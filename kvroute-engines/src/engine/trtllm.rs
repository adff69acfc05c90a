//! TensorRT-LLM (`trtllm-serve`): JSON KV events drained by
//! `POST {url}/kv_cache_events` (a destructive read: every drain consumes
//! the engine's events, so one router must be its only consumer), load from
//! the Prometheus page `GET /prometheus/metrics` (its JSON `/metrics` is a
//! destructive drain too), vLLM's request validators.
//!
//! Token-id prompts are not forwarded ([`KeepText::Engine`]): its id-prompt
//! path was not verified.
//!
//! ```
//! use kvroute_engines::engine::{Engine, Follow, KeepText, Stream, TRTLLM};
//! use kvroute_engines::{prompt::parse_json, ApiKind};
//! use kvroute_ingest::SeqWindowConfig;
//!
//! let follow = Follow::new("http://10.0.0.9:8000", 32);
//! assert_eq!(TRTLLM.window(&follow), SeqWindowConfig::destructive_drain());
//! let streams = TRTLLM.streams(&follow).unwrap();
//! assert_eq!(streams.len(), 1);
//! assert_eq!(streams[0].address(), "http://10.0.0.9:8000/kv_cache_events");
//! // It publishes nothing over ZeroMQ.
//! let err = TRTLLM.streams(&follow.clone().events("tcp://*:5557")).unwrap_err();
//! assert!(err.to_string().starts_with("events: TensorRT-LLM publishes no ZeroMQ events"));
//!
//! let plain = parse_json(br#"{"model": "m", "prompt": "hi"}"#).unwrap();
//! assert_eq!(TRTLLM.token_ids_equivalent(ApiKind::Completions, &plain), Err(KeepText::Engine));
//! ```

use kvroute_ingest::SeqWindowConfig;

use super::{DrainStream, Engine, Follow, Stream};
use crate::transport::TransportError;
use crate::MetricsDialect;

/// TensorRT-LLM (~1.1 – main 2026).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Trtllm;

/// The TensorRT-LLM engine.
pub static TRTLLM: Trtllm = Trtllm;

impl Engine for Trtllm {
    fn name(&self) -> &str {
        "trtllm"
    }

    /// `blocks[].tokens` of `stored` events.
    fn events_carry_tokens(&self) -> bool {
        true
    }

    /// [`SeqWindowConfig::destructive_drain`]: any `event_id` gap clears (the
    /// drain consumed the lost events), a restart clears and applies.
    fn window(&self, _follow: &Follow) -> SeqWindowConfig {
        SeqWindowConfig::destructive_drain()
    }

    /// One drain of `{url}/kv_cache_events`, interleaving the attention-DP
    /// ranks (each event names its own).
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        let drain = format!("{}/kv_cache_events", follow.url);
        for (field, set) in [
            ("events", follow.events.is_some()),
            ("replay", follow.replay.is_some()),
        ] {
            if set {
                return Err(Follow::invalid(
                    field,
                    format!("TensorRT-LLM publishes no ZeroMQ events; its events are drained from {drain}"),
                ));
            }
        }
        if follow.host().is_none() {
            return Err(Follow::invalid(
                "url",
                format!("{:?} names no host", follow.url),
            ));
        }
        Ok(vec![Stream::Drain(DrainStream {
            url: drain,
            tokens_per_block: follow.block_size,
        })])
    }

    /// The Prometheus page: the JSON `/metrics` would drain the iteration
    /// stats other readers need.
    fn metrics_dialect(&self) -> Option<MetricsDialect> {
        Some(MetricsDialect::TrtllmPrometheus)
    }
}
