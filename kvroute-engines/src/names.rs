//! Configuration names: the error of an unknown one, and `FromStr` of
//! [`crate::ApiKind`] (engines are looked up in [`crate::engine::Registry`]).

use std::str::FromStr;

use crate::prompt::ApiKind;

/// A name that is not an engine (`vllm`, `sglang`, `trtllm`, `llama.cpp`) or
/// an API kind (`chat`, `completions`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {name:?}; expected {expected}")]
pub struct UnknownName {
    /// What was parsed.
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The accepted names.
    pub expected: &'static str,
}

impl FromStr for ApiKind {
    type Err = UnknownName;

    /// `chat` or `completions` ([`ApiKind::as_str`]).
    ///
    /// ```
    /// use kvroute_engines::ApiKind;
    /// assert_eq!("chat".parse::<ApiKind>(), Ok(ApiKind::Chat));
    /// assert_eq!(ApiKind::Completions.as_str().parse::<ApiKind>(), Ok(ApiKind::Completions));
    /// ```
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "chat" => Ok(Self::Chat),
            "completions" => Ok(Self::Completions),
            _ => Err(UnknownName {
                what: "API kind",
                name: s.to_owned(),
                expected: "chat or completions",
            }),
        }
    }
}
