//! Simulation results: the JSON shape, the text table and the SVG chart.

use std::fmt::Write as _;

use serde::Serialize;

/// Mean and percentiles of one latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Mean.
    pub mean: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
}

impl Summary {
    /// Summarises microsecond samples (sorts them in place).
    #[must_use]
    pub fn of_us(samples: &mut [u64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let n = samples.len();
        let rank = |q: f64| {
            #[allow(
                clippy::cast_precision_loss,
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss
            )]
            let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
            #[allow(clippy::cast_precision_loss)]
            let v = samples.get(i).copied().unwrap_or(0) as f64 / 1000.0;
            v
        };
        let sum: u128 = samples.iter().map(|x| u128::from(*x)).sum();
        #[allow(clippy::cast_precision_loss)]
        let mean = sum as f64 / n as f64 / 1000.0;
        Self {
            mean,
            p50: rank(0.50),
            p99: rank(0.99),
        }
    }
}

/// How evenly the work spread.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadReport {
    /// Time-averaged requests in flight per worker: the busiest worker over
    /// the mean.
    pub max_over_mean_in_flight: f64,
    /// Time-averaged requests in flight, mean over workers.
    pub mean_in_flight: f64,
    /// Time-averaged requests in flight of the busiest worker.
    pub max_in_flight: f64,
    /// Requests routed to the busiest worker over the mean.
    pub routed_max_over_mean: f64,
    /// Placements that took a worker above `⌈(1+ε)·mean⌉` in-flight requests
    /// (the `kv-bounded` cap), as a fraction of served requests.
    pub over_bound_fraction: f64,
}

impl LoadReport {
    /// From per-worker time-averaged in-flight counts and routed counts.
    #[must_use]
    pub fn new(avg_in_flight: &[f64], routed: &[u64], over_bound: u64, served: u64) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let n = avg_in_flight.len().max(1) as f64;
        let mean = avg_in_flight.iter().sum::<f64>() / n;
        let max = avg_in_flight.iter().copied().fold(0.0, f64::max);
        #[allow(clippy::cast_precision_loss)]
        let routed_mean = routed.iter().sum::<u64>() as f64 / routed.len().max(1) as f64;
        #[allow(clippy::cast_precision_loss)]
        let routed_max = routed.iter().copied().max().unwrap_or(0) as f64;
        let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        #[allow(clippy::cast_precision_loss)]
        Self {
            max_over_mean_in_flight: div(max, mean),
            mean_in_flight: mean,
            max_in_flight: max,
            routed_max_over_mean: div(routed_max, routed_mean),
            over_bound_fraction: div(over_bound as f64, served as f64),
        }
    }
}

/// What the rule decided, and how well its predictions held.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoutingReport {
    /// KV-exact decisions with a non-zero overlap.
    pub kv_hits: u64,
    /// Decisions made by the fallback selector.
    pub fallbacks: u64,
    /// `kv-bounded` picks that passed over a better-overlap worker for load.
    pub load_diversions: u64,
    /// Σ cached tokens the index predicted for KV-exact picks.
    pub predicted_cached_tokens: u64,
    /// Of those, Σ the workers actually served from cache.
    pub delivered_of_predicted: u64,
    /// `delivered_of_predicted / predicted_cached_tokens` (stale or missing
    /// events lower it).
    pub prediction_accuracy: Option<f64>,
}

/// The KV event path.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EventReport {
    /// Batches the workers emitted.
    pub batches: u64,
    /// Batches lost on the way.
    pub lost: u64,
    /// Gaps the sequence windows absorbed (inventory kept).
    pub gaps_kept: u64,
    /// Gaps beyond the window (inventory cleared).
    pub gaps_cleared: u64,
    /// Endpoint clears, any cause.
    pub clears: u64,
}

