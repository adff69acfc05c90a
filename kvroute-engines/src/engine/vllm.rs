//! vLLM: msgpack `KVEventBatch`es over ZeroMQ (one PUB per DP rank on
//! `port + rank`, ROUTER replay), `/metrics` in Prometheus text with `vllm:`
//! names, vLLM's own request validators.
//!
//! Token-id prompts (vLLM 0.33, `entrypoints/openai/completion/protocol.py`,
//! `renderers/base.py`, `renderers/params.py`): `CompletionRequest.prompt` is
//! `list[int >= 0] | list[list[int]] | str | list[str]`. A string is
//! tokenized as `tokenizer(prompt, add_special_tokens=…)` (default `true`:
//! the BOS, if the tokenizer adds one, is in the ids kvroute computes the
//! same way); a token list becomes `prompt_token_ids` verbatim — no
//! tokenization, so no second BOS — and only truncation and the
//! `max_model_len` check run on it, as on the tokenized text. Differences,
//! all kept as text: `echo` (the echoed prompt is the ids decoded back,
//! `tokenizer.decode`, not the client's string), `suffix` (fill-in-the-middle
//! rendering needs text), `truncate_prompt_tokens` (the ids must be the whole
//! prompt), `return_token_offsets` (offsets exist for text input only).
//! `prompt_logprobs`, `logprobs`, `return_token_ids`, `usage` and
//! `cached_tokens` are the same for the same ids. `add_special_tokens` is
//! ignored for an id prompt, which is right: it already shaped the ids.
//!
//! ```
//! use kvroute_engines::engine::{Engine, KeepText, VLLM};
//! use kvroute_engines::{prompt::parse_json, ApiKind};
//! let plain = parse_json(br#"{"model": "m", "prompt": "hi", "max_tokens": 4}"#).unwrap();
//! assert_eq!(VLLM.token_ids_equivalent(ApiKind::Completions, &plain), Ok(()));
//! let echo = parse_json(br#"{"model": "m", "prompt": "hi", "echo": true}"#).unwrap();
//! assert_eq!(VLLM.token_ids_equivalent(ApiKind::Completions, &echo), Err(KeepText::Echo));
//! let offsets = parse_json(br#"{"model": "m", "prompt": "hi", "return_token_offsets": true}"#).unwrap();
//! assert_eq!(VLLM.token_ids_equivalent(ApiKind::Completions, &offsets), Err(KeepText::TokenOffsets));
//! assert_eq!(VLLM.token_ids_equivalent(ApiKind::Chat, &plain), Err(KeepText::Chat));
//! ```

use kvroute_ingest::{EventBatch, SeqWindowConfig};

use super::token_ids::{completion_with_text_prompt, flag_set};
use super::{replay_window, zmq_streams, Engine, Follow, FrameDecoder, KeepText, Stream};
use crate::events::{self, DecodeError, DecodeStats};
use crate::prompt::{Dialect, PyValue};
use crate::transport::TransportError;
use crate::{ApiKind, MetricsDialect};

/// vLLM (0.9 – 0.33).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Vllm;

/// The vLLM engine.
pub static VLLM: Vllm = Vllm;

/// vLLM's ZeroMQ payloads ([`events::vllm::decode_into`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct VllmDecoder;

impl FrameDecoder for VllmDecoder {
    fn decode_into(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut EventBatch,
        stats: &mut DecodeStats,
    ) -> Result<(), DecodeError> {
        events::vllm::decode_into(payload, seq, out, stats)
    }
}

impl Engine for Vllm {
    fn name(&self) -> &str {
        "vllm"
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
        Some(Box::new(VllmDecoder))
    }

    /// [`zmq_streams`]: one subscriber per DP rank.
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        zmq_streams(follow)
    }

    fn metrics_dialect(&self) -> Option<MetricsDialect> {
        Some(MetricsDialect::Vllm)
    }

    fn prompt_dialect(&self) -> Dialect {
        Dialect::Vllm
    }

    fn token_ids_equivalent(&self, api: ApiKind, body: &PyValue) -> Result<(), KeepText> {
        let d = completion_with_text_prompt(api, body)?;
        if flag_set(d, "return_token_offsets") {
            return Err(KeepText::TokenOffsets);
        }
        Ok(())
    }
}
