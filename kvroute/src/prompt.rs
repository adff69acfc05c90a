//! Body → the prompt selection needs (on the blocking pool, within limits),
//! and "tokenize once": forwarding the token ids kvroute computed as the
//! engine's `prompt`, so the engine does not tokenize the text again.
//!
//! ## The prompt step
//!
//! [`prepare`] is what every host runs per completion request, the facade's
//! [`crate::KvRouter::pick`] and the example gateway alike: parse the body
//! like vLLM, read its `model`, ask the [`PromptHost`] for that model's
//! [`PromptOptions`], render and tokenize within the limits, and — when the
//! options carry the rule's [`ContractKeys`] — hash the prompt's block keys
//! in the same job, each piece's blocks while the next piece still encodes
//! on the parallel tokenizer. The [`PreparedPrompt`] it returns gives
//! selection its [`Request`] (ids, text, extras, keys: selection hashes
//! nothing again, and decides exactly as from the ids), and the body to
//! forward (`stream_options.include_usage` added, the id prompt).
//! [`prepare_admitted`] runs it on the blocking pool behind the
//! [`crate::admission`] bound; [`unadmitted`] is what a refused request gets.
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
use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::{BlockKey, RequestExtras};
use kvroute_engines::engine::Engine;
use kvroute_engines::prompt::{self, Dialect, PromptLimits, PyValue, TokenizerPool};
use kvroute_engines::ApiKind;
use kvroute_select::{ContractId, ContractKeys, MissReason, PromptInput, PromptKeys, Request};

use crate::admission::{TokenizeAdmission, TokenizeOverload};

/// How [`prepare`] treats one request body: its limits, the rewrites of the
/// body to forward, and whether to hash the prompt's block keys in the same
/// job. [`Default`] is [`crate::KvRouterBuilder`]'s defaults (1 M characters,
/// 128 Ki tokens, usage added to streamed requests, vLLM's validators, text
/// forwarded, no hashing).
///
/// ```
/// use kvroute::prompt::PromptOptions;
/// let mut o = PromptOptions::default();
/// o.max_prompt_tokens = 32 << 10;
/// o.include_usage = false; // streamed receipts only when the client asks for usage
/// assert!(o.keys.is_none() && !o.forward_token_ids);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PromptOptions {
    /// Most prompt characters tokenized ([`PromptLimits::max_chars`]; more: a
    /// `prompt_too_long` miss, still routed by the fallback).
    pub max_prompt_chars: usize,
    /// Most prompt tokens routed on (more: a `prompt_too_long` miss).
    pub max_prompt_tokens: usize,
    /// Add `stream_options.include_usage` to streamed requests
    /// ([`crate::receipt::include_usage`]; a client's own setting stands).
    pub include_usage: bool,
    /// Whose request validators apply
    /// ([`kvroute_engines::engine::prompt_dialect_of`] the endpoints' engines).
    pub dialect: Dialect,
    /// The endpoints' engines (one of each): which of them take a
    /// completions prompt as token ids ([`IdsBody`]).
    pub engines: Vec<Arc<dyn Engine>>,
    /// Prepare the id-prompt body of `/v1/completions` ([`IdsBody`]).
    pub forward_token_ids: bool,
    /// The rule's contract keys, when it routes KV-exact: the prompt's block
    /// keys are then hashed in the same job, each tokenized piece's blocks
    /// while later pieces still tokenize
    /// ([`kvroute_engines::prompt::encode_and_hash`]), and handed to selection
    /// ([`PreparedPrompt::request`]), which then does not hash them again.
    pub keys: Option<Arc<ContractKeys>>,
    /// Hash extras the body does not carry, e.g. the LoRA adapter the
    /// request's model names (vLLM keys its blocks with it). The body's
    /// `cache_salt` replaces the one here.
    pub extras: RequestExtras,
}

impl Default for PromptOptions {
    fn default() -> Self {
        Self {
            max_prompt_chars: 1 << 20,
            max_prompt_tokens: 128 << 10,
            include_usage: true,
            dialect: Dialect::Vllm,
            engines: Vec::new(),
            forward_token_ids: false,
            keys: None,
            extras: RequestExtras::NONE,
        }
    }
}

