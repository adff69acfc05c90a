//! `GET /metrics`: the engine's own load gauges, under the names the imitated
//! engine exports them, so an engine-load poller (`kvroute_engines::parse_load`)
//! reads the mock exactly as it reads the real thing.
//!
//! | `--format` | body | names |
//! |---|---|---|
//! | `vllm` | Prometheus text | `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info{block_size, num_gpu_blocks, ...}`, histograms `vllm:request_prefill_time_seconds` and `vllm:request_prefill_kv_computed_tokens` (`_count`, `_sum` and the `+Inf` bucket only) (labels `model_name`, `engine="0"`) |
//! | `sglang` | Prometheus text | `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`, `sglang:num_used_tokens`, `sglang:max_total_num_tokens`, `sglang:page_size`, `sglang:num_pages` |
//! | `trtllm` | JSON iteration stats | `numActiveRequests`, `numQueuedRequests`, `kvCacheStats.{maxNumBlocks, usedNumBlocks, freeNumBlocks, tokensPerBlock}` |
//!
//! The text is written the way Python's `prometheus_client` writes it (`# HELP` /
//! `# TYPE`, labels in name order, floats as `3.0`). Figures are read from the
//! worker model at the time of the request: `running` counts admitted requests
//! (prefilling or decoding), `waiting` the queue, usage the blocks requests hold
//! (cached but unreferenced blocks count as free, as in vLLM's `BlockPool`).
//! Deviation: TensorRT-LLM drains one row per executor iteration and answers `[]`
//! when idle; the mock answers one row with the current state on every call.

use std::fmt::Write as _;

use serde_json::json;

use super::engine::LoadSnapshot;

/// Which engine's metrics to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// vLLM 0.33 names.
    Vllm,
    /// SGLang 0.5.23 names.
    Sglang,
    /// TensorRT-LLM iteration stats.
    Trtllm,
}

fn usage(s: &LoadSnapshot) -> f64 {
    if s.capacity_blocks == 0 {
        0.0
    } else {
        f64::from(s.in_use_blocks) / f64::from(s.capacity_blocks)
    }
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    // `{:?}` prints 3.0 and 0.25 as Python's repr does.
    let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
}

/// A histogram reduced to what its totals say: the `+Inf` bucket, count and sum.
fn histogram(out: &mut String, name: &str, help: &str, labels: &str, count: u64, sum: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    #[allow(clippy::cast_precision_loss)]
    let count = count as f64;
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count:?}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {count:?}");
    let _ = writeln!(out, "{name}_sum{{{labels}}} {sum:?}");
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The body and its content type.
pub fn render(
    flavor: Flavor,
    model: &str,
    iteration: u64,
    s: &LoadSnapshot,
) -> (String, &'static str) {
    let model = escape(model);
    match flavor {
        Flavor::Vllm => {
            let l = format!("engine=\"0\",model_name=\"{model}\"");
            let mut out = String::with_capacity(1024);
            gauge(
                &mut out,
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                &l,
                f64::from(s.running),
            );
            gauge(
                &mut out,
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                &l,
                f64::from(s.waiting),
            );
            gauge(
                &mut out,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                &l,
                usage(s),
            );
            let info = format!(
                "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
                 engine=\"0\",kv_cache_size_tokens=\"{}\",num_gpu_blocks=\"{}\"",
                s.block_size,
                u64::from(s.capacity_blocks) * u64::from(s.block_size),
                s.capacity_blocks
            );
            gauge(
                &mut out,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                &info,
                1.0,
            );
            #[allow(clippy::cast_precision_loss)]
            let (tokens, secs) = (s.prefilled_tokens as f64, s.prefilled_us as f64 / 1e6);
            histogram(
                &mut out,
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                &l,
                s.prefilled_requests,
                secs,
            );
            histogram(
                &mut out,
                "vllm:request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                &l,
                s.prefilled_requests,
                tokens,
            );
            (out, "text/plain; version=0.0.4; charset=utf-8")
        }
        Flavor::Sglang => {
            let l = format!(
                "engine_type=\"unified\",model_name=\"{model}\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\""
            );
            let tokens = u64::from(s.capacity_blocks) * u64::from(s.block_size);
            let used = u64::from(s.in_use_blocks) * u64::from(s.block_size);
            let mut out = String::with_capacity(1024);
            gauge(
                &mut out,
                "sglang:num_running_reqs",
                "The number of running requests.",
                &l,
                f64::from(s.running),
            );
            gauge(
                &mut out,
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                &l,
                f64::from(s.waiting),
            );
            gauge(
                &mut out,
                "sglang:token_usage",
                "The token usage.",
                &l,
                usage(s),
            );
            gauge(
                &mut out,
                "sglang:num_used_tokens",
                "The number of used tokens.",
                &l,
                used as f64,
            );
            gauge(
                &mut out,
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV cache pool.",
                &l,
                tokens as f64,
            );
            gauge(
                &mut out,
                "sglang:page_size",
                "KV cache page size in tokens.",
                &l,
                f64::from(s.block_size),
            );
            gauge(
                &mut out,
                "sglang:num_pages",
                "Number of KV cache pages.",
                &l,
                f64::from(s.capacity_blocks),
            );
            (out, "text/plain; version=0.0.4; charset=utf-8")
        }
        Flavor::Trtllm => {
            let row = json!({
                "iter": iteration,
                "iterLatencyMS": 0.0,
                "numActiveRequests": s.running,
                "numQueuedRequests": s.waiting,
                "numCompletedRequests": 0,
                "maxNumActiveRequests": s.max_running,
                "kvCacheStats": {
                    "maxNumBlocks": s.capacity_blocks,
                    "usedNumBlocks": s.in_use_blocks,
                    "freeNumBlocks": s.capacity_blocks.saturating_sub(s.in_use_blocks),
                    "tokensPerBlock": s.block_size,
                },
            });
            (json!([row]).to_string(), "application/json")
        }
    }
}
