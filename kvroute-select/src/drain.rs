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
//! not drain: the estimate is the tracker's `Q`, as before.
//!
//! Where the tracker cannot see prefills end — a non-streamed request's first
//! byte is its whole answer, so `Q` holds its prompt through decode and busy
//! periods include decode time — that rate is too low and `B` keeps prompts
//! long prefilled. Engines that count their own prefill work
//! ([`Load::prefill_progress`], vLLM's per-request prefill time and computed
//! tokens) give a second estimate: their counters' increments, tokens over
//! prefill time, summed with the same forgetting. Each is a lower bound of
//! the true rate (overlapping prefills each count their time), so the larger
//! is used.
//!
//! Replicas. `Q` is net (charged minus done), so work other gateway replicas
//! charge cannot be told from work finished unless the view counts charges:
//! [`Load::charged_prefill_tokens`], the tracker's monotonic counter plus
//! the counters other replicas announce in their [`crate::LoadDelta`]s. The
//! model then reads "charged since the last read" from the counter instead
//! of its own charges, so the rate is learnt from every replica's work and
//! the others' charges join `B` when they are seen; the host makes them seen
//! when they arrive by calling [`crate::Rule::observe_load`] after applying
//! a batch of deltas (without it they would join at this replica's next
//! decision, up to a few hundred ms late with four replicas, and the
//! intervals the rate is measured over would be four times longer). Work that appears in `Q` and in no counter (a view without the counter,
//! engine reports' estimate of others' requests) is added to `B` as it is
//! seen; once it is more than a twentieth of the known charges, the model
//! stands aside and the tracker's figure is used, since it cannot time work
//! it never saw charged. Every error is bounded by `Q`: an endpoint whose
//! engine is slower than the rate shows a smaller backlog only until its
//! requests' first tokens are overdue, and never below zero.

use std::time::Duration;

use parking_lot::Mutex;

use kvroute_core::EndpointId;

use crate::load::{EndpointLoad, Load, PrefillProgress};
use crate::pool::Visit;

/// Endpoint `i` of a decision's arrays.
fn endpoint_id(i: usize) -> EndpointId {
    EndpointId(u32::try_from(i).unwrap_or(u32::MAX))
}

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
    /// The load view's charged-token counter at the last read, if it counts.
    total: Option<u64>,
    /// Scratch of one `observe`: work known to have been charged since the
    /// last read.
    known: u64,
    /// The engine's prefill counters at the last read, if it reports them.
    progress: Option<PrefillProgress>,
}

#[derive(Debug, Default)]
struct State {
    slots: Vec<Slot>,
    /// Σ tokens prefilled per unit of capacity over busy intervals.
    tokens: f64,
    /// Σ those intervals, µs.
    busy_us: f64,
    /// The engines' own figures: Σ tokens prefilled per unit of capacity and
    /// Σ time spent prefilling them (µs), from their counters' increments.
    engine_tokens: f64,
    engine_us: f64,
    /// Tokens this rule charged, and tokens that appeared without its charge
    /// (other replicas' requests, another rule on the tracker), both decayed
    /// per decision.
    own: f64,
    foreign: f64,
    /// Reused by [`PrefillDrain::observe_view`].
    scratch: Vec<EndpointLoad>,
}

