//! Hostile request bodies, pass-through accounting and secret hygiene, over
//! real sockets: `kvroute serve` on 127.0.0.1 in front of an in-test echo
//! upstream. Every hostile body must get a clean answer (never a 5xx, never a
//! hang) and be counted under its own miss reason.

mod gateway_support;

use std::net::SocketAddr;

use gateway_support::*;
use serde_json::{json, Value};

const ADMIN_TOKEN: &str = "adm1n-t0ken-9f8e7d6c5b4a";
const CLIENT_AUTH: &str = "Bearer sk-client-0123456789abcdef";
const CLIENT_API_KEY: &str = "xk-upstream-key-fedcba9876543210";

/// A KV rule (default, qwen3) over the echo upstream, whose KV events never
/// arrive (so every completion falls back), plus a rule whose endpoint is down.
fn config(echo: SocketAddr, admin: &str, limits: &str) -> String {
    format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\n\
         [[rules.endpoints]]\nurl = \"http://{echo}\"\nzmq = \"tcp://*:{}\"\n\n\
         [[rules]]\nname = \"down\"\nmodels = [\"down-model\"]\nchoice = \"round_robin\"\n\
         [[rules.endpoints]]\nurl = \"http://127.0.0.1:{}\"\n",
        config_head_with_admin(admin, &format!("[limits]\n{limits}\n[health]\ninterval_ms = 0\n")),
        closed_port(),
        closed_port(),
    )
}

async fn misses(gw: &Gateway, token: Option<&str>) -> Value {
    get_json(&gw.admin_url("/admin/counters"), token).await["rules"]["kv"]["misses"].clone()
}

/// All misses of a rule's counters, whatever the reason.
fn miss_total(misses: &Value) -> u64 {
    misses
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum()
}

