//! The gateway's inventories: per rule one [`SharedIndex`] (slot `i` = endpoint
//! `i`) written by one [`EndpointIngest`] per endpoint (sequence windows per DP
//! rank, clears, counters, contract attestation, completeness — all
//! `kvroute-ingest`), fed through the library's own sinks: one
//! [`DecodingSink`]`<`[`IndexIngest`]`>` per (endpoint, rank) ZeroMQ
//! subscriber, all ranks of an endpoint sharing its ingest, and one
//! [`TrtllmSink`]`<`[`IndexIngest`]`>` per TensorRT-LLM drain poller. Selection
//! reads the index through [`InventoryView`], whose [`InventoryView::health`]
//! says which endpoints are mismatched or partial.
//!
//! Continuity is the library's: with a replay socket a (re)connect bootstraps or
//! resumes from our last batch (its digest proves the engine did not restart);
//! without one a reconnect is judged by sequence numbers alone, so a network
//! blip keeps the inventory. TensorRT-LLM `event_id`s are judged by the same
//! window with the destructive-drain policy (any gap clears).
//!
//! Each endpoint is named by its URL in every log line, metric and admin field;
//! contract status, completeness and counters are per endpoint.
//!
//! Re-key contracts (`rekey:xxh3_64_chain:...`): the ingest recomputes
//! kvroute's own keys from the token ids of each stored event, chained through
//! the parent's internal key, and maps engine keys to them so removals still
//! apply ([`Keying::Rekey`]). The prompt side hashes with the same contract, so
//! engines whose keys cannot be reproduced (vLLM with a random `PYTHONHASHSEED`,
//! salted TensorRT-LLM, SGLang before 0.5.6) become routable. Engine keys are
//! not attested then: they are opaque by assumption.
//!
//! Capacity: every endpoint is bounded by the index default
//! ([`kvroute_ingest::DEFAULT_CAPACITY`] blocks per tier) until the engine
//! reports its own ([`RuleInventory::set_capacity`]; TensorRT-LLM's `created`
//! event does it by itself).

use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, HashContract, Medium};
use kvroute_engines::transport::{
    DecodingSink, EngineKind, IndexIngest, SharedIngest, TransportError, TrtllmSink,
};
use kvroute_ingest::{AttestCounters, ContractAttestor, ContractStatus, KeyAttestor};
use kvroute_ingest::{
    Completeness, EndpointIngest, IndexConfig, IngestConfig, IngestCounters, InventoryHealth,
    InventoryView, KeyMode, Keying, Overlap, SharedIndex,
};
use kvroute_ingest::{RestartPolicy, SeqCounters, SeqWindowConfig};

use super::config::EndpointSpec;

/// Every inventory of one rule.
pub struct RuleInventory {
    index: Arc<SharedIndex>,
    ingests: Vec<SharedIngest>,
    rekeyed: bool,
}

impl std::fmt::Debug for RuleInventory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleInventory")
            .field("endpoints", &self.ingests.len())
            .finish_non_exhaustive()
    }
}

/// What an inventory needs to know of one endpoint.
#[derive(Clone, Debug)]
pub struct SlotSpec {
    /// The endpoint's URL (names it in logs).
    pub name: String,
    /// Fed by a destructive drain (TensorRT-LLM): any `event_id` gap clears.
    pub drain: bool,
    /// Every DP rank has the engine's replay socket: a detected restart
    /// replays the new process's buffer from 0 ([`RestartPolicy::Replay`]), so
    /// what it stored before our re-dial is learned too.
    pub replay: bool,
}

impl From<&EndpointSpec> for SlotSpec {
    fn from(e: &EndpointSpec) -> Self {
        Self {
            name: e.url.clone(),
            drain: e.drain.is_some(),
            replay: !e.events.is_empty() && e.events.iter().all(|s| s.replay.is_some()),
        }
    }
}

fn new_ingest(
    slot: usize,
    spec: &SlotSpec,
    contract: Option<&HashContract>,
    keying: &Keying,
    attestor: Option<&Arc<dyn KeyAttestor>>,
) -> EndpointIngest {
    let config = IngestConfig {
        // Engine blocks of another size never match the prompt side's keys:
        // counted and shown as a contract mismatch (also in re-key mode).
        expected_block_size: contract.map(|c| c.block_size().get()),
        chained_keys: contract.is_none_or(HashContract::keys_chained),
        window: if spec.drain {
            SeqWindowConfig::destructive_drain()
        } else if spec.replay {
            SeqWindowConfig {
                on_restart: RestartPolicy::Replay,
                ..SeqWindowConfig::default()
            }
        } else {
            SeqWindowConfig::default()
        },
        ..IngestConfig::default()
    };
    let ingest = EndpointIngest::new(
        EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)),
        config,
        keying.clone(),
    )
    .with_name(spec.name.as_str());
    match attestor {
        Some(a) => ingest.with_attestor(Arc::clone(a)),
        None => ingest,
    }
}

