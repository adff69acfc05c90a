//! Entry points for the cargo-fuzz targets `openai_request`, `chat_template`
//! and `byte_bpe` (and the corpus replay test). Not a stable API.

use std::path::Path;
use std::sync::OnceLock;

use super::tokenizer::{ModelOptions, ModelTokenizer};

use super::chat::template_input;
use super::pyvalue::{parse_json, PyDict, PyValue};
use super::request::{extract_request_as, ApiKind, Dialect, OpenAiRequest};
use super::template::ChatTemplate;

/// The Qwen3 chat template, embedded so the fuzz targets need no files.
pub const QWEN3_TEMPLATE: &str = include_str!("qwen3_chat_template.jinja");

fn qwen3() -> Option<&'static ChatTemplate> {
    static T: OnceLock<Option<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        ChatTemplate::new(
            QWEN3_TEMPLATE,
            vec![
                ("eos_token".into(), "<|im_end|>".into()),
                ("pad_token".into(), "<|endoftext|>".into()),
            ],
        )
        .ok()
    })
    .as_ref()
}

/// The fields the skimming reader keeps in the fuzz target.
const FIELDS: [&str; 2] = ["model", "stream"];

/// The oracle of [`super::pyvalue::parse_json_fields`]: [`parse_json`]'s
/// result with the top-level dict cut down to `model` and `stream` (in that order),
/// anything else valid read as `Null`.
pub fn fields_of(
    parsed: &Result<PyValue, super::pyvalue::JsonSyntaxError>,
) -> Result<PyValue, super::pyvalue::JsonSyntaxError> {
    match parsed {
        Ok(PyValue::Dict(d)) => {
            let mut kept = PyDict::new();
            for (k, v) in d.iter().filter(|(k, _)| FIELDS.contains(&k.as_str())) {
                kept.insert(k.clone(), v.clone());
            }
            Ok(PyValue::Dict(kept))
        }
        Ok(_) => Ok(PyValue::Null),
        Err(e) => Err(e.clone()),
    }
}

/// Arbitrary bytes as a body: parse, extract for both endpoints, and render chat
/// requests with the Qwen3 template, as vLLM and as SGLang. Must never panic.
/// Returns vLLM's rendered text length (so the work is not optimised away).
pub fn openai_request(data: &[u8]) -> usize {
    let parsed = parse_json(data);
    // The skimming reader agrees with the full one on everything it keeps.
    // Compared as text: a `NaN` value is equal to itself there.
    assert_eq!(
        format!("{:?}", super::pyvalue::parse_json_fields(data, &FIELDS)),
        format!("{:?}", fields_of(&parsed)),
        "parse_json_fields differs from parse_json"
    );
    let Ok(body) = parsed else {
        return 0;
    };
    let mut n = 0;
    for endpoint in [ApiKind::Chat, ApiKind::Completions] {
        if let Ok(OpenAiRequest::Chat(chat)) = extract_request_as(endpoint, &body, Dialect::Vllm) {
            n += render_len(&chat);
        }
        // SGLang's chat path takes the same bytes (its outcome is not
        // counted: the corpus names say what vLLM does).
        if let Ok(OpenAiRequest::Chat(chat)) = extract_request_as(endpoint, &body, Dialect::Sglang)
        {
            std::hint::black_box(render_len(&chat));
        }
    }
    n
}

/// The rendered length of `chat` under its dialect's chat path, 0 when it
/// is refused.
fn render_len(chat: &super::ChatRequest) -> usize {
    let Some(t) = qwen3() else { return 0 };
    let rendered = match chat.dialect {
        Dialect::Vllm => template_input(chat, t)
            .ok()
            .and_then(|input| t.render(&input).ok()),
        Dialect::Sglang => super::chat_sglang::template_input(chat, t)
            .ok()
            .and_then(|s| super::chat_sglang::render(t, s.input, usize::MAX).ok())
            .map(|(_, r)| r),
    };
    rendered.map_or(0, |s| s.len())
}

