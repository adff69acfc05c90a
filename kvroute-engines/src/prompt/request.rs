//! OpenAI request bodies → the fields that decide the prompt (vLLM 0.33 defaults
//! and validators). Sampling, streaming and unknown fields are ignored.

use super::error::PromptError;
use super::pyvalue::{PyDict, PyValue};

/// Which OpenAI API a body was posted to (not a backend: that is
/// `kvroute_select::Endpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

impl ApiKind {
    /// The endpoint for a request path, `None` for anything else.
    ///
    /// ```
    /// use kvroute_engines::prompt::ApiKind;
    /// assert_eq!(ApiKind::from_path("/v1/chat/completions"), Some(ApiKind::Chat));
    /// assert_eq!(ApiKind::from_path("/v1/completions?x=1"), Some(ApiKind::Completions));
    /// ```
    #[must_use]
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or("").trim_end_matches('/');
        if path.ends_with("/chat/completions") {
            Some(Self::Chat)
        } else if path.ends_with("/completions") {
            Some(Self::Completions)
        } else {
            None
        }
    }

    /// Guesses the endpoint from the body: `messages` → chat, else completions.
    #[must_use]
    pub fn detect(body: &PyValue) -> Self {
        match body.as_dict() {
            Some(d) if d.contains_key("messages") => Self::Chat,
            _ => Self::Completions,
        }
    }

    /// The golden-file name (`"chat"` / `"completions"`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
        }
    }
}

/// Which end of an over-long prompt `truncate_prompt_tokens` keeps, when the
/// request says (`truncation_side`); without it vLLM truncates inside the
/// tokenizer, keeping the last tokens and the special tokens it adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TruncationSide {
    /// Keep the last N tokens.
    Left,
    /// Keep the first N tokens.
    Right,
}

/// Fields shared by both endpoints.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CommonFields {
    /// The model slug.
    pub model: String,
    /// `add_special_tokens` (chat default false, completions true).
    pub add_special_tokens: bool,
    /// `truncate_prompt_tokens` (`-1` = model maximum).
    pub truncate_prompt_tokens: Option<i64>,
    /// `truncation_side` (`None`: not given).
    pub truncation_side: Option<TruncationSide>,
    /// `cache_salt`: ids unchanged, block 0's hash changes. Always non-empty
    /// (vLLM refuses an empty salt; `null` is the same as absent).
    pub cache_salt: Option<String>,
    /// The tokens the request asks to generate, as its dialect reads them.
    /// vLLM: `max_tokens`, or on chat `max_completion_tokens` first (only
    /// `0` matters: it changes what `-1` truncates to). SGLang: its
    /// `max_new_tokens` (completions `max_tokens`, default 16; chat
    /// `max_completion_tokens or max_tokens`), which its context check adds
    /// to the prompt's length.
    pub max_tokens: Option<i64>,
}

/// What a `/v1/completions` `prompt` is, and so what the engine receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionPrompt {
    /// A string: one engine prompt, tokenized with special tokens by default.
    Text(String),
    /// A token-id list: one engine prompt, used verbatim.
    Ids(Vec<i64>),
    /// A list of strings: one engine request per string, each hashed separately.
    Texts(Vec<String>),
    /// A list of token-id lists: one engine request per list.
    IdLists(Vec<Vec<i64>>),
}

/// A `/v1/completions` body reduced to what decides its prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// Shared fields.
    pub common: CommonFields,
    /// The prompt.
    pub prompt: CompletionPrompt,
}

