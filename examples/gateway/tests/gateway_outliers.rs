//! Outlier detection through the real gateway: an engine that passes its
//! health probe but never answers requests is taken out of rotation and the
//! requests it holds are retried elsewhere long before the response-header
//! timeout (120 s here); it is back once it answers again. An engine busy
//! with long non-streamed generations, whose load report counts them, stays
//! in. A streamed request whose engine sends no headers is retried after the
//! streamed-header timeout.
//!
//! Every engine here is an HTTP server on 127.0.0.1 that answers `/health`
//! and serves a vLLM-style `/metrics` page the gateway polls.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::Value;

/// What an engine does with completions.
const ANSWER: u8 = 0;
/// Accepts completions and never answers them.
const HOLD: u8 = 1;
/// Answers completions after `SLOW`.
const SLOW: u8 = 2;
const SLOW_FOR: Duration = Duration::from_secs(8);

/// What its `/metrics` page says.
const COUNT: u8 = 0;
/// `num_requests_running` 0 whatever it holds.
const ZERO: u8 = 1;
/// Never answers.
const HANG: u8 = 2;

struct Engine {
    addr: SocketAddr,
    mode: AtomicU8,
    metrics: AtomicU8,
    received: AtomicUsize,
    answered: AtomicUsize,
    /// Completions it holds now.
    holding: AtomicUsize,
}

