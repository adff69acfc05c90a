//! [`EndpointIngest`]: the sans-IO writer of one endpoint — sequence windows (one
//! per DP rank), key mode, attestation and counters — applying event batches to a
//! [`SharedIndex`].
//!
//! # Decisions
//!
//! * **DP ranks.** Each rank numbers its batches from 0, so each gets its own
//!   [`SeqWindow`]. All ranks of one endpoint write into the endpoint's single
//!   inventory (their union; reference counts keep a block stored by two ranks
//!   until both remove it). A clear triggered by any rank (gap, restart,
//!   `AllBlocksCleared`) clears the whole endpoint: a stale entry would only cost
//!   an optimisation, and so does a missing one. Hosts that route to ranks
//!   separately give each rank its own endpoint slot and `EndpointIngest`.
//! * **Hybrid groups.** Only events of [`IngestConfig::scored_group`] (group 0, the
//!   full-attention group in vLLM, by default) are applied; other groups' events
//!   are counted and skipped. The prompt side hashes at one block size, other
//!   groups use other block sizes (so their keys never match) or hold only a
//!   sliding window of the prefix. `None` applies every group into one key space.
//! * **Key modes.** [`KeyMode::Engine`] stores the keys the engine reports.
//!   [`KeyMode::Rekey`] computes internal keys from the event's token ids chained
//!   through the parent's internal key, and keeps engine key → (internal key,
//!   outstanding stores) so `BlockRemoved` and tier moves still work. A stored
//!   event whose parent is unknown, or whose blocks lack tokens, cannot be
//!   re-keyed; it is counted and skipped.
//!
//! ```
//! use kvroute_core::{BlockKey, EndpointId, Medium};
//! use kvroute_ingest::{
//!     BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, KeyMode, KvEvent,
//!     SharedIndex, seq::SeqAction,
//! };
//!
//! let index = SharedIndex::new(1, IndexConfig::default());
//! let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), KeyMode::Engine);
//! let batch = EventBatch {
//!     seq: 0,
//!     events: vec![KvEvent::Stored(BlockStored {
//!         keys: vec![BlockKey(7), BlockKey(8)],
//!         block_size: 16,
//!         ..Default::default()
//!     })],
//!     ..Default::default()
//! };
//! let outcome = ingest.apply_batch(&batch, &index);
//! assert_eq!(outcome.action, SeqAction::Apply);
//! assert!(index.contains(EndpointId(0), BlockKey(8), Medium::Gpu));
//! ```

use std::sync::Arc;

use kvroute_core::{BlockKey, Digest, EndpointId, Medium};

use crate::attest::{AttestCounters, ContractStatus, KeyAttestor, ParentLink};
use crate::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{KeyMap, SharedIndex, WriteStats};
use crate::rekey::BlockRekeyer;
use crate::seq::{DropReason, ReplayEnd, SeqAction, SeqCounters, SeqWindow, SeqWindowConfig};

/// How an endpoint's inventory is keyed.
#[derive(Clone)]
pub enum KeyMode {
    /// Use the keys the engine reports; the prompt side must reproduce them.
    Engine,
    /// Recompute keys from token ids with this rule; the prompt side uses it too.
    Rekey(Arc<dyn BlockRekeyer>),
}

impl std::fmt::Debug for KeyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyMode::Engine => f.write_str("Engine"),
            KeyMode::Rekey(_) => f.write_str("Rekey(..)"),
        }
    }
}

/// Configuration of one endpoint's ingest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestConfig {
    /// Sequence-window settings, shared by all of the endpoint's DP ranks.
    pub window: SeqWindowConfig,
    /// The KV-cache group whose events are applied (`None`: all groups).
    pub scored_group: Option<u32>,
    /// Most distinct DP-rank streams tracked; batches from further ranks are
    /// dropped and counted, so a peer cannot grow this without bound.
    pub max_streams: usize,
    /// Most parent digests remembered for attesting later events of a chain
    /// (the cache is emptied when full).
    pub attest_links: usize,
    /// The prompt side's block size (the contract's). A `BlockStored` of another
    /// size can never match a prompt's keys, in any key mode: such blocks are
    /// still applied but counted in [`IngestCounters::block_size_mismatches`],
    /// logged as errors and reported as a contract mismatch. `None`: unchecked.
    pub expected_block_size: Option<u32>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            window: SeqWindowConfig::default(),
            scored_group: Some(0),
            max_streams: 64,
            attest_links: 1 << 16,
            expected_block_size: None,
        }
    }
}

