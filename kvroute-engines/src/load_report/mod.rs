//! Engine-reported load: what an engine's own metrics endpoint says about its
//! queue and its KV cache, parsed sans-IO into one [`EngineLoadReport`].
//!
//! A gateway only sees the requests it sent itself; with N gateway replicas each
//! one sees about 1/N of an engine's load. The engines publish the whole picture
//! (every replica's requests, prefill and decode alike), so a poller of these
//! endpoints gives every replica the same, true load signal. The poller is the
//! thin shell in `transport::LoadPoller` (feature `trtllm-http`); everything here
//! is a pure function of the response body.
//!
//! The metric names per engine and version, the files they were read from, and
//! how ranks combine are documented on [`MetricsDialect`]. In short, the names come
//! from vLLM 0.33.0 `vllm/v1/metrics/loggers.py` (and `vllm/config/cache.py` for the
//! `cache_config_info` labels), SGLang 0.5.23
//! `sglang/srt/observability/metrics_collector.py`, and TensorRT-LLM
//! `tensorrt_llm/serve/openai_server.py` (`GET /metrics`) and
//! `tensorrt_llm/metrics/collector.py` (`trtllm_*` gauges, iteration-stats keys).

mod prometheus;
mod trtllm;

/// Largest metrics body [`parse_load`] accepts (16 MiB; a vLLM `/metrics` page with
/// eight DP engines is a few hundred KiB).
pub const MAX_METRICS_BODY_BYTES: usize = 16 << 20;

/// Most distinct ranks (DP engines) one body may describe.
pub const MAX_RANKS: usize = 1024;

