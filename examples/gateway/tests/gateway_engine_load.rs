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

/// A gateway with one KV rule over `engine`, polling its `/metrics` every
/// 50 ms (health probes off), subscribed to its events.
async fn polling_gateway(engine: &Engine) -> Gateway {
    let config = format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 50\n"),
        kv_rule("kv", "converged"),
        engine.endpoint_toml("both"),
    );
    let gw = Gateway::start(&config);
    wait_subscribed(&gw).await;
    gw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_reported_load_and_poll_outcomes_are_on_metrics() {
    let mut engine = Engine::start("both");
    let gw = polling_gateway(&engine).await;

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

/// Non-streamed requests hide their prefill end from the gateway (the first
/// byte is the whole answer), so the tracker holds each prompt through its
/// decode. The engine's own prefill counters, polled from `/metrics`, give
/// the cost scorer's drain the true rate: `/admin/counters` shows it beside
/// the tracker's decode-diluted one, and the drain uses the larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_prefill_counters_set_the_drain_rate_for_non_streamed_requests() {
    let engine = Engine::start("both");
    let gw = polling_gateway(&engine).await;

    // The engine's true rate: one 100 µs step plus 50 µs per token per
    // request. Fresh ~300-word prompts, 60 ms of decode each, four at a time.
    let mut done = 0usize;
    let mut rate = None;
    for round in 0..60 {
        let batch: Vec<_> = (0..4)
            .map(|k| {
                let p = prompt(&format!("r{round}k{k}"), 300);
                let url = gw.url("/v1/completions");
                tokio::spawn(async move {
                    client()
                        .post(url)
                        .json(&json!({"model": MODEL, "prompt": p, "max_tokens": 120}))
                        .send()
                        .await
                        .map(|r| r.status().as_u16())
                })
            })
            .collect();
        for b in batch {
            assert_eq!(b.await.unwrap().unwrap(), 200);
            done += 1;
        }
        let c = counters(&gw, "kv").await;
        if c["prefill_rate"]["engine_reported"].is_number() {
            rate = Some(c["prefill_rate"].clone());
            break;
        }
    }
    let rate = rate.unwrap_or_else(|| panic!("no engine-reported rate after {done} requests"));
    let reported = rate["engine_reported"].as_f64().unwrap();
    // ≤ 1e6 / 50 tokens/s; the step costs at most a few per cent at these sizes.
    assert!(
        (15_000.0..=20_000.0).contains(&reported),
        "engine-reported rate {reported}: {rate}"
    );
    let used = rate["used"].as_f64().unwrap();
    assert!(
        rate["tracked"]
            .as_f64()
            .is_none_or(|t| t < reported * 0.8 && used == reported),
        "the tracker's rate includes decode time: {rate}"
    );
    assert!(used >= reported, "{rate}");
    // The per-endpoint report carries the counters it came from.
    let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
    let rep = &eps["endpoints"][0]["load"]["engine_reported"];
    assert!(rep["prefill_tokens"].as_u64().unwrap() > 0, "{eps}");
    assert!(rep["prefill_seconds"].as_f64().unwrap() > 0.0, "{eps}");
}
