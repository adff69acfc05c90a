//! OpenAI request body → the exact token ids vLLM prefills.
//!
//! The pipeline mirrors vLLM 0.33.0's OpenAI server (see
//! `golden/chat/README.md`, the specification):
//!
//! 1. [`parse_json`] parses the body like Python's `json.loads` into a
//!    [`PyValue`] (not JSON → [`PromptError::NotJson`]);
//! 2. [`extract_request`] reduces it to the prompt-deciding fields
//!    ([`OpenAiRequest`]) with vLLM's defaults and validators ([`Dialect`]
//!    where SGLang differs);
//! 3. chat messages become the [`TemplateInput`] (content-part joining,
//!    developer→system, tool normalisation, argument parsing; SGLang's own
//!    message and tool processing for [`Dialect::Sglang`]) and the
//!    [`ChatTemplate`] renders it with minijinja, Python-compatible (`tojson`
//!    as `json.dumps`, `raise_exception`, `strftime_now`,
//!    `continue_final_message`): [`render_chat`];
//! 4. the [`ModelTokenizer`] tokenizes (span-cached; byte-level BPE
//!    pipelines through an exact fast path with a pre-token cache,
//!    [`PreTokenCacheStats`]; optionally on a [`ParallelEncoder`]) and
//!    truncates; the engine's length/vocabulary checks
//!    complete it: [`prompt_tokens`], [`prompt_tokens_limited`] (with
//!    [`PromptLimits`]), [`prompt_tokens_as`] (with a [`Dialect`]).
//!
//! [`TokenizerPool`] loads the tokenizers by model slug and runs all four
//! steps from body bytes; [`prompt_tokens_and_keys`] and [`encode_and_hash`]
//! also compute the block keys, overlapped with the tokenization. Every
//! failure is a typed [`PromptError`]: the request is routed without KV
//! awareness, never refused for it.
//!
//! What each completions `prompt` shape routes on: a string → one engine prompt
//! (its tokenization); a token-id list → one prompt, the ids verbatim; a list of
//! strings or of id lists → one engine request per element, each hashed on its
//! own ([`PromptTokens::engine_prompts`] has one entry per element).
//!
//! A chat request through the real Qwen3 tokenizer, then its block keys under
//! the engine's hash contract:
//!
//! ```
//! use kvroute_core::{HashContract, RequestExtras};
//! use kvroute_engines::prompt::{ApiKind, TokenizerPool};
//!
//! let pool = TokenizerPool::new();
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
//! pool.register("Qwen/Qwen3-8B", dir);
//! let body = br#"{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "Hello!"}]}"#;
//! let p = pool.prompt_tokens(ApiKind::Chat, body)?;
//! assert_eq!(p.engine_prompts[0].rendered.as_deref(),
//!            Some("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"));
//!
//! let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse::<HashContract>()?.hasher()?;
//! let mut keys = Vec::new();
//! hasher.hash_prompt(&p.engine_prompts[0].token_ids, &RequestExtras::NONE, &mut keys)?;
//! // Only full blocks of 16 tokens have keys.
//! assert_eq!(keys.len(), p.engine_prompts[0].token_ids.len() / 16);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// The submodules are private: the items below are the module's surface, one
// name per concept, so a submodule can be split or merged without breaking hosts.
mod byte_bpe;
mod chat;
mod chat_sglang;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "parity")]
pub mod golden;
mod jinja_compat;
mod parallel;
mod pipeline;
mod pyjson;
mod pyvalue;
mod render_budget;
mod request;
mod span_cache;
mod template;
mod tokenizer;

