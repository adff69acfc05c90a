//! The error of every configuration name kvroute parses (`FromStr` of its
//! fieldless enums: key modes, engines, API kinds, choices, topologies,
//! scorers, selectors, roles): one type, so every crate reports an unknown
//! name the same way and a host matches one error.

/// A name no variant of the enum has.
///
/// ```
/// use kvroute_core::{KeyMode, UnknownName};
/// let err = "hybrid".parse::<KeyMode>().unwrap_err();
/// assert_eq!(err, UnknownName { what: "key mode", name: "hybrid".into(), expected: "engine or rekey" });
/// assert_eq!(err.to_string(), "unknown key mode \"hybrid\"; expected engine or rekey");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {name:?}; expected {expected}")]
pub struct UnknownName {
    /// What was parsed (`"choice"`, `"engine"`, `"key mode"`, ...).
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The accepted names, as a sentence fragment.
    pub expected: &'static str,
}
