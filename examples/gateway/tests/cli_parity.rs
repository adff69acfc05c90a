//! `kvroute parity` over the repository's golden data, and its failure modes.

use std::path::{Path, PathBuf};
use std::process::Command;

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

fn parity(args: &[&Path]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .arg("parity")
        .args(args)
        .output()
        .expect("run kvroute parity");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success(), text)
}

fn summary(text: &str) -> (usize, usize) {
    let last = text.lines().last().expect("a summary line");
    let words: Vec<&str> = last.split_whitespace().collect();
    assert_eq!(words.len(), 4, "summary line: {last}");
    assert_eq!(
        (words[1], words[3]),
        ("passed,", "failed"),
        "summary: {last}"
    );
    (words[0].parse().unwrap(), words[2].parse().unwrap())
}

#[test]
fn every_golden_case_passes() {
    let (ok, text) = parity(&[&golden()]);
    let (passed, failed) = summary(&text);
    assert!(ok, "parity failed:\n{text}");
    assert_eq!(failed, 0, "{text}");
    // 116 hash-vector cases (vLLM 54 + 8 empty values, SGLang 13 + 10 empty
    // values + legacy 6, Dynamo 6, re-key 8, TRT-LLM 7 + 4 empty values) + 62
    // event fixtures + 50 chat cases: a file that silently stopped being
    // checked changes this number. + 9 engine-metrics pages.
    assert_eq!(passed, 116 + 62 + 50 + 9, "{text}");
    assert!(!text.contains("FAIL"), "{text}");
}

#[test]
fn a_corrupted_vector_is_reported_and_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let src = golden().join("vllm/hash_vectors_v0.33.0.json");
    let text = std::fs::read_to_string(src).unwrap();
    // The worked example's digest, changed in its last hex digit.
    let good = "00f47afb294c373f5d91d782c33b4111d46b4dac185a32b0a56a3ce09aa53c65";
    assert!(text.contains(good));
    let bad = text.replacen(
        good,
        "00f47afb294c373f5d91d782c33b4111d46b4dac185a32b0a56a3ce09aa53c64",
        1,
    );
    let file = dir.path().join("vectors.json");
    std::fs::write(&file, bad).unwrap();
    let (ok, out) = parity(&[&file]);
    assert!(!ok);
    let (passed, failed) = summary(&out);
    assert_eq!((passed, failed), (53, 1), "{out}");
    assert!(
        out.contains("FAIL") && out.contains("sha256_cbor-bs16-seed0-one_block"),
        "{out}"
    );
}

#[test]
fn unknown_files_are_failures_not_skips() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("mystery.json"), br#"{"hello": 1}"#).unwrap();
    std::fs::write(dir.path().join("orphan.msgpack"), [0x90u8]).unwrap();
    std::fs::write(dir.path().join("data.bin"), [1u8, 2, 3]).unwrap();
    let (ok, out) = parity(&[dir.path()]);
    assert!(!ok);
    assert_eq!(summary(&out), (0, 3), "{out}");
}

#[test]
fn an_empty_tree_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = parity(&[dir.path()]);
    assert!(!ok, "{out}");
}

#[test]
fn an_engine_metrics_case_that_disagrees_fails() {
    let dir = tempfile::tempdir().unwrap();
    let src = golden().join("engine-metrics");
    std::fs::copy(src.join("vllm-0.33.0-dp2.txt"), dir.path().join("page.txt")).unwrap();
    let cases =
        r#"[{"file": "page.txt", "dialect": "vllm", "expect": {"running": 12, "waiting": 4}}]"#;
    std::fs::write(dir.path().join("cases.json"), cases).unwrap();
    let (ok, out) = parity(&[dir.path()]);
    assert!(!ok, "{out}");
    assert!(out.contains("waiting: expected 4 got 3"), "{out}");
    assert!(
        !out.contains("page.txt -: "),
        "the body is a companion, not a case: {out}"
    );
}
