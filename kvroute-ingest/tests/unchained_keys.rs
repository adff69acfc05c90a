//! Keys that are not chains (SGLang 0.4.8 ..= 0.5.5 hashes each page alone)
//! must not be stored as chain runs: with runs, a prompt that shares only a
//! stored event's first and last page would be credited with the pages
//! between, which the engine does not hold.

use kvroute_core::{BlockKey, EndpointId, HashContract};
use kvroute_ingest::{
    BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, InventoryView, Keying,
    KvEvent, Overlap, SharedIndex,
};

fn stored(keys: &[u64]) -> EventBatch {
    EventBatch {
        seq: 0,
        events: vec![KvEvent::Stored(BlockStored {
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
            token_ids: (0..keys.len() as u32 * 16).collect(),
            block_size: 16,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    }
}

fn prefix_after_storing(contract: &str, stored_keys: &[u64], prompt: &[u64]) -> u32 {
    let contract: HashContract = contract.parse().unwrap();
    let index = SharedIndex::new(1, IndexConfig::default());
    let config = IngestConfig {
        expected_block_size: Some(16),
        chained_keys: contract.keys_chained(),
        ..IngestConfig::default()
    };
    let mut ingest = EndpointIngest::new(EndpointId(0), config, Keying::for_contract(&contract));
    let _ = ingest.apply_batch(&stored(stored_keys), &index);
    let prompt: Vec<BlockKey> = prompt.iter().map(|&k| BlockKey(k)).collect();
    let mut out = [Overlap::default(); 1];
    index.score_prefix(&prompt, &mut out);
    out[0].prefix
}

#[test]
fn per_page_keys_are_looked_up_one_by_one() {
    // The engine holds pages 1..=8; the prompt has page 1, two other pages,
    // then pages 4..=8 (the same page texts in other places hash alike).
    let held: Vec<u64> = (1..=8).collect();
    let prompt = [1, 100, 101, 4, 5, 6, 7, 8];
    assert_eq!(
        prefix_after_storing("sglang@0.5.5:legacy_pyhash:block=16", &held, &prompt),
        1,
        "only page 1 is a cached prefix"
    );
}

#[test]
fn chained_contracts_still_cross_runs() {
    // With a chained contract the same inventory and a prompt of the held
    // keys is credited in full (the run shortcut applies).
    let held: Vec<u64> = (1..=8).collect();
    assert_eq!(
        prefix_after_storing("sglang@0.5.23:sha256_page_chain:block=16", &held, &held),
        8
    );
}
