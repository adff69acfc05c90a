//! The outlier detector's specification as a naive model: it keeps the whole
//! history (every attempt, every report, every ejection) and answers each
//! question by scanning it, where the detector keeps a few running fields.
//! The fuzz target and the property tests drive both with the same inputs
//! and compare every answer.

use std::time::Duration;

use super::{EjectionCause, EngineEvidence, OutlierConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Answered,
    Abandoned,
    TimedOut,
}

#[derive(Clone, Debug)]
struct Attempt {
    endpoint: usize,
    sent: Duration,
    sent_seq: usize,
    end: Option<(usize, End, Duration)>,
}

#[derive(Clone, Debug)]
struct Report {
    endpoint: usize,
    at: Duration,
    seq: usize,
    evidence: EngineEvidence,
}

#[derive(Clone, Debug)]
struct Ejection {
    endpoint: usize,
    seq: usize,
    until: Duration,
    /// Ended early by an answer at this time.
    cut: Option<Duration>,
    cause: EjectionCause,
}

impl Ejection {
    fn end(&self) -> Duration {
        self.cut.unwrap_or(self.until)
    }
}

/// The model (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Model {
    config: OutlierConfig,
    /// Per endpoint: present, and the (seq, time) its current life began.
    lives: Vec<(bool, usize, Duration)>,
    /// Per endpoint: the host routes to it (not drained, breaker closed).
    available: Vec<bool>,
    attempts: Vec<Attempt>,
    reports: Vec<Report>,
    ejections: Vec<Ejection>,
    seq: usize,
}

impl Model {
    pub(crate) fn new(endpoints: usize, config: OutlierConfig) -> Self {
        Self {
            config,
            lives: vec![(true, 0, Duration::ZERO); endpoints],
            available: vec![true; endpoints],
            attempts: Vec::new(),
            reports: Vec::new(),
            ejections: Vec::new(),
            seq: 0,
        }
    }

    fn tick(&mut self) -> usize {
        self.seq += 1;
        self.seq
    }

    fn life(&self, e: usize) -> (bool, usize, Duration) {
        self.lives
            .get(e)
            .copied()
            .unwrap_or((false, usize::MAX, Duration::ZERO))
    }

    fn in_life(&self, e: usize, seq: usize) -> bool {
        seq > self.life(e).1
    }

