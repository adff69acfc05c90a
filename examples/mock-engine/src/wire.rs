//! Encoders from engine-neutral events to the engines' KV-event payloads, byte
//! for byte as the engines' own msgspec encoders write them
//! (golden/vllm-events/README.md, golden/sglang-events/README.md).

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::{BlockRemoved, BlockStored, ExtraKey, KvEvent};
use rmp::encode;

/// Writing into a `Vec<u8>` cannot fail for I/O reasons; this covers the
/// length-overflow cases msgpack has (more than 2^32 entries).
#[derive(Debug, thiserror::Error)]
#[error("msgpack encoding failed: {0}")]
pub struct EncodeError(String);

impl From<encode::ValueWriteError> for EncodeError {
    fn from(e: encode::ValueWriteError) -> Self {
        Self(e.to_string())
    }
}

impl From<std::io::Error> for EncodeError {
    fn from(e: std::io::Error) -> Self {
        Self(e.to_string())
    }
}

/// Which engine's payload layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFormat {
    /// vLLM 0.24 – 0.33 `KVEventBatch` (map events, `kv_cache_spec_kind` annotation).
    Vllm,
    /// SGLang ≥ 0.5.20 `KVEventBatch` (map events, hashes as signed i64).
    Sglang,
}

type Out = Vec<u8>;

fn len32(n: usize) -> Result<u32, EncodeError> {
    u32::try_from(n).map_err(|_| EncodeError(format!("{n} entries exceed msgpack limits")))
}

fn key(out: &mut Out, k: &str) -> Result<(), EncodeError> {
    encode::write_str(out, k)?;
    Ok(())
}

/// msgspec writes a struct with more than 15 possible fields with a map16 header
/// even when fewer are present.
fn map16(out: &mut Out, n: u16) {
    out.push(0xde);
    out.extend_from_slice(&n.to_be_bytes());
}

fn medium_name(format: WireFormat, m: Medium) -> &'static str {
    match (format, m) {
        (_, Medium::Gpu) => "GPU",
        (WireFormat::Vllm, Medium::Cpu) => "CPU",
        (WireFormat::Sglang, Medium::Cpu) => "CPU_PINNED",
        (_, Medium::Disk) => "DISK",
        (_, Medium::External) => "EXTERNAL",
    }
}

fn block_key(out: &mut Out, format: WireFormat, k: BlockKey) -> Result<(), EncodeError> {
    match format {
        WireFormat::Vllm => {
            encode::write_uint(out, k.0)?;
        }
        WireFormat::Sglang => {
            encode::write_sint(out, k.as_i64())?;
        }
    }
    Ok(())
}

fn keys(out: &mut Out, format: WireFormat, ks: &[BlockKey]) -> Result<(), EncodeError> {
    encode::write_array_len(out, len32(ks.len())?)?;
    for &k in ks {
        block_key(out, format, k)?;
    }
    Ok(())
}

fn tokens(out: &mut Out, ts: &[TokenId]) -> Result<(), EncodeError> {
    encode::write_array_len(out, len32(ts.len())?)?;
    for &t in ts {
        encode::write_uint(out, u64::from(t))?;
    }
    Ok(())
}

fn opt_str(out: &mut Out, s: Option<&str>) -> Result<(), EncodeError> {
    match s {
        Some(s) => encode::write_str(out, s)?,
        None => encode::write_nil(out)?,
    }
    Ok(())
}

fn extra_keys(out: &mut Out, items: &[ExtraKey]) -> Result<(), EncodeError> {
    encode::write_array_len(out, len32(items.len())?)?;
    for item in items {
        match item {
            ExtraKey::Text(t) => encode::write_str(out, t)?,
            ExtraKey::Int(i) => {
                encode::write_sint(out, *i)?;
            }
            ExtraKey::Bytes(b) => encode::write_bin(out, b)?,
            ExtraKey::List(l) => extra_keys(out, l)?,
        }
    }
    Ok(())
}

