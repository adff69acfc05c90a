//! Body → the prompt selection needs (on the blocking pool, within limits),
//! and "tokenize once": forwarding the token ids kvroute computed as the
//! engine's `prompt`, so the engine does not tokenize the text again.
//!
//! ## Token-id forwarding
//!
//! Opt-in ([`crate::KvRouterBuilder::forward_token_ids`]; the gateway's rule
//! key `forward_token_ids`). For a `/v1/completions` request whose `prompt` is
//! one string, [`crate::Pick::upstream_body`] returns the body with `prompt`
//! replaced by the ids as a JSON list, every other byte as the client sent it
//! ([`with_token_ids`]), composed with the `stream_options.include_usage`
//! rewrite. Everything else goes as text, counted by [`KeepText`] reason.
//!
//! What the engines do with an id prompt (read in their sources):
//!
//! * **vLLM 0.33** (`entrypoints/openai/completion/protocol.py`,
//!   `renderers/base.py`, `renderers/params.py`): `CompletionRequest.prompt`
//!   is `list[int >= 0] | list[list[int]] | str | list[str]`. A string is
//!   tokenized as `tokenizer(prompt, add_special_tokens=…)` (default `true`:
//!   the BOS, if the tokenizer adds one, is in the ids kvroute computes the
//!   same way); a token list becomes `prompt_token_ids` verbatim — no
//!   tokenization, so no second BOS — and only truncation and the
//!   `max_model_len` check run on it, as on the tokenized text. Differences,
//!   all kept as text: `echo` (the echoed prompt is the ids decoded back,
//!   `tokenizer.decode`, not the client's string), `suffix` (fill-in-the-middle
//!   rendering needs text), `truncate_prompt_tokens` (the ids must be the whole
//!   prompt), `return_token_offsets` (offsets exist for text input only).
//!   `prompt_logprobs`, `logprobs`, `return_token_ids`, `usage` and
//!   `cached_tokens` are the same for the same ids. `add_special_tokens` is
//!   ignored for an id prompt, which is right: it already shaped the ids.
//! * **SGLang 0.5** (`entrypoints/openai/serving_completions.py`): a list of
//!   ints becomes `GenerateReqInput(input_ids=…)`, a string `text=…`
//!   tokenized by the tokenizer manager. `echo` decodes id prompts with
//!   `skip_special_tokens=True` (kept as text); an explicit
//!   `add_special_tokens` is not an SGLang completions field (kept as text).
//!   A server started with `--completion-template` rewrites string prompts
//!   for FIM: do not turn forwarding on for such a server.
//! * **TensorRT-LLM** and llama.cpp: not forwarded ([`KeepText::Engine`]);
//!   their id-prompt paths were not verified.
//! * Chat requests are never rewritten: the chat endpoints take `messages`.
//!
//! The forwarded ids are what kvroute routed on, so the engine prefills
//! exactly the blocks the decision predicted.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kvroute_core::RequestExtras;
use kvroute_engines::prompt::pyvalue::PyValue;
use kvroute_engines::prompt::{self, pyvalue, request, PromptLimits, PromptMiss, TokenizerPool};
use kvroute_engines::transport::EngineKind;
use kvroute_engines::ApiKind;
use kvroute_select::MissBeforeKeys;

