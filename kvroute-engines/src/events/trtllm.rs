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
//! * `removed` → [`KvEvent::Removed`] in the tier the block is in. The event names
//!   no tier because a TensorRT-LLM block lives in exactly one cache level at a
//!   time (it is stored at a level, offloading *moves* it: `updated` with an
//!   `old_value → new_value` diff) and `removed` means it left the reuse tree
//!   wherever it was (fixtures 06/07 and their `resident_full_block_hashes_after`,
//!   which list residents of every level together). The decoder therefore remembers
//!   the tier of every block it saw leave (or be stored outside) the GPU level, per
//!   attention-DP rank (each rank has its own cache), in a bounded map; any other
//!   block is on the GPU. When a rank's sequence shows an engine restart, that
//!   rank's tiers are forgotten ([`TrtllmDecoder::restarted`]); a host that applies
//!   batches decodes a drain event by event ([`TrtllmDecoder::decode_event`]) so
//!   the reset comes before the new process's later events are read. A block that left the GPU while
//!   the map was full is counted in [`DecodeStats::untracked_offloaded_blocks`] and
//!   its removal goes to the GPU tier (its other copy goes stale: a lost
//!   optimisation, never a wrong answer).
//! * `updated` with a `cache_level` diff → [`KvEvent::Moved`] (level 0 = GPU,
//!   1 = host).
//! * `window_size`: only the largest window seen so far is kept (variable sliding
//!   window models emit one stream per window; only full attention describes a
//!   reusable prefix). The decoder remembers the largest window across drains.

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::{BlockMoved, BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
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
    /// Last announced capacity per attention-DP rank (bounded).
    rank_capacity: Vec<(Option<u32>, Vec<u64>)>,
    /// Tier of every block known to sit outside the GPU level, per
    /// attention-DP rank (each rank has its own cache: one block can be on
    /// one rank's GPU and in another's host cache); absent = GPU.
    /// By (attention-DP rank, layer group, key): groups may share keys.
    off_gpu: hashbrown::HashMap<(Option<u32>, u32, u64), Medium>,
    off_gpu_limit: usize,
    /// A `created` event was decoded since [`Self::take_capacity_update`].
    capacity_update: bool,
}

/// Attention-DP ranks whose `created` capacity is remembered.
const MAX_CAPACITY_RANKS: usize = 64;

