//! jinja2's semantics where minijinja's built-in tests and filters differ
//! from them, for those chat templates use. transformers renders templates
//! with jinja2, so a template that asks `content is sequence` or pipes a
//! string through `int` gets Python's answer there; each override here is
//! checked against jinja2 (through transformers) by
//! `tests/prompt_template_jinja2.rs`.

use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

/// Installs the overrides.
pub(crate) fn register(env: &mut Environment<'_>) {
    env.add_test("sequence", is_sequence);
    env.add_test("iterable", is_iterable);
    env.add_filter("int", int_filter);
    env.add_filter("float", float_filter);
    env.add_filter("indent", indent_filter);
}

/// jinja2's `sequence`: a length and item access, which strings and
/// mappings have (and an undefined value, of length 0); `None`, numbers and
/// lazy iterables (dict views, `map`/`select` results) do not.
fn is_sequence(v: &Value) -> bool {
    matches!(
        v.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Undefined
    )
}

/// jinja2's `iterable`: `iter(value)` succeeds — strings, sequences,
/// mappings, lazy iterables, an undefined value; not `None`, booleans or
/// numbers.
fn is_iterable(v: &Value) -> bool {
    is_sequence(v) || v.kind() == ValueKind::Iterable
}

/// Positional argument `i` or keyword `name` of a filter, if given.
fn arg(rest: &Rest<Value>, kwargs: &Kwargs, i: usize, name: &str) -> Result<Option<Value>, Error> {
    let kw: Option<Value> = kwargs.get(name)?;
    Ok(kw.or_else(|| rest.get(i).cloned()))
}

/// jinja2's `int(value, default=0, base=10)`: `int(value)` (a string in
/// `base`, its prefix allowed), else `int(float(value))`, else `default`.
/// An undefined value, and an infinite one, raise as in Python.
fn int_filter(value: Value, rest: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let default = arg(&rest, &kwargs, 0, "default")?.unwrap_or(Value::from(0));
    // A base that is not an integer makes `int(s, base)` raise a TypeError,
    // which the filter answers with `int(float(s))`.
    let base = match arg(&rest, &kwargs, 1, "base")? {
        Some(b) => u32::try_from(b).ok(),
        None => Some(10),
    };
    kwargs.assert_all_used()?;
    let parsed = match value.kind() {
        ValueKind::Undefined => return Err(bad("int: the value is undefined")),
        // `int(s, base)`, else `int(float(s))`, whose overflow is caught.
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            base.and_then(|b| py_int(s, b))
                .or_else(|| py_float(s).and_then(truncate))
        }
        ValueKind::Bool => Some(i128::from(value.is_true())),
        // `int(x)` of an infinite float raises (its overflow is not caught
        // there); of NaN it falls back to the default.
        ValueKind::Number => match i128::try_from(value.clone()) {
            Ok(n) => Some(n),
            Err(_) => match f64::try_from(value) {
                Ok(f) if f.is_infinite() => {
                    return Err(bad("int: cannot convert float infinity to integer"))
                }
                Ok(f) => truncate(f),
                Err(_) => None,
            },
        },
        _ => None,
    };
    Ok(parsed.map_or(default, Value::from))
}

/// jinja2's `float(value, default=0.0)`: `float(value)`, else `default`;
/// an undefined value raises.
fn float_filter(value: Value, rest: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let default = arg(&rest, &kwargs, 0, "default")?.unwrap_or(Value::from(0.0));
    kwargs.assert_all_used()?;
    let parsed = match value.kind() {
        ValueKind::Undefined => return Err(bad("float: the value is undefined")),
        ValueKind::String => py_float(value.as_str().unwrap_or_default()),
        ValueKind::Bool => Some(if value.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(value).ok(),
        _ => None,
    };
    Ok(parsed.map_or(default, Value::from))
}

/// jinja2's `indent(s, width=4, first=False, blank=False)`: lines split as
/// Python's `str.splitlines` splits them, after a newline appended to `s`
/// (so a trailing newline survives); blank lines stay unindented unless
/// `blank`.
fn indent_filter(value: Value, rest: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let width = arg(&rest, &kwargs, 0, "width")?;
    let first = arg(&rest, &kwargs, 1, "first")?.is_some_and(|v| v.is_true());
    let blank = arg(&rest, &kwargs, 2, "blank")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    // Python adds a newline to the value: anything but a string raises.
    if value.kind() != ValueKind::String {
        return Err(bad("indent: the value is not a string"));
    }
    let indention = match &width {
        None => "    ".to_owned(),
        Some(w) if w.kind() == ValueKind::String => w.as_str().unwrap_or_default().to_owned(),
        Some(w) => {
            let n = i64::try_from(w.clone())
                .map_err(|_| bad("indent: width must be a number or a string"))?;
            " ".repeat(usize::try_from(n).unwrap_or(0))
        }
    };
    let mut text = value.as_str().unwrap_or_default().to_owned();
    text.push('\n');
    let lines = splitlines(&text);
    let mut out = String::with_capacity(text.len() + lines.len() * indention.len());
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(&indention);
            }
        }
        out.push_str(line);
    }
    if first {
        out.insert_str(0, &indention);
    }
    Ok(Value::from(out))
}