/// One policy's results.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Policy name.
    pub policy: String,
    /// Requests in the workload.
    pub requests: u64,
    /// Requests that ran.
    pub served: u64,
    /// Requests no worker could hold (prompt + output beyond the KV capacity).
    pub rejected: u64,
    /// Prompt tokens served from a worker's prefix cache over all prompt tokens.
    pub prefix_hit_ratio: f64,
    /// `prefix_hit_ratio` over the workload's pooled bound.
    pub hit_over_pooled: f64,
    /// Requests with at least one cached block.
    pub requests_with_hit: f64,
    /// Time to first token.
    pub ttft_ms: Summary,
    /// Arrival to last token.
    pub e2e_ms: Summary,
    /// Served requests per second of simulated time.
    pub throughput_rps: f64,
    /// Generated tokens per second of simulated time.
    pub output_tokens_per_s: f64,
    /// First arrival to last completion, simulated seconds.
    pub makespan_s: f64,
    /// Load spread.
    pub load: LoadReport,
    /// Decision evidence.
    pub routing: RoutingReport,
    /// Event path.
    pub events: EventReport,
    /// Load shared between gateway replicas (all zero with one replica or
    /// sharing off).
    pub replica_sync: ReplicaSyncReport,
    /// Per-request samples behind the figures (the HTML report's charts; not
    /// in the JSON).
    #[serde(skip)]
    pub samples: PolicySamples,
}

/// Per-request samples of one policy's run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySamples {
    /// Every served request's time to first token, µs, ascending.
    pub ttft_us: Vec<u64>,
    /// Every placement: (arrival µs of simulated time, worker), in arrival order.
    pub routed: Vec<(u64, u32)>,
}

/// What the replicas sent each other: each message is published once and
/// reaches every other replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ReplicaSyncReport {
    /// Messages published.
    pub messages: u64,
    /// Endpoint entries in them.
    pub endpoint_entries: u64,
    /// Their bytes as the NATS transport encodes them (JSON, before the
    /// NATS protocol's own framing).
    pub bytes: u64,
    /// `bytes` per served request.
    pub per_decision_bytes: f64,
}

/// The workload as run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkloadReport {
    /// Trace file or synthetic kind.
    pub source: String,
    /// Requests.
    pub requests: u64,
    /// Σ prompt tokens.
    pub prompt_tokens: u64,
    /// Prefix-hit ratio of one infinite shared cache (an upper bound).
    pub ideal_prefix_hit_ratio: f64,
    /// The `pooled` bound: one LRU cache with the fleet's total capacity.
    pub pooled_prefix_hit_ratio: f64,
}

/// The fleet as configured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FleetReport {
    /// Workers.
    pub workers: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity per worker, blocks.
    pub capacity_blocks: u32,
    /// Running requests per worker.
    pub max_running: u32,
    /// Prefill: µs per step.
    pub prefill_step_us: f64,
    /// Prefill: µs per uncached token.
    pub prefill_us_per_token: f64,
    /// Prefill batching budget, tokens per step.
    pub max_batched_tokens: u32,
    /// Decode: µs per output token.
    pub decode_us_per_token: f64,
    /// Event delivery delay, ms.
    pub event_delay_ms: f64,
    /// Event batch loss probability.
    pub event_loss: f64,
    /// Sequence window.
    pub seq_window: u64,
    /// Closed-loop concurrency, if any.
    pub concurrency: Option<u32>,
    /// Arrival time scale.
    pub time_scale: f64,
    /// Requests of one instant spread over this many µs.
    pub arrival_spread_us: u64,
    /// `kv-bounded` ε.
    pub epsilon: f64,
    /// CHWBL load factor.
    pub chwbl_factor: f64,
    /// Candidate sampling's draws on large pools (0: off).
    pub sample_size: u32,
    /// `kv-bounded` prefill tokens per in-flight request.
    pub tokens_per_in_flight: f64,
    /// `kv-bounded` fallback selector.
    pub bounded_fallback: String,
    /// Seed.
    pub seed: u64,
    /// Gateway replicas behind a random front end.
    pub replicas: usize,
    /// Engine load poll interval, ms (0 = never).
    pub load_poll_ms: f64,
    /// Replica decision-sharing delay, ms (0 = replicas do not share).
    pub replica_sync_ms: f64,
    /// Replicas' turns within a burst: rank k holds k times this, ms (0 =
    /// no turns).
    pub replica_stagger_ms: f64,
    /// Requests without a home wait this long in a burst, ms (0 = off).
    pub burst_order_ms: f64,
    /// The peers' gauge scrape interval, ms (0 = exact at each decision).
    pub peer_poll_ms: f64,
}