/// Which engine's metrics format a body is in.
///
/// # Where each engine publishes what
///
/// Names, labels and semantics were read from the engines' source (versions as
/// noted); every name below is the exact string the parser matches.
///
/// | field | vLLM (`GET /metrics`, Prometheus text) | SGLang (`GET /metrics`, `--enable-metrics`) | TensorRT-LLM (`GET /metrics`, JSON) | TensorRT-LLM (`GET /prometheus/metrics`) |
/// |---|---|---|---|---|
/// | `running` | `vllm:num_requests_running` | `sglang:num_running_reqs` | `numActiveRequests` | `trtllm_num_requests_running` |
/// | `waiting` | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `numQueuedRequests` | `trtllm_num_requests_waiting` |
/// | `kv_usage` | `vllm:kv_cache_usage_perc` (≤ 0.10: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` | `kvCacheStats.usedNumBlocks / maxNumBlocks` | `trtllm_kv_cache_utilization` |
/// | `kv_capacity_blocks` | label `num_gpu_blocks` of `vllm:cache_config_info` | `sglang:num_pages` | `kvCacheStats.maxNumBlocks` | `trtllm_kv_cache_max_blocks` |
/// | `block_size` | label `block_size` of `vllm:cache_config_info` | `sglang:page_size` | `kvCacheStats.tokensPerBlock` | `trtllm_kv_cache_tokens_per_block` |
/// | `kv_capacity_tokens` | blocks × block size | `sglang:max_total_num_tokens` | blocks × tokens per block | blocks × tokens per block |
/// | `waiting_prefill_tokens` | — | — | `inflightBatchingStats.numQueuedCtxTokens` | — |
/// | `prefill_computed_tokens` | `vllm:request_prefill_kv_computed_tokens_sum` | — | — | — |
/// | `prefill_seconds` | `vllm:request_prefill_time_seconds_sum` | — | — | — |
/// | rank label (summed) | `engine` (the DP engine index) | `dp_rank` | `attentionDpRank` | — |
///
/// Sources:
/// - vLLM 0.33.0, `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`: label names
///   `["model_name", "engine"]`, one series per engine index; `log_metrics_info`
///   emits `vllm:cache_config_info` per engine with every `CacheConfig` field as a
///   label, `vllm/config/cache.py::CacheConfig.metrics_info`, so `num_gpu_blocks`
///   reads `"None"` before the engine has profiled memory). `vllm:gpu_cache_usage_perc`
///   is the pre-0.10 name (deprecated in 0.9, same file in 0.8–0.10).
///   The two prefill histograms are observed per finished request
///   (`PrometheusStatLogger.record`, from `FinishedRequestStats`):
///   `request_prefill_time_seconds` is `first_token_ts − scheduled_ts`, the time
///   the request spent prefilling once scheduled (queueing excluded), and
///   `request_prefill_kv_computed_tokens` its prompt tokens minus the cached
///   ones; only their `_sum` series are read.
/// - SGLang 0.5.23, `sglang/srt/observability/metrics_collector.py`
///   (`SchedulerMetricsCollector`: labels `model_name, engine_type, tp_rank, pp_rank,
///   moe_ep_rank`, plus `dp_rank` under data parallelism and `priority` under
///   priority scheduling; `emit_constants` sets `max_total_num_tokens`, `page_size`,
///   `num_pages` once at startup). `sglang:token_usage` is the most loaded pool
///   (max of full / SWA / Mamba usage). Older releases (docs/references/production_metrics.md)
///   export only the model-name label and no page constants.
/// - TensorRT-LLM main (2026), `tensorrt_llm/serve/openai_server.py`
///   (`get_iteration_stats`: `GET /metrics` returns the iteration-stats queue the
///   executor filled since the previous call, a JSON array) and
///   `tensorrt_llm/metrics/collector.py` (`MetricsCollector`: the `trtllm_*`
///   Prometheus gauges under `/prometheus/metrics`, mounted only when the server
///   runs with `return_perf_metrics`, fed from the same iteration stats).
///   Iteration stats exist only with `enable_iter_perf_stats: true` (PyTorch backend).
///
/// # Semantics worth knowing
///
/// * **Ranks are summed, replicas of one rank are not.** vLLM's data-parallel
///   engines and SGLang's DP ranks each run their own scheduler, so their running
///   and waiting counts add up. SGLang can also export the same scheduler from
///   several TP / PP ranks (`--enable-metrics-for-all-schedulers`): series that
///   differ only in those labels describe the same batch, so within one rank the
///   parser takes the maximum instead of the sum.
/// * **SGLang priority breakdowns are skipped.** With priority scheduling the total
///   is exported under `priority=""` and the per-priority split under
///   `priority="<n>"`; only the total counts.
/// * **KV usage is the fraction of blocks held by requests** (cached but
///   unreferenced blocks count as free in vLLM's `BlockPool.get_usage`). Across
///   ranks it is the capacity-weighted mean; it is `None` unless every rank reports
///   it. Values are clamped to `0..=1`.
/// * **TensorRT-LLM's JSON `/metrics` is a destructive drain** like
///   `/kv_cache_events`: each call returns (and removes) the iterations since the
///   previous one, so run one poller per engine. The parser uses each rank's latest
///   iteration. An empty array means no iteration ran since the last poll; the
///   executor only iterates with work in flight, so that is reported as idle
///   (`running = waiting = 0`) with `ranks = 0` and no KV figures — a caller that
///   knows another consumer shares the queue should treat `ranks == 0` as "no news".
///   `/prometheus/metrics` (dialect [`MetricsDialect::TrtllmPrometheus`]) can be
///   read by any number of pollers.
///
/// # Robustness
///
/// Bodies over [`MAX_METRICS_BODY_BYTES`] are refused. Lines of metrics the dialect
/// does not use are skipped without being interpreted (a vLLM `/metrics` page is
/// mostly histograms), so a damaged line elsewhere cannot fail the parse; a damaged
/// line of a metric that is used is an error naming the line. Work is linear in
/// the body length, memory is bounded by the number of ranks (at most
/// [`MAX_RANKS`]), and no byte sequence panics (fuzz target `engine_metrics`).
///
///
/// ```
/// use kvroute_engines::{parse_load, MetricsDialect};
///
/// let body = b"# HELP vllm:num_requests_running Number of requests in model execution batches.
/// # TYPE vllm:num_requests_running gauge
/// vllm:num_requests_running{engine=\"0\",model_name=\"qwen\"} 3.0
/// vllm:num_requests_running{engine=\"1\",model_name=\"qwen\"} 1.0
/// vllm:num_requests_waiting{engine=\"0\",model_name=\"qwen\"} 2.0
/// vllm:num_requests_waiting{engine=\"1\",model_name=\"qwen\"} 0.0
/// vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"qwen\"} 0.5
/// vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"qwen\"} 0.25
/// vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
/// vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1000\"} 1.0
/// ";
/// let report = parse_load(MetricsDialect::Vllm, body).unwrap();
/// assert_eq!((report.running, report.waiting, report.ranks), (4, 2, 2));
/// assert_eq!(report.kv_usage, Some(0.375));
/// assert_eq!(report.kv_capacity_blocks, Some(2000));
/// assert_eq!(report.block_size, Some(16));
/// assert_eq!(report.kv_capacity_tokens, Some(32_000));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MetricsDialect {
    /// vLLM `GET /metrics` (Prometheus text, `vllm:` names).
    Vllm,
    /// SGLang `GET /metrics` (Prometheus text, `sglang:` names; needs `--enable-metrics`).
    Sglang,
    /// TensorRT-LLM `trtllm-serve` `GET /metrics`: a JSON array of iteration stats
    /// (a destructive drain, see [`MetricsDialect`]).
    Trtllm,
    /// TensorRT-LLM `GET /prometheus/metrics` (Prometheus text, `trtllm_` names;
    /// needs `return_perf_metrics`).
    TrtllmPrometheus,
}

