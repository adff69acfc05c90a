//! Live load, supplied by the host (as tower's `Load`, but per endpoint).

use kvroute_core::EndpointId;

use crate::report_cell::{ReportCell, Reported};

/// The work an endpoint currently carries, as the host observes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointLoad {
    /// Requests sent and not yet completed.
    pub in_flight: u32,
    /// Prompt tokens admitted but not yet prefilled (engine queue), if known.
    pub queued_prefill_tokens: u64,
}

/// Per-endpoint load of a rule's endpoints, indexed by the rule's [`EndpointId`]s.
///
/// ```
/// use kvroute_select::{EndpointLoad, Load, LoadTable};
/// use kvroute_core::EndpointId;
/// let mut t = LoadTable::new(2);
/// t.set(EndpointId(1), EndpointLoad { in_flight: 3, queued_prefill_tokens: 0 });
/// assert_eq!(t.load(EndpointId(1)).in_flight, 3);
/// assert_eq!(t.load(EndpointId(9)), EndpointLoad::default());
/// ```
pub trait Load {
    /// The load of endpoint `endpoint`; unknown endpoints report zero load.
    fn load(&self, endpoint: EndpointId) -> EndpointLoad;

    /// Predicted prefill tokens ever charged to `endpoint` by every host whose
    /// work [`Load::load`] includes — a monotonic counter — or `None` when the
    /// view does not count them (the default). `queued_prefill_tokens` is net
    /// (charged minus done); with this counter the cost scorer's drain model
    /// can tell how much arrived and how much was prefilled between two
    /// decisions, including other replicas' requests.
    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        let _ = endpoint;
        None
    }

    /// What `endpoint`'s engine reports it has prefilled (monotonic
    /// counters), or `None` (the default) when no report says. The cost
    /// scorer's drain model learns the prefill rate from it where the host
    /// cannot see prefills end: a non-streamed request's first byte is its
    /// whole answer, so its charge lasts through decode.
    fn prefill_progress(&self, endpoint: EndpointId) -> Option<PrefillProgress> {
        let _ = endpoint;
        None
    }

    /// The engine's own last report on `endpoint` (running, waiting, KV
    /// usage and capacity), or `None` (the default) when the host does not
    /// poll it. Scorers read it through [`crate::Candidate::report`].
    fn report(&self, endpoint: EndpointId) -> Option<EngineReport> {
        let _ = endpoint;
        None
    }

    /// [`Load::load`] and [`Load::report`] of `endpoint` together: a
    /// decision reads both for every endpoint, and a view that derives both
    /// from one shared report reads it once. The default calls the two.
    fn load_and_report(&self, endpoint: EndpointId) -> (EndpointLoad, Option<EngineReport>) {
        (self.load(endpoint), self.report(endpoint))
    }

    /// Who routes over these endpoints from views like this one: how many
    /// deciders (gateway replicas whose decisions the view shares) and this
    /// host's rank among them. [`Deciders::ALONE`] (the default) for a host
    /// that routes alone. The cost scorer reads it to keep replicas that
    /// decide one burst on one view from choosing the same endpoints (see
    /// [`crate::CostConfig`]), and every rotation (exact ties, round robin,
    /// the fallback selectors, the P/D decode leg) to start each replica
    /// apart from the others.
    fn deciders(&self) -> Deciders {
        Deciders::ALONE
    }
}

/// Who routes over a set of endpoints: the number of deciders sharing their
/// load ([`crate::RemoteLoad`]) and this one's rank among them.
///
/// Ranks must be distinct among the deciders for the cost scorer to spread
/// them (the replica-sync view ranks every replica by its origin id, which
/// all replicas see alike); a repeated rank only makes the two deciders
/// behave alike again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deciders {
    /// Deciders, this one included (at least 1).
    pub count: u32,
    /// This decider's rank, in `0..count`.
    pub rank: u32,
    /// This decision is part of a burst the deciders decide in order
    /// ([`crate::burst_turn`]): a request without a home is decided after
    /// the lower ranks' part of the burst is in this view and before the
    /// higher ranks decide theirs; a request with a home at once, while the
    /// others place only their own requests with a home. No other decider
    /// is placing a share of the burst on its zone, so nothing is expected
    /// unseen, except as `home` says.
    pub ordered: bool,
    /// With `ordered`: this is a request with a home, decided at the same
    /// instant as the others' requests with a home. Most stay at their
    /// homes; those that leave a busy one would all go to the endpoints
    /// every view finds cheapest, so the cost scorer ranks the other zones
    /// in this decider's own spill-over order (cost only, nothing expected
    /// unseen), except this request's home.
    pub home: bool,
}

