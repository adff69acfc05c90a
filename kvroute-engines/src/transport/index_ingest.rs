//! Glue to the ingest crate: [`IndexIngest`] drives one endpoint's
//! [`EndpointIngest`] (sequence windows, key mode) writing the [`SharedIndex`] that
//! scoring reads. It is the [`SeqIngest`] of a [`super::DecodingSink`] (vLLM /
//! SGLang over ZeroMQ) and the [`BatchApplier`] of a [`super::TrtllmSink`].
//!
//! For TensorRT-LLM build the [`EndpointIngest`] with `RestartPolicy::Clear` (there
//! is no replay socket) and `KeyMode::Rekey` (its keys depend on salts and LoRA
//! ids the events do not carry).

use std::sync::Arc;

use kvroute_ingest::seq::{ClearReason, SeqAction};
use kvroute_ingest::{EndpointIngest, EventBatch, SharedIndex};

use super::decoding_sink::{IngestOutcome, SeqIngest};
use super::sink::{FrameReport, FrameSource, ReplayOutcome};
use super::trtllm_sink::BatchApplier;

/// One endpoint's ingest state plus the shared index it writes.
///
/// ```
/// use std::sync::Arc;
/// use kvroute_core::EndpointId;
/// use kvroute_engines::transport::{DecodingSink, EngineKind, IndexIngest};
/// use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, KeyMode, SharedIndex};
///
/// let index = Arc::new(SharedIndex::new(4, IndexConfig::default()));
/// let ingest = EndpointIngest::new(EndpointId(2), IngestConfig::default(), KeyMode::Engine);
/// // DP rank 0 as vLLM puts it in the payload; replay bootstrap on connect.
/// let sink = DecodingSink::new(EngineKind::Vllm, IndexIngest::new(ingest, index, Some(0), true));
/// assert!(sink.is_ok());
/// ```
#[derive(Debug)]
pub struct IndexIngest {
    ingest: EndpointIngest,
    index: Arc<SharedIndex>,
    dp_rank: Option<u32>,
    bootstrap: bool,
    connected_before: bool,
}

impl IndexIngest {
    /// `dp_rank` is the rank the engine writes into its payloads (`Some(r)` for
    /// vLLM ≥ 0.9.2 and SGLang ≥ 0.5.17); `bootstrap` asks for a replay on every
    /// (re)connect (needs the subscriber's replay endpoint).
    #[must_use]
    pub fn new(
        ingest: EndpointIngest,
        index: Arc<SharedIndex>,
        dp_rank: Option<u32>,
        bootstrap: bool,
    ) -> Self {
        Self {
            ingest,
            index,
            dp_rank,
            bootstrap,
            connected_before: false,
        }
    }

    /// The ingest state (counters, windows).
    #[must_use]
    pub fn endpoint_ingest(&self) -> &EndpointIngest {
        &self.ingest
    }

    /// The shared index.
    #[must_use]
    pub fn index(&self) -> &Arc<SharedIndex> {
        &self.index
    }
}

impl SeqIngest for IndexIngest {
    fn ingest(&mut self, batch: &EventBatch, _source: FrameSource) -> IngestOutcome {
        let outcome = self.ingest.apply_batch(batch, &self.index);
        let action = outcome.action;
        IngestOutcome {
            applied: outcome.events_applied,
            gap: matches!(
                action,
                SeqAction::ApplyAfterGap { .. }
                    | SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { .. })
            ),
            cleared: action.clears(),
            restart: matches!(
                action,
                SeqAction::ClearThenApply(ClearReason::Restart) | SeqAction::ClearThenReplay { .. }
            ),
            ignored: matches!(action, SeqAction::Drop(_)),
            replay_from: outcome.replay_from(),
        }
    }

    fn connected(&mut self) -> Option<u64> {
        let reconnect = std::mem::replace(&mut self.connected_before, true);
        if !self.bootstrap {
            if reconnect {
                self.ingest.on_reconnect(self.dp_rank);
            }
            return None;
        }
        // With a replay socket a reconnect resumes from our last batch, whose
        // digest tells a live engine from one that restarted and published past
        // our last sequence while we were away.
        if reconnect {
            if let Some(last) = self.ingest.on_resume(self.dp_rank) {
                return Some(last);
            }
        }
        self.ingest.on_bootstrap(self.dp_rank)
    }

    fn replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        let end = self
            .ingest
            .on_replay_finished(self.dp_rank, outcome.completed, &self.index);
        if end.clears() {
            tracing::info!(
                endpoint = self.ingest.endpoint().0,
                from = outcome.requested_from,
                "engine replay ends before our last sequence: restart; inventory cleared"
            );
        }
        FrameReport::from(end)
    }
}

impl BatchApplier for IndexIngest {
    fn apply(&mut self, batch: &EventBatch) -> u32 {
        self.ingest.apply_batch(batch, &self.index).events_applied
    }

    fn clear(&mut self) {
        let _ = self.ingest.clear(&self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::sink::{Frame, FrameSink, SinkAction};
    use crate::transport::{DecodingSink, EngineKind};
    use kvroute_core::{BlockKey, EndpointId, Medium};
    use kvroute_ingest::{IndexConfig, IngestConfig, KeyMode};

    fn payload(name: &str) -> Vec<u8> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden/vllm-events/v0.33.0/stream");
        std::fs::read(dir.join(name)).unwrap()
    }

    #[test]
    fn golden_vllm_stream_lands_in_the_shared_index() {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), KeyMode::Engine);
        let mut sink = DecodingSink::new(
            EngineKind::Vllm,
            IndexIngest::new(ingest, index.clone(), Some(0), true),
        )
        .unwrap();
        assert_eq!(sink.on_connected(), SinkAction::Replay { from_seq: 0 });
        sink.on_replay_done(&ReplayOutcome::default());
        let first = payload("01_store_prompt_two_blocks.msgpack");
        let report = sink.on_frame(Frame {
            topic: b"kv@vllm",
            seq: 0,
            payload: &first,
            source: FrameSource::Live,
        });
        assert_eq!(report.events_applied, 1);
        // Keys from golden/vllm-events/v0.33.0/zmq_capture.json, seq 0.
        for key in [2491132359561299653u64, 2054623090183999839] {
            assert!(index.contains(EndpointId(0), BlockKey(key), Medium::Gpu));
        }
        // seq 4 after 0: a gap inside the window keeps the inventory.
        let reset = payload("04_reset_prefix_cache.msgpack");
        let report = sink.on_frame(Frame {
            topic: b"kv@vllm",
            seq: 4,
            payload: &reset,
            source: FrameSource::Live,
        });
        assert!(report.gap);
        assert!(!index.contains(EndpointId(0), BlockKey(2491132359561299653), Medium::Gpu));
    }
}
