//! Tokenize and hash at once: a long text's block keys, each block hashed as
//! soon as its ids exist ([`encode_and_hash`], [`prompt_tokens_and_keys`]).

use kvroute_core::{BlockHasher, BlockKey, HashError, PromptHasher, RequestExtras};

use super::pyvalue::PyValue;
use super::request::Dialect;
use super::{ApiKind, ModelTokenizer, PromptError, PromptLimits, PromptTokens};

/// Why [`encode_and_hash`] produced no keys.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Tokenization failed.
    #[error(transparent)]
    Prompt(#[from] PromptError),
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
///
/// With a parallel encoder attached ([`ModelTokenizer::set_parallel`]) a long
/// text is encoded in pieces on the worker pool; the pieces reach the caller's
/// thread in text order ([`ModelTokenizer::encode_each`]) and each one's full
/// blocks are hashed there while later pieces still encode. The chain is
/// sequential, so the hasher carries the parent digest and the partial block
/// at a piece's end over to the next piece ([`PromptHasher::extend`] over the
/// ids so far). What is left after the last piece is its own blocks only.
///
/// The keys are those of the whole untruncated ids: a request that
/// `truncate_prompt_tokens` cuts must be hashed again from its kept ids.
///
/// ```
/// use kvroute_core::{HashContract, RequestExtras};
/// use kvroute_engines::prompt::{encode_and_hash, ModelTokenizer};
/// # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
/// let tok = ModelTokenizer::load(&dir, &Default::default())?;
/// let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse::<HashContract>()?.hasher()?;
/// let text = "the router keeps a prefix of every prompt ".repeat(40);
/// let (mut ids, mut keys) = (Vec::new(), Vec::new());
/// encode_and_hash(&tok, &text, false, &hasher, &RequestExtras::NONE, &mut ids, &mut keys)?;
/// let mut one_shot = Vec::new();
/// hasher.hash_prompt(&tok.encode(&text, false)?, &RequestExtras::NONE, &mut one_shot)?;
/// assert_eq!(keys, one_shot);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
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

/// A request's prompt tokens with the block keys of the prompt a router
/// routes on ([`PromptTokens::engine_prompts`]`[0]`), computed in the same
/// pass: [`prompt_tokens_and_keys`].
#[derive(Debug, Clone)]
pub struct KeyedPrompt {
    /// What [`super::prompt_tokens_as`] returns for the same arguments.
    pub tokens: PromptTokens,
    /// The hash inputs besides the ids: what the `extras` callback made of
    /// the body's `cache_salt`.
    pub extras: RequestExtras,
    /// [`BlockHasher::hash_prompt`] of the first engine prompt's ids with
    /// [`KeyedPrompt::extras`]; `None` when there is no engine prompt or the
    /// contract refused the extras or an id (hashing the ids again reports
    /// the same error, so a caller can leave that to selection).
    pub keys: Option<Vec<BlockKey>>,
    /// Parts the ids of a text prompt arrived in (0: the keys were hashed
    /// after tokenizing, e.g. for an id prompt or a truncated one).
    pub parts: usize,
}

/// [`super::prompt_tokens_as`] that also hashes the routed prompt's block
/// keys under `hasher`. A chat request's rendered prompt and a string
/// completions prompt go through [`encode_and_hash`] (each piece's blocks
/// hashed while later pieces tokenize); the keys of an id prompt, of a list
/// prompt's first element, or of ids that `truncate_prompt_tokens` cut are
/// hashed from the final ids afterwards. `extras` turns the body's
/// `cache_salt` into the request's hash extras (adding, e.g., the LoRA
/// adapter its model names); it is called once.
///
/// The ids, and so every miss, are those of `prompt_tokens_as`; the keys
/// equal [`BlockHasher::hash_prompt`] of the first engine prompt's ids.
///
/// ```
/// use kvroute_core::{HashContract, RequestExtras};
/// use kvroute_engines::prompt::{parse_json, prompt_tokens_and_keys, ApiKind, Dialect, ModelTokenizer};
/// # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
/// let tok = ModelTokenizer::load(&dir, &Default::default())?;
/// let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse::<HashContract>()?.hasher()?;
/// let body = parse_json(br#"{"model": "m", "cache_salt": "t1", "messages": [{"role": "user", "content": "a question about routing, asked at some length so that it spans a few blocks"}]}"#)?;
/// let salted = |salt: Option<&str>| RequestExtras { cache_salt: salt.map(str::to_owned), ..RequestExtras::NONE };
/// let p = prompt_tokens_and_keys(&tok, ApiKind::Chat, &body, Default::default(), Dialect::Vllm, &hasher, salted)?;
/// let mut one_shot = Vec::new();
/// hasher.hash_prompt(&p.tokens.engine_prompts[0].token_ids, &p.extras, &mut one_shot)?;
/// assert_eq!(p.keys.as_deref(), Some(&one_shot[..]));
/// assert!(!one_shot.is_empty() && p.extras.cache_salt.as_deref() == Some("t1"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// The [`PromptError`] of `prompt_tokens_as`.
pub fn prompt_tokens_and_keys(
    tok: &ModelTokenizer,
    api: ApiKind,
    body: &PyValue,
    limits: PromptLimits,
    dialect: Dialect,
    hasher: &BlockHasher,
    extras: impl FnOnce(Option<&str>) -> RequestExtras,
) -> Result<KeyedPrompt, PromptError> {
    let mut extras = Some(extras);
    let mut made: Option<RequestExtras> = None;
    // Keys of the one text prompt, hashed as it tokenized (`None`: the
    // contract refused, hash nothing more).
    // (keys, parts, ids encoded): ids added after the encoding (SGLang's
    // continued assistant text) make the keys stale.
    let mut piped: Option<(Option<Vec<BlockKey>>, usize, usize)> = None;
    let tokens =
        super::prompt_tokens_encoded(tok, api, body, limits, dialect, &mut |salt, text, add| {
            let e = made.insert(extras.take().map_or(RequestExtras::NONE, |f| f(salt)));
            let (mut ids, mut keys) = (Vec::new(), Vec::new());
            match encode_and_hash(tok, text, add, hasher, e, &mut ids, &mut keys) {
                Ok(parts) => piped = Some((Some(keys), parts, ids.len())),
                Err(PipelineError::Prompt(m)) => return Err(m),
                Err(PipelineError::Hash(err)) => {
                    tracing::debug!(%err, "contract refused the prompt: no keys");
                    // The ids are still the request's; hashing stopped early.
                    ids = tok.encode(text, add)?;
                    piped = Some((None, 0, ids.len()));
                }
            }
            Ok(ids)
        })?;
    let extras = match made {
        Some(e) => e,
        None => extras.map_or(RequestExtras::NONE, |f| f(tokens.cache_salt.as_deref())),
    };
    let final_len = tokens.engine_prompts.first().map(|p| p.token_ids.len());
    let (keys, parts) = match (piped, tokens.truncated) {
        (Some((keys, parts, n)), false) if Some(n) == final_len => (keys, parts),
        (Some((None, _, _)), _) => (None, 0),
        // Truncated (the keys were of the whole text), or not a text prompt.
        _ => {
            let keys = tokens.engine_prompts.first().and_then(|p| {
                let mut keys = Vec::new();
                hasher
                    .hash_prompt(&p.token_ids, &extras, &mut keys)
                    .map_err(|err| tracing::debug!(%err, "contract refused the prompt: no keys"))
                    .ok()
                    .map(|_| keys)
            });
            (keys, 0)
        }
    };
    Ok(KeyedPrompt {
        tokens,
        extras,
        keys,
        parts,
    })
}
