//! Chat messages → template input as SGLang 0.5.23's OpenAI server builds it
//! for a Jinja chat template: `protocol.py`'s message and tool models (what
//! their `model_dump` gives the template), then `serving_chat.py`
//! `_apply_jinja_template`'s plain branch (tool-call arguments parsed, null
//! content as `""`, `jinja_template_utils.process_content_for_template_format`,
//! `normalize_tool_content`, `_handle_last_assistant_message`) and the tools
//! and template arguments `_render_and_encode_chat_template` passes.
//!
//! Where SGLang's chat path differs from vLLM's (`chat.rs`):
//! * text parts join with `" "`, empty ones kept; only `text` parts count
//!   (`thinking` parts are dropped, `input_text`/`refusal`/bare strings are
//!   refused by the message models);
//! * the generation prompt is always added (the request has no
//!   `add_generation_prompt` field);
//! * a last assistant message with string content becomes a user message,
//!   or, with `continue_final_message`, is removed and its text appended as
//!   separately encoded ids ([`SglangInput::assistant_prefix`]);
//! * roles other than `user` are lower-cased and must be one of the generic
//!   roles; `developer` stays `developer`; no system messages are merged, no
//!   billing header is stripped; a `reasoning` key is ignored;
//! * tools are `model_dump`ed: the client's key order, absent `description`
//!   and `parameters` as null at the end, `defer_loading` on every tool;
//!   `tool_choice: "none"` renders none, a named choice only that tool;
//! * tool-call arguments must be a JSON object (a string is parsed, a
//!   parse failure or another type refuses the request);
//! * every `chat_template_kwargs` entry reaches the template.
//!
//! Not reproduced (documented in `docs/contracts.md`): the rewrite of
//! non-standard JSON-schema types in tool parameters and the schema check.

use super::error::PromptError;
use super::pyvalue::{parse_json_str, PyDict, PyValue};
use super::request::ChatRequest;
use super::template::{ChatTemplate, ContentFormat, TemplateError, TemplateInput};

/// The roles of SGLang's generic message model (`_GenericMessageRole`).
const GENERIC_ROLES: &[&str] = &[
    "system",
    "assistant",
    "tool",
    "function",
    "developer",
    "latest_reminder",
    "root",
];

/// Media part types: the models accept them, a text-only path cannot render them.
const MEDIA_PART_TYPES: &[&str] = &["image_url", "video_url", "audio_url", "input_audio"];

/// Template arguments `apply_chat_template` also receives by name: the same
/// key in `chat_template_kwargs` is a duplicate keyword (an engine error).
const CLASHING_KWARGS: &[&str] = &[
    "add_generation_prompt",
    "tools",
    "tokenize",
    "return_dict",
    "conversation",
    "continue_final_message",
];

/// SGLang's template input for a chat request.
#[derive(Debug)]
pub(crate) struct SglangInput {
    /// What the template renders.
    pub(crate) input: TemplateInput,
    /// `continue_final_message`: the removed last assistant message's text,
    /// which SGLang encodes on its own and appends to the rendered prompt's
    /// ids (`_append_assistant_prefix_to_prompt_ids`).
    pub(crate) assistant_prefix: Option<String>,
}

fn validation(msg: String) -> PromptError {
    PromptError::RequestValidation(msg)
}

/// `Optional[str]` in pydantic's lax mode: a string or null; absent is null.
fn opt_str(d: &PyDict, key: &str, at: &str) -> Result<PyValue, PromptError> {
    match d.get(key) {
        None | Some(PyValue::Null) => Ok(PyValue::Null),
        Some(v @ PyValue::Str(_)) => Ok(v.clone()),
        Some(other) => Err(validation(format!(
            "{at}.{key}: expected a string, got {}",
            other.type_name()
        ))),
    }
}

/// `Optional[bool]` in pydantic's lax mode.
fn opt_bool(d: &PyDict, key: &str, at: &str) -> Result<PyValue, PromptError> {
    let bad = |v: &PyValue| {
        validation(format!(
            "{at}.{key}: expected a boolean, got {}",
            v.type_name()
        ))
    };
    match d.get(key) {
        None | Some(PyValue::Null) => Ok(PyValue::Null),
        Some(v @ PyValue::Bool(_)) => Ok(v.clone()),
        Some(PyValue::Int(0)) => Ok(PyValue::Bool(false)),
        Some(PyValue::Int(1)) => Ok(PyValue::Bool(true)),
        Some(v @ PyValue::Str(s)) => match s.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" | "t" | "y" => Ok(PyValue::Bool(true)),
            "false" | "0" | "no" | "off" | "f" | "n" => Ok(PyValue::Bool(false)),
            _ => Err(bad(v)),
        },
        Some(other) => Err(bad(other)),
    }
}

