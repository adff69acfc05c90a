//! Glue to the ingest crate: [`IndexIngest`] drives one endpoint's
//! [`EndpointIngest`] (sequence windows, key mode, attestation, completeness)
//! writing the [`SharedIndex`] that scoring reads. It is the [`SeqIngest`] of a
//! [`super::DecodingSink`] (vLLM / SGLang over ZeroMQ) and the [`BatchApplier`]
//! of a [`super::TrtllmSink`] — the one ingest path hosts use.
//!
//! * **Several DP ranks, one endpoint.** An engine with data parallelism
//!   publishes one stream per rank (each on its own ports). Build one
//!   [`SharedIngest`] per endpoint and one [`IndexIngest::shared`] per rank's
//!   subscriber: each rank is judged in its own sequence window (the rank is the
//!   subscriber's, whatever the payload says), all write the endpoint's one
//!   inventory.
//! * **Replay socket or not.** With a replay socket (`replay = true`) the first
//!   connect bootstraps the engine's buffer and a reconnect resumes from our
//!   last batch, whose digest proves continuity. Without one, a reconnect is
//!   judged by sequence numbers alone ([`EndpointIngest::on_reconnect`]): a near
//!   reconnect keeps the inventory — resuming would wait for a replay that can
//!   never come and take the next live batch for a restart, clearing the
//!   inventory on every network blip.
//! * **TensorRT-LLM.** Build the [`EndpointIngest`] with
//!   [`SeqWindowConfig::destructive_drain`] (every `event_id` gap clears: the
//!   drain consumed the lost events) and pass `dp_rank = None` (the drain
//!   interleaves the attention-DP ranks; each event names its own). The
//!   capacity its `created` event reports bounds the endpoint's inventory.
//!
//! [`SeqWindowConfig::destructive_drain`]: kvroute_ingest::SeqWindowConfig::destructive_drain

use std::sync::Arc;

use kvroute_core::Medium;
use kvroute_ingest::{ClearReason, DropReason, SeqAction};
use kvroute_ingest::{EndpointIngest, EventBatch, Outcome, SharedIndex};
use parking_lot::{Mutex, MutexGuard};

use super::decoding_sink::{IngestOutcome, SeqIngest};
use super::sink::{FrameReport, FrameSource, ReplayOutcome};
use super::trtllm_sink::BatchApplier;

/// One endpoint's ingest state, shared by the subscribers of its DP ranks.
pub type SharedIngest = Arc<Mutex<EndpointIngest>>;

/// One stream's (endpoint, DP rank) view of the endpoint's ingest state plus the
/// shared index it writes.
///
/// ```
/// use std::sync::Arc;
/// use kvroute_core::EndpointId;
/// use kvroute_engines::engine::VLLM;
/// use kvroute_engines::transport::{DecodingSink, IndexIngest};
/// use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};
///
/// let index = Arc::new(SharedIndex::new(4, IndexConfig::default()));
/// let ingest = EndpointIngest::new(EndpointId(2), IngestConfig::default(), Keying::Engine);
/// let shared = IndexIngest::share(ingest);
/// // Two DP ranks of endpoint 2, each with its own subscriber and replay socket.
/// let rank0 = DecodingSink::for_engine(
///     &VLLM,
///     IndexIngest::shared(Arc::clone(&shared), Arc::clone(&index), Some(0), true),
/// );
/// let rank1 = DecodingSink::for_engine(
///     &VLLM,
///     IndexIngest::shared(Arc::clone(&shared), index, Some(1), true),
/// );
/// assert!(rank0.is_ok() && rank1.is_ok());
/// ```
#[derive(Debug)]
pub struct IndexIngest {
    ingest: SharedIngest,
    index: Arc<SharedIndex>,
    dp_rank: Option<u32>,
    replay: bool,
    connected_before: bool,
    capacity: Option<[u64; 2]>,
}

