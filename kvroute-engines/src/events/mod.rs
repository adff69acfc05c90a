//! Decoders from the engines' KV-event wire formats to the engine-neutral
//! [`kvroute_ingest::EventBatch`] types.
//!
//! | engine | transport | decoder |
//! |---|---|---|
//! | vLLM 0.9.0 – 0.33.x | ZeroMQ PUB, msgpack `KVEventBatch` | [`vllm::decode`] |
//! | SGLang 0.4.10 – 0.5.23 | ZeroMQ PUB, msgpack `KVEventBatch` | [`sglang::decode`] |
//! | TensorRT-LLM ~1.1 – main 2026 | HTTP `POST /kv_cache_events` JSON drain | [`trtllm::TrtllmDecoder`] |
//!
//! Every decoder is total: any byte sequence yields either events or a typed
//! [`DecodeError`], never a panic, and the work is bounded by the input length.
//! Things the decoders skip on purpose (unknown fields, unknown event tags, events of
//! a smaller attention window, ...) are counted in [`DecodeStats`] so they stay
//! visible in metrics.
//!
//! ```
//! use kvroute_engines::events::{vllm, DecodeStats};
//! use kvroute_ingest::KvEvent;
//!
//! // [ts=0.0, [{"type": "AllBlocksCleared"}], dp_rank=0]
//! let payload = [
//!     0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x81, 0xa4, b't', b'y', b'p', b'e',
//!     0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's', b'C', b'l', b'e',
//!     b'a', b'r', b'e', b'd', 0x00,
//! ];
//! let mut stats = DecodeStats::default();
//! let batch = vllm::decode(&payload, 7, &mut stats).unwrap();
//! assert_eq!(batch.seq, 7);
//! assert_eq!(batch.dp_rank, Some(0));
//! assert_eq!(batch.events, vec![KvEvent::AllCleared]);
//! ```

mod frames;
#[cfg(feature = "parity")]
pub mod golden;
mod kv_batch;
pub(crate) mod msgpack;
pub mod sglang;
pub mod trtllm;
pub mod vllm;

pub use frames::{LiveMessage, ReplayReply, REPLAY_END_SEQ};

/// Why a payload could not be decoded.
///
/// Offsets are byte offsets into the payload (msgpack) — enough to find the spot in
/// a hex dump. The caller knows the endpoint and the transport sequence; it reports
/// them with [`MalformedPayload`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload ended inside a value.
    #[error("payload truncated at byte {offset}")]
    Truncated {
        /// Where the missing bytes should have started.
        offset: usize,
    },
    /// A value of the wrong msgpack type.
    #[error("expected {expected} at byte {offset}, found marker {found:#04x}")]
    UnexpectedType {
        /// Offset of the marker byte.
        offset: usize,
        /// What the layout requires there.
        expected: &'static str,
        /// The marker actually found.
        found: u8,
    },
    /// A string that is not UTF-8.
    #[error("invalid UTF-8 in string at byte {offset}")]
    InvalidUtf8 {
        /// Offset of the string header.
        offset: usize,
    },
    /// An integer outside the range of its field.
    #[error("{what} out of range at byte {offset}")]
    IntOutOfRange {
        /// Offset of the integer.
        offset: usize,
        /// Which field.
        what: &'static str,
    },
    /// A block hash that is neither an integer nor a byte string of at least 8 bytes.
    #[error("invalid block hash at byte {offset}")]
    InvalidHash {
        /// Offset of the hash value.
        offset: usize,
    },
    /// Nesting deeper than any engine produces.
    #[error("nesting too deep at byte {offset}")]
    TooDeep {
        /// Offset where the limit was hit.
        offset: usize,
    },
    /// The batch has the wrong shape (e.g. fewer than two elements).
    #[error("bad batch layout: {what}")]
    BadLayout {
        /// What is wrong.
        what: &'static str,
    },
    /// Bytes left over after the batch.
    #[error("{count} trailing bytes after the batch at byte {offset}")]
    TrailingBytes {
        /// Offset of the first extra byte.
        offset: usize,
        /// How many bytes are left.
        count: usize,
    },
    /// The TensorRT-LLM body is not valid JSON.
    #[error("invalid JSON: {0}")]
    Json(String),
}

