//! The shared engine worker model against a naive reference: capacity is never
//! exceeded, the event stream replays to exactly the cache contents, hits are the
//! longest cached prefix and evictions follow vLLM's free-queue order.

use kvroute_engine_model as engine_model;

use std::collections::{BTreeMap, HashSet};

use engine_model::{AllocRequest, CostModel, PrefixCache, RequestSpec, Worker, WorkerConfig};
use kvroute_core::{BlockKey, Medium};
use kvroute_ingest::KvEvent;
use proptest::prelude::*;

/// Chain keys of a path in a small trie: position `i` and every choice before it
/// determine the key, so shared prefixes share keys and no key repeats in a chain.
fn chain(path: &[u8]) -> Vec<BlockKey> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    path.iter()
        .map(|&c| {
            h = (h ^ u64::from(c) ^ 0x100).wrapping_mul(0x0100_0000_01b3);
            BlockKey(h)
        })
        .collect()
}

/// The reference: a map key → (refs, free stamp) and a scan for the victim.
#[derive(Default)]
struct Naive {
    capacity: u32,
    anonymous: u32,
    blocks: BTreeMap<u64, (u32, u64)>,
    stamp: u64,
}

impl Naive {
    fn prefix(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.blocks.contains_key(&k.0))
            .count()
    }

    /// Returns (hit, evicted keys in order, stored keys) or None if it does not fit.
    fn allocate(
        &mut self,
        keys: &[BlockKey],
        hit_limit: usize,
        anon: u32,
    ) -> Option<(usize, Vec<u64>, Vec<u64>)> {
        let hit = self.prefix(keys).min(hit_limit);
        let new: u32 = keys
            .iter()
            .filter(|k| !self.blocks.contains_key(&k.0))
            .count() as u32;
        let will_pin: HashSet<u64> = keys
            .iter()
            .map(|k| k.0)
            .filter(|k| self.blocks.contains_key(k))
            .collect();
        let evictable = self
            .blocks
            .iter()
            .filter(|(k, (r, _))| *r == 0 && !will_pin.contains(*k))
            .count() as u32;
        let used = self.blocks.len() as u32 + self.anonymous;
        let free = self.capacity - used;
        if new + anon > free + evictable {
            return None;
        }
        for k in keys {
            if let Some(b) = self.blocks.get_mut(&k.0) {
                b.0 += 1;
            }
        }
        let mut evicted = Vec::new();
        while self.capacity - (self.blocks.len() as u32 + self.anonymous) < new + anon {
            let (&victim, _) = self
                .blocks
                .iter()
                .filter(|(_, (r, _))| *r == 0)
                .min_by_key(|(_, (_, s))| *s)
                .unwrap();
            self.blocks.remove(&victim);
            evicted.push(victim);
        }
        for k in &keys[hit..] {
            self.blocks.entry(k.0).or_insert((1, 0));
        }
        self.anonymous += anon;
        Some((hit, evicted, keys[hit..].iter().map(|k| k.0).collect()))
    }

    fn release(&mut self, keys: &[BlockKey], anon: u32) {
        for k in keys.iter().rev() {
            if let Some(b) = self.blocks.get_mut(&k.0) {
                b.0 -= 1;
                if b.0 == 0 {
                    self.stamp += 1;
                    b.1 = self.stamp;
                }
            }
        }
        self.anonymous -= anon;
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate {
        path: Vec<u8>,
        hit_limit: usize,
        anon: u32,
    },
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u8..3, 0..6), 0usize..8, 0u32..3)
            .prop_map(|(path, hit_limit, anon)| Op::Allocate { path, hit_limit, anon }),
        2 => (0usize..8).prop_map(Op::Release),
    ]
}