fn obj<'a>(v: &'a PyValue, at: &str) -> Result<&'a PyDict, PromptError> {
    v.as_dict()
        .ok_or_else(|| validation(format!("{at}: expected an object, got {}", v.type_name())))
}

/// One content part as its model dumps it; a media part is refused (this
/// path is text-only).
fn part(v: &PyValue, role: &str, at: &str) -> Result<PyDict, PromptError> {
    let d = obj(v, at)?;
    let ty = match d.get("type") {
        Some(PyValue::Str(t)) => t.as_str(),
        _ => return Err(validation(format!("{at}.type: field required"))),
    };
    let mut out = PyDict::new();
    out.insert("type".into(), PyValue::Str(ty.to_owned()));
    match ty {
        "text" => match d.get("text") {
            Some(t @ PyValue::Str(_)) => {
                out.insert("text".into(), t.clone());
            }
            _ => return Err(validation(format!("{at}.text: expected a string"))),
        },
        "thinking" | "reasoning" => {
            if role != "assistant" {
                return Err(validation(
                    "thinking content parts are only valid in assistant messages".into(),
                ));
            }
            let thinking = opt_str(d, "thinking", at)?;
            let text = opt_str(d, "text", at)?;
            if thinking.is_null() == text.is_null() {
                return Err(validation(
                    "thinking parts require exactly one of 'thinking' or 'text'".into(),
                ));
            }
            out.insert("thinking".into(), thinking);
            out.insert("text".into(), text);
        }
        "tool_reference" => match d.get("name") {
            Some(n @ PyValue::Str(_)) => {
                out.insert("name".into(), n.clone());
            }
            _ => return Err(validation(format!("{at}.name: expected a string"))),
        },
        t if MEDIA_PART_TYPES.contains(&t) => {
            return Err(PromptError::Unsupported(format!(
                "content part type {t:?} (multimodal) on a text-only path"
            )))
        }
        other => {
            return Err(validation(format!(
                "{at}: unknown content part type {other:?}"
            )))
        }
    }
    Ok(out)
}

/// A message's `content` as the models take it: a string, a list of parts
/// (dumped), or null (not for a user message).
fn content(d: &PyDict, role: &str, at: &str) -> Result<PyValue, PromptError> {
    match d.get("content") {
        None | Some(PyValue::Null) if role != "user" => Ok(PyValue::Null),
        Some(s @ PyValue::Str(_)) => Ok(s.clone()),
        Some(PyValue::List(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| part(p, role, &format!("{at}.content[{j}]")).map(PyValue::Dict))
            .collect::<Result<Vec<_>, _>>()
            .map(PyValue::List),
        Some(other) => Err(validation(format!(
            "{at}.content: expected a string or a list of parts, got {}",
            other.type_name()
        ))),
        None => Err(validation(format!("{at}.content: field required"))),
    }
}

/// A tool call as `ToolCall.model_dump()`: `id`, `index`, `type`,
/// `function{name, arguments}`, with string arguments parsed as
/// `normalize_assistant_tool_call_arguments(strict=True)` does on an
/// assistant message.
fn tool_call(v: &PyValue, parse_arguments: bool, at: &str) -> Result<PyValue, PromptError> {
    let d = obj(v, at)?;
    let index = match d.get("index") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(i @ PyValue::Int(_)) => i.clone(),
        Some(other) => {
            return Err(validation(format!(
                "{at}.index: expected an integer, got {}",
                other.type_name()
            )))
        }
    };
    match d.get("type") {
        None | Some(PyValue::Null) => {}
        Some(PyValue::Str(t)) if t == "function" => {}
        Some(_) => return Err(validation(format!("{at}.type: expected 'function'"))),
    }
    let f = obj(
        d.get("function")
            .ok_or_else(|| validation(format!("{at}.function: field required")))?,
        &format!("{at}.function"),
    )?;
    let arguments = match f.get("arguments") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(PyValue::Str(s)) if parse_arguments => match strict_json_object(s) {
            Some(obj) => obj,
            None => {
                return Err(validation(
                    "Assistant tool call function.arguments must be a valid JSON object.".into(),
                ))
            }
        },
        Some(a @ (PyValue::Str(_) | PyValue::Dict(_))) => a.clone(),
        Some(other) => {
            return Err(validation(format!(
                "{at}.function.arguments: expected a string or an object, got {}",
                other.type_name()
            )))
        }
    };
    let mut func = PyDict::new();
    func.insert(
        "name".into(),
        opt_str(f, "name", &format!("{at}.function"))?,
    );
    func.insert("arguments".into(), arguments);
    let mut out = PyDict::new();
    out.insert("id".into(), opt_str(d, "id", at)?);
    out.insert("index".into(), index);
    out.insert("type".into(), PyValue::Str("function".into()));
    out.insert("function".into(), PyValue::Dict(func));
    Ok(PyValue::Dict(out))
}