/// What [`prepare`] needs from its host: the tokenizers, and per request the
/// options for the model the body names (e.g. the options of the rule that
/// serves it; `None` when the body names none or is not JSON).
///
/// ```
/// use kvroute::prompt::{prepare, PromptHost, PromptOptions};
/// use kvroute_engines::{prompt::TokenizerPool, ApiKind};
/// struct Host(TokenizerPool);
/// impl PromptHost for Host {
///     fn tokenizers(&self) -> &TokenizerPool { &self.0 }
///     fn options(&self, _model: Option<&str>) -> PromptOptions { PromptOptions::default() }
/// }
/// let host = Host(TokenizerPool::new());
/// host.0.register("qwen3", concat!(env!("CARGO_MANIFEST_DIR"), "/../golden/tokenizers/qwen3"));
/// let body = br#"{"model": "qwen3", "stream": true, "messages": [{"role": "user", "content": "hi"}]}"#;
/// let p = prepare(&host, ApiKind::Chat, body);
/// assert_eq!(p.model(), Some("qwen3"));
/// assert!(p.tokens().is_ok_and(|ids| !ids.is_empty()));
/// assert!(p.rewritten().is_some()); // stream_options.include_usage added
/// ```
pub trait PromptHost {
    /// The tokenizers by model slug.
    fn tokenizers(&self) -> &TokenizerPool;
    /// The options for a request naming `model`.
    fn options(&self, model: Option<&str>) -> PromptOptions;
}

/// What one request body gave, owned (it outlives the blocking job): the
/// model, the prompt ids or the miss, the text, the hash extras, the keys
/// when [`PromptOptions::keys`] hashed them, and the bodies to forward.
#[derive(Debug, Clone)]
pub struct PreparedPrompt {
    model: Option<String>,
    tokens: Result<Vec<u32>, MissReason>,
    text: Option<String>,
    extras: RequestExtras,
    /// The keys of `tokens` with `extras`, and their contract.
    keys: Option<(Vec<BlockKey>, ContractId)>,
    /// The body to forward when it differs from the client's
    /// ([`crate::receipt::include_usage`]).
    rewritten: Option<Bytes>,
    /// The same with `prompt` as ids, per target engine (`None`: forwarding
    /// is off).
    ids: Option<IdsBody>,
    /// The body asks for a streamed answer (`"stream": true`).
    streamed: bool,
    /// `truncate_prompt_tokens` cut the prompt.
    truncated: bool,
    /// This replica's turn within a burst, once taken
    /// ([`crate::KvRouter::take_turn`]): the decision is then made in turn.
    turn: kvroute_select::Turn,
}

impl PreparedPrompt {
    /// A request that missed before tokenizing (e.g. an empty body:
    /// [`MissReason::NoModel`]); nothing to rewrite.
    ///
    /// ```
    /// use kvroute::prompt::PreparedPrompt;
    /// use kvroute_select::{MissReason, PromptInput};
    /// let p = PreparedPrompt::missed(None, MissReason::NoModel);
    /// assert!(matches!(p.request().prompt, PromptInput::Missing(MissReason::NoModel)));
    /// ```
    #[must_use]
    pub fn missed(model: Option<String>, miss: MissReason) -> Self {
        Self {
            model,
            tokens: Err(miss),
            text: None,
            extras: RequestExtras::NONE,
            keys: None,
            rewritten: None,
            ids: None,
            streamed: false,
            truncated: false,
            turn: kvroute_select::Turn::NONE,
        }
    }

    /// Whether `truncate_prompt_tokens` cut the request's prompt (of a list
    /// of prompts, any of them); the tokens and keys are of what the engine
    /// keeps.
    #[must_use]
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Whether the body asks for a streamed answer (`"stream": true`): its
    /// engine then sends response headers as soon as it accepts it.
    #[must_use]
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// The model the body named.
    #[must_use]
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The prompt ids routed on (the first engine prompt), or the miss.
    ///
    /// # Errors
    /// The [`MissReason`] the prompt pipeline ended in.
    pub fn tokens(&self) -> Result<&[u32], MissReason> {
        self.tokens.as_deref().map_err(|m| *m)
    }

