//! Engine-reported load: one poller per endpoint reads the engine's own
//! metrics (vLLM / SGLang Prometheus gauges, TensorRT-LLM's Prometheus page)
//! and feeds the rule's [`kvroute_select::ReportedLoad`] — what keeps several
//! gateway replicas honest, since each counts only its own requests — and the
//! inventory's per-endpoint capacity, so the index is bounded by what the
//! engine really holds.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{EndpointId, Medium};
use kvroute_engines::transport::{EngineKind, LoadPoller, LoadPollerConfig};
use kvroute_engines::MetricsDialect;
use kvroute_select::{EngineReport, PrefillProgress};

use super::state::RuleRuntime;

/// The metrics dialect of an engine kind (`None`: it exports none we read).
/// TensorRT-LLM's JSON `/metrics` is a destructive drain, so its Prometheus
/// page is read instead.
fn dialect(engine: EngineKind) -> Option<MetricsDialect> {
    match engine {
        EngineKind::Vllm => Some(MetricsDialect::Vllm),
        EngineKind::Sglang => Some(MetricsDialect::Sglang),
        EngineKind::TensorRtLlm => Some(MetricsDialect::TrtllmPrometheus),
        _ => None,
    }
}

/// Starts a poller for every endpoint of `rt` whose engine exports metrics,
/// every `interval`, until the rule stops.
pub fn spawn(rt: &Arc<RuleRuntime>, interval: Duration) {
    for (i, ep) in rt.endpoints.iter().enumerate() {
        let Some(dialect) = dialect(ep.spec.engine) else {
            continue;
        };
        let url = format!(
            "{}{}",
            ep.spec.url.trim_end_matches('/'),
            dialect.default_path()
        );
        let poller = match LoadPoller::new(
            LoadPollerConfig::new(url.clone(), dialect)
                .interval(interval)
                .timeout(interval.max(Duration::from_millis(200))),
        ) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(%url, error = %e, "engine load poller not started");
                continue;
            }
        };
        let id = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
        let rule = Arc::clone(rt);
        let mut stop = rt.stopped();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let mut warned = false;
        tokio::spawn(poller.run(
            move |result| match result {
                Ok(r) => {
                    if let Some(ep) = rule.endpoints.get(i) {
                        ep.load_polls.ok.fetch_add(1, Ordering::Relaxed);
                    }
                    warned = false;
                    let report = EngineReport {
                        running: r.running,
                        waiting: r.waiting,
                        kv_usage: r.kv_usage,
                        prefill: r.prefill_computed_tokens.zip(r.prefill_seconds).map(
                            |(tokens, seconds)| PrefillProgress { tokens, seconds },
                        ),
                        kv_capacity_blocks: r.kv_capacity_blocks,
                    };
                    // Every replica's requests: the engine counts them all.
                    let local = rule.replicas_load(id);
                    rule.reported.update(id, report, local, rule.now());
                    if let Some(blocks) = r.kv_capacity_blocks {
                        let blocks = usize::try_from(blocks).unwrap_or(usize::MAX);
                        rule.inventory.set_capacity(i, Medium::Gpu, blocks);
                    }
                }
                Err(e) => {
                    if let Some(ep) = rule.endpoints.get(i) {
                        ep.load_polls.failed.fetch_add(1, Ordering::Relaxed);
                    }
                    rule.reported.invalidate(id);
                    if !warned {
                        // Once per outage, at INFO: selection falls back to
                        // this gateway's own counts, which is what a single
                        // replica needs anyway.
                        tracing::info!(rule = %rule.spec.doc.name, endpoint = %url,
                            error = %e, "engine load report unavailable; using this gateway's own counts");
                        warned = true;
                    }
                }
            },
            stopped,
        ));
    }
}
