//! One key mode for both sides: the ingest side's keying
//! ([`Keying::for_contract`]) and the prompt side's key provider
//! ([`ContractKeys`]) both derive from the rule's contract, and a re-keyed
//! inventory then holds exactly the keys the prompt side computes.

use kvroute_core::{BlockKey, EndpointId, HashContract, KeyMode};
use kvroute_ingest::{
    BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, InventoryView, Keying,
    KvEvent, Overlap, SharedIndex,
};
use kvroute_select::{ContractKeys, PromptKeys};

const CONTRACTS: [&str; 6] = [
    "vllm@0.33.0:sha256_cbor:block=16:seed=0",
    "sglang@0.5.23:sha256_page_chain:block=16",
    "trtllm:v1_block_key:block=16",
    "rekey:xxh3_64_chain:block=16:seed=1337",
    "rekey:xxh3_64_chain:block=16:seed=7",
    "rekey:xxh3_64_chain:block=4:seed=0",
];

#[test]
fn both_sides_take_the_contracts_mode() {
    for spec in CONTRACTS {
        let c: HashContract = spec.parse().unwrap();
        let prompt_side = ContractKeys::new(&c).unwrap().key_mode();
        let ingest_side = Keying::for_contract(&c).mode();
        assert_eq!(prompt_side, c.key_mode(), "{spec}");
        assert_eq!(ingest_side, c.key_mode(), "{spec}");
        let expected = if spec.starts_with("rekey:") {
            KeyMode::Rekey
        } else {
            KeyMode::Engine
        };
        assert_eq!(c.key_mode(), expected, "{spec}");
    }
}

/// Stores 3 blocks of `tokens` (engine keys 100..) into an inventory keyed by
/// `ingest_contract` and returns the prefix the prompt side's keys under
/// `prompt_contract` find.
fn prefix_found(ingest_contract: &str, prompt_contract: &str, tokens: &[u32]) -> u32 {
    let ic: HashContract = ingest_contract.parse().unwrap();
    let pc: HashContract = prompt_contract.parse().unwrap();
    let bs = ic.block_size().get();
    let blocks = tokens.len() as u32 / bs;
    let index = SharedIndex::new(1, IndexConfig::default());
    let config = IngestConfig {
        expected_block_size: Some(bs),
        ..IngestConfig::default()
    };
    let mut ingest = EndpointIngest::new(EndpointId(0), config, Keying::for_contract(&ic));
    let batch = EventBatch {
        seq: 0,
        events: vec![KvEvent::Stored(BlockStored {
            keys: (0..u64::from(blocks)).map(|i| BlockKey(100 + i)).collect(),
            token_ids: tokens.to_vec(),
            block_size: bs,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    };
    let _ = ingest.apply_batch(&batch, &index);
    let mut keys = Vec::new();
    ContractKeys::new(&pc)
        .unwrap()
        .keys(tokens, &mut keys)
        .unwrap();
    assert_eq!(keys.len(), blocks as usize);
    let mut out = [Overlap::default()];
    index.score(&keys, &mut out);
    out[0].prefix
}

#[test]
fn a_rekeyed_inventory_holds_the_prompt_sides_keys() {
    let tokens: Vec<u32> = (1000..1048).collect();
    for seed in [0u64, 7, 1337] {
        let spec = format!("rekey:xxh3_64_chain:block=16:seed={seed}");
        assert_eq!(prefix_found(&spec, &spec, &tokens), 3, "{spec}");
    }
    // The seed travels from the contract into the ingest's re-keyer: another
    // seed on the prompt side matches nothing.
    assert_eq!(
        prefix_found(
            "rekey:xxh3_64_chain:block=16:seed=7",
            "rekey:xxh3_64_chain:block=16:seed=1337",
            &tokens
        ),
        0
    );
}