/// The selection-side miss of a prompt-pipeline miss.
///
/// `PromptMiss` (kvroute-engines) and [`MissBeforeKeys`] (kvroute-select)
/// live in crates that may not depend on each other, so Rust's orphan rule
/// leaves no crate where a `From` impl could be written except this one's
/// function; `MissBeforeKeys` then converts with `From` into the counted
/// [`kvroute_select::MissReason`].
///
/// ```
/// use kvroute::miss_before_keys;
/// use kvroute_engines::prompt::PromptMiss;
/// use kvroute_select::{MissBeforeKeys, MissReason};
/// let m = miss_before_keys(&PromptMiss::UnknownModel("x".into()));
/// assert_eq!(m, MissBeforeKeys::NoTokenizer);
/// assert_eq!(MissReason::from(m), MissReason::NoTokenizer);
/// assert_eq!(miss_before_keys(&PromptMiss::RequestRule("tools: []".into())), MissBeforeKeys::InvalidRequest);
/// ```
#[must_use]
pub fn miss_before_keys(m: &PromptMiss) -> MissBeforeKeys {
    match m {
        PromptMiss::NotJson(_) => MissBeforeKeys::NotJson,
        PromptMiss::NoModel => MissBeforeKeys::NoModel,
        PromptMiss::UnknownModel(_) | PromptMiss::ModelLoad { .. } => MissBeforeKeys::NoTokenizer,
        PromptMiss::PromptTooLong { .. } => MissBeforeKeys::PromptTooLong,
        m if m.is_request_error() => MissBeforeKeys::InvalidRequest,
        _ => MissBeforeKeys::TokenizeError,
    }
}

/// What one request body gave, owned (it outlives the blocking task).
#[derive(Debug, Clone)]
pub(crate) struct Prompt {
    pub(crate) model: Option<String>,
    pub(crate) tokens: Result<Vec<u32>, MissBeforeKeys>,
    pub(crate) text: Option<String>,
    pub(crate) extras: RequestExtras,
    /// The body to forward when it differs from the client's
    /// ([`crate::receipt::include_usage`]).
    pub(crate) rewritten: Option<Bytes>,
    /// The same with `prompt` as ids, per target engine (`None`: forwarding
    /// is off).
    pub(crate) ids: Option<IdsBody>,
}

impl Prompt {
    pub(crate) fn missed(model: Option<String>, miss: MissBeforeKeys) -> Self {
        Self {
            model,
            tokens: Err(miss),
            text: None,
            extras: RequestExtras::NONE,
            rewritten: None,
            ids: None,
        }
    }
}

/// Limits one request's prompt work obeys.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) prompt: PromptLimits,
    pub(crate) max_prompt_tokens: usize,
    pub(crate) include_usage: bool,
    /// Whose request validators apply (the endpoints' engine).
    pub(crate) dialect: request::Dialect,
    /// [`crate::KvRouterBuilder::forward_token_ids`].
    pub(crate) forward_token_ids: bool,
}

/// What a request refused tokenization by the admission still gets: its
/// model and the usage rewrite, and a `tokenize_overloaded` miss (CPU work
/// about the body's size: run it on the blocking pool).
pub(crate) fn unadmitted(body: &[u8], limits: Limits) -> Prompt {
    let model = pyvalue::parse_json(body)
        .ok()
        .and_then(|v| request::model_of(&v).map(str::to_owned));
    let mut out = Prompt::missed(model, MissBeforeKeys::TokenizeOverloaded);
    if limits.include_usage {
        out.rewritten = crate::receipt::include_usage(body).map(Bytes::from);
    }
    if limits.forward_token_ids {
        out.ids = Some(IdsBody::text(KeepText::NoTokens));
    }
    out
}

