//! kvroute's own engine-independent re-key, for engines whose keys cannot be
//! reproduced from a prompt (random roots, legacy SGLang, unroutable LoRA scopes).
//!
//! It is Dynamo's `LocalBlockHash` / sequence-hash scheme, so Dynamo's published
//! vectors (golden/sglang/dynamo_xxh3_local_block_hash.json) apply unchanged:
//!
//! ```text
//! local[i] = xxh3_64_with_seed(u32le(tokens of block i), seed)
//! key[0]   = local[0]
//! key[i]   = xxh3_64_with_seed(u64le(key[i-1]) || u64le(local[i]), seed)
//! ```
//! Both sides (router and event ingest) recompute it from token ids, so it only
//! needs the tokens that stored events carry.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::types::{BlockKey, TokenId};

/// Dynamo's seed (`XXH3_SEED`).
pub const DYNAMO_SEED: u64 = 1337;

/// `xxh3_64_with_seed(u32le(tokens), seed)`.
#[must_use]
#[inline]
pub fn local_block_hash(tokens: &[TokenId], seed: u64) -> u64 {
    // 64 tokens × 4 bytes covers the common block sizes in one stack buffer.
    let mut buf = [0u8; 256];
    if tokens.len() * 4 <= buf.len() {
        for (slot, t) in buf.chunks_exact_mut(4).zip(tokens) {
            slot.copy_from_slice(&t.to_le_bytes());
        }
        return xxh3_64_with_seed(buf.get(..tokens.len() * 4).unwrap_or(&[]), seed);
    }
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    for chunk in tokens.chunks(buf.len() / 4) {
        for (slot, t) in buf.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&t.to_le_bytes());
        }
        h.update(buf.get(..chunk.len() * 4).unwrap_or(&[]));
    }
    h.digest()
}

/// The sequence key of a block with local hash `local` after `parent` (`None` at the root).
#[must_use]
#[inline]
pub fn sequence_key(parent: Option<BlockKey>, local: u64, seed: u64) -> BlockKey {
    match parent {
        None => BlockKey(local),
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.0.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            BlockKey(xxh3_64_with_seed(&buf, seed))
        }
    }
}