/// A `/v1/chat/completions` body reduced to what decides its prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatRequest {
    /// Shared fields.
    pub common: CommonFields,
    /// The raw `messages` array (validated when the template input is built).
    pub messages: Vec<PyValue>,
    /// `tools` as sent.
    pub tools: Option<Vec<PyValue>>,
    /// `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false).
    pub continue_final_message: bool,
    /// `chat_template_kwargs`.
    pub chat_template_kwargs: PyDict,
    /// `documents`.
    pub documents: Option<PyValue>,
    /// `reasoning_effort`.
    pub reasoning_effort: Option<PyValue>,
    /// `tool_choice` (SGLang renders tools by it).
    pub tool_choice: Option<PyValue>,
    /// `reasoning` (SGLang takes its effort as `reasoning_effort`).
    pub reasoning: Option<PyValue>,
    /// Whose chat path renders the request.
    pub dialect: Dialect,
}

/// A parsed request of either endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum OpenAiRequest {
    /// Chat completions.
    Chat(Box<ChatRequest>),
    /// Completions.
    Completions(CompletionRequest),
}

impl OpenAiRequest {
    /// The common fields.
    #[must_use]
    pub fn common(&self) -> &CommonFields {
        match self {
            Self::Chat(c) => &c.common,
            Self::Completions(c) => &c.common,
        }
    }
}

/// The `model` of a JSON body, if it is a string. Cheap: no validation.
#[must_use]
pub fn model_of(body: &PyValue) -> Option<&str> {
    body.as_dict()?.get("model")?.as_str()
}

fn invalid(field: &str, want: &str, got: &PyValue) -> PromptError {
    PromptError::RequestValidation(format!("{field}: expected {want}, got {}", got.type_name()))
}

/// A present, non-null field.
fn field<'a>(d: &'a PyDict, name: &str) -> Option<&'a PyValue> {
    d.get(name).filter(|v| !v.is_null())
}

fn opt_bool(d: &PyDict, name: &str, default: bool) -> Result<bool, PromptError> {
    match d.get(name) {
        None => Ok(default),
        Some(PyValue::Bool(b)) => Ok(*b),
        // pydantic lax mode accepts 0/1 and a few strings for bool fields.
        Some(PyValue::Int(0)) => Ok(false),
        Some(PyValue::Int(1)) => Ok(true),
        Some(PyValue::Str(s)) => match s.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" | "t" | "y" => Ok(true),
            "false" | "0" | "no" | "off" | "f" | "n" => Ok(false),
            _ => Err(invalid(name, "a boolean", &PyValue::Str(s.clone()))),
        },
        Some(other) => Err(invalid(name, "a boolean", other)),
    }
}

fn opt_int(d: &PyDict, name: &str) -> Result<Option<i64>, PromptError> {
    match field(d, name) {
        None => Ok(None),
        Some(PyValue::Int(i)) => Ok(Some(*i)),
        Some(PyValue::Float(f)) if f.fract() == 0.0 && f.abs() < 9e15 => Ok(Some(*f as i64)),
        Some(other) => Err(invalid(name, "an integer", other)),
    }
}

fn opt_string(d: &PyDict, name: &str) -> Result<Option<String>, PromptError> {
    match field(d, name) {
        None => Ok(None),
        Some(PyValue::Str(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid(name, "a string", other)),
    }
}

/// Whose request validators apply where the engines differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dialect {
    /// vLLM 0.33 (the reference of this module).
    #[default]
    Vllm,
    /// SGLang 0.5.23: `cache_salt` is normalised, not validated, and chat
    /// requests are rendered by SGLang's chat path (its message and tool
    /// models, a last assistant message asked again as a user message,
    /// text parts joined with a space; see `docs/contracts.md`).
    Sglang,
}

/// SGLang's completions `max_tokens` when the request has none.
const SGLANG_COMPLETION_MAX_TOKENS: i64 = 16;

/// Longest `cache_salt` vLLM accepts (`_MAX_CACHE_SALT_LENGTH`).
const MAX_CACHE_SALT_CHARS: usize = 128;