/// A whole run: what `--json` writes. Holds no wall-clock figures, so the same
/// inputs give the same file.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// Workload.
    pub workload: WorkloadReport,
    /// Fleet.
    pub fleet: FleetReport,
    /// One entry per policy, in the order run.
    pub policies: Vec<PolicyReport>,
}

impl SimReport {
    /// The text table.
    #[must_use]
    pub fn table(&self) -> String {
        let mut s = String::new();
        let w = &self.workload;
        let f = &self.fleet;
        let _ = writeln!(
            s,
            "workload {}: {} requests, {} prompt tokens; {} workers, block {} tokens, {} blocks each",
            w.source, w.requests, w.prompt_tokens, f.workers, f.block_size, f.capacity_blocks
        );
        let _ = writeln!(
            s,
            "ideal prefix-hit ratio (one infinite cache): {:.1}%; pooled bound (one LRU cache of the fleet's capacity): {:.1}%",
            w.ideal_prefix_hit_ratio * 100.0,
            w.pooled_prefix_hit_ratio * 100.0
        );
        if f.replicas > 1 {
            let _ = writeln!(
                s,
                "{} gateway replicas behind a random front end; engine load polled every {} ms; decisions shared after {} ms (0 = not shared); turns within a burst {} ms apart (0 = none)",
                f.replicas, f.load_poll_ms, f.replica_sync_ms, f.replica_stagger_ms
            );
        }
        let _ = writeln!(
            s,
            "peer policies scrape engine gauges every {} ms (0 = exact at each decision)",
            f.peer_poll_ms
        );
        let _ = writeln!(
            s,
            "{:<15} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>7}",
            "policy",
            "hit%",
            "/pool",
            "ttft_mean",
            "ttft_p50",
            "ttft_p99",
            "e2e_p50",
            "e2e_p99",
            "req/s",
            "load_mx",
            "route_mx",
            "ovr_bnd"
        );
        for p in &self.policies {
            let _ = writeln!(
                s,
                "{:<15} {:>6.1} {:>6.2} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>6.1}%",
                p.policy,
                p.prefix_hit_ratio * 100.0,
                p.hit_over_pooled,
                p.ttft_ms.mean,
                p.ttft_ms.p50,
                p.ttft_ms.p99,
                p.e2e_ms.p50,
                p.e2e_ms.p99,
                p.throughput_rps,
                p.load.max_over_mean_in_flight,
                p.load.routed_max_over_mean,
                p.load.over_bound_fraction * 100.0
            );
        }
        let lossy = self.policies.iter().any(|p| p.events.lost > 0);
        if lossy {
            for p in self
                .policies
                .iter()
                .filter(|p| p.routing.predicted_cached_tokens > 0)
            {
                let _ = writeln!(
                    s,
                    "{:<15} events: {} batches, {} lost, {} gaps kept, {} cleared; prediction accuracy {:.1}%",
                    p.policy,
                    p.events.batches,
                    p.events.lost,
                    p.events.gaps_kept,
                    p.events.gaps_cleared,
                    p.routing.prediction_accuracy.unwrap_or(0.0) * 100.0
                );
            }
        }
        s.push_str("(ms; /pool = hit ratio over the pooled bound; load_mx = time-averaged in-flight max/mean; route_mx = routed max/mean; ovr_bnd = placements above the bounded-load cap)\n");
        s
    }

