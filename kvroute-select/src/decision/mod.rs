//! The guard ladder as a sans-IO value: [`Rule::decide`] builds a [`Decision`],
//! the host connects to its [`Target`], reports failures with [`Rule::retry`] and
//! completion with [`Rule::record_receipt`].

use std::sync::atomic::Ordering;
use std::time::Duration;

mod explained;
mod inventory;
pub(crate) use inventory::predicted_endpoint;
mod receipt;
mod sample;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{InventoryView, Overlap};

pub use receipt::Settlement;

use crate::bounded::BoundedMap;
use crate::counters::MissReason;
use crate::explain::{Explanation, Ineligible, Reach};
use crate::health::Health;
use crate::keys::Request;
use crate::load::{EndpointLoad, EngineReport, Load};
use crate::pool::Pool;
use crate::rule::{Choice, Rule, Topology};
use crate::scoring::{ScoreInput, ScorePick};
use crate::selector::SelectorKind;

/// Where a request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// The endpoint that receives the request (the prefill endpoint in P/D).
    pub endpoint: EndpointId,
    /// The decode endpoint of a P/D decision (least loaded); `None` when converged.
    pub decode: Option<EndpointId>,
}

/// Which ladder tier produced the current target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Source {
    /// P/D session affinity.
    SessionAffinity,
    /// P/D prefix-trie affinity.
    TrieAffinity,
    /// KV-exact scoring.
    KvExact,
    /// The fallback: P/D minimum load, or the rule's selector.
    Fallback(SelectorKind),
    /// Nothing was eligible (also: no decision made yet).
    #[default]
    Exhausted,
}

/// Which leg of a request failed to connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Leg {
    /// The target's main (prefill or converged) endpoint.
    Endpoint,
    /// The P/D decode endpoint.
    Decode,
}

/// One request's routing state: its keys (computed once, reused by retries),
/// overlaps, exclusions and current target.
///
/// Its buffers are sized by the rule's endpoint count. A host that decides
/// many requests keeps one `Decision` and passes it to [`Rule::decide_into`]:
/// the buffers are reused, so steady-state decisions do not allocate.
#[derive(Clone, Debug, Default)]
pub struct Decision {
    keys: Vec<BlockKey>,
    overlaps: Vec<Overlap>,
    /// Prefix blocks predicted entries credit, per endpoint (empty if none).
    speculative: Vec<u32>,
    slot_scratch: Vec<Overlap>,
    excluded: Vec<bool>,
    excluded_decode: Vec<bool>,
    eligible: Vec<bool>,
    decode_eligible: Vec<bool>,
    loads: Vec<EndpointLoad>,
    /// The engines' own reports, per endpoint, when the host polls them.
    reports: Vec<Option<EngineReport>>,
    prompt_tokens: u32,
    /// Endpoints whose inventory reports a mismatched hash contract. Like
    /// `clears` and `gpu_blocks`, read for the scored endpoints only: the
    /// entries of endpoints a sampled decision leaves out are not its own
    /// (only the sample's are read) until a widening writes them.
    mismatched: Vec<bool>,
    /// Every scored endpoint with an inventory is mismatched.
    all_mismatched: bool,
    /// Each scored endpoint's inventory clears so far (predictions made
    /// before a clear are void); `None` where a retry's widening could not
    /// read it.
    clears: Vec<Option<u64>>,
    /// Blocks each endpoint's inventory holds in its GPU cache
    /// ([`kvroute_ingest::InventoryView::gpu_blocks`]).
    gpu_blocks: Vec<Option<u64>>,
    affinity_key: Option<u64>,
    key_miss: Option<MissReason>,
    miss: Option<MissReason>,
    target: Option<Target>,
    source: Source,
    predicted_blocks: u32,
    retries: u32,
    /// Who routes over the endpoints, as the load view says.
    deciders: crate::load::Deciders,
    /// Credited prefixes at the picks, in tokens: the account's inputs.
    reach: Reach,
    /// The explanation, when the host asked for one (kept, with its
    /// buffers, across decisions).
    explain: Option<Box<Explanation>>,
    /// The endpoints a sampled decision scores, ascending
    /// ([`crate::Thresholds::sample_size`]); empty: every endpoint.
    sampled: Vec<u32>,
    /// The sample's members as a bit set (scratch of [`sample::choose`]).
    sample_marks: Vec<u64>,
    /// Per run of [`kvroute_ingest::UNIFORM_RUN`] endpoints: the view
    /// scored them all alike ([`InventoryView::score_prefix_uniform`]).
    uniform: Vec<bool>,
}

