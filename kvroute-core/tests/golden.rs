//! Runs the golden checkers over every hash-vector file in the repository's
//! `golden/` directory and pins the number of cases each must check.

use std::path::{Path, PathBuf};

use kvroute_core::golden::{self, detect, GoldenReport, HashVectorFormat};
use serde_json::Value;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden")
}

fn load(rel: &str) -> Value {
    let path = golden_dir().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn check_file(rel: &str, format: HashVectorFormat, expected_cases: usize) {
    let v = load(rel);
    assert_eq!(detect(&v), Some(format), "{rel}: detected format");
    let report = golden::check(format, rel, &v);
    for f in &report.failures {
        eprintln!("{f}");
    }
    assert!(report.is_clean(), "{rel}: {}", report.summary());
    assert_eq!(report.passed, expected_cases, "{rel}: case count");
}

#[test]
fn vllm_v0_33_0() {
    check_file(
        "vllm/hash_vectors_v0.33.0.json",
        HashVectorFormat::VllmBlockHashV1,
        54,
    );
}

/// Empty optional inputs (`cache_salt`, `PYTHONHASHSEED`, a LoRA name, an mm
/// identifier) as vLLM's own hasher treats them.
#[test]
fn vllm_empty_values_v0_33_0() {
    check_file(
        "vllm/hash_vectors_v0.33.0_empty_values.json",
        HashVectorFormat::VllmBlockHashV1,
        8,
    );
}

#[test]
fn sglang_page_chain_v0_5_23() {
    check_file(
        "sglang/hash_vectors_v0.5.23.json",
        HashVectorFormat::SglangPageChain,
        13,
    );
}

/// Empty `cache_salt` / `extra_key` request values (SGLang takes them as
/// absent) beside their non-empty neighbours, default and dynamo formats.
#[test]
fn sglang_empty_values_v0_5_23() {
    check_file(
        "sglang/hash_vectors_v0.5.23_empty_values.json",
        HashVectorFormat::SglangPageChain,
        10,
    );
}

#[test]
fn sglang_legacy_pyhash() {
    // 5 vectors + the empty-tuple hash.
    check_file(
        "sglang/hash_vectors_legacy_pyhash.json",
        HashVectorFormat::SglangLegacyPyhash,
        6,
    );
}

#[test]
fn dynamo_rekey_vectors() {
    check_file(
        "sglang/dynamo_xxh3_local_block_hash.json",
        HashVectorFormat::RekeyXxh3,
        6,
    );
}

#[test]
fn kvroute_rekey_vectors() {
    check_file(
        "rekey/kvroute_xxh3_chain_vectors.json",
        HashVectorFormat::RekeyXxh3,
        8,
    );
}

#[test]
fn trtllm_v1_block_key() {
    check_file(
        "trtllm-events/hash_vectors_v1_block_key.json",
        HashVectorFormat::TrtllmV1BlockKey,
        7,
    );
}

/// `lora_task_id` / `cache_salt_id` 0 (and the id of an empty salt string):
/// TensorRT-LLM mixes an optional input whenever it is present.
#[test]
fn trtllm_v1_block_key_empty_values() {
    check_file(
        "trtllm-events/hash_vectors_v1_block_key_empty_values.json",
        HashVectorFormat::TrtllmV1BlockKey,
        4,
    );
}

/// Every JSON file under golden/ that looks like a hash-vector file is one of the
/// files pinned above, so a new vector file cannot be skipped silently.
#[test]
fn every_hash_vector_file_is_pinned() {
    let pinned = [
        "vllm/hash_vectors_v0.33.0.json",
        "vllm/hash_vectors_v0.33.0_empty_values.json",
        "sglang/hash_vectors_v0.5.23.json",
        "sglang/hash_vectors_v0.5.23_empty_values.json",
        "sglang/hash_vectors_legacy_pyhash.json",
        "sglang/dynamo_xxh3_local_block_hash.json",
        "rekey/kvroute_xxh3_chain_vectors.json",
        "trtllm-events/hash_vectors_v1_block_key.json",
        "trtllm-events/hash_vectors_v1_block_key_empty_values.json",
    ];
    let mut found = Vec::new();
    let mut stack = vec![golden_dir()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "json") {
                let text = std::fs::read_to_string(&path).unwrap();
                let Ok(v) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                if detect(&v).is_some() {
                    let rel = path
                        .strip_prefix(golden_dir())
                        .unwrap()
                        .to_string_lossy()
                        .replace('\\', "/");
                    found.push(rel);
                }
            }
        }
    }
    found.sort();
    let mut want: Vec<String> = pinned.iter().map(|s| (*s).to_owned()).collect();
    want.sort();
    assert_eq!(found, want);
}

fn mutate_first<'a>(v: &'a mut Value, pointer: &str) -> &'a mut Value {
    v.pointer_mut(pointer)
        .unwrap_or_else(|| panic!("no {pointer}"))
}

fn flip_hex(s: &str) -> String {
    let mut chars: Vec<char> = s.chars().collect();
    chars[0] = if chars[0] == '0' { '1' } else { '0' };
    chars.into_iter().collect()
}

fn assert_one_failure(report: &GoldenReport, case: &str, needle: &str) {
    assert_eq!(report.failed(), 1, "{:?}", report.failures);
    assert_eq!(report.failures[0].case, case);
    assert!(
        report.failures[0].message.contains(needle),
        "{}",
        report.failures[0].message
    );
}

