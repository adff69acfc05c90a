//! Chain runs (`SharedIndex::store_chain`) against the plain per-key walk:
//! random chained inventories (forking chains, so prompts leave runs part-way),
//! stores continued across calls through their parent, second holders, removes,
//! tier moves, clears and evictions; every prompt's `score_prefix` must equal a
//! naive scan of the inventory, which a reference model of reference counts
//! checks too (unbounded case).

use std::collections::BTreeMap;

use kvroute_core::mix::splitmix64 as splitmix;
use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
use proptest::prelude::*;

/// Endpoint slots: two banks, so runs of the second bank are exercised too.
const SLOTS: u32 = 70;
/// Endpoints the operations draw from (three in each bank).
const EPS: [u32; 6] = [0, 1, 2, 64, 65, 66];

/// Chains of keys, each key a hash of the previous key and a block: chain 0
/// from the root, chain `c` forking off an earlier chain at some position.
fn chains(shape: &[(usize, usize, usize)]) -> Vec<Vec<u64>> {
    let mut out: Vec<Vec<u64>> = Vec::new();
    for (c, (from, at, len)) in shape.iter().enumerate() {
        let mut keys: Vec<u64> = match out.get(from % c.max(1)) {
            Some(base) if c > 0 => base.iter().take(*at).copied().collect(),
            _ => Vec::new(),
        };
        let mut prev = keys.last().copied().unwrap_or(0x5851_f42d);
        for j in 0..*len {
            prev = splitmix(prev ^ ((c as u64) << 40) ^ (j as u64));
            keys.push(prev);
        }
        out.push(keys);
    }
    out
}

