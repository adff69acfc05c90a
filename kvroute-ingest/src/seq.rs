/// What to do after an engine restart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RestartPolicy {
    /// Clear the endpoint and apply the batch.
    #[default]
    Clear,
    /// Clear the endpoint and ask for a replay from sequence 0.
    Replay,
}

/// Configuration of one stream's window.
///
/// Sans-IO: the transport adapter feeds it sequence numbers and connection
/// events, and it answers with the [`SeqAction`] to take. It never touches an
/// inventory itself.
///
/// # Rules
///
/// With `last` the highest sequence number accepted so far and `W` the window
/// (64 by default):
///
/// | input | condition | action |
/// |---|---|---|
/// | batch `s` | first batch of the stream | apply |
/// | batch `s` | `s == last + 1` | apply |
/// | batch `s` | `last + 1 < s ≤ last + 1 + W` (gap of at most `W`) | apply, keep inventory (counted) |
/// | batch `s` | `s > last + 1 + W` | clear the endpoint, then apply |
/// | batch `s` | `s == last` | drop (duplicate) |
/// | batch `s` | `last - W ≤ s < last`, and not (`s == 0` outside a replay) | drop (old) |
/// | batch `s` | `s < last - W`, or `s == 0 < last` outside a replay | engine restart |
/// | batch `s` | first batch after [`SeqWindow::on_reconnect`] with `s ≤ last` | engine restart |
///
/// **Restart vs. old duplicate.** Publishers number batches from 0 per process,
/// and ZeroMQ PUB/SUB never redelivers, so outside a replay the only way to see
/// an old number is a new publisher process. A number far below `last` (more
/// than `W` back), a return to exactly 0, or any number `≤ last` right after the
/// transport reported a reconnect is therefore a restart. Within `W` below `last`
/// and not 0 it is treated as a stray duplicate (a replay overlapping live
/// traffic), because clearing a healthy inventory costs more than a few
/// missed events. While a replay is in flight ([`SeqWindow::on_bootstrap`] until
/// [`SeqWindow::on_replay_done`]) every number `≤ last` is a duplicate.
///
/// On restart, [`RestartPolicy::Clear`] clears and applies the batch (its
/// events belong to the new process); [`RestartPolicy::Replay`] clears, does not
/// apply it, and asks for a replay from 0 so the new process's buffer is read
/// in order.
///
/// **Reconnects.** After `on_reconnect`, a next batch within the window keeps the
/// inventory (a near reconnect), one beyond it clears, one at or below `last`
/// is a restart.
///
/// **Verified resumes.** Sequence numbers cannot show a restart that happened
/// while we were disconnected once the new process has published past `last`:
/// its next batch looks like a small forward gap. A transport with a replay
/// service (vLLM's and SGLang's ZeroMQ ROUTER socket) reports the reconnect with
/// [`SeqWindow::on_resume`] instead, requests a replay from the number it
/// returns (`last` itself, not `last + 1`), and passes each batch's content
/// digest ([`SeqWindow::on_batch_with_digest`]). Then:
///
/// | first input after `on_resume` | meaning | action |
/// |---|---|---|
/// | batch `last` with the digest we applied | same publisher | drop (duplicate); resume verified |
/// | batch `last` with another digest (or none) | a different process numbered a different batch `last` | restart |
/// | batch `s < last` | a new process | restart |
/// | batch `s > last` | the publisher no longer holds `last`: restarted, or overwrote its buffer; unverifiable | restart |
/// | replay ended complete, no batch ([`SeqWindow::on_replay_finished`]) | the publisher's newest batch is older than `last` | restart |
/// | replay failed or timed out | no evidence yet | wait: the next batch decides |
///
/// Why these signals and not others: a publisher process never numbers two
/// different batches alike and its replay buffer serves the exact batches it
/// published, so a digest mismatch at `last` proves a new process, and the
/// buffer always holds its newest batches, so a complete replay from `last`
/// that is empty proves its numbering is below `last`. A forward batch in place
/// of `last` proves nothing either way, so the inventory is cleared rather than
/// trusted (a cold endpoint costs a few cache misses; a stale one misroutes
/// until its keys age out). Weaker evidence was rejected: a `BlockStored` whose
/// parent we do not hold also follows any kept gap or capacity eviction, and
/// the engine's timestamps move forward across a restart just as within one
/// process (and wall clocks can step back), so neither distinguishes a restart.
/// The adapter must deliver the replayed batches before buffered live ones.
///
/// **Implausible numbers.** A publisher numbers its batches from 0, one per
/// engine step, so a number above [`SeqWindowConfig::max_seq`] (2^48 by default:
/// ~9 years at a million batches a second) cannot come from a real engine, and a
/// jump of more than [`SeqWindowConfig::max_jump`] batches past `last` is
/// implausible on a stream we stayed subscribed to. Accepting such a number as the
/// new `last` would make every later real batch look old or duplicate and discard
/// the live stream, so:
///
/// | batch `s` | action |
/// |---|---|
/// | `s > max_seq` | drop ([`DropReason::Implausible`]), `last` unchanged |
/// | `s > last + 1 + max_jump`, and the previous batch was not `s - 1` | drop ([`DropReason::Implausible`]), remember `s` |
/// | `s > last + 1 + max_jump`, right after an implausible `s - 1` | a real jump (e.g. a long silent cut): judged as usual (a gap beyond the window clears) |
///
/// A real stream that jumped is followed from its second batch on; one forged or
/// corrupted number never moves `last`. The rule applies to replayed and live
/// batches alike and is checked before the resume verification, which then
/// judges the next plausible batch.
///
/// **Completeness.** Besides the action, each window tracks how many of the
/// current publisher process's batches it knows the inventory lacks
/// ([`SeqWindow::missing_batches`]): a first batch at `s` (a subscriber started
/// over a warm engine, or a bootstrap replay whose answer starts at `s` because
/// the engine's buffer no longer reaches back, or failed) misses `s`; a gap kept
/// inside the window adds its missed batches; a clear (gap beyond the window or a
/// restart at `s`) leaves only what batch `s` and later carry, so `s` are missing.
/// The count returns to 0 only when the inventory provably equals the engine's
/// again: a batch carrying `AllBlocksCleared` ([`SeqWindow::mark_complete`], called
/// by [`crate::EndpointIngest`]), or a new process seen from its batch 0.
///
/// ```
/// use kvroute_ingest::{ClearReason, SeqAction, SeqWindow, SeqWindowConfig};
///
/// let mut w = SeqWindow::new(SeqWindowConfig::default());
/// assert_eq!(w.on_batch(0), SeqAction::Apply);
/// assert_eq!(w.on_batch(1), SeqAction::Apply);
/// assert_eq!(w.on_batch(5), SeqAction::ApplyAfterGap { missed: 3 });
/// assert!(matches!(w.on_batch(5), SeqAction::Drop(_)));
/// assert_eq!(w.on_batch(500), SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { missed: 494 }));
/// assert_eq!(w.on_batch(0), SeqAction::ClearThenApply(ClearReason::Restart));
/// assert_eq!(w.counters().restarts, 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqWindowConfig {
    /// Largest gap (missed batches) that keeps the inventory.
    pub window: u64,
    /// What a detected engine restart does.
    pub on_restart: RestartPolicy,
    /// Highest sequence number accepted at all (see "Implausible numbers" in the
    /// [`SeqWindow`] docs).
    pub max_seq: u64,
    /// Largest forward jump past the last accepted batch taken from a single
    /// batch; a longer one needs its successor to confirm it.
    pub max_jump: u64,
}

