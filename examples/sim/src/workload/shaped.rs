//! The bursty conversation generator behind `chat-bursts` and `agent-bursts`:
//! a workload whose statistics are set, not emergent.
//!
//! * **Arrivals in bursts.** `requests / burst_mean` distinct millisecond
//!   instants over the duration, the first at 0: evenly spaced
//!   ([`Spacing::Periodic`], as a batch front end or a trace logged at a
//!   fixed tick delivers them) or uniform ([`Spacing::Random`], a Poisson
//!   process conditioned on its count). Each instant carries one request
//!   plus its share of the rest: each of those lands on a uniformly drawn
//!   instant ([`BurstSizes::Poisson`]: sizes 1 + Poisson(`burst_mean` − 1),
//!   batch arrivals), or shares go in proportion to Pareto type II weights of
//!   shape `burst_alpha` ([`BurstSizes::Pareto`]: many instants of one or a
//!   few requests, a few of a hundred or more).
//! * **Prompt lengths** are drawn independently of everything else from a
//!   log-normal truncated to `[prompt_min, prompt_max]`, its two parameters
//!   solved so that the truncated distribution has the requested median and
//!   mean.
//! * **One shared root.** Every prompt starts with the same `root_tokens`
//!   (one 512-token block by default).
//! * **Conversations.** A request either starts a conversation (root + fresh
//!   tokens) or is the next turn of an open one: that conversation's whole
//!   last prompt, then fresh tokens (its answer and the next message) up to
//!   the drawn length. A turn comes at least `think_s` after the previous one
//!   (the answer must exist) and a conversation idle for `idle_s` ends.
//!   Which: the generator tracks the ideal reuse so far (the tokens of each
//!   prompt that an earlier prompt already sent, counted in 16-token blocks
//!   as [`crate::fleet::ideal_hit_ratio`] counts them) and continues a
//!   conversation only while that is below `reuse` — then the open one with
//!   the longest prompt that fits (a turn adds the least). Since lengths are
//!   drawn first, the choice never changes the length distribution.

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::Rng;

use super::{uniform, Gen, Kind, Segment, MOONCAKE_BLOCK_TOKENS};

/// Statistics of the bursty conversation kinds (`chat-bursts`,
/// `agent-bursts`); the other kinds ignore them. See the source file's
/// module comment for how each is produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// Span of the arrivals, seconds (first to last instant); `None`:
    /// requests / rate.
    pub duration_s: Option<f64>,
    /// Shortest prompt, tokens.
    pub prompt_min: u32,
    /// Longest prompt, tokens.
    pub prompt_max: u32,
    /// Mean prompt length, tokens.
    pub prompt_mean: f64,
    /// Median prompt length, tokens.
    pub prompt_median: f64,
    /// Ideal prefix reuse: the fraction of prompt tokens an infinite shared
    /// cache would serve.
    pub reuse: f64,
    /// Mean requests per distinct arrival instant (1: no bursts).
    pub burst_mean: f64,
    /// How the requests are shared among the instants.
    pub burst_sizes: BurstSizes,
    /// Pareto shape of [`BurstSizes::Pareto`] (> 1; smaller: heavier tail).
    pub burst_alpha: f64,
    /// Where the instants fall.
    pub spacing: Spacing,
    /// Tokens every prompt starts with (0: no shared root). Shared at
    /// 512-token granularity, as the trace format identifies blocks.
    pub root_tokens: u32,
    /// Output tokens, uniform in this range.
    pub output: (u32, u32),
    /// A conversation's next turn comes at least this long after its last,
    /// seconds.
    pub think_s: f64,
    /// A conversation idle this long ends, seconds.
    pub idle_s: f64,
}

/// How a bursty workload's requests are shared among its instants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BurstSizes {
    /// Batch arrivals: one request per instant, each other request on a
    /// uniformly drawn instant (sizes 1 + Poisson).
    Poisson,
    /// One request per instant, the rest in proportion to Pareto type II
    /// weights (heavy-tailed sizes).
    Pareto,
}

