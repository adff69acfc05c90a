//! kvroute's re-key chain (`rekey:xxh3_64_chain:block=B:seed=1337`) beside
//! NVIDIA Dynamo's chained sequence hash (`dynamo-kv-router` 1.6.1), one
//! process, one run, the same token blocks. Every variant's keys are asserted
//! equal to Dynamo's before anything is timed.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench chain -- --warm-up-time 1 --measurement-time 2
//! # Dynamo and kvroute timed in alternating rounds (for a machine whose load
//! # changes between criterion benchmarks): median per-round ratio
//! cd examples/bench-dynamo && cargo bench --bench chain -- ratio
//! ```
//!
//! * `dynamo_block_then_seq`: `compute_block_hash_for_seq` then
//!   `compute_seq_hash_for_block`, the pair Dynamo's router calls per request
//!   (each returns a fresh `Vec`, as its API does).
//! * `kvroute_hash_prompt`: `BlockHasher::hash_prompt`, what kvroute's router
//!   calls, into a reused key vector.
//! * `kvroute_prompt_extend`: the incremental `PromptHasher::extend` (reset per
//!   prompt), what the pipelined path calls.
//! * `kvroute_raw_fns`: `rekey::local_block_hash` + `rekey::sequence_key`, the
//!   per-block free functions, like for like with Dynamo's.
//! * `kvroute_extend_chain`: `rekey::extend_chain`, the loop `PromptHasher` runs.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_seq_hash_for_block, BlockHashOptions,
};
use kvroute_core::{rekey, BlockKey, HashContract, RequestExtras};

/// Blocks per prompt: a 8 K-token prompt at block size 16.
const BLOCKS: usize = 512;

/// Deterministic token ids spread over a 152 K vocabulary (Qwen-sized).
fn tokens(n: usize) -> Vec<u32> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 152_000) as u32
        })
        .collect()
}

fn dynamo(toks: &[u32], bs: u32) -> Vec<u64> {
    let locals = compute_block_hash_for_seq(toks, bs, BlockHashOptions::default());
    compute_seq_hash_for_block(&locals)
}

fn raw_fns(toks: &[u32], bs: usize, out: &mut Vec<BlockKey>) {
    let mut parent = None;
    for block in toks.chunks_exact(bs) {
        let local = rekey::local_block_hash(block, rekey::DYNAMO_SEED);
        let key = rekey::sequence_key(parent, local, rekey::DYNAMO_SEED);
        out.push(key);
        parent = Some(key);
    }
}

fn bench(c: &mut Criterion) {
    for bs in [16usize, 64] {
        let toks = tokens(BLOCKS * bs);
        let hasher = format!("rekey:xxh3_64_chain:block={bs}:seed=1337")
            .parse::<HashContract>()
            .expect("contract")
            .hasher()
            .expect("hasher");
        let extras = RequestExtras::NONE;

        // Same answers first: a bench of different outputs measures nothing.
        let expected = dynamo(&toks, bs as u32);
        assert_eq!(expected.len(), BLOCKS);
        let mut keys = Vec::with_capacity(BLOCKS);
        hasher
            .hash_prompt(&toks, &extras, &mut keys)
            .expect("hash_prompt");
        assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), expected);
        let mut prompt = hasher.prompt(&extras).expect("prompt");
        keys.clear();
        prompt.extend(&toks, &mut keys).expect("extend");
        assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), expected);
        keys.clear();
        raw_fns(&toks, bs, &mut keys);
        assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), expected);
        keys.clear();
        rekey::extend_chain(None, &toks, bs, rekey::DYNAMO_SEED, &mut keys);
        assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), expected);

        let mut group = c.benchmark_group(format!("chain_bs{bs}"));
        group.throughput(Throughput::Elements(BLOCKS as u64));
        group.bench_function(BenchmarkId::from_parameter("dynamo_block_then_seq"), |b| {
            b.iter(|| black_box(dynamo(black_box(&toks), bs as u32)))
        });
        group.bench_function(BenchmarkId::from_parameter("kvroute_hash_prompt"), |b| {
            b.iter(|| {
                keys.clear();
                hasher
                    .hash_prompt(black_box(&toks), &extras, &mut keys)
                    .expect("hash_prompt");
                black_box(keys.last().copied())
            })
        });
        group.bench_function(BenchmarkId::from_parameter("kvroute_prompt_extend"), |b| {
            b.iter(|| {
                prompt.reset();
                keys.clear();
                prompt.extend(black_box(&toks), &mut keys).expect("extend");
                black_box(keys.last().copied())
            })
        });
        group.bench_function(BenchmarkId::from_parameter("kvroute_raw_fns"), |b| {
            b.iter(|| {
                keys.clear();
                raw_fns(black_box(&toks), bs, &mut keys);
                black_box(keys.last().copied())
            })
        });
        group.bench_function(BenchmarkId::from_parameter("kvroute_extend_chain"), |b| {
            b.iter(|| {
                keys.clear();
                rekey::extend_chain(None, black_box(&toks), bs, rekey::DYNAMO_SEED, &mut keys);
                black_box(keys.last().copied())
            })
        });
        group.finish();
    }
}

/// `-- ratio`: Dynamo's pair and kvroute's `hash_prompt` alternately, 301
/// rounds of ~0.5 ms each side; prints blocks/s (median and fastest round)
/// and the median of the per-round ratios kvroute / Dynamo.
fn ratios() {
    for bs in [16usize, 64] {
        let toks = tokens(BLOCKS * bs);
        let hasher = format!("rekey:xxh3_64_chain:block={bs}:seed=1337")
            .parse::<HashContract>()
            .expect("contract")
            .hasher()
            .expect("hasher");
        let extras = RequestExtras::NONE;
        let mut keys = Vec::with_capacity(BLOCKS);
        let mut ours = || {
            keys.clear();
            hasher
                .hash_prompt(black_box(&toks), &extras, &mut keys)
                .expect("hash_prompt");
            black_box(keys.last().copied());
        };
        let mut theirs = || {
            black_box(dynamo(black_box(&toks), bs as u32));
        };
        let t = Instant::now();
        theirs();
        let iters = (500_000 / t.elapsed().as_nanos().max(1) as usize).max(1);
        let time = |f: &mut dyn FnMut()| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        };
        let rounds: Vec<(f64, f64)> = (0..301)
            .map(|_| (time(&mut theirs), time(&mut ours)))
            .collect();
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let fastest = |v: Vec<f64>| v.into_iter().fold(f64::MAX, f64::min);
        let per_s = |ns: f64| BLOCKS as f64 / ns * 1e3;
        let d: Vec<f64> = rounds.iter().map(|r| r.0).collect();
        let k: Vec<f64> = rounds.iter().map(|r| r.1).collect();
        println!(
            "bs{bs:<3} dynamo {:>7.1} M blocks/s (fastest {:>7.1})  kvroute hash_prompt {:>7.1} M blocks/s (fastest {:>7.1})  kvroute/dynamo {:.2} [{:.2}]",
            per_s(median(d.clone())),
            per_s(fastest(d.clone())),
            per_s(median(k.clone())),
            per_s(fastest(k.clone())),
            median(rounds.iter().map(|(d, k)| d / k).collect()),
            fastest(k) .recip() / fastest(d).recip(),
        );
    }
}

criterion_group!(benches, bench);

fn main() {
    if std::env::args().skip(1).any(|a| a == "ratio") {
        ratios();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
