//! TensorRT-LLM `v1_block_key` (`BlockKeyHasher::hash`, golden/trtllm-events/README.md).
//!
//! ```text
//! seed = n_tokens ^ (parent * 0xbf58476d1ce4e5b9)          parent = previous key, 0 at the root
//! if parent == 0 and cache_salt_id: seed = mix64(salt, seed)
//! per token: seed = mix32(token, seed) [; seed = mix64(extra_id, seed)]
//! if lora_task_id: seed = mix64(lora, seed)
//! ```
//! Multimodal keys are not implemented (a request with them is refused).

use crate::types::BlockKey;

const PARENT_MUL: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX64_MUL_1: u64 = 0xbf58_476d_1ce4_e5b9;
const MIX64_MUL_2: u64 = 0x94d0_49bb_1331_11eb;
const MIX32_MUL: u32 = 0x045d_9f3b;
const COMBINE: u32 = 0x9e37_79b9;

#[inline(always)]
fn combine(seed: u64, value: u64) -> u64 {
    seed ^ value
        .wrapping_add(u64::from(COMBINE))
        .wrapping_add(seed << 6)
        .wrapping_add(seed >> 2)
}

/// `hash32Mix`.
#[inline(always)]
#[must_use]
pub fn mix32(value: u32, seed: u64) -> u64 {
    let mut v = ((value >> 16) ^ value).wrapping_mul(MIX32_MUL);
    v = ((v >> 16) ^ v).wrapping_mul(MIX32_MUL);
    v = (v >> 16) ^ v;
    // The 32-bit combine constant is added in 32-bit arithmetic before widening.
    let v = v.wrapping_add(COMBINE);
    seed ^ u64::from(v).wrapping_add(seed << 6).wrapping_add(seed >> 2)
}

/// `hash64Mix`.
#[inline(always)]
#[must_use]
pub fn mix64(value: u64, seed: u64) -> u64 {
    let mut v = (value ^ (value >> 30)).wrapping_mul(MIX64_MUL_1);
    v = (v ^ (v >> 27)).wrapping_mul(MIX64_MUL_2);
    v ^= v >> 31;
    combine(seed, v)
}

/// Inputs of one TensorRT-LLM block besides its tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrtllmBlockExtras<'a> {
    /// One extra id per token of this block, when the request uses extra ids.
    pub token_extra_ids: Option<&'a [u64]>,
    /// `lora_task_id`.
    pub lora_task_id: Option<u64>,
    /// `cache_salt_id` (only mixed when `parent == 0`).
    pub cache_salt_id: Option<u64>,
}

/// The key of one block (full or partial: `n_tokens` is the block's own length).
///
/// Tokens are TensorRT-LLM `int32` ids reinterpreted as `u32`.
#[must_use]
pub fn block_key(parent: BlockKey, tokens: &[u32], extras: TrtllmBlockExtras<'_>) -> BlockKey {
    let mut seed = (tokens.len() as u64) ^ parent.0.wrapping_mul(PARENT_MUL);
    if parent.0 == 0 {
        if let Some(salt) = extras.cache_salt_id {
            seed = mix64(salt, seed);
        }
    }
    match extras.token_extra_ids {
        None => {
            for &t in tokens {
                seed = mix32(t, seed);
            }
        }
        Some(ids) => {
            for (i, &t) in tokens.iter().enumerate() {
                seed = mix32(t, seed);
                seed = mix64(ids.get(i).copied().unwrap_or(0), seed);
            }
        }
    }
    if let Some(lora) = extras.lora_task_id {
        seed = mix64(lora, seed);
    }
    BlockKey(seed)
}
