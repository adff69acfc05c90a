//! Following an endpoint's KV events: the engine's transport feeding the
//! endpoint's ingest, and the sequence-window policy its stream needs.

use std::sync::Arc;

use kvroute_engines::transport::{EngineKind, IndexIngest, SharedIngest, SubscriberMetrics};
use kvroute_ingest::{RestartPolicy, SeqWindowConfig};
use tokio::sync::watch;

use super::slots::{index_of, SlotRuntime};
use super::{BuildError, Shared};
use crate::backend::Backend;

fn endpoint_err(url: &str, reason: impl std::fmt::Display) -> BuildError {
    BuildError::Endpoint {
        url: url.to_owned(),
        reason: reason.to_string(),
    }
}

/// Whether `b` keeps an inventory: it can prefill and its engine publishes
/// events the router follows.
pub(crate) fn has_inventory(b: &Backend) -> bool {
    b.role.can_prefill() && (b.events.is_some() || (b.engine == EngineKind::TensorRtLlm && b.drain))
}

/// The sequence-window policy of `b`'s event stream.
pub(crate) fn window(b: &Backend) -> SeqWindowConfig {
    if b.engine == EngineKind::TensorRtLlm {
        SeqWindowConfig::destructive_drain()
    } else if b.replay.is_some() {
        // A detected restart replays the new process's buffer from 0.
        SeqWindowConfig {
            on_restart: RestartPolicy::Replay,
            ..SeqWindowConfig::default()
        }
    } else {
        SeqWindowConfig::default()
    }
}

/// Checks that `b`'s events could be followed (for a router that starts
/// nothing).
pub(crate) fn check(b: &Backend) -> Result<(), BuildError> {
    kvroute_engines::transport::require_kv_events(b.engine).map_err(|e| endpoint_err(&b.url, e))
}

/// Starts `b`'s followers on `handle`; they stop with the slot.
// Without the transports `shared`, `handle`, `ingest` and `stop` go unused.
#[cfg_attr(
    not(all(feature = "zmq", feature = "trtllm-http")),
    allow(unused_variables)
)]
pub(crate) fn start(
    shared: &Shared,
    handle: &tokio::runtime::Handle,
    b: &Backend,
    ingest: &SharedIngest,
    stop: &watch::Sender<bool>,
) -> Result<Vec<Arc<SubscriberMetrics>>, BuildError> {
    let mut metrics = Vec::new();
    match b.engine {
        EngineKind::Vllm | EngineKind::Sglang => {
            #[cfg(feature = "zmq")]
            {
                use kvroute_engines::transport::{
                    DecodingSink, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
                };
                let Some(events) = &b.events else {
                    return Ok(metrics);
                };
                let host = b
                    .host()
                    .ok_or_else(|| endpoint_err(&b.url, "the URL names no host"))?;
                // Every rank's stream is set up before any starts: a bad rank
                // refuses the endpoint as a whole.
                let mut ready = Vec::new();
                for rank in 0..b.dp_ranks {
                    let ep = ZmqEndpoint::for_engine(b.engine, events, &host, rank)
                        .map_err(|e| endpoint_err(&b.url, e))?;
                    let mut cfg = ZmqSubscriberConfig::new(ep).topic(b.topic.clone());
                    if let Some(r) = &b.replay {
                        let replay = ZmqEndpoint::for_engine(b.engine, r, &host, rank)
                            .map_err(|e| endpoint_err(&b.url, e))?;
                        cfg = cfg.replay_endpoint(replay.address);
                    }
                    let sink = DecodingSink::new(
                        b.engine,
                        IndexIngest::shared(
                            Arc::clone(ingest),
                            Arc::clone(index_of(shared)),
                            Some(rank),
                            b.replay.is_some(),
                        ),
                    )
                    .map_err(|e| endpoint_err(&b.url, e))?;
                    ready.push((ZmqSubscriber::new(cfg), sink));
                }
                for (subscriber, sink) in ready {
                    metrics.push(subscriber.metrics());
                    let stopped = SlotRuntime::stopped(stop);
                    tracing::info!(rule = %shared.settings.name, endpoint = %b.url, "starting KV-event subscriber");
                    handle.spawn(async move {
                        let _ = subscriber.run(sink, stopped).await;
                    });
                }
                Ok(metrics)
            }
            #[cfg(not(feature = "zmq"))]
            Err(endpoint_err(
                &b.url,
                "this build has no ZeroMQ transport (enable kvroute's `zmq` feature)",
            ))
        }
        EngineKind::TensorRtLlm => {
            #[cfg(feature = "trtllm-http")]
            {
                use kvroute_engines::transport::{TrtllmPoller, TrtllmPollerConfig, TrtllmSink};
                let poller = TrtllmPoller::new(TrtllmPollerConfig::new(format!(
                    "{}/kv_cache_events",
                    b.url
                )))
                .map_err(|e| endpoint_err(&b.url, e))?;
                let sink = TrtllmSink::new(
                    shared.contract.block_size,
                    IndexIngest::shared(
                        Arc::clone(ingest),
                        Arc::clone(index_of(shared)),
                        None,
                        false,
                    ),
                );
                metrics.push(poller.metrics());
                tracing::warn!(rule = %shared.settings.name, endpoint = %b.url,
                    "TensorRT-LLM KV-event drain poller: every POST to /kv_cache_events consumes \
                     the engine's events, so this router must be its only consumer (no second \
                     replica, script or curl); a competing consumer shows up as steady event_id \
                     gaps and clears");
                let stopped = SlotRuntime::stopped(stop);
                handle.spawn(async move {
                    let _ = poller.run(sink, stopped).await;
                });
                Ok(metrics)
            }
            #[cfg(not(feature = "trtllm-http"))]
            Err(endpoint_err(
                &b.url,
                "this build has no TensorRT-LLM drain (enable kvroute's `trtllm-http` feature)",
            ))
        }
        _ => Err(check(b)
            .err()
            .unwrap_or_else(|| endpoint_err(&b.url, format!("{} is not supported", b.engine)))),
    }
}

/// The dialect of `b`'s engine's load report (`None`: it exports none the
/// router reads). TensorRT-LLM's JSON `/metrics` is a destructive drain, so
/// its Prometheus page is read instead.
pub(crate) fn metrics_dialect(b: &Backend) -> Option<kvroute_engines::MetricsDialect> {
    use kvroute_engines::MetricsDialect;
    match b.engine {
        EngineKind::Vllm => Some(MetricsDialect::Vllm),
        EngineKind::Sglang => Some(MetricsDialect::Sglang),
        EngineKind::TensorRtLlm => Some(MetricsDialect::TrtllmPrometheus),
        _ => None,
    }
}
