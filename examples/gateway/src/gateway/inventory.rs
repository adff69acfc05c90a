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
//!
//! Re-key contracts (`rekey:xxh3_64_chain:...`): the ingest recomputes
//! kvroute's own keys from the token ids of each stored event, chained through
//! the parent's internal key, and maps engine keys to them so removals still
//! apply ([`KeyMode::Rekey`]). The prompt side hashes with the same contract, so
//! engines whose keys cannot be reproduced (vLLM with a random `PYTHONHASHSEED`,
//! salted TensorRT-LLM, SGLang before 0.5.6) become routable. Engine keys are
//! not attested then: they are opaque by assumption.
//!
//! TensorRT-LLM endpoints are drained over HTTP instead; [`DrainApplier`] feeds
//! the same per-endpoint ingest.

use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, HashContract};
use kvroute_engines::events::{self, DecodeStats};
use kvroute_engines::transport::{
    BatchApplier, EngineKind, Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction,
};
use kvroute_ingest::attest::{AttestCounters, ContractAttestor, ContractStatus, KeyAttestor};
use kvroute_ingest::rekey::{BlockRekeyer, XxhChainRekeyer};
use kvroute_ingest::seq::{ClearReason, SeqAction, SeqCounters};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, IngestCounters, InventoryView, KeyMode,
    KvEvent, Overlap, SharedIndex,
};
use parking_lot::Mutex;

/// Every inventory of one rule.
pub struct RuleInventory {
    index: SharedIndex,
    ingests: Vec<Mutex<EndpointIngest>>,
    rekeyed: bool,
}

impl std::fmt::Debug for RuleInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleInventory")
            .field("endpoints", &self.ingests.len())
            .finish_non_exhaustive()
    }
}

fn new_ingest(
    slot: usize,
    contract: Option<&HashContract>,
    rekeyer: Option<&Arc<dyn BlockRekeyer>>,
    attestor: Option<&Arc<dyn KeyAttestor>>,
) -> EndpointIngest {
    let mode = rekeyer.map_or(KeyMode::Engine, |r| KeyMode::Rekey(Arc::clone(r)));
    let config = IngestConfig {
        // Engine blocks of another size never match the prompt side's keys:
        // counted and shown as a contract mismatch (also in re-key mode).
        expected_block_size: contract.map(|c| c.block_size().get()),
        ..IngestConfig::default()
    };
    let ingest = EndpointIngest::new(
        EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)),
        config,
        mode,
    );
    match attestor {
        Some(a) => ingest.with_attestor(Arc::clone(a)),
        None => ingest,
    }
}

/// The ingest-side re-keyer of a re-key contract (`None` for engine-key contracts).
#[must_use]
pub fn rekeyer_for(contract: &HashContract) -> Option<Arc<dyn BlockRekeyer>> {
    match contract {
        // `xxh3_64_chain` is the only re-key algorithm; the prompt side hashes it
        // through kvroute-core's hasher with the same seed.
        HashContract::Rekey(c) => Some(Arc::new(XxhChainRekeyer { seed: c.seed })),
        _ => None,
    }
}

impl RuleInventory {
    /// Inventories for `endpoints` endpoint slots. An engine-key `contract`
    /// attests the engines' stored keys; a re-key contract makes every
    /// endpoint's ingest re-key stored blocks from their tokens.
    #[must_use]
    pub fn new(endpoints: usize, contract: Option<&HashContract>) -> Self {
        let rekeyer = contract.and_then(rekeyer_for);
        let attestor = match (&rekeyer, contract) {
            (None, Some(c)) => c
                .hasher()
                .ok()
                .map(|h| Arc::new(ContractAttestor::from_hasher(h)) as Arc<dyn KeyAttestor>),
            _ => None,
        };
        Self {
            index: SharedIndex::new(endpoints, IndexConfig::default()),
            ingests: (0..endpoints)
                .map(|i| Mutex::new(new_ingest(i, contract, rekeyer.as_ref(), attestor.as_ref())))
                .collect(),
            rekeyed: rekeyer.is_some(),
        }
    }

    /// Whether the inventories hold re-keyed (internal) keys.
    #[must_use]
    pub fn is_rekeyed(&self) -> bool {
        self.rekeyed
    }

