//! Chat templates rendered with minijinja the way transformers renders them with
//! Jinja2 (`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`,
//! loop controls, lenient undefined, `tojson` = Python `json.dumps`,
//! `raise_exception`, `strftime_now`), plus transformers' `continue_final_message`
//! cut and vLLM's content-format detection.

use std::collections::HashSet;
use std::fmt::{self, Write as _};
use std::sync::Arc;

use indexmap::IndexMap;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior};

use super::pyjson::{dumps, float_repr, DumpOptions};
use super::pyvalue::{PyDict, PyValue};

/// The marker transformers appends to the final message to find where its
/// content ends in the rendered text.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG";

/// How message content reaches the template (vLLM `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is a string; text parts are joined with `"\n"`.
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// Why a template failed to compile or render.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template source does not compile.
    #[error("chat template does not compile: {0}")]
    Compile(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised: {0}")]
    Raised(String),
    /// Rendering failed (type error, unserialisable `tojson` input, ...).
    #[error("chat template rendering failed: {0}")]
    Render(String),
    /// transformers refuses the input before or after rendering
    /// (empty conversation, `continue_final_message` without a findable final text).
    #[error("{0}")]
    Input(String),
    /// The rendered prompt would be longer than this many bytes
    /// ([`ChatTemplate::render_limited`]).
    #[error("rendered prompt over {0} bytes")]
    OutputTooLong(usize),
}

/// An integer outside `i128`, carried into the template so `tojson` prints it exactly.
#[derive(Debug, Clone)]
pub(crate) struct BigIntText(pub Box<str>);

impl BigIntText {
    /// The decimal digits (with sign).
    #[must_use]
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

impl Object for BigIntText {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }
    fn is_true(self: &Arc<Self>) -> bool {
        true
    }
    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Converts a parsed request value into a template value, keeping Python's types.
#[must_use]
pub(crate) fn to_value(v: &PyValue) -> Value {
    match v {
        PyValue::Null => Value::from(()),
        PyValue::Bool(b) => Value::from(*b),
        PyValue::Int(i) => Value::from(*i),
        PyValue::BigInt(text) => match text.parse::<i128>() {
            Ok(i) => Value::from(i),
            Err(_) => Value::from_object(BigIntText(text.clone())),
        },
        PyValue::Float(f) => Value::from(*f),
        PyValue::Str(s) => Value::from(s.as_str()),
        PyValue::List(items) => Value::from(items.iter().map(to_value).collect::<Vec<_>>()),
        PyValue::Dict(d) => dict_to_value(d),
    }
}

fn dict_to_value(d: &PyDict) -> Value {
    let map: IndexMap<Value, Value> = d
        .iter()
        .map(|(k, v)| (Value::from(k.as_str()), to_value(v)))
        .collect();
    Value::from(map)
}

/// Everything that reaches the template for one chat request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TemplateInput {
    /// Conversation after vLLM's message parsing (dicts).
    pub messages: Vec<PyValue>,
    /// Tool schemas (vLLM's normalised `model_dump`), `None` when absent.
    pub tools: Option<Vec<PyValue>>,
    /// `documents` from the request.
    pub documents: Option<PyValue>,
    /// Open an assistant turn at the end.
    pub add_generation_prompt: bool,
    /// Leave the last message open (cut at its end).
    pub continue_final_message: bool,
    /// Other template variables that passed vLLM's kwarg filter (e.g. `enable_thinking`).
    pub extra: PyDict,
}

