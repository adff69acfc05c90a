//! The mock engine's `--request-log` on 127.0.0.1: one JSON line per admitted
//! request, whose id is the response's (and names the engine's port), whose
//! cached tokens are what `usage` reported, and whose queue and timeline show a
//! request that waited for a running slot. `scripts/bench_smg_trace.py` joins
//! these lines to a benchmark client's per-request view.

use kvroute_mock_engine as mock_engine;

use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: mock_engine::Args,
}

/// One running request at a time, 20 ms per output token; ephemeral ports.
fn args(log: &std::path::Path) -> mock_engine::Args {
    Cli::parse_from([
        "mock-engine",
        "--port",
        "0",
        "--zmq-port",
        "0",
        "--max-running",
        "1",
        "--prefill-step-us",
        "100",
        "--prefill-us-per-token",
        "10",
        "--decode-us-per-token",
        "20000",
        "--request-log",
        log.to_str().unwrap(),
    ])
    .args
}

/// 100 bytes, one token per byte: 6 full blocks.
fn prompt(tag: char) -> String {
    std::iter::repeat_n(tag, 100).collect()
}

async fn complete(base: &str, prompt: &str, max_tokens: u32) -> Value {
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "mock", "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.json().await.unwrap()
}

fn lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn by_id<'a>(log: &'a [Value], id: &Value) -> &'a Value {
    let found: Vec<&Value> = log.iter().filter(|l| &l["id"] == id).collect();
    assert_eq!(found.len(), 1, "one line for {id} in {log:?}");
    found[0]
}

#[tokio::test]
async fn one_line_per_request_with_its_id_cache_queue_and_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let engine = mock_engine::start(&args(&path)).await.unwrap();
    let base = format!("http://{}", engine.http);
    let port = engine.http.port();

    // Cold, then the same prompt again: the second finds its blocks cached.
    let cold = complete(&base, &prompt('a'), 1).await;
    let warm = complete(&base, &prompt('a'), 1).await;
    let cold_id = cold["id"].as_str().unwrap();
    assert!(
        cold_id.starts_with(&format!("cmpl-mock-{port}-")),
        "the id names the engine: {cold_id}"
    );
    assert_ne!(cold["id"], warm["id"]);

    // One running slot: a second request sent while the first runs waits.
    let running = {
        let base = base.clone();
        tokio::spawn(async move { complete(&base, &prompt('b'), 5).await })
    };
    wait_running(&base, 1).await;
    let second = complete(&base, &prompt('c'), 5).await;
    let first = running.await.unwrap();

    let log = lines(&path);
    assert_eq!(log.len(), 4, "{log:?}");
    for (resp, cached) in [
        (&cold, Some(0)),
        (&warm, None),
        (&first, None),
        (&second, None),
    ] {
        let l = by_id(&log, &resp["id"]);
        let reported = &resp["usage"]["prompt_tokens_details"]["cached_tokens"];
        assert_eq!(&l["cached_tokens"], reported, "{l}");
        if let Some(c) = cached {
            assert_eq!(l["cached_tokens"], c);
        }
        assert_eq!(l["prompt_tokens"], resp["usage"]["prompt_tokens"], "{l}");
        let t = |k: &str| l[k].as_u64().unwrap_or_else(|| panic!("{k} in {l}"));
        assert!(t("admitted_us") <= t("first_token_us"), "{l}");
        assert!(t("first_token_us") <= t("finish_us"), "{l}");
        assert!(l["unix_s"].as_f64().unwrap() > 1.0e9, "{l}");
    }
    assert!(
        by_id(&log, &warm["id"])["cached_tokens"].as_u64().unwrap() >= 80,
        "{log:?}"
    );

    // The second saw the first running and was admitted only when it
    // finished (5 tokens of 20 ms: ~80 ms after the first's start).
    let (a, b) = (by_id(&log, &first["id"]), by_id(&log, &second["id"]));
    assert_eq!(a["running_at_submit"], 0, "{a}");
    assert_eq!(a["admitted_us"], 0, "{a}");
    assert_eq!(b["running_at_submit"], 1, "{b}");
    assert!(b["admitted_us"].as_u64().unwrap() >= 50_000, "{b}");
    // On the shared wall clock (each line's times are relative to its own
    // `unix_s`, read just before submission): admitted when the first ended.
    let a_end = a["unix_s"].as_f64().unwrap() + a["finish_us"].as_f64().unwrap() / 1e6;
    let b_admit = b["unix_s"].as_f64().unwrap() + b["admitted_us"].as_f64().unwrap() / 1e6;
    assert!(
        (b_admit - a_end).abs() < 0.02,
        "admitted at {b_admit}, first ended {a_end}"
    );
}

/// Polls the engine's own gauge until `n` requests run (bounded: 10 s).
async fn wait_running(base: &str, n: u32) {
    let want = format!("}} {}.0", n);
    for _ in 0..2000 {
        let text = reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if text
            .lines()
            .any(|l| l.starts_with("vllm:num_requests_running{") && l.ends_with(&want))
        {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("the engine never ran {n} requests");
}

#[tokio::test]
async fn no_log_without_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut a = args(&path);
    a.request_log = None;
    let engine = mock_engine::start(&a).await.unwrap();
    let base = format!("http://{}", engine.http);
    complete(&base, &prompt('a'), 1).await;
    assert!(!path.exists());
}