pub use byte_bpe::PreTokenCacheStats;
pub use error::PromptError;
pub use parallel::{seams, ParallelConfig, ParallelEncoder, ParallelError, SeamPolicy};
pub use pipeline::{encode_and_hash, prompt_tokens_and_keys, KeyedPrompt, PipelineError};
pub use pyvalue::{
    parse_json, parse_json_fields, JsonSyntaxError, PyDict, PyValue, MAX_JSON_DEPTH,
};
pub use request::{
    extract_request, extract_request_as, model_of, ApiKind, ChatRequest, CommonFields,
    CompletionPrompt, CompletionRequest, Dialect, OpenAiRequest, TruncationSide,
};
pub use span_cache::SpanCacheStats;
pub use template::{ChatTemplate, ContentFormat, TemplateError, TemplateInput};
pub use tokenizer::{
    ModelLoadError, ModelOptions, ModelTokenizer, TokenizerPool, DEFAULT_SPAN_CACHE_BYTES,
};

/// One request the engine runs: the text it tokenized (if any) and the ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnginePrompt {
    /// The rendered/prompt text (`None` for token-id prompts). Untruncated, as vLLM keeps it.
    pub rendered: Option<String>,
    /// The ids the engine prefills (after truncation).
    pub token_ids: Vec<u32>,
}

/// The prompt(s) of one OpenAI request, ready for block hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    /// The model slug from the body.
    pub model: String,
    /// The endpoint the body was for.
    pub endpoint: ApiKind,
    /// One entry per engine request (several for array completions prompts).
    pub engine_prompts: Vec<EnginePrompt>,
    /// `cache_salt`: ids unchanged, but it enters block 0's hash.
    pub cache_salt: Option<String>,
    /// `truncate_prompt_tokens` cut at least one prompt.
    pub truncated: bool,
}

impl TokenizerPool {
    /// Body bytes → prompt tokens for the model the body names.
    ///
    /// Every failure is a typed [`PromptError`]; nothing here is an error to the client.
    pub fn prompt_tokens(
        &self,
        endpoint: ApiKind,
        body: &[u8],
    ) -> Result<PromptTokens, PromptError> {
        let value = parse_json(body).map_err(|e| PromptError::NotJson(e.to_string()))?;
        let model = model_of(&value).ok_or(PromptError::NoModel)?;
        let tok = self.get(model)?;
        prompt_tokens(&tok, endpoint, &value)
    }
}

/// Bounds on the work one request may cost the router before it gives up on
/// KV routing (a [`PromptError::PromptTooLong`] miss, never a client error).
///
/// Tokenizing is linear in the prompt but far from free (a few MB of text costs
/// the router a CPU-second); the body size limit alone does not bound it tightly.
///
/// ```
/// use kvroute_engines::prompt::{parse_json, prompt_tokens_limited, ApiKind,
///     ModelOptions, ModelTokenizer, PromptLimits, PromptError};
/// # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
/// let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
/// let body = parse_json(br#"{"model": "m", "prompt": "a rather long prompt"}"#).unwrap();
/// let limits = PromptLimits { max_chars: 8 };
/// let miss = prompt_tokens_limited(&tok, ApiKind::Completions, &body, limits).unwrap_err();
/// assert_eq!(miss, PromptError::PromptTooLong { limit: 8 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimits {
    /// Most characters (Unicode scalar values) of prompt text tokenized: a
    /// completions prompt (all elements of a list together), or a chat
    /// request's message strings before and its rendered prompt after templating.
    pub max_chars: usize,
}

impl Default for PromptLimits {
    /// No limit.
    fn default() -> Self {
        Self {
            max_chars: usize::MAX,
        }
    }
}

impl PromptLimits {
    /// `Err` when `chars` already counted exceed the limit.
    fn check(self, chars: usize) -> Result<(), PromptError> {
        if chars > self.max_chars {
            Err(PromptError::PromptTooLong {
                limit: self.max_chars,
            })
        } else {
            Ok(())
        }
    }

    /// Adds `text`'s characters to `total` and checks the limit. Characters,
    /// not bytes, also while far from the limit: a prompt of several strings
    /// is judged by all of them together.
    fn add(self, total: &mut usize, text: &str) -> Result<(), PromptError> {
        *total = total.saturating_add(text.chars().count());
        self.check(*total)
    }
}

