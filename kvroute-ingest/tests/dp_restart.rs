//! An engine with several DP ranks restarts: every rank's stream shows the
//! restart, one after the other. The endpoint is cleared once; what the new
//! process stores meanwhile stays, and the inventory is complete again.

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{
    BlockStored, ClearReason, Completeness, EndpointIngest, EventBatch, IndexConfig, IngestConfig,
    Keying, KvEvent, SeqAction, SharedIndex,
};

const EP: EndpointId = EndpointId(0);

fn stored(rank: u32, seq: u64, key: u64) -> EventBatch {
    EventBatch {
        seq,
        dp_rank: Some(rank),
        events: vec![KvEvent::Stored(BlockStored {
            keys: vec![BlockKey(key)],
            block_size: 16,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    }
}

fn two_ranks_with_history() -> (SharedIndex, EndpointIngest) {
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(EP, IngestConfig::default(), Keying::Engine);
    for seq in 0..4 {
        let _ = ingest.apply_batch(&stored(0, seq, 100 + seq), &index);
        let _ = ingest.apply_batch(&stored(1, seq, 200 + seq), &index);
    }
    (index, ingest)
}

#[test]
fn each_rank_showing_one_restart_clears_the_endpoint_once() {
    let (index, mut ingest) = two_ranks_with_history();
    let has = |index: &SharedIndex, k| index.contains(EP, BlockKey(k), Medium::Gpu);
    // The engine restarts: rank 0's first batch of the new process shows it.
    let restart = SeqAction::ClearThenApply(ClearReason::Restart);
    assert_eq!(
        ingest.apply_batch(&stored(0, 0, 300), &index).action,
        restart
    );
    let _ = ingest.apply_batch(&stored(0, 1, 301), &index);
    assert!(
        !has(&index, 103) && !has(&index, 203),
        "the old process is gone"
    );
    // Then rank 1's: the endpoint already holds only the new process's blocks.
    let outcome = ingest.apply_batch(&stored(1, 0, 400), &index);
    assert_eq!(outcome.action, restart);
    assert!(!outcome.cleared, "the clear was not needed");
    assert!(
        has(&index, 300) && has(&index, 301),
        "rank 0's new blocks kept"
    );
    assert!(has(&index, 400));
    assert_eq!(ingest.counters().clears, 1);
    assert_eq!(ingest.counters().clears_not_needed, 1);
    assert_eq!(ingest.completeness(), Completeness::Complete);
}

/// A rank that went on writing after another rank's clear still clears at its
/// own restart: what it wrote belongs to the old process.
#[test]
fn a_rank_that_wrote_since_the_clear_clears_at_its_restart() {
    let (index, mut ingest) = two_ranks_with_history();
    let has = |k| index.contains(EP, BlockKey(k), Medium::Gpu);
    let _ = ingest.apply_batch(&stored(0, 0, 300), &index);
    // Rank 1 is still the old process: its next batch continues its numbers.
    assert_eq!(
        ingest.apply_batch(&stored(1, 4, 204), &index).action,
        SeqAction::Apply
    );
    let _ = ingest.apply_batch(&stored(1, 0, 400), &index);
    assert!(!has(204), "the old process's block is gone");
    assert!(has(400));
    assert_eq!(ingest.counters().clears, 2);
    assert_eq!(ingest.counters().clears_not_needed, 0);
    // Rank 0's new blocks went with that clear: it is partial.
    assert!(matches!(
        ingest.completeness(),
        Completeness::Partial { .. }
    ));
}