/// A compiled chat template with the variables it declares.
pub struct ChatTemplate {
    env: Environment<'static>,
    declared: HashSet<String>,
    source: String,
    special_tokens: Vec<(String, String)>,
    content_format: ContentFormat,
    /// What SGLang's detection picks (it has no override).
    sglang_content_format: ContentFormat,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("declared", &self.declared)
            .field("content_format", &self.content_format)
            .finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `special_tokens` are the tokenizer's special-token
    /// strings (`eos_token`, ...) that transformers passes as variables.
    ///
    /// ```
    /// use kvroute_engines::prompt::{parse_json, ChatTemplate, TemplateInput};
    /// let t = ChatTemplate::new("{% for m in messages %}{{ m.content | tojson }}{% endfor %}", vec![]).unwrap();
    /// let input = TemplateInput {
    ///     messages: vec![parse_json(br#"{"role": "user", "content": "<1.0>"}"#).unwrap()],
    ///     ..TemplateInput::default()
    /// };
    /// assert_eq!(t.render(&input).unwrap(), "\"<1.0>\"");
    /// ```
    pub fn new(source: &str, special_tokens: Vec<(String, String)>) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        super::jinja_compat::register(&mut env);
        env.set_formatter(|out, _state, value| {
            out.write_str(&py_str(value))
                .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        });
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        let declared = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Compile(e.to_string()))?
            .undeclared_variables(false);
        Ok(Self {
            env,
            declared,
            source: source.to_owned(),
            special_tokens,
            content_format: detect_content_format(source),
            sglang_content_format: detect_sglang_content_format(source),
        })
    }

    /// The content format messages reach the template in: what vLLM's
    /// `auto` detection picks for it, unless set.
    #[must_use]
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// The content format SGLang 0.5.23 gives messages for this template:
    /// its own detection, unless set ([`ChatTemplate::with_content_format`]).
    #[must_use]
    pub fn sglang_content_format(&self) -> ContentFormat {
        self.sglang_content_format
    }

    /// Sets the content format (the engines run with an explicit
    /// `--chat-template-content-format`).
    #[must_use]
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = format;
        self.sglang_content_format = format;
        self
    }

    /// Whether the template reads a variable of this name (only such
    /// `chat_template_kwargs` reach it, as in vLLM).
    #[must_use]
    pub fn declares(&self, name: &str) -> bool {
        self.declared.contains(name)
    }

    /// `true` when the template source mentions the role as a literal; vLLM maps
    /// `developer` to `system` only for templates that never mention it.
    #[must_use]
    pub fn knows_role(&self, role: &str) -> bool {
        self.source.contains(&format!("'{role}'")) || self.source.contains(&format!("\"{role}\""))
    }

    /// Renders like transformers' `apply_chat_template(tokenize=False)`.
    pub fn render(&self, input: &TemplateInput) -> Result<String, TemplateError> {
        self.render_limited(input, usize::MAX)
    }

    /// [`ChatTemplate::render`], stopping with [`TemplateError::OutputTooLong`]
    /// once the output would pass `max_bytes`: a template's output is not
    /// bounded by its input (`tojson(indent=4)` over a deeply nested tool
    /// schema writes about 500 bytes per byte of it), so the bound applies
    /// while rendering, to `tojson`'s text too, not to the finished prompt.
    ///
    /// ```
    /// use kvroute_engines::prompt::{parse_json, ChatTemplate, TemplateError, TemplateInput};
    /// let t = ChatTemplate::new("{{ messages | tojson(indent=64) }}", vec![]).unwrap();
    /// // 17 bytes of nested lists, 1 000 levels of indentation each.
    /// let nested = parse_json(br#"{"a": [[[[0, 0]]]]}"#).unwrap();
    /// let input = TemplateInput { messages: vec![nested; 10], ..TemplateInput::default() };
    /// assert!(t.render(&input).unwrap().len() > 10_000);
    /// assert_eq!(t.render_limited(&input, 1_000), Err(TemplateError::OutputTooLong(1_000)));
    /// ```
    pub fn render_limited(
        &self,
        input: &TemplateInput,
        max_bytes: usize,
    ) -> Result<String, TemplateError> {
        if input.messages.is_empty() {
            return Err(TemplateError::Input(
                "conversation is empty: nothing to render".into(),
            ));
        }
        // Only continue_final_message changes a message: the others render
        // from the input as it is, without a deep copy.
        let continued;
        let mut final_text = String::new();
        let messages: &[PyValue] = if input.continue_final_message {
            // transformers refuses a template that never names the field.
            if !self.source.contains("content") {
                return Err(TemplateError::Input(
                    "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template".into(),
                ));
            }
            let mut m = input.messages.clone();
            final_text = append_continue_tag(&mut m)?;
            continued = m;
            &continued
        } else {
            &input.messages
        };
        let mut ctx: IndexMap<Value, Value> = IndexMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(Value::from(k.as_str()), Value::from(v.as_str()));
        }
        for (k, v) in &input.extra {
            ctx.insert(Value::from(k.as_str()), to_value(v));
        }
        ctx.insert(
            Value::from("messages"),
            Value::from(messages.iter().map(to_value).collect::<Vec<_>>()),
        );
        ctx.insert(
            Value::from("tools"),
            match &input.tools {
                Some(t) => Value::from(t.iter().map(to_value).collect::<Vec<_>>()),
                None => Value::from(()),
            },
        );
        ctx.insert(
            Value::from("documents"),
            input.documents.as_ref().map_or(Value::from(()), to_value),
        );
        ctx.insert(
            Value::from("add_generation_prompt"),
            Value::from(input.add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        let budget = super::render_budget::Scope::enter(max_bytes);
        let mut out = super::render_budget::CappedOutput::new(max_bytes);
        let rendered = match tmpl.render_captured_to(Value::from(ctx), &mut out) {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|e| TemplateError::Render(format!("output is not UTF-8: {e}")))?,
            Err(_) if budget.exceeded() => return Err(TemplateError::OutputTooLong(max_bytes)),
            Err(e) => return Err(render_error(e)),
        };
        drop(budget);
        if input.continue_final_message {
            cut_at_continue_tag(&rendered, &final_text)
        } else {
            Ok(rendered)
        }
    }
}

