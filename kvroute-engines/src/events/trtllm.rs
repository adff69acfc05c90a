//! TensorRT-LLM `POST /kv_cache_events` drains (JSON), classic (~1.1 – 1.2) and the
//! additive 2026 fields (`layer_group_id`, `hash_algo`, per-block `cache_salt`,
//! `mm_keys`).
//!
//! # Sequence numbers
//!
//! A drain holds many events, each with its own `event_id`, counted per attention-DP
//! rank. The decoder returns **one [`EventBatch`] per engine event**, with
//! `seq = event_id` and `dp_rank = attention_dp_rank`, in drain order. Events that
//! carry nothing for the inventory (`created`, smaller-window events, priority-only
//! updates, unknown types, malformed events that still have an id) become batches
//! with no events, so the per-rank `seq` stays contiguous and the ingest sequence
//! window sees a real gap only when the engine's event queue overflowed. A drain
//! therefore maps 1:1 onto the window logic of the ZeroMQ engines: route the batches
//! by `dp_rank` and feed them in order.
//!
//! # Mapping
//!
//! * `stored` → [`KvEvent::Stored`], split into runs of blocks with the same cache
//!   level and salt; `block_size` is the configured `tokens_per_block`, and a block
//!   with fewer tokens sets `partial_last_block` (and ends its run). Hashes are `u64`
//!   (C++ `size_t`), including values above 2^63.
//! * `removed` → [`KvEvent::Removed`] with medium GPU: TensorRT-LLM does not say
//!   which tier the block left.
//! * `updated` with a `cache_level` diff → [`KvEvent::Moved`] (level 0 = GPU,
//!   1 = host).
//! * `window_size`: only the largest window seen so far is kept (variable sliding
//!   window models emit one stream per window; only full attention describes a
//!   reusable prefix). The decoder remembers the largest window across drains.

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use serde_json::{Map, Value};

use super::{DecodeError, DecodeStats};

/// Stateful decoder for one TensorRT-LLM endpoint (remembers the largest attention
/// window and the last announced capacity).
///
/// ```
/// use kvroute_engines::events::{trtllm::TrtllmDecoder, DecodeStats};
/// use kvroute_ingest::KvEvent;
/// let body = br#"[{"event_id": 4, "window_size": 8192,
///     "data": {"type": "removed", "block_hashes": [18446744073709551615]}}]"#;
/// let mut dec = TrtllmDecoder::new(32);
/// let mut stats = DecodeStats::default();
/// let batches = dec.decode_drain(body, &mut stats).unwrap();
/// assert_eq!(batches[0].seq, 4);
/// let KvEvent::Removed(r) = &batches[0].events[0] else { unreachable!() };
/// assert_eq!(r.keys[0].0, u64::MAX);
/// ```
#[derive(Clone, Debug)]
pub struct TrtllmDecoder {
    tokens_per_block: u32,
    largest_window: Option<u64>,
    capacity: Option<Vec<u64>>,
}

const EVENT_KEYS: &[&str] = &[
    "event_id",
    "data",
    "window_size",
    "attention_dp_rank",
    "layer_group_id",
    "hash_algo",
];
const STORED_KEYS: &[&str] = &["type", "parent_hash", "blocks"];
const BLOCK_KEYS: &[&str] = &[
    "type",
    "block_hash",
    "tokens",
    "cache_level",
    "priority",
    "cache_salt",
    "mm_keys",
    "lora_id",
];

impl TrtllmDecoder {
    /// A decoder for an engine with `tokens_per_block` tokens per KV block (needed to
    /// recognise partial blocks; 0 treats every block as full).
    #[must_use]
    pub fn new(tokens_per_block: u32) -> Self {
        Self {
            tokens_per_block,
            largest_window: None,
            capacity: None,
        }
    }

    /// The largest attention window seen so far.
    #[must_use]
    pub fn largest_window(&self) -> Option<u64> {
        self.largest_window
    }

    /// `num_blocks_per_cache_level` of the last `created` event (`[gpu, host]`).
    #[must_use]
    pub fn capacity(&self) -> Option<&[u64]> {
        self.capacity.as_deref()
    }

    /// Forgets the window and capacity state (after an engine restart).
    pub fn reset(&mut self) {
        self.largest_window = None;
        self.capacity = None;
    }

