//! End to end over real sockets: `kvroute serve` in front of two `kvroute
//! mock-engine`s (real prefix caches publishing vLLM 0.33 KV events over ZeroMQ,
//! the real qwen3 tokenizer on both sides).

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn two_engine_config(a: &Engine, b: &Engine, health: &str) -> String {
    format!(
        "{}{}{}{}",
        config_head(&format!("[health]\n{health}\n")),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    )
}

/// The one endpoint index holding blocks, once exactly one does.
async fn single_holder(gw: &Gateway) -> usize {
    eventually("one endpoint holding the prompt", || async {
        let inv = inventory(gw).await;
        let holders: Vec<usize> = (0..inv.len()).filter(|&i| inv[i] > 0).collect();
        (holders.len() == 1).then(|| holders[0])
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_requests_land_on_the_endpoint_holding_the_prefix() {
    let a = Engine::start("both");
    let b = Engine::start("both");
    let gw = Gateway::start(&two_engine_config(&a, &b, "interval_ms = 200"));
    wait_subscribed(&gw).await;

    let p = prompt("alpha", 150);
    let (status, cold) = complete(&gw, &p, 2).await;
    assert_eq!(status, 200, "{cold}");
    assert_eq!(cached_tokens(&cold), 0, "first request cannot hit: {cold}");
    let holder = single_holder(&gw).await;
    let before = counters(&gw, "kv").await;
    let hits_before = before["hits"][holder].as_u64().unwrap();

    for k in 0..3 {
        let (status, warm) = complete(&gw, &format!("{p} follow-up {k}"), 2).await;
        assert_eq!(status, 200, "{warm}");
        // The engine itself reports the reuse: only the holder has these blocks.
        assert!(
            cached_tokens(&warm) >= 16,
            "warm request {k} missed the cache: {warm}"
        );
    }
    let after = counters(&gw, "kv").await;
    assert_eq!(
        after["hits"][holder].as_u64().unwrap(),
        hits_before + 3,
        "{after}"
    );
    assert_eq!(after["hits"][1 - holder].as_u64().unwrap(), 0, "{after}");
    assert!(after["tiers"]["kv_exact"].as_u64().unwrap() >= 3, "{after}");

    // Streaming is passed through chunk by chunk; the final usage chunk is the receipt.
    let body = json!({"model": MODEL, "prompt": format!("{p} streamed"), "max_tokens": 6,
                      "stream": true, "stream_options": {"include_usage": true}});
    let mut resp = client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut chunks = 0;
    let mut text = String::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        chunks += 1;
        text.push_str(std::str::from_utf8(&c).unwrap());
    }
    assert!(chunks >= 2, "expected several chunks, got {chunks}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let usage_line = text
        .lines()
        .find(|l| l.contains("\"usage\""))
        .expect("usage chunk");
    let usage: Value = serde_json::from_str(usage_line.trim_start_matches("data: ")).unwrap();
    let streamed_cached = cached_tokens(&usage);
    assert!(streamed_cached >= 16, "{usage}");

    // Receipts: delivered cached tokens reach the holder's evidence and /metrics.
    let eps = endpoints(&gw).await;
    let delivered = eps[holder]["delivered_cached_tokens"].as_u64().unwrap();
    assert!(delivered >= streamed_cached, "{:?}", eps[holder]);
    assert_eq!(
        eps[holder]["contract_status"], "verified",
        "{:?}",
        eps[holder]
    );
    let metrics = metrics_text(&gw).await;
    let holder_url = eps[holder]["url"].as_str().unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("kvroute_delivered_cached_tokens_total{") && l.contains(holder_url))
        .expect("delivered metric");
    let value: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(value, delivered);
    assert!(metrics.contains("kvroute_decision_latency_seconds_count "));
    assert!(metrics.contains("kvroute_subscriber_connected{"));
    assert!(metrics.contains("reason=\"zero_overlap\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connection_goes_to_the_next_best_and_the_client_succeeds() {
    let mut engines = [Engine::start("both"), Engine::start("both")];
    // No probes: the refused connect itself must trigger the retry.
    let gw = Gateway::start(&two_engine_config(
        &engines[0],
        &engines[1],
        "interval_ms = 0",
    ));
    wait_subscribed(&gw).await;
    let p = prompt("bravo", 120);
    assert_eq!(complete(&gw, &p, 1).await.0, 200);
    let holder = single_holder(&gw).await;
    // The holder stops accepting connections; its inventory is still there, so
    // KV-exact picks it first.
    engines[holder].proc.kill();
    let (status, v) = complete(&gw, &format!("{p} again"), 1).await;
    assert_eq!(status, 200, "the client must still succeed: {v}");
    let c = counters(&gw, "kv").await;
    assert_eq!(c["retries"].as_u64().unwrap(), 1, "{c}");
    assert_eq!(
        c["hits"][holder].as_u64().unwrap(),
        1,
        "KV-exact chose the holder first: {c}"
    );
    let eps = endpoints(&gw).await;
    assert_eq!(
        eps[1 - holder]["receipts"].as_u64().unwrap(),
        1,
        "{:?}",
        eps[1 - holder]
    );

    // With every engine gone: 503 with a reason, not a hang.
    engines[1 - holder].proc.kill();
    let (status, v) = complete(&gw, &p, 1).await;
    assert_eq!(status, 503, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("connect failed") || msg.contains("breaker"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restart_clears_its_inventory() {
    let a = Engine::start("both");
    let gw = Gateway::start(&format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n"),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both")
    ));
    wait_subscribed(&gw).await;
    assert_eq!(complete(&gw, &prompt("delta", 100), 1).await.0, 200);
    // (Counted before the restart: the old prompt's blocks.)
    eventually("inventory filled", || async {
        (inventory(&gw).await[0] > 0).then_some(())
    })
    .await;
    let old = prompt("delta", 100);
    let before = counters(&gw, "kv").await["hits"][0].as_u64().unwrap();
    let resp = client()
        .post(format!("http://{}/admin/restart-publisher", a.http))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    // New events follow the restart (sequence numbers start over): the
    // inventory is cleared, then holds only what the engine stored since.
    let fresh = prompt("echo", 30);
    assert_eq!(complete(&gw, &fresh, 1).await.0, 200);
    eventually("restart seen by the subscriber", || async {
        let eps = endpoints(&gw).await;
        let s = &eps[0]["subscribers"][0];
        (s["restarts"].as_u64().unwrap() + s["clears"].as_u64().unwrap() > 0).then_some(())
    })
    .await;
    eventually("inventory refilled with the fresh prompt only", || async {
        let n = inventory(&gw).await[0];
        (n > 0 && n < 20).then_some(())
    })
    .await;
    // The old prompt is no longer predicted anywhere, and the engine agrees.
    let (status, v) = complete(&gw, &format!("{old} again"), 1).await;
    assert_eq!(status, 200);
    assert_eq!(cached_tokens(&v), 0, "{v}");
    let after = counters(&gw, "kv").await;
    assert_eq!(after["hits"][0].as_u64().unwrap(), before, "{after}");
}
