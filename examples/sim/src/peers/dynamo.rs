//! NVIDIA Dynamo's KV-router cost function.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{argmin_random_ties, f, PeerPolicy, PeerRequest, WorkerView};

/// NVIDIA Dynamo's KV-router cost function (see the source file's module comment).
#[derive(Debug)]
pub struct DynamoCost {
    overlap_score_credit: f64,
    prefill_load_scale: f64,
    overlap_score_credit_decay: f64,
    decode_active_request_weight: f64,
    router_temperature: f64,
    rng: StdRng,
    costs: Vec<f64>,
    probabilities: Vec<f64>,
}

impl DynamoCost {
    /// Dynamo's defaults: credit 1, prefill scale 1, no decay, no per-request
    /// decode weight, temperature 0 (argmin).
    #[must_use]
    pub fn new(workers: usize, seed: u64) -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            overlap_score_credit_decay: 0.0,
            decode_active_request_weight: 0.0,
            router_temperature: 0.0,
            rng: StdRng::seed_from_u64(seed),
            costs: Vec::with_capacity(workers),
            probabilities: Vec::with_capacity(workers),
        }
    }

    /// `overlap_score_credit` (0..=1): fraction of a cached block credited
    /// against the prefill load; 0 ignores the cache.
    #[must_use]
    pub fn with_overlap_score_credit(mut self, credit: f64) -> Self {
        self.overlap_score_credit = credit;
        self
    }

    /// `prefill_load_scale`: weight of the prefill term after the credit.
    #[must_use]
    pub fn with_prefill_load_scale(mut self, scale: f64) -> Self {
        self.prefill_load_scale = scale;
        self
    }

    /// The deprecated `overlap_score_weight`, mapped as Dynamo maps it: it
    /// becomes `prefill_load_scale`, and 0 also zeroes the overlap credit.
    #[must_use]
    pub fn with_overlap_score_weight(mut self, weight: f64) -> Self {
        self.prefill_load_scale = weight;
        if weight == 0.0 {
            self.overlap_score_credit = 0.0;
        }
        self
    }

    /// `overlap_score_credit_decay`: shrinks the credit of workers whose
    /// queued prefill exceeds the least-loaded one's, relative to this
    /// request's size.
    #[must_use]
    pub fn with_overlap_score_credit_decay(mut self, decay: f64) -> Self {
        self.overlap_score_credit_decay = decay;
        self
    }

    /// `decode_active_request_weight`: blocks charged per request in flight.
    #[must_use]
    pub fn with_decode_active_request_weight(mut self, weight: f64) -> Self {
        self.decode_active_request_weight = weight;
        self
    }

    /// `router_temperature`: 0 picks the least cost; above 0 samples a
    /// softmax of the min-max-normalised negated costs.
    #[must_use]
    pub fn with_router_temperature(mut self, temperature: f64) -> Self {
        self.router_temperature = temperature;
        self
    }

    /// Fills `out` with each worker's cost (the logit Dynamo minimises).
    pub fn costs(&self, req: &PeerRequest<'_>, workers: &[WorkerView], out: &mut Vec<f64>) {
        out.clear();
        let bs = f64::from(req.block_size.max(1));
        let isl = f64::from(req.prompt_tokens);
        let request_blocks = f64::from(req.prompt_tokens.div_ceil(req.block_size.max(1)).max(1));
        let prompt_blocks = req.keys.len() as u64;
        let min_queued = workers
            .iter()
            .map(|w| w.queued_prefill_tokens)
            .min()
            .unwrap_or(0);
        for w in workers {
            let raw_prefill_blocks = (f(w.queued_prefill_tokens) + isl) / bs;
            let decay = if self.overlap_score_credit_decay > 0.0 {
                let excess = f(w.queued_prefill_tokens.saturating_sub(min_queued)) / bs;
                1.0 / (1.0 + self.overlap_score_credit_decay * excess / request_blocks)
            } else {
                1.0
            };
            let credit = self.overlap_score_credit * decay * f64::from(w.prefix_blocks);
            let prefill = self.prefill_load_scale * (raw_prefill_blocks - credit).max(0.0);
            let new_blocks = prompt_blocks.saturating_sub(u64::from(w.active_prefix_blocks));
            let decode = f(w.active_blocks.saturating_add(new_blocks));
            let requests = self.decode_active_request_weight * f64::from(w.in_flight);
            out.push(prefill + decode + requests);
        }
    }
}

/// Softmax probabilities of Dynamo's sampler: `p_i ∝ exp(−(c_i − min) /
/// ((max − min) × T))`, uniform when every cost is equal.
pub fn softmax_probabilities(costs: &[f64], temperature: f64, out: &mut Vec<f64>) {
    out.clear();
    if costs.is_empty() {
        return;
    }
    let (lo, hi) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
            (lo.min(c), hi.max(c))
        });
    #[allow(clippy::cast_precision_loss)]
    let n = costs.len() as f64;
    let range = hi - lo;
    if range <= 0.0 || !range.is_finite() || temperature <= 0.0 || !temperature.is_finite() {
        out.resize(costs.len(), 1.0 / n);
        return;
    }
    out.extend(
        costs
            .iter()
            .map(|&c| (-(c - lo) / (range * temperature)).exp()),
    );
    let sum: f64 = out.iter().sum();
    for p in out.iter_mut() {
        *p /= sum;
    }
}

/// The first index whose cumulative probability reaches `sample` (the last one
/// if rounding leaves the sum short).
pub(crate) fn sample_index(probabilities: &[f64], sample: f64) -> usize {
    let mut cumulative = 0.0;
    for (i, p) in probabilities.iter().enumerate() {
        cumulative += p;
        if sample <= cumulative {
            return i;
        }
    }
    probabilities.len().saturating_sub(1)
}

impl PeerPolicy for DynamoCost {
    fn name(&self) -> &'static str {
        "dynamo-cost"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], _now_us: u64) -> usize {
        let mut costs = std::mem::take(&mut self.costs);
        self.costs(req, workers, &mut costs);
        let chosen = if self.router_temperature > 0.0 {
            softmax_probabilities(&costs, self.router_temperature, &mut self.probabilities);
            let u: f64 = self.rng.gen();
            sample_index(&self.probabilities, u)
        } else {
            argmin_random_ties(&costs, &mut self.rng)
        };
        self.costs = costs;
        chosen
    }
}