/// Plain counters the decoders increment. Merge them into metrics as you like.
///
/// ```
/// let mut stats = kvroute_engines::events::DecodeStats::default();
/// assert!(kvroute_engines::events::vllm::decode(b"\xc1", 0, &mut stats).is_err());
/// assert_eq!(stats.malformed_payloads, 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Payloads (vLLM/SGLang messages, TensorRT-LLM drains) decoded successfully.
    pub batches: u64,
    /// Engine events seen inside successfully decoded payloads (including skipped ones).
    pub events: u64,
    /// Payloads rejected with a [`DecodeError`].
    pub malformed_payloads: u64,
    /// Single events dropped because their fields were invalid while the rest of the
    /// payload was well-formed.
    pub malformed_events: u64,
    /// Event fields this crate does not know (skipped).
    pub unknown_fields: u64,
    /// Events whose tag / type this crate does not know (skipped).
    pub unknown_event_tags: u64,
    /// Medium / cache-level values this crate does not know (mapped to
    /// [`kvroute_core::Medium::External`]).
    pub unknown_media: u64,
    /// Extra-key values that have no [`kvroute_ingest::ExtraKey`] form (floats, maps,
    /// booleans; dropped from the key list).
    pub unsupported_extra_keys: u64,
    /// TensorRT-LLM events of an attention window smaller than the largest one seen
    /// (dropped: only the full-attention window describes reusable prefixes).
    pub smaller_window_events: u64,
    /// TensorRT-LLM `created` events (cache capacity announcements).
    pub capacity_events: u64,
    /// Stored events whose tokens came as (token, next token) pairs: SGLang
    /// with a bigram radix key (EAGLE speculative decoding). Their block
    /// keys hash the pairs, not the plain token chain, so only a re-keying
    /// contract (`rekey:…`, from the tokens) matches them; the tokens kept
    /// are each pair's first.
    pub bigram_token_events: u64,
    /// TensorRT-LLM `updated` events without a cache-level change (priority only).
    pub priority_only_updates: u64,
    /// TensorRT-LLM blocks that left the GPU tier but could not be remembered
    /// because the decoder's off-GPU tier map was full: a later `removed` of such a
    /// block is applied to the GPU tier (the copy in the other tier goes stale).
    pub untracked_offloaded_blocks: u64,
}

impl DecodeStats {
    /// Adds another set of counters to this one.
    pub fn merge(&mut self, other: &DecodeStats) {
        self.batches += other.batches;
        self.events += other.events;
        self.malformed_payloads += other.malformed_payloads;
        self.malformed_events += other.malformed_events;
        self.unknown_fields += other.unknown_fields;
        self.unknown_event_tags += other.unknown_event_tags;
        self.unknown_media += other.unknown_media;
        self.unsupported_extra_keys += other.unsupported_extra_keys;
        self.smaller_window_events += other.smaller_window_events;
        self.capacity_events += other.capacity_events;
        self.bigram_token_events += other.bigram_token_events;
        self.priority_only_updates += other.priority_only_updates;
        self.untracked_offloaded_blocks += other.untracked_offloaded_blocks;
    }
}

/// A rejected payload, with where it came from: what a subscriber logs and exposes.
#[derive(Clone, Debug, PartialEq)]
pub struct MalformedPayload {
    /// The endpoint (as the caller names it) that sent the payload.
    pub endpoint: String,
    /// Transport sequence number of the payload (ZeroMQ frame 1, TensorRT-LLM drain
    /// counter).
    pub seq: u64,
    /// Payload length in bytes.
    pub len: usize,
    /// Why it was rejected.
    pub error: DecodeError,
}