impl MetricsDialect {
    /// Every dialect.
    pub const ALL: [MetricsDialect; 4] = [
        MetricsDialect::Vllm,
        MetricsDialect::Sglang,
        MetricsDialect::Trtllm,
        MetricsDialect::TrtllmPrometheus,
    ];

    /// The HTTP path the engine serves this dialect on.
    #[must_use]
    pub fn default_path(self) -> &'static str {
        match self {
            MetricsDialect::Vllm | MetricsDialect::Sglang | MetricsDialect::Trtllm => "/metrics",
            MetricsDialect::TrtllmPrometheus => "/prometheus/metrics",
        }
    }

    /// Lower-case name as used in configuration.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsDialect::Vllm => "vllm",
            MetricsDialect::Sglang => "sglang",
            MetricsDialect::Trtllm => "trtllm",
            MetricsDialect::TrtllmPrometheus => "trtllm-prometheus",
        }
    }
}

impl std::fmt::Display for MetricsDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MetricsDialect {
    type Err = LoadReportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MetricsDialect::ALL
            .into_iter()
            .find(|d| d.as_str().eq_ignore_ascii_case(s))
            .ok_or(LoadReportError::UnknownDialect)
    }
}

/// One engine's load as its metrics endpoint reported it, summed over its ranks.
///
/// Built by [`parse_load`]; `Default` is an idle engine that reported nothing
/// about its KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoadReport {
    /// Requests in the engine's running batch (prefilling or decoding).
    pub running: u32,
    /// Requests queued for admission.
    pub waiting: u32,
    /// Fraction of KV blocks held by requests, `0..=1`.
    pub kv_usage: Option<f64>,
    /// KV capacity in blocks (all ranks).
    pub kv_capacity_blocks: Option<u64>,
    /// Tokens per KV block (page size).
    pub block_size: Option<u32>,
    /// KV capacity in tokens (all ranks).
    pub kv_capacity_tokens: Option<u64>,
    /// Prompt tokens of queued requests still to prefill (TensorRT-LLM only).
    pub waiting_prefill_tokens: Option<u64>,
    /// Uncached prompt tokens the engine has prefilled since it started, over
    /// finished requests (a counter; vLLM only). With `prefill_seconds` it
    /// gives the engine's own prefill rate, which a gateway cannot measure for
    /// non-streamed requests (their first byte is the whole answer).
    pub prefill_computed_tokens: Option<u64>,
    /// Seconds those requests spent prefilling, summed per request (a counter;
    /// overlapping prefills each count, so `tokens / seconds` is a lower bound
    /// of the rate). `Some` exactly when `prefill_computed_tokens` is.
    pub prefill_seconds: Option<f64>,
    /// Ranks (DP engines) the figures sum over; 0 when a TensorRT-LLM drain
    /// returned no iteration.
    pub ranks: u32,
}

impl EngineLoadReport {
    /// Requests the engine holds: running plus waiting.
    #[must_use]
    pub fn requests(&self) -> u64 {
        u64::from(self.running) + u64::from(self.waiting)
    }
}