/// Python's `str.splitlines()`: lines without their ends, on every line
/// boundary Python knows; no empty last line for a trailing boundary.
fn splitlines(s: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let boundary = matches!(
            c,
            '\n' | '\r'
                | '\u{b}'
                | '\u{c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        );
        if !boundary {
            continue;
        }
        lines.push(&s[start..i]);
        let mut end = i + c.len_utf8();
        if c == '\r' {
            if let Some((j, '\n')) = chars.peek().copied() {
                chars.next();
                end = j + 1;
            }
        }
        start = end;
    }
    if start < s.len() {
        lines.push(&s[start..]);
    }
    lines
}

fn bad(msg: &'static str) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg)
}

/// Python's `int(float)`: truncation; `None` for infinities and NaN
/// (`OverflowError`, `ValueError`).
fn truncate(f: f64) -> Option<i128> {
    #[allow(clippy::cast_possible_truncation)]
    (f.is_finite() && f.abs() < 1.0e38).then(|| f.trunc() as i128)
}

/// Python's `int(s, base)`: surrounding whitespace, a sign, the base's
/// prefix (`0x`, `0o`, `0b`; base 0 reads it, and is 10 without one), and
/// single underscores between digits (or after the prefix) allowed.
fn py_int(s: &str, base: u32) -> Option<i128> {
    let s = s.trim();
    let (negative, rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let prefix = |r: &str| -> Option<u32> {
        match r.get(..2).map(str::to_ascii_lowercase).as_deref() {
            Some("0x") => Some(16),
            Some("0o") => Some(8),
            Some("0b") => Some(2),
            _ => None,
        }
    };
    let (base, digits) = match (base, prefix(rest)) {
        (0, Some(b)) => (b, &rest[2..]),
        (0, None) => (10, rest),
        (b, Some(p)) if b == p => (b, &rest[2..]),
        (b, _) => (b, rest),
    };
    // After a prefix, one underscore may lead: `0x_ff`.
    let digits = if digits.len() < rest.len() {
        digits.strip_prefix('_').unwrap_or(digits)
    } else {
        digits
    };
    let digits = without_underscores(digits)?;
    if !(2..=36).contains(&base) {
        return None;
    }
    let n = i128::from_str_radix(&digits, base).ok()?;
    Some(if negative { -n } else { n })
}

/// Python's `float(s)`: surrounding whitespace, `inf`/`nan` spellings, and
/// single underscores between digits allowed.
fn py_float(s: &str) -> Option<f64> {
    let s = s.trim();
    let lower = s.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if matches!(unsigned, "inf" | "infinity" | "nan") {
        return lower.parse().ok();
    }
    let plain = without_underscores_in_number(s, u8::is_ascii_digit)?;
    // Rust's parser also takes "inf"-like words handled above; anything
    // else it takes is a Python float literal too.
    plain.parse().ok()
}

/// `s` without its underscores, if each sits between two digits (and `s` is
/// digits only otherwise).
fn without_underscores(s: &str) -> Option<String> {
    if s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    without_underscores_in_number(s, u8::is_ascii_alphanumeric)
}

/// `s` without underscores that each sit between two `digit`s; `None` if
/// one does not.
fn without_underscores_in_number(s: &str, digit: fn(&u8) -> bool) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    for (i, c) in s.char_indices() {
        if c == '_' {
            let before = i.checked_sub(1).and_then(|j| bytes.get(j));
            let after = bytes.get(i + 1);
            if !(before.is_some_and(digit) && after.is_some_and(digit)) {
                return None;
            }
        } else {
            out.push(c);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_number_parsing() {
        assert_eq!(py_int(" 42 ", 10), Some(42));
        assert_eq!(py_int("-1_000", 10), Some(-1000));
        assert_eq!(py_int("1__0", 10), None);
        assert_eq!(py_int("_1", 10), None);
        assert_eq!(py_int("2.5", 10), None);
        assert_eq!(py_int("ff", 16), Some(255));
        assert_eq!(py_int("0x1A", 16), Some(26));
        assert_eq!(py_int("0b101", 2), Some(5));
        assert_eq!(py_int("0x10", 0), Some(16));
        assert_eq!(py_int("0x_ff", 16), Some(255));
        assert_eq!(py_int("-0o17", 8), Some(-15));
        assert_eq!(py_int("0x10", 10), None);
        assert_eq!(py_float("2.5"), Some(2.5));
        assert_eq!(py_float(" 1e3 "), Some(1000.0));
        assert_eq!(py_float("-inf"), Some(f64::NEG_INFINITY));
        assert!(py_float("nan").is_some_and(f64::is_nan));
        assert_eq!(py_float("x"), None);
        assert_eq!(truncate(-2.7), Some(-2));
        assert_eq!(truncate(f64::INFINITY), None);
    }

    #[test]
    fn python_splitlines() {
        assert_eq!(splitlines("a\nb\n"), vec!["a", "b"]);
        assert_eq!(splitlines("a\r\nb\rc\u{2028}d"), vec!["a", "b", "c", "d"]);
        assert_eq!(splitlines("\n"), vec![""]);
        assert!(splitlines("").is_empty());
    }
}
