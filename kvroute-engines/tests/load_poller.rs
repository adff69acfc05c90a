//! The load poller against a real HTTP server on 127.0.0.1 (axum) serving a
//! scripted sequence: vLLM bodies, a 500, garbage, a hang past the timeout, an
//! oversized body, then the engine again.
#![cfg(feature = "trtllm-http")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kvroute_engines::transport::{LoadPollError, LoadPoller, LoadPollerConfig};
use kvroute_engines::{EngineLoadReport, LoadReportError, MetricsDialect};

#[derive(Clone)]
enum Step {
    Body(String),
    Status(u16),
    Hang(Duration),
}

fn vllm(running: u32, waiting: u32, usage: f64) -> String {
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4096\"}} 1.0\n"
    )
}

async fn serve(steps: Vec<Step>) -> (String, Arc<AtomicUsize>) {
    let steps = Arc::new(steps);
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let steps = Arc::clone(&steps);
            let h = Arc::clone(&h);
            async move {
                let i = h.fetch_add(1, Ordering::SeqCst);
                // After the script, keep serving its last step.
                let step = steps[i.min(steps.len() - 1)].clone();
                match step {
                    Step::Body(b) => b.into_response(),
                    Step::Status(s) => StatusCode::from_u16(s).unwrap().into_response(),
                    Step::Hang(d) => {
                        tokio::time::sleep(d).await;
                        Response::new(vllm(99, 99, 0.99).into())
                    }
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/metrics"), hits)
}

#[tokio::test]
async fn reports_load_and_every_failure_kind_in_order() {
    let big = "#".repeat(64 * 1024);
    let steps = vec![
        Step::Body(vllm(3, 1, 0.25)),
        Step::Status(500),
        Step::Body("<html>bad gateway</html>".into()),
        Step::Hang(Duration::from_secs(3)),
        Step::Body(big),
        Step::Body(vllm(0, 0, 0.0)),
    ];
    let (url, hits) = serve(steps).await;
    let config = LoadPollerConfig::new(url, MetricsDialect::Vllm)
        .interval(Duration::from_millis(20))
        .timeout(Duration::from_millis(300))
        .max_body_bytes(16 * 1024);
    let poller = LoadPoller::new(config).unwrap();
    let metrics = poller.metrics();
    let seen: Arc<Mutex<Vec<Result<EngineLoadReport, String>>>> = Arc::default();
    let kinds: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (s, k) = (Arc::clone(&seen), Arc::clone(&kinds));
    let task = tokio::spawn(poller.run(
        move |r| {
            k.lock().unwrap().push(match &r {
                Ok(_) => "ok",
                Err(LoadPollError::Status(500)) => "status",
                Err(LoadPollError::Parse(LoadReportError::MissingMetric { .. })) => "parse",
                Err(LoadPollError::Timeout(_)) => "timeout",
                Err(LoadPollError::TooLarge(_)) => "too_large",
                Err(_) => "other",
            });
            s.lock().unwrap().push(r.map_err(|e| e.to_string()));
        },
        async move {
            let _ = stopped.await;
        },
    ));

    let deadline = Instant::now() + Duration::from_secs(15);
    while kinds.lock().unwrap().len() < 7 {
        assert!(
            Instant::now() < deadline,
            "polls: {:?}",
            kinds.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    task.await.unwrap();

    let kinds = kinds.lock().unwrap().clone();
    assert_eq!(
        &kinds[..7],
        ["ok", "status", "parse", "timeout", "too_large", "ok", "ok"],
        "{:?}",
        seen.lock().unwrap()
    );
    let seen = seen.lock().unwrap();
    let first = seen[0].as_ref().unwrap();
    assert_eq!((first.running, first.waiting), (3, 1));
    assert_eq!(first.kv_usage, Some(0.25));
    assert_eq!(first.kv_capacity_tokens, Some(4096 * 16));
    let last = seen[5].as_ref().unwrap();
    assert_eq!(
        (last.running, last.waiting, last.kv_usage),
        (0, 0, Some(0.0))
    );

    let m = metrics.snapshot();
    assert!(m.polls >= 7, "{m:?}");
    assert_eq!(
        (
            m.status_errors,
            m.parse_errors,
            m.timeouts,
            m.too_large,
            m.request_errors
        ),
        (1, 1, 1, 1, 0),
        "{m:?}"
    );
    assert_eq!(m.failures, 4);
    assert_eq!(m.consecutive_failures, 0);
    assert!(m.last_success.is_some());
    assert!(hits.load(Ordering::SeqCst) >= 7);
}

#[tokio::test]
async fn an_engine_that_is_not_there_is_a_request_error_and_stop_ends_the_task() {
    // Bind and drop to get a port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = LoadPollerConfig::new(
        format!("http://127.0.0.1:{port}/metrics"),
        MetricsDialect::Sglang,
    )
    .interval(Duration::from_millis(10))
    .timeout(Duration::from_millis(500));
    let poller = LoadPoller::new(config).unwrap();
    let metrics = poller.metrics();
    assert!(matches!(
        poller.poll_once().await,
        Err(LoadPollError::Request(_))
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = Arc::clone(&n);
    let task = tokio::spawn(poller.run(
        move |r| {
            assert!(r.is_err());
            n2.fetch_add(1, Ordering::SeqCst);
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while n.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("stop ends the poller")
        .unwrap();
    let m = metrics.snapshot();
    assert!(
        m.request_errors >= 4 && m.consecutive_failures == m.polls,
        "{m:?}"
    );
    assert_eq!(m.last_success, None);
}
