//! Chat messages → template input, following vLLM 0.33's
//! `renderers/chat_utils/chat_message.py` and `renderers/hf.py`.

use super::error::PromptError;
use super::pyvalue::{parse_json_str, PyDict, PyValue};
use super::request::ChatRequest;
use super::template::{ChatTemplate, ContentFormat, TemplateInput};

/// Claude Code prepends this attribution line to system text; vLLM removes it.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Part types whose text vLLM takes, and the field holding it.
fn text_field(part_type: &str) -> Option<&'static str> {
    match part_type {
        "text" | "input_text" | "output_text" => Some("text"),
        "refusal" => Some("refusal"),
        "thinking" => Some("thinking"),
        _ => None,
    }
}

/// The non-text keys of vLLM 0.33's `MM_PARSER_MAP`
/// (`renderers/chat_utils/chat_message.py`): parts vLLM accepts but this
/// text-only path cannot render. Any other type is refused by vLLM itself
/// (`parse_chat_message_content_part`, `:549-556`: "Unsupported chat content
/// part type", a `VLLMValidationError` → HTTP 400).
const MEDIA_PART_TYPES: &[&str] = &[
    "input_image",
    "image_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
];

fn validation(msg: String) -> PromptError {
    PromptError::RequestValidation(msg)
}

/// The text pieces of a message's content, before joining: `None` content is no
/// pieces, a string is one piece, text parts give their text (null skipped).
fn content_texts(content: Option<&PyValue>, idx: usize) -> Result<Vec<String>, PromptError> {
    match content {
        None | Some(PyValue::Null) => Ok(Vec::new()),
        Some(PyValue::Str(s)) => Ok(vec![s.clone()]),
        Some(PyValue::List(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                // A bare string part is text (`chat_message.py:458-462`; `str` is
                // a member of `ChatCompletionContentPartParam`, types.py:279).
                if let PyValue::Str(t) = part {
                    out.push(t.clone());
                    continue;
                }
                let p = part.as_dict().ok_or_else(|| {
                    validation(format!(
                        "messages[{idx}].content[{j}]: expected an object, got {}",
                        part.type_name()
                    ))
                })?;
                let ty = match p.get("type") {
                    Some(PyValue::Str(t)) => t.as_str(),
                    _ => {
                        return Err(PromptError::RenderValidation(format!(
                            "messages[{idx}].content[{j}]: missing 'type'"
                        )))
                    }
                };
                let Some(key) = text_field(ty) else {
                    if MEDIA_PART_TYPES.contains(&ty) {
                        return Err(PromptError::Unsupported(format!(
                            "content part type {ty:?} (multimodal) on a text-only path"
                        )));
                    }
                    return Err(PromptError::RenderValidation(format!(
                        "messages[{idx}].content[{j}]: Unsupported chat content part type: {ty:?}"
                    )));
                };
                match p.get(key) {
                    Some(PyValue::Null) => {}
                    Some(PyValue::Str(t)) => out.push(t.clone()),
                    Some(other) => {
                        return Err(PromptError::RenderValidation(format!(
                            "messages[{idx}].content[{j}].{key}: expected a string, got {}",
                            other.type_name()
                        )))
                    }
                    None => {
                        return Err(PromptError::RenderValidation(format!(
                            "messages[{idx}].content[{j}]: missing {key:?}"
                        )))
                    }
                }
            }
            Ok(out)
        }
        Some(other) => Err(validation(format!(
            "messages[{idx}].content: expected a string, a list of parts or null, got {}",
            other.type_name()
        ))),
    }
}

/// Drops the billing-header line from system text pieces.
fn strip_billing_header(texts: Vec<String>) -> Vec<String> {
    texts
        .into_iter()
        .filter_map(|t| {
            if t.starts_with(BILLING_HEADER) {
                let rest = t
                    .split_once('\n')
                    .map(|(_, r)| r.to_owned())
                    .unwrap_or_default();
                (!rest.is_empty()).then_some(rest)
            } else {
                Some(t)
            }
        })
        .collect()
}

