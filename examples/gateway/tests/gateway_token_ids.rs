//! Rule `forward_token_ids`: `kvroute serve` sends a `/v1/completions`
//! string prompt to the engine as the token ids it computed (the library's
//! `kvroute::prompt::IdsBody`), and the engine — the vLLM stand-in, vLLM
//! 0.33.0's block hasher and pool — runs exactly the ids its own `/tokenize`
//! gives for the text, with the cached-token receipt the gateway predicted.
//! Chat requests and `echo` go as text; with the key off everything does.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn config(forward: bool, engine: &Standin) -> String {
    let mut s = config_head("[health]\ninterval_ms = 0\n");
    s.push_str(&kv_rule("kv", "converged"));
    if forward {
        // Rule keys come before the rule's endpoint tables.
        s = s.trim_end().to_owned() + "\nforward_token_ids = true\n\n";
    }
    s.push_str(&engine.endpoint_toml("both"));
    s
}

async fn post(url: String, body: &Value) -> Value {
    let resp = client().post(url).json(body).send().await.unwrap();
    let status = resp.status();
    let v: Value = resp.json().await.unwrap();
    assert!(status.is_success(), "{status}: {v}");
    v
}

/// The endpoints once `n` receipts are booked (at the response body's end,
/// which the client may see before the gateway has run it).
async fn receipts(gw: &Gateway, n: u64) -> Vec<Value> {
    eventually("the receipts", || async {
        let eps = endpoints(gw).await;
        (eps[0]["receipts"].as_u64() == Some(n)).then_some(eps)
    })
    .await
}

async fn own_ids(engine: &Standin, text: &str) -> Value {
    post(
        engine.url("/tokenize"),
        &json!({"model": MODEL, "prompt": text}),
    )
    .await["tokens"]
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_reach_the_engine_as_the_ids_it_would_compute() {
    let engine = Standin::start(StandinOpts::default());
    let gw = Gateway::start(&config(true, &engine));
    wait_subscribed(&gw).await;

    let text = prompt("tokenize-once", 60);
    let want = own_ids(&engine, &text).await;
    assert!(want.as_array().unwrap().len() > 48, "{want}");
    let body = json!({"model": MODEL, "prompt": text, "max_tokens": 4});

    let first = post(gw.url("/v1/completions"), &body).await;
    assert_eq!(cached_tokens(&first), 0);
    let stats = engine.stats().await;
    assert_eq!(stats["completion_prompts_ids"], 1, "{stats}");
    assert_eq!(stats["completion_prompts_text"], 0, "{stats}");
    assert_eq!(stats["last_completion_prompt"]["token_ids"], want);

    // The repeat is a KV-exact hit, delivered as predicted.
    eventually("the engine's blocks in the inventory", || async {
        (inventory(&gw).await[0] > 0).then_some(())
    })
    .await;
    let second = post(gw.url("/v1/completions"), &body).await;
    assert!(cached_tokens(&second) >= 48, "{second}");
    let eps = receipts(&gw, 2).await;
    assert_eq!(
        eps[0]["predicted_cached_tokens"], eps[0]["delivered_cached_tokens"],
        "{eps:?}"
    );
    assert_eq!(engine.stats().await["completion_prompts_ids"], 2);

    // Text: echo (the engine would echo the ids decoded back) and chat.
    let echo = json!({"model": MODEL, "prompt": text, "max_tokens": 2, "echo": true});
    post(gw.url("/v1/completions"), &echo).await;
    let chat = json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Chat stays chat."}]});
    post(gw.url("/v1/chat/completions"), &chat).await;
    let stats = engine.stats().await;
    assert_eq!(stats["completion_prompts_ids"], 2, "{stats}");
    assert_eq!(stats["completion_prompts_text"], 1, "{stats}");
    assert_eq!(stats["requests"], 4, "{stats}");

    // Counted once per request: forwarded, or kept as text and why.
    let metrics = metrics_text(&gw).await;
    for (outcome, n) in [("forwarded", 2), ("echo", 1), ("chat", 1), ("engine", 0)] {
        let line =
            format!("kvroute_prompt_token_ids_total{{rule=\"kv\",outcome=\"{outcome}\"}} {n}");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_the_engine_gets_the_text() {
    let engine = Standin::start(StandinOpts::default());
    let gw = Gateway::start(&config(false, &engine));
    wait_subscribed(&gw).await;
    let (status, _) = complete(&gw, &prompt("plain", 20), 2).await;
    assert_eq!(status, 200);
    let stats = engine.stats().await;
    assert_eq!(stats["completion_prompts_text"], 1, "{stats}");
    assert_eq!(stats["completion_prompts_ids"], 0, "{stats}");
}

fn forward_rule(topology: &str) -> String {
    kv_rule("kv", topology).trim_end().to_owned() + "\nforward_token_ids = true\n\n"
}

async fn token_id_metric(gw: &Gateway, outcome: &str) -> u64 {
    let metrics = metrics_text(gw).await;
    let prefix = format!("kvroute_prompt_token_ids_total{{rule=\"kv\",outcome=\"{outcome}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{prefix} in\n{metrics}"))
}

/// The mock engine (kvroute-engines' own prompt pipeline) takes id prompts:
/// its receipt for the forwarded ids equals the gateway's prediction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_engine_takes_the_ids_with_the_predicted_receipt() {
    let engine = Engine::start("both");
    let config = format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n"),
        forward_rule("converged"),
        engine.endpoint_toml("both")
    );
    let gw = Gateway::start(&config);
    wait_subscribed(&gw).await;
    let p = prompt("mock-ids", 80);
    let (status, v) = complete(&gw, &p, 2).await;
    assert_eq!((status, cached_tokens(&v)), (200, 0), "{v}");
    eventually("the mock engine's blocks in the inventory", || async {
        (inventory(&gw).await[0] > 0).then_some(())
    })
    .await;
    let (status, v) = complete(&gw, &p, 2).await;
    assert_eq!(status, 200, "{v}");
    assert!(cached_tokens(&v) >= 48, "{v}");
    let eps = receipts(&gw, 2).await;
    assert_eq!(
        eps[0]["predicted_cached_tokens"], eps[0]["delivered_cached_tokens"],
        "{eps:?}"
    );
    assert_eq!(token_id_metric(&gw, "forwarded").await, 2);
}

/// A P/D two-step builds both legs from the client's body: text, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_legs_go_as_text() {
    let prefill = Engine::start("prefill");
    let decode = Engine::start("decode");
    let config = format!(
        "{}{}{}[[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"decode\"\n\n",
        config_head("[health]\ninterval_ms = 0\n"),
        forward_rule("prefill_decode"),
        prefill.endpoint_toml("prefill"),
        decode.http
    );
    let gw = Gateway::start(&config);
    wait_subscribed(&gw).await;
    let (status, v) = complete(&gw, &prompt("pd-ids", 40), 3).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(token_id_metric(&gw, "prefill_decode").await, 1);
    assert_eq!(token_id_metric(&gw, "forwarded").await, 0);
}