impl Deciders {
    /// These deciders for a decision made in `turn` ([`crate::burst_turn`]):
    /// `ordered` in its turn, `home` when it is also of a request with a
    /// home.
    #[must_use]
    pub fn in_turn(self, turn: crate::Turn) -> Self {
        Self {
            ordered: turn.in_turn,
            home: turn.in_turn && turn.home,
            ..self
        }
    }

    /// Whether this decision is made at the same instant as the other
    /// deciders' on one view: several deciders, outside a burst decided in
    /// turns or for a request with a home (decided at once). A decision in
    /// its turn sees the lower ranks' placements and is made as a decider
    /// alone makes it.
    #[must_use]
    pub fn at_once(self) -> bool {
        self.count > 1 && (!self.ordered || self.home)
    }

    /// Where this decider's rotations start over `size` places (round
    /// robin, exact ties, the P/D decode leg): `rank · size / count` when
    /// [`Deciders::at_once`], so that deciders counting their turns alike
    /// from one view at one instant (replicas started together, each with
    /// its first request of a burst) start `size / count` places apart
    /// instead of on the same place; otherwise 0, as for a decider alone.
    ///
    /// ```
    /// use kvroute_select::Deciders;
    /// let third = Deciders { count: 4, rank: 3, ..Deciders::ALONE };
    /// assert_eq!(third.rotation_start(8), 6);
    /// assert_eq!(third.rotate(1, 8), 7);
    /// assert_eq!(Deciders::ALONE.rotate(9, 8), 1);
    /// ```
    #[must_use]
    pub fn rotation_start(self, size: u64) -> u64 {
        if !self.at_once() {
            return 0;
        }
        self.start_among(size)
    }

    /// The place `turn` names among `size` places (0 when there are none),
    /// from this decider's [`Deciders::rotation_start`]: what a scorer of
    /// its own uses to break exact ties from [`crate::ScoreInput::turn`].
    #[must_use]
    pub fn rotate(self, turn: u64, size: u64) -> u64 {
        if size == 0 {
            return 0;
        }
        (turn % size + self.rotation_start(size)) % size
    }

    /// [`Deciders::rotate`] for a rotation blind to load (round robin): the
    /// lower ranks' placements in the view do not move it, so deciders
    /// start apart whenever there are several, in their turns too.
    #[must_use]
    pub(crate) fn rotate_blind(self, turn: u64, size: u64) -> u64 {
        if size == 0 {
            return 0;
        }
        (turn % size + self.start_among(size)) % size
    }

    /// `rank · size / count` (0 for a decider alone).
    fn start_among(self, size: u64) -> u64 {
        if self.count <= 1 || size == 0 {
            return 0;
        }
        u64::from(self.rank % self.count) * size / u64::from(self.count)
    }

    /// What this decider mixes into its pseudo-random draws: 0 alone (the
    /// seed's own sequence), a sequence of its own for every other rank.
    #[must_use]
    pub(crate) fn random_salt(self) -> u64 {
        match self.rank % self.count.max(1) {
            0 => 0,
            rank => kvroute_core::mix::splitmix64(u64::from(rank)),
        }
    }

    /// One decider: a host routing alone.
    pub const ALONE: Self = Self {
        count: 1,
        rank: 0,
        ordered: false,
        home: false,
    };
}

impl Default for Deciders {
    fn default() -> Self {
        Self::ALONE
    }
}

/// An engine's own prefill counters: uncached prompt tokens it prefilled
/// and the time those requests spent prefilling, each summed since the
/// engine started (vLLM: the `_sum`s of `vllm:request_prefill_kv_computed_tokens`
/// and `vllm:request_prefill_time_seconds`). Overlapping prefills each count
/// their time, so tokens over time is a lower bound of the engine's rate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillProgress {
    /// Uncached prompt tokens prefilled.
    pub tokens: u64,
    /// Seconds spent prefilling them, summed per request.
    pub seconds: f64,
}

