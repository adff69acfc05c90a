//! The candidate set of one decision step: which endpoints are eligible and what
//! load they carry, plus the bounded-load limit shared by CHWBL and the
//! load-aware scorer.

use crate::endpoint::Endpoint;
use crate::load::{Deciders, EndpointLoad};

/// Eligible endpoints and their loads, indexed by rule endpoint position.
#[derive(Clone, Copy)]
pub(crate) struct Pool<'a> {
    pub(crate) endpoints: &'a [Endpoint],
    pub(crate) eligible: &'a [bool],
    pub(crate) loads: &'a [EndpointLoad],
    /// The endpoints a sampled decision scores (ascending); empty: all.
    /// Only these can be eligible.
    pub(crate) sampled: &'a [u32],
}

/// The endpoints a decision step visits: a sampled decision's (ascending),
/// or every one of `0..n` when `sampled` is empty.
#[derive(Clone)]
pub(crate) enum Visit<'a> {
    All(std::ops::Range<usize>),
    Sampled(std::slice::Iter<'a, u32>),
}

impl<'a> Visit<'a> {
    pub(crate) fn new(sampled: &'a [u32], n: usize) -> Self {
        if sampled.is_empty() {
            Visit::All(0..n)
        } else {
            Visit::Sampled(sampled.iter())
        }
    }
}

impl Iterator for Visit<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        match self {
            Visit::All(r) => r.next(),
            Visit::Sampled(s) => s.next().map(|&i| i as usize),
        }
    }
}

impl<'a> Pool<'a> {
    /// `(index, endpoint, load)` of every eligible endpoint, in endpoint order.
    pub(crate) fn candidates(
        &self,
    ) -> impl Iterator<Item = (usize, &'a Endpoint, EndpointLoad)> + '_ {
        let visit = Visit::new(self.sampled, self.endpoints.len());
        let (endpoints, eligible, loads) = (self.endpoints, self.eligible, self.loads);
        visit.filter_map(move |i| {
            if !eligible.get(i).copied().unwrap_or(false) {
                return None;
            }
            Some((
                i,
                endpoints.get(i)?,
                loads.get(i).copied().unwrap_or_default(),
            ))
        })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.candidates().next().is_none()
    }

    pub(crate) fn load_of(&self, i: usize) -> EndpointLoad {
        self.loads.get(i).copied().unwrap_or_default()
    }

    pub(crate) fn capacity_of(&self, i: usize) -> u32 {
        self.endpoints.get(i).map_or(1, Endpoint::capacity_or_one)
    }

    /// The bounded-load limit over the eligible endpoints with factor `c`.
    pub(crate) fn bound(&self, c: f64) -> LoadBound {
        let (mut in_flight, mut capacity) = (0u64, 0u64);
        for (_, e, l) in self.candidates() {
            in_flight += u64::from(l.in_flight);
            capacity += u64::from(e.capacity_or_one());
        }
        LoadBound::new(in_flight, capacity, c)
    }

    /// Index of the least-utilised eligible endpoint (`in_flight / capacity`, then
    /// queued prefill tokens); among exact ties the `turn`-th one, so a
    /// round-robin counter only ever breaks ties, counted from `deciders`'
    /// own start among them ([`Deciders::rotate`]).
    pub(crate) fn least_loaded(&self, turn: u64, deciders: Deciders) -> Option<usize> {
        self.least_by(turn, deciders, compare_load)
    }

    /// Like [`Pool::least_loaded`], queued prefill tokens first.
    pub(crate) fn least_prefill(&self, turn: u64, deciders: Deciders) -> Option<usize> {
        self.least_by(turn, deciders, compare_prefill)
    }

    fn least_by(
        &self,
        turn: u64,
        deciders: Deciders,
        compare_load: fn(EndpointLoad, u32, EndpointLoad, u32) -> std::cmp::Ordering,
    ) -> Option<usize> {
        let mut best: Option<(usize, EndpointLoad, u32)> = None;
        let mut ties = 0u64;
        for (i, e, l) in self.candidates() {
            let cap = e.capacity_or_one();
            match best {
                None => {
                    best = Some((i, l, cap));
                    ties = 1;
                }
                Some((_, bl, bcap)) => match compare_load(l, cap, bl, bcap) {
                    std::cmp::Ordering::Less => {
                        best = Some((i, l, cap));
                        ties = 1;
                    }
                    std::cmp::Ordering::Equal => ties += 1,
                    std::cmp::Ordering::Greater => {}
                },
            }
        }
        let (_, bl, bcap) = best?;
        let mut k = deciders.rotate(turn, ties.max(1));
        for (i, e, l) in self.candidates() {
            if compare_load(l, e.capacity_or_one(), bl, bcap).is_eq() {
                if k == 0 {
                    return Some(i);
                }
                k -= 1;
            }
        }
        None
    }
}

/// Orders loads by queued prefill tokens per unit of capacity, then utilisation.
pub(crate) fn compare_prefill(
    a: EndpointLoad,
    acap: u32,
    b: EndpointLoad,
    bcap: u32,
) -> std::cmp::Ordering {
    (u128::from(a.queued_prefill_tokens) * u128::from(bcap))
        .cmp(&(u128::from(b.queued_prefill_tokens) * u128::from(acap)))
        .then_with(|| {
            (u64::from(a.in_flight) * u64::from(bcap))
                .cmp(&(u64::from(b.in_flight) * u64::from(acap)))
        })
}

/// Orders loads by utilisation, then queued prefill tokens per unit of capacity.
pub(crate) fn compare_load(
    a: EndpointLoad,
    acap: u32,
    b: EndpointLoad,
    bcap: u32,
) -> std::cmp::Ordering {
    let util =
        (u64::from(a.in_flight) * u64::from(bcap)).cmp(&(u64::from(b.in_flight) * u64::from(acap)));
    util.then_with(|| {
        (u128::from(a.queued_prefill_tokens) * u128::from(bcap))
            .cmp(&(u128::from(b.queued_prefill_tokens) * u128::from(acap)))
    })
}

/// Consistent-hashing-with-bounded-loads limit: endpoint `e` may take one more
/// request while `in_flight_e + 1 ≤ ⌈c · (Σ in_flight + 1) · cap_e / Σ cap⌉`
/// (for equal capacities: at most `c` times the mean load after this request).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadBound {
    /// Σ in-flight over the eligible endpoints.
    pub total_in_flight: u64,
    /// Σ capacity over the eligible endpoints (≥ 1).
    pub total_capacity: u64,
    /// `c = 1 + ε`, at least 1.
    pub factor: f64,
}

impl LoadBound {
    /// The limit over endpoints holding `in_flight` requests in all with
    /// `capacity` in all, with factor `c` (below 1 or not finite: 1).
    pub(crate) fn new(in_flight: u64, capacity: u64, c: f64) -> Self {
        Self {
            total_in_flight: in_flight,
            total_capacity: capacity.max(1),
            factor: if c.is_finite() && c >= 1.0 { c } else { 1.0 },
        }
    }

    /// The most requests an endpoint of capacity `capacity` may hold after
    /// taking this one.
    #[must_use]
    pub fn limit(&self, capacity: u32) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let share = (self.total_in_flight as f64 + 1.0) * f64::from(capacity.max(1))
            / self.total_capacity as f64;
        (self.factor * share).ceil()
    }

    /// Whether an endpoint with `in_flight` requests may take one more.
    #[must_use]
    pub fn admits(&self, in_flight: u32, capacity: u32) -> bool {
        f64::from(in_flight) + 1.0 <= self.limit(capacity)
    }
}