/// Parses and tokenizes `body` (CPU work: run it on the blocking pool).
/// Never fails: every problem is a typed miss.
pub(crate) fn tokenize(pool: &TokenizerPool, api: ApiKind, body: &[u8], limits: Limits) -> Prompt {
    let rewritten = if limits.include_usage {
        crate::receipt::include_usage(body).map(Bytes::from)
    } else {
        None
    };
    let no_ids = |mut p: Prompt| {
        if limits.forward_token_ids {
            let why = if api == ApiKind::Chat {
                KeepText::Chat
            } else {
                KeepText::NoTokens
            };
            p.ids = Some(IdsBody::text(why));
        }
        p
    };
    let value = match pyvalue::parse_json(body) {
        Ok(v) => v,
        Err(_) => return no_ids(Prompt::missed(None, MissBeforeKeys::NotJson)),
    };
    let model = request::model_of(&value).map(str::to_owned);
    let Some(m) = &model else {
        return no_ids(Prompt::missed(None, MissBeforeKeys::NoModel));
    };
    let tokens = pool
        .get(m)
        .and_then(|tok| prompt::prompt_tokens_as(&tok, api, &value, limits.prompt, limits.dialect));
    let mut truncated = false;
    let mut out = match tokens {
        Ok(p) => {
            truncated = p.truncated;
            let cache_salt = p.cache_salt;
            let first = p.engine_prompts.into_iter().next();
            let (ids, text) = first.map_or((Vec::new(), None), |e| (e.token_ids, e.rendered));
            let tokens = if ids.is_empty() {
                Err(MissBeforeKeys::EmptyPrompt)
            } else if ids.len() > limits.max_prompt_tokens {
                Err(MissBeforeKeys::PromptTooLong)
            } else {
                Ok(ids)
            };
            Prompt {
                model,
                tokens,
                text,
                extras: RequestExtras {
                    cache_salt,
                    ..RequestExtras::NONE
                },
                rewritten: None,
                ids: None,
            }
        }
        Err(e) => {
            tracing::debug!(kind = e.kind(), "no prompt tokens");
            Prompt::missed(model, miss_before_keys(&e))
        }
    };
    if limits.forward_token_ids {
        let base = rewritten.as_deref().unwrap_or(body);
        let ids = out.tokens.as_deref().ok();
        out.ids = Some(IdsBody::prepare(api, base, &value, ids, truncated));
    }
    out.rewritten = rewritten;
    out
}

// ---------------------------------------------------------------------------
// Token-id forwarding ("tokenize once").

/// Why a `/v1/completions` request went to the engine as text although
/// token-id forwarding was on (the counted reason, see [`TokenIdCounters`]).
///
/// Each reason is a case where sending `prompt` as the ids kvroute computed
/// would not be provably the same request to the engine (see the
/// [module documentation](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeepText {
    /// A chat request: the engines' chat endpoints take `messages`, not ids.
    Chat,
    /// `prompt` is not one string (already ids, a batch list, embeddings).
    PromptNotText,
    /// `echo`: the engine would echo the ids decoded back to text, which may
    /// differ from the client's string.
    Echo,
    /// `suffix`: vLLM renders fill-in-the-middle from text prompts only.
    Suffix,
    /// `truncate_prompt_tokens`: the forwarded ids must be the whole prompt.
    Truncation,
    /// `return_token_offsets`: vLLM computes character offsets for text input only.
    TokenOffsets,
    /// SGLang with an explicit `add_special_tokens`: not one of SGLang's
    /// completions fields, so kvroute's ids may not be what it would encode.
    AddSpecialTokens,
    /// The target engine is not known to treat an id prompt exactly as its
    /// tokenization of the text (TensorRT-LLM, llama.cpp).
    Engine,
    /// No exact ids: the prompt pipeline missed (no tokenizer, overloaded,
    /// over `max_prompt_tokens`, invalid request, ...).
    NoTokens,
    /// The body could not be rewritten keeping every other byte (not strict
    /// JSON, e.g. `NaN`, or `prompt` given twice).
    Rewrite,
    /// A prefill/decode two-step: a host that builds the two legs' bodies
    /// from the client's (the example gateway) sends both as text.
    PrefillDecode,
}

impl KeepText {
    /// Every reason, in [`KeepText::index`] order.
    pub const ALL: [KeepText; 11] = [
        KeepText::Chat,
        KeepText::PromptNotText,
        KeepText::Echo,
        KeepText::Suffix,
        KeepText::Truncation,
        KeepText::TokenOffsets,
        KeepText::AddSpecialTokens,
        KeepText::Engine,
        KeepText::NoTokens,
        KeepText::Rewrite,
        KeepText::PrefillDecode,
    ];

