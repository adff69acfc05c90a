//! Why the KV-exact tier did not decide a request: one reason per miss,
//! whichever crate found it (the host's body parsing and tokenization in
//! `kvroute-engines`, hashing and scoring in `kvroute-select`), counted per
//! rule and exported under one label each.

use std::fmt;

/// Why the KV-exact tier did not decide a request.
///
/// The first eight reasons arise before any key exists (body, model,
/// tokenization); the host reports them to selection so they are counted with
/// the rule's other misses. [`MissReason::as_str`] is the metrics and admin
/// label.
///
/// ```
/// use kvroute_core::MissReason;
/// assert_eq!(MissReason::TokenizeOverloaded.as_str(), "tokenize_overloaded");
/// assert_eq!(MissReason::ZeroOverlap.to_string(), "zero_overlap");
/// assert!(MissReason::ALL.iter().enumerate().all(|(i, r)| r.index() == i));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// The body was not OpenAI JSON (e.g. `text/plain`).
    NotJson,
    /// The body named no model.
    NoModel,
    /// No tokenizer is staged for the model.
    NoTokenizer,
    /// Tokenization or templating failed.
    TokenizeError,
    /// The prompt was empty.
    EmptyPrompt,
    /// Token ids arrived but the rule has no key provider.
    NoHasher,
    /// The key provider failed.
    HashError,
    /// The prompt is shorter than one block, so it has no keys.
    NoKeys,
    /// The rule has no inventory index, or no candidate publishes one.
    NoInventory,
    /// Precomputed keys follow a different contract than the rule's.
    ContractMismatch,
    /// No eligible endpoint holds any of the prompt's blocks.
    ZeroOverlap,
    /// The best overlap is below the rule's minimum.
    BelowThreshold,
    /// Endpoints holding blocks exist but every one is excluded, down or
    /// behind an open breaker (or nothing is eligible at all).
    AllCandidatesFiltered,
    /// The prompt exceeds the host's routing limit (characters or tokens), so
    /// it was not tokenized or hashed: bounded work per request.
    PromptTooLong,
    /// The request carries an extra (cache salt, LoRA adapter, multimodal
    /// items, …) that the rule's key provider or hash contract cannot mix into
    /// block keys: hashing without it would give keys no engine publishes.
    ExtrasUnsupported,
    /// The request is one the engine itself refuses (a vLLM 400: schema or
    /// validation error, unknown content-part type, a template's
    /// `raise_exception`): there is nothing to route on, and it is the client's
    /// error, not a tokenizer failure.
    InvalidRequest,
    /// The host's tokenization capacity (concurrent tokenizations, bytes in
    /// flight) was used up, so the prompt was not tokenized: bounded memory
    /// under a flood of long prompts.
    TokenizeOverloaded,
}

impl MissReason {
    /// Number of reasons (size of per-reason arrays).
    pub const COUNT: usize = 17;

    /// Every reason, in [`MissReason::index`] order.
    pub const ALL: [MissReason; Self::COUNT] = [
        MissReason::NotJson,
        MissReason::NoModel,
        MissReason::NoTokenizer,
        MissReason::TokenizeError,
        MissReason::EmptyPrompt,
        MissReason::NoHasher,
        MissReason::HashError,
        MissReason::NoKeys,
        MissReason::NoInventory,
        MissReason::ContractMismatch,
        MissReason::ZeroOverlap,
        MissReason::BelowThreshold,
        MissReason::AllCandidatesFiltered,
        MissReason::PromptTooLong,
        MissReason::ExtrasUnsupported,
        MissReason::InvalidRequest,
        MissReason::TokenizeOverloaded,
    ];

    /// Stable array index.
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The snake_case label of metrics (`reason="..."`), the admin API and
    /// the miss response header.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            MissReason::NotJson => "not_json",
            MissReason::NoModel => "no_model",
            MissReason::NoTokenizer => "no_tokenizer",
            MissReason::TokenizeError => "tokenize_error",
            MissReason::EmptyPrompt => "empty_prompt",
            MissReason::NoHasher => "no_hasher",
            MissReason::HashError => "hash_error",
            MissReason::NoKeys => "no_keys",
            MissReason::NoInventory => "no_inventory",
            MissReason::ContractMismatch => "contract_mismatch",
            MissReason::ZeroOverlap => "zero_overlap",
            MissReason::BelowThreshold => "below_threshold",
            MissReason::AllCandidatesFiltered => "all_candidates_filtered",
            MissReason::PromptTooLong => "prompt_too_long",
            MissReason::ExtrasUnsupported => "extras_unsupported",
            MissReason::InvalidRequest => "invalid_request",
            MissReason::TokenizeOverloaded => "tokenize_overloaded",
        }
    }
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::MissReason;

    /// Labels are distinct and snake_case: each reason has its own series.
    #[test]
    fn labels_are_distinct_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for r in MissReason::ALL {
            let s = r.as_str();
            assert!(
                s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{s}"
            );
            assert!(seen.insert(s), "{s}");
        }
    }
}