/// The admin/metrics label of a contract status.
fn status_label(status: ContractStatus, rekeyed: bool) -> &'static str {
    if rekeyed && !matches!(status, ContractStatus::Mismatch { .. }) {
        return "rekeyed";
    }
    match status {
        ContractStatus::Unknown => "unverified",
        ContractStatus::Unverifiable { .. } => "unverifiable",
        ContractStatus::Verified { .. } => "verified",
        ContractStatus::Mismatch { .. } => "mismatch",
    }
}

impl RuleInventory {
    /// Inventories for `endpoints`. An engine-key `contract` attests the
    /// engines' stored keys; a re-key contract makes every endpoint's ingest
    /// re-key stored blocks from their tokens.
    #[must_use]
    pub fn new(endpoints: &[SlotSpec], contract: Option<&HashContract>) -> Self {
        let keying = contract.map_or(Keying::Engine, Keying::for_contract);
        let attestor = match (&keying, contract) {
            (Keying::Engine, Some(c)) => c
                .hasher()
                .ok()
                .map(|h| Arc::new(ContractAttestor::from_hasher(h)) as Arc<dyn KeyAttestor>),
            _ => None,
        };
        Self {
            index: Arc::new(SharedIndex::new(endpoints.len(), IndexConfig::default())),
            ingests: endpoints
                .iter()
                .enumerate()
                .map(|(i, spec)| {
                    IndexIngest::share(new_ingest(i, spec, contract, &keying, attestor.as_ref()))
                })
                .collect(),
            rekeyed: keying.mode() == KeyMode::Rekey,
        }
    }

    /// The ZeroMQ sink of DP rank `rank` of endpoint `slot` (`replay`: the
    /// subscriber has the engine's replay socket). All ranks of a slot share
    /// its ingest.
    ///
    /// # Errors
    /// An engine without ZeroMQ events, or a slot outside the rule (the
    /// message).
    pub fn zmq_sink(
        &self,
        slot: usize,
        rank: u32,
        engine: EngineKind,
        replay: bool,
    ) -> Result<DecodingSink<IndexIngest>, String> {
        let ingest = self.slot_ingest(slot)?;
        DecodingSink::new(
            engine,
            IndexIngest::shared(ingest, Arc::clone(&self.index), Some(rank), replay),
        )
        .map_err(|e: TransportError| e.to_string())
    }

    /// The drain sink of TensorRT-LLM endpoint `slot`.
    ///
    /// # Errors
    /// A slot outside the rule.
    pub fn drain_sink(
        &self,
        slot: usize,
        tokens_per_block: u32,
    ) -> Result<TrtllmSink<IndexIngest>, String> {
        let ingest = self.slot_ingest(slot)?;
        Ok(TrtllmSink::new(
            tokens_per_block,
            IndexIngest::shared(ingest, Arc::clone(&self.index), None, false),
        ))
    }

    fn slot_ingest(&self, slot: usize) -> Result<SharedIngest, String> {
        self.ingests
            .get(slot)
            .cloned()
            .ok_or_else(|| format!("endpoint slot {slot} is outside the rule's inventory"))
    }

    fn with<T: Default>(&self, slot: usize, f: impl FnOnce(&EndpointIngest) -> T) -> T {
        self.ingests
            .get(slot)
            .map(|i| f(&i.lock()))
            .unwrap_or_default()
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
        self.with(slot, EndpointIngest::seq_counters)
    }

    /// Event-level counters of endpoint `slot` (re-key skips among them).
    #[must_use]
    pub fn ingest_counters(&self, slot: usize) -> IngestCounters {
        self.with(slot, |i| *i.counters())
    }

    /// Attestation counts of endpoint `slot`; blocks whose engine block size
    /// differs from the contract's count as mismatched (in re-key mode too:
    /// they can never match a prompt).
    #[must_use]
    pub fn endpoint_attestation(&self, slot: usize) -> AttestCounters {
        self.with(slot, |i| {
            let mut c = i.attest_counters();
            c.mismatched_blocks += i.counters().block_size_mismatches;
            c
        })
    }

    /// Attestation counts summed over the rule's endpoints.
    #[must_use]
    pub fn attestation(&self) -> AttestCounters {
        let mut sum = AttestCounters::default();
        for slot in 0..self.ingests.len() {
            let c = self.endpoint_attestation(slot);
            sum.verified_blocks += c.verified_blocks;
            sum.mismatched_blocks += c.mismatched_blocks;
            sum.unverifiable_events += c.unverifiable_events;
            sum.mismatched_root_blocks += c.mismatched_root_blocks;
        }
        sum
    }

