//! `limits.include_usage`: a streamed request that does not ask for usage
//! is forwarded with `stream_options.include_usage = true` (the facade's
//! `kvroute::receipt::include_usage`), so the engine — the vLLM stand-in,
//! vLLM 0.33.0's block pool and usage — ends the stream with its
//! `cached_tokens` and the decision gets its receipt. Off, such a stream has
//! no receipt; a client's own `include_usage: false` always stands.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn config(include_usage: Option<bool>, engine: &Standin) -> String {
    let limits = match include_usage {
        Some(on) => format!("[limits]\ninclude_usage = {on}\n"),
        None => String::new(),
    };
    let mut s = config_head(&format!("[health]\ninterval_ms = 0\n{limits}"));
    s.push_str(&kv_rule("kv", "converged"));
    s.push_str(&engine.endpoint_toml("both"));
    s
}

/// A streamed chat request (`stream_options` as given) read to its end:
/// the SSE text the client got.
async fn stream_chat(gw: &Gateway, text: &str, stream_options: Option<Value>) -> String {
    let mut body = json!({"model": MODEL, "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": text}]});
    if let Some(o) = stream_options {
        body["stream_options"] = o;
    }
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let sse = resp.text().await.unwrap();
    assert!(sse.contains("data: [DONE]"), "{sse}");
    sse
}

/// The cached tokens of the SSE's usage chunk, `None` without one.
fn sse_cached(sse: &str) -> Option<u64> {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .map(|v| cached_tokens(&v))
}

/// (receipts, delivered cached tokens) of the rule's one endpoint once a
/// non-streamed request of a fresh prompt (`seed`; its usage always comes
/// back, with 0 cached tokens) has been booked and the count reached
/// `at_least`. A receipt the streams before it make is booked at each
/// body's end, well before this request's round trip ends: a stream that
/// booked none leaves the count one short of one that did.
async fn settle(gw: &Gateway, seed: &str, at_least: u64) -> (u64, u64) {
    let (status, v) = complete(gw, &prompt(seed, 10), 1).await;
    assert_eq!((status, cached_tokens(&v)), (200, 0), "{v}");
    eventually(&format!("{at_least} receipts"), || async {
        let eps = endpoints(gw).await;
        let n = eps[0]["receipts"].as_u64().unwrap_or(0);
        let delivered = eps[0]["delivered_cached_tokens"].as_u64().unwrap_or(0);
        (n >= at_least).then_some((n, delivered))
    })
    .await
}

/// What a receipt needs the stream to carry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_does_not_ask_for_usage_still_books_its_receipt() {
    let engine = Standin::start(StandinOpts::default());
    let gw = Gateway::start(&config(None, &engine));
    wait_subscribed(&gw).await;
    let text = prompt("usage-default", 60);

    let first = stream_chat(&gw, &text, None).await;
    assert_eq!(sse_cached(&first), Some(0), "usage added: {first}");
    eventually("the engine's blocks in the inventory", || async {
        (inventory(&gw).await[0] > 0).then_some(())
    })
    .await;
    // The repeat is a hit; its stream's receipt confirms the prediction.
    let second = stream_chat(&gw, &text, None).await;
    let streamed = sse_cached(&second).expect("usage added");
    assert!(streamed >= 48, "{second}");
    // Both streams and the plain request.
    let (receipts, delivered) = settle(&gw, "sync-a", 3).await;
    assert_eq!(receipts, 3);
    assert_eq!(delivered, streamed, "the second stream's cached tokens");
    let eps = endpoints(&gw).await;
    assert_eq!(
        eps[0]["predicted_cached_tokens"], eps[0]["delivered_cached_tokens"],
        "{eps:?}"
    );

    // A client that said no keeps its stream as asked: no usage, no receipt.
    let declined = stream_chat(&gw, &text, Some(json!({"include_usage": false}))).await;
    assert_eq!(sse_cached(&declined), None, "{declined}");
    let (receipts, _) = settle(&gw, "sync-b", 4).await;
    assert_eq!(receipts, 4, "the declined stream booked nothing");
    // One that asked gets it, once.
    let asked = stream_chat(&gw, &text, Some(json!({"include_usage": true}))).await;
    assert_eq!(asked.matches("\"usage\"").count(), 1, "{asked}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_a_stream_without_usage_books_no_receipt() {
    let engine = Standin::start(StandinOpts::default());
    let gw = Gateway::start(&config(Some(false), &engine));
    wait_subscribed(&gw).await;
    let text = prompt("usage-off", 60);
    let sse = stream_chat(&gw, &text, None).await;
    assert_eq!(sse_cached(&sse), None, "{sse}");
    let (receipts, _) = settle(&gw, "sync-a", 1).await;
    assert_eq!(receipts, 1, "only the plain request booked one");
    // Asking still works with the rewrite off.
    let asked = stream_chat(&gw, &text, Some(json!({"include_usage": true}))).await;
    assert!(sse_cached(&asked).is_some(), "{asked}");
    let (receipts, _) = settle(&gw, "sync-b", 3).await;
    assert_eq!(receipts, 3);
}
