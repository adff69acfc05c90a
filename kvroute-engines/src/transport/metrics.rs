//! Per-subscriber health counters, shared between the transport task (writer)
//! and whoever exports them (admin API, Prometheus): atomics, and the
//! decoder's counters under a lock taken once per payload.
// The writers live in the feature-gated transports.
#![cfg_attr(not(all(feature = "zmq", feature = "trtllm-http")), allow(dead_code))]

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::sink::{DrainReport, FrameReport, FrameSource};
#[cfg(doc)]
use super::sink::{DrainSink, FrameSink};
use crate::events::DecodeStats;

const NO_SEQ: u64 = u64::MAX;

/// Live counters of one subscriber (one endpoint and DP rank) or one drain poller.
///
/// All fields are monotonic counters except `connected`, `last_seq`, `events_per_sec`
/// and the staleness gauges. Read them with [`SubscriberMetrics::snapshot`].
#[derive(Debug)]
pub struct SubscriberMetrics {
    connected: AtomicBool,
    last_seq: AtomicU64,
    frames_live: AtomicU64,
    frames_replayed: AtomicU64,
    events_applied: AtomicU64,
    gaps: AtomicU64,
    clears: AtomicU64,
    restarts: AtomicU64,
    ignored: AtomicU64,
    replays_requested: AtomicU64,
    replays_completed: AtomicU64,
    replay_duplicates_dropped: AtomicU64,
    decode_errors: AtomicU64,
    malformed_frames: AtomicU64,
    oversized_frames: AtomicU64,
    oversized_peers_dropped: AtomicU64,
    implausible_frames: AtomicU64,
    last_rejected_seq: AtomicU64,
    other_topic_frames: AtomicU64,
    dial_failures: AtomicU64,
    connects: AtomicU64,
    disconnects: AtomicU64,
    polls: AtomicU64,
    poll_failures: AtomicU64,
    events_per_sec_bits: AtomicU64,
    last_staleness_us: AtomicI64,
    max_staleness_us: AtomicI64,
    /// The sink's decoder counters, as of its last payload.
    decode: parking_lot::Mutex<DecodeStats>,
}

impl Default for SubscriberMetrics {
    fn default() -> Self {
        Self {
            connected: AtomicBool::new(false),
            last_seq: AtomicU64::new(NO_SEQ),
            frames_live: AtomicU64::new(0),
            frames_replayed: AtomicU64::new(0),
            events_applied: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            clears: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            ignored: AtomicU64::new(0),
            replays_requested: AtomicU64::new(0),
            replays_completed: AtomicU64::new(0),
            replay_duplicates_dropped: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            malformed_frames: AtomicU64::new(0),
            oversized_frames: AtomicU64::new(0),
            oversized_peers_dropped: AtomicU64::new(0),
            implausible_frames: AtomicU64::new(0),
            last_rejected_seq: AtomicU64::new(NO_SEQ),
            other_topic_frames: AtomicU64::new(0),
            dial_failures: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
            polls: AtomicU64::new(0),
            poll_failures: AtomicU64::new(0),
            events_per_sec_bits: AtomicU64::new(0f64.to_bits()),
            last_staleness_us: AtomicI64::new(0),
            max_staleness_us: AtomicI64::new(0),
            decode: parking_lot::Mutex::new(DecodeStats::default()),
        }
    }
}

/// A point-in-time copy of [`SubscriberMetrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// A peer is connected (ZeroMQ) / the last poll succeeded (HTTP).
    pub connected: bool,
    /// Last sequence number (ZeroMQ seq or TensorRT-LLM `event_id`) handed to the sink.
    pub last_seq: Option<u64>,
    /// Frames read from the PUB stream / drains polled with a body.
    pub frames_live: u64,
    /// Frames received through replay.
    pub frames_replayed: u64,
    /// Events the sink applied.
    pub events_applied: u64,
    /// Sequence (or `event_id`) gaps the sink saw.
    pub gaps: u64,
    /// Inventory clears.
    pub clears: u64,
    /// Engine restarts detected (sequence went backwards).
    pub restarts: u64,
    /// Frames the sink ignored (duplicate / stale).
    pub ignored: u64,
    /// Replay requests sent.
    pub replays_requested: u64,
    /// Replays that ended with the end marker.
    pub replays_completed: u64,
    /// Live frames dropped because a replay had already delivered them.
    pub replay_duplicates_dropped: u64,
    /// Payloads the decoder rejected.
    pub decode_errors: u64,
    /// Messages without the `[topic, seq(8), payload]` shape.
    pub malformed_frames: u64,
    /// Messages dropped because they exceed the subscriber's `max_message_bytes`.
    pub oversized_frames: u64,
    /// Peer connections closed because a frame header declared, or a multipart
    /// message grew past, `max_message_bytes` (or the part limit): refused on
    /// the declared length before buffering. Each also counts in
    /// `oversized_frames`.
    pub oversized_peers_dropped: u64,
    /// Frames ignored because their sequence number is implausible for the
    /// stream (beyond the window's `max_seq`, or an unconfirmed far jump); they
    /// never move `last_seq`.
    pub implausible_frames: u64,
    /// Sequence number of the last message dropped as malformed, oversized or
    /// undecodable, when it carried a readable one (the log line names it too).
    pub last_rejected_seq: Option<u64>,
    /// Messages whose topic is not ours (prefix-matched by ZeroMQ, exact-checked here).
    pub other_topic_frames: u64,
    /// Dial / bind attempts that failed.
    pub dial_failures: u64,
    /// Successful connects (incl. reconnects and accepted engine connections).
    pub connects: u64,
    /// Peer disconnects.
    pub disconnects: u64,
    /// HTTP drains attempted (TensorRT-LLM).
    pub polls: u64,
    /// HTTP drains that failed (connect error, timeout, non-2xx).
    pub poll_failures: u64,
    /// Applied events per second over the last completed ~1 s window.
    pub events_per_sec: f64,
    /// Engine timestamp → applied, last batch, microseconds (negative = clock skew).
    pub last_staleness_us: i64,
    /// Largest staleness seen, microseconds.
    pub max_staleness_us: i64,
    /// The decoder's counters ([`FrameSink::decode_stats`],
    /// [`DrainSink::decode_stats`]): events dropped as malformed, of unknown
    /// types, of a smaller attention window, blocks whose tier could not be
    /// tracked.
    pub decode: DecodeStats,
}