/// Default [`SeqWindowConfig::max_seq`]: 2^48.
pub const DEFAULT_MAX_SEQ: u64 = 1 << 48;
/// Default [`SeqWindowConfig::max_jump`]: 2^20 batches (hours of engine steps).
pub const DEFAULT_MAX_JUMP: u64 = 1 << 20;

impl Default for SeqWindowConfig {
    fn default() -> Self {
        Self {
            window: 64,
            on_restart: RestartPolicy::Clear,
            max_seq: DEFAULT_MAX_SEQ,
            max_jump: DEFAULT_MAX_JUMP,
        }
    }
}

impl SeqWindowConfig {
    /// The policy a destructive drain (TensorRT-LLM `/kv_cache_events`) needs:
    /// its `event_id`s count every event, so any gap means events were lost
    /// (another consumer, a buffer overflow, a timed-out drain) and clears;
    /// there is no replay, so a restart clears and applies.
    #[must_use]
    pub fn destructive_drain() -> Self {
        Self {
            window: 0,
            on_restart: RestartPolicy::Clear,
            ..Self::default()
        }
    }
}

/// Why a batch is dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Same number as the last accepted batch.
    Duplicate,
    /// Below the last accepted batch (within the window, or during a replay).
    Old,
    /// The batch's DP rank would exceed the endpoint's stream limit (produced by
    /// [`crate::EndpointIngest`], never by the window itself).
    StreamLimit,
    /// The number is above [`SeqWindowConfig::max_seq`], or jumps further than
    /// [`SeqWindowConfig::max_jump`] without confirmation.
    Implausible,
    /// The endpoint left its slot ([`crate::EndpointIngest::retire`]; produced
    /// by the ingest, never by the window itself).
    Retired,
}

