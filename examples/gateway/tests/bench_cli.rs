//! `kvroute bench gateway` end to end: mock engines and the gateway in one
//! process on loopback, a small bounded load both direct and through the
//! gateway. Asserts correctness only (every request answered, no errors, every
//! gateway request routed); the timings go to BENCHMARKS.md.

use std::process::Command;

use serde_json::Value;

#[test]
fn bench_gateway_answers_every_request_on_both_paths() {
    let requests = 200;
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "bench",
            "gateway",
            "--engines",
            "2",
            "--concurrency",
            "8",
            "--requests",
            &requests.to_string(),
            "--prompt-words",
            "48",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    for path in ["direct", "gateway"] {
        let run = &report[path];
        assert_eq!(run["requests"], requests, "{path}: {run}");
        assert_eq!(run["errors"], 0, "{path}: {run}");
        assert_eq!(run["valid"], requests, "{path}: {run}");
        assert!(run["first_error"].is_null(), "{path}: {run}");
        assert!(run["p99_ms"].as_f64().unwrap() >= run["p50_ms"].as_f64().unwrap());
    }
    // Every gateway request was a routing decision that reached an engine.
    assert_eq!(report["gateway_proxied"], requests, "{report}");
    let decided: u64 = report["decisions"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(decided, requests as u64, "{report}");
    assert_eq!(report["decisions"]["exhausted"], 0, "{report}");
    // Tenants share prompt prefixes, so KV-exact routing found cached blocks
    // once the engines' events arrived.
    assert!(
        report["decisions"]["kv_exact"].as_u64().unwrap() > 0,
        "{report}"
    );
}

#[test]
fn bench_gateway_table_names_both_paths() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "bench",
            "gateway",
            "--engines",
            "1",
            "--concurrency",
            "2",
            "--requests",
            "10",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in ["direct ", "gateway ", "gateway adds: p50 ", "req/s"] {
        assert!(stdout.contains(want), "want {want:?} in\n{stdout}");
    }
}

/// `--fresh`: fresh long chats through relays that time the first upstream
/// byte; every request of both runs is answered and seen by a relay, and the
/// report has the added latency beside a single-threaded tokenization.
#[test]
fn bench_gateway_fresh_reports_the_first_upstream_byte_of_both_paths() {
    let requests = 4;
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "bench",
            "gateway",
            "--fresh",
            "--prompt-tokens",
            "6000",
            "--tokenizer-threads",
            "2",
            "--engines",
            "2",
            "--concurrency",
            "2",
            "--requests",
            &requests.to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    for path in ["direct", "gateway"] {
        assert_eq!(report[path]["valid"], requests, "{path}: {report}");
        assert_eq!(report[path]["errors"], 0, "{path}: {report}");
    }
    let fresh = &report["fresh"];
    assert_eq!(fresh["unmatched"], 0, "{fresh}");
    assert_eq!(fresh["tokenizer_threads"], 2, "{fresh}");
    let tokens = fresh["prompt_tokens"].as_u64().unwrap();
    assert!((5_000..7_500).contains(&tokens), "{fresh}");
    for f in [
        "direct_first_byte_p50_ms",
        "direct_first_byte_p99_ms",
        "gateway_first_byte_p50_ms",
        "gateway_first_byte_p99_ms",
        "tokenize_single_ms",
    ] {
        let v = fresh[f].as_f64().unwrap_or_else(|| panic!("{f}: {fresh}"));
        assert!(v.is_finite() && v > 0.0, "{f} = {v}: {fresh}");
    }
    for (p, q) in [("p50", "p99")] {
        for side in ["direct", "gateway"] {
            let lo = fresh[format!("{side}_first_byte_{p}_ms")].as_f64().unwrap();
            let hi = fresh[format!("{side}_first_byte_{q}_ms")].as_f64().unwrap();
            assert!(hi >= lo, "{side}: {fresh}");
        }
    }
    let added = fresh["added_first_byte_p50_ms"].as_f64().unwrap();
    let ratio = fresh["added_p50_ratio"].as_f64().unwrap();
    let single = fresh["tokenize_single_ms"].as_f64().unwrap();
    assert!((ratio * single - added).abs() < 1e-6, "{fresh}");
    // Fresh documents: no request found a cached prefix, every one was routed.
    assert_eq!(report["decisions"]["kv_exact"], 0, "{report}");
    assert_eq!(report["gateway_proxied"], requests, "{report}");
}
