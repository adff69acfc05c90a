//! Checker for `kvroute-chat-golden/1` files (`golden/chat/*.json`): every case's
//! rendered text, ids and error kind against a model's staged tokenizer. Used by
//! the tests and by `kvroute parity`, so users can check their own template.

use std::path::Path;

use super::pyjson::{dumps, DumpOptions};
use super::pyvalue::{parse_json, PyDict, PyValue};
use super::request::{self, ApiKind, OpenAiRequest};
use super::template::{to_value, TemplateInput};
use super::tokenizer::{ModelOptions, ModelTokenizer};
use super::{prompt_tokens, render_chat, PromptError, PromptTokens};

/// The file is not a chat-golden file.
#[derive(Debug, thiserror::Error)]
pub enum GoldenFileError {
    /// Not JSON.
    #[error("golden file is not JSON: {0}")]
    Json(String),
    /// JSON, but not the expected schema.
    #[error("golden file schema: {0}")]
    Schema(String),
    /// The model directory does not load.
    #[error(transparent)]
    Load(#[from] super::tokenizer::ModelLoadError),
}

/// One case that did not match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatCaseFailure {
    /// Case id.
    pub id: String,
    /// What differed.
    pub reason: String,
}

/// Outcome of checking a chat-golden file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatCaseReport {
    /// Cases in the file.
    pub total: usize,
    /// Cases expected to succeed.
    pub render_cases: usize,
    /// Cases expected to fail with a typed error.
    pub error_cases: usize,
    /// Engine prompts compared.
    pub engine_prompts: usize,
    /// Cases whose `template_input` was compared too.
    pub template_inputs_checked: usize,
    /// Cases that matched.
    pub passed: usize,
    /// Cases that did not.
    pub failures: Vec<ChatCaseFailure>,
}

impl ChatCaseReport {
    /// `true` when every case matched.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.failures.is_empty() && self.passed == self.total
    }
}

/// Checks a chat-golden file against the model staged in `model_dir`.
pub fn check_chat_cases_in_dir(
    file: &[u8],
    model_dir: &Path,
    options: &ModelOptions,
) -> Result<ChatCaseReport, GoldenFileError> {
    let tok = ModelTokenizer::load(model_dir, options)?;
    check_chat_cases(file, &tok)
}

/// Same as [`check_chat_cases_in_dir`] for an already parsed `serde_json` value
/// (re-serialised; prefer the bytes form when exact numbers matter).
pub fn check_chat_cases_value(
    file: &serde_json::Value,
    model_dir: &Path,
    options: &ModelOptions,
) -> Result<ChatCaseReport, GoldenFileError> {
    let bytes = serde_json::to_vec(file).map_err(|e| GoldenFileError::Json(e.to_string()))?;
    check_chat_cases_in_dir(&bytes, model_dir, options)
}

/// Checks every case of a chat-golden file (bytes) with `tok`.
pub fn check_chat_cases(
    file: &[u8],
    tok: &ModelTokenizer,
) -> Result<ChatCaseReport, GoldenFileError> {
    let root = parse_json(file).map_err(|e| GoldenFileError::Json(e.to_string()))?;
    let cases = root
        .as_dict()
        .and_then(|d| d.get("cases"))
        .and_then(PyValue::as_list)
        .ok_or_else(|| GoldenFileError::Schema("no \"cases\" array".into()))?;
    let mut report = ChatCaseReport {
        total: cases.len(),
        ..ChatCaseReport::default()
    };
    for case in cases {
        let d = case
            .as_dict()
            .ok_or_else(|| GoldenFileError::Schema("a case is not an object".into()))?;
        let id = d
            .get("id")
            .and_then(PyValue::as_str)
            .unwrap_or("?")
            .to_owned();
        if d.get("error").is_some_and(|e| !e.is_null()) {
            report.error_cases += 1;
        } else {
            report.render_cases += 1;
        }
        match check_case(d, tok, &mut report) {
            Ok(()) => report.passed += 1,
            Err(reason) => report.failures.push(ChatCaseFailure { id, reason }),
        }
    }
    Ok(report)
}

fn json_text(v: &PyValue) -> String {
    dumps(&to_value(v), &DumpOptions::default()).unwrap_or_else(|e| e.to_string())
}

