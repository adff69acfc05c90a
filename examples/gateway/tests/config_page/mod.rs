//! The configuration reference page (`docs/configuration.md`) read as data:
//! its key tables, and TOML documents built from their values. Shared by
//! `config_reference.rs` (the page against `kvroute serve`) and
//! `config_defaults.rs` (its defaults against the built-in ones).

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};

/// The page, relative to the repository root.
pub const PAGE: &str = "docs/configuration.md";

/// The tables of a minimal valid file besides the listeners: one model and
/// one KV-exact rule with a plain endpoint (index 0, which [`set`]
/// addresses) and one with KV events (so endpoint 0 may change engine or
/// role).
pub const MODEL_AND_RULE: &str = r#"
[[models]]
slug = "m"
dir = "model"
[[rules]]
name = "r"
models = ["m"]
contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0"
[[rules.endpoints]]
url = "http://127.0.0.1:9"
[[rules.endpoints]]
url = "http://127.0.0.1:10"
zmq = "tcp://*:11"
"#;

/// One documented key.
#[derive(Debug)]
pub struct Row {
    pub key: String,
    /// The default as a TOML value, when the page gives one in backticks.
    pub default: Option<String>,
    pub example: Option<String>,
    /// `(dotted path, TOML value)` the example (and the default) needs.
    pub needs: Vec<(String, String)>,
    /// The whole table row, for the names check and messages.
    pub text: String,
}

/// The backticked spans of a cell.
pub fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect()
}

/// A cell that is exactly one backticked span: its content.
pub fn literal(cell: &str) -> Option<String> {
    let c = cell.trim();
    (c.len() >= 2
        && c.starts_with('`')
        && c.ends_with('`')
        && c[1..c.len() - 1].find('`').is_none())
    .then(|| c[1..c.len() - 1].to_owned())
}

pub fn rows(page: &str) -> Vec<Row> {
    let mut out = Vec::new();
    let mut columns: Option<BTreeMap<String, usize>> = None;
    for line in page.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            columns = None;
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.first() == Some(&"key") {
            columns = Some(
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| ((*c).to_owned(), i))
                    .collect(),
            );
            continue;
        }
        let (Some(cols), Some(key)) = (&columns, cells.first().and_then(|c| literal(c))) else {
            continue;
        };
        let cell = |name: &str| {
            let i = *cols
                .get(name)
                .unwrap_or_else(|| panic!("{PAGE}: a key table without a `{name}` column"));
            cells.get(i).copied().unwrap_or("")
        };
        let needs = code_spans(cell("needs"))
            .into_iter()
            .map(|n| {
                let (path, value) = n
                    .split_once(" = ")
                    .unwrap_or_else(|| panic!("{key}: needs `{n}` is not `path = value`"));
                (path.to_owned(), value.to_owned())
            })
            .collect();
        out.push(Row {
            default: literal(cell("default")),
            example: literal(cell("example")),
            needs,
            text: line.to_owned(),
            key,
        });
    }
    out
}

/// The segments of `rules.endpoints[1].role`: `("rules", 0)`, `("endpoints", 1)`, `("role", 0)`.
pub fn segments(path: &str) -> Vec<(String, usize)> {
    path.split('.')
        .map(|s| match s.split_once('[') {
            Some((name, rest)) => (
                name.to_owned(),
                rest.trim_end_matches(']')
                    .parse()
                    .unwrap_or_else(|_| panic!("bad index in {path}")),
            ),
            None => (s.to_owned(), 0),
        })
        .collect()
}

/// The dotted path without indices.
pub fn plain(path: &str) -> String {
    segments(path)
        .into_iter()
        .map(|(s, _)| s)
        .collect::<Vec<_>>()
        .join(".")
}

pub fn toml_value(text: &str) -> Result<toml::Value, String> {
    let t: toml::Table = toml::from_str(&format!("v = {text}")).map_err(|e| e.to_string())?;
    Ok(t["v"].clone())
}

/// Sets `path` in `doc`: tables are created as needed; a segment in `arrays`
/// (an array of tables) is indexed, grown with empty tables when short.
pub fn set(doc: &mut toml::Table, path: &str, value: toml::Value, arrays: &BTreeSet<String>) {
    let segs = segments(path);
    let mut table = doc;
    let mut at = String::new();
    for (i, (name, index)) in segs.iter().enumerate() {
        if !at.is_empty() {
            at.push('.');
        }
        at.push_str(name);
        if i + 1 == segs.len() {
            table.insert(name.clone(), value);
            return;
        }
        if arrays.contains(&at) {
            let entry = table
                .entry(name.clone())
                .or_insert_with(|| toml::Value::Array(Vec::new()));
            if !entry.is_array() {
                *entry = toml::Value::Array(Vec::new());
            }
            let list = entry.as_array_mut().unwrap();
            while list.len() <= *index {
                list.push(toml::Value::Table(toml::Table::new()));
            }
            table = list[*index].as_table_mut().expect("an array of tables");
        } else {
            let entry = table
                .entry(name.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            table = entry.as_table_mut().unwrap();
        }
    }
}
