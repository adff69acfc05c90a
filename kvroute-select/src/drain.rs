//! How much of an endpoint's queued prefill is still ahead of a new request.
//!
//! The tracker counts a request's predicted uncached tokens from its decision
//! until its first token: the request being prefilled counts in full until the
//! very end. An endpoint 5 ms from finishing a 6 000-token prompt and one that
//! has just started it both report 6 000 tokens, so the cost scorer, reading
//! the tracker alone, sends a request to the one that makes it wait 300 ms
//! instead of 5 (in `kvroute sim`'s RAG workload this is where the TTFT p99
//! tail came from: the chosen endpoint's true backlog was 144 ms on average
//! for the slowest 1 % while another had 28 ms).
//!
//! [`PrefillDrain`] models each endpoint as what an engine's scheduler is: a
//! work-conserving queue that consumes prefill tokens at a rate. Per endpoint
//! it keeps a virtual backlog `B`: every charge adds its tokens, time drains
//! `rate · elapsed`, and `B` never exceeds what the tracker still holds (`Q`,
//! the exact upper bound) nor survives `Q` reaching zero. The scorer then reads
//! `min(Q, B)` as the queued prefill.
//!
//! The rate is measured, not configured. Between two decisions an endpoint
//! that held work prefilled `Q_before + charged − Q_after` tokens, and it was
//! busy the whole interval if it still holds work (the tracker only grows at
//! decisions). Summed over a busy period these telescope to everything charged
//! in it; the period ends in the interval in which the endpoint emptied,
//! counted as half of it, and a period whose last interval is longer than the
//! rest of it (an idle gap follows) is dropped as unmeasurable. Tokens over
//! busy time, over the fleet per unit of capacity with exponential
//! forgetting, is the rate. Its resolution is the interval between decisions,
//! which is short exactly when queues form.
//! Until a second of busy time has been seen the rate is unknown and `B` does
//! not drain: the estimate is the tracker's `Q`, as before. Work that other
//! replicas or rules added (`Q` grew by more than this rule charged) is added
//! to `B` as it is seen; once it is more than a twentieth of what the rule
//! reads (several replicas sharing their load), the model stands aside and
//! the tracker's figure is used, since it cannot time work it never saw
//! charged. Every error is bounded by `Q`: an endpoint whose
//! engine is slower than the rate shows a smaller backlog only until its
//! requests' first tokens are overdue, and never below zero.

use std::time::Duration;

use parking_lot::Mutex;

use crate::load::EndpointLoad;

/// Busy time (µs) the rate must be measured over before it is used.
const MIN_BUSY_US: f64 = 1_000_000.0;
/// A busy period longer than this is committed in segments of this length.
const SEGMENT_US: f64 = 2_000_000.0;
/// The model needs to see the charges: once more than this share of the
/// queued tokens it reads arrived without one (the load view adds other
/// replicas' requests, which it cannot time), it drains nothing and the
/// tracker's figure stands.
const FOREIGN: f64 = 0.05;
/// Forgetting of the own / foreign token sums, per decision.
const KEEP_SHARE: f64 = 1.0 - 1.0 / 1024.0;
/// Forgetting per committed sample (a busy period or segment): about the
/// last 256 count.
const KEEP: f64 = 1.0 - 1.0 / 256.0;

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    seen: bool,
    /// When the tracker was last read for this endpoint.
    at_us: u64,
    /// What it held then.
    queued: u64,
    /// Tokens this rule charged since.
    charged: u64,
    /// Virtual backlog as of `backlog_at_us` (the last read or charge).
    backlog: f64,
    backlog_at_us: u64,
    /// The current busy period's drained tokens and busy time not yet
    /// committed to the rate.
    period_tokens: f64,
    period_us: f64,
}

#[derive(Debug, Default)]
struct State {
    slots: Vec<Slot>,
    /// Σ tokens prefilled per unit of capacity over busy intervals.
    tokens: f64,
    /// Σ those intervals, µs.
    busy_us: f64,
    /// Tokens this rule charged, and tokens that appeared without its charge
    /// (other replicas' requests, another rule on the tracker), both decayed
    /// per decision.
    own: f64,
    foreign: f64,
}

impl State {
    /// Tokens per µs per unit of capacity, once measured.
    fn rate(&self) -> Option<f64> {
        (self.busy_us >= MIN_BUSY_US && self.tokens > 0.0 && self.foreign <= FOREIGN * self.own)
            .then(|| self.tokens / self.busy_us)
    }
}

/// Per-rule drain model of the endpoints' prefill queues (see the module
/// docs). Decisions go through `&self`.
#[derive(Debug, Default)]
pub(crate) struct PrefillDrain {
    state: Mutex<State>,
}

fn micros(now: Duration) -> u64 {
    u64::try_from(now.as_micros()).unwrap_or(u64::MAX)
}

impl PrefillDrain {
    pub(crate) fn new(endpoints: usize) -> Self {
        Self {
            state: Mutex::new(State {
                slots: vec![Slot::default(); endpoints],
                ..State::default()
            }),
        }
    }

