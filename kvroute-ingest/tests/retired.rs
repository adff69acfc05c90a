//! An endpoint that left its slot writes nothing more: a subscriber still
//! stopping may hand its ingest batches, clears or replay verdicts, and the
//! slot's next endpoint must not get the old one's blocks, lose its own, or
//! see its health overwritten.

use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{
    BlockStored, DropReason, EndpointIngest, EventBatch, HealthCell, IndexConfig, IngestConfig,
    Keying, KvEvent, SeqAction, SharedIndex,
};

fn stored(seq: u64, keys: &[u64]) -> EventBatch {
    EventBatch {
        seq,
        events: vec![KvEvent::Stored(BlockStored {
            keys: keys.iter().map(|&k| BlockKey(k)).collect(),
            block_size: 16,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    }
}

#[test]
fn a_retired_ingest_leaves_the_slot_to_its_next_endpoint() {
    let index = SharedIndex::new(1, IndexConfig::default());
    let slot = EndpointId(0);
    let cell = Arc::new(HealthCell::default());
    let mut old = EndpointIngest::new(slot, IngestConfig::default(), Keying::Engine)
        .with_health_cell(Arc::clone(&cell));
    assert_eq!(
        old.apply_batch(&stored(0, &[1, 2]), &index).events_applied,
        1
    );
    assert!(index.contains(slot, BlockKey(1), Medium::Gpu));

    // The host removes the endpoint: retires its ingest, then clears the slot
    // and installs the next endpoint's ingest, which stores its own block.
    old.retire();
    assert!(old.is_retired());
    index.clear_endpoint(slot).unwrap();
    let mut next = EndpointIngest::new(slot, IngestConfig::default(), Keying::Engine)
        .with_health_cell(Arc::clone(&cell));
    assert_eq!(next.apply_batch(&stored(0, &[9]), &index).events_applied, 1);
    let health = cell.get();

    // The old endpoint's subscriber, still stopping, hands over a batch, a
    // gap that would clear, a reset and a replay verdict: none reaches the
    // index or the cell.
    let late = old.apply_batch(&stored(1, &[3]), &index);
    assert_eq!(late.action, SeqAction::Drop(DropReason::Retired));
    assert_eq!(late.events_applied, 0);
    let _ = old.apply_batch(&stored(500, &[4]), &index);
    let _ = old.reset(&index);
    let _ = old.clear(&index);
    let _ = old.on_replay_report(None, 0, Some(7), false, &index);
    for k in [1, 2, 3, 4] {
        assert!(!index.contains(slot, BlockKey(k), Medium::Gpu), "key {k}");
    }
    assert!(index.contains(slot, BlockKey(9), Medium::Gpu));
    assert_eq!(cell.get(), health);
    assert_eq!(health, next.inventory_health());
}
