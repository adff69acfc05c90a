//! The guard ladder as a sans-IO value: [`Rule::decide`] builds a [`Decision`],
//! the host connects to its [`Target`], reports failures with [`Rule::retry`] and
//! completion with [`Rule::record_receipt`].

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId, TokenId};
use kvroute_ingest::{InventoryView, Overlap};

use crate::bounded::{chain, hash_bytes, BoundedMap};
use crate::counters::MissReason;
use crate::health::Health;
use crate::keys::{KeysError, PromptInput, Request};
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
    /// Endpoints whose inventory reports a mismatched hash contract.
    mismatched: Vec<bool>,
    /// Every endpoint with an inventory is mismatched.
    all_mismatched: bool,
    /// Each endpoint's inventory clears so far (predictions made before a
    /// clear are void).
    clears: Vec<u64>,
    affinity_key: Option<u64>,
    key_miss: Option<MissReason>,
    miss: Option<MissReason>,
    target: Option<Target>,
    source: Source,
    predicted_blocks: u32,
    retries: u32,
    /// Who routes over the endpoints, as the load view says.
    deciders: crate::load::Deciders,
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
        self.slot_scratch.clear();
        fill(&mut self.overlaps, n, Overlap::default());
        fill(&mut self.excluded, n, false);
        fill(&mut self.excluded_decode, n, false);
        fill(&mut self.eligible, n, false);
        // Filled by `pick_decode` when a P/D decision needs it.
        self.decode_eligible.clear();
        fill(&mut self.loads, n, EndpointLoad::default());
        fill(&mut self.reports, n, None);
        self.prompt_tokens = 0;
        fill(&mut self.mismatched, n, false);
        fill(&mut self.clears, n, 0);
        self.all_mismatched = false;
        self.affinity_key = None;
        self.key_miss = None;
        self.miss = None;
        self.target = None;
        self.source = Source::Exhausted;
        self.predicted_blocks = 0;
        self.retries = 0;
        self.deciders = crate::load::Deciders::ALONE;
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
}

/// The key positions predicted entries use: every `stride`-th key and the
/// last. Keys are chained, so an entry at position `j` stands for the whole
/// prefix `0..=j`: recording one key in `stride` keeps the hot path's work
/// (and the lock) per decision small at the cost of crediting prefixes in
/// steps of `stride` blocks (an exact repeat of a prompt still matches whole).
fn predicted_positions(len: usize, stride: usize) -> impl Iterator<Item = usize> {
    let last = len.checked_sub(1);
    (stride - 1..len)
        .step_by(stride)
        .chain(last.filter(|l| (l + 1) % stride != 0))
}

/// A predicted entry: the endpoint and the low 32 bits of its inventory's
/// clear count when the prediction was made.
fn pack(endpoint: u32, clears: u32) -> u64 {
    (u64::from(clears) << 32) | u64::from(endpoint)
}

fn unpack(entry: u64) -> (u32, u32) {
    ((entry & 0xffff_ffff) as u32, (entry >> 32) as u32)
}

