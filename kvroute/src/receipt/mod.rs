//! Delivery receipts: what the engine says it actually reused
//! (`usage.prompt_tokens_details.cached_tokens`), found in the response body as
//! it streams past, recorded against the decision, and the request's load
//! charge released when the body ends or is dropped.
//!
//! * [`UsageScanner`]: a sans-IO scanner fed the body's chunks, for a JSON
//!   answer or an SSE stream (the last event carrying `usage` wins; events
//!   are read as a browser's `EventSource` reads them: `data` lines joined,
//!   CRLF, LF or CR line ends).
//! * [`ReceiptTracker`]: one response's receipt for a host handed the body
//!   in chunks (pingora's `response_body_filter`, other callbacks): it feeds
//!   the scanner, marks the first byte on the [`LoadGuard`] (prefill is
//!   over), and on [`ReceiptTracker::on_end`] — or its drop, when the client
//!   goes away — calls the host's completion once and releases the guard.
//! * [`ReceiptBody`]: the same tracker inside an [`http_body::Body`] wrapper,
//!   driven by the body's frames.
//! * [`include_usage`]: streamed requests carry usage only when they ask for it
//!   (`stream_options.include_usage`); without it every streamed receipt is
//!   silently `None`. The helper splices the option into a streamed request
//!   body that does not mention it, leaving the client's bytes as they were. Its effect on the client: one more SSE event
//!   before `[DONE]`, with `"choices": []` and the `usage` object, as OpenAI
//!   documents for the option. [`crate::KvRouterBuilder::include_usage`] turns
//!   it off (a client that set the option itself is never overridden).
//!
//! ```
//! use kvroute::receipt::{BodyKind, UsageScanner};
//! let mut s = UsageScanner::new(BodyKind::Sse);
//! s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usa");
//! s.feed(b"ge\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n");
//! assert_eq!(s.finish(), Some(32));
//! ```

use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvroute_select::LoadGuard;
use serde_json::value::RawValue;

use self::sse::SseEvents;

#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
mod sse;

/// Largest JSON answer (or SSE line and its event's data) held for the receipt; past it the
/// receipt is `None` and the body still streams through untouched. A chat
/// answer with usage is a few KB; 4 MiB bounds what the scanner holds per
/// request whatever the engine sends (its buffers' capacity at most twice
/// that, 2.5 times for an instant while one grows; only the `usage` object
/// is built from it, the rest is skipped).
pub const MAX_SCAN_BYTES: usize = 4 << 20;

/// How a response body is framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// One JSON document (a non-streamed completion).
    Json,
    /// `text/event-stream`: events whose `data` is a JSON chunk.
    Sse,
    /// A body that carries no receipt (an answer to a request routed without
    /// a KV decision, e.g. `/v1/models`): streamed through unscanned, so it
    /// costs no buffer; its receipt is always `None`.
    Opaque,
}

impl BodyKind {
    /// The kind a response's `Content-Type` announces (SSE for
    /// `text/event-stream`, JSON otherwise); [`BodyKind::Opaque`] for an
    /// answer with a `Content-Encoding` (compressed: its usage cannot be
    /// read, so nothing is buffered for it).
    ///
    /// ```
    /// use kvroute::receipt::BodyKind;
    /// let mut h = http::HeaderMap::new();
    /// h.insert("content-type", "Text/Event-Stream; charset=utf-8".parse().unwrap());
    /// assert_eq!(BodyKind::of(&h), BodyKind::Sse);
    /// h.insert("content-encoding", "gzip".parse().unwrap());
    /// assert_eq!(BodyKind::of(&h), BodyKind::Opaque);
    /// ```
    #[must_use]
    pub fn of(headers: &http::HeaderMap) -> Self {
        let encoded = headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"));
        if encoded {
            return Self::Opaque;
        }
        // Media types are case-insensitive (RFC 9110 §8.3.1).
        let sse = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|ct| ct.trim_start().get(..17))
            .is_some_and(|ct| ct.eq_ignore_ascii_case("text/event-stream"));
        if sse {
            Self::Sse
        } else {
            Self::Json
        }
    }
}