/// `orjson.loads(text)` when it is a JSON object: strict JSON (no `NaN` or
/// `Infinity`), the value as Python sees it.
fn strict_json_object(text: &str) -> Option<PyValue> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    match parse_json_str(text) {
        Ok(v @ PyValue::Dict(_)) => Some(v),
        _ => None,
    }
}

/// A tool as `Tool.model_dump()`: `type`, `function` (the client's key
/// order, `description` and `parameters` null at the end when absent,
/// `strict` / `defer_loading` only when set), `defer_loading`.
fn tool(v: &PyValue, at: &str) -> Result<(String, PyValue), PromptError> {
    let d = obj(v, at)?;
    let ty = match d.get("type") {
        None | Some(PyValue::Null) => "function".to_owned(),
        Some(PyValue::Str(t)) => t.clone(),
        Some(other) => {
            return Err(validation(format!(
                "{at}.type: expected a string, got {}",
                other.type_name()
            )))
        }
    };
    let fat = format!("{at}.function");
    let f = obj(
        d.get("function")
            .ok_or_else(|| validation(format!("{fat}: field required")))?,
        &fat,
    )?;
    let name = match f.get("name") {
        Some(PyValue::Str(n)) => n.clone(),
        _ => return Err(validation(format!("{fat}.name: expected a string"))),
    };
    let tool_defer = opt_bool(d, "defer_loading", at)?;
    let mut defer = opt_bool(f, "defer_loading", &fat)?;
    if defer.is_null() {
        defer = tool_defer.clone();
    }
    // The model's fields in their order, as the serializer starts from.
    let mut fields: Vec<(&str, PyValue)> = vec![
        ("description", opt_str(f, "description", &fat)?),
        ("name", PyValue::Str(name.clone())),
        (
            "parameters",
            f.get("parameters").cloned().unwrap_or(PyValue::Null),
        ),
    ];
    let strict = opt_bool(f, "strict", &fat)?;
    if !strict.is_null() {
        fields.push(("strict", strict));
    }
    if !defer.is_null() {
        fields.push(("defer_loading", defer));
    }
    let mut func = PyDict::new();
    for key in f.keys() {
        if let Some((k, v)) = fields.iter().find(|(k, _)| *k == key.as_str()) {
            func.insert((*k).to_owned(), v.clone());
        }
    }
    for (k, v) in fields {
        if !func.contains_key(k) {
            func.insert(k.to_owned(), v);
        }
    }
    let mut out = PyDict::new();
    out.insert("type".into(), PyValue::Str(ty));
    out.insert("function".into(), PyValue::Dict(func));
    out.insert("defer_loading".into(), tool_defer);
    Ok((name, PyValue::Dict(out)))
}

fn tools_of(list: &[PyValue], at: &str) -> Result<Vec<(String, PyValue)>, PromptError> {
    list.iter()
        .enumerate()
        .map(|(i, t)| tool(t, &format!("{at}[{i}]")))
        .collect()
}