/// A plain table of loads — what a host that counts its own in-flight requests
/// can hand to selection directly.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadTable {
    loads: Vec<EndpointLoad>,
}

impl LoadTable {
    /// `endpoints` zero loads.
    #[must_use]
    pub fn new(endpoints: usize) -> Self {
        Self {
            loads: vec![EndpointLoad::default(); endpoints],
        }
    }

    /// Sets the load of one endpoint (ignored for ids beyond the table).
    pub fn set(&mut self, endpoint: EndpointId, load: EndpointLoad) {
        if let Some(slot) = self.loads.get_mut(endpoint.index()) {
            *slot = load;
        }
    }

    /// Mutable access for incremental bookkeeping.
    pub fn get_mut(&mut self, endpoint: EndpointId) -> Option<&mut EndpointLoad> {
        self.loads.get_mut(endpoint.index())
    }
}

impl Load for LoadTable {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.loads
            .get(endpoint.index())
            .copied()
            .unwrap_or_default()
    }
}

impl<L: Load + ?Sized> Load for &L {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        (**self).load(endpoint)
    }

    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        (**self).charged_prefill_tokens(endpoint)
    }
    fn prefill_progress(&self, endpoint: EndpointId) -> Option<PrefillProgress> {
        (**self).prefill_progress(endpoint)
    }

    fn report(&self, endpoint: EndpointId) -> Option<EngineReport> {
        (**self).report(endpoint)
    }

    fn load_and_report(&self, endpoint: EndpointId) -> (EndpointLoad, Option<EngineReport>) {
        (**self).load_and_report(endpoint)
    }

    fn deciders(&self) -> Deciders {
        (**self).deciders()
    }
}

/// What an engine reports about its own queue (e.g. polled from its metrics
/// endpoint: vLLM `vllm:num_requests_running` / `vllm:num_requests_waiting`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineReport {
    /// Requests the engine is running.
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// KV-cache usage, 0..=1, if reported.
    pub kv_usage: Option<f64>,
    /// The engine's prefill counters, if it exports them.
    pub prefill: Option<PrefillProgress>,
    /// The engine's KV capacity in blocks, if it reports it.
    pub kv_capacity_blocks: Option<u64>,
}

/// Engine-reported load combined with this host's own in-flight accounting —
/// what keeps several gateway replicas honest: each replica counts only its
/// own requests, the engine counts everyone's.
///
/// Between two reports the combined load is the engine's figure plus what this
/// host started or finished since (`local_now − local_at_report`), never below
/// the host's own count; a report older than `max_age` is ignored. Prefill
/// tokens of requests other replicas sent are estimated from this host's own
/// mean of queued prefill tokens per request in flight, over all endpoints
/// (engines report request counts, not the prefill work still queued).
///
/// Sans-IO: the host polls and calls [`ReportedLoad::update`] with its time;
/// [`ReportedLoad::view`] composes with any local [`Load`] (as tower's `Load`
/// combinators compose).
///
/// ```
/// use std::time::Duration;
/// use kvroute_core::EndpointId;
/// use kvroute_select::{EndpointLoad, EngineReport, Load, LoadTable, ReportedLoad};
///
/// let mut local = LoadTable::new(1);
/// local.set(EndpointId(0), EndpointLoad { in_flight: 2, queued_prefill_tokens: 200 });
/// let reported = ReportedLoad::new(1, Duration::from_secs(5));
/// // The engine runs 6 requests: 4 came from other replicas.
/// reported.update(EndpointId(0), EngineReport { running: 6, ..Default::default() },
///                 local.load(EndpointId(0)), Duration::ZERO);
/// // One more of ours since the poll.
/// local.set(EndpointId(0), EndpointLoad { in_flight: 3, queued_prefill_tokens: 300 });
/// let view = reported.view(&local, Duration::from_secs(1));
/// assert_eq!(view.load(EndpointId(0)).in_flight, 7);
/// ```
#[derive(Debug)]
pub struct ReportedLoad {
    slots: Box<[ReportCell]>,
    max_age: std::time::Duration,
}

