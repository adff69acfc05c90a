//! Readers scoring while writers store and clear: per-endpoint isolation holds
//! under concurrency and readers always see a consistent inventory for endpoints
//! nobody writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};

#[test]
fn readers_see_stable_endpoints_while_another_is_cleared_and_refilled() {
    let index = Arc::new(SharedIndex::new(70, IndexConfig::default()));
    let prompt: Vec<BlockKey> = (0..256).map(BlockKey).collect();
    // Endpoint 1 holds the first half for the whole test.
    index
        .store(EndpointId(1), Medium::Gpu, &prompt[..128])
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, stop, prompt) = (index.clone(), stop.clone(), prompt.clone());
            std::thread::spawn(move || {
                let mut out = vec![Overlap::default(); index.endpoint_count()];
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds == 0 {
                    index.score(&prompt, &mut out);
                    assert_eq!((out[1].blocks, out[1].prefix), (128, 128));
                    assert!(out[0].blocks <= 256 && out[0].prefix <= out[0].blocks);
                    assert!(out[66].blocks <= 256);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    for _ in 0..50 {
        index.store(EndpointId(0), Medium::Gpu, &prompt).unwrap();
        index.store(EndpointId(66), Medium::Cpu, &prompt).unwrap();
        index.clear_endpoint(EndpointId(0)).unwrap();
        index.clear_endpoint(EndpointId(66)).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    assert_eq!(index.inventory(EndpointId(0)).total(), 0);
    assert_eq!(index.inventory(EndpointId(1)).total(), 128);
}
