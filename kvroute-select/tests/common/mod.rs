//! Shared test helpers: golden vLLM vectors and the real vLLM hasher; a
//! health view of fixed availability.

#![allow(dead_code)]

use std::sync::Arc;

use kvroute_core::{BlockKey, TokenId};
use kvroute_select::{ContractId, PromptKeys};

/// One golden vLLM case: its tokens and the event keys vLLM computed.
pub struct GoldenCase {
    pub tokens: Vec<TokenId>,
    pub keys: Vec<BlockKey>,
    pub block_size: u32,
}

pub fn golden_case(id: &str) -> GoldenCase {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../golden/vllm/hash_vectors_v0.33.0.json"
    );
    let text = std::fs::read_to_string(path).expect("golden vLLM vectors");
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("golden case {id} missing"));
    GoldenCase {
        tokens: case["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect(),
        keys: case["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| BlockKey(b["event_key_u64"].as_u64().unwrap()))
            .collect(),
        block_size: u32::try_from(case["block_size"].as_u64().unwrap()).unwrap(),
    }
}

/// vLLM 0.33 `sha256_cbor`, PYTHONHASHSEED unset, block 16 — the real
/// kvroute-core hasher — and the golden case computed by vLLM under that contract.
pub fn vllm_sha256_cbor_unset_seed() -> (ContractId, Arc<dyn PromptKeys>, GoldenCase) {
    let contract: kvroute_core::HashContract = "vllm@0.33.0:sha256_cbor:block=16".parse().unwrap();
    let provider = kvroute_select::ContractKeys::new(&contract).unwrap();
    let case = golden_case("sha256_cbor-bs16-seedunset-multi3_plus7");
    (ContractId::from(&contract), Arc::new(provider), case)
}

/// Endpoint `i` is available when `self.0[i]` is true, administratively
/// down otherwise.
pub struct Avail(pub Vec<bool>);

impl kvroute_select::Health for Avail {
    fn availability(
        &self,
        e: kvroute_core::EndpointId,
        _: std::time::Duration,
    ) -> kvroute_select::Availability {
        if self.0.get(e.index()).copied().unwrap_or(false) {
            kvroute_select::Availability::Available
        } else {
            kvroute_select::Availability::AdminDown
        }
    }
}
