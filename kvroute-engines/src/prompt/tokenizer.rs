//! Staged per-model tokenizers (tokenizer.json + chat template) and the pool
//! that loads them lazily by model slug.

use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};
use tokenizers::Tokenizer;

use super::byte_bpe::{ByteBpe, PreTokenCacheStats, DEFAULT_WORD_CACHE_BYTES};
use super::error::PromptError;
use super::parallel::{ParallelEncoder, SeamPolicy};
use super::span_cache::{SegmentPolicy, SpanCache, SpanCacheStats};
use super::template::{ChatTemplate, ContentFormat, TemplateError};

/// Default span-cache budget per model.
pub const DEFAULT_SPAN_CACHE_BYTES: usize = 64 << 20;

/// Why a model directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// No `tokenizer.json` / `tokenizer.json.gz` in the directory.
    #[error("no tokenizer.json or tokenizer.json.gz in {0}")]
    NoTokenizer(PathBuf),
    /// `tokenizer.json` does not parse.
    #[error("tokenizer.json: {0}")]
    Tokenizer(String),
    /// `tokenizer_config.json` / `chat_template.json` is not valid JSON.
    #[error("{path}: {reason}")]
    Config {
        /// The file.
        path: PathBuf,
        /// The parse error.
        reason: String,
    },
}

/// Per-model settings that are not in the staged files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOptions {
    /// The engine's `max_model_len`; `None` (or 0): read `config.json`'s
    /// `max_position_embeddings` if present, else no length check.
    pub max_model_len: Option<usize>,
    /// Span-cache budget in bytes (`0` turns the cache off).
    pub span_cache_bytes: usize,
    /// The engines' `--chat-template-content-format`; `None`: detected from
    /// the template as vLLM's `auto` does.
    pub content_format: Option<ContentFormat>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            max_model_len: None,
            span_cache_bytes: DEFAULT_SPAN_CACHE_BYTES,
            content_format: None,
        }
    }
}

/// One model's tokenizer, chat template and tokenization cache.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    template: Option<Result<ChatTemplate, TemplateError>>,
    max_model_len: Option<usize>,
    vocab_size: usize,
    post_processor_adds_tokens: bool,
    /// Special tokens the post-processor adds before and after a single
    /// sequence's own tokens (a BOS: `(1, 0)`).
    added_special: (usize, usize),
    /// The id of `tokenizer_config.json`'s `bos_token` (transformers'
    /// `bos_token_id`).
    bos_token_id: Option<u32>,
    segments: Option<SegmentPolicy>,
    cache: Option<SpanCache>,
    seams: Option<SeamPolicy>,
    /// `tokenizer` without its NFC normalizer, for texts NFC leaves as they
    /// are ([`nfc_free_for`]); `None` when the normalizer is not exactly NFC.
    nfc_free: Option<Tokenizer>,
    /// When set, [`ModelTokenizer::encode`] tokenizes long texts on it.
    parallel: Option<Arc<ParallelEncoder>>,
    /// The exact fast path for byte-level BPE pipelines (`byte_bpe.rs`);
    /// `None` for other pipelines.
    fast: Option<ByteBpe>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("template", &self.template)
            .field("max_model_len", &self.max_model_len)
            .field("vocab_size", &self.vocab_size)
            .field("segments", &self.segments)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ModelLoadError> {
    fs::read(path).map_err(|source| ModelLoadError::Io {
        path: path.to_owned(),
        source,
    })
}

fn read_tokenizer_json(dir: &Path) -> Result<Vec<u8>, ModelLoadError> {
    let plain = dir.join("tokenizer.json");
    if plain.is_file() {
        return read(&plain);
    }
    let gz = dir.join("tokenizer.json.gz");
    if gz.is_file() {
        let compressed = read(&gz)?;
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(compressed.as_slice())
            .read_to_end(&mut out)
            .map_err(|source| ModelLoadError::Io { path: gz, source })?;
        return Ok(out);
    }
    Err(ModelLoadError::NoTokenizer(dir.to_owned()))
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, ModelLoadError> {
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = read(path)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ModelLoadError::Config {
            path: path.to_owned(),
            reason: e.to_string(),
        })
}

