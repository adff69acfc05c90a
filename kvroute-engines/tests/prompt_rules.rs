//! Rule-level tests of the prompt pipeline with the real Qwen3 tokenizer and
//! template: part joining, developer→system merge, continue_final_message,
//! truncation, tool JSON, completions shapes, misses.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{
    prompt_tokens, ApiKind, ModelOptions, ModelTokenizer, PromptError, PromptTokens, TokenizerPool,
};

fn qwen3_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3")
}

fn qwen3() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let opts = ModelOptions {
            max_model_len: Some(40960),
            ..ModelOptions::default()
        };
        ModelTokenizer::load(&qwen3_dir(), &opts).unwrap()
    })
}

fn run(endpoint: ApiKind, body: &str) -> Result<PromptTokens, PromptError> {
    prompt_tokens(qwen3(), endpoint, &parse_json(body.as_bytes()).unwrap())
}

fn chat_text(body: &str) -> String {
    run(ApiKind::Chat, body).unwrap().engine_prompts[0]
        .rendered
        .clone()
        .unwrap()
}

#[test]
fn parts_join_with_newline_and_drop_empty() {
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":[
        {"type":"text","text":"a"},{"type":"text","text":""},{"type":"input_text","text":"b"},
        {"type":"text","text":null},{"type":"refusal","refusal":"c"}]}]}"#,
    );
    assert_eq!(
        text,
        "<|im_start|>user\na\nb\nc<|im_end|>\n<|im_start|>assistant\n"
    );
    let miss = run(
        ApiKind::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
    );
    assert_eq!(miss.unwrap_err().kind(), "unsupported");
}

#[test]
fn developer_messages_merge_into_one_system() {
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"u"},
        {"role":"developer","content":"D"}]}"#,
    );
    assert_eq!(text, "<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
    // Without a developer message a late system message renders in place.
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":"u"},{"role":"system","content":"S"}]}"#,
    );
    assert_eq!(
        text,
        "<|im_start|>user\nu<|im_end|>\n<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn billing_header_line_is_removed_from_system_text() {
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"system","content":[
        {"type":"text","text":"x-anthropic-billing-header: abc"},{"type":"text","text":"x-anthropic-billing-header: q\nkeep"}]},
        {"role":"user","content":"u"}]}"#,
    );
    assert_eq!(text, "<|im_start|>system\nkeep<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
}

/// vLLM 0.33 `renderers/hf.py` `_consolidate_system_messages`: empty system
/// contents are left out of the merge; `chat_message.py:635`: the billing
/// header is stripped from `system` messages only, before a developer
/// message becomes a system one.
#[test]
fn the_system_merge_skips_empty_contents_and_keeps_a_developers_billing_line() {
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"system","content":""},
        {"role":"developer","content":"B"},{"role":"user","content":"u"}]}"#,
    );
    assert_eq!(
        text,
        "<|im_start|>system\nB<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    );
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"developer","content":"x-anthropic-billing-header: q\nBe brief."},
        {"role":"user","content":"u"}]}"#,
    );
    assert_eq!(text, "<|im_start|>system\nx-anthropic-billing-header: q\nBe brief.<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
}