#[test]
fn mutated_vllm_digest_is_reported() {
    let mut v = load("vllm/hash_vectors_v0.33.0.json");
    let case_id = v["cases"][4]["id"].as_str().unwrap().to_owned();
    let d = mutate_first(&mut v, "/cases/4/blocks/2/digest_hex");
    *d = Value::from(flip_hex(d.as_str().unwrap()));
    let report = golden::check(HashVectorFormat::VllmBlockHashV1, "mutated", &v);
    assert_one_failure(&report, &case_id, "blocks[2].digest_hex");
    assert_eq!(report.passed, 53);
}

#[test]
fn mutated_fields_of_every_kind_are_reported() {
    let cases: [(&str, HashVectorFormat, &str, &str); 8] = [
        (
            "vllm/hash_vectors_v0.33.0.json",
            HashVectorFormat::VllmBlockHashV1,
            "/cases/20/blocks/1/hash_input_hex",
            "hash_input_hex",
        ),
        (
            "vllm/hash_vectors_v0.33.0.json",
            HashVectorFormat::VllmBlockHashV1,
            "/cases/20/none_hash_hex",
            "none_hash_hex",
        ),
        (
            "vllm/hash_vectors_v0.33.0.json",
            HashVectorFormat::VllmBlockHashV1,
            "/cases/52/group_views/1/digests_hex/0",
            "group_views[1].digests_hex[0]",
        ),
        (
            "sglang/hash_vectors_v0.5.23.json",
            HashVectorFormat::SglangPageChain,
            "/unsalted/1/page_sha256_hex/2",
            "page_sha256_hex",
        ),
        (
            "sglang/hash_vectors_v0.5.23.json",
            HashVectorFormat::SglangPageChain,
            "/namespaced/1/namespace_seed_hex",
            "namespace_seed_hex",
        ),
        (
            "sglang/hash_vectors_v0.5.23.json",
            HashVectorFormat::SglangPageChain,
            "/namespaced/0/salt_seed_hex",
            "salt_seed_hex",
        ),
        (
            "sglang/hash_vectors_v0.5.23.json",
            HashVectorFormat::SglangPageChain,
            "/unsalted/0/page_sha256_hex/0",
            "page_sha256_hex",
        ),
        (
            "vllm/hash_vectors_v0.33.0.json",
            HashVectorFormat::VllmBlockHashV1,
            "/cases/46/blocks/0/hash_input_hex",
            "hash_input_hex",
        ),
    ];
    for (file, format, pointer, needle) in cases {
        let mut v = load(file);
        let x = mutate_first(&mut v, pointer);
        *x = Value::from(flip_hex(x.as_str().unwrap()));
        let report = golden::check(format, file, &v);
        assert_eq!(report.failed(), 1, "{pointer}: {:?}", report.failures);
        assert!(
            report.failures[0].message.contains(needle),
            "{pointer}: {}",
            report.failures[0].message
        );
    }
    // Integer fields (u64 above 2^53, i64 forms).
    let int_cases: [(&str, HashVectorFormat, &str); 6] = [
        (
            "vllm/hash_vectors_v0.33.0.json",
            HashVectorFormat::VllmBlockHashV1,
            "/cases/4/blocks/3/event_key_u64",
        ),
        (
            "sglang/hash_vectors_v0.5.23.json",
            HashVectorFormat::SglangPageChain,
            "/unsalted/0/block_hash_i64/0",
        ),
        (
            "sglang/hash_vectors_legacy_pyhash.json",
            HashVectorFormat::SglangLegacyPyhash,
            "/vectors/1/page_hash_u64/1",
        ),
        (
            "sglang/dynamo_xxh3_local_block_hash.json",
            HashVectorFormat::RekeyXxh3,
            "/vectors/1/seq_hash_u64/3",
        ),
        (
            "trtllm-events/hash_vectors_v1_block_key.json",
            HashVectorFormat::TrtllmV1BlockKey,
            "/vectors/0/with_partial_last_block_u64/2",
        ),
        (
            "trtllm-events/hash_vectors_v1_block_key.json",
            HashVectorFormat::TrtllmV1BlockKey,
            "/vectors/4/full_block_hashes_u64/0",
        ),
    ];
    for (file, format, pointer) in int_cases {
        let mut v = load(file);
        let x = mutate_first(&mut v, pointer);
        *x = if let Some(u) = x.as_u64() {
            Value::from(u ^ 1)
        } else {
            Value::from(x.as_i64().unwrap() ^ 1)
        };
        let report = golden::check(format, file, &v);
        assert_eq!(report.failed(), 1, "{pointer}: {:?}", report.failures);
    }
}

#[test]
fn big_u64_values_parse_exactly() {
    let v = load("vllm/hash_vectors_v0.33.0.json");
    // 2^63 < key: must not go through f64.
    let keys: Vec<u64> = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| {
            c["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["event_key_u64"].as_u64().unwrap())
        })
        .collect();
    assert!(keys.iter().any(|&k| k > 1 << 63));
    assert!(keys.iter().any(|&k| k % 2 == 1 && k > 1 << 53));
}

#[test]
fn non_vector_json_is_not_detected() {
    let v = load("chat/qwen3_cases.json");
    assert_eq!(detect(&v), None);
    assert!(golden::check_value("chat", &v).is_none());
}