impl IndexIngest {
    /// A stream with its own (unshared) endpoint ingest. `dp_rank`: `Some(r)`
    /// judges every batch in rank `r`'s window (a ZeroMQ subscriber of that
    /// rank); `None` uses the rank each batch names (TensorRT-LLM drains).
    /// `replay`: the subscriber has the engine's replay socket (bootstrap on
    /// connect, resume on reconnect).
    #[must_use]
    pub fn new(
        ingest: EndpointIngest,
        index: Arc<SharedIndex>,
        dp_rank: Option<u32>,
        replay: bool,
    ) -> Self {
        Self::shared(Self::share(ingest), index, dp_rank, replay)
    }

    /// Wraps an endpoint's ingest for sharing between its ranks' streams.
    #[must_use]
    pub fn share(ingest: EndpointIngest) -> SharedIngest {
        Arc::new(Mutex::new(ingest))
    }

    /// One DP rank's stream of an endpoint whose ingest is `ingest` (see
    /// [`Self::new`] for `dp_rank` and `replay`).
    #[must_use]
    pub fn shared(
        ingest: SharedIngest,
        index: Arc<SharedIndex>,
        dp_rank: Option<u32>,
        replay: bool,
    ) -> Self {
        Self {
            ingest,
            index,
            dp_rank,
            replay,
            connected_before: false,
            capacity: None,
        }
    }

    /// The endpoint's ingest state (counters, windows, completeness), locked.
    pub fn endpoint_ingest(&self) -> MutexGuard<'_, EndpointIngest> {
        self.ingest.lock()
    }

    /// The shared handle of the endpoint's ingest state.
    #[must_use]
    pub fn shared_ingest(&self) -> &SharedIngest {
        &self.ingest
    }

    /// The shared index.
    #[must_use]
    pub fn index(&self) -> &Arc<SharedIndex> {
        &self.index
    }

    fn judge_and_apply(&self, batch: &EventBatch) -> Outcome {
        let rank = self.dp_rank.or(batch.dp_rank);
        self.ingest.lock().apply_batch_on(rank, batch, &self.index)
    }
}

/// The transport-facing summary of one window decision.
fn summarize(outcome: &Outcome) -> IngestOutcome {
    let action = outcome.action;
    IngestOutcome {
        applied: outcome.events_applied,
        gap: matches!(
            action,
            SeqAction::ApplyAfterGap { .. }
                | SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { .. })
        ),
        cleared: outcome.cleared,
        restart: matches!(
            action,
            SeqAction::ClearThenApply(ClearReason::Restart) | SeqAction::ClearThenReplay { .. }
        ),
        ignored: matches!(action, SeqAction::Drop(_)),
        rejected: matches!(action, SeqAction::Drop(DropReason::Implausible)),
        replay_from: outcome.replay_from(),
    }
}

impl SeqIngest for IndexIngest {
    fn ingest(&mut self, batch: &EventBatch, _source: FrameSource) -> IngestOutcome {
        summarize(&self.judge_and_apply(batch))
    }

    fn connected(&mut self) -> Option<u64> {
        let reconnect = std::mem::replace(&mut self.connected_before, true);
        let mut ingest = self.ingest.lock();
        if !self.replay {
            if reconnect {
                ingest.on_reconnect(self.dp_rank);
            }
            return None;
        }
        // With a replay socket a reconnect resumes from our last batch, whose
        // digest tells a live engine from one that restarted and published past
        // our last sequence while we were away.
        if reconnect {
            if let Some(last) = ingest.on_resume(self.dp_rank) {
                return Some(last);
            }
        }
        ingest.on_bootstrap(self.dp_rank)
    }

    fn replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        // A restart found in the replay already cleared the endpoint; the
        // subscriber replays the new process's buffer next. This replay,
        // cut short, proves nothing.
        if outcome.restart_from.is_some() {
            return FrameReport::default();
        }
        let mut ingest = self.ingest.lock();
        let clears = ingest.counters().clears;
        let end = ingest.on_replay_report(
            self.dp_rank,
            outcome.requested_from,
            outcome.first_seq,
            outcome.completed,
            &self.index,
        );
        let cleared = ingest.counters().clears > clears;
        if end.clears() {
            tracing::info!(
                endpoint = ingest.name(),
                from = outcome.requested_from,
                cleared,
                "engine replay ends before our last sequence: restart"
            );
        }
        FrameReport {
            cleared,
            ..FrameReport::from(end)
        }
    }
}