impl SubscriberMetrics {
    /// Copies every counter.
    #[must_use]
    pub fn snapshot(&self) -> MetricsSnapshot {
        let last_seq = self.last_seq.load(Relaxed);
        MetricsSnapshot {
            connected: self.connected.load(Relaxed),
            last_seq: (last_seq != NO_SEQ).then_some(last_seq),
            frames_live: self.frames_live.load(Relaxed),
            frames_replayed: self.frames_replayed.load(Relaxed),
            events_applied: self.events_applied.load(Relaxed),
            gaps: self.gaps.load(Relaxed),
            clears: self.clears.load(Relaxed),
            restarts: self.restarts.load(Relaxed),
            ignored: self.ignored.load(Relaxed),
            replays_requested: self.replays_requested.load(Relaxed),
            replays_completed: self.replays_completed.load(Relaxed),
            replay_duplicates_dropped: self.replay_duplicates_dropped.load(Relaxed),
            decode_errors: self.decode_errors.load(Relaxed),
            malformed_frames: self.malformed_frames.load(Relaxed),
            oversized_frames: self.oversized_frames.load(Relaxed),
            oversized_peers_dropped: self.oversized_peers_dropped.load(Relaxed),
            implausible_frames: self.implausible_frames.load(Relaxed),
            last_rejected_seq: {
                let seq = self.last_rejected_seq.load(Relaxed);
                (seq != NO_SEQ).then_some(seq)
            },
            other_topic_frames: self.other_topic_frames.load(Relaxed),
            dial_failures: self.dial_failures.load(Relaxed),
            connects: self.connects.load(Relaxed),
            disconnects: self.disconnects.load(Relaxed),
            polls: self.polls.load(Relaxed),
            poll_failures: self.poll_failures.load(Relaxed),
            events_per_sec: f64::from_bits(self.events_per_sec_bits.load(Relaxed)),
            last_staleness_us: self.last_staleness_us.load(Relaxed),
            max_staleness_us: self.max_staleness_us.load(Relaxed),
            decode: *self.decode.lock(),
        }
    }

