//! Tokenize and hash at once: a long text's block keys, each block hashed as
//! soon as its ids exist.
//!
//! With a parallel encoder attached ([`ModelTokenizer::set_parallel`]) a long
//! text is encoded in pieces on the worker pool; the pieces reach the caller's
//! thread in text order ([`ModelTokenizer::encode_each`]) and each one's full
//! blocks are hashed there while later pieces still encode. The chain is
//! sequential, so the hasher carries the parent digest and the partial block
//! at a piece's end over to the next piece ([`PromptHasher::extend`] over the
//! ids so far). What is left after the last piece is its own blocks only.
//!
//! The keys are those of the whole untruncated ids: a request that
//! `truncate_prompt_tokens` cuts must be hashed again from its kept ids.
//!
//! ```
//! use kvroute_core::{HashContract, RequestExtras};
//! use kvroute_engines::prompt::pipeline::encode_and_hash;
//! use kvroute_engines::prompt::ModelTokenizer;
//! # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
//! let tok = ModelTokenizer::load(&dir, &Default::default())?;
//! let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse::<HashContract>()?.hasher()?;
//! let text = "the router keeps a prefix of every prompt ".repeat(40);
//! let (mut ids, mut keys) = (Vec::new(), Vec::new());
//! encode_and_hash(&tok, &text, false, &hasher, &RequestExtras::NONE, &mut ids, &mut keys)?;
//! let mut one_shot = Vec::new();
//! hasher.hash_prompt(&tok.encode(&text, false)?, &RequestExtras::NONE, &mut one_shot)?;
//! assert_eq!(keys, one_shot);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use kvroute_core::{BlockHasher, BlockKey, HashError, PromptHasher, RequestExtras};

use super::{ModelTokenizer, PromptMiss};

/// Why [`encode_and_hash`] produced no keys.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Tokenization failed.
    #[error(transparent)]
    Prompt(#[from] PromptMiss),
    /// The hash contract refused the request (its extras) or a block.
    #[error(transparent)]
    Hash(#[from] HashError),
}

/// Token ids of `text` into `ids` and the block keys of those ids under
/// `hasher` into `keys` (both cleared first, their capacity kept), the
/// hashing overlapped with the tokenization of later pieces. Returns how many
/// parts the ids arrived in (1: nothing overlapped).
///
/// `ids` equal [`ModelTokenizer::encode`]`(text, add_special_tokens)` and
/// `keys` equal [`BlockHasher::hash_prompt`] of them.
pub fn encode_and_hash(
    tok: &ModelTokenizer,
    text: &str,
    add_special_tokens: bool,
    hasher: &BlockHasher,
    extras: &RequestExtras,
    ids: &mut Vec<u32>,
    keys: &mut Vec<BlockKey>,
) -> Result<usize, PipelineError> {
    ids.clear();
    keys.clear();
    // About 4 bytes per token in prose: one reservation for most prompts.
    ids.reserve(text.len() / 3 + 16);
    keys.reserve(text.len() / (3 * hasher.block_size().max(1)) + 1);
    let mut chain: PromptHasher<'_> = hasher.prompt(extras)?;
    let mut parts = 0;
    tok.encode_each(text, add_special_tokens, |part: &[u32]| {
        parts += 1;
        ids.extend_from_slice(part);
        chain.extend(ids, keys)?;
        Ok::<(), PipelineError>(())
    })?;
    Ok(parts)
}