/// `usage.prompt_tokens_details.cached_tokens` of one OpenAI response object.
/// A count beyond `u32` reads as `u32::MAX`: no prompt is that long, so the
/// rule refuses it as implausible ([`kvroute_select::Rule::record_usage`]).
///
/// ```
/// let v = serde_json::json!({"usage": {"prompt_tokens_details": {"cached_tokens": 496}}});
/// assert_eq!(kvroute::receipt::cached_tokens(&v), Some(496));
/// assert_eq!(kvroute::receipt::cached_tokens(&serde_json::json!({"usage": null})), None);
/// let huge = serde_json::json!({"usage": {"prompt_tokens_details": {"cached_tokens": 4294967304u64}}});
/// assert_eq!(kvroute::receipt::cached_tokens(&huge), Some(u32::MAX));
/// ```
#[must_use]
pub fn cached_tokens(v: &serde_json::Value) -> Option<u32> {
    v.pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(serde_json::Value::as_u64)
        .map(saturate)
}

/// `usage.prompt_tokens` of one OpenAI response object: the engine's own
/// count of the prompt, the bound of its `cached_tokens` (beyond `u32`:
/// `u32::MAX`).
///
/// ```
/// let v = serde_json::json!({"usage": {"prompt_tokens": 512, "prompt_tokens_details": {"cached_tokens": 496}}});
/// assert_eq!(kvroute::receipt::prompt_tokens(&v), Some(512));
/// ```
#[must_use]
pub fn prompt_tokens(v: &serde_json::Value) -> Option<u32> {
    v.pointer("/usage/prompt_tokens")
        .and_then(serde_json::Value::as_u64)
        .map(saturate)
}

fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// `(cached_tokens, prompt_tokens)` of one OpenAI response object, as
/// [`cached_tokens`] and [`prompt_tokens`] read them, building only its
/// `usage` object: the rest (choices, logprobs: megabytes of small values
/// that would take many times their size as a [`serde_json::Value`]) is
/// skipped. `None`: not a JSON object.
fn usage_receipt(doc: &[u8]) -> Option<(Option<u32>, Option<u32>)> {
    #[derive(serde::Deserialize)]
    struct Doc<'a> {
        #[serde(borrow, default)]
        usage: Option<&'a RawValue>,
    }
    let doc: Doc<'_> = serde_json::from_slice(doc).ok()?;
    let Some(raw) = doc.usage else {
        return Some((None, None));
    };
    let usage: serde_json::Value = serde_json::from_str(raw.get()).ok()?;
    let u64_at = |p: &str| usage.pointer(p).and_then(serde_json::Value::as_u64);
    Some((
        u64_at("/prompt_tokens_details/cached_tokens").map(saturate),
        u64_at("/prompt_tokens").map(saturate),
    ))
}

/// Finds the cached-token receipt in a response body fed chunk by chunk.
/// Memory is bounded by [`MAX_SCAN_BYTES`]; nothing is parsed until an
/// event (SSE, read as a browser's `EventSource` reads it: `data` lines
/// joined, any line ending) or the body (JSON) is complete.
#[derive(Debug)]
pub struct UsageScanner {
    kind: BodyKind,
    buf: Vec<u8>,
    events: SseEvents,
    found: Option<u32>,
    /// `usage.prompt_tokens` of the object `found` came from.
    found_prompt: Option<u32>,
    overflowed: bool,
}

/// What a receipt reads from one SSE event's data: its usage, if it has
/// one with `cached_tokens` (a later one replaces an earlier one).
fn sse_event(data: &[u8], found: &mut Option<u32>, found_prompt: &mut Option<u32>) {
    // Only the usage event is parsed: the token deltas are most of the stream.
    if !data.windows(7).any(|w| w == b"\"usage\"") {
        return;
    }
    if let Some((Some(c), prompt)) = usage_receipt(data) {
        *found = Some(c);
        *found_prompt = prompt;
    }
}

impl UsageScanner {
    /// A scanner for a body of `kind`.
    #[must_use]
    pub fn new(kind: BodyKind) -> Self {
        Self {
            kind,
            buf: Vec::new(),
            events: SseEvents::new(MAX_SCAN_BYTES),
            found: None,
            found_prompt: None,
            overflowed: false,
        }
    }