/// Where a bursty workload's instants fall.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Spacing {
    /// Evenly spaced over the duration.
    Periodic,
    /// Uniformly over the duration (Poisson, conditioned on the count).
    Random,
}

/// A [`Shape`] that cannot be generated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ShapeError(String);

impl Shape {
    /// The kind's defaults. `chat-bursts`: the statistics of a real one-hour
    /// multi-turn conversation trace (Mooncake's `conversation_trace.jsonl`:
    /// 12 031 requests at 1 180 distinct milliseconds, one every 3 s with
    /// 10.2 requests on average, Poisson-like; prompts 891–126 195 tokens
    /// with mean 12 035 and median 6 909; 37 % ideal reuse; one root block
    /// shared by every request; mean output 343 tokens). `agent-bursts`:
    /// short agent turns (1 100–32 768 tokens, mean 4 000, median 2 500),
    /// 60 % reuse, heavy-tailed bursts of 12 on average at random instants,
    /// a 1 024-token root. Other kinds get the `chat-bursts` values (unused).
    #[must_use]
    pub fn for_kind(kind: Kind) -> Self {
        match kind {
            Kind::AgentBursts => Self {
                duration_s: None,
                prompt_min: 1_100,
                prompt_max: 32_768,
                prompt_mean: 4_000.0,
                prompt_median: 2_500.0,
                reuse: 0.6,
                burst_mean: 12.0,
                burst_sizes: BurstSizes::Pareto,
                burst_alpha: 3.0,
                spacing: Spacing::Random,
                root_tokens: 1024,
                output: (20, 300),
                think_s: 2.0,
                idle_s: 120.0,
            },
            _ => Self {
                duration_s: None,
                prompt_min: 900,
                prompt_max: 126_000,
                prompt_mean: 12_000.0,
                prompt_median: 6_900.0,
                reuse: 0.37,
                burst_mean: 12_031.0 / 1_180.0,
                burst_sizes: BurstSizes::Poisson,
                burst_alpha: 3.0,
                spacing: Spacing::Periodic,
                root_tokens: 512,
                output: (1, 700),
                think_s: 10.0,
                idle_s: 900.0,
            },
        }
    }

    /// Whether the values can be generated.
    ///
    /// # Errors
    /// The first value out of range, named as its CLI flag.
    pub fn check(&self) -> Result<(), ShapeError> {
        let bad = |m: &str| Err(ShapeError(m.to_owned()));
        if self.prompt_min == 0 || self.prompt_min >= self.prompt_max {
            return bad("--prompt-min must be at least 1 and below --prompt-max");
        }
        let (lo, hi) = (f64::from(self.prompt_min), f64::from(self.prompt_max));
        if !(self.prompt_median > lo && self.prompt_median < hi) {
            return bad("--prompt-median must lie strictly between --prompt-min and --prompt-max");
        }
        if !(self.prompt_mean > lo && self.prompt_mean < hi) {
            return bad("--prompt-mean must lie strictly between --prompt-min and --prompt-max");
        }
        if !(0.0..1.0).contains(&self.reuse) {
            return bad("--reuse must be in [0, 1)");
        }
        if !(self.burst_mean.is_finite() && self.burst_mean >= 1.0) {
            return bad("--burst-mean must be at least 1");
        }
        if !(self.burst_alpha.is_finite() && self.burst_alpha > 1.0) {
            return bad("--burst-alpha must be above 1");
        }
        if self.root_tokens >= self.prompt_min {
            return bad("--root-tokens must be below --prompt-min");
        }
        if self.output.0 > self.output.1 {
            return bad("the output range is empty");
        }
        if !(self.think_s.is_finite() && self.think_s >= 0.0) {
            return bad("--think-s must be a non-negative number");
        }
        if !(self.idle_s.is_finite() && self.idle_s >= self.think_s) {
            return bad("--idle-s must be a number at least --think-s");
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                return bad("--duration-s must be a positive number");
            }
        }
        Ok(())
    }
}

