//! What a request brings to selection: token ids, precomputed block keys, or the
//! reason the gateway could not get that far.

use std::fmt;
use std::sync::Arc;

pub use kvroute_core::KeyMode;
use kvroute_core::{BlockKey, MissReason, RequestExtras, TokenId};

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

/// Why block keys could not be produced from token ids.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    /// The hasher refused the input (e.g. a token id outside the contract's range).
    #[error("block hashing failed: {0}")]
    Hashing(String),
    /// The request carries an extra the provider (or its contract) cannot mix
    /// into keys. Never hashed without it: those keys would match nothing.
    #[error("request extra `{field}` is not supported: {reason}")]
    ExtraNotSupported {
        /// The [`RequestExtras`] field that is set.
        field: &'static str,
        /// Why (the contract's hint, or "this provider hashes token ids only").
        reason: String,
    },
}

/// No extras, as a `'static` the accessors can hand out.
static NO_EXTRAS: RequestExtras = RequestExtras::NONE;

/// The first [`RequestExtras`] field that is set, `None` for a plain request.
/// Allocation-free, so the plain-request hot path stays cheap.
#[must_use]
pub(crate) fn first_set_extra(e: &RequestExtras) -> Option<&'static str> {
    [
        ("lora", e.lora.is_some()),
        ("mm_features", !e.mm_features.is_empty()),
        ("cache_salt", e.cache_salt.is_some()),
        ("prompt_embeds", !e.prompt_embeds.is_empty()),
        ("sglang_extra_key", e.sglang_extra_key.is_some()),
        ("trtllm_lora_task_id", e.trtllm_lora_task_id.is_some()),
        ("trtllm_cache_salt_id", e.trtllm_cache_salt_id.is_some()),
        ("trtllm_token_extra_ids", e.trtllm_token_extra_ids.is_some()),
    ]
    .into_iter()
    .find_map(|(name, set)| set.then_some(name))
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
        KeyMode::Engine
    }
    /// Appends the keys of `tokens`' blocks to `out` (block 0 first).
    ///
    /// # Errors
    /// [`KeysError`] when the contract cannot hash this input.
    fn keys(&self, tokens: &[TokenId], out: &mut Vec<BlockKey>) -> Result<(), KeysError>;

    /// Like [`PromptKeys::keys`] for a request with per-request `extras`
    /// (vLLM `cache_salt`, LoRA adapter, …).
    ///
    /// The default hashes plain requests with [`PromptKeys::keys`] and refuses
    /// any extra with [`KeysError::ExtraNotSupported`]: a provider that cannot
    /// honour an extra must never return keys computed without it. Providers
    /// that can (e.g. [`crate::ContractKeys`]) override this.
    ///
    /// # Errors
    /// [`KeysError`] when the contract cannot hash this input or these extras.
    ///
    /// ```
    /// use kvroute_core::{BlockKey, RequestExtras, TokenId};
    /// use kvroute_select::{ContractId, KeysError, PromptKeys};
    /// struct Plain(ContractId);
    /// impl PromptKeys for Plain {
    ///     fn contract(&self) -> &ContractId { &self.0 }
    ///     fn block_size(&self) -> u32 { 4 }
    ///     fn keys(&self, t: &[TokenId], out: &mut Vec<BlockKey>) -> Result<(), KeysError> {
    ///         out.extend(t.chunks_exact(4).map(|c| BlockKey(u64::from(c[0]))));
    ///         Ok(())
    ///     }
    /// }
    /// let p = Plain(ContractId::new("plain/bs4"));
    /// let salted = RequestExtras { cache_salt: Some("tenant-a".into()), ..RequestExtras::NONE };
    /// let mut out = Vec::new();
    /// let err = p.keys_with_extras(&[1, 2, 3, 4], &salted, &mut out).unwrap_err();
    /// assert!(matches!(err, KeysError::ExtraNotSupported { field: "cache_salt", .. }));
    /// assert!(out.is_empty());
    /// ```
    fn keys_with_extras(
        &self,
        tokens: &[TokenId],
        extras: &RequestExtras,
        out: &mut Vec<BlockKey>,
    ) -> Result<(), KeysError> {
        match first_set_extra(extras) {
            None => self.keys(tokens, out),
            Some(field) => Err(KeysError::ExtraNotSupported {
                field,
                reason: "this key provider hashes token ids only".to_owned(),
            }),
        }
    }
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
    /// No keys: the request missed before hashing (one of the reasons that
    /// arise before keys exist, e.g. [`MissReason::NoTokenizer`]).
    Missing(MissReason),
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
    /// Per-request hash inputs besides the tokens (cache salt, LoRA adapter, …);
    /// `None` is a plain request. Used when the rule hashes
    /// [`PromptInput::Tokens`]; precomputed [`PromptInput::Keys`] must already
    /// include them.
    pub extras: Option<&'a RequestExtras>,
    /// The block keys of [`PromptInput::Tokens`] (with [`Request::extras`])
    /// as the host already computed them, and their contract: see
    /// [`Request::with_keys`].
    pub keys: Option<(&'a [BlockKey], &'a ContractId)>,
}

impl<'a> Request<'a> {
    /// A request with only a prompt.
    #[must_use]
    pub const fn new(prompt: PromptInput<'a>) -> Self {
        Self {
            prompt,
            session: None,
            text: None,
            extras: None,
            keys: None,
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

    /// Adds per-request hash extras (e.g. vLLM's `cache_salt`).
    ///
    /// ```
    /// use kvroute_core::RequestExtras;
    /// use kvroute_select::{PromptInput, Request};
    /// let salted = RequestExtras { cache_salt: Some("tenant-a".into()), ..RequestExtras::NONE };
    /// let tokens = [1u32, 2, 3];
    /// let req = Request::new(PromptInput::Tokens(&tokens)).with_extras(&salted);
    /// assert_eq!(req.extras().cache_salt.as_deref(), Some("tenant-a"));
    /// ```
    #[must_use]
    pub const fn with_extras(mut self, extras: &'a RequestExtras) -> Self {
        self.extras = Some(extras);
        self
    }

    /// Adds the block keys of the request's [`PromptInput::Tokens`] under
    /// `contract`, computed by the host (e.g. hashed while the prompt was
    /// tokenizing, off the async worker). A rule whose contract is
    /// `contract` uses them instead of hashing the tokens; every other part
    /// of the decision (prompt length, affinity key, receipts) still reads
    /// the tokens, so it is the decision the tokens alone give when the keys
    /// are theirs. Another contract's keys are ignored (the tokens are
    /// hashed).
    ///
    /// ```
    /// use kvroute_core::BlockKey;
    /// use kvroute_select::{ContractId, PromptInput, Request};
    /// let tokens = [1u32, 2, 3, 4];
    /// let (keys, contract) = ([BlockKey(7)], ContractId::new("plain/bs4"));
    /// let req = Request::new(PromptInput::Tokens(&tokens)).with_keys(&keys, &contract);
    /// assert_eq!(req.keys.map(|(k, _)| k.len()), Some(1));
    /// ```
    #[must_use]
    pub const fn with_keys(mut self, keys: &'a [BlockKey], contract: &'a ContractId) -> Self {
        self.keys = Some((keys, contract));
        self
    }

    /// The request's extras ([`RequestExtras::NONE`] when none were added).
    #[must_use]
    pub fn extras(&self) -> &'a RequestExtras {
        self.extras.unwrap_or(&NO_EXTRAS)
    }
}
