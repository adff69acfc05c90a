//! The prefix walk of pools whose banks are full of a shared root (the walk
//! starts each bank past the keys all its endpoints hold), driven by bytes
//! against a naive model of every (endpoint, tier, key) store count.

use std::collections::BTreeMap;

use kvroute_core::{BlockKey, EndpointId, Medium};

use super::Bytes;
use crate::index::{IndexConfig, SharedIndex};
use crate::view::{InventoryView, Overlap, UNIFORM_RUN};

/// Keys `0..ROOT` are the prompt; writes touch keys up to `ROOT + 4`.
const ROOT: u64 = 12;

fn key(k: u64) -> BlockKey {
    BlockKey(k.wrapping_mul(0x9e37_79b9) + 1)
}

/// Runs the op stream, checking every endpoint's prefix after each step.
///
/// # Panics
/// When the index and the model disagree.
pub fn index_walk(data: &[u8]) {
    let mut b = Bytes(data);
    // One to three banks (16–175 endpoints); a bank is tracked from 16
    // endpoints on.
    let n = 16 + u32::from(b.byte() % 160);
    let shards = 1 + usize::from(b.byte() % 8);
    let index = SharedIndex::new(
        n as usize,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            shards,
        },
    );
    let mut model: BTreeMap<(u32, usize, u64), u32> = BTreeMap::new();
    let prompt: Vec<BlockKey> = (0..ROOT).map(key).collect();
    let mut out = vec![Overlap::default(); n as usize];
    let mut uniform = vec![false; (n as usize).div_ceil(UNIFORM_RUN)];
    for _ in 0..64 {
        let Some(op) = b.next() else { break };
        let ep = u32::from(b.byte()) % n;
        let tier = if b.byte() % 4 == 0 {
            usize::from(b.byte() % 4)
        } else {
            0
        };
        let from = u64::from(b.byte()) % ROOT;
        let len = 1 + u64::from(b.byte() % 5);
        let keys: Vec<BlockKey> = (from..from + len).map(key).collect();
        let medium = Medium::ALL[tier];
        match op % 8 {
            // The whole pool stores (GPU): a shared root.
            0..=2 => {
                for e in 0..n {
                    let stored = if op & 8 == 0 {
                        index.store_chain(EndpointId(e), Medium::Gpu, None, &keys)
                    } else {
                        index.store(EndpointId(e), Medium::Gpu, &keys)
                    };
                    assert!(stored.is_ok());
                    for k in &keys {
                        *model.entry((e, 0, k.0)).or_insert(0) += 1;
                    }
                }
            }
            3 | 4 => {
                assert!(index.store(EndpointId(ep), medium, &keys).is_ok());
                for k in &keys {
                    *model.entry((ep, tier, k.0)).or_insert(0) += 1;
                }
            }
            5 | 6 => {
                assert!(index.remove(EndpointId(ep), medium, &keys).is_ok());
                for k in &keys {
                    if let Some(c) = model.get_mut(&(ep, tier, k.0)) {
                        *c -= 1;
                        if *c == 0 {
                            model.remove(&(ep, tier, k.0));
                        }
                    }
                }
            }
            _ => {
                assert!(index.clear_endpoint(EndpointId(ep)).is_ok());
                model.retain(|(e, _, _), _| *e != ep);
            }
        }
        index.score_prefix_uniform(&prompt, &mut out, &mut uniform);
        // A bank marked as scored alike holds one overlap throughout.
        for (run, alike) in out.chunks(UNIFORM_RUN).zip(&uniform) {
            if *alike {
                assert!(run.iter().all(|o| Some(o) == run.first()), "after op {op}");
            }
        }
        for (e, got) in out.iter().enumerate() {
            let mut want = [0u32; 4];
            for k in &prompt {
                let e = u32::try_from(e).unwrap_or(u32::MAX);
                match (0..4).find(|t| model.contains_key(&(e, *t, k.0))) {
                    Some(t) => want[t] += 1,
                    None => break,
                }
            }
            assert_eq!(got.prefix_by_medium, want, "endpoint {e} after op {op}");
            assert_eq!(got.prefix, want.iter().sum::<u32>(), "endpoint {e}");
        }
    }
}
