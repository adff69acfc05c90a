//! The embedding example routing real engines: two vLLM stand-ins (vLLM
//! 0.33.0's own KV-cache code), the example's axum proxy on 127.0.0.1, the
//! same chat sent twice through it.

use kvroute_testkit as support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use http_body_util::Full;
use support::*;

fn endpoint_arg(s: &Standin) -> String {
    format!("{},tcp://*:{},tcp://127.0.0.1:{}", s.url(), s.zmq, s.replay)
}

async fn post(proxy: &str, body: bytes::Bytes) -> (String, serde_json::Value) {
    let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = client().request(req).await.expect("proxy answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    let endpoint = resp.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    let json = serde_json::from_slice(&read_all(resp.into_body()).await).unwrap();
    (endpoint, json)
}

/// The second identical chat is decided as a KV-exact hit on the engine that
/// cached the first, and that engine's own receipt reports exactly the
/// cached tokens the decision predicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_chat_twice_hits_the_engine_that_cached_it() {
    let engines = [Standin::start(), Standin::start()];
    let args: Vec<String> = engines.iter().map(endpoint_arg).collect();
    let dir = model_dir();
    let router = kvroute_embed_axum::router(CONTRACT, MODEL, dir.to_str().unwrap(), &args).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = listener.local_addr().unwrap().to_string();
    tokio::spawn(kvroute_embed_axum::serve(
        listener,
        kvroute_embed_axum::app(router.clone()),
    ));

    let body = chat("the embedding example", false);
    let (first, json) = post(&proxy, body.clone()).await;
    assert_eq!(kvroute::receipt::cached_tokens(&json), Some(0));
    wait_until("the first engine's blocks", || router.blocks(&first) > 0).await;
    let before = router.counters();

    let (second, json) = post(&proxy, body).await;
    assert_eq!(second, first);
    let cached = kvroute::receipt::cached_tokens(&json).unwrap();
    assert!(cached >= 16, "{json}");
    let after = router.counters();
    let slot = router.endpoint_id(&second).unwrap().index();
    let (b, a) = (&before.endpoints[slot], &after.endpoints[slot]);
    assert_eq!(a.hits - b.hits, 1, "a KV-exact hit");
    assert_eq!(
        a.predicted_tokens - b.predicted_tokens,
        u64::from(cached),
        "predicted = delivered"
    );
    assert_eq!(a.delivered_tokens - b.delivered_tokens, u64::from(cached));
    assert_eq!(router.in_flight(&second), 0);
}

/// The example program itself (argument parsing, listener) proxies to an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_binary_serves() {
    let engine = Standin::start();
    let mut child = Command::new(env!("CARGO_BIN_EXE_embed_axum"))
        .arg("127.0.0.1:0")
        .arg(CONTRACT)
        .arg(format!("{MODEL}={}", model_dir().display()))
        .arg(endpoint_arg(&engine))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn embed_axum");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let proxy = line
        .strip_prefix("embed_axum: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .trim()
        .to_owned();
    let (endpoint, json) = post(&proxy, chat("the binary", false)).await;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(endpoint, engine.url());
    assert_eq!(kvroute::receipt::cached_tokens(&json), Some(0));
}