/// Builds the content value for the template in the given format.
fn content_value(texts: Vec<String>, format: ContentFormat) -> PyValue {
    match format {
        // Empty strings are dropped before joining (vLLM keeps only truthy
        // parts, and an empty string is falsy)...
        ContentFormat::String => PyValue::Str(
            texts
                .into_iter()
                .filter(|t| !t.is_empty())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        // ... while an empty text part's dict is not: it stays.
        ContentFormat::OpenAi => PyValue::List(
            texts
                .into_iter()
                .map(|t| {
                    let mut d = PyDict::new();
                    d.insert("type".into(), PyValue::Str("text".into()));
                    d.insert("text".into(), PyValue::Str(t));
                    PyValue::Dict(d)
                })
                .collect(),
        ),
    }
}

fn req_str<'a>(d: &'a PyDict, key: &str, at: &str) -> Result<&'a str, PromptError> {
    match d.get(key) {
        Some(PyValue::Str(s)) => Ok(s),
        Some(other) => Err(validation(format!(
            "{at}.{key}: expected a string, got {}",
            other.type_name()
        ))),
        None => Err(validation(format!("{at}.{key}: field required"))),
    }
}

/// One tool call in pydantic's field order (`id`, `function{arguments, name}`,
/// `type`), with `arguments` parsed as vLLM's post-processing does.
fn tool_call(v: &PyValue, at: &str) -> Result<PyValue, PromptError> {
    let d = v
        .as_dict()
        .ok_or_else(|| validation(format!("{at}: expected an object")))?;
    let id = req_str(d, "id", at)?;
    let ty = req_str(d, "type", at)?;
    let f = d
        .get("function")
        .and_then(PyValue::as_dict)
        .ok_or_else(|| validation(format!("{at}.function: expected an object")))?;
    let name = req_str(f, "name", &format!("{at}.function"))?;
    let arguments = match f.get("arguments") {
        None | Some(PyValue::Null) => PyValue::Dict(PyDict::new()),
        Some(PyValue::Str(s)) => match parse_json_str(s) {
            // Only a JSON object survives; "", invalid JSON and non-objects become {}.
            Ok(obj @ PyValue::Dict(_)) => obj,
            _ => PyValue::Dict(PyDict::new()),
        },
        Some(other) => {
            return Err(validation(format!(
                "{at}.function.arguments: expected a string, got {}",
                other.type_name()
            )))
        }
    };
    let mut func = PyDict::new();
    func.insert("arguments".into(), arguments);
    func.insert("name".into(), PyValue::Str(name.to_owned()));
    let mut out = PyDict::new();
    out.insert("id".into(), PyValue::Str(id.to_owned()));
    out.insert("function".into(), PyValue::Dict(func));
    out.insert("type".into(), PyValue::Str(ty.to_owned()));
    Ok(PyValue::Dict(out))
}

/// One request message → the template's message dict.
fn message(v: &PyValue, idx: usize, format: ContentFormat) -> Result<PyValue, PromptError> {
    let at = format!("messages[{idx}]");
    let d = v
        .as_dict()
        .ok_or_else(|| validation(format!("{at}: expected an object, got {}", v.type_name())))?;
    let role = req_str(d, "role", &at)?;
    let mut texts = content_texts(d.get("content"), idx)?;
    // Only a system message's (vLLM strips it before a developer message
    // becomes a system one).
    if role == "system" {
        texts = strip_billing_header(texts);
    }
    let mut out = PyDict::new();
    out.insert("role".into(), PyValue::Str(role.to_owned()));
    let content = match (role, format) {
        // vLLM joins a tool message's text parts into one string
        // (`parse_chat_message_content`, role "tool"): most templates
        // handle only string tool results.
        ("tool", ContentFormat::OpenAi) => PyValue::Str(texts.join("\n")),
        _ => content_value(texts, format),
    };
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            match d.get("tool_calls") {
                None | Some(PyValue::Null) => {}
                Some(PyValue::List(calls)) => {
                    let calls = calls
                        .iter()
                        .enumerate()
                        .map(|(j, c)| tool_call(c, &format!("{at}.tool_calls[{j}]")))
                        .collect::<Result<Vec<_>, _>>()?;
                    // vLLM's post-processing removes an empty tool_calls list.
                    if !calls.is_empty() {
                        out.insert("tool_calls".into(), PyValue::List(calls));
                    }
                }
                Some(other) => {
                    return Err(validation(format!(
                        "{at}.tool_calls: expected a list, got {}",
                        other.type_name()
                    )))
                }
            }
            // The request's `reasoning_content` is renamed to `reasoning`
            // unless `reasoning` is given (vLLM's `_normalize_messages_before`);
            // the template sees it under both names.
            let reasoning = d
                .get("reasoning")
                .filter(|r| !r.is_null())
                .or_else(|| d.get("reasoning_content").filter(|r| !r.is_null()));
            match reasoning {
                None => {}
                Some(PyValue::Str(r)) => {
                    out.insert("reasoning".into(), PyValue::Str(r.clone()));
                    out.insert("reasoning_content".into(), PyValue::Str(r.clone()));
                }
                Some(other) => {
                    return Err(validation(format!(
                        "{at}.reasoning: expected a string, got {}",
                        other.type_name()
                    )))
                }
            }
        }
        "tool" => match d.get("tool_call_id") {
            None | Some(PyValue::Null) => {}
            Some(PyValue::Str(id)) => {
                out.insert("tool_call_id".into(), PyValue::Str(id.clone()));
            }
            Some(other) => {
                return Err(validation(format!(
                    "{at}.tool_call_id: expected a string, got {}",
                    other.type_name()
                )))
            }
        },
        _ => {}
    }
    match d.get("name") {
        None | Some(PyValue::Null) => {}
        Some(PyValue::Str(n)) => {
            out.insert("name".into(), PyValue::Str(n.clone()));
        }
        Some(other) => {
            return Err(validation(format!(
                "{at}.name: expected a string, got {}",
                other.type_name()
            )))
        }
    }
    Ok(PyValue::Dict(out))
}

