//! Dynamo's router-side record of the blocks its requests hold
//! (`ActiveSequences` in `lib/kv-router`, defaults
//! `router_track_active_blocks = true`, `router_assume_kv_reuse = true`,
//! `router_track_output_blocks = false`): each routed request's prompt blocks
//! count on its worker from the routing decision until the request is freed
//! at the end of its stream, blocks shared by several of a worker's requests
//! once; generated tokens' blocks are not counted. The cost function charges
//! a worker its active blocks plus the request's blocks not already active
//! there.
//!
//! Keys are chained (a key names its whole prefix), and every request adds
//! a whole prefix, so a worker holding a key holds every key before it: the
//! request's active depth is found by binary search.

use std::collections::HashMap;

use kvroute_core::BlockKey;

/// The blocks of the requests in flight, per worker.
#[derive(Debug, Default)]
pub struct ActiveSequences {
    /// Per worker: each active block's number of requests holding it.
    workers: Vec<HashMap<BlockKey, u32>>,
    /// Each committed request's worker and prompt blocks.
    requests: HashMap<u64, (usize, Vec<BlockKey>)>,
    /// The last decision's worker and blocks, until the host commits or
    /// discards it.
    staged: Option<(usize, Vec<BlockKey>)>,
}

impl ActiveSequences {
    /// Tracks `workers` workers.
    #[must_use]
    pub fn new(workers: usize) -> Self {
        Self {
            workers: vec![HashMap::new(); workers],
            ..Self::default()
        }
    }

    /// Distinct blocks worker `w`'s requests in flight hold.
    #[must_use]
    pub fn active_blocks(&self, w: usize) -> u64 {
        self.workers.get(w).map_or(0, |m| m.len() as u64)
    }

    /// How many leading blocks of `keys` worker `w`'s requests in flight
    /// already hold.
    #[must_use]
    pub fn active_prefix(&self, w: usize, keys: &[BlockKey]) -> u32 {
        let Some(m) = self.workers.get(w).filter(|m| !m.is_empty()) else {
            return 0;
        };
        // Presence is monotone along the prefix: the first absent key.
        let (mut lo, mut hi) = (0usize, keys.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if keys.get(mid).is_some_and(|k| m.contains_key(k)) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        u32::try_from(lo).unwrap_or(u32::MAX)
    }

    /// The policy routed `keys` to worker `w`: held until the host commits it
    /// to a request ([`ActiveSequences::commit`]) or discards it.
    pub fn stage(&mut self, w: usize, keys: &[BlockKey]) {
        self.staged = Some((w, keys.to_vec()));
    }

    /// The staged decision is request `request`'s: its blocks count on its
    /// worker until [`ActiveSequences::free`]. False when nothing was staged
    /// (the decision did not go through the policy).
    pub fn commit(&mut self, request: u64) -> bool {
        let Some((w, keys)) = self.staged.take() else {
            return false;
        };
        if let Some(m) = self.workers.get_mut(w) {
            for k in &keys {
                *m.entry(*k).or_insert(0) += 1;
            }
        }
        if let Some((old_w, old)) = self.requests.insert(request, (w, keys)) {
            self.release(old_w, &old);
        }
        true
    }

    /// The staged decision was not submitted.
    pub fn discard(&mut self) {
        self.staged = None;
    }

    /// Request `request` ended: its blocks stop counting.
    pub fn free(&mut self, request: u64) {
        if let Some((w, keys)) = self.requests.remove(&request) {
            self.release(w, &keys);
        }
    }

    fn release(&mut self, w: usize, keys: &[BlockKey]) {
        let Some(m) = self.workers.get_mut(w) else {
            return;
        };
        for k in keys {
            if let Some(n) = m.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(k);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Chained keys of a prompt: root `r`'s blocks 0..len.
    fn chain(root: u64, len: usize) -> Vec<BlockKey> {
        (0..len as u64).map(|i| BlockKey(root << 32 | i)).collect()
    }

    #[test]
    fn shared_blocks_count_once_and_leave_with_their_last_request() {
        let mut a = ActiveSequences::new(2);
        a.stage(0, &chain(1, 4));
        assert!(a.commit(10));
        a.stage(0, &chain(1, 6));
        assert!(a.commit(11));
        assert_eq!(a.active_blocks(0), 6);
        assert_eq!(a.active_prefix(0, &chain(1, 8)), 6);
        assert_eq!(a.active_prefix(1, &chain(1, 8)), 0);
        a.free(11);
        assert_eq!(a.active_blocks(0), 4);
        assert_eq!(a.active_prefix(0, &chain(1, 8)), 4);
        a.free(10);
        a.free(10);
        assert_eq!(a.active_blocks(0), 0);
        // Nothing staged: nothing committed.
        assert!(!a.commit(12));
        a.stage(1, &chain(2, 3));
        a.discard();
        assert!(!a.commit(12));
        assert_eq!(a.active_blocks(1), 0);
    }

    proptest! {
        /// Against a naive model: every request's blocks listed, counts and
        /// prefixes recomputed from the list.
        #[test]
        fn matches_a_naive_model(ops in proptest::collection::vec(
            (0u8..3, 0usize..3, 0u64..4, 0usize..12, 0u64..6), 1..200)) {
            let mut a = ActiveSequences::new(3);
            let mut live: HashMap<u64, (usize, Vec<BlockKey>)> = HashMap::new();
            for (op, w, root, len, req) in ops {
                match op {
                    0 => {
                        a.stage(w, &chain(root, len));
                        if a.commit(req) {
                            live.insert(req, (w, chain(root, len)));
                        }
                    }
                    1 => {
                        a.free(req);
                        live.remove(&req);
                    }
                    _ => {
                        a.stage(w, &chain(root, len));
                        a.discard();
                    }
                }
                for w in 0..3 {
                    let held: std::collections::HashSet<BlockKey> = live
                        .values()
                        .filter(|(x, _)| *x == w)
                        .flat_map(|(_, k)| k.iter().copied())
                        .collect();
                    prop_assert_eq!(a.active_blocks(w), held.len() as u64);
                    for r in 0..4 {
                        let probe = chain(r, 12);
                        let naive = probe.iter().take_while(|k| held.contains(k)).count();
                        prop_assert_eq!(a.active_prefix(w, &probe) as usize, naive);
                    }
                }
            }
        }
    }
}
