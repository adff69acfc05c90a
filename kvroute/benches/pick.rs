//! What one decision costs through the runtime every host runs
//! ([`KvRouter::pick_keys`]: the rule over the router's live views — load
//! tracker, engine reports, breakers, outlier detector, inventory health —
//! and the charge), beside the same rule over plain tables
//! (`kvroute-select`'s `decide/scale` bench). A 512-block prompt over 64,
//! 256 and 1 024 endpoints; every endpoint holds the prompt's first 32
//! blocks (a shared system prompt) and 2 000 other blocks, endpoint 0 the
//! whole prompt. `reported`: every engine's own load report is fresh too
//! (running, waiting, prefill counters: what the engine load poller
//! records), on a clock the bench holds still so they stay fresh.
//!
//! `cargo bench -p kvroute --bench pick`

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kvroute::engine::{Engine, Follow};
use kvroute::{Backend, IndexConfig, KvRouter, ManualClock};
use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{BlockStored, EventBatch, KvEvent, SeqWindowConfig};
use kvroute_select::{EngineReport, PrefillProgress};

const BLOCKS: usize = 512;
const BLOCK: u32 = 16;

/// Endpoints whose events the bench applies itself.
#[derive(Debug)]
struct HostEngine;

impl Engine for HostEngine {
    fn name(&self) -> &str {
        "bench"
    }

    fn events_carry_tokens(&self) -> bool {
        false
    }

    fn window(&self, _follow: &Follow) -> SeqWindowConfig {
        SeqWindowConfig::default()
    }
}

fn stored(keys: &[BlockKey], parent: Option<BlockKey>) -> KvEvent {
    KvEvent::Stored(BlockStored {
        keys: keys.to_vec(),
        parent,
        block_size: BLOCK,
        ..BlockStored::default()
    })
}

fn router(n: usize, keys: &[BlockKey], reported: bool) -> KvRouter {
    let engine: Arc<dyn Engine> = Arc::new(HostEngine);
    let mut b = KvRouter::builder_for_keys("bench/bs16", BLOCK)
        .max_endpoints(n)
        .index(IndexConfig::default())
        .no_engine_load()
        .no_health_probes();
    if reported {
        b = b.clock(Arc::new(ManualClock::default()));
    }
    for e in 0..n {
        b = b.endpoint(
            Backend::new(
                Arc::clone(&engine),
                format!("http://10.{}.{}.1:8000", e / 256, e % 256),
            )
            .host_events(),
        );
    }
    let router = b.build().expect("router");
    for e in 0..n {
        let held = if e == 0 { keys.len() } else { 32 };
        let other: Vec<BlockKey> = (0..2000u64).map(|j| BlockKey(j << 20 | e as u64)).collect();
        let batch = EventBatch {
            seq: 0,
            timestamp: 0.0,
            dp_rank: None,
            events: vec![stored(&keys[..held], None), stored(&other, None)],
        };
        assert!(router.ingest_at(EndpointId(e as u32), &batch), "ingest {e}");
        if reported {
            let report = EngineReport {
                running: (e % 3) as u32,
                waiting: 0,
                kv_usage: Some(0.25),
                prefill: Some(PrefillProgress {
                    tokens: 1_000_000 + e as u64,
                    seconds: 100.0,
                }),
                kv_capacity_blocks: Some(32_768),
            };
            router.report_engine_load_at(EndpointId(e as u32), report);
        }
    }
    router
}

fn bench(c: &mut Criterion) {
    let keys: Vec<BlockKey> = (0..BLOCKS)
        .map(|i| BlockKey(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)))
        .collect();
    for (n, reported) in [64usize, 256, 1024]
        .into_iter()
        .flat_map(|n| [(n, false), (n, true)])
    {
        let router = router(n, &keys, reported);
        let first = router
            .pick_keys(&keys, BLOCKS as u32 * BLOCK)
            .expect("pick");
        assert_eq!(
            first.endpoint_id(),
            Some(EndpointId(0)),
            "the prompt's home"
        );
        drop(first);
        c.bench_function(
            &format!(
                "pick_keys/shared_root{}/512_blocks/{n}_endpoints",
                if reported { "_reported" } else { "" }
            ),
            |b| b.iter(|| black_box(router.pick_keys(black_box(&keys), BLOCKS as u32 * BLOCK))),
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
