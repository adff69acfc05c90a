//! The TensorRT-LLM drain sink: decode a `/kv_cache_events` body, check `event_id`
//! continuity per attention-DP rank, and feed the batches to the endpoint's ingest
//! state. Sans-IO; [`super::trtllm_poller`] drives it.
//!
//! Continuity is the only loss signal a destructive drain has: `event_id`s count up
//! by one per event (per rank), so a jump means events were drained by someone else,
//! overflowed the engine's buffer, or died with a timed-out request. Any jump — and a
//! body that does not decode, since its events are gone too — clears the inventory.
//! An `event_id` that goes backwards means the engine restarted: clear as well.

use hashbrown::HashMap;
use kvroute_ingest::EventBatch;

use super::sink::{DrainReport, DrainSink};
use crate::events::trtllm::TrtllmDecoder;
use crate::events::DecodeStats;

/// Where decoded batches go: one endpoint's ingest state.
pub trait BatchApplier: Send {
    /// Applies one batch (in engine order); returns the number of events applied.
    fn apply(&mut self, batch: &EventBatch) -> u32;
    /// Empties the endpoint's inventory.
    fn clear(&mut self);
}

/// How one `event_id` relates to the previous one of its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// First id seen for this rank.
    First,
    /// Exactly the next id.
    Next,
    /// Ids were skipped.
    Gap {
        /// The id expected.
        expected: u64,
    },
    /// The id went backwards: the engine restarted.
    Restart,
}

/// Next expected `event_id` per attention-DP rank.
#[derive(Clone, Debug, Default)]
pub struct EventIdTracker {
    next: HashMap<Option<u32>, u64>,
}

impl EventIdTracker {
    /// Records `event_id` for `rank` and classifies it.
    pub fn observe(&mut self, rank: Option<u32>, event_id: u64) -> Continuity {
        let continuity = match self.next.get(&rank) {
            None => Continuity::First,
            Some(&n) if n == event_id => Continuity::Next,
            Some(&n) if event_id > n => Continuity::Gap { expected: n },
            Some(_) => Continuity::Restart,
        };
        self.next.insert(rank, event_id.saturating_add(1));
        continuity
    }

    /// Forgets every rank (after a clear caused by an undecodable drain).
    pub fn reset(&mut self) {
        self.next.clear();
    }
}

/// [`DrainSink`] that decodes TensorRT-LLM drains and applies them to `A`.
#[derive(Debug)]
pub struct TrtllmSink<A> {
    decoder: TrtllmDecoder,
    ids: EventIdTracker,
    stats: DecodeStats,
    applier: A,
}

impl<A: BatchApplier> TrtllmSink<A> {
    /// A sink for an engine with `tokens_per_block` tokens per KV block.
    pub fn new(tokens_per_block: u32, applier: A) -> Self {
        Self {
            decoder: TrtllmDecoder::new(tokens_per_block),
            ids: EventIdTracker::default(),
            stats: DecodeStats::default(),
            applier,
        }
    }

    /// The applier (e.g. to inspect an inventory in tests).
    pub fn applier(&self) -> &A {
        &self.applier
    }

    /// Decoder counters.
    pub fn decode_stats(&self) -> &DecodeStats {
        &self.stats
    }
}

