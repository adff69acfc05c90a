//! Active health checks: every endpoint of every rule is probed with
//! `GET <health.path>` on an interval. Probe failures and request connect
//! failures feed the same per-endpoint circuit breaker (the library's
//! [`kvroute_select::CircuitBreaker`]); a successful probe closes it again, so an
//! engine that comes back is used again without waiting for a request to risk it.

use std::sync::Arc;
use std::time::Duration;

use super::state::{Gateway, RuleRuntime};

/// Spawns one probe task per endpoint of `rt` (none when the interval is 0).
/// Tasks end when the rule is removed or replaced.
pub fn spawn_probes(gw: &Arc<Gateway>, rt: &Arc<RuleRuntime>) {
    if gw.health.interval_ms == 0 {
        return;
    }
    let interval = Duration::from_millis(gw.health.interval_ms);
    let timeout = Duration::from_millis(gw.health.timeout_ms.max(1));
    for i in 0..rt.endpoints.len() {
        let weak_gw = Arc::downgrade(gw);
        let weak_rt = Arc::downgrade(rt);
        let mut stop = rt.stopped();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tick.tick() => {}
                }
                let (Some(gw), Some(rt)) = (weak_gw.upgrade(), weak_rt.upgrade()) else {
                    return;
                };
                let Some(ep) = rt.endpoints.get(i) else {
                    return;
                };
                let ok = gw
                    .client
                    .probe(&ep.spec.base, &gw.health.path, timeout)
                    .await;
                let was = ep.probe_ok.lock().replace(ok);
                if ok {
                    ep.success();
                    if was == Some(false) {
                        tracing::info!(endpoint = %ep.spec.url, "health probe recovered");
                    }
                } else {
                    ep.failure(gw.now());
                    gw.metrics.probe_failures.inc();
                    if was != Some(false) {
                        tracing::warn!(endpoint = %ep.spec.url, "health probe failed");
                    }
                }
            }
        });
    }
}