/// `cache_salt` as the engine validates it; never silently dropped when the
/// engine would use it (the salt changes block 0's key, so routing without it
/// would predict wrong hits).
///
/// * vLLM 0.33 (`entrypoints/generate/base/protocol.py:42-56`, run by a
///   `model_validator(mode="before")` of both requests,
///   `chat_completion/protocol.py:568-574`): `None` passes; anything that is
///   not a non-empty string of at most 128 characters without `@`, `/`, `\`
///   or NUL raises `VLLMValidationError` → 400 (`request_rule`, before any field
///   type check).
/// * SGLang 0.5.23: `GenerateReqInput._normalize_cache_salt` turns a string into
///   `value or None` (`managers/io_struct.py:873-875`) and `RadixKey` keeps
///   `cache_salt or None` (`mem_cache/radix_cache.py:77`): an empty salt is no
///   salt, the blocks are the unsalted ones. A batch (`batch`: its prompt
///   count) may give a list with one salt per prompt (`io_struct.py:876-884`);
///   a single prompt takes a string only (`io_struct.py:575-580`), unless
///   `n` > 1 makes it a batch of one (`_handle_parallel_sampling`). The salt
///   returned is the first prompt's, the one the request is routed by.
fn cache_salt(
    d: &PyDict,
    dialect: Dialect,
    batch: Option<usize>,
) -> Result<Option<String>, PromptError> {
    let rule = |msg: &str| PromptError::RequestRule(format!("cache_salt: {msg}"));
    match (dialect, field(d, "cache_salt")) {
        (_, None) => Ok(None),
        (Dialect::Sglang, Some(PyValue::Str(s))) => Ok((!s.is_empty()).then(|| s.clone())),
        (Dialect::Sglang, Some(PyValue::List(items))) => {
            let salts = items
                .iter()
                .map(PyValue::as_str)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    PromptError::RequestValidation("cache_salt: expected strings".into())
                })?;
            let size = match batch {
                Some(k) => k,
                None if opt_int(d, "n")?.unwrap_or(1) > 1 => 1,
                None => return Err(rule("should be a string for a single request")),
            };
            if salts.len() != size {
                return Err(rule("the length should be equal to the batch size"));
            }
            Ok(salts
                .first()
                .filter(|s| !s.is_empty())
                .map(|s| (*s).to_owned()))
        }
        (Dialect::Sglang, Some(other)) => Err(invalid("cache_salt", "a string or a list", other)),
        (Dialect::Vllm, Some(PyValue::Str(s))) if s.is_empty() => {
            Err(rule("must be a non-empty string if provided"))
        }
        (Dialect::Vllm, Some(PyValue::Str(s))) => {
            if s.chars().count() > MAX_CACHE_SALT_CHARS
                || s.chars().any(|c| matches!(c, '@' | '/' | '\\' | '\0'))
            {
                return Err(rule(
                    "must be at most 128 characters and must not contain '@', '/', '\\', or NUL",
                ));
            }
            Ok(Some(s.clone()))
        }
        (Dialect::Vllm, Some(_)) => Err(rule("must be a non-empty string if provided")),
    }
}

