//! Measurements criterion cannot take: resident memory per (endpoint, key) pair
//! and the longest reader stall while an endpoint with 1 M keys is cleared.
//!
//! ```text
//! cargo run --release -p kvroute-ingest --example measure -- rss no_overlap
//! cargo run --release -p kvroute-ingest --example measure -- rss full_overlap
//! cargo run --release -p kvroute-ingest --example measure -- rss half_overlap
//! cargo run --release -p kvroute-ingest --example measure -- rss no_overlap 100
//! cargo run --release -p kvroute-ingest --example measure -- rss no_overlap 64 2097152
//! cargo run --release -p kvroute-ingest --example measure -- stall
//! cargo run --release -p kvroute-ingest --example measure -- stall 2097152
//! ```
//!
//! `rss <layout> [endpoints] [capacity]` stores 10 M (endpoint, key) pairs over
//! `endpoints` (64 by default) with an optional per-endpoint capacity bound (by
//! default none). `stall [capacity]` clears an endpoint holding 1 M keys while a
//! reader thread scores 512 keys in a loop, and prints the clear's duration and
//! the reader's longest score call during and outside the clear.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};

fn key(i: u64) -> BlockKey {
    BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5851_f42d_4c95_7f2d)
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn config(capacity: Option<&String>) -> IndexConfig {
    IndexConfig {
        capacity_per_endpoint: capacity.map_or(usize::MAX, |c| c.parse().unwrap()),
        ..IndexConfig::default()
    }
}

fn rss(layout: &str, endpoints: u64, config: IndexConfig) {
    const PAIRS: u64 = 10_000_000;
    let (eps, per) = (endpoints, PAIRS / endpoints);
    let stride = match layout {
        "no_overlap" => per,
        "half_overlap" => per / 2,
        "full_overlap" => 0,
        other => panic!("unknown layout {other}"),
    };
    let capacity = config.capacity_per_endpoint;
    let before = rss_kib();
    let index = SharedIndex::new(eps as usize, config);
    let mut chunk = Vec::with_capacity(4096);
    for e in 0..eps {
        let mut i = e * stride;
        while i < e * stride + per {
            chunk.clear();
            chunk.extend((i..(i + 4096).min(e * stride + per)).map(key));
            index
                .store(EndpointId(e as u32), Medium::Gpu, &chunk)
                .unwrap();
            i += 4096;
        }
    }
    let after = rss_kib();
    let pairs = eps * per;
    let distinct = if stride == 0 {
        per
    } else {
        stride * (eps - 1) + per
    };
    println!(
        "layout={layout} endpoints={eps} capacity={capacity} pairs={pairs} \
         distinct_keys={distinct} rss_delta={} MiB \
         bytes_per_pair={:.1} memory_bytes()={} MiB ({:.1} B/pair)",
        (after - before) / 1024,
        (after - before) as f64 * 1024.0 / pairs as f64,
        index.memory_bytes() / (1 << 20),
        index.memory_bytes() as f64 / pairs as f64,
    );
}

fn stall(config: IndexConfig) {
    const N: u64 = 1_000_000;
    let capacity = config.capacity_per_endpoint;
    let index = Arc::new(SharedIndex::new(64, config));
    let keys: Vec<BlockKey> = (0..N).map(key).collect();
    index.store(EndpointId(5), Medium::Gpu, &keys).unwrap();
    index
        .store(EndpointId(6), Medium::Gpu, &keys[..100_000])
        .unwrap();
    let prompt: Vec<BlockKey> = keys[..512].to_vec();
    let stop = Arc::new(AtomicBool::new(false));
    let phase = Arc::new(AtomicBool::new(false));
    let reader = {
        let (index, stop, phase, prompt) =
            (index.clone(), stop.clone(), phase.clone(), prompt.clone());
        std::thread::spawn(move || {
            let mut out = vec![Overlap::default(); 64];
            let (mut idle, mut during) = (Vec::with_capacity(1 << 20), Vec::with_capacity(1 << 20));
            while !stop.load(Ordering::Acquire) {
                let in_clear = phase.load(Ordering::Acquire);
                let t = Instant::now();
                index.score(&prompt, &mut out);
                let d = t.elapsed();
                if in_clear { &mut during } else { &mut idle }.push(d);
            }
            (idle, during)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    phase.store(true, Ordering::Release);
    let t = Instant::now();
    let stats = index.clear_endpoint(EndpointId(5)).unwrap();
    let clear = t.elapsed();
    phase.store(false, Ordering::Release);
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Release);
    let (mut idle, mut during) = reader.join().unwrap();
    println!(
        "capacity={capacity}: clear of {} keys took {clear:?}",
        stats.cleared
    );
    println!("  reader during the clear:  {}", summary(&mut during));
    println!("  reader outside the clear: {}", summary(&mut idle));
}

/// Count, median, p99 and max of score-call latencies. On a shared machine the
/// max includes the reader being descheduled; the clear's own stall shows as the
/// gap between the two phases' high percentiles.
fn summary(samples: &mut [Duration]) -> String {
    samples.sort_unstable();
    let at = |q: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    format!(
        "{} scores, p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}",
        samples.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("rss") => rss(
            args.get(2).map_or("no_overlap", String::as_str),
            args.get(3).map_or(64, |e| e.parse().unwrap()),
            config(args.get(4)),
        ),
        Some("stall") => stall(config(args.get(2))),
        _ => eprintln!(
            "usage: measure rss <no_overlap|half_overlap|full_overlap> [endpoints] [capacity] \
             | stall [capacity]"
        ),
    }
}
