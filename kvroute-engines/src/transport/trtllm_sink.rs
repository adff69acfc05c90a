//! The TensorRT-LLM drain sink: decode a `/kv_cache_events` body and feed one
//! batch per event (seq = `event_id`, per attention-DP rank) to the endpoint's
//! ingest state. Sans-IO; [`super::trtllm_poller`] drives it.
//!
//! Continuity is the only loss signal a destructive drain has: `event_id`s count up
//! by one per event (per rank), so a jump means events were drained by someone else,
//! overflowed the engine's buffer, or died with a timed-out request. The ingest's
//! sequence window judges it — the same window as the ZeroMQ engines, configured
//! with [`SeqWindowConfig::destructive_drain`] (any gap clears; an id that goes
//! backwards is a restart: clear and apply) and bounded by the ingest's stream
//! limit per rank. A body that does not decode clears too, since its events are
//! gone, and forgets the ranks' ids ([`BatchApplier::clear`]).
//!
//! The `created` event's `num_blocks_per_cache_level` bounds the endpoint's
//! inventory ([`BatchApplier::set_capacity`]).
//!
//! [`SeqWindowConfig::destructive_drain`]: kvroute_ingest::SeqWindowConfig::destructive_drain

use kvroute_ingest::EventBatch;

use super::decoding_sink::IngestOutcome;
use super::sink::{DrainReport, DrainSink};
use crate::events::trtllm::{parse_drain, TrtllmDecoder};
use crate::events::DecodeStats;

/// Where decoded batches go: one endpoint's ingest state, which judges each
/// batch's `event_id` in its rank's sequence window.
pub trait BatchApplier: Send {
    /// Applies one batch (in engine order); says what the window decided.
    fn apply(&mut self, batch: &EventBatch) -> IngestOutcome;
    /// Empties the endpoint's inventory and forgets the ranks' sequence state
    /// (the events of an undecodable drain are lost, so the next id must not be
    /// judged against them).
    fn clear(&mut self);
    /// The engine announced its KV capacity in blocks per cache level
    /// (`[gpu, host]`, TensorRT-LLM's `created` event).
    fn set_capacity(&mut self, _blocks_per_level: &[u64]) {}
}

/// [`DrainSink`] that decodes TensorRT-LLM drains and applies them to `A`.
#[derive(Debug)]
pub struct TrtllmSink<A> {
    decoder: TrtllmDecoder,
    stats: DecodeStats,
    applier: A,
    gap_warnings: u64,
}

impl<A: BatchApplier> TrtllmSink<A> {
    /// A sink for an engine with `tokens_per_block` tokens per KV block.
    pub fn new(tokens_per_block: u32, applier: A) -> Self {
        Self {
            decoder: TrtllmDecoder::new(tokens_per_block),
            stats: DecodeStats::default(),
            applier,
            gap_warnings: 0,
        }
    }

    /// The applier (e.g. to inspect an inventory in tests).
    pub fn applier(&self) -> &A {
        &self.applier
    }
}

impl<A: BatchApplier> DrainSink for TrtllmSink<A> {
    fn on_drain(&mut self, body: &[u8]) -> DrainReport {
        let mut report = DrainReport::default();
        let events = match parse_drain(body, &mut self.stats) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(error = %e, "trtllm: undecodable drain, clearing inventory");
                self.lost(&mut report);
                return report;
            }
        };
        // Event by event: a restart one rank's window finds at an event
        // resets that rank's decoder state before the events after it are
        // decoded, so what the new process reports later in the same drain
        // (offloads, capacity) is kept.
        self.decoder.begin_drain(&events, &mut self.stats);
        for (index, ev) in events.iter().enumerate() {
            let Some(batch) = self.decoder.decode_event(index, ev, &mut self.stats) else {
                continue;
            };
            report.events = report
                .events
                .saturating_add(u32::try_from(batch.events.len()).unwrap_or(u32::MAX));
            if let Some(caps) = self.decoder.take_capacity_update() {
                self.applier.set_capacity(&caps);
            }
            let outcome = self.applier.apply(&batch);
            if outcome.gap {
                report.gap = true;
                // Loud but bounded: the first gap and every power of two.
                self.gap_warnings += 1;
                if self.gap_warnings.is_power_of_two() {
                    tracing::warn!(got = batch.seq, rank = ?batch.dp_rank, gaps = self.gap_warnings,
                        cleared = outcome.cleared,
                        "trtllm: event_id gap (another consumer or buffer overflow)");
                }
            }
            if outcome.cleared {
                report.cleared = true;
            }
            if outcome.restart {
                tracing::info!(
                    got = batch.seq,
                    rank = ?batch.dp_rank,
                    "trtllm: event_id went back, engine restarted"
                );
                // A new process on that rank: its tiers start afresh, from
                // this event on (the event is the new process's first, so
                // its own effect on the state is read again).
                self.decoder
                    .restarted(batch.dp_rank, events.get(index..).unwrap_or_default());
                let _ = self
                    .decoder
                    .decode_event(index, ev, &mut DecodeStats::default());
            }
            report.events_applied = report.events_applied.saturating_add(outcome.applied);
            if !outcome.rejected {
                report.last_event_id = Some(batch.seq);
            }
        }
        if let Some(caps) = self.decoder.take_capacity_update() {
            self.applier.set_capacity(&caps);
        }
        report
    }

    fn decode_stats(&self) -> Option<&DecodeStats> {
        Some(&self.stats)
    }

    fn on_lost_drain(&mut self) -> DrainReport {
        tracing::warn!("trtllm: a drain was lost unread, clearing inventory");
        let mut report = DrainReport::default();
        self.lost(&mut report);
        report
    }
}

