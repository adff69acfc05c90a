//! What a request brings to selection: token ids, precomputed block keys, or the
//! reason the gateway could not get that far.

use std::fmt;
use std::sync::Arc;

use kvroute_core::{BlockKey, TokenId};

/// Names one hash contract (engine, version range, algorithm, seed, block size,
/// extra keys). Two contracts match only when their names are equal; the
/// descriptor behind the name lives in `kvroute-core` / `kvroute-engines`.
///
/// ```
/// use kvroute_select::ContractId;
/// let a = ContractId::new("vllm>=0.29/sha256_cbor/seed=unset/bs16");
/// assert_eq!(a, ContractId::new("vllm>=0.29/sha256_cbor/seed=unset/bs16"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ContractId(Arc<str>);

impl ContractId {
    /// A contract name.
    #[must_use]
    pub fn new(name: &str) -> Self {
        Self(Arc::from(name))
    }

    /// The name.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ContractId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContractId({:?})", &*self.0)
    }
}

impl fmt::Display for ContractId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where the inventory's keys come from, which fixes how prompt keys must be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KeyMode {
    /// The engine's own event keys; prompt keys must be bit-identical to them.
    #[default]
    EngineKeys,
    /// kvroute re-keys stored blocks from the tokens the events carry (for
    /// contracts that cannot be reproduced); prompt keys use the same re-keying.
    Rekeyed,
}

/// Why block keys could not be produced from token ids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    /// The hasher refused the input (e.g. a token id outside the contract's range).
    #[error("block hashing failed: {0}")]
    Hashing(String),
}

/// Turns a prompt's token ids into block keys under one contract.
///
/// The implementation for vLLM's `sha256_cbor` and friends lives in `kvroute-core`;
/// selection only needs this seam, so it does not care which contract a rule uses.
pub trait PromptKeys: Send + Sync {
    /// The contract the keys follow.
    fn contract(&self) -> &ContractId;
    /// Tokens per block.
    fn block_size(&self) -> u32;
    /// Engine keys or re-keyed.
    fn key_mode(&self) -> KeyMode {
        KeyMode::EngineKeys
    }
    /// Appends the keys of `tokens`' blocks to `out` (block 0 first).
    ///
    /// # Errors
    /// [`KeysError`] when the contract cannot hash this input.
    fn keys(&self, tokens: &[TokenId], out: &mut Vec<BlockKey>) -> Result<(), KeysError>;
}

/// A miss that happened before any key existed (in the gateway's body parsing or
/// tokenization), reported so it is counted with the rule's other misses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MissBeforeKeys {
    /// The body was not OpenAI JSON (e.g. `text/plain`).
    NotJson,
    /// The body had no `model`.
    NoModel,
    /// No staged tokenizer for the model.
    NoTokenizer,
    /// The tokenizer or chat template failed.
    TokenizeError,
    /// The prompt was empty.
    EmptyPrompt,
    /// The prompt exceeds the host's routing limit (characters or tokens), so
    /// it was not tokenized or hashed: bounded work per request.
    PromptTooLong,
}

/// The prompt as the gateway hands it to selection.
#[derive(Clone, Copy, Debug)]
pub enum PromptInput<'a> {
    /// Token ids; the rule's [`PromptKeys`] hashes them.
    Tokens(&'a [TokenId]),
    /// Keys the host already computed, with the contract they follow.
    Keys {
        /// Block keys, block 0 first.
        keys: &'a [BlockKey],
        /// Contract they were computed under (checked against the rule's).
        contract: &'a ContractId,
        /// Prompt length in tokens (for load-aware cost and receipts).
        prompt_tokens: u32,
    },
    /// No keys: the request missed before hashing.
    Missing(MissBeforeKeys),
}

/// One request as selection sees it.
///
/// ```
/// use kvroute_select::{PromptInput, Request};
/// let tokens = [1u32, 2, 3];
/// let req = Request::new(PromptInput::Tokens(&tokens)).with_session("user-42");
/// assert_eq!(req.session, Some("user-42"));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The prompt.
    pub prompt: PromptInput<'a>,
    /// A session / conversation id, if the client sent one (P/D session affinity,
    /// CHWBL key).
    pub session: Option<&'a str>,
    /// Prompt text (P/D prefix-trie affinity, CHWBL key when no tokens exist).
    pub text: Option<&'a str>,
}

impl<'a> Request<'a> {
    /// A request with only a prompt.
    #[must_use]
    pub const fn new(prompt: PromptInput<'a>) -> Self {
        Self {
            prompt,
            session: None,
            text: None,
        }
    }

    /// Adds a session id.
    #[must_use]
    pub const fn with_session(mut self, session: &'a str) -> Self {
        self.session = Some(session);
        self
    }

    /// Adds the prompt text.
    #[must_use]
    pub const fn with_text(mut self, text: &'a str) -> Self {
        self.text = Some(text);
        self
    }
}
