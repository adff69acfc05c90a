//! A chat template's output is not bounded by its input: a template that
//! pretty-prints the request's tools (`tojson(indent=4)`, as Llama 3.1's
//! does) writes a newline and the whole indentation before every item of a
//! deeply nested schema, about 1 000 bytes per 2 bytes of body here. The
//! render stops once the prompt is certainly over the request's character
//! limit: the request is a `prompt_too_long` miss, and the memory it took
//! stays a few times the limit, measured by this binary's own allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_engines::prompt::{
    parse_json, prompt_tokens_limited, ApiKind, ModelOptions, ModelTokenizer, PromptError,
    PromptLimits,
};

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; the counters only
// observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System::alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Levels of nesting of the tool's parameters, and items at the deepest.
const DEPTH: usize = 240;
const ITEMS: usize = 20_000;

#[test]
fn a_template_that_multiplies_its_input_stops_at_the_prompt_limit() {
    let staged = std::env::temp_dir().join(format!("kvroute-render-budget-{}", std::process::id()));
    std::fs::create_dir_all(&staged).unwrap();
    let qwen3 = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
    for f in ["tokenizer.json.gz", "tokenizer_config.json"] {
        std::fs::copy(qwen3.join(f), staged.join(f)).unwrap();
    }
    std::fs::write(
        staged.join("chat_template.jinja"),
        "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}\
         {% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let tok = ModelTokenizer::load(&staged, &ModelOptions::default()).unwrap();
    let _ = std::fs::remove_dir_all(&staged);

    let body = format!(
        r#"{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}],
            "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {{"a": {}{}{}}}}}}}]}}"#,
        "[".repeat(DEPTH),
        vec!["0"; ITEMS].join(","),
        "]".repeat(DEPTH),
    );
    let body_len = body.len();
    let body = parse_json(body.as_bytes()).unwrap();
    // The router's default limit.
    let limits = PromptLimits { max_chars: 1 << 20 };
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let miss = prompt_tokens_limited(&tok, ApiKind::Chat, &body, limits).unwrap_err();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    eprintln!(
        "{} bytes of body: peak {:.1} MiB",
        body_len,
        peak as f64 / f64::from(1 << 20)
    );
    assert_eq!(
        miss,
        PromptError::PromptTooLong {
            limit: limits.max_chars
        }
    );
    // Rendered in full the tools alone would be ~20 MB (several copies of
    // it at once: 59 MiB); the limit is 4 MiB of output (15.7 MiB at the
    // peak, a few copies of it).
    assert!(peak < 24 << 20, "peak {} MiB", peak >> 20);
}