    /// Endpoint `slot`'s contract status: `unverified`, `unverifiable`,
    /// `verified` or `mismatch`; `rekeyed` for a re-key contract, whose engine
    /// keys are not checked (its block size is: a different engine block size
    /// is a `mismatch` there too).
    #[must_use]
    pub fn endpoint_contract_status(&self, slot: usize) -> &'static str {
        status_label(self.endpoint_attestation(slot).status(), self.rekeyed)
    }

    /// The most likely cause of endpoint `slot`'s mismatch (`None` unless it is
    /// mismatched).
    #[must_use]
    pub fn mismatch_cause(&self, slot: usize) -> Option<&'static str> {
        self.with(slot, EndpointIngest::likely_mismatch_cause)
    }

    /// Whether endpoint `slot`'s inventory holds everything its engine reported.
    #[must_use]
    pub fn completeness(&self, slot: usize) -> Completeness {
        self.ingests
            .get(slot)
            .map_or(Completeness::Unknown, |i| i.lock().completeness())
    }

    /// Bounds endpoint `slot`'s inventory in tier `medium` to `blocks` (the
    /// engine's reported KV capacity, e.g. vLLM/SGLang `num_gpu_blocks`).
    // Called by the engine-metrics poller once the gateway wires it; TensorRT-LLM
    // endpoints bound themselves from their `created` event.
    #[allow(dead_code)]
    pub fn set_capacity(&self, slot: usize, medium: Medium, blocks: usize) {
        let id = EndpointId(u32::try_from(slot).unwrap_or(u32::MAX));
        if let Err(err) = self.index.set_capacity(id, medium, blocks) {
            tracing::warn!(%err, "capacity of an endpoint outside the rule");
        }
    }

    /// Endpoint `slot`'s bound in tier `medium`.
    #[must_use]
    pub fn capacity(&self, slot: usize, medium: Medium) -> Option<u64> {
        self.index
            .capacity(EndpointId(u32::try_from(slot).unwrap_or(u32::MAX)), medium)
    }

    /// Heap bytes of the rule's index and ingest maps.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.index.memory_bytes()
            + self
                .ingests
                .iter()
                .map(|i| i.lock().memory_bytes())
                .sum::<usize>()
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
        self.with(slot, |i| i.counters().clears)
    }
}

impl InventoryView for RuleInventory {
    fn endpoint_count(&self) -> usize {
        self.index.endpoint_count()
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.index.score(keys, out);
    }

