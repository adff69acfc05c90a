//! Blocks/s of every contract at block sizes 16 and 64, beside a naive reference
//! (ciborium + sha2, allocating per block) and raw SHA-256 / XXH3-128 of the
//! same serialised bytes.
//!
//! Run: `cargo bench -p kvroute-core --bench hashing -- --warm-up-time 1 --measurement-time 3`

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
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
        let root = kvroute_core::vllm::none_hash(kvroute_core::VllmAlgorithm::Sha256Cbor, "0");
        group.bench_function(BenchmarkId::from_parameter("naive_ciborium_sha2"), |b| {
            b.iter(|| black_box(naive_sha256_cbor(black_box(&toks), bs, root.as_bytes())))
        });

        // Raw digests of the exact bytes sha256_cbor / xxhash_cbor hash.
        for (name, spec, xxh) in [
            (
                "raw_sha256_same_bytes",
                format!("vllm@0.33.0:sha256_cbor:block={bs}:seed=0"),
                false,
            ),
            (
                "raw_xxh3_128_same_bytes",
                format!("vllm@0.33.0:xxhash_cbor:block={bs}:seed=0"),
                true,
            ),
        ] {
            let hasher = spec.parse::<HashContract>().unwrap().hasher().unwrap();
            let inputs = serialised_inputs(&hasher, &toks);
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    let mut acc = 0u8;
                    for input in &inputs {
                        if xxh {
                            acc ^= xxhash_rust::xxh3::xxh3_128(black_box(input)) as u8;
                        } else {
                            acc ^= Sha256::digest(black_box(input))[31];
                        }
                    }
                    black_box(acc)
                })
            });
        }
        group.finish();
    }
}

/// The serialised block inputs of a vLLM CBOR chain (via the public golden path).
fn serialised_inputs(hasher: &kvroute_core::BlockHasher, toks: &[u32]) -> Vec<Vec<u8>> {
    let HashContract::Vllm(c) = hasher.contract() else {
        unreachable!()
    };
    let bs = hasher.block_size();
    let mut parent = hasher.root(&RequestExtras::NONE).unwrap();
    let mut out = Vec::new();
    let mut scratch = Vec::new();
    for block in toks.chunks_exact(bs) {
        let d = kvroute_core::vllm::hash_block(
            c.algorithm,
            &mut scratch,
            &parent,
            block,
            std::iter::empty(),
            None,
        )
        .unwrap();
        out.push(scratch.clone());
        parent = d;
    }
    out
}

criterion_group!(benches, bench);
criterion_main!(benches);
