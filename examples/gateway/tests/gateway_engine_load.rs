//! The engine-load poller on `/metrics`: the engine's own report of running
//! and waiting requests (which counts every replica's requests, not only this
//! gateway's), and the poll outcomes, so an operator can see when selection
//! falls back to this replica's own counts.

mod gateway_support;

use gateway_support::*;
use serde_json::json;

/// Sum of the samples of `name` (labelled or not) in a Prometheus text page;
/// `None` when the family has no sample.
fn sample(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
        *found.get_or_insert(0.0) += v;
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_reported_load_and_poll_outcomes_are_on_metrics() {
    let mut engine = Engine::start("both");
    let config = format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 50\n"),
        kv_rule("kv", "converged"),
        engine.endpoint_toml("both"),
    );
    let gw = Gateway::start(&config);
    wait_subscribed(&gw).await;

    // Idle: polls succeed, the engine reports nothing running.
    eventually("first load polls", || async {
        let m = metrics_text(&gw).await;
        let ok = sample(&m, "kvroute_engine_load_polls_total")?;
        (ok >= 2.0 && sample(&m, "kvroute_engine_reported_running") == Some(0.0)).then_some(())
    })
    .await;

    // One request through the gateway and two straight to the engine, as
    // other replicas' would be: the gateway counts one, the engine three.
    let long = |seed: &str| json!({"model": MODEL, "prompt": prompt(seed, 40), "max_tokens": 4000});
    let mut held = Vec::new();
    let urls = [
        gw.url("/v1/completions"),
        format!("http://{}/v1/completions", engine.http),
        format!("http://{}/v1/completions", engine.http),
    ];
    for (i, url) in urls.into_iter().enumerate() {
        let body = long(&format!("held{i}"));
        held.push(tokio::spawn(async move {
            client()
                .post(url)
                .json(&body)
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    let (own, engine_total) = eventually("engine reports all three requests", || async {
        let m = metrics_text(&gw).await;
        let running = sample(&m, "kvroute_engine_reported_running")?;
        let waiting = sample(&m, "kvroute_engine_reported_waiting")?;
        let own = sample(&m, "kvroute_in_flight")?;
        (running + waiting == 3.0).then_some((own, running + waiting))
    })
    .await;
    assert_eq!(
        own, 1.0,
        "this gateway has one request of its own in flight"
    );
    assert_eq!(engine_total, 3.0);

    // The engine goes away: polls fail, counted, and the stale report is gone.
    engine.proc.kill();
    for h in held {
        let _ = h.await;
    }
    eventually("poll failures counted, report withdrawn", || async {
        let m = metrics_text(&gw).await;
        let failed = sample(&m, "kvroute_engine_load_poll_failures_total")?;
        (failed >= 1.0 && sample(&m, "kvroute_engine_reported_running").is_none()).then_some(())
    })
    .await;
}