    /// Takes the sink's decoder counters after it handled a payload.
    pub(crate) fn decoded(&self, stats: Option<&DecodeStats>) {
        if let Some(stats) = stats {
            *self.decode.lock() = *stats;
        }
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        let was = self.connected.swap(connected, Relaxed);
        if connected {
            self.connects.fetch_add(1, Relaxed);
        } else if was {
            self.disconnects.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn dial_failed(&self) {
        self.dial_failures.fetch_add(1, Relaxed);
    }

    pub(crate) fn malformed(&self, seq: Option<u64>) {
        self.malformed_frames.fetch_add(1, Relaxed);
        self.rejected(seq);
    }

    pub(crate) fn oversized(&self, seq: Option<u64>) {
        self.oversized_frames.fetch_add(1, Relaxed);
        self.rejected(seq);
    }

    pub(crate) fn oversized_peer_dropped(&self) {
        self.oversized_peers_dropped.fetch_add(1, Relaxed);
        self.oversized(None);
    }

    fn rejected(&self, seq: Option<u64>) {
        if let Some(seq) = seq {
            self.last_rejected_seq.store(seq, Relaxed);
        }
    }

    pub(crate) fn other_topic(&self) {
        self.other_topic_frames.fetch_add(1, Relaxed);
    }

    pub(crate) fn replay_requested(&self) {
        self.replays_requested.fetch_add(1, Relaxed);
    }

    pub(crate) fn replay_completed(&self) {
        self.replays_completed.fetch_add(1, Relaxed);
    }

    pub(crate) fn replay_duplicate(&self) {
        self.replay_duplicates_dropped.fetch_add(1, Relaxed);
    }

    pub(crate) fn poll(&self, ok: bool) {
        self.polls.fetch_add(1, Relaxed);
        if !ok {
            self.poll_failures.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn frame(&self, seq: u64, source: FrameSource, report: &FrameReport) {
        if report.rejected {
            self.implausible_frames.fetch_add(1, Relaxed);
            self.rejected(Some(seq));
        } else {
            self.last_seq.store(seq, Relaxed);
        }
        match source {
            FrameSource::Live => self.frames_live.fetch_add(1, Relaxed),
            FrameSource::Replay => self.frames_replayed.fetch_add(1, Relaxed),
        };
        self.count(
            report.events_applied,
            report.decode_error,
            report.gap,
            report.cleared,
        );
        if report.restart {
            self.restarts.fetch_add(1, Relaxed);
        }
        if report.ignored {
            self.ignored.fetch_add(1, Relaxed);
        }
        if report.decode_error {
            self.rejected(Some(seq));
        }
        if let Some(ts) = report.engine_timestamp {
            self.staleness(ts);
        }
    }

    /// What the end of a replay proved (a restart clears the inventory).
    pub(crate) fn replay_end(&self, report: &FrameReport) {
        self.count(report.events_applied, false, report.gap, report.cleared);
        if report.restart {
            self.restarts.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn drain(&self, report: &DrainReport) {
        if let Some(id) = report.last_event_id {
            self.last_seq.store(id, Relaxed);
        }
        self.frames_live.fetch_add(1, Relaxed);
        self.count(
            report.events_applied,
            report.decode_error,
            report.gap,
            report.cleared,
        );
    }

    fn count(&self, applied: u32, decode_error: bool, gap: bool, cleared: bool) {
        self.events_applied.fetch_add(u64::from(applied), Relaxed);
        for (flag, counter) in [
            (decode_error, &self.decode_errors),
            (gap, &self.gaps),
            (cleared, &self.clears),
        ] {
            if flag {
                counter.fetch_add(1, Relaxed);
            }
        }
    }

    fn staleness(&self, engine_ts: f64) {
        if !engine_ts.is_finite() {
            return;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // Saturating float → int cast: absurd timestamps clamp instead of wrapping.
        let us = ((now - engine_ts) * 1e6) as i64;
        self.last_staleness_us.store(us, Relaxed);
        self.max_staleness_us.fetch_max(us, Relaxed);
    }

    fn publish_rate(&self, per_sec: f64) {
        self.events_per_sec_bits.store(per_sec.to_bits(), Relaxed);
    }
}

/// Turns the applied-events counter into an events/s gauge over ~1 s windows.
/// Lives on the transport task (it owns the clock).
#[derive(Debug)]
pub(crate) struct RateMeter {
    window_start: Instant,
    applied_at_start: u64,
}

impl RateMeter {
    pub(crate) const WINDOW: Duration = Duration::from_secs(1);

    pub(crate) fn new(now: Instant) -> Self {
        Self {
            window_start: now,
            applied_at_start: 0,
        }
    }

    /// Publishes the rate when a window has elapsed.
    pub(crate) fn tick(&mut self, metrics: &SubscriberMetrics, now: Instant) {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed < Self::WINDOW {
            return;
        }
        let applied = metrics.events_applied.load(Relaxed);
        let delta = applied.saturating_sub(self.applied_at_start);
        metrics.publish_rate(delta as f64 / elapsed.as_secs_f64());
        self.window_start = now;
        self.applied_at_start = applied;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_reports_feed_counters_and_staleness() {
        let m = SubscriberMetrics::default();
        assert_eq!(m.snapshot().last_seq, None);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let report = FrameReport {
            events_applied: 3,
            gap: true,
            cleared: true,
            engine_timestamp: Some(now - 2.0),
            ..FrameReport::default()
        };
        m.frame(7, FrameSource::Live, &report);
        m.frame(
            8,
            FrameSource::Replay,
            &FrameReport {
                decode_error: true,
                ..FrameReport::default()
            },
        );
        let s = m.snapshot();
        assert_eq!(s.last_seq, Some(8));
        assert_eq!((s.frames_live, s.frames_replayed), (1, 1));
        assert_eq!(
            (s.events_applied, s.gaps, s.clears, s.decode_errors),
            (3, 1, 1, 1)
        );
        assert!(s.last_staleness_us >= 2_000_000, "{}", s.last_staleness_us);
        assert_eq!(s.max_staleness_us, s.last_staleness_us);
    }

    #[test]
    fn connect_disconnect_counts_transitions() {
        let m = SubscriberMetrics::default();
        m.set_connected(false);
        m.set_connected(true);
        m.set_connected(false);
        let s = m.snapshot();
        assert_eq!((s.connected, s.connects, s.disconnects), (false, 1, 1));
    }

    #[test]
    fn rate_meter_publishes_per_window() {
        let m = SubscriberMetrics::default();
        let t0 = Instant::now();
        let mut meter = RateMeter::new(t0);
        m.count(500, false, false, false);
        meter.tick(&m, t0 + Duration::from_millis(500));
        assert_eq!(m.snapshot().events_per_sec, 0.0);
        meter.tick(&m, t0 + Duration::from_secs(2));
        assert_eq!(m.snapshot().events_per_sec, 250.0);
    }
}
