//! `parse_load` on engine metrics bodies: the golden vLLM 0.33 two-engine page
//! (11 KB), a full-size eight-engine vLLM page (the golden series per engine plus
//! twelve 22-bucket histograms each, ≈ 0.5 MB: what a DP-8 vLLM serves), the golden
//! SGLang DP page and a TensorRT-LLM drain of 64 iterations × 2 ranks.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvroute_engines::{parse_load, MetricsDialect};

fn golden(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/engine-metrics")
            .join(name),
    )
    .expect("golden body")
}

fn full_vllm_page(engines: usize) -> Vec<u8> {
    let mut out = String::new();
    let buckets = [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
        "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "+Inf",
    ];
    for h in 0..12 {
        let _ = writeln!(
            out,
            "# HELP vllm:histogram_{h}_seconds A latency histogram."
        );
        let _ = writeln!(out, "# TYPE vllm:histogram_{h}_seconds histogram");
        for e in 0..engines {
            for (i, le) in buckets.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "vllm:histogram_{h}_seconds_bucket{{engine=\"{e}\",le=\"{le}\",model_name=\"Qwen/Qwen3-8B\"}} {}.0",
                    i * 37
                );
            }
            let _ = writeln!(out, "vllm:histogram_{h}_seconds_count{{engine=\"{e}\",model_name=\"Qwen/Qwen3-8B\"}} 777.0");
            let _ = writeln!(out, "vllm:histogram_{h}_seconds_sum{{engine=\"{e}\",model_name=\"Qwen/Qwen3-8B\"}} 123.456");
        }
    }
    let page = String::from_utf8(golden("vllm-0.33.0-dp2.txt")).expect("utf-8");
    for e in 0..engines {
        for line in page.lines().filter(|l| l.contains("engine=\"0\"")) {
            let _ = writeln!(
                out,
                "{}",
                line.replace("engine=\"0\"", &format!("engine=\"{e}\""))
            );
        }
    }
    out.into_bytes()
}

fn trtllm_drain(iterations: usize) -> Vec<u8> {
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&golden("trtllm-adp2-drain.json")).expect("json");
    let mut out = Vec::new();
    for it in 0..iterations {
        for r in &rows[..2] {
            let mut r = r.clone();
            r["iter"] = serde_json::json!(it);
            out.push(r);
        }
    }
    serde_json::to_vec(&out).expect("json")
}

fn bench(c: &mut Criterion) {
    let cases = [
        (
            "vllm_dp2_golden",
            MetricsDialect::Vllm,
            golden("vllm-0.33.0-dp2.txt"),
        ),
        (
            "vllm_dp8_full_page",
            MetricsDialect::Vllm,
            full_vllm_page(8),
        ),
        (
            "sglang_dp2_golden",
            MetricsDialect::Sglang,
            golden("sglang-0.5.23-dp2-priority.txt"),
        ),
        (
            "trtllm_drain_64x2",
            MetricsDialect::Trtllm,
            trtllm_drain(64),
        ),
    ];
    let mut g = c.benchmark_group("parse_load");
    for (name, dialect, body) in &cases {
        let r = parse_load(*dialect, body).expect(name);
        assert!(r.ranks > 0, "{name}");
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(*name, |b| b.iter(|| parse_load(*dialect, black_box(body))));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
