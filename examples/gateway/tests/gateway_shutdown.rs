//! Graceful shutdown: on SIGTERM the gateway stops accepting, lets an in-flight
//! streamed response finish, and exits cleanly.

mod gateway_support;

use gateway_support::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_streams_finish() {
    let engine = Engine::start("both");
    let mut gw = Gateway::start(&format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n[limits]\nshutdown_grace_ms = 30000\n"),
        kv_rule("kv", "converged"),
        engine.endpoint_toml("both")
    ));
    // 2000 tokens at 500 µs of modelled decode each: a stream of about 1 s.
    let body = json!({"model": MODEL, "prompt": prompt("shutdown", 20), "max_tokens": 2000,
                      "stream": true});
    let mut resp = client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().expect("first chunk");
    assert!(first.starts_with(b"data: "));

    let pid = gw.proc.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());

    let mut rest = String::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.push_str(std::str::from_utf8(&c).unwrap());
    }
    // Most of the stream flowed after the signal.
    let events = rest.matches("data: ").count();
    assert!(events > 1000, "only {events} events after SIGTERM");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    let status = tokio::task::spawn_blocking(move || gw.proc.child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// A gateway started in this process (`gateway::start`, as a host embedding
/// it would) in front of `engine`, with a shutdown grace of `grace_ms`.
async fn in_process(engine: &Engine, grace_ms: u64) -> kvroute_gateway::gateway::Running {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("serve.toml");
    std::fs::write(
        &path,
        format!(
            "{}{}{}",
            config_head(&format!(
                "[health]\ninterval_ms = 0\n[limits]\nshutdown_grace_ms = {grace_ms}\n"
            )),
            kv_rule("kv", "converged"),
            engine.endpoint_toml("both")
        ),
    )
    .unwrap();
    let config = kvroute_gateway::gateway::ServeConfig::load(&path).unwrap();
    kvroute_gateway::gateway::start(&config).await.unwrap()
}

/// A streamed completion of `max_tokens` tokens through `running`'s proxy,
/// its first chunk read.
async fn stream_started(
    running: &kvroute_gateway::gateway::Running,
    max_tokens: u32,
) -> reqwest::Response {
    let body = json!({"model": MODEL, "prompt": prompt("shutdown", 20),
                      "max_tokens": max_tokens, "stream": true});
    let mut resp = client()
        .post(format!("http://{}/v1/completions", running.proxy))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.chunk().await.unwrap().is_some());
    resp
}

/// Hosting the gateway in-process: once the grace period is over,
/// `Running::shutdown` closes the connections still open (their tasks are
/// aborted) instead of leaving them streaming after it returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_shutdown_closes_what_is_left_after_the_grace_period() {
    let engine = Engine::start("both");
    let running = in_process(&engine, 300).await;
    // 20 000 tokens at 500 µs of modelled decode each: a stream of about 10 s.
    let mut resp = stream_started(&running, 20_000).await;
    let asked = std::time::Instant::now();
    running.shutdown().await;
    let shut = asked.elapsed();
    // The stream ends (cut) right after shutdown returned, not 10 s later.
    let mut rest = String::new();
    let ended = tokio::time::timeout(std::time::Duration::from_secs(3), async {
        while let Ok(Some(c)) = resp.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&c));
        }
    })
    .await;
    println!("SHUTDOWN returned after {shut:?}");
    assert!(
        ended.is_ok(),
        "the stream kept flowing after shutdown returned"
    );
    assert!(!rest.contains("[DONE]"), "the stream finished: not cut");
}

/// While the proxy drains, the admin API stays up: `/readyz` answers 503
/// with `draining` (a load balancer stops sending), `/metrics` is still
/// scraped; the admin listener stops once the proxy's requests are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_reports_draining_while_the_proxy_drains() {
    let engine = Engine::start("both");
    let running = in_process(&engine, 30_000).await;
    let admin = format!("http://{}", running.admin);
    let get = |path: &str| client().get(format!("{admin}{path}")).send();
    assert_eq!(get("/readyz").await.unwrap().status(), 200);
    // 12 000 tokens at 500 µs each: a stream of about 6 s.
    let mut resp = stream_started(&running, 12_000).await;
    let shutdown = tokio::spawn(running.shutdown());
    let readyz = eventually("/readyz says draining", || async {
        let r = get("/readyz").await.ok()?;
        let status = r.status().as_u16();
        let v: serde_json::Value = r.json().await.ok()?;
        (status == 503 && v["draining"] == true).then_some(v)
    })
    .await;
    assert_eq!(readyz["ready"], false, "{readyz}");
    assert_eq!(get("/metrics").await.unwrap().status(), 200);
    assert!(!shutdown.is_finished(), "shut down with a stream in flight");
    let mut rest = String::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&c));
    }
    assert!(
        rest.trim_end().ends_with("data: [DONE]"),
        "the stream finished"
    );
    tokio::time::timeout(WAIT, shutdown).await.unwrap().unwrap();
    assert!(
        get("/readyz").await.is_err(),
        "the admin listener stopped after the drain"
    );
}
