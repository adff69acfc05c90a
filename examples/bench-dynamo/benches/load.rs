//! Loading the side-by-side inventory (64 workers × 100 032 blocks, 16-block
//! store events naming their parent) into kvroute's `SharedIndex::store_chain`
//! and into Dynamo's `RadixTree::apply_event`, in alternating rounds on one
//! thread, both from events built before the clock starts: the ratio of each
//! round's rates (per loading-thread CPU time, `/proc/thread-self/schedstat`,
//! so other processes on the cores do not count) and their median. The
//! shared machine's load changes over seconds, so one pair of loads back to
//! back says more than two separate criterion runs.
//!
//! ```text
//! cd examples/bench-dynamo && cargo bench --bench load            # 5 rounds
//! cd examples/bench-dynamo && cargo bench --bench load -- 9        # 9 rounds
//! cd examples/bench-dynamo && cargo bench --bench load -- 3 kvroute  # kvroute only (profiling)
//! # smaller inventory (pairs = 64 × (32 + SEQUENCES × 512)):
//! BENCH_SEQUENCES=4 cargo bench --bench load
//! # lock shards per bank (default: IndexConfig::default().shards):
//! BENCH_SHARDS=16 cargo bench --bench load
//! # the default capacity bound per endpoint instead of none:
//! BENCH_BOUNDED=1 cargo bench --bench load
//! # blocks per store event (default 16):
//! BENCH_EVENT_BLOCKS=64 cargo bench --bench load
//! # the workers' events interleaved (one event of each worker in turn, as
//! # 64 live engines publish) instead of one worker's inventory after another:
//! BENCH_INTERLEAVE=1 cargo bench --bench load
//! # both on the gateway binary's allocator (mimalloc) instead of the system one:
//! cargo bench --features mimalloc --bench load
//! ```

use bench_dynamo::{
    allocator, apply_dynamo_interleaved, apply_dynamo_tree, apply_kvroute_direct,
    apply_kvroute_interleaved, chain_events, dynamo_events, Load, Workload,
};
use kvroute_ingest::IndexConfig;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(5);
    let only_kvroute = args.iter().any(|a| a == "kvroute");
    let mut w = Workload::FULL;
    if let Some(s) = std::env::var("BENCH_SEQUENCES")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        w.sequences = s;
    }
    if let Some(b) = std::env::var("BENCH_EVENT_BLOCKS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        w.event_blocks = b;
    }
    let config = IndexConfig {
        // BENCH_BOUNDED=1: the default bound (insertion rings kept).
        capacity_per_endpoint: if std::env::var_os("BENCH_BOUNDED").is_some() {
            IndexConfig::default().capacity_per_endpoint
        } else {
            usize::MAX
        },
        shards: std::env::var("BENCH_SHARDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(IndexConfig::default().shards),
    };
    let interleave = std::env::var_os("BENCH_INTERLEAVE").is_some();
    let kv_events: Vec<_> = (0..w.workers).map(|wk| chain_events(&w, wk)).collect();
    let dy_events = if only_kvroute {
        Vec::new()
    } else {
        dynamo_events(&w)
    };
    println!(
        "{} (worker, block) pairs per load, {rounds} rounds, {} allocator, {}",
        w.pairs(),
        allocator(),
        if interleave {
            "workers' events interleaved"
        } else {
            "one worker after another"
        }
    );
    let (mut kv_rates, mut dy_rates, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let line = |name: &str, l: &Load| {
        println!(
            "  {name:<18} {:>6.2} M blocks/s CPU, {:>6.2} wall",
            l.cpu_rate() / 1e6,
            l.rate() / 1e6
        );
    };
    for round in 0..rounds {
        println!("round {round}");
        let kv = || {
            let (index, load) = if interleave {
                apply_kvroute_interleaved(&w, config.clone(), &kv_events)
            } else {
                apply_kvroute_direct(&w, config.clone(), &kv_events)
            };
            line("kvroute store_chain", &load);
            drop(index);
            load
        };
        if only_kvroute {
            kv_rates.push(kv().cpu_rate());
            continue;
        }
        let dy = || {
            let (tree, load) = if interleave {
                apply_dynamo_interleaved(dy_events.clone())
            } else {
                apply_dynamo_tree(dy_events.clone())
            };
            line("dynamo RadixTree", &load);
            drop(tree);
            load
        };
        // Alternating order, so a drift of the machine's load favours neither.
        let (k, d) = if round % 2 == 0 {
            let k = kv();
            (k, dy())
        } else {
            let d = dy();
            (kv(), d)
        };
        kv_rates.push(k.cpu_rate());
        dy_rates.push(d.cpu_rate());
        ratios.push(k.cpu_rate() / d.cpu_rate());
        println!(
            "  ratio kvroute / dynamo {:.3}",
            k.cpu_rate() / d.cpu_rate()
        );
    }
    println!(
        "median: kvroute store_chain {:.2} M blocks/s CPU",
        median(&mut kv_rates) / 1e6
    );
    if !only_kvroute {
        println!(
            "median: dynamo RadixTree {:.2} M blocks/s CPU; kvroute / dynamo {:.3} (per round: {})",
            median(&mut dy_rates) / 1e6,
            median(&mut ratios.clone()),
            ratios
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}
