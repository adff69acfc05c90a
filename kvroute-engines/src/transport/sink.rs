//! The seam between transports (bytes, sockets, timers) and the consumers of the
//! bytes (decoder + ingest state machine).
//!
//! Transports call a sink synchronously on their own task and never interpret a
//! payload; the sink reports back what happened so the transport can keep its
//! metrics and run the replays the sink asks for.

/// Where a frame came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameSource {
    /// The PUB stream.
    Live,
    /// An answer of the engine's ROUTER replay socket.
    Replay,
}

/// One ZeroMQ KV-event message: `[topic, seq, payload]`.
#[derive(Clone, Copy, Debug)]
pub struct Frame<'a> {
    /// Topic frame (UTF-8 by convention, empty by default).
    pub topic: &'a [u8],
    /// Publisher sequence number (8-byte big-endian on the wire).
    pub seq: u64,
    /// msgpack `KVEventBatch`.
    pub payload: &'a [u8],
    /// Live or replayed.
    pub source: FrameSource,
}

/// What the sink wants the transport to do next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SinkAction {
    /// Keep reading.
    #[default]
    Continue,
    /// Ask the engine's replay socket for every buffered batch with seq ≥ `from_seq`
    /// (ignored when no replay endpoint is configured or a replay is running).
    Replay {
        /// First sequence number wanted.
        from_seq: u64,
    },
}

/// What a sink did with one frame; the transport turns it into metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FrameReport {
    /// Next step.
    pub action: SinkAction,
    /// Events applied to the inventory.
    pub events_applied: u32,
    /// The payload did not decode (the batch was dropped).
    pub decode_error: bool,
    /// A sequence gap was seen before this frame.
    pub gap: bool,
    /// The inventory was cleared (gap beyond the window, restart, `AllBlocksCleared`).
    pub cleared: bool,
    /// The engine restarted (sequence went backwards).
    pub restart: bool,
    /// The frame was a duplicate or stale and was ignored.
    pub ignored: bool,
    /// The frame was ignored because its sequence number is implausible for the
    /// stream (u64 extremes, an unconfirmed far jump): a replay must not take it
    /// as the last batch it delivered.
    pub rejected: bool,
    /// Engine timestamp of the batch, seconds since the Unix epoch.
    pub engine_timestamp: Option<f64>,
}

impl From<kvroute_ingest::ReplayEnd> for FrameReport {
    /// The report of a replay's end as the ingest window judged it: a restart
    /// clears, and may ask for a replay from 0.
    fn from(end: kvroute_ingest::ReplayEnd) -> Self {
        use kvroute_ingest::ReplayEnd;
        let restart = end.clears();
        FrameReport {
            cleared: restart,
            restart,
            action: match end {
                ReplayEnd::ClearThenReplay { from } => SinkAction::Replay { from_seq: from },
                ReplayEnd::Continue | ReplayEnd::Clear(_) => SinkAction::Continue,
            },
            ..FrameReport::default()
        }
    }
}

/// Consumer of ZeroMQ KV-event frames for one endpoint (one subscriber).
///
/// ```
/// use kvroute_engines::transport::{Frame, FrameReport, FrameSink, SinkAction};
///
/// /// Counts frames and asks for a replay from 0 on (re)connect.
/// struct Counting(u64);
/// impl FrameSink for Counting {
///     fn on_frame(&mut self, _frame: Frame<'_>) -> FrameReport {
///         self.0 += 1;
///         FrameReport::default()
///     }
///     fn on_connected(&mut self) -> SinkAction {
///         SinkAction::Replay { from_seq: 0 }
///     }
/// }
/// ```
pub trait FrameSink: Send {
    /// One message from the PUB stream or from a replay, in arrival order.
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport;

    /// The socket has a peer (after the first dial, a reconnect, or an engine
    /// connecting to our bound socket). Return a replay request to bootstrap.
    fn on_connected(&mut self) -> SinkAction {
        SinkAction::Continue
    }

    /// The peer went away (engine stopped or restarted, network failure).
    fn on_disconnected(&mut self) {}

    /// The decoder's counters, which the transport copies into its metrics
    /// after every payload (`None`: the sink keeps none).
    fn decode_stats(&self) -> Option<&crate::events::DecodeStats> {
        None
    }

    /// A replay finished (end marker, timeout, error, or no replay endpoint).
    /// The report says what its end proved: `cleared`/`restart` when the
    /// engine's buffer showed a restart (e.g. it ends before the last batch we
    /// applied), and `action` may ask for one more replay.
    fn on_replay_done(&mut self, _outcome: &ReplayOutcome) -> FrameReport {
        FrameReport::default()
    }
}

/// How a replay request ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayOutcome {
    /// The sequence number asked for.
    pub requested_from: u64,
    /// Batches received before the end marker.
    pub batches: u64,
    /// First replayed sequence number. Greater than `requested_from` when the
    /// engine's buffer (`buffer_steps`) no longer held the start: the sink sees that
    /// as a gap.
    pub first_seq: Option<u64>,
    /// Last replayed sequence number.
    pub last_seq: Option<u64>,
    /// The end marker arrived (otherwise: timeout, socket error or bad reply).
    pub completed: bool,
    /// The sink asked for another replay, from this number, while replaying
    /// (a restart found in the replay): the rest of this replay was not
    /// read, and the subscriber requests that one next.
    pub restart_from: Option<u64>,
}

/// What a sink did with one TensorRT-LLM drain.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DrainReport {
    /// Events in the drain.
    pub events: u32,
    /// Events applied to the inventory.
    pub events_applied: u32,
    /// The body did not decode (the whole drain was dropped).
    pub decode_error: bool,
    /// An `event_id` gap was seen (events were lost: drained by someone else or
    /// overflowed the engine's buffer).
    pub gap: bool,
    /// The inventory was cleared.
    pub cleared: bool,
    /// Last `event_id` of the drain.
    pub last_event_id: Option<u64>,
}

/// Consumer of TensorRT-LLM `/kv_cache_events` drains for one endpoint.
pub trait DrainSink: Send {
    /// One successful (2xx) response body: a JSON array of events, `[]` when idle.
    fn on_drain(&mut self, body: &[u8]) -> DrainReport;

    /// The engine stopped answering (connect error, timeout, non-2xx) after having
    /// answered; events may be lost while it is unreachable.
    fn on_unreachable(&mut self) {}

    /// The decoder's counters, which the poller copies into its metrics
    /// after every drain (`None`: the sink keeps none).
    fn decode_stats(&self) -> Option<&crate::events::DecodeStats> {
        None
    }

    /// A drain was answered but its body was dropped unread (larger than
    /// [`TrtllmPollerConfig::max_body_bytes`](super::TrtllmPollerConfig::max_body_bytes)):
    /// the engine has already handed those events out, so they are lost.
    /// The report says what the sink did about it.
    fn on_lost_drain(&mut self) -> DrainReport {
        DrainReport {
            decode_error: true,
            ..DrainReport::default()
        }
    }
}
