//! `kvroute bench prompt` end to end at small sizes with the real Qwen3
//! tokenizer: the table on stdout and the `--json` report with one row per
//! (size, threads) and every field. Asserts shape and consistency only (the
//! command itself refuses to report when the span-cached, parallel and plain
//! encodes disagree on the token count); the timings go to BENCHMARKS.md.

use std::process::Command;

use serde_json::Value;

#[test]
fn bench_prompt_writes_every_field_per_size_and_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("prompt.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "bench",
            "prompt",
            "--sizes",
            "64,400",
            "--threads",
            "1,2",
            "--runs",
            "2",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("fresh chat body -> block keys"), "{stdout}");

    let report: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["runs"], 2);
    let rows = report["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{report}");
    let fields = [
        "plain_encode_ms",
        "single_ms",
        "parallel_ms",
        "parse_ms",
        "render_ms",
        "tokenize_ms",
        "parallel_tokenize_ms",
        "hash_ms",
        "score_ms",
        "single_ratio",
        "parallel_ratio",
        "pipelined_ms",
        "pipelined_ratio",
        "tail_hash_ms",
        "score_hit_ms",
        "decision_after_ids_ms",
    ];
    for (row, (size, threads)) in rows.iter().zip([(64, 1), (64, 2), (400, 1), (400, 2)]) {
        assert_eq!(row["threads"], threads, "{row}");
        let tokens = row["tokens"].as_u64().unwrap();
        // The document is sized by a calibration encode: within a few tokens
        // of the target plus the chat template's own tokens.
        assert!(
            tokens as f64 > size as f64 * 0.8 && (tokens as f64) < size as f64 * 1.3 + 20.0,
            "{size}: {row}"
        );
        for f in fields {
            let v = row[f]
                .as_f64()
                .unwrap_or_else(|| panic!("{f} missing: {row}"));
            assert!(v.is_finite() && v > 0.0, "{f} = {v}: {row}");
        }
        // Chat template segments plus the user message: several parts even
        // when nothing is long enough to split.
        assert!(row["pipeline_parts"].as_u64().unwrap() > 1, "{row}");
        let tail = row["tail_hash_ms"].as_f64().unwrap();
        let decision = row["decision_after_ids_ms"].as_f64().unwrap();
        assert!(decision >= tail, "{row}");
        let parts: f64 = ["parse_ms", "render_ms", "tokenize_ms", "hash_ms"]
            .iter()
            .map(|f| row[f].as_f64().unwrap())
            .sum();
        // Medians of sums and sums of medians differ a little; not by 2x.
        let single = row["single_ms"].as_f64().unwrap();
        assert!(single < parts * 2.0 && parts < single * 2.0, "{row}");
    }
}
