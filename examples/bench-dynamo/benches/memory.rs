//! kvroute's index bytes per (worker, block) pair over a sweep of inventory
//! sizes: the side-by-side inventory (64 workers, 32 shared blocks, then
//! `sequences` conversations of 512 blocks each) loaded through each
//! endpoint's `EndpointIngest` as `side_by_side` loads it, for each size of
//! the sweep, with the default capacity bound (insertion rings kept) and
//! unbounded. `SharedIndex::memory_bytes` per pair is the figure the
//! benchmarks reference gives as bytes per (endpoint, block) (resident-set growth says
//! little here: from the second load on, the allocator reuses the memory
//! the previous one freed). No Dynamo structure is built.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench memory
//! # other sizes (conversations per worker):
//! BENCH_SWEEP=30,70,195 cargo bench --bench memory
//! ```

use bench_dynamo::{allocator, load_kvroute, Workload};
use kvroute_ingest::IndexConfig;

fn main() {
    let sweep: Vec<usize> = std::env::var("BENCH_SWEEP")
        .ok()
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![30, 70, 90, 110, 130, 150, 170, 195]);
    println!(
        "memory_bytes per (worker, block) pair, {} allocator: conversations per worker \
         (pairs): default bound, unbounded",
        allocator()
    );
    let mut worst: f64 = 0.0;
    for sequences in sweep {
        let w = Workload {
            sequences,
            ..Workload::FULL
        };
        let pairs = w.pairs() as f64;
        let (bounded, _) = load_kvroute(&w, IndexConfig::default());
        let b = bounded.memory_bytes() as f64 / pairs;
        drop(bounded);
        let (unbounded, _) = load_kvroute(
            &w,
            IndexConfig {
                capacity_per_endpoint: usize::MAX,
                ..IndexConfig::default()
            },
        );
        let u = unbounded.memory_bytes() as f64 / pairs;
        drop(unbounded);
        worst = worst.max(b);
        println!(
            "{sequences:>4} ({:>8} pairs): {b:>5.1}  {u:>5.1}",
            w.pairs()
        );
    }
    println!("worst default-bound figure: {worst:.1} B/pair");
}
