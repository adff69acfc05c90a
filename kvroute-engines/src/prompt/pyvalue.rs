//! A JSON value as Python's `json.loads` sees it, and a parser that matches it.
//!
//! vLLM receives the body through FastAPI (`json.loads`), and everything the chat
//! template later serialises with `tojson` is a Python object built from that parse.
//! Reproducing the template output byte for byte therefore needs Python's number
//! model (int of any size vs. float), Python's dict semantics (first position, last
//! value for a duplicate key) and its extensions (`NaN`, `Infinity`). serde_json
//! offers neither exact big integers without the workspace-wide
//! `arbitrary_precision` feature nor `NaN`, so this module parses the body itself.

use indexmap::IndexMap;

/// Python's default `sys.set_int_max_str_digits` limit: longer integer literals
/// make `json.loads` raise, so the body is not JSON for vLLM either.
const MAX_INT_DIGITS: usize = 4300;

/// Deeper nesting than this is refused (Python would hit its recursion limit
/// near 1000; a bound keeps the parser's stack use fixed for any input).
pub const MAX_JSON_DEPTH: usize = 256;

/// A parsed JSON value with Python's data model.
#[derive(Debug, Clone, PartialEq)]
pub enum PyValue {
    /// `null` (Python `None`).
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// An integer that fits `i64`.
    Int(i64),
    /// An integer outside `i64`, kept as its canonical decimal text.
    BigInt(Box<str>),
    /// A float (any literal with a fraction or exponent, `NaN`, `Infinity`).
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    List(Vec<PyValue>),
    /// An object; insertion order preserved like a Python dict.
    Dict(PyDict),
}

/// An insertion-ordered string-keyed map (Python `dict` from JSON).
pub type PyDict = IndexMap<String, PyValue>;

impl PyValue {
    /// The string, if this is one.
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The dict, if this is one.
    #[must_use]
    pub fn as_dict(&self) -> Option<&PyDict> {
        match self {
            Self::Dict(d) => Some(d),
            _ => None,
        }
    }

    /// The list, if this is one.
    #[must_use]
    pub fn as_list(&self) -> Option<&[PyValue]> {
        match self {
            Self::List(l) => Some(l),
            _ => None,
        }
    }

    /// `true` for `null`.
    #[must_use]
    pub fn is_null(&self) -> bool {
        matches!(self, Self::Null)
    }

    /// Python truthiness (`bool(x)`).
    #[must_use]
    pub fn is_truthy(&self) -> bool {
        match self {
            Self::Null => false,
            Self::Bool(b) => *b,
            Self::Int(i) => *i != 0,
            Self::BigInt(_) => true,
            Self::Float(f) => *f != 0.0,
            Self::Str(s) => !s.is_empty(),
            Self::List(l) => !l.is_empty(),
            Self::Dict(d) => !d.is_empty(),
        }
    }

    /// Python type name, for error messages.
    #[must_use]
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Null => "NoneType",
            Self::Bool(_) => "bool",
            Self::Int(_) | Self::BigInt(_) => "int",
            Self::Float(_) => "float",
            Self::Str(_) => "str",
            Self::List(_) => "list",
            Self::Dict(_) => "dict",
        }
    }
}

/// Why a body is not JSON for Python's `json.loads`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON at byte {offset}: {reason}")]
pub struct JsonSyntaxError {
    /// Byte offset of the problem.
    pub offset: usize,
    /// What was expected or found.
    pub reason: &'static str,
}

/// Parses bytes the way `json.loads(body: bytes)` does (UTF-8, optional BOM,
/// strict strings, `NaN`/`Infinity` accepted, last duplicate key wins).
///
/// ```
/// use kvroute_engines::prompt::{parse_json, PyValue};
/// let v = parse_json(br#"{"a": 1e2, "b": 123456789012345678901234567890}"#).unwrap();
/// let d = v.as_dict().unwrap();
/// assert_eq!(d["a"], PyValue::Float(100.0));
/// assert_eq!(d["b"], PyValue::BigInt("123456789012345678901234567890".into()));
/// ```
pub fn parse_json(bytes: &[u8]) -> Result<PyValue, JsonSyntaxError> {
    parse_json_str(body_text(bytes)?)
}

