//! Body → the prompt selection needs, on the blocking pool and within limits.

use bytes::Bytes;
use kvroute_core::RequestExtras;
use kvroute_engines::prompt::{self, pyvalue, request, PromptLimits, PromptMiss, TokenizerPool};
use kvroute_engines::ApiKind;
use kvroute_select::MissBeforeKeys;

/// The selection-side miss of a prompt-pipeline miss.
///
/// `PromptMiss` (kvroute-engines) and [`MissBeforeKeys`] (kvroute-select)
/// live in crates that may not depend on each other, so Rust's orphan rule
/// leaves no crate where a `From` impl could be written except this one's
/// function; `MissBeforeKeys` then converts with `From` into the counted
/// [`kvroute_select::MissReason`].
///
/// ```
/// use kvroute::miss_before_keys;
/// use kvroute_engines::prompt::PromptMiss;
/// use kvroute_select::{MissBeforeKeys, MissReason};
/// let m = miss_before_keys(&PromptMiss::UnknownModel("x".into()));
/// assert_eq!(m, MissBeforeKeys::NoTokenizer);
/// assert_eq!(MissReason::from(m), MissReason::NoTokenizer);
/// assert_eq!(miss_before_keys(&PromptMiss::RequestRule("tools: []".into())), MissBeforeKeys::InvalidRequest);
/// ```
#[must_use]
pub fn miss_before_keys(m: &PromptMiss) -> MissBeforeKeys {
    match m {
        PromptMiss::NotJson(_) => MissBeforeKeys::NotJson,
        PromptMiss::NoModel => MissBeforeKeys::NoModel,
        PromptMiss::UnknownModel(_) | PromptMiss::ModelLoad { .. } => MissBeforeKeys::NoTokenizer,
        PromptMiss::PromptTooLong { .. } => MissBeforeKeys::PromptTooLong,
        m if m.is_request_error() => MissBeforeKeys::InvalidRequest,
        _ => MissBeforeKeys::TokenizeError,
    }
}

/// What one request body gave, owned (it outlives the blocking task).
#[derive(Debug, Clone)]
pub(crate) struct Prompt {
    pub(crate) model: Option<String>,
    pub(crate) tokens: Result<Vec<u32>, MissBeforeKeys>,
    pub(crate) text: Option<String>,
    pub(crate) extras: RequestExtras,
    /// The body to forward when it differs from the client's
    /// ([`crate::receipt::include_usage`]).
    pub(crate) rewritten: Option<Bytes>,
}

impl Prompt {
    pub(crate) fn missed(model: Option<String>, miss: MissBeforeKeys) -> Self {
        Self {
            model,
            tokens: Err(miss),
            text: None,
            extras: RequestExtras::NONE,
            rewritten: None,
        }
    }
}

/// Limits one request's prompt work obeys.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) prompt: PromptLimits,
    pub(crate) max_prompt_tokens: usize,
    pub(crate) include_usage: bool,
    /// Whose request validators apply (the endpoints' engine).
    pub(crate) dialect: request::Dialect,
}

/// What a request refused tokenization by the admission still gets: its
/// model and the usage rewrite, and a `tokenize_overloaded` miss (CPU work
/// about the body's size: run it on the blocking pool).
pub(crate) fn unadmitted(body: &[u8], limits: Limits) -> Prompt {
    let model = pyvalue::parse_json(body)
        .ok()
        .and_then(|v| request::model_of(&v).map(str::to_owned));
    let mut out = Prompt::missed(model, MissBeforeKeys::TokenizeOverloaded);
    if limits.include_usage {
        out.rewritten = crate::receipt::include_usage(body).map(Bytes::from);
    }
    out
}

/// Parses and tokenizes `body` (CPU work: run it on the blocking pool).
/// Never fails: every problem is a typed miss.
pub(crate) fn tokenize(pool: &TokenizerPool, api: ApiKind, body: &[u8], limits: Limits) -> Prompt {
    let rewritten = if limits.include_usage {
        crate::receipt::include_usage(body).map(Bytes::from)
    } else {
        None
    };
    let value = match pyvalue::parse_json(body) {
        Ok(v) => v,
        Err(_) => return Prompt::missed(None, MissBeforeKeys::NotJson),
    };
    let model = request::model_of(&value).map(str::to_owned);
    let Some(m) = &model else {
        return Prompt::missed(None, MissBeforeKeys::NoModel);
    };
    let tokens = pool
        .get(m)
        .and_then(|tok| prompt::prompt_tokens_as(&tok, api, &value, limits.prompt, limits.dialect));
    let mut out = match tokens {
        Ok(p) => {
            let cache_salt = p.cache_salt;
            let first = p.engine_prompts.into_iter().next();
            let (ids, text) = first.map_or((Vec::new(), None), |e| (e.token_ids, e.rendered));
            let tokens = if ids.is_empty() {
                Err(MissBeforeKeys::EmptyPrompt)
            } else if ids.len() > limits.max_prompt_tokens {
                Err(MissBeforeKeys::PromptTooLong)
            } else {
                Ok(ids)
            };
            Prompt {
                model,
                tokens,
                text,
                extras: RequestExtras {
                    cache_salt,
                    ..RequestExtras::NONE
                },
                rewritten: None,
            }
        }
        Err(e) => {
            tracing::debug!(kind = e.kind(), "no prompt tokens");
            Prompt::missed(model, miss_before_keys(&e))
        }
    };
    out.rewritten = rewritten;
    out
}
