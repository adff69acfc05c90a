//! Consistent hashing with bounded loads (Mirrokni et al.): a ring of virtual
//! nodes; a request goes to the first endpoint clockwise from its key's hash
//! that is eligible and still under the load bound.

use crate::bounded::{chain, mix64};
use crate::endpoint::Endpoint;
use crate::pool::Pool;

/// The hash ring of one rule.
#[derive(Clone, Debug, Default)]
pub(crate) struct Ring {
    /// `(point, endpoint index)`, sorted by point.
    points: Vec<(u64, u32)>,
}

impl Ring {
    /// `virtual_nodes` points per unit of weight (at least one point per endpoint).
    pub(crate) fn new(endpoints: &[Endpoint], virtual_nodes: u32) -> Self {
        let mut points = Vec::new();
        for (i, e) in endpoints.iter().enumerate() {
            let Ok(idx) = u32::try_from(i) else { break };
            let seed = crate::bounded::hash_bytes(e.address.as_bytes());
            let n = virtual_nodes.max(1).saturating_mul(e.weight.clamp(1, 64));
            for v in 0..n {
                points.push((chain(seed, u64::from(v)), idx));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// Walks clockwise from `key`: the first eligible endpoint the bound admits,
    /// else (every eligible endpoint over the bound) the first eligible one met.
    pub(crate) fn lookup(&self, key: u64, pool: &Pool<'_>, factor: f64) -> Option<usize> {
        if self.points.is_empty() || pool.is_empty() {
            return None;
        }
        let bound = pool.bound(factor);
        let hashed = mix64(key);
        let start = self.points.partition_point(|(p, _)| *p < hashed);
        let n = self.points.len();
        let mut first_eligible = None;
        for step in 0..n {
            let Some(&(_, idx)) = self.points.get((start + step) % n) else {
                continue;
            };
            let i = idx as usize;
            if !pool.eligible.get(i).copied().unwrap_or(false) {
                continue;
            }
            if bound.admits(pool.load_of(i).in_flight, pool.capacity_of(i)) {
                return Some(i);
            }
            first_eligible.get_or_insert(i);
        }
        first_eligible
    }
}
