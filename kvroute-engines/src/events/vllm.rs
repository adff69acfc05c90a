//! vLLM `KVEventBatch` payloads (ZeroMQ frame 2), every layout from 0.9.0 on.
//!
//! * 0.24.0 and later: events are msgpack **maps** tagged by `"type"`; defaulted
//!   fields are omitted. Decoded by key, in any order.
//! * 0.9.0 – 0.23.x: events are **arrays** `[tag, field1, ...]` with every field of
//!   that version present. Fields were only ever appended (see [`ArrayLayout`]), so
//!   the event's length tells the version and positional decoding needs no hint.
//!
//! Block hashes are either integers (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the
//! default) or the raw digests as `bin` (`=0`); digests become the same 64-bit key
//! the int mode publishes (last 8 bytes, big-endian), so both modes route alike.

use kvroute_ingest::EventBatch;

use super::kv_batch::{self, Dialect, Field};
use super::{DecodeError, DecodeStats};

const STORED_POSITIONS: &[Field] = &[
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::Ignored, // kv_cache_spec_sliding_window
];

const REMOVED_POSITIONS: &[Field] = &[Field::BlockHashes, Field::Medium, Field::GroupIdx];

fn field_of_key(key: &str) -> Option<Field> {
    Some(match key {
        "block_hashes" => Field::BlockHashes,
        "parent_block_hash" => Field::ParentBlockHash,
        "token_ids" => Field::TokenIds,
        "block_size" => Field::BlockSize,
        "lora_id" => Field::LoraId,
        "medium" => Field::Medium,
        "lora_name" => Field::LoraName,
        "extra_keys" => Field::ExtraKeys,
        "group_idx" => Field::GroupIdx,
        "kv_cache_spec_kind" => Field::SpecKind,
        "kv_cache_spec_sliding_window"
        | "locality"
        | "ownership"
        | "session_id"
        | "lookahead_token_ids" => Field::Ignored,
        _ => return None,
    })
}

static DIALECT: Dialect = Dialect {
    stored_positions: STORED_POSITIONS,
    removed_positions: REMOVED_POSITIONS,
    field_of_key,
};

/// Decodes one vLLM payload. `seq` is the transport sequence (ZeroMQ frame 1).
///
/// ```
/// use kvroute_engines::events::{vllm, DecodeStats};
/// let mut stats = DecodeStats::default();
/// // A truncated payload is an error, never a panic.
/// assert!(vllm::decode(&[0x93, 0xcb, 0x41], 0, &mut stats).is_err());
/// ```
pub fn decode(
    payload: &[u8],
    seq: u64,
    stats: &mut DecodeStats,
) -> Result<EventBatch, DecodeError> {
    let mut out = EventBatch::default();
    decode_into(payload, seq, &mut out, stats)?;
    Ok(out)
}

/// Like [`decode`], reusing `out` (its event Vec keeps its capacity).
pub fn decode_into(
    payload: &[u8],
    seq: u64,
    out: &mut EventBatch,
    stats: &mut DecodeStats,
) -> Result<(), DecodeError> {
    kv_batch::decode_into(&DIALECT, payload, seq, out, stats)
}

/// Positional field names of the legacy array layout of one vLLM release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrayLayout {
    /// `BlockStored` fields after the tag.
    pub block_stored: &'static [&'static str],
    /// `BlockRemoved` fields after the tag.
    pub block_removed: &'static [&'static str],
    /// Whether the batch carries `data_parallel_rank` as third element (0.9.2+).
    pub batch_has_dp_rank: bool,
}

const STORED_NAMES: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_NAMES: &[&str] = &["block_hashes", "medium", "group_idx"];

/// The array layout a vLLM version (`"0.23.0"`, `"0.10.2.post1"`, ...) publishes, or
/// `None` when it publishes maps (0.24.0+) or predates KV events (< 0.9.0) or the
/// string is not a version.
///
/// ```
/// use kvroute_engines::events::vllm::array_layout;
/// assert_eq!(array_layout("0.11.0").unwrap().block_stored.len(), 6);
/// assert!(array_layout("0.33.0").is_none());
/// ```
#[must_use]
pub fn array_layout(version: &str) -> Option<ArrayLayout> {
    let mut parts = version.split(['.', '+', '-']).map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let major = parts.next()??;
    let minor = parts.next()??;
    let patch = parts.next().flatten().unwrap_or(0);
    let v = (major, minor, patch);
    if major != 0 || !((0, 9, 0)..(0, 24, 0)).contains(&v) {
        return None;
    }
    let (stored, removed) = if v >= (0, 22, 0) {
        (11, 3)
    } else if v >= (0, 20, 0) {
        (9, 3)
    } else if v >= (0, 17, 0) {
        (8, 2)
    } else if v >= (0, 14, 0) {
        (7, 2)
    } else if v >= (0, 10, 2) {
        (6, 2)
    } else {
        (5, 1)
    };
    Some(ArrayLayout {
        block_stored: STORED_NAMES.get(..stored)?,
        block_removed: REMOVED_NAMES.get(..removed)?,
        batch_has_dp_rank: v >= (0, 9, 2),
    })
}
