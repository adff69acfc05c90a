//! A `BlockStored` whose block size differs from the contract's can never match
//! a prompt's keys: the ingest counts it and reports the contract as mismatched,
//! in engine-key and re-key mode alike.

use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::ContractStatus;
use kvroute_ingest::XxhChainRekeyer;
use kvroute_ingest::{
    BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent,
    SharedIndex,
};

fn stored(seq: u64, block_size: u32, keys: &[u64]) -> EventBatch {
    EventBatch {
        seq,
        events: vec![KvEvent::Stored(BlockStored {
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
            token_ids: (0..keys.len() as u32 * block_size).collect(),
            block_size,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    }
}

fn ingest(mode: Keying, expected: Option<u32>) -> EndpointIngest {
    let config = IngestConfig {
        expected_block_size: expected,
        ..IngestConfig::default()
    };
    EndpointIngest::new(EndpointId(0), config, mode)
}

fn modes() -> [Keying; 2] {
    [
        Keying::Engine,
        Keying::Rekey(Arc::new(XxhChainRekeyer { seed: 7 })),
    ]
}

#[test]
fn other_block_sizes_are_counted_and_make_the_contract_a_mismatch() {
    for mode in modes() {
        let index = SharedIndex::new(1, IndexConfig::default());
        let mut ingest = ingest(mode, Some(16));
        let _ = ingest.apply_batch(&stored(0, 16, &[1, 2]), &index);
        assert_eq!(ingest.counters().block_size_mismatches, 0);
        assert_ne!(
            ingest.contract_status(),
            ContractStatus::Mismatch {
                mismatched: 0,
                verified: 0
            }
        );
        let _ = ingest.apply_batch(&stored(1, 32, &[3, 4, 5]), &index);
        assert_eq!(ingest.counters().block_size_mismatches, 3);
        assert!(
            matches!(
                ingest.contract_status(),
                ContractStatus::Mismatch { mismatched: 3, .. }
            ),
            "{:?}",
            ingest.contract_status()
        );
        // Still applied: the inventory stays a faithful mirror of the engine.
        assert_eq!(ingest.counters().stored_events, 2);
    }
}

#[test]
fn without_an_expected_size_nothing_is_checked() {
    for mode in modes() {
        let index = SharedIndex::new(1, IndexConfig::default());
        let mut ingest = ingest(mode, None);
        let _ = ingest.apply_batch(&stored(0, 32, &[3, 4]), &index);
        assert_eq!(ingest.counters().block_size_mismatches, 0);
        assert_eq!(ingest.contract_status(), ContractStatus::Unknown);
    }
}