/// Default bound of the off-GPU tier map (≈ 16 MiB at most).
pub const DEFAULT_OFF_GPU_BLOCKS: usize = 1 << 20;

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
            rank_capacity: Vec::new(),
            off_gpu: hashbrown::HashMap::new(),
            off_gpu_limit: DEFAULT_OFF_GPU_BLOCKS,
            capacity_update: false,
        }
    }

    /// Bounds how many off-GPU blocks (host-offloaded) the decoder remembers the
    /// tier of ([`DEFAULT_OFF_GPU_BLOCKS`] by default; the engine's host cache size
    /// in blocks is enough).
    #[must_use]
    pub fn with_off_gpu_limit(mut self, blocks: usize) -> Self {
        self.off_gpu_limit = blocks;
        self
    }

    /// The tier `key` of layer group `group` is in on attention-DP rank
    /// `rank` as far as the events seen so far say.
    #[must_use]
    pub fn tier_of(&self, rank: Option<u32>, group: u32, key: BlockKey) -> Medium {
        self.off_gpu
            .get(&(rank, group, key.0))
            .copied()
            .unwrap_or(Medium::Gpu)
    }

    /// Blocks currently remembered as outside the GPU tier.
    #[must_use]
    pub fn tracked_off_gpu_blocks(&self) -> usize {
        self.off_gpu.len()
    }

    fn set_tier(
        &mut self,
        (rank, group): (Option<u32>, u32),
        key: BlockKey,
        medium: Medium,
        stats: &mut DecodeStats,
    ) {
        let at = (rank, group, key.0);
        if medium == Medium::Gpu {
            self.off_gpu.remove(&at);
        } else if self.off_gpu.len() < self.off_gpu_limit || self.off_gpu.contains_key(&at) {
            self.off_gpu.insert(at, medium);
        } else {
            stats.untracked_offloaded_blocks += 1;
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

    /// The endpoint's capacity per cache level: the last `created` figure of
    /// every attention-DP rank, summed (each rank has its own cache; the
    /// endpoint's inventory is their union).
    #[must_use]
    pub fn total_capacity(&self) -> Option<Vec<u64>> {
        let mut total: Option<Vec<u64>> = None;
        for (_, caps) in &self.rank_capacity {
            let sum = total.get_or_insert_with(|| vec![0; caps.len()]);
            if sum.len() < caps.len() {
                sum.resize(caps.len(), 0);
            }
            for (s, c) in sum.iter_mut().zip(caps) {
                *s = s.saturating_add(*c);
            }
        }
        total
    }

    /// [`Self::total_capacity`] if a `created` event was decoded since the
    /// last call.
    pub fn take_capacity_update(&mut self) -> Option<Vec<u64>> {
        if std::mem::take(&mut self.capacity_update) {
            self.total_capacity()
        } else {
            None
        }
    }

    /// Forgets the window and capacity state (after an engine restart).
    pub fn reset(&mut self) {
        self.largest_window = None;
        self.capacity = None;
        self.rank_capacity.clear();
        self.off_gpu = hashbrown::HashMap::new();
    }

    /// Attention-DP rank `rank` of the engine restarted (its sequence window
    /// said so at an event of the drain `rest` begins with): forgets the
    /// tiers of that rank's blocks, and takes the largest attention window
    /// from `rest` afresh (a restarted engine may serve another model).
    /// The other ranks' state is kept: each rank shows the restart at its
    /// own first event, possibly in a later drain, and the events before it
    /// are the new process's already. The capacity is kept until the rank
    /// announces it again.
    ///
    /// The event that showed the restart was decoded before it was judged,
    /// with the old state: a restarted engine whose attention window is
    /// smaller than the old one loses that event if it stores blocks (the
    /// first event of a TensorRT-LLM process is `created`, which stores
    /// none). Ranks that do not come back after a restart keep their
    /// capacity and tiers.
    pub fn restarted(&mut self, rank: Option<u32>, rest: &[Value]) {
        self.off_gpu.retain(|(r, _, _), _| *r != rank);
        self.largest_window = drain_window(rest);
    }

    /// Decodes one drain body (`[]` when idle).
    pub fn decode_drain(
        &mut self,
        body: &[u8],
        stats: &mut DecodeStats,
    ) -> Result<Vec<EventBatch>, DecodeError> {
        let events = parse_drain(body, stats)?;
        Ok(self.decode_events(&events, stats))
    }

    /// Decodes an already parsed drain.
    pub fn decode_value(
        &mut self,
        drain: &Value,
        stats: &mut DecodeStats,
    ) -> Result<Vec<EventBatch>, DecodeError> {
        let events = drain_array(drain, stats)?;
        Ok(self.decode_events(events, stats))
    }

    fn decode_events(&mut self, events: &[Value], stats: &mut DecodeStats) -> Vec<EventBatch> {
        self.begin_drain(events, stats);
        events
            .iter()
            .enumerate()
            .filter_map(|(index, ev)| self.decode_event(index, ev, stats))
            .collect()
    }

    /// Starts decoding the events of one drain ([`parse_drain`]) one at a
    /// time with [`Self::decode_event`]: the drain's largest attention
    /// window is known before its first event is judged.
    pub fn begin_drain(&mut self, events: &[Value], stats: &mut DecodeStats) {
        self.largest_window = self.largest_window.max(drain_window(events));
        stats.batches += 1;
    }

    /// Decodes event `index` of the drain begun with [`Self::begin_drain`]:
    /// its batch (`seq = event_id`, no events if it carries nothing for the
    /// inventory or is malformed), or `None` for an event without an id,
    /// which cannot be placed in the sequence.
    pub fn decode_event(
        &mut self,
        index: usize,
        ev: &Value,
        stats: &mut DecodeStats,
    ) -> Option<EventBatch> {
        stats.events += 1;
        // An event without an id cannot be placed in the sequence, so it is
        // dropped before it can touch the tier map: the ingest never sees it.
        let Some(id) = ev.get("event_id").and_then(Value::as_u64) else {
            stats.malformed_events += 1;
            tracing::debug!(index, "TensorRT-LLM event without event_id dropped");
            return None;
        };
        let rank = ev
            .get("attention_dp_rank")
            .and_then(Value::as_u64)
            .and_then(|r| u32::try_from(r).ok());
        let mut batch = EventBatch {
            seq: id,
            timestamp: 0.0,
            dp_rank: rank,
            events: Vec::new(),
        };
        if let Err(what) = self.event(ev, rank, &mut batch.events, stats) {
            stats.malformed_events += 1;
            tracing::debug!(index, what, "malformed TensorRT-LLM event dropped");
            batch.events.clear();
        }
        Some(batch)
    }

    fn event(
        &mut self,
        ev: &Value,
        rank: Option<u32>,
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
                let rank = obj
                    .get("attention_dp_rank")
                    .and_then(Value::as_u64)
                    .and_then(|r| u32::try_from(r).ok());
                let known = self.rank_capacity.len();
                match self.rank_capacity.iter_mut().find(|(r, _)| *r == rank) {
                    Some((_, c)) => c.clone_from(&caps),
                    // Bounded like the ingest's streams: a peer cannot grow it.
                    None if known < MAX_CAPACITY_RANKS => {
                        self.rank_capacity.push((rank, caps.clone()));
                    }
                    None => {}
                }
                self.capacity = Some(caps);
                self.capacity_update = true;
                stats.capacity_events += 1;
            }
            Some("stored") => {
                let start = out.len();
                self.stored(data, group, out, stats)?;
                // Only once the whole event parsed: a dropped event changes nothing.
                for event in out.get(start..).unwrap_or_default() {
                    if let KvEvent::Stored(stored) = event {
                        for key in &stored.keys {
                            self.set_tier((rank, stored.group), *key, stored.medium, stats);
                        }
                    }
                }
            }
            Some("removed") => {
                count_unknown(data, &["type", "block_hashes"], stats);
                let keys = data
                    .get("block_hashes")
                    .and_then(Value::as_array)
                    .ok_or("removed without block_hashes")?
                    .iter()
                    .map(hash)
                    .collect::<Result<Vec<_>, _>>()?;
                self.removed(rank, keys, group, out);
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
                        self.set_tier((rank, group), key, to, stats);
                        out.push(KvEvent::Moved(BlockMoved {
                            key,
                            from,
                            to,
                            group,
                        }));
                    }
                }
            }
            Some(_) => stats.unknown_event_tags += 1,
            None => return Err("data has no type".into()),
        }
        Ok(())
    }

    /// `Removed` events for the tiers the blocks are in; the blocks leave the tier
    /// map.
    fn removed(
        &mut self,
        rank: Option<u32>,
        keys: Vec<BlockKey>,
        group: u32,
        out: &mut Vec<KvEvent>,
    ) {
        if keys
            .iter()
            .all(|k| !self.off_gpu.contains_key(&(rank, group, k.0)))
        {
            out.push(KvEvent::Removed(BlockRemoved {
                keys,
                medium: Medium::Gpu,
                group,
            }));
            return;
        }
        // Runs of consecutive blocks in the same tier keep the engine's order.
        let mut run: Option<BlockRemoved> = None;
        for key in keys {
            let medium = self
                .off_gpu
                .remove(&(rank, group, key.0))
                .unwrap_or(Medium::Gpu);
            match &mut run {
                Some(r) if r.medium == medium => r.keys.push(key),
                _ => {
                    let next = BlockRemoved {
                        keys: vec![key],
                        medium,
                        group,
                    };
                    if let Some(done) = run.replace(next) {
                        out.push(KvEvent::Removed(done));
                    }
                }
            }
        }
        if let Some(done) = run {
            out.push(KvEvent::Removed(done));
        }
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
            // What TensorRT-LLM mixes into the block's key besides its
            // tokens (the LoRA task, multimodal hashes, per-token extra
            // ids): kept as the block's extra keys, so an attestor knows it
            // cannot recompute the key from the tokens alone.
            let extras = block_extras(b, tokens);
            if extras.is_some() && r.extra_keys.len() < r.keys.len() {
                r.extra_keys.resize(r.keys.len(), None);
            }
            if extras.is_some() || !r.extra_keys.is_empty() {
                r.extra_keys.push(extras);
            }
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

/// The events of one drain body: a JSON array (`[]` when idle); decode them
/// with [`TrtllmDecoder::begin_drain`] and [`TrtllmDecoder::decode_event`].
///
/// # Errors
/// [`DecodeError`] when the body is not JSON or not an array (counted in
/// `stats` as a malformed payload).
pub fn parse_drain(body: &[u8], stats: &mut DecodeStats) -> Result<Vec<Value>, DecodeError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Array(events)) => Ok(events),
        Ok(_) => {
            stats.malformed_payloads += 1;
            Err(DecodeError::BadLayout {
                what: "drain is not a JSON array",
            })
        }
        Err(e) => {
            stats.malformed_payloads += 1;
            Err(DecodeError::Json(e.to_string()))
        }
    }
}

