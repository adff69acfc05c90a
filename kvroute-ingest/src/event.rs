use kvroute_core::{BlockKey, Medium, TokenId};

/// One extra key attached to a stored block, already stripped of engine tags.
///
/// vLLM's `BlockStored.extra_keys` carries, per block, an untagged list of these:
/// the LoRA name, `[mm_identifier, offset]`, the cache salt and prompt-embeds digests.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// A string key (LoRA name, cache salt, ...).
    Text(String),
    /// An integer key.
    Int(i64),
    /// A byte-string key (prompt-embeds digest).
    Bytes(Vec<u8>),
    /// A nested list (multimodal `[identifier, offset]`).
    List(Vec<ExtraKey>),
}

/// Blocks were written into the engine's cache.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// Keys of the stored blocks, in chain order.
    pub keys: Vec<BlockKey>,
    /// Key of the block preceding `keys[0]` in the chain, if any.
    pub parent: Option<BlockKey>,
    /// Token ids of all stored blocks, concatenated (`block_size * keys.len()` for
    /// full blocks; TensorRT-LLM may end with a partial block).
    pub token_ids: Vec<TokenId>,
    /// Number of tokens in each block (the last block may be shorter when
    /// `partial_last_block` is set).
    pub block_size: u32,
    /// True when the final block holds fewer than `block_size` tokens.
    pub partial_last_block: bool,
    /// Storage tier.
    pub medium: Medium,
    /// LoRA adapter name, when the engine reports one.
    pub lora_name: Option<String>,
    /// Per-block extra keys (empty when the engine sends none).
    pub extra_keys: Vec<Option<Vec<ExtraKey>>>,
    /// Hybrid-model KV-cache group index (0 for single-group models).
    pub group: u32,
    /// Whether `group` is a full-attention group, when the engine says
    /// (vLLM's `kv_cache_spec_kind`: `full_attention`, `mla_attention` and
    /// `sink_full_attention` are; sliding-window, chunked-local, Mamba and
    /// the others are not); `None` when it does not.
    pub full_attention: Option<bool>,
    /// Cache salt, when the engine reports it on the event (SGLang, TRT-LLM main).
    pub cache_salt: Option<String>,
}

/// Blocks were evicted from the engine's cache (in the given tier).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// Keys of the removed blocks.
    pub keys: Vec<BlockKey>,
    /// Storage tier the blocks left.
    pub medium: Medium,
    /// Hybrid-model KV-cache group index.
    pub group: u32,
}

/// A block moved between tiers (TensorRT-LLM `updated` with a cache-level diff).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMoved {
    /// The block.
    pub key: BlockKey,
    /// Tier it left.
    pub from: Medium,
    /// Tier it now lives in.
    pub to: Medium,
    /// KV-cache group (TensorRT-LLM `layer_group_id`; 0 when not given):
    /// filtered like [`BlockStored::group`], since groups may share keys.
    pub group: u32,
}

/// One engine-neutral KV event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks stored.
    Stored(BlockStored),
    /// Blocks removed.
    Removed(BlockRemoved),
    /// A block changed tier.
    Moved(BlockMoved),
    /// The engine emptied its whole cache.
    AllCleared,
}

/// A batch of events as one engine message carries it.
///
/// Every engine adapter (vLLM / SGLang msgpack, TensorRT-LLM JSON) decodes its wire
/// format into these types; everything downstream — the sequence window, the
/// inventories, attestation — only ever sees this shape.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct EventBatch {
    /// Transport sequence number (ZeroMQ frame 1; TensorRT-LLM `event_id` of the
    /// first event).
    pub seq: u64,
    /// Engine timestamp, seconds since the Unix epoch.
    pub timestamp: f64,
    /// Data-parallel / attention-DP rank that produced the batch.
    pub dp_rank: Option<u32>,
    /// The events, in engine order.
    pub events: Vec<KvEvent>,
}

/// Order-sensitive accumulator for [`EventBatch::fingerprint`]
/// ([`kvroute_core::mix::fold`] per word, [`kvroute_core::mix::fmix64`] at
/// the end). Detects accidental differences; not meant to resist a publisher
/// crafting collisions (it could fake any batch anyway).
struct Fold(u64);

impl Fold {
    #[inline]
    fn word(&mut self, x: u64) {
        self.0 = kvroute_core::mix::fold(self.0, x);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.word(b.len() as u64);
        for chunk in b.chunks(8) {
            let mut w = [0u8; 8];
            w.iter_mut().zip(chunk).for_each(|(d, s)| *d = *s);
            self.word(u64::from_le_bytes(w));
        }
    }

    fn finish(self) -> u64 {
        kvroute_core::mix::fmix64(self.0)
    }
}

impl EventBatch {
    /// A 64-bit digest of the batch's content: timestamp, DP rank and every
    /// event's keys, parent, tier, group, block size, token count and first
    /// and last tokens, LoRA name and cache salt. Not the sequence number.
    ///
    /// The same publisher replaying a batch reproduces it exactly; a different
    /// process that numbered a different batch alike almost surely does not
    /// (its timestamp alone differs). [`crate::SeqWindow`] compares it to
    /// verify a resume.
    ///
    /// ```
    /// use kvroute_core::BlockKey;
    /// use kvroute_ingest::{BlockRemoved, EventBatch, KvEvent};
    ///
    /// let a = EventBatch {
    ///     seq: 4,
    ///     timestamp: 1.5,
    ///     events: vec![KvEvent::Removed(BlockRemoved { keys: vec![BlockKey(9)], ..Default::default() })],
    ///     ..Default::default()
    /// };
    /// let mut b = a.clone();
    /// assert_eq!(a.fingerprint(), b.fingerprint());
    /// b.timestamp = 1.75;
    /// assert_ne!(a.fingerprint(), b.fingerprint());
    /// ```
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        let mut f = Fold(0x243f_6a88_85a3_08d3);
        f.word(self.timestamp.to_bits());
        f.word(self.dp_rank.map_or(u64::MAX, u64::from));
        f.word(self.events.len() as u64);
        for event in &self.events {
            match event {
                KvEvent::Stored(s) => {
                    f.word(1);
                    f.word(s.keys.len() as u64);
                    s.keys.iter().for_each(|k| f.word(k.0));
                    f.word(s.parent.map_or(u64::MAX, |p| p.0));
                    f.word(s.token_ids.len() as u64);
                    f.word(s.token_ids.first().map_or(0, |t| u64::from(*t)));
                    f.word(s.token_ids.last().map_or(0, |t| u64::from(*t)));
                    f.word(u64::from(s.block_size) << 1 | u64::from(s.partial_last_block));
                    f.word((s.medium.index() as u64) << 32 | u64::from(s.group));
                    f.word(s.extra_keys.iter().filter(|e| e.is_some()).count() as u64);
                    f.bytes(s.lora_name.as_deref().unwrap_or("").as_bytes());
                    f.bytes(s.cache_salt.as_deref().unwrap_or("").as_bytes());
                }
                KvEvent::Removed(r) => {
                    f.word(2);
                    f.word(r.keys.len() as u64);
                    r.keys.iter().for_each(|k| f.word(k.0));
                    f.word((r.medium.index() as u64) << 32 | u64::from(r.group));
                }
                KvEvent::Moved(m) => {
                    f.word(3);
                    f.word(m.key.0);
                    f.word(
                        u64::from(m.group) << 32
                            | (m.from.index() as u64) << 8
                            | m.to.index() as u64,
                    );
                }
                KvEvent::AllCleared => f.word(4),
            }
        }
        f.finish()
    }
}
