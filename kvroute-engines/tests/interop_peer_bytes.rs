//! The Python peers must emit the engines' exact bytes: re-encode every golden
//! vLLM 0.33 / SGLang 0.5.23 payload with kv_publisher.py's msgspec Structs and
//! compare byte for byte (the publisher's `--selfcheck`).

mod interop_support;

use std::process::Command;

use interop_support::{golden, python, script};

fn fixtures(dirs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for dir in dirs {
        for entry in std::fs::read_dir(golden(dir)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            let has_payload = path.with_extension("msgpack").exists();
            if name.ends_with(".json") && has_payload {
                out.push(path.display().to_string());
            }
        }
    }
    out.sort();
    out
}

fn selfcheck(engine: &str, dirs: &[&str]) {
    let files = fixtures(dirs);
    assert!(files.len() >= 5, "fixtures missing for {engine}: {files:?}");
    let output = Command::new(python())
        .arg(script("kv_publisher.py"))
        .args(["--engine", engine, "--selfcheck"])
        .args(&files)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{engine} selfcheck failed:\n{stdout}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("OK ")).count(),
        files.len(),
        "{stdout}"
    );
}

#[test]
fn vllm_publisher_bytes_match_golden_payloads() {
    selfcheck(
        "vllm",
        &[
            "vllm-events/v0.33.0/stream",
            "vllm-events/v0.33.0/standalone",
        ],
    );
}

#[test]
fn sglang_publisher_bytes_match_golden_payloads() {
    selfcheck(
        "sglang",
        &[
            "sglang-events/v0.5.23/stream",
            "sglang-events/v0.5.23/standalone",
        ],
    );
}