/// One message as its model dumps it, before the chat path's processing.
fn message(v: &PyValue, idx: usize) -> Result<PyDict, PromptError> {
    let at = format!("messages[{idx}]");
    let d = obj(v, &at)?;
    let role = match d.get("role") {
        Some(PyValue::Str(r)) if r == "user" => "user".to_owned(),
        Some(PyValue::Str(r)) => {
            let lower = r.to_lowercase();
            if !GENERIC_ROLES.contains(&lower.as_str()) {
                return Err(validation(format!("{at}.role: {r:?} is not a valid role")));
            }
            lower
        }
        Some(other) => {
            return Err(validation(format!(
                "{at}.role: expected a string, got {}",
                other.type_name()
            )))
        }
        None => return Err(validation(format!("{at}.role: field required"))),
    };
    let mut out = PyDict::new();
    out.insert("role".into(), PyValue::Str(role.clone()));
    out.insert("content".into(), content(d, &role, &at)?);
    if role == "user" {
        return Ok(out);
    }
    out.insert("tool_call_id".into(), opt_str(d, "tool_call_id", &at)?);
    out.insert("name".into(), opt_str(d, "name", &at)?);
    let phase = match d.get("phase") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(p @ PyValue::Str(s)) if s == "commentary" || s == "final_answer" => p.clone(),
        Some(_) => return Err(validation(format!("{at}.phase: not a valid phase"))),
    };
    out.insert("phase".into(), phase);
    out.insert(
        "reasoning_content".into(),
        opt_str(d, "reasoning_content", &at)?,
    );
    let calls = match d.get("tool_calls") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(PyValue::List(l)) => PyValue::List(
            l.iter()
                .enumerate()
                .map(|(j, c)| tool_call(c, role == "assistant", &format!("{at}.tool_calls[{j}]")))
                .collect::<Result<_, _>>()?,
        ),
        Some(other) => {
            return Err(validation(format!(
                "{at}.tool_calls: expected a list, got {}",
                other.type_name()
            )))
        }
    };
    out.insert("tool_calls".into(), calls);
    let tools = match d.get("tools") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(PyValue::List(l)) => PyValue::List(
            tools_of(l, &format!("{at}.tools"))?
                .into_iter()
                .map(|(_, t)| t)
                .collect(),
        ),
        Some(other) => {
            return Err(validation(format!(
                "{at}.tools: expected a list, got {}",
                other.type_name()
            )))
        }
    };
    out.insert("tools".into(), tools);
    out.insert("prefix".into(), opt_bool(d, "prefix", &at)?);
    Ok(out)
}

/// `process_content_for_template_format` after null content became `""`,
/// then `normalize_tool_content`.
fn for_template(mut m: PyDict, format: ContentFormat) -> PyDict {
    if m.get("content").is_none_or(PyValue::is_null) {
        m.insert("content".into(), PyValue::Str(String::new()));
    }
    let texts = |parts: &[PyValue]| -> Vec<String> {
        parts
            .iter()
            .filter_map(|p| {
                let d = p.as_dict()?;
                (d.get("type")?.as_str()? == "text")
                    .then(|| d.get("text")?.as_str().map(str::to_owned))?
            })
            .collect()
    };
    let mut m = match (m.get("content"), format) {
        (Some(PyValue::List(parts)), ContentFormat::String) => {
            let joined = texts(parts).join(" ");
            m.insert("content".into(), PyValue::Str(joined));
            m
        }
        (Some(PyValue::List(parts)), ContentFormat::OpenAi) => {
            let kept: Vec<PyValue> = parts
                .iter()
                .filter(|p| {
                    p.as_dict()
                        .and_then(|d| d.get("type"))
                        .and_then(PyValue::as_str)
                        .is_some_and(|t| t == "text" || t == "tool_reference")
                })
                .cloned()
                .collect();
            // The content goes last: the other keys are copied first.
            m.shift_remove("content");
            m.insert("content".into(), PyValue::List(kept));
            m
        }
        _ => m,
    };
    m.retain(|_, v| !v.is_null());
    if m.get("role").and_then(PyValue::as_str) == Some("tool") {
        if let Some(PyValue::List(parts)) = m.get("content") {
            let all_text = parts.iter().all(|p| {
                p.as_dict()
                    .and_then(|d| d.get("type"))
                    .and_then(PyValue::as_str)
                    == Some("text")
            });
            if all_text {
                let joined = texts(parts).join(" ");
                m.insert("content".into(), PyValue::Str(joined));
            }
        }
    }
    m
}

