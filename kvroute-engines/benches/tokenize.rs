//! Tokenization throughput with the real Qwen3 tokenizer: plain full
//! tokenization at ~1K/8K/32K-token chat prompts, `encode` vs `encode_fast`,
//! and the span-cached 32K multi-turn case (leading messages seen before, a new
//! final user message every iteration).

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvroute_engines::prompt::{
    prompt_tokens, ApiKind, ModelOptions, ModelTokenizer, PyDict, PyValue,
};

const WORDS: &[&str] = &[
    "the",
    "order",
    "shipping",
    "return",
    "warranty",
    "customer",
    "boots",
    "harness",
    "rope",
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
    "carabiner",
    "helmet",
    "sizing",
    "measure",
    "evening",
    "policy",
    "exchange",
    "damaged",
    "because",
    "however",
    "camping",
    "stove",
    "gas",
    "cartridge",
    "tent",
    "sleeping",
    "bag",
    "waterproof",
    "jacket",
    "trail",
    "summit",
    "weather",
    "forecast",
    "2024",
    "€75",
    "größe",
    "naïve",
    "東京",
    "😀",
    "(see",
    "step",
    "3)",
    "—",
    "e.g.",
    "isn't",
];

/// Deterministic pseudo-random prose of roughly `words` words.
fn prose(seed: u64, words: usize) -> String {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        out.push(if i % 17 == 16 { '\n' } else { ' ' });
    }
    out
}

fn chat(turns: usize, words_per_turn: usize, tail_seed: u64) -> PyValue {
    let mut messages = Vec::new();
    let mut push = |role: &str, content: String| {
        let mut d = PyDict::new();
        d.insert("role".into(), PyValue::Str(role.into()));
        d.insert("content".into(), PyValue::Str(content));
        messages.push(PyValue::Dict(d));
    };
    push("system", prose(1, words_per_turn));
    for t in 0..turns {
        push(
            if t % 2 == 0 { "user" } else { "assistant" },
            prose(100 + t as u64, words_per_turn),
        );
    }
    push("user", prose(tail_seed, 40));
    let mut body = PyDict::new();
    body.insert("model".into(), PyValue::Str("qwen3".into()));
    body.insert("messages".into(), PyValue::List(messages));
    PyValue::Dict(body)
}

fn rendered(tok: &ModelTokenizer, body: &PyValue) -> (String, usize) {
    let p = prompt_tokens(tok, ApiKind::Chat, body).unwrap();
    let ep = &p.engine_prompts[0];
    (ep.rendered.clone().unwrap(), ep.token_ids.len())
}

fn load(cache: bool) -> ModelTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3");
    let opts = ModelOptions {
        span_cache_bytes: if cache { 64 << 20 } else { 0 },
        ..ModelOptions::default()
    };
    ModelTokenizer::load(&dir, &opts).unwrap()
}

fn bench(c: &mut Criterion) {
    let plain = load(false);
    let cached = load(true);
    // ~400 words per turn ≈ 500-600 tokens.
    let sizes = [("1K", 1usize), ("8K", 14), ("32K", 56)];

    let mut g = c.benchmark_group("tokenize_plain");
    for (label, turns) in sizes {
        let (text, n) = rendered(&plain, &chat(turns, 400, 7));
        eprintln!("{label}: {n} tokens, {} bytes", text.len());
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("encode_fast", label), &text, |b, t| {
            b.iter(|| plain.encode_uncached(t, false).unwrap())
        });
        if label == "8K" {
            g.bench_with_input(
                BenchmarkId::new("encode_with_offsets", label),
                &text,
                |b, t| {
                    b.iter(|| {
                        plain
                            .tokenizer()
                            .encode(t.as_str(), false)
                            .unwrap()
                            .get_ids()
                            .len()
                    })
                },
            );
        }
    }
    g.finish();

    let mut g = c.benchmark_group("tokenize_cached_multiturn");
    let (_, n) = rendered(&plain, &chat(56, 400, 7));
    g.throughput(Throughput::Elements(n as u64));
    // Warm: the conversation was seen once (with another final message).
    let (warm, _) = rendered(&plain, &chat(56, 400, 1_000_000));
    cached.encode(&warm, false).unwrap();
    // Each iteration gets a final user message never seen before (built in the
    // untimed setup), so the tail is really tokenized and only the leading
    // messages can come from the cache.
    let head = warm
        .rfind("<|im_start|>user\n")
        .map(|i| warm[..i].to_owned())
        .unwrap();
    let mut counter = 0u64;
    g.bench_function("32K_new_tail", |b| {
        b.iter_batched(
            || {
                counter += 1;
                format!(
                    "{head}<|im_start|>user\n{} #{counter}<|im_end|>\n<|im_start|>assistant\n",
                    prose(counter, 40)
                )
            },
            |text| cached.encode(&text, false).unwrap(),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
