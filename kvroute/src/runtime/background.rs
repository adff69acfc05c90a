//! The router's per-endpoint background work — health probes and engine
//! load polling — and the tokenizer loads, all on the host's runtime and
//! all ending with the endpoint or the router.

#[cfg(feature = "trtllm-http")]
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::Medium;
#[cfg(feature = "trtllm-http")]
use kvroute_select::PrefillProgress;
use kvroute_select::{EngineReport, Load};
use tokio::sync::watch;

#[cfg(feature = "trtllm-http")]
use super::slots::SlotRuntime;
use super::status::TokenizerState;
use super::view::RouterView;
use super::{id, Shared};
use crate::backend::Backend;

/// Loads every model's tokenizer on the blocking pool, recording each
/// outcome for [`crate::KvRouter::readiness`].
pub(crate) fn load_tokenizers(shared: &Arc<Shared>, handle: &tokio::runtime::Handle) {
    for (slug, _) in &shared.models {
        let weak = Arc::downgrade(shared);
        let slug = slug.clone();
        handle.spawn_blocking(move || {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let state = match shared.tokenizers.get(&slug) {
                Ok(_) => TokenizerState::Loaded,
                Err(e) => {
                    tracing::warn!(model = %slug, error = %e,
                        "tokenizer not usable: requests for this model miss with no_tokenizer");
                    TokenizerState::Failed(e.to_string())
                }
            };
            for (s, st) in shared.tokenizer_states.lock().iter_mut() {
                if *s == slug {
                    *st = state.clone();
                }
            }
        });
    }
}

/// Records `report` for endpoint `url`: the load view composes it with
/// every replica's own counts, the engine's capacity bounds the endpoint's
/// inventory, and its running and waiting requests are outlier detection's
/// evidence.
pub(crate) fn record_report(shared: &Shared, url: &str, report: EngineReport) -> bool {
    super::slots::at_url(shared, url, |slot, _| {
        record_slot(shared, slot, report);
        let busy = report.running.saturating_add(report.waiting);
        let evidence = kvroute_select::EngineEvidence::Report { busy };
        super::outlier::evidence(shared, id(slot), shared.now(), evidence);
    })
    .is_some()
}

pub(crate) fn record_slot(shared: &Shared, slot: usize, mut report: EngineReport) {
    let now = shared.now();
    let endpoint = id(slot);
    if let Some(blocks) = report.kv_capacity_blocks {
        // Never above the configured bound, and 0 ignored: the figure is
        // the engine's, the memory bound the configuration's. The scorer's
        // cache room reads the bound in force, as the inventory is held to
        // it.
        match shared
            .index
            .set_reported_capacity(endpoint, Medium::Gpu, blocks)
        {
            Ok(bound) => {
                report.kv_capacity_blocks = bound.and_then(|b| u64::try_from(b).ok());
            }
            Err(err) => {
                tracing::warn!(%err, slot, "engine-reported capacity of an endpoint outside the index");
            }
        }
    }
    // Every replica's requests: the engine counts them all.
    let local = RouterView::replicas_only(shared, now).load(endpoint);
    shared.reported.update(endpoint, report, local, now);
}

/// The epoch of the endpoint now in `slot` ([`super::slots::SlotState::epoch`]).
#[cfg(feature = "trtllm-http")]
fn slot_epoch(shared: &Shared, slot: usize) -> Option<u64> {
    shared
        .slots
        .get(slot)
        .map(|s| s.epoch.load(Ordering::Acquire))
}

/// Starts `b`'s health probe and engine load poller (as configured); they
/// end with the slot (`stop`) or the router.
#[cfg_attr(not(feature = "trtllm-http"), allow(unused_variables))]
pub(crate) fn start_endpoint(
    shared: &Arc<Shared>,
    handle: &tokio::runtime::Handle,
    slot: usize,
    b: &Backend,
    stop: &watch::Sender<bool>,
) {
    #[cfg(feature = "trtllm-http")]
    {
        if let Some(cfg) = shared.probes.clone() {
            spawn_probe(shared, handle, slot, b, cfg, stop);
        }
        if let Some(cfg) = shared.engine_load {
            spawn_load_poller(shared, handle, slot, b, cfg, stop);
        }
    }
    #[cfg(not(feature = "trtllm-http"))]
    if shared.probes.is_some() || shared.engine_load.is_some() {
        tracing::warn!(endpoint = %b.url,
            "health probes and engine load polling need kvroute's `trtllm-http` feature; not started");
    }
}