    /// The prompt text (rendered chat prompt or completions string).
    #[must_use]
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }

    /// The hash extras (`cache_salt`, the LoRA adapter).
    #[must_use]
    pub fn extras(&self) -> &RequestExtras {
        &self.extras
    }

    /// The block keys hashed with the tokenization, and their contract
    /// ([`PromptOptions::keys`]).
    #[must_use]
    pub fn keys(&self) -> Option<(&[BlockKey], &ContractId)> {
        self.keys.as_ref().map(|(k, c)| (&k[..], c))
    }

    /// The turn taken for this prompt ([`crate::KvRouter::take_turn`];
    /// [`kvroute_select::Turn::NONE`] until then).
    #[must_use]
    pub fn turn(&self) -> kvroute_select::Turn {
        self.turn
    }

    pub(crate) fn set_turn(&mut self, turn: kvroute_select::Turn) {
        self.turn = turn;
    }

    /// The body to forward instead of the client's (`stream_options.include_usage`
    /// added), if it differs.
    #[must_use]
    pub fn rewritten(&self) -> Option<&Bytes> {
        self.rewritten.as_ref()
    }

    /// The id-prompt body per engine, while [`PromptOptions::forward_token_ids`] is on.
    #[must_use]
    pub fn ids(&self) -> Option<&IdsBody> {
        self.ids.as_ref()
    }

    /// The request as selection takes it (add a session with
    /// [`Request::with_session`]): the ids, the text, the extras and the
    /// keys already hashed.
    #[must_use]
    pub fn request(&self) -> Request<'_> {
        let input = match &self.tokens {
            Ok(ids) => PromptInput::Tokens(ids),
            Err(m) => PromptInput::Missing(*m),
        };
        let mut req = Request::new(input);
        if let Some(t) = &self.text {
            req = req.with_text(t);
        }
        if self.extras != RequestExtras::NONE {
            req = req.with_extras(&self.extras);
        }
        if let Some((keys, contract)) = &self.keys {
            req = req.with_keys(keys, contract);
        }
        req
    }
}

/// What a request refused tokenization by the admission still gets: its
/// model and the usage rewrite, and a `tokenize_overloaded` miss (CPU work
/// about the body's size: run it on the blocking pool).
///
/// ```
/// use kvroute::prompt::{unadmitted, PromptHost, PromptOptions};
/// use kvroute_engines::prompt::TokenizerPool;
/// use kvroute_select::MissReason;
/// struct Host(TokenizerPool);
/// impl PromptHost for Host {
///     fn tokenizers(&self) -> &TokenizerPool { &self.0 }
///     fn options(&self, _: Option<&str>) -> PromptOptions { PromptOptions::default() }
/// }
/// let p = unadmitted(&Host(TokenizerPool::new()), br#"{"model": "m", "stream": true, "prompt": "x"}"#);
/// assert_eq!((p.model(), p.tokens()), (Some("m"), Err(MissReason::TokenizeOverloaded)));
/// assert!(p.rewritten().is_some());
/// ```
pub fn unadmitted<H: PromptHost + ?Sized>(host: &H, body: &[u8]) -> PreparedPrompt {
    // Only what a request routed without its prompt needs: the body's tree
    // is never built (under overload a flood of large bodies would hold many
    // times their size).
    let value = prompt::parse_json_fields(body, &["model", "stream"]).ok();
    let model = value
        .as_ref()
        .and_then(|v| prompt::model_of(v).map(str::to_owned));
    let options = host.options(model.as_deref());
    let mut out = PreparedPrompt::missed(model, MissReason::TokenizeOverloaded);
    out.rewritten = usage_rewrite(&options, value.as_ref(), body);
    out.streamed = streamed(value.as_ref());
    if options.forward_token_ids {
        out.ids = Some(IdsBody::text(KeepText::NoTokens));
    }
    out
}

/// [`crate::receipt::include_usage`] of a streamed `body` (`value`, parsed)
/// when the options ask for it: the rewrite parses the body again, so
/// non-streamed requests, most of them, skip it.
fn usage_rewrite(options: &PromptOptions, value: Option<&PyValue>, body: &[u8]) -> Option<Bytes> {
    if options.include_usage && streamed(value) {
        crate::receipt::include_usage(body).map(Bytes::from)
    } else {
        None
    }
}

