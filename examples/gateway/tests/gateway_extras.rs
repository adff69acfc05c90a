//! Per-request hash extras end to end: `kvroute serve` in front of two
//! `kvroute mock-engine`s whose block keys include vLLM's `cache_salt` (the
//! engines hash with kvroute-core's vLLM 0.33 hasher and publish the salted
//! keys over ZeroMQ). A salted request must be hashed with its salt by the
//! gateway too, or it can never match the engine's inventory.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn two_engine_config(a: &Engine, b: &Engine) -> String {
    format!(
        "{}{}{}{}",
        config_head("[health]\ninterval_ms = 200\n"),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    )
}

/// POST /v1/completions with `cache_salt` (none when `salt` is `None`).
async fn complete_salted(gw: &Gateway, prompt: &str, salt: Option<&str>) -> (u16, Value) {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let resp = client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn miss(counters: &Value, reason: &str) -> u64 {
    counters["misses"][reason]
        .as_u64()
        .unwrap_or_else(|| panic!("no {reason} in {counters}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_requests_route_to_the_endpoint_holding_the_salted_blocks() {
    let a = Engine::start("both");
    let b = Engine::start("both");
    let gw = Gateway::start(&two_engine_config(&a, &b));
    wait_subscribed(&gw).await;

    let p = prompt("salted", 150);
    let (status, cold) = complete_salted(&gw, &p, Some("tenant-a")).await;
    assert_eq!(status, 200, "{cold}");
    assert_eq!(cached_tokens(&cold), 0, "first request cannot hit: {cold}");
    let holder = eventually("one endpoint holding the salted prompt", || async {
        let inv = inventory(&gw).await;
        let holders: Vec<usize> = (0..inv.len()).filter(|&i| inv[i] > 0).collect();
        (holders.len() == 1).then(|| holders[0])
    })
    .await;
    let before = counters(&gw, "kv").await;

    for k in 0..3 {
        let (status, warm) =
            complete_salted(&gw, &format!("{p} follow-up {k}"), Some("tenant-a")).await;
        assert_eq!(status, 200, "{warm}");
        // The engine itself confirms the reuse: only the holder has these salted blocks.
        assert!(
            cached_tokens(&warm) >= 16,
            "salted warm request {k} missed the cache: {warm}"
        );
    }
    let after = counters(&gw, "kv").await;
    let hits = |c: &Value, i: usize| c["hits"][i].as_u64().unwrap();
    assert_eq!(hits(&after, holder), hits(&before, holder) + 3, "{after}");
    assert_eq!(hits(&after, 1 - holder), 0, "{after}");
    assert_eq!(
        miss(&after, "extras_unsupported"),
        0,
        "vLLM 0.33 keys cache_salt: {after}"
    );

    // The same text unsalted, or under another tenant's salt, shares no block
    // with the salted inventory: a counted zero-overlap miss, not a false hit.
    for salt in [None, Some("tenant-b")] {
        let zero_before = miss(&counters(&gw, "kv").await, "zero_overlap");
        let (status, other) = complete_salted(&gw, &format!("{p} follow-up 0"), salt).await;
        assert_eq!(status, 200, "{other}");
        assert_eq!(
            cached_tokens(&other),
            0,
            "salt {salt:?} must not reuse tenant-a's blocks: {other}"
        );
        let c = counters(&gw, "kv").await;
        assert_eq!(miss(&c, "zero_overlap"), zero_before + 1, "{salt:?}: {c}");
        assert_eq!(hits(&c, holder), hits(&after, holder), "{salt:?}: {c}");
    }

    // A non-string salt is refused by the prompt extractor: routed without KV,
    // never hashed without the salt.
    let resp = client()
        .post(gw.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": p, "max_tokens": 2, "cache_salt": 42}))
        .send()
        .await
        .unwrap();
    let _ = resp.status();
    let c = counters(&gw, "kv").await;
    assert_eq!(hits(&c, holder), hits(&after, holder), "{c}");
    // vLLM answers it with a 400 (its request rule): the client's error,
    // counted as such, not as a tokenizer failure.
    assert!(miss(&c, "invalid_request") >= 1, "{c}");
    assert_eq!(miss(&c, "tokenize_error"), 0, "{c}");
}