/// The fields both endpoints share; `batch`: the prompt count of a
/// completions prompt given as a list of prompts (`None`: one prompt).
fn common_fields(
    d: &PyDict,
    model: &str,
    add_special_default: bool,
    dialect: Dialect,
    batch: Option<usize>,
) -> Result<CommonFields, PromptError> {
    // SGLang's chat and completions requests have neither field, nor
    // `add_special_tokens` (`protocol.py`): they are ignored, whatever their
    // value; its tokenizer adds the special tokens to a completions prompt
    // (`TokenizerManager._tokenize_texts`), never to a rendered chat.
    let ignored = dialect == Dialect::Sglang;
    let truncate_prompt_tokens = if ignored {
        None
    } else {
        opt_int(d, "truncate_prompt_tokens")?
    };
    if let Some(n) = truncate_prompt_tokens {
        if n < -1 {
            return Err(PromptError::RequestValidation(
                "truncate_prompt_tokens must be >= -1".into(),
            ));
        }
    }
    let side = if ignored {
        None
    } else {
        opt_string(d, "truncation_side")?
    };
    let truncation_side = match side.as_deref() {
        None => None,
        Some("left") => Some(TruncationSide::Left),
        Some("right") => Some(TruncationSide::Right),
        Some(other) => {
            return Err(PromptError::RequestValidation(format!(
                "truncation_side: expected 'left' or 'right', got {other:?}"
            )))
        }
    };
    let cache_salt = cache_salt(d, dialect, batch)?;
    let chat = !add_special_default;
    let max_tokens = match dialect {
        // `max_completion_tokens` is a chat field: vLLM's completions
        // request has only `max_tokens` (`build_tok_params`).
        Dialect::Vllm if chat => match opt_int(d, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => opt_int(d, "max_tokens")?,
        },
        Dialect::Vllm => opt_int(d, "max_tokens")?,
        // `max_completion_tokens or max_tokens` (`protocol.py:1214`): a 0
        // falls through as Python's `or` does.
        Dialect::Sglang if chat => opt_int(d, "max_completion_tokens")?
            .filter(|n| *n != 0)
            .or(opt_int(d, "max_tokens")?),
        // `max_tokens: int = 16`, positive (`protocol.py:378, 448-453`).
        Dialect::Sglang => match d.get("max_tokens") {
            None => Some(SGLANG_COMPLETION_MAX_TOKENS),
            Some(PyValue::Null) => return Err(invalid("max_tokens", "an integer", &PyValue::Null)),
            Some(_) => match opt_int(d, "max_tokens")? {
                Some(n) if n > 0 => Some(n),
                _ => {
                    return Err(PromptError::RequestValidation(
                        "max_tokens must be positive".into(),
                    ))
                }
            },
        },
    };
    Ok(CommonFields {
        model: model.to_owned(),
        add_special_tokens: if ignored {
            add_special_default
        } else {
            opt_bool(d, "add_special_tokens", add_special_default)?
        },
        truncate_prompt_tokens,
        truncation_side,
        cache_salt,
        max_tokens,
    })
}

/// Extracts and validates the prompt-deciding fields of a body.
///
/// ```
/// use kvroute_engines::prompt::{extract_request, parse_json, ApiKind, CompletionPrompt, OpenAiRequest};
/// let body = parse_json(br#"{"model": "m", "prompt": [1, 2, 3]}"#).unwrap();
/// let OpenAiRequest::Completions(req) = extract_request(ApiKind::Completions, &body).unwrap() else { panic!() };
/// assert_eq!(req.prompt, CompletionPrompt::Ids(vec![1, 2, 3]));
/// assert!(req.common.add_special_tokens);
/// ```
pub fn extract_request(endpoint: ApiKind, body: &PyValue) -> Result<OpenAiRequest, PromptError> {
    extract_request_as(endpoint, body, Dialect::Vllm)
}

/// [`extract_request`] with `dialect`'s validators where the engines differ.
///
/// A body of the other endpoint's shape is a schema error, as in the engine
/// (a completions body on the chat route lacks the required `messages`,
/// `chat_completion/protocol.py:238`; a chat body on the completions route
/// lacks `prompt`), never guessed from the body.
pub fn extract_request_as(
    endpoint: ApiKind,
    body: &PyValue,
    dialect: Dialect,
) -> Result<OpenAiRequest, PromptError> {
    let d = body
        .as_dict()
        .ok_or_else(|| invalid("body", "a JSON object", body))?;
    let model = match d.get("model") {
        Some(PyValue::Str(s)) => s.as_str(),
        None | Some(PyValue::Null) => return Err(PromptError::NoModel),
        Some(other) => return Err(invalid("model", "a string", other)),
    };
    match endpoint {
        ApiKind::Chat => extract_chat(d, model, dialect).map(|c| OpenAiRequest::Chat(Box::new(c))),
        ApiKind::Completions => {
            extract_completion(d, model, dialect).map(OpenAiRequest::Completions)
        }
    }
}

