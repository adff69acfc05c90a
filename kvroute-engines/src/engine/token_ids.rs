//! Token-id prompts ("tokenize once"): when a `/v1/completions` request may
//! go to an engine with its `prompt` replaced by the token ids kvroute
//! computed, and the reasons it goes as text otherwise ([`KeepText`]).
//!
//! Each engine decides in its [`super::Engine::token_ids_equivalent`]; the
//! fields every engine that takes id prompts reads the same way are checked
//! here ([`completion_with_text_prompt`]).

use crate::prompt::{PyDict, PyValue};
use crate::ApiKind;

/// Why a `/v1/completions` request went to the engine as text although
/// token-id forwarding was on (the counted reason).
///
/// Each reason is a case where sending `prompt` as the ids kvroute computed
/// would not be provably the same request to the engine. The engine-side
/// reasons come from [`super::Engine::token_ids_equivalent`]; `NoTokens`,
/// `Rewrite` and `PrefillDecode` are the host's.
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
    /// use kvroute_engines::engine::KeepText;
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

/// The checks shared by the engines that take a completions `prompt` of
/// token ids verbatim (vLLM, SGLang): a completions request whose `prompt`
/// is one non-empty string, without `prompt_embeds`, `echo`, `suffix` or
/// `truncate_prompt_tokens`. Returns the body's object for the engine's own
/// checks.
///
/// A field the engine reads as "off" when null/false/absent counts as set
/// for anything else (including a value of the wrong type, which the
/// engine refuses for text and ids alike).
///
/// # Errors
/// The [`KeepText`] reason.
pub(crate) fn completion_with_text_prompt(
    api: ApiKind,
    body: &PyValue,
) -> Result<&PyDict, KeepText> {
    if api == ApiKind::Chat {
        return Err(KeepText::Chat);
    }
    let Some(d) = body.as_dict() else {
        return Err(KeepText::PromptNotText);
    };
    if !matches!(d.get("prompt"), Some(PyValue::Str(s)) if !s.is_empty())
        || flag_set(d, "prompt_embeds")
    {
        return Err(KeepText::PromptNotText);
    }
    if flag_set(d, "echo") {
        return Err(KeepText::Echo);
    }
    if present(d, "suffix") {
        return Err(KeepText::Suffix);
    }
    if present(d, "truncate_prompt_tokens") {
        return Err(KeepText::Truncation);
    }
    Ok(d)
}

/// `name` is neither absent, `null` nor `false`.
pub(crate) fn flag_set(d: &PyDict, name: &str) -> bool {
    d.get(name)
        .is_some_and(|v| !matches!(v, PyValue::Null | PyValue::Bool(false)))
}

/// `name` is neither absent nor `null`.
pub(crate) fn present(d: &PyDict, name: &str) -> bool {
    d.get(name).is_some_and(|v| !v.is_null())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, LLAMA_CPP, SGLANG, TRTLLM, VLLM};
    use crate::prompt::parse_json;

    type Case = (
        &'static str,
        ApiKind,
        &'static dyn Engine,
        Result<(), KeepText>,
    );

    #[test]
    fn each_reason_keeps_the_text() {
        let cases: [Case; 16] = [
            (
                r#"{"model":"m","prompt":"x"}"#,
                ApiKind::Completions,
                &VLLM,
                Ok(()),
            ),
            (
                r#"{"model":"m","prompt":"x","add_special_tokens":false}"#,
                ApiKind::Completions,
                &VLLM,
                Ok(()),
            ),
            (
                r#"{"model":"m","prompt":"x","echo":false,"suffix":null}"#,
                ApiKind::Completions,
                &SGLANG,
                Ok(()),
            ),
            (
                r#"{"model":"m","prompt":"x","return_token_offsets":true}"#,
                ApiKind::Completions,
                &SGLANG,
                Ok(()),
            ),
            (
                r#"{"model":"m","messages":[]}"#,
                ApiKind::Chat,
                &VLLM,
                Err(KeepText::Chat),
            ),
            (
                r#"{"model":"m","messages":[]}"#,
                ApiKind::Chat,
                &TRTLLM,
                Err(KeepText::Chat),
            ),
            (
                r#"{"model":"m","prompt":[1,2]}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::PromptNotText),
            ),
            (
                r#"{"model":"m","prompt":["a","b"]}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::PromptNotText),
            ),
            (
                r#"{"model":"m","prompt":"x","prompt_embeds":"AAAA"}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::PromptNotText),
            ),
            (
                r#"{"model":"m","prompt":"x","echo":true}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::Echo),
            ),
            (
                r#"{"model":"m","prompt":"x","suffix":"y"}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::Suffix),
            ),
            (
                r#"{"model":"m","prompt":"x","truncate_prompt_tokens":8}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::Truncation),
            ),
            (
                r#"{"model":"m","prompt":"x","return_token_offsets":true}"#,
                ApiKind::Completions,
                &VLLM,
                Err(KeepText::TokenOffsets),
            ),
            (
                r#"{"model":"m","prompt":"x","add_special_tokens":true}"#,
                ApiKind::Completions,
                &SGLANG,
                Err(KeepText::AddSpecialTokens),
            ),
            (
                r#"{"model":"m","prompt":"x"}"#,
                ApiKind::Completions,
                &TRTLLM,
                Err(KeepText::Engine),
            ),
            (
                r#"{"model":"m","prompt":"x"}"#,
                ApiKind::Completions,
                &LLAMA_CPP,
                Err(KeepText::Engine),
            ),
        ];
        for (body, api, engine, want) in cases {
            let value = parse_json(body.as_bytes()).unwrap();
            assert_eq!(
                engine.token_ids_equivalent(api, &value),
                want,
                "{body} on {}",
                engine.name()
            );
        }
        // Not an object at all.
        let list = parse_json(b"[1]").unwrap();
        assert_eq!(
            VLLM.token_ids_equivalent(ApiKind::Completions, &list),
            Err(KeepText::PromptNotText)
        );
    }

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<_> = KeepText::ALL.iter().map(|k| k.to_string()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), KeepText::ALL.len());
    }
}