#[derive(Clone, Debug)]
enum Op {
    /// Store `chain[from..from + len]` with its parent, in tier `tier`.
    Chain {
        ep: usize,
        chain: usize,
        from: usize,
        len: usize,
        tier: usize,
    },
    /// Like `Chain`, from where this endpoint's last `Continue` on the chain
    /// stopped (an engine growing a sequence event by event).
    Continue {
        ep: usize,
        chain: usize,
        len: usize,
    },
    /// Plain store of one key (no run).
    Plain {
        ep: usize,
        chain: usize,
        at: usize,
    },
    Remove {
        ep: usize,
        chain: usize,
        at: usize,
        tier: usize,
    },
    Clear {
        ep: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let tier = prop_oneof![6 => Just(0usize), 1 => Just(1usize)];
    prop_oneof![
        8 => (0..EPS.len(), 0usize..6, 0usize..260, 1usize..80, tier.clone())
            .prop_map(|(ep, chain, from, len, tier)| Op::Chain { ep, chain, from, len, tier }),
        8 => (0..EPS.len(), 0usize..6, prop_oneof![Just(1usize), 1usize..40])
            .prop_map(|(ep, chain, len)| Op::Continue { ep, chain, len }),
        1 => (0..EPS.len(), 0usize..6, 0usize..300)
            .prop_map(|(ep, chain, at)| Op::Plain { ep, chain, at }),
        4 => (0..EPS.len(), 0usize..6, 0usize..300, tier)
            .prop_map(|(ep, chain, at, tier)| Op::Remove { ep, chain, at, tier }),
        1 => (0..EPS.len()).prop_map(|ep| Op::Clear { ep }),
    ]
}

/// The run of held keys from block 0, each counted in its fastest tier, from
/// one `contains` per (key, tier): the walk without any shortcut.
fn per_key_walk(index: &SharedIndex, ep: u32, prompt: &[u64]) -> [u32; 4] {
    let mut want = [0u32; 4];
    for k in prompt {
        match (0..4).find(|t| index.contains(EndpointId(ep), BlockKey(*k), Medium::ALL[*t])) {
            Some(t) => want[t] += 1,
            None => break,
        }
    }
    want
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn prefix_with_runs_equals_the_per_key_walk(
        shape in proptest::collection::vec((0usize..6, 0usize..200, 0usize..260), 1..6),
        ops in proptest::collection::vec(op(), 1..60),
        capacity in prop_oneof![3 => Just(usize::MAX), 1 => 8usize..300],
        shards in prop_oneof![Just(1usize), 2usize..80],
    ) {
        let chains = chains(&shape);
        let index = SharedIndex::new(
            SLOTS as usize,
            IndexConfig { capacity_per_endpoint: capacity, shards },
        );
        let mut model: BTreeMap<(u32, usize, u64), u32> = BTreeMap::new();
        let mut cursor: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        let key_of = |chain: usize, at: usize| {
            let c = &chains[chain % chains.len()];
            (!c.is_empty()).then(|| c[at % c.len()])
        };
        for op in &ops {
            let op = match *op {
                Op::Continue { ep, chain, len } => {
                    let at = cursor.entry((ep, chain % chains.len())).or_insert(0);
                    let from = *at;
                    *at += len;
                    Op::Chain { ep, chain, from, len, tier: 0 }
                }
                ref other => other.clone(),
            };
            match op {
                Op::Continue { .. } => {}
                Op::Chain { ep, chain, from, len, tier } => {
                    let c = &chains[chain % chains.len()];
                    let from = from.min(c.len());
                    let slice: Vec<BlockKey> =
                        c.iter().skip(from).take(len).map(|k| BlockKey(*k)).collect();
                    let parent = from.checked_sub(1).map(|p| BlockKey(c[p]));
                    index
                        .store_chain(EndpointId(EPS[ep]), Medium::ALL[tier], parent, &slice)
                        .unwrap();
                    for k in &slice {
                        *model.entry((EPS[ep], tier, k.0)).or_insert(0) += 1;
                    }
                }
                Op::Plain { ep, chain, at } => {
                    if let Some(k) = key_of(chain, at) {
                        index.store(EndpointId(EPS[ep]), Medium::Gpu, &[BlockKey(k)]).unwrap();
                        *model.entry((EPS[ep], 0, k)).or_insert(0) += 1;
                    }
                }
                Op::Remove { ep, chain, at, tier } => {
                    if let Some(k) = key_of(chain, at) {
                        index
                            .remove(EndpointId(EPS[ep]), Medium::ALL[tier], &[BlockKey(k)])
                            .unwrap();
                        if let Some(n) = model.get_mut(&(EPS[ep], tier, k)) {
                            *n -= 1;
                            if *n == 0 {
                                model.remove(&(EPS[ep], tier, k));
                            }
                        }
                    }
                }
                Op::Clear { ep } => {
                    index.clear_endpoint(EndpointId(EPS[ep])).unwrap();
                    model.retain(|(e, _, _), _| *e != EPS[ep]);
                    cursor.retain(|(e, _), _| *e != ep);
                }
            }
            // Every chain's prompt, whole and cut, after every step.
            for c in &chains {
                for cut in [c.len(), c.len() / 2, c.len().saturating_sub(7)] {
                    let prompt = &c[..cut];
                    let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
                    let mut early = vec![Overlap { blocks: 9, prefix: 9, prefix_by_medium: [9; 4] }; SLOTS as usize];
                    index.score_prefix(&keys, &mut early);
                    let mut full = vec![Overlap::default(); SLOTS as usize];
                    index.score(&keys, &mut full);
                    for ep in EPS {
                        let got = early[ep as usize];
                        let want = per_key_walk(&index, ep, prompt);
                        prop_assert_eq!(got.prefix_by_medium, want, "endpoint {}, cut {}", ep, cut);
                        prop_assert_eq!(got.prefix, want.iter().sum::<u32>());
                        prop_assert_eq!(got.prefix_by_medium, full[ep as usize].prefix_by_medium);
                        if capacity == usize::MAX {
                            let mut naive = [0u32; 4];
                            for k in prompt {
                                match (0..4).find(|t| model.contains_key(&(ep, *t, *k))) {
                                    Some(t) => naive[t] += 1,
                                    None => break,
                                }
                            }
                            prop_assert_eq!(want, naive, "index vs model, endpoint {}", ep);
                        }
                    }
                }
            }
        }
    }
}

/// A long chain stored block by block (as an engine decoding emits it) and in
/// events, then holed in the middle: the prefix stops at the hole, then
/// continues once the key is stored again.
#[test]
fn a_removed_middle_key_ends_the_prefix_until_stored_again() {
    let chain = chains(&[(0, 0, 300)]).remove(0);
    let keys: Vec<BlockKey> = chain.iter().map(|k| BlockKey(*k)).collect();
    let index = SharedIndex::new(2, IndexConfig::default());
    let e = EndpointId(1);
    index.store_chain(e, Medium::Gpu, None, &keys[..1]).unwrap();
    for i in 1..100 {
        index
            .store_chain(e, Medium::Gpu, Some(keys[i - 1]), &keys[i..=i])
            .unwrap();
    }
    for from in (100..300).step_by(50) {
        index
            .store_chain(e, Medium::Gpu, Some(keys[from - 1]), &keys[from..from + 50])
            .unwrap();
    }
    let prefix = |index: &SharedIndex| {
        let mut out = [Overlap::default(); 2];
        index.score_prefix(&keys, &mut out);
        out[1].prefix
    };
    assert_eq!(prefix(&index), 300);
    for hole in [250usize, 120, 40, 5] {
        index.remove(e, Medium::Gpu, &keys[hole..=hole]).unwrap();
        assert_eq!(prefix(&index), hole as u32, "hole at {hole}");
        index.store(e, Medium::Gpu, &keys[hole..=hole]).unwrap();
        assert_eq!(prefix(&index), 300, "hole at {hole} filled");
    }
    // A second holder of a middle key voids the run's claim for the first,
    // which must still be scored from its own keys.
    index
        .store(EndpointId(0), Medium::Gpu, &keys[150..=150])
        .unwrap();
    assert_eq!(prefix(&index), 300);
    index.remove(e, Medium::Gpu, &keys[150..=150]).unwrap();
    assert_eq!(prefix(&index), 150);
    index.store(e, Medium::Gpu, &keys[150..=150]).unwrap();
    index.remove(e, Medium::Gpu, &keys[200..=200]).unwrap();
    assert_eq!(prefix(&index), 200);
}

/// Writers storing chains (runs), voiding runs through second holders,
/// removes and clears (so run slots are freed and reused by other
/// endpoints), while readers walk: a key no writer ever stores for an
/// endpoint bounds that endpoint's prefix in every read, and an endpoint
/// nobody touches keeps its exact prefix.
#[test]
fn runs_stay_sound_while_slots_are_voided_and_reused_concurrently() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const HOLE: usize = 150;
    let chain: Vec<BlockKey> = chains(&[(0, 0, 400)])
        .remove(0)
        .into_iter()
        .map(BlockKey)
        .collect();
    let index = Arc::new(SharedIndex::new(8, IndexConfig::default()));
    // Endpoint 7 holds the first 300 blocks in runs for the whole test.
    for from in (0..300usize).step_by(20) {
        let parent = from.checked_sub(1).map(|p| chain[p]);
        index
            .store_chain(EndpointId(7), Medium::Gpu, parent, &chain[from..from + 20])
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, stop, chain) = (index.clone(), stop.clone(), chain.clone());
            std::thread::spawn(move || {
                let mut out = vec![Overlap::default(); 8];
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds == 0 {
                    index.score_prefix(&chain, &mut out);
                    for (e, o) in out.iter().enumerate().take(3) {
                        assert!(o.prefix as usize <= HOLE, "endpoint {e}: {o:?}");
                    }
                    assert_eq!(out[7].prefix, 300);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let writers: Vec<_> = (0..3u32)
        .map(|e| {
            let (index, chain) = (index.clone(), chain.clone());
            std::thread::spawn(move || {
                let mut x = 0x2545_f491_4f6c_dd1du64 ^ u64::from(e);
                for round in 0..300 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Everything but the hole, in events of 1..24 blocks.
                    let step = 1 + (x % 24) as usize;
                    let mut from = 0;
                    while from < chain.len() {
                        let to = (from + step).min(chain.len());
                        let parent = from.checked_sub(1).map(|p| chain[p]);
                        let keys: Vec<BlockKey> = (from..to)
                            .filter(|i| *i != HOLE)
                            .map(|i| chain[i])
                            .collect();
                        if to <= HOLE || from > HOLE {
                            index
                                .store_chain(EndpointId(e), Medium::Gpu, parent, &keys)
                                .unwrap();
                        } else {
                            // The event around the hole is not a chain
                            // segment any more: stored plainly.
                            index.store(EndpointId(e), Medium::Gpu, &keys).unwrap();
                        }
                        from = to;
                    }
                    // Another endpoint's keys held too, removed, cleared.
                    let other = EndpointId((e + 1) % 3);
                    let at = (x >> 20) as usize % chain.len();
                    if at != HOLE {
                        index.store(other, Medium::Gpu, &chain[at..=at]).unwrap();
                        index
                            .remove(EndpointId(e), Medium::Gpu, &chain[at..=at])
                            .unwrap();
                    }
                    if round % 7 == 0 {
                        index.clear_endpoint(EndpointId(e)).unwrap();
                    }
                }
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
}
