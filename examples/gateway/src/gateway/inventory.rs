//! The gateway's ingest glue: per rule one [`SharedIndex`] (slot `i` = endpoint
//! `i`) written by one [`EndpointIngest`] per endpoint (sequence windows per DP
//! rank, clears, counters — all `kvroute-ingest`), fed by one ZeroMQ subscriber
//! per (endpoint, rank). Selection reads the index through [`InventoryView`].
//!
//! One addition on top of the library's window: replay bootstraps every
//! (re)connect from the *last* sequence seen rather than the next, and the
//! engine's batch at that sequence must be the one we applied (same payload
//! digest). A different payload, or an engine whose replay buffer ends before
//! it, means the engine restarted while we were away — a restart the sequence
//! numbers alone cannot show once the new engine has published past our last
//! sequence.
//!
//! Contract attestation: a stored batch with no parent starts at the chain root,
//! so re-hashing its tokens with the rule's contract must reproduce the engine's
//! keys; matches and mismatches are counted (the admin API shows the verdict).

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_core::{BlockHasher, BlockKey, EndpointId, RequestExtras};
use kvroute_engines::events::{self, DecodeStats};
use kvroute_engines::transport::{
    EngineKind, Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction,
};
use kvroute_ingest::seq::{ClearReason, SeqAction};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, InventoryView, KeyMode, KvEvent,
    Overlap, SharedIndex,
};
use parking_lot::Mutex;

/// Attestation counters of one rule.
#[derive(Debug, Default)]
pub struct Attestation {
    /// Root batches whose keys our contract reproduced.
    pub matched: AtomicU64,
    /// Root batches whose keys differ: the contract is wrong for this engine.
    pub mismatched: AtomicU64,
}

impl Attestation {
    /// `unverified`, `verified` or `mismatch`.
    #[must_use]
    pub fn status(&self) -> &'static str {
        match (
            self.matched.load(Ordering::Relaxed),
            self.mismatched.load(Ordering::Relaxed),
        ) {
            (_, m) if m > 0 => "mismatch",
            (0, 0) => "unverified",
            _ => "verified",
        }
    }
}

/// Every inventory of one rule.
pub struct RuleInventory {
    index: SharedIndex,
    ingests: Vec<Mutex<EndpointIngest>>,
    /// Attestation verdicts.
    pub attestation: Attestation,
}

impl std::fmt::Debug for RuleInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleInventory")
            .field("endpoints", &self.ingests.len())
            .finish_non_exhaustive()
    }
}

fn fresh_ingest(slot: usize) -> EndpointIngest {
    EndpointIngest::new(
        EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)),
        IngestConfig::default(),
        KeyMode::Engine,
    )
}

impl RuleInventory {
    /// Inventories for `endpoints` endpoint slots.
    #[must_use]
    pub fn new(endpoints: usize) -> Self {
        Self {
            index: SharedIndex::new(endpoints, IndexConfig::default()),
            ingests: (0..endpoints)
                .map(|i| Mutex::new(fresh_ingest(i)))
                .collect(),
            attestation: Attestation::default(),
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

    /// Forgets everything about endpoint `slot` (engine restart seen by replay).
    fn reset(&self, slot: usize) {
        if let Some(i) = self.ingests.get(slot) {
            *i.lock() = fresh_ingest(slot);
        }
        let _ = self
            .index
            .clear_endpoint(EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)));
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
    hasher: Option<BlockHasher>,
    last_seq: Option<u64>,
    /// Digest of the payload applied at `last_seq`.
    last_digest: u64,
    stats: DecodeStats,
    batch: EventBatch,
    scratch: Vec<BlockKey>,
}

impl RankSink {
    /// A sink for DP rank `rank` of endpoint slot `slot`; `hasher` (the rule's
    /// contract) attests root batches.
    #[must_use]
    pub fn new(
        inventory: Arc<RuleInventory>,
        slot: usize,
        rank: u32,
        engine: EngineKind,
        hasher: Option<BlockHasher>,
    ) -> Self {
        Self {
            inventory,
            slot,
            rank,
            engine,
            hasher,
            last_seq: None,
            last_digest: 0,
            stats: DecodeStats::default(),
            batch: EventBatch::default(),
            scratch: Vec::new(),
        }
    }

