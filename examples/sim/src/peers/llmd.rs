//! llm-d's weighted prefix / queue / KV-utilisation scorers.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{argmax_random_ties, f, PeerPolicy, PeerRequest, WorkerView};

/// llm-d's inference scheduler with the precise prefix-cache, queue and
/// KV-utilisation scorers and the max-score picker (see the source file's
/// module comment).
#[derive(Debug)]
pub struct LlmdWeighted {
    prefix_weight: f64,
    queue_weight: f64,
    kv_cache_weight: f64,
    rng: StdRng,
    scores: Vec<f64>,
}

impl LlmdWeighted {
    /// The weights of llm-d's shipped precise-prefix-cache configuration:
    /// prefix 2, queue 1, KV utilisation 1.
    #[must_use]
    pub fn new(workers: usize, seed: u64) -> Self {
        Self {
            prefix_weight: 2.0,
            queue_weight: 1.0,
            kv_cache_weight: 1.0,
            rng: StdRng::seed_from_u64(seed),
            scores: Vec::with_capacity(workers),
        }
    }

    /// All three weights at once (the EPP's built-in default profile is
    /// prefix 3, queue 2, KV utilisation 2).
    #[must_use]
    pub fn with_weights(mut self, prefix: f64, queue: f64, kv_cache: f64) -> Self {
        self.prefix_weight = prefix;
        self.queue_weight = queue;
        self.kv_cache_weight = kv_cache;
        self
    }

    /// Weight of the precise prefix-cache scorer.
    #[must_use]
    pub fn with_prefix_weight(mut self, weight: f64) -> Self {
        self.prefix_weight = weight;
        self
    }

    /// Weight of the queue scorer.
    #[must_use]
    pub fn with_queue_weight(mut self, weight: f64) -> Self {
        self.queue_weight = weight;
        self
    }

    /// Weight of the KV-cache-utilisation scorer.
    #[must_use]
    pub fn with_kv_cache_weight(mut self, weight: f64) -> Self {
        self.kv_cache_weight = weight;
        self
    }

    /// Fills `out` with each worker's weighted score (higher is better).
    pub fn scores(&self, req: &PeerRequest<'_>, workers: &[WorkerView], out: &mut Vec<f64>) {
        out.clear();
        let (min_q, max_q) = workers.iter().fold((u32::MAX, 0), |(lo, hi), w| {
            (lo.min(w.waiting), hi.max(w.waiting))
        });
        let total_blocks = req.keys.len() as u64;
        for w in workers {
            let prefix = if total_blocks == 0 {
                0.0
            } else {
                (f64::from(w.prefix_blocks) / f(total_blocks)).min(1.0)
            };
            let queue = if max_q == min_q {
                1.0
            } else {
                f64::from(max_q - w.waiting) / f64::from(max_q - min_q)
            };
            let kv = 1.0 - w.kv_usage;
            out.push(
                self.prefix_weight * prefix + self.queue_weight * queue + self.kv_cache_weight * kv,
            );
        }
    }
}

impl PeerPolicy for LlmdWeighted {
    fn name(&self) -> &'static str {
        "llmd-weighted"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], _now_us: u64) -> usize {
        let mut scores = std::mem::take(&mut self.scores);
        self.scores(req, workers, &mut scores);
        let chosen = argmax_random_ties(&scores, &mut self.rng);
        self.scores = scores;
        chosen
    }
}
