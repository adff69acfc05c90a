//! Engine-neutral KV-cache events.
//!
//! Every engine adapter (vLLM / SGLang msgpack, TensorRT-LLM JSON) decodes its wire
//! format into these types; everything downstream — the sequence window, the
//! inventories, attestation — only ever sees this shape.

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
