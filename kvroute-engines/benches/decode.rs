//! Decode throughput of realistic KV-event payloads.
//!
//! The vLLM batch mirrors a 0.33 publisher step during prefill: two `BlockStored`
//! events (a 20-block and a 12-block prompt, 16-token blocks, Qwen-sized token ids)
//! plus an eviction `BlockRemoved`, ≈ 2.7 KB on the wire.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_engines::events::trtllm::TrtllmDecoder;
use kvroute_engines::events::{sglang, vllm, DecodeStats};
use kvroute_ingest::EventBatch;
use rmpv::Value as M;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn stored(rng: &mut XorShift, blocks: usize, parent: Option<u64>) -> M {
    let s = M::from;
    let hashes = (0..blocks).map(|_| M::from(rng.next())).collect();
    let tokens = (0..blocks * 16)
        .map(|_| M::from(rng.next() % 151_936))
        .collect();
    M::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), M::Array(hashes)),
        (s("parent_block_hash"), parent.map_or(M::Nil, M::from)),
        (s("token_ids"), M::Array(tokens)),
        (s("block_size"), M::from(16)),
        (s("lora_id"), M::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), M::Nil),
        (s("extra_keys"), M::Array(vec![M::Nil; blocks])),
        (s("group_idx"), M::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

fn vllm_batch() -> Vec<u8> {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let removed = M::Map(vec![
        (M::from("type"), M::from("BlockRemoved")),
        (
            M::from("block_hashes"),
            M::Array((0..3).map(|_| M::from(rng.next())).collect()),
        ),
        (M::from("medium"), M::from("GPU")),
        (M::from("group_idx"), M::from(0)),
    ]);
    let parent = rng.next();
    let batch = M::Array(vec![
        M::F64(1_767_225_600.25),
        M::Array(vec![
            removed,
            stored(&mut rng, 20, None),
            stored(&mut rng, 12, Some(parent)),
        ]),
        M::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn golden(path: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden")
            .join(path),
    )
    .unwrap()
}

fn bench(c: &mut Criterion) {
    let payload = vllm_batch();
    let mut g = c.benchmark_group("vllm");
    g.throughput(Throughput::Bytes(payload.len() as u64));
    let mut stats = DecodeStats::default();
    let mut out = EventBatch::default();
    g.bench_function(format!("decode_into_{}B_batch", payload.len()), |b| {
        b.iter(|| {
            vllm::decode_into(black_box(&payload), 1, &mut out, &mut stats).unwrap();
            black_box(out.events.len())
        })
    });
    g.bench_function(format!("decode_fresh_{}B_batch", payload.len()), |b| {
        b.iter(|| black_box(vllm::decode(black_box(&payload), 1, &mut stats).unwrap()))
    });
    g.finish();

    let sg = golden("sglang-events/v0.5.23/stream/03_two_stores_one_batch.msgpack");
    let mut g = c.benchmark_group("sglang");
    g.throughput(Throughput::Bytes(sg.len() as u64));
    g.bench_function(format!("decode_into_{}B_batch", sg.len()), |b| {
        b.iter(|| {
            sglang::decode_into(black_box(&sg), 1, &mut out, &mut stats).unwrap();
            black_box(out.events.len())
        })
    });
    g.finish();

    let drain = golden("trtllm-events/classic/02_context_blocks_stored.json");
    let mut g = c.benchmark_group("trtllm");
    g.throughput(Throughput::Bytes(drain.len() as u64));
    g.bench_function(format!("decode_drain_{}B", drain.len()), |b| {
        let mut dec = TrtllmDecoder::new(32);
        b.iter(|| black_box(dec.decode_drain(black_box(&drain), &mut stats).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
