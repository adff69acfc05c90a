//! Throughput of the shared worker model, the simulator's inner loop: requests
//! with shared prefixes spread over a fleet of workers, events drained.

use kvroute_engine_model as engine_model;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use engine_model::{RequestSpec, Worker, WorkerConfig};
use kvroute_core::BlockKey;

const WORKERS: usize = 256;
const REQUESTS: usize = 20_000;
const BLOCKS: usize = 64; // 1024-token prompts at block size 16

/// Prompts: one of 512 "system prompts" (first 32 blocks) + a unique tail.
fn chains() -> Vec<Vec<BlockKey>> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..REQUESTS)
        .map(|_| {
            let family = next() % 512;
            let tail = next();
            (0..BLOCKS)
                .map(|i| {
                    let seed = if i < 32 { family } else { tail };
                    BlockKey(seed.wrapping_mul(0x100_0000_01b3).wrapping_add(i as u64))
                })
                .collect()
        })
        .collect()
}

fn fleet(c: &mut Criterion) {
    let chains = chains();
    let mut group = c.benchmark_group("engine_model");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    group.sample_size(10);
    group.bench_function("fleet_256_workers_20k_requests", |b| {
        b.iter_batched(
            || {
                (0..WORKERS)
                    .map(|_| {
                        Worker::<u32>::new(WorkerConfig {
                            capacity_blocks: 2048,
                            max_running: 32,
                            ..WorkerConfig::default()
                        })
                    })
                    .collect::<Vec<_>>()
            },
            |mut workers| {
                let mut events = Vec::new();
                let mut hits = 0u64;
                for (i, keys) in chains.iter().enumerate() {
                    let now = i as u64 * 500;
                    let w = &mut workers[(keys[0].0 as usize) % WORKERS];
                    w.advance(now);
                    let spec = RequestSpec {
                        keys,
                        tokens: &[],
                        prompt_tokens: (BLOCKS * 16) as u32,
                        output_tokens: 128,
                        kv_transferred: false,
                        cache_salt: None,
                    };
                    w.submit(now, i as u32, &spec).unwrap();
                    hits += w
                        .drain_admissions()
                        .map(|a| u64::from(a.cached_blocks))
                        .sum::<u64>();
                    w.take_events_into(&mut events);
                    events.clear();
                }
                hits
            },
            BatchSize::LargeInput,
        );
    });
    group.finish();
}

criterion_group!(benches, fleet);
criterion_main!(benches);