/// Adds the characters of every string inside `v` (dict keys excluded) to `total`.
fn add_strings(limits: PromptLimits, total: &mut usize, v: &PyValue) -> Result<(), PromptError> {
    match v {
        PyValue::Str(s) => limits.add(total, s),
        PyValue::List(items) => items.iter().try_for_each(|i| add_strings(limits, total, i)),
        PyValue::Dict(d) => d.values().try_for_each(|i| add_strings(limits, total, i)),
        _ => Ok(()),
    }
}

/// A parsed body → prompt tokens with a given model's tokenizer (the model
/// slug in the body is reported, not checked).
pub fn prompt_tokens(
    tok: &ModelTokenizer,
    endpoint: ApiKind,
    body: &PyValue,
) -> Result<PromptTokens, PromptError> {
    prompt_tokens_limited(tok, endpoint, body, PromptLimits::default())
}

/// [`prompt_tokens`] that refuses, before tokenizing, prompt text beyond
/// `limits` ([`PromptError::PromptTooLong`]).
pub fn prompt_tokens_limited(
    tok: &ModelTokenizer,
    endpoint: ApiKind,
    body: &PyValue,
    limits: PromptLimits,
) -> Result<PromptTokens, PromptError> {
    prompt_tokens_as(tok, endpoint, body, limits, Dialect::Vllm)
}

/// [`prompt_tokens_limited`] with `dialect`'s request validators where the
/// engines differ (e.g. SGLang takes an empty `cache_salt` as none, vLLM
/// refuses it): use the rule's engine.
pub fn prompt_tokens_as(
    tok: &ModelTokenizer,
    endpoint: ApiKind,
    body: &PyValue,
    limits: PromptLimits,
    dialect: Dialect,
) -> Result<PromptTokens, PromptError> {
    prompt_tokens_encoded(tok, endpoint, body, limits, dialect, &mut |_, text, add| {
        tok.encode(text, add)
    })
}

/// How a request's single prompt text is encoded: given its `cache_salt`,
/// the text and `add_special_tokens`, the ids ([`encode_and_hash`] hashes there).
pub(crate) type EncodeOne<'a> =
    dyn FnMut(Option<&str>, &str, bool) -> Result<Vec<u32>, PromptError> + 'a;