fn extract_chat(d: &PyDict, model: &str, dialect: Dialect) -> Result<ChatRequest, PromptError> {
    let messages = match d.get("messages") {
        Some(PyValue::List(l)) => l.clone(),
        Some(other) => return Err(invalid("messages", "a list", other)),
        None => {
            return Err(PromptError::RequestValidation(
                "messages: field required".into(),
            ))
        }
    };
    let sglang = dialect == Dialect::Sglang;
    let tools = match field(d, "tools") {
        None => None,
        // SGLang takes an empty list as no tools.
        Some(PyValue::List(l)) if l.is_empty() && !sglang => {
            return Err(PromptError::RequestRule(
                "tools: an empty list is not allowed; omit the field".into(),
            ))
        }
        Some(PyValue::List(l)) => Some(l.clone()),
        Some(other) => return Err(invalid("tools", "a list", other)),
    };
    // SGLang's chat request has no `add_generation_prompt`: the generation
    // prompt is always added, and continuing the last message does not
    // conflict with it.
    let add_generation_prompt = sglang || opt_bool(d, "add_generation_prompt", true)?;
    let continue_final_message = opt_bool(d, "continue_final_message", false)?;
    if add_generation_prompt && continue_final_message && !sglang {
        return Err(PromptError::RequestRule(
            "continue_final_message and add_generation_prompt cannot both be true".into(),
        ));
    }
    let chat_template_kwargs = match field(d, "chat_template_kwargs") {
        None => PyDict::new(),
        Some(PyValue::Dict(k)) => k.clone(),
        Some(other) => return Err(invalid("chat_template_kwargs", "an object", other)),
    };
    if field(d, "chat_template").is_some()
        || field(&chat_template_kwargs, "chat_template").is_some()
    {
        return Err(PromptError::RenderRule(
            "a request-supplied chat_template needs --trust-request-chat-template".into(),
        ));
    }
    Ok(ChatRequest {
        common: common_fields(d, model, false, dialect, None)?,
        messages,
        tools,
        add_generation_prompt,
        continue_final_message,
        chat_template_kwargs,
        documents: field(d, "documents").cloned(),
        reasoning_effort: field(d, "reasoning_effort").cloned(),
        tool_choice: field(d, "tool_choice").cloned(),
        reasoning: field(d, "reasoning").cloned(),
        dialect,
    })
}

fn id_list(items: &[PyValue]) -> Option<Vec<i64>> {
    items
        .iter()
        .map(|v| match v {
            PyValue::Int(i) => Some(*i),
            _ => None,
        })
        .collect()
}

