//! `kvroute sim` end to end through the binary: the same seed gives
//! byte-identical JSON, generated files replay, bad traces fail with the line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = kvroute(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const FLEET: [&str; 6] = ["--workers", "4", "--block-size", "64", "--requests", "600"];

#[test]
fn same_seed_same_json_different_seed_different_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = |name: &str, seed: &str| -> String {
        let path = dir.path().join(name);
        let mut args = vec!["sim", "run", "--kind", "tenants", "--seed", seed];
        args.extend(FLEET);
        args.extend(["--event-loss", "0.1", "--json", s(&path)]);
        ok(&args);
        std::fs::read_to_string(path).unwrap()
    };
    let a = json("a.json", "3");
    let b = json("b.json", "3");
    let c = json("c.json", "4");
    assert_eq!(a, b);
    assert_ne!(a, c);
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    let policies = v["policies"].as_array().unwrap();
    // rr, least-load, p2c, chwbl, kv-overlap, kv-prefix, kv-bounded, kv-exact
    // and the three peers.
    assert_eq!(policies.len(), 11);
    for p in policies {
        for field in ["prefix_hit_ratio", "throughput_rps"] {
            assert!(p[field].is_f64(), "{field} in {p}");
        }
        for field in ["mean", "p50", "p99"] {
            assert!(p["ttft_ms"][field].is_f64() && p["e2e_ms"][field].is_f64());
        }
        assert!(p["load"]["max_over_mean_in_flight"].is_f64());
        assert!(p["load"]["mean_in_flight"].is_f64());
    }
    assert!(v["workload"]["ideal_prefix_hit_ratio"].is_f64());
    let pooled = v["workload"]["pooled_prefix_hit_ratio"].as_f64().unwrap();
    assert!(pooled > 0.0 && pooled <= v["workload"]["ideal_prefix_hit_ratio"].as_f64().unwrap());
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    for n in [
        "kv-exact",
        "dynamo-cost",
        "smg-cache-aware",
        "llmd-weighted",
    ] {
        assert!(names.contains(&n), "{names:?}");
    }
}

#[test]
fn generated_trace_replays_like_the_in_memory_workload() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("rag.jsonl");
    ok(&[
        "sim",
        "gen",
        "--kind",
        "rag",
        "--requests",
        "600",
        "--seed",
        "9",
        "--out",
        s(&trace),
    ]);
    let again = dir.path().join("rag2.jsonl");
    ok(&[
        "sim",
        "gen",
        "--kind",
        "rag",
        "--requests",
        "600",
        "--seed",
        "9",
        "--out",
        s(&again),
    ]);
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        std::fs::read(&again).unwrap()
    );
    let run = |source: &[&str], json: &PathBuf, svg: &PathBuf| {
        let mut args = vec!["sim", "run", "--seed", "9", "--policies", "rr,kv-bounded"];
        args.extend(source);
        args.extend(FLEET);
        args.extend(["--json", s(json), "--svg", s(svg)]);
        ok(&args)
    };
    let (j1, j2) = (dir.path().join("1.json"), dir.path().join("2.json"));
    let (s1, s2) = (dir.path().join("1.svg"), dir.path().join("2.svg"));
    let table = run(&["--trace", s(&trace)], &j1, &s1);
    run(&["--kind", "rag"], &j2, &s2);
    assert!(table.contains("kv-bounded") && table.contains("ideal prefix-hit ratio"));
    let policies = |p: &PathBuf| {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        v["policies"].clone()
    };
    assert_eq!(policies(&j1), policies(&j2));
    let svg = std::fs::read_to_string(&s1).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<rect").count(), 1 + 2 + 2 * 2, "{svg}");
}

#[test]
fn golden_trace_runs_and_bad_trace_names_the_line() {
    let golden =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sim/workloads/mooncake-golden.jsonl");
    let table = ok(&[
        "sim",
        "run",
        "--trace",
        s(&golden),
        "--workers",
        "2",
        "--block-size",
        "512",
    ]);
    assert!(
        table.contains("ideal prefix-hit ratio (one infinite cache): 41.4%"),
        "{table}"
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": \"x\"}\n",
    )
    .unwrap();
    let out = kvroute(&["sim", "run", "--trace", s(&bad)]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.jsonl") && err.contains("line 2"), "{err}");

    let out = kvroute(&[
        "sim",
        "run",
        "--kind",
        "tenants",
        "--policies",
        "rr,fastest",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown policy \"fastest\""));
}