/// [`prompt_tokens_as`] with the one text of a chat request (its rendered
/// prompt) or of a string completions prompt encoded by `encode`; lists of
/// strings encode with `tok`.
pub(crate) fn prompt_tokens_encoded(
    tok: &ModelTokenizer,
    endpoint: ApiKind,
    body: &PyValue,
    limits: PromptLimits,
    dialect: Dialect,
    encode: &mut EncodeOne<'_>,
) -> Result<PromptTokens, PromptError> {
    let req = extract_request_as(endpoint, body, dialect)?;
    let common = req.common().clone();
    let mut truncated = false;
    // What the tokenizer adds around a text encoded for this request.
    let specials = if common.add_special_tokens {
        tok.added_special_tokens()
    } else {
        (0, 0)
    };
    // A prompt given as ids: checked, nothing added around it.
    let from_ids = |ids: &[i64], truncated: &mut bool| {
        finish(
            tok,
            dialect,
            &common,
            None,
            checked_ids(tok, ids)?,
            (0, 0),
            truncated,
        )
    };
    let engine_prompts = match &req {
        OpenAiRequest::Chat(chat) => {
            // Message text bounds the rendering work; the rendered prompt
            // (template text added) bounds the tokenizing.
            let mut chars = 0;
            chat.messages
                .iter()
                .try_for_each(|m| add_strings(limits, &mut chars, m))?;
            // A rendered prompt over `max_chars` is refused: past four bytes
            // a character it is, whatever it holds, so the rendering stops
            // there (a template's output is not bounded by its input).
            let max_bytes = limits.max_chars.saturating_mul(4);
            let (_, mut rendered, prefix) =
                render_chat_parts(tok, chat, max_bytes).map_err(|e| match e {
                    PromptError::Template(TemplateError::OutputTooLong(_)) => {
                        PromptError::PromptTooLong {
                            limit: limits.max_chars,
                        }
                    }
                    e => e,
                })?;
            limits.add(&mut 0, &rendered)?;
            let mut ids = encode(
                common.cache_salt.as_deref(),
                &rendered,
                common.add_special_tokens,
            )?;
            if let Some(prefix) = prefix {
                limits.add(&mut 0, &prefix)?;
                ids.extend(continued_prefix_ids(tok, &prefix)?);
                rendered.push_str(&prefix);
            }
            vec![finish(
                tok,
                dialect,
                &common,
                Some(rendered),
                ids,
                specials,
                &mut truncated,
            )?]
        }
        OpenAiRequest::Completions(c) => match &c.prompt {
            CompletionPrompt::Text(text) => {
                limits.add(&mut 0, text)?;
                let ids = encode(
                    common.cache_salt.as_deref(),
                    text,
                    common.add_special_tokens,
                )?;
                vec![finish(
                    tok,
                    dialect,
                    &common,
                    Some(text.clone()),
                    ids,
                    specials,
                    &mut truncated,
                )?]
            }
            CompletionPrompt::Ids(ids) => vec![from_ids(ids, &mut truncated)?],
            CompletionPrompt::Texts(texts) => {
                let mut chars = 0;
                texts.iter().try_for_each(|t| limits.add(&mut chars, t))?;
                texts
                    .iter()
                    .map(|t| {
                        let ids = tok.encode(t, common.add_special_tokens)?;
                        finish(
                            tok,
                            dialect,
                            &common,
                            Some(t.clone()),
                            ids,
                            specials,
                            &mut truncated,
                        )
                    })
                    .collect::<Result<_, _>>()?
            }
            CompletionPrompt::IdLists(lists) => lists
                .iter()
                .map(|ids| from_ids(ids, &mut truncated))
                .collect::<Result<_, _>>()?,
        },
    };
    Ok(PromptTokens {
        model: common.model,
        endpoint,
        engine_prompts,
        cache_salt: common.cache_salt,
        truncated,
    })
}

/// A chat request → the template input and the rendered prompt text, as
/// the request's [`Dialect`] renders it. An SGLang request continuing its
/// last assistant message gets that message's text after the rendered
/// template (SGLang encodes the two apart: [`prompt_tokens_as`] does too).
pub fn render_chat(
    tok: &ModelTokenizer,
    chat: &ChatRequest,
) -> Result<(TemplateInput, String), PromptError> {
    let (input, mut rendered, prefix) = render_chat_parts(tok, chat, usize::MAX)?;
    if let Some(prefix) = prefix {
        rendered.push_str(&prefix);
    }
    Ok((input, rendered))
}

/// [`render_chat`] with SGLang's continued assistant text apart, the
/// rendering stopped past `max_bytes` ([`ChatTemplate::render_limited`]).
fn render_chat_parts(
    tok: &ModelTokenizer,
    chat: &ChatRequest,
    max_bytes: usize,
) -> Result<(TemplateInput, String, Option<String>), PromptError> {
    let template = tok.chat_template()?;
    let (input, rendered, prefix) = match chat.dialect {
        Dialect::Vllm => {
            let input = chat::template_input(chat, template)?;
            let rendered = template.render_limited(&input, max_bytes)?;
            (input, rendered, None)
        }
        Dialect::Sglang => {
            let s = chat_sglang::template_input(chat, template)?;
            let (input, rendered) = chat_sglang::render(template, s.input, max_bytes)?;
            (
                input,
                rendered,
                s.assistant_prefix.filter(|p| !p.is_empty()),
            )
        }
    };
    Ok((input, rendered, prefix))
}

