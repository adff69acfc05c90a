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