/// Folds the first `n` tokens into a 64-bit CHWBL key.
fn token_prefix_key(tokens: &[TokenId], n: usize) -> u64 {
    tokens
        .iter()
        .take(n)
        .fold(0u64, |h, t| chain(h, u64::from(*t)))
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
                self.speculate(d, now, map);
            }
        }
        self.run_ladder(
            d,
            request,
            load,
            health,
            now,
            true,
            predicted.as_deref_mut(),
        );
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
        if d.retries > self.config.thresholds.max_retries {
            d.target = None;
            d.source = Source::Exhausted;
            self.counters.exhausted();
            return None;
        }
        // A converged target has no decode leg: its only endpoint is what failed.
        let failed = if current.decode.is_none() {
            Leg::Endpoint
        } else {
            failed
        };
        match failed {
            Leg::Endpoint => {
                if let Some(x) = d.excluded.get_mut(current.endpoint.index()) {
                    *x = true;
                }
                self.run_ladder(d, request, load, health, now, false, None);
            }
            Leg::Decode => {
                if let Some(x) = current
                    .decode
                    .and_then(|e| d.excluded_decode.get_mut(e.index()))
                {
                    *x = true;
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
        d.target
    }

    /// The backend answered: `cached_tokens` is its
    /// `usage.prompt_tokens_details.cached_tokens`. Feeds predicted-vs-delivered
    /// accuracy and the contract-drift alarm; returns `true` when this receipt
    /// raised the alarm. [`Rule::record_usage`] without the engine's own
    /// prompt count.
    pub fn record_receipt(&self, d: &Decision, cached_tokens: u32) -> bool {
        self.record_usage(d, cached_tokens, None)
    }

    /// [`Rule::record_receipt`] with the engine's own `usage.prompt_tokens`
    /// from the same answer, when it sent one.
    ///
    /// A receipt claiming more cached tokens than the prompt has is refused
    /// and counted as implausible (it would skew accuracy and hide drift):
    /// more than the decision's prompt length when it is known, than the
    /// engine's own prompt count when it sent one, and in any case than
    /// [`crate::Thresholds::max_receipt_tokens`].
    pub fn record_usage(
        &self,
        d: &Decision,
        cached_tokens: u32,
        prompt_tokens: Option<u32>,
    ) -> bool {
        let Some(t) = d.target else { return false };
        let bound = [
            (d.prompt_tokens > 0).then_some(d.prompt_tokens),
            prompt_tokens,
            Some(self.config.thresholds.max_receipt_tokens),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(u32::MAX);
        if cached_tokens > bound {
            self.counters.implausible_receipt();
            tracing::debug!(rule = %self.config.name, cached_tokens, prompt_tokens = d.prompt_tokens,
                reported_prompt_tokens = ?prompt_tokens,
                "receipt claims more cached tokens than the prompt has; ignored");
            return false;
        }
        let predicted = d.predicted_cached_tokens(self.config.block_size);
        let raised = self.counters.receipt(
            t.endpoint.index(),
            u64::from(predicted),
            u64::from(cached_tokens),
            self.config.thresholds.drift_alarm_after,
        );
        if raised {
            tracing::warn!(
                rule = %self.config.name,
                endpoint = %t.endpoint,
                "predicted KV hits keep delivering zero cached tokens: hash contract drift?"
            );
        }
        raised
    }

    fn prepare_keys<V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        view: &V,
    ) {
        let n_prefix = self.config.thresholds.chwbl_prefix_tokens;
        d.affinity_key = request.session.map(|s| hash_bytes(s.as_bytes()));
        let kv = self.config.choice == Choice::KvExact;
        let result: Result<(), MissReason> = match request.prompt {
            PromptInput::Missing(m) => Err(m),
            PromptInput::Tokens([]) => Err(MissReason::EmptyPrompt),
            PromptInput::Tokens(tokens) => {
                d.prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
                d.affinity_key
                    .get_or_insert_with(|| token_prefix_key(tokens, n_prefix));
                match (&self.keys, kv, request.keys) {
                    (_, false, _) => Ok(()),
                    (None, true, _) => Err(MissReason::NoHasher),
                    // The host hashed these tokens already, under this contract.
                    (Some(_), true, Some((keys, c))) if c == &self.config.contract => {
                        d.keys.extend_from_slice(keys);
                        Ok(())
                    }
                    (Some(p), true, _) => p
                        .keys_with_extras(tokens, request.extras(), &mut d.keys)
                        .map_err(|e| {
                            tracing::debug!(rule = %self.config.name, error = %e, "prompt hashing failed");
                            match e {
                                KeysError::ExtraNotSupported { .. } => {
                                    MissReason::ExtrasUnsupported
                                }
                                KeysError::Hashing(_) => MissReason::HashError,
                            }
                        }),
                }
            }
            PromptInput::Keys {
                keys,
                contract,
                prompt_tokens,
            } => {
                d.prompt_tokens = prompt_tokens;
                if contract == &self.config.contract {
                    d.keys.extend_from_slice(keys);
                    let per_block = usize::try_from(self.config.block_size).unwrap_or(1).max(1);
                    let k = n_prefix.div_ceil(per_block).min(keys.len());
                    if let Some(key) = k.checked_sub(1).and_then(|i| keys.get(i)) {
                        d.affinity_key.get_or_insert(key.0);
                    }
                    Ok(())
                } else {
                    Err(MissReason::ContractMismatch)
                }
            }
        };
        if d.affinity_key.is_none() {
            d.affinity_key = request.text.map(|t| {
                let end = t.len().min(n_prefix.saturating_mul(4));
                hash_bytes(t.as_bytes().get(..end).unwrap_or_default())
            });
        }
        if !kv {
            return;
        }
        if let Err(miss) = result {
            d.key_miss = Some(miss);
            return;
        }
        if d.keys.is_empty() {
            d.key_miss = Some(MissReason::NoKeys);
            return;
        }
        let slots = view.endpoint_count();
        let mapped = self
            .config
            .endpoints
            .iter()
            .any(|e| e.inventory_slot.is_some_and(|s| (s as usize) < slots));
        if !mapped {
            d.key_miss = Some(MissReason::NoInventory);
            return;
        }
        d.slot_scratch.clear();
        d.slot_scratch.resize(slots, Overlap::default());
        if self.config.scorer.reads_any_position() {
            view.score(&d.keys, &mut d.slot_scratch);
        } else {
            view.score_prefix(&d.keys, &mut d.slot_scratch);
        }
        let mut slotted = 0usize;
        let mut mismatched = 0usize;
        for (((o, e), m), c) in d
            .overlaps
            .iter_mut()
            .zip(&self.config.endpoints)
            .zip(d.mismatched.iter_mut())
            .zip(d.clears.iter_mut())
        {
            let Some(slot) = e.inventory_slot.filter(|s| (*s as usize) < slots) else {
                continue;
            };
            if let Some(s) = d.slot_scratch.get(slot as usize) {
                *o = *s;
            }
            slotted += 1;
            let health = view.health(slot as usize);
            *m = health.contract_mismatch;
            *c = health.clears;
            mismatched += usize::from(*m);
        }
        d.all_mismatched = slotted > 0 && mismatched == slotted;
    }

    /// Credits each endpoint with the prompt prefix its predicted entries
    /// cover. Keys are chained (key `j` depends on every earlier block), so an
    /// entry for key `j` on endpoint `e` stands for the whole prefix `0..=j`.
    /// The walk stops at the first key no entry names.
    fn speculate(&self, d: &mut Decision, now: Duration, map: &BoundedMap<u64>) {
        if self.config.predicted.capacity == 0 || d.keys.is_empty() {
            return;
        }
        if map.len() == 0 {
            return;
        }
        let n = self.config.endpoints.len();
        let stride = self.config.predicted.stride.max(1);
        for j in predicted_positions(d.keys.len(), stride) {
            let Some(entry) = d.keys.get(j).and_then(|k| map.get(k.0, now)) else {
                break;
            };
            let (e, clears) = unpack(entry);
            // The engine dropped its cache since: the prediction is void.
            if d.clears.get(e as usize).map(|c| *c as u32) != Some(clears) {
                continue;
            }
            if d.speculative.is_empty() {
                d.speculative.resize(n, 0);
            }
            // An engine whose keys provably differ never confirms a
            // prediction: crediting it would claim hits that cannot exist.
            if d.mismatched.get(e as usize).copied().unwrap_or(false) {
                continue;
            }
            if let Some(x) = d.speculative.get_mut(e as usize) {
                *x = u32::try_from(j + 1).unwrap_or(u32::MAX);
            }
        }
    }

    /// Records that `endpoint` will hold the prompt's blocks soon, in `held`
    /// (the map the decision already locked) or else in the rule's map.
    fn predict(
        &self,
        d: &Decision,
        endpoint: EndpointId,
        now: Duration,
        held: Option<&mut BoundedMap<u64>>,
    ) {
        let cfg = &self.config.predicted;
        if cfg.capacity == 0 || d.keys.is_empty() {
            return;
        }
        let clears = d.clears.get(endpoint.index()).copied().unwrap_or(0) as u32;
        let entry = pack(endpoint.0, clears);
        let keys = &d.keys[..d.keys.len().min(cfg.max_keys_per_request)];
        let mut locked;
        let map = match held {
            Some(m) => m,
            None => {
                locked = self.predicted.lock();
                &mut *locked
            }
        };
        for j in predicted_positions(keys.len(), cfg.stride.max(1)) {
            if let Some(k) = keys.get(j) {
                map.insert(k.0, entry, now);
            }
        }
    }

    /// Recomputes loads and main-leg eligibility (not excluded, available, and a
    /// prefill role in P/D).
    fn refresh_pool<L: Load + ?Sized, H: Health + ?Sized>(
        &self,
        d: &mut Decision,
        load: &L,
        health: &H,
        now: Duration,
    ) {
        let pd = self.config.topology == Topology::PrefillDecode;
        d.deciders = load.deciders();
        for (i, e) in crate::endpoint::enumerate(&self.config.endpoints) {
            let ix = i.index();
            if let Some(l) = d.loads.get_mut(ix) {
                *l = load.load(i);
            }
            if let Some(r) = d.reports.get_mut(ix) {
                *r = load.report(i);
            }
            let ok = !d.excluded.get(ix).copied().unwrap_or(true)
                && (!pd || e.role.can_prefill())
                && health.availability(i, now).is_available();
            if let Some(x) = d.eligible.get_mut(ix) {
                *x = ok;
            }
        }
        if let Some(drain) = &self.drain {
            let eps = &self.config.endpoints;
            drain.observe(now, &mut d.loads, load, |i| {
                eps.get(i)
                    .map_or(1, crate::endpoint::Endpoint::capacity_or_one)
            });
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
        };
        let turn = self.decode_turns.fetch_add(1, Ordering::Relaxed);
        pool.least_loaded(turn)
            .and_then(|i| u32::try_from(i).ok())
            .map(EndpointId)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_ladder<L: Load + ?Sized, H: Health + ?Sized>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        load: &L,
        health: &H,
        now: Duration,
        first: bool,
        predicted: Option<&mut BoundedMap<u64>>,
    ) {
        self.refresh_pool(d, load, health, now);
        let pd = self.config.topology == Topology::PrefillDecode;
        let picked = self.pick_main(d, request, now, first);
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
    fn trie_pick(&self, eligible: &[bool], request: &Request<'_>, now: Duration) -> Option<usize> {
        let m = request.text.and_then(|t| self.trie.lock().lookup(t, now))?;
        if !eligible.get(m.endpoint.index()).copied().unwrap_or(false) {
            return None;
        }
        self.counters.trie_affinity();
        Some(m.endpoint.index())
    }

    /// The main-leg endpoint index, setting `d.source` (and KV bookkeeping).
    fn pick_main(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        now: Duration,
        first: bool,
    ) -> Option<usize> {
        let cfg = &self.config;
        let pd = cfg.topology == Topology::PrefillDecode;
        let pool = Pool {
            endpoints: &cfg.endpoints,
            eligible: &d.eligible,
            loads: &d.loads,
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
            return match checked(cfg.scorer.pick(&scoring(true))) {
                ScorePick::Winner {
                    index,
                    predicted_blocks,
                    diverted,
                } => {
                    d.predicted_blocks = predicted_blocks;
                    self.counters.hit(index, predicted_blocks, diverted);
                    Some(index)
                }
                ScorePick::Miss(_) => None,
            };
        }
        if pd {
            let eligible = |e: EndpointId| d.eligible.get(e.index()).copied().unwrap_or(false);
            if let Some(e) = request
                .session
                .and_then(|s| self.sessions.lock().get(s, now))
            {
                if eligible(e) {
                    d.source = Source::SessionAffinity;
                    self.counters.session_affinity();
                    return Some(e.index());
                }
            }
            if cfg.affinity.trie_before_kv {
                if let Some(e) = self.trie_pick(&d.eligible, request, now) {
                    d.source = Source::TrieAffinity;
                    return Some(e);
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
                    self.counters.hit(index, predicted_blocks, diverted);
                    return Some(index);
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
            if let Some(e) = self.trie_pick(&d.eligible, request, now) {
                d.source = Source::TrieAffinity;
                return Some(e);
            }
        }
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
        );
        if picked.is_some() {
            d.source = Source::Fallback(kind);
            self.counters.fallback();
        }
        picked
    }
}