/// POSTs `body` as JSON to `path`; returns (status, echoed JSON).
async fn post_raw(gw: &Gateway, path: &str, body: Vec<u8>) -> (u16, Value) {
    let resp = client()
        .post(gw.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_get_clean_answers_and_counted_misses() {
    let echo = echo_upstream().await;
    // 8 MB bodies allowed; the prompt limit (default 1 Mi characters) bounds tokenizing.
    let gw = Gateway::start(&config(echo, "", "max_body_bytes = 8388608\n"));

    // Invalid UTF-8 labelled as JSON: not JSON to the router (json.loads would
    // refuse it too) → a not_json miss, forwarded untouched by the rule's selector.
    let mut bad = br#"{"model": "qwen3", "prompt": ""#.to_vec();
    bad.extend_from_slice(b"\xff\xfe\xc3\x28");
    bad.extend_from_slice(br#""}"#);
    let n = bad.len();
    let (status, v) = post_raw(&gw, "/v1/completions", bad).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["len"], n, "{v}");
    assert_eq!(misses(&gw, None).await["not_json"], 1);

    // 100 000 levels of nesting: the parser stops at its depth bound (256) →
    // not_json, forwarded; the gateway does no work proportional to the depth.
    for (open, seen) in [("[", 2), ("{\"a\":", 3)] {
        let deep = open.repeat(100_000).into_bytes();
        let n = deep.len();
        let (status, v) = post_raw(&gw, "/v1/chat/completions", deep).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["len"], n);
        assert_eq!(misses(&gw, None).await["not_json"], seen);
    }

    // A 4 M-character completions prompt: not tokenized (prompt_too_long),
    // forwarded intact.
    let huge = "lorem ".repeat(700_000);
    let body = json!({"model": MODEL, "prompt": huge, "max_tokens": 1}).to_string();
    let n = body.len();
    let (status, v) = post_raw(&gw, "/v1/completions", body.into_bytes()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["len"], n);
    assert_eq!(misses(&gw, None).await["prompt_too_long"], 1);
    // The same as a chat message: refused before the template is even rendered.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": huge}]});
    let (status, v) = post_raw(&gw, "/v1/chat/completions", body.to_string().into_bytes()).await;
    assert_eq!(status, 200, "{v}");
    let m = misses(&gw, None).await;
    assert_eq!(m["prompt_too_long"], 2, "{m}");
    // None of the hostile bodies was mistaken for a tokenizer failure.
    assert_eq!(m["tokenize_error"], 0, "{m}");

    // The gateway is still healthy, and a normal prompt is tokenized.
    let (status, v) = complete(&gw, &prompt("after", 40), 1).await;
    assert_eq!(status, 200, "{v}");
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("kvroute_kv_misses_total{rule=\"kv\",reason=\"prompt_too_long\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_requests_total{rule=\"kv\",outcome=\"proxied\"} 6"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_prompt_limit_applies_to_tokens_and_characters() {
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(
        echo,
        "",
        "max_prompt_chars = 200\nmax_prompt_tokens = 20\n",
    ));
    // Under both limits: tokenized (then a miss for another reason: no KV
    // events ever arrive).
    let (status, _) = complete(&gw, "a short prompt", 1).await;
    assert_eq!(status, 200);
    // Under the character limit but over the token limit.
    let (status, _) = complete(&gw, &"x1 ".repeat(50), 1).await;
    assert_eq!(status, 200);
    // Over the character limit.
    let (status, _) = complete(&gw, &"y".repeat(201), 1).await;
    assert_eq!(status, 200);
    // A token-id prompt over the token limit (never tokenized).
    let ids: Vec<u32> = (1..=21).collect();
    let body = json!({"model": MODEL, "prompt": ids}).to_string();
    let (status, _) = post_raw(&gw, "/v1/completions", body.into_bytes()).await;
    assert_eq!(status, 200);
    let m = misses(&gw, None).await;
    assert_eq!(m["prompt_too_long"], 3, "{m}");
    assert_eq!(miss_total(&m), 4, "{m}");
    assert_eq!(m["tokenize_error"], 0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_requests_are_counted_apart_from_kv_misses() {
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(echo, "", ""));
    let http = client();

    let r = http.get(gw.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["path"], "/v1/models");
    let r = http
        .post(gw.url("/v1/embeddings"))
        .json(&json!({"model": MODEL, "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // GET on a completions path is not a completion either.
    let r = http.get(gw.url("/v1/completions")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // A HEAD answer has no body to stream: complete, not an aborted stream.
    let r = http.head(gw.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    let c = get_json(&gw.admin_url("/admin/counters"), None).await["rules"]["kv"].clone();
    assert_eq!(c["decisions"], 0, "{c}");
    assert_eq!(miss_total(&c["misses"]), 0, "{c}");

    // A pass-through for a rule whose only endpoint is down: 503 with the reason.
    let r = http
        .post(gw.url("/v1/embeddings"))
        .json(&json!({"model": "down-model", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("connect failed"), "{msg}");

    // A completion still is a KV decision (a miss here: no events arrive).
    let (status, _) = complete(&gw, "one completion", 1).await;
    assert_eq!(status, 200);
    let c = get_json(&gw.admin_url("/admin/counters"), None).await["rules"]["kv"].clone();
    assert_eq!(c["decisions"], 1, "{c}");
    assert_eq!(miss_total(&c["misses"]), 1, "{c}");

    let text = http
        .get(gw.admin_url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("kvroute_requests_total{rule=\"kv\",outcome=\"passthrough\"} 4"),
        "{text}"
    );
    assert!(text.contains("kvroute_aborted_streams_total 0"), "{text}");
    assert!(
        text.contains("kvroute_requests_total{rule=\"down\",outcome=\"no_endpoint\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("kvroute_requests_total{rule=\"kv\",outcome=\"proxied\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_reach_the_logs_at_debug_or_trace_level() {
    for level in ["debug", "trace"] {
        secrets_stay_out_of_the_log(level).await;
    }
}

async fn secrets_stay_out_of_the_log(level: &str) {
    let echo = echo_upstream().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(
        &config(echo, &format!("token = \"{ADMIN_TOKEN}\"\n"), ""),
        level,
        log.reopen().unwrap(),
    );
    let http = client();
    let wrong_token = "wr0ng-admin-guess-1122334455";

    // Admin calls with the right and a wrong token.
    get_json(&gw.admin_url("/admin/rules"), Some(ADMIN_TOKEN)).await;
    let r = http
        .get(gw.admin_url("/admin/counters"))
        .bearer_auth(wrong_token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // Client credentials pass through to the upstream, on every path kind:
    // completion (decision logged at debug), pass-through, not-JSON body,
    // unreachable upstream (warnings logged).
    let send = |path: &str, body: Value| {
        http.post(gw.url(path))
            .header("authorization", CLIENT_AUTH)
            .header("x-api-key", CLIENT_API_KEY)
            .header("accept-encoding", "gzip, br")
            .json(&body)
            .send()
    };
    let r = send(
        "/v1/completions",
        json!({"model": MODEL, "prompt": prompt("secret", 30), "max_tokens": 1}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["authorization"], CLIENT_AUTH,
        "credentials must reach the upstream"
    );
    // Asked for an answer the receipt scanner can read.
    assert_eq!(v["accept-encoding"], "identity");
    let r = send("/v1/embeddings", json!({"model": MODEL, "input": "x"}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = send(
        "/v1/completions",
        json!({"model": "down-model", "prompt": "x"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 503);
    let r = http
        .post(gw.url("/v1/chat/completions"))
        .header("authorization", CLIENT_AUTH)
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http
        .get(gw.url("/v1/models"))
        .header("authorization", CLIENT_AUTH)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Stop the gateway (SIGKILL: nothing is flushed at exit that was not written before).
    let mut gw = gw;
    gw.proc.kill();
    let text = std::fs::read_to_string(log.path()).unwrap();
    // The log is really at debug level and saw these requests.
    assert!(
        text.contains("DEBUG"),
        "no debug output captured at {level}:\n{text}"
    );
    assert!(text.contains("decision"), "no decision logged:\n{text}");
    assert!(
        text.contains("no endpoint"),
        "no 503 warning logged:\n{text}"
    );
    for secret in [
        ADMIN_TOKEN,
        wrong_token,
        CLIENT_AUTH,
        "sk-client-0123456789abcdef",
        CLIENT_API_KEY,
        // Prompt text is user data too (the tokenizer would log it at trace).
        "secret-word17",
    ] {
        assert!(
            !text.contains(secret),
            "{secret:?} leaked into the {level} log:\n{text}"
        );
    }
}