/// The reasoning effort SGLang's request validator settles on, and whether
/// it turns thinking on or off (`normalize_reasoning_inputs`).
fn reasoning(req: &ChatRequest) -> Result<(Option<PyValue>, Option<bool>), PromptError> {
    const EFFORTS: &[&str] = &[
        "none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max",
    ];
    let mut effort = req.reasoning_effort.clone().filter(|e| !e.is_null());
    if let Some(PyValue::Bool(_)) = effort {
        return Err(validation("reasoning_effort must not be a boolean".into()));
    }
    let mut thinking = None;
    if let Some(PyValue::Dict(r)) = &req.reasoning {
        let given = r
            .get("effort")
            .filter(|e| !e.is_null())
            .or_else(|| r.get("reasoning_effort").filter(|e| !e.is_null()));
        match given {
            None => {}
            Some(PyValue::Str(s)) if EFFORTS.contains(&s.as_str()) => {
                effort = Some(PyValue::Str(s.clone()));
            }
            Some(PyValue::Int(i)) => {
                #[allow(clippy::cast_precision_loss)]
                let f = *i as f64;
                effort = Some(PyValue::Float(f));
            }
            Some(PyValue::Float(f)) => effort = Some(PyValue::Float(*f)),
            Some(PyValue::Str(s)) => match s.trim().parse::<f64>() {
                Ok(f) => effort = Some(PyValue::Float(f)),
                Err(_) => return Err(validation(format!("invalid reasoning effort: {s:?}"))),
            },
            Some(_) => return Err(validation("invalid reasoning effort".into())),
        }
        let enabled = match r.get("enabled").filter(|e| !e.is_null()) {
            Some(e) => Some(e),
            None => r.get("enable"),
        };
        let on = match enabled {
            Some(PyValue::Str(s)) => {
                matches!(
                    s.trim().to_lowercase().as_str(),
                    "1" | "true" | "yes" | "y" | "on"
                )
            }
            Some(v) => v.is_truthy(),
            None => false,
        };
        if on {
            thinking = Some(true);
        }
    }
    if let Some(e) = &effort {
        thinking = Some(e.as_str() != Some("none"));
    }
    Ok((effort, thinking))
}

/// `_validate_request`'s checks of the tool choice against the tools the
/// request and its messages give (`effective`); the tool a named choice
/// picks, if it is one.
fn check_tools<'c>(
    choice: &'c PyValue,
    effective: &[&str],
    message_tools: bool,
) -> Result<Option<&'c str>, PromptError> {
    let refuse = |m: &str| Err(PromptError::RequestRule(m.to_owned()));
    if message_tools {
        let mut names = effective.to_vec();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return refuse("Tool names must be unique across request and message tools.");
        }
    }
    match choice {
        PyValue::Str(c) if !matches!(c.as_str(), "auto" | "required" | "none") => Err(validation(
            format!("tool_choice: {c:?} is not 'auto', 'required' or 'none'"),
        )),
        PyValue::Str(c) if c == "required" && effective.is_empty() => {
            refuse("Tools cannot be empty if tool choice is set to required.")
        }
        PyValue::Str(_) => Ok(None),
        _ if effective.is_empty() => {
            refuse("Tools cannot be empty if tool choice is set to a specific tool.")
        }
        named => {
            let name = named
                .as_dict()
                .and_then(|d| d.get("function")?.as_dict()?.get("name")?.as_str())
                .ok_or_else(|| validation("tool_choice.function.name: field required".into()))?;
            if effective.contains(&name) {
                Ok(Some(name))
            } else {
                refuse(&format!("Tool '{name}' not found in tools list."))
            }
        }
    }
}

/// The template's tools: the request's (`model_dump`ed), none when the
/// choice is `"none"`, only the named one for a named choice
/// (`serving_chat.py`, tools handling before the template call).
fn template_tools(
    request_tools: Vec<(String, PyValue)>,
    choice: &PyValue,
    named: Option<&str>,
) -> Option<Vec<PyValue>> {
    if choice.as_str() == Some("none") {
        return None;
    }
    let picked: Vec<PyValue> = request_tools
        .into_iter()
        .filter(|(n, _)| named.is_none_or(|x| x == n))
        .map(|(_, t)| t)
        .collect();
    (!picked.is_empty()).then_some(picked)
}

/// Renders `input`; when that fails with tools, SGLang renders again with
/// the tools as their functions alone (the shape some templates expect).
pub(crate) fn render(
    template: &ChatTemplate,
    input: TemplateInput,
    max_bytes: usize,
) -> Result<(TemplateInput, String), PromptError> {
    match template.render_limited(&input, max_bytes) {
        Ok(r) => Ok((input, r)),
        Err(e @ TemplateError::OutputTooLong(_)) => Err(e.into()),
        Err(_) if input.tools.is_some() => {
            let mut flat = input;
            flat.tools = flat.tools.map(|tools| {
                tools
                    .into_iter()
                    .map(|t| match t {
                        PyValue::Dict(mut d) => match d.shift_remove("function") {
                            Some(f) => f,
                            None => PyValue::Dict(d),
                        },
                        other => other,
                    })
                    .collect()
            });
            let r = template.render_limited(&flat, max_bytes)?;
            Ok((flat, r))
        }
        Err(e) => Err(e.into()),
    }
}