/// vLLM's tool shape: `{"type": "function", "function": {"name", "description",
/// "parameters"[, "strict"][, "defer_loading"]}}`, nulls for absent optionals.
fn tool(v: &PyValue, idx: usize) -> Result<PyValue, PromptError> {
    let at = format!("tools[{idx}]");
    let d = v
        .as_dict()
        .ok_or_else(|| validation(format!("{at}: expected an object")))?;
    match d.get("type") {
        None => {}
        Some(PyValue::Str(t)) if t == "function" => {}
        Some(_) => return Err(validation(format!("{at}.type: expected 'function'"))),
    }
    let f = d
        .get("function")
        .and_then(PyValue::as_dict)
        .ok_or_else(|| validation(format!("{at}.function: expected an object")))?;
    let name = req_str(f, "name", &format!("{at}.function"))?;
    let description = match f.get("description") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(PyValue::Str(s)) => PyValue::Str(s.clone()),
        Some(_) => {
            return Err(validation(format!(
                "{at}.function.description: expected a string"
            )))
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(PyValue::Null) => PyValue::Null,
        Some(p @ PyValue::Dict(_)) => p.clone(),
        Some(_) => {
            return Err(validation(format!(
                "{at}.function.parameters: expected an object"
            )))
        }
    };
    let mut func = PyDict::new();
    func.insert("name".into(), PyValue::Str(name.to_owned()));
    func.insert("description".into(), description);
    func.insert("parameters".into(), parameters);
    for optional in ["strict", "defer_loading"] {
        match f.get(optional) {
            None => {}
            Some(v @ (PyValue::Null | PyValue::Bool(_))) => {
                func.insert(optional.into(), v.clone());
            }
            Some(_) => {
                return Err(validation(format!(
                    "{at}.function.{optional}: expected a boolean"
                )))
            }
        }
    }
    let mut out = PyDict::new();
    out.insert("type".into(), PyValue::Str("function".into()));
    out.insert("function".into(), PyValue::Dict(func));
    Ok(PyValue::Dict(out))
}

fn role_of(m: &PyValue) -> Option<&str> {
    m.as_dict()?.get("role")?.as_str()
}

