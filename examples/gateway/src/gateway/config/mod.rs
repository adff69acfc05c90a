//! `kvroute serve` configuration: the TOML file and the rule documents the admin
//! API accepts (the same `[[rules]]` shape, as JSON).
//!
//! [`schema`] is the file's shape as serde reads it; [`validate`] turns a
//! document into typed, checked specs ([`ServeConfig`], [`RuleSpec`]) or a
//! [`ConfigError`] whose message names the field at fault.

mod decisions;
mod schema;
mod validate;

pub use decisions::{DecisionsConfig, MAX_DECISION_RING};
pub use schema::{
    CostDoc, EndpointDoc, FileConfig, HealthConfig, LimitsConfig, ModelConfig, ReplicasConfig,
    RuleDoc,
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
    /// The TOML (or JSON) does not parse, or a field is unknown, missing, of
    /// the wrong type, or not one of the names its enum accepts (the message
    /// lists them), e.g. `rules[0].choice: unknown choice "fastest"; expected
    /// kv_exact, round_robin or content_affinity (line 5, column 10)`.
    #[error("{}", syntax_text(.field.as_deref(), .message, *.position))]
    Syntax {
        /// Dotted path of the field at fault, e.g. `rules[0].endpoints[1].role`
        /// (`None` when the text does not parse that far).
        field: Option<String>,
        /// What is wrong.
        message: String,
        /// Where in the text.
        position: Option<TextPosition>,
    },
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

/// A place in a configuration text, both 1-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextPosition {
    /// Line.
    pub line: usize,
    /// Column, in characters.
    pub column: usize,
}

impl TextPosition {
    /// The position of byte `offset` of `text` (clamped to its end and to a
    /// character boundary).
    fn of_offset(text: &str, offset: usize) -> Self {
        let mut end = offset.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let before = &text[..end];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Self {
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }
}

impl std::fmt::Display for TextPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// `field: message (line L, column C)`, each part only when known: the field
/// first, like [`ConfigError::Invalid`], so one reading serves both.
fn syntax_text(field: Option<&str>, message: &str, position: Option<TextPosition>) -> String {
    let mut out = String::new();
    if let Some(field) = field {
        out.push_str(field);
        out.push_str(": ");
    }
    out.push_str(message);
    if let Some(p) = position {
        out.push_str(&format!(" ({p})"));
    }
    out
}