    fn health(&self, endpoint: usize) -> InventoryHealth {
        self.with(endpoint, |i| InventoryHealth {
            contract_mismatch: matches!(i.contract_status(), ContractStatus::Mismatch { .. }),
            missing_batches: i.missing_batches(),
            clears: i.counters().clears,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_engines::transport::BatchApplier;
    use kvroute_ingest::{BlockStored, EventBatch, KvEvent};

    fn slots(n: usize) -> Vec<SlotSpec> {
        (0..n)
            .map(|i| SlotSpec {
                name: format!("http://127.0.0.1:{}", 8000 + i),
                drain: false,
                replay: false,
            })
            .collect()
    }

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
        let inv = RuleInventory::new(&slots(2), None);
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
            let inv = RuleInventory::new(&slots(1), Some(&contract));
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
            assert_eq!(inv.endpoint_contract_status(0), "mismatch", "{c}");
            assert_eq!(inv.attestation().mismatched_blocks, 2, "{c}");
        }
    }

    #[test]
    fn rekey_rule_keys_stored_blocks_like_the_prompt_side() {
        let contract: HashContract = "rekey:xxh3_64_chain:block=4:seed=1337".parse().unwrap();
        let inv = Arc::new(RuleInventory::new(&slots(1), Some(&contract)));
        assert!(inv.is_rekeyed());
        assert_eq!(inv.endpoint_contract_status(0), "rekeyed");
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
        let mut applier =
            IndexIngest::shared(inv.ingests[0].clone(), Arc::clone(&inv.index), None, false);
        assert_eq!(applier.apply(&first).applied, 1);
        assert_eq!(applier.apply(&second).applied, 1);
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
        assert_eq!(applier.apply(&removed).applied, 1);
        inv.score(&keys, &mut out);
        assert_eq!(out[0].prefix, 3, "{out:?}");
        let c = inv.ingest_counters(0);
        assert_eq!((c.rekey_orphan_blocks, c.remove_unmapped), (0, 0), "{c:?}");
    }

    /// The golden TensorRT-LLM drains through the library's drain sink, under
    /// the engine-key contract: blocks land and their keys attest.
    #[test]
    fn golden_trtllm_drains_fill_the_rule_inventory() {
        use kvroute_engines::transport::DrainSink;
        let contract: HashContract = "trtllm:v1_block_key:block=32".parse().unwrap();
        let spec = [SlotSpec {
            name: "http://127.0.0.1:8000".into(),
            drain: true,
            replay: false,
        }];
        let inv = Arc::new(RuleInventory::new(&spec, Some(&contract)));
        let mut sink = inv.drain_sink(0, 32).unwrap();
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
        assert_eq!(inv.endpoint_contract_status(0), "verified");
        assert!(inv.seq_counters(0).first > 0);
        // The `created` event bounded the endpoint (7454 GPU, 2048 host blocks).
        assert_eq!(inv.capacity(0, Medium::Gpu), Some(7454));
        assert_eq!(inv.completeness(0), Completeness::Complete);
    }

    fn vllm_stored(seq: u64, tokens: std::ops::Range<u32>, keys: Vec<BlockKey>) -> EventBatch {
        EventBatch {
            seq,
            dp_rank: Some(0),
            events: vec![KvEvent::Stored(BlockStored {
                keys,
                token_ids: tokens.collect(),
                block_size: 16,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        }
    }

    /// Issue 14 #2: contract status is per endpoint. One engine of three on
    /// another seed is `mismatch` with a cause; the others stay `verified`, and
    /// the view tells selection which endpoint is mismatched.
    #[test]
    fn contract_status_and_health_are_per_endpoint() {
        let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
        let inv = RuleInventory::new(&slots(3), Some(&contract));
        let tokens = 1000..1032;
        let good = prompt_keys(&contract, &tokens.clone().collect::<Vec<_>>());
        let other: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=7".parse().unwrap();
        let bad = prompt_keys(&other, &tokens.clone().collect::<Vec<_>>());
        for (slot, keys) in [(0, &good), (1, &bad), (2, &good)] {
            let batch = vllm_stored(0, tokens.clone(), keys.clone());
            let _ = inv.ingests[slot].lock().apply_batch(&batch, &inv.index);
        }
        assert_eq!(inv.endpoint_contract_status(0), "verified");
        assert_eq!(inv.endpoint_contract_status(1), "mismatch");
        assert_eq!(inv.endpoint_contract_status(2), "verified");
        assert_eq!(status_label(inv.attestation().status(), false), "mismatch");
        assert!(inv
            .mismatch_cause(1)
            .unwrap()
            .starts_with("hash seed or algorithm"));
        assert_eq!(inv.mismatch_cause(0), None);
        assert!(inv.health(1).contract_mismatch);
        assert!(!inv.health(0).contract_mismatch && !inv.health(2).contract_mismatch);
    }

    /// Issue 14 #1/Must 2: what scoring does with a partial inventory — nothing
    /// special: the blocks it holds still score (a hit there is real), the ones
    /// it lacks score 0 (a lost optimisation), and the view reports it partial.
    #[test]
    fn a_partial_inventory_still_scores_what_it_holds() {
        let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
        let inv = RuleInventory::new(&slots(2), Some(&contract));
        let tokens: Vec<u32> = (1000..1064).collect();
        let keys = prompt_keys(&contract, &tokens);
        // Endpoint 0 was subscribed late: its first batch is 326 and carries
        // only the last two blocks' store (their parent stored before).
        let late = EventBatch {
            seq: 326,
            dp_rank: Some(0),
            events: vec![KvEvent::Stored(BlockStored {
                keys: keys[2..].to_vec(),
                parent: Some(keys[1]),
                token_ids: tokens[32..].to_vec(),
                block_size: 16,
                ..BlockStored::default()
            })],
            ..EventBatch::default()
        };
        let _ = inv.ingests[0].lock().apply_batch(&late, &inv.index);
        let _ = inv.ingests[1]
            .lock()
            .apply_batch(&vllm_stored(0, 1000..1032, keys[..2].to_vec()), &inv.index);
        assert_eq!(
            inv.completeness(0),
            Completeness::Partial {
                missing_batches: 326
            }
        );
        assert_eq!(inv.completeness(1), Completeness::Complete);
        assert_eq!(inv.health(0).missing_batches, 326);
        let mut out = [Overlap::default(); 2];
        inv.score(&keys, &mut out);
        // The partial endpoint's blocks count, but not as a prefix (its first
        // blocks are the ones it never heard of).
        assert_eq!((out[0].blocks, out[0].prefix), (2, 0));
        assert_eq!((out[1].blocks, out[1].prefix), (2, 2));
    }
}