/// Why the endpoint must be cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearReason {
    /// More batches were missed than the window allows.
    GapBeyondWindow {
        /// Batches missed.
        missed: u64,
    },
    /// The publisher started over (new engine process).
    Restart,
}

/// The action the adapter must take for one input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum SeqAction {
    /// Apply the batch.
    Apply,
    /// Apply the batch; some were missed but the inventory is kept.
    ApplyAfterGap {
        /// Batches missed.
        missed: u64,
    },
    /// Ignore the batch.
    Drop(DropReason),
    /// Clear the endpoint's inventory, then apply the batch.
    ClearThenApply(ClearReason),
    /// Clear the endpoint's inventory, do not apply the batch, and request a
    /// replay starting at `from`.
    ClearThenReplay {
        /// First sequence number to replay.
        from: u64,
    },
}

impl SeqAction {
    /// True when the batch's events must be applied.
    #[must_use]
    pub fn applies(self) -> bool {
        matches!(
            self,
            SeqAction::Apply | SeqAction::ApplyAfterGap { .. } | SeqAction::ClearThenApply(_)
        )
    }

    /// True when the endpoint must be cleared first.
    #[must_use]
    pub fn clears(self) -> bool {
        matches!(
            self,
            SeqAction::ClearThenApply(_) | SeqAction::ClearThenReplay { .. }
        )
    }
}

/// Every transition of a window, counted (plain integers; sum them across streams
/// with `+=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqCounters {
    /// First batch of a stream accepted.
    pub first: u64,
    /// Batches accepted in order.
    pub in_order: u64,
    /// Batches accepted after a gap within the window.
    pub gaps_kept: u64,
    /// Batches missed in those gaps.
    pub missed_in_kept_gaps: u64,
    /// Gaps beyond the window (inventory cleared).
    pub gaps_cleared: u64,
    /// Duplicate batches dropped.
    pub duplicates: u64,
    /// Old batches dropped.
    pub old: u64,
    /// Engine restarts detected.
    pub restarts: u64,
    /// Reconnects reported by the transport.
    pub reconnects: u64,
    /// Reconnects whose next batch kept the inventory.
    pub near_reconnects: u64,
    /// Replays requested (bootstrap or restart).
    pub replays_requested: u64,
    /// Replays reported finished.
    pub replays_done: u64,
    /// Resumes reported with [`SeqWindow::on_resume`] (something to verify).
    pub resumes: u64,
    /// Resumes whose replayed batch `last` matched the one applied.
    pub resumes_verified: u64,
    /// Restarts found by a resume check (digest mismatch, a batch other than
    /// `last`, or an empty complete replay); also counted in `restarts`.
    pub resume_restarts: u64,
    /// Batches dropped as implausible (beyond `max_seq`, or an unconfirmed jump).
    pub implausible: u64,
    /// Jumps beyond `max_jump` confirmed by the next batch and followed.
    pub jumps_confirmed: u64,
}

