//! How the mock engine turns an OpenAI request body into prompt token ids.
//!
//! With `--model-dir` it runs kvroute-engines' prompt pipeline — the very code
//! the gateway routes with (tokenizer, chat template, vLLM's request rules) — so
//! its block keys match the gateway's. Without one it falls back to
//! [`ByteTokens`], good only for tests that feed both sides the same way.

use std::path::Path;

use anyhow::Context as _;
use kvroute_core::TokenId;
use kvroute_engines::prompt::{self, ApiKind, ModelOptions, ModelTokenizer};
use serde_json::Value;

/// The prompt of one engine request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    /// Token ids the engine prefills.
    pub tokens: Vec<TokenId>,
    /// `cache_salt`, which enters block 0's hash.
    pub cache_salt: Option<String>,
}

/// Request body → prompt.
pub trait PromptSource: Send + Sync {
    /// Tokenizes a `/v1/completions` (`chat == false`) or `/v1/chat/completions` body.
    fn prompt(&self, chat: bool, body: &[u8]) -> Result<Prompt, String>;
}

/// The real pipeline for one staged model.
pub struct ModelPrompts {
    tokenizer: ModelTokenizer,
}

impl ModelPrompts {
    /// Loads `dir` (tokenizer.json[.gz], tokenizer_config.json).
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let tokenizer = ModelTokenizer::load(dir, &ModelOptions::default())
            .with_context(|| format!("loading model directory {}", dir.display()))?;
        Ok(Self { tokenizer })
    }
}

impl PromptSource for ModelPrompts {
    fn prompt(&self, chat: bool, body: &[u8]) -> Result<Prompt, String> {
        let value = prompt::parse_json(body).map_err(|e| e.to_string())?;
        let endpoint = if chat {
            ApiKind::Chat
        } else {
            ApiKind::Completions
        };
        let p =
            prompt::prompt_tokens(&self.tokenizer, endpoint, &value).map_err(|e| e.to_string())?;
        let mut prompts = p.engine_prompts.into_iter();
        match (prompts.next(), prompts.next()) {
            (Some(first), None) => Ok(Prompt {
                tokens: first.token_ids,
                cache_salt: p.cache_salt,
            }),
            (None, _) => Err("no prompt".to_owned()),
            (Some(_), Some(_)) => Err("the mock engine serves one prompt per request".to_owned()),
        }
    }
}

/// A `prompt` given as token ids (vLLM accepts `[int, ...]`), if it is one.
fn prompt_token_ids(body: &Value) -> Option<Result<Vec<TokenId>, String>> {
    let ids = body.get("prompt")?.as_array()?;
    if ids.first().is_some_and(Value::is_string) {
        return None;
    }
    Some(
        ids.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| TokenId::try_from(n).ok())
                    .ok_or_else(|| format!("prompt token id {v} is not a u32"))
            })
            .collect(),
    )
}

/// A string `prompt` (or a one-element list of strings).
fn prompt_text(body: &Value) -> Result<&str, String> {
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(items)) if items.len() == 1 => items
            .first()
            .and_then(Value::as_str)
            .ok_or_else(|| "`prompt` must be a string or token ids".to_owned()),
        Some(_) => Err("`prompt` must be a string, one string, or token ids".to_owned()),
        None => Err("missing `prompt`".to_owned()),
    }
}

/// Fallback without a model: one token per UTF-8 byte; chat messages are joined
/// as `role\ncontent\n`. Keys only match a gateway that does the same.
pub struct ByteTokens;

impl PromptSource for ByteTokens {
    fn prompt(&self, chat: bool, body: &[u8]) -> Result<Prompt, String> {
        let body: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let cache_salt = body
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let tokens = if chat {
            let messages = body
                .get("messages")
                .and_then(Value::as_array)
                .ok_or("missing `messages`")?;
            let mut text = String::new();
            for m in messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                text.push_str(role);
                text.push('\n');
                text.push_str(&content);
                text.push('\n');
            }
            text.bytes().map(TokenId::from).collect()
        } else if let Some(ids) = prompt_token_ids(&body) {
            ids?
        } else {
            prompt_text(&body)?.bytes().map(TokenId::from).collect()
        };
        Ok(Prompt { tokens, cache_salt })
    }
}
