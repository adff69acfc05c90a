//! kvroute's re-key chain (`rekey:xxh3_64_chain:block=B:seed=1337`) beside
//! NVIDIA Dynamo's chained sequence hash (`dynamo-kv-router` 1.6.1), one
//! process, one run, the same token blocks. Every variant's keys are asserted
//! equal to Dynamo's before anything is timed.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench chain -- --warm-up-time 1 --measurement-time 2
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
//!   free functions, like for like with Dynamo's.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
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
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
