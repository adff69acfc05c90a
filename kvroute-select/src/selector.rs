//! Fallback selectors: what a converged rule does when KV-exact misses, and what
//! RR / content-affinity rules do always.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::bounded::mix64;
use crate::chwbl::Ring;
use crate::pool::{compare_load, Pool};

/// A load-balancing algorithm over the eligible endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum SelectorKind {
    /// Round robin over eligible endpoints.
    #[default]
    RoundRobin,
    /// Least utilised (`in_flight / capacity`, then queued prefill tokens); round
    /// robin among exact ties.
    LeastLoad,
    /// Least predicted prefill wait: queued prefill tokens per unit of
    /// capacity, then utilisation; round robin among exact ties. What a
    /// request that no endpoint has cached waits for before its first token.
    LeastPrefill,
    /// Two pseudo-random candidates, the less loaded wins.
    PowerOfTwoChoices,
    /// Consistent hashing with bounded loads over the request's affinity key
    /// (round robin when the request has none).
    Chwbl,
    /// Uniform pseudo-random.
    Random,
    /// Pseudo-random proportional to endpoint weight.
    Weighted,
}

/// Per-rule selector state: counters only, so selection works through `&self`.
#[derive(Debug)]
pub(crate) struct SelectorState {
    turn: AtomicU64,
    rng: AtomicU64,
    pub(crate) ring: Ring,
}

impl SelectorState {
    pub(crate) fn new(ring: Ring, seed: u64) -> Self {
        Self {
            turn: AtomicU64::new(0),
            rng: AtomicU64::new(seed),
            ring,
        }
    }

    pub(crate) fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Ordering::Relaxed)
    }

    fn next_random(&self) -> u64 {
        mix64(self.rng.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed))
    }

    /// Picks an eligible endpoint index.
    pub(crate) fn select(
        &self,
        kind: SelectorKind,
        pool: &Pool<'_>,
        affinity_key: Option<u64>,
        chwbl_factor: f64,
    ) -> Option<usize> {
        let count = pool.candidates().count();
        if count == 0 {
            return None;
        }
        let nth = |k: u64| {
            let k = usize::try_from(k % count as u64).unwrap_or(0);
            pool.candidates().nth(k).map(|(i, _, _)| i)
        };
        match kind {
            SelectorKind::RoundRobin => nth(self.next_turn()),
            SelectorKind::LeastLoad => pool.least_loaded(self.next_turn()),
            SelectorKind::LeastPrefill => pool.least_prefill(self.next_turn()),
            SelectorKind::Random => nth(self.next_random()),
            SelectorKind::PowerOfTwoChoices => {
                let r = self.next_random();
                let a = nth(r)?;
                let b = nth(r >> 32)?;
                let la = pool.load_of(a);
                let lb = pool.load_of(b);
                let pick_b = compare_load(lb, pool.capacity_of(b), la, pool.capacity_of(a)).is_lt();
                Some(if pick_b { b } else { a })
            }
            SelectorKind::Chwbl => match affinity_key {
                Some(key) => self.ring.lookup(key, pool, chwbl_factor),
                None => nth(self.next_turn()),
            },
            SelectorKind::Weighted => {
                let total: u64 = pool.candidates().map(|(_, e, _)| u64::from(e.weight)).sum();
                if total == 0 {
                    return nth(self.next_random());
                }
                let mut r = self.next_random() % total;
                for (i, e, _) in pool.candidates() {
                    let w = u64::from(e.weight);
                    if r < w {
                        return Some(i);
                    }
                    r -= w;
                }
                None
            }
        }
    }
}