fn check_case(d: &PyDict, tok: &ModelTokenizer, report: &mut ChatCaseReport) -> Result<(), String> {
    let endpoint = match d.get("endpoint").and_then(PyValue::as_str) {
        Some("chat") => ApiKind::Chat,
        Some("completions") => ApiKind::Completions,
        other => return Err(format!("unknown endpoint {other:?}")),
    };
    let outcome: Result<PromptTokens, PromptError> = match d.get("request") {
        Some(req @ PyValue::Dict(_)) => prompt_tokens(tok, endpoint, req),
        _ => {
            let raw = d.get("request_raw").and_then(PyValue::as_str).unwrap_or("");
            parse_json(raw.as_bytes())
                .map_err(|e| PromptError::NotJson(e.to_string()))
                .and_then(|v| prompt_tokens(tok, endpoint, &v))
        }
    };
    if let Some(err) = d.get("error").and_then(PyValue::as_dict) {
        let want = err.get("kind").and_then(PyValue::as_str).unwrap_or("?");
        return match outcome {
            Err(miss) if miss.kind() == want => Ok(()),
            Err(miss) => Err(format!(
                "expected error {want}, got {} ({miss})",
                miss.kind()
            )),
            Ok(_) => Err(format!("expected error {want}, got success")),
        };
    }
    let got = outcome.map_err(|m| format!("unexpected {}: {m}", m.kind()))?;
    let want = d
        .get("engine_prompts")
        .and_then(PyValue::as_list)
        .ok_or("no engine_prompts")?;
    if want.len() != got.engine_prompts.len() {
        return Err(format!(
            "{} engine prompts, expected {}",
            got.engine_prompts.len(),
            want.len()
        ));
    }
    for (i, (w, g)) in want.iter().zip(&got.engine_prompts).enumerate() {
        let w = w.as_dict().ok_or("engine prompt is not an object")?;
        let want_text = w.get("rendered_prompt").and_then(PyValue::as_str);
        if want_text != g.rendered.as_deref() {
            return Err(format!(
                "prompt {i}: rendered text differs\n  want {want_text:?}\n  got  {:?}",
                g.rendered
            ));
        }
        let want_ids: Vec<i64> = w
            .get("token_ids")
            .and_then(PyValue::as_list)
            .ok_or("no token_ids")?
            .iter()
            .map(|v| match v {
                PyValue::Int(i) => *i,
                _ => -1,
            })
            .collect();
        let got_ids: Vec<i64> = g.token_ids.iter().map(|&i| i64::from(i)).collect();
        if want_ids != got_ids {
            return Err(format!(
                "prompt {i}: ids differ\n  want {want_ids:?}\n  got  {got_ids:?}"
            ));
        }
        report.engine_prompts += 1;
    }
    // The single-prompt shorthand fields, when present, must agree too.
    if let (Some(PyValue::List(ids)), [only]) = (d.get("token_ids"), got.engine_prompts.as_slice())
    {
        let want_ids: Vec<i64> = ids
            .iter()
            .map(|v| match v {
                PyValue::Int(i) => *i,
                _ => -1,
            })
            .collect();
        let got_ids: Vec<i64> = only.token_ids.iter().map(|&i| i64::from(i)).collect();
        if want_ids != got_ids {
            return Err(format!(
                "token_ids differ\n  want {want_ids:?}\n  got  {got_ids:?}"
            ));
        }
        let want_text = d.get("rendered_prompt").and_then(PyValue::as_str);
        if want_text.is_some() && want_text != only.rendered.as_deref() {
            return Err(format!("rendered_prompt differs: want {want_text:?}"));
        }
    }
    let want_truncated = d.get("token_ids_truncated").is_some_and(PyValue::is_truthy);
    if want_truncated != got.truncated {
        return Err(format!(
            "truncated flag {}, expected {want_truncated}",
            got.truncated
        ));
    }
    if let (Some(PyValue::Dict(ti)), Some(req)) = (d.get("template_input"), d.get("request")) {
        check_template_input(ti, tok, endpoint, req)?;
        report.template_inputs_checked += 1;
    }
    Ok(())
}

/// Compares what reached the template (messages, tools, flags, extra vars) as
/// Python JSON text, so key order and number types count.
fn check_template_input(
    want: &PyDict,
    tok: &ModelTokenizer,
    endpoint: ApiKind,
    req: &PyValue,
) -> Result<(), String> {
    let Ok(OpenAiRequest::Chat(chat)) = request::extract_request(endpoint, req) else {
        return Err("template_input on a non-chat case".into());
    };
    let (input, _) = render_chat(tok, &chat).map_err(|e| e.to_string())?;
    let TemplateInput {
        messages,
        tools,
        add_generation_prompt,
        continue_final_message,
        extra,
        ..
    } = input;
    let pairs = [
        ("messages", PyValue::List(messages)),
        ("tools", tools.map_or(PyValue::Null, PyValue::List)),
        (
            "add_generation_prompt",
            PyValue::Bool(add_generation_prompt),
        ),
        (
            "continue_final_message",
            PyValue::Bool(continue_final_message),
        ),
        ("extra_template_vars", PyValue::Dict(extra)),
    ];
    for (key, got) in pairs {
        let w = want.get(key).map(json_text).unwrap_or_default();
        let g = json_text(&got);
        if w != g {
            return Err(format!(
                "template_input.{key} differs\n  want {w}\n  got  {g}"
            ));
        }
    }
    Ok(())
}