/// `"stream": true` in a parsed body: the request is answered as a stream
/// (its headers come at once, and the stream header timeout applies).
///
/// ```
/// use kvroute_engines::prompt::parse_json_fields;
/// let v = parse_json_fields(br#"{"model": "m", "stream": true}"#, &["model", "stream"]).ok();
/// assert!(kvroute::prompt::streamed(v.as_ref()));
/// assert!(!kvroute::prompt::streamed(None));
/// ```
#[must_use]
pub fn streamed(value: Option<&PyValue>) -> bool {
    value
        .and_then(PyValue::as_dict)
        .is_some_and(|d| matches!(d.get("stream"), Some(PyValue::Bool(true))))
}

/// Parses and tokenizes `body`, an OpenAI `api` request, under the options
/// its model gets from `host` (CPU work: run it on the blocking pool, as
/// [`prepare_admitted`] does). Never fails: every problem is a typed miss.
pub fn prepare<H: PromptHost + ?Sized>(host: &H, api: ApiKind, body: &[u8]) -> PreparedPrompt {
    prepare_within(host, api, body, usize::MAX)
        .unwrap_or_else(|| PreparedPrompt::missed(None, MissReason::PromptTooLong))
}

/// [`prepare`] with the prompt's characters bounded by `max_chars` as well
/// as by the options' limit; `None` when the prompt is over `max_chars` but
/// not over the options' limit (the caller prepares it without the bound).
fn prepare_within<H: PromptHost + ?Sized>(
    host: &H,
    api: ApiKind,
    body: &[u8],
    max_chars: usize,
) -> Option<PreparedPrompt> {
    let value = prompt::parse_json(body).ok();
    let model = value
        .as_ref()
        .and_then(|v| prompt::model_of(v).map(str::to_owned));
    let options = host.options(model.as_deref());
    let rewritten = usage_rewrite(&options, value.as_ref(), body);
    let is_streamed = streamed(value.as_ref());
    let no_ids = |mut p: PreparedPrompt| {
        p.streamed = is_streamed;
        if options.forward_token_ids {
            let why = if api == ApiKind::Chat {
                KeepText::Chat
            } else {
                KeepText::NoTokens
            };
            p.ids = Some(IdsBody::text(why));
        }
        p
    };
    let Some(value) = value else {
        return Some(no_ids(PreparedPrompt::missed(None, MissReason::NotJson)));
    };
    let Some(m) = &model else {
        return Some(no_ids(PreparedPrompt::missed(None, MissReason::NoModel)));
    };
    let bounded = max_chars < options.max_prompt_chars;
    let limits = PromptLimits {
        max_chars: options.max_prompt_chars.min(max_chars),
    };
    let extras_of = |salt: Option<&str>| RequestExtras {
        cache_salt: salt.map(str::to_owned),
        ..options.extras.clone()
    };
    let keyed = host
        .tokenizers()
        .get(m)
        .and_then(|tok| match &options.keys {
            Some(keys) => prompt::prompt_tokens_and_keys(
                &tok,
                api,
                &value,
                limits,
                options.dialect,
                keys.hasher(),
                extras_of,
            )
            .map(|k| (k.tokens, k.extras, k.keys)),
            None => prompt::prompt_tokens_as(&tok, api, &value, limits, options.dialect).map(|t| {
                let extras = extras_of(t.cache_salt.as_deref());
                (t, extras, None)
            }),
        });
    let mut truncated = false;
    let mut out = match keyed {
        Ok((p, extras, keys)) => {
            truncated = p.truncated;
            let first = p.engine_prompts.into_iter().next();
            let (ids, text) = first.map_or((Vec::new(), None), |e| (e.token_ids, e.rendered));
            let tokens = if ids.is_empty() {
                Err(MissReason::EmptyPrompt)
            } else if ids.len() > options.max_prompt_tokens {
                tracing::debug!(
                    tokens = ids.len(),
                    "prompt over max_prompt_tokens: not routed by KV"
                );
                Err(MissReason::PromptTooLong)
            } else {
                Ok(ids)
            };
            let keys = match (&tokens, keys, &options.keys) {
                (Ok(_), Some(k), Some(c)) => Some((k, c.contract().clone())),
                _ => None,
            };
            PreparedPrompt {
                model,
                tokens,
                text,
                extras,
                keys,
                rewritten: None,
                ids: None,
                streamed: false,
                truncated,
                turn: kvroute_select::Turn::NONE,
            }
        }
        Err(prompt::PromptError::PromptTooLong { .. }) if bounded => return None,
        Err(e) => {
            tracing::debug!(kind = e.kind(), "no prompt tokens");
            PreparedPrompt::missed(model, e.reason())
        }
    };
    if options.forward_token_ids {
        let base = rewritten.as_deref().unwrap_or(body);
        let ids = out.tokens.as_deref().ok();
        out.ids = Some(IdsBody::prepare(
            api,
            base,
            &value,
            ids,
            truncated,
            &options.engines,
        ));
    }
    out.rewritten = rewritten;
    out.streamed = is_streamed;
    Some(out)
}

