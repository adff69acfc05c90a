//! `kvroute serve` configuration: the TOML file and the rule documents the admin
//! API accepts (the same `[[rules]]` shape, as JSON).
//!
//! [`schema`] is the file's shape as serde reads it; [`validate`] turns a
//! document into typed, checked specs ([`ServeConfig`], [`RuleSpec`]) or a
//! [`ConfigError`] whose message names the field at fault.

mod schema;
mod validate;

pub use schema::{
    DecisionsConfig, EndpointDoc, FileConfig, HealthConfig, LimitsConfig, ModelConfig,
    ReplicasConfig, RuleDoc,
};
pub use validate::{check_rule_set, rule_from_json, EndpointSpec, RuleSpec, ServeConfig};

use std::path::PathBuf;

/// A configuration that cannot be used, with the place it went wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML (or JSON) does not parse or has unknown / mistyped fields.
    #[error("{0}")]
    Syntax(String),
    /// A value is out of range or inconsistent.
    #[error("{field}: {message}")]
    Invalid {
        /// Dotted path of the field, e.g. `rules[0].endpoints[1].url`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}
