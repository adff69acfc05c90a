//! Server-sent events as an `EventSource` reads them (the WHATWG HTML
//! standard's "event stream interpretation"), keeping only what a receipt
//! needs: each event's `data`.
//!
//! * Lines end with CRLF, LF or a bare CR, in any mix; a CRLF split between
//!   two chunks is one line end.
//! * An empty line dispatches the event: its `data` lines' values joined by
//!   LF (a value loses one leading space). An event without `data` is none.
//! * A line starting with `:` is a comment; other fields (`event`, `id`,
//!   `retry`, unknown ones) are skipped; a leading byte-order mark is dropped.
//! * At the end of the body an event not yet dispatched is dispatched (the
//!   standard drops it; a receipt is taken from whatever arrived).
//!
//! Memory is bounded: a line longer than the limit less the data its event
//! holds so far, or an event's data longer than the limit, makes that event
//! nothing (counted by [`SseEvents::overflowed`]); the events before and
//! after it still count. A line and its event's data together stay within
//! the limit; the buffers' capacity grows to at most the limit each (2.5
//! times the limit in all for an instant while the data grows beside a
//! long held line), and a large one is freed once its line or event is
//! over.

/// The byte-order mark an event stream may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A buffer's capacity kept for the next line or event; a larger one is
/// freed (an over-long line must not pin its memory for the stream's life).
const KEEP: usize = 64 << 10;

/// Appends `parts` to `v` after one reservation, its capacity growing to at
/// most `cap` (a reallocation holds the old buffer and the new one at once).
fn append(v: &mut Vec<u8>, parts: &[&[u8]], cap: usize) {
    let need = v.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    if need > v.capacity() {
        let want = need.max(v.capacity().saturating_mul(2)).min(cap.max(need));
        v.reserve_exact(want - v.len());
    }
    for p in parts {
        v.extend_from_slice(p);
    }
}

/// An event stream's parser, fed the body's chunks.
#[derive(Debug)]
pub(crate) struct SseEvents {
    limit: usize,
    /// The current line's bytes from earlier chunks (empty while a line
    /// lies whole inside one chunk).
    line: Vec<u8>,
    /// The current event's data so far, each value followed by LF.
    data: Vec<u8>,
    /// The last byte fed was a CR: an LF right after it ends nothing.
    after_cr: bool,
    /// The current line grew past the limit: the rest of it is skipped.
    skipping: bool,
    /// The current event lost a line or data to the limit: it is nothing.
    spoiled: bool,
    /// No line has ended yet (a byte-order mark may lead the first one).
    first: bool,
    /// Some event was lost to the limit.
    overflowed: bool,
}

impl SseEvents {
    /// A parser holding at most `limit` bytes of a line or of one event's data.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            line: Vec::new(),
            data: Vec::new(),
            after_cr: false,
            skipping: false,
            spoiled: false,
            first: true,
            overflowed: false,
        }
    }

    /// Whether some event was lost to the limit.
    pub(crate) fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Feeds the next chunk; `on_event` receives each event's data as it
    /// is dispatched.
    pub(crate) fn feed(&mut self, chunk: &[u8], on_event: &mut impl FnMut(&[u8])) {
        let mut rest = chunk;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if let Some(tail) = rest.strip_prefix(b"\n") {
                rest = tail;
            }
        }
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (part, tail) = rest.split_at(end);
            let cr = tail.first() == Some(&b'\r');
            rest = tail.get(1..).unwrap_or_default();
            if cr {
                match rest.first() {
                    Some(b'\n') => rest = rest.get(1..).unwrap_or_default(),
                    Some(_) => {}
                    // The chunk ends on the CR: an LF may open the next.
                    None => self.after_cr = true,
                }
            }
            if self.line.is_empty() && !self.skipping {
                self.line_ended(part, on_event);
            } else {
                self.hold(part);
                let mut line = std::mem::take(&mut self.line);
                self.line_ended(&line, on_event);
                // Keep the buffer's room for the next line, unless large.
                if line.capacity() <= KEEP {
                    line.clear();
                    self.line = line;
                }
            }
        }
        self.hold(rest);
    }

    /// The body ended: the line and the event under way count as ended.
    pub(crate) fn finish(&mut self, on_event: &mut impl FnMut(&[u8])) {
        if !self.line.is_empty() || self.skipping {
            let line = std::mem::take(&mut self.line);
            self.line_ended(&line, on_event);
        }
        self.dispatch(on_event);
        self.line = Vec::new();
        self.data = Vec::new();
    }

    /// Keeps `part` of a line not yet ended, within the limit.
    fn hold(&mut self, part: &[u8]) {
        if self.skipping || part.is_empty() {
            return;
        }
        let room = self.limit.saturating_sub(self.data.len());
        if self.line.len() + part.len() > room {
            self.skipping = true;
            self.line = Vec::new();
        } else {
            append(&mut self.line, &[part], room);
        }
    }

    fn line_ended(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8])) {
        // The limit counts the line as it came, a byte-order mark included,
        // with the data its event holds.
        if std::mem::take(&mut self.skipping) || line.len() + self.data.len() > self.limit {
            self.first = false;
            self.spoil();
            return;
        }
        let line = if std::mem::take(&mut self.first) {
            line.strip_prefix(BOM).unwrap_or(line)
        } else {
            line
        };
        if line.is_empty() {
            self.dispatch(on_event);
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(0) => return,
            Some(colon) => {
                let value = line.get(colon + 1..).unwrap_or_default();
                (
                    line.get(..colon).unwrap_or_default(),
                    value.strip_prefix(b" ").unwrap_or(value),
                )
            }
            None => (line, &[][..]),
        };
        if field != b"data" || self.spoiled {
            return;
        }
        if self.data.len() + value.len() + 1 > self.limit {
            self.spoil();
            return;
        }
        append(&mut self.data, &[value, b"\n"], self.limit);
    }

    /// The event under way loses its data to the limit.
    fn spoil(&mut self) {
        self.spoiled = true;
        self.overflowed = true;
        self.data = Vec::new();
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(&[u8])) {
        if !std::mem::take(&mut self.spoiled) {
            if let Some(data) = self.data.strip_suffix(b"\n") {
                on_event(data);
            }
        }
        if self.data.capacity() > KEEP {
            self.data = Vec::new();
        }
        self.data.clear();
    }
}
