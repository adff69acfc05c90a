//! The concrete ZeroMQ sink: decode each payload with the engine's
//! [`FrameDecoder`] and hand the batch, with its transport seq, to the
//! endpoint's sequence-window state ([`SeqIngest`], implemented by the ingest
//! layer). Sans-IO.

use kvroute_ingest::EventBatch;

use super::sink::{Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction};
use super::TransportError;
use crate::engine::{Engine, FrameDecoder};
use crate::events::DecodeStats;

/// What the sequence-window state machine did with one batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Events applied to the inventory.
    pub applied: u32,
    /// A seq gap was seen (inside or beyond the window).
    pub gap: bool,
    /// The inventory was cleared.
    pub cleared: bool,
    /// The seq went backwards: engine restart.
    pub restart: bool,
    /// Duplicate / stale batch, ignored.
    pub ignored: bool,
    /// Ignored because its sequence number is implausible (beyond the window's
    /// `max_seq`, or an unconfirmed far jump); also `ignored`.
    pub rejected: bool,
    /// Ask the engine's replay socket for everything from this seq.
    pub replay_from: Option<u64>,
}

/// One endpoint's sequence-window state + inventory, as the ZeroMQ sink drives it.
pub trait SeqIngest: Send {
    /// A decoded batch (`batch.seq` is the transport seq) from the live stream or a
    /// replay.
    fn ingest(&mut self, batch: &EventBatch, source: FrameSource) -> IngestOutcome;
    /// The subscriber (re)connected; return a seq to bootstrap from by replay.
    fn connected(&mut self) -> Option<u64>;
    /// The subscriber lost its peer.
    fn disconnected(&mut self) {}
    /// A replay asked for by [`SeqIngest::connected`] or an outcome's `replay_from`
    /// ended (also when it could not be sent: no replay endpoint, error, timeout).
    /// What its end proved (see [`FrameSink::on_replay_done`]).
    fn replay_done(&mut self, _outcome: &ReplayOutcome) -> FrameReport {
        FrameReport::default()
    }
}

/// [`FrameSink`] that decodes an engine's ZeroMQ payloads (vLLM, SGLang, or
/// any [`Engine`] with a [`FrameDecoder`]) into a [`SeqIngest`].
#[derive(Debug)]
pub struct DecodingSink<I> {
    decoder: Box<dyn FrameDecoder>,
    batch: EventBatch,
    stats: DecodeStats,
    ingest: I,
}

impl<I: SeqIngest> DecodingSink<I> {
    /// A sink for `engine`'s ZeroMQ payloads, decoded by its
    /// [`Engine::frame_decoder`].
    ///
    /// # Errors
    /// The engine's [`Engine::kv_events`] error, or
    /// [`TransportError::Unsupported`] when it publishes no ZeroMQ payloads
    /// (no frame decoder: TensorRT-LLM drains over HTTP).
    pub fn for_engine(engine: &dyn Engine, ingest: I) -> Result<Self, TransportError> {
        engine.kv_events()?;
        let decoder = engine
            .frame_decoder()
            .ok_or_else(|| TransportError::Unsupported {
                engine: engine.name().to_owned(),
                feature: "ZeroMQ KV events",
                reason: "this engine does not publish its KV events over ZeroMQ",
                suggestion: "follow it with its own transport (engine::Engine::followers)",
            })?;
        Ok(Self::with_decoder(decoder, ingest))
    }

    /// A sink decoding every payload with `decoder`.
    #[must_use]
    pub fn with_decoder(decoder: Box<dyn FrameDecoder>, ingest: I) -> Self {
        Self {
            decoder,
            batch: EventBatch::default(),
            stats: DecodeStats::default(),
            ingest,
        }
    }

    /// The ingest state.
    pub fn ingest(&self) -> &I {
        &self.ingest
    }
}

impl<I: SeqIngest> FrameSink for DecodingSink<I> {
    fn decode_stats(&self) -> Option<&DecodeStats> {
        Some(&self.stats)
    }

    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let decoded =
            self.decoder
                .decode_into(frame.payload, frame.seq, &mut self.batch, &mut self.stats);
        if let Err(e) = decoded {
            // The transport logs the drop with its endpoint; the reason is here.
            tracing::debug!(seq = frame.seq, error = %e, "undecodable KV event payload");
            return FrameReport {
                decode_error: true,
                ..FrameReport::default()
            };
        }
        let outcome = self.ingest.ingest(&self.batch, frame.source);
        FrameReport {
            action: outcome
                .replay_from
                .map_or(SinkAction::Continue, |from_seq| SinkAction::Replay {
                    from_seq,
                }),
            events_applied: outcome.applied,
            decode_error: false,
            gap: outcome.gap,
            cleared: outcome.cleared,
            restart: outcome.restart,
            ignored: outcome.ignored,
            rejected: outcome.rejected,
            engine_timestamp: Some(self.batch.timestamp),
        }
    }

    fn on_connected(&mut self) -> SinkAction {
        self.ingest
            .connected()
            .map_or(SinkAction::Continue, |from_seq| SinkAction::Replay {
                from_seq,
            })
    }

    fn on_disconnected(&mut self) {
        self.ingest.disconnected();
    }

    fn on_replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        self.ingest.replay_done(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{LLAMA_CPP, SGLANG, TRTLLM, VLLM};

    #[derive(Debug, Default)]
    struct Seqs(Vec<(u64, usize)>);

    impl SeqIngest for Seqs {
        fn ingest(&mut self, batch: &EventBatch, _source: FrameSource) -> IngestOutcome {
            self.0.push((batch.seq, batch.events.len()));
            IngestOutcome {
                applied: batch.events.len() as u32,
                replay_from: (batch.seq == 4).then_some(0),
                ..IngestOutcome::default()
            }
        }
        fn connected(&mut self) -> Option<u64> {
            Some(7)
        }
    }

    fn golden(rel: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../golden")
            .join(rel);
        std::fs::read(path).unwrap()
    }

    #[test]
    fn decodes_golden_payloads_and_maps_outcomes() {
        let mut sink = DecodingSink::for_engine(&VLLM, Seqs::default()).unwrap();
        assert_eq!(sink.on_connected(), SinkAction::Replay { from_seq: 7 });
        let payload = golden("vllm-events/v0.33.0/stream/03_evict_then_store.msgpack");
        let frame = |seq, payload| Frame {
            topic: b"",
            seq,
            payload,
            source: FrameSource::Live,
        };
        let report = sink.on_frame(frame(4, &payload));
        assert_eq!(report.events_applied, 4);
        assert_eq!(report.action, SinkAction::Replay { from_seq: 0 });
        assert_eq!(report.engine_timestamp, Some(1_767_225_601.0));
        let bad = sink.on_frame(frame(5, &payload[..10]));
        assert!(bad.decode_error);
        assert_eq!(sink.ingest().0, vec![(4, 4)]);
        assert_eq!(sink.decode_stats().map(|s| s.malformed_payloads), Some(1));
    }

    #[test]
    fn only_zeromq_engines_are_accepted() {
        assert!(DecodingSink::for_engine(&SGLANG, Seqs::default()).is_ok());
        for engine in [&TRTLLM as &dyn Engine, &LLAMA_CPP] {
            let err = DecodingSink::for_engine(engine, Seqs::default()).unwrap_err();
            assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
        }
    }
}