    /// The metrics label.
    ///
    /// ```
    /// use kvroute::prompt::KeepText;
    /// assert_eq!(KeepText::Echo.as_str(), "echo");
    /// assert!(KeepText::ALL.iter().enumerate().all(|(i, k)| k.index() == i));
    /// ```
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::PromptNotText => "prompt_not_text",
            Self::Echo => "echo",
            Self::Suffix => "suffix",
            Self::Truncation => "truncate_prompt_tokens",
            Self::TokenOffsets => "return_token_offsets",
            Self::AddSpecialTokens => "add_special_tokens",
            Self::Engine => "engine",
            Self::NoTokens => "no_tokens",
            Self::Rewrite => "rewrite",
            Self::PrefillDecode => "prefill_decode",
        }
    }

    /// Position in [`KeepText::ALL`].
    #[must_use]
    pub fn index(self) -> usize {
        match self {
            Self::Chat => 0,
            Self::PromptNotText => 1,
            Self::Echo => 2,
            Self::Suffix => 3,
            Self::Truncation => 4,
            Self::TokenOffsets => 5,
            Self::AddSpecialTokens => 6,
            Self::Engine => 7,
            Self::NoTokens => 8,
            Self::Rewrite => 9,
            Self::PrefillDecode => 10,
        }
    }
}

impl std::fmt::Display for KeepText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether `engine` runs a completions `prompt` of token ids exactly as its
/// own tokenization of the text, given the request's other fields (`body`,
/// parsed as the engine parses it). `Ok(())` only when provably so; the
/// ids themselves must also be the whole, untruncated prompt (the caller's
/// part, [`IdsBody::prepare`]).
///
/// ```
/// use kvroute::prompt::{token_ids_equivalent, KeepText};
/// use kvroute_engines::{prompt::pyvalue::parse_json, transport::EngineKind, ApiKind};
/// let plain = parse_json(br#"{"model": "m", "prompt": "hi", "max_tokens": 4}"#).unwrap();
/// assert_eq!(token_ids_equivalent(ApiKind::Completions, EngineKind::Vllm, &plain), Ok(()));
/// let echo = parse_json(br#"{"model": "m", "prompt": "hi", "echo": true}"#).unwrap();
/// assert_eq!(token_ids_equivalent(ApiKind::Completions, EngineKind::Vllm, &echo), Err(KeepText::Echo));
/// assert_eq!(token_ids_equivalent(ApiKind::Chat, EngineKind::Vllm, &plain), Err(KeepText::Chat));
/// assert_eq!(token_ids_equivalent(ApiKind::Completions, EngineKind::TensorRtLlm, &plain), Err(KeepText::Engine));
/// ```
pub fn token_ids_equivalent(
    api: ApiKind,
    engine: EngineKind,
    body: &PyValue,
) -> Result<(), KeepText> {
    if api == ApiKind::Chat {
        return Err(KeepText::Chat);
    }
    if !matches!(engine, EngineKind::Vllm | EngineKind::Sglang) {
        return Err(KeepText::Engine);
    }
    let Some(d) = body.as_dict() else {
        return Err(KeepText::PromptNotText);
    };
    // A field the engine reads as "off" when null/false/absent; anything
    // else (including a value of the wrong type, which the engine refuses
    // for text and ids alike) keeps the text.
    let set = |name: &str| {
        d.get(name)
            .is_some_and(|v| !matches!(v, PyValue::Null | PyValue::Bool(false)))
    };
    if !matches!(d.get("prompt"), Some(PyValue::Str(s)) if !s.is_empty()) || set("prompt_embeds") {
        return Err(KeepText::PromptNotText);
    }
    if set("echo") {
        return Err(KeepText::Echo);
    }
    if d.get("suffix").is_some_and(|v| !v.is_null()) {
        return Err(KeepText::Suffix);
    }
    if d.get("truncate_prompt_tokens")
        .is_some_and(|v| !v.is_null())
    {
        return Err(KeepText::Truncation);
    }
    if engine == EngineKind::Vllm && set("return_token_offsets") {
        return Err(KeepText::TokenOffsets);
    }
    if engine == EngineKind::Sglang && d.get("add_special_tokens").is_some_and(|v| !v.is_null()) {
        return Err(KeepText::AddSpecialTokens);
    }
    Ok(())
}

