//! Python `json.dumps` output for template values, and Python `repr(float)`.
//!
//! transformers replaces Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
//! so tool schemas and tool-call arguments appear in the prompt exactly as Python
//! prints them: `", "`/`": "` separators, floats in repr form (`100.0`, `1e-07`,
//! `1e+21`), integers of any size, no HTML escaping.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};

use super::template::BigIntText;

/// Options of Python's `json.dumps` that chat templates may pass to `tojson`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (surrogate pairs above U+FFFF).
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string (Python: an int n means n spaces).
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; default `(", ", ": ")`, or `(",", ": ")`
    /// when `indent` is set, as in Python.
    pub separators: Option<(String, String)>,
    /// Sort dict keys.
    pub sort_keys: bool,
}

/// A value `json.dumps` cannot serialise (Python raises `TypeError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Object of type {0} is not JSON serializable")]
pub(crate) struct NotSerializable(pub String);

/// Python `repr(float)`: shortest round-trip digits, exponent form when the
/// decimal exponent is < -4 or >= 16, `.0` on integral values.
#[must_use]
pub(crate) fn float_repr(x: f64) -> String {
    let mut out = String::new();
    write_float_repr(&mut out, x);
    out
}

fn write_float_repr(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("NaN");
        return;
    }
    if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits (same digits as Python's repr),
    // e.g. "-1.5e-7"; re-lay them out with Python's rules.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if neg {
        out.push('-');
    }
    // Python: decpt = exp + 1; repr uses scientific iff decpt <= -4 or decpt > 16.
    let decpt = exp + 1;
    if decpt <= -4 || decpt > 16 {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    } else if decpt <= 0 {
        out.push_str("0.");
        for _ in 0..(-decpt) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let decpt = decpt as usize;
        if digits.len() <= decpt {
            out.push_str(&digits);
            for _ in digits.len()..decpt {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            let (int, frac) = digits.split_at(decpt);
            out.push_str(int);
            out.push('.');
            out.push_str(frac);
        }
    }
}

/// Writes `s` as a Python JSON string literal.
pub(crate) fn write_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    let mut run = 0;
    for (i, c) in s.char_indices() {
        let esc: Option<&str> = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            _ => None,
        };
        let needs_hex = c < ' ' || (ensure_ascii && !c.is_ascii());
        if esc.is_none() && !needs_hex {
            continue;
        }
        out.push_str(s.get(run..i).unwrap_or(""));
        run = i + c.len_utf8();
        if let Some(e) = esc {
            out.push_str(e);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        }
    }
    out.push_str(s.get(run..).unwrap_or(""));
    out.push('"');
}

/// `json.dumps(value, **opts)` for a template value.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, NotSerializable> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if opts.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut w = Writer {
        out: String::new(),
        budget: super::render_budget::remaining(),
        opts,
        item_sep,
        key_sep,
    };
    w.value(value, 0)?;
    Ok(w.out)
}

struct Writer<'a> {
    out: String,
    /// Bytes the text may reach (the render's budget: see `render_budget`).
    budget: usize,
    opts: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

/// Python converts dict keys that are not strings: `True` → `"true"`, `None` →
/// `"null"`, numbers → their repr.
fn key_string(key: &Value) -> Result<String, NotSerializable> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        other => Err(NotSerializable(format!("{other} (as a dict key)"))),
    }
}

fn write_number(out: &mut String, v: &Value) {
    if v.is_integer() {
        let _ = write!(out, "{v}");
    } else {
        write_float_repr(out, f64::try_from(v.clone()).unwrap_or(f64::NAN));
    }
}

impl Writer<'_> {
    fn newline(&mut self, level: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(indent);
            }
        }
    }

    fn value(&mut self, v: &Value, level: usize) -> Result<(), NotSerializable> {
        if level > 512 {
            return Err(NotSerializable("value nested too deeply".into()));
        }
        if self.out.len() > self.budget {
            super::render_budget::exceed();
            return Err(NotSerializable(
                "text over the rendered prompt's budget".into(),
            ));
        }
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(&mut self.out, v),
            ValueKind::String => write_json_string(
                &mut self.out,
                v.as_str().unwrap_or(""),
                self.opts.ensure_ascii,
            ),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v
                    .try_iter()
                    .map_err(|_| NotSerializable("iterable".into()))?
                    .collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(level + 1);
                    self.value(item, level + 1)?;
                }
                self.newline(level);
                self.out.push(']');
            }
            ValueKind::Map => {
                let mut pairs = Vec::new();
                for key in v
                    .try_iter()
                    .map_err(|_| NotSerializable("mapping".into()))?
                {
                    let item = v.get_item(&key).unwrap_or(Value::UNDEFINED);
                    pairs.push((key_string(&key)?, item));
                }
                if self.opts.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if pairs.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                self.out.push('{');
                for (i, (k, item)) in pairs.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(level + 1);
                    write_json_string(&mut self.out, k, self.opts.ensure_ascii);
                    self.out.push_str(self.key_sep);
                    self.value(item, level + 1)?;
                }
                self.newline(level);
                self.out.push('}');
            }
            ValueKind::Plain => match v.downcast_object_ref::<BigIntText>() {
                Some(big) => self.out.push_str(big.as_str()),
                None => return Err(NotSerializable(v.kind().to_string())),
            },
            ValueKind::Undefined => return Err(NotSerializable("Undefined".into())),
            other => return Err(NotSerializable(other.to_string())),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases: &[(f64, &str)] = &[
            (100.0, "100.0"),
            (0.5, "0.5"),
            (1.5e-7, "1.5e-07"),
            (1e21, "1e+21"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (9999999999999998.0, "9999999999999998.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (0.1 + 0.2, "0.30000000000000004"),
            (123.456, "123.456"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (-2.5e-5, "-2.5e-05"),
            (12345678901234567890.0, "1.2345678901234567e+19"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(*x), *want, "{x:e}");
        }
    }

    #[test]
    fn strings_escape_like_python() {
        let mut s = String::new();
        write_json_string(&mut s, "a\"\\\n\u{1}é😀<>&'\u{7f}", false);
        assert_eq!(s, "\"a\\\"\\\\\\n\\u0001é😀<>&'\u{7f}\"");
        let mut s = String::new();
        write_json_string(&mut s, "é😀", true);
        assert_eq!(s, "\"\\u00e9\\ud83d\\ude00\"");
    }

    #[test]
    fn default_options_keep_order_and_print_like_python() {
        let v = crate::prompt::template::to_value(
            &crate::prompt::parse_json(r#"{"b": [1, 2.5, "é<"], "a": null}"#.as_bytes()).unwrap(),
        );
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            r#"{"b": [1, 2.5, "é<"], "a": null}"#
        );
    }

    #[test]
    fn indent_separators_sort_keys() {
        let v = crate::prompt::template::to_value(
            &crate::prompt::parse_json(br#"{"b": [1, {}], "a": []}"#).unwrap(),
        );
        let opts = DumpOptions {
            indent: Some("  ".into()),
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": [],\n  \"b\": [\n    1,\n    {}\n  ]\n}"
        );
        let opts = DumpOptions {
            separators: Some((",".into(), ":".into())),
            ..DumpOptions::default()
        };
        assert_eq!(dumps(&v, &opts).unwrap(), r#"{"b":[1,{}],"a":[]}"#);
        assert!(dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
    }
}
