//! Attestation: recomputing the keys of stored blocks locally and comparing them
//! with the keys the engine reported.
//!
//! A mismatch means the configured hash contract (algorithm, seed, block size,
//! tokenizer, extra keys) differs from the engine's, and prompt-side keys will
//! never match this endpoint's inventory: routing silently gets 0 % hits. The
//! ingest therefore exposes a per-endpoint [`ContractStatus`], counts every
//! verified and mismatched block, and logs an error on the first mismatch (and
//! again at every power of two).

use kvroute_core::{BlockKey, Digest};

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