impl<A: BatchApplier> TrtllmSink<A> {
    /// A drain's events are gone (undecodable, or dropped unread): whatever
    /// they were, the inventory may miss them, and the next `event_id`
    /// must not be judged against them.
    fn lost(&mut self, report: &mut DrainReport) {
        report.decode_error = true;
        report.cleared = true;
        self.applier.clear();
        self.decoder.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::transport::IndexIngest;
    use kvroute_core::{BlockKey, EndpointId, Medium};
    use kvroute_ingest::SeqWindowConfig;
    use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};
    use std::sync::Arc;

    fn drain_sink(index: &Arc<SharedIndex>) -> TrtllmSink<IndexIngest> {
        let config = IngestConfig {
            window: SeqWindowConfig::destructive_drain(),
            ..IngestConfig::default()
        };
        let ingest = EndpointIngest::new(EndpointId(0), config, Keying::Engine);
        TrtllmSink::new(32, IndexIngest::new(ingest, Arc::clone(index), None, false))
    }

    fn stored(id: u64, hash: u64) -> String {
        format!(
            r#"{{"event_id": {id}, "window_size": 8192, "data": {{"type": "stored",
            "parent_hash": null, "blocks": [{{"type": "stored_block", "block_hash": {hash},
            "tokens": [], "cache_level": 0, "priority": 35}}]}}}}"#
        )
    }

    /// One continuity judgement: a restart clears once and a gap counts
    /// once, judged by the window alone (a second tracker in the sink would
    /// clear and count again).
    #[test]
    fn gaps_and_restarts_are_judged_once_by_the_window() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let body = format!("[{},{}]", stored(0, 11), stored(1, 12));
        let r = sink.on_drain(body.as_bytes());
        assert!(!r.gap && !r.cleared, "{r:?}");
        // event 2 lost: the window (destructive-drain policy) clears once.
        let r = sink.on_drain(format!("[{}]", stored(3, 13)).as_bytes());
        assert!(r.gap && r.cleared, "{r:?}");
        assert!(!index.contains(EndpointId(0), BlockKey(11), Medium::Gpu));
        assert!(index.contains(EndpointId(0), BlockKey(13), Medium::Gpu));
        {
            let ingest = sink.applier().endpoint_ingest();
            assert_eq!(ingest.counters().clears, 1);
            assert_eq!(ingest.seq_counters().gaps_cleared, 1);
        }
        // The engine restarts: event_id back to 0 — one clear, the batch applied.
        let r = sink.on_drain(format!("[{}]", stored(0, 14)).as_bytes());
        assert!(r.cleared && !r.gap, "{r:?}");
        let ingest = sink.applier().endpoint_ingest();
        assert_eq!(ingest.counters().clears, 2, "a restart clears once");
        assert_eq!(ingest.seq_counters().restarts, 1);
        assert!(index.contains(EndpointId(0), BlockKey(14), Medium::Gpu));
        assert!(!index.contains(EndpointId(0), BlockKey(13), Medium::Gpu));
        // A restart seen from event 0: the inventory is complete again.
        assert_eq!(
            ingest.completeness(),
            kvroute_ingest::Completeness::Complete
        );
    }

    fn event(id: u64, rank: Option<u32>, data: &str) -> String {
        let rank = rank.map_or(String::new(), |r| format!(r#""attention_dp_rank": {r},"#));
        format!(r#"{{"event_id": {id}, {rank} "window_size": 8192, "data": {data}}}"#)
    }

    fn store(hash: u64) -> String {
        format!(
            r#"{{"type": "stored", "parent_hash": null, "blocks": [{{"type": "stored_block",
            "block_hash": {hash}, "tokens": [], "cache_level": 0, "priority": 35}}]}}"#
        )
    }

    fn offload(hash: u64) -> String {
        format!(
            r#"{{"type": "updated", "block_hash": {hash},
            "cache_level": {{"old_value": 0, "new_value": 1}}}}"#
        )
    }

    fn remove(hash: u64) -> String {
        format!(r#"{{"type": "removed", "block_hashes": [{hash}]}}"#)
    }

    const CREATED: &str = r#"{"type": "created", "num_blocks_per_cache_level": [100, 100]}"#;

    fn drain(sink: &mut TrtllmSink<IndexIngest>, events: &[String]) -> DrainReport {
        sink.on_drain(format!("[{}]", events.join(",")).as_bytes())
    }

    /// A restart shown at the first event of a drain resets the decoder
    /// before the rest of the drain is decoded: an offload the new process
    /// reports in the same drain is remembered, and the block's later
    /// removal leaves the host tier.
    #[test]
    fn a_restart_keeps_what_the_rest_of_its_drain_reports() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let _ = drain(
            &mut sink,
            &[event(0, None, CREATED), event(1, None, &store(5))],
        );
        let r = drain(
            &mut sink,
            &[
                event(0, None, CREATED),
                event(1, None, &store(7)),
                event(2, None, &offload(7)),
            ],
        );
        assert!(r.cleared, "{r:?}");
        let has = |k, m| index.contains(EndpointId(0), BlockKey(k), m);
        assert!(has(7, Medium::Cpu) && !has(7, Medium::Gpu) && !has(5, Medium::Gpu));
        let _ = drain(&mut sink, &[event(3, None, &remove(7))]);
        assert!(!has(7, Medium::Cpu), "the removal leaves the host tier");
        let writes = sink.applier().endpoint_ingest().counters().writes;
        assert_eq!(writes.remove_absent, 0, "{writes:?}");
    }

    /// Each attention-DP rank has its own cache: a block one rank offloaded
    /// is still on another rank's GPU, and that rank's removal leaves the
    /// GPU tier; one rank's restart forgets only its own tiers.
    #[test]
    fn tiers_are_tracked_per_attention_dp_rank() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let has = |k, m| index.contains(EndpointId(0), BlockKey(k), m);
        let _ = drain(
            &mut sink,
            &[
                event(0, Some(0), CREATED),
                event(0, Some(1), CREATED),
                event(1, Some(0), &store(9)),
                event(1, Some(1), &store(9)),
                event(2, Some(0), &offload(9)),
                event(2, Some(1), &remove(9)),
            ],
        );
        assert!(has(9, Medium::Cpu), "rank 0's copy is in its host cache");
        assert!(!has(9, Medium::Gpu), "rank 1 removed its GPU copy");
        // The engine restarts; rank 0 shows it first, and offloads a block
        // of the new process before rank 1 shows it in the next drain.
        let _ = drain(
            &mut sink,
            &[
                event(0, Some(0), CREATED),
                event(1, Some(0), &store(11)),
                event(2, Some(0), &offload(11)),
            ],
        );
        let _ = drain(&mut sink, &[event(0, Some(1), CREATED)]);
        let _ = drain(&mut sink, &[event(3, Some(0), &remove(11))]);
        assert!(!has(11, Medium::Cpu) && !has(11, Medium::Gpu));
        let writes = sink.applier().endpoint_ingest().counters().writes;
        assert_eq!(writes.remove_absent, 0, "{writes:?}");
    }

    /// The `created` event's capacity bounds the inventory.
    #[test]
    fn the_created_event_bounds_the_inventory() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/trtllm-events/classic");
        let created = std::fs::read(dir.join("01_startup_created.json")).unwrap();
        let _ = sink.on_drain(&created);
        assert_eq!(index.capacity(EndpointId(0), Medium::Gpu), Some(7454));
        assert_eq!(index.capacity(EndpointId(0), Medium::Cpu), Some(2048));
    }

    /// With attention DP every rank announces its own cache: the endpoint's
    /// bound is their sum.
    #[test]
    fn attention_dp_ranks_add_their_capacity() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let created = |rank: u32, gpu: u64| {
            format!(
                r#"{{"event_id": 0, "attention_dp_rank": {rank}, "window_size": 8192,
                "data": {{"type": "created", "num_blocks_per_cache_level": [{gpu}, 0]}}}}"#
            )
        };
        let body = format!("[{},{}]", created(0, 1000), created(1, 1500));
        let _ = sink.on_drain(body.as_bytes());
        assert_eq!(index.capacity(EndpointId(0), Medium::Gpu), Some(2500));
    }

    /// An event_id at u64 extremes is dropped, not taken as the rank's last id.
    #[test]
    fn an_implausible_event_id_does_not_poison_the_rank() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
        let _ = sink.on_drain(format!("[{}]", stored(0, 21)).as_bytes());
        let r = sink.on_drain(format!("[{}]", stored(u64::MAX - 1, 22)).as_bytes());
        assert_eq!((r.events_applied, r.last_event_id), (0, None), "{r:?}");
        let r = sink.on_drain(format!("[{}]", stored(1, 23)).as_bytes());
        assert!(!r.cleared && r.events_applied == 1, "{r:?}");
        assert!(index.contains(EndpointId(0), BlockKey(21), Medium::Gpu));
    }

    /// Golden flow through the real ingest: a block offloaded to the host (fixture
    /// 07) and then removed (the fixture-06 event shape, which names no tier) leaves
    /// the index entirely, while the blocks still on the GPU stay.
    #[test]
    fn removed_offloaded_block_leaves_the_host_tier_of_the_index() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let mut sink = drain_sink(&index);
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
}
