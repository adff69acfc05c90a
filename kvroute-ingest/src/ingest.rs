//! The per-endpoint ingest state machine ([`EndpointIngest`], whose docs hold
//! the decisions it makes).

use std::sync::Arc;

use kvroute_core::{BlockKey, Digest, EndpointId, HashContract, KeyMode, Medium};

use crate::attest::{AttestCounters, ContractStatus, KeyAttestor, ParentLink};
use crate::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{KeyMap, SharedIndex, WriteStats};
use crate::rekey::{BlockRekeyer, XxhChainRekeyer};
use crate::seq::{DropReason, ReplayEnd, SeqAction, SeqCounters, SeqWindow, SeqWindowConfig};

/// How an endpoint's inventory is keyed: the [`KeyMode`] with, for
/// [`KeyMode::Rekey`], the re-keying rule. Build it from the rule's contract
/// with [`Keying::for_contract`] so the ingest side and the prompt side
/// ([`HashContract::key_mode`]) follow the same contract by construction.
///
/// ```
/// use kvroute_core::{HashContract, KeyMode};
/// use kvroute_ingest::Keying;
/// let c: HashContract = "rekey:xxh3_64_chain:block=16:seed=1".parse().unwrap();
/// assert_eq!(Keying::for_contract(&c).mode(), KeyMode::Rekey);
/// assert_eq!(Keying::for_contract(&c).mode(), c.key_mode());
/// ```
#[derive(Clone)]
pub enum Keying {
    /// Use the keys the engine reports; the prompt side must reproduce them.
    Engine,
    /// Recompute keys from token ids with this rule; the prompt side uses it too.
    Rekey(Arc<dyn BlockRekeyer>),
}

impl Keying {
    /// The keying a contract implies: engine keys for engine contracts, the
    /// contract's own re-keyer (with its seed) for re-key contracts.
    #[must_use]
    pub fn for_contract(contract: &HashContract) -> Self {
        match contract {
            // `xxh3_64_chain` is the only re-key algorithm; the prompt side
            // hashes it through kvroute-core's hasher with the same seed.
            HashContract::Rekey(c) => Keying::Rekey(Arc::new(XxhChainRekeyer { seed: c.seed })),
            HashContract::Vllm(_) | HashContract::Sglang(_) | HashContract::Trtllm(_) => {
                Keying::Engine
            }
        }
    }

    /// The key mode, without the re-keyer.
    #[must_use]
    pub fn mode(&self) -> KeyMode {
        match self {
            Keying::Engine => KeyMode::Engine,
            Keying::Rekey(_) => KeyMode::Rekey,
        }
    }
}

impl std::fmt::Debug for Keying {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keying::Engine => f.write_str("Engine"),
            Keying::Rekey(_) => f.write_str("Rekey(..)"),
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
    /// Most entries of the re-key map (engine key → internal key), at least: the
    /// map may also hold as many entries as the endpoint's inventory can hold
    /// keys over all tiers (a correct publisher needs one per key), plus 1024.
    pub max_rekey_entries: usize,
    /// Whether the engine's keys form chains (each depends on every block
    /// before it; `HashContract::keys_chained`). On, a stored event's blocks
    /// are recorded as runs the prefix walk may cross with one lookup; off
    /// (SGLang's legacy per-page hash), every key is looked up. Re-keyed
    /// inventories are always chained.
    pub chained_keys: bool,
}

/// Default [`IngestConfig::max_rekey_entries`]: 2^16 (the bound then follows the
/// index's capacity for the endpoint).
pub const DEFAULT_REKEY_ENTRIES: usize = 1 << 16;

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            window: SeqWindowConfig::default(),
            scored_group: Some(0),
            max_streams: 64,
            attest_links: 1 << 16,
            expected_block_size: None,
            max_rekey_entries: DEFAULT_REKEY_ENTRIES,
            chained_keys: true,
        }
    }
}

/// Whether an endpoint's inventory holds everything its engine reported
/// ([`EndpointIngest::completeness`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completeness {
    /// No batch seen yet.
    Unknown,
    /// Every batch of the engine's current process(es) since their start or
    /// their last `AllBlocksCleared` was applied.
    Complete,
    /// Some batches are known missing (late or failed bootstrap replay, gaps,
    /// clears): the inventory under-reports until an `AllBlocksCleared` or a
    /// restart seen from batch 0.
    Partial {
        /// Batches known missing, summed over the endpoint's streams.
        missing_batches: u64,
    },
}

