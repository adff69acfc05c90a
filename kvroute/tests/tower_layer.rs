//! The tower layer in front of hyper-util's client: buffer → decide → forward
//! → retry (each attempt under the router's header wait and outlier detection) → receipt body.

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

/// An HTTP server on 127.0.0.1 that answers `/health`; completions are
/// answered at once (`hold` false) or never, and its `/metrics` page hangs
/// when `hold` (an engine stuck as a whole, whose health endpoint still
/// answers). Returns its URL.
async fn engine(hold: bool) -> String {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::response::IntoResponse;
    let app = axum::Router::new().fallback(move |req: Request<Body>| async move {
        let path = req.uri().path().to_owned();
        let _ = axum::body::to_bytes(req.into_body(), 1 << 20).await;
        match path.as_str() {
            "/health" => StatusCode::OK.into_response(),
            _ if hold => std::future::pending().await,
            "/metrics" => "vllm:num_requests_running{engine=\"0\"} 0.0\nvllm:num_requests_waiting{engine=\"0\"} 0.0\n"
                .into_response(),
            _ => axum::Json(serde_json::json!({"choices": [{"text": "ok"}],
                "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}}))
            .into_response(),
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

/// Round robin over a stuck engine and a live one, no header timeout at
/// all: requests held by the stuck engine are retried on the live one once
/// outlier detection ejects it (they would wait forever otherwise); the
/// stuck engine is then out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_held_by_an_ejected_endpoint_are_retried_on_the_next() {
    let stuck = engine(true).await;
    let live = engine(false).await;
    let router = KvRouter::builder_without_contract()
        .choice(kvroute::Choice::RoundRobin)
        .endpoint(Backend::vllm(stuck.clone()))
        .endpoint(Backend::vllm(live.clone()))
        .engine_load(kvroute::EngineLoadConfig {
            interval: std::time::Duration::from_millis(100),
            timeout: std::time::Duration::from_millis(200),
            max_age: std::time::Duration::from_secs(5),
        })
        .outlier_detection(kvroute::OutlierConfig {
            stall_after: std::time::Duration::from_secs(1),
            report_grace: std::time::Duration::from_millis(300),
            ..kvroute::OutlierConfig::default()
        })
        .spawn()
        .unwrap();
    let service = KvRouteLayer::new(router.clone()).layer(client());
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let s = service.clone();
            let body = bytes::Bytes::from(format!(r#"{{"model": "m", "prompt": "p{i}"}}"#));
            tokio::spawn(async move {
                let req = http::Request::post("/v1/completions")
                    .header("content-type", "application/json")
                    .body(Full::new(body))
                    .unwrap();
                s.oneshot(req).await.map(|r| r.status())
            })
        })
        .collect();
    for c in calls {
        // Bounded: without outlier detection the held ones never return.
        let status = tokio::time::timeout(std::time::Duration::from_secs(60), c)
            .await
            .expect("answered")
            .unwrap()
            .unwrap();
        assert!(status.is_success(), "{status}");
    }
    let s = router.endpoint_status(&stuck).unwrap();
    assert!(s.outlier.ejections >= 1, "{:?}", s.outlier);
    assert!(router.counters().retries >= 1);
    assert_eq!((router.in_flight(&stuck), router.in_flight(&live)), (0, 0));
}

/// A round-robin router over two live engines the inner service below
/// stands in for (it never reaches them).
async fn two_engines() -> KvRouter {
    KvRouter::builder_without_contract()
        .choice(kvroute::Choice::RoundRobin)
        .endpoint(Backend::vllm(engine(false).await))
        .endpoint(Backend::vllm(engine(false).await))
        .spawn()
        .unwrap()
}

/// The inner service sent the request and then failed (a reset): the
/// engine may have acted on it, so it is not sent again elsewhere; the
/// error comes back and nothing stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_after_the_request_was_sent_is_not_retried() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let router = two_engines().await;
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&calls);
    let inner = tower::service_fn(move |_req: http::Request<Full<bytes::Bytes>>| {
        seen.fetch_add(1, Ordering::SeqCst);
        async {
            Err::<http::Response<Full<bytes::Bytes>>, _>(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "reset after the request was sent",
            ))
        }
    });
    let service = KvRouteLayer::new(router.clone()).layer(inner);
    let err = service
        .oneshot(request(chat("x", false)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("reset after"), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(router.counters().retries, 0);
    for s in router.endpoint_statuses() {
        assert_eq!(s.load.in_flight, 0, "{s:?}");
    }
}

/// Hop-by-hop headers, the fixed ones and those a `Connection` header
/// names, cross the layer in neither direction; the others do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_cross_in_neither_direction() {
    let router = two_engines().await;
    let upstream = std::sync::Arc::new(parking_lot::Mutex::new(http::HeaderMap::new()));
    let record = std::sync::Arc::clone(&upstream);
    let inner = tower::service_fn(move |req: http::Request<Full<bytes::Bytes>>| {
        *record.lock() = req.headers().clone();
        async {
            Ok::<_, std::io::Error>(
                http::Response::builder()
                    .header("connection", "close, x-hop-back")
                    .header("keep-alive", "timeout=5")
                    .header("x-hop-back", "1")
                    .header("x-end", "1")
                    .body(Full::new(bytes::Bytes::from_static(b"{}")))
                    .unwrap(),
            )
        }
    });
    let service = KvRouteLayer::new(router).layer(inner);
    let mut req = request(chat("x", false));
    for (k, v) in [
        ("connection", "x-hop"),
        ("x-hop", "1"),
        ("proxy-connection", "keep-alive"),
        ("x-keep", "1"),
    ] {
        req.headers_mut().insert(k, v.parse().unwrap());
    }
    let resp = service.oneshot(req).await.unwrap();
    let sent = upstream.lock().clone();
    for h in ["connection", "x-hop", "proxy-connection"] {
        assert!(!sent.contains_key(h), "{h} reached the engine: {sent:?}");
    }
    assert_eq!(sent["x-keep"], "1");
    for h in ["connection", "keep-alive", "x-hop-back"] {
        assert!(
            !resp.headers().contains_key(h),
            "{h} came back: {:?}",
            resp.headers()
        );
    }
    assert_eq!(resp.headers()["x-end"], "1");
}

/// A `POST` to `path` whose body serves an embedding or a completion.
fn post(path: &str) -> http::Request<Full<bytes::Bytes>> {
    http::Request::post(path)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from_static(
            br#"{"model": "m", "input": "x", "prompt": "x"}"#,
        )))
        .unwrap()
}

/// An unrouted request that is not idempotent (`POST /v1/embeddings`) taken
/// by an engine that sends no headers in time is not sent again: the
/// engine may have acted on it. The stall comes back, the other engine is
/// never called and nothing stays charged; a routed completion stalled the
/// same way moves to the next engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_unrouted_post_is_not_sent_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let stuck = engine(true).await;
    let live_calls = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&live_calls);
    let live = {
        let app = axum::Router::new().fallback(move || {
            seen.fetch_add(1, Ordering::SeqCst);
            async {
                axum::Json(serde_json::json!({"data": [], "choices": [{"text": "ok"}],
                    "usage": {"prompt_tokens": 5}}))
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}")
    };
    let router = KvRouter::builder_without_contract()
        .choice(kvroute::Choice::RoundRobin)
        .endpoint(Backend::vllm(stuck.clone()))
        .endpoint(Backend::vllm(live.clone()))
        .no_engine_load()
        .no_health_probes()
        .header_timeouts(kvroute::HeaderTimeouts {
            response: Some(std::time::Duration::from_millis(300)),
            streamed: None,
        })
        .spawn()
        .unwrap();
    let service = KvRouteLayer::new(router.clone()).layer(client());
    // Round robin starts on the stuck engine.
    let err = service
        .clone()
        .oneshot(post("/v1/embeddings"))
        .await
        .unwrap_err();
    assert!(
        err.downcast_ref::<kvroute::tower::KvRouteError>()
            .is_some_and(|e| matches!(e, kvroute::tower::KvRouteError::Stalled(_))),
        "{err}"
    );
    assert_eq!(live_calls.load(Ordering::SeqCst), 0);
    assert_eq!(router.counters().retries, 0);
    // A completion stalled on the stuck engine is retried on the live one.
    let mut answered = 0;
    for _ in 0..2 {
        let r = service.clone().oneshot(post("/v1/completions")).await;
        answered += usize::from(r.is_ok_and(|r| r.status().is_success()));
    }
    assert_eq!(answered, 2);
    assert!(router.counters().retries >= 1);
    for s in router.endpoint_statuses() {
        assert_eq!(s.load.in_flight, 0, "{s:?}");
    }
}

/// An answer to a request routed without a prompt (`POST /v1/embeddings`)
/// settles no receipt, even when it carries a usage block with cached
/// tokens: its decision predicted nothing to compare with. A completion's
/// answer settles one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrouted_answer_settles_no_receipt() {
    let router = KvRouter::builder_without_contract()
        .choice(kvroute::Choice::RoundRobin)
        .endpoint(Backend::vllm(engine(false).await))
        .no_engine_load()
        .no_health_probes()
        .spawn()
        .unwrap();
    let service = KvRouteLayer::new(router.clone()).layer(client());
    let receipts = || -> u64 { router.counters().endpoints.iter().map(|e| e.receipts).sum() };
    for (path, settled) in [("/v1/embeddings", 0), ("/v1/completions", 1)] {
        let response = service.clone().oneshot(post(path)).await.unwrap();
        assert!(response.status().is_success());
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(body.starts_with(b"{\"choices\""), "{body:?}");
        assert_eq!(receipts(), settled, "{path}");
    }
}

/// An engine behind a compressing proxy (nginx's `gzip on`) compresses its
/// answer when the request accepts it, which hides the usage block from the
/// receipt scanner. The layer asks for an uncompressed answer whatever the
/// client accepts, so the receipt settles; an answer compressed anyway is
/// passed through intact and unscanned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_is_asked_for_an_answer_the_receipt_can_read() {
    use std::io::{Read, Write};
    const ANSWER: &[u8] =
        br#"{"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}}"#;
    let gzip = |b: &[u8]| {
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(b).unwrap();
        z.finish().unwrap()
    };
    for always in [false, true] {
        let router = KvRouter::builder_without_contract()
            .choice(kvroute::Choice::RoundRobin)
            .endpoint(Backend::vllm(engine(false).await))
            .no_engine_load()
            .no_health_probes()
            .spawn()
            .unwrap();
        let accepted = std::sync::Arc::new(parking_lot::Mutex::new(None));
        let record = std::sync::Arc::clone(&accepted);
        let inner = tower::service_fn(move |req: http::Request<Full<bytes::Bytes>>| {
            let accepts = req.headers().get("accept-encoding").cloned();
            *record.lock() = accepts.clone();
            let compress = always || accepts.is_some_and(|v| v.to_str().unwrap().contains("gzip"));
            let b = http::Response::builder().header("content-type", "application/json");
            let response = if compress {
                b.header("content-encoding", "gzip")
                    .body(Full::new(bytes::Bytes::from(gzip(ANSWER))))
            } else {
                b.body(Full::new(bytes::Bytes::from_static(ANSWER)))
            };
            async move { Ok::<_, std::io::Error>(response.unwrap()) }
        });
        let service = KvRouteLayer::new(router.clone()).layer(inner);
        let mut req = post("/v1/completions");
        req.headers_mut()
            .insert("accept-encoding", "gzip, deflate".parse().unwrap());
        let response = service.oneshot(req).await.unwrap();
        let encoded = response.headers().contains_key("content-encoding");
        let body = read_all(response.into_body()).await;
        let mut plain = Vec::new();
        if encoded {
            flate2::read::GzDecoder::new(&body[..])
                .read_to_end(&mut plain)
                .unwrap();
        } else {
            plain = body.to_vec();
        }
        assert_eq!(plain, ANSWER, "always compressed: {always}");
        assert_eq!(accepted.lock().clone().unwrap(), "identity");
        let receipts: u64 = router.counters().endpoints.iter().map(|e| e.receipts).sum();
        assert_eq!(receipts, u64::from(!always), "always compressed: {always}");
    }
}
