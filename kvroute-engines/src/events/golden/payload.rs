//! Payload fixtures (vLLM and SGLang): the payload's bytes, its generic
//! msgpack reading, and the decoder's neutral events against the events read
//! from `decoded_payload` by field name.

use std::path::Path;

use kvroute_core::{BlockKey, Medium};
use kvroute_ingest::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
use serde_json::Value;

use super::{decode, sha256_hex, str_at, unhex, Engine, GoldenReport};
use crate::events::msgpack::{hex_lower, to_json, Reader};
use crate::events::{vllm, DecodeStats};

/// A payload fixture: bytes, generic decode, neutral decode.
pub(super) fn payload_fixture(r: &mut GoldenReport, v: &Value, dir: &Path, engine: Engine) {
    let (file, len, sha, seq) = match engine {
        Engine::Vllm => (
            str_at(v, "/payload_file"),
            v.get("payload_len").and_then(Value::as_u64),
            str_at(v, "/payload_sha256"),
            None,
        ),
        Engine::Sglang => (
            str_at(v, "/zmq_multipart/frame2_payload_file"),
            v.pointer("/zmq_multipart/frame2_payload_len")
                .and_then(Value::as_u64),
            str_at(v, "/zmq_multipart/frame2_payload_sha256"),
            v.pointer("/zmq_multipart/frame1_seq")
                .and_then(Value::as_u64),
        ),
    };
    let Some(file) = file else {
        return r.fail("payload file name", "missing");
    };
    let payload = match std::fs::read(dir.join(file)) {
        Ok(p) => p,
        Err(e) => return r.fail(format!("read {file}"), e),
    };
    if let Some(hex) = str_at(v, "/payload_hex") {
        r.eq(
            "payload file == payload_hex",
            Some(payload.clone()),
            unhex(hex),
        );
    }
    if let Some(len) = len {
        r.eq("payload length", len, payload.len() as u64);
    }
    match sha {
        Some(sha) => r.eq("payload sha256", sha.to_string(), sha256_hex(&payload)),
        None => r.fail("payload sha256", "missing"),
    }
    if let (Some(seq), Some(hex)) = (seq, str_at(v, "/zmq_multipart/frame1_seq_hex_be_u64")) {
        r.eq(
            "frame1 seq hex",
            hex.to_string(),
            hex_lower(&seq.to_be_bytes()),
        );
    }
    if engine == Engine::Vllm {
        legacy_field_names(r, v);
    }
    let Some(expected) = v.get("decoded_payload") else {
        return r.fail("decoded_payload", "missing");
    };
    let names = v.get("array_field_names");
    payload_matches(
        r,
        "payload",
        engine,
        &payload,
        seq.unwrap_or(0),
        expected,
        names,
    );
}

/// The fixture's positional names agree with [`vllm::array_layout`] for its version.
fn legacy_field_names(r: &mut GoldenReport, v: &Value) {
    let Some(names) = v.get("array_field_names") else {
        return;
    };
    let version = str_at(v, "/engine_version").unwrap_or_default();
    let Some(layout) = vllm::array_layout(version) else {
        return r.fail(
            "array layout",
            format!("no array layout known for vLLM {version}"),
        );
    };
    let list = |k: &str| -> Vec<String> {
        names
            .get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let own = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    r.eq(
        "BlockStored array fields",
        list("BlockStored"),
        own(layout.block_stored),
    );
    r.eq(
        "BlockRemoved array fields",
        list("BlockRemoved"),
        own(layout.block_removed),
    );
}

/// Generic decode == `expected`, and neutral decode == events read from `expected`.
pub(super) fn payload_matches(
    r: &mut GoldenReport,
    at: &str,
    engine: Engine,
    payload: &[u8],
    seq: u64,
    expected: &Value,
    names: Option<&Value>,
) {
    let mut reader = Reader::new(payload);
    match to_json(&mut reader, 0) {
        Ok(generic) => {
            let ok = generic == *expected && reader.is_empty();
            r.check(
                format!("{at}: msgpack reads as decoded_payload"),
                ok,
                expected,
                generic,
            );
        }
        Err(e) => r.fail(format!("{at}: generic msgpack read"), e),
    }
    let mut stats = DecodeStats::default();
    let batch = match decode(engine, payload, seq, &mut stats) {
        Ok(b) => b,
        Err(e) => return r.fail(format!("{at}: decode"), e),
    };
    r.eq(
        format!("{at}: skipped or malformed events"),
        (0, 0, 0),
        (
            stats.unknown_fields,
            stats.unknown_event_tags,
            stats.malformed_events,
        ),
    );
    match expected_batch(engine, expected, names) {
        Ok(want) => {
            r.eq(format!("{at}: timestamp"), want.timestamp, batch.timestamp);
            r.eq(format!("{at}: dp rank"), want.dp_rank, batch.dp_rank);
            r.eq(
                format!("{at}: event count"),
                want.events.len(),
                batch.events.len(),
            );
            for (i, (w, g)) in want.events.iter().zip(&batch.events).enumerate() {
                r.eq(format!("{at}: event {i}"), w, g);
            }
        }
        Err(e) => r.fail(format!("{at}: read decoded_payload"), e),
    }
}

// ---- the JSON-side reading of `decoded_payload` ----

fn json_key(v: &Value) -> Result<BlockKey, String> {
    if let Some(u) = v.as_u64() {
        return Ok(BlockKey(u));
    }
    if let Some(i) = v.as_i64() {
        return Ok(BlockKey::from_i64(i));
    }
    let bytes = str_at(v, "/bytes_hex")
        .and_then(unhex)
        .ok_or(format!("bad hash {v}"))?;
    let tail: [u8; 8] = bytes
        .len()
        .checked_sub(8)
        .and_then(|s| bytes.get(s..))
        .and_then(|t| t.try_into().ok())
        .ok_or(format!("digest shorter than 8 bytes: {v}"))?;
    Ok(BlockKey(u64::from_be_bytes(tail)))
}

fn json_extra(v: &Value) -> Result<ExtraKey, String> {
    Ok(match v {
        Value::String(s) => ExtraKey::Text(s.clone()),
        Value::Number(n) => ExtraKey::Int(n.as_i64().ok_or(format!("extra key int {n}"))?),
        Value::Array(a) => ExtraKey::List(a.iter().map(json_extra).collect::<Result<_, _>>()?),
        Value::Object(_) => ExtraKey::Bytes(
            str_at(v, "/bytes_hex")
                .and_then(unhex)
                .ok_or(format!("extra key {v}"))?,
        ),
        other => return Err(format!("extra key {other}")),
    })
}

const SGLANG_STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
];
const SGLANG_REMOVED: &[&str] = &["block_hashes", "medium"];