fn render_error(e: Error) -> TemplateError {
    // `raise_exception` errors carry this prefix; anything else is a render failure.
    let detail = e.detail().unwrap_or_default().to_owned();
    if let Some(msg) = detail.strip_prefix(RAISED_PREFIX) {
        TemplateError::Raised(msg.to_owned())
    } else {
        let mut s = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(inner) = src {
            let _ = write!(s, ": {inner}");
            src = inner.source();
        }
        TemplateError::Render(s)
    }
}

/// transformers: append the tag to the final message's text (the last text part
/// when content is a list); returns that text as it was.
fn append_continue_tag(messages: &mut [PyValue]) -> Result<String, TemplateError> {
    let missing = || {
        TemplateError::Input(
            "continue_final_message is set but we could not find any text to continue in the final message".into(),
        )
    };
    let last = messages.last_mut().ok_or_else(missing)?;
    let PyValue::Dict(msg) = last else {
        return Err(missing());
    };
    match msg.get_mut("content") {
        Some(PyValue::Str(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            s.push(' ');
            Ok(text)
        }
        Some(PyValue::List(parts)) => {
            for part in parts.iter_mut().rev() {
                if let PyValue::Dict(p) = part {
                    if let Some(PyValue::Str(t)) = p.get_mut("text") {
                        let text = t.clone();
                        t.push_str(CONTINUE_TAG);
                        t.push(' ');
                        return Ok(text);
                    }
                }
            }
            Err(missing())
        }
        _ => Err(missing()),
    }
}

/// transformers: the rendered chat up to the tag; an error unless the final
/// message's text (stripped) and the tag both appear in it (a template that
/// escapes or cuts the message has nothing to continue).
fn cut_at_continue_tag(rendered: &str, final_text: &str) -> Result<String, TemplateError> {
    let absent = || {
        TemplateError::Input(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template".into(),
        )
    };
    if !rendered.contains(final_text.trim()) {
        return Err(absent());
    }
    let idx = rendered.rfind(CONTINUE_TAG).ok_or_else(absent)?;
    let head = rendered.get(..idx).unwrap_or("");
    let followed_by_space = rendered
        .get(idx + CONTINUE_TAG.len()..)
        .is_some_and(|rest| rest.starts_with(' '));
    Ok(if followed_by_space {
        head.to_owned()
    } else {
        head.trim_end().to_owned()
    })
}

const RAISED_PREFIX: &str = "raise_exception: ";

fn raise_exception(message: Value) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{}", py_str(&message)),
    ))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`;
/// positional arguments bind in that order, as in Python.
fn tojson_filter(
    value: Value,
    positional: minijinja::value::Rest<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let arg = |i: usize, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        Ok(kw
            .or_else(|| positional.get(i).cloned())
            .filter(|v| !v.is_undefined()))
    };
    let ensure_ascii = arg(0, "ensure_ascii")?;
    let indent = arg(1, "indent")?;
    let separators = arg(2, "separators")?;
    let sort_keys = arg(3, "sort_keys")?;
    kwargs.assert_all_used()?;
    let mut opts = DumpOptions::default();
    if let Some(v) = ensure_ascii {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = indent {
        opts.indent = match v.kind() {
            ValueKind::None => None,
            ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
            ValueKind::Number => {
                let n = i64::try_from(v).unwrap_or(0).clamp(0, 64) as usize;
                Some(" ".repeat(n))
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bad indent",
                ))
            }
        };
    }
    if let Some(v) = separators {
        if !v.is_none() {
            let parts: Vec<Value> = v
                .try_iter()
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: bad separators"))?
                .collect();
            match parts.as_slice() {
                [a, b] => {
                    opts.separators = Some((
                        a.as_str().unwrap_or("").to_owned(),
                        b.as_str().unwrap_or("").to_owned(),
                    ));
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair",
                    ))
                }
            }
        }
    }
    if let Some(v) = sort_keys {
        opts.sort_keys = v.is_true();
    }
    dumps(&value, &opts)
        .map(Value::from)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `strftime_now(format)`: the current UTC time formatted with Python's
/// `strftime` directives (the common subset; unknown directives are kept verbatim).
fn strftime_now(format: &str) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(strftime(format, secs)))
}

/// Formats Unix time `secs` (UTC) with Python `strftime` directives.
#[must_use]
pub(crate) fn strftime(format: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let (hh, mm, ss) = (sod / 3600, sod / 60 % 60, sod % 60);
    let month = MONTHS
        .get((m as usize).wrapping_sub(1))
        .copied()
        .unwrap_or("");
    let day_name = DAYS.get(weekday).copied().unwrap_or("");
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(dir) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match dir {
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'm' => write!(out, "{m:02}"),
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:>2}"),
            '-' => match chars.next() {
                Some('d') => write!(out, "{d}"),
                Some('m') => write!(out, "{m}"),
                Some('H') => write!(out, "{hh}"),
                Some(other) => write!(out, "%-{other}"),
                None => write!(out, "%-"),
            },
            'B' => write!(out, "{month}"),
            'b' | 'h' => write!(out, "{}", month.get(..3).unwrap_or("")),
            'A' => write!(out, "{day_name}"),
            'a' => write!(out, "{}", day_name.get(..3).unwrap_or("")),
            'H' => write!(out, "{hh:02}"),
            'I' => write!(out, "{:02}", if hh % 12 == 0 { 12 } else { hh % 12 }),
            'p' => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            'M' => write!(out, "{mm:02}"),
            'S' => write!(out, "{ss:02}"),
            'j' => write!(out, "{yday:03}"),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            'T' => write!(out, "{hh:02}:{mm:02}:{ss:02}"),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

// Howard Hinnant's civil-calendar algorithms (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Python `str(x)` for what `{{ x }}` prints (Jinja2 prints `None`, `True`,
/// float reprs, and Python reprs of lists/dicts).
#[must_use]
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::String => v.as_str().unwrap_or("").to_owned(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(v),
    }
}

fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    write_py_repr(&mut out, v, 0);
    out
}

fn write_py_repr(out: &mut String, v: &Value, depth: usize) {
    if depth > 256 {
        out.push_str("...");
        return;
    }
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number if v.is_integer() => {
            let _ = write!(out, "{v}");
        }
        ValueKind::Number => out.push_str(
            &float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN))
                .replace("Infinity", "inf")
                .replace("NaN", "nan"),
        ),
        ValueKind::String => {
            let _ = write!(out, "{v:?}");
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = v.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item, depth + 1);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = v.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &key, depth + 1);
                    out.push_str(": ");
                    let item = v.get_item(&key).unwrap_or(Value::UNDEFINED);
                    write_py_repr(out, &item, depth + 1);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// vLLM's `auto` content-format detection (`renderers/hf.py`,
/// `_iter_nodes_assign_content_item`): a template that loops over a
/// message's `content` wants OpenAI-style part lists; any other template gets
/// strings. vLLM walks the Jinja AST; minijinja exposes no AST, so this scans
/// the statements. Message variables are the targets of loops over
/// `messages` or a name assigned from it (`set`, slices, `namespace`
/// fields). A loop is over content when its iterable
///
/// * is a message variable's `content` (`m.content`, `m['content']`,
///   through filters and slices);
/// * is the bare name `content`, outside any macro;
/// * is a parameter of the macro it is in, and a call of that macro passes
///   a message variable's `content` for it (templates that render parts in a
///   macro, `render_content(message.content)`).
#[must_use]
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let statements: Vec<&str> = tags(source).collect();
    let messages = names_assigned_from(&statements, "messages");
    let message_vars: Vec<&str> = statements
        .iter()
        .filter_map(|t| {
            let (target, iterable) = t.strip_prefix("for ")?.split_once(" in ")?;
            let iterable = iterable.split(" if ").next().unwrap_or("");
            let target = target.trim();
            (messages.iter().any(|m| m == accessed(iterable)) && is_identifier(target))
                .then_some(target)
        })
        .collect();
    let is_content = |expr: &str| {
        let expr = accessed(expr);
        ["['content']", "[\"content\"]", ".content"]
            .iter()
            .any(|key| {
                expr.strip_suffix(key)
                    .is_some_and(|v| message_vars.contains(&v.trim()))
            })
    };
    // (macro name, its parameters) while inside one.
    let mut macro_at: Option<(&str, Vec<&str>)> = None;
    // Macros with a loop over a parameter: (name, parameter index, name).
    let mut param_loops: Vec<(&str, usize, &str)> = Vec::new();
    for tag in &statements {
        if let Some(def) = tag.strip_prefix("macro ") {
            let (name, params) = def.split_once('(').unwrap_or((def, ""));
            let params = split_args(params)
                .unwrap_or_default()
                .into_iter()
                .map(|p| p.split('=').next().unwrap_or("").trim())
                .collect();
            macro_at = Some((name.trim(), params));
            continue;
        }
        if tag.starts_with("endmacro") {
            macro_at = None;
            continue;
        }
        let Some((_, iterable)) = tag.strip_prefix("for ").and_then(|b| b.split_once(" in "))
        else {
            continue;
        };
        let whole = iterable.split(" if ").next().unwrap_or("").trim();
        if is_content(whole) {
            return ContentFormat::OpenAi;
        }
        // A bare name only as the whole iterable (vLLM wants a name node).
        let bare = whole.trim_start_matches('(').trim_end_matches(')').trim();
        match &macro_at {
            None if bare == "content" => return ContentFormat::OpenAi,
            Some((name, params)) => {
                if let Some(i) = params.iter().position(|p| *p == bare) {
                    param_loops.push((name, i, bare));
                }
            }
            None => {}
        }
    }
    let passes_content = |name: &str, index: usize, param: &str| {
        calls(source, name).any(|args| {
            args.iter().enumerate().any(|(i, a)| {
                let (key, value) = match a.split_once('=') {
                    Some((k, v)) if !k.contains(['(', '[', '\'', '"']) => (Some(k.trim()), v),
                    _ => (None, *a),
                };
                let names_it = match key {
                    Some(k) => k == param,
                    None => i == index,
                };
                names_it && is_content(value)
            })
        })
    };
    if param_loops
        .iter()
        .any(|(name, i, param)| passes_content(name, *i, param))
    {
        return ContentFormat::OpenAi;
    }
    ContentFormat::String
}

/// SGLang 0.5.23's content-format detection
/// (`parser/jinja_template_utils.py`, `detect_jinja_template_content_format`):
/// a template whose text names images, audio, video or vision wants part
/// lists, as does one with a loop over `message.content`, `msg.content` or
/// `m.content` (through filters and slices); any other gets strings. Unlike
/// vLLM's, it follows no assignments or macros.
#[must_use]
pub(crate) fn detect_sglang_content_format(source: &str) -> ContentFormat {
    if ["image", "audio", "video", "vision"]
        .iter()
        .any(|k| source.contains(k))
    {
        return ContentFormat::OpenAi;
    }
    let loops_over_content = tags(source).any(|tag| {
        let Some((_, iterable)) = tag.strip_prefix("for ").and_then(|b| b.split_once(" in "))
        else {
            return false;
        };
        let iterable = iterable.split(" if ").next().unwrap_or("");
        let iterable = iterable.split(" recursive").next().unwrap_or("");
        let expr = accessed(iterable);
        ["['content']", "[\"content\"]", ".content"]
            .iter()
            .any(|key| {
                expr.strip_suffix(key)
                    .is_some_and(|v| matches!(v.trim(), "message" | "msg" | "m"))
            })
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// `var` and the names assigned from it, directly or through slices and
/// filters (`set rest = messages[1:]`), including `namespace` fields
/// (`set ns = namespace(rest=messages)` names `ns.rest`), to a fixed point.
fn names_assigned_from(statements: &[&str], var: &str) -> Vec<String> {
    let mut names = vec![var.to_owned()];
    // Each pass adds a name or ends; there are at most as many as statements.
    for _ in 0..=statements.len() {
        let before = names.len();
        for tag in statements {
            let Some((lhs, rhs)) = tag.strip_prefix("set ").and_then(|a| a.split_once('=')) else {
                continue;
            };
            let (lhs, rhs) = (lhs.trim(), rhs.trim());
            let mut found: Vec<String> = Vec::new();
            if names.iter().any(|n| n == accessed(rhs)) {
                found.push(lhs.to_owned());
            } else if let Some(fields) = rhs.strip_prefix("namespace(") {
                for field in split_args(fields).unwrap_or_default() {
                    if let Some((key, value)) = field.split_once('=') {
                        if names.iter().any(|n| n == accessed(value)) {
                            found.push(format!("{lhs}.{}", key.trim()));
                        }
                    }
                }
            }
            for f in found {
                if !names.contains(&f) {
                    names.push(f);
                }
            }
        }
        if names.len() == before {
            break;
        }
    }
    names
}

/// What `expr` reads, past its filters and trailing slices: `m.content[1:] |
/// list` reads `m.content`.
fn accessed(expr: &str) -> &str {
    let mut e = expr.split('|').next().unwrap_or("").trim();
    e = e.trim_start_matches('(').trim_end_matches(')').trim();
    while let Some(open) = e.strip_suffix(']').and_then(|x| x.rfind('[')) {
        let slice = e.get(open..).unwrap_or("");
        if !slice.contains(':') {
            break;
        }
        e = e.get(..open).unwrap_or("").trim();
    }
    e
}

