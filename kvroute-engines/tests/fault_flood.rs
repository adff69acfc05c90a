//! Fault injection: a publisher floods random block keys (a
//! misbehaving engine, or one whose cache is far larger than the index is sized
//! for). The per-endpoint capacity bounds the inventory at every moment, every
//! eviction is counted, and the index's own memory figure stays at the size of a
//! full index instead of growing with the number of keys sent.
//!
//! Real peer: tests/python/kv_fault_publisher.py `flood_random` (pyzmq XPUB,
//! vLLM 0.33 batches of 64 random 64-bit keys).
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::cell::Cell;
use std::time::Duration;

use fault::{Rig, RigConfig, EP};
use interop_support::{free_port_pair, Peer};
use kvroute_core::{BlockKey, Medium};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};
use kvroute_ingest::{IndexConfig, SharedIndex};

const T: Duration = Duration::from_secs(15);
const CAPACITY: usize = 2048;
const BATCHES: u64 = 2000;
const KEYS_PER_BATCH: u64 = 64;

/// Memory figure of a capped index that went through one full turnover
/// (2 × capacity distinct keys stored directly): the steady state of a full index.
fn full_index_memory() -> usize {
    let index = SharedIndex::new(
        1,
        IndexConfig {
            capacity_per_endpoint: CAPACITY,
            ..IndexConfig::default()
        },
    );
    let keys: Vec<BlockKey> = (0..2 * CAPACITY as u64)
        .map(|i| BlockKey(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect();
    index.store(EP, Medium::Gpu, &keys).unwrap();
    assert_eq!(index.inventory(EP).total(), CAPACITY as u64);
    index.memory_bytes()
}

#[test]
fn random_key_flood_stays_within_capacity_and_counts_evictions() {
    let port = free_port_pair();
    let mut config = RigConfig::new(ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!(
        "tcp://127.0.0.1:{port}"
    ))));
    config.index = IndexConfig {
        capacity_per_endpoint: CAPACITY,
        ..IndexConfig::default()
    };
    let rig = Rig::start(config);
    let mut publisher = Peer::spawn(
        "kv_fault_publisher.py",
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
    );
    // Paced so that nothing is lost on the way: the eviction count is then exact.
    publisher.send_line(
        &format!(
            r#"[{{"op":"wait_subscriber"}},
            {{"op":"flood_random","count":{BATCHES},"keys":{KEYS_PER_BATCH},"rate":2000}},
            {{"op":"serve","ms":3000}}]"#
        )
        .replace('\n', " "),
    );
    let flooded = publisher.expect("FLOODED", T);
    let distinct: u64 = flooded
        .rsplit_once("distinct=")
        .and_then(|(_, n)| n.parse().ok())
        .expect("FLOODED line names the distinct keys");

    // Watch the bound while the flood is applied.
    let max_keys = Cell::new(0);
    let max_memory = Cell::new(0);
    rig.wait_for("every flooded batch", T, |r| {
        let inv = r.index.inventory(EP);
        assert!(
            inv.total() <= CAPACITY as u64,
            "inventory {} over capacity",
            inv.total()
        );
        max_keys.set(max_keys.get().max(inv.total()));
        max_memory.set(max_memory.get().max(r.index.memory_bytes()));
        r.metrics.snapshot().frames_live == BATCHES
    });
    let (max_keys, max_memory) = (
        max_keys.get(),
        max_memory.get().max(rig.index.memory_bytes()),
    );
    let reference = full_index_memory();
    let (m, sink) = rig.finish();
    let ingest = sink.inner.ingest().endpoint_ingest();
    let writes = ingest.counters().writes;
    let inv = sink.inner.ingest().index().inventory(EP);
    println!(
        "FAULT random-key flood: {BATCHES} batches, {distinct} distinct keys, capacity \
         {CAPACITY}: inventory {} (max seen {max_keys}), evictions {} (index) / {} (ingest), \
         index memory {max_memory} B vs full-index reference {reference} B, ingest memory {} B; \
         metrics {m:?}",
        inv.total(),
        inv.evictions,
        writes.evicted,
        ingest.memory_bytes()
    );
    assert_eq!((m.gaps, m.decode_errors, m.malformed_frames), (0, 0, 0));
    assert_eq!(
        distinct,
        BATCHES * KEYS_PER_BATCH,
        "random keys do not repeat"
    );
    assert_eq!(inv.total(), CAPACITY as u64);
    assert_eq!(writes.inserted, distinct);
    assert_eq!(inv.evictions, distinct - CAPACITY as u64);
    assert_eq!(writes.evicted, inv.evictions);
    // Under churn each shard's table keeps the size its largest count
    // needed (a table shrinks only below a quarter full), and with random
    // keys every shard's count walks around capacity / shards: the tables
    // settle one or two 1.5x growth steps above a freshly loaded index's
    // (2.00-2.01x measured). What must not happen is growth with the keys
    // sent (here 62x the capacity), which this bound still catches.
    assert!(
        max_memory * 2 <= 5 * reference,
        "index memory {max_memory} B grew past 2.5 x a full index ({reference} B)"
    );
}
