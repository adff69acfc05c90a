//! What a workload allows at best, whatever the routing: the hit ratio of
//! one infinite shared cache, and of one LRU cache holding the whole fleet's
//! capacity.

use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasherDefault;

use kvroute_engine_model::cache::KeyHasher;

use super::trace::{block_keys, Workload};

/// Fraction of prompt tokens one infinite shared cache would serve: every
/// request finds every block of every earlier request (with the same "last
/// token is recomputed" cap the workers apply).
#[must_use]
pub fn ideal_hit_ratio(workload: &Workload, block_size: u32) -> f64 {
    let mut seen: HashSet<u64, BuildHasherDefault<KeyHasher>> = HashSet::default();
    let mut keys = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    let bs = block_size.max(1);
    for r in workload.requests() {
        block_keys(workload.ids(r), r.input_tokens, bs, &mut keys);
        let limit = (r.input_tokens.saturating_sub(1) / bs) as usize;
        let prefix = keys.iter().take_while(|k| seen.contains(&k.0)).count();
        hit += (prefix.min(limit) as u64 * u64::from(bs)).min(u64::from(r.input_tokens));
        total += u64::from(r.input_tokens);
        seen.extend(keys.iter().map(|k| k.0));
    }
    ratio(hit, total)
}

/// Fraction of prompt tokens one LRU cache holding the whole fleet's capacity
/// (`capacity_blocks` blocks) would serve, requests in arrival order: the
/// best any placement over that many blocks can do without knowing the future
/// (a fleet partitions the capacity; duplicating a prefix on two workers
/// spends it twice).
#[must_use]
pub fn pooled_hit_ratio(workload: &Workload, block_size: u32, capacity_blocks: u64) -> f64 {
    let mut lru = Lru::new(capacity_blocks);
    let mut keys = Vec::new();
    let (mut hit, mut total) = (0u64, 0u64);
    let bs = block_size.max(1);
    for r in workload.requests() {
        block_keys(workload.ids(r), r.input_tokens, bs, &mut keys);
        let limit = (r.input_tokens.saturating_sub(1) / bs) as usize;
        let prefix = keys.iter().take_while(|k| lru.contains(k.0)).count();
        hit += (prefix.min(limit) as u64 * u64::from(bs)).min(u64::from(r.input_tokens));
        total += u64::from(r.input_tokens);
        for k in &keys {
            lru.touch(k.0);
        }
    }
    ratio(hit, total)
}

/// A least-recently-used set of keys: every touch appends `(key, stamp)` to a
/// queue; a queue record is live while the map still holds its stamp.
struct Lru {
    map: std::collections::HashMap<u64, u64, BuildHasherDefault<KeyHasher>>,
    order: VecDeque<(u64, u64)>,
    capacity: u64,
    stamp: u64,
}

impl Lru {
    fn new(capacity: u64) -> Self {
        Self {
            map: std::collections::HashMap::default(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            stamp: 0,
        }
    }

    fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    fn touch(&mut self, key: u64) {
        self.stamp += 1;
        self.map.insert(key, self.stamp);
        self.order.push_back((key, self.stamp));
        while self.map.len() as u64 > self.capacity {
            let Some((k, st)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k) == Some(&st) {
                self.map.remove(&k);
            }
        }
        if self.order.len() > self.map.len() * 2 + 1024 {
            let map = &self.map;
            self.order.retain(|(k, st)| map.get(k) == Some(st));
        }
    }
}

#[allow(clippy::cast_precision_loss)]
pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}
