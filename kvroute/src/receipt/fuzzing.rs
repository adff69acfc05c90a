//! The receipt scanner against a reference model: the entry point of the
//! `usage_scanner` cargo-fuzz target and of its corpus replay, and the model
//! the property tests compare with.

use super::sse::SseEvents;
use super::{sse_event, usage_receipt, BodyKind, UsageScanner, MAX_SCAN_BYTES};

/// The events of a whole body, read as [`SseEvents`] reads it in chunks but
/// written plainly: the body split into lines first (CRLF, LF, CR), then
/// each line taken in turn. Also whether some event was lost to `limit`.
#[must_use]
pub fn reference_events(body: &[u8], limit: usize) -> (Vec<Vec<u8>>, bool) {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < body.len() {
        match body.get(i) {
            Some(b'\r') => {
                lines.push(body.get(start..i).unwrap_or_default());
                if body.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            Some(b'\n') => {
                lines.push(body.get(start..i).unwrap_or_default());
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    let last = body.get(start..).unwrap_or_default();
    if !last.is_empty() {
        lines.push(last);
    }
    // The end of the body dispatches the event under way.
    lines.push(b"");
    let (mut events, mut data, mut spoiled, mut overflowed) =
        (Vec::new(), Vec::new(), false, false);
    for (k, line) in lines.into_iter().enumerate() {
        if line.len() + data.len() > limit {
            (spoiled, overflowed) = (true, true);
            data.clear();
            continue;
        }
        let line = if k == 0 {
            line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line)
        } else {
            line
        };
        if line.is_empty() {
            if !spoiled && !data.is_empty() {
                data.pop();
                events.push(std::mem::take(&mut data));
            }
            data.clear();
            spoiled = false;
            continue;
        }
        if line.first() == Some(&b':') {
            continue;
        }
        let Some(value) = line.strip_prefix(b"data") else {
            continue;
        };
        let value = match value {
            [] => value,
            [b':', rest @ ..] => rest.strip_prefix(b" ").unwrap_or(rest),
            // Another field whose name starts with "data".
            _ => continue,
        };
        if spoiled {
            continue;
        }
        if data.len() + value.len() + 1 > limit {
            (spoiled, overflowed) = (true, true);
            data.clear();
            continue;
        }
        data.extend_from_slice(value);
        data.push(b'\n');
    }
    (events, overflowed)
}

/// Arbitrary bytes as a response body: the first byte picks the limit, the
/// next three where the body is cut into chunks. Panics if the chunked
/// parser and the reference disagree on the events, the SSE receipt or the
/// JSON receipt.
pub fn usage_scanner(data: &[u8]) {
    let (Some(&mode), Some(cuts), Some(body)) = (data.first(), data.get(1..4), data.get(4..))
    else {
        return;
    };
    let limit = match mode & 3 {
        0 => 4,
        1 => 16,
        2 => 256,
        _ => MAX_SCAN_BYTES,
    };
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|&c| usize::from(c) * body.len() / 255)
        .collect();
    at.sort_unstable();
    let chunks = || {
        let mut from = 0;
        at.iter().copied().chain([body.len()]).map(move |to| {
            let chunk = body.get(from..to).unwrap_or_default();
            from = to;
            chunk
        })
    };

    let mut parser = SseEvents::new(limit);
    let mut events = Vec::new();
    for chunk in chunks() {
        parser.feed(chunk, &mut |d| events.push(d.to_vec()));
    }
    parser.finish(&mut |d| events.push(d.to_vec()));
    let (expected, overflowed) = reference_events(body, limit);
    assert_eq!(events, expected, "events (limit {limit})");
    assert_eq!(parser.overflowed(), overflowed, "overflow (limit {limit})");

    let mut s = UsageScanner::new(BodyKind::Sse);
    for chunk in chunks() {
        s.feed(chunk);
    }
    let (mut found, mut prompt) = (None, None);
    for e in &reference_events(body, MAX_SCAN_BYTES).0 {
        sse_event(e, &mut found, &mut prompt);
    }
    assert_eq!(
        (s.finish(), s.prompt_tokens()),
        (found, prompt),
        "SSE receipt"
    );

    let mut s = UsageScanner::new(BodyKind::Json);
    for chunk in chunks() {
        s.feed(chunk);
    }
    let whole = match usage_receipt(body) {
        Some((cached, prompt)) if !body.is_empty() => (cached, cached.and(prompt)),
        _ => (None, None),
    };
    assert_eq!((s.finish(), s.prompt_tokens()), whole, "JSON receipt");
}