/// Why a metrics body gave no report.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadReportError {
    /// The body exceeds the size limit.
    #[error("metrics body of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge {
        /// Body length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A line of a metric the dialect uses is not valid exposition text.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A count is negative or not a number, or a capacity label is not an integer.
    #[error("line {line}: {metric} has an invalid value")]
    InvalidValue {
        /// The metric (or `metric/label`).
        metric: &'static str,
        /// 1-based line number (0 for JSON).
        line: usize,
    },
    /// The body lacks a metric every report needs: it is not this dialect, or the
    /// engine runs without metrics.
    #[error("{metric} not found: not a {dialect} metrics body, or metrics are disabled")]
    MissingMetric {
        /// The dialect asked for.
        dialect: MetricsDialect,
        /// The missing metric.
        metric: &'static str,
    },
    /// More distinct ranks than [`MAX_RANKS`].
    #[error("more than {limit} ranks in one body")]
    TooManyRanks {
        /// The limit.
        limit: usize,
    },
    /// A TensorRT-LLM iteration-stats body is not the expected JSON.
    #[error("TensorRT-LLM iteration stats: {reason}")]
    Json {
        /// serde_json's message.
        reason: String,
    },
    /// A dialect name that is not one of [`MetricsDialect::ALL`].
    #[error("unknown metrics dialect (expected vllm, sglang, trtllm or trtllm-prometheus)")]
    UnknownDialect,
}

/// Parses one metrics response body into a load report.
///
/// Pure and bounded: see [`MetricsDialect`] for the metric names per dialect,
/// how ranks combine and which lines may be damaged.
///
/// ```
/// use kvroute_engines::{parse_load, LoadReportError, MetricsDialect};
///
/// let sglang = b"sglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 5.0
/// sglang:num_queue_reqs{model_name=\"m\",tp_rank=\"0\"} 1.0
/// sglang:token_usage{model_name=\"m\",tp_rank=\"0\"} 0.28
/// ";
/// let r = parse_load(MetricsDialect::Sglang, sglang).unwrap();
/// assert_eq!((r.running, r.waiting, r.kv_usage), (5, 1, Some(0.28)));
///
/// let trtllm = br#"[{"iter": 7, "numActiveRequests": 2, "numQueuedRequests": 1,
///     "kvCacheStats": {"maxNumBlocks": 100, "usedNumBlocks": 25, "tokensPerBlock": 32}}]"#;
/// let r = parse_load(MetricsDialect::Trtllm, trtllm).unwrap();
/// assert_eq!((r.running, r.waiting, r.kv_usage, r.block_size), (2, 1, Some(0.25), Some(32)));
///
/// let html = b"<html>502 Bad Gateway</html>";
/// assert!(matches!(
///     parse_load(MetricsDialect::Vllm, html),
///     Err(LoadReportError::MissingMetric { .. })
/// ));
/// ```
pub fn parse_load(
    dialect: MetricsDialect,
    body: &[u8],
) -> Result<EngineLoadReport, LoadReportError> {
    if body.len() > MAX_METRICS_BODY_BYTES {
        return Err(LoadReportError::TooLarge {
            len: body.len(),
            limit: MAX_METRICS_BODY_BYTES,
        });
    }
    match dialect {
        MetricsDialect::Vllm => prometheus::parse(&prometheus::VLLM, dialect, body),
        MetricsDialect::Sglang => prometheus::parse(&prometheus::SGLANG, dialect, body),
        MetricsDialect::TrtllmPrometheus => {
            prometheus::parse(&prometheus::TRTLLM_PROMETHEUS, dialect, body)
        }
        MetricsDialect::Trtllm => trtllm::parse(body),
    }
}

/// What every rank contributed, before summing.
#[derive(Clone, Copy, Debug, Default)]
struct RankLoad {
    running: Option<f64>,
    waiting: Option<f64>,
    kv_usage: Option<f64>,
    capacity_blocks: Option<f64>,
    block_size: Option<f64>,
    capacity_tokens: Option<f64>,
    waiting_prefill_tokens: Option<f64>,
    prefill_computed_tokens: Option<f64>,
    prefill_seconds: Option<f64>,
}

fn max_opt(a: Option<f64>, b: f64) -> Option<f64> {
    Some(a.map_or(b, |a| a.max(b)))
}

fn count(v: f64) -> u64 {
    // Validated finite and non-negative; the saturating cast clamps absurd values.
    v.round() as u64
}