fn extract_completion(
    d: &PyDict,
    model: &str,
    dialect: Dialect,
) -> Result<CompletionRequest, PromptError> {
    if field(d, "prompt_embeds").is_some() {
        return Err(PromptError::Unsupported("prompt_embeds".into()));
    }
    let empty = || PromptError::RequestRule("prompt must not be empty".into());
    let prompt = match field(d, "prompt") {
        None => {
            return Err(PromptError::RequestRule(
                "either prompt or prompt_embeds must be provided".into(),
            ))
        }
        Some(PyValue::Str(s)) if s.is_empty() => return Err(empty()),
        Some(PyValue::Str(s)) => CompletionPrompt::Text(s.clone()),
        Some(PyValue::List(items)) if items.is_empty() => return Err(empty()),
        Some(PyValue::List(items)) => {
            if let Some(ids) = id_list(items) {
                CompletionPrompt::Ids(ids)
            } else if let Some(texts) = items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
            {
                CompletionPrompt::Texts(texts)
            } else if let Some(lists) = items
                .iter()
                .map(|v| v.as_list().and_then(id_list))
                .collect::<Option<Vec<_>>>()
            {
                CompletionPrompt::IdLists(lists)
            } else {
                return Err(PromptError::RequestValidation(
                    "prompt: expected a string, a list of ints, strings, or int lists".into(),
                ));
            }
        }
        Some(other) => return Err(invalid("prompt", "a string or a list", other)),
    };
    let batch = match &prompt {
        CompletionPrompt::Texts(t) => Some(t.len()),
        CompletionPrompt::IdLists(l) => Some(l.len()),
        CompletionPrompt::Text(_) | CompletionPrompt::Ids(_) => None,
    };
    Ok(CompletionRequest {
        common: common_fields(d, model, true, dialect, batch)?,
        prompt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::parse_json;

    fn ex(endpoint: ApiKind, json: &str) -> Result<OpenAiRequest, PromptError> {
        extract_request(endpoint, &parse_json(json.as_bytes()).unwrap())
    }

    #[test]
    fn chat_defaults_and_rules() {
        let Ok(OpenAiRequest::Chat(c)) = ex(ApiKind::Chat, r#"{"model":"m","messages":[]}"#) else {
            panic!()
        };
        assert!(c.add_generation_prompt && !c.continue_final_message);
        assert!(!c.common.add_special_tokens);
        assert_eq!(
            ex(ApiKind::Chat, r#"{"messages":[]}"#),
            Err(PromptError::NoModel)
        );
        assert_eq!(
            ex(ApiKind::Chat, r#"{"model":"m","messages":[],"tools":[]}"#).map_err(|e| e.kind()),
            Err("request_rule")
        );
        assert_eq!(
            ex(
                ApiKind::Chat,
                r#"{"model":"m","messages":[],"continue_final_message":true}"#
            )
            .map_err(|e| e.kind()),
            Err("request_rule")
        );
        assert_eq!(
            ex(
                ApiKind::Chat,
                r#"{"model":"m","messages":[],"chat_template":"x"}"#
            )
            .map_err(|e| e.kind()),
            Err("render_rule")
        );
    }

    #[test]
    fn cache_salt_is_extracted_from_both_endpoints_and_validated() {
        let salt = |endpoint: ApiKind, json: &str| {
            ex(endpoint, json)
                .map(|r| r.common().cache_salt.clone())
                .map_err(|e| (e.kind(), e.to_string()))
        };
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":SALT}"#;
        let completion = r#"{"model":"m","prompt":"hi","cache_salt":SALT}"#;
        for (endpoint, body) in [(ApiKind::Chat, chat), (ApiKind::Completions, completion)] {
            let with = |v: &str| salt(endpoint, &body.replace("SALT", v));
            assert_eq!(with(r#""tenant-42""#), Ok(Some("tenant-42".to_owned())));
            assert_eq!(with("null"), Ok(None));
            let without = body.replace(r#","cache_salt":SALT"#, "");
            assert_eq!(salt(endpoint, &without), Ok(None));
            // vLLM 0.33 `validate_cache_salt` (entrypoints/generate/base/protocol.py:42-56)
            // runs in a `model_validator(mode="before")`: every bad value is a
            // VLLMValidationError (request_rule), before field types are checked.
            let long = format!("\"{}\"", "s".repeat(129));
            for bad in [
                "42",
                "true",
                r#"["a"]"#,
                r#"{"a":1}"#,
                "\"\"",
                r#""a/b""#,
                r#""a@b""#,
                &long,
            ] {
                let err = with(bad).unwrap_err();
                assert_eq!(err.0, "request_rule", "{bad}: {err:?}");
                assert!(err.1.contains("cache_salt"), "{bad}: {err:?}");
            }
            assert_eq!(
                with(&format!("\"{}\"", "s".repeat(128))).map(|s| s.map(|s| s.len())),
                Ok(Some(128))
            );
        }
    }

    /// SGLang 0.5.23 normalises an empty salt to none (`io_struct.py:873-875`:
    /// `value = self.cache_salt or None`; `radix_cache.py:77`:
    /// `self.cache_salt = cache_salt or None`): its blocks are the unsalted
    /// ones, so the request routes like one without a salt.
    #[test]
    fn sglang_ignores_the_fields_its_requests_do_not_have() {
        let body = |v: &str| crate::prompt::parse_json(v.as_bytes()).unwrap();
        let fields =
            r#""truncate_prompt_tokens": 3, "truncation_side": "bogus", "add_special_tokens": "#;
        for (api, extra, special) in [
            (ApiKind::Completions, r#""prompt": "x""#, "false"),
            (ApiKind::Chat, r#""messages": []"#, "true"),
        ] {
            let v = body(&format!(r#"{{"model": "m", {extra}, {fields}{special}}}"#));
            let req = extract_request_as(api, &v, Dialect::Sglang).unwrap();
            let c = req.common();
            assert_eq!(c.truncate_prompt_tokens, None);
            assert_eq!(c.truncation_side, None);
            // Completions prompts get the tokenizer's special tokens, chats not.
            assert_eq!(c.add_special_tokens, api == ApiKind::Completions);
            assert!(extract_request_as(api, &v, Dialect::Vllm).is_err());
        }
    }

    #[test]
    fn sglang_takes_an_empty_cache_salt_as_none() {
        let body = |salt: &str| {
            parse_json(format!(r#"{{"model":"m","prompt":"hi","cache_salt":{salt}}}"#).as_bytes())
                .unwrap()
        };
        let salt = |s: &str, dialect| {
            extract_request_as(ApiKind::Completions, &body(s), dialect)
                .map(|r| r.common().cache_salt.clone())
                .map_err(|e| e.kind())
        };
        assert_eq!(salt("\"\"", Dialect::Sglang), Ok(None));
        assert_eq!(salt("\"\"", Dialect::Vllm), Err("request_rule"));
        assert_eq!(salt(r#""t""#, Dialect::Sglang), Ok(Some("t".to_owned())));
        assert_eq!(salt("null", Dialect::Sglang), Ok(None));
        assert_eq!(salt("42", Dialect::Sglang), Err("request_validation"));
    }

    /// A completions-shaped body on the chat route is a schema error (vLLM's
    /// `ChatCompletionRequest.messages` is required, chat_completion/protocol.py:238),
    /// and a chat body on the completions route lacks `prompt` — never re-read as
    /// the other endpoint.
    #[test]
    fn a_body_of_the_other_endpoint_is_a_schema_error() {
        let completion = parse_json(br#"{"model":"m","prompt":"hi"}"#).unwrap();
        let err = extract_request(ApiKind::Chat, &completion).unwrap_err();
        assert_eq!(err.kind(), "request_validation", "{err}");
        assert!(err.to_string().contains("messages"), "{err}");
        assert!(err.is_request_error());
        let chat =
            parse_json(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        let err = extract_request(ApiKind::Completions, &chat).unwrap_err();
        assert!(err.is_request_error(), "{err}");
    }

    #[test]
    fn completion_prompt_shapes() {
        let shape = |p: &str| match ex(
            ApiKind::Completions,
            &format!(r#"{{"model":"m","prompt":{p}}}"#),
        ) {
            Ok(OpenAiRequest::Completions(c)) => Ok(c.prompt),
            Ok(_) => panic!(),
            Err(e) => Err(e.kind()),
        };
        assert_eq!(shape(r#""a""#), Ok(CompletionPrompt::Text("a".into())));
        assert_eq!(shape("[1,2]"), Ok(CompletionPrompt::Ids(vec![1, 2])));
        assert_eq!(
            shape(r#"["a","b"]"#),
            Ok(CompletionPrompt::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            shape("[[1],[2,3]]"),
            Ok(CompletionPrompt::IdLists(vec![vec![1], vec![2, 3]]))
        );
        assert_eq!(shape(r#""""#), Err("request_rule"));
        assert_eq!(shape("[]"), Err("request_rule"));
        assert_eq!(shape(r#"[1,"a"]"#), Err("request_validation"));
    }
}
