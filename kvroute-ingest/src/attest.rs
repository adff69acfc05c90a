use kvroute_core::{BlockHasher, BlockKey, ContractError, Digest, HashContract, RequestExtras};

use crate::event::BlockStored;

/// Where the chain of a `BlockStored` event starts, as far as ingest knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParentLink<'a> {
    /// The event has no parent: block 0 of a sequence.
    Root,
    /// The parent's full digest, remembered from an earlier attested event.
    Digest(&'a Digest),
    /// Only the parent's 64-bit key is known (contracts that chain on the key
    /// can continue from it; others must answer unverifiable).
    KeyOnly(BlockKey),
}

/// Why an event's keys cannot be recomputed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("keys not recomputable: {reason}")]
pub struct Unverifiable {
    /// Short static reason (for logs and metrics labels).
    pub reason: &'static str,
}

/// Recomputes engine keys under the endpoint's hash contract.
///
/// Attestation: recomputing the keys of stored blocks locally and comparing them
/// with the keys the engine reported.
///
/// A mismatch means the configured hash contract (algorithm, seed, block size,
/// tokenizer, extra keys) differs from the engine's, and prompt-side keys will
/// never match this endpoint's inventory: routing silently gets 0 % hits. The
/// ingest therefore exposes a per-endpoint [`ContractStatus`], counts every
/// verified and mismatched block, and logs an error on the first mismatch (and
/// again at every power of two).
pub trait KeyAttestor: Send + Sync {
    /// Appends the recomputed key and full digest of each of `stored`'s blocks
    /// (in order, as many as can be computed) continuing from `parent`.
    fn recompute(
        &self,
        parent: ParentLink<'_>,
        stored: &BlockStored,
        keys: &mut Vec<BlockKey>,
        digests: &mut Vec<Digest>,
    ) -> Result<(), Unverifiable>;
}

/// An endpoint's hash-contract status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContractStatus {
    /// Nothing checked yet (or no attestor configured).
    Unknown,
    /// Events arrived but none could be recomputed.
    Unverifiable {
        /// Events that could not be recomputed.
        events: u64,
    },
    /// Every recomputed block matched.
    Verified {
        /// Blocks that matched.
        blocks: u64,
    },
    /// Some recomputed block differed from the engine's key.
    Mismatch {
        /// Blocks that differed.
        mismatched: u64,
        /// Blocks that matched.
        verified: u64,
    },
}

/// Attestation counters of one endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttestCounters {
    /// Blocks whose recomputed key equals the engine's.
    pub verified_blocks: u64,
    /// Blocks whose recomputed key differs.
    pub mismatched_blocks: u64,
    /// Stored events that could not be recomputed.
    pub unverifiable_events: u64,
    /// Mismatched blocks that start a chain (no parent): the contract's root
    /// (seed, algorithm, first-block extras) differs, not only a chained step.
    pub mismatched_root_blocks: u64,
}

impl AttestCounters {
    /// The status these counts imply.
    #[must_use]
    pub fn status(&self) -> ContractStatus {
        if self.mismatched_blocks > 0 {
            ContractStatus::Mismatch {
                mismatched: self.mismatched_blocks,
                verified: self.verified_blocks,
            }
        } else if self.verified_blocks > 0 {
            ContractStatus::Verified {
                blocks: self.verified_blocks,
            }
        } else if self.unverifiable_events > 0 {
            ContractStatus::Unverifiable {
                events: self.unverifiable_events,
            }
        } else {
            ContractStatus::Unknown
        }
    }
}

/// A [`KeyAttestor`] backed by a kvroute-core [`BlockHasher`]: recomputes the keys
/// of text-only stored events under the endpoint's [`HashContract`].
///
/// Events that carry per-block extras (LoRA, multimodal, cache salt, prompt
/// embeds) are reported [`Unverifiable`]: the event does not carry enough of
/// the request to rebuild them. A chained event needs its parent's full digest
/// (remembered by [`crate::EndpointIngest`] from earlier verified blocks) unless
/// the contract chains on the 64-bit key (SGLang legacy, TensorRT-LLM, re-key),
/// in which case the parent key is enough.
///
/// ```
/// use std::sync::Arc;
/// use kvroute_core::{BlockKey, EndpointId, HashContract, RequestExtras};
/// use kvroute_ingest::{ContractAttestor, ContractStatus};
/// use kvroute_ingest::{
///     BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent,
///     SharedIndex,
/// };
///
/// let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?;
/// let attestor = ContractAttestor::new(&contract)?;
///
/// // What a correctly configured engine would publish for 32 tokens.
/// let hasher = contract.hasher()?;
/// let tokens: Vec<u32> = (1000..1032).collect();
/// let mut keys = Vec::new();
/// let root = hasher.root(&RequestExtras::NONE)?;
/// hasher.hash_chain(&RequestExtras::NONE, &root, 0, &tokens, &mut keys, None)?;
///
/// let index = SharedIndex::new(1, IndexConfig::default());
/// let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine)
///     .with_attestor(Arc::new(attestor));
/// let batch = EventBatch {
///     events: vec![KvEvent::Stored(BlockStored {
///         keys,
///         token_ids: tokens,
///         block_size: 16,
///         ..Default::default()
///     })],
///     ..Default::default()
/// };
/// let _ = ingest.apply_batch(&batch, &index);
/// assert_eq!(ingest.contract_status(), ContractStatus::Verified { blocks: 2 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct ContractAttestor {
    hasher: BlockHasher,
}

impl ContractAttestor {
    /// An attestor for `contract` (validated and prepared once).
    pub fn new(contract: &HashContract) -> Result<Self, ContractError> {
        Ok(Self {
            hasher: contract.hasher()?,
        })
    }

    /// An attestor around an already prepared hasher.
    #[must_use]
    pub fn from_hasher(hasher: BlockHasher) -> Self {
        Self { hasher }
    }
}

impl KeyAttestor for ContractAttestor {
    fn recompute(
        &self,
        parent: ParentLink<'_>,
        stored: &BlockStored,
        keys: &mut Vec<BlockKey>,
        digests: &mut Vec<Digest>,
    ) -> Result<(), Unverifiable> {
        if stored.lora_name.is_some()
            || stored.cache_salt.is_some()
            || stored.extra_keys.iter().any(Option::is_some)
        {
            return Err(Unverifiable {
                reason: "per-block extras",
            });
        }
        let extras = RequestExtras::NONE;
        let parent = match parent {
            ParentLink::Root => self
                .hasher
                .root(&extras)
                .map_err(|_| Unverifiable { reason: "root" })?,
            ParentLink::Digest(d) => *d,
            ParentLink::KeyOnly(k) => self.hasher.parent_from_key(k).ok_or(Unverifiable {
                reason: "parent digest unknown",
            })?,
        };
        // Without extras the absolute block position does not enter the hash, so
        // a chained event can start at index 0.
        self.hasher
            .hash_chain(&extras, &parent, 0, &stored.token_ids, keys, Some(digests))
            .map(|_| ())
            .map_err(|_| Unverifiable {
                reason: "hash error",
            })
    }
}