fn saturating_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// Sums ranks into one report (shared by the text and JSON dialects).
fn combine(ranks: &[RankLoad]) -> EngineLoadReport {
    let mut report = EngineLoadReport {
        ranks: saturating_u32(ranks.len() as u64),
        ..EngineLoadReport::default()
    };
    let mut running = 0u64;
    let mut waiting = 0u64;
    let all = |f: fn(&RankLoad) -> Option<f64>| -> Option<Vec<f64>> {
        if ranks.is_empty() {
            return None;
        }
        ranks.iter().map(f).collect()
    };
    for r in ranks {
        running = running.saturating_add(r.running.map_or(0, count));
        waiting = waiting.saturating_add(r.waiting.map_or(0, count));
    }
    report.running = saturating_u32(running);
    report.waiting = saturating_u32(waiting);

    // One block size for the engine, or none if ranks disagree.
    let sizes: Vec<u64> = ranks
        .iter()
        .filter_map(|r| r.block_size.map(count))
        .collect();
    report.block_size = match sizes.split_first() {
        Some((&first, rest)) if first > 0 && rest.iter().all(|&s| s == first) => {
            u32::try_from(first).ok()
        }
        _ => None,
    };
    let per_rank_blocks: Option<Vec<u64>> = ranks
        .iter()
        .map(|r| {
            r.capacity_blocks.map(count).or_else(|| {
                let size = report.block_size?;
                r.capacity_tokens.map(|t| count(t) / u64::from(size))
            })
        })
        .collect();
    let per_rank_tokens: Option<Vec<u64>> = ranks
        .iter()
        .map(|r| {
            r.capacity_tokens.map(count).or_else(|| {
                let size = report.block_size?;
                r.capacity_blocks
                    .map(|b| count(b).saturating_mul(u64::from(size)))
            })
        })
        .collect();
    if !ranks.is_empty() {
        report.kv_capacity_blocks = per_rank_blocks
            .as_ref()
            .map(|v| v.iter().fold(0u64, |a, &b| a.saturating_add(b)));
        report.kv_capacity_tokens = per_rank_tokens
            .as_ref()
            .map(|v| v.iter().fold(0u64, |a, &b| a.saturating_add(b)));
    }
    if let Some(usage) = all(|r| r.kv_usage) {
        let weights = per_rank_blocks
            .as_ref()
            .filter(|w| w.iter().any(|&b| b > 0));
        let mean = match weights {
            Some(w) => {
                let total: f64 = w.iter().map(|&b| b as f64).sum();
                usage.iter().zip(w).map(|(u, &b)| u * b as f64).sum::<f64>() / total
            }
            None => usage.iter().sum::<f64>() / usage.len() as f64,
        };
        report.kv_usage = mean.is_finite().then(|| mean.clamp(0.0, 1.0));
    }
    // Progress counters only when every rank has both: a partial sum would
    // read as a rate change when a rank appears.
    if let (Some(tokens), Some(seconds)) = (
        all(|r| r.prefill_computed_tokens),
        all(|r| r.prefill_seconds),
    ) {
        report.prefill_computed_tokens =
            Some(tokens.iter().fold(0u64, |a, &b| a.saturating_add(count(b))));
        report.prefill_seconds = Some(seconds.iter().sum());
    }
    let prefill: Vec<f64> = ranks
        .iter()
        .filter_map(|r| r.waiting_prefill_tokens)
        .collect();
    if !prefill.is_empty() {
        report.waiting_prefill_tokens = Some(
            prefill
                .iter()
                .fold(0u64, |a, &b| a.saturating_add(count(b))),
        );
    }
    report
}

/// Fuzzing entry point (fuzz target `engine_metrics` and its corpus replay test).
/// Not a stable API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{parse_load, MetricsDialect};

    /// Parses `data` in every dialect; panics only if an invariant breaks: a
    /// report's usage is within `0..=1`, capacities agree with the block size,
    /// and parsing is deterministic.
    pub fn engine_metrics(data: &[u8]) {
        for dialect in MetricsDialect::ALL {
            let first = parse_load(dialect, data);
            assert_eq!(first, parse_load(dialect, data), "{dialect}");
            if let Ok(r) = first {
                if let Some(u) = r.kv_usage {
                    assert!((0.0..=1.0).contains(&u), "{dialect}: usage {u}");
                }
                if let Some(size) = r.block_size {
                    assert!(size > 0, "{dialect}: zero block size");
                }
                if r.ranks == 0 {
                    assert_eq!(r.requests(), 0, "{dialect}: load without ranks");
                }
            }
        }
    }
}