impl BatchApplier for IndexIngest {
    fn apply(&mut self, batch: &EventBatch) -> IngestOutcome {
        summarize(&self.judge_and_apply(batch))
    }

    fn clear(&mut self) {
        let _ = self.ingest.lock().reset(&self.index);
    }

    fn set_capacity(&mut self, blocks_per_level: &[u64]) {
        // A level the engine does not announce is left as it is (as 0).
        let gpu = blocks_per_level.first().copied().unwrap_or(0);
        let host = blocks_per_level.get(1).copied().unwrap_or(0);
        if self.capacity == Some([gpu, host]) {
            return;
        }
        self.capacity = Some([gpu, host]);
        let ingest = self.ingest.lock();
        if ingest.is_retired() {
            return;
        }
        let endpoint = ingest.endpoint();
        for (medium, blocks) in [(Medium::Gpu, gpu), (Medium::Cpu, host)] {
            // A level the engine does not have (0 blocks) keeps the bound
            // in force; none is lifted above the configured one.
            match self.index.set_reported_capacity(endpoint, medium, blocks) {
                Ok(Some(bound)) => tracing::info!(
                    endpoint = ingest.name(),
                    ?medium,
                    reported = blocks,
                    bound,
                    "inventory bounded by the engine's reported KV capacity"
                ),
                Ok(None) => {}
                Err(err) => tracing::warn!(%err, "capacity of an endpoint outside the index"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::VLLM;
    use crate::transport::sink::{Frame, FrameSink, SinkAction};
    use crate::transport::DecodingSink;
    use kvroute_core::{BlockKey, EndpointId, Medium};
    use kvroute_ingest::{Completeness, IndexConfig, IngestConfig, Keying};

    fn payload(name: &str) -> Vec<u8> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/vllm-events/v0.33.0/stream");
        std::fs::read(dir.join(name)).unwrap()
    }

    fn frame<'a>(seq: u64, payload: &'a [u8], source: FrameSource) -> Frame<'a> {
        Frame {
            topic: b"kv@vllm",
            seq,
            payload,
            source,
        }
    }

    #[test]
    fn golden_vllm_stream_lands_in_the_shared_index() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        let mut sink = DecodingSink::for_engine(
            &VLLM,
            IndexIngest::new(ingest, index.clone(), Some(0), true),
        )
        .unwrap();
        assert_eq!(sink.on_connected(), SinkAction::Replay { from_seq: 0 });
        let _ = sink.on_replay_done(&ReplayOutcome {
            completed: true,
            ..ReplayOutcome::default()
        });
        let first = payload("01_store_prompt_two_blocks.msgpack");
        let report = sink.on_frame(frame(0, &first, FrameSource::Live));
        assert_eq!(report.events_applied, 1);
        // Keys from golden/vllm-events/v0.33.0/zmq_capture.json, seq 0.
        for key in [2491132359561299653u64, 2054623090183999839] {
            assert!(index.contains(EndpointId(0), BlockKey(key), Medium::Gpu));
        }
        assert_eq!(
            sink.ingest().endpoint_ingest().completeness(),
            Completeness::Complete
        );
        // seq 4 after 0: a gap inside the window keeps the inventory.
        let reset = payload("04_reset_prefix_cache.msgpack");
        let report = sink.on_frame(frame(4, &reset, FrameSource::Live));
        assert!(report.gap);
        assert!(!index.contains(EndpointId(0), BlockKey(2491132359561299653), Medium::Gpu));
        // Its AllBlocksCleared makes the inventory provably complete again.
        assert_eq!(
            sink.ingest().endpoint_ingest().completeness(),
            Completeness::Complete
        );
    }

