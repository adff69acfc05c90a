//! The gateway's ingest glue: per rule one [`SharedIndex`] (slot `i` = endpoint
//! `i`) written by one [`EndpointIngest`] per endpoint (sequence windows per DP
//! rank, clears, counters, contract attestation — all `kvroute-ingest`), fed by
//! one ZeroMQ subscriber per (endpoint, rank). Selection reads the index through
//! [`InventoryView`].
//!
//! Every (re)connect resumes through the library's window
//! ([`EndpointIngest::on_resume`]): the replay starts at the *last* batch we
//! applied, whose digest must match — otherwise (or if the engine's replay ends
//! before it) the engine restarted while we were away, a restart the sequence
//! numbers alone cannot show once the new engine has published past our last
//! sequence.
//!
//! Contract attestation: each endpoint's ingest carries a
//! [`ContractAttestor`] for the rule's contract; the admin API and `/metrics`
//! show the verdict summed over the rule's endpoints.

use std::sync::Arc;

use kvroute_core::{BlockHasher, BlockKey, EndpointId};
use kvroute_engines::events::{self, DecodeStats};
use kvroute_engines::transport::{
    EngineKind, Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction,
};
use kvroute_ingest::attest::{AttestCounters, ContractAttestor, ContractStatus, KeyAttestor};
use kvroute_ingest::seq::{ClearReason, ReplayEnd, SeqAction};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, InventoryView, KeyMode, KvEvent,
    Overlap, SharedIndex,
};
use parking_lot::Mutex;

/// Every inventory of one rule.
pub struct RuleInventory {
    index: SharedIndex,
    ingests: Vec<Mutex<EndpointIngest>>,
}

impl std::fmt::Debug for RuleInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleInventory")
            .field("endpoints", &self.ingests.len())
            .finish_non_exhaustive()
    }
}

fn new_ingest(slot: usize, attestor: Option<&Arc<dyn KeyAttestor>>) -> EndpointIngest {
    let ingest = EndpointIngest::new(
        EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)),
        IngestConfig::default(),
        KeyMode::Engine,
    );
    match attestor {
        Some(a) => ingest.with_attestor(Arc::clone(a)),
        None => ingest,
    }
}

impl RuleInventory {
    /// Inventories for `endpoints` endpoint slots; `contract` (the rule's
    /// hasher) attests the engines' stored keys.
    #[must_use]
    pub fn new(endpoints: usize, contract: Option<BlockHasher>) -> Self {
        let attestor =
            contract.map(|h| Arc::new(ContractAttestor::from_hasher(h)) as Arc<dyn KeyAttestor>);
        Self {
            index: SharedIndex::new(endpoints, IndexConfig::default()),
            ingests: (0..endpoints)
                .map(|i| Mutex::new(new_ingest(i, attestor.as_ref())))
                .collect(),
        }
    }

    /// Attestation counts summed over the rule's endpoints.
    #[must_use]
    pub fn attestation(&self) -> AttestCounters {
        let mut sum = AttestCounters::default();
        for i in &self.ingests {
            let c = i.lock().attest_counters();
            sum.verified_blocks += c.verified_blocks;
            sum.mismatched_blocks += c.mismatched_blocks;
            sum.unverifiable_events += c.unverifiable_events;
        }
        sum
    }

    /// `unverified`, `unverifiable`, `verified` or `mismatch` (any endpoint's
    /// mismatch makes the rule's contract wrong for that engine).
    #[must_use]
    pub fn contract_status(&self) -> &'static str {
        match self.attestation().status() {
            ContractStatus::Unknown => "unverified",
            ContractStatus::Unverifiable { .. } => "unverifiable",
            ContractStatus::Verified { .. } => "verified",
            ContractStatus::Mismatch { .. } => "mismatch",
        }
    }

    /// Blocks held by endpoint slot `slot` (all ranks, all tiers).
    #[must_use]
    pub fn blocks(&self, slot: usize) -> u64 {
        self.index
            .inventory(EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)))
            .total()
    }

    /// Inventory clears the library's ingest made for endpoint `slot`.
    #[must_use]
    pub fn ingest_clears(&self, slot: usize) -> u64 {
        self.ingests
            .get(slot)
            .map_or(0, |i| i.lock().counters().clears)
    }
}

impl InventoryView for RuleInventory {
    fn endpoint_count(&self) -> usize {
        self.index.endpoint_count()
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.index.score(keys, out);
    }
}

/// The [`FrameSink`] of one (endpoint, rank) subscriber.
pub struct RankSink {
    inventory: Arc<RuleInventory>,
    slot: usize,
    rank: u32,
    engine: EngineKind,
    stats: DecodeStats,
    batch: EventBatch,
}