/// `body` (a JSON object) with the value of its top-level `prompt` replaced
/// by `ids` as a JSON list, every other byte kept as it was; `None` when the
/// body is not strict JSON (e.g. `NaN`), not an object, has no `prompt` or
/// has it twice (parsers disagree on which one counts).
///
/// ```
/// use kvroute::prompt::with_token_ids;
/// let body = br#"{"model": "m", "prompt": "Hello world", "max_tokens": 1.50}"#;
/// let out = with_token_ids(body, &[9707, 1879]).unwrap();
/// assert_eq!(out, br#"{"model": "m", "prompt": [9707,1879], "max_tokens": 1.50}"#.to_vec());
/// assert_eq!(with_token_ids(br#"{"prompt": "a", "prompt": "b"}"#, &[1]), None);
/// assert_eq!(with_token_ids(br#"{"model": "m"}"#, &[1]), None);
/// ```
#[must_use]
pub fn with_token_ids(body: &[u8], ids: &[u32]) -> Option<Vec<u8>> {
    let (start, end) = prompt_span(body)?;
    let mut out = Vec::with_capacity(body.len() - (end - start) + ids.len() * 7 + 2);
    out.extend_from_slice(&body[..start]);
    out.push(b'[');
    let mut digits = itoa::Buffer::new();
    for (i, &id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(digits.format(id).as_bytes());
    }
    out.push(b']');
    out.extend_from_slice(&body[end..]);
    Some(out)
}

