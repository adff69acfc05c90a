//! An endpoint's sequence counters (exported as Prometheus counters) never
//! go back: a reset that forgets its streams' windows (a TensorRT-LLM drain
//! that could not be decoded) keeps what they counted.

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{
    BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent,
    SharedIndex,
};

fn stored(seq: u64, key: u64) -> EventBatch {
    EventBatch {
        seq,
        events: vec![KvEvent::Stored(BlockStored {
            keys: vec![BlockKey(key)],
            block_size: 16,
            ..BlockStored::default()
        })],
        ..EventBatch::default()
    }
}

#[test]
fn a_reset_keeps_the_counts_of_the_streams_it_forgets() {
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
    for seq in 0..3 {
        let _ = ingest.apply_batch(&stored(seq, seq + 1), &index);
    }
    let _ = ingest.apply_batch(&stored(1, 9), &index); // old: dropped
    ingest.on_reconnect(None);
    let before = ingest.seq_counters();
    assert_eq!((before.in_order, before.old, before.reconnects), (2, 1, 1));
    let _ = ingest.reset(&index);
    assert_eq!(ingest.seq_counters(), before);
    // The next batch starts a fresh window; the counts go on from there.
    let _ = ingest.apply_batch(&stored(100, 50), &index);
    let after = ingest.seq_counters();
    assert_eq!(after.first, before.first + 1);
    assert_eq!(after.in_order, before.in_order);
}