    /// Feeds the next chunk of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.kind {
            BodyKind::Opaque => {}
            BodyKind::Json => {
                if self.overflowed {
                    return;
                }
                if self.buf.len() + chunk.len() > MAX_SCAN_BYTES {
                    self.overflowed = true;
                    self.buf = Vec::new();
                } else {
                    self.buf.extend_from_slice(chunk);
                }
            }
            BodyKind::Sse => {
                let (found, prompt) = (&mut self.found, &mut self.found_prompt);
                self.events
                    .feed(chunk, &mut |data| sse_event(data, found, prompt));
            }
        }
    }

    /// The receipt so far (SSE: the last usage event seen).
    #[must_use]
    pub fn found(&self) -> Option<u32> {
        self.found
    }

    /// The engine's `usage.prompt_tokens` beside the receipt so far.
    #[must_use]
    pub fn prompt_tokens(&self) -> Option<u32> {
        self.found_prompt
    }

    /// Whether some input was too long to scan (the receipt may be missing).
    #[must_use]
    pub fn overflowed(&self) -> bool {
        self.overflowed || self.events.overflowed()
    }

    /// The body ended: the receipt, if the engine sent one.
    pub fn finish(&mut self) -> Option<u32> {
        match self.kind {
            BodyKind::Opaque => {}
            BodyKind::Json => {
                if !self.overflowed && !self.buf.is_empty() {
                    if let Some((cached, prompt)) = usage_receipt(&self.buf) {
                        self.found = cached;
                        self.found_prompt = cached.and(prompt);
                    }
                }
                self.buf = Vec::new();
            }
            BodyKind::Sse => {
                // A last event without its empty line.
                let (found, prompt) = (&mut self.found, &mut self.found_prompt);
                self.events
                    .finish(&mut |data| sse_event(data, found, prompt));
            }
        }
        self.found
    }
}

/// How a response body ended, handed to the completion callback once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Receipt {
    /// The engine's `cached_tokens`, if its answer carried usage.
    pub cached_tokens: Option<u32>,
    /// The engine's own `usage.prompt_tokens` beside it, if it sent one
    /// (what bounds `cached_tokens`).
    pub prompt_tokens: Option<u32>,
    /// The body reached its end (`false`: an error, or the client dropped it).
    pub complete: bool,
}

/// Called once when a [`ReceiptTracker`] (or the [`ReceiptBody`] around it)
/// ends or is dropped.
pub type OnReceipt = Box<dyn FnOnce(Receipt) + Send>;

/// One response's receipt, for hosts that see the body as chunks handed to a
/// callback (pingora's `response_body_filter(body, end_of_stream)`, hyper or
/// other push-style hooks) rather than as an [`http_body::Body`]: feed it
/// each chunk with [`ReceiptTracker::on_chunk`], call
/// [`ReceiptTracker::on_end`] at the body's end; dropping it first (an
/// error, a client that went away) records nothing. Either way the
/// completion runs once and then the load charge is released.
/// [`ReceiptBody`] is this tracker driven by a body's frames.
///
/// ```
/// use kvroute::receipt::{BodyKind, Receipt, ReceiptTracker};
/// let (tx, rx) = std::sync::mpsc::channel();
/// let mut r = ReceiptTracker::new(BodyKind::Sse, None, Box::new(move |r| tx.send(r).unwrap()));
/// r.on_chunk(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":");
/// r.on_chunk(b"{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n");
/// r.on_end();
/// assert_eq!(rx.recv().unwrap(), Receipt { cached_tokens: Some(32), prompt_tokens: None, complete: true });
///
/// // Dropped before its end: no receipt, the charge is released all the same.
/// let (tx, rx) = std::sync::mpsc::channel();
/// let mut r = ReceiptTracker::new(BodyKind::Json, None, Box::new(move |r| tx.send(r).unwrap()));
/// r.on_chunk(br#"{"usage":{"prompt_tokens_details":{"cached_tokens":32}}}"#);
/// drop(r);
/// assert_eq!(rx.recv().unwrap(), Receipt { cached_tokens: None, prompt_tokens: None, complete: false });
/// ```
pub struct ReceiptTracker {
    scanner: UsageScanner,
    guard: Option<LoadGuard>,
    // Hosts keep the tracker in per-request state that must be `Sync`
    // (pingora's `CTX`), while the completion need only be `Send`: a mutex
    // makes it `Sync`, and `get_mut` (every use takes `&mut self`) never locks.
    on_end: Mutex<Option<OnReceipt>>,
}

impl std::fmt::Debug for ReceiptTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiptTracker")
            .field("scanner", &self.scanner)
            .field("guard", &self.guard)
            .field("ended", &self.is_ended())
            .finish_non_exhaustive()
    }
}

impl ReceiptTracker {
    /// A tracker for a body of `kind`; `guard` (if any) is released when it
    /// ends or is dropped, after `on_end` ran.
    #[must_use]
    pub fn new(kind: BodyKind, guard: Option<LoadGuard>, on_end: OnReceipt) -> Self {
        Self {
            scanner: UsageScanner::new(kind),
            guard,
            on_end: Mutex::new(Some(on_end)),
        }
    }