#[cfg(feature = "trtllm-http")]
fn spawn_probe(
    shared: &Arc<Shared>,
    handle: &tokio::runtime::Handle,
    slot: usize,
    b: &Backend,
    cfg: super::ProbeConfig,
    stop: &watch::Sender<bool>,
) {
    let url = format!("{}{}", b.url.trim_end_matches('/'), cfg.path);
    let client = match reqwest::Client::builder()
        .timeout(cfg.timeout.max(std::time::Duration::from_millis(1)))
        // Probes every 5 s by default, the engines' keep-alive: a pooled
        // connection would be closed by the engine as the probe is sent.
        .pool_idle_timeout(kvroute_engines::ENGINE_HTTP_IDLE)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%url, error = %e, "health probe not started");
            return;
        }
    };
    let weak = Arc::downgrade(shared);
    let epoch = slot_epoch(shared, slot);
    let slot_stopped = SlotRuntime::stopped(stop);
    let router_stopped = shared.stopped();
    handle.spawn(async move {
        let mut tick = tokio::time::interval(cfg.interval.max(std::time::Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(slot_stopped);
        tokio::pin!(router_stopped);
        loop {
            tokio::select! {
                () = &mut slot_stopped => return,
                () = &mut router_stopped => return,
                _ = tick.tick() => {}
            }
            let ok = matches!(client.get(&url).send().await, Ok(r) if r.status().is_success());
            let Some(shared) = weak.upgrade() else {
                return;
            };
            // A verdict that came back after its endpoint left (the stop
            // is only seen at the next tick) is not the slot's next one's.
            let Some(state) = shared
                .slots
                .get(slot)
                .filter(|_| slot_epoch(&shared, slot) == epoch)
            else {
                return;
            };
            let was = state.probe_ok.lock().replace(ok);
            if ok {
                state.breaker.on_success();
                if was == Some(false) {
                    tracing::info!(endpoint = %url, "health probe recovered");
                }
            } else {
                state.probe_failures.fetch_add(1, Ordering::Relaxed);
                state.breaker.on_failure(shared.now());
                if was != Some(false) {
                    tracing::warn!(endpoint = %url, "health probe failed");
                }
            }
        }
    });
}

#[cfg(feature = "trtllm-http")]
fn spawn_load_poller(
    shared: &Arc<Shared>,
    handle: &tokio::runtime::Handle,
    slot: usize,
    b: &Backend,
    cfg: super::EngineLoadConfig,
    stop: &watch::Sender<bool>,
) {
    use kvroute_engines::transport::{LoadPollError, LoadPoller, LoadPollerConfig};
    let Some(dialect) = super::followers::metrics_dialect(b) else {
        return;
    };
    let url = format!("{}{}", b.url.trim_end_matches('/'), dialect.default_path());
    let poller = match LoadPoller::new(
        LoadPollerConfig::new(url.clone(), dialect)
            .interval(cfg.interval)
            .timeout(cfg.timeout),
    ) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(%url, error = %e, "engine load poller not started");
            return;
        }
    };
    let weak = Arc::downgrade(shared);
    let epoch = slot_epoch(shared, slot);
    let slot_stopped = SlotRuntime::stopped(stop);
    let router_stopped = shared.stopped();
    let stopped = async move {
        tokio::select! {
            () = slot_stopped => {}
            () = router_stopped => {}
        }
    };
    let name = shared.settings.name.clone();
    let mut warned = false;
    handle.spawn(poller.run(
        move |result| {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            // Likewise for a poll that ended after its endpoint left.
            let Some(state) = shared
                .slots
                .get(slot)
                .filter(|_| slot_epoch(&shared, slot) == epoch)
            else {
                return;
            };
            match result {
                Ok(r) => {
                    state.polls_ok.fetch_add(1, Ordering::Relaxed);
                    warned = false;
                    // A TensorRT-LLM drain with no iteration counts nothing.
                    if r.ranks > 0 {
                        let busy = r.running.saturating_add(r.waiting);
                        let evidence = kvroute_select::EngineEvidence::Report { busy };
                        super::outlier::evidence(&shared, id(slot), shared.now(), evidence);
                    }
                    let report = EngineReport {
                        running: r.running,
                        waiting: r.waiting,
                        kv_usage: r.kv_usage,
                        prefill: r
                            .prefill_computed_tokens
                            .zip(r.prefill_seconds)
                            .map(|(tokens, seconds)| PrefillProgress { tokens, seconds }),
                        kv_capacity_blocks: r.kv_capacity_blocks,
                    };
                    record_slot(&shared, slot, report);
                }
                Err(e) => {
                    state.polls_failed.fetch_add(1, Ordering::Relaxed);
                    shared.reported.invalidate(id(slot));
                    // The page hung or its connection failed: the engine does
                    // not answer this either. An error status or an
                    // unreadable page says nothing about requests.
                    if matches!(e, LoadPollError::Timeout(_) | LoadPollError::Request(_)) {
                        let evidence = kvroute_select::EngineEvidence::Unreachable;
                        super::outlier::evidence(&shared, id(slot), shared.now(), evidence);
                    }
                    if !warned {
                        // Once per outage: selection falls back to the
                        // replicas' own counts, which is what one replica
                        // needs anyway.
                        tracing::info!(rule = %name, endpoint = %url, error = %e,
                            "engine load report unavailable; using the replicas' own counts");
                        warned = true;
                    }
                }
            }
        },
        stopped,
    ));
}

