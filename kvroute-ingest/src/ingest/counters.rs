//! What an endpoint's ingest reports: its completeness, counters and the
//! outcome of one batch.

use crate::index::WriteStats;
use crate::seq::SeqAction;

#[cfg(doc)]
use super::EndpointIngest;

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
    /// Batches dropped because their DP rank exceeded [`IngestConfig::max_streams`](super::IngestConfig::max_streams).
    pub stream_limit_drops: u64,
    /// Endpoint clears (any cause).
    pub clears: u64,
    /// Clears a stream's window asked for (a restart, a gap beyond the
    /// window) that were not needed: nothing of that stream had been written
    /// since the endpoint was last cleared. The usual case: an engine with
    /// DP ranks restarts, the first rank to show it clears the endpoint, and
    /// the others find only the new process's blocks there.
    pub clears_not_needed: u64,
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
    /// Stored events naming only blocks the endpoint already held before
    /// the batch, with no parent: a request reporting the blocks it found
    /// cached (vLLM's `kv_cache_report_mode = "full"`), not a new copy.
    /// Skipped: counting them would keep the blocks past their eviction.
    pub reported_hits: u64,
    /// Re-key: blocks skipped because their parent's internal key is unknown.
    pub rekey_orphan_blocks: u64,
    /// Re-key: blocks skipped because the event lacks their tokens and their
    /// engine key was never re-keyed (a block without tokens whose key is
    /// mapped, such as an offloaded copy, is stored under its internal key).
    pub rekey_untokenized_blocks: u64,
    /// Re-key: an engine key re-stored with different tokens (map updated).
    pub rekey_conflicts: u64,
    /// Re-key: removes of engine keys with no mapping in the removed tier,
    /// and moves of engine keys with no mapping at all.
    pub remove_unmapped: u64,
    /// Stored blocks whose event's block size differs from
    /// [`IngestConfig::expected_block_size`](super::IngestConfig::expected_block_size).
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
    /// The endpoint's inventory was cleared: by the window's decision (unless
    /// not needed, see [`IngestCounters::clears_not_needed`]), an
    /// `AllBlocksCleared` event or a re-key map reset.
    pub cleared: bool,
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