impl State {
    /// Tokens per µs per unit of capacity, once measured.
    ///
    /// Two lower bounds of the engines' rate, so the larger wins: the
    /// tracker's (busy time counts until first tokens, which for a
    /// non-streamed request is its last byte, so decode time dilutes it) and
    /// the engines' own counters (overlapping prefills each count their
    /// time).
    fn rate(&self) -> Option<f64> {
        if self.foreign > FOREIGN * self.own {
            return None;
        }
        match (self.tracked_rate(), self.reported_rate()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// From the tracker, once measured over enough busy time.
    fn tracked_rate(&self) -> Option<f64> {
        measured(self.tokens, self.busy_us)
    }

    /// From the engines' counters, likewise.
    fn reported_rate(&self) -> Option<f64> {
        measured(self.engine_tokens, self.engine_us)
    }
}

/// Tokens per µs over `us` of busy time, once that is long enough to trust.
fn measured(tokens: f64, us: f64) -> Option<f64> {
    (us >= MIN_BUSY_US && tokens > 0.0).then(|| tokens / us)
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
    /// `progress(i)` is endpoint `i`'s [`Load::prefill_progress`] (a
    /// decision has it from the reports it read).
    pub(crate) fn observe<L: Load + ?Sized>(
        &self,
        now: Duration,
        loads: &mut [EndpointLoad],
        sampled: &[u32],
        view: &L,
        progress: impl Fn(usize) -> Option<PrefillProgress>,
        capacity: impl Fn(usize) -> u32,
    ) {
        let mut st = self.state.lock();
        // A sampled decision reads (and learns from) its sample only; each
        // endpoint's queue carries on from its last read.
        let visit = Visit::new(sampled, loads.len());
        observe_locked(&mut st, micros(now), loads, visit, view, progress, capacity);
    }

    /// [`PrefillDrain::observe`] between decisions: reads `view` for
    /// `endpoints` endpoints and learns from it (nothing is decided).
    pub(crate) fn observe_view<L: Load + ?Sized>(
        &self,
        now: Duration,
        endpoints: usize,
        view: &L,
        capacity: impl Fn(usize) -> u32,
    ) {
        let mut st = self.state.lock();
        let mut loads = std::mem::take(&mut st.scratch);
        loads.clear();
        loads.extend((0..endpoints).map(|i| view.load(endpoint_id(i))));
        let progress = |i: usize| view.prefill_progress(endpoint_id(i));
        let visit = Visit::new(&[], loads.len());
        observe_locked(
            &mut st,
            micros(now),
            &mut loads,
            visit,
            view,
            progress,
            capacity,
        );
        st.scratch = loads;
    }

    /// The endpoint left its slot: the slot's queue and counters start
    /// over for the next endpoint (whose engine counters are not the old
    /// one's, so an increment between them would be a bogus sample).
    pub(crate) fn forget(&self, endpoint: usize) {
        if let Some(s) = self.state.lock().slots.get_mut(endpoint) {
            *s = Slot::default();
        }
    }

    /// The decision sent `tokens` predicted uncached tokens to `endpoint` at
    /// `now`.
    pub(crate) fn charge(&self, endpoint: usize, tokens: u32, now: Duration, capacity: u32) {
        let now_us = micros(now);
        let mut st = self.state.lock();
        let rate = st.rate();
        if let Some(s) = st.slots.get_mut(endpoint) {
            let b = drained(s, now_us, rate, capacity);
            s.backlog = b + f64::from(tokens);
            // A charge whose clock was read before the last read (hosts
            // read it before tokenizing) must not move the backlog's time
            // back: that span would drain twice.
            s.backlog_at_us = now_us.max(s.backlog_at_us);
            s.charged = s.charged.saturating_add(u64::from(tokens));
        }
    }

    /// The measured prefill rate, tokens per second per unit of capacity.
    #[cfg(test)]
    pub(crate) fn rate_per_s(&self) -> Option<f64> {
        self.state.lock().rate().map(|r| r * 1e6)
    }

    /// Both estimates and the one in use.
    pub(crate) fn rates(&self) -> PrefillRate {
        let st = self.state.lock();
        let per_s = |r: Option<f64>| r.map(|r| r * 1e6);
        PrefillRate {
            tracked: per_s(st.tracked_rate()),
            reported: per_s(st.reported_rate()),
            used: per_s(st.rate()),
        }
    }
}

/// The cost scorer's prefill-rate estimates ([`crate::Rule::prefill_rate`]),
/// tokens per second per unit of endpoint capacity; `None` until a second of
/// busy prefill has been measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillRate {
    /// From the tracker: tokens charged over the time endpoints held them.
    pub tracked: Option<f64>,
    /// From the engines' counters ([`Load::prefill_progress`]).
    pub reported: Option<f64>,
    /// The rate the queues drain at: the larger estimate, `None` while the
    /// model stands aside (work in the view that no charge accounts for).
    pub used: Option<f64>,
}

/// [`PrefillDrain::observe`] under the lock.
fn observe_locked<L: Load + ?Sized>(
    st: &mut State,
    now_us: u64,
    loads: &mut [EndpointLoad],
    visit: impl Iterator<Item = usize> + Clone,
    view: &L,
    progress: impl Fn(usize) -> Option<PrefillProgress>,
    capacity: impl Fn(usize) -> u32,
) {
    if st.slots.len() < loads.len() {
        st.slots.resize(loads.len(), Slot::default());
    }
    let State {
        slots,
        tokens,
        busy_us,
        engine_tokens,
        engine_us,
        own,
        foreign,
        ..
    } = &mut *st;
    // Integer sums: a floating-point accumulator carried through the loop
    // is the loop's longest dependency on a large fleet.
    let (mut known_sum, mut unknown_sum) = (0u64, 0u64);
    for i in visit.clone() {
        let (Some(l), Some(s)) = (loads.get(i), slots.get_mut(i)) else {
            continue;
        };
        // A read stamped before the last one (hosts' tasks racing for the
        // lock) counts as made at the last one's time.
        let now_us = now_us.max(s.at_us);
        let q = l.queued_prefill_tokens;
        let cap = capacity(i);
        // The engine's counters advance only as its reports arrive; a
        // counter that went back is a restarted engine (its next increment
        // counts).
        let progress = progress(i);
        if let (Some(a), Some(b)) = (s.progress, progress) {
            if b.tokens > a.tokens && b.seconds > a.seconds {
                #[allow(clippy::cast_precision_loss)]
                let t = (b.tokens - a.tokens) as f64 / f64::from(cap.max(1));
                *engine_tokens = *engine_tokens * KEEP + t;
                *engine_us = *engine_us * KEEP + (b.seconds - a.seconds) * 1e6;
            }
        }
        s.progress = progress;
        // Work charged since the last read: this rule's own charges or,
        // when the view counts every host's charges (the tracker's
        // counter plus replica sync's), all of them. `known − charged`
        // is what others charged (other replicas, another rule on the
        // tracker): it joins the backlog as it is seen.
        let total = view.charged_prefill_tokens(endpoint_id(i));
        let counted = match (s.total, total) {
            (Some(a), Some(b)) if b >= a => b - a,
            _ => 0,
        };
        let known = counted.max(s.charged);
        s.known = known;
        s.total = total;
        let before = s.queued.saturating_add(known);
        // Learn from every endpoint first, so this decision already uses
        // the figures it brought. Samples are whole busy periods: charges
        // come at reads (this rule's right after its reads, others' when
        // the host reads their deltas), so an endpoint that held work at
        // the last read and still does now was busy throughout; over a busy
        // period the prefilled tokens telescope to everything charged in
        // it, so a partly prefilled head counted in full at an
        // interval's start biases nothing. A period ends somewhere in
        // the interval in which the endpoint emptied, counted as half of
        // it — unless that interval is long against the period (an idle
        // gap), when the period says nothing reliable and is dropped. A
        // period busy for more than `SEGMENT_US` is committed as it goes
        // (a saturated endpoint).
        if s.seen && now_us > s.at_us && before > 0 {
            #[allow(clippy::cast_precision_loss)]
            let (done, dt) = (before.saturating_sub(q) as f64, (now_us - s.at_us) as f64);
            let c = f64::from(cap.max(1));
            let mut commit = |t: f64, b: f64| {
                *tokens = *tokens * KEEP + t / c;
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
        if s.seen {
            known_sum = known_sum.saturating_add(known);
            unknown_sum = unknown_sum.saturating_add(q.saturating_sub(before));
        }
    }
    #[allow(clippy::cast_precision_loss)]
    {
        *own = *own * KEEP_SHARE + known_sum as f64;
        *foreign = *foreign * KEEP_SHARE + unknown_sum as f64;
    }
    let rate = st.rate();
    for i in visit {
        let (Some(l), Some(s)) = (loads.get_mut(i), st.slots.get_mut(i)) else {
            continue;
        };
        let now_us = now_us.max(s.at_us);
        let q = l.queued_prefill_tokens;
        let cap = capacity(i);
        let b = if s.seen {
            // Work nobody charged in a way this view counts (engine
            // reports' estimate of others' requests) joins the queue now,
            // as does what others charged.
            let unknown = q.saturating_sub(s.queued.saturating_add(s.known));
            let late = s.known - s.charged;
            #[allow(clippy::cast_precision_loss)]
            let added = late.saturating_add(unknown) as f64;
            drained(s, now_us, rate, cap) + added
        } else {
            #[allow(clippy::cast_precision_loss)]
            let all = q as f64;
            all
        };
        #[allow(clippy::cast_precision_loss)]
        let b = b.clamp(0.0, q as f64);
        s.seen = true;
        s.at_us = now_us;
        s.queued = q;
        s.charged = 0;
        s.backlog = b;
        s.backlog_at_us = now_us;
        let ahead = ceil_u64(b);
        l.queued_prefill_tokens = ahead.min(q);
    }
}

impl crate::Rule {
    /// Lets the cost scorer's drain model (`CostConfig::drain_queue`) read
    /// `load` at `now` between decisions; nothing is decided. Call it when
    /// the load changes in a way this rule's decisions do not see: after
    /// applying other replicas' [`crate::LoadDelta`]s, so their charges join
    /// the modelled queue when they arrive, not at this replica's next
    /// decision, and the prefill rate is measured over intervals as short as
    /// one replica's. `load` must be the view the rule decides by, with
    /// [`Load::charged_prefill_tokens`]. A no-op for rules without the
    /// drain.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvroute_select::{
    ///     ContractId, Endpoint, LoadTracker, RemoteConfig, RemoteLoad, Role, Rule, RuleConfig,
    ///     Topology,
    /// };
    /// let eps = vec![Endpoint::new("10.0.0.1:8000", Role::Both)];
    /// let cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, 16, ContractId::new("c"));
    /// let rule = Rule::new(cfg, None).unwrap();
    /// let tracker = LoadTracker::with_sync(1, 7);
    /// let remote = RemoteLoad::new(RemoteConfig { endpoints: 1, ..RemoteConfig::default() }, 7);
    /// let now = Duration::from_millis(5);
    /// // ... remote.apply(&delta, now) for each received delta, then:
    /// rule.observe_load(&remote.view(&tracker, now), now);
    /// ```
    pub fn observe_load<L: Load + ?Sized>(&self, load: &L, now: Duration) {
        self.observe_load_inner(load, now);
    }

    /// The drain model's prefill-rate estimates, or `None` for a rule
    /// without the drain (another scorer, `drain_queue` off).
    ///
    /// ```
    /// use kvroute_select::{ContractId, Endpoint, Role, Rule, RuleConfig, Topology};
    /// let eps = vec![Endpoint::new("10.0.0.1:8000", Role::Both)];
    /// let cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, 16, ContractId::new("c"));
    /// let rule = Rule::new(cfg, None).unwrap();
    /// // Nothing measured yet.
    /// assert_eq!(rule.prefill_rate().unwrap().used, None);
    /// ```
    #[must_use]
    pub fn prefill_rate(&self) -> Option<PrefillRate> {
        self.drain.as_deref().map(PrefillDrain::rates)
    }

    fn observe_load_inner<L: Load + ?Sized>(&self, load: &L, now: Duration) {
        if let Some(drain) = &self.drain {
            let eps = &self.config.endpoints;
            drain.observe_view(now, eps.len(), load, |i| {
                eps.get(i)
                    .map_or(1, crate::endpoint::Endpoint::capacity_or_one)
            });
        }
    }
}

/// `b.ceil() as u64` (saturating; 0 for NaN) without the libm call that
/// baseline x86-64 makes for `ceil`: the drain rounds every endpoint's
/// backlog on every decision.
#[inline]
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss
)]
fn ceil_u64(b: f64) -> u64 {
    // Truncation is exact below 2^53; above it every f64 is an integer.
    let t = b as u64;
    if (t as f64) < b {
        t.saturating_add(1)
    } else {
        t
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

    /// `drain` observing `loads` from a view that knows nothing more (no
    /// engine counters, no other host's charges), all capacities 1.
    fn observe_alone(drain: &PrefillDrain, now: Duration, loads: &mut [EndpointLoad]) {
        drain.observe(now, loads, &[], &crate::LoadTable::new(0), |_| None, |_| 1);
    }

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
            observe_alone(&drain, ms(t), &mut loads);
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

    /// A charge whose clock reading is older than the backlog's last read
    /// (decisions read the clock before tokenizing) leaves the backlog's
    /// time where it is: read later, it equals the same charge made in order.
    #[test]
    fn a_late_charge_does_not_move_the_backlog_time_back() {
        let backlog_after = |charge_at: u64| {
            let drain = PrefillDrain::new(1);
            // A serial engine at 20 tokens per ms, busy for seconds.
            for i in 0..400u64 {
                let mut loads = [EndpointLoad {
                    in_flight: 1,
                    queued_prefill_tokens: 2000,
                }];
                observe_alone(&drain, ms(i * 100), &mut loads);
                drain.charge(0, 2000, ms(i * 100), 1);
            }
            assert!(drain.rate_per_s().is_some());
            let mut loads = [EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: 2000,
            }];
            observe_alone(&drain, ms(40_000), &mut loads);
            drain.charge(0, 10_000, ms(charge_at), 1);
            let mut loads = [EndpointLoad {
                in_flight: 2,
                queued_prefill_tokens: 12_000,
            }];
            observe_alone(&drain, ms(40_010), &mut loads);
            loads[0].queued_prefill_tokens
        };
        let (late, in_order) = (backlog_after(39_950), backlog_after(40_000));
        assert!(in_order < 12_000, "the model drains: {in_order}");
        assert_eq!(late, in_order);
    }

    /// A view whose engine reports its prefill counters.
    struct Reporting(Option<PrefillProgress>);

    impl Load for Reporting {
        fn load(&self, _: EndpointId) -> EndpointLoad {
            EndpointLoad::default()
        }

        fn prefill_progress(&self, _: EndpointId) -> Option<PrefillProgress> {
            self.0
        }
    }

    /// The first test's engine serving non-streamed requests: the tracker
    /// holds each prompt until its last byte, 400 ms of decode after its
    /// first token, so the rate the tracker shows is diluted by decode time
    /// and the backlog it implies is mostly decode. Returns the mean
    /// absolute error of the drain's estimate against the true backlog,
    /// with and without the engine's counters polled every 500 ms.
    fn non_streamed_error(report: bool) -> (f64, Option<f64>) {
        let drain = PrefillDrain::new(1);
        // (charged ms, tokens, first token ms, prefill start ms)
        let mut jobs: Vec<(u64, u64, u64, u64)> = Vec::new();
        let (mut t, mut busy_until, mut x) = (0u64, 0u64, 1u64);
        let (mut progress, mut polled_at) = (None, 0u64);
        let (mut err, mut n) = (0u64, 0u64);
        for k in 0..2000 {
            x = crate::bounded::mix64(x);
            t += 100 + x % 217;
            let tokens = 500 + (x >> 32) % 4001;
            let q: u64 = jobs
                .iter()
                .filter(|&&(c, _, f, _)| c <= t && f + 400 > t)
                .map(|j| j.1)
                .sum();
            if report && t >= polled_at + 500 {
                polled_at = t;
                let done = jobs.iter().filter(|j| j.2 <= t);
                #[allow(clippy::cast_precision_loss)]
                let p = PrefillProgress {
                    tokens: done.clone().map(|j| j.1).sum(),
                    seconds: done.map(|j| (j.2 - j.3) as f64 / 1e3).sum(),
                };
                progress = Some(p);
            }
            let mut loads = [EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: q,
            }];
            drain.observe(
                ms(t),
                &mut loads,
                &[],
                &Reporting(progress),
                |_| progress,
                |_| 1,
            );
            if k >= 200 {
                err += loads[0]
                    .queued_prefill_tokens
                    .abs_diff(busy_until.saturating_sub(t) * 20);
                n += 1;
            }
            drain.charge(0, u32::try_from(tokens).unwrap(), ms(t), 1);
            let start = busy_until.max(t);
            busy_until = start + tokens / 20;
            jobs.push((t, tokens, busy_until, start));
        }
        #[allow(clippy::cast_precision_loss)]
        (err as f64 / n as f64, drain.rate_per_s())
    }