/// SGLang's ids of a continued assistant text
/// (`_append_assistant_prefix_to_prompt_ids`): encoded with the tokenizer's
/// special tokens, less a first id equal to the `bos_token`'s.
fn continued_prefix_ids(tok: &ModelTokenizer, prefix: &str) -> Result<Vec<u32>, PromptError> {
    let mut ids = tok.encode(prefix, true)?;
    if tok.bos_token_id().is_some() && ids.first().copied() == tok.bos_token_id() {
        ids.remove(0);
    }
    Ok(ids)
}

/// The engine refuses ids outside the vocabulary.
fn checked_ids(tok: &ModelTokenizer, ids: &[i64]) -> Result<Vec<u32>, PromptError> {
    ids.iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&u| (u as usize) < tok.vocab_size())
                .ok_or_else(|| {
                    PromptError::EngineInput(format!("token id {id} is out of vocabulary"))
                })
        })
        .collect()
}

/// Applies `truncate_prompt_tokens`, then the engine's input checks.
/// `specials`: the special tokens the tokenizer added before and after the
/// text's own tokens (none for a prompt given as ids).
fn finish(
    tok: &ModelTokenizer,
    dialect: Dialect,
    common: &CommonFields,
    rendered: Option<String>,
    mut ids: Vec<u32>,
    specials: (usize, usize),
    truncated: &mut bool,
) -> Result<EnginePrompt, PromptError> {
    let keep = match common.truncate_prompt_tokens {
        Some(-1) => tok.max_model_len().map(|m| {
            if common.max_tokens == Some(0) {
                m
            } else {
                m.saturating_sub(1)
            }
        }),
        Some(n) => {
            let n = usize::try_from(n).ok();
            // vLLM refuses a truncation longer than the context
            // (`TokenizeParams.__post_init__`).
            if let (Some(n), Some(max)) = (n, tok.max_model_len()) {
                if n > max {
                    return Err(PromptError::EngineInput(format!(
                        "truncate_prompt_tokens={n} cannot be greater than max_model_len={max}"
                    )));
                }
            }
            n
        }
        None => None,
    };
    if let Some(keep) = keep {
        if ids.len() > keep {
            *truncated = true;
            match common.truncation_side {
                Some(TruncationSide::Left) => {
                    ids.drain(..ids.len() - keep);
                }
                Some(TruncationSide::Right) => ids.truncate(keep),
                // No side given: vLLM truncates inside the tokenizer (its
                // generation tokenizers cut from the left), which cuts the
                // text's own tokens so that they fit beside the special
                // tokens it adds, and keeps those (a BOS stays first).
                // Fewer than the special tokens: the tokenizer does not cut
                // (its bound less the added tokens wraps), and vLLM slices
                // the ids from the left.
                None if keep < specials.0 + specials.1 => {
                    ids.drain(..ids.len() - keep);
                }
                None => {
                    let (front, back) = specials;
                    let own_end = ids.len().saturating_sub(back);
                    let own_keep = keep.saturating_sub(front + back);
                    let cut_from = front.min(own_end);
                    let cut_to = own_end.saturating_sub(own_keep).max(cut_from);
                    ids.drain(cut_from..cut_to);
                }
            }
        }
    }
    if ids.is_empty() {
        return Err(PromptError::EngineInput(
            "the decoder prompt cannot be empty".into(),
        ));
    }
    if let Some(max) = tok.max_model_len() {
        context_check(dialect, common, ids.len(), max)?;
    }
    Ok(EnginePrompt {
        rendered,
        token_ids: ids,
    })
}

