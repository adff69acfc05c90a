//! Readers scoring while writers store and clear: per-endpoint isolation holds
//! under concurrency and readers always see a consistent inventory for endpoints
//! nobody writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex, UNIFORM_RUN};

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

/// Writers of three banks storing and removing a shared root at once (each
/// key's whole-bank transitions in different banks meet in one table) while
/// readers walk: endpoints nobody writes always read the whole root, and
/// once the writers stop every endpoint reads exactly what it holds.
#[test]
fn whole_bank_keys_stay_exact_under_concurrent_writers() {
    let n = 192u32;
    let index = Arc::new(SharedIndex::new(n as usize, IndexConfig::default()));
    let root: Vec<BlockKey> = (0..16).map(|k| BlockKey(k * 0x9e37_79b9 + 1)).collect();
    for e in 0..n {
        index
            .store_chain(EndpointId(e), Medium::Gpu, None, &root)
            .unwrap();
    }
    // Endpoints 0–9 of each bank churn; the others keep the root.
    let churn = |e: u32| e % 64 < 10;
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, stop, root) = (index.clone(), stop.clone(), root.clone());
            std::thread::spawn(move || {
                let mut out = vec![Overlap::default(); n as usize];
                let mut uniform = [false; 3];
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds == 0 {
                    index.score_prefix_uniform(&root, &mut out, &mut uniform);
                    for e in (0..n).filter(|e| !churn(*e)) {
                        assert_eq!(out[e as usize].prefix, 16, "endpoint {e}");
                    }
                    // A bank marked alike is alike, clears in flight or not.
                    for (b, run) in out.chunks(UNIFORM_RUN).enumerate() {
                        if uniform[b] {
                            assert!(run.iter().all(|o| *o == run[0]), "bank {b}");
                        }
                    }
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let writers: Vec<_> = (0..3u32)
        .map(|bank| {
            let (index, root) = (index.clone(), root.clone());
            std::thread::spawn(move || {
                for round in 0..300u32 {
                    let e = EndpointId(bank * 64 + round % 10);
                    let from = (round % 16) as usize;
                    index.remove(e, Medium::Gpu, &root[from..]).unwrap();
                    if round % 7 == 0 {
                        index.clear_endpoint(e).unwrap();
                    }
                    index.store(e, Medium::Gpu, &root[from..]).unwrap();
                    if round % 7 == 0 {
                        index.store(e, Medium::Gpu, &root[..from]).unwrap();
                    }
                }
                // Then one endpoint of the bank keeps blocks 0..3 only.
                let e = EndpointId(bank * 64 + 3);
                index.remove(e, Medium::Gpu, &root[3..]).unwrap();
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    let mut out = vec![Overlap::default(); n as usize];
    index.score_prefix(&root, &mut out);
    for e in 0..n {
        let want = if e % 64 == 3 { 3 } else { 16 };
        assert_eq!(out[e as usize].prefix, want, "endpoint {e}");
    }
}