/// Developer messages become system messages for templates that do not know the
/// role; if that leaves a system message anywhere but first (or several), all
/// system messages merge into one leading message joined by `"\n\n"`.
fn map_developer_role(messages: &mut Vec<PyValue>) {
    if !messages.iter().any(|m| role_of(m) == Some("developer")) {
        return;
    }
    for m in messages.iter_mut() {
        if let PyValue::Dict(d) = m {
            if d.get("role").and_then(PyValue::as_str) == Some("developer") {
                d.insert("role".into(), PyValue::Str("system".into()));
            }
        }
    }
    let system_at: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| role_of(m) == Some("system"))
        .map(|(i, _)| i)
        .collect();
    if system_at.len() <= 1 && system_at.first().is_none_or(|&i| i == 0) {
        return;
    }
    let mut texts = Vec::new();
    for &i in &system_at {
        if let Some(content) = messages
            .get(i)
            .and_then(PyValue::as_dict)
            .and_then(|d| d.get("content"))
        {
            let text = match content {
                PyValue::Str(s) => s.clone(),
                PyValue::List(parts) => {
                    let joined: Vec<&str> = parts
                        .iter()
                        .filter_map(|p| p.as_dict()?.get("text")?.as_str())
                        .collect();
                    joined.join("\n")
                }
                _ => String::new(),
            };
            // vLLM's `_consolidate_system_messages` keeps non-empty texts.
            if !text.is_empty() {
                texts.push(text);
            }
        }
    }
    let merged = texts.join("\n\n");
    messages.retain(|m| role_of(m) != Some("system"));
    let mut sys = PyDict::new();
    sys.insert("role".into(), PyValue::Str("system".into()));
    // A string whatever the content format: vLLM builds the merged message
    // after the parts were normalised.
    sys.insert("content".into(), PyValue::Str(merged));
    messages.insert(0, PyValue::Dict(sys));
}

/// Builds the template input for a chat request (messages, tools, kwargs after
/// vLLM's merge and filter).
pub(crate) fn template_input(
    req: &ChatRequest,
    template: &ChatTemplate,
) -> Result<TemplateInput, PromptError> {
    let format = template.content_format();
    let mut messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(m, i, format))
        .collect::<Result<Vec<_>, _>>()?;
    if !template.knows_role("developer") {
        map_developer_role(&mut messages);
    }
    let mut tools = match &req.tools {
        Some(t) => Some(
            t.iter()
                .enumerate()
                .map(|(i, v)| tool(v, i))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        None => None,
    };

    // merge_kwargs(chat_template_kwargs, top-level fields): top level wins, and
    // override values None / "auto" are dropped.
    let mut kwargs = req.chat_template_kwargs.clone();
    let mut overrides: Vec<(&str, PyValue)> = vec![
        (
            "add_generation_prompt",
            PyValue::Bool(req.add_generation_prompt),
        ),
        (
            "continue_final_message",
            PyValue::Bool(req.continue_final_message),
        ),
    ];
    if let Some(docs) = &req.documents {
        overrides.push(("documents", docs.clone()));
    }
    if let Some(effort) = &req.reasoning_effort {
        overrides.push(("reasoning_effort", effort.clone()));
        if !req.chat_template_kwargs.contains_key("enable_thinking") {
            let thinking = effort.as_str() != Some("none");
            overrides.push(("enable_thinking", PyValue::Bool(thinking)));
        }
    }
    for (k, v) in overrides {
        if v.is_null() || v.as_str() == Some("auto") {
            continue;
        }
        kwargs.insert(k.to_owned(), v);
    }
    // `tools` in chat_template_kwargs sits above the request's tools.
    if let Some(t) = kwargs.shift_remove("tools") {
        tools = match t {
            PyValue::List(l) => Some(l),
            PyValue::Null => tools,
            other => Some(vec![other]),
        };
    }
    let add_generation_prompt = kwargs
        .shift_remove("add_generation_prompt")
        .is_some_and(|v| v.is_truthy());
    let continue_final_message = kwargs
        .shift_remove("continue_final_message")
        .is_some_and(|v| v.is_truthy());
    let documents = kwargs.shift_remove("documents").filter(|d| !d.is_null());
    for consumed in ["tokenize", "chat_template", "messages", "conversation"] {
        kwargs.shift_remove(consumed);
    }
    // Only variables the template reads reach it; the rest vanish silently.
    kwargs.retain(|k, _| template.declares(k));
    Ok(TemplateInput {
        messages,
        tools,
        documents,
        add_generation_prompt,
        continue_final_message,
        extra: kwargs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{extract_request, parse_json, ApiKind, OpenAiRequest};

    #[test]
    fn text_parts_join_with_newlines_and_empty_parts_are_kept_out() {
        let body = parse_json(
            br#"{"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]}"#,
        )
        .unwrap();
        let OpenAiRequest::Chat(req) = extract_request(ApiKind::Chat, &body).unwrap() else {
            panic!("a chat body")
        };
        let t = ChatTemplate::new("{{ messages[0].content }}", vec![]).unwrap();
        let input = template_input(&req, &t).unwrap();
        assert_eq!(t.render(&input).unwrap(), "a\nb");
    }
}