/// A body's text as `json.loads(body: bytes)` decodes it: UTF-8, an
/// optional BOM dropped.
fn body_text(bytes: &[u8]) -> Result<&str, JsonSyntaxError> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    std::str::from_utf8(bytes).map_err(|e| JsonSyntaxError {
        offset: e.valid_up_to(),
        reason: "body is not UTF-8",
    })
}

/// [`parse_json`] keeping only the top-level object's `fields`: the result
/// is a dict of those (as [`parse_json`]'s dict has them: first position,
/// last value) when the body is an object, [`PyValue::Null`] when it is
/// valid JSON of another kind, and the same error whenever [`parse_json`]
/// fails. Every other value is checked but never built, so the memory it
/// takes is about the largest single string or number, not the body's tree
/// (a body of a million list items builds nothing) — for hosts that need a
/// request's `model` or `stream` without its prompt.
///
/// ```
/// use kvroute_engines::prompt::{parse_json_fields, PyValue};
/// let v = parse_json_fields(br#"{"prompt": [1, 2, 3], "model": "m", "stream": true}"#, &["model", "stream"]).unwrap();
/// let d = v.as_dict().unwrap();
/// assert_eq!(d.len(), 2);
/// assert_eq!(d["model"], PyValue::Str("m".into()));
/// assert_eq!(parse_json_fields(b"[0, 0]", &["model"]).unwrap(), PyValue::Null);
/// assert!(parse_json_fields(br#"{"model": "m",}"#, &["model"]).is_err());
/// ```
///
/// # Errors
/// [`JsonSyntaxError`] where [`parse_json`] has one.
pub fn parse_json_fields(bytes: &[u8], fields: &[&str]) -> Result<PyValue, JsonSyntaxError> {
    parse_whole(body_text(bytes)?, |p| {
        if p.peek() == Some(b'{') {
            p.object_fields(fields)
        } else {
            p.skip_value(0).map(|()| PyValue::Null)
        }
    })
}

/// Parses a string the way `json.loads(text: str)` does.
pub(crate) fn parse_json_str(text: &str) -> Result<PyValue, JsonSyntaxError> {
    parse_whole(text, |p| p.value(0))
}