/// vLLM 0.33 `ChatCompletionRequest._normalize_messages_before`:
/// `reasoning_content` is used only when `reasoning` is absent or null.
#[test]
fn reasoning_wins_over_reasoning_content() {
    let body = |fields: &str| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"q"}},
            {{"role":"assistant","content":"x"{fields}}}]}}"#
        )
    };
    // The last turn's reasoning renders (Qwen3 keeps it after the last query).
    let both = chat_text(&body(r#","reasoning":"A","reasoning_content":"B""#));
    assert!(both.contains("<think>\nA\n</think>"), "{both}");
    assert_eq!(both, chat_text(&body(r#","reasoning":"A""#)));
    let null = chat_text(&body(r#","reasoning":null,"reasoning_content":"B""#));
    assert_eq!(null, chat_text(&body(r#","reasoning":"B""#)));
}

#[test]
fn continue_final_message_leaves_the_turn_open() {
    let text = chat_text(
        r#"{"model":"m","add_generation_prompt":false,"continue_final_message":true,
        "messages":[{"role":"user","content":"q"},{"role":"assistant","content":"\n\nA  "}]}"#,
    );
    // Last message after the last query: think block, content lstripped of '\n', trailing spaces kept.
    assert_eq!(
        text,
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA  "
    );
    let err = run(
        ApiKind::Chat,
        r#"{"model":"m","add_generation_prompt":false,"continue_final_message":true,
        "messages":[{"role":"user","content":"q"},{"role":"weird","content":"x"}]}"#,
    )
    .unwrap_err();
    assert_eq!(err.kind(), "template_error");
}

#[test]
fn truncation_left_right_and_minus_one() {
    let body =
        |extra: &str| format!(r#"{{"model":"m","prompt":"one two three four five six"{extra}}}"#);
    let full = run(ApiKind::Completions, &body("")).unwrap().engine_prompts[0]
        .token_ids
        .clone();
    assert!(full.len() > 3);
    let left = run(
        ApiKind::Completions,
        &body(r#","truncate_prompt_tokens":3"#),
    )
    .unwrap();
    assert!(left.truncated);
    assert_eq!(left.engine_prompts[0].token_ids, full[full.len() - 3..]);
    assert_eq!(
        left.engine_prompts[0].rendered.as_deref(),
        Some("one two three four five six")
    );
    let right = run(
        ApiKind::Completions,
        &body(r#","truncate_prompt_tokens":3,"truncation_side":"right""#),
    )
    .unwrap();
    assert_eq!(right.engine_prompts[0].token_ids, full[..3]);
    let all = run(
        ApiKind::Completions,
        &body(r#","truncate_prompt_tokens":-1"#),
    )
    .unwrap();
    assert!(!all.truncated);
    assert_eq!(all.engine_prompts[0].token_ids, full);
    assert_eq!(
        run(
            ApiKind::Completions,
            &body(r#","truncate_prompt_tokens":-2"#)
        )
        .unwrap_err()
        .kind(),
        "request_validation"
    );
}

#[test]
fn tool_json_is_python_json_dumps() {
    let text = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":"u"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f",
         "arguments":"{\"x\":1e2,\"y\":0.50,\"z\":1.5e-7,\"w\":1e21,\"n\":-0.0,\"big\":123456789012345678901234567890,\"s\":\"é<&>\"}"}},
         {"id":"2","type":"function","function":{"name":"g","arguments":"[1]"}}]}],
        "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","minimum":1E2}},"extra":1}]}"#,
    );
    assert!(text.contains(r#"{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object", "minimum": 100.0}}}"#), "{text}");
    assert!(text.contains(r#""arguments": {"x": 100.0, "y": 0.5, "z": 1.5e-07, "w": 1e+21, "n": -0.0, "big": 123456789012345678901234567890, "s": "é<&>"}}"#), "{text}");
    // A non-object arguments string becomes {}.
    assert!(text.contains(r#"{"name": "g", "arguments": {}}"#), "{text}");
    let err = run(
        ApiKind::Chat,
        r#"{"model":"m","messages":[{"role":"assistant","content":"","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":{}}}]}]}"#,
    );
    assert_eq!(err.unwrap_err().kind(), "request_validation");
}

#[test]
fn kwargs_merge_and_reasoning_effort() {
    let plain = chat_text(r#"{"model":"m","messages":[{"role":"user","content":"u"}]}"#);
    // Top-level add_generation_prompt wins over chat_template_kwargs; unknown kwargs vanish.
    let same = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":"u"}],
        "chat_template_kwargs":{"add_generation_prompt":false,"unknown":1}}"#,
    );
    assert_eq!(plain, same);
    let off = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":"u"}],"reasoning_effort":"none"}"#,
    );
    assert_eq!(off, format!("{plain}<think>\n\n</think>\n\n"));
    let kept = chat_text(
        r#"{"model":"m","messages":[{"role":"user","content":"u"}],"reasoning_effort":"none",
        "chat_template_kwargs":{"enable_thinking":true}}"#,
    );
    assert_eq!(kept, plain);
}

#[test]
fn completions_shapes_and_engine_checks() {
    let p = run(
        ApiKind::Completions,
        r#"{"model":"m","prompt":[[1,2],[3]]}"#,
    )
    .unwrap();
    assert_eq!(p.engine_prompts.len(), 2);
    assert_eq!(p.engine_prompts[1].token_ids, vec![3]);
    assert_eq!(p.engine_prompts[1].rendered, None);
    assert_eq!(
        run(ApiKind::Completions, r#"{"model":"m","prompt":["a",""]}"#)
            .unwrap_err()
            .kind(),
        "engine_input"
    );
    assert_eq!(
        run(
            ApiKind::Completions,
            r#"{"model":"m","prompt":[999999999]}"#
        )
        .unwrap_err()
        .kind(),
        "engine_input"
    );
    let long = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a ".repeat(41000));
    assert_eq!(
        run(ApiKind::Completions, &long).unwrap_err().kind(),
        "engine_input"
    );
}

#[test]
fn pool_misses_are_typed() {
    let pool = TokenizerPool::new();
    pool.register("qwen", qwen3_dir());
    pool.register(
        "broken",
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("no-such-dir"),
    );
    assert!(matches!(
        pool.prompt_tokens(ApiKind::Chat, b"hello there"),
        Err(PromptError::NotJson(_))
    ));
    assert_eq!(
        pool.prompt_tokens(ApiKind::Chat, br#"{"messages":[]}"#),
        Err(PromptError::NoModel)
    );
    assert_eq!(
        pool.prompt_tokens(ApiKind::Chat, br#"{"model":"other","messages":[]}"#),
        Err(PromptError::UnknownModel("other".into()))
    );
    assert_eq!(
        pool.prompt_tokens(ApiKind::Chat, br#"{"model":"broken","messages":[]}"#)
            .unwrap_err()
            .kind(),
        "model_load"
    );
    let ok = pool
        .prompt_tokens(
            ApiKind::Chat,
            br#"{"model":"qwen","messages":[{"role":"user","content":"Hello!"}],"cache_salt":"s"}"#,
        )
        .unwrap();
    assert_eq!(
        ok.engine_prompts[0].token_ids,
        vec![151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
    );
    assert_eq!(ok.cache_salt.as_deref(), Some("s"));
    let a = pool.get("qwen").unwrap();
    pool.reload("qwen");
    let b = pool.get("qwen").unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a, &b));
}

/// A template that loops over content parts gets vLLM's "openai" content
/// (vLLM 0.33 `chat_message.py`): an empty text part stays (its dict is
/// truthy, `parse_chat_message_content_parts`), and a tool message's text
/// parts are joined into one string (`parse_chat_message_content`, role
/// "tool").
#[test]
fn openai_content_keeps_empty_parts_and_joins_tool_results() {
    let dir = std::env::temp_dir().join(format!("kvroute-openai-fmt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json.gz", "tokenizer_config.json"] {
        std::fs::copy(qwen3_dir().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for message in messages %}{{ message.role }}:\
         {% if message.content is string %}S({{ message.content }})\
         {% else %}{% for c in message.content %}[{{ c.text }}]{% endfor %}{% endif %}|\
         {% endfor %}",
    )
    .unwrap();
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
    let body = r#"{"model":"m","add_generation_prompt":false,"messages":[
        {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""}]},
        {"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function",
            "function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":[{"type":"text","text":"r1"},{"type":"text","text":"r2"}]}]}"#;
    let p = prompt_tokens(&tok, ApiKind::Chat, &parse_json(body.as_bytes()).unwrap()).unwrap();
    assert_eq!(
        p.engine_prompts[0].rendered.as_deref(),
        Some("user:[a][]|assistant:[]|tool:S(r1\nr2)|")
    );
    // Engines run with `--chat-template-content-format string`: strings.
    let forced = ModelTokenizer::load(
        &dir,
        &ModelOptions {
            content_format: Some(kvroute_engines::prompt::ContentFormat::String),
            ..ModelOptions::default()
        },
    )
    .unwrap();
    let p = prompt_tokens(
        &forced,
        ApiKind::Chat,
        &parse_json(body.as_bytes()).unwrap(),
    )
    .unwrap();
    assert_eq!(
        p.engine_prompts[0].rendered.as_deref(),
        Some("user:S(a)|assistant:S()|tool:S(r1\nr2)|")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
