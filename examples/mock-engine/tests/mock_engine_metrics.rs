//! The mock engine's `GET /metrics` on 127.0.0.1, scraped while real requests run
//! and parsed with kvroute-engines' engine-load parser: running, waiting and KV
//! usage follow the worker's state, and capacity and block size its configuration,
//! in each imitated engine's names.

use kvroute_mock_engine as mock_engine;

use std::time::{Duration, Instant};

use clap::Parser;
use kvroute_engines::{parse_load, EngineLoadReport, MetricsDialect};
use serde_json::{json, Value};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: mock_engine::Args,
}

const CAPACITY: u32 = 256;

/// One running request at a time, ~0.5 s of decode each; ephemeral ports.
fn args(format: &str) -> mock_engine::Args {
    let capacity = CAPACITY.to_string();
    Cli::parse_from([
        "mock-engine",
        "--port",
        "0",
        "--zmq-port",
        "0",
        "--format",
        format,
        "--max-running",
        "1",
        "--capacity-blocks",
        &capacity,
        "--prefill-step-us",
        "100",
        "--prefill-us-per-token",
        "10",
        "--decode-us-per-token",
        "20000",
    ])
    .args
}

async fn scrape(base: &str, dialect: MetricsDialect) -> EngineLoadReport {
    let resp = reqwest::get(format!("{base}/metrics")).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let body = resp.bytes().await.unwrap();
    parse_load(dialect, &body).unwrap_or_else(|e| panic!("{e}\n{}", String::from_utf8_lossy(&body)))
}

/// A 100-byte prompt (one token per byte): 6 full blocks; with 25 output tokens
/// the request holds ceil(125 / 16) = 8 blocks while it runs.
fn prompt(i: usize) -> String {
    format!("{i:02} ").repeat(34)[..100].to_owned()
}

const HELD_BLOCKS: f64 = 8.0;

fn spawn_requests(base: &str, n: usize) -> Vec<tokio::task::JoinHandle<Value>> {
    (0..n)
        .map(|i| {
            let url = format!("{base}/v1/completions");
            tokio::spawn(async move {
                let resp = reqwest::Client::new()
                    .post(url)
                    .json(&json!({"model": "mock", "prompt": prompt(i), "max_tokens": 25}))
                    .send()
                    .await
                    .unwrap();
                assert!(resp.status().is_success());
                resp.json::<Value>().await.unwrap()
            })
        })
        .collect()
}

async fn wait_for(base: &str, dialect: MetricsDialect, want: (u32, u32)) -> EngineLoadReport {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = scrape(base, dialect).await;
        if (r.running, r.waiting) == want {
            return r;
        }
        assert!(Instant::now() < deadline, "never saw {want:?}; last {r:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn vllm_gauges_follow_the_queue_and_the_cache() {
    let engine = mock_engine::start(&args("vllm")).await.unwrap();
    let base = format!("http://{}", engine.http);

    let idle = scrape(&base, MetricsDialect::Vllm).await;
    assert_eq!(
        idle,
        EngineLoadReport {
            running: 0,
            waiting: 0,
            kv_usage: Some(0.0),
            kv_capacity_blocks: Some(u64::from(CAPACITY)),
            block_size: Some(16),
            kv_capacity_tokens: Some(u64::from(CAPACITY) * 16),
            waiting_prefill_tokens: None,
            prefill_computed_tokens: Some(0),
            prefill_seconds: Some(0.0),
            ranks: 1,
        }
    );

    let requests = spawn_requests(&base, 3);
    let busy = wait_for(&base, MetricsDialect::Vllm, (1, 2)).await;
    assert_eq!(busy.kv_usage, Some(HELD_BLOCKS / f64::from(CAPACITY)));
    // The queue drains one request at a time.
    wait_for(&base, MetricsDialect::Vllm, (1, 1)).await;
    wait_for(&base, MetricsDialect::Vllm, (1, 0)).await;
    let mut computed = 0u64;
    for r in requests {
        let usage = &r.await.unwrap()["usage"];
        computed += usage["prompt_tokens"].as_u64().unwrap()
            - usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
    }

    let done = scrape(&base, MetricsDialect::Vllm).await;
    assert_eq!((done.running, done.waiting), (0, 0));
    // The prefill histograms' sums: every uncached prompt token, and each
    // request's prefill time from its start in the serial pipeline (one
    // 100 µs step plus 10 µs per token), queueing excluded.
    assert_eq!(done.prefill_computed_tokens, Some(computed));
    let seconds = done.prefill_seconds.unwrap();
    let expect = (3.0 * 100.0 + 10.0 * computed as f64) / 1e6;
    assert!((seconds - expect).abs() < 1e-9, "{seconds} vs {expect}");
    // Finished requests leave their prompt blocks cached but unreferenced: free.
    assert_eq!(done.kv_usage, Some(0.0));
    let cache: Value = reqwest::get(format!("{base}/admin/cache"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(cache["cached_blocks"].as_u64().unwrap() >= 18, "{cache}");
}

#[tokio::test]
async fn sglang_and_trtllm_flavours_use_their_engines_names() {
    for (format, dialect) in [
        ("sglang", MetricsDialect::Sglang),
        ("trtllm", MetricsDialect::Trtllm),
    ] {
        let engine = mock_engine::start(&args(format)).await.unwrap();
        let base = format!("http://{}", engine.http);
        let requests = spawn_requests(&base, 2);
        let busy = wait_for(&base, dialect, (1, 1)).await;
        assert_eq!(
            busy.kv_usage,
            Some(HELD_BLOCKS / f64::from(CAPACITY)),
            "{format}"
        );
        assert_eq!(
            busy.kv_capacity_blocks,
            Some(u64::from(CAPACITY)),
            "{format}"
        );
        assert_eq!(busy.block_size, Some(16), "{format}");
        assert_eq!(
            busy.kv_capacity_tokens,
            Some(u64::from(CAPACITY) * 16),
            "{format}"
        );
        // A body of one flavour is not another's.
        let body = reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert!(parse_load(MetricsDialect::Vllm, &body).is_err(), "{format}");
        for r in requests {
            r.await.unwrap();
        }
        let done = wait_for(&base, dialect, (0, 0)).await;
        assert_eq!(done.kv_usage, Some(0.0), "{format}");
    }
}