    /// Sequence-window counters of endpoint `slot`, summed over its DP ranks
    /// (resumes, verified resumes, restarts found by a resume, ...).
    #[must_use]
    pub fn seq_counters(&self, slot: usize) -> SeqCounters {
        self.ingests
            .get(slot)
            .map(|i| i.lock().seq_counters())
            .unwrap_or_default()
    }

    /// Event-level counters of endpoint `slot` (re-key skips among them).
    #[must_use]
    pub fn ingest_counters(&self, slot: usize) -> IngestCounters {
        self.ingests
            .get(slot)
            .map(|i| *i.lock().counters())
            .unwrap_or_default()
    }

    /// Attestation counts summed over the rule's endpoints.
    #[must_use]
    /// Blocks whose engine block size differs from the contract's count as
    /// mismatched (in re-key mode too: they can never match a prompt).
    pub fn attestation(&self) -> AttestCounters {
        let mut sum = AttestCounters::default();
        for i in &self.ingests {
            let i = i.lock();
            let c = i.attest_counters();
            sum.verified_blocks += c.verified_blocks;
            sum.mismatched_blocks += c.mismatched_blocks + i.counters().block_size_mismatches;
            sum.unverifiable_events += c.unverifiable_events;
        }
        sum
    }

    /// `unverified`, `unverifiable`, `verified` or `mismatch` (any endpoint's
    /// mismatch makes the rule's contract wrong for that engine); `rekeyed` for a
    /// re-key contract, whose engine keys are not checked (its block size is:
    /// a different engine block size is a `mismatch` there too).
    #[must_use]
    pub fn contract_status(&self) -> &'static str {
        let status = self.attestation().status();
        if self.rekeyed && !matches!(status, ContractStatus::Mismatch { .. }) {
            return "rekeyed";
        }
        match status {
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

/// The [`BatchApplier`] of one TensorRT-LLM endpoint's drain poller: decoded
/// drains go through the endpoint's ingest (sequence window on `event_id`, key
/// mode, attestation) into the rule's index.
pub struct DrainApplier {
    inventory: Arc<RuleInventory>,
    slot: usize,
}

impl DrainApplier {
    /// The applier of endpoint slot `slot`.
    #[must_use]
    pub fn new(inventory: Arc<RuleInventory>, slot: usize) -> Self {
        Self { inventory, slot }
    }
}

impl BatchApplier for DrainApplier {
    fn apply(&mut self, batch: &EventBatch) -> u32 {
        let Some(ingest) = self.inventory.ingests.get(self.slot) else {
            return 0;
        };
        ingest
            .lock()
            .apply_batch(batch, &self.inventory.index)
            .events_applied
    }

    fn clear(&mut self) {
        if let Some(ingest) = self.inventory.ingests.get(self.slot) {
            let _ = ingest.lock().clear(&self.inventory.index);
        }
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
        if end.clears() {
            // The engine's buffer ends before our last batch: it restarted.
            tracing::info!(
                from = outcome.requested_from,
                "engine replay ends before our last sequence: restart; inventory cleared"
            );
        }
        FrameReport::from(end)
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

    /// Keys a prompt side would compute with `contract` (kvroute-core's hasher).
    fn prompt_keys(contract: &HashContract, tokens: &[u32]) -> Vec<BlockKey> {
        let mut keys = Vec::new();
        contract
            .hasher()
            .unwrap()
            .hash_prompt(tokens, &kvroute_core::RequestExtras::NONE, &mut keys)
            .unwrap();
        keys
    }

    /// A re-key rule ignores the engine's (opaque) keys: stored blocks are keyed
    /// from their tokens, chained through the parent's internal key, and the
    /// prompt side's keys for the same contract find them; a removal by engine
    /// key still applies.
    /// An engine publishing blocks of another size than the rule's contract can
    /// never be hit: the rule says `mismatch`, in re-key mode too.
    #[test]
    fn an_engine_block_size_other_than_the_contracts_is_a_mismatch() {
        for c in [
            "rekey:xxh3_64_chain:block=16:seed=1337",
            "vllm@0.33.0:sha256_cbor:block=16:seed=0",
        ] {
            let contract: HashContract = c.parse().unwrap();
            let inv = RuleInventory::new(1, Some(&contract));
            let batch = EventBatch {
                seq: 0,
                events: vec![KvEvent::Stored(BlockStored {
                    keys: vec![BlockKey(1), BlockKey(2)],
                    token_ids: (0..64).collect(),
                    block_size: 32,
                    ..BlockStored::default()
                })],
                ..EventBatch::default()
            };
            let _ = inv.ingests[0].lock().apply_batch(&batch, &inv.index);
            assert_eq!(inv.contract_status(), "mismatch", "{c}");
            assert_eq!(inv.attestation().mismatched_blocks, 2, "{c}");
        }
    }

    #[test]
    fn rekey_rule_keys_stored_blocks_like_the_prompt_side() {
        let contract: HashContract = "rekey:xxh3_64_chain:block=4:seed=1337".parse().unwrap();
        let inv = RuleInventory::new(1, Some(&contract));
        assert!(inv.is_rekeyed());
        assert_eq!(inv.contract_status(), "rekeyed");
        let tokens: Vec<u32> = (100..116).collect();
        // Two events: blocks 0-1 at the root, then 2-3 under engine key 0xB.
        let first = EventBatch {
            seq: 0,
            events: vec![KvEvent::Stored(BlockStored {
                keys: vec![BlockKey(0xA0), BlockKey(0xB)],
                token_ids: tokens[..8].to_vec(),
                block_size: 4,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        };
        let second = EventBatch {
            seq: 1,
            events: vec![KvEvent::Stored(BlockStored {
                keys: vec![BlockKey(0xC0), BlockKey(0xD0)],
                parent: Some(BlockKey(0xB)),
                token_ids: tokens[8..].to_vec(),
                block_size: 4,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        };
        let mut applier = DrainApplier::new(Arc::new(inv), 0);
        assert_eq!(applier.apply(&first), 1);
        assert_eq!(applier.apply(&second), 1);
        let inv = Arc::clone(&applier.inventory);
        let keys = prompt_keys(&contract, &tokens);
        assert_eq!(keys.len(), 4);
        let mut out = [Overlap::default()];
        inv.score(&keys, &mut out);
        assert_eq!(out[0].prefix, 4, "{out:?}");
        // Engine keys are not in the index.
        inv.score(&[BlockKey(0xA0)], &mut out);
        assert_eq!(out[0].blocks, 0);
        // Removing engine key 0xD0 removes the internal key of block 3.
        let removed = EventBatch {
            seq: 2,
            events: vec![KvEvent::Removed(kvroute_ingest::BlockRemoved {
                keys: vec![BlockKey(0xD0)],
                ..Default::default()
            })],
            ..EventBatch::default()
        };
        assert_eq!(applier.apply(&removed), 1);
        inv.score(&keys, &mut out);
        assert_eq!(out[0].prefix, 3, "{out:?}");
        let c = inv.ingest_counters(0);
        assert_eq!((c.rekey_orphan_blocks, c.remove_unmapped), (0, 0), "{c:?}");
    }

    /// The golden TensorRT-LLM drains through the gateway's drain applier, under
    /// the engine-key contract: blocks land and their keys attest.
    #[test]
    fn golden_trtllm_drains_fill_the_rule_inventory() {
        use kvroute_engines::transport::{DrainSink, TrtllmSink};
        let contract: HashContract = "trtllm:v1_block_key:block=32".parse().unwrap();
        let inv = Arc::new(RuleInventory::new(1, Some(&contract)));
        let mut sink = TrtllmSink::new(32, DrainApplier::new(Arc::clone(&inv), 0));
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../golden/trtllm-events/classic");
        for f in ["01_startup_created.json", "02_context_blocks_stored.json"] {
            let report = sink.on_drain(&std::fs::read(dir.join(f)).unwrap());
            assert!(!report.cleared && !report.decode_error, "{f}: {report:?}");
        }
        assert!(inv.blocks(0) > 0);
        let att = inv.attestation();
        assert!(att.verified_blocks > 0, "{att:?}");
        assert_eq!(att.mismatched_blocks, 0, "{att:?}");
        assert_eq!(inv.contract_status(), "verified");
        assert!(inv.seq_counters(0).first > 0);
    }
}
