//! What "tokenize once" costs the router and saves the engine: rewriting a
//! `/v1/completions` body's string `prompt` as its token ids
//! (`kvroute::prompt::with_token_ids`, and `IdsBody::prepare` with the field
//! checks) beside a plain full tokenization of the same text with the real
//! Qwen3 tokenizer (`tokenizers` `encode_fast`, the library vLLM's fast
//! tokenizer runs) — the work the engine skips — at ~1K/8K/32K tokens.
//!
//! `cargo bench -p kvroute --bench token_ids`

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::prompt::{with_token_ids, IdsBody};
use kvroute_engines::prompt::parse_json;
use kvroute_engines::prompt::{ApiKind, ModelOptions, ModelTokenizer};

const WORDS: &[&str] = &[
    "the",
    "order",
    "shipping",
    "return",
    "warranty",
    "customer",
    "boots",
    "delivery",
    "refund",
    "within",
    "days",
    "please",
    "check",
    "tracking",
    "number",
    "warehouse",
    "Rotterdam",
    "express",
    "helmet",
    "policy",
    "exchange",
    "damaged",
    "because",
    "however",
    "2024",
    "€75",
    "größe",
    "naïve",
    "東京",
    "🙂",
    "\n",
    "  ",
    "it's",
    "don't",
    "(see",
    "§3)",
    "x=42;",
];

/// About `tokens` tokens of varied text (a fixed linear congruential walk).
fn text(tokens: usize) -> String {
    let mut s = String::new();
    let mut x: u64 = 0x2545_f491;
    for _ in 0..tokens {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let w = WORDS[(x >> 33) as usize % WORDS.len()];
        s.push_str(w);
        s.push(' ');
    }
    s
}

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).expect("qwen3 tokenizer");
    let mut g = c.benchmark_group("token_ids");
    for n in [1_000usize, 8_000, 32_000] {
        let text = text(n);
        let ids = tok.encode_uncached(&text, true).expect("encode");
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "qwen3", "prompt": text, "max_tokens": 16, "temperature": 0.2,
            "stream": true, "stream_options": {"include_usage": true},
        }))
        .expect("body");
        let value = parse_json(&body).expect("json");
        eprintln!(
            "token_ids: {n} words → {} tokens, body {} bytes",
            ids.len(),
            body.len()
        );
        g.throughput(Throughput::Elements(ids.len() as u64));
        g.bench_with_input(
            BenchmarkId::new("with_token_ids", ids.len()),
            &ids,
            |b, ids| {
                b.iter(|| with_token_ids(&body, ids).expect("rewrite"));
            },
        );
        let engines = vec![kvroute::engine::by_name("vllm").expect("built-in engine")];
        g.bench_with_input(
            BenchmarkId::new("ids_body_prepare", ids.len()),
            &ids,
            |b, ids| {
                b.iter(|| {
                    let p = IdsBody::prepare(
                        ApiKind::Completions,
                        &body,
                        &value,
                        Some(ids),
                        false,
                        &engines,
                    );
                    assert!(p.for_engine(&kvroute::engine::VLLM).is_ok());
                    p
                });
            },
        );
        g.bench_with_input(
            BenchmarkId::new("engine_encode_saved", ids.len()),
            &text,
            |b, t| {
                b.iter(|| tok.encode_uncached(t, true).expect("encode"));
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