impl MalformedPayload {
    /// Builds the report and logs it once at `warn` level.
    #[must_use]
    pub fn report(endpoint: &str, seq: u64, payload: &[u8], error: DecodeError) -> Self {
        tracing::warn!(endpoint, seq, len = payload.len(), %error, "malformed KV-event payload");
        Self {
            endpoint: endpoint.to_owned(),
            seq,
            len: payload.len(),
            error,
        }
    }
}

/// Fuzzing entry points (used by `fuzz/fuzz_targets/*` and the corpus replay test).
///
/// Each one decodes arbitrary bytes and panics only if an invariant breaks: exactly
/// one of `batches` / `malformed_payloads` moves per payload, and decoding into a
/// reused batch gives the same result as a fresh decode.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use kvroute_ingest::{EventBatch, KvEvent};

    use super::{sglang, trtllm, vllm, DecodeError, DecodeStats};

    type DecodeInto = fn(&[u8], u64, &mut EventBatch, &mut DecodeStats) -> Result<(), DecodeError>;

    fn msgspec(data: &[u8], decode_into: DecodeInto) {
        let mut stats = DecodeStats::default();
        let mut fresh = EventBatch::default();
        let first = decode_into(data, 9, &mut fresh, &mut stats);
        assert_eq!(stats.batches + stats.malformed_payloads, 1);
        assert_eq!(first.is_ok(), stats.batches == 1);
        let mut reused = EventBatch {
            events: vec![KvEvent::AllCleared; 3],
            ..EventBatch::default()
        };
        let second = decode_into(data, 9, &mut reused, &mut stats);
        assert_eq!(first, second);
        assert_eq!(fresh.events, reused.events);
        assert_eq!(fresh.dp_rank, reused.dp_rank);
    }

    /// Decodes `data` as a vLLM payload.
    pub fn vllm_events(data: &[u8]) {
        msgspec(data, vllm::decode_into);
    }

    /// Decodes `data` as an SGLang payload.
    pub fn sglang_events(data: &[u8]) {
        msgspec(data, sglang::decode_into);
    }

    /// Decodes `data` as a TensorRT-LLM drain twice (the second run sees the window
    /// and tier state of the first). Every `Removed` must name the tier a reference
    /// model of the emitted events puts the block in, and a decoder with a tiny
    /// tier-map bound must keep to it.
    pub fn trtllm_events(data: &[u8]) {
        let mut stats = DecodeStats::default();
        let mut dec = trtllm::TrtllmDecoder::new(32);
        let first = dec.decode_drain(data, &mut stats);
        let second = dec.decode_drain(data, &mut stats);
        assert_eq!(stats.batches + stats.malformed_payloads, 2);
        assert_eq!(first.is_ok(), second.is_ok());
        if let (Ok(a), Ok(b)) = (&first, &second) {
            assert_eq!(a.len(), b.len());
        }
        let mut tiers = std::collections::HashMap::new();
        for batch in first.iter().chain(second.iter()).flatten() {
            for event in &batch.events {
                match event {
                    KvEvent::Stored(s) => s.keys.iter().for_each(|k| {
                        tiers.insert(k.0, s.medium);
                    }),
                    KvEvent::Moved(m) => {
                        tiers.insert(m.key.0, m.to);
                    }
                    KvEvent::Removed(r) => {
                        for k in &r.keys {
                            let want = tiers.remove(&k.0).unwrap_or(kvroute_core::Medium::Gpu);
                            assert_eq!(r.medium, want, "removed block {}", k.0);
                        }
                    }
                    KvEvent::AllCleared => {}
                }
            }
        }
        let mut small = trtllm::TrtllmDecoder::new(32).with_off_gpu_limit(2);
        for _ in 0..2 {
            let _ = small.decode_drain(data, &mut stats);
            assert!(small.tracked_off_gpu_blocks() <= 2);
        }
    }
}
