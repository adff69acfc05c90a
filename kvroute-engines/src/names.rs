//! Configuration names of the engines' enums (`FromStr`), matching
//! [`EngineKind::as_str`] and [`crate::ApiKind::as_str`].

use std::str::FromStr;

pub use kvroute_core::UnknownName;

use crate::prompt::ApiKind;
use crate::transport::EngineKind;

impl FromStr for EngineKind {
    type Err = UnknownName;

    /// The names [`EngineKind::as_str`] prints (`llamacpp` is accepted too).
    ///
    /// ```
    /// use kvroute_engines::transport::EngineKind;
    /// for e in [EngineKind::Vllm, EngineKind::Sglang, EngineKind::TensorRtLlm, EngineKind::LlamaCpp] {
    ///     assert_eq!(e.as_str().parse::<EngineKind>(), Ok(e));
    /// }
    /// assert!("tgi".parse::<EngineKind>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        match s {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "trtllm" => Ok(Self::TensorRtLlm),
            "llama.cpp" | "llamacpp" => Ok(Self::LlamaCpp),
            _ => Err(UnknownName {
                what: "engine",
                name: s.to_owned(),
                expected: "vllm, sglang, trtllm or llama.cpp",
            }),
        }
    }
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