    /// Reads the loads of one decision at `now` (the tracker's figures, indexed
    /// by endpoint; `capacity(i)` is endpoint `i`'s capacity weight), learns
    /// the rate from them and replaces each `queued_prefill_tokens` by the
    /// backlog still ahead of a new request.
    pub(crate) fn observe(
        &self,
        now: Duration,
        loads: &mut [EndpointLoad],
        capacity: impl Fn(usize) -> u32,
    ) {
        let now_us = micros(now);
        let mut st = self.state.lock();
        let State {
            slots,
            tokens,
            busy_us,
            ..
        } = &mut *st;
        if slots.len() < loads.len() {
            slots.resize(loads.len(), Slot::default());
        }
        // Learn from every endpoint first, so this decision already uses the
        // figures it brought. Samples are whole busy periods: the tracker only
        // grows at decisions, so an endpoint that held work at the last one
        // and still does now was busy throughout; over a busy period the
        // drained tokens telescope to everything charged in it, so a partly
        // prefilled head counted in full at an interval's start biases
        // nothing. A period ends somewhere in the interval in which the
        // endpoint emptied, counted as half of it — unless that interval is
        // long against the period (an idle gap), when the period says nothing
        // reliable and is dropped. A period busy for more than
        // `SEGMENT_US` is committed as it goes (a saturated endpoint).
        for (i, (l, s)) in loads.iter().zip(slots.iter_mut()).enumerate() {
            let q = l.queued_prefill_tokens;
            let before = s.queued.saturating_add(s.charged);
            if !(s.seen && now_us > s.at_us && before > 0) {
                continue;
            }
            #[allow(clippy::cast_precision_loss)]
            let (done, dt) = (before.saturating_sub(q) as f64, (now_us - s.at_us) as f64);
            let cap = f64::from(capacity(i).max(1));
            let mut commit = |t: f64, b: f64| {
                *tokens = *tokens * KEEP + t / cap;
                *busy_us = *busy_us * KEEP + b;
            };
            if q > 0 {
                s.period_tokens += done;
                s.period_us += dt;
                if s.period_us >= SEGMENT_US {
                    commit(s.period_tokens, s.period_us);
                    s.period_tokens = 0.0;
                    s.period_us = 0.0;
                }
            } else {
                let (t, b) = (s.period_tokens + done, s.period_us + dt / 2.0);
                if dt <= b {
                    commit(t, b);
                }
                s.period_tokens = 0.0;
                s.period_us = 0.0;
            }
        }
        let mut foreign = 0.0;
        for (l, s) in loads.iter().zip(st.slots.iter()) {
            if s.seen {
                let expected = s.queued.saturating_add(s.charged);
                #[allow(clippy::cast_precision_loss)]
                let added = l.queued_prefill_tokens.saturating_sub(expected) as f64;
                foreign += added;
            }
        }
        st.foreign = st.foreign * KEEP_SHARE + foreign;
        st.own *= KEEP_SHARE;
        let rate = st.rate();
        for (i, (l, s)) in loads.iter_mut().zip(st.slots.iter_mut()).enumerate() {
            let q = l.queued_prefill_tokens;
            let expected = s.queued.saturating_add(s.charged);
            let mut b = drained(s, now_us, rate, capacity(i));
            if s.seen {
                // Work this rule did not charge (another replica, another rule
                // on the same tracker) joins the queue now.
                #[allow(clippy::cast_precision_loss)]
                let added = q.saturating_sub(expected) as f64;
                b += added;
            } else {
                #[allow(clippy::cast_precision_loss)]
                let all = q as f64;
                b = all;
            }
            #[allow(clippy::cast_precision_loss)]
            let b = b.clamp(0.0, q as f64);
            s.seen = true;
            s.at_us = now_us;
            s.queued = q;
            s.charged = 0;
            s.backlog = b;
            s.backlog_at_us = now_us;
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let ahead = b.ceil() as u64;
            l.queued_prefill_tokens = ahead.min(q);
        }
    }

    /// The decision sent `tokens` predicted uncached tokens to `endpoint` at
    /// `now`.
    pub(crate) fn charge(&self, endpoint: usize, tokens: u32, now: Duration, capacity: u32) {
        let now_us = micros(now);
        let mut st = self.state.lock();
        st.own += f64::from(tokens);
        let rate = st.rate();
        if let Some(s) = st.slots.get_mut(endpoint) {
            let b = drained(s, now_us, rate, capacity);
            s.backlog = b + f64::from(tokens);
            s.backlog_at_us = now_us;
            s.charged = s.charged.saturating_add(u64::from(tokens));
        }
    }

    /// The measured prefill rate, tokens per second per unit of capacity.
    #[cfg(test)]
    pub(crate) fn rate_per_s(&self) -> Option<f64> {
        self.state.lock().rate().map(|r| r * 1e6)
    }
}