struct Holding(Arc<Engine>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.holding.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Engine {
    async fn start(mode: u8, metrics: u8) -> Arc<Self> {
        use axum::body::Body;
        use axum::http::{header, Request, StatusCode};
        use axum::response::IntoResponse;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let engine = Arc::new(Self {
            addr: listener.local_addr().unwrap(),
            mode: AtomicU8::new(mode),
            metrics: AtomicU8::new(metrics),
            received: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
            holding: AtomicUsize::new(0),
        });
        let e = Arc::clone(&engine);
        let app = axum::Router::new().fallback(move |req: Request<Body>| {
            let e = Arc::clone(&e);
            async move {
                let path = req.uri().path().to_owned();
                let body = axum::body::to_bytes(req.into_body(), 64 << 20)
                    .await
                    .unwrap_or_default();
                match path.as_str() {
                    "/health" => return StatusCode::OK.into_response(),
                    "/metrics" => {
                        let running = match e.metrics.load(Ordering::SeqCst) {
                            HANG => std::future::pending().await,
                            ZERO => 0,
                            _ => e.holding.load(Ordering::SeqCst),
                        };
                        return format!(
                            "vllm:num_requests_running{{engine=\"0\",model_name=\"{MODEL}\"}} {running}.0\n\
                             vllm:num_requests_waiting{{engine=\"0\",model_name=\"{MODEL}\"}} 0.0\n"
                        )
                        .into_response();
                    }
                    p if p.starts_with("/v1/") => {}
                    _ => return StatusCode::NOT_FOUND.into_response(),
                }
                e.received.fetch_add(1, Ordering::SeqCst);
                e.holding.fetch_add(1, Ordering::SeqCst);
                let _held = Holding(Arc::clone(&e));
                match e.mode.load(Ordering::SeqCst) {
                    HOLD => std::future::pending().await,
                    SLOW => tokio::time::sleep(SLOW_FOR).await,
                    _ => {}
                }
                e.answered.fetch_add(1, Ordering::SeqCst);
                let usage = serde_json::json!({"prompt_tokens": 10, "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 0}});
                let answer = serde_json::json!({"choices": [{"text": "ok"}], "usage": usage});
                if serde_json::from_slice::<Value>(&body).is_ok_and(|v| v["stream"] == true) {
                    let sse = format!("data: {answer}\n\ndata: [DONE]\n\n");
                    return ([(header::CONTENT_TYPE, "text/event-stream")], sse).into_response();
                }
                axum::Json(answer).into_response()
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        engine
    }

    fn set(&self, mode: u8, metrics: u8) {
        self.mode.store(mode, Ordering::SeqCst);
        self.metrics.store(metrics, Ordering::SeqCst);
    }
}

/// A round-robin rule over `engines` with health probes every 500 ms (which
/// every engine here passes) and the engine load poll at its default 500 ms.
fn config(engines: &[&Arc<Engine>], limits: &str, health: &str) -> String {
    let mut s = config_head(&format!(
        "[limits]\n{limits}\n[health]\ninterval_ms = 500\n{health}\n"
    ));
    s.push_str("[[rules]]\nname = \"rr\"\ndefault = true\nchoice = \"round_robin\"\nselector = \"round_robin\"\n\n");
    for e in engines {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\n\n",
            e.addr
        ));
    }
    s
}

async fn ready(gw: &Gateway) {
    eventually("the gateway is ready", || async {
        let r = client().get(gw.admin_url("/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
}

/// `n` completions sent `gap` apart, each answered or failed within the
/// test client's bound ([`WAIT`], well under the 120 s response-header
/// timeout): (status, seconds to the whole answer) each.
async fn burst(gw: &Gateway, n: usize, gap: Duration, stream: bool) -> Vec<(u16, f64)> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = gw.url("/v1/completions");
        let body = serde_json::json!({"model": MODEL, "prompt": format!("request {i}"),
            "max_tokens": 4, "stream": stream});
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let status = match client().post(url).json(&body).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    // The whole answer, not only its headers.
                    match r.bytes().await {
                        Ok(_) => status,
                        Err(_) => 0,
                    }
                }
                Err(_) => 0,
            };
            (status, started.elapsed().as_secs_f64())
        }));
        tokio::time::sleep(gap).await;
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

async fn endpoint(gw: &Gateway, e: &Engine) -> Value {
    let url = format!("http://{}", e.addr);
    endpoints(gw)
        .await
        .into_iter()
        .find(|v| v["url"] == url.as_str())
        .unwrap_or_else(|| panic!("{url} not on /admin/endpoints"))
}

/// The round-robin black-hole case: one good engine and one that passes its
/// health probe but holds every request, ten non-streamed requests 0.2 s
/// apart. Every request is answered (by the good engine) within the test
/// client's 60 s bound — without outlier detection half of them would wait
/// for the 120 s response-header timeout — and the hole is out of rotation;
/// once it answers again it is back. `metrics` is what the hole's load
/// report does: hang as its requests do, or report nothing running.
async fn black_hole_round_robin(metrics: u8) {
    let good = Engine::start(ANSWER, COUNT).await;
    let hole = Engine::start(HOLD, metrics).await;
    let gw = Gateway::start(&config(&[&good, &hole], "", "outlier_ejection_ms = 3000"));
    ready(&gw).await;
    let answers = burst(&gw, 10, Duration::from_millis(200), false).await;
    let slowest = answers.iter().map(|a| a.1).fold(0.0, f64::max);
    println!("black hole (metrics mode {metrics}): latencies {answers:?}, slowest {slowest:.2} s");
    assert!(answers.iter().all(|a| a.0 == 200), "{answers:?}");
    assert!(
        hole.received.load(Ordering::SeqCst) >= 1,
        "the hole got requests"
    );
    assert_eq!(hole.answered.load(Ordering::SeqCst), 0);
    assert_eq!(good.answered.load(Ordering::SeqCst), 10);
    let ep = endpoint(&gw, &hole).await;
    assert!(ep["outlier"]["stall_ejections"].as_u64() >= Some(1), "{ep}");
    assert_eq!(
        ep["probe_ok"], true,
        "its health probe passes throughout: {ep}"
    );
    let m = metrics_text(&gw).await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvroute_outlier_ejections_total{")
                && l.contains(&hole.addr.to_string())
                && !l.ends_with(" 0")),
        "{m}"
    );

    // It answers again: back in rotation once its ejection ends (3 s, or 6 s
    // after a second one), its requests answered.
    hole.set(ANSWER, COUNT);
    eventually("the healed engine answers requests again", || async {
        let (status, _) = complete(&gw, "again", 4).await;
        assert_eq!(status, 200);
        (hole.answered.load(Ordering::SeqCst) >= 1).then_some(())
    })
    .await;
    assert_eq!(endpoint(&gw, &hole).await["ejected"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_hole_whose_metrics_hang_is_ejected_and_its_requests_retried() {
    black_hole_round_robin(HANG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_hole_that_reports_nothing_running_is_ejected_and_its_requests_retried() {
    black_hole_round_robin(ZERO).await;
}

/// Two engines that take 8 s per non-streamed answer beside a fast one,
/// with a 2 s stall limit: the one whose load report counts the requests it
/// holds is never ejected and answers every request it got; the one that
/// reports nothing running while it holds them is ejected and its requests
/// are answered elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_engine_whose_report_counts_its_requests_is_never_ejected() {
    let fast = Engine::start(ANSWER, COUNT).await;
    let busy = Engine::start(SLOW, COUNT).await;
    let silent = Engine::start(SLOW, ZERO).await;
    let gw = Gateway::start(&config(
        &[&fast, &busy, &silent],
        "",
        "outlier_stall_ms = 2000\noutlier_ejection_ms = 60000",
    ));
    ready(&gw).await;
    let answers = burst(&gw, 9, Duration::from_millis(200), false).await;
    println!("busy engines: latencies {answers:?}");
    assert!(answers.iter().all(|a| a.0 == 200), "{answers:?}");
    let b = endpoint(&gw, &busy).await;
    assert_eq!(b["outlier"]["ejections"], 0, "{b}");
    assert!(busy.received.load(Ordering::SeqCst) >= 1);
    assert_eq!(
        busy.answered.load(Ordering::SeqCst),
        busy.received.load(Ordering::SeqCst),
        "every request the busy engine got was left to it"
    );
    let s = endpoint(&gw, &silent).await;
    assert!(s["outlier"]["stall_ejections"].as_u64() >= Some(1), "{s}");
    // Each request answered once: the silent engine's were answered elsewhere.
    let answered_elsewhere =
        fast.answered.load(Ordering::SeqCst) + busy.answered.load(Ordering::SeqCst);
    assert_eq!(answered_elsewhere, 9);
}

/// A streamed request to an engine that sends no headers (its load report
/// counts the request, so it is not a stall) is retried after the 1 s
/// streamed-header timeout; non-streamed ones are not cut by it. Three such
/// timeouts in a row eject the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_without_headers_is_retried_after_the_stream_header_timeout() {
    let good = Engine::start(ANSWER, COUNT).await;
    let mute = Engine::start(HOLD, COUNT).await;
    let gw = Gateway::start(&config(
        &[&good, &mute],
        "stream_header_timeout_ms = 1000",
        "outlier_ejection_ms = 60000",
    ));
    ready(&gw).await;
    let mut sent = 0;
    eventually(
        "three streamed-header timeouts eject the mute engine",
        || {
            sent += 1;
            let gw = &gw;
            let mute = &mute;
            async move {
                let answers = burst(gw, 1, Duration::ZERO, true).await;
                assert_eq!(answers[0].0, 200, "{answers:?}");
                let ep = endpoint(gw, mute).await;
                (ep["outlier"]["ejections"].as_u64() >= Some(1)).then_some(ep)
            }
        },
    )
    .await;
    assert_eq!(
        mute.received.load(Ordering::SeqCst),
        3,
        "after {sent} requests"
    );
    assert_eq!(mute.answered.load(Ordering::SeqCst), 0);
    assert_eq!(good.answered.load(Ordering::SeqCst), sent);
    let c = counters(&gw, "rr").await;
    assert!(c["retries"].as_u64() >= Some(3), "{c}");
}
