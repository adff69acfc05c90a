//! Ingest and scoring benchmarks.
//!
//! * `apply`: block updates per second through `EndpointIngest::apply_batch`
//!   (stores of new 16-block chains plus removes of old ones, steady size).
//! * `score_512_keys_64x100k`: one prompt of 512 keys against 64 endpoints of
//!   100 K keys each, for a no-overlap and a half-overlap layout.
//! * `clear_1m`: clearing an endpoint that holds 1 M keys, without a capacity
//!   bound (bank scan) and with one (insertion ring).

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{
    BlockRemoved, BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig,
    InventoryView, Keying, KvEvent, Overlap, SharedIndex,
};

fn key(i: u64) -> BlockKey {
    // Engine keys are digests: spread the bits like one.
    BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d)
}

fn apply(c: &mut Criterion) {
    const EVENTS: u64 = 16;
    const BLOCKS: u64 = 16;
    const RESIDENT: u64 = 100_000;
    let index = SharedIndex::new(64, IndexConfig::default());
    let mut ingest = EndpointIngest::new(EndpointId(3), IngestConfig::default(), Keying::Engine);
    let mut next = 0u64;
    let mut seq = 0u64;
    let mut batch = move || {
        let mut events = Vec::new();
        for _ in 0..EVENTS {
            let keys: Vec<BlockKey> = (next..next + BLOCKS).map(key).collect();
            events.push(KvEvent::Stored(BlockStored {
                keys,
                block_size: 16,
                ..Default::default()
            }));
            if next >= RESIDENT {
                let old: Vec<BlockKey> = (next - RESIDENT..next - RESIDENT + BLOCKS)
                    .map(key)
                    .collect();
                events.push(KvEvent::Removed(BlockRemoved {
                    keys: old,
                    medium: Medium::Gpu,
                    group: 0,
                }));
            }
            next += BLOCKS;
        }
        seq += 1;
        EventBatch {
            seq,
            timestamp: 0.0,
            dp_rank: Some(0),
            events,
        }
    };
    // Reach the steady resident size first.
    for _ in 0..(RESIDENT / (EVENTS * BLOCKS)) {
        let b = batch();
        let _ = ingest.apply_batch(&b, &index);
    }
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(2 * EVENTS * BLOCKS));
    g.bench_function("store_and_remove_16x16_blocks", |b| {
        b.iter_batched(
            &mut batch,
            |batch| ingest.apply_batch(&batch, &index),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn filled(layout: &str) -> (SharedIndex, Vec<BlockKey>) {
    const EPS: u64 = 64;
    const PER: u64 = 100_000;
    let index = SharedIndex::new(EPS as usize, IndexConfig::default());
    // no_overlap: disjoint key ranges; half_overlap: endpoint e holds
    // [e*PER/2, e*PER/2 + PER), so neighbours share half their keys.
    let stride = if layout == "no_overlap" { PER } else { PER / 2 };
    for e in 0..EPS {
        let keys: Vec<BlockKey> = (e * stride..e * stride + PER).map(key).collect();
        index
            .store(EndpointId(e as u32), Medium::Gpu, &keys)
            .unwrap();
    }
    // A prompt whose first 300 blocks endpoint 7 holds, then 212 unknown blocks.
    let mut prompt: Vec<BlockKey> = (7 * stride..7 * stride + 300).map(key).collect();
    prompt.extend((0..212).map(|i| key(u64::MAX / 2 + i)));
    (index, prompt)
}

fn score(c: &mut Criterion) {
    let mut g = c.benchmark_group("score_512_keys_64x100k");
    for layout in ["no_overlap", "half_overlap"] {
        let (index, prompt) = filled(layout);
        let mut out = vec![Overlap::default(); 64];
        index.score(&prompt, &mut out);
        assert_eq!(out[7].prefix, 300);
        g.bench_function(layout, |b| {
            b.iter(|| {
                index.score(black_box(&prompt), &mut out);
                black_box(out[7].prefix)
            })
        });
    }
    g.finish();
}

fn clear(c: &mut Criterion) {
    let mut g = c.benchmark_group("clear_1m");
    g.sample_size(10);
    let keys: Vec<BlockKey> = (0..1_000_000).map(key).collect();
    for (name, capacity) in [
        ("one_endpoint_of_4", usize::MAX),
        ("one_endpoint_of_4_bounded", 1 << 21),
    ] {
        let config = IndexConfig {
            capacity_per_endpoint: capacity,
            ..IndexConfig::default()
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let index = SharedIndex::new(4, config.clone());
                    index.store(EndpointId(2), Medium::Gpu, &keys).unwrap();
                    let start = Instant::now();
                    index.clear_endpoint(EndpointId(2)).unwrap();
                    total += start.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, apply, score, clear);
criterion_main!(benches);