/// Byte range of the top-level `prompt` value in `body`.
fn prompt_span(body: &[u8]) -> Option<(usize, usize)> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
    use serde_json::value::RawValue;

    /// The top-level object's `prompt` value, borrowed from the input.
    struct Find;
    impl<'de> Visitor<'de> for Find {
        type Value = Option<&'de RawValue>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found: Option<&'de RawValue> = None;
            let mut twice = false;
            // Keys are decoded (a `\u0070rompt` key is `prompt` to the engine too).
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                let value: &'de RawValue = map.next_value()?;
                if key == "prompt" {
                    twice |= found.is_some();
                    found = Some(value);
                }
            }
            Ok(if twice { None } else { found })
        }
    }
    impl<'de> DeserializeSeed<'de> for Find {
        type Value = Option<&'de RawValue>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    let mut de = serde_json::Deserializer::from_slice(body);
    let raw = Find.deserialize(&mut de).ok()??;
    de.end().ok()?;
    // The raw value is a slice of `body` itself: its offset is the distance
    // between the two addresses (checked, never assumed).
    let text = raw.get().as_bytes();
    let start = (text.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start.checked_add(text.len())?;
    (body.get(start..end)? == text).then_some((start, end))
}

/// One request's id-prompt body, prepared once with its tokenization and
/// chosen per target engine ([`IdsBody::for_engine`]): retries may land on
/// an engine of another kind.
#[derive(Debug, Clone)]
pub struct IdsBody {
    /// The body with `prompt` as ids, when the ids are the whole prompt and
    /// at least one engine kind may take it.
    body: Option<Bytes>,
    vllm: Result<(), KeepText>,
    sglang: Result<(), KeepText>,
}

impl IdsBody {
    /// Nothing to forward (forwarding off for this request, or no ids): every
    /// engine gets the text, for `why`.
    #[must_use]
    pub fn text(why: KeepText) -> Self {
        Self {
            body: None,
            vllm: Err(why),
            sglang: Err(why),
        }
    }

    /// Prepares the id body of one request: `base` is the body that would be
    /// forwarded otherwise (the client's, or its usage rewrite), `value` the
    /// client's body parsed, `ids` the exact prompt ids kvroute computed
    /// (`None` when the pipeline missed), `truncated` whether
    /// `truncate_prompt_tokens` cut them. CPU work about the body's size: run
    /// it where the tokenization runs.
    ///
    /// ```
    /// use kvroute::prompt::{IdsBody, KeepText};
    /// use kvroute_engines::{prompt::pyvalue::parse_json, transport::EngineKind, ApiKind};
    /// let body = br#"{"model":"m","prompt":"Hello world"}"#;
    /// let value = parse_json(body).unwrap();
    /// let ids = [9707, 1879];
    /// let p = IdsBody::prepare(ApiKind::Completions, body, &value, Some(&ids), false);
    /// assert_eq!(&p.for_engine(EngineKind::Vllm).unwrap()[..], br#"{"model":"m","prompt":[9707,1879]}"#);
    /// assert_eq!(p.for_engine(EngineKind::TensorRtLlm).unwrap_err(), KeepText::Engine);
    /// ```
    #[must_use]
    pub fn prepare(
        api: ApiKind,
        base: &[u8],
        value: &PyValue,
        ids: Option<&[u32]>,
        truncated: bool,
    ) -> Self {
        let vllm = token_ids_equivalent(api, EngineKind::Vllm, value);
        let sglang = token_ids_equivalent(api, EngineKind::Sglang, value);
        let gate = match (ids, truncated) {
            (None, _) => Err(KeepText::NoTokens),
            (Some(_), true) => Err(KeepText::Truncation),
            (Some([]), false) => Err(KeepText::NoTokens),
            (Some(ids), false) => Ok(ids),
        };
        // The request's own reason first (chat, echo, ...): it says more than
        // the pipeline's miss.
        let (vllm, sglang, ids) = match gate {
            Err(g) => (vllm.and(Err(g)), sglang.and(Err(g)), None),
            Ok(ids) => (vllm, sglang, Some(ids)),
        };
        let body = match ids {
            Some(ids) if vllm.is_ok() || sglang.is_ok() => {
                with_token_ids(base, ids).map(Bytes::from)
            }
            _ => None,
        };
        let missing = |r: Result<(), KeepText>| match (&body, r) {
            (None, Ok(())) => Err(KeepText::Rewrite),
            (_, r) => r,
        };
        Self {
            vllm: missing(vllm),
            sglang: missing(sglang),
            body,
        }
    }

    /// The id body for a target of `engine`, or why it gets the text.
    ///
    /// # Errors
    /// The [`KeepText`] reason.
    pub fn for_engine(&self, engine: EngineKind) -> Result<&Bytes, KeepText> {
        let ok = match engine {
            EngineKind::Vllm => self.vllm,
            EngineKind::Sglang => self.sglang,
            _ => Err(KeepText::Engine),
        };
        ok?;
        self.body.as_ref().ok_or(KeepText::Rewrite)
    }
}

/// Requests forwarded with token ids, and the ones kept as text by reason
/// (lock-free; one per router or rule). Count each request once, for its
/// first target.
///
/// ```
/// use kvroute::prompt::{KeepText, TokenIdCounters};
/// let c = TokenIdCounters::default();
/// c.record(Ok(()));
/// c.record(Err(KeepText::Echo));
/// let s = c.snapshot();
/// assert_eq!((s.forwarded, s.kept(KeepText::Echo), s.kept(KeepText::Chat)), (1, 1, 0));
/// ```
#[derive(Debug, Default)]
pub struct TokenIdCounters {
    forwarded: AtomicU64,
    kept: [AtomicU64; KeepText::ALL.len()],
}

impl TokenIdCounters {
    /// Counts one request: forwarded as ids, or kept as text for a reason.
    pub fn record(&self, outcome: Result<(), KeepText>) {
        let c = match outcome {
            Ok(()) => &self.forwarded,
            Err(k) => &self.kept[k.index()],
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    #[must_use]
    pub fn snapshot(&self) -> TokenIdSnapshot {
        TokenIdSnapshot {
            forwarded: self.forwarded.load(Ordering::Relaxed),
            kept: std::array::from_fn(|i| self.kept[i].load(Ordering::Relaxed)),
        }
    }
}

/// [`TokenIdCounters::snapshot`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenIdSnapshot {
    /// Requests whose `prompt` went to the engine as token ids.
    pub forwarded: u64,
    /// Requests kept as text, by [`KeepText::index`].
    pub kept: [u64; KeepText::ALL.len()],
}

impl TokenIdSnapshot {
    /// Requests kept as text for `why`.
    #[must_use]
    pub fn kept(&self, why: KeepText) -> u64 {
        self.kept[why.index()]
    }
}
