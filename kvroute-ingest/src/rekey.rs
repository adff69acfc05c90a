use kvroute_core::{BlockKey, TokenId};

/// Computes internal keys for consecutive full blocks of tokens, chained after a
/// parent internal key (`None` at the root of a sequence).
///
/// Implementations must be pure: the same inputs always give the same keys, on
/// the prompt side and on the ingest side.
///
/// Re-keying: computing kvroute's own block keys from the token ids that
/// `BlockStored` events carry, for engines whose keys the prompt side cannot
/// reproduce (vLLM with a random hash seed, salted or LoRA TensorRT-LLM, SGLang
/// before 0.5.6).
///
/// The prompt side must hash prompts with the same [`BlockRekeyer`] rule; the
/// ingest side keeps an engine-key → internal-key map per endpoint so that
/// `BlockRemoved` (which carries only engine keys) still works.
pub trait BlockRekeyer: Send + Sync {
    /// Appends one key per full `block_size` block of `tokens` to `out`; a partial
    /// tail block gets no key.
    fn rekey(
        &self,
        parent: Option<BlockKey>,
        tokens: &[TokenId],
        block_size: u32,
        out: &mut Vec<BlockKey>,
    );
}

/// kvroute's re-key contract `xxh3_64_chain` (Dynamo's local-block-hash +
/// sequence-hash scheme): the chain of [`kvroute_core::rekey::extend_chain`],
/// the one the prompt side hashes with, so both sides' keys agree by
/// construction.
///
/// ```
/// use kvroute_core::BlockKey;
/// use kvroute_ingest::{BlockRekeyer, XxhChainRekeyer};
///
/// let rekeyer = XxhChainRekeyer::default();
/// let tokens: Vec<u32> = (0..40).collect();
/// let mut whole = Vec::new();
/// rekeyer.rekey(None, &tokens, 16, &mut whole);
/// assert_eq!(whole.len(), 2); // the 8-token tail has no key
///
/// // Continuing from the first block's key gives the same second key.
/// let mut tail = Vec::new();
/// rekeyer.rekey(Some(whole[0]), &tokens[16..], 16, &mut tail);
/// assert_eq!(tail, whole[1..]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XxhChainRekeyer {
    /// The xxh3 seed (Dynamo's 1337 by default).
    pub seed: u64,
}

impl Default for XxhChainRekeyer {
    fn default() -> Self {
        Self {
            seed: kvroute_core::rekey::DYNAMO_SEED,
        }
    }
}

impl BlockRekeyer for XxhChainRekeyer {
    fn rekey(
        &self,
        parent: Option<BlockKey>,
        tokens: &[TokenId],
        block_size: u32,
        out: &mut Vec<BlockKey>,
    ) {
        // A block size beyond the address space has no full block.
        let Ok(block_size) = usize::try_from(block_size) else {
            return;
        };
        kvroute_core::rekey::extend_chain(parent, tokens, block_size, self.seed, out);
    }
}