impl RankSink {
    /// A sink for DP rank `rank` of endpoint slot `slot`.
    #[must_use]
    pub fn new(inventory: Arc<RuleInventory>, slot: usize, rank: u32, engine: EngineKind) -> Self {
        Self {
            inventory,
            slot,
            rank,
            engine,
            stats: DecodeStats::default(),
            batch: EventBatch::default(),
        }
    }
}

impl FrameSink for RankSink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let mut report = FrameReport::default();
        let decoded = match self.engine {
            EngineKind::Sglang => events::sglang::decode_into(
                frame.payload,
                frame.seq,
                &mut self.batch,
                &mut self.stats,
            ),
            _ => events::vllm::decode_into(
                frame.payload,
                frame.seq,
                &mut self.batch,
                &mut self.stats,
            ),
        };
        if let Err(e) = decoded {
            tracing::warn!(seq = frame.seq, error = %e, "KV event batch dropped: does not decode");
            report.decode_error = true;
            return report;
        }
        // The window is per subscriber (rank), whatever the payload says.
        self.batch.dp_rank = Some(self.rank);
        report.engine_timestamp = Some(self.batch.timestamp);
        let outcome = match self.inventory.ingests.get(self.slot) {
            Some(ingest) => ingest
                .lock()
                .apply_batch(&self.batch, &self.inventory.index),
            None => return report,
        };
        match outcome.action {
            SeqAction::Apply => {}
            SeqAction::ApplyAfterGap { .. } => report.gap = true,
            SeqAction::Drop(_) => {
                report.ignored = true;
                return report;
            }
            SeqAction::ClearThenApply(reason) => {
                report.cleared = true;
                report.gap = matches!(reason, ClearReason::GapBeyondWindow { .. });
                report.restart = matches!(reason, ClearReason::Restart);
                if report.restart && frame.source == FrameSource::Replay {
                    tracing::info!(
                        seq = frame.seq,
                        "replayed batch differs from the one applied: engine restarted; inventory cleared"
                    );
                }
            }
            SeqAction::ClearThenReplay { from } => {
                report.cleared = true;
                report.action = SinkAction::Replay { from_seq: from };
            }
        }
        if self
            .batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllCleared))
        {
            report.cleared = true;
        }
        report.events_applied = outcome.events_applied;
        report
    }

    fn on_connected(&mut self) -> SinkAction {
        let Some(ingest) = self.inventory.ingests.get(self.slot) else {
            return SinkAction::Continue;
        };
        let mut ingest = ingest.lock();
        // Resume from our last batch (to check it is still the engine's), else
        // bootstrap the whole buffer.
        match ingest.on_resume(Some(self.rank)) {
            Some(last) => SinkAction::Replay { from_seq: last },
            None => ingest
                .on_bootstrap(Some(self.rank))
                .map_or(SinkAction::Continue, |from| SinkAction::Replay {
                    from_seq: from,
                }),
        }
    }

    fn on_disconnected(&mut self) {}

    fn on_replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        let Some(ingest) = self.inventory.ingests.get(self.slot) else {
            return FrameReport::default();
        };
        let end = ingest.lock().on_replay_finished(
            Some(self.rank),
            outcome.completed,
            &self.inventory.index,
        );
        if !end.clears() {
            return FrameReport::default();
        }
        // The engine's buffer ends before our last batch: it restarted.
        tracing::info!(
            from = outcome.requested_from,
            "engine replay ends before our last sequence: restart; inventory cleared"
        );
        FrameReport {
            cleared: true,
            restart: true,
            action: match end {
                ReplayEnd::ClearThenReplay { from } => SinkAction::Replay { from_seq: from },
                _ => SinkAction::Continue,
            },
            ..FrameReport::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_ingest::BlockStored;

    fn stored(seq: u64, keys: &[u64]) -> EventBatch {
        EventBatch {
            seq,
            dp_rank: Some(0),
            events: vec![KvEvent::Stored(BlockStored {
                keys: keys.iter().map(|&k| BlockKey(k)).collect(),
                block_size: 4,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        }
    }

    #[test]
    fn ingest_writes_the_rules_index_by_endpoint_slot() {
        let inv = RuleInventory::new(2, None);
        for (slot, batch) in [(0, stored(0, &[1, 2])), (1, stored(0, &[2, 3]))] {
            let o = inv.ingests[slot].lock().apply_batch(&batch, &inv.index);
            assert!(o.action.applies());
        }
        let mut out = [Overlap::default(); 2];
        inv.score(&[BlockKey(1), BlockKey(2), BlockKey(3)], &mut out);
        assert_eq!((out[0].prefix, out[0].blocks), (2, 2));
        assert_eq!((out[1].prefix, out[1].blocks), (0, 2));
        assert_eq!(inv.blocks(0), 2);
        let _ = inv.ingests[0].lock().clear(&inv.index);
        assert_eq!(inv.blocks(0), 0);
        assert_eq!(inv.blocks(1), 2);
    }
}
