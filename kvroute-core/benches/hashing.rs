//! Blocks/s of every contract at block sizes 16 and 64, beside a naive reference
//! (ciborium + sha2, allocating per block) and raw SHA-256 / XXH3-128 of the
//! same serialised bytes.
//!
//! Run: `cargo bench -p kvroute-core --bench hashing -- --warm-up-time 1 --measurement-time 3`
//!
//! `cargo bench -p kvroute-core --bench hashing -- ratio` instead times the CBOR
//! contracts and the raw digests of their bytes in alternating rounds, one
//! right after the other, and prints the median of the per-round ratios: on a
//! shared machine whose load changes from one criterion benchmark to the next
//! this is the figure to compare with a target ratio. `-- ratio "bs16 sha256"`
//! runs only the rows whose block size and algorithm contain that text.

use std::time::Instant;

use criterion::{black_box, criterion_group, BenchmarkId, Criterion, Throughput};
use kvroute_core::{BlockKey, HashContract, RequestExtras};
use sha2::{Digest as _, Sha256};

const BLOCKS: usize = 256;

/// Deterministic token ids spread over a 152k vocabulary (Qwen-sized).
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

fn contracts(bs: usize) -> Vec<(&'static str, String)> {
    vec![
        (
            "vllm_sha256_cbor",
            format!("vllm@0.33.0:sha256_cbor:block={bs}:seed=0"),
        ),
        (
            "vllm_xxhash_cbor",
            format!("vllm@0.33.0:xxhash_cbor:block={bs}:seed=0"),
        ),
        (
            "vllm_sha256_pickle",
            format!("vllm@0.33.0:sha256:block={bs}"),
        ),
        (
            "vllm_xxhash_pickle",
            format!("vllm@0.33.0:xxhash:block={bs}:seed=0"),
        ),
        (
            "sglang_page_chain",
            format!("sglang@0.5.23:sha256_page_chain:block={bs}"),
        ),
        (
            "sglang_legacy_pyhash",
            format!("sglang@0.5.5:legacy_pyhash:block={bs}"),
        ),
        (
            "trtllm_v1_block_key",
            format!("trtllm:v1_block_key:block={bs}"),
        ),
        (
            "rekey_xxh3_chain",
            format!("rekey:xxh3_64_chain:block={bs}:seed=1337"),
        ),
    ]
}

fn naive_sha256_cbor(tokens: &[u32], bs: usize, root: &[u8]) -> Vec<BlockKey> {
    use ciborium::value::Value;
    let mut parent = root.to_vec();
    let mut keys = Vec::new();
    for block in tokens.chunks_exact(bs) {
        let value = Value::Array(vec![
            Value::Bytes(parent.clone()),
            Value::Array(block.iter().map(|&t| Value::Integer(t.into())).collect()),
            Value::Null,
        ]);
        let mut buf = Vec::new();
        ciborium::into_writer(&value, &mut buf).unwrap();
        parent = Sha256::digest(&buf).to_vec();
        keys.push(BlockKey(u64::from_be_bytes(
            parent[24..].try_into().unwrap(),
        )));
    }
    keys
}

fn bench(c: &mut Criterion) {
    for bs in [16usize, 64] {
        let toks = tokens(BLOCKS * bs);
        // The fast path and the naive encoding must agree before either is timed.
        let root = kvroute_core::vllm::none_hash(kvroute_core::VllmAlgorithm::Sha256Cbor, "0");
        let mut fast = Vec::new();
        format!("vllm@0.33.0:sha256_cbor:block={bs}:seed=0")
            .parse::<HashContract>()
            .unwrap()
            .hasher()
            .unwrap()
            .hash_prompt(&toks, &RequestExtras::NONE, &mut fast)
            .unwrap();
        assert_eq!(fast, naive_sha256_cbor(&toks, bs, root.as_bytes()));
        let mut group = c.benchmark_group(format!("hash_bs{bs}"));
        group.throughput(Throughput::Elements(BLOCKS as u64));
        for (name, spec) in contracts(bs) {
            let hasher = spec.parse::<HashContract>().unwrap().hasher().unwrap();
            let extras = RequestExtras::NONE;
            let mut prompt = hasher.prompt(&extras).unwrap();
            let mut keys = Vec::with_capacity(BLOCKS);
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    prompt.reset();
                    keys.clear();
                    prompt.extend(black_box(&toks), &mut keys).unwrap();
                    black_box(keys.last().copied())
                })
            });
        }

        // Naive reference: a ciborium value tree and a fresh Vec per block.
        group.bench_function(BenchmarkId::from_parameter("naive_ciborium_sha2"), |b| {
            b.iter(|| black_box(naive_sha256_cbor(black_box(&toks), bs, root.as_bytes())))
        });

        // Raw digests of the exact bytes sha256_cbor / xxhash_cbor hash.
        for (name, raw) in [
            ("raw_sha256_same_bytes", Raw::Sha256),
            ("raw_sha256_same_bytes_chained", Raw::Sha256Chained),
            ("raw_sha256_compress_only", Raw::Sha256CompressOnly),
            ("raw_xxh3_128_same_bytes", Raw::Xxh3_128),
            ("raw_xxh3_128_same_bytes_chained", Raw::Xxh3_128Chained),
        ] {
            let inputs = RawInputs::new(raw, &toks, bs);
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| black_box(inputs.run()))
            });
        }
        group.finish();
    }
}

