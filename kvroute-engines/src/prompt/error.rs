//! The typed reasons a request yields no prompt tokens.

use kvroute_core::MissReason;

use super::template::TemplateError;

/// Why no token ids could be produced for a request, with the detail a log
/// needs.
///
/// For the router every variant is a *miss* (fall back to the rule's selector),
/// counted under [`PromptError::reason`]; none of them is an error to the
/// client. Variants that vLLM itself would answer with HTTP 400 map to the
/// golden `error.kind` via [`PromptError::kind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromptError {
    /// The body is not JSON (e.g. `text/plain`): the model stays unknown.
    #[error("request body is not JSON: {0}")]
    NotJson(String),
    /// JSON, but no string `model` field.
    #[error("request names no model")]
    NoModel,
    /// No tokenizer is staged for this model slug.
    #[error("no tokenizer staged for model {0:?}")]
    UnknownModel(String),
    /// The staged tokenizer directory could not be loaded.
    #[error("tokenizer for model {model:?} failed to load: {reason}")]
    ModelLoad {
        /// Model slug.
        model: String,
        /// Loader error text.
        reason: String,
    },
    /// The model has no chat template but a chat request came in.
    #[error("model has no chat template")]
    NoChatTemplate,
    /// The body does not match the OpenAI schema (pydantic would reject it).
    #[error("request does not match the OpenAI schema: {0}")]
    RequestValidation(String),
    /// A request-level rule refuses it (e.g. `tools: []`, empty prompt).
    #[error("request refused: {0}")]
    RequestRule(String),
    /// The renderer refuses it (e.g. a request-supplied chat template).
    #[error("renderer refused: {0}")]
    RenderRule(String),
    /// A content part fails validation while rendering.
    #[error("invalid content part: {0}")]
    RenderValidation(String),
    /// The chat template failed (compile, `raise_exception`, render error).
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The request carries inputs this text-only path cannot tokenize
    /// (images, audio, prompt embeddings).
    #[error("unsupported input: {0}")]
    Unsupported(String),
    /// The tokenizer failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The engine's input check refuses the ids (empty, too long, out of vocabulary).
    #[error("engine would refuse the prompt: {0}")]
    EngineInput(String),
    /// The prompt text is longer than the router's [`super::PromptLimits`]: it
    /// was not tokenized, so the work per request stays bounded.
    #[error("prompt has more than {limit} characters (router limit)")]
    PromptTooLong {
        /// The limit in force.
        limit: usize,
    },
}

impl PromptError {
    /// The golden-file `error.kind` vLLM reports for this condition, or a
    /// router-only reason (`no_model`, `unknown_model`, ...).
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotJson(_) => "invalid_json",
            Self::NoModel => "no_model",
            Self::UnknownModel(_) => "unknown_model",
            Self::ModelLoad { .. } => "model_load",
            Self::NoChatTemplate => "no_chat_template",
            Self::RequestValidation(_) => "request_validation",
            Self::RequestRule(_) => "request_rule",
            Self::RenderRule(_) => "render_rule",
            Self::RenderValidation(_) => "render_validation",
            Self::Template(_) => "template_error",
            Self::Unsupported(_) => "unsupported",
            Self::Tokenize(_) => "tokenize",
            Self::EngineInput(_) => "engine_input",
            Self::PromptTooLong { .. } => "prompt_too_long",
        }
    }

    /// The counted miss reason: what selection and the metrics see of this
    /// failure (the detail stays in the error's message).
    ///
    /// ```
    /// use kvroute_core::MissReason;
    /// use kvroute_engines::prompt::PromptError;
    /// assert_eq!(PromptError::UnknownModel("x".into()).reason(), MissReason::NoTokenizer);
    /// assert_eq!(PromptError::RequestRule("tools: []".into()).reason(), MissReason::InvalidRequest);
    /// assert_eq!(PromptError::Unsupported("image_url".into()).reason(), MissReason::TokenizeError);
    /// ```
    #[must_use]
    pub fn reason(&self) -> MissReason {
        match self {
            Self::NotJson(_) => MissReason::NotJson,
            Self::NoModel => MissReason::NoModel,
            Self::UnknownModel(_) | Self::ModelLoad { .. } => MissReason::NoTokenizer,
            Self::PromptTooLong { .. } => MissReason::PromptTooLong,
            m if m.is_request_error() => MissReason::InvalidRequest,
            _ => MissReason::TokenizeError,
        }
    }

    /// True when the engine itself refuses the request with HTTP 400 (schema,
    /// request rule, renderer, content part, template or input check): a
    /// client error no routing choice changes, to be counted apart from
    /// tokenizer failures and unsupported inputs.
    ///
    /// ```
    /// use kvroute_engines::prompt::PromptError;
    /// assert!(PromptError::RequestValidation("messages: field required".into()).is_request_error());
    /// assert!(!PromptError::Unsupported("image_url".into()).is_request_error());
    /// ```
    #[must_use]
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            Self::RequestValidation(_)
                | Self::RequestRule(_)
                | Self::RenderRule(_)
                | Self::RenderValidation(_)
                | Self::Template(_)
                | Self::EngineInput(_)
        )
    }
}
