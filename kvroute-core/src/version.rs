//! Engine versions as operators write them (`0.33.0`, `v0.5.5.post3`, `0.10.2rc1`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A parsed `major.minor.patch` engine version.
///
/// Suffixes such as `.post3`, `rc1` or `+cu128` are accepted and ignored: no
/// hashing rule this crate knows about changes inside a patch release.
///
/// ```
/// use kvroute_core::EngineVersion;
/// let v: EngineVersion = "0.5.5.post3".parse().unwrap();
/// assert_eq!(v, EngineVersion::new(0, 5, 5));
/// assert!(v < EngineVersion::new(0, 5, 6));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineVersion {
    /// Major component.
    pub major: u32,
    /// Minor component.
    pub minor: u32,
    /// Patch component (0 when absent).
    pub patch: u32,
}

impl EngineVersion {
    /// Builds a version from its components.
    #[must_use]
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }
}

/// A version string that is not `MAJOR.MINOR[.PATCH][suffix]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine version {0:?} is not MAJOR.MINOR[.PATCH] (e.g. \"0.33.0\" or \"0.5.5.post3\")")]
pub struct VersionParseError(pub String);

/// Leading ASCII digits of `s` as a number; `None` if there are none.
fn leading_number(s: &str) -> Option<u32> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    s.get(..end)?.parse().ok()
}

impl FromStr for EngineVersion {
    type Err = VersionParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || VersionParseError(s.to_owned());
        let trimmed = s.trim();
        let body = trimmed.strip_prefix(['v', 'V']).unwrap_or(trimmed);
        let mut parts = body.split('.');
        let major_text = parts.next().ok_or_else(err)?;
        if major_text.is_empty() || !major_text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let major = major_text.parse().map_err(|_| err())?;
        let minor = parts.next().and_then(leading_number).ok_or_else(err)?;
        let patch = match parts.next() {
            None => 0,
            Some(p) => leading_number(p).unwrap_or(0),
        };
        Ok(Self::new(major, minor, patch))
    }
}

impl fmt::Display for EngineVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl Serialize for EngineVersion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EngineVersion {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_engine_spellings() {
        let cases = [
            ("0.33.0", (0, 33, 0)),
            ("v0.10.2rc1", (0, 10, 2)),
            ("0.5.5.post3", (0, 5, 5)),
            ("0.4.10.post2", (0, 4, 10)),
            ("1.2", (1, 2, 0)),
            ("1.1.0rc5+cu128", (1, 1, 0)),
        ];
        for (text, (a, b, c)) in cases {
            assert_eq!(
                text.parse::<EngineVersion>(),
                Ok(EngineVersion::new(a, b, c)),
                "{text}"
            );
        }
        for bad in ["", "x.1", "1", "1.x", "v"] {
            assert!(bad.parse::<EngineVersion>().is_err(), "{bad}");
        }
    }
}