impl std::ops::AddAssign for SeqCounters {
    fn add_assign(&mut self, o: Self) {
        self.first += o.first;
        self.in_order += o.in_order;
        self.gaps_kept += o.gaps_kept;
        self.missed_in_kept_gaps += o.missed_in_kept_gaps;
        self.gaps_cleared += o.gaps_cleared;
        self.duplicates += o.duplicates;
        self.old += o.old;
        self.restarts += o.restarts;
        self.reconnects += o.reconnects;
        self.near_reconnects += o.near_reconnects;
        self.replays_requested += o.replays_requested;
        self.replays_done += o.replays_done;
        self.resumes += o.resumes;
        self.resumes_verified += o.resumes_verified;
        self.resume_restarts += o.resume_restarts;
        self.implausible += o.implausible;
        self.jumps_confirmed += o.jumps_confirmed;
    }
}

/// What the end of a replay means for the inventory
/// ([`SeqWindow::on_replay_finished`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum ReplayEnd {
    /// Nothing to do.
    Continue,
    /// The publisher restarted: clear the endpoint (no batch to apply).
    Clear(ClearReason),
    /// The publisher restarted: clear the endpoint and request a replay from `from`.
    ClearThenReplay {
        /// First sequence number to replay.
        from: u64,
    },
}

impl ReplayEnd {
    /// True when the endpoint must be cleared.
    #[must_use]
    pub fn clears(self) -> bool {
        !matches!(self, ReplayEnd::Continue)
    }
}

/// What the window expects after the transport reconnected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// Connected, nothing pending.
    Steady,
    /// [`SeqWindow::on_reconnect`]: the next batch is judged by number only.
    Reconnected,
    /// [`SeqWindow::on_resume`]: the next batch must be `last` with its digest.
    Verifying,
}

/// One stream's sequence window: the state machine of one (endpoint, DP rank) event stream.
#[derive(Clone, Debug)]
pub struct SeqWindow {
    config: SeqWindowConfig,
    last: Option<u64>,
    /// Content digest of the batch accepted at `last`, when the caller gave one.
    last_digest: Option<u64>,
    resume: Resume,
    replaying: bool,
    /// The last batch dropped as an implausible jump (a next batch one above it
    /// confirms the jump).
    jump_candidate: Option<u64>,
    /// Batches of the current publisher process the inventory is known to lack.
    missing: u64,
    counters: SeqCounters,
}

impl SeqWindow {
    /// A window that has seen nothing yet.
    #[must_use]
    pub fn new(config: SeqWindowConfig) -> Self {
        Self {
            config,
            last: None,
            last_digest: None,
            resume: Resume::Steady,
            replaying: false,
            jump_candidate: None,
            missing: 0,
            counters: SeqCounters::default(),
        }
    }

    /// Batches of the current publisher process whose effects the inventory is
    /// known to lack (0: complete as far as this stream can tell). See
    /// "Completeness" in the [`SeqWindow`] docs.
    #[must_use]
    pub fn missing_batches(&self) -> u64 {
        self.missing
    }

    /// The inventory provably holds everything this stream's publisher holds
    /// (it applied an `AllBlocksCleared` of this stream).
    pub fn mark_complete(&mut self) {
        self.missing = 0;
    }

    /// The inventory lost this stream's contribution (the endpoint was cleared
    /// for another stream's reason): every batch accepted so far is missing.
    pub fn mark_lost(&mut self) {
        if let Some(last) = self.last {
            self.missing = last.saturating_add(1);
        }
    }

    /// The highest accepted sequence number.
    #[must_use]
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    /// True between [`Self::on_bootstrap`] (or a replaying restart) and
    /// [`Self::on_replay_done`].
    #[must_use]
    pub fn replaying(&self) -> bool {
        self.replaying
    }

    /// Transition counters.
    #[must_use]
    pub fn counters(&self) -> &SeqCounters {
        &self.counters
    }

