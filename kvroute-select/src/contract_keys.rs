//! [`PromptKeys`] backed by `kvroute-core`'s contract hashers.

use kvroute_core::{
    BlockHasher, BlockKey, ContractError, HashContract, HashError, RequestExtras, TokenId,
};

use crate::keys::{ContractId, KeyMode, KeysError, PromptKeys};

impl From<&HashContract> for ContractId {
    /// The contract's canonical compact form, e.g.
    /// `vllm@0.33.0:sha256_cbor:block=16:seed=0`.
    fn from(c: &HashContract) -> Self {
        ContractId::new(&c.to_string())
    }
}

/// Hashes prompts with a [`HashContract`], per-request extras included
/// ([`PromptKeys::keys_with_extras`]: vLLM `cache_salt`, LoRA adapter, …).
/// Extras the contract has no place for are refused with
/// [`KeysError::ExtraNotSupported`], never hashed away.
///
/// ```
/// use kvroute_core::HashContract;
/// use kvroute_select::{ContractKeys, PromptKeys};
/// let c: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
/// let keys = ContractKeys::new(&c).unwrap();
/// let mut out = Vec::new();
/// keys.keys(&(0..40).collect::<Vec<u32>>(), &mut out).unwrap();
/// assert_eq!(out.len(), 2);
/// assert_eq!(keys.contract().as_str(), "vllm@0.33.0:sha256_cbor:block=16:seed=0");
///
/// // A salted request changes block 0's key, and with it every later one.
/// let salted = kvroute_core::RequestExtras { cache_salt: Some("tenant-a".into()), ..Default::default() };
/// let mut salted_keys = Vec::new();
/// keys.keys_with_extras(&(0..40).collect::<Vec<u32>>(), &salted, &mut salted_keys).unwrap();
/// assert_eq!(salted_keys.len(), 2);
/// assert_ne!(salted_keys[0], out[0]);
/// ```
#[derive(Clone, Debug)]
pub struct ContractKeys {
    hasher: BlockHasher,
    id: ContractId,
    mode: KeyMode,
}

impl ContractKeys {
    /// A provider for `contract`.
    ///
    /// # Errors
    /// [`ContractError`] when the contract cannot be reproduced.
    pub fn new(contract: &HashContract) -> Result<Self, ContractError> {
        Ok(Self {
            hasher: BlockHasher::new(contract)?,
            id: ContractId::from(contract),
            mode: contract.key_mode(),
        })
    }

    /// The contract's block hasher (what [`PromptKeys::keys`] runs), for a
    /// host that hashes with tokenization and hands selection the keys
    /// ([`crate::Request::with_keys`] with [`PromptKeys::contract`]).
    #[must_use]
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }
}

impl PromptKeys for ContractKeys {
    fn contract(&self) -> &ContractId {
        &self.id
    }

    fn block_size(&self) -> u32 {
        u32::try_from(self.hasher.block_size()).unwrap_or(u32::MAX)
    }

    fn key_mode(&self) -> KeyMode {
        self.mode
    }

    fn keys(&self, tokens: &[TokenId], out: &mut Vec<BlockKey>) -> Result<(), KeysError> {
        self.keys_with_extras(tokens, &RequestExtras::NONE, out)
    }

    fn keys_with_extras(
        &self,
        tokens: &[TokenId],
        extras: &RequestExtras,
        out: &mut Vec<BlockKey>,
    ) -> Result<(), KeysError> {
        let before = out.len();
        self.hasher
            .hash_prompt(tokens, extras, out)
            .map(|_| ())
            .map_err(|e| {
                // Never leave keys of a refused request behind.
                out.truncate(before);
                match e {
                    HashError::ExtraNotSupported { field, .. } => KeysError::ExtraNotSupported {
                        field,
                        reason: e.to_string(),
                    },
                    other => KeysError::Hashing(other.to_string()),
                }
            })
    }
}