/// Structured random conversation from bytes: each byte pair picks a role and
/// a content shape, so the fuzzer explores role orders, tool calls, reasoning
/// and parts rather than JSON syntax, through vLLM's and SGLang's chat paths.
/// Must never panic. Returns vLLM's rendered length.
pub fn chat_template(data: &[u8]) -> usize {
    const ROLES: [&str; 6] = ["system", "user", "assistant", "tool", "developer", "other"];
    const TEXTS: [&str; 8] = [
        "",
        "hello",
        "<think>\nr\n</think>\n\nanswer",
        "<tool_response>x</tool_response>",
        "<|im_end|>",
        " \n\t ",
        "é\u{301}😀",
        "{\"a\": 1}",
    ];
    let pick = |b: u8, n: usize| usize::from(b) % n;
    let mut messages = Vec::new();
    let mut chunks = data.chunks(2);
    let flags = chunks.next().and_then(|c| c.first()).copied().unwrap_or(0);
    for c in chunks.take(64) {
        let (a, b) = (
            c.first().copied().unwrap_or(0),
            c.get(1).copied().unwrap_or(0),
        );
        let role = ROLES.get(pick(a, ROLES.len())).copied().unwrap_or("user");
        let text = TEXTS.get(pick(b, TEXTS.len())).copied().unwrap_or("");
        let mut m = PyDict::new();
        m.insert("role".into(), PyValue::Str(role.into()));
        let content = match a / 8 % 4 {
            0 => PyValue::Str(text.into()),
            1 => PyValue::Null,
            2 => PyValue::List(vec![
                part("text", text),
                part("text", ""),
                part("refusal", text),
            ]),
            _ => PyValue::List(Vec::new()),
        };
        m.insert("content".into(), content);
        if role == "assistant" && b & 0x10 != 0 {
            m.insert("reasoning_content".into(), PyValue::Str(text.into()));
        }
        if role == "assistant" && b & 0x20 != 0 {
            let args = if b & 0x40 != 0 {
                "{\"x\": 1e2}"
            } else {
                "not json"
            };
            m.insert("tool_calls".into(), tool_calls(args));
        }
        messages.push(PyValue::Dict(m));
    }
    let mut body = PyDict::new();
    body.insert("model".into(), PyValue::Str("m".into()));
    body.insert("messages".into(), PyValue::List(messages));
    let cont = flags & 1 != 0;
    body.insert(
        "add_generation_prompt".into(),
        PyValue::Bool(!cont && flags & 2 != 0),
    );
    body.insert("continue_final_message".into(), PyValue::Bool(cont));
    if flags & 4 != 0 {
        let mut kw = PyDict::new();
        kw.insert("enable_thinking".into(), PyValue::Bool(flags & 8 != 0));
        body.insert("chat_template_kwargs".into(), PyValue::Dict(kw));
    }
    let body = PyValue::Dict(body);
    // SGLang's chat path runs on the same request; vLLM's length is returned.
    let rendered = |d| match extract_request_as(ApiKind::Chat, &body, d) {
        Ok(OpenAiRequest::Chat(chat)) => render_len(&chat),
        _ => 0,
    };
    std::hint::black_box(rendered(Dialect::Sglang));
    rendered(Dialect::Vllm)
}

fn part(ty: &str, text: &str) -> PyValue {
    let mut d = PyDict::new();
    d.insert("type".into(), PyValue::Str(ty.into()));
    let key = if ty == "refusal" { "refusal" } else { "text" };
    d.insert(key.into(), PyValue::Str(text.into()));
    PyValue::Dict(d)
}

fn tool_calls(arguments: &str) -> PyValue {
    let mut f = PyDict::new();
    f.insert("name".into(), PyValue::Str("f".into()));
    f.insert("arguments".into(), PyValue::Str(arguments.into()));
    let mut c = PyDict::new();
    c.insert("id".into(), PyValue::Str("c".into()));
    c.insert("type".into(), PyValue::Str("function".into()));
    c.insert("function".into(), PyValue::Dict(f));
    PyValue::List(vec![PyValue::Dict(c)])
}

fn qwen3_tokenizer() -> Option<&'static ModelTokenizer> {
    static T: OnceLock<Option<ModelTokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
        // A small span cache, so long runs also go through its evictions.
        let options = ModelOptions {
            span_cache_bytes: 1 << 20,
            ..ModelOptions::default()
        };
        ModelTokenizer::load(&dir, &options).ok()
    })
    .as_ref()
}

/// Arbitrary bytes as text (lossy UTF-8) through the real Qwen3 tokenizer:
/// kvroute's encode (span cache, NFC gate, the fast byte-level BPE path
/// with its pre-token cache) must give `tokenizers`' own ids, with and
/// without special tokens. Panics on a difference — the fuzzer's signal.
/// Returns the number of ids.
///
/// # Panics
///
/// When the two tokenizations differ, or the tokenizer files are missing.
pub fn byte_bpe(data: &[u8]) -> usize {
    let Some(tok) = qwen3_tokenizer() else {
        panic!("golden/tokenizers/qwen3 could not be loaded");
    };
    let text = String::from_utf8_lossy(data);
    let mut n = 0;
    for add_special in [false, true] {
        let ours = tok.encode(&text, add_special);
        let reference = tok.encode_uncached(&text, add_special);
        match (ours, reference) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "ids differ for {text:?}");
                n += a.len();
            }
            (Err(_), Err(_)) => {}
            (a, b) => panic!("one encode failed for {text:?}: {a:?} vs {b:?}"),
        }
    }
    n
}
