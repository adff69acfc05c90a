//! Decision visibility beyond the quickstart: `[decisions] headers = false`
//! hides the headers, `log_sample_rate = 1.0` logs every decision at INFO,
//! an answer the gateway makes itself after a decision (503: the only engine
//! is gone) still names the tier, a pass-through request names its endpoint,
//! a connect failure is described once, and a drain is logged.

mod gateway_support;

use gateway_support::*;

fn kv_headers(resp: &reqwest::Response) -> Vec<String> {
    resp.headers()
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("x-kvroute-"))
        .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?")))
        .collect()
}

async fn post(gw: &Gateway, prompt: &str) -> reqwest::Response {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_off_hides_them_and_full_sampling_logs_every_decision() {
    let engine = Engine::start("both");
    let toml = format!(
        "{}{}{}",
        config_head("[decisions]\nheaders = false\nlog_sample_rate = 1.0\n"),
        kv_rule("vis", "converged"),
        engine.endpoint_toml("both")
    );
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(&toml, "info", log.reopen().unwrap());
    wait_subscribed(&gw).await;
    let text = prompt("visibility", 60);
    for _ in 0..3 {
        let resp = post(&gw, &text).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(kv_headers(&resp), Vec::<String>::new());
    }
    let log_text = eventually("three decision lines", || async {
        let t = std::fs::read_to_string(log.path()).unwrap();
        (t.matches(" decision rule=vis ").count() == 3).then_some(t)
    })
    .await;
    assert!(log_text.contains("tier=\"kv_exact\""), "{log_text}");
    assert!(
        log_text.contains("miss_reason=\"zero_overlap\""),
        "{log_text}"
    );

    let drain = client()
        .put(gw.admin_url("/admin/rules/vis/endpoints/0/admin"))
        .body(r#"{"down": true}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(drain.status(), 200);
    eventually("drain logged", || async {
        let t = std::fs::read_to_string(log.path()).unwrap();
        t.contains("endpoint drained (admin down) rule=vis")
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_after_the_decision_still_names_the_tier() {
    let mut engine = Engine::start("both");
    let toml = format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 60000\n"),
        kv_rule("gone", "converged"),
        engine.endpoint_toml("both")
    );
    let gw = Gateway::start(&toml);
    wait_subscribed(&gw).await;
    let resp = post(&gw, &prompt("gone", 40)).await;
    assert_eq!(resp.status(), 200);
    let url = format!("http://{}", engine.http);
    assert!(
        kv_headers(&resp).contains(&format!("x-kvroute-endpoint: {url}")),
        "{:?}",
        kv_headers(&resp)
    );
    // No KV decision for a non-completion request: endpoint and tier still shown.
    let models = client().get(gw.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 200);
    let shown = kv_headers(&models);
    assert!(
        shown.contains(&"x-kvroute-tier: passthrough".to_owned())
            && shown.contains(&format!("x-kvroute-endpoint: {url}")),
        "{shown:?}"
    );
    engine.proc.kill();
    let resp = post(&gw, &prompt("gone", 40)).await;
    assert!(
        resp.status() == 502 || resp.status() == 503,
        "{}",
        resp.status()
    );
    let headers = kv_headers(&resp);
    assert!(
        headers.iter().any(|h| h.starts_with("x-kvroute-tier: ")),
        "{} without a tier header: {headers:?}",
        resp.status()
    );
    assert!(
        headers.contains(&"x-kvroute-rule: gone".to_owned()),
        "{headers:?}"
    );
    // The reason says "connect failed" once, from the cause on.
    let body: serde_json::Value = resp.json().await.unwrap();
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(msg.matches("connect failed").count(), 1, "{msg}");
    assert!(!msg.contains("client error (Connect)"), "{msg}");
}

/// An engine that sets kvroute's decision headers itself (one behind
/// another kvroute) does not pass them off as this gateway's: with
/// `headers = false` the client sees none, routed or passed through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_own_decision_headers_do_not_pass_through() {
    let app = axum::Router::new().fallback(|| async {
        (
            [
                ("x-kvroute-decision-id", "inner-7"),
                ("x-kvroute-miss-reason", "zero_overlap"),
                ("x-other", "kept"),
            ],
            axum::Json(serde_json::json!({"choices": [{"text": "ok"}], "data": []})),
        )
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let toml = format!(
        "{}[[rules]]\nname = \"rr\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"round_robin\"\n\
         [[rules.endpoints]]\nurl = \"http://{upstream}\"\n",
        config_head("[decisions]\nheaders = false\n[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n"),
    );
    let gw = Gateway::start(&toml);
    let routed = post(&gw, "hello").await;
    assert_eq!(routed.status(), 200);
    assert_eq!(kv_headers(&routed), Vec::<String>::new());
    assert_eq!(routed.headers()["x-other"], "kept");
    let passed = client()
        .post(gw.url("/v1/embeddings"))
        .json(&serde_json::json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(passed.status(), 200);
    assert_eq!(kv_headers(&passed), Vec::<String>::new());
}