impl ReportedLoad {
    /// Reports for `endpoints` endpoints, each trusted for `max_age`.
    #[must_use]
    pub fn new(endpoints: usize, max_age: std::time::Duration) -> Self {
        Self {
            slots: (0..endpoints).map(|_| ReportCell::default()).collect(),
            max_age,
        }
    }

    /// Records a report of `endpoint` taken at `now`, with the host's own load
    /// on it at that moment.
    pub fn update(
        &self,
        endpoint: EndpointId,
        report: EngineReport,
        local_at_report: EndpointLoad,
        now: std::time::Duration,
    ) {
        if let Some(s) = self.slots.get(endpoint.index()) {
            s.set(&Reported {
                report,
                local_at_report,
                at: now,
                valid: true,
            });
        }
    }

    /// Forgets `endpoint`'s report (its engine went away).
    pub fn invalidate(&self, endpoint: EndpointId) {
        if let Some(s) = self.slots.get(endpoint.index()) {
            s.update(|r| Reported { valid: false, ..r });
        }
    }

    /// The last report of `endpoint` still fresh at `now`.
    #[must_use]
    pub fn report(&self, endpoint: EndpointId, now: std::time::Duration) -> Option<EngineReport> {
        self.fresh(endpoint, now).map(|r| r.report)
    }

    /// `local` combined with the reports, as of `now`.
    #[must_use]
    pub fn view<'a, L: Load + ?Sized>(
        &'a self,
        local: &'a L,
        now: std::time::Duration,
    ) -> CombinedLoad<'a, L> {
        CombinedLoad {
            reported: self,
            local,
            now,
            per_request: MeanCell::Own(std::cell::Cell::new(None)),
        }
    }

    /// [`ReportedLoad::view`] that keeps the host's mean queued prefill per
    /// request (read over every endpoint of `local`) in `mean`: a host that
    /// builds a view per endpoint, one instant and local view apart, computes
    /// it once for all of them instead of once per endpoint. `mean` must be
    /// empty (`None`) whenever `local` or `now` differ from the last view
    /// that filled it.
    ///
    /// ```
    /// use std::cell::Cell;
    /// use std::time::Duration;
    /// use kvroute_core::EndpointId;
    /// use kvroute_select::{EndpointLoad, EngineReport, Load, LoadTable, ReportedLoad};
    ///
    /// let mut local = LoadTable::new(2);
    /// local.set(EndpointId(0), EndpointLoad { in_flight: 1, queued_prefill_tokens: 300 });
    /// let reported = ReportedLoad::new(2, Duration::from_secs(5));
    /// let two = EngineReport { running: 2, ..Default::default() };
    /// reported.update(EndpointId(1), two, EndpointLoad::default(), Duration::ZERO);
    /// let mean = Cell::new(None);
    /// let one_view = reported.view_sharing_mean(&local, Duration::ZERO, &mean);
    /// // Two requests of other hosts, at this host's 300 tokens per request.
    /// assert_eq!(one_view.load(EndpointId(1)).queued_prefill_tokens, 600);
    /// assert_eq!(mean.get(), Some(300));
    /// ```
    #[must_use]
    pub fn view_sharing_mean<'a, L: Load + ?Sized>(
        &'a self,
        local: &'a L,
        now: std::time::Duration,
        mean: &'a std::cell::Cell<Option<u64>>,
    ) -> CombinedLoad<'a, L> {
        CombinedLoad {
            reported: self,
            local,
            now,
            per_request: MeanCell::Shared(mean),
        }
    }

    /// `local`'s queued prefill tokens per request in flight, over all
    /// endpoints.
    fn mean_prefill<L: Load + ?Sized>(&self, local: &L) -> u64 {
        let (mut tokens, mut requests) = (0u64, 0u64);
        for i in 0..self.slots.len() {
            let l = local.load(EndpointId(u32::try_from(i).unwrap_or(u32::MAX)));
            tokens = tokens.saturating_add(l.queued_prefill_tokens);
            requests += u64::from(l.in_flight);
        }
        tokens.checked_div(requests).unwrap_or(0)
    }

    /// `endpoint`'s last report if still fresh at `now` (one read of its cell).
    fn fresh(&self, endpoint: EndpointId, now: std::time::Duration) -> Option<Reported> {
        let r = self.slots.get(endpoint.index())?.get();
        (r.valid && now.saturating_sub(r.at) <= self.max_age).then_some(r)
    }

    /// `local` corrected by the fresh report `fresh`.
    fn combine(
        fresh: Option<&Reported>,
        local: EndpointLoad,
        per_request: impl FnOnce() -> u64,
    ) -> EndpointLoad {
        let Some(r) = fresh else {
            return local;
        };
        let engine = i64::from(r.report.running) + i64::from(r.report.waiting);
        let delta = i64::from(local.in_flight) - i64::from(r.local_at_report.in_flight);
        let combined = (engine + delta).max(i64::from(local.in_flight));
        let in_flight = u32::try_from(combined).unwrap_or(u32::MAX);
        let others = u64::from(in_flight - local.in_flight);
        if others == 0 {
            return EndpointLoad { in_flight, ..local };
        }
        let per_request = per_request();
        EndpointLoad {
            in_flight,
            queued_prefill_tokens: local
                .queued_prefill_tokens
                .saturating_add(others.saturating_mul(per_request)),
        }
    }
}

