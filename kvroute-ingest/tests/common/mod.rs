//! Test helpers: the vLLM golden fixtures' `decoded_payload` (a generic msgpack
//! decode as JSON) turned into engine-neutral batches, and the library's
//! contract attestor for a spec string.
#![allow(dead_code)]

use std::path::PathBuf;

use kvroute_core::{BlockKey, HashContract, Medium};
use kvroute_ingest::ContractAttestor;
use kvroute_ingest::{BlockRemoved, BlockStored, EventBatch, KvEvent};
use serde_json::Value;

pub fn golden(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("golden")
        .join(rel)
}

pub fn load(rel: &str) -> Value {
    let path = golden(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn keys(v: &Value) -> Vec<BlockKey> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|k| BlockKey(k.as_u64().unwrap()))
        .collect()
}

fn medium(v: &Value) -> Medium {
    v.get("medium")
        .and_then(Value::as_str)
        .map_or(Medium::Gpu, |s| Medium::from_wire(s).unwrap())
}

fn group(v: &Value) -> u32 {
    v.get("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32
}

/// One vLLM event (map layout) as JSON → engine-neutral event.
pub fn vllm_event(e: &Value) -> KvEvent {
    match e["type"].as_str().unwrap() {
        "BlockStored" => KvEvent::Stored(BlockStored {
            keys: keys(&e["block_hashes"]),
            parent: e["parent_block_hash"].as_u64().map(BlockKey),
            token_ids: e["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            block_size: e["block_size"].as_u64().unwrap() as u32,
            medium: medium(e),
            lora_name: e["lora_name"].as_str().map(str::to_owned),
            extra_keys: Vec::new(),
            group: group(e),
            ..BlockStored::default()
        }),
        "BlockRemoved" => KvEvent::Removed(BlockRemoved {
            keys: keys(&e["block_hashes"]),
            medium: medium(e),
            group: group(e),
        }),
        "AllBlocksCleared" => KvEvent::AllCleared,
        other => panic!("unknown event type {other}"),
    }
}

/// `[ts, events, dp_rank]` → batch with sequence number `seq`.
pub fn vllm_batch(seq: u64, payload: &Value) -> EventBatch {
    let p = payload.as_array().unwrap();
    EventBatch {
        seq,
        timestamp: p[0].as_f64().unwrap(),
        dp_rank: p[2].as_u64().map(|r| r as u32),
        events: p[1].as_array().unwrap().iter().map(vllm_event).collect(),
    }
}

/// The live messages of one DP rank of `zmq_capture.json`, in arrival order.
pub fn capture_rank(rank: usize) -> Vec<EventBatch> {
    let capture = load("vllm-events/v0.33.0/zmq_capture.json");
    capture[format!("live_messages_rank{rank}")]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            vllm_batch(
                m["frames"][1]["as_u64_be"].as_u64().unwrap(),
                &m["decoded_payload"],
            )
        })
        .collect()
}

/// The library's contract attestor for a contract spec string.
pub fn contract_attestor(spec: &str) -> ContractAttestor {
    ContractAttestor::new(&spec.parse::<HashContract>().unwrap()).unwrap()
}
