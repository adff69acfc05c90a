//! The tower layer in front of hyper-util's client: buffer → decide → forward
//! → retry (tower's `Retry` with the router's retry) → receipt body.

use kvroute_testkit as support;

use http_body_util::Full;
use kvroute::tower::KvRouteLayer;
use kvroute::{Backend, KvRouter, SelectorKind};
use support::*;
use tower::{Layer, ServiceExt};

fn request(body: bytes::Bytes) -> http::Request<Full<bytes::Bytes>> {
    http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("host", "proxy.example")
        .body(Full::new(body))
        .unwrap()
}

/// Round robin sends one of two fresh prompts to the dead endpoint first:
/// the client's connect error is retried on the live engine, both answers
/// arrive, and both receipts are recorded there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_failure_is_retried_on_the_next_endpoint() {
    let engine = Standin::start();
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let router = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(dead.clone()))
        .endpoint(engine.backend())
        .fallback(SelectorKind::RoundRobin)
        .spawn()
        .unwrap();
    let service = KvRouteLayer::new(router.clone()).layer(client());
    for topic in ["first topic", "second topic"] {
        let resp = service
            .clone()
            .oneshot(request(chat(topic, false)))
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.status());
        let body = read_all(resp.into_body()).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(kvroute::receipt::cached_tokens(&v), Some(0));
    }
    let c = router.counters();
    // Round robin's turn also advances on the retry's fallback, so each
    // request meets the dead endpoint first here.
    assert_eq!(c.retries, 2, "{c:?}");
    let live = router.endpoint_id(&engine.url()).unwrap().index();
    assert_eq!(c.endpoints[live].receipts, 2);
    assert_eq!(
        (router.in_flight(&dead), router.in_flight(&engine.url())),
        (0, 0)
    );
}

/// Every endpoint refuses: the inner service's error comes back once the
/// router has no endpoint left, and nothing stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_endpoint_refuses_the_error_comes_back() {
    let urls: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let mut b = KvRouter::builder(CONTRACT.parse().unwrap()).model(MODEL, model_dir());
    for u in &urls {
        b = b.endpoint(Backend::vllm(u.clone()));
    }
    let router = b.spawn().unwrap();
    let service = KvRouteLayer::new(router.clone()).layer(client());
    let err = service
        .oneshot(request(chat("x", false)))
        .await
        .unwrap_err();
    assert!(err.is::<hyper_util::client::legacy::Error>(), "{err:?}");
    assert!(urls.iter().all(|u| router.in_flight(u) == 0));
    assert_eq!(router.counters().exhausted, 1);
}

/// A body over the layer's limit is refused before any decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_is_refused_before_deciding() {
    let router = KvRouter::builder(CONTRACT.parse().unwrap())
        .endpoint(Backend::vllm(format!("http://127.0.0.1:{}", closed_port())))
        .spawn()
        .unwrap();
    let service = KvRouteLayer::new(router.clone())
        .max_body_bytes(64)
        .layer(client());
    let err = service
        .oneshot(request(chat("x", false)))
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("request body"), "{err}");
    assert_eq!(router.counters().decisions, 0);
}
