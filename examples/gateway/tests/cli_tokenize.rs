//! `kvroute tokenize`: ids equal vLLM's golden ids, keys equal the contract's keys.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvroute_core::{BlockKey, HashContract, RequestExtras};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

#[test]
fn chat_request_gives_golden_ids_and_contract_keys() {
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden().join("chat/qwen3_cases.json")).unwrap())
            .unwrap();
    let case = cases["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "chat_shared_prefix_1")
        .expect("golden case");
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(&req, serde_json::to_vec(&case["request"]).unwrap()).unwrap();
    let spec = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--json", "--contract", spec, "--model-dir"])
        .arg(golden().join("tokenizers/qwen3"))
        .arg("--request")
        .arg(&req)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let prompt = &doc["engine_prompts"][0];
    assert_eq!(prompt["token_ids"], case["token_ids"]);
    assert_eq!(prompt["rendered_prompt"], case["rendered_prompt"]);

    let ids: Vec<u32> = serde_json::from_value(case["token_ids"].clone()).unwrap();
    let hasher = spec.parse::<HashContract>().unwrap().hasher().unwrap();
    let mut keys: Vec<BlockKey> = Vec::new();
    hasher
        .hash_prompt(&ids, &RequestExtras::default(), &mut keys)
        .unwrap();
    assert_eq!(keys.len(), ids.len() / 16);
    let printed: Vec<u64> = serde_json::from_value(prompt["block_keys_u64"].clone()).unwrap();
    assert_eq!(printed, keys.iter().map(|k| k.0).collect::<Vec<_>>());
}

#[test]
fn bad_contract_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "tokenize",
            "--contract",
            "vllm:sha512:block=16",
            "--model-dir",
        ])
        .arg(golden().join("tokenizers/qwen3"))
        .arg("--request")
        .arg(golden().join("chat/qwen3_cases.json"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--contract"));
}