/// `read` over the whole of `text`: whitespace around the value allowed,
/// anything after it an error.
fn parse_whole(
    text: &str,
    read: impl FnOnce(&mut Parser<'_>) -> Result<PyValue, JsonSyntaxError>,
) -> Result<PyValue, JsonSyntaxError> {
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
    };
    p.skip_ws();
    let v = read(&mut p)?;
    p.skip_ws();
    if p.pos != p.s.len() {
        return Err(p.err("extra data after the value"));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, reason: &'static str) -> JsonSyntaxError {
        JsonSyntaxError {
            offset: self.pos,
            reason,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat_literal(&mut self, lit: &[u8]) -> bool {
        if self.s.get(self.pos..self.pos + lit.len()) == Some(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<PyValue, JsonSyntaxError> {
        if depth > MAX_JSON_DEPTH {
            return Err(self.err("nesting too deep"));
        }
        match self.peek() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => self.string().map(PyValue::Str),
            Some(b'n') if self.eat_literal(b"null") => Ok(PyValue::Null),
            Some(b't') if self.eat_literal(b"true") => Ok(PyValue::Bool(true)),
            Some(b'f') if self.eat_literal(b"false") => Ok(PyValue::Bool(false)),
            Some(b'N') if self.eat_literal(b"NaN") => Ok(PyValue::Float(f64::NAN)),
            Some(b'I') if self.eat_literal(b"Infinity") => Ok(PyValue::Float(f64::INFINITY)),
            Some(b'-') if self.eat_literal(b"-Infinity") => Ok(PyValue::Float(f64::NEG_INFINITY)),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(self.err("expecting value")),
        }
    }

    /// A `{...}` or `[...]` at the cursor (its opening byte), each member or
    /// item handed to `item`; the delimiters and their errors are Python's.
    fn members(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Result<(), JsonSyntaxError>,
    ) -> Result<(), JsonSyntaxError> {
        self.pos += 1;
        self.skip_ws();
        if self.peek() == Some(close) {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            item(self)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(c) if c == close => {
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(self.err("expecting ',' delimiter")),
            }
        }
    }

    /// An object member's key and the `:` after it; the cursor is left on
    /// the value.
    fn member_key(&mut self) -> Result<String, JsonSyntaxError> {
        if self.peek() != Some(b'"') {
            return Err(self.err("expecting property name enclosed in double quotes"));
        }
        let key = self.string()?;
        self.skip_ws();
        if self.peek() != Some(b':') {
            return Err(self.err("expecting ':' delimiter"));
        }
        self.pos += 1;
        self.skip_ws();
        Ok(key)
    }

    fn object(&mut self, depth: usize) -> Result<PyValue, JsonSyntaxError> {
        let mut map = PyDict::new();
        self.members(b'}', |p| {
            let key = p.member_key()?;
            let v = p.value(depth + 1)?;
            // Python dict: a repeated key keeps its first position, takes the last value.
            map.insert(key, v);
            Ok(())
        })?;
        Ok(PyValue::Dict(map))
    }

    /// The top-level object (at `{`) with only `fields` built.
    fn object_fields(&mut self, fields: &[&str]) -> Result<PyValue, JsonSyntaxError> {
        let mut map = PyDict::new();
        self.members(b'}', |p| {
            let key = p.member_key()?;
            if fields.contains(&key.as_str()) {
                let v = p.value(1)?;
                map.insert(key, v);
                Ok(())
            } else {
                p.skip_value(1)
            }
        })?;
        Ok(PyValue::Dict(map))
    }

    /// [`Self::value`]'s checks without building the value (strings and
    /// numbers are read one at a time and dropped).
    fn skip_value(&mut self, depth: usize) -> Result<(), JsonSyntaxError> {
        if depth > MAX_JSON_DEPTH {
            return Err(self.err("nesting too deep"));
        }
        match self.peek() {
            Some(b'{') => self.members(b'}', |p| {
                p.member_key()?;
                p.skip_value(depth + 1)
            }),
            Some(b'[') => self.members(b']', |p| p.skip_value(depth + 1)),
            _ => self.value(depth).map(drop),
        }
    }

    fn array(&mut self, depth: usize) -> Result<PyValue, JsonSyntaxError> {
        let mut items = Vec::new();
        self.members(b']', |p| {
            items.push(p.value(depth + 1)?);
            Ok(())
        })?;
        Ok(PyValue::List(items))
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<PyValue, JsonSyntaxError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.err("expecting value")),
        }
        let mut is_float = false;
        if self.peek() == Some(b'.') && matches!(self.s.get(self.pos + 1), Some(b'0'..=b'9')) {
            self.pos += 1;
            self.digits();
            is_float = true;
        }
        if let Some(b'e' | b'E') = self.peek() {
            // Python's scanner only takes the exponent when digits follow; otherwise
            // the number ends before the 'e' (and the 'e' is then extra data).
            let save = self.pos;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                self.pos = save;
            } else {
                is_float = true;
            }
        }
        let lit = self.text.get(start..self.pos).unwrap_or("");
        if is_float {
            // Rust's parser is correctly rounded, like Python's float().
            return lit
                .parse::<f64>()
                .map(PyValue::Float)
                .map_err(|_| self.err("bad number"));
        }
        if let Ok(i) = lit.parse::<i64>() {
            return Ok(PyValue::Int(i));
        }
        let digits = lit.trim_start_matches('-');
        if digits.len() > MAX_INT_DIGITS {
            return Err(self.err("integer literal exceeds Python's digit limit"));
        }
        Ok(PyValue::BigInt(lit.into()))
    }

    fn hex4(&mut self) -> Result<u32, JsonSyntaxError> {
        let h = self
            .s
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.err("invalid \\uXXXX escape"))?;
        let mut v = 0u32;
        for &b in h {
            let d = (b as char)
                .to_digit(16)
                .ok_or_else(|| self.err("invalid \\uXXXX escape"))?;
            v = v * 16 + d;
        }
        self.pos += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonSyntaxError> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let run_start = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // Runs stop only at ASCII bytes, so the slice is on char boundaries.
            out.push_str(self.text.get(run_start..self.pos).unwrap_or(""));
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let esc = self.peek().ok_or_else(|| self.err("unterminated string"))?;
                    self.pos += 1;
                    match esc {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let c = self.unicode_escape()?;
                            out.push(c);
                        }
                        _ => return Err(self.err("invalid \\escape")),
                    }
                }
                Some(_) => return Err(self.err("invalid control character in string")),
                None => return Err(self.err("unterminated string")),
            }
        }
    }

    fn unicode_escape(&mut self) -> Result<char, JsonSyntaxError> {
        let hi = self.hex4()?;
        if (0xD800..0xDC00).contains(&hi) && self.s.get(self.pos..self.pos + 2) == Some(b"\\u") {
            let save = self.pos;
            self.pos += 2;
            let lo = self.hex4()?;
            if (0xDC00..0xE000).contains(&lo) {
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return char::from_u32(c).ok_or_else(|| self.err("invalid surrogate pair"));
            }
            self.pos = save;
        }
        // Python keeps a lone surrogate in the str, but it can never be encoded
        // to UTF-8 for tokenization; refusing it here is the only faithful option
        // for a Rust String.
        char::from_u32(hi).ok_or_else(|| self.err("lone surrogate in \\u escape"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_number_model() {
        assert_eq!(parse_json(b"100").unwrap(), PyValue::Int(100));
        assert_eq!(parse_json(b"-0").unwrap(), PyValue::Int(0));
        assert_eq!(parse_json(b"1.0").unwrap(), PyValue::Float(1.0));
        assert_eq!(parse_json(b"1E2").unwrap(), PyValue::Float(100.0));
        assert!(matches!(parse_json(b"NaN").unwrap(), PyValue::Float(f) if f.is_nan()));
        assert_eq!(
            parse_json(b"-Infinity").unwrap(),
            PyValue::Float(f64::NEG_INFINITY)
        );
        assert_eq!(
            parse_json(b"-99999999999999999999").unwrap(),
            PyValue::BigInt("-99999999999999999999".into())
        );
        assert!(parse_json(b"01").is_err());
        assert!(parse_json(b"1.").is_err());
        assert!(parse_json(b"1e").is_err());
    }

    #[test]
    fn duplicate_key_keeps_first_position_last_value() {
        let v = parse_json(br#"{"a":1,"b":2,"a":3}"#).unwrap();
        let d = v.as_dict().unwrap();
        let pairs: Vec<_> = d.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert_eq!(pairs, vec![("a", PyValue::Int(3)), ("b", PyValue::Int(2))]);
    }

    #[test]
    fn strings_strict_and_surrogates() {
        assert_eq!(
            parse_json(br#""\ud83d\ude00 \u00e9""#).unwrap(),
            PyValue::Str("\u{1F600} \u{e9}".into())
        );
        assert!(parse_json(b"\"a\nb\"").is_err());
        assert!(parse_json(br#""\ud800""#).is_err());
        assert_eq!(
            parse_json(b"\xEF\xBB\xBF\"x\"").unwrap(),
            PyValue::Str("x".into())
        );
        assert!(parse_json(b"\"\xff\"").is_err());
    }

    #[test]
    fn depth_is_bounded() {
        let deep = "[".repeat(MAX_JSON_DEPTH + 5);
        assert!(parse_json(deep.as_bytes()).is_err());
        let at_limit = format!(
            "{}{}",
            "[".repeat(MAX_JSON_DEPTH + 1),
            "]".repeat(MAX_JSON_DEPTH + 1)
        );
        assert!(parse_json(at_limit.as_bytes()).is_ok());
        // A hostile body: refused at the bound, whatever the nesting (no stack
        // overflow, no work beyond the first MAX_JSON_DEPTH levels).
        for open in ["[", "{\"a\":"] {
            let hostile = open.repeat(100_000);
            let err = parse_json(hostile.as_bytes()).unwrap_err();
            assert_eq!(err.reason, "nesting too deep");
            assert!(err.offset <= open.len() * (MAX_JSON_DEPTH + 1), "{err:?}");
        }
    }
}