    /// Decodes one drain body (`[]` when idle).
    pub fn decode_drain(
        &mut self,
        body: &[u8],
        stats: &mut DecodeStats,
    ) -> Result<Vec<EventBatch>, DecodeError> {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => self.decode_value(&v, stats),
            Err(e) => {
                stats.malformed_payloads += 1;
                Err(DecodeError::Json(e.to_string()))
            }
        }
    }

    /// Decodes an already parsed drain.
    pub fn decode_value(
        &mut self,
        drain: &Value,
        stats: &mut DecodeStats,
    ) -> Result<Vec<EventBatch>, DecodeError> {
        let Some(events) = drain.as_array() else {
            stats.malformed_payloads += 1;
            return Err(DecodeError::BadLayout {
                what: "drain is not a JSON array",
            });
        };
        let drain_max = events
            .iter()
            .filter_map(|e| e.get("window_size").and_then(Value::as_u64))
            .max();
        self.largest_window = self.largest_window.max(drain_max);

        let mut out = Vec::with_capacity(events.len());
        for (index, ev) in events.iter().enumerate() {
            stats.events += 1;
            let id = ev.get("event_id").and_then(Value::as_u64);
            let rank = ev
                .get("attention_dp_rank")
                .and_then(Value::as_u64)
                .and_then(|r| u32::try_from(r).ok());
            let mut batch = EventBatch {
                seq: id.unwrap_or(0),
                timestamp: 0.0,
                dp_rank: rank,
                events: Vec::new(),
            };
            match self.event(ev, &mut batch.events, stats) {
                Ok(()) if id.is_some() => out.push(batch),
                Ok(()) => {
                    stats.malformed_events += 1;
                    tracing::debug!(index, "TensorRT-LLM event without event_id dropped");
                }
                Err(what) => {
                    stats.malformed_events += 1;
                    tracing::debug!(index, what, "malformed TensorRT-LLM event dropped");
                    if id.is_some() {
                        batch.events.clear();
                        out.push(batch);
                    }
                }
            }
        }
        stats.batches += 1;
        Ok(out)
    }

    fn event(
        &mut self,
        ev: &Value,
        out: &mut Vec<KvEvent>,
        stats: &mut DecodeStats,
    ) -> Result<(), String> {
        let obj = ev.as_object().ok_or("event is not an object")?;
        count_unknown(obj, EVENT_KEYS, stats);
        if let Some(w) = obj.get("window_size").filter(|w| !w.is_null()) {
            let w = w.as_u64().ok_or("window_size is not an unsigned integer")?;
            if self.largest_window.is_some_and(|max| w < max) {
                stats.smaller_window_events += 1;
                return Ok(());
            }
        }
        if let Some(r) = obj.get("attention_dp_rank").filter(|r| !r.is_null()) {
            r.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or("attention_dp_rank is not a u32")?;
        }
        let group = match obj.get("layer_group_id") {
            None | Some(Value::Null) => 0,
            Some(g) => g
                .as_u64()
                .and_then(|g| u32::try_from(g).ok())
                .ok_or("layer_group_id is not a u32")?,
        };
        let data = obj
            .get("data")
            .and_then(Value::as_object)
            .ok_or("event has no data object")?;
        match data.get("type").and_then(Value::as_str) {
            Some("created") => {
                let levels = data
                    .get("num_blocks_per_cache_level")
                    .and_then(Value::as_array)
                    .ok_or("created without num_blocks_per_cache_level")?;
                let caps = levels
                    .iter()
                    .map(Value::as_u64)
                    .collect::<Option<Vec<u64>>>()
                    .ok_or("num_blocks_per_cache_level is not a list of counts")?;
                self.capacity = Some(caps);
                stats.capacity_events += 1;
            }
            Some("stored") => self.stored(data, group, out, stats)?,
            Some("removed") => {
                count_unknown(data, &["type", "block_hashes"], stats);
                let keys = data
                    .get("block_hashes")
                    .and_then(Value::as_array)
                    .ok_or("removed without block_hashes")?
                    .iter()
                    .map(hash)
                    .collect::<Result<Vec<_>, _>>()?;
                out.push(KvEvent::Removed(BlockRemoved {
                    keys,
                    medium: Medium::Gpu,
                    group,
                }));
            }
            Some("updated") => {
                count_unknown(
                    data,
                    &["type", "block_hash", "cache_level", "priority"],
                    stats,
                );
                let key = hash(data.get("block_hash").ok_or("updated without block_hash")?)?;
                match data.get("cache_level") {
                    None | Some(Value::Null) => stats.priority_only_updates += 1,
                    Some(diff) => {
                        let level = |name: &str| {
                            diff.get(name)
                                .and_then(Value::as_u64)
                                .ok_or("cache_level diff without integer values")
                        };
                        let from = level_medium(level("old_value")?, stats);
                        let to = level_medium(level("new_value")?, stats);
                        out.push(KvEvent::Moved(BlockMoved { key, from, to }));
                    }
                }
            }
            Some(_) => stats.unknown_event_tags += 1,
            None => return Err("data has no type".into()),
        }
        Ok(())
    }

    fn stored(
        &self,
        data: &Map<String, Value>,
        group: u32,
        out: &mut Vec<KvEvent>,
        stats: &mut DecodeStats,
    ) -> Result<(), String> {
        count_unknown(data, STORED_KEYS, stats);
        let mut parent = match data.get("parent_hash") {
            None | Some(Value::Null) => None,
            Some(h) => Some(hash(h)?),
        };
        let blocks = data
            .get("blocks")
            .and_then(Value::as_array)
            .ok_or("stored without blocks")?;
        let mut run: Option<BlockStored> = None;
        for b in blocks {
            let b = b.as_object().ok_or("stored block is not an object")?;
            count_unknown(b, BLOCK_KEYS, stats);
            let key = hash(
                b.get("block_hash")
                    .ok_or("stored block without block_hash")?,
            )?;
            let tokens = b
                .get("tokens")
                .and_then(Value::as_array)
                .ok_or("stored block without tokens")?;
            let medium = match b.get("cache_level") {
                None | Some(Value::Null) => Medium::Gpu,
                Some(l) => level_medium(l.as_u64().ok_or("cache_level is not an integer")?, stats),
            };
            let salt = match b.get("cache_salt") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) => Some(n.to_string()),
                Some(_) => return Err("cache_salt is neither string nor number".into()),
            };
            let tpb = usize::try_from(self.tokens_per_block).unwrap_or(usize::MAX);
            if self.tokens_per_block > 0 && tokens.len() > tpb {
                return Err("block holds more tokens than tokens_per_block".into());
            }
            let partial = self.tokens_per_block > 0 && tokens.len() < tpb;

            let continues = run.as_ref().is_some_and(|r| {
                r.medium == medium && r.cache_salt == salt && !r.partial_last_block
            });
            if !continues {
                if let Some(done) = run.take() {
                    out.push(KvEvent::Stored(done));
                }
                run = Some(BlockStored {
                    parent,
                    block_size: self.tokens_per_block,
                    medium,
                    group,
                    cache_salt: salt,
                    ..BlockStored::default()
                });
            }
            let Some(r) = run.as_mut() else {
                return Err("internal: no open run".into());
            };
            r.keys.push(BlockKey(key.0));
            r.token_ids.reserve(tokens.len());
            for t in tokens {
                r.token_ids.push(token_id(t)?);
            }
            r.partial_last_block = partial;
            parent = Some(key);
        }
        if let Some(done) = run {
            out.push(KvEvent::Stored(done));
        }
        Ok(())
    }
}

fn hash(v: &Value) -> Result<BlockKey, String> {
    v.as_u64()
        .map(BlockKey)
        .ok_or_else(|| format!("block hash {v} is not a u64"))
}

fn token_id(t: &Value) -> Result<TokenId, String> {
    let id = match t {
        Value::Object(o) => o.get("token_id").and_then(Value::as_u64),
        other => other.as_u64(),
    };
    id.and_then(|v| TokenId::try_from(v).ok())
        .ok_or_else(|| "token_id is not a u32".to_string())
}

fn level_medium(level: u64, stats: &mut DecodeStats) -> Medium {
    match level {
        0 => Medium::Gpu,
        1 => Medium::Cpu,
        _ => {
            stats.unknown_media += 1;
            Medium::External
        }
    }
}

fn count_unknown(obj: &Map<String, Value>, known: &[&str], stats: &mut DecodeStats) {
    let unknown = obj.keys().filter(|k| !known.contains(&k.as_str())).count();
    stats.unknown_fields += unknown as u64;
}