impl Completeness {
    /// `unknown`, `complete` or `partial` (metrics and admin API).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Completeness::Unknown => "unknown",
            Completeness::Complete => "complete",
            Completeness::Partial { .. } => "partial",
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
    /// Re-key: endpoint resets because the re-key map was full of live entries
    /// (more engine keys than the inventory can hold keys).
    pub rekey_map_full: u64,
    /// Replays that failed or timed out (no end marker).
    pub replays_incomplete: u64,
    /// Replays whose first batch was after the requested one (the engine's
    /// buffer no longer reached back).
    pub replays_late: u64,
    /// Transitions of the endpoint to [`Completeness::Partial`].
    pub partial_episodes: u64,
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
    /// Most map entries: the larger of [`IngestConfig::max_rekey_entries`] and
    /// the keys the endpoint's inventory can hold (one engine key per internal
    /// key), refreshed when the map fills.
    limit: usize,
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

/// One endpoint's ingest state machine: the sans-IO writer of one endpoint — sequence windows (one
/// per DP rank), key mode, attestation and counters — applying event batches to a
/// [`SharedIndex`].
///
/// # Decisions
///
/// * **DP ranks.** Each rank numbers its batches from 0, so each gets its own
///   [`SeqWindow`]. All ranks of one endpoint write into the endpoint's single
///   inventory (their union; reference counts keep a block stored by two ranks
///   until both remove it). A clear triggered by any rank (gap, restart,
///   `AllBlocksCleared`) clears the whole endpoint: a stale entry would only cost
///   an optimisation, and so does a missing one. Hosts that route to ranks
///   separately give each rank its own endpoint slot and `EndpointIngest`.
/// * **Hybrid groups.** Only events of [`IngestConfig::scored_group`] (group 0, the
///   full-attention group in vLLM, by default) are applied; other groups' events
///   are counted and skipped. The prompt side hashes at one block size, other
///   groups use other block sizes (so their keys never match) or hold only a
///   sliding window of the prefix. `None` applies every group into one key space.
/// * **Key modes.** [`Keying::Engine`] stores the keys the engine reports.
///   [`Keying::Rekey`] computes internal keys from the event's token ids chained
///   through the parent's internal key, and keeps engine key → (internal key,
///   outstanding stores) so `BlockRemoved` and tier moves still work. A stored
///   event whose parent is unknown, or whose blocks lack tokens, cannot be
///   re-keyed; it is counted and skipped. The map is bounded by the endpoint's
///   capacity (see [`IngestConfig::max_rekey_entries`]): entries whose internal
///   key left the index are dropped first; a map still full of live entries
///   (many engine keys per internal key: a broken or hostile publisher) resets
///   the endpoint, counted in [`IngestCounters::rekey_map_full`].
/// * **Completeness.** Each stream's window counts the batches of the engine's
///   current process the inventory is known to lack
///   ([`crate::SeqWindow::missing_batches`]); an endpoint is
///   [`Completeness::Partial`] while any stream lacks some. A clear caused by one
///   stream (or by the host) makes every other stream's batches missing; an
///   `AllBlocksCleared` makes its own stream complete again. The transition to
///   partial is logged once at WARN with the endpoint's name (its URL in the
///   gateway) and counted; the return to complete at INFO.
///
/// ```
/// use kvroute_core::{BlockKey, EndpointId, Medium};
/// use kvroute_ingest::{
///     BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent,
///     SharedIndex, SeqAction,
/// };
///
/// let index = SharedIndex::new(1, IndexConfig::default());
/// let mut ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
/// let batch = EventBatch {
///     seq: 0,
///     events: vec![KvEvent::Stored(BlockStored {
///         keys: vec![BlockKey(7), BlockKey(8)],
///         block_size: 16,
///         ..Default::default()
///     })],
///     ..Default::default()
/// };
/// let outcome = ingest.apply_batch(&batch, &index);
/// assert_eq!(outcome.action, SeqAction::Apply);
/// assert!(index.contains(EndpointId(0), BlockKey(8), Medium::Gpu));
/// ```
pub struct EndpointIngest {
    endpoint: EndpointId,
    name: Arc<str>,
    /// Whether the last completeness check found the endpoint partial.
    partial: bool,
    /// Whether the contract mismatch was logged.
    mismatch_warned: bool,
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
            .field("name", &self.name)
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
    pub fn new(endpoint: EndpointId, config: IngestConfig, keying: Keying) -> Self {
        let rekeying = match keying {
            Keying::Engine => None,
            Keying::Rekey(rekeyer) => Some(Rekeying {
                rekeyer,
                limit: config.max_rekey_entries,
                map: KeyMap::default(),
                evicted_since_compact: 0,
            }),
        };
        Self {
            endpoint,
            name: Arc::from(endpoint.to_string()),
            partial: false,
            mismatch_warned: false,
            config,
            streams: Vec::new(),
            rekeying,
            attesting: None,
            counters: IngestCounters::default(),
            scratch: Vec::new(),
        }
    }

