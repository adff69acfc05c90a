//! kvroute's inventory index beside NVIDIA Dynamo's (`dynamo-kv-router`
//! 1.6.1), one process, one run: the same inventory loaded into each (load
//! rate and resident bytes per (worker, block) pair printed), then the same
//! three 512-block prompts scored by each, after asserting that every
//! structure gives every worker the same prefix.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench side_by_side
//! # smaller inventory (pairs = 64 × (32 + SEQUENCES × 512)):
//! BENCH_SEQUENCES=20 cargo bench --bench side_by_side
//! # on the gateway binary's allocator (mimalloc):
//! cargo bench --features mimalloc --bench side_by_side
//! ```

use std::hint::black_box;

use bench_dynamo::{
    allocator, dense, kvroute_full_prefix, kvroute_prefix, load_dynamo_concurrent,
    load_dynamo_tree, load_kvroute, load_kvroute_direct, split, Load, Workload,
};
use criterion::Criterion;
use dynamo_kv_router::SyncIndexer;
use kvroute_ingest::{IndexConfig, InventoryView, Overlap};

fn report(name: &str, load: &Load, pairs: u64, extra: &str) {
    let cpu = if load.cpu.is_zero() {
        "     -".to_owned()
    } else {
        format!("{:>6.2}", load.cpu_rate() / 1e6)
    };
    println!(
        "load {name:<30} {:>6.2} M blocks/s (CPU time: {cpu})  ({} blocks in {:.2} s)  rss {:>5.1} B/pair{extra}",
        load.rate() / 1e6,
        load.blocks,
        load.apply.as_secs_f64(),
        load.rss_growth as f64 / pairs as f64,
    );
}

fn unbounded_config_for(shards: usize) -> IndexConfig {
    IndexConfig {
        capacity_per_endpoint: usize::MAX,
        shards,
    }
}

fn main() {
    let mut w = Workload::FULL;
    if let Some(s) = std::env::var("BENCH_SEQUENCES")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        w.sequences = s;
    }
    let shards = std::env::var("BENCH_SHARDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IndexConfig::default().shards);
    let pairs = w.pairs();
    println!(
        "inventory: {} workers, {pairs} (worker, block) pairs, {} allocator",
        w.workers,
        allocator()
    );

    // Loaded one after the other, each measured on its own resident growth.
    let (bounded, kv_load) = load_kvroute(
        &w,
        IndexConfig {
            shards,
            ..IndexConfig::default()
        },
    );
    report(
        "kvroute (default bound)",
        &kv_load,
        pairs,
        &format!(
            "  memory_bytes {:.1} B/pair",
            bounded.memory_bytes() as f64 / pairs as f64
        ),
    );
    let unbounded_config = unbounded_config_for(shards);
    let (index, kv_unbounded) = load_kvroute(&w, unbounded_config);
    report(
        "kvroute (unbounded)",
        &kv_unbounded,
        pairs,
        &format!(
            "  memory_bytes {:.1} B/pair",
            index.memory_bytes() as f64 / pairs as f64
        ),
    );
    drop(bounded);
    let (direct, kv_direct) = load_kvroute_direct(&w, unbounded_config_for(shards));
    report("kvroute store() (unbounded)", &kv_direct, pairs, "");
    drop(direct);
    let (tree, dy_load) = load_dynamo_tree(&w);
    report("dynamo RadixTree", &dy_load, pairs, "");
    let (concurrent, cc_load) = load_dynamo_concurrent(&w);
    report("dynamo ConcurrentRadixTree", &cc_load, pairs, "");

    let prompts = w.prompts();
    for (name, prompt) in &prompts {
        let (keys, locals) = split(prompt);
        let early = kvroute_prefix(&index, &keys);
        let full = kvroute_full_prefix(&index, &keys);
        let dy = dense(&tree.find_matches(locals.clone(), false), w.workers);
        let cc = dense(&concurrent.find_matches(&locals, false), w.workers);
        assert_eq!(early, full, "{name}: early stop vs full walk");
        assert_eq!(early, dy, "{name}: kvroute vs dynamo RadixTree");
        assert_eq!(early, cc, "{name}: kvroute vs dynamo concurrent tree");
        let best = early.iter().max().copied().unwrap_or(0);
        let matched = early.iter().filter(|p| **p > 0).count();
        println!("prompt {name:<7}: longest prefix {best} blocks, {matched} workers match; all four agree");
    }

    let mut c = Criterion::default().configure_from_args();
    let mut g = c.benchmark_group("score_512_blocks_64_workers");
    let mut out = vec![Overlap::default(); index.endpoint_count()];
    for (name, prompt) in &prompts {
        let (keys, locals) = split(prompt);
        g.bench_function(format!("kvroute_score_prefix/{name}"), |b| {
            b.iter(|| {
                index.score_prefix(black_box(&keys), &mut out);
                black_box(out[7].prefix)
            })
        });
        g.bench_function(format!("kvroute_full_walk/{name}"), |b| {
            b.iter(|| {
                index.score(black_box(&keys), &mut out);
                black_box(out[7].prefix)
            })
        });
        // Its API takes the prompt by value: the copy is part of a call.
        g.bench_function(format!("dynamo_radix_tree/{name}"), |b| {
            b.iter(|| black_box(tree.find_matches(black_box(locals.clone()), false)))
        });
        g.bench_function(format!("dynamo_concurrent_tree/{name}"), |b| {
            b.iter(|| black_box(concurrent.find_matches(black_box(&locals), false)))
        });
    }
    g.finish();
    c.final_summary();
}
