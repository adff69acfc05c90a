//! Fallback selectors: what a converged rule does when KV-exact misses, and what
//! RR / content-affinity rules do always.

use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_core::mix::GAMMA;

use crate::bounded::mix64;
use crate::chwbl::Ring;
use crate::load::Deciders;
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
    /// Two distinct pseudo-random candidates, the less loaded wins.
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
/// The counters are shared with the rules rebuilt from this one.
#[derive(Debug)]
pub(crate) struct SelectorState {
    turn: std::sync::Arc<AtomicU64>,
    rng: std::sync::Arc<AtomicU64>,
    seed: u64,
    pub(crate) ring: Ring,
}

impl SelectorState {
    pub(crate) fn new(ring: Ring, seed: u64) -> Self {
        Self {
            turn: std::sync::Arc::new(AtomicU64::new(0)),
            rng: std::sync::Arc::new(AtomicU64::new(seed)),
            seed,
            ring,
        }
    }

    /// The state of a rule rebuilt from this one over `ring`: the turn and
    /// the random sequence carry on (a rebuild on every endpoint change
    /// would otherwise send round robin back to the first endpoint and
    /// replay the same draws); a new `seed` starts its own sequence.
    pub(crate) fn carried(&self, ring: Ring, seed: u64) -> Self {
        Self {
            turn: std::sync::Arc::clone(&self.turn),
            rng: if seed == self.seed {
                std::sync::Arc::clone(&self.rng)
            } else {
                std::sync::Arc::new(AtomicU64::new(seed))
            },
            seed,
            ring,
        }
    }

    pub(crate) fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Ordering::Relaxed)
    }

    /// The next draw of the rule's sequence, as decider `deciders` sees it
    /// (each rank draws a sequence of its own: see [`Deciders::random_salt`]).
    fn next_random(&self, deciders: Deciders) -> u64 {
        mix64(self.rng.fetch_add(GAMMA, Ordering::Relaxed) ^ deciders.random_salt())
    }

    /// Picks an eligible endpoint index; `deciders` start their rotations
    /// and draw their random sequences apart ([`Deciders::rotate`]).
    pub(crate) fn select(
        &self,
        kind: SelectorKind,
        pool: &Pool<'_>,
        affinity_key: Option<u64>,
        chwbl_factor: f64,
        deciders: Deciders,
    ) -> Option<usize> {
        let count = pool.candidates().count();
        if count == 0 {
            return None;
        }
        let nth = |k: u64| {
            let k = usize::try_from(k % count as u64).unwrap_or(0);
            pool.candidates().nth(k).map(|(i, _, _)| i)
        };
        let turn = |k: u64| {
            let k = usize::try_from(deciders.rotate_blind(k, count as u64)).unwrap_or(0);
            pool.candidates().nth(k).map(|(i, _, _)| i)
        };
        match kind {
            SelectorKind::RoundRobin => turn(self.next_turn()),
            SelectorKind::LeastLoad => pool.least_loaded(self.next_turn(), deciders),
            SelectorKind::LeastPrefill => pool.least_prefill(self.next_turn(), deciders),
            SelectorKind::Random => nth(self.next_random(deciders)),
            SelectorKind::PowerOfTwoChoices => {
                // Two distinct candidates (as tower's p2c samples): drawing
                // both independently picks one endpoint twice 1/n of the time.
                let r = self.next_random(deciders);
                let n = count as u64;
                let ka = (r & 0xffff_ffff) % n;
                let kb = if n > 1 {
                    (ka + 1 + (r >> 32) % (n - 1)) % n
                } else {
                    ka
                };
                let a = nth(ka)?;
                let b = nth(kb)?;
                let la = pool.load_of(a);
                let lb = pool.load_of(b);
                let pick_b = compare_load(lb, pool.capacity_of(b), la, pool.capacity_of(a)).is_lt();
                Some(if pick_b { b } else { a })
            }
            SelectorKind::Chwbl => match affinity_key {
                Some(key) => self.ring.lookup(key, pool, chwbl_factor),
                None => turn(self.next_turn()),
            },
            SelectorKind::Weighted => {
                let total: u64 = pool.candidates().map(|(_, e, _)| u64::from(e.weight)).sum();
                if total == 0 {
                    return nth(self.next_random(deciders));
                }
                let mut r = self.next_random(deciders) % total;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::{Endpoint, Role};
    use crate::load::EndpointLoad;

    /// With two endpoints, P2C always compares both: the loaded one is never
    /// chosen.
    #[test]
    fn p2c_compares_two_distinct_endpoints() {
        let eps = vec![
            Endpoint::new("a", Role::Both),
            Endpoint::new("b", Role::Both),
        ];
        let eligible = vec![true, true];
        let loads = vec![
            EndpointLoad {
                in_flight: 5,
                queued_prefill_tokens: 0,
            },
            EndpointLoad::default(),
        ];
        let pool = Pool {
            endpoints: &eps,
            eligible: &eligible,
            loads: &loads,
            sampled: &[],
        };
        let state = SelectorState::new(Ring::new(&eps, 4), 7);
        for _ in 0..200 {
            assert_eq!(
                state.select(
                    SelectorKind::PowerOfTwoChoices,
                    &pool,
                    None,
                    1.25,
                    Deciders::ALONE
                ),
                Some(1)
            );
        }
    }
}