    fn attest(&mut self) {
        let Some(h) = &self.hasher else { return };
        for e in &self.batch.events {
            let KvEvent::Stored(s) = e else { continue };
            let plain = s.parent.is_none()
                && s.lora_name.is_none()
                && s.cache_salt.is_none()
                && s.extra_keys.iter().all(Option::is_none)
                && !s.partial_last_block
                && !s.keys.is_empty()
                && s.token_ids.len() == s.keys.len() * s.block_size as usize;
            if !plain {
                continue;
            }
            self.scratch.clear();
            if h.hash_prompt(&s.token_ids, &RequestExtras::NONE, &mut self.scratch)
                .is_err()
            {
                continue;
            }
            let counter = if self.scratch == s.keys {
                &self.inventory.attestation.matched
            } else {
                &self.inventory.attestation.mismatched
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn digest(payload: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

impl FrameSink for RankSink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let mut report = FrameReport::default();
        let payload_digest = digest(frame.payload);
        if frame.source == FrameSource::Replay
            && self.last_seq == Some(frame.seq)
            && payload_digest != self.last_digest
        {
            tracing::info!(
                seq = frame.seq,
                "replayed batch differs from the one applied: engine restarted; inventory cleared"
            );
            self.inventory.reset(self.slot);
            report.restart = true;
            report.cleared = true;
        }
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
            }
            SeqAction::ClearThenReplay { from } => {
                report.cleared = true;
                report.action = SinkAction::Replay { from_seq: from };
            }
        }
        self.last_seq = Some(frame.seq);
        self.last_digest = payload_digest;
        if self
            .batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllCleared))
        {
            report.cleared = true;
        }
        if outcome.action.applies() {
            self.attest();
        }
        report.events_applied = outcome.events_applied;
        report
    }

    fn on_connected(&mut self) -> SinkAction {
        let from = self.inventory.ingests.get(self.slot).and_then(|i| {
            let mut i = i.lock();
            i.on_reconnect(Some(self.rank));
            i.on_bootstrap(Some(self.rank))
        });
        // From our last batch (to check it is still the engine's), else the library's.
        match (self.last_seq, from) {
            (Some(last), _) => SinkAction::Replay { from_seq: last },
            (None, Some(from)) => SinkAction::Replay { from_seq: from },
            (None, None) => SinkAction::Continue,
        }
    }

    fn on_disconnected(&mut self) {}

    fn on_replay_done(&mut self, outcome: &ReplayOutcome) {
        if let Some(i) = self.inventory.ingests.get(self.slot) {
            i.lock().on_replay_done(Some(self.rank));
        }
        // The engine holds nothing from our last sequence on: it restarted (its
        // new batches, if any, carry smaller sequence numbers).
        if outcome.completed
            && outcome.batches == 0
            && self.last_seq.is_some_and(|l| l == outcome.requested_from)
        {
            tracing::info!(last = ?self.last_seq, "engine replay ends before our last sequence: restart; inventory cleared");
            self.inventory.reset(self.slot);
            self.last_seq = None;
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
        let inv = RuleInventory::new(2);
        for (slot, batch) in [(0, stored(0, &[1, 2])), (1, stored(0, &[2, 3]))] {
            let o = inv.ingests[slot].lock().apply_batch(&batch, &inv.index);
            assert!(o.action.applies());
        }
        let mut out = [Overlap::default(); 2];
        inv.score(&[BlockKey(1), BlockKey(2), BlockKey(3)], &mut out);
        assert_eq!((out[0].prefix, out[0].blocks), (2, 2));
        assert_eq!((out[1].prefix, out[1].blocks), (0, 2));
        assert_eq!(inv.blocks(0), 2);
        inv.reset(0);
        assert_eq!(inv.blocks(0), 0);
        assert_eq!(inv.blocks(1), 2);
    }
}
