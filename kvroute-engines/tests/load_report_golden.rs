//! Golden engine metrics bodies (golden/engine-metrics/, provenance in its README)
//! parsed into load reports and compared with the expected reports in cases.json.

use std::path::{Path, PathBuf};

use kvroute_engines::{parse_load, EngineLoadReport, LoadReportError, MetricsDialect};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/engine-metrics")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(dir().join("cases.json")).expect("cases.json");
    serde_json::from_str::<Vec<Value>>(&text).expect("cases.json is a JSON array")
}

fn opt_u64(v: &Value) -> Option<u64> {
    v.as_u64()
}

fn expected(e: &Value) -> EngineLoadReport {
    EngineLoadReport {
        running: e["running"].as_u64().unwrap() as u32,
        waiting: e["waiting"].as_u64().unwrap() as u32,
        kv_usage: e["kv_usage"].as_f64(),
        kv_capacity_blocks: opt_u64(&e["kv_capacity_blocks"]),
        block_size: opt_u64(&e["block_size"]).map(|b| b as u32),
        kv_capacity_tokens: opt_u64(&e["kv_capacity_tokens"]),
        waiting_prefill_tokens: opt_u64(&e["waiting_prefill_tokens"]),
        // Absent in a case: the dialect has no progress counters.
        prefill_computed_tokens: opt_u64(&e["prefill_computed_tokens"]),
        prefill_seconds: e["prefill_seconds"].as_f64(),
        ranks: e["ranks"].as_u64().unwrap() as u32,
    }
}

fn same(a: &EngineLoadReport, b: &EngineLoadReport) -> bool {
    let usage = match (a.kv_usage, b.kv_usage) {
        (Some(x), Some(y)) => (x - y).abs() < 1e-9,
        (None, None) => true,
        _ => false,
    };
    usage
        && EngineLoadReport {
            kv_usage: None,
            ..*a
        } == EngineLoadReport {
            kv_usage: None,
            ..*b
        }
}

#[test]
fn every_golden_body_gives_its_expected_report() {
    let cases = cases();
    assert!(cases.len() >= 9, "{} cases", cases.len());
    for case in &cases {
        let file = case["file"].as_str().unwrap();
        let dialect: MetricsDialect = case["dialect"].as_str().unwrap().parse().unwrap();
        let body = std::fs::read(dir().join(file)).unwrap();
        let got = parse_load(dialect, &body).unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = expected(&case["expect"]);
        assert!(same(&got, &want), "{file}:\n got {got:?}\nwant {want:?}");
    }
}

#[test]
fn every_body_file_has_a_case() {
    let listed: Vec<String> = cases()
        .iter()
        .map(|c| c["file"].as_str().unwrap().to_owned())
        .collect();
    for entry in std::fs::read_dir(dir()).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".txt") || (name.ends_with(".json") && name != "cases.json") {
            assert!(listed.contains(&name), "{name} has no entry in cases.json");
        }
    }
}

#[test]
fn a_body_read_in_another_dialect_is_a_clear_error() {
    for case in cases() {
        let file = case["file"].as_str().unwrap();
        let own: MetricsDialect = case["dialect"].as_str().unwrap().parse().unwrap();
        let body = std::fs::read(dir().join(file)).unwrap();
        for other in MetricsDialect::ALL {
            if other == own || body == b"[]" {
                continue;
            }
            let err = parse_load(other, &body).expect_err(file);
            match other {
                MetricsDialect::Trtllm => {
                    assert!(matches!(err, LoadReportError::Json { .. }), "{file}: {err}")
                }
                _ => assert!(
                    matches!(err, LoadReportError::MissingMetric { dialect, .. } if dialect == other),
                    "{file} as {other}: {err}"
                ),
            }
        }
    }
}

#[test]
fn damaged_lines_of_unused_metrics_are_skipped_but_used_ones_fail() {
    let body = std::fs::read_to_string(dir().join("vllm-0.33.0-dp2.txt")).unwrap();
    let want = parse_load(MetricsDialect::Vllm, body.as_bytes()).unwrap();

    let noisy = body.replace(
        "vllm:prefix_cache_hits_total{",
        "vllm:prefix_cache_hits_total{broken=\"",
    ) + "\u{0}\u{ff} garbage line\nvllm:prefix_cache_queries_total not-a-number\n";
    let got = parse_load(MetricsDialect::Vllm, noisy.as_bytes()).unwrap();
    assert_eq!(got, want);

    let damaged = body.replacen(
        "vllm:num_requests_waiting{engine=\"1\"",
        "vllm:num_requests_waiting{engine=\"1\" model_name=",
        1,
    );
    assert_ne!(damaged, body);
    let err = parse_load(MetricsDialect::Vllm, damaged.as_bytes()).unwrap_err();
    assert!(matches!(err, LoadReportError::Syntax { .. }), "{err}");

    let negative = body.replacen(
        "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 7.0",
        "vllm:num_requests_running{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} -7.0",
        1,
    );
    assert_ne!(negative, body);
    let err = parse_load(MetricsDialect::Vllm, negative.as_bytes()).unwrap_err();
    assert!(
        matches!(
            err,
            LoadReportError::InvalidValue {
                metric: "vllm:num_requests_running",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn oversized_bodies_are_refused_before_parsing() {
    let body = vec![b'#'; kvroute_engines::MAX_METRICS_BODY_BYTES + 1];
    for dialect in MetricsDialect::ALL {
        assert!(matches!(
            parse_load(dialect, &body),
            Err(LoadReportError::TooLarge { .. })
        ));
    }
}