/// The engine's context-length check of a `len`-token prompt, `max` the
/// model's context length.
///
/// * vLLM refuses a prompt longer than the context
///   (`renderers/params.py` `_token_len_check`) and clamps `max_tokens` to
///   what is left (`get_max_tokens`).
/// * SGLang refuses a prompt as long as the context or longer, and one whose
///   `max_new_tokens` does not fit beside it
///   (`TokenizerManager._validate_one_request`, without
///   `--allow-auto-truncate`).
fn context_check(
    dialect: Dialect,
    common: &CommonFields,
    len: usize,
    max: usize,
) -> Result<(), PromptError> {
    match dialect {
        Dialect::Vllm if len > max => Err(PromptError::EngineInput(format!(
            "prompt has {len} tokens, more than max_model_len {max}"
        ))),
        Dialect::Vllm => Ok(()),
        Dialect::Sglang if len >= max => Err(PromptError::EngineInput(format!(
            "the input ({len} tokens) is longer than the model's context length ({max} tokens)"
        ))),
        Dialect::Sglang => {
            let (len, max) = (len as i128, max as i128);
            match common.max_tokens {
                Some(new) if i128::from(new) + len > max => Err(PromptError::EngineInput(format!(
                    "{len} prompt tokens and {new} new tokens exceed the model's context \
                         length ({max} tokens)"
                ))),
                _ => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> ModelTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
        ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap()
    }

    fn body(json: &serde_json::Value) -> PyValue {
        parse_json(json.to_string().as_bytes()).unwrap()
    }

    fn limited(
        tok: &ModelTokenizer,
        e: ApiKind,
        v: &serde_json::Value,
        max: usize,
    ) -> Result<PromptTokens, PromptError> {
        prompt_tokens_limited(tok, e, &body(v), PromptLimits { max_chars: max })
    }

    #[test]
    fn prompt_limit_counts_characters_and_refuses_before_tokenizing() {
        let tok = qwen3();
        // 10 characters, 20 UTF-8 bytes: the limit is in characters.
        let text = "é".repeat(10);
        let v = serde_json::json!({"model": "m", "prompt": text});
        let full = prompt_tokens(&tok, ApiKind::Completions, &body(&v)).unwrap();
        assert_eq!(limited(&tok, ApiKind::Completions, &v, 10).unwrap(), full);
        assert_eq!(
            limited(&tok, ApiKind::Completions, &v, 9),
            Err(PromptError::PromptTooLong { limit: 9 })
        );
        // Several strings count in characters together (4 + 3 here, in
        // 8 + 6 bytes), however far below the limit the first ones are.
        let v = serde_json::json!({"model": "m", "prompt": ["éééé", "ééé"]});
        for limit in [7, 10, 13] {
            assert!(limited(&tok, ApiKind::Completions, &v, limit).is_ok());
        }
        assert!(limited(&tok, ApiKind::Completions, &v, 6).is_err());
        // A list prompt counts all its elements together.
        let v = serde_json::json!({"model": "m", "prompt": ["abcdef", "ghijkl"]});
        assert_eq!(
            limited(&tok, ApiKind::Completions, &v, 12)
                .unwrap()
                .engine_prompts
                .len(),
            2
        );
        assert_eq!(
            limited(&tok, ApiKind::Completions, &v, 11)
                .unwrap_err()
                .kind(),
            "prompt_too_long"
        );
        // Token-id prompts are not tokenized: no character limit applies.
        let v = serde_json::json!({"model": "m", "prompt": [1, 2, 3]});
        assert!(limited(&tok, ApiKind::Completions, &v, 0).is_ok());
    }

    #[test]
    fn chat_limit_applies_to_message_text_and_to_the_rendered_prompt() {
        let tok = qwen3();
        let v = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "0123456789"}]}]});
        let rendered = prompt_tokens(&tok, ApiKind::Chat, &body(&v))
            .unwrap()
            .engine_prompts[0]
            .rendered
            .clone()
            .unwrap();
        let n = rendered.chars().count();
        assert!(limited(&tok, ApiKind::Chat, &v, n).is_ok());
        // Over the rendered length but not over the message text: refused after rendering.
        assert_eq!(
            limited(&tok, ApiKind::Chat, &v, n - 1),
            Err(PromptError::PromptTooLong { limit: n - 1 })
        );
        // Message strings ("user", "text", "0123456789" = 18 chars) over the
        // limit: refused before rendering.
        assert_eq!(
            limited(&tok, ApiKind::Chat, &v, 17),
            Err(PromptError::PromptTooLong { limit: 17 })
        );
    }
}