fn stored(out: &mut Out, format: WireFormat, s: &BlockStored) -> Result<(), EncodeError> {
    match format {
        WireFormat::Vllm => {
            // type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
            // medium, lora_name (always) + extra_keys, group_idx, kv_cache_spec_kind.
            map16(out, 11);
        }
        WireFormat::Sglang => {
            let optional = usize::from(s.cache_salt.is_some()) + usize::from(s.lora_name.is_some());
            encode::write_map_len(out, len32(7 + optional)?)?;
        }
    }
    key(out, "type")?;
    key(out, "BlockStored")?;
    key(out, "block_hashes")?;
    keys(out, format, &s.keys)?;
    key(out, "parent_block_hash")?;
    match s.parent {
        Some(p) => block_key(out, format, p)?,
        None => encode::write_nil(out)?,
    }
    key(out, "token_ids")?;
    tokens(out, &s.token_ids)?;
    key(out, "block_size")?;
    encode::write_uint(out, u64::from(s.block_size))?;
    key(out, "lora_id")?;
    encode::write_nil(out)?;
    key(out, "medium")?;
    key(out, medium_name(format, s.medium))?;
    match format {
        WireFormat::Vllm => {
            key(out, "lora_name")?;
            opt_str(out, s.lora_name.as_deref())?;
            key(out, "extra_keys")?;
            // One entry per block (vLLM always fills the list).
            encode::write_array_len(out, len32(s.keys.len())?)?;
            for i in 0..s.keys.len() {
                match s.extra_keys.get(i) {
                    Some(Some(items)) => extra_keys(out, items)?,
                    _ => encode::write_nil(out)?,
                }
            }
            key(out, "group_idx")?;
            encode::write_uint(out, u64::from(s.group))?;
            key(out, "kv_cache_spec_kind")?;
            key(out, "full_attention")?;
        }
        WireFormat::Sglang => {
            if let Some(salt) = &s.cache_salt {
                key(out, "cache_salt")?;
                key(out, salt)?;
            }
            if let Some(lora) = &s.lora_name {
                key(out, "lora_name")?;
                key(out, lora)?;
            }
        }
    }
    Ok(())
}

fn removed(out: &mut Out, format: WireFormat, r: &BlockRemoved) -> Result<(), EncodeError> {
    let fields = match format {
        WireFormat::Vllm => 4,
        WireFormat::Sglang => 3,
    };
    encode::write_map_len(out, fields)?;
    key(out, "type")?;
    key(out, "BlockRemoved")?;
    key(out, "block_hashes")?;
    keys(out, format, &r.keys)?;
    key(out, "medium")?;
    key(out, medium_name(format, r.medium))?;
    if format == WireFormat::Vllm {
        key(out, "group_idx")?;
        encode::write_uint(out, u64::from(r.group))?;
    }
    Ok(())
}

/// Encodes one `KVEventBatch` payload (`[ts, events, dp_rank]`) into `out`
/// (cleared first). `Moved` events have no vLLM/SGLang form and are skipped.
///
/// ```
/// # use kvroute_ingest::KvEvent;
/// # use kvroute_mock_engine::wire::{encode_batch, WireFormat};
/// let mut out = Vec::new();
/// encode_batch(WireFormat::Vllm, 0.0, &[KvEvent::AllCleared], Some(0), &mut out)?;
/// assert_eq!(out[0], 0x93);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn encode_batch(
    format: WireFormat,
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
    out: &mut Out,
) -> Result<(), EncodeError> {
    out.clear();
    encode::write_array_len(out, 3)?;
    encode::write_f64(out, ts)?;
    let n = events
        .iter()
        .filter(|e| !matches!(e, KvEvent::Moved(_)))
        .count();
    encode::write_array_len(out, len32(n)?)?;
    for e in events {
        match e {
            KvEvent::Stored(s) => stored(out, format, s)?,
            KvEvent::Removed(r) => removed(out, format, r)?,
            KvEvent::AllCleared => {
                encode::write_map_len(out, 1)?;
                key(out, "type")?;
                key(out, "AllBlocksCleared")?;
            }
            KvEvent::Moved(_) => {}
        }
    }
    match dp_rank {
        Some(r) => {
            encode::write_uint(out, u64::from(r))?;
        }
        None => encode::write_nil(out)?,
    }
    Ok(())
}