    /// Names the endpoint in logs (the gateway uses its URL; the slot number
    /// by default).
    #[must_use]
    pub fn with_name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.name = name.into();
        self
    }

    /// The name used in logs.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the inventory holds everything the engine reported (see
    /// "Completeness" in the [`EndpointIngest`] docs).
    #[must_use]
    pub fn completeness(&self) -> Completeness {
        if self.streams.iter().all(|(_, w)| w.last_seq().is_none()) {
            return Completeness::Unknown;
        }
        match self.missing_batches() {
            0 => Completeness::Complete,
            missing_batches => Completeness::Partial { missing_batches },
        }
    }

    /// Batches known missing, summed over the streams.
    #[must_use]
    pub fn missing_batches(&self) -> u64 {
        self.streams
            .iter()
            .fold(0u64, |sum, (_, w)| sum.saturating_add(w.missing_batches()))
    }

    /// The most likely reason for a contract mismatch, derived from which checks
    /// fail (`None` while none fails). Tokenizer and chat-template differences
    /// cannot show here: attestation recomputes keys from the token ids the
    /// engine reports, so they show on the prompt side (a verified contract
    /// whose predictions never hit).
    #[must_use]
    pub fn likely_mismatch_cause(&self) -> Option<&'static str> {
        if self.counters.block_size_mismatches > 0 {
            return Some(
                "block size: the engine's blocks hold another number of tokens than the contract's",
            );
        }
        let a = self.attest_counters();
        if a.mismatched_blocks == 0 {
            return None;
        }
        Some(if a.verified_blocks == 0 {
            "hash seed or algorithm: no recomputed key matches (e.g. vLLM's PYTHONHASHSEED or \
             --prefix-caching-hash-algo, or another engine version)"
        } else if a.mismatched_root_blocks == 0 {
            "chained keys only: first blocks match, later ones differ (extra keys or a \
             different parent chaining)"
        } else {
            "part of the stream differs: engines with different seeds or versions behind \
             one endpoint?"
        })
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
            + self.streams.capacity() * std::mem::size_of::<(Option<u32>, SeqWindow)>()
    }

    fn stream_pos(&mut self, dp_rank: Option<u32>) -> Option<usize> {
        match self.streams.iter().position(|(r, _)| *r == dp_rank) {
            Some(pos) => Some(pos),
            None if self.streams.len() < self.config.max_streams => {
                self.streams
                    .push((dp_rank, SeqWindow::new(self.config.window)));
                Some(self.streams.len() - 1)
            }
            None => None,
        }
    }

    fn window(&mut self, dp_rank: Option<u32>) -> Option<&mut SeqWindow> {
        let pos = self.stream_pos(dp_rank)?;
        self.streams.get_mut(pos).map(|(_, w)| w)
    }

    /// Logs and counts a change between complete and partial.
    fn check_completeness(&mut self) {
        let missing = self.missing_batches();
        let partial = missing > 0;
        if partial == std::mem::replace(&mut self.partial, partial) {
            return;
        }
        if partial {
            self.counters.partial_episodes += 1;
            tracing::warn!(
                endpoint = %self.name,
                missing_batches = missing,
                replays_late = self.counters.replays_late,
                replays_incomplete = self.counters.replays_incomplete,
                "inventory is partial: engine batches were never applied (late or failed replay, \
                 gap or clear); it under-reports until an AllBlocksCleared or an engine restart"
            );
        } else {
            tracing::info!(endpoint = %self.name, "inventory complete again");
        }
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
        let Some(pos) = self.stream_pos(dp_rank) else {
            return ReplayEnd::Continue;
        };
        let verdict = self
            .streams
            .get_mut(pos)
            .map_or(ReplayEnd::Continue, |(_, w)| {
                w.on_replay_finished(completed)
            });
        if verdict.clears() {
            let writes = self.clear_for(index, Some(pos));
            self.counters.writes += writes;
        }
        self.check_completeness();
        verdict
    }

    /// [`Self::on_replay_finished`] with what the transport saw of the replay:
    /// one that asked for `requested_from` and failed or timed out, or whose
    /// first batch `first_seq` came later, is counted (and shows in the
    /// endpoint's [`Completeness`] through the batches it could not deliver).
    pub fn on_replay_report(
        &mut self,
        dp_rank: Option<u32>,
        requested_from: u64,
        first_seq: Option<u64>,
        completed: bool,
        index: &SharedIndex,
    ) -> ReplayEnd {
        let late = first_seq.is_some_and(|f| f > requested_from);
        if late {
            self.counters.replays_late += 1;
        }
        if !completed {
            self.counters.replays_incomplete += 1;
        }
        if late || !completed {
            // The WARN comes with the endpoint turning partial (the batches this
            // replay could not deliver are counted there), once.
            tracing::info!(
                endpoint = %self.name,
                requested_from,
                ?first_seq,
                completed,
                "KV-event replay did not deliver from the requested batch: the inventory misses \
                 what the engine published before"
            );
        }
        self.on_replay_finished(dp_rank, completed, index)
    }

    /// Runs `batch` through its stream's window and applies it to `index`.
    pub fn apply_batch(&mut self, batch: &EventBatch, index: &SharedIndex) -> Outcome {
        self.apply_batch_on(batch.dp_rank, batch, index)
    }

    /// [`Self::apply_batch`] on the window of stream `dp_rank`, whatever rank the
    /// payload names (a subscriber per DP rank knows its rank from its socket;
    /// older engines leave it out of the payload).
    pub fn apply_batch_on(
        &mut self,
        dp_rank: Option<u32>,
        batch: &EventBatch,
        index: &SharedIndex,
    ) -> Outcome {
        self.counters.batches += 1;
        let Some(pos) = self.stream_pos(dp_rank) else {
            self.counters.stream_limit_drops += 1;
            return Outcome {
                action: SeqAction::Drop(DropReason::StreamLimit),
                writes: WriteStats::default(),
                events_applied: 0,
            };
        };
        let action = match self.streams.get_mut(pos) {
            Some((_, window)) => window.on_batch_with_digest(batch.seq, batch.fingerprint()),
            None => SeqAction::Drop(DropReason::StreamLimit),
        };
        let mut writes = WriteStats::default();
        if action.clears() {
            writes += self.clear_for(index, Some(pos));
        }
        let mut events_applied = 0;
        if action.applies() {
            for event in &batch.events {
                if let Some(w) = self.apply_event(event, index, pos) {
                    writes += w;
                    events_applied += 1;
                }
            }
        }
        self.counters.writes += writes;
        if writes.evicted > 0 {
            self.after_evictions(writes.evicted, index);
        }
        self.check_completeness();
        Outcome {
            action,
            writes,
            events_applied,
        }
    }

    /// Empties the endpoint (inventory, re-key map, attestation links). Every
    /// stream's batches so far count as missing.
    pub fn clear(&mut self, index: &SharedIndex) -> WriteStats {
        let writes = self.clear_for(index, None);
        self.check_completeness();
        writes
    }

    /// Empties the endpoint and forgets every stream's sequence state, so the
    /// next batch of each starts afresh (e.g. after a drain whose events were
    /// lost undecoded: the next `event_id` must not be judged against the lost
    /// ones).
    pub fn reset(&mut self, index: &SharedIndex) -> WriteStats {
        let writes = self.clear_for(index, None);
        self.streams.clear();
        self.check_completeness();
        writes
    }

    /// Empties the endpoint because of stream `cause` (whose window already
    /// accounts for its own missing batches; `None`: the host's reason).
    fn clear_for(&mut self, index: &SharedIndex, cause: Option<usize>) -> WriteStats {
        for (i, (_, w)) in self.streams.iter_mut().enumerate() {
            if Some(i) != cause {
                w.mark_lost();
            }
        }
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
        tracing::debug!(
            endpoint = %self.name,
            engine_block_size = stored.block_size,
            expected,
            blocks = after,
            "engine block size differs from the contract's"
        );
        self.mismatch_seen();
        false
    }

    fn apply_event(
        &mut self,
        event: &KvEvent,
        index: &SharedIndex,
        stream: usize,
    ) -> Option<WriteStats> {
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
                let writes = self.clear_for(index, Some(stream));
                // The engine emptied its cache: nothing of this stream is missing.
                if let Some((_, w)) = self.streams.get_mut(stream) {
                    w.mark_complete();
                }
                return Some(writes);
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
            // A stored event's blocks are consecutive in one chain after
            // `parent`; with chained keys that lets the index record runs.
            if !self.config.chained_keys {
                return index.store(self.endpoint, s.medium, &s.keys);
            }
            return index.store_chain(self.endpoint, s.medium, s.parent, &s.keys);
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
        let mut reset = WriteStats::default();
        if r.map.len().saturating_add(full) > r.limit {
            let held: u64 = Medium::ALL
                .iter()
                .map(|m| index.capacity(self.endpoint, *m).unwrap_or(0))
                .sum();
            let held = usize::try_from(held).unwrap_or(usize::MAX);
            r.limit = self.config.max_rekey_entries.max(held.saturating_add(1024));
        }
        if r.map.len().saturating_add(full) > r.limit {
            // Only evictions leave stale entries behind (removes drop theirs):
            // without one since the last compaction, another would free nothing.
            if r.evicted_since_compact > 0 {
                compact_rekey_map(r, self.endpoint, index);
            }
            if r.map.len().saturating_add(full) > r.limit {
                // More engine keys than the inventory can hold keys: only many
                // engine keys per internal key get here (a hostile or broken
                // publisher). Start the endpoint over rather than freeze it.
                self.counters.rekey_map_full += 1;
                r.map = KeyMap::default();
                r.evicted_since_compact = 0;
                tracing::warn!(
                    endpoint = %self.name,
                    limit = r.limit,
                    "re-key map full of live entries: endpoint inventory reset"
                );
                self.counters.clears += 1;
                for (_, w) in &mut self.streams {
                    w.mark_lost();
                }
                reset = index.clear_endpoint(self.endpoint)?;
            }
        }
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
        let mut writes = index.store_chain(
            self.endpoint,
            s.medium,
            parent,
            self.scratch.get(..n).unwrap_or_default(),
        )?;
        writes += reset;
        Ok(writes)
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
        compact_rekey_map(r, self.endpoint, index);
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
            tracing::debug!(endpoint = %self.name, %err, "stored event not attestable");
            return;
        }
        if a.keys.is_empty() {
            a.counters.unverifiable_events += 1;
            return;
        }
        let before = a.counters.mismatched_blocks;
        if s.parent.is_none() && a.keys.first() != s.keys.first() {
            a.counters.mismatched_root_blocks += 1;
        }
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
        if after > before {
            self.mismatch_seen();
        }
    }

    /// Names a mismatched endpoint once, at WARN, with the most likely cause.
    fn mismatch_seen(&mut self) {
        if std::mem::replace(&mut self.mismatch_warned, true) {
            return;
        }
        let a = self.attest_counters();
        tracing::warn!(
            endpoint = %self.name,
            likely_cause = self.likely_mismatch_cause().unwrap_or("unknown"),
            block_size_mismatches = self.counters.block_size_mismatches,
            expected_block_size = ?self.config.expected_block_size,
            mismatched_blocks = a.mismatched_blocks,
            verified_blocks = a.verified_blocks,
            "hash contract mismatch: this engine's block keys differ from the rule's contract; \
             KV-exact routing misses on this endpoint (counted as contract_mismatch)"
        );
    }
}

/// Drops the re-key entries whose internal key is no longer in the index.
fn compact_rekey_map(r: &mut Rekeying, endpoint: EndpointId, index: &SharedIndex) {
    r.map.retain(|_, (internal, _)| {
        Medium::ALL
            .iter()
            .any(|m| index.contains(endpoint, BlockKey(*internal), *m))
    });
    r.evicted_since_compact = 0;
}
