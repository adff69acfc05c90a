//! What adding `stream_options.include_usage` to a streamed chat request
//! costs the router per request: `kvroute::receipt::include_usage` (one
//! strict validating pass that keeps only `stream` / `stream_options` as raw
//! slices, one copy with the option spliced in) beside the serde_json `Value` round trip it replaced
//! (`tests/receipt_oracle`), on ~1K- and ~32K-token chat bodies (token counts
//! from the real Qwen3 tokenizer, printed at start). Both run in the same
//! process, alternating per benchmark: read them as a ratio.
//!
//! `cargo bench -p kvroute --bench receipt`

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::receipt::include_usage;
use kvroute_engines::prompt::{ModelOptions, ModelTokenizer};

use kvroute_testkit::receipt_oracle;

const WORDS: &[&str] = &[
    "the",
    "order",
    "shipping",
    "return",
    "warranty",
    "customer",
    "delivery",
    "refund",
    "within",
    "days",
    "please",
    "check",
    "tracking",
    "\"quoted\"",
    "number",
    "2024",
    "€75",
    "größe",
    "東京",
    "🙂",
    "\n",
    "\t",
    "it's",
    "C:\\path",
    "(see",
    "§3)",
    "x=42;",
];

/// About `words` words of varied text, with characters JSON must escape.
fn text(words: usize) -> String {
    let mut s = String::new();
    let mut x: u64 = 0x9e37_79b9;
    for _ in 0..words {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        s.push_str(WORDS[(x >> 33) as usize % WORDS.len()]);
        s.push(' ');
    }
    s
}

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).expect("qwen3 tokenizer");
    let mut g = c.benchmark_group("include_usage");
    for words in [500usize, 16_000] {
        let (system, user) = (text(words), text(words / 4));
        let tokens = tok.encode_uncached(&system, false).expect("encode").len()
            + tok.encode_uncached(&user, false).expect("encode").len();
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "qwen3",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 16, "temperature": 0.2, "stream": true,
        }))
        .expect("body");
        eprintln!("include_usage: ~{tokens} tokens, body {} bytes", body.len());
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&include_usage(&body).expect("splice"))
                .expect("json"),
            serde_json::from_slice::<serde_json::Value>(
                &receipt_oracle::include_usage_by_value(&body).expect("oracle")
            )
            .expect("json"),
        );
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_with_input(BenchmarkId::new("splice", tokens), &body, |b, body| {
            b.iter(|| include_usage(body).expect("splice"));
        });
        g.bench_with_input(BenchmarkId::new("by_value", tokens), &body, |b, body| {
            b.iter(|| receipt_oracle::include_usage_by_value(body).expect("oracle"));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