impl Decision {
    /// An empty decision (no target) whose buffers [`Rule::decide_into`] fills
    /// and reuses.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears every field and sizes the per-endpoint buffers for `n` endpoints,
    /// keeping their capacity.
    fn reset(&mut self, n: usize) {
        fn fill<T: Copy>(v: &mut Vec<T>, n: usize, value: T) {
            v.clear();
            v.resize(n, value);
        }
        self.keys.clear();
        self.speculative.clear();
        self.sampled.clear();
        self.uniform.clear();
        self.slot_scratch.clear();
        /// Sizes `v` for `n` endpoints without clearing it: for buffers
        /// every ladder run rewrites in full (`refresh_pool`) before
        /// anything reads them. On a large fleet clearing them is a
        /// memset of several times the decision's other state.
        fn size<T: Copy>(v: &mut Vec<T>, n: usize, value: T) {
            v.truncate(n);
            v.resize(n, value);
        }
        // Written in full by `prepare_keys` (by the view itself when it
        // scores straight into them).
        size(&mut self.overlaps, n, Overlap::default());
        fill(&mut self.excluded, n, false);
        fill(&mut self.excluded_decode, n, false);
        size(&mut self.eligible, n, false);
        // Filled by `pick_decode` when a P/D decision needs it.
        self.decode_eligible.clear();
        size(&mut self.loads, n, EndpointLoad::default());
        size(&mut self.reports, n, None);
        self.prompt_tokens = 0;
        // Written for every endpoint by `prepare_keys` when it scores
        // nothing, else for every scored one by `read_scored` (and for the
        // rest when a widening reads or `unsample` forgets them).
        size(&mut self.mismatched, n, false);
        size(&mut self.clears, n, None);
        size(&mut self.gpu_blocks, n, None);
        self.all_mismatched = false;
        self.affinity_key = None;
        self.key_miss = None;
        self.miss = None;
        self.target = None;
        self.source = Source::Exhausted;
        self.predicted_blocks = 0;
        self.retries = 0;
        self.deciders = crate::load::Deciders::ALONE;
        self.reach = Reach::default();
        if let Some(x) = self.explain.as_deref_mut() {
            x.reset(n);
        }
    }

    /// The current target, `None` once nothing eligible is left.
    #[must_use]
    pub fn target(&self) -> Option<Target> {
        self.target
    }

    /// The tier that produced the current target.
    #[must_use]
    pub fn source(&self) -> Source {
        self.source
    }

    /// Why KV-exact did not decide, if it was tried and missed.
    #[must_use]
    pub fn miss(&self) -> Option<MissReason> {
        self.miss
    }

    /// The scorer's overlap figure for the current target (blocks for the
    /// overlap-count scorer, prefix blocks otherwise); 0 outside KV-exact.
    #[must_use]
    pub fn predicted_blocks(&self) -> u32 {
        self.predicted_blocks
    }

    /// Cached tokens the current target should report, from its prefix overlap.
    #[must_use]
    pub fn predicted_cached_tokens(&self, block_size: u32) -> u32 {
        let Some(t) = self.target else { return 0 };
        let prefix = self
            .overlaps
            .get(t.endpoint.index())
            .map_or(0, |o| o.prefix);
        prefix.saturating_mul(block_size).min(self.prompt_tokens)
    }

    /// The prompt's block keys.
    #[must_use]
    pub fn keys(&self) -> &[BlockKey] {
        &self.keys
    }

