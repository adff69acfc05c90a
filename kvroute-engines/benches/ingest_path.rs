//! Decode + apply throughput of realistic vLLM batches through the real ingest path.
//!
//! Each batch mirrors a vLLM 0.33 publisher step during prefill (the layout of
//! `benches/decode.rs`, ≈ 2.7 KB): a `BlockRemoved` of 3 blocks stored four steps
//! earlier, then two `BlockStored` (a 20-block prompt and a 12-block continuation,
//! 16-token blocks, Qwen-sized token ids). That is 35 block updates per batch.
//!
//! One iteration feeds a run of `RUN` such batches, as ZeroMQ frames with
//! consecutive seqs, into a fresh `DecodingSink<IndexIngest>` writing a fresh
//! `SharedIndex` — exactly what the ZeroMQ subscriber calls per frame — so the index
//! grows from empty to ~29 K keys inside the measurement (allocation included). The
//! `apply_only` group feeds the same batches pre-decoded to `IndexIngest` to show
//! the decoder's share.
//!
//! ```text
//! cargo bench -p kvroute-engines --bench ingest_path -- --warm-up-time 1 --measurement-time 3
//! ```
//! Throughput is reported in batches; block updates/s = batches/s × 35.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute_core::EndpointId;
use kvroute_engines::engine::VLLM;
use kvroute_engines::events::{vllm, DecodeStats};
use kvroute_engines::transport::{
    DecodingSink, Frame, FrameSink, FrameSource, IndexIngest, SeqIngest,
};
use kvroute_ingest::{EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, SharedIndex};
use rmpv::Value as M;

/// Batches per iteration.
const RUN: usize = 1024;
/// Blocks each batch removes, stores.
const REMOVED: usize = 3;
const STORED: [usize; 2] = [20, 12];

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn stored(rng: &mut XorShift, keys: &[u64], parent: Option<u64>) -> M {
    let s = M::from;
    let tokens = (0..keys.len() * 16)
        .map(|_| M::from(rng.next() % 151_936))
        .collect();
    M::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            M::Array(keys.iter().map(|&k| M::from(k)).collect()),
        ),
        (s("parent_block_hash"), parent.map_or(M::Nil, M::from)),
        (s("token_ids"), M::Array(tokens)),
        (s("block_size"), M::from(16)),
        (s("lora_id"), M::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), M::Nil),
        (s("extra_keys"), M::Array(vec![M::Nil; keys.len()])),
        (s("group_idx"), M::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

/// `RUN` vLLM 0.33 payloads; batch `i` removes the last 3 blocks batch `i - 4` stored.
fn vllm_run() -> Vec<Vec<u8>> {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut history: Vec<Vec<u64>> = Vec::new();
    (0..RUN)
        .map(|i| {
            let first: Vec<u64> = (0..STORED[0]).map(|_| rng.next()).collect();
            let second: Vec<u64> = (0..STORED[1]).map(|_| rng.next()).collect();
            let removed: Vec<u64> = i.checked_sub(4).and_then(|j| history.get(j)).map_or_else(
                || (0..REMOVED).map(|_| rng.next()).collect(),
                |keys: &Vec<u64>| keys[keys.len() - REMOVED..].to_vec(),
            );
            let events = vec![
                M::Map(vec![
                    (M::from("type"), M::from("BlockRemoved")),
                    (
                        M::from("block_hashes"),
                        M::Array(removed.iter().map(|&k| M::from(k)).collect()),
                    ),
                    (M::from("medium"), M::from("GPU")),
                    (M::from("group_idx"), M::from(0)),
                ]),
                stored(&mut rng, &first, None),
                stored(&mut rng, &second, first.last().copied()),
            ];
            history.push(first.iter().chain(&second).copied().collect());
            let batch = M::Array(vec![
                M::F64(1_767_225_600.25 + i as f64 * 0.01),
                M::Array(events),
                M::from(0),
            ]);
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &batch).unwrap();
            out
        })
        .collect()
}

fn fresh_ingest() -> IndexIngest {
    let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
    let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
    IndexIngest::new(ingest, index, Some(0), false)
}

fn bench(c: &mut Criterion) {
    let payloads = vllm_run();
    let mean_len = payloads.iter().map(Vec::len).sum::<usize>() / payloads.len();
    let updates_per_batch = REMOVED + STORED.iter().sum::<usize>();

    // Sanity (outside the timing): the run applies every event and keeps the
    // inventory that stores minus removes predict.
    let mut sink = DecodingSink::for_engine(&VLLM, fresh_ingest()).unwrap();
    for (seq, p) in payloads.iter().enumerate() {
        let r = sink.on_frame(Frame {
            topic: b"",
            seq: seq as u64,
            payload: p,
            source: FrameSource::Live,
        });
        assert_eq!((r.events_applied, r.decode_error), (3, false));
    }
    let keys = sink.ingest().index().inventory(EndpointId(0)).total();
    let stored: usize = RUN * STORED.iter().sum::<usize>();
    assert_eq!(keys as usize, stored - (RUN - 4) * REMOVED);

    let mut g = c.benchmark_group(format!(
        "ingest_path/vllm_{mean_len}B_batches_{updates_per_batch}_block_updates"
    ));
    g.throughput(Throughput::Elements(RUN as u64));
    g.bench_function(format!("decode_apply_run_of_{RUN}"), |b| {
        b.iter_batched(
            || DecodingSink::for_engine(&VLLM, fresh_ingest()).unwrap(),
            |mut sink| {
                for (seq, p) in payloads.iter().enumerate() {
                    black_box(sink.on_frame(Frame {
                        topic: b"",
                        seq: seq as u64,
                        payload: black_box(p),
                        source: FrameSource::Live,
                    }));
                }
                sink
            },
            BatchSize::PerIteration,
        )
    });

    let mut stats = DecodeStats::default();
    let decoded: Vec<EventBatch> = payloads
        .iter()
        .enumerate()
        .map(|(seq, p)| vllm::decode(p, seq as u64, &mut stats).unwrap())
        .collect();
    g.bench_function(format!("apply_only_run_of_{RUN}"), |b| {
        b.iter_batched(
            fresh_ingest,
            |mut ingest| {
                for batch in &decoded {
                    black_box(ingest.ingest(black_box(batch), FrameSource::Live));
                }
                ingest
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
