//! Engine receipts on a rule that cannot count the prompt (its model has no
//! tokenizer): an implausible `cached_tokens` is refused and counted — on
//! `/admin/counters` and on `/metrics` — and never reaches the delivered
//! evidence, while a plausible one does.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::Arc;

use gateway_support::*;
use parking_lot::Mutex;
use serde_json::Value;

/// A model the gateway has no tokenizer for.
const UNTOKENIZED: &str = "no-tokenizer-model";

/// An engine answering each completion with the next usage object of
/// `usages` (the last one repeated).
async fn receipt_engine(usages: Vec<Value>) -> SocketAddr {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    let queue = Arc::new(Mutex::new(usages));
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let queue = Arc::clone(&queue);
        async move {
            if !req.uri().path().starts_with("/v1/") {
                return axum::http::StatusCode::NOT_FOUND.into_response();
            }
            let usage = {
                let mut q = queue.lock();
                if q.len() > 1 {
                    q.remove(0)
                } else {
                    q.first().cloned().unwrap_or(Value::Null)
                }
            };
            axum::Json(serde_json::json!({"choices": [{"text": "ok"}], "usage": usage}))
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn usage(cached: u64, prompt: Option<u64>) -> Value {
    let mut u = serde_json::json!({"prompt_tokens_details": {"cached_tokens": cached}});
    if let Some(p) = prompt {
        u["prompt_tokens"] = p.into();
    }
    u
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn implausible_receipts_are_refused_and_counted_when_the_prompt_length_is_unknown() {
    let engine = receipt_engine(vec![
        // More than the engine's own prompt count.
        usage(4_294_967_295, Some(10)),
        // Beyond u32, and no prompt count.
        usage(4_294_967_304, None),
        // Beyond any context window, and no prompt count.
        usage(3_000_000_000, None),
        // Plausible.
        usage(8, Some(10)),
    ])
    .await;
    let toml = format!(
        "{}[[rules]]\nname = \"rr\"\nmodels = [\"{UNTOKENIZED}\"]\nchoice = \"round_robin\"\n\n[[rules.endpoints]]\nurl = \"http://{engine}\"\n",
        config_head("[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n")
    );
    let gw = Gateway::start(&toml);
    eventually("ready", || async {
        let r = client().get(gw.admin_url("/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    for i in 0..4 {
        let body =
            serde_json::json!({"model": UNTOKENIZED, "prompt": format!("p{i}"), "max_tokens": 1});
        let r = client()
            .post(gw.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // The receipt is recorded when the body ends.
        let _ = r.bytes().await.unwrap();
    }
    let c = eventually("four receipts judged", || async {
        let c = counters(&gw, "rr").await;
        let eps = endpoints(&gw).await;
        let receipts = eps[0]["receipts"].as_u64().unwrap_or(0);
        (c["implausible_receipts"].as_u64().unwrap_or(0) + receipts == 4).then_some(c)
    })
    .await;
    assert_eq!(c["implausible_receipts"], 3, "{c}");
    let ep = &endpoints(&gw).await[0];
    assert_eq!(ep["receipts"], 1, "{ep}");
    assert_eq!(ep["delivered_cached_tokens"], 8, "{ep}");
    let m = metrics_text(&gw).await;
    assert!(
        m.lines()
            .any(|l| l == "kvroute_implausible_receipts_total{rule=\"rr\"} 3"),
        "{m}"
    );
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvroute_delivered_cached_tokens_total{")
                && l.contains("rule=\"rr\"")
                && l.ends_with(" 8")),
        "{m}"
    );
}
