//! SGLang `KVEventBatch` payloads (ZeroMQ frame 2), 0.4.10 – 0.5.23.
//!
//! * 0.5.20 and later: events are msgpack **maps** tagged by `"type"` (optional
//!   `cache_salt`, `session_id`, `lora_name`); one `BlockStored` may cover several
//!   pages.
//! * up to 0.5.19: **arrays** `["BlockStored", hashes, parent, tokens, block_size,
//!   lora_id(, medium)]` — `medium` is missing in 0.4.10 / 0.5.5; the event length
//!   tells which.
//!
//! Hashes arrive as int64 (`0xd3`, negative values) or uint64 (`0xcf`); both keep
//! their 64 bits (`BlockKey::from_i64`). Medium `"CPU_PINNED"` is the host tier.

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
];

const REMOVED_POSITIONS: &[Field] = &[Field::BlockHashes, Field::Medium];

fn field_of_key(key: &str) -> Option<Field> {
    Some(match key {
        "block_hashes" => Field::BlockHashes,
        "parent_block_hash" => Field::ParentBlockHash,
        "token_ids" => Field::TokenIds,
        "block_size" => Field::BlockSize,
        "lora_id" => Field::LoraId,
        "medium" => Field::Medium,
        "lora_name" => Field::LoraName,
        "cache_salt" => Field::CacheSalt,
        "session_id" => Field::Ignored,
        _ => return None,
    })
}

static DIALECT: Dialect = Dialect {
    stored_positions: STORED_POSITIONS,
    removed_positions: REMOVED_POSITIONS,
    field_of_key,
};

/// Decodes one SGLang payload. `seq` is the transport sequence (ZeroMQ frame 1).
///
/// ```
/// use kvroute_engines::events::{sglang, DecodeStats};
/// let mut stats = DecodeStats::default();
/// // ["AllBlocksCleared"] in the legacy array layout, batch without a rank.
/// let payload = [0x92, 0x00, 0x91, 0x91, 0xb0, b'A', b'l', b'l', b'B', b'l', b'o', b'c',
///     b'k', b's', b'C', b'l', b'e', b'a', b'r', b'e', b'd'];
/// let batch = sglang::decode(&payload, 3, &mut stats).unwrap();
/// assert_eq!(batch.events.len(), 1);
/// assert_eq!(batch.dp_rank, None);
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