    /// The next chunk of the body. The first non-empty one marks the first
    /// byte on the guard (the engine's prefill is over). Ignored once ended.
    pub fn on_chunk(&mut self, chunk: &[u8]) {
        let ended = self
            .on_end
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none();
        if chunk.is_empty() || ended {
            return;
        }
        if let Some(g) = self.guard.as_mut() {
            g.first_byte();
        }
        self.scanner.feed(chunk);
    }

    /// The body reached its end: the completion gets the receipt (if the
    /// engine sent one) and the charge is released. Later calls do nothing.
    pub fn on_end(&mut self) {
        self.finish(true);
    }

    /// The body failed before its end (an upstream error): no receipt, the
    /// charge is released. Dropping the tracker does the same.
    pub fn on_error(&mut self) {
        self.finish(false);
    }

    /// Whether [`ReceiptTracker::on_end`] or [`ReceiptTracker::on_error`] ran.
    #[must_use]
    pub fn is_ended(&self) -> bool {
        self.on_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// This tracker driven by `inner`'s frames. A body that is already at
    /// its end (a HEAD answer, a 204 or 304, `content-length: 0`) ends the
    /// tracker now, complete: servers never poll such a body, they drop it.
    #[must_use]
    pub fn body<B: Body>(mut self, inner: B) -> ReceiptBody<B> {
        if inner.is_end_stream() {
            self.on_end();
        }
        ReceiptBody {
            inner,
            tracker: self,
        }
    }

    fn finish(&mut self, complete: bool) {
        let on_end = self
            .on_end
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = on_end.take() {
            let (cached_tokens, prompt_tokens) = if complete {
                (self.scanner.finish(), self.scanner.prompt_tokens())
            } else {
                (None, None)
            };
            f(Receipt {
                cached_tokens,
                prompt_tokens,
                complete,
            });
        }
        self.guard = None;
    }
}

impl Drop for ReceiptTracker {
    fn drop(&mut self) {
        // The client went away (or the host dropped the response) before the end.
        self.finish(false);
    }
}

/// A response body that records the delivery receipt and releases the
/// request's load charge when it ends, errors or is dropped: a
/// [`ReceiptTracker`] fed by the body's frames.
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use kvroute::receipt::{BodyKind, Receipt, ReceiptBody};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let (tx, rx) = std::sync::mpsc::channel();
/// let answer = Full::new(Bytes::from_static(
///     br#"{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#));
/// let body = ReceiptBody::new(answer, BodyKind::Json, None, Box::new(move |r| tx.send(r).unwrap()));
/// let bytes = body.collect().await.unwrap().to_bytes();
/// assert!(bytes.starts_with(b"{\"usage\""));
/// assert_eq!(rx.recv().unwrap(), Receipt { cached_tokens: Some(32), prompt_tokens: Some(40), complete: true });
/// # });
/// ```
pub struct ReceiptBody<B> {
    inner: B,
    tracker: ReceiptTracker,
}

impl<B> std::fmt::Debug for ReceiptBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiptBody")
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

impl<B: Body> ReceiptBody<B> {
    /// Wraps `inner`; `guard` (if any) is released when the body ends or is
    /// dropped, after `on_end` ran.
    #[must_use]
    pub fn new(inner: B, kind: BodyKind, guard: Option<LoadGuard>, on_end: OnReceipt) -> Self {
        ReceiptTracker::new(kind, guard, on_end).body(inner)
    }
}

impl<B> Body for ReceiptBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.tracker.on_chunk(data);
                }
                // A sized body may never be polled past its last frame.
                if this.inner.is_end_stream() {
                    this.tracker.on_end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.tracker.on_error();
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.tracker.on_end();
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A streamed request body with `stream_options.include_usage = true` added,
/// or `None` when nothing needs changing (not JSON, not `"stream": true`, or
/// `stream_options` already says something about `include_usage`, or is not
/// an object). Every byte of the client's body is kept: the option is
/// spliced in (into the client's `stream_options` object, in place of a
/// `null` one, or before the body's closing brace), so key order, spacing and
/// number spelling stay as sent. A key repeated at the top level counts by
/// its last occurrence, as a JSON parser reads it.
///
/// ```
/// use kvroute::receipt::include_usage;
/// let body = br#"{"model":"m","stream":true,"messages":[]}"#;
/// let out = include_usage(body).unwrap();
/// assert_eq!(out, br#"{"model":"m","stream":true,"messages":[],"stream_options":{"include_usage":true}}"#.to_vec());
/// let out = include_usage(br#"{"stream": true, "stream_options": {"continuous_usage_stats": true}}"#).unwrap();
/// assert_eq!(out, br#"{"stream": true, "stream_options": {"continuous_usage_stats": true,"include_usage":true}}"#.to_vec());
/// // The client's own choice stands; non-streamed requests are left alone.
/// assert_eq!(include_usage(br#"{"stream":true,"stream_options":{"include_usage":false}}"#), None);
/// assert_eq!(include_usage(br#"{"stream":false}"#), None);
/// ```
#[must_use]
pub fn include_usage(body: &[u8]) -> Option<Vec<u8>> {
    // One pass that accepts exactly what a `serde_json::Value` parse accepts,
    // without building one: the splice must not turn a body the engine would
    // reject into one it takes, nor the reverse.
    let top: splice::Top<'_> = serde_json::from_slice(body).ok()?;
    if top.stream.map(RawValue::get) != Some("true") {
        return None;
    }
    const OPTION: &[u8] = br#""include_usage":true"#;
    let (at, replace, insert): (usize, usize, &[&[u8]]) = match top.options {
        None => {
            // `Top` parsed an object, so the last non-space byte is its `}`;
            // it holds at least `stream`, so the new member needs a comma.
            let close = body.iter().rposition(|&b| b == b'}')?;
            (close, 0, &[br#","stream_options":{"#, OPTION, b"}"])
        }
        Some(raw) if raw.get() == "null" => (splice::offset(body, raw)?, 4, &[b"{", OPTION, b"}"]),
        Some(raw) => {
            let opts: splice::Options = serde_json::from_str(raw.get()).ok()?;
            if opts.include_usage {
                return None;
            }
            let close = splice::offset(body, raw)? + raw.get().len() - 1;
            let sep: &[u8] = if opts.members > 0 { b"," } else { b"" };
            (close, 0, &[sep, OPTION])
        }
    };
    let (head, tail) = (body.get(..at)?, body.get(at + replace..)?);
    let added: usize = insert.iter().map(|s| s.len()).sum();
    let mut out = Vec::with_capacity(body.len() + added);
    out.extend_from_slice(head);
    for s in insert {
        out.extend_from_slice(s);
    }
    out.extend_from_slice(tail);
    Some(out)
}

/// The pieces [`include_usage`] reads with serde_json: a validator that keeps
/// nothing, the top-level members it needs as raw slices of the body, and the
/// keys of `stream_options`.
mod splice {
    use std::fmt;

    use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde_json::value::RawValue;

    /// Any JSON value, checked as strictly as a `serde_json::Value` parse
    /// (strings decoded, so lone surrogates fail; numbers converted, so an
    /// overflowing float fails; the same nesting limit) and dropped.
    pub(super) struct Valid;

    impl<'de> Deserialize<'de> for Valid {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(Valid)
        }
    }

    impl<'de> Visitor<'de> for Valid {
        type Value = Valid;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_str<E>(self, _: &str) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_unit<E>(self) -> Result<Valid, E> {
            Ok(Valid)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Valid, A::Error> {
            // Ends: every element consumes input.
            while seq.next_element::<Valid>()?.is_some() {}
            Ok(Valid)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Valid, A::Error> {
            while map.next_entry::<Valid, Valid>()?.is_some() {}
            Ok(Valid)
        }
    }

    /// A member name, compared without keeping it.
    enum Key {
        Stream,
        StreamOptions,
        IncludeUsage,
        Other,
    }

    impl<'de> Deserialize<'de> for Key {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Key;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a member name")
                }
                // Escaped names arrive decoded: `"str\u0065am"` is `stream`.
                fn visit_str<E>(self, s: &str) -> Result<Key, E> {
                    Ok(match s {
                        "stream" => Key::Stream,
                        "stream_options" => Key::StreamOptions,
                        "include_usage" => Key::IncludeUsage,
                        _ => Key::Other,
                    })
                }
            }
            d.deserialize_str(V)
        }
    }

    /// The top-level object's `stream` and `stream_options` (last occurrence
    /// of each), as slices of the body; every other member checked by
    /// [`Valid`] and dropped.
    pub(super) struct Top<'a> {
        pub(super) stream: Option<&'a RawValue>,
        pub(super) options: Option<&'a RawValue>,
    }

    impl<'de> Deserialize<'de> for Top<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Top<'de>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top<'de>, A::Error> {
                    let mut top = Top {
                        stream: None,
                        options: None,
                    };
                    while let Some(k) = map.next_key::<Key>()? {
                        let slot = match k {
                            Key::Stream => &mut top.stream,
                            Key::StreamOptions => &mut top.options,
                            Key::IncludeUsage | Key::Other => {
                                map.next_value::<Valid>()?;
                                continue;
                            }
                        };
                        // A raw slice is read leniently (lone surrogates,
                        // overflowing numbers pass): check it as strictly,
                        // one level deep as it is here, so the nesting limit
                        // counts the same.
                        let v: &'de RawValue = map.next_value()?;
                        serde_json::from_str::<[Valid; 1]>(&format!("[{}]", v.get()))
                            .map_err(serde::de::Error::custom)?;
                        *slot = Some(v);
                    }
                    Ok(top)
                }
            }
            d.deserialize_map(V)
        }
    }

    /// What [`super::include_usage`] needs of a `stream_options` object.
    pub(super) struct Options {
        pub(super) members: usize,
        pub(super) include_usage: bool,
    }

    impl<'de> Deserialize<'de> for Options {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Options;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("an object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Options, A::Error> {
                    let mut o = Options {
                        members: 0,
                        include_usage: false,
                    };
                    while let Some(k) = map.next_key::<Key>()? {
                        map.next_value::<IgnoredAny>()?;
                        o.members += 1;
                        o.include_usage |= matches!(k, Key::IncludeUsage);
                    }
                    Ok(o)
                }
            }
            d.deserialize_map(V)
        }
    }

    /// Where `raw`, a slice of `body` handed out by serde_json, starts in it.
    pub(super) fn offset(body: &[u8], raw: &RawValue) -> Option<usize> {
        let at = (raw.get().as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
        (at + raw.get().len() <= body.len()).then_some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &str = r#"{"id":"x","choices":[],"usage":{"prompt_tokens":48,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#;

    fn sse(events: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for e in events {
            out.extend_from_slice(format!("data: {e}\n\n").as_bytes());
        }
        out
    }

    /// Reference: the receipt is the last usage event of the whole body,
    /// its events read by the plain model ([`fuzzing::reference_events`]).
    /// The scanner must agree for every way of cutting the body into chunks.
    fn reference(body: &[u8]) -> Option<u32> {
        let mut last = None;
        for d in fuzzing::reference_events(body, MAX_SCAN_BYTES).0 {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d) {
                if let Some(c) = cached_tokens(&v) {
                    last = Some(c);
                }
            }
        }
        last
    }

    #[test]
    fn sse_receipt_is_found_whatever_the_chunking() {
        let body = sse(&[
            r#"{"choices":[{"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"delta":{"content":"usage"}}]}"#,
            USAGE,
            "[DONE]",
        ]);
        assert_eq!(reference(&body), Some(32));
        for cut in 1..body.len() {
            for cut2 in [cut, (cut + 7).min(body.len())] {
                let mut s = UsageScanner::new(BodyKind::Sse);
                s.feed(&body[..cut]);
                s.feed(&body[cut..cut2]);
                s.feed(&body[cut2..]);
                assert_eq!(s.finish(), Some(32), "cut at {cut}/{cut2}");
            }
        }
    }

    /// The scanner builds only `usage`; it reads what [`cached_tokens`] and
    /// [`prompt_tokens`] read from the whole document.
    #[test]
    fn the_usage_only_parse_agrees_with_the_whole_document() {
        let logprobs: Vec<String> = (0..200_000).map(|i| format!("-{i}.5")).collect();
        let big = format!(
            r#"{{"choices":[{{"logprobs":{{"token_logprobs":[{}]}}}}],"usage":{{"prompt_tokens":9,"prompt_tokens_details":{{"cached_tokens":8}}}}}}"#,
            logprobs.join(",")
        );
        let docs = [
            USAGE.to_owned(),
            big,
            r#"{"usage":null}"#.to_owned(),
            r#"{"usage":{"prompt_tokens":1.5,"prompt_tokens_details":{"cached_tokens":3}}}"#
                .to_owned(),
            r#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":-1}}}"#
                .to_owned(),
            r#"{"usage":{"prompt_tokens":7,"prompt_tokens_details":null}}"#.to_owned(),
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":4294967304}}}"#.to_owned(),
            r#"{"usage":5}"#.to_owned(),
            r#"[{"usage":{"prompt_tokens_details":{"cached_tokens":3}}}]"#.to_owned(),
            r#"{"choices":[]}"#.to_owned(),
            r#"{"usage":{"prompt_tokens":2,"#.to_owned(),
        ];
        for doc in &docs {
            let whole = serde_json::from_str::<serde_json::Value>(doc).ok();
            let cached = whole.as_ref().and_then(cached_tokens);
            let prompt = cached.and(whole.as_ref().and_then(prompt_tokens));
            let mut s = UsageScanner::new(BodyKind::Json);
            s.feed(doc.as_bytes());
            assert_eq!(
                (s.finish(), s.prompt_tokens()),
                (cached, prompt),
                "{doc:.80}"
            );
        }
    }

    #[test]
    fn sse_without_usage_has_no_receipt() {
        let body = sse(&[r#"{"choices":[{"delta":{"content":"usage"}}]}"#, "[DONE]"]);
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(&body);
        assert_eq!(s.finish(), None);
        assert_eq!(reference(&body), None);
    }

    #[test]
    fn crlf_lines_and_a_last_line_without_newline() {
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(format!("data: {USAGE}\r").as_bytes());
        assert_eq!(s.finish(), Some(32));
    }

    #[test]
    fn json_receipt_needs_the_whole_body() {
        let mut s = UsageScanner::new(BodyKind::Json);
        let (a, b) = USAGE.as_bytes().split_at(20);
        s.feed(a);
        assert_eq!(s.found(), None);
        s.feed(b);
        assert_eq!(s.finish(), Some(32));
        let mut s = UsageScanner::new(BodyKind::Json);
        s.feed(&USAGE.as_bytes()[..30]);
        assert_eq!(s.finish(), None, "a truncated body is no receipt");
    }

    #[test]
    fn an_opaque_body_keeps_nothing_and_has_no_receipt() {
        let mut s = UsageScanner::new(BodyKind::Opaque);
        s.feed(USAGE.as_bytes());
        s.feed(format!("\ndata: {USAGE}\n").as_bytes());
        assert!(s.buf.is_empty(), "nothing buffered");
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn oversized_input_is_dropped_and_says_so() {
        let mut s = UsageScanner::new(BodyKind::Json);
        s.feed(&vec![b' '; MAX_SCAN_BYTES]);
        s.feed(USAGE.as_bytes());
        assert!(s.overflowed());
        assert_eq!(s.finish(), None);
        // SSE: the event of an over-long line is dropped, the next ones
        // still count; so is an event whose data lines add up past the
        // bound.
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: ");
        s.feed(&vec![b'x'; MAX_SCAN_BYTES]);
        s.feed(format!("\ndata: {USAGE}\n\ndata: {USAGE}\n\n").as_bytes());
        assert!(s.overflowed());
        assert_eq!(s.finish(), Some(32));
        let half = format!("data: {}\n", "x".repeat(MAX_SCAN_BYTES / 2));
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(format!("{half}{half}data: {USAGE}\n\n").as_bytes());
        assert!(s.overflowed());
        assert_eq!(s.finish(), None, "one event, over the bound");
    }

    /// The event stream as a browser reads it: an event's `data` lines are
    /// joined by LF (a JSON chunk may span several), lines end with CRLF,
    /// LF or a bare CR (split between chunks or not), comments and other
    /// fields are skipped, a byte-order mark may lead.
    #[test]
    fn sse_events_are_read_as_an_event_source_reads_them() {
        let pretty = serde_json::to_string_pretty(
            &serde_json::from_str::<serde_json::Value>(USAGE).unwrap(),
        )
        .unwrap();
        let multi_line: String = pretty.lines().map(|l| format!("data: {l}\n")).collect();
        let bodies = [
            format!("event: chunk\nid: 7\n{multi_line}\n"),
            format!("data: {USAGE}\r\rdata: [DONE]\r\r"),
            format!("\u{feff}: hello\r\ndata: {USAGE}\r\n\r\n"),
            format!("retry: 10\ndata:{USAGE}\n\n"),
            format!("data: {USAGE}\n"),
        ];
        for body in &bodies {
            let bytes = body.as_bytes();
            for cut in 0..=bytes.len() {
                let mut s = UsageScanner::new(BodyKind::Sse);
                s.feed(&bytes[..cut]);
                s.feed(&bytes[cut..]);
                assert_eq!(s.finish(), Some(32), "{body:?} cut at {cut}");
            }
        }
        // A bare CR then an LF in the next chunk is one line end, not an
        // empty line: the two data lines stay one event, one JSON chunk.
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"usage\":\r");
        s.feed(b"\ndata: {\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n");
        assert_eq!(s.finish(), Some(5));
        // Split over the same two lines with a blank line between: two
        // events, neither JSON.
        let mut s = UsageScanner::new(BodyKind::Sse);
        s.feed(b"data: {\"usage\":\r\r");
        s.feed(b"data: {\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n");
        assert_eq!(s.finish(), None);
    }

    /// The committed corpus of the `usage_scanner` fuzz target replays
    /// through its entry point.
    #[test]
    fn the_fuzz_corpus_replays() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/usage_scanner");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            fuzzing::usage_scanner(&std::fs::read(entry.unwrap().path()).unwrap());
            n += 1;
        }
        // Seeds are committed; a missing one means the corpus was not checked in.
        assert!(n >= 8, "{n} corpus files");
    }

    #[test]
    fn include_usage_adds_to_an_existing_object_only() {
        let out =
            include_usage(br#"{"stream":true,"stream_options":{"continuous_usage_stats":false}}"#)
                .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream_options"]["continuous_usage_stats"], false);
        assert_eq!(
            include_usage(br#"{"stream":true,"stream_options":"x"}"#),
            None
        );
        assert_eq!(include_usage(b"not json"), None);
        assert_eq!(include_usage(br#"{"messages":[]}"#), None);
        let out = include_usage(br#"{"stream":true,"stream_options":null}"#).unwrap();
        assert_eq!(
            out,
            br#"{"stream":true,"stream_options":{"include_usage":true}}"#.to_vec()
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        /// One SSE event: a delta, a usage event (cached tokens), a comment
        /// or keep-alive line, or `[DONE]`.
        fn event() -> impl Strategy<Value = String> {
            prop_oneof![
                "[a-z \"usage]{0,40}".prop_map(|t| format!(
                    "data: {}\n\n",
                    serde_json::json!({"choices": [{"delta": {"content": t}}]})
                )),
                (0u32..100_000).prop_map(|c| format!(
                    "data: {}\r\n\r\n",
                    serde_json::json!({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": c}}})
                )),
                Just(": keep-alive\n\n".to_owned()),
                Just("data: [DONE]\n\n".to_owned()),
            ]
        }

        proptest! {
            /// Any stream, cut anywhere: the scanner's receipt is the
            /// reference model's (the last usage event of the whole body).
            #[test]
            fn sse_scanner_agrees_with_the_reference(
                events in proptest::collection::vec(event(), 0..12),
                cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..6),
            ) {
                let body: Vec<u8> = events.concat().into_bytes();
                let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
                at.sort_unstable();
                let mut s = UsageScanner::new(BodyKind::Sse);
                let mut from = 0;
                for cut in at.into_iter().chain([body.len()]) {
                    s.feed(&body[from..cut]);
                    from = cut;
                }
                prop_assert_eq!(s.finish(), reference(&body));
            }

            /// Arbitrary bytes in any three cuts, at every limit: the
            /// chunked parser's events, overflow and receipts are the
            /// reference model's.
            #[test]
            fn any_body_agrees_with_the_reference(
                data in proptest::collection::vec(
                    prop_oneof![
                        Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' '),
                        Just(b'd'), Just(b'a'), Just(b't'), any::<u8>(),
                    ],
                    0..200,
                ),
                head in proptest::array::uniform4(any::<u8>()),
            ) {
                let mut input = head.to_vec();
                input.extend_from_slice(&data);
                fuzzing::usage_scanner(&input);
            }

            /// Events of any shape (data over several lines, comments,
            /// other fields, any line ending), cut anywhere: the same.
            #[test]
            fn event_streams_agree_with_the_reference(
                lines in proptest::collection::vec(
                    (
                        prop_oneof![
                            Just(String::new()),
                            Just(": ping".to_owned()),
                            Just("event: x".to_owned()),
                            Just("data".to_owned()),
                            "data: [a-z{}\":]{0,12}",
                            Just(format!("data: {USAGE}")),
                        ],
                        prop_oneof![Just("\n"), Just("\r"), Just("\r\n")],
                    ),
                    0..16,
                ),
                head in proptest::array::uniform4(any::<u8>()),
            ) {
                let mut input = head.to_vec();
                for (line, end) in &lines {
                    input.extend_from_slice(line.as_bytes());
                    input.extend_from_slice(end.as_bytes());
                }
                fuzzing::usage_scanner(&input);
            }

            /// A JSON answer cut anywhere: the receipt is the whole
            /// document's.
            #[test]
            fn json_scanner_agrees_with_a_whole_parse(
                cached in proptest::option::of(0u32..100_000),
                cut in any::<proptest::sample::Index>(),
            ) {
                let v = match cached {
                    Some(c) => serde_json::json!({"id": "x", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": c}}}),
                    None => serde_json::json!({"id": "x", "usage": {"prompt_tokens": 10}}),
                };
                let body = serde_json::to_vec(&v).unwrap();
                let cut = cut.index(body.len() + 1);
                let mut s = UsageScanner::new(BodyKind::Json);
                s.feed(&body[..cut]);
                s.feed(&body[cut..]);
                prop_assert_eq!(s.finish(), cached);
            }
        }
    }
}