    /// A self-contained SVG: prefix-hit ratio per policy (with the ideal as a
    /// dashed line) above TTFT p50 / p99 per policy.
    #[must_use]
    pub fn svg(&self) -> String {
        let n = self.policies.len().max(1);
        let group = 96.0;
        let left = 64.0;
        let width = left + group * n as f64 + 24.0;
        let panel = 180.0;
        let top1 = 48.0;
        let top2 = top1 + panel + 64.0;
        let height = top2 + panel + 56.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="20" font-size="14">{} — {} workers, block {}</text>"#,
            escape(&self.workload.source),
            self.fleet.workers,
            self.fleet.block_size
        );
        // Panel 1: hit ratio (0..100 %).
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="{:.0}">prefix-hit ratio (%) — dashed: ideal (one infinite cache)</text>"#,
            top1 - 8.0
        );
        axis(&mut s, left, top1, panel, width, 100.0, "%");
        for (i, p) in self.policies.iter().enumerate() {
            let x = left + group * i as f64 + 20.0;
            let h = p.prefix_hit_ratio.clamp(0.0, 1.0) * panel;
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="56" height="{h:.1}" fill="#4c78a8"><title>{} {:.1}%</title></rect>"##,
                top1 + panel - h,
                escape(&p.policy),
                p.prefix_hit_ratio * 100.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{:.1}</text>"#,
                x + 28.0,
                top1 + panel - h - 3.0,
                p.prefix_hit_ratio * 100.0
            );
        }
        let ideal_y = top1 + panel - self.workload.ideal_prefix_hit_ratio.clamp(0.0, 1.0) * panel;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.1}" y1="{ideal_y:.1}" y2="{ideal_y:.1}" stroke="#e45756" stroke-dasharray="6 4"/>"##,
            width - 24.0
        );
        // Panel 2: TTFT p50 / p99 (ms), log scale: one overloaded policy can be
        // a thousand times slower than the rest.
        let max_ttft = self
            .policies
            .iter()
            .map(|p| p.ttft_ms.p99.max(p.ttft_ms.p50))
            .fold(10.0, f64::max);
        let decades = max_ttft.log10().ceil().max(1.0);
        let _ = writeln!(
            s,
            r##"<text x="{left}" y="{:.0}">TTFT (ms, log scale): <tspan fill="#72b7b2">p50</tspan> / <tspan fill="#f58518">p99</tspan></text>"##,
            top2 - 8.0
        );
        log_axis(&mut s, left, top2, panel, width, decades);
        for (i, p) in self.policies.iter().enumerate() {
            let x = left + group * i as f64 + 20.0;
            for (j, (v, color)) in [(p.ttft_ms.p50, "#72b7b2"), (p.ttft_ms.p99, "#f58518")]
                .into_iter()
                .enumerate()
            {
                let h = (v.max(1.0).log10() / decades).clamp(0.0, 1.0) * panel;
                let bx = x + 28.0 * j as f64;
                let _ = writeln!(
                    s,
                    r#"<rect x="{bx:.1}" y="{:.1}" width="26" height="{h:.1}" fill="{color}"><title>{} {:.0} ms</title></rect>"#,
                    top2 + panel - h,
                    escape(&p.policy),
                    v
                );
            }
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x + 28.0,
                top2 + panel + 16.0,
                escape(&p.policy)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

/// Y axis with five gridlines from 0 to `max`.
fn axis(s: &mut String, left: f64, top: f64, panel: f64, width: f64, max: f64, unit: &str) {
    for k in 0..=4 {
        let v = max * f64::from(k) / 4.0;
        let y = top + panel - panel * f64::from(k) / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#dddddd"/>"##,
            width - 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}{unit}</text>"#,
            left - 6.0,
            y + 4.0,
            fmt_tick(v)
        );
    }
}

/// Y axis with one gridline per power of ten, 1 to `10^decades`.
fn log_axis(s: &mut String, left: f64, top: f64, panel: f64, width: f64, decades: f64) {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = decades as u32;
    for k in 0..=n {
        let y = top + panel - panel * f64::from(k) / decades;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#dddddd"/>"##,
            width - 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 6.0,
            y + 4.0,
            fmt_tick(10f64.powi(i32::try_from(k).unwrap_or(0)))
        );
    }
}

fn fmt_tick(v: f64) -> String {
    if v >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<u64> = (1..=100).map(|x| x * 1000).collect();
        let s = Summary::of_us(&mut v);
        assert_eq!(s.p50, 50.0);
        assert_eq!(s.p99, 99.0);
        assert!((s.mean - 50.5).abs() < 1e-9);
    }
}