fn apply(set: &mut HashSet<u64>, events: &[KvEvent]) {
    for e in events {
        match e {
            KvEvent::Stored(s) => set.extend(s.keys.iter().map(|k| k.0)),
            KvEvent::Removed(r) => {
                for k in &r.keys {
                    set.remove(&k.0);
                }
            }
            KvEvent::AllCleared => set.clear(),
            KvEvent::Moved(_) => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cache_matches_naive_model(capacity in 1u32..12, ops in prop::collection::vec(op(), 1..60)) {
        let mut cache = PrefixCache::new(capacity, Medium::Gpu);
        let mut naive = Naive { capacity, ..Naive::default() };
        let mut held: Vec<(Vec<BlockKey>, u32)> = Vec::new();
        let mut replayed = HashSet::new();
        let mut out = Vec::new();
        for op in ops {
            match op {
                Op::Allocate { path, hit_limit, anon } => {
                    let keys = chain(&path);
                    prop_assert_eq!(cache.longest_prefix(&keys), naive.prefix(&keys));
                    out.clear();
                    let request = AllocRequest { hit_limit, anonymous: anon, block_size: 4, ..AllocRequest::keys(&keys) };
                    let got = cache.allocate(&request, &mut out);
                    let want = naive.allocate(&keys, hit_limit, anon);
                    match (got, want) {
                        (Ok(a), Some((hit, evicted, stored))) => {
                            prop_assert_eq!(a.hit_blocks as usize, hit);
                            let removed: Vec<u64> = out.iter().filter_map(|e| match e {
                                KvEvent::Removed(r) => Some(r.keys[0].0), _ => None }).collect();
                            prop_assert_eq!(removed, evicted);
                            let st: Vec<u64> = out.iter().filter_map(|e| match e {
                                KvEvent::Stored(s) => Some(s.keys.iter().map(|k| k.0).collect::<Vec<_>>()),
                                _ => None }).flatten().collect();
                            prop_assert_eq!(st, stored);
                            held.push((keys, anon));
                        }
                        (Err(_), None) => prop_assert!(out.is_empty()),
                        (g, w) => prop_assert!(false, "cache {:?} vs naive {:?}", g, w.is_some()),
                    }
                }
                Op::Release(i) => {
                    if !held.is_empty() {
                        let (keys, anon) = held.remove(i % held.len());
                        cache.release(&keys, anon);
                        naive.release(&keys, anon);
                    }
                }
            }
            apply(&mut replayed, &out);
            out.clear();
            prop_assert!(cache.used_blocks() <= capacity);
            let contents: HashSet<u64> = cache.keys().map(|k| k.0).collect();
            prop_assert_eq!(&contents, &replayed);
            let naive_keys: HashSet<u64> = naive.blocks.keys().copied().collect();
            prop_assert_eq!(&contents, &naive_keys);
        }
    }

    #[test]
    fn worker_keeps_invariants_and_finishes_everything(
        capacity in 4u32..24,
        max_running in 1u32..4,
        reqs in prop::collection::vec((prop::collection::vec(0u8..3, 0..5), 1u32..6, 0u64..500), 1..40),
    ) {
        let config = WorkerConfig {
            block_size: 4,
            capacity_blocks: capacity,
            max_running,
            cost: CostModel { prefill_step_us: 10.0, prefill_us_per_token: 1.0, max_batched_tokens: 8, decode_us_per_token: 7.0 },
            medium: Medium::Gpu,
        };
        let mut w: Worker<usize> = Worker::new(config);
        let mut now = 0;
        let mut accepted = 0;
        let mut admitted = Vec::new();
        let mut replayed = HashSet::new();
        let mut events = Vec::new();
        for (i, (path, out_tokens, gap)) in reqs.iter().enumerate() {
            now += gap;
            w.advance(now);
            let keys = chain(path);
            // Prompt covers the full blocks plus two tokens of a partial block.
            let prompt = keys.len() as u32 * 4 + 2;
            let expected_hit = w.peek_hit(&keys).min(((prompt - 1) / 4) as usize) as u32;
            let queued_before = w.waiting();
            let spec = RequestSpec { keys: &keys, tokens: &[], prompt_tokens: prompt, output_tokens: *out_tokens, kv_transferred: false, cache_salt: None };
            let ok = w.submit(now, i, &spec).is_ok();
            accepted += usize::from(ok);
            for a in w.drain_admissions() {
                if ok && a.tag == i && queued_before == 0 {
                    // Admitted on the spot: the hit is the longest cached prefix.
                    prop_assert_eq!(a.cached_blocks, expected_hit);
                }
                admitted.push(a);
            }
            prop_assert!(w.running() <= max_running);
            prop_assert!(w.cache().used_blocks() <= capacity);
            w.take_events_into(&mut events);
            apply(&mut replayed, &events);
            events.clear();
            let contents: HashSet<u64> = w.cache().keys().map(|k| k.0).collect();
            prop_assert_eq!(&contents, &replayed);
        }
        while let Some(t) = w.next_completion_us() {
            w.advance(t);
            admitted.extend(w.drain_admissions());
            prop_assert!(w.cache().used_blocks() <= capacity);
        }
        prop_assert_eq!(w.waiting(), 0);
        prop_assert_eq!(admitted.len(), accepted);
        for a in &admitted {
            prop_assert!(a.submitted_us <= a.admitted_us);
            prop_assert!(a.admitted_us < a.first_token_us);
            prop_assert!(a.first_token_us <= a.finish_us);
        }
        // Everything finished: nothing is pinned, every cached block is evictable.
        prop_assert_eq!(w.cache().evictable_blocks(), w.cache().cached_blocks());
    }
}

#[test]
fn worker_is_deterministic() {
    let run = || {
        let mut w: Worker<u32> = Worker::new(WorkerConfig {
            capacity_blocks: 64,
            max_running: 3,
            ..WorkerConfig::default()
        });
        let mut log = Vec::new();
        for i in 0..50u32 {
            let keys = chain(&[(i % 3) as u8, (i % 5) as u8, (i % 2) as u8]);
            let now = u64::from(i) * 30_000;
            w.advance(now);
            w.submit(
                now,
                i,
                &RequestSpec {
                    keys: &keys,
                    tokens: &[],
                    prompt_tokens: 50,
                    output_tokens: 4,
                    kv_transferred: false,
                    cache_salt: None,
                },
            )
            .unwrap();
            log.extend(
                w.drain_admissions()
                    .map(|a| (a.tag, a.cached_tokens, a.admitted_us, a.finish_us)),
            );
        }
        log
    };
    let a = run();
    assert!(a.iter().any(|&(_, cached, _, _)| cached > 0));
    assert_eq!(a, run());
}

#[test]
fn restart_clears_and_reports_all_cleared() {
    let mut w: Worker<u32> = Worker::new(WorkerConfig::default());
    let keys = chain(&[1, 2, 3]);
    let spec = RequestSpec {
        keys: &keys,
        tokens: &[],
        prompt_tokens: 60,
        output_tokens: 2,
        kv_transferred: false,
        cache_salt: None,
    };
    w.submit(0, 0, &spec).unwrap();
    assert_eq!(w.cache().cached_blocks(), 3);
    let _ = w.drain_events().count();
    assert!(w.restart().is_empty());
    assert_eq!(
        w.drain_events().collect::<Vec<_>>(),
        vec![KvEvent::AllCleared]
    );
    assert_eq!(w.cache().cached_blocks(), 0);
    // The pre-restart request finishing later must not disturb the new cache.
    w.advance(u64::MAX / 2);
    w.submit(u64::MAX / 2, 1, &spec).unwrap();
    assert_eq!(w.drain_admissions().next().unwrap().cached_blocks, 0);
}
