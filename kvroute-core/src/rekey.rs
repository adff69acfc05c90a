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
    #[cfg(target_endian = "little")]
    {
        // In memory the ids already are their little-endian bytes: no copy.
        xxh3_64_with_seed(zerocopy::IntoBytes::as_bytes(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut buf = [0u8; 256];
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed);
        for chunk in tokens.chunks(buf.len() / 4) {
            for (slot, t) in buf.chunks_exact_mut(4).zip(chunk) {
                slot.copy_from_slice(&t.to_le_bytes());
            }
            h.update(buf.get(..chunk.len() * 4).unwrap_or(&[]));
        }
        h.digest()
    }
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

/// Appends the keys of every full block of `tokens` (blocks of `block_size`
/// tokens, the partial tail ignored) chained after `parent` (`None` at the
/// root) to `out`; returns the last key, or `parent` if no block was full.
///
/// One tight loop with no per-block state beyond the parent key: this is the
/// hot path of [`crate::PromptHasher`] for re-key contracts.
///
/// ```
/// use kvroute_core::rekey::{extend_chain, local_block_hash, sequence_key, DYNAMO_SEED};
/// let tokens: Vec<u32> = (0..40).collect();
/// let mut keys = Vec::new();
/// let last = extend_chain(None, &tokens, 16, DYNAMO_SEED, &mut keys);
/// assert_eq!(keys.len(), 2);
/// let k0 = sequence_key(None, local_block_hash(&tokens[..16], DYNAMO_SEED), DYNAMO_SEED);
/// let k1 = sequence_key(Some(k0), local_block_hash(&tokens[16..32], DYNAMO_SEED), DYNAMO_SEED);
/// assert_eq!(keys, [k0, k1]);
/// assert_eq!(last, Some(k1));
/// ```
#[inline]
pub fn extend_chain(
    parent: Option<BlockKey>,
    tokens: &[TokenId],
    block_size: usize,
    seed: u64,
    out: &mut Vec<BlockKey>,
) -> Option<BlockKey> {
    if block_size == 0 {
        return parent;
    }
    out.reserve(tokens.len() / block_size);
    let mut blocks = tokens.chunks_exact(block_size);
    let mut last = match parent {
        Some(p) => p,
        None => {
            let first = blocks.next()?;
            let key = BlockKey(local_block_hash(first, seed));
            out.push(key);
            key
        }
    };
    for block in blocks {
        last = sequence_key(Some(last), local_block_hash(block, seed), seed);
        out.push(last);
    }
    Some(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The specification written out literally: the bytes built one token at a
    /// time, every key through the parent's bytes.
    fn reference(parent: Option<u64>, tokens: &[u32], bs: usize, seed: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut parent = parent;
        for block in tokens.chunks_exact(bs) {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            let local = xxh3_64_with_seed(&bytes, seed);
            let key = match parent {
                None => local,
                Some(p) => {
                    let mut both = p.to_le_bytes().to_vec();
                    both.extend_from_slice(&local.to_le_bytes());
                    xxh3_64_with_seed(&both, seed)
                }
            };
            out.push(key);
            parent = Some(key);
        }
        out
    }

    proptest! {
        #[test]
        fn extend_chain_matches_reference(
            tokens in proptest::collection::vec(any::<u32>(), 0..600),
            bs in 1usize..130,
            parent in proptest::option::of(any::<u64>()),
            seed in prop_oneof![Just(DYNAMO_SEED), Just(0u64), any::<u64>()],
        ) {
            let mut keys = Vec::new();
            let last = extend_chain(parent.map(BlockKey), &tokens, bs, seed, &mut keys);
            let want = reference(parent, &tokens, bs, seed);
            prop_assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), want.clone());
            prop_assert_eq!(last.map(|k| k.0), want.last().copied().or(parent));
        }
    }

    #[test]
    fn zero_block_size_appends_nothing() {
        let mut keys = Vec::new();
        assert_eq!(
            extend_chain(Some(BlockKey(7)), &[1, 2, 3], 0, DYNAMO_SEED, &mut keys),
            Some(BlockKey(7))
        );
        assert!(keys.is_empty());
    }
}
