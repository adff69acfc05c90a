//! A capacity- and TTL-bounded map from 64-bit keys, evicting least recently
//! written entries first. Backs the session map and the prefix trie.

use std::collections::VecDeque;
use std::time::Duration;

use hashbrown::HashMap;

struct Entry<V> {
    value: V,
    written: Duration,
    generation: u64,
}

/// Every write appends `(key, generation)` to `order`; an order record is live
/// only while the entry still carries that generation, so re-writes never need a
/// search. Dead records are skipped when popped and compacted when they pile up.
pub(crate) struct BoundedMap<V> {
    map: HashMap<u64, Entry<V>>,
    order: VecDeque<(u64, u64)>,
    capacity: usize,
    ttl: Duration,
    next_generation: u64,
}

impl<V: Copy> BoundedMap<V> {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            ttl,
            next_generation: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The value for `key` if written less than `ttl` before `now`.
    pub(crate) fn get(&self, key: u64, now: Duration) -> Option<V> {
        let e = self.map.get(&key)?;
        (now.saturating_sub(e.written) < self.ttl).then_some(e.value)
    }

    pub(crate) fn insert(&mut self, key: u64, value: V, now: Duration) {
        if self.capacity == 0 {
            return;
        }
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1);
        self.map.insert(
            key,
            Entry {
                value,
                written: now,
                generation,
            },
        );
        self.order.push_back((key, generation));
        self.evict(now);
        if self.order.len() > self.capacity.saturating_mul(2).saturating_add(64) {
            self.compact();
        }
    }

    fn evict(&mut self, now: Duration) {
        while let Some(&(key, generation)) = self.order.front() {
            let live = self.map.get(&key).filter(|e| e.generation == generation);
            let drop = match live {
                None => {
                    self.order.pop_front();
                    continue;
                }
                Some(e) => {
                    self.map.len() > self.capacity || now.saturating_sub(e.written) >= self.ttl
                }
            };
            if !drop {
                break;
            }
            self.order.pop_front();
            self.map.remove(&key);
        }
    }

    /// Keeps only the entries whose value passes `keep`.
    pub(crate) fn retain_values(&mut self, mut keep: impl FnMut(V) -> bool) {
        self.map.retain(|_, e| keep(e.value));
        self.compact();
    }

    fn compact(&mut self) {
        let map = &self.map;
        self.order
            .retain(|(key, generation)| map.get(key).is_some_and(|e| e.generation == *generation));
    }
}

/// 64-bit hash of a byte string (session ids, text chunks).
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Chains `next` onto `parent` so a path hash depends on every step before it.
pub(crate) fn chain(parent: u64, next: u64) -> u64 {
    mix64(parent ^ next.rotate_left(29))
}

/// SplitMix64 (kvroute-core's one mixer): a cheap, well-spread 64-bit mix.
pub(crate) use kvroute_core::mix::splitmix64 as mix64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_evicts_oldest_write_first() {
        let mut m = BoundedMap::new(2, Duration::from_secs(60));
        let t = Duration::ZERO;
        m.insert(1, 10u32, t);
        m.insert(2, 20, t);
        m.insert(1, 11, t); // rewrite makes 2 the oldest
        m.insert(3, 30, t);
        assert_eq!(m.get(2, t), None);
        assert_eq!(m.get(1, t), Some(11));
        assert_eq!(m.get(3, t), Some(30));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn ttl_hides_and_then_evicts() {
        let mut m = BoundedMap::new(8, Duration::from_secs(5));
        m.insert(1, 1u8, Duration::from_secs(0));
        assert_eq!(m.get(1, Duration::from_secs(4)), Some(1));
        assert_eq!(m.get(1, Duration::from_secs(5)), None);
        m.insert(2, 2, Duration::from_secs(6));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn order_queue_stays_bounded_under_rewrites() {
        let mut m = BoundedMap::new(4, Duration::from_secs(60));
        for i in 0..10_000u64 {
            m.insert(i % 3, i, Duration::ZERO);
        }
        assert!(m.order.len() <= 4 * 2 + 64 + 1);
        assert_eq!(m.get(0, Duration::ZERO), Some(9999));
    }
}
