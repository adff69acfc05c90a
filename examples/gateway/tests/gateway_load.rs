//! Load accounting through the real gateway: a request counts on
//! its endpoint from the routing decision — not from when the upstream's
//! headers arrive — so a slow non-streaming engine's in-flight requests and
//! queued prefill tokens are visible while it prefills, and they are released
//! when the answer ends. A hung engine that never sends a status line is cut
//! by the response-header timeout and the request retried elsewhere.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gateway_support::*;
use serde_json::Value;

/// Requests an engine stand-in received and answered.
#[derive(Default)]
struct Seen {
    received: AtomicUsize,
    answered: AtomicUsize,
}

/// An engine stand-in that holds each request `delay` before answering
/// (headers and body together, as a non-streaming engine does).
async fn slow_engine(delay: Duration) -> (SocketAddr, Arc<Seen>) {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    let seen = Arc::new(Seen::default());
    let seen2 = Arc::clone(&seen);
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let seen = Arc::clone(&seen2);
        async move {
            // The gateway also polls `/metrics` (engine-reported load): only
            // completions count here.
            let completion = req.uri().path().starts_with("/v1/");
            let _ = axum::body::to_bytes(req.into_body(), 64 << 20).await;
            if !completion {
                return axum::http::StatusCode::NOT_FOUND.into_response();
            }
            seen.received.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(delay).await;
            seen.answered.fetch_add(1, Ordering::SeqCst);
            axum::Json(serde_json::json!({
                "choices": [{"text": "ok"}],
                "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}},
            }))
            .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, seen)
}

/// An engine server whose keep-alive closes idle connections (uvicorn's,
/// 5 s for vLLM and SGLang), made deterministic: a request that arrives on a
/// connection idle for longer than `keep_alive` is dropped unanswered, as
/// when the engine's close crosses the request on the wire. Counts the
/// completions answered and dropped.
async fn keep_alive_engine(keep_alive: Duration) -> (SocketAddr, Arc<Seen>) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    let seen = Arc::new(Seen::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen2 = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = Arc::clone(&seen2);
            let last = Arc::new(parking_lot::Mutex::new(std::time::Instant::now()));
            let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                let (seen, last) = (Arc::clone(&seen), Arc::clone(&last));
                async move {
                    let idle = last.lock().elapsed();
                    let _ = http_body_util::BodyExt::collect(req.into_body()).await;
                    if idle > keep_alive {
                        seen.received.fetch_add(1, Ordering::SeqCst);
                        return Err("closed by keep-alive");
                    }
                    seen.answered.fetch_add(1, Ordering::SeqCst);
                    let body = serde_json::json!({
                        "choices": [{"text": "ok"}],
                        "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}},
                    });
                    *last.lock() = std::time::Instant::now();
                    Ok(hyper::Response::builder()
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body.to_string())))
                        .unwrap())
                }
            });
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// Accepts connections and reads, but never answers.
async fn black_hole() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
            if held.len() > 64 {
                held.remove(0);
            }
        }
    });
    addr
}

