//! SGLang: msgpack `KVEventBatch`es over ZeroMQ (one PUB per DP rank on
//! `port + rank`, ROUTER replay), `/metrics` in Prometheus text with
//! `sglang:` names (`--enable-metrics`), SGLang's request validators.
//!
//! Token-id prompts (SGLang 0.5, `entrypoints/openai/serving_completions.py`):
//! a list of ints becomes `GenerateReqInput(input_ids=…)`, a string `text=…`
//! tokenized by the tokenizer manager. `echo` decodes id prompts with
//! `skip_special_tokens=True` (kept as text); an explicit
//! `add_special_tokens` is not an SGLang completions field (kept as text).
//! A server started with `--completion-template` rewrites string prompts for
//! fill-in-the-middle: do not turn forwarding on for such a server.
//!
//! ```
//! use kvroute_engines::engine::{Engine, KeepText, SGLANG};
//! use kvroute_engines::{prompt::parse_json, ApiKind};
//! let off = parse_json(br#"{"model": "m", "prompt": "x", "echo": false, "suffix": null}"#).unwrap();
//! assert_eq!(SGLANG.token_ids_equivalent(ApiKind::Completions, &off), Ok(()));
//! let special = parse_json(br#"{"model": "m", "prompt": "x", "add_special_tokens": false}"#).unwrap();
//! assert_eq!(SGLANG.token_ids_equivalent(ApiKind::Completions, &special), Err(KeepText::AddSpecialTokens));
//! ```

use kvroute_ingest::{EventBatch, SeqWindowConfig};

use super::token_ids::{completion_with_text_prompt, present};
use super::{replay_window, zmq_streams, Engine, Follow, FrameDecoder, KeepText, Stream};
use crate::events::{self, DecodeError, DecodeStats};
use crate::prompt::{Dialect, PyValue};
use crate::transport::TransportError;
use crate::{ApiKind, MetricsDialect};

/// SGLang (0.4.10 – 0.5.23).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Sglang;

/// The SGLang engine.
pub static SGLANG: Sglang = Sglang;

/// SGLang's ZeroMQ payloads ([`events::sglang::decode_into`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct SglangDecoder;

impl FrameDecoder for SglangDecoder {
    fn decode_into(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut EventBatch,
        stats: &mut DecodeStats,
    ) -> Result<(), DecodeError> {
        events::sglang::decode_into(payload, seq, out, stats)
    }
}

impl Engine for Sglang {
    fn name(&self) -> &str {
        "sglang"
    }

    /// `BlockStored.token_ids`.
    fn events_carry_tokens(&self) -> bool {
        true
    }

    /// [`replay_window`]: replay after a restart when a replay socket is
    /// configured.
    fn window(&self, follow: &Follow) -> SeqWindowConfig {
        replay_window(follow)
    }

    fn frame_decoder(&self) -> Option<Box<dyn FrameDecoder>> {
        Some(Box::new(SglangDecoder))
    }

    /// [`zmq_streams`]: one subscriber per DP rank.
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        zmq_streams(follow)
    }

    fn metrics_dialect(&self) -> Option<MetricsDialect> {
        Some(MetricsDialect::Sglang)
    }

    /// SGLang's validators (`cache_salt` normalised, not validated).
    fn prompt_dialect(&self) -> Dialect {
        Dialect::Sglang
    }

    fn token_ids_equivalent(&self, api: ApiKind, body: &PyValue) -> Result<(), KeepText> {
        let d = completion_with_text_prompt(api, body)?;
        if present(d, "add_special_tokens") {
            return Err(KeepText::AddSpecialTokens);
        }
        Ok(())
    }
}