    fn my_attempts(&self, e: usize) -> impl Iterator<Item = (usize, &Attempt)> + '_ {
        self.attempts
            .iter()
            .enumerate()
            .filter(move |(_, a)| a.endpoint == e && self.in_life(e, a.sent_seq))
    }

    /// Attempts at `e` still waiting just before event `seq`.
    fn waiting_at(&self, e: usize, seq: usize) -> Vec<&Attempt> {
        self.my_attempts(e)
            .map(|(_, a)| a)
            .filter(|a| a.sent_seq < seq && a.end.is_none_or(|(s, _, _)| s > seq))
            .collect()
    }

    fn my_ejections(&self, e: usize) -> impl Iterator<Item = &Ejection> + '_ {
        self.ejections
            .iter()
            .filter(move |j| j.endpoint == e && self.in_life(e, j.seq))
    }

    pub(crate) fn is_ejected(&self, e: usize, now: Duration) -> bool {
        self.my_ejections(e).last().is_some_and(|j| now < j.end())
    }

    fn back_at(&self, e: usize, now: Duration) -> Duration {
        self.my_ejections(e)
            .map(Ejection::end)
            .filter(|t| *t <= now)
            .fold(self.life(e).2, Duration::max)
    }

    fn last_answer(&self, e: usize) -> Option<Duration> {
        self.my_attempts(e)
            .filter_map(|(_, a)| match a.end {
                Some((_, End::Answered, t)) => Some(t),
                _ => None,
            })
            .max()
    }

    /// (latest vouching report, latest accusing report) of `e`.
    fn verdicts(&self, e: usize) -> (Option<Duration>, Option<Duration>) {
        let grace = self.config.report_grace;
        let (mut vouch, mut accuse) = (None::<Duration>, None::<Duration>);
        for r in self
            .reports
            .iter()
            .filter(|r| r.endpoint == e && self.in_life(e, r.seq))
        {
            let due = self
                .waiting_at(e, r.seq)
                .iter()
                .filter(|a| a.sent.saturating_add(grace) <= r.at)
                .count();
            if due == 0 {
                continue;
            }
            let vouches = match r.evidence {
                EngineEvidence::Report { busy } => busy as usize >= due,
                EngineEvidence::Unreachable => false,
            };
            let slot = if vouches { &mut vouch } else { &mut accuse };
            *slot = Some(slot.map_or(r.at, |t| t.max(r.at)));
        }
        (vouch, accuse)
    }

    /// Timeouts at `e` since its last answer or ejection.
    pub(crate) fn consecutive_timeouts(&self, e: usize) -> u32 {
        // Every event of `e`'s life that resets or counts, in order.
        let mut marks: Vec<(usize, Option<bool>)> = self
            .my_attempts(e)
            .filter_map(|(_, a)| match a.end {
                Some((s, End::Answered, _)) => Some((s, None)),
                Some((s, End::TimedOut, _)) => Some((s, Some(true))),
                _ => None,
            })
            .chain(self.my_ejections(e).map(|j| (j.seq, None)))
            .collect();
        marks.sort_by_key(|(s, _)| *s);
        let mut n = 0u32;
        for (_, m) in marks {
            n = if m.is_some() { n.saturating_add(1) } else { 0 };
        }
        n
    }

    fn others_in_rotation(
        &self,
        e: usize,
        now: Duration,
        answered_after: Option<Duration>,
    ) -> bool {
        (0..self.lives.len()).any(|f| {
            f != e
                && self.life(f).0
                && self.available.get(f).copied().unwrap_or(false)
                && !self.is_ejected(f, now)
                && answered_after.is_none_or(|t| self.last_answer(f).is_some_and(|a| a > t))
        })
    }

    fn stalled_since(&self, e: usize, now: Duration) -> Option<Duration> {
        if !self.life(e).0 || self.is_ejected(e, now) {
            return None;
        }
        let oldest = self
            .waiting_at(e, usize::MAX)
            .iter()
            .map(|a| a.sent)
            .min()?;
        let since = oldest.max(self.back_at(e, now));
        if now < since.saturating_add(self.config.stall_after) {
            return None;
        }
        let mark = since.saturating_add(self.config.report_grace);
        let (vouch, accuse) = self.verdicts(e);
        (accuse.is_some_and(|t| t >= mark) && vouch.is_none_or(|t| t < mark)).then_some(since)
    }

    fn eject(&mut self, e: usize, now: Duration, cause: EjectionCause) {
        // Ejections since the last answer, this one included.
        let answered = self.my_attempts(e).filter_map(|(_, a)| match a.end {
            Some((s, End::Answered, _)) => Some(s),
            _ => None,
        });
        let since = answered.max().unwrap_or(0);
        let streak = self.my_ejections(e).filter(|j| j.seq > since).count() as u32 + 1;
        let length = self
            .config
            .base_ejection
            .saturating_mul(streak)
            .min(self.config.max_ejection);
        let seq = self.tick();
        self.ejections.push(Ejection {
            endpoint: e,
            seq,
            until: now.saturating_add(length),
            cut: None,
            cause,
        });
    }

    pub(crate) fn set_present(&mut self, e: usize, present: bool, now: Duration) {
        let seq = self.tick();
        if let Some(l) = self.lives.get_mut(e) {
            *l = (present, seq, now);
        }
        if let Some(a) = self.available.get_mut(e) {
            *a = true;
        }
    }

    pub(crate) fn available(&self, e: usize) -> bool {
        self.available.get(e).copied().unwrap_or(false)
    }

    pub(crate) fn set_available(&mut self, e: usize, available: bool) {
        if let Some(a) = self.available.get_mut(e) {
            *a = available;
        }
    }

    /// Returns the attempt's index (the model's handle).
    pub(crate) fn sent(&mut self, e: usize, now: Duration) -> Option<usize> {
        if e >= self.lives.len() {
            return None;
        }
        let seq = self.tick();
        self.attempts.push(Attempt {
            endpoint: e,
            sent: now,
            sent_seq: seq,
            end: None,
        });
        Some(self.attempts.len() - 1)
    }

    fn waiting(&self, a: usize) -> bool {
        self.attempts
            .get(a)
            .is_some_and(|x| x.end.is_none() && self.in_life(x.endpoint, x.sent_seq))
    }

    fn end(&mut self, a: usize, how: End, now: Duration) -> Option<usize> {
        if !self.waiting(a) {
            return None;
        }
        let seq = self.tick();
        let x = self.attempts.get_mut(a)?;
        x.end = Some((seq, how, now));
        Some(x.endpoint)
    }

    pub(crate) fn answered(&mut self, a: usize, now: Duration) {
        let Some(e) = self.end(a, End::Answered, now) else {
            return;
        };
        if self.is_ejected(e, now) {
            let life = self.life(e).1;
            if let Some(j) = self
                .ejections
                .iter_mut()
                .rev()
                .find(|j| j.endpoint == e && j.seq > life)
            {
                j.cut = Some(now);
            }
        }
    }

    pub(crate) fn abandoned(&mut self, a: usize, now: Duration) {
        self.end(a, End::Abandoned, now);
    }

    pub(crate) fn timed_out(&mut self, a: usize, now: Duration) -> bool {
        let Some(e) = self.end(a, End::TimedOut, now) else {
            return false;
        };
        let threshold = self.config.consecutive_timeouts;
        if threshold > 0
            && self.consecutive_timeouts(e) >= threshold
            && !self.is_ejected(e, now)
            && self.others_in_rotation(e, now, None)
        {
            self.eject(e, now, EjectionCause::Timeouts);
            return true;
        }
        false
    }

    pub(crate) fn evidence(&mut self, e: usize, now: Duration, evidence: EngineEvidence) {
        if e >= self.lives.len() {
            return;
        }
        let seq = self.tick();
        self.reports.push(Report {
            endpoint: e,
            at: now,
            seq,
            evidence,
        });
    }

    pub(crate) fn evaluate(&mut self, now: Duration) -> Vec<usize> {
        let mut out = Vec::new();
        if self.config.stall_after.is_zero() {
            return out;
        }
        for e in 0..self.lives.len() {
            if let Some(since) = self.stalled_since(e, now) {
                if self.others_in_rotation(e, now, Some(since)) {
                    self.eject(e, now, EjectionCause::Stalled);
                    out.push(e);
                }
            }
        }
        out
    }

    pub(crate) fn ejections(&self, e: usize) -> (u64, u64) {
        let all = self.my_ejections(e).count() as u64;
        let stalls = self
            .my_ejections(e)
            .filter(|j| j.cause == EjectionCause::Stalled)
            .count() as u64;
        (all, stalls)
    }

    /// The end of `e`'s ejection in force at `now`.
    pub(crate) fn ejected_until(&self, e: usize, now: Duration) -> Option<Duration> {
        self.my_ejections(e)
            .last()
            .map(Ejection::end)
            .filter(|end| now < *end)
    }

    pub(crate) fn waiting_count(&self, e: usize) -> usize {
        self.waiting_at(e, usize::MAX).len()
    }

    pub(crate) fn present(&self, e: usize) -> bool {
        self.life(e).0
    }
}