#[cfg(all(test, feature = "trtllm-http"))]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::test_support::{host_router, HostEngine};
    use crate::{Backend, Change, ProbeConfig};

    /// A `/health` answering `status` after `delay`, on 127.0.0.1.
    async fn health(delay: Duration, status: u16) -> String {
        let app = axum::Router::new().route(
            "/health",
            axum::routing::get(move || async move {
                tokio::time::sleep(delay).await;
                axum::http::StatusCode::from_u16(status).unwrap_or_default()
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}")
    }

    /// A probe of a removed endpoint that was in flight when it left, and
    /// fails afterwards, does not count against the endpoint now in its
    /// slot (nor open its breaker).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_probe_answered_after_its_endpoint_left_is_not_the_slots_next_ones() {
        let failing = health(Duration::from_millis(400), 500).await;
        let healthy = health(Duration::ZERO, 200).await;
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        let router = host_router(0)
            .endpoint(Backend::new(Arc::clone(&engine), failing.clone()).host_events())
            .health_probes(ProbeConfig {
                path: "/health".to_owned(),
                interval: Duration::from_millis(50),
                timeout: Duration::from_secs(5),
            })
            .breaker(kvroute_select::BreakerConfig {
                failure_threshold: 1,
                cool_down: Duration::from_secs(60),
            })
            .spawn()
            .expect("router");
        // The first probe is on its way (400 ms) when the endpoint leaves and
        // another takes its slot.
        tokio::time::sleep(Duration::from_millis(100)).await;
        router.apply(Change::Remove(failing)).expect("remove");
        router
            .apply(Change::Insert(
                Backend::new(engine, healthy.clone()).host_events(),
            ))
            .expect("insert");
        // Past the old probe's answer, and the new endpoint probed (bounded).
        let removed = tokio::time::Instant::now();
        for _ in 0..200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let probed = router
                .endpoint_status(&healthy)
                .is_some_and(|s| s.probe_ok == Some(true));
            if probed && removed.elapsed() > Duration::from_millis(700) {
                break;
            }
        }
        let s = router.endpoint_status(&healthy).expect("status");
        assert_eq!(s.slot, 0);
        assert_eq!(s.probe_failures, 0);
        assert_eq!(s.probe_ok, Some(true));
        assert_eq!(s.breaker, kvroute_select::BreakerState::Closed);
    }
}