fn rule(endpoints: &[SocketAddr], limits: &str) -> String {
    let mut s = format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\n\n",
        config_head(&format!("[limits]\n{limits}\n[health]\ninterval_ms = 0\n")),
    );
    for e in endpoints {
        // Event sockets nothing publishes on: every request is a KV miss
        // placed by the fallback selector, which reads the same load.
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{e}\"\nzmq = \"tcp://127.0.0.1:{}\"\n\n",
            closed_port()
        ));
    }
    s
}

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefilling_non_streaming_request_counts_from_the_decision() {
    let (engine, seen) = slow_engine(Duration::from_millis(3000)).await;
    let gw = Gateway::start(&rule(&[engine], ""));
    let text = prompt("slow", 400);
    let reqs: Vec<_> = (0..3)
        .map(|i| {
            let url = gw.url("/v1/completions");
            let body = serde_json::json!({"model": MODEL, "prompt": format!("{text} {i}"), "max_tokens": 4});
            tokio::spawn(async move { client().post(url).json(&body).send().await.unwrap().status().as_u16() })
        })
        .collect();
    // While the engine holds them (no response headers yet), all three count.
    let load = eventually("three requests in flight while prefilling", || async {
        let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
        let ep = eps["endpoints"][0].clone();
        (ep["in_flight"].as_u64() == Some(3) && seen.received.load(Ordering::SeqCst) == 3)
            .then_some(ep)
    })
    .await;
    assert_eq!(
        seen.answered.load(Ordering::SeqCst),
        0,
        "counted before any response header existed"
    );
    let queued = load["queued_prefill_tokens"].as_u64().unwrap();
    assert!(
        queued > 3 * 300,
        "predicted uncached prompt tokens count as queued prefill: {load}"
    );
    let metrics = metrics_text(&gw).await;
    assert_eq!(metric(&metrics, "kvroute_in_flight{"), 3, "{metrics}");
    assert_eq!(metric(&metrics, "kvroute_queued_prefill_tokens{"), queued);
    for r in reqs {
        assert_eq!(r.await.unwrap(), 200);
    }
    // Answered: nothing is left charged.
    eventually("released after the bodies ended", || async {
        let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
        let ep = &eps["endpoints"][0];
        (ep["in_flight"].as_u64() == Some(0) && ep["queued_prefill_tokens"].as_u64() == Some(0))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_releases_its_charge() {
    let (engine, seen) = slow_engine(Duration::from_secs(30)).await;
    let gw = Gateway::start(&rule(&[engine], ""));
    let body = serde_json::json!({"model": MODEL, "prompt": prompt("gone", 50), "max_tokens": 4});
    let url = gw.url("/v1/completions");
    let pending = tokio::spawn(async move { client().post(url).json(&body).send().await });
    eventually("the request is at the engine and counted", || async {
        let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
        (eps["endpoints"][0]["in_flight"].as_u64() == Some(1)
            && seen.received.load(Ordering::SeqCst) == 1)
            .then_some(())
    })
    .await;
    // The client goes away (its connection is dropped) long before the answer.
    pending.abort();
    assert_eq!(seen.answered.load(Ordering::SeqCst), 0);
    eventually("the dropped request stops counting", || async {
        let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
        (eps["endpoints"][0]["in_flight"].as_u64() == Some(0)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_is_cut_by_the_header_timeout_and_the_request_retried() {
    let hole = black_hole().await;
    let (engine, seen) = slow_engine(Duration::from_millis(10)).await;
    let gw = Gateway::start(&rule(&[hole, engine], "response_header_timeout_ms = 500"));
    // Without the timeout each request to the hole would hang until the
    // client's own timeout fails it; the retries counter below shows the cut.
    for i in 0..4 {
        let (status, v): (u16, Value) = complete(&gw, &prompt(&format!("hung{i}"), 30), 4).await;
        assert_eq!(status, 200, "{v}");
    }
    assert_eq!(
        seen.answered.load(Ordering::SeqCst),
        4,
        "every request answered by the live engine"
    );
    let eps = get_json(&gw.admin_url("/admin/endpoints"), None).await;
    assert_eq!(eps["endpoints"][0]["in_flight"].as_u64(), Some(0));
    let counters = counters(&gw, "kv").await;
    assert!(counters["retries"].as_u64().unwrap() >= 1, "{counters}");
}

/// Pass-through requests (no KV decision) to engines that take them and do
/// not answer within the header timeout: a `POST` is not sent again (the
/// engine may still be running it) and the client gets a 504; a `GET` is
/// tried on the next endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_pass_through_post_is_not_sent_twice() {
    let (a, seen_a) = slow_engine(Duration::from_millis(3000)).await;
    let (b, seen_b) = slow_engine(Duration::from_millis(3000)).await;
    let gw = Gateway::start(&rule(&[a, b], "response_header_timeout_ms = 300"));
    let received =
        || seen_a.received.load(Ordering::SeqCst) + seen_b.received.load(Ordering::SeqCst);
    let resp = client()
        .post(gw.url("/v1/embeddings"))
        .json(&serde_json::json!({"model": MODEL, "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 504);
    assert_eq!(received(), 1, "the POST reached one engine only");
    let resp = client().get(gw.url("/v1/models")).send().await.unwrap();
    assert_eq!(
        resp.status().as_u16(),
        504,
        "both engines took the GET and timed out: a gateway timeout"
    );
    assert_eq!(received(), 3, "the GET was tried on both engines");
}

/// A streamed pass-through request (`"stream": true` on a path without a
/// prompt) waits for its headers only as long as a streamed completion
/// does (`stream_header_timeout_ms`), not the non-streamed limit: engines
/// send a stream's headers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_pass_through_request_gets_the_stream_header_timeout() {
    let (a, seen) = slow_engine(Duration::from_millis(20_000)).await;
    let gw = Gateway::start(&rule(
        &[a],
        "response_header_timeout_ms = 15000\nstream_header_timeout_ms = 300",
    ));
    let resp = client()
        .post(gw.url("/v1/responses"))
        .json(&serde_json::json!({"model": MODEL, "input": "hello", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 504);
    let v: Value = resp.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("within 300ms"), "{v}");
    assert_eq!(seen.received.load(Ordering::SeqCst), 1);
}

/// A completion whose every attempt reached an engine that did not answer
/// within the header timeout gets 504 `upstream_timeout` (503 `no_endpoint`
/// is for endpoints that could not be reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_every_engine_timed_out_on_is_a_gateway_timeout() {
    let (a, _) = slow_engine(Duration::from_millis(3000)).await;
    let (b, _) = slow_engine(Duration::from_millis(3000)).await;
    let gw = Gateway::start(&rule(&[a, b], "response_header_timeout_ms = 300"));
    let (status, v): (u16, Value) = complete(&gw, &prompt("late", 30), 4).await;
    assert_eq!(status, 504, "{v}");
    assert_eq!(v["error"]["type"], "upstream_timeout", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("no endpoint answered in time"), "{v}");
    // Refused connects only: nothing could be reached, still a 503.
    let down: Vec<SocketAddr> = closed_ports(2)
        .into_iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect();
    let gw = Gateway::start(&rule(&down, ""));
    let (status, v): (u16, Value) = complete(&gw, &prompt("down", 30), 4).await;
    assert_eq!(status, 503, "{v}");
}

/// Upstream connections are not kept idle longer than
/// `limits.upstream_pool_idle_ms`: a request after a pause goes on a new
/// connection, not on one the engine's keep-alive is closing. Kept longer
/// than the engine's keep-alive, the request after the pause is written on
/// the closing connection and fails unanswered (502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_not_reused_past_the_pool_idle_time() {
    let pause = Duration::from_millis(1000);
    for (pool_idle_ms, want) in [(300, 200), (5000, 502)] {
        let (engine, seen) = keep_alive_engine(Duration::from_millis(600)).await;
        let limits = format!("upstream_pool_idle_ms = {pool_idle_ms}\nengine_load_poll_ms = 0");
        let gw = Gateway::start(&rule(&[engine], &limits));
        let (status, v): (u16, Value) = complete(&gw, &prompt("first", 30), 4).await;
        assert_eq!(status, 200, "{v}");
        tokio::time::sleep(pause).await;
        let (status, v): (u16, Value) = complete(&gw, &prompt("second", 30), 4).await;
        assert_eq!(status, want, "pool idle {pool_idle_ms} ms: {v}");
        let dropped = seen.received.load(Ordering::SeqCst);
        assert_eq!(
            dropped,
            usize::from(want != 200),
            "pool idle {pool_idle_ms} ms"
        );
    }
}
