//! Configuration names: the error of an unknown one, and `FromStr` of
//! [`crate::ApiKind`] (engines are looked up in [`crate::engine::Registry`]).

use std::str::FromStr;

pub use kvroute_core::UnknownName;

use crate::prompt::ApiKind;

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