/// transformers stores the template as a string, or a list of named templates
/// (the one named `default` is used).
fn template_from_config_value(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => items.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(str::to_owned))
                .flatten()
        }),
        _ => None,
    }
}

/// A special-token entry is a string or `{"content": ...}` (older configs).
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ModelTokenizer {
    /// Loads a staged model directory: `tokenizer.json` (or `.json.gz`),
    /// `tokenizer_config.json` (special tokens, `chat_template`), and a chat
    /// template from `chat_template.jinja` or `chat_template.json` if present
    /// (those win over the config, as in transformers).
    ///
    /// A tokenizer whose normalizer is NFC is held twice: as loaded, and
    /// without the normalizer for the texts NFC leaves unchanged (most
    /// prompts; NFC is ~6 % of a Qwen3 encode). The copy costs the
    /// tokenizer's size again (~23 MB for Qwen3).
    pub fn load(dir: &Path, options: &ModelOptions) -> Result<Self, ModelLoadError> {
        let json = read_tokenizer_json(dir)?;
        let mut tokenizer =
            Tokenizer::from_bytes(&json).map_err(|e| ModelLoadError::Tokenizer(e.to_string()))?;
        // vLLM passes truncation per call; a stored default would change ids.
        tokenizer
            .with_truncation(None)
            .map_err(|e| ModelLoadError::Tokenizer(e.to_string()))?;
        tokenizer.with_padding(None);

        let config = read_json(&dir.join("tokenizer_config.json"))?;
        // transformers sets its backend's `encode_special_tokens` from the
        // config's `split_special_tokens` (whatever the tokenizer class):
        // special tokens written in the text are then encoded as text.
        if config
            .as_ref()
            .and_then(|c| c.get("split_special_tokens"))
            .and_then(serde_json::Value::as_bool)
            == Some(true)
        {
            tokenizer.set_encode_special_tokens(true);
        }
        let mut template_src = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(template_from_config_value);
        if let Some(v) = read_json(&dir.join("chat_template.json"))? {
            if let Some(t) = v.get("chat_template").and_then(template_from_config_value) {
                template_src = Some(t);
            }
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let bytes = read(&jinja)?;
            template_src = Some(String::from_utf8_lossy(&bytes).into_owned());
        }
        let mut special = Vec::new();
        if let Some(c) = &config {
            for name in [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ] {
                if let Some(t) = c.get(name).and_then(token_text) {
                    special.push((name.to_owned(), t));
                }
            }
        }
        let bos_token_id = special
            .iter()
            .find(|(name, _)| name == "bos_token")
            .and_then(|(_, text)| tokenizer.token_to_id(text));
        let template = template_src.map(|src| {
            ChatTemplate::new(&src, special).map(|t| match options.content_format {
                Some(format) => t.with_content_format(format),
                None => t,
            })
        });
        // 0 would refuse every prompt: read as not given.
        let max_model_len = options.max_model_len.filter(|m| *m > 0).or_else(|| {
            read_json(&dir.join("config.json"))
                .ok()
                .flatten()
                .and_then(|c| c.get("max_position_embeddings")?.as_u64())
                .map(|n| n as usize)
        });
        let post_processor_adds_tokens = tokenizer
            .get_post_processor()
            .is_some_and(|p| tokenizers::PostProcessor::added_tokens(p, false) > 0);
        let added_special = if post_processor_adds_tokens {
            added_special_tokens(&tokenizer)
        } else {
            (0, 0)
        };
        let segments = if options.span_cache_bytes > 0 {
            SegmentPolicy::from_tokenizer(
                &tokenizer,
                &["<|im_start|>", "<start_of_turn>", "<|start_header_id|>"],
            )
        } else {
            None
        };
        let cache = segments
            .as_ref()
            .map(|_| SpanCache::new(options.span_cache_bytes));
        let vocab_size = tokenizer.get_vocab_size(true);
        let seams = SeamPolicy::for_tokenizer(&tokenizer);
        let nfc_free = without_nfc(&tokenizer);
        let fast = ByteBpe::for_tokenizer(&tokenizer, DEFAULT_WORD_CACHE_BYTES);
        Ok(Self {
            fast,
            seams,
            nfc_free,
            parallel: None,
            tokenizer,
            template,
            max_model_len,
            vocab_size,
            post_processor_adds_tokens,
            added_special,
            bos_token_id,
            segments,
            cache,
        })
    }

    /// The chat template, if the model has one (or why it does not compile).
    pub fn chat_template(&self) -> Result<&ChatTemplate, PromptError> {
        match &self.template {
            Some(Ok(t)) => Ok(t),
            Some(Err(e)) => Err(PromptError::Template(e.clone())),
            None => Err(PromptError::NoChatTemplate),
        }
    }

    /// How many special tokens encoding a text with `add_special_tokens`
    /// adds before and after the text's own tokens (Llama 3's BOS: `(1, 0)`).
    #[must_use]
    pub fn added_special_tokens(&self) -> (usize, usize) {
        self.added_special
    }

    /// The id of the configuration's `bos_token`, if it names a token.
    #[must_use]
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The engine's maximum prompt length, if known.
    #[must_use]
    pub fn max_model_len(&self) -> Option<usize> {
        self.max_model_len
    }

    /// Vocabulary size including added tokens (token ids must be below it).
    #[must_use]
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The underlying `tokenizers` tokenizer.
    #[must_use]
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Span-cache counters (`None` when caching is off for this tokenizer).
    #[must_use]
    pub fn span_cache_stats(&self) -> Option<SpanCacheStats> {
        self.cache.as_ref().map(SpanCache::stats)
    }

    /// Counters of the pre-token cache of the fast byte-level BPE path;
    /// `None` when this tokenizer's pipeline is not one that path is proven
    /// exact for (then every encode runs `tokenizers`' own pipeline).
    #[must_use]
    pub fn pre_token_cache_stats(&self) -> Option<PreTokenCacheStats> {
        self.fast.as_ref().map(ByteBpe::cache_stats)
    }

    /// Full tokenization without the span cache (the reference).
    pub fn encode_uncached(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, PromptError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| PromptError::Tokenize(e.to_string()))
    }

    /// Token ids of `text`, using the span cache when it is provably exact
    /// for this tokenizer ([`SpanCacheStats`]; checked at load, off
    /// otherwise), and the parallel encoder attached with
    /// [`Self::set_parallel`] if any (the same ids).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        match &self.parallel {
            Some(encoder) => self.encode_parallel(text, add_special_tokens, encoder),
            None => self.encode_cached(text, add_special_tokens),
        }
    }

    /// Attaches (or with `None` detaches) a parallel encoder used by
    /// [`Self::encode`] for long texts.
    pub fn set_parallel(&mut self, encoder: Option<Arc<ParallelEncoder>>) {
        self.parallel = encoder;
    }

    fn encode_cached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        let (Some(policy), Some(cache)) = (&self.segments, &self.cache) else {
            return self.encode_piece(text, add_special_tokens);
        };
        if add_special_tokens && self.post_processor_adds_tokens {
            return self.encode_piece(text, add_special_tokens);
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        for seg in policy.segments(text) {
            let part = cache.get_or_insert(seg, |s| self.encode_piece(s, false))?;
            ids.extend_from_slice(&part);
        }
        Ok(ids)
    }

    /// The tokenizer to encode `text` with: the NFC-free twin when NFC would
    /// leave `text` unchanged, the tokenizer itself otherwise. Same ids.
    fn tokenizer_for(&self, text: &str) -> &Tokenizer {
        nfc_free_for(self.nfc_free.as_ref(), text).unwrap_or(&self.tokenizer)
    }

    /// [`Self::encode_uncached`]'s ids: through the fast byte-level BPE
    /// path where it is exact for `text` (the pipeline is one it supports,
    /// the normalizer leaves `text` as it is and the post-processor adds
    /// nothing), else on [`Self::tokenizer_for`].
    fn encode_piece(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        if let Some(fast) = &self.fast {
            if (!add_special_tokens || !self.post_processor_adds_tokens)
                && normalizer_keeps(&self.tokenizer, self.nfc_free.is_some(), text)
            {
                let mut ids = Vec::with_capacity(text.len() / 3);
                fast.encode_into(self.tokenizer.get_model(), text, &mut ids)?;
                return Ok(ids);
            }
        }
        self.tokenizer_for(text)
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| PromptError::Tokenize(e.to_string()))
    }
}