/// `s`'s virtual backlog drained from its last update to `now_us`.
fn drained(s: &Slot, now_us: u64, rate: Option<f64>, capacity: u32) -> f64 {
    match rate {
        #[allow(clippy::cast_precision_loss)]
        Some(r) => {
            let dt = now_us.saturating_sub(s.backlog_at_us) as f64;
            (s.backlog - r * f64::from(capacity.max(1)) * dt).max(0.0)
        }
        None => s.backlog,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A serial FIFO engine prefilling 20 tokens per ms, fed prompts of
    /// 500..4 500 tokens at pseudo-random gaps (utilisation about 0.6), read
    /// at every arrival the way the tracker reports it: each prompt in full
    /// from its charge until its first token.
    #[test]
    fn learns_the_rate_and_tracks_the_true_backlog() {
        let drain = PrefillDrain::new(1);
        let mut jobs: Vec<(u64, u64, u64)> = Vec::new(); // (charged ms, tokens, first token ms)
        let (mut t, mut busy_until, mut x) = (0u64, 0u64, 1u64);
        let mut seen = Vec::new();
        for _ in 0..2000 {
            x = crate::bounded::mix64(x);
            t += 100 + x % 217; // mean gap 208 ms
            let tokens = 500 + (x >> 32) % 4001; // mean 2 500 tokens = 125 ms
            let q: u64 = jobs
                .iter()
                .filter(|&&(c, _, f)| c <= t && f > t)
                .map(|j| j.1)
                .sum();
            let mut loads = [EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: q,
            }];
            drain.observe(ms(t), &mut loads, |_| 1);
            let truth = busy_until.saturating_sub(t) * 20;
            seen.push((q, loads[0].queued_prefill_tokens, truth));
            let tokens32 = u32::try_from(tokens).unwrap();
            drain.charge(0, tokens32, ms(t), 1);
            busy_until = busy_until.max(t) + tokens / 20;
            jobs.push((t, tokens, busy_until));
        }
        let rate = drain.rate_per_s().expect("busy for seconds");
        assert!((16_000.0..=24_000.0).contains(&rate), "rate {rate}");
        // The estimate never exceeds the tracker's and is much closer to the
        // true backlog.
        let (mut err_tracker, mut err_drain) = (0u64, 0u64);
        for &(q, est, truth) in &seen[200..] {
            assert!(est <= q);
            err_tracker += q.abs_diff(truth);
            err_drain += est.abs_diff(truth);
        }
        assert!(
            err_drain * 3 < err_tracker,
            "drain error {err_drain} vs tracker {err_tracker}"
        );
    }

    /// The same engine, but a second host charges as much again on it: the
    /// view's figure then includes work this rule cannot time, and it is
    /// left as it is.
    #[test]
    fn work_charged_elsewhere_turns_the_drain_off() {
        let drain = PrefillDrain::new(1);
        let (mut t, mut x) = (0u64, 1u64);
        let mut jobs: Vec<(u64, u64, u64)> = Vec::new(); // (charged ms, tokens, first token ms)
        let mut busy_until = 0u64;
        let mut reads = Vec::new();
        for k in 0..2000u64 {
            x = crate::bounded::mix64(x);
            t += 50 + x % 100;
            let tokens = 500 + (x >> 32) % 1001;
            let q: u64 = jobs
                .iter()
                .filter(|&&(c, _, f)| c <= t && f > t)
                .map(|j| j.1)
                .sum();
            let mut loads = [EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: q,
            }];
            drain.observe(ms(t), &mut loads, |_| 1);
            reads.push((q, loads[0].queued_prefill_tokens));
            // Every other request is the other host's: it reaches the
            // engine but never this rule's `charge`.
            if k % 2 == 0 {
                drain.charge(0, u32::try_from(tokens).unwrap(), ms(t), 1);
            }
            busy_until = busy_until.max(t) + tokens / 20;
            jobs.push((t, tokens, busy_until));
        }
        assert!(reads[1000..].iter().all(|&(q, est)| q == est));
    }

    #[test]
    fn empty_queue_resets_and_foreign_work_is_added() {
        let drain = PrefillDrain::new(2);
        let mut loads = [EndpointLoad::default(); 2];
        drain.observe(ms(0), &mut loads, |_| 1);
        drain.charge(0, 500, ms(0), 1);
        // 700 on endpoint 0: 200 more than this rule charged (another
        // replica's request); endpoint 1 got 300 it never charged.
        let mut loads = [
            EndpointLoad {
                in_flight: 2,
                queued_prefill_tokens: 700,
            },
            EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: 300,
            },
        ];
        drain.observe(ms(1), &mut loads, |_| 1);
        // No rate yet: nothing drains, everything the tracker holds counts.
        assert_eq!(loads[0].queued_prefill_tokens, 700);
        assert_eq!(loads[1].queued_prefill_tokens, 300);
        let mut loads = [EndpointLoad::default(); 2];
        drain.observe(ms(2), &mut loads, |_| 1);
        assert_eq!(loads[0].queued_prefill_tokens, 0);
    }
}