/// Bodies up to this size are prepared on the calling task when a permit is
/// free at once: a chat turn of a few KiB costs tens of microseconds (its
/// earlier messages come from the span cache, its new words mostly from the
/// pre-token cache of the fast byte-level BPE path), less than the hand-off
/// to the blocking pool and back; even an 8 KiB body nobody has sent before
/// (~2 K tokens) is ~0.7 ms with that path.
pub const INLINE_PREPARE_BYTES: usize = 8192;

/// The most characters a prompt prepared on the calling task may have: a
/// chat template can make a small body a long prompt (one that pretty-prints
/// a request's deeply nested tool schema writes hundreds of bytes per byte
/// of it), and tokenizing that on the calling task would hold up everything
/// else it runs. A prompt over it is prepared again on the blocking pool.
pub const INLINE_PROMPT_CHARS: usize = 4 * INLINE_PREPARE_BYTES;

/// [`prepare`] on the blocking pool behind `handle`, admitted first by
/// `admission` (at most so many tokenizations and bytes at once; a request
/// finding no room waits up to `wait` under [`TokenizeOverload::Wait`], then
/// gets [`unadmitted`]'s `tokenize_overloaded` miss). The permit is held by
/// the blocking job, not by this future: a caller that goes away does not
/// stop the tokenizer, so its room stays taken until the work really ends.
/// An empty body is a `no_model` miss without a job. What
/// [`crate::KvRouter::pick`] runs, for hosts that drive selection themselves.
pub async fn prepare_admitted<H: PromptHost + Send + Sync + 'static>(
    host: &Arc<H>,
    handle: &tokio::runtime::Handle,
    admission: &Arc<TokenizeAdmission>,
    overload: TokenizeOverload,
    wait: std::time::Duration,
    api: ApiKind,
    body: &Bytes,
) -> PreparedPrompt {
    if body.is_empty() {
        return PreparedPrompt::missed(None, MissReason::NoModel);
    }
    let mut inline = None;
    if body.len() <= INLINE_PREPARE_BYTES {
        if let Some(permit) = admission.try_take(body.len()) {
            match prepare_within(&**host, api, body, INLINE_PROMPT_CHARS) {
                Some(p) => return p,
                // Its template made it a long prompt: prepared on the
                // blocking pool, under the permit it holds.
                None => inline = Some(permit),
            }
        }
    }
    let permit = match inline {
        Some(permit) => Some(permit),
        None => admission.admit(body.len(), overload, wait).await,
    };
    let host = Arc::clone(host);
    let body = body.clone();
    let job = match permit {
        Some(permit) => handle.spawn_blocking(move || {
            let _permit = permit;
            prepare(&*host, api, &body)
        }),
        None => {
            tracing::debug!(
                bytes = body.len(),
                "tokenization at capacity: not routed by KV"
            );
            // The model and the usage rewrite still apply; they cost about
            // the body's size, not the tokenizer's ~280 times.
            handle.spawn_blocking(move || unadmitted(&*host, &body))
        }
    };
    match job.await {
        Ok(p) => p,
        Err(err) => {
            tracing::warn!(%err, "tokenize task failed");
            PreparedPrompt::missed(None, MissReason::TokenizeError)
        }
    }
}