/// Event-level counters of one endpoint (plain integers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestCounters {
    /// Batches received.
    pub batches: u64,
    /// Batches dropped because their DP rank exceeded [`IngestConfig::max_streams`].
    pub stream_limit_drops: u64,
    /// Endpoint clears (any cause).
    pub clears: u64,
    /// `BlockStored` events applied.
    pub stored_events: u64,
    /// `BlockRemoved` events applied.
    pub removed_events: u64,
    /// Tier moves applied.
    pub moved_events: u64,
    /// `AllBlocksCleared` events applied.
    pub all_cleared_events: u64,
    /// Events skipped because they belong to another KV-cache group.
    pub other_group_events: u64,
    /// Re-key: blocks skipped because their parent's internal key is unknown.
    pub rekey_orphan_blocks: u64,
    /// Re-key: blocks skipped because the event lacks their tokens.
    pub rekey_untokenized_blocks: u64,
    /// Re-key: an engine key re-stored with different tokens (map updated).
    pub rekey_conflicts: u64,
    /// Re-key: removes of engine keys with no mapping.
    pub remove_unmapped: u64,
    /// Stored blocks whose event's block size differs from
    /// [`IngestConfig::expected_block_size`].
    pub block_size_mismatches: u64,
    /// Index writes.
    pub writes: WriteStats,
}

/// What [`EndpointIngest::apply_batch`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct Outcome {
    /// The window's decision (already carried out, except a replay request).
    pub action: SeqAction,
    /// Index writes of this batch.
    pub writes: WriteStats,
    /// Events applied.
    pub events_applied: u32,
}

impl Outcome {
    /// The replay the transport adapter must request, if any.
    #[must_use]
    pub fn replay_from(&self) -> Option<u64> {
        match self.action {
            SeqAction::ClearThenReplay { from } => Some(from),
            _ => None,
        }
    }
}

struct Rekeying {
    rekeyer: Arc<dyn BlockRekeyer>,
    /// Engine key → (internal key, stores not yet removed).
    map: KeyMap<(u64, u32)>,
    evicted_since_compact: u64,
}

struct Attesting {
    attestor: Arc<dyn KeyAttestor>,
    links: KeyMap<Digest>,
    counters: AttestCounters,
    keys: Vec<BlockKey>,
    digests: Vec<Digest>,
}

/// One endpoint's ingest state machine. See the [module docs](self).
pub struct EndpointIngest {
    endpoint: EndpointId,
    config: IngestConfig,
    streams: Vec<(Option<u32>, SeqWindow)>,
    rekeying: Option<Rekeying>,
    attesting: Option<Attesting>,
    counters: IngestCounters,
    scratch: Vec<BlockKey>,
}

