//! The receipt scanner's memory: a non-streamed answer is held up to
//! `MAX_SCAN_BYTES` and only its `usage` object is built from it; a hostile
//! event stream pins no more than the bound. Counted by this binary's own
//! allocator (one test, so nothing else allocates meanwhile beyond the
//! harness).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute::receipt::{BodyKind, UsageScanner, MAX_SCAN_BYTES};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// An answer of per-token log-probabilities just under the scan bound: the
/// receipt is read with well under the answer's size again, where a whole
/// parse into `serde_json::Value` takes several times it.
#[test]
fn a_large_answer_is_read_for_its_receipt_without_building_it() {
    let mut body = String::from(r#"{"choices":[{"logprobs":{"token_logprobs":["#);
    while body.len() < MAX_SCAN_BYTES - 200 {
        body.push_str("-0.5,");
    }
    body.push_str(
        r#"-1]}}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}}}"#,
    );
    assert!(body.len() <= MAX_SCAN_BYTES);
    let mut s = UsageScanner::new(BodyKind::Json);
    s.feed(body.as_bytes());
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    assert_eq!(s.finish(), Some(8));
    let extra = PEAK.load(Ordering::Relaxed) - before;
    assert!(
        extra < 64 << 10,
        "reading the receipt of a {} byte answer took {extra} more bytes",
        body.len()
    );
    drop(body);
    an_event_stream_of_long_lines_holds_at_most_the_bound();
}

/// Events whose data lines come just under the bound, each line fed in
/// small pieces (held until it ends), then an event whose lines add up past
/// it, then one whose data grows by doubling before a long held line joins
/// it: the scanner's buffers stay within 2.5 times the bound while one
/// grows (twice at rest), are freed once their line or event is over, and
/// the usage event after them is read.
fn an_event_stream_of_long_lines_holds_at_most_the_bound() {
    let piece = vec![b'x'; 64 << 10];
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let mut s = UsageScanner::new(BodyKind::Sse);
    for _ in 0..3 {
        s.feed(b"data: ");
        for _ in 0..(MAX_SCAN_BYTES - 100) / piece.len() {
            s.feed(&piece);
        }
        s.feed(b"\ndata: x\n");
        for _ in 0..(MAX_SCAN_BYTES / 2) / piece.len() {
            s.feed(&piece);
        }
        s.feed(b"\n\n");
    }
    let mut first = b"data: ".to_vec();
    first.resize(6 + (1 << 20) - 1, b'x');
    s.feed(&first);
    drop(first);
    s.feed(b"\ndata: x\ndata: ");
    for _ in 0..(3 << 20) / piece.len() - 1 {
        s.feed(&piece);
    }
    s.feed(b"\n\n");
    let held = LIVE.load(Ordering::Relaxed) - before;
    s.feed(b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\n");
    assert_eq!(s.finish(), Some(5));
    assert!(s.overflowed());
    let peak = PEAK.load(Ordering::Relaxed) - before;
    eprintln!("event stream of long lines: peak {peak} bytes, {held} held between events");
    assert!(
        peak <= MAX_SCAN_BYTES * 5 / 2 + (64 << 10),
        "peak {peak} bytes"
    );
    assert!(held < 128 << 10, "{held} bytes still held between events");
}