/// The standard normal CDF (erfc with fractional error below 1.2e-7,
/// Numerical Recipes' `erfcc`).
fn phi(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// The standard normal quantile (Acklam's rational approximation, one
/// Newton step on [`phi`]).
fn phi_inv(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    let x = if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    };
    let e = phi(x) - p;
    let u = e * (2.0 * std::f64::consts::PI).sqrt() * (x * x / 2.0).exp();
    x - u / (1.0 + x * u / 2.0)
}

/// A log-normal truncated to `[min, max]`: `ln X ~ N(mu, s²)` conditioned on
/// the bounds, sampled by inverse transform.
#[derive(Clone, Copy, Debug)]
struct Lengths {
    mu: f64,
    s: f64,
    lo: f64,
    hi: f64,
    min: u32,
    max: u32,
}

impl Lengths {
    fn new(mu: f64, s: f64, min: u32, max: u32) -> Self {
        let (a, b) = (f64::from(min).ln(), f64::from(max).ln());
        Self {
            mu,
            s,
            lo: phi((a - mu) / s),
            hi: phi((b - mu) / s),
            min,
            max,
        }
    }

    fn median(&self) -> f64 {
        (self.mu + self.s * phi_inv(0.5 * (self.lo + self.hi))).exp()
    }

    fn mean(&self) -> f64 {
        let z = self.hi - self.lo;
        if z <= 0.0 {
            return self.mu.exp();
        }
        let (a, b) = (f64::from(self.min).ln(), f64::from(self.max).ln());
        let (al, be) = ((a - self.mu) / self.s, (b - self.mu) / self.s);
        (self.mu + self.s * self.s / 2.0).exp() * (phi(be - self.s) - phi(al - self.s)) / z
    }