impl std::fmt::Debug for EndpointIngest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointIngest")
            .field("endpoint", &self.endpoint)
            .field("streams", &self.streams.len())
            .field("rekey", &self.rekeying.is_some())
            .field("attest", &self.attesting.is_some())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl EndpointIngest {
    /// A fresh ingest for endpoint slot `endpoint`.
    #[must_use]
    pub fn new(endpoint: EndpointId, config: IngestConfig, mode: KeyMode) -> Self {
        let rekeying = match mode {
            KeyMode::Engine => None,
            KeyMode::Rekey(rekeyer) => Some(Rekeying {
                rekeyer,
                map: KeyMap::default(),
                evicted_since_compact: 0,
            }),
        };
        Self {
            endpoint,
            config,
            streams: Vec::new(),
            rekeying,
            attesting: None,
            counters: IngestCounters::default(),
            scratch: Vec::new(),
        }
    }

    /// Enables attestation of stored events with `attestor`.
    #[must_use]
    pub fn with_attestor(mut self, attestor: Arc<dyn KeyAttestor>) -> Self {
        self.attesting = Some(Attesting {
            attestor,
            links: KeyMap::default(),
            counters: AttestCounters::default(),
            keys: Vec::new(),
            digests: Vec::new(),
        });
        self
    }

    /// The endpoint slot this ingest writes.
    #[must_use]
    pub fn endpoint(&self) -> EndpointId {
        self.endpoint
    }

    /// Event-level counters.
    #[must_use]
    pub fn counters(&self) -> &IngestCounters {
        &self.counters
    }

    /// Window counters summed over all DP ranks.
    #[must_use]
    pub fn seq_counters(&self) -> SeqCounters {
        let mut sum = SeqCounters::default();
        for (_, w) in &self.streams {
            sum += *w.counters();
        }
        sum
    }

    /// The window of one DP rank, if it has sent anything.
    #[must_use]
    pub fn stream(&self, dp_rank: Option<u32>) -> Option<&SeqWindow> {
        self.streams
            .iter()
            .find(|(r, _)| *r == dp_rank)
            .map(|(_, w)| w)
    }

    /// The hash-contract status from attestation and the block-size check (a
    /// block-size mismatch counts as mismatched blocks).
    #[must_use]
    pub fn contract_status(&self) -> ContractStatus {
        let attested = self
            .attesting
            .as_ref()
            .map_or(ContractStatus::Unknown, |a| a.counters.status());
        match (self.counters.block_size_mismatches, attested) {
            (0, status) => status,
            (
                wrong,
                ContractStatus::Mismatch {
                    mismatched,
                    verified,
                },
            ) => ContractStatus::Mismatch {
                mismatched: mismatched + wrong,
                verified,
            },
            (wrong, ContractStatus::Verified { blocks }) => ContractStatus::Mismatch {
                mismatched: wrong,
                verified: blocks,
            },
            (wrong, _) => ContractStatus::Mismatch {
                mismatched: wrong,
                verified: 0,
            },
        }
    }

    /// Attestation counters (zero without an attestor).
    #[must_use]
    pub fn attest_counters(&self) -> AttestCounters {
        self.attesting
            .as_ref()
            .map(|a| a.counters)
            .unwrap_or_default()
    }

    /// Approximate heap bytes of this ingest's own maps (re-key map, attestation
    /// links); the inventory itself is in [`SharedIndex::memory_bytes`].
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.rekeying
            .as_ref()
            .map_or(0, |r| r.map.allocation_size())
            + self
                .attesting
                .as_ref()
                .map_or(0, |a| a.links.allocation_size())
            + self.scratch.capacity() * std::mem::size_of::<BlockKey>()
    }

    fn window(&mut self, dp_rank: Option<u32>) -> Option<&mut SeqWindow> {
        let pos = match self.streams.iter().position(|(r, _)| *r == dp_rank) {
            Some(pos) => pos,
            None if self.streams.len() < self.config.max_streams => {
                self.streams
                    .push((dp_rank, SeqWindow::new(self.config.window)));
                self.streams.len() - 1
            }
            None => return None,
        };
        self.streams.get_mut(pos).map(|(_, w)| w)
    }

    /// The transport of `dp_rank`'s stream reconnected.
    pub fn on_reconnect(&mut self, dp_rank: Option<u32>) {
        if let Some(w) = self.window(dp_rank) {
            w.on_reconnect();
        }
    }

    /// The transport of `dp_rank`'s stream reconnected and can verify continuity
    /// through a replay: request a replay from the returned sequence number (the
    /// last accepted batch). `None`: nothing to verify (no batch accepted yet, or
    /// the rank exceeds the stream limit). Batches go through
    /// [`Self::apply_batch`] as usual, which digests them with
    /// [`EventBatch::fingerprint`]; see [`SeqWindow::on_resume`].
    #[must_use]
    pub fn on_resume(&mut self, dp_rank: Option<u32>) -> Option<u64> {
        self.window(dp_rank).and_then(SeqWindow::on_resume)
    }

    /// The subscriber of `dp_rank` (re)starts: the sequence number to request a
    /// replay from (`None` when the rank would exceed the stream limit).
    #[must_use]
    pub fn on_bootstrap(&mut self, dp_rank: Option<u32>) -> Option<u64> {
        self.window(dp_rank).map(SeqWindow::on_bootstrap)
    }

    /// The replay of `dp_rank` ended.
    pub fn on_replay_done(&mut self, dp_rank: Option<u32>) {
        if let Some(w) = self.window(dp_rank) {
            w.on_replay_done();
        }
    }

    /// The replay of `dp_rank` ended; `completed` when the publisher sent its end
    /// marker. If that proves a restart during a resume, the endpoint is cleared
    /// here and the verdict says whether to request a replay from 0
    /// ([`SeqWindow::on_replay_finished`]).
    pub fn on_replay_finished(
        &mut self,
        dp_rank: Option<u32>,
        completed: bool,
        index: &SharedIndex,
    ) -> ReplayEnd {
        let verdict = self
            .window(dp_rank)
            .map_or(ReplayEnd::Continue, |w| w.on_replay_finished(completed));
        if verdict.clears() {
            let writes = self.clear(index);
            self.counters.writes += writes;
        }
        verdict
    }

    /// Runs `batch` through its stream's window and applies it to `index`.
    pub fn apply_batch(&mut self, batch: &EventBatch, index: &SharedIndex) -> Outcome {
        self.counters.batches += 1;
        let Some(window) = self.window(batch.dp_rank) else {
            self.counters.stream_limit_drops += 1;
            return Outcome {
                action: SeqAction::Drop(DropReason::StreamLimit),
                writes: WriteStats::default(),
                events_applied: 0,
            };
        };
        let action = window.on_batch_with_digest(batch.seq, batch.fingerprint());
        let mut writes = WriteStats::default();
        if action.clears() {
            writes += self.clear(index);
        }
        let mut events_applied = 0;
        if action.applies() {
            for event in &batch.events {
                if let Some(w) = self.apply_event(event, index) {
                    writes += w;
                    events_applied += 1;
                }
            }
        }
        self.counters.writes += writes;
        if writes.evicted > 0 {
            self.after_evictions(writes.evicted, index);
        }
        Outcome {
            action,
            writes,
            events_applied,
        }
    }

    /// Empties the endpoint (inventory, re-key map, attestation links).
    pub fn clear(&mut self, index: &SharedIndex) -> WriteStats {
        self.counters.clears += 1;
        if let Some(r) = &mut self.rekeying {
            r.map = KeyMap::default();
            r.evicted_since_compact = 0;
        }
        if let Some(a) = &mut self.attesting {
            a.links = KeyMap::default();
        }
        index.clear_endpoint(self.endpoint).unwrap_or_else(|err| {
            tracing::warn!(%err, "clear of an endpoint outside the index");
            WriteStats::default()
        })
    }

    fn in_scored_group(&mut self, group: u32) -> bool {
        let keep = self.config.scored_group.is_none_or(|g| g == group);
        if !keep {
            self.counters.other_group_events += 1;
        }
        keep
    }

    /// False (counted and logged) when `stored` has another block size than the
    /// contract's.
    fn block_size_matches(&mut self, stored: &BlockStored) -> bool {
        let Some(expected) = self.config.expected_block_size else {
            return true;
        };
        if stored.block_size == expected {
            return true;
        }
        let before = self.counters.block_size_mismatches;
        let after = before + stored.keys.len() as u64;
        self.counters.block_size_mismatches = after;
        // Loud but bounded: the first time and whenever the count passes a power of two.
        if before == 0 || (after > before && before.ilog2() != after.ilog2()) {
            tracing::error!(
                endpoint = self.endpoint.0,
                engine_block_size = stored.block_size,
                expected,
                blocks = self.counters.block_size_mismatches,
                "engine block size differs from the contract's: its blocks can never match a prompt"
            );
        }
        false
    }

    fn apply_event(&mut self, event: &KvEvent, index: &SharedIndex) -> Option<WriteStats> {
        let result = match event {
            KvEvent::Stored(s) => {
                if !self.in_scored_group(s.group) {
                    return None;
                }
                self.counters.stored_events += 1;
                // A block of the wrong size is one mismatch, not also an attestation one.
                if self.block_size_matches(s) {
                    self.attest(s);
                }
                self.store(s, index)
            }
            KvEvent::Removed(r) => {
                if !self.in_scored_group(r.group) {
                    return None;
                }
                self.counters.removed_events += 1;
                self.remove(r, index)
            }
            KvEvent::Moved(m) => {
                self.counters.moved_events += 1;
                self.mov(m, index)
            }
            KvEvent::AllCleared => {
                self.counters.all_cleared_events += 1;
                return Some(self.clear(index));
            }
        };
        match result {
            Ok(w) => Some(w),
            Err(err) => {
                tracing::warn!(%err, "event not applied");
                None
            }
        }
    }

    fn store(
        &mut self,
        s: &BlockStored,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let Some(r) = &mut self.rekeying else {
            return index.store(self.endpoint, s.medium, &s.keys);
        };
        let parent = match s.parent {
            None => None,
            Some(p) => match r.map.get(&p.0) {
                Some((internal, _)) => Some(BlockKey(*internal)),
                None => {
                    self.counters.rekey_orphan_blocks += s.keys.len() as u64;
                    return Ok(WriteStats::default());
                }
            },
        };
        let bs = s.block_size as usize;
        let full = s
            .token_ids
            .len()
            .checked_div(bs)
            .map_or(0, |blocks| s.keys.len().min(blocks));
        self.counters.rekey_untokenized_blocks += (s.keys.len() - full) as u64;
        self.scratch.clear();
        let tokens = s.token_ids.get(..full * bs).unwrap_or_default();
        r.rekeyer
            .rekey(parent, tokens, s.block_size, &mut self.scratch);
        for (engine, internal) in s.keys.iter().zip(&self.scratch) {
            let entry = r.map.entry(engine.0).or_insert((internal.0, 0));
            if entry.0 != internal.0 {
                self.counters.rekey_conflicts += 1;
                entry.0 = internal.0;
            }
            entry.1 = entry.1.saturating_add(1);
        }
        let n = full.min(self.scratch.len());
        index.store(
            self.endpoint,
            s.medium,
            self.scratch.get(..n).unwrap_or_default(),
        )
    }

    fn remove(
        &mut self,
        rm: &BlockRemoved,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let Some(r) = &mut self.rekeying else {
            return index.remove(self.endpoint, rm.medium, &rm.keys);
        };
        self.scratch.clear();
        for engine in &rm.keys {
            let Some(entry) = r.map.get_mut(&engine.0) else {
                self.counters.remove_unmapped += 1;
                continue;
            };
            self.scratch.push(BlockKey(entry.0));
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                r.map.remove(&engine.0);
            }
        }
        index.remove(self.endpoint, rm.medium, &self.scratch)
    }

    fn mov(
        &mut self,
        m: &BlockMoved,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let key = match &self.rekeying {
            None => m.key,
            Some(r) => match r.map.get(&m.key.0) {
                Some((internal, _)) => BlockKey(*internal),
                None => {
                    self.counters.remove_unmapped += 1;
                    return Ok(WriteStats::default());
                }
            },
        };
        let mut w = index.remove(self.endpoint, m.from, &[key])?;
        w += index.store(self.endpoint, m.to, &[key])?;
        Ok(w)
    }

    /// Capacity evictions leave re-key map entries behind; once they could make up
    /// half of the map, drop the entries whose internal key is gone.
    fn after_evictions(&mut self, evicted: u64, index: &SharedIndex) {
        let Some(r) = &mut self.rekeying else {
            return;
        };
        r.evicted_since_compact += evicted;
        if r.evicted_since_compact.saturating_mul(2) < r.map.len() as u64 {
            return;
        }
        let e = self.endpoint;
        r.map.retain(|_, (internal, _)| {
            Medium::ALL
                .iter()
                .any(|m| index.contains(e, BlockKey(*internal), *m))
        });
        r.evicted_since_compact = 0;
    }

    fn attest(&mut self, s: &BlockStored) {
        let Some(a) = &mut self.attesting else {
            return;
        };
        a.keys.clear();
        a.digests.clear();
        let parent = match s.parent {
            None => ParentLink::Root,
            Some(p) => a
                .links
                .get(&p.0)
                .map_or(ParentLink::KeyOnly(p), ParentLink::Digest),
        };
        let result = a.attestor.recompute(parent, s, &mut a.keys, &mut a.digests);
        if let Err(err) = result {
            a.counters.unverifiable_events += 1;
            tracing::debug!(endpoint = %self.endpoint, %err, "stored event not attestable");
            return;
        }
        if a.keys.is_empty() {
            a.counters.unverifiable_events += 1;
            return;
        }
        let before = a.counters.mismatched_blocks;
        for (i, (mine, theirs)) in a.keys.iter().zip(&s.keys).enumerate() {
            if mine == theirs {
                a.counters.verified_blocks += 1;
                if let Some(d) = a.digests.get(i) {
                    if a.links.len() >= self.config.attest_links {
                        a.links.clear();
                    }
                    a.links.insert(theirs.0, *d);
                }
            } else {
                a.counters.mismatched_blocks += 1;
            }
        }
        let after = a.counters.mismatched_blocks;
        // Loud but bounded: log on the first mismatch and at every power of two.
        if after > before && (before == 0 || (after.ilog2() != before.ilog2())) {
            tracing::error!(
                endpoint = %self.endpoint,
                mismatched_blocks = after,
                verified_blocks = a.counters.verified_blocks,
                "hash contract mismatch: engine block keys differ from the configured contract \
                 (seed, algorithm, block size or tokenizer); KV-exact routing will miss on this endpoint"
            );
        }
    }
}
