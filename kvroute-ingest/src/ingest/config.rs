//! How an endpoint's inventory is keyed and configured.

use std::sync::Arc;

use kvroute_core::{HashContract, KeyMode};

use crate::rekey::{BlockRekeyer, XxhChainRekeyer};
use crate::seq::SeqWindowConfig;

/// How an endpoint's inventory is keyed: the [`KeyMode`] with, for
/// [`KeyMode::Rekey`], the re-keying rule. Build it from the rule's contract
/// with [`Keying::for_contract`] so the ingest side and the prompt side
/// ([`HashContract::key_mode`]) follow the same contract by construction.
///
/// ```
/// use kvroute_core::{HashContract, KeyMode};
/// use kvroute_ingest::Keying;
/// let c: HashContract = "rekey:xxh3_64_chain:block=16:seed=1".parse().unwrap();
/// assert_eq!(Keying::for_contract(&c).mode(), KeyMode::Rekey);
/// assert_eq!(Keying::for_contract(&c).mode(), c.key_mode());
/// ```
#[derive(Clone)]
pub enum Keying {
    /// Use the keys the engine reports; the prompt side must reproduce them.
    Engine,
    /// Recompute keys from token ids with this rule; the prompt side uses it too.
    Rekey(Arc<dyn BlockRekeyer>),
}

impl Keying {
    /// The keying a contract implies: engine keys for engine contracts, the
    /// contract's own re-keyer (with its seed) for re-key contracts.
    #[must_use]
    pub fn for_contract(contract: &HashContract) -> Self {
        match contract {
            // `xxh3_64_chain` is the only re-key algorithm; the prompt side
            // hashes it through kvroute-core's hasher with the same seed.
            HashContract::Rekey(c) => Keying::Rekey(Arc::new(XxhChainRekeyer { seed: c.seed })),
            HashContract::Vllm(_) | HashContract::Sglang(_) | HashContract::Trtllm(_) => {
                Keying::Engine
            }
        }
    }

    /// The key mode, without the re-keyer.
    #[must_use]
    pub fn mode(&self) -> KeyMode {
        match self {
            Keying::Engine => KeyMode::Engine,
            Keying::Rekey(_) => KeyMode::Rekey,
        }
    }
}

impl std::fmt::Debug for Keying {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keying::Engine => f.write_str("Engine"),
            Keying::Rekey(_) => f.write_str("Rekey(..)"),
        }
    }
}

/// Which KV-cache group of a hybrid model an ingest applies
/// ([`IngestConfig::scored_group`]): prompts are scored on one group's
/// blocks, and only a full-attention group holds every block of a prefix
/// (a sliding-window group frees the blocks before its window).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ScoredGroup {
    /// The first group whose stores the engine reports as full attention
    /// ([`crate::BlockStored::full_attention`]); group 0 while none has
    /// (engines that report no kind, single-group models). vLLM numbers
    /// groups in the order of their first layers, so a model whose first
    /// layer uses a sliding window (Gemma 3, gpt-oss) has its full-attention
    /// group further on.
    #[default]
    FullAttention,
    /// This group only.
    Group(u32),
    /// Every group, into one key space.
    All,
}

/// Configuration of one endpoint's ingest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// Sequence-window settings, shared by all of the endpoint's DP ranks.
    pub window: SeqWindowConfig,
    /// The KV-cache group whose events are applied.
    pub scored_group: ScoredGroup,
    /// Most distinct DP-rank streams tracked; batches from further ranks are
    /// dropped and counted, so a peer cannot grow this without bound.
    pub max_streams: usize,
    /// Most parent digests remembered for attesting later events of a chain
    /// (the cache is emptied when full).
    pub attest_links: usize,
    /// The prompt side's block size (the contract's). A `BlockStored` of another
    /// size can never match a prompt's keys, in any key mode: such blocks are
    /// still applied but counted in [`IngestCounters::block_size_mismatches`](super::IngestCounters::block_size_mismatches),
    /// logged as errors and reported as a contract mismatch. `None`: unchecked.
    pub expected_block_size: Option<u32>,
    /// Most entries of the re-key map (engine key → internal key), at least: the
    /// map may also hold as many entries as the endpoint's inventory can hold
    /// keys over all tiers (a correct publisher needs one per key), plus 1024.
    pub max_rekey_entries: usize,
    /// Whether the engine's keys form chains (each depends on every block
    /// before it; `HashContract::keys_chained`). On, a stored event's blocks
    /// are recorded as runs the prefix walk may cross with one lookup; off
    /// (SGLang's legacy per-page hash), every key is looked up. Re-keyed
    /// inventories are always chained.
    pub chained_keys: bool,
}

/// Default [`IngestConfig::max_rekey_entries`]: 2^16 (the bound then follows the
/// index's capacity for the endpoint).
pub const DEFAULT_REKEY_ENTRIES: usize = 1 << 16;

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            window: SeqWindowConfig::default(),
            scored_group: ScoredGroup::FullAttention,
            max_streams: 64,
            attest_links: 1 << 16,
            expected_block_size: None,
            max_rekey_entries: DEFAULT_REKEY_ENTRIES,
            chained_keys: true,
        }
    }
}