impl<A: BatchApplier> DrainSink for TrtllmSink<A> {
    fn on_drain(&mut self, body: &[u8]) -> DrainReport {
        let mut report = DrainReport::default();
        let batches = match self.decoder.decode_drain(body, &mut self.stats) {
            Ok(b) => b,
            Err(e) => {
                // The drain consumed those events: whatever they were, they are lost.
                tracing::warn!(error = %e, "trtllm: undecodable drain, clearing inventory");
                report.decode_error = true;
                report.cleared = true;
                self.applier.clear();
                self.ids.reset();
                self.decoder.reset();
                return report;
            }
        };
        for batch in &batches {
            report.events = report
                .events
                .saturating_add(u32::try_from(batch.events.len()).unwrap_or(u32::MAX));
            match self.ids.observe(batch.dp_rank, batch.seq) {
                Continuity::First | Continuity::Next => {}
                Continuity::Gap { expected } => {
                    tracing::warn!(expected, got = batch.seq, rank = ?batch.dp_rank,
                        "trtllm: event_id gap (another consumer or buffer overflow), clearing");
                    report.gap = true;
                    report.cleared = true;
                    self.applier.clear();
                }
                Continuity::Restart => {
                    tracing::info!(
                        got = batch.seq,
                        "trtllm: event_id went back, engine restarted"
                    );
                    report.cleared = true;
                    self.applier.clear();
                    // A new process: its tiers, window and capacity start afresh.
                    self.decoder.reset();
                }
            }
            report.events_applied = report
                .events_applied
                .saturating_add(self.applier.apply(batch));
            report.last_event_id = Some(batch.seq);
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_ids_per_rank() {
        let mut t = EventIdTracker::default();
        assert_eq!(t.observe(Some(0), 0), Continuity::First);
        assert_eq!(t.observe(Some(1), 0), Continuity::First);
        assert_eq!(t.observe(Some(0), 1), Continuity::Next);
        assert_eq!(t.observe(Some(1), 1), Continuity::Next);
        assert_eq!(t.observe(Some(0), 5), Continuity::Gap { expected: 2 });
        assert_eq!(t.observe(Some(0), 0), Continuity::Restart);
        assert_eq!(t.observe(None, u64::MAX), Continuity::First);
        assert_eq!(t.observe(None, 7), Continuity::Restart);
    }

    /// Golden flow through the real ingest: a block offloaded to the host (fixture
    /// 07) and then removed (the fixture-06 event shape, which names no tier) leaves
    /// the index entirely, while the blocks still on the GPU stay.
    #[test]
    fn removed_offloaded_block_leaves_the_host_tier_of_the_index() {
        use crate::transport::IndexIngest;
        use kvroute_core::{BlockKey, EndpointId, Medium};
        use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, KeyMode, SharedIndex};
        use std::sync::Arc;

        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), KeyMode::Engine);
        let mut sink = TrtllmSink::new(32, IndexIngest::new(ingest, index.clone(), None, false));
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/trtllm-events/classic");
        for f in [
            "01_startup_created.json",
            "02_context_blocks_stored.json",
            "03_release_stores_rest_incl_partial.json",
            "04_shared_prefix_new_branch.json",
            "05_empty_drain.json",
            "06_eviction_removed_coalesced.json",
            "07_offload_updated_cache_level.json",
        ] {
            let report = sink.on_drain(&std::fs::read(dir.join(f)).unwrap());
            assert!(!report.cleared && !report.decode_error, "{f}: {report:?}");
        }
        let (offloaded, on_gpu) = (
            BlockKey(6281115329494198917),
            BlockKey(13121859508051604645),
        );
        let has = |k, m| index.contains(EndpointId(0), k, m);
        assert!(has(offloaded, Medium::Cpu) && !has(offloaded, Medium::Gpu));
        assert!(has(on_gpu, Medium::Gpu));

        let removed = br#"[{"event_id": 6, "window_size": 8192,
            "data": {"type": "removed", "block_hashes": [6281115329494198917]}}]"#;
        let report = sink.on_drain(removed);
        assert_eq!(report.events_applied, 1);
        assert!(!has(offloaded, Medium::Cpu) && !has(offloaded, Medium::Gpu));
        assert!(has(on_gpu, Medium::Gpu));
        let writes = sink.applier().endpoint_ingest().counters().writes;
        assert_eq!(writes.remove_absent, 0, "{writes:?}");
    }

    proptest::proptest! {
        /// Against a model that remembers every (rank, id) ever seen in order.
        #[test]
        fn matches_reference_model(ids in proptest::collection::vec((0u32..3, 0u64..20), 0..64)) {
            let mut t = EventIdTracker::default();
            let mut last: std::collections::HashMap<u32, u64> = Default::default();
            for (rank, id) in ids {
                let want = match last.get(&rank) {
                    None => Continuity::First,
                    Some(&prev) if id == prev + 1 => Continuity::Next,
                    Some(&prev) if id > prev + 1 => Continuity::Gap { expected: prev + 1 },
                    Some(_) => Continuity::Restart,
                };
                proptest::prop_assert_eq!(t.observe(Some(rank), id), want);
                last.insert(rank, id);
            }
        }
    }
}