/// A [`Load`] that is a host's own load corrected by engine reports; see
/// [`ReportedLoad`].
#[derive(Debug)]
pub struct CombinedLoad<'a, L: ?Sized> {
    reported: &'a ReportedLoad,
    local: &'a L,
    now: std::time::Duration,
    /// This host's queued prefill tokens per request in flight: computed
    /// once per view, and only when an endpoint carries other hosts' requests.
    per_request: MeanCell<'a>,
}

/// Where a [`CombinedLoad`] keeps its per-request mean.
#[derive(Debug)]
enum MeanCell<'a> {
    Own(std::cell::Cell<Option<u64>>),
    Shared(&'a std::cell::Cell<Option<u64>>),
}

impl MeanCell<'_> {
    fn cell(&self) -> &std::cell::Cell<Option<u64>> {
        match self {
            Self::Own(c) => c,
            Self::Shared(c) => c,
        }
    }
}

impl<L: Load + ?Sized> CombinedLoad<'_, L> {
    /// This host's queued prefill tokens per request in flight (computed once).
    fn per_request(&self) -> u64 {
        let cell = self.per_request.cell();
        if let Some(v) = cell.get() {
            return v;
        }
        let v = self.reported.mean_prefill(self.local);
        cell.set(Some(v));
        v
    }
}

impl<L: Load + ?Sized> Load for CombinedLoad<'_, L> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.load_and_report(endpoint).0
    }

    /// One read of the endpoint's report for both.
    fn load_and_report(&self, endpoint: EndpointId) -> (EndpointLoad, Option<EngineReport>) {
        let fresh = self.reported.fresh(endpoint, self.now);
        let load = ReportedLoad::combine(fresh.as_ref(), self.local.load(endpoint), || {
            self.per_request()
        });
        let report = match fresh {
            Some(r) => Some(r.report),
            None => self.local.report(endpoint),
        };
        (load, report)
    }

    /// The local view's counter: engine reports carry no charges (work they
    /// add is unknown to a drain model, which treats it as such).
    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        self.local.charged_prefill_tokens(endpoint)
    }

    /// The fresh report's counters, else the local view's.
    fn prefill_progress(&self, endpoint: EndpointId) -> Option<PrefillProgress> {
        self.reported
            .report(endpoint, self.now)
            .and_then(|r| r.prefill)
            .or_else(|| self.local.prefill_progress(endpoint))
    }

    fn report(&self, endpoint: EndpointId) -> Option<EngineReport> {
        self.reported
            .report(endpoint, self.now)
            .or_else(|| self.local.report(endpoint))
    }

    fn deciders(&self) -> Deciders {
        self.local.deciders()
    }
}

impl Load for std::sync::Arc<crate::tracker::LoadTracker> {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        (**self).load(endpoint)
    }

    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        (**self).charged_prefill_tokens(endpoint)
    }
}