    /// With the engine's counters the drain learns the true rate and its
    /// estimate stays close to the true backlog; from the tracker alone the
    /// decode-diluted rate leaves most of the held prompts in the estimate.
    #[test]
    fn engine_counters_give_the_rate_non_streamed_requests_hide() {
        let (with, rate) = non_streamed_error(true);
        let (without, diluted) = non_streamed_error(false);
        let rate = rate.expect("reported for seconds");
        assert!((16_000.0..=24_000.0).contains(&rate), "rate {rate}");
        assert!(
            diluted.is_none_or(|d| d < rate * 0.8),
            "tracker rate {diluted:?}"
        );
        assert!(
            with * 2.0 < without,
            "error {with} with counters vs {without}"
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
            observe_alone(&drain, ms(t), &mut loads);
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

    /// A load view that counts every host's charges (the tracker's counter
    /// plus replica sync's).
    struct Counted(u64);

    impl Load for Counted {
        fn load(&self, _: EndpointId) -> EndpointLoad {
            EndpointLoad::default()
        }

        fn charged_prefill_tokens(&self, _: EndpointId) -> Option<u64> {
            Some(self.0)
        }
    }

    /// Two hosts charge one serial engine alternately, and the view counts
    /// both hosts' charges: the model learns the rate from all of them, adds
    /// the other host's work as it arrives and tracks the true backlog much
    /// better than the tracker's figure. (Without the counter this is
    /// `work_charged_elsewhere_turns_the_drain_off`: the drain stands aside.)
    #[test]
    fn work_charged_elsewhere_and_counted_keeps_the_drain() {
        let drain = PrefillDrain::new(1);
        let (mut t, mut x, mut busy_until, mut total) = (0u64, 1u64, 0u64, 0u64);
        let mut jobs: Vec<(u64, u64, u64)> = Vec::new(); // (charged ms, tokens, first token ms)
        let queued = |jobs: &[(u64, u64, u64)], t: u64| -> u64 {
            jobs.iter()
                .filter(|&&(c, _, f)| c <= t && f > t)
                .map(|j| j.1)
                .sum()
        };
        let mut seen = Vec::new();
        for k in 0..3000u64 {
            x = crate::bounded::mix64(x);
            t += 100 + x % 217;
            let tokens = 500 + (x >> 32) % 4001;
            let mut loads = [EndpointLoad {
                in_flight: 1,
                queued_prefill_tokens: queued(&jobs, t),
            }];
            // This rule decides every other request; the other host's are
            // counted by the view, which the rule reads when they arrive
            // (`Rule::observe_load` after applying the delta).
            if k % 2 == 0 {
                drain.observe(ms(t), &mut loads, &[], &Counted(total), |_| None, |_| 1);
                let truth = busy_until.saturating_sub(t) * 20;
                seen.push((loads[0].queued_prefill_tokens, truth, queued(&jobs, t)));
                drain.charge(0, u32::try_from(tokens).unwrap(), ms(t), 1);
            }
            total += tokens;
            busy_until = busy_until.max(t) + tokens / 20;
            jobs.push((t, tokens, busy_until));
            if k % 2 == 1 {
                let mut loads = [EndpointLoad {
                    in_flight: 1,
                    queued_prefill_tokens: queued(&jobs, t),
                }];
                drain.observe(ms(t), &mut loads, &[], &Counted(total), |_| None, |_| 1);
            }
        }
        // Learnt from both hosts' work. Biased low: a read right after the
        // other host's charge sees work, so an idle stretch before it counts
        // as busy (a slower drain, never more than the tracker holds).
        let rate = drain.rate_per_s().expect("busy for seconds");
        assert!((12_000.0..=24_000.0).contains(&rate), "rate {rate}");
        let (mut err_tracker, mut err_drain) = (0u64, 0u64);
        for &(est, truth, q) in &seen[200..] {
            assert!(est <= q);
            err_tracker += q.abs_diff(truth);
            err_drain += est.abs_diff(truth);
        }
        assert!(
            err_drain * 2 < err_tracker,
            "drain error {err_drain} vs tracker {err_tracker}"
        );
    }

    #[test]
    fn empty_queue_resets_and_foreign_work_is_added() {
        let drain = PrefillDrain::new(2);
        let mut loads = [EndpointLoad::default(); 2];
        observe_alone(&drain, ms(0), &mut loads);
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
        observe_alone(&drain, ms(1), &mut loads);
        // No rate yet: nothing drains, everything the tracker holds counts.
        assert_eq!(loads[0].queued_prefill_tokens, 700);
        assert_eq!(loads[1].queued_prefill_tokens, 300);
        let mut loads = [EndpointLoad::default(); 2];
        observe_alone(&drain, ms(2), &mut loads);
        assert_eq!(loads[0].queued_prefill_tokens, 0);
    }

    /// The libm-free rounding agrees with `ceil` on every value the drain
    /// can produce and on the edges (integers, halves, 2^53 and above,
    /// infinities, NaN).
    #[test]
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    fn rounding_up_matches_ceil() {
        let oracle = |b: f64| b.ceil() as u64;
        let edges = [
            0.0,
            -0.0,
            0.5,
            1.0,
            1.000_000_1,
            4_503_599_627_370_495.5,
            9_007_199_254_740_992.0,
            9_007_199_254_740_993.0,
            u64::MAX as f64,
            f64::MAX,
            f64::INFINITY,
            f64::NAN,
            -1.5,
        ];
        for b in edges {
            assert_eq!(ceil_u64(b), oracle(b), "{b}");
        }
        proptest::proptest!(|(bits in proptest::prelude::any::<u64>(), small in 0.0f64..1e12)| {
            let b = f64::from_bits(bits);
            proptest::prop_assert_eq!(ceil_u64(b), oracle(b), "{}", b);
            proptest::prop_assert_eq!(ceil_u64(small), oracle(small), "{}", small);
        });
    }
}