/// True when `tokenizer`'s normalizer leaves `text` (and each of its
/// substrings) as it is: there is none, or it is NFC (`nfc`) and `text`
/// passes the NFC quick check (see [`nfc_free_for`]).
fn normalizer_keeps(tokenizer: &Tokenizer, nfc: bool, text: &str) -> bool {
    if tokenizer.get_normalizer().is_none() {
        return true;
    }
    nfc && (text.is_ascii()
        || unicode_normalization_alignments::is_nfc_quick(text.chars())
            == unicode_normalization_alignments::IsNormalized::Yes)
}

/// A copy of `tokenizer` without its normalizer when that normalizer is
/// exactly NFC (Qwen2/Qwen3 and others); `None` otherwise.
fn without_nfc(tokenizer: &Tokenizer) -> Option<Tokenizer> {
    let n = tokenizer.get_normalizer()?;
    let nfc = serde_json::to_value(n)
        .ok()
        .is_some_and(|v| v.get("type").and_then(|t| t.as_str()) == Some("NFC"));
    if !nfc {
        return None;
    }
    let mut twin = tokenizer.clone();
    twin.with_normalizer(None::<tokenizers::NormalizerWrapper>);
    Some(twin)
}

/// `twin` (a tokenizer without its NFC normalizer, from [`without_nfc`]) when
/// NFC is the identity on `text` and on every substring of it, so that the
/// normalizer the twin lacks would have changed nothing.
///
/// Why that holds when the NFC quick check of `text` answers *yes*: *yes*
/// means the text is in NFC, and NFC of a normalized text is the text. The
/// tokenizer normalizes substrings (the parts between added tokens, our
/// pieces), and *yes* for a text is *yes* for each of its substrings: the
/// check looks at each character's own properties and at the combining
/// class of the character before it, which a substring keeps or (at its
/// start) resets to that of a starter, the most permissive case. The
/// normalized added-token matches see the same string either way. The check
/// and the tokenizer's NFC use the same Unicode tables (the same crate).
/// Text without a non-ASCII byte is *yes* at once.
fn nfc_free_for<'t>(twin: Option<&'t Tokenizer>, text: &str) -> Option<&'t Tokenizer> {
    let twin = twin?;
    let yes = text.is_ascii()
        || unicode_normalization_alignments::is_nfc_quick(text.chars())
            == unicode_normalization_alignments::IsNormalized::Yes;
    yes.then_some(twin)
}

