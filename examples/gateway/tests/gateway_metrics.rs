//! `/metrics` of a gateway that served real traffic (two mock engines, the
//! real qwen3 tokenizer): parsed by the official Prometheus client's strict
//! OpenMetrics parser from the repo's `.venv`, every family the docs name is
//! there with its type, and the samples agree with the admin API and with
//! what the test sent.

mod gateway_support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Command, Stdio};

use gateway_support::*;
use serde_json::{json, Value};

/// Parses `text` with `prometheus_client.openmetrics.parser` (which refuses
/// anything the OpenMetrics format does not allow) and returns
/// `{family: {"type": t, "samples": [[name, {labels}, value], ...]}}`.
fn parse_openmetrics(text: &str) -> Value {
    let py = repo().join(".venv/bin/python");
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for f in text_string_to_metric_families(sys.stdin.read()):
    out[f.name] = {"type": f.type, "samples": [[s.name, s.labels, s.value] for s in f.samples]}
print(json.dumps(out))
"#;
    let mut child = Command::new(&py)
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}: run scripts/python-env.sh", py.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused /metrics ({}; prometheus_client missing? run scripts/python-env.sh):\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The value of the sample `name` whose labels include every `(k, v)`.
fn value(families: &Value, family: &str, name: &str, with: &[(&str, &str)]) -> Option<f64> {
    families[family]["samples"]
        .as_array()?
        .iter()
        .find(|s| s[0] == name && with.iter().all(|(k, v)| s[1][*k].as_str() == Some(*v)))
        .and_then(|s| s[2].as_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_valid_openmetrics_and_match_the_traffic() {
    let a = Engine::start("both");
    let b = Engine::start("both");
    let gw = Gateway::start(&format!(
        "{}{}{}{}",
        config_head("[health]\ninterval_ms = 200\n"),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    ));
    wait_subscribed(&gw).await;

    // Three completions (one streamed with usage), one pass-through, one
    // path outside /v1/.
    let p = prompt("metrics", 120);
    for k in 0..2 {
        let (status, v) = complete(&gw, &format!("{p} {k}"), 2).await;
        assert_eq!(status, 200, "{v}");
    }
    let body = json!({"model": MODEL, "prompt": format!("{p} streamed"), "max_tokens": 4,
                      "stream": true, "stream_options": {"include_usage": true}});
    let resp = client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let streamed = resp.text().await.unwrap();
    assert!(streamed.contains("\"usage\""), "{streamed}");
    let models = client().get(gw.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 200);
    models.bytes().await.unwrap();
    let outside = client().get(gw.url("/health")).send().await.unwrap();
    assert_eq!(outside.status(), 404);

    // Receipts are recorded when the bodies end: wait for all three.
    let receipts = eventually("three receipts", || async {
        let eps = endpoints(&gw).await;
        let n: u64 = eps
            .iter()
            .map(|e| e["receipts"].as_u64().unwrap_or(0))
            .sum();
        (n == 3).then_some(eps)
    })
    .await;

    let resp = client().get(gw.admin_url("/metrics")).send().await.unwrap();
    let ct = resp.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    let text = resp.text().await.unwrap();
    let m = parse_openmetrics(&text);
    // Unlabelled samples are written bare, as operators' greps expect
    // (`kvroute_tokenize_admitted_total 3`), never with an empty `{}`.
    assert!(!text.contains("{}"), "{text}");
    assert!(
        text.lines()
            .any(|l| l == "kvroute_tokenize_admitted_total 3"),
        "{text}"
    );

    // Every family the docs and tests name, with its type (the parser names
    // counters without `_total`).
    let mut expected: BTreeMap<&str, &str> = BTreeMap::new();
    for f in [
        "kvroute_requests",
        "kvroute_decisions",
        "kvroute_prefill_requests",
        "kvroute_aborted_streams",
        "kvroute_probe_failures",
        "kvroute_kv_hits",
        "kvroute_kv_misses",
        "kvroute_retries",
        "kvroute_exhausted",
        "kvroute_predicted_cached_tokens",
        "kvroute_delivered_cached_tokens",
        "kvroute_receipts",
        "kvroute_contract_attestations",
        "kvroute_subscriber_events_applied",
        "kvroute_subscriber_decode_errors",
        "kvroute_subscriber_polls",
        "kvroute_subscriber_malformed_events",
        "kvroute_subscriber_unknown_event_types",
        "kvroute_subscriber_smaller_window_events",
        "kvroute_subscriber_untracked_offloaded_blocks",
        "kvroute_ingest_resumes",
        "kvroute_ingest_verified_blocks",
        "kvroute_connections_accepted",
        "kvroute_connections_first_byte_timeouts",
        "kvroute_accept_errors",
        "kvroute_tokenize_admitted",
        "kvroute_tokenize_overloaded",
    ] {
        expected.insert(f, "counter");
    }
    for f in [
        "kvroute_contract_drift_alarm",
        "kvroute_inventory_blocks",
        "kvroute_inventory_memory_bytes",
        "kvroute_in_flight",
        "kvroute_queued_prefill_tokens",
        "kvroute_endpoint_available",
        "kvroute_subscriber_connected",
        "kvroute_subscriber_last_rejected_seq",
        "kvroute_ingest_inventory_partial",
        "kvroute_ingest_capacity_blocks",
        "kvroute_connections_open",
        "kvroute_tokenize_max_concurrent",
        "kvroute_tokenize_in_flight",
    ] {
        expected.insert(f, "gauge");
    }
    expected.insert("kvroute_decision_latency_seconds", "histogram");
    for (family, kind) in &expected {
        assert_eq!(m[*family]["type"], *kind, "{family}: {}", m[*family]);
    }

    let req = |rule: &str, outcome: &str| {
        value(
            &m,
            "kvroute_requests",
            "kvroute_requests_total",
            &[("rule", rule), ("outcome", outcome)],
        )
    };
    assert_eq!(req("kv", "proxied"), Some(3.0));
    assert_eq!(req("kv", "passthrough"), Some(1.0));
    assert_eq!(req("", "rejected"), Some(1.0));
    assert_eq!(
        req("kv", "no_endpoint"),
        Some(0.0),
        "registered, not counted"
    );
    // One decision per completion, each observed once by the histogram.
    let decisions: f64 = m["kvroute_decisions"]["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s[1]["rule"] == "kv")
        .map(|s| s[2].as_f64().unwrap())
        .sum();
    assert_eq!(decisions, 3.0);
    let latency = |name: &str, with: &[(&str, &str)]| {
        value(&m, "kvroute_decision_latency_seconds", name, with).unwrap()
    };
    assert_eq!(latency("kvroute_decision_latency_seconds_count", &[]), 3.0);
    assert_eq!(
        latency("kvroute_decision_latency_seconds_bucket", &[("le", "+Inf")]),
        3.0
    );
    assert!(latency("kvroute_decision_latency_seconds_sum", &[]) > 0.0);

    // Per endpoint: the receipts and delivered tokens are the admin API's,
    // and nothing is left in flight once the bodies ended.
    for ep in &receipts {
        let url = ep["url"].as_str().unwrap();
        let labels = [("rule", "kv"), ("endpoint", url), ("role", "both")];
        assert_eq!(
            value(&m, "kvroute_receipts", "kvroute_receipts_total", &labels),
            ep["receipts"].as_f64(),
            "{url}"
        );
        assert_eq!(
            value(
                &m,
                "kvroute_delivered_cached_tokens",
                "kvroute_delivered_cached_tokens_total",
                &labels
            ),
            ep["delivered_cached_tokens"].as_f64(),
            "{url}"
        );
        assert_eq!(
            value(&m, "kvroute_in_flight", "kvroute_in_flight", &labels),
            Some(0.0)
        );
        let rank = [labels[0], labels[1], labels[2], ("rank", "0")];
        assert_eq!(
            value(
                &m,
                "kvroute_subscriber_connected",
                "kvroute_subscriber_connected",
                &rank
            ),
            Some(1.0),
            "{url}"
        );
    }
    let open = value(
        &m,
        "kvroute_connections_open",
        "kvroute_connections_open",
        &[("listener", "admin")],
    );
    assert!(open >= Some(1.0), "this scrape's own connection: {open:?}");
}
