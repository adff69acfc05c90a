//! The per-endpoint ingest state machine ([`EndpointIngest`], whose docs hold
//! the decisions it makes).
//!
//! * this module: the state machine, its streams and their lifecycle
//!   (reconnect, resume, bootstrap, replay);
//! * `apply`: a batch's events applied to the index (stores, removes, moves,
//!   re-keying, attestation);
//! * `config`: [`Keying`] and [`IngestConfig`]; `counters`: [`Completeness`],
//!   [`IngestCounters`] and a batch's [`Outcome`].

mod apply;
mod config;
mod counters;

use std::sync::Arc;

use kvroute_core::{BlockKey, Digest, EndpointId};

pub use config::{IngestConfig, Keying, ScoredGroup, DEFAULT_REKEY_ENTRIES};
pub use counters::{Completeness, IngestCounters, Outcome};

use crate::attest::{AttestCounters, ContractStatus, KeyAttestor};
use crate::index::{KeyMap, SharedIndex, WriteStats};
use crate::rekey::BlockRekeyer;
use crate::seq::{ReplayEnd, SeqCounters, SeqWindow};
use crate::view::{HealthCell, InventoryHealth};

struct Rekeying {
    rekeyer: Arc<dyn BlockRekeyer>,
    /// Most map entries: the larger of [`IngestConfig::max_rekey_entries`] and
    /// the keys the endpoint's inventory can hold (one engine key per internal
    /// key), refreshed when the map fills.
    limit: usize,
    /// Engine key → (internal key, stores not yet removed per tier). Per
    /// tier: an offloaded copy's removal (vLLM's offloading connector) must
    /// not take the device copy's mapping with it.
    map: KeyMap<(u64, [u16; 4])>,
    evicted_since_compact: u64,
}

struct Attesting {
    attestor: Arc<dyn KeyAttestor>,
    links: KeyMap<Digest>,
    counters: AttestCounters,
    keys: Vec<BlockKey>,
    digests: Vec<Digest>,
}

/// One DP rank's event stream of an endpoint.
#[derive(Debug)]
struct Stream {
    rank: Option<u32>,
    window: SeqWindow,
    /// A batch of this stream was applied since the endpoint was last
    /// cleared: the inventory may hold what it wrote.
    written: bool,
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
///   an optimisation, and so does a missing one. A window's clear removes what
///   its own stream wrote, so a stream that wrote nothing since the endpoint
///   was last cleared does not clear it
///   ([`IngestCounters::clears_not_needed`]): when an engine with several
///   ranks restarts, the first rank to show it clears the endpoint, and the
///   others, showing the same restart, keep what the new process has stored
///   meanwhile (clearing again would drop it and leave the first rank
///   partial). Hosts that route to ranks separately give each rank its own
///   endpoint slot and `EndpointIngest`.
/// * **Reported hits.** A stored event with no parent whose blocks the
///   endpoint all held before its batch is a request reporting what it found
///   cached (vLLM's `kv_cache_report_mode = "full"`), not another copy of
///   them: it is counted ([`IngestCounters::reported_hits`]) and skipped.
///   Stores of a block already stored in the same batch are copies and count
///   (see [`SharedIndex`]'s reference counts), as do all stores on an
///   endpoint with several DP-rank streams (a rank's copy of a block another
///   rank holds is its own).
/// * **Hybrid groups.** Only events of [`IngestConfig::scored_group`] are
///   applied (by default the first group the engine reports as full attention,
///   group 0 while it reports none); other groups' events are counted and
///   skipped. The prompt side hashes at one block size, other groups use other
///   block sizes (so their keys never match) or hold only a sliding window of
///   the prefix. [`ScoredGroup::All`] applies every group into one key space.
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
    streams: Vec<Stream>,
    rekeying: Option<Rekeying>,
    attesting: Option<Attesting>,
    counters: IngestCounters,
    scratch: Vec<BlockKey>,
    /// What decisions read of this ingest, published after every change.
    health: Arc<HealthCell>,
    /// The endpoint left its slot ([`Self::retire`]): nothing more is
    /// written to the index.
    retired: bool,
    /// Counters of the streams a [`Self::reset`] forgot.
    reset_streams: SeqCounters,
    /// What the engine's stores said of their groups so far
    /// ([`ScoredGroup::FullAttention`]).
    full_group: FullGroup,
    /// (tier, key) stored by the batch being applied (its copies count;
    /// see `IngestCounters::reported_hits`).
    batch_keys: hashbrown::HashSet<(usize, u64)>,
}