fn drain_array<'v>(drain: &'v Value, stats: &mut DecodeStats) -> Result<&'v [Value], DecodeError> {
    match drain.as_array() {
        Some(events) => Ok(events),
        None => {
            stats.malformed_payloads += 1;
            Err(DecodeError::BadLayout {
                what: "drain is not a JSON array",
            })
        }
    }
}

/// The largest attention window the events name.
fn drain_window(events: &[Value]) -> Option<u64> {
    events
        .iter()
        .filter_map(|e| e.get("window_size").and_then(Value::as_u64))
        .max()
}

fn hash(v: &Value) -> Result<BlockKey, String> {
    v.as_u64()
        .map(BlockKey)
        .ok_or_else(|| format!("block hash {v} is not a u64"))
}

/// A stored block's `lora_id`, `mm_keys` and tokens' `token_extra_id`, when
/// it has any.
fn block_extras(b: &Map<String, Value>, tokens: &[Value]) -> Option<Vec<ExtraKey>> {
    let mut extras = Vec::new();
    if let Some(id) = b.get("lora_id").and_then(Value::as_i64) {
        extras.push(ExtraKey::Int(id));
    }
    if let Some(mm) = b
        .get("mm_keys")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
    {
        extras.push(ExtraKey::Text(Value::Array(mm.clone()).to_string()));
    }
    let token_extra = tokens.iter().filter_map(|t| {
        t.get("token_extra_id")
            .and_then(Value::as_i64)
            .filter(|id| *id != 0)
    });
    extras.extend(token_extra.map(ExtraKey::Int));
    (!extras.is_empty()).then_some(extras)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(rel: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/trtllm-events")
            .join(rel);
        std::fs::read(path).unwrap()
    }

    fn removals(batches: &[EventBatch]) -> Vec<(Medium, Vec<u64>)> {
        batches
            .iter()
            .flat_map(|b| &b.events)
            .filter_map(|e| match e {
                KvEvent::Removed(r) => Some((r.medium, r.keys.iter().map(|k| k.0).collect())),
                _ => None,
            })
            .collect()
    }

    /// A LoRA or multimodal block's key mixes in what its tokens do not say:
    /// the block carries it as extra keys, so an attestor of the contract
    /// leaves it unverified instead of counting a mismatch (which would
    /// flag the endpoint's contract as wrong for good).
    #[test]
    fn lora_and_multimodal_blocks_carry_their_extras() {
        let mut dec = TrtllmDecoder::new(4);
        let mut stats = DecodeStats::default();
        let body = r#"[{"event_id": 1, "window_size": 64, "data": {"type": "stored",
            "parent_hash": null, "blocks": [
              {"type": "stored_block", "block_hash": 11, "tokens": [1, 2, 3, 4], "lora_id": 3},
              {"type": "stored_block", "block_hash": 12, "tokens": [5, 6, 7, 8], "lora_id": null},
              {"type": "stored_block", "block_hash": 13, "tokens": [9, 10, 11, 12],
               "mm_keys": [["abcd", 0]]}]}}]"#;
        let batches = dec.decode_drain(body.as_bytes(), &mut stats).unwrap();
        let [KvEvent::Stored(s)] = batches[0].events.as_slice() else {
            panic!("{batches:?}");
        };
        assert_eq!(s.keys.len(), 3);
        assert_eq!(
            s.extra_keys,
            vec![
                Some(vec![ExtraKey::Int(3)]),
                None,
                Some(vec![ExtraKey::Text(r#"[["abcd",0]]"#.to_owned())]),
            ]
        );
        let contract: kvroute_core::HashContract =
            "trtllm@1.1.0:v1_block_key:block=4".parse().unwrap();
        let attestor = kvroute_ingest::ContractAttestor::new(&contract).unwrap();
        let index = kvroute_ingest::SharedIndex::new(1, kvroute_ingest::IndexConfig::default());
        let mut ingest = kvroute_ingest::EndpointIngest::new(
            kvroute_core::EndpointId(0),
            kvroute_ingest::IngestConfig::default(),
            kvroute_ingest::Keying::Engine,
        )
        .with_attestor(std::sync::Arc::new(attestor));
        let _ = ingest.apply_batch(&batches[0], &index);
        assert!(
            !matches!(
                ingest.contract_status(),
                kvroute_ingest::ContractStatus::Mismatch { .. }
            ),
            "{:?}",
            ingest.contract_status()
        );
    }

    /// Golden flow 02 → 07: block 6281115329494198917 is stored on the GPU and then
    /// offloaded to the host (`updated`, level 0 → 1). Its later `removed` (schema of
    /// fixture 06, which names no tier) must leave the host tier, while a block that
    /// never left the GPU is removed from the GPU.
    #[test]
    fn removed_applies_to_the_tier_the_block_is_in() {
        let mut dec = TrtllmDecoder::new(32);
        let mut stats = DecodeStats::default();
        for f in [
            "classic/01_startup_created.json",
            "classic/02_context_blocks_stored.json",
            "classic/03_release_stores_rest_incl_partial.json",
            "classic/07_offload_updated_cache_level.json",
        ] {
            dec.decode_drain(&golden(f), &mut stats).unwrap();
        }
        let offloaded = 6281115329494198917u64;
        assert_eq!(dec.tier_of(None, 0, BlockKey(offloaded)), Medium::Cpu);
        let on_gpu = 13121859508051604645u64;
        assert_eq!(dec.tier_of(None, 0, BlockKey(on_gpu)), Medium::Gpu);

        let body = format!(
            r#"[{{"event_id": 6, "window_size": 8192,
                 "data": {{"type": "removed", "block_hashes": [{on_gpu}, {offloaded}]}}}}]"#
        );
        let batches = dec.decode_drain(body.as_bytes(), &mut stats).unwrap();
        assert_eq!(
            removals(&batches),
            vec![(Medium::Gpu, vec![on_gpu]), (Medium::Cpu, vec![offloaded])]
        );
        // Gone from the tier map: a re-store on the GPU and removal go to the GPU.
        assert_eq!(dec.tier_of(None, 0, BlockKey(offloaded)), Medium::Gpu);
        assert_eq!(stats.untracked_offloaded_blocks, 0);
    }

    #[test]
    fn golden_coalesced_removal_of_gpu_blocks_stays_on_the_gpu() {
        let mut dec = TrtllmDecoder::new(32);
        let mut stats = DecodeStats::default();
        let batches = dec
            .decode_drain(
                &golden("classic/06_eviction_removed_coalesced.json"),
                &mut stats,
            )
            .unwrap();
        assert_eq!(
            removals(&batches),
            vec![(Medium::Gpu, vec![1571258491847846631, 2862714622994288290])]
        );
    }

    #[test]
    fn blocks_stored_on_the_host_level_are_removed_from_the_host() {
        let mut dec = TrtllmDecoder::new(2);
        let mut stats = DecodeStats::default();
        let body = br#"[{"event_id": 1, "data": {"type": "stored", "parent_hash": null, "blocks": [
            {"type": "stored_block", "block_hash": 11, "tokens": [1, 2], "cache_level": 1},
            {"type": "stored_block", "block_hash": 12, "tokens": [3, 4], "cache_level": 0}]}},
          {"event_id": 2, "data": {"type": "removed", "block_hashes": [11, 12]}}]"#;
        let batches = dec.decode_drain(body, &mut stats).unwrap();
        assert_eq!(
            removals(&batches),
            vec![(Medium::Cpu, vec![11]), (Medium::Gpu, vec![12])]
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Store(u64, u64),
        Move(u64, u64, u64),
        Remove(Vec<u64>),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0u64..6, 0u64..3).prop_map(|(k, l)| Op::Store(k, l)),
            (0u64..6, 0u64..3, 0u64..3).prop_map(|(k, a, b)| Op::Move(k, a, b)),
            proptest::collection::vec(0u64..6, 1..4).prop_map(Op::Remove),
        ]
    }

    fn level(l: u64) -> Medium {
        [Medium::Gpu, Medium::Cpu, Medium::External][l as usize]
    }

    proptest::proptest! {
        /// Against a model that remembers every block's last stored / moved-to tier:
        /// each removed block is removed from exactly that tier, in engine order.
        #[test]
        fn removals_follow_a_reference_tier_model(
            ops in proptest::collection::vec(op(), 0..40),
            split in 0usize..40,
        ) {
            let events: Vec<String> = ops.iter().enumerate().map(|(id, op)| {
                let data = match op {
                    Op::Store(k, l) => format!(
                        r#"{{"type":"stored","parent_hash":null,"blocks":[{{"type":"stored_block",
                           "block_hash":{k},"tokens":[1,2],"cache_level":{l}}}]}}"#),
                    Op::Move(k, a, b) => format!(
                        r#"{{"type":"updated","block_hash":{k},"cache_level":{{"type":"event_diff",
                           "new_value":{b},"old_value":{a}}}}}"#),
                    Op::Remove(keys) => format!(r#"{{"type":"removed","block_hashes":{keys:?}}}"#),
                };
                format!(r#"{{"event_id":{id},"data":{data}}}"#)
            }).collect();
            let split = split.min(events.len());
            let mut dec = TrtllmDecoder::new(2);
            let mut stats = DecodeStats::default();
            let mut got = Vec::new();
            for drain in [&events[..split], &events[split..]] {
                let body = format!("[{}]", drain.join(","));
                for batch in dec.decode_drain(body.as_bytes(), &mut stats).unwrap() {
                    for e in batch.events {
                        if let KvEvent::Removed(r) = e {
                            got.extend(r.keys.iter().map(|k| (k.0, r.medium)));
                        }
                    }
                }
            }
            let mut model = std::collections::HashMap::new();
            let mut want = Vec::new();
            for op in &ops {
                match op {
                    Op::Store(k, l) => { model.insert(*k, level(*l)); }
                    Op::Move(k, _, b) => { model.insert(*k, level(*b)); }
                    Op::Remove(keys) => want.extend(
                        keys.iter().map(|k| (*k, model.remove(k).unwrap_or(Medium::Gpu)))),
                }
            }
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(stats.malformed_events, 0);
        }
    }

    /// Layer groups may hold blocks of the same key (one pool per attention
    /// window): a block of another group offloaded to the host neither moves
    /// the scored group's block in the inventory nor changes the tier its
    /// later removal is read from.
    #[test]
    fn another_layer_groups_offload_leaves_the_scored_groups_block_alone() {
        use kvroute_core::EndpointId;
        use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};
        let event = |id: u64, group: u32, data: &str| {
            format!(r#"{{"event_id": {id}, "layer_group_id": {group}, "data": {data}}}"#)
        };
        let stored = r#"{"type": "stored", "parent_hash": null, "blocks": [{"type": "stored_block",
            "block_hash": 77, "tokens": [1, 2], "cache_level": 0}]}"#;
        let offload = r#"{"type": "updated", "block_hash": 77,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}}"#;
        let removed = r#"{"type": "removed", "block_hashes": [77]}"#;
        let index = SharedIndex::new(1, IndexConfig::default());
        let mut ingest =
            EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        let mut dec = TrtllmDecoder::new(2);
        let mut stats = DecodeStats::default();
        let mut drain = |events: &[String]| {
            let body = format!("[{}]", events.join(","));
            for b in dec.decode_drain(body.as_bytes(), &mut stats).unwrap() {
                let _ = ingest.apply_batch(&b, &index);
            }
        };
        let at = |m| index.contains(EndpointId(0), BlockKey(77), m);
        drain(&[
            event(1, 0, stored),
            event(2, 1, stored),
            event(3, 1, offload),
        ]);
        assert!(at(Medium::Gpu), "the scored group's block stays on the GPU");
        assert!(
            !at(Medium::Cpu),
            "another group's offload is not this group's"
        );
        drain(&[event(4, 0, removed)]);
        assert!(!at(Medium::Gpu), "its removal is read from the GPU tier");
        assert!(!at(Medium::Cpu));
    }

    #[test]
    fn off_gpu_map_is_bounded_and_counts_what_it_cannot_track() {
        let mut dec = TrtllmDecoder::new(2).with_off_gpu_limit(1);
        let mut stats = DecodeStats::default();
        let moved = |id: u64, key: u64| {
            format!(
                r#"{{"event_id": {id}, "data": {{"type": "updated", "block_hash": {key},
                   "cache_level": {{"type": "event_diff", "new_value": 1, "old_value": 0}}}}}}"#
            )
        };
        let body = format!("[{}, {}]", moved(1, 21), moved(2, 22));
        dec.decode_drain(body.as_bytes(), &mut stats).unwrap();
        assert_eq!(dec.tier_of(None, 0, BlockKey(21)), Medium::Cpu);
        assert_eq!(dec.tier_of(None, 0, BlockKey(22)), Medium::Gpu);
        assert_eq!(stats.untracked_offloaded_blocks, 1);
        dec.reset();
        assert_eq!(dec.tier_of(None, 0, BlockKey(21)), Medium::Gpu);
    }
}