// ---------------------------------------------------------------------------
// Token-id forwarding ("tokenize once").

pub use kvroute_engines::engine::KeepText;
/// Per-model tokenizer options ([`crate::KvRouterBuilder::model_with`]).
pub use kvroute_engines::prompt::{ContentFormat, ModelOptions};

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

/// The id-prompt body of one completions request and, per engine, whether
/// a target running it gets that body or the text (and why).
#[derive(Debug, Clone)]
pub struct IdsBody {
    /// The body with `prompt` as ids, when the ids are the whole prompt and
    /// at least one engine may take it.
    body: Option<Bytes>,
    /// Per engine (by name), the outcome for a target running it.
    engines: Vec<(String, Result<(), KeepText>)>,
    /// The outcome for any other engine.
    other: KeepText,
}

impl IdsBody {
    /// Nothing to forward (forwarding off for this request, or no ids): every
    /// engine gets the text, for `why`.
    #[must_use]
    pub fn text(why: KeepText) -> Self {
        Self {
            body: None,
            engines: Vec::new(),
            other: why,
        }
    }

    /// Prepares the id body of one request for targets running `engines`:
    /// `base` is the body that would be forwarded otherwise (the client's,
    /// or its usage rewrite), `value` the client's body parsed, `ids` the
    /// exact prompt ids kvroute computed (`None` when the pipeline missed),
    /// `truncated` whether `truncate_prompt_tokens` cut them. CPU work about
    /// the body's size: run it where the tokenization runs.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kvroute::prompt::{IdsBody, KeepText};
    /// use kvroute_engines::engine::{by_name, Engine};
    /// use kvroute_engines::{prompt::parse_json, ApiKind};
    /// let (vllm, trt) = (by_name("vllm").unwrap(), by_name("trtllm").unwrap());
    /// let body = br#"{"model":"m","prompt":"Hello world"}"#;
    /// let value = parse_json(body).unwrap();
    /// let ids = [9707, 1879];
    /// let p = IdsBody::prepare(ApiKind::Completions, body, &value, Some(&ids), false, &[vllm.clone(), trt.clone()]);
    /// assert_eq!(&p.for_engine(&*vllm).unwrap()[..], br#"{"model":"m","prompt":[9707,1879]}"#);
    /// assert_eq!(p.for_engine(&*trt).unwrap_err(), KeepText::Engine);
    /// ```
    #[must_use]
    pub fn prepare(
        api: ApiKind,
        base: &[u8],
        value: &PyValue,
        ids: Option<&[u32]>,
        truncated: bool,
        engines: &[Arc<dyn Engine>],
    ) -> Self {
        let gate = match (ids, truncated) {
            (None, _) => Err(KeepText::NoTokens),
            (Some(_), true) => Err(KeepText::Truncation),
            (Some([]), false) => Err(KeepText::NoTokens),
            (Some(ids), false) => Ok(ids),
        };
        // The request's own reason first (chat, echo, ...): it says more than
        // the pipeline's miss.
        let mut outcomes: Vec<(String, Result<(), KeepText>)> = engines
            .iter()
            .map(|e| {
                let own = e.token_ids_equivalent(api, value);
                let r = match gate {
                    Err(g) => own.and(Err(g)),
                    Ok(_) => own,
                };
                (e.name().to_owned(), r)
            })
            .collect();
        let body = match gate {
            Ok(ids) if outcomes.iter().any(|(_, r)| r.is_ok()) => {
                with_token_ids(base, ids).map(Bytes::from)
            }
            _ => None,
        };
        if body.is_none() {
            for (_, r) in &mut outcomes {
                if r.is_ok() {
                    *r = Err(KeepText::Rewrite);
                }
            }
        }
        Self {
            body,
            engines: outcomes,
            other: KeepText::Engine,
        }
    }

    /// The id body for a target running `engine`, or why it gets the text.
    ///
    /// # Errors
    /// The [`KeepText`] reason.
    pub fn for_engine(&self, engine: &dyn Engine) -> Result<&Bytes, KeepText> {
        let ok = self
            .engines
            .iter()
            .find(|(n, _)| n == engine.name())
            .map_or(Err(self.other), |(_, r)| *r);
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