    /// Overlap per rule endpoint (zero where unknown), from the engines'
    /// own events only.
    #[must_use]
    pub fn overlaps(&self) -> &[Overlap] {
        &self.overlaps
    }

    /// Prefix blocks that predicted entries (this rule's recent decisions
    /// whose engine events have not arrived yet) credit to each endpoint;
    /// empty when no entry matched. Never evidence: receipts and
    /// [`Decision::predicted_cached_tokens`] read [`Decision::overlaps`] only.
    #[must_use]
    pub fn speculative_prefix(&self) -> &[u32] {
        &self.speculative
    }

    /// Uncached prompt tokens the current target is predicted to prefill —
    /// what a [`crate::LoadTracker`] charges it with.
    #[must_use]
    pub fn predicted_prefill_tokens(&self, block_size: u32) -> u32 {
        let Some(t) = self.target else { return 0 };
        let i = t.endpoint.index();
        let indexed = self.overlaps.get(i).map_or(0, |o| o.prefix);
        let spec = self.speculative.get(i).copied().unwrap_or(0);
        let cached = indexed
            .max(spec)
            .saturating_mul(block_size)
            .min(self.prompt_tokens);
        self.prompt_tokens - cached
    }

    /// Endpoints excluded by connect failures so far.
    #[must_use]
    pub fn is_excluded(&self, endpoint: EndpointId) -> bool {
        self.excluded
            .get(endpoint.index())
            .copied()
            .unwrap_or(false)
    }

    /// Retries taken.
    #[must_use]
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Prompt length in tokens (0 when unknown).
    #[must_use]
    pub fn prompt_tokens(&self) -> u32 {
        self.prompt_tokens
    }

    /// Makes the decision score every endpoint from now on. The inventory
    /// figures of the endpoints outside the sample were not read
    /// (`read_scored`): unknown for them (the cache-room term leaves them
    /// out, no prediction is recorded for them, and they do not count as
    /// mismatched).
    fn unsample(&mut self) {
        let mut next = self.sampled.iter().copied().peekable();
        for (i, ((held, clears), mismatched)) in self
            .gpu_blocks
            .iter_mut()
            .zip(self.clears.iter_mut())
            .zip(self.mismatched.iter_mut())
            .enumerate()
        {
            if next.peek().is_some_and(|s| *s as usize == i) {
                next.next();
            } else {
                (*held, *clears, *mismatched) = (None, None, false);
            }
        }
        self.sampled.clear();
    }

    /// The endpoints a sampled decision scored, in ascending index order
    /// ([`crate::Thresholds::sample_size`]); empty when it scored every
    /// endpoint (a small pool, sampling off, or a fallback, which chooses
    /// over the whole pool).
    #[must_use]
    pub fn sampled(&self) -> &[u32] {
        &self.sampled
    }
}

impl Rule {
    /// Runs the guard ladder for `request` and returns the decision; the host
    /// connects to [`Decision::target`].
    ///
    /// `view` is the inventory index (its dense ids are the endpoints'
    /// `inventory_slot`s), `load` and `health` are the host's live signals, `now`
    /// is the host's monotonic time.
    pub fn decide<V, L, H>(
        &self,
        request: &Request<'_>,
        view: &V,
        load: &L,
        health: &H,
        now: Duration,
    ) -> Decision
    where
        V: InventoryView + ?Sized,
        L: Load + ?Sized,
        H: Health + ?Sized,
    {
        let mut d = Decision::new();
        self.decide_into(&mut d, request, view, load, health, now);
        d
    }