    /// Without a replay socket a reconnect must not resume (the
    /// gateway's old sink did: its window waited for a replay that never came
    /// and took the next live batch for a restart, clearing the inventory).
    #[test]
    fn a_reconnect_without_replay_socket_keeps_the_inventory() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        let mut sink = DecodingSink::for_engine(
            &VLLM,
            IndexIngest::new(ingest, index.clone(), Some(0), false),
        )
        .unwrap();
        assert_eq!(sink.on_connected(), SinkAction::Continue);
        let first = payload("01_store_prompt_two_blocks.msgpack");
        let _ = sink.on_frame(frame(0, &first, FrameSource::Live));
        sink.on_disconnected();
        assert_eq!(sink.on_connected(), SinkAction::Continue);
        let second = payload("02_store_third_block_after_decode.msgpack");
        let report = sink.on_frame(frame(1, &second, FrameSource::Live));
        assert!(!report.cleared && !report.restart, "{report:?}");
        assert!(index.contains(EndpointId(0), BlockKey(2491132359561299653), Medium::Gpu));
        let ingest = sink.ingest().endpoint_ingest();
        assert_eq!(ingest.counters().clears, 0);
        assert_eq!(ingest.seq_counters().near_reconnects, 1);
    }

    /// A bootstrap replay that fails or times out is a
    /// detected gap: counted, and the first live batch's number tells how many
    /// batches the inventory lacks.
    #[test]
    fn a_failed_bootstrap_replay_leaves_the_endpoint_partial() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        let mut sink = DecodingSink::for_engine(
            &VLLM,
            IndexIngest::new(ingest, index.clone(), Some(0), true),
        )
        .unwrap();
        assert_eq!(sink.on_connected(), SinkAction::Replay { from_seq: 0 });
        let end = sink.on_replay_done(&ReplayOutcome {
            requested_from: 0,
            completed: false,
            ..ReplayOutcome::default()
        });
        assert!(!end.cleared);
        let first = payload("01_store_prompt_two_blocks.msgpack");
        let _ = sink.on_frame(frame(41, &first, FrameSource::Live));
        let ingest = sink.ingest().endpoint_ingest();
        assert_eq!(ingest.counters().replays_incomplete, 1);
        assert_eq!(
            ingest.completeness(),
            Completeness::Partial {
                missing_batches: 41
            }
        );
        assert_eq!(ingest.counters().partial_episodes, 1);
    }

    /// Two DP ranks of one endpoint share its ingest: each is judged in its own
    /// window (by the subscriber's rank, not the payload's), both fill the one
    /// inventory, and a bootstrap replay that starts late makes the endpoint
    /// partial with the missing batches counted.
    #[test]
    fn dp_ranks_share_one_endpoint_ingest_and_late_replays_are_partial() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let shared = IndexIngest::share(
            EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine)
                .with_name("http://127.0.0.1:9/"),
        );
        let mut sinks: Vec<_> = [0, 1]
            .map(|rank| {
                DecodingSink::for_engine(
                    &VLLM,
                    IndexIngest::shared(Arc::clone(&shared), index.clone(), Some(rank), true),
                )
                .unwrap()
            })
            .into();
        let first = payload("01_store_prompt_two_blocks.msgpack");
        let second = payload("02_store_third_block_after_decode.msgpack");
        // Rank 0: complete bootstrap from 0. Rank 1: the engine's buffer starts at 326.
        for (rank, seq, body) in [(0usize, 0u64, &first), (1, 326, &second)] {
            let sink = &mut sinks[rank];
            assert_eq!(sink.on_connected(), SinkAction::Replay { from_seq: 0 });
            let r = sink.on_frame(frame(seq, body, FrameSource::Replay));
            assert_eq!(r.events_applied, 1);
            let _ = sink.on_replay_done(&ReplayOutcome {
                requested_from: 0,
                batches: 1,
                first_seq: Some(seq),
                last_seq: Some(seq),
                completed: true,
                restart_from: None,
            });
        }
        let ingest = shared.lock();
        assert_eq!(ingest.seq_counters().first, 2, "one window per rank");
        assert_eq!(
            ingest.completeness(),
            Completeness::Partial {
                missing_batches: 326
            }
        );
        assert_eq!(ingest.counters().replays_late, 1);
        assert_eq!(ingest.counters().partial_episodes, 1);
        assert_eq!(index.inventory(EndpointId(0)).total(), 3);
    }
}
