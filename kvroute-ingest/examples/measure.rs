//! Measurements criterion cannot take: resident memory per (endpoint, key) pair
//! and the longest reader stall while an endpoint with 1 M keys is cleared.
//!
//! ```text
//! cargo run --release -p kvroute-ingest --example measure -- rss no_overlap
//! cargo run --release -p kvroute-ingest --example measure -- rss full_overlap
//! cargo run --release -p kvroute-ingest --example measure -- rss half_overlap
//! cargo run --release -p kvroute-ingest --example measure -- stall
//! ```

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

fn rss(layout: &str) {
    const EPS: u64 = 64;
    const PER: u64 = 156_250; // 64 × 156 250 = 10 M pairs
    let stride = match layout {
        "no_overlap" => PER,
        "half_overlap" => PER / 2,
        "full_overlap" => 0,
        other => panic!("unknown layout {other}"),
    };
    let config = IndexConfig::default();
    let before = rss_kib();
    let index = SharedIndex::new(EPS as usize, config);
    let mut chunk = Vec::with_capacity(4096);
    for e in 0..EPS {
        let mut i = e * stride;
        while i < e * stride + PER {
            chunk.clear();
            chunk.extend((i..(i + 4096).min(e * stride + PER)).map(key));
            index
                .store(EndpointId(e as u32), Medium::Gpu, &chunk)
                .unwrap();
            i += 4096;
        }
    }
    let after = rss_kib();
    let pairs = EPS * PER;
    let distinct = if stride == 0 {
        PER
    } else {
        stride * (EPS - 1) + PER
    };
    println!(
        "layout={layout} pairs={pairs} distinct_keys={distinct} rss_delta={} MiB \
         bytes_per_pair={:.1} memory_bytes()={} MiB ({:.1} B/pair)",
        (after - before) / 1024,
        (after - before) as f64 * 1024.0 / pairs as f64,
        index.memory_bytes() / (1 << 20),
        index.memory_bytes() as f64 / pairs as f64,
    );
}

fn stall() {
    const N: u64 = 1_000_000;
    let index = Arc::new(SharedIndex::new(64, IndexConfig::default()));
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
            let (mut worst_idle, mut worst_clear, mut n_clear) =
                (Duration::ZERO, Duration::ZERO, 0u64);
            while !stop.load(Ordering::Acquire) {
                let during = phase.load(Ordering::Acquire);
                let t = Instant::now();
                index.score(&prompt, &mut out);
                let d = t.elapsed();
                if during {
                    worst_clear = worst_clear.max(d);
                    n_clear += 1;
                } else {
                    worst_idle = worst_idle.max(d);
                }
            }
            (worst_idle, worst_clear, n_clear)
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
    let (idle, during, n) = reader.join().unwrap();
    println!(
        "clear of {} keys took {clear:?}; reader: {n} scores (512 keys) during the clear, \
         longest {during:?}; longest outside the clear {idle:?}",
        stats.cleared
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("rss") => rss(args.get(2).map_or("no_overlap", String::as_str)),
        Some("stall") => stall(),
        _ => eprintln!("usage: measure rss <no_overlap|half_overlap|full_overlap> | stall"),
    }
}