    /// Decides what to do with batch `seq` (no content digest: a resume check
    /// at `last` then cannot confirm continuity, see the [`SeqWindow`] docs).
    pub fn on_batch(&mut self, seq: u64) -> SeqAction {
        self.decide(seq, None)
    }

    /// Decides what to do with batch `seq` whose content digest is `digest` (any
    /// hash of the payload or of the decoded batch that the same publisher's
    /// replay reproduces, e.g. [`crate::EventBatch::fingerprint`]).
    pub fn on_batch_with_digest(&mut self, seq: u64, digest: u64) -> SeqAction {
        self.decide(seq, Some(digest))
    }

    fn decide(&mut self, seq: u64, digest: Option<u64>) -> SeqAction {
        if self.implausible(seq) {
            self.counters.implausible += 1;
            return SeqAction::Drop(DropReason::Implausible);
        }
        let action = self.judge(seq, digest);
        if action.applies() {
            self.last_digest = digest;
        }
        self.track_missing(seq, action);
        action
    }

    /// True when `seq` must be dropped as implausible; remembers an unconfirmed
    /// jump, and forgets it on any other batch.
    fn implausible(&mut self, seq: u64) -> bool {
        let candidate = self.jump_candidate.take();
        if seq > self.config.max_seq {
            return true;
        }
        let Some(last) = self.last else {
            return false;
        };
        if seq <= last || seq - last - 1 <= self.config.max_jump {
            return false;
        }
        if candidate.and_then(|c| c.checked_add(1)) == Some(seq) {
            self.counters.jumps_confirmed += 1;
            return false;
        }
        self.jump_candidate = Some(seq);
        true
    }

    fn track_missing(&mut self, seq: u64, action: SeqAction) {
        match action {
            SeqAction::ApplyAfterGap { missed } => {
                self.missing = self.missing.saturating_add(missed);
            }
            // Only batch `seq` and later reach the inventory.
            SeqAction::ClearThenApply(_) => self.missing = seq,
            _ => {}
        }
    }

    fn judge(&mut self, seq: u64, digest: Option<u64>) -> SeqAction {
        let resume = std::mem::replace(&mut self.resume, Resume::Steady);
        let Some(last) = self.last else {
            self.counters.first += 1;
            self.last = Some(seq);
            // Batches 0..seq of this publisher were never seen.
            self.missing = seq;
            return SeqAction::Apply;
        };
        if resume == Resume::Verifying {
            if seq == last && digest.is_some() && digest == self.last_digest {
                self.counters.resumes_verified += 1;
                self.counters.duplicates += 1;
                return SeqAction::Drop(DropReason::Duplicate);
            }
            self.counters.resume_restarts += 1;
            return self.restart(Some(seq));
        }
        if seq > last {
            self.last = Some(seq);
            let missed = seq - last - 1;
            if missed > self.config.window {
                self.counters.gaps_cleared += 1;
                return SeqAction::ClearThenApply(ClearReason::GapBeyondWindow { missed });
            }
            if resume == Resume::Reconnected {
                self.counters.near_reconnects += 1;
            }
            if missed == 0 {
                self.counters.in_order += 1;
                return SeqAction::Apply;
            }
            self.counters.gaps_kept += 1;
            self.counters.missed_in_kept_gaps += missed;
            return SeqAction::ApplyAfterGap { missed };
        }
        let restart = resume == Resume::Reconnected
            || (!self.replaying && (last - seq > self.config.window || (seq == 0 && last > 0)));
        if !restart {
            if seq == last {
                self.counters.duplicates += 1;
                return SeqAction::Drop(DropReason::Duplicate);
            }
            self.counters.old += 1;
            return SeqAction::Drop(DropReason::Old);
        }
        self.restart(Some(seq))
    }

