//! kvroute's scoring alone, robust to a noisy machine: the side-by-side
//! inventory loaded once (unbounded, through `EndpointIngest`, as
//! `side_by_side` loads the index it scores), then each prompt scored in
//! batches; the fastest batch's time per call is printed (interference only
//! ever adds time), with the median batch beside it. For before/after
//! comparisons of the index's lookup path without Dynamo or criterion.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench score
//! BENCH_SEQUENCES=20 cargo bench --bench score
//! BENCH_PROMPT=shared cargo bench --bench score   # one prompt (miss, shared, deep)
//! BENCH_KEYS=32 cargo bench --bench score          # each prompt's first 32 keys
//! ```

use std::hint::black_box;
use std::time::Instant;

use bench_dynamo::{allocator, load_kvroute, split, Workload};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap};

fn main() {
    let mut w = Workload::FULL;
    if let Some(s) = std::env::var("BENCH_SEQUENCES")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        w.sequences = s;
    }
    let (index, _) = load_kvroute(
        &w,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            ..IndexConfig::default()
        },
    );
    println!(
        "{} (worker, block) pairs, {} allocator; ns per call: fastest batch (median batch)",
        w.pairs(),
        allocator()
    );
    let only = std::env::var("BENCH_PROMPT").ok();
    let mut out = vec![Overlap::default(); index.endpoint_count()];
    for (name, prompt) in w.prompts() {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let (mut keys, _) = split(&prompt);
        // BENCH_KEYS=n: the prompt's first n keys only.
        if let Some(n) = std::env::var("BENCH_KEYS")
            .ok()
            .and_then(|n| n.parse().ok())
        {
            keys.truncate(n);
        }
        for full in [false, true] {
            let calls = if full { 20 } else { 200 };
            let mut per_batch: Vec<f64> = (0..300)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..calls {
                        if full {
                            index.score(black_box(&keys), &mut out);
                        } else {
                            index.score_prefix(black_box(&keys), &mut out);
                        }
                        black_box(out[7].prefix);
                    }
                    t.elapsed().as_nanos() as f64 / f64::from(calls)
                })
                .collect();
            per_batch.sort_by(f64::total_cmp);
            println!(
                "  {:<11} {name:<7} {:>9.1} ({:>9.1})",
                if full { "full_walk" } else { "score_prefix" },
                per_batch[0],
                per_batch[per_batch.len() / 2]
            );
        }
    }
}