/// A plain variable name.
fn is_identifier(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// The statements of `source` (`{% ... %}`), trimmed of whitespace control.
fn tags(source: &str) -> impl Iterator<Item = &str> {
    let mut rest = source;
    std::iter::from_fn(move || {
        let start = rest.find("{%")?;
        let after = rest.get(start + 2..).unwrap_or("");
        let end = after.find("%}").unwrap_or(after.len());
        let tag = after.get(..end).unwrap_or("");
        rest = after.get(end..).unwrap_or("");
        Some(tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()))
    })
}

/// The argument lists of every call of macro `name` in `source` (its
/// definition aside).
fn calls<'s>(source: &'s str, name: &'s str) -> impl Iterator<Item = Vec<&'s str>> + 's {
    source.match_indices(name).filter_map(move |(at, _)| {
        let before = source.get(..at)?;
        if before
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
            || before.trim_end().ends_with("macro")
        {
            return None;
        }
        let open = source.get(at + name.len()..)?.trim_start();
        split_args(open.strip_prefix('(')?)
    })
}

/// The top-level comma-separated items of `list` up to its closing
/// parenthesis (brackets and quoted strings kept whole); `None` if it does
/// not close.
fn split_args(list: &str) -> Option<Vec<&str>> {
    let (mut depth, mut quote, mut args, mut from) = (0usize, None, Vec::new(), 0usize);
    for (i, c) in list.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') if depth > 0 => depth -= 1,
            (None, ')') => {
                let last = list.get(from..i)?.trim();
                if !last.is_empty() || !args.is_empty() {
                    args.push(last);
                }
                return Some(args);
            }
            (None, ',') if depth == 0 => {
                args.push(list.get(from..i)?.trim());
                from = i + 1;
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::parse_json;

    fn msgs(json: &str) -> Vec<PyValue> {
        match parse_json(json.as_bytes()).unwrap() {
            PyValue::List(l) => l,
            _ => panic!("not a list"),
        }
    }

    #[test]
    fn python_printing_and_tojson_kwargs() {
        let t = ChatTemplate::new(
            "{{ messages[0].x }}|{{ messages[0].y }}|{{ messages[0].z }}|{{ messages[0] | tojson(indent=1, sort_keys=true) }}|{{ messages[0].w | tojson(true) }}",
            vec![],
        )
        .unwrap();
        let input = TemplateInput {
            messages: msgs(r#"[{"x": null, "y": true, "z": 1e2, "w": "é"}]"#),
            ..TemplateInput::default()
        };
        assert_eq!(
            t.render(&input).unwrap(),
            "None|True|100.0|{\n \"w\": \"é\",\n \"x\": null,\n \"y\": true,\n \"z\": 100.0\n}|\"\\u00e9\""
        );
    }

    #[test]
    fn raise_exception_is_typed() {
        let t = ChatTemplate::new("{{ raise_exception('no ' ~ 'way') }}", vec![]).unwrap();
        let input = TemplateInput {
            messages: msgs(r#"[{"role": "user", "content": "x"}]"#),
            ..TemplateInput::default()
        };
        assert_eq!(
            t.render(&input),
            Err(TemplateError::Raised("no way".into()))
        );
    }

    #[test]
    fn continue_final_message_cut() {
        let t = ChatTemplate::new(
            "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}",
            vec![],
        )
        .unwrap();
        let input = TemplateInput {
            messages: msgs(r#"[{"role": "assistant", "content": "abc  "}]"#),
            continue_final_message: true,
            ..TemplateInput::default()
        };
        // The template strips the tag's space, so what precedes is rstripped.
        assert_eq!(t.render(&input).unwrap(), "[abc");
    }

    #[test]
    fn content_format_detection() {
        assert_eq!(
            detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ContentFormat::String
        );
        assert_eq!(
            detect_content_format(
                "{% for m in messages %}{%- for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        // Each rule against vLLM's own detection: tests/prompt_content_format.rs.
    }

    #[test]
    fn strftime_dates() {
        assert_eq!(
            strftime("%d %B %Y, %a %H:%M:%S %j %%", 1_700_000_000),
            "14 November 2023, Tue 22:13:20 318 %"
        );
        assert_eq!(strftime("%Y-%m-%d %A", 0), "1970-01-01 Thursday");
        assert_eq!(strftime("%d %b %Y %j", 951_782_400), "29 Feb 2000 060");
    }
}