    /// A restart: with `seq`, the batch that revealed it (applied under
    /// [`RestartPolicy::Clear`]); without, a restart found at a replay's end.
    fn restart(&mut self, seq: Option<u64>) -> SeqAction {
        self.counters.restarts += 1;
        match (self.config.on_restart, seq) {
            (RestartPolicy::Clear, Some(seq)) => {
                self.last = Some(seq);
                SeqAction::ClearThenApply(ClearReason::Restart)
            }
            (RestartPolicy::Clear, None) => {
                self.last = None;
                self.last_digest = None;
                SeqAction::ClearThenApply(ClearReason::Restart)
            }
            (RestartPolicy::Replay, _) => {
                self.last = None;
                self.last_digest = None;
                self.replaying = true;
                self.counters.replays_requested += 1;
                SeqAction::ClearThenReplay { from: 0 }
            }
        }
    }

    /// The transport lost and re-established its connection; the next batch
    /// decides between a near reconnect, a far one and a restart.
    pub fn on_reconnect(&mut self) {
        self.counters.reconnects += 1;
        self.resume = if self.last.is_some() {
            Resume::Reconnected
        } else {
            Resume::Steady
        };
    }

    /// The transport reconnected and will verify continuity: request a replay
    /// from the returned sequence number (the last accepted batch) and pass
    /// batches with [`Self::on_batch_with_digest`]. `None` when nothing was
    /// accepted yet (there is nothing to verify; no replay is needed for it).
    /// See the resume table in the [`SeqWindow`] docs.
    ///
    /// ```
    /// use kvroute_ingest::{ClearReason, DropReason, SeqAction, SeqWindow, SeqWindowConfig};
    ///
    /// let mut w = SeqWindow::new(SeqWindowConfig::default());
    /// assert_eq!(w.on_batch_with_digest(7, 0xaa), SeqAction::Apply);
    /// // Same engine: its replay starts with our batch 7, unchanged.
    /// assert_eq!(w.on_resume(), Some(7));
    /// assert_eq!(w.on_batch_with_digest(7, 0xaa), SeqAction::Drop(DropReason::Duplicate));
    /// assert_eq!(w.on_batch_with_digest(8, 0xbb), SeqAction::Apply);
    /// // Restarted engine that already published past 8: its batch 8 differs.
    /// assert_eq!(w.on_resume(), Some(8));
    /// assert_eq!(w.on_batch_with_digest(8, 0xcc), SeqAction::ClearThenApply(ClearReason::Restart));
    /// assert_eq!((w.counters().resumes_verified, w.counters().resume_restarts), (1, 1));
    /// ```
    #[must_use]
    pub fn on_resume(&mut self) -> Option<u64> {
        self.counters.reconnects += 1;
        let last = self.last?;
        self.counters.resumes += 1;
        self.counters.replays_requested += 1;
        self.resume = Resume::Verifying;
        self.replaying = true;
        Some(last)
    }

    /// The replay requested by [`Self::on_bootstrap`] or [`Self::on_resume`] ended.
    /// `completed`: the publisher sent its end marker (as opposed to an error or
    /// a timeout). A complete replay from `last` that delivered no batch while a
    /// resume was pending proves a restart.
    pub fn on_replay_finished(&mut self, completed: bool) -> ReplayEnd {
        self.on_replay_done();
        if !(completed && self.resume == Resume::Verifying) {
            return ReplayEnd::Continue;
        }
        self.resume = Resume::Steady;
        self.counters.resume_restarts += 1;
        match self.restart(None) {
            SeqAction::ClearThenReplay { from } => ReplayEnd::ClearThenReplay { from },
            _ => ReplayEnd::Clear(ClearReason::Restart),
        }
    }

    /// The subscriber starts (or re-bootstraps): returns the sequence number to
    /// request a replay from (everything after the last accepted batch).
    #[must_use]
    pub fn on_bootstrap(&mut self) -> u64 {
        self.replaying = true;
        self.counters.replays_requested += 1;
        self.last.map_or(0, |l| l.saturating_add(1))
    }

    /// The replay requested earlier has ended (end marker, error or timeout).
    pub fn on_replay_done(&mut self) {
        if self.replaying {
            self.counters.replays_done += 1;
        }
        self.replaying = false;
    }
}