/// A raw digest over the bytes one contract's blocks hash.
#[derive(Clone, Copy)]
enum Raw {
    /// `sha2::Sha256::digest` of each block's CBOR (the crate's public API),
    /// the blocks independent of each other (the CPU overlaps them).
    Sha256,
    /// The same, each block's input read only once the previous digest is
    /// known, as in a chain (whose next input holds the previous digest).
    Sha256Chained,
    /// Only sha2's compression function over each block's CBOR, padded
    /// beforehand: the floor any SHA-256 of these bytes costs.
    Sha256CompressOnly,
    /// `xxh3_128` of each block's CBOR.
    Xxh3_128,
    /// The same, chained like `Sha256Chained`.
    Xxh3_128Chained,
}

struct RawInputs {
    raw: Raw,
    /// Every block's input in one buffer (padded for `Sha256CompressOnly`).
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl RawInputs {
    fn new(raw: Raw, toks: &[u32], bs: usize) -> Self {
        let spec = match raw {
            Raw::Xxh3_128 | Raw::Xxh3_128Chained => {
                format!("vllm@0.33.0:xxhash_cbor:block={bs}:seed=0")
            }
            _ => format!("vllm@0.33.0:sha256_cbor:block={bs}:seed=0"),
        };
        let hasher = spec.parse::<HashContract>().unwrap().hasher().unwrap();
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        for mut input in serialised_inputs(&hasher, toks) {
            if let Raw::Sha256CompressOnly = raw {
                let bits = (input.len() as u64) * 8;
                input.push(0x80);
                while input.len() % 64 != 56 {
                    input.push(0);
                }
                input.extend_from_slice(&bits.to_be_bytes());
            }
            bytes.extend_from_slice(&input);
            ends.push(bytes.len());
        }
        Self { raw, bytes, ends }
    }

    fn run(&self) -> u8 {
        let mut acc = 0u8;
        let mut start = 0;
        // Zero, but only known at run time: `acc & mask` makes the next
        // input's address wait for the previous digest.
        let mask = black_box(0usize);
        for &end in &self.ends {
            let dep = match self.raw {
                Raw::Sha256Chained | Raw::Xxh3_128Chained => usize::from(acc) & mask,
                _ => 0,
            };
            let input = black_box(&self.bytes[start + dep..end]);
            acc ^= match self.raw {
                Raw::Sha256 | Raw::Sha256Chained => Sha256::digest(input)[31],
                Raw::Sha256CompressOnly => {
                    // The compression costs the same whatever the state holds.
                    let mut state = [0u32; 8];
                    for block in input.chunks_exact(64) {
                        sha2::compress256(
                            &mut state,
                            std::slice::from_ref(
                                sha2::digest::generic_array::GenericArray::from_slice(block),
                            ),
                        );
                    }
                    state[7] as u8
                }
                Raw::Xxh3_128 | Raw::Xxh3_128Chained => xxhash_rust::xxh3::xxh3_128(input) as u8,
            };
            start = end;
        }
        acc
    }
}

/// Ns per call of the two closures timed alternately: `rounds` rounds of
/// `iters` calls each, one side right after the other.
fn alternate(
    rounds: usize,
    iters: usize,
    mut a: impl FnMut(),
    mut b: impl FnMut(),
) -> Vec<(f64, f64)> {
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        t.elapsed().as_nanos() as f64 / iters as f64
    };
    (0..rounds).map(|_| (time(&mut a), time(&mut b))).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn fastest(v: impl Iterator<Item = f64>) -> f64 {
    v.fold(f64::MAX, f64::min)
}

/// `-- ratio`: each CBOR contract against the raw digests of its own bytes,
/// alternating in 301 rounds of ~0.5 ms per side. Printed: the median of the
/// per-round ratios, and the ratio of the two fastest rounds (the rounds no
/// other process interrupted).
fn ratios(filter: Option<&str>) {
    println!(
        "interleaved, {BLOCKS} blocks per call, 301 rounds: median per-round ratio [ratio of fastest rounds]"
    );
    for bs in [16usize, 64] {
        let toks = tokens(BLOCKS * bs);
        for (contract, raws) in [
            (
                format!("vllm@0.33.0:sha256_cbor:block={bs}:seed=0"),
                vec![
                    ("raw_sha256_same_bytes", Raw::Sha256),
                    ("raw_sha256_same_bytes_chained", Raw::Sha256Chained),
                    ("raw_sha256_compress_only", Raw::Sha256CompressOnly),
                ],
            ),
            (
                format!("vllm@0.33.0:xxhash_cbor:block={bs}:seed=0"),
                vec![
                    ("raw_xxh3_128_same_bytes", Raw::Xxh3_128),
                    ("raw_xxh3_128_same_bytes_chained", Raw::Xxh3_128Chained),
                ],
            ),
        ] {
            let hasher = contract.parse::<HashContract>().unwrap().hasher().unwrap();
            let algorithm = contract.split(':').nth(1).unwrap_or("?").to_owned();
            if filter.is_some_and(|f| !format!("bs{bs} {algorithm}").contains(f)) {
                continue;
            }
            let extras = RequestExtras::NONE;
            let mut prompt = hasher.prompt(&extras).unwrap();
            let mut keys = Vec::with_capacity(BLOCKS);
            for (raw_name, raw) in raws {
                let inputs = RawInputs::new(raw, &toks, bs);
                let mut ours = || {
                    prompt.reset();
                    keys.clear();
                    prompt.extend(black_box(&toks), &mut keys).unwrap();
                    black_box(keys.last().copied());
                };
                let t = Instant::now();
                ours();
                let iters = (500_000 / t.elapsed().as_nanos().max(1) as usize).max(1);
                let rounds = alternate(301, iters, &mut ours, || {
                    black_box(inputs.run());
                });
                let per_s = |ns: f64| BLOCKS as f64 / ns * 1e3;
                let (o_min, r_min) = (
                    fastest(rounds.iter().map(|r| r.0)),
                    fastest(rounds.iter().map(|r| r.1)),
                );
                println!(
                    "bs{bs:<3} {algorithm:<12} {:>6.2} M blocks/s (fastest {:>6.2})  {raw_name:<31} {:>6.2} M blocks/s (fastest {:>6.2})  ratio {:.3} [{:.3}]",
                    per_s(median(rounds.iter().map(|r| r.0).collect())),
                    per_s(o_min),
                    per_s(median(rounds.iter().map(|r| r.1).collect())),
                    per_s(r_min),
                    median(rounds.iter().map(|(o, r)| r / o).collect()),
                    r_min / o_min,
                );
            }
        }
    }
}

/// The serialised block inputs of a vLLM CBOR chain (via the public API).
fn serialised_inputs(hasher: &kvroute_core::BlockHasher, toks: &[u32]) -> Vec<Vec<u8>> {
    let HashContract::Vllm(c) = hasher.contract() else {
        unreachable!()
    };
    let bs = hasher.block_size();
    let mut parent = hasher.root(&RequestExtras::NONE).unwrap();
    let mut out = Vec::new();
    let mut scratch = Vec::new();
    for block in toks.chunks_exact(bs) {
        let mut bytes = Vec::new();
        kvroute_core::vllm::serialize_block(
            c.algorithm,
            &mut bytes,
            &parent,
            block,
            std::iter::empty(),
            None,
        );
        out.push(bytes);
        parent = kvroute_core::vllm::hash_block(
            c.algorithm,
            &mut scratch,
            &parent,
            block,
            std::iter::empty(),
            None,
        )
        .unwrap();
    }
    out
}

criterion_group!(benches, bench);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "ratio") {
        // `-- ratio "bs16 sha256_cbor"`: only the rows whose block size and
        // algorithm contain that text.
        ratios(
            args.get(i + 1)
                .map(String::as_str)
                .filter(|f| !f.starts_with('-')),
        );
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