    /// The truncated log-normal with the given median and (as near as the
    /// bounds allow) mean: for each `s` the `mu` giving the median
    /// (bisection; the median grows with `mu`), and `s` by bisection on the
    /// mean (which grows with `s` at a fixed median).
    fn fit(min: u32, max: u32, mean: f64, median: f64) -> Self {
        let (a, b) = (f64::from(min).ln(), f64::from(max).ln());
        let target = median.clamp(f64::from(min), f64::from(max));
        let with_median = |s: f64| {
            let (mut lo, mut hi) = (a - 10.0 * s - 1.0, b + 10.0 * s + 1.0);
            for _ in 0..100 {
                let mid = 0.5 * (lo + hi);
                if Self::new(mid, s, min, max).median() < target {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            Self::new(0.5 * (lo + hi), s, min, max)
        };
        let (mut lo, mut hi) = (1e-3, 6.0);
        for _ in 0..100 {
            let mid = 0.5 * (lo + hi);
            if with_median(mid).mean() < mean {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        with_median(0.5 * (lo + hi))
    }

    fn sample(&self, rng: &mut StdRng) -> u32 {
        let u: f64 = rng.gen();
        let x = (self.mu + self.s * phi_inv(self.lo + u * (self.hi - self.lo))).exp();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let x = x.round().clamp(f64::from(self.min), f64::from(self.max)) as u32;
        x
    }
}

/// `d` distinct instants in milliseconds, the first at 0, the others evenly
/// spaced up to `span_ms` or uniform over `(0, span_ms]`, sorted.
fn instants(rng: &mut StdRng, d: usize, span_ms: u64, spacing: Spacing) -> Vec<u64> {
    let mut out = Vec::with_capacity(d);
    if d == 0 {
        return out;
    }
    out.push(0);
    if d > 1 && spacing == Spacing::Periodic && span_ms >= d as u64 {
        let step = span_ms as f64 / (d - 1) as f64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        out.extend((1..d).map(|i| (i as f64 * step).round() as u64));
        return out;
    }
    if (d as u64).saturating_mul(2) > span_ms {
        // Too dense to draw: evenly spaced (one per ms at most).
        out.extend((1..d as u64).map(|i| i * span_ms.max(d as u64) / d as u64));
        return out;
    }
    let mut seen: HashSet<u64> = HashSet::with_capacity(d);
    seen.insert(0);
    while out.len() < d {
        let t = rng.gen_range(1..=span_ms);
        if seen.insert(t) {
            out.push(t);
        }
    }
    out.sort_unstable();
    out
}

/// Sizes of `d` bursts holding `n ≥ d` requests: one each, the rest on
/// uniformly drawn bursts ([`BurstSizes::Poisson`]) or in proportion to
/// Pareto type II (Lomax, shape `alpha`) weights, which start at 0, so
/// single requests stay common while a few bursts are large (largest
/// remainders round).
fn burst_sizes(rng: &mut StdRng, n: usize, d: usize, sizes: BurstSizes, alpha: f64) -> Vec<usize> {
    if d == 0 {
        return Vec::new();
    }
    if sizes == BurstSizes::Poisson {
        let mut out = vec![1usize; d];
        for _ in d..n {
            out[rng.gen_range(0..d)] += 1;
        }
        return out;
    }
    let weights: Vec<f64> = (0..d)
        .map(|_| {
            let u: f64 = rng.gen_range(0.0..1.0);
            (1.0 - u).powf(-1.0 / alpha) - 1.0
        })
        .collect();
    let total: f64 = weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let extra = n.saturating_sub(d);
    #[allow(clippy::cast_precision_loss)]
    let shares: Vec<f64> = weights.iter().map(|w| extra as f64 * w / total).collect();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let mut sizes: Vec<usize> = shares.iter().map(|s| 1 + s.floor() as usize).collect();
    let given: usize = sizes.iter().sum::<usize>() - d;
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&i, &j| {
        let (fi, fj) = (shares[i] - shares[i].floor(), shares[j] - shares[j].floor());
        fj.total_cmp(&fi).then(i.cmp(&j))
    });
    for &i in order.iter().cycle().take(extra.saturating_sub(given)) {
        sizes[i] += 1;
    }
    sizes
}

/// Prompt tokens an earlier prompt already sent, as
/// [`crate::fleet::ideal_hit_ratio`] counts them at 16-token blocks: the
/// full blocks within the leading `seen_ids` 512-token blocks, at most all
/// but the last token.
fn reused_tokens(seen_ids: usize, input: u32) -> u64 {
    const B: u64 = 16;
    let input = u64::from(input);
    let covered = (seen_ids as u64 * u64::from(MOONCAKE_BLOCK_TOKENS)).min(input);
    (covered / B).min(input.saturating_sub(1) / B) * B
}

struct Conversation {
    segments: Vec<Segment>,
    len: u32,
    last_us: u64,
}

impl Gen<'_> {
    /// `n` requests of the bursty conversation kinds.
    pub(super) fn shaped(&mut self, n: usize, rate: f64, shape: &Shape) {
        let lengths = Lengths::fit(
            shape.prompt_min.max(1),
            shape.prompt_max.max(shape.prompt_min.max(1) + 1),
            shape.prompt_mean,
            shape.prompt_median,
        );
        #[allow(clippy::cast_precision_loss)]
        let duration_s = shape.duration_s.unwrap_or(n as f64 / rate);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let span_ms = (duration_s * 1000.0).round().max(1.0) as u64;
        let burst_mean = shape.burst_mean.max(1.0);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let d = ((n as f64 / burst_mean).round() as usize).clamp(usize::from(n > 0), n);
        let at = instants(self.rng, d, span_ms, shape.spacing);
        let sizes = burst_sizes(
            self.rng,
            n,
            d,
            shape.burst_sizes,
            shape.burst_alpha.max(1.0 + 1e-6),
        );
        let root = Segment {
            id: 0,
            len: shape.root_tokens,
        };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let think_us = (shape.think_s.max(0.0) * 1e6) as u64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let idle_us = (shape.idle_s.max(0.0) * 1e6) as u64;
        let root_reuse =
            u64::from(shape.root_tokens / MOONCAKE_BLOCK_TOKENS * MOONCAKE_BLOCK_TOKENS);
        let mut open: Vec<Conversation> = Vec::new();
        let mut seen: HashSet<u64> = HashSet::new();
        let (mut reused, mut total) = (0u64, 0u64);
        for (&ms, &size) in at.iter().zip(&sizes) {
            let t = ms * 1000;
            open.retain(|c| t.saturating_sub(c.last_us) <= idle_us);
            for _ in 0..size {
                let len = lengths.sample(self.rng);
                let output = uniform(self.rng, shape.output);
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss
                )]
                let want = (shape.reuse * (total + u64::from(len)) as f64) as u64;
                let fresh_reuse = if total > 0 { root_reuse } else { 0 };
                let turn = if reused + fresh_reuse >= want {
                    None
                } else {
                    open.iter()
                        .enumerate()
                        .filter(|(_, c)| c.last_us + think_us <= t && c.len < len)
                        .max_by(|(i, a), (j, b)| a.len.cmp(&b.len).then(j.cmp(i)))
                        .map(|(i, _)| i)
                };
                let segments = match turn {
                    Some(i) => {
                        let add = self.fresh(len - open[i].len);
                        let c = &mut open[i];
                        c.segments.push(add);
                        c.len = len;
                        c.last_us = t;
                        std::mem::take(&mut c.segments)
                    }
                    None => {
                        let first = self.fresh(len - shape.root_tokens.min(len - 1));
                        if shape.root_tokens > 0 {
                            vec![root, first]
                        } else {
                            vec![first]
                        }
                    }
                };
                #[allow(clippy::cast_precision_loss)]
                self.emit(t as f64, &segments, output);
                let lead = self
                    .scratch
                    .iter()
                    .take_while(|id| seen.contains(id))
                    .count();
                seen.extend(self.scratch.iter().copied());
                reused += reused_tokens(lead, len);
                total += u64::from(len);
                match turn {
                    Some(i) => open[i].segments = segments,
                    None => open.push(Conversation {
                        segments,
                        len,
                        last_us: t,
                    }),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn normal_quantile_inverts_the_cdf() {
        for p in [1e-6, 0.01, 0.2, 0.5, 0.7, 0.99, 1.0 - 1e-6] {
            assert!((phi(phi_inv(p)) - p).abs() < 1e-7 * p.max(1e-3), "{p}");
        }
        assert!((phi(1.959_964) - 0.975).abs() < 1e-6);
    }

    #[test]
    fn fitted_lengths_have_the_requested_median_and_mean() {
        let l = Lengths::fit(900, 126_000, 12_000.0, 6_900.0);
        assert!((l.median() / 6_900.0 - 1.0).abs() < 1e-3, "{}", l.median());
        assert!((l.mean() / 12_000.0 - 1.0).abs() < 1e-3, "{}", l.mean());
        let mut rng = StdRng::seed_from_u64(1);
        let mut xs: Vec<u32> = (0..40_000).map(|_| l.sample(&mut rng)).collect();
        xs.sort_unstable();
        let mean = xs.iter().map(|x| f64::from(*x)).sum::<f64>() / xs.len() as f64;
        assert!((mean / 12_000.0 - 1.0).abs() < 0.03, "{mean}");
        let median = f64::from(xs[xs.len() / 2]);
        assert!((median / 6_900.0 - 1.0).abs() < 0.03, "{median}");
        assert!(xs[0] >= 900 && xs[xs.len() - 1] <= 126_000);
    }

    #[test]
    fn bursts_hold_every_request_at_distinct_instants() {
        let mut rng = StdRng::seed_from_u64(2);
        for kind in [BurstSizes::Poisson, BurstSizes::Pareto] {
            let sizes = burst_sizes(&mut rng, 12_031, 1_180, kind, 2.0);
            assert_eq!(sizes.len(), 1_180);
            assert_eq!(sizes.iter().sum::<usize>(), 12_031);
            assert!(sizes.iter().all(|s| *s >= 1));
        }
        for spacing in [Spacing::Periodic, Spacing::Random] {
            let at = instants(&mut rng, 1_180, 3_537_000, spacing);
            assert_eq!(at.len(), 1_180);
            assert!(at.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(at.last().copied().map(|t| t <= 3_537_000), Some(true));
            assert_eq!(instants(&mut rng, 50, 10, spacing).len(), 50);
        }
        let at = instants(&mut rng, 1_180, 3_537_000, Spacing::Periodic);
        assert!(at
            .windows(2)
            .all(|w| (2_999..=3_001).contains(&(w[1] - w[0]))));
    }
}