fn expected_batch(engine: Engine, v: &Value, names: Option<&Value>) -> Result<EventBatch, String> {
    let top = v.as_array().ok_or("decoded_payload is not an array")?;
    let ts = top.first().and_then(Value::as_f64).ok_or("no timestamp")?;
    let events = top.get(1).and_then(Value::as_array).ok_or("no events")?;
    let dp_rank = match top.get(2) {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or("bad rank")?,
        ),
    };
    let mut out = Vec::new();
    for ev in events {
        // Normalise both layouts to (tag, name → value).
        let (tag, fields): (String, Vec<(String, Value)>) = match ev {
            Value::Object(o) => (
                o.get("type")
                    .and_then(Value::as_str)
                    .ok_or("no type")?
                    .to_owned(),
                o.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            ),
            Value::Array(a) => {
                let tag = a
                    .first()
                    .and_then(Value::as_str)
                    .ok_or("no tag")?
                    .to_owned();
                let table: Vec<String> =
                    match (names.and_then(|n| n.get(&tag)), engine, tag.as_str()) {
                        (Some(n), _, _) => n
                            .as_array()
                            .ok_or("bad array_field_names")?
                            .iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect(),
                        (None, Engine::Sglang, "BlockStored") => {
                            SGLANG_STORED.iter().map(|s| (*s).to_owned()).collect()
                        }
                        (None, Engine::Sglang, "BlockRemoved") => {
                            SGLANG_REMOVED.iter().map(|s| (*s).to_owned()).collect()
                        }
                        _ => Vec::new(),
                    };
                let fields = table.into_iter().zip(a.iter().skip(1).cloned()).collect();
                (tag, fields)
            }
            _ => return Err("event neither map nor array".into()),
        };
        let get = |k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v);
        let keys = |k: &str| -> Result<Vec<BlockKey>, String> {
            get(k)
                .and_then(Value::as_array)
                .ok_or(format!("no {k}"))?
                .iter()
                .map(json_key)
                .collect()
        };
        let medium = match get("medium") {
            None | Some(Value::Null) => Medium::Gpu,
            Some(m) => Medium::from_wire(m.as_str().ok_or("medium")?).unwrap_or(Medium::External),
        };
        let group = get("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32;
        let opt_str = |k: &str| get(k).and_then(Value::as_str).map(str::to_owned);
        match tag.as_str() {
            "BlockStored" => {
                let parent = match get("parent_block_hash") {
                    None | Some(Value::Null) => None,
                    Some(p) => Some(json_key(p)?),
                };
                let token_ids = get("token_ids")
                    .and_then(Value::as_array)
                    .ok_or("no token_ids")?
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or("token")
                    })
                    .collect::<Result<_, _>>()?;
                let extra_keys = match get("extra_keys") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(x) => x
                        .as_array()
                        .ok_or("extra_keys")?
                        .iter()
                        .map(|b| match b {
                            Value::Null => Ok(None),
                            Value::Array(a) => {
                                a.iter().map(json_extra).collect::<Result<_, _>>().map(Some)
                            }
                            other => Err(format!("extra_keys entry {other}")),
                        })
                        .collect::<Result<_, _>>()?,
                };
                out.push(KvEvent::Stored(BlockStored {
                    keys: keys("block_hashes")?,
                    parent,
                    token_ids,
                    block_size: get("block_size")
                        .and_then(Value::as_u64)
                        .ok_or("block_size")? as u32,
                    partial_last_block: false,
                    medium,
                    lora_name: opt_str("lora_name"),
                    extra_keys,
                    group,
                    full_attention: opt_str("kv_cache_spec_kind")
                        .as_deref()
                        .and_then(super::super::kv_batch::full_attention_kind),
                    cache_salt: opt_str("cache_salt"),
                }));
            }
            "BlockRemoved" => out.push(KvEvent::Removed(BlockRemoved {
                keys: keys("block_hashes")?,
                medium,
                group,
            })),
            "AllBlocksCleared" => out.push(KvEvent::AllCleared),
            other => return Err(format!("unknown tag {other}")),
        }
    }
    Ok(EventBatch {
        seq: 0,
        timestamp: ts,
        dp_rank,
        events: out,
    })
}