/// The full-attention group as an engine's stores name it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum FullGroup {
    /// No store named an attention kind: group 0 is scored.
    #[default]
    Unknown,
    /// Stores name kinds, none full attention yet: nothing is scored.
    NotYet,
    /// The first group named full attention.
    Group(u32),
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
            health: Arc::default(),
            retired: false,
            reset_streams: SeqCounters::default(),
            full_group: FullGroup::Unknown,
            batch_keys: hashbrown::HashSet::new(),
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
        if self.streams.iter().all(|s| s.window.last_seq().is_none()) {
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
        self.streams.iter().fold(0u64, |sum, s| {
            sum.saturating_add(s.window.missing_batches())
        })
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
        // Streams forgotten by a reset still count: counters never go back.
        let mut sum = self.reset_streams;
        for s in &self.streams {
            sum += *s.window.counters();
        }
        sum
    }

    /// The window of one DP rank, if it has sent anything.
    #[must_use]
    pub fn stream(&self, dp_rank: Option<u32>) -> Option<&SeqWindow> {
        self.streams
            .iter()
            .find(|s| s.rank == dp_rank)
            .map(|s| &s.window)
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
            + self.streams.capacity() * std::mem::size_of::<Stream>()
    }

    fn stream_pos(&mut self, dp_rank: Option<u32>) -> Option<usize> {
        match self.streams.iter().position(|s| s.rank == dp_rank) {
            Some(pos) => Some(pos),
            None if self.streams.len() < self.config.max_streams => {
                self.streams.push(Stream {
                    rank: dp_rank,
                    window: SeqWindow::new(self.config.window),
                    written: false,
                });
                Some(self.streams.len() - 1)
            }
            None => None,
        }
    }

    fn window(&mut self, dp_rank: Option<u32>) -> Option<&mut SeqWindow> {
        let pos = self.stream_pos(dp_rank)?;
        self.streams.get_mut(pos).map(|s| &mut s.window)
    }

    /// Logs and counts a change between complete and partial.
    /// The inventory's health as decisions see it ([`crate::InventoryView::health`]).
    #[must_use]
    pub fn inventory_health(&self) -> InventoryHealth {
        InventoryHealth {
            contract_mismatch: matches!(self.contract_status(), ContractStatus::Mismatch { .. }),
            missing_batches: self.missing_batches(),
            clears: self.counters.clears,
        }
    }

    /// The cell this ingest publishes [`Self::inventory_health`] to after
    /// every change, for readers that must not take its lock.
    #[must_use]
    pub fn health_cell(&self) -> &Arc<HealthCell> {
        &self.health
    }

    /// Publishes to `cell` from now on (a host that reads each slot's
    /// health from one cell for the slot's lifetime hands it to every
    /// ingest it installs there).
    #[must_use]
    pub fn with_health_cell(mut self, cell: Arc<HealthCell>) -> Self {
        self.health = cell;
        self.publish_health();
        self
    }

    /// The endpoint left its slot: from now on this ingest writes nothing to
    /// the index (batches are dropped as [`DropReason::Retired`], clears and
    /// replay verdicts leave the index alone) and stops publishing to the
    /// cell it was given. A host removing an endpoint calls it under the
    /// ingest's lock before clearing the slot, so a subscriber still
    /// stopping — a batch being applied, a replay running — cannot write the
    /// old endpoint's blocks, or its health, into the slot's next endpoint.
    ///
    /// [`DropReason::Retired`]: crate::DropReason::Retired
    pub fn retire(&mut self) {
        self.retired = true;
        self.health = Arc::default();
    }

    /// Whether [`Self::retire`] was called.
    #[must_use]
    pub fn is_retired(&self) -> bool {
        self.retired
    }

    fn publish_health(&self) {
        self.health.set(self.inventory_health());
    }

    /// Publishes the health and logs the inventory turning partial or
    /// complete; every change of the ingest ends here.
    fn check_completeness(&mut self) {
        self.publish_health();
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
        self.publish_health();
    }

    /// The transport of `dp_rank`'s stream reconnected and can verify continuity
    /// through a replay: request a replay from the returned sequence number (the
    /// last accepted batch). `None`: nothing to verify (no batch accepted yet, or
    /// the rank exceeds the stream limit). Batches go through
    /// [`Self::apply_batch`] as usual, which digests them with
    /// [`EventBatch::fingerprint`](crate::EventBatch::fingerprint); see [`SeqWindow::on_resume`].
    #[must_use]
    pub fn on_resume(&mut self, dp_rank: Option<u32>) -> Option<u64> {
        let from = self.window(dp_rank).and_then(SeqWindow::on_resume);
        self.publish_health();
        from
    }

    /// The subscriber of `dp_rank` (re)starts: the sequence number to request a
    /// replay from (`None` when the rank would exceed the stream limit).
    #[must_use]
    pub fn on_bootstrap(&mut self, dp_rank: Option<u32>) -> Option<u64> {
        let from = self.window(dp_rank).map(SeqWindow::on_bootstrap);
        self.publish_health();
        from
    }

    /// The replay of `dp_rank` ended.
    pub fn on_replay_done(&mut self, dp_rank: Option<u32>) {
        if let Some(w) = self.window(dp_rank) {
            w.on_replay_done();
        }
        self.publish_health();
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
        let verdict = self.streams.get_mut(pos).map_or(ReplayEnd::Continue, |s| {
            s.window.on_replay_finished(completed)
        });
        if verdict.clears() {
            let writes = self.clear_for_stream(index, pos);
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
        // Another engine may take the slot: its groups are its own.
        self.full_group = FullGroup::Unknown;
        for s in self.streams.drain(..) {
            self.reset_streams += *s.window.counters();
        }
        self.check_completeness();
        writes
    }

    /// The clear stream `pos`'s window asked for: it removes what that
    /// stream wrote, so it is skipped when the stream wrote nothing since the
    /// endpoint was last cleared (see "DP ranks" in the type's docs).
    pub(crate) fn clear_for_stream(&mut self, index: &SharedIndex, pos: usize) -> WriteStats {
        if self.streams.get(pos).is_some_and(|s| !s.written) {
            self.counters.clears_not_needed += 1;
            return WriteStats::default();
        }
        self.clear_for(index, Some(pos))
    }

    /// Empties the endpoint because of stream `cause` (whose window already
    /// accounts for its own missing batches; `None`: the host's reason).
    fn clear_for(&mut self, index: &SharedIndex, cause: Option<usize>) -> WriteStats {
        if self.retired {
            return WriteStats::default();
        }
        for (i, s) in self.streams.iter_mut().enumerate() {
            if Some(i) != cause {
                s.window.mark_lost();
            }
            s.written = false;
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
}