    /// [`Rule::decide`] into a caller-owned `d`, overwriting whatever decision
    /// it held and reusing its buffers: a host that keeps one `Decision` per
    /// worker decides without allocating once the buffers have grown.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kvroute_core::BlockKey;
    /// use kvroute_select::*;
    /// let c = ContractId::new("example/bs4");
    /// let eps = vec![Endpoint::new("a:1", Role::Both).with_inventory_slot(0),
    ///                Endpoint::new("b:1", Role::Both).with_inventory_slot(1)];
    /// let rule = Rule::new(RuleConfig::kv_exact("r", Topology::Converged, eps, 4, c.clone()), None).unwrap();
    /// let mut inv = KeySetInventory::new(2);
    /// inv.store(1, [BlockKey(7)]);
    /// let (load, mut d) = (LoadTable::new(2), Decision::new());
    /// for _ in 0..3 {
    ///     let keys = [BlockKey(7)];
    ///     let req = Request::new(PromptInput::Keys { keys: &keys, contract: &c, prompt_tokens: 4 });
    ///     rule.decide_into(&mut d, &req, &inv, &load, &AlwaysAvailable, Duration::ZERO);
    ///     assert_eq!(d.target().map(|t| t.endpoint.index()), Some(1));
    /// }
    /// ```
    pub fn decide_into<V, L, H>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        view: &V,
        load: &L,
        health: &H,
        now: Duration,
    ) where
        V: InventoryView + ?Sized,
        L: Load + ?Sized,
        H: Health + ?Sized,
    {
        d.reset(self.config.endpoints.len());
        self.counters.decision();
        self.prepare_keys(d, request, view);
        let kv = self.config.choice == Choice::KvExact;
        // From reading the predicted entries to recording this decision's
        // (and its charge in the drained queue), decisions of the rule take
        // turns: two decisions that both read before either recorded would
        // each miss the other, and a burst sharing a new prefix would split
        // (a tenant's first requests at a gateway's start each went to a
        // different engine and each missed). Only this short section is
        // serialised; scoring against the index above runs in parallel.
        let mut predicted = (kv && self.config.predicted.capacity > 0 && !d.keys.is_empty())
            .then(|| self.predicted.lock());
        if d.key_miss.is_none() && kv {
            if let Some(map) = predicted.as_deref() {
                self.speculate(d, now, map, view);
            }
            self.choose_sample(d, load);
            self.read_scored(d, view);
        }
        self.run_ladder(
            d,
            request,
            load,
            health,
            now,
            true,
            predicted.as_deref_mut(),
            Some(view),
        );
        self.after_pick(d, None);
    }

    /// The host could not connect to `failed` of the current target: exclude it
    /// and return the next target. After a KV-exact pick the next target is the
    /// next best by overlap among eligible prefill endpoints — never a decode
    /// endpoint, never round robin. Keys are not recomputed.
    pub fn retry<L, H>(
        &self,
        d: &mut Decision,
        failed: Leg,
        request: &Request<'_>,
        load: &L,
        health: &H,
        now: Duration,
    ) -> Option<Target>
    where
        L: Load + ?Sized,
        H: Health + ?Sized,
    {
        let current = d.target?;
        self.counters.retry();
        d.retries = d.retries.saturating_add(1);
        // A converged target has no decode leg: its only endpoint is what failed.
        let failed = if current.decode.is_none() {
            Leg::Endpoint
        } else {
            failed
        };
        let failed_endpoint = match failed {
            Leg::Endpoint => current.endpoint,
            Leg::Decode => current.decode.unwrap_or(current.endpoint),
        };
        if d.retries > self.config.thresholds.max_retries {
            d.target = None;
            d.source = Source::Exhausted;
            self.counters.exhausted();
            self.after_pick(d, Some((failed_endpoint, failed)));
            return None;
        }
        match failed {
            // A host that failed one leg is no better for the other (an
            // endpoint may both prefill and decode): out of both for the
            // rest of this request.
            Leg::Endpoint => {
                for v in [&mut d.excluded, &mut d.excluded_decode] {
                    if let Some(x) = v.get_mut(current.endpoint.index()) {
                        *x = true;
                    }
                }
                // No view at hand: the endpoints a widening adds stay unread.
                let no_view = None::<&kvroute_ingest::SharedIndex>;
                self.run_ladder(d, request, load, health, now, false, None, no_view);
            }
            Leg::Decode => {
                if let Some(e) = current.decode {
                    if let Some(x) = d.excluded_decode.get_mut(e.index()) {
                        *x = true;
                    }
                    // Unless it is the prefill endpoint, which answered its
                    // leg and keeps it.
                    if e != current.endpoint {
                        if let Some(x) = d.excluded.get_mut(e.index()) {
                            *x = true;
                        }
                    }
                }
                self.refresh_pool(d, load, health, now);
                match self.pick_decode(d, health, now) {
                    Some(decode) => {
                        d.target = Some(Target {
                            decode: Some(decode),
                            ..current
                        });
                    }
                    None => {
                        d.target = None;
                        d.source = Source::Exhausted;
                        self.counters.exhausted();
                    }
                }
            }
        }
        self.after_pick(d, Some((failed_endpoint, failed)));
        d.target
    }

    /// Chooses the endpoints a KV-exact decision scores on a pool of more
    /// than four times [`crate::Thresholds::sample_size`] (see `sample`):
    /// converged rules whose scorer reads the cached prefix only.
    fn choose_sample<L: Load + ?Sized>(&self, d: &mut Decision, load: &L) {
        let cfg = &self.config;
        if cfg.topology != Topology::Converged
            || cfg.scorer.reads_any_position()
            || d.keys.is_empty()
        {
            return;
        }
        let n = cfg.endpoints.len();
        let size = cfg.thresholds.sample_size as usize;
        if size == 0 || n <= size.saturating_mul(4) {
            return;
        }
        let turn = self.sample_turns.fetch_add(1, Ordering::Relaxed);
        let seed = sample::seed(cfg.seed, load.deciders().rank, turn);
        sample::choose(d, n, size, seed);
    }

    /// Recomputes loads and main-leg eligibility (not excluded, available, and a
    /// prefill role in P/D) — of the sampled endpoints only, when the
    /// decision is sampled.
    fn refresh_pool<L: Load + ?Sized, H: Health + ?Sized>(
        &self,
        d: &mut Decision,
        load: &L,
        health: &H,
        now: Duration,
    ) {
        d.deciders = load.deciders();
        let visits = if d.sampled.is_empty() {
            self.config.endpoints.len()
        } else {
            d.eligible.fill(false);
            if let Some(x) = d.explain.as_deref_mut() {
                // Rows of the endpoints left out show no stale figures.
                d.loads.fill(EndpointLoad::default());
                d.reports.fill(None);
                for row in &mut x.endpoints {
                    row.ineligible = Some(Ineligible::NotSampled);
                }
            }
            d.sampled.len()
        };
        for k in 0..visits {
            let ix = d.sampled.get(k).map_or(k, |&i| i as usize);
            self.refresh_endpoint(d, ix, load, health, now);
        }
        if let Some(drain) = &self.drain {
            let eps = &self.config.endpoints;
            // The reports just read carry the engines' prefill counters.
            let reports = &d.reports;
            let progress = |i: usize| match reports.get(i).and_then(Option::as_ref) {
                Some(EngineReport {
                    prefill: Some(p), ..
                }) => Some(*p),
                _ => load.prefill_progress(EndpointId(u32::try_from(i).unwrap_or(u32::MAX))),
            };
            drain.observe(now, &mut d.loads, &d.sampled, load, progress, |i| {
                eps.get(i)
                    .map_or(1, crate::endpoint::Endpoint::capacity_or_one)
            });
        }
    }

    /// A sampled decision from here on scores the whole pool (nothing to do
    /// for one that is not sampled), reading the inventories of the
    /// endpoints it adds when the `view` is at hand (a first pick; a retry
    /// has none: they stay unknown).
    fn widen<L: Load + ?Sized, H: Health + ?Sized, V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        load: &L,
        health: &H,
        now: Duration,
        view: Option<&V>,
    ) {
        if !d.sampled.is_empty() {
            d.unsample();
            if let Some(view) = view {
                self.read_scored(d, view);
            }
            self.refresh_pool(d, load, health, now);
        }
    }

    /// [`Rule::refresh_pool`] for endpoint `ix`.
    fn refresh_endpoint<L: Load + ?Sized, H: Health + ?Sized>(
        &self,
        d: &mut Decision,
        ix: usize,
        load: &L,
        health: &H,
        now: Duration,
    ) {
        let (Some(e), Ok(id)) = (self.config.endpoints.get(ix), u32::try_from(ix)) else {
            return;
        };
        let i = EndpointId(id);
        let pd = self.config.topology == Topology::PrefillDecode;
        let (l, r) = load.load_and_report(i);
        if let Some(slot) = d.loads.get_mut(ix) {
            *slot = l;
        }
        if let Some(slot) = d.reports.get_mut(ix) {
            *slot = r;
        }
        let excluded = d.excluded.get(ix).copied().unwrap_or(true);
        let role = !pd || e.role.can_prefill();
        let ok = !excluded && role && {
            let a = health.availability(i, now);
            if let Some(x) = d.explain.as_deref_mut() {
                if let Some(row) = x.endpoints.get_mut(ix) {
                    row.ineligible = (!a.is_available()).then_some(Ineligible::Unavailable(a));
                }
            }
            a.is_available()
        };
        if let Some(x) = d.eligible.get_mut(ix) {
            *x = ok;
        }
        if let Some(row) = d
            .explain
            .as_deref_mut()
            .and_then(|x| x.endpoints.get_mut(ix))
        {
            if excluded {
                row.ineligible = Some(Ineligible::ConnectFailed);
            } else if !role {
                row.ineligible = Some(Ineligible::DecodeOnly);
            }
        }
    }

    fn pick_decode<H: Health + ?Sized>(
        &self,
        d: &mut Decision,
        health: &H,
        now: Duration,
    ) -> Option<EndpointId> {
        let excluded = &d.excluded_decode;
        d.decode_eligible.clear();
        d.decode_eligible
            .extend(
                crate::endpoint::enumerate(&self.config.endpoints).map(|(i, e)| {
                    e.role.can_decode()
                        && !excluded.get(i.index()).copied().unwrap_or(true)
                        && health.availability(i, now).is_available()
                }),
            );
        let pool = Pool {
            endpoints: &self.config.endpoints,
            eligible: &d.decode_eligible,
            loads: &d.loads,
            sampled: &[],
        };
        let turn = self.decode_turns.fetch_add(1, Ordering::Relaxed);
        pool.least_loaded(turn, d.deciders)
            .and_then(|i| u32::try_from(i).ok())
            .map(EndpointId)
    }

    /// Picks the target. `view` is the inventory view of a first pick
    /// (`None` for a retry).
    #[allow(clippy::too_many_arguments)]
    fn run_ladder<L: Load + ?Sized, H: Health + ?Sized, V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        load: &L,
        health: &H,
        now: Duration,
        first: bool,
        predicted: Option<&mut BoundedMap<u64>>,
        view: Option<&V>,
    ) {
        self.refresh_pool(d, load, health, now);
        let eligible = |i: &u32| d.eligible.get(*i as usize).copied().unwrap_or(false);
        if !d.sampled.iter().any(eligible) {
            // Nothing of the sample can take the request (down, excluded):
            // the decision is made over the whole pool.
            self.widen(d, load, health, now, view);
        }
        self.reach_candidates(d, first);
        let pd = self.config.topology == Topology::PrefillDecode;
        let mut main = self.pick_main(d, request, now, first);
        if matches!(main, Main::Picked(None))
            && !first
            && d.source == Source::KvExact
            && !d.sampled.is_empty()
        {
            // A retry that found the sample exhausted: the rest of the pool
            // is next, still by KV-exact.
            self.widen(d, load, health, now, view);
            self.reach_candidates(d, first);
            main = self.pick_main(d, request, now, first);
        }
        let picked = match main {
            Main::Picked(i) => i,
            Main::Fallback => {
                // The fallback selectors (CHWBL's ring above all) choose
                // over the whole pool, never over a sample.
                self.widen(d, load, health, now, view);
                self.pick_fallback(d, first)
            }
        };
        if picked.is_none() || d.source != Source::KvExact {
            d.predicted_blocks = 0;
        }
        let Some(index) = picked.and_then(|i| u32::try_from(i).ok()) else {
            d.target = None;
            d.source = Source::Exhausted;
            self.counters.exhausted();
            return;
        };
        let endpoint = EndpointId(index);
        let decode = if pd {
            match self.pick_decode(d, health, now) {
                Some(e) => Some(e),
                None => {
                    d.target = None;
                    d.source = Source::Exhausted;
                    self.counters.exhausted();
                    return;
                }
            }
        } else {
            None
        };
        d.target = Some(Target { endpoint, decode });
        if let Some(drain) = &self.drain {
            let cap = self
                .config
                .endpoints
                .get(endpoint.index())
                .map_or(1, crate::endpoint::Endpoint::capacity_or_one);
            let tokens = d.predicted_prefill_tokens(self.config.block_size);
            drain.charge(endpoint.index(), tokens, now, cap);
        }
        if let Some(b) = self.burst.as_ref().filter(|_| first) {
            b.lock()
                .charged(d.predicted_prefill_tokens(self.config.block_size));
        }
        if self.config.choice == Choice::KvExact {
            self.predict(d, endpoint, now, predicted);
        }
        if pd {
            if let Some(s) = request.session {
                self.sessions.lock().remember(s, endpoint, now);
            }
            if let Some(t) = request.text {
                self.trie.lock().remember(t, endpoint, now);
            }
        }
    }

    /// P/D prefix-trie affinity: the endpoint that prefilled most of this
    /// prompt's text recently, if eligible.
    fn trie_pick(
        &self,
        eligible: &[bool],
        request: &Request<'_>,
        now: Duration,
        first: bool,
    ) -> Option<usize> {
        let m = request.text.and_then(|t| self.trie.lock().lookup(t, now))?;
        if !eligible.get(m.endpoint.index()).copied().unwrap_or(false) {
            return None;
        }
        if first {
            self.counters.trie_affinity();
        }
        Some(m.endpoint.index())
    }

    /// The main-leg endpoint index, setting `d.source` (and KV bookkeeping),
    /// or that the fallback selector decides.
    fn pick_main(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        now: Duration,
        first: bool,
    ) -> Main {
        let cfg = &self.config;
        let pd = cfg.topology == Topology::PrefillDecode;
        let pool = Pool {
            endpoints: &cfg.endpoints,
            eligible: &d.eligible,
            loads: &d.loads,
            sampled: &d.sampled,
        };
        let tie_turn = if cfg.choice == Choice::KvExact {
            self.tie_turns.fetch_add(1, Ordering::Relaxed)
        } else {
            0
        };
        let burst = match (&self.burst, cfg.scorer.burst_window()) {
            (Some(b), Some(window)) if first => b.lock().decision(now, window),
            _ => crate::scoring::BurstStats::default(),
        };
        let scoring = |retry| ScoreInput {
            pool,
            overlaps: &d.overlaps,
            speculative: &d.speculative,
            reports: &d.reports,
            gpu_blocks: &d.gpu_blocks,
            keys: &d.keys,
            prompt_tokens: d.prompt_tokens,
            block_size: cfg.block_size,
            min_blocks: cfg.thresholds.min_overlap_blocks.max(1),
            retry,
            turn: tie_turn,
            deciders: d.deciders,
            burst,
            now,
        };
        // A scorer may only name an eligible endpoint: anything else (a
        // host's own scorer gone wrong) is treated as no pick.
        let checked = |pick: ScorePick| match pick {
            ScorePick::Winner { index, .. } if !d.eligible.get(index).copied().unwrap_or(false) => {
                tracing::warn!(rule = %cfg.name, scorer = cfg.scorer.name(), index,
                    "scorer picked an endpoint that is not a candidate; ignored");
                ScorePick::Miss(MissReason::AllCandidatesFiltered)
            }
            other => other,
        };
        // A retry after a KV-exact pick stays in the tier: next best by overlap.
        if !first && d.source == Source::KvExact {
            return Main::Picked(match checked(cfg.scorer.pick(&scoring(true))) {
                ScorePick::Winner {
                    index,
                    predicted_blocks,
                    diverted,
                } => {
                    d.predicted_blocks = predicted_blocks;
                    d.reach.diverted = diverted;
                    explained::explain_pick(
                        &*cfg.scorer,
                        &scoring(true),
                        d.explain.as_deref_mut(),
                        &mut d.reach,
                        index,
                    );
                    // Once per decision (a retry's pick is the same decision).
                    if first {
                        self.counters.hit(index, predicted_blocks, diverted);
                    }
                    Some(index)
                }
                ScorePick::Miss(_) => None,
            });
        }
        if pd {
            let eligible = |e: EndpointId| d.eligible.get(e.index()).copied().unwrap_or(false);
            if let Some(e) = request
                .session
                .and_then(|s| self.sessions.lock().get(s, now))
            {
                if eligible(e) {
                    d.source = Source::SessionAffinity;
                    if first {
                        self.counters.session_affinity();
                    }
                    return Main::Picked(Some(e.index()));
                }
            }
            if cfg.affinity.trie_before_kv {
                if let Some(e) = self.trie_pick(&d.eligible, request, now, first) {
                    d.source = Source::TrieAffinity;
                    return Main::Picked(Some(e));
                }
            }
        }
        if cfg.choice == Choice::KvExact {
            let pick = match d.key_miss {
                Some(miss) => ScorePick::Miss(miss),
                None => match checked(cfg.scorer.pick(&scoring(false))) {
                    // Nothing matched because no engine hashes like the rule.
                    ScorePick::Miss(MissReason::ZeroOverlap) if d.all_mismatched => {
                        ScorePick::Miss(MissReason::ContractMismatch)
                    }
                    other => other,
                },
            };
            match pick {
                ScorePick::Winner {
                    index,
                    predicted_blocks,
                    diverted,
                } => {
                    d.source = Source::KvExact;
                    d.predicted_blocks = predicted_blocks;
                    d.reach.diverted = diverted;
                    explained::explain_pick(
                        &*cfg.scorer,
                        &scoring(false),
                        d.explain.as_deref_mut(),
                        &mut d.reach,
                        index,
                    );
                    // Once per decision (a retry's pick is the same decision).
                    if first {
                        self.counters.hit(index, predicted_blocks, diverted);
                    }
                    return Main::Picked(Some(index));
                }
                ScorePick::Miss(reason) => {
                    if d.miss.is_none() {
                        self.counters.miss(reason);
                    }
                    d.miss = Some(reason);
                }
            }
        }
        // The approximate trie decides only what the exact signal could not.
        if pd && !cfg.affinity.trie_before_kv {
            if let Some(e) = self.trie_pick(&d.eligible, request, now, first) {
                d.source = Source::TrieAffinity;
                return Main::Picked(Some(e));
            }
        }
        Main::Fallback
    }

    /// The rule's fallback selector over the eligible endpoints.
    fn pick_fallback(&self, d: &mut Decision, first: bool) -> Option<usize> {
        let cfg = &self.config;
        let pd = cfg.topology == Topology::PrefillDecode;
        // Fallbacks choose over the whole pool (see `run_ladder`).
        let pool = Pool {
            endpoints: &cfg.endpoints,
            eligible: &d.eligible,
            loads: &d.loads,
            sampled: &[],
        };
        let kind = match (cfg.choice, pd) {
            (Choice::RoundRobin, _) => SelectorKind::RoundRobin,
            (Choice::ContentAffinity, _) => SelectorKind::Chwbl,
            (Choice::KvExact, true) => SelectorKind::LeastPrefill,
            (Choice::KvExact, false) => cfg.fallback,
        };
        let picked = self.selector.select(
            kind,
            &pool,
            d.affinity_key,
            cfg.thresholds.chwbl_load_factor,
            d.deciders,
        );
        if picked.is_some() {
            d.source = Source::Fallback(kind);
            if first {
                self.counters.fallback();
            }
        }
        picked
    }
}

/// What [`Rule::pick_main`] leaves to the caller.
enum Main {
    /// A tier before the fallback decided (`None`: nothing was left).
    Picked(Option<usize>),
    /// The fallback selector decides.
    Fallback,
}