/// Builds SGLang's template input for a chat request.
pub(crate) fn template_input(
    req: &ChatRequest,
    template: &ChatTemplate,
) -> Result<SglangInput, PromptError> {
    let format = template.sglang_content_format();
    if req.messages.is_empty() {
        return Err(PromptError::RequestRule("Messages cannot be empty.".into()));
    }
    let dumped = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(m, i))
        .collect::<Result<Vec<_>, _>>()?;
    let request_tools = match &req.tools {
        Some(t) => tools_of(t, "tools")?,
        None => Vec::new(),
    };
    // Tools of root, system and developer messages count as the request's
    // for whether tools apply at all and for the checks (`_effective_tools`).
    let tool_name = |t: &PyValue| {
        t.as_dict()
            .and_then(|d| d.get("function")?.as_dict()?.get("name")?.as_str())
            .map(str::to_owned)
    };
    let message_tools: Vec<String> = dumped
        .iter()
        .filter(|m| {
            matches!(
                m.get("role").and_then(PyValue::as_str),
                Some("root" | "system" | "developer")
            )
        })
        .filter_map(|m| m.get("tools").and_then(PyValue::as_list))
        .flat_map(|l| l.iter().filter_map(tool_name))
        .collect();
    let effective: Vec<&str> = request_tools
        .iter()
        .map(|(n, _)| n.as_str())
        .chain(message_tools.iter().map(String::as_str))
        .collect();
    let choice = match &req.tool_choice {
        Some(c) => c.clone(),
        None if req.tools.is_none() && message_tools.is_empty() => PyValue::Str("none".into()),
        None => PyValue::Str("auto".into()),
    };
    let named = check_tools(&choice, &effective, !message_tools.is_empty())?;
    let tools = template_tools(request_tools, &choice, named);
    let mut messages: Vec<PyDict> = dumped
        .into_iter()
        .map(|m| for_template(m, format))
        .collect();
    // The last assistant message, when its content is a string: removed as
    // the prefix to continue, or asked again as a user message.
    let mut assistant_prefix = None;
    let last_text = messages.last().and_then(|m| {
        (m.get("role").and_then(PyValue::as_str) == Some("assistant")).then(|| {
            m.get("content")
                .and_then(PyValue::as_str)
                .map(str::to_owned)
        })?
    });
    if let Some(text) = last_text {
        messages.pop();
        if req.continue_final_message {
            assistant_prefix = Some(text);
        } else {
            let mut user = PyDict::new();
            user.insert("role".into(), PyValue::Str("user".into()));
            user.insert("content".into(), PyValue::Str(text));
            messages.push(user);
        }
    }
    let (effort, thinking) = reasoning(req)?;
    let mut kwargs = req.chat_template_kwargs.clone();
    if let Some(t) = thinking {
        kwargs.entry("thinking".into()).or_insert(PyValue::Bool(t));
        kwargs
            .entry("enable_thinking".into())
            .or_insert(PyValue::Bool(t));
    }
    // `chat_template_kwargs.reasoning_effort` is the request's effort.
    let effort = kwargs
        .shift_remove("reasoning_effort")
        .filter(|e| !e.is_null())
        .or(effort);
    let mut extra = PyDict::new();
    if let Some(e) = effort.filter(|e| !e.is_null()) {
        extra.insert("reasoning_effort".into(), e);
    }
    if let Some(k) = CLASHING_KWARGS.iter().find(|k| kwargs.contains_key(**k)) {
        return Err(PromptError::RenderValidation(format!(
            "chat_template_kwargs.{k} repeats an argument of apply_chat_template"
        )));
    }
    let documents = kwargs.shift_remove("documents").filter(|d| !d.is_null());
    extra.extend(kwargs);
    Ok(SglangInput {
        input: TemplateInput {
            messages: messages.into_iter().map(PyValue::Dict).collect(),
            tools,
            documents,
            add_generation_prompt: true,
            continue_final_message: false,
            extra,
        },
        assistant_prefix,
    })
}
