//! The mock engine's msgpack encoders reproduce the engines' own payload bytes:
//! every golden batch, rebuilt from its decoded form, encodes to identical bytes.

use kvroute_mock_engine::wire;

use std::path::{Path, PathBuf};

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::{BlockRemoved, BlockStored, KvEvent};
use serde_json::Value;
use wire::{encode_batch, WireFormat};

fn golden(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden")
        .join(rel)
}

fn key(v: &Value) -> BlockKey {
    match (v.as_u64(), v.as_i64()) {
        (Some(u), _) => BlockKey(u),
        (None, Some(i)) => BlockKey::from_i64(i),
        _ => panic!("not a block key: {v}"),
    }
}

fn keys(v: &Value) -> Vec<BlockKey> {
    v.as_array().unwrap().iter().map(key).collect()
}

/// Builds the engine-neutral events back from a golden `decoded_payload`.
fn events(decoded: &Value) -> Vec<KvEvent> {
    decoded[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => {
                let n = e["block_hashes"].as_array().unwrap().len();
                KvEvent::Stored(BlockStored {
                    keys: keys(&e["block_hashes"]),
                    parent: (!e["parent_block_hash"].is_null())
                        .then(|| key(&e["parent_block_hash"])),
                    token_ids: e["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as TokenId)
                        .collect(),
                    block_size: e["block_size"].as_u64().unwrap() as u32,
                    medium: Medium::from_wire(e["medium"].as_str().unwrap()).unwrap(),
                    lora_name: e
                        .get("lora_name")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    cache_salt: e
                        .get("cache_salt")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                    extra_keys: vec![None; n],
                    group: e.get("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32,
                    ..BlockStored::default()
                })
            }
            "BlockRemoved" => KvEvent::Removed(BlockRemoved {
                keys: keys(&e["block_hashes"]),
                medium: Medium::from_wire(e["medium"].as_str().unwrap()).unwrap(),
                group: e.get("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32,
            }),
            "AllBlocksCleared" => KvEvent::AllCleared,
            other => panic!("unexpected event type {other}"),
        })
        .collect()
}

fn check_dir(dir: &str, format: WireFormat) -> usize {
    let mut checked = 0;
    let mut files: Vec<_> = std::fs::read_dir(golden(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json") && !p.ends_with("stream_index.json"))
        .collect();
    files.sort();
    for path in files {
        let case: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let Some(decoded) = case.get("decoded_payload") else {
            continue;
        };
        let expected = std::fs::read(path.with_extension("msgpack")).unwrap();
        let ts = decoded[0].as_f64().unwrap();
        let rank = decoded[2].as_u64().map(|r| r as u32);
        let mut out = Vec::new();
        encode_batch(format, ts, &events(decoded), rank, &mut out).unwrap();
        assert_eq!(
            hex::encode(&out),
            hex::encode(&expected),
            "{} differs",
            path.display()
        );
        checked += 1;
    }
    checked
}

#[test]
fn vllm_0_33_stream_payloads_are_byte_identical() {
    assert_eq!(check_dir("vllm-events/v0.33.0/stream", WireFormat::Vllm), 5);
}

#[test]
fn sglang_0_5_23_stream_payloads_are_byte_identical() {
    assert!(check_dir("sglang-events/v0.5.23/stream", WireFormat::Sglang) >= 8);
}