impl ModelTokenizer {
    /// [`Self::encode`] with the long pieces tokenized on `encoder`'s worker
    /// pool ([`ParallelEncoder`]): the same ids, split at seams the tokenizer
    /// provably cannot merge across. Span-cache segments are still looked up
    /// first; a segment that misses and is longer than the encoder's
    /// threshold is encoded in parallel, shorter ones on the caller's thread.
    /// Tokenizers the seam rule is not proven for encode as [`Self::encode`].
    pub fn encode_parallel(
        &self,
        text: &str,
        add_special_tokens: bool,
        encoder: &ParallelEncoder,
    ) -> Result<Vec<u32>, PromptError> {
        if add_special_tokens && self.post_processor_adds_tokens {
            return self.encode_piece(text, add_special_tokens);
        }
        let Some(seams) = &self.seams else {
            return self.encode_cached(text, add_special_tokens);
        };
        let piece = |t: &str| self.encode_piece(t, false);
        let (Some(policy), Some(cache)) = (&self.segments, &self.cache) else {
            return encoder.encode_with(&piece, Some(seams), text);
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        for seg in policy.segments(text) {
            let part = cache.get_or_insert(seg, |s| encoder.encode_with(&piece, Some(seams), s))?;
            ids.extend_from_slice(&part);
        }
        Ok(ids)
    }

    /// [`Self::encode`] that hands the ids to `sink` in order, in parts, as
    /// they are ready: span-cache hits at once, a long segment that misses
    /// piece by piece from the attached parallel encoder while its later
    /// pieces still encode ([`ParallelEncoder::encode_each`]). The parts
    /// concatenate to `encode`'s ids. Without a parallel encoder (or for a
    /// tokenizer without seams) the parts are the span-cache segments.
    pub fn encode_each<E, F>(
        &self,
        text: &str,
        add_special_tokens: bool,
        mut sink: F,
    ) -> Result<(), E>
    where
        E: From<PromptError>,
        F: FnMut(&[u32]) -> Result<(), E>,
    {
        let whole = add_special_tokens && self.post_processor_adds_tokens;
        let split = self.parallel.as_deref().zip(self.seams.as_ref());
        let piece = |t: &str| self.encode_piece(t, false);
        let (Some(policy), Some(cache), false) = (&self.segments, &self.cache, whole) else {
            return match split {
                Some((encoder, seams)) if !whole => {
                    encoder.encode_each_with(&piece, Some(seams), text, sink)
                }
                _ => sink(&self.encode(text, add_special_tokens)?),
            };
        };
        for seg in policy.segments(text) {
            let mut streamed = false;
            let mut failed = None;
            let ids = cache.get_or_insert(seg, |s| {
                let Some((encoder, seams)) = split else {
                    return self.encode_piece(s, false);
                };
                let mut all = Vec::new();
                streamed = true;
                let r = encoder.encode_each_with(&piece, Some(seams), s, |part| {
                    all.extend_from_slice(part);
                    sink(part)
                });
                match r {
                    Ok(()) => Ok(all),
                    Err(e) => {
                        failed = Some(e);
                        Err(PromptError::Tokenize("stopped by the caller".into()))
                    }
                }
            });
            if let Some(e) = failed {
                return Err(e);
            }
            let ids = ids?;
            if !streamed {
                sink(&ids)?;
            }
        }
        Ok(())
    }

    /// Empties the span cache (benchmarks of fresh prompts; a no-op when
    /// caching is off).
    pub fn clear_span_cache(&self) {
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// Empties the pre-token cache of the fast byte-level BPE path
    /// (benchmarks of text no request has sent before; a no-op for
    /// tokenizers that path does not cover).
    pub fn clear_pre_token_cache(&self) {
        if let Some(fast) = &self.fast {
            fast.clear_cache();
        }
    }

    /// True when this tokenizer's pipeline admits seams
    /// ([`super::parallel::SeamPolicy`]), i.e. [`Self::encode_parallel`]
    /// can use more than one thread.
    #[must_use]
    pub fn splits_in_parallel(&self) -> bool {
        self.seams.is_some()
    }
}

/// Tokenizers keyed by model slug: staged directories registered up front,
/// loaded on first use, shared across threads, reloadable on demand.
///
/// ```no_run
/// use kvroute_engines::prompt::{ApiKind, TokenizerPool};
/// let pool = TokenizerPool::new();
/// pool.register("Qwen/Qwen3-8B", "/models/qwen3");
/// let body = br#"{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]}"#;
/// let out = pool.prompt_tokens(ApiKind::Chat, body).unwrap();
/// assert!(!out.engine_prompts[0].token_ids.is_empty());
/// ```
#[derive(Default)]
pub struct TokenizerPool {
    staged: RwLock<HashMap<String, (PathBuf, ModelOptions)>>,
    /// Models served with another model's tokenizer (a LoRA adapter's name
    /// → its base model).
    aliases: RwLock<HashMap<String, String>>,
    loaded: RwLock<HashMap<String, Result<Arc<ModelTokenizer>, String>>>,
    load_lock: Mutex<()>,
    parallel: RwLock<Option<Arc<ParallelEncoder>>>,
}

impl std::fmt::Debug for TokenizerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerPool")
            .field("staged", &self.staged.read().keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl TokenizerPool {
    /// An empty pool.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Stages `dir` for `model` with default options (replaces any earlier
    /// staging and drops a loaded copy).
    pub fn register(&self, model: impl Into<String>, dir: impl Into<PathBuf>) {
        self.register_with(model, dir, ModelOptions::default());
    }

    /// Stages `dir` for `model` with explicit options.
    pub fn register_with(
        &self,
        model: impl Into<String>,
        dir: impl Into<PathBuf>,
        options: ModelOptions,
    ) {
        let model = model.into();
        self.loaded.write().remove(&model);
        self.staged.write().insert(model, (dir.into(), options));
    }

    /// Tokenizes long prompts of every model on `encoder` (`None`: one
    /// thread each). Loaded copies are dropped so the next use loads with
    /// it.
    pub fn set_parallel(&self, encoder: Option<Arc<ParallelEncoder>>) {
        *self.parallel.write() = encoder;
        self.loaded.write().clear();
    }

    /// Serves `model` with `base`'s tokenizer (one load shared by both):
    /// a LoRA adapter requested by its own name tokenizes as its base model.
    /// A model staged under its own name keeps its own tokenizer.
    ///
    /// ```
    /// use kvroute_engines::prompt::TokenizerPool;
    /// let pool = TokenizerPool::new();
    /// pool.register("qwen3", concat!(env!("CARGO_MANIFEST_DIR"), "/../golden/tokenizers/qwen3"));
    /// pool.alias("sql-lora", "qwen3");
    /// assert!(std::sync::Arc::ptr_eq(&pool.get("sql-lora")?, &pool.get("qwen3")?));
    /// assert!(pool.get("other").is_err());
    /// # Ok::<(), kvroute_engines::prompt::PromptError>(())
    /// ```
    pub fn alias(&self, model: impl Into<String>, base: impl Into<String>) {
        self.aliases.write().insert(model.into(), base.into());
    }

    /// Forgets a model (and its alias, if it is one).
    pub fn unregister(&self, model: &str) {
        self.staged.write().remove(model);
        self.aliases.write().remove(model);
        self.loaded.write().remove(model);
    }

    /// Drops the loaded copy so the next use reads the directory again.
    pub fn reload(&self, model: &str) {
        self.loaded.write().remove(model);
    }

    /// Model slugs that are staged.
    #[must_use]
    pub fn models(&self) -> Vec<String> {
        self.staged.read().keys().cloned().collect()
    }

    /// The loaded tokenizer for `model`, loading it on first use. A failed load
    /// is remembered (no retry storm) until [`reload`](Self::reload).
    pub fn get(&self, model: &str) -> Result<Arc<ModelTokenizer>, PromptError> {
        if !self.staged.read().contains_key(model) {
            if let Some(base) = self.aliases.read().get(model).cloned() {
                return self.load(&base);
            }
        }
        self.load(model)
    }

    fn load(&self, model: &str) -> Result<Arc<ModelTokenizer>, PromptError> {
        if let Some(r) = self.loaded.read().get(model) {
            return Self::result(model, r);
        }
        let _serialise_loads = self.load_lock.lock();
        if let Some(r) = self.loaded.read().get(model) {
            return Self::result(model, r);
        }
        let Some((dir, options)) = self.staged.read().get(model).cloned() else {
            return Err(PromptError::UnknownModel(model.to_owned()));
        };
        let loaded = match ModelTokenizer::load(&dir, &options) {
            Ok(mut t) => {
                t.set_parallel(self.parallel.read().clone());
                tracing::info!(model, dir = %dir.display(), "tokenizer loaded");
                Ok(Arc::new(t))
            }
            Err(e) => {
                tracing::warn!(model, dir = %dir.display(), error = %e, "tokenizer failed to load");
                Err(e.to_string())
            }
        };
        let out = Self::result(model, &loaded);
        self.loaded.write().insert(model.to_owned(), loaded);
        out
    }

    fn result(
        model: &str,
        r: &Result<Arc<ModelTokenizer>, String>,
    ) -> Result<Arc<ModelTokenizer>, PromptError> {
        r.clone().map_err(|reason| PromptError::ModelLoad {
            model: model.to_owned(),
            reason,
        })
    }
}

/// Where the post-processor puts its special tokens around a single
/// sequence: a probe text encoded with and without them, the text's own ids
/// found inside the first.
fn added_special_tokens(tokenizer: &Tokenizer) -> (usize, usize) {
    let probe = "kvroute probe";
    let ids = |special: bool| {
        tokenizer
            .encode_fast(probe, special)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let (with, without) = (ids(true), ids(false));
    if without.is_empty() || with.len() < without.len() {
        return (0, 0);
    }
    match with
        .windows(without.len())
        .position(|w| w == without.as_slice())
    {
        Some(front) => (front, with.len() - front - without.len()),
        None => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    fn qwen3() -> &'static ModelTokenizer {
        static T: OnceLock<ModelTokenizer> = OnceLock::new();
        T.get_or_init(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
            ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap()
        })
    }

    /// `encode_fast` with the tokenizer as loaded (its NFC normalizer on).
    fn reference(text: &str) -> Vec<u32> {
        qwen3().encode_uncached(text, false).unwrap()
    }

    /// Texts NFC changes (decomposed accents, singletons such as the
    /// Ångström and Ohm signs, CJK compatibility ideographs, Hangul jamo,
    /// combining marks out of canonical order) and texts it keeps.
    const FRAGMENTS: &[&str] = &[
        "e\u{301}",
        "\u{212B}",
        "\u{2126}",
        "\u{F900}",
        "\u{1100}\u{1161}",
        "a\u{301}\u{323}",
        "a\u{323}\u{301}",
        "\u{301}",
        "é",
        "Å",
        "한국어",
        "漢字",
        "😀",
        "—",
        "’",
        "Straße",
        "cafe",
        " ",
        "  ",
        "\n",
        "42",
        "<|im_start|>",
        "don't",
        "x",
    ];

    /// The twin is used exactly when the quick check says yes, and it is
    /// needed: on a text NFC changes, the twin alone gives other ids.
    #[test]
    fn the_nfc_free_twin_is_used_only_where_nfc_changes_nothing() {
        let tok = qwen3();
        let twin = tok.nfc_free.as_ref().expect("Qwen3 normalizes with NFC");
        for text in ["plain ASCII text", "café — naïve ’quotes’ 漢字 😀"] {
            assert!(std::ptr::eq(tok.tokenizer_for(text), twin), "{text:?}");
        }
        for text in ["e\u{301}", "\u{212B}ngstr\u{F6}m", "\u{F900}"] {
            assert!(
                std::ptr::eq(tok.tokenizer_for(text), &tok.tokenizer),
                "{text:?}"
            );
            let twin_ids = twin.encode_fast(text, false).unwrap().get_ids().to_vec();
            assert_ne!(twin_ids, reference(text), "{text:?}: NFC should matter");
            assert_eq!(tok.encode_piece(text, false).unwrap(), reference(text));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every path that may take the twin (span-cached segments, the
        /// parallel encoder, the pipelined parts) gives the ids of the
        /// tokenizer as loaded.
        #[test]
        fn ids_equal_the_normalizing_tokenizer(
            picks in proptest::collection::vec(any::<usize>(), 0..120),
        ) {
            let text: String = picks
                .iter()
                .map(|p| FRAGMENTS[p % FRAGMENTS.len()])
                .collect::<Vec<_>>()
                .join(" and ");
            let tok = qwen3();
            let want = reference(&text);
            tok.clear_span_cache();
            prop_assert_eq!(tok.encode(&text, false).unwrap(), want.clone());
            let enc = ParallelEncoder::new(super::super::ParallelConfig {
                threads: 2,
                min_bytes: 0,
                pieces_per_thread: 3,
                window_bytes: 16,
            })
            .unwrap();
            tok.clear_span_cache();
            prop_assert_eq!(tok.encode_parallel(&text, false, &enc).unwrap(), want);
        }
    }
}
