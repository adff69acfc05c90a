//! Contract edge cases where kvroute's request handling must equal
//! the engines', each quoted from the engine's own source (vLLM 0.33.0 and
//! SGLang 0.5.23 wheels; paths relative to the package) and run through the real
//! Qwen3 tokenizer and template.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{
    prompt_tokens, prompt_tokens_as, ApiKind, Dialect, ModelOptions, ModelTokenizer, PromptError,
    PromptLimits, PromptTokens,
};

fn qwen3() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
        ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap()
    })
}

fn run(endpoint: ApiKind, body: &str) -> Result<PromptTokens, PromptError> {
    prompt_tokens(qwen3(), endpoint, &parse_json(body.as_bytes()).unwrap())
}

fn user(content: &str) -> String {
    format!(r#"{{"model":"m","messages":[{{"role":"user","content":{content}}}]}}"#)
}

/// vLLM `renderers/chat_utils/chat_message.py:549-556`: a part type outside
/// `MM_PARSER_MAP` raises
/// `VLLMValidationError(f"Unsupported chat content part type: {part_type!r}. ...")`
/// → HTTP 400; kvroute counts the same request as a validation error, not as
/// an "unsupported multimodal" miss.
#[test]
fn an_unknown_content_part_type_is_a_validation_error() {
    let err = run(ApiKind::Chat, &user(r#"[{"type":"bogus","text":"hi"}]"#)).unwrap_err();
    assert_eq!(err.kind(), "render_validation", "{err}");
    assert!(err.is_request_error());
    assert!(
        err.to_string()
            .contains("Unsupported chat content part type"),
        "{err}"
    );
    // A real multimodal type stays "unsupported" (vLLM serves it; we cannot hash it).
    for media in [
        r#"[{"type":"image_url","image_url":{"url":"http://x/i.png"}}]"#,
        r#"[{"type":"input_audio","input_audio":{"data":"","format":"wav"}}]"#,
    ] {
        let err = run(ApiKind::Chat, &user(media)).unwrap_err();
        assert_eq!(err.kind(), "unsupported", "{media}: {err}");
        assert!(!err.is_request_error());
    }
}

/// vLLM `chat_message.py:458-462`: `if isinstance(part, str): ... return part`
/// (`str` is a member of `ChatCompletionContentPartParam`,
/// `renderers/chat_utils/types.py:279`): a bare string part is text, joined with
/// the others by "\n" like a text part.
#[test]
fn a_bare_string_content_part_is_text() {
    let as_parts = run(ApiKind::Chat, &user(r#"["a", {"type":"text","text":"b"}]"#)).unwrap();
    let as_text = run(ApiKind::Chat, &user(r#""a\nb""#)).unwrap();
    assert_eq!(
        as_parts.engine_prompts[0].token_ids,
        as_text.engine_prompts[0].token_ids
    );
}

/// vLLM `chat_completion/protocol.py:238`: `messages: list[ChatCompletionMessageParam]`
/// is required, so a completions-shaped body posted to the chat route is a 400
/// schema error (pydantic "Field required"), not something to tokenize.
#[test]
fn a_completions_body_on_the_chat_route_is_a_schema_error() {
    let err = run(ApiKind::Chat, r#"{"model":"m","prompt":"Hello"}"#).unwrap_err();
    assert_eq!(err.kind(), "request_validation", "{err}");
    assert!(err.is_request_error());
}

/// Empty `cache_salt`: vLLM refuses it (`entrypoints/generate/base/protocol.py:46-50`,
/// "Parameter 'cache_salt' must be a non-empty string if provided.", raised in a
/// `model_validator` → request_rule); SGLang 0.5.23 takes it as no salt
/// (`managers/io_struct.py:874` `value = self.cache_salt or None`,
/// `mem_cache/radix_cache.py:77` `self.cache_salt = cache_salt or None`), so its
/// blocks — and the prompt keys — are the unsalted ones.
#[test]
fn an_empty_cache_salt_follows_each_engine() {
    let body =
        parse_json(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":""}"#)
            .unwrap();
    let vllm = prompt_tokens(qwen3(), ApiKind::Chat, &body).unwrap_err();
    assert_eq!(vllm.kind(), "request_rule", "{vllm}");
    let limits = PromptLimits::default();
    let sglang = prompt_tokens_as(qwen3(), ApiKind::Chat, &body, limits, Dialect::Sglang).unwrap();
    assert_eq!(sglang.cache_salt, None);
    let plain = run(ApiKind::Chat, &user(r#""hi""#)).unwrap();
    assert_eq!(sglang.engine_prompts, plain.engine_prompts);
}
