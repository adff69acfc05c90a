//! The msgspec `KVEventBatch` wire shape shared by vLLM and SGLang.
//!
//! Both engines define the same three tagged structs with msgspec and encode the
//! batch as `[ts, events, dp_rank]`. They differ only in which fields exist and, for
//! the legacy array layout, in their positions, so one decoder takes a [`Dialect`].
//!
//! Array-layout fields were only ever appended, so a field's position never changes
//! across versions: decoding by position with the event's own length is unambiguous
//! and needs no version hint. Extra trailing positions (a future version) are
//! skipped and counted as unknown fields.

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};

use super::msgpack::{Int, Reader, MAX_DEPTH};
use super::{DecodeError, DecodeStats};

/// A field of `BlockStored` / `BlockRemoved` on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    /// vLLM's `kv_cache_spec_kind` (the attention kind of `group_idx`).
    SpecKind,
    CacheSalt,
    /// Known fields with no place in the neutral events
    /// (`kv_cache_spec_sliding_window`, `session_id`, `locality`, ...):
    /// skipped without counting.
    Ignored,
}

/// What distinguishes one engine's msgspec structs from another's.
#[derive(Debug)]
pub(crate) struct Dialect {
    /// `BlockStored` fields by array position (after the tag).
    pub(crate) stored_positions: &'static [Field],
    /// `BlockRemoved` fields by array position (after the tag).
    pub(crate) removed_positions: &'static [Field],
    /// Maps a map-layout key to its field; `None` = unknown (counted).
    pub(crate) field_of_key: fn(&str) -> Option<Field>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(s: &str) -> Tag {
    match s {
        "BlockStored" => Tag::Stored,
        "BlockRemoved" => Tag::Removed,
        "AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Field values of one event, filled in whatever order the wire uses.
/// Most elements reserved from a length a payload announces (the rest grow
/// as they decode).
const RESERVE_CAP: usize = 1024;
/// Events a reused batch keeps room for between payloads.
const KEEP_EVENTS: usize = 4096;

#[derive(Default)]
struct Fields {
    keys: Vec<BlockKey>,
    has_keys: bool,
    parent: Option<BlockKey>,
    tokens: Vec<TokenId>,
    has_tokens: bool,
    block_size: Option<u32>,
    medium: Medium,
    lora_name: Option<String>,
    extra_keys: Vec<Option<Vec<ExtraKey>>>,
    group: u32,
    full_attention: Option<bool>,
    cache_salt: Option<String>,
}

/// Whether a vLLM `KVCacheSpecKind` (`v1/kv_cache_interface.py`) attends to
/// every earlier token, so that its group holds every block of a prefix:
/// full attention, MLA and full attention with sinks do; sliding windows,
/// chunked-local attention, Mamba state, encoder-only and cross attention do
/// not. `unknown` (and any other string) says nothing.
pub(crate) fn full_attention_kind(kind: &str) -> Option<bool> {
    match kind {
        "full_attention" | "mla_attention" | "sink_full_attention" => Some(true),
        "sliding_window"
        | "sliding_window_mla"
        | "chunked_local_attention"
        | "mamba"
        | "encoder_only_attention"
        | "cross_attention" => Some(false),
        _ => None,
    }
}

/// Reads a block hash: an integer (its 64 bits) or a digest byte string (its last 8
/// bytes, big-endian — the same value vLLM publishes in int mode).
fn block_key(r: &mut Reader<'_>) -> Result<BlockKey, DecodeError> {
    let at = r.pos();
    match r.peek()? {
        0xc4..=0xc6 => {
            let b = r.bin()?;
            let tail = b
                .len()
                .checked_sub(8)
                .and_then(|s| b.get(s..))
                .ok_or(DecodeError::InvalidHash { offset: at })?;
            let mut k = [0u8; 8];
            k.copy_from_slice(tail);
            Ok(BlockKey(u64::from_be_bytes(k)))
        }
        _ => match r.int() {
            Ok(i) => Ok(BlockKey(i.bits())),
            Err(_) => Err(DecodeError::InvalidHash { offset: at }),
        },
    }
}

fn opt_string(r: &mut Reader<'_>) -> Result<Option<String>, DecodeError> {
    if r.eat_nil()? {
        Ok(None)
    } else {
        Ok(Some(r.str()?.to_owned()))
    }
}

fn medium(r: &mut Reader<'_>, stats: &mut DecodeStats) -> Result<Medium, DecodeError> {
    if r.eat_nil()? {
        // vLLM's `medium` is declared `str | None`; None means the default GPU pool.
        return Ok(Medium::Gpu);
    }
    let s = r.str()?;
    Ok(Medium::from_wire(s).unwrap_or_else(|| {
        stats.unknown_media += 1;
        Medium::External
    }))
}

/// One untagged extra key; `None` when the value has no neutral form.
fn extra_key(
    r: &mut Reader<'_>,
    depth: usize,
    stats: &mut DecodeStats,
) -> Result<Option<ExtraKey>, DecodeError> {
    if depth > MAX_DEPTH {
        return Err(DecodeError::TooDeep { offset: r.pos() });
    }
    Ok(match r.peek()? {
        0xa0..=0xbf | 0xd9..=0xdb => Some(ExtraKey::Text(r.str()?.to_owned())),
        0xc4..=0xc6 => Some(ExtraKey::Bytes(r.bin()?.to_vec())),
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xcf | 0xd0..=0xd3 => {
            Some(ExtraKey::Int(match r.int()? {
                Int::Unsigned(v) => i64::try_from(v).map_err(|_| DecodeError::IntOutOfRange {
                    offset: r.pos(),
                    what: "extra key integer",
                })?,
                Int::Negative(v) => v,
            }))
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            let n = r.array_len()?;
            let mut items = Vec::with_capacity(n.min(r.remaining() / 8));
            for _ in 0..n {
                if let Some(k) = extra_key(r, depth + 1, stats)? {
                    items.push(k);
                }
            }
            Some(ExtraKey::List(items))
        }
        _ => {
            r.skip_value()?;
            stats.unsupported_extra_keys += 1;
            None
        }
    })
}

fn read_field(
    r: &mut Reader<'_>,
    field: Field,
    f: &mut Fields,
    stats: &mut DecodeStats,
) -> Result<(), DecodeError> {
    match field {
        Field::BlockHashes => {
            let n = r.array_len()?;
            f.keys.clear();
            f.keys.reserve(n.min(RESERVE_CAP));
            for _ in 0..n {
                f.keys.push(block_key(r)?);
            }
            f.has_keys = true;
        }
        Field::ParentBlockHash => {
            f.parent = if r.eat_nil()? {
                None
            } else {
                Some(block_key(r)?)
            };
        }
        Field::TokenIds => {
            let n = r.array_len()?;
            f.tokens.clear();
            f.tokens.reserve(n.min(RESERVE_CAP));
            let mut bigram = false;
            for _ in 0..n {
                // SGLang with a bigram radix key (EAGLE speculative
                // decoding) publishes each token as (token, next token)
                // (`mem_cache/events.py`): the page's own token is the first.
                if matches!(r.peek()?, 0x90..=0x9f | 0xdc | 0xdd) {
                    let at = r.pos();
                    if r.array_len()? != 2 {
                        return Err(DecodeError::UnexpectedType {
                            offset: at,
                            expected: "a token id or a (token, next token) pair",
                            found: 0x90,
                        });
                    }
                    f.tokens.push(r.u32("token id")?);
                    r.u32("token id")?;
                    bigram = true;
                } else {
                    f.tokens.push(r.u32("token id")?);
                }
            }
            if bigram {
                stats.bigram_token_events += 1;
            }
            f.has_tokens = true;
        }
        Field::BlockSize => f.block_size = Some(r.u32("block_size")?),
        Field::Medium => f.medium = medium(r, stats)?,
        Field::LoraName => f.lora_name = opt_string(r)?,
        Field::CacheSalt => f.cache_salt = opt_string(r)?,
        Field::GroupIdx => {
            f.group = if r.eat_nil()? { 0 } else { r.u32("group_idx")? };
        }
        Field::SpecKind => {
            f.full_attention = opt_string(r)?.as_deref().and_then(full_attention_kind);
        }
        Field::ExtraKeys => {
            f.extra_keys.clear();
            if !r.eat_nil()? {
                let n = r.array_len()?;
                f.extra_keys.reserve(n.min(RESERVE_CAP));
                for _ in 0..n {
                    if r.eat_nil()? {
                        f.extra_keys.push(None);
                        continue;
                    }
                    let m = r.array_len()?;
                    let mut keys = Vec::with_capacity(m.min(r.remaining() / 8));
                    for _ in 0..m {
                        if let Some(k) = extra_key(r, 1, stats)? {
                            keys.push(k);
                        }
                    }
                    f.extra_keys.push(Some(keys));
                }
            }
        }
        Field::LoraId | Field::Ignored => r.skip_value()?,
    }
    Ok(())
}

fn build(tag: Tag, f: Fields) -> Result<Option<KvEvent>, DecodeError> {
    let missing = |what: &'static str| Err(DecodeError::BadLayout { what });
    Ok(match tag {
        Tag::Stored => {
            if !f.has_keys {
                return missing("BlockStored without block_hashes");
            }
            if !f.has_tokens {
                return missing("BlockStored without token_ids");
            }
            let Some(block_size) = f.block_size else {
                return missing("BlockStored without block_size");
            };
            Some(KvEvent::Stored(BlockStored {
                keys: f.keys,
                parent: f.parent,
                token_ids: f.tokens,
                block_size,
                partial_last_block: false,
                medium: f.medium,
                lora_name: f.lora_name,
                extra_keys: f.extra_keys,
                group: f.group,
                full_attention: f.full_attention,
                cache_salt: f.cache_salt,
            }))
        }
        Tag::Removed => {
            if !f.has_keys {
                return missing("BlockRemoved without block_hashes");
            }
            Some(KvEvent::Removed(BlockRemoved {
                keys: f.keys,
                medium: f.medium,
                group: f.group,
            }))
        }
        Tag::Cleared => Some(KvEvent::AllCleared),
        Tag::Unknown => None,
    })
}

/// Decodes one event (array or map layout). `Ok(None)` = skipped (unknown tag).
fn event(
    d: &Dialect,
    r: &mut Reader<'_>,
    stats: &mut DecodeStats,
) -> Result<Option<KvEvent>, DecodeError> {
    let mut f = Fields::default();
    match r.peek()? {
        0x90..=0x9f | 0xdc | 0xdd => {
            let n = r.array_len()?;
            if n == 0 {
                return Err(DecodeError::BadLayout {
                    what: "empty event array",
                });
            }
            let tag = tag_of(r.str()?);
            let positions: &[Field] = match tag {
                Tag::Stored => d.stored_positions,
                Tag::Removed => d.removed_positions,
                Tag::Cleared => &[],
                Tag::Unknown => {
                    stats.unknown_event_tags += 1;
                    for _ in 1..n {
                        r.skip_value()?;
                    }
                    return Ok(None);
                }
            };
            // The oldest layouts (vLLM 0.9.0, SGLang 0.4.10) already carry
            // block_hashes..lora_id for stores and block_hashes for removals.
            let required = match tag {
                Tag::Stored => 5,
                Tag::Removed => 1,
                _ => 0,
            };
            if n - 1 < required {
                return Err(DecodeError::BadLayout {
                    what: "event array shorter than the oldest layout",
                });
            }
            for i in 1..n {
                match positions.get(i - 1) {
                    Some(&field) => read_field(r, field, &mut f, stats)?,
                    None => {
                        stats.unknown_fields += 1;
                        r.skip_value()?;
                    }
                }
            }
            build(tag, f)
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let n = r.map_len()?;
            let mut tag = None;
            for i in 0..n {
                let key = r.str()?;
                if key == "type" {
                    let t = tag_of(r.str()?);
                    if t == Tag::Unknown {
                        stats.unknown_event_tags += 1;
                        for _ in i + 1..n {
                            r.skip_value()?;
                            r.skip_value()?;
                        }
                        return Ok(None);
                    }
                    tag = Some(t);
                    continue;
                }
                match (d.field_of_key)(key) {
                    Some(field) => read_field(r, field, &mut f, stats)?,
                    None => {
                        stats.unknown_fields += 1;
                        r.skip_value()?;
                    }
                }
            }
            match tag {
                Some(t) => build(t, f),
                None => Err(DecodeError::BadLayout {
                    what: "event map without \"type\"",
                }),
            }
        }
        m => Err(DecodeError::UnexpectedType {
            offset: r.pos(),
            expected: "event array or map",
            found: m,
        }),
    }
}

fn batch(
    d: &Dialect,
    payload: &[u8],
    out: &mut EventBatch,
    stats: &mut DecodeStats,
) -> Result<(), DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len()?;
    if n < 2 {
        return Err(DecodeError::BadLayout {
            what: "batch has fewer than 2 elements",
        });
    }
    out.timestamp = r.f64()?;
    let count = r.array_len()?;
    // A header's count is the peer's word: reserve a little, grow as
    // events actually decode.
    out.events.reserve(count.min(RESERVE_CAP));
    for _ in 0..count {
        stats.events += 1;
        let start = r.pos();
        match event(d, &mut r, stats) {
            Ok(Some(ev)) => out.events.push(ev),
            Ok(None) => {}
            Err(e) => {
                // Drop just this event if the payload's structure is still intact.
                r.rewind(start);
                if r.skip_value().is_err() {
                    return Err(e);
                }
                stats.malformed_events += 1;
                tracing::debug!(error = %e, "dropped malformed KV event");
            }
        }
    }
    if n >= 3 {
        out.dp_rank = if r.eat_nil()? {
            None
        } else {
            Some(r.u32("data_parallel_rank")?)
        };
    }
    for _ in 3..n {
        stats.unknown_fields += 1;
        r.skip_value()?;
    }
    if !r.is_empty() {
        return Err(DecodeError::TrailingBytes {
            offset: r.pos(),
            count: r.remaining(),
        });
    }
    Ok(())
}

/// Decodes one payload into `out` (its `events` Vec is reused). On error `out.events`
/// is left empty and only `malformed_payloads` is incremented.
pub(crate) fn decode_into(
    d: &Dialect,
    payload: &[u8],
    seq: u64,
    out: &mut EventBatch,
    stats: &mut DecodeStats,
) -> Result<(), DecodeError> {
    out.seq = seq;
    out.timestamp = 0.0;
    out.dp_rank = None;
    out.events.clear();
    // The Vec is kept across payloads: not at the size of the largest one
    // a peer ever sent.
    if out.events.capacity() > KEEP_EVENTS {
        out.events = Vec::new();
    }
    let mut local = DecodeStats::default();
    match batch(d, payload, out, &mut local) {
        Ok(()) => {
            local.batches += 1;
            stats.merge(&local);
            Ok(())
        }
        Err(e) => {
            out.events.clear();
            stats.malformed_payloads += 1;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header announcing four billion events over 16 MiB of nils: nothing
    /// near that is reserved (it would stay with the subscriber's reused
    /// batch for good), and a batch grown by a large real payload shrinks
    /// back at the next one.
    #[test]
    fn announced_lengths_reserve_little_and_a_reused_batch_shrinks() {
        let mut hostile = vec![0x93, 0xcb];
        hostile.extend_from_slice(&0f64.to_be_bytes());
        hostile.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        hostile.resize(hostile.len() + (16 << 20), 0xc0);
        let mut out = EventBatch::default();
        let mut stats = DecodeStats::default();
        let sglang = crate::events::sglang::decode_into;
        assert!(sglang(&hostile, 1, &mut out, &mut stats).is_err());
        assert!(
            out.events.capacity() <= RESERVE_CAP,
            "{}",
            out.events.capacity()
        );
        // One key list announcing four billion keys, truncated: same.
        let mut keys = vec![0x93, 0xcb];
        keys.extend_from_slice(&0f64.to_be_bytes());
        keys.extend_from_slice(&[0x91, 0x82, 0xa4]);
        keys.extend_from_slice(b"type");
        keys.extend_from_slice(&[0xab]);
        keys.extend_from_slice(b"BlockStored");
        keys.extend_from_slice(&[0xac]);
        keys.extend_from_slice(b"block_hashes");
        keys.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        keys.resize(keys.len() + (1 << 20), 0x01);
        let _ = sglang(&keys, 2, &mut out, &mut stats);
        // A real batch larger than what is kept, then a small one.
        out.events = Vec::with_capacity(KEEP_EVENTS * 2);
        let mut small = vec![0x93, 0xcb];
        small.extend_from_slice(&0f64.to_be_bytes());
        small.extend_from_slice(&[0x90, 0xc0]);
        sglang(&small, 3, &mut out, &mut stats).unwrap();
        assert!(out.events.capacity() <= KEEP_EVENTS);
    }
}
