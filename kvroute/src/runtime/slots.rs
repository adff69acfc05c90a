//! Endpoint slots: assembly of the router, endpoint changes, and the rule
//! rebuilt over the slots in use.
//!
//! Slot `i` is `EndpointId(i)` everywhere: in the inventory index, the load
//! tracker, the replica tables and the rule. A removed endpoint's slot stays
//! in the rule (never available) until a new endpoint reuses it, so ids in
//! decisions in flight keep naming what they named.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvroute_engines::engine::{self, Engine, Stream};
use kvroute_engines::transport::{IndexIngest, SharedIngest, SubscriberMetrics};
use kvroute_ingest::{
    ContractAttestor, EndpointIngest, HealthCell, IngestConfig, InventoryHealth, KeyAttestor,
    Keying, SharedIndex,
};
use kvroute_select::{
    ContractId, ContractKeys, Endpoint, KeyMode, LoadTracker, PromptKeys, ReportedLoad, Role, Rule,
    RuleConfig, Topology,
};
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use super::breaker::SlotBreaker;
use super::builder::KvRouterBuilder;
use super::replicas_state::ReplicaState;
use super::status::TokenizerState;
use super::{background, followers, id, BuildError, Change, ContractSide, Settings, Shared};
use crate::admission::TokenizeAdmission;
use crate::backend::Backend;

/// What decisions read of one slot without the change lock.
#[derive(Debug)]
pub(crate) struct SlotState {
    pub(crate) present: AtomicBool,
    /// Which endpoint occupies the slot: every insert takes the next
    /// number. A generation records the epoch of each of its endpoints, so
    /// a decision or retry of an older generation never takes a reused slot
    /// for the endpoint it named, and its outcomes never reach the new
    /// endpoint's breaker or outlier state.
    pub(crate) epoch: AtomicU64,
    pub(crate) admin_down: AtomicBool,
    pub(crate) breaker: SlotBreaker,
    /// Last active probe verdict (`None` before the first probe).
    pub(crate) probe_ok: Mutex<Option<bool>>,
    pub(crate) ingest: RwLock<Option<SharedIngest>>,
    /// The slot's inventory health as its ingest publishes it: decisions
    /// read it for every endpoint without the ingest's lock, which an event
    /// batch holds while it is applied.
    pub(crate) health: Arc<HealthCell>,
    /// Health probes that failed.
    pub(crate) probe_failures: AtomicU64,
    /// Engine load polls that gave a report / failed.
    pub(crate) polls_ok: AtomicU64,
    pub(crate) polls_failed: AtomicU64,
}

/// A slot's running endpoint (only touched by changes). Dropping it stops
/// the endpoint's followers, probe and load poller.
pub(crate) struct SlotRuntime {
    pub(crate) backend: Backend,
    stop: watch::Sender<bool>,
    pub(crate) followers: Vec<(Stream, Arc<SubscriberMetrics>)>,
}

impl Drop for SlotRuntime {
    fn drop(&mut self) {
        let _ = self.stop.send_replace(true);
    }
}

impl SlotRuntime {
    /// A future that completes when the slot's endpoint goes away.
    pub(crate) fn stopped(
        stop: &watch::Sender<bool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// One rule built over the slots in use; requests keep the generation they
/// were decided in.
pub(crate) struct Generation {
    pub(crate) rule: Arc<Rule>,
    /// URL of each rule endpoint (= slot).
    pub(crate) urls: Vec<Arc<str>>,
    /// Engine of each rule endpoint (= slot): which body it takes.
    pub(crate) engines: Vec<Arc<dyn Engine>>,
    /// [`SlotState::epoch`] of each rule endpoint (= slot) when this
    /// generation was built ([`NO_EPOCH`] for a slot without one).
    pub(crate) epochs: Vec<u64>,
    /// The present endpoints' engines, one of each, and the request dialect
    /// they share: how prompts of this generation are rendered.
    pub(crate) prompt_engines: Vec<Arc<dyn Engine>>,
    pub(crate) dialect: kvroute_engines::prompt::Dialect,
}

/// The distinct engines of `backends` and their shared request dialect
/// ([`engine::prompt_dialect_of`]).
fn prompt_engines<'a>(
    backends: impl Iterator<Item = &'a Backend>,
) -> (Vec<Arc<dyn Engine>>, kvroute_engines::prompt::Dialect) {
    let mut engines: Vec<Arc<dyn Engine>> = Vec::new();
    for b in backends {
        if !engines.iter().any(|e| e.name() == b.engine.name()) {
            engines.push(Arc::clone(&b.engine));
        }
    }
    let dialect = engine::prompt_dialect_of(engines.iter());
    (engines, dialect)
}

/// A generation's epoch of a slot it has no endpoint in: matches none.
pub(crate) const NO_EPOCH: u64 = u64::MAX;

impl Generation {
    /// Whether `slot` still holds the endpoint this generation named there.
    pub(crate) fn current(&self, shared: &Shared, slot: usize) -> bool {
        let (Some(&e), Some(s)) = (self.epochs.get(slot), shared.slots.get(slot)) else {
            return false;
        };
        e != NO_EPOCH && s.epoch.load(Ordering::Acquire) == e
    }
}

fn contract_err(contract: &str, reason: impl std::fmt::Display) -> BuildError {
    BuildError::Contract {
        contract: contract.to_owned(),
        reason: reason.to_string(),
    }
}

fn contract_side(b: &KvRouterBuilder) -> Result<ContractSide, BuildError> {
    let Some(contract) = b.contract.clone() else {
        if let Some((name, block_size)) = &b.host_keys {
            return Ok(ContractSide {
                contract: None,
                id: Some(ContractId::new(name)),
                keys: None,
                block_size: *block_size,
                keying: Keying::Engine,
                attestor: None,
            });
        }
        if b.choice == kvroute_select::Choice::KvExact {
            return Err(contract_err(
                "(none)",
                "a KV-exact router needs a hash contract (KvRouter::builder)",
            ));
        }
        return Ok(ContractSide {
            contract: None,
            id: None,
            keys: None,
            block_size: 16,
            keying: Keying::Engine,
            attestor: None,
        });
    };
    let name = contract.to_string();
    let keys = Arc::new(ContractKeys::new(&contract).map_err(|e| contract_err(&name, e))?);
    // The ingest side's keying and the prompt side's key mode both come from
    // the contract, so they agree by construction.
    let keying = Keying::for_contract(&contract);
    // Engine keys are attested against the prompt side's hasher; re-keyed
    // inventories hold kvroute's own keys, nothing to attest.
    let attestor = match &keying {
        Keying::Engine => Some(Arc::new(ContractAttestor::from_hasher(
            contract.hasher().map_err(|e| contract_err(&name, e))?,
        )) as Arc<dyn KeyAttestor>),
        Keying::Rekey(_) => None,
    };
    Ok(ContractSide {
        id: Some(keys.contract().clone()),
        block_size: keys.block_size(),
        keys: Some(keys),
        contract: Some(contract),
        keying,
        attestor,
    })
}

/// A model directory must hold a tokenizer: a wrong directory is an error
/// when the router is built, not a stream of `no_tokenizer` misses.
fn check_model_dir(model: &str, dir: &std::path::Path) -> Result<(), BuildError> {
    let found = ["tokenizer.json", "tokenizer.json.gz"]
        .iter()
        .any(|f| dir.join(f).is_file());
    if found {
        Ok(())
    } else {
        Err(BuildError::Model {
            model: model.to_owned(),
            reason: format!("{} holds no tokenizer.json", dir.display()),
        })
    }
}

pub(crate) fn assemble(
    b: KvRouterBuilder,
    handle: Option<tokio::runtime::Handle>,
) -> Result<Arc<Shared>, BuildError> {
    let contract = contract_side(&b)?;
    if b.backends.len() > b.max_endpoints {
        return Err(BuildError::TooManyEndpoints(b.max_endpoints));
    }
    if b.topology == Topology::PrefillDecode
        && !(b.backends.iter().any(|e| e.role.can_prefill())
            && b.backends.iter().any(|e| e.role.can_decode()))
    {
        return Err(kvroute_select::RuleError::IncompletePrefillDecode.into());
    }
    let tokenizers = b.tokenizers.clone().unwrap_or_default();
    for (slug, dir, options) in &b.models {
        if handle.is_some() {
            check_model_dir(slug, dir)?;
        }
        tokenizers.register_with(slug.clone(), dir.clone(), options.clone());
    }
    // An adapter requested by its own name tokenizes as the router's first
    // model unless a tokenizer is staged under that name.
    if let Some((base, _, _)) = b.models.first() {
        let staged = tokenizers.models();
        for adapter in b.lora.keys() {
            if !staged.contains(adapter) {
                tokenizers.alias(adapter.clone(), base.clone());
            }
        }
    }
    // The dialect and engines are the current generation's (see `rebuild`).
    let mut options = b.options.clone();
    // Hashed with the tokenization when the keys are what the rule routes on.
    if b.choice == kvroute_select::Choice::KvExact {
        options.keys.clone_from(&contract.keys);
    }
    let n = b.max_endpoints;
    let replicas = b
        .replicas
        .as_ref()
        .map(|cfg| ReplicaState::new(cfg.clone(), n, &b.name));
    let tracker = match &replicas {
        Some(r) => LoadTracker::with_sync(n, r.origin()).wake_on_change(r.waker()),
        None => LoadTracker::new(n),
    };
    let reported = ReportedLoad::new(
        n,
        b.engine_load
            .map_or(std::time::Duration::from_secs(5), |c| c.max_age),
    );
    let settings = Settings {
        name: b.name.clone(),
        topology: b.topology,
        choice: b.choice,
        scorer: Arc::clone(&b.scorer),
        fallback: b.fallback,
        thresholds: b.thresholds,
        predicted: b.predicted,
        seed: b.seed,
        breaker: b.breaker,
    };
    let placeholder = Arc::new(Generation {
        rule: Arc::new(build_rule(
            &settings,
            &contract,
            n,
            vec![placeholder_endpoint()],
            None,
        )?),
        urls: vec![Arc::from("")],
        engines: vec![text_only()],
        epochs: vec![NO_EPOCH],
        prompt_engines: Vec::new(),
        dialect: kvroute_engines::prompt::Dialect::Vllm,
    });
    let (stop, _) = watch::channel(false);
    let shared = Arc::new(Shared {
        tokenizer_states: Mutex::new(
            b.models
                .iter()
                .map(|(s, _, _)| (s.clone(), TokenizerState::Loading))
                .collect(),
        ),
        models: b
            .models
            .iter()
            .map(|(s, d, _)| (s.clone(), d.clone()))
            .collect(),
        tokenizers,
        lora: b.lora.clone(),
        admission: b
            .shared_admission
            .clone()
            .unwrap_or_else(|| Arc::new(TokenizeAdmission::new(b.admission))),
        overload: b.overload,
        tokenize_wait: b.tokenize_wait,
        options,
        token_ids: crate::prompt::TokenIdCounters::default(),
        index: Arc::new(SharedIndex::new(n, b.index)),
        tracker: Arc::new(tracker),
        reported,
        replicas,
        burst_order: b.burst_order,
        recycled: super::recycle::Recycled::default(),
        slots: (0..n)
            .map(|_| SlotState {
                present: AtomicBool::new(false),
                epoch: AtomicU64::new(0),
                admin_down: AtomicBool::new(false),
                breaker: SlotBreaker::new(b.breaker),
                probe_ok: Mutex::new(None),
                ingest: RwLock::new(None),
                health: Arc::default(),
                probe_failures: AtomicU64::new(0),
                polls_ok: AtomicU64::new(0),
                polls_failed: AtomicU64::new(0),
            })
            .collect(),
        membership: Mutex::new(Vec::new()),
        generation: RwLock::new(placeholder),
        engine_load: b.engine_load,
        probes: b.probes.clone(),
        outliers: super::outlier::Outliers::new(n, b.outlier, b.header_timeouts),
        clock: Arc::clone(&b.clock),
        handle,
        stop,
        settings,
        contract,
    });
    {
        let mut slots = shared.membership.lock();
        for backend in b.backends {
            insert(&shared, &mut slots, backend)?;
        }
        rebuild(&shared, &slots)?;
    }
    if let Some(h) = &shared.handle {
        background::load_tokenizers(&shared, h);
        if let Some(r) = &shared.replicas {
            r.start(&shared, h)?;
        }
    }
    Ok(shared)
}

/// The engine of a slot that takes no id prompt (removed or placeholder).
fn text_only() -> Arc<dyn Engine> {
    Arc::new(engine::LlamaCpp)
}

fn placeholder_endpoint() -> Endpoint {
    Endpoint::new(String::new(), Role::Both)
}

fn build_rule(
    st: &Settings,
    contract: &ContractSide,
    capacity: usize,
    endpoints: Vec<Endpoint>,
    previous: Option<&Rule>,
) -> Result<Rule, BuildError> {
    let contract_id = contract
        .id
        .clone()
        .unwrap_or_else(|| ContractId::new("none"));
    let mut cfg = RuleConfig::kv_exact(
        &st.name,
        st.topology,
        endpoints,
        contract.block_size,
        contract_id,
    );
    cfg.choice = st.choice;
    cfg.key_mode = contract
        .keys
        .as_ref()
        .map_or(KeyMode::Engine, |k| k.key_mode());
    cfg.scorer = Arc::clone(&st.scorer);
    cfg.fallback = st.fallback;
    cfg.thresholds = st.thresholds;
    cfg.predicted = st.predicted;
    cfg.seed = st.seed;
    cfg.endpoint_capacity = capacity;
    let keys = contract.keys.clone().map(|k| k as Arc<dyn PromptKeys>);
    Ok(match previous {
        Some(p) => p.rebuild(cfg, keys)?,
        None => Rule::new(cfg, keys)?,
    })
}

/// A new rule over the slots in use, carrying the previous rule's state.
/// Its endpoint `i` is slot `i`; a removed slot keeps its last address but
/// is never available.
pub(crate) fn rebuild(shared: &Shared, slots: &[Option<SlotRuntime>]) -> Result<(), BuildError> {
    let previous = shared.current();
    let mut endpoints = Vec::with_capacity(slots.len().max(1));
    let mut urls = Vec::with_capacity(slots.len().max(1));
    let mut engines = Vec::with_capacity(slots.len().max(1));
    let mut epochs = Vec::with_capacity(slots.len().max(1));
    for (i, s) in slots.iter().enumerate() {
        epochs.push(match (s, shared.slots.get(i)) {
            (Some(_), Some(state)) => state.epoch.load(Ordering::Acquire),
            _ => NO_EPOCH,
        });
        match s {
            Some(s) => {
                let b = &s.backend;
                let mut ep = Endpoint::new(b.url.clone(), b.role)
                    .with_weight(b.weight)
                    .with_capacity(b.capacity);
                if followers::has_inventory(b, shared.contract.block_size) {
                    ep = ep.with_inventory_slot(u32::try_from(i).unwrap_or(u32::MAX));
                }
                urls.push(Arc::from(b.url.as_str()));
                engines.push(Arc::clone(&b.engine));
                endpoints.push(ep);
            }
            None => {
                let old = previous
                    .urls
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| Arc::from(""));
                endpoints.push(Endpoint::new(old.to_string(), Role::Both));
                urls.push(old);
                // Never chosen again: the text body is the safe default.
                engines.push(text_only());
            }
        }
    }
    if endpoints.is_empty() {
        endpoints.push(placeholder_endpoint());
        urls.push(Arc::from(""));
        engines.push(text_only());
        epochs.push(NO_EPOCH);
    }
    let rule = build_rule(
        &shared.settings,
        &shared.contract,
        shared.slots.len(),
        endpoints,
        Some(&previous.rule),
    )?;
    // Endpoints of another engine may have come or gone: prompts render as
    // the present ones' engines do.
    let (prompt_engines, dialect) = prompt_engines(slots.iter().flatten().map(|s| &s.backend));
    *shared.generation.write() = Arc::new(Generation {
        rule: Arc::new(rule),
        urls,
        engines,
        epochs,
        prompt_engines,
        dialect,
    });
    Ok(())
}

fn new_ingest(shared: &Shared, slot: usize, b: &Backend) -> EndpointIngest {
    let c = &shared.contract;
    let config = IngestConfig {
        // Engine blocks of another size never match the prompt side's keys:
        // counted and shown as a contract mismatch (also in re-key mode).
        expected_block_size: c.contract.as_ref().map(|c| c.block_size().get()),
        chained_keys: c
            .contract
            .as_ref()
            .is_none_or(kvroute_core::HashContract::keys_chained),
        window: followers::window(b, c.block_size),
        ..IngestConfig::default()
    };
    let ingest = EndpointIngest::new(id(slot), config, c.keying.clone()).with_name(b.url.as_str());
    match &c.attestor {
        Some(a) => ingest.with_attestor(Arc::clone(a)),
        None => ingest,
    }
}

/// Puts `b` in the lowest free slot and starts its background work (the
/// same slot on every replica that applies the same changes: the cost
/// scorer's zones are by slot).
pub(crate) fn insert(
    shared: &Arc<Shared>,
    slots: &mut Vec<Option<SlotRuntime>>,
    b: Backend,
) -> Result<usize, BuildError> {
    if member_slot(slots, &b.url).is_some() {
        return Err(BuildError::Membership(b.url, "already present"));
    }
    let slot = match slots.iter().position(Option::is_none) {
        Some(i) => i,
        None if slots.len() < shared.slots.len() => {
            slots.push(None);
            slots.len() - 1
        }
        None => return Err(BuildError::TooManyEndpoints(shared.slots.len())),
    };
    let Some(state) = shared.slots.get(slot) else {
        return Err(BuildError::TooManyEndpoints(shared.slots.len()));
    };
    let (stop, _) = watch::channel(false);
    let mut metrics = Vec::new();
    let bs = shared.contract.block_size;
    let ingest = if followers::has_inventory(&b, bs) {
        let ingest = IndexIngest::share(
            new_ingest(shared, slot, &b).with_health_cell(Arc::clone(&state.health)),
        );
        if let Some(h) = &shared.handle {
            metrics = followers::start(shared, h, &b, &ingest, &stop)?;
        } else {
            followers::check(&b, bs)?;
        }
        Some(ingest)
    } else {
        // What a KV-exact router cannot follow is refused, not ignored.
        if b.role.can_prefill() && shared.settings.choice == kvroute_select::Choice::KvExact {
            followers::check(&b, bs)?;
        }
        None
    };
    // A reused slot starts empty (its previous endpoint's keys were cleared
    // on removal) with a fresh breaker, probe verdict and load report.
    *state.ingest.write() = ingest;
    state.breaker.reset(shared.settings.breaker);
    *state.probe_ok.lock() = None;
    state.admin_down.store(false, Ordering::Release);
    for c in [&state.probe_failures, &state.polls_ok, &state.polls_failed] {
        c.store(0, Ordering::Relaxed);
    }
    shared.reported.invalidate(id(slot));
    shared.outliers.set_present(id(slot), true, shared.now());
    // Requests of the slot's previous endpoint that still run are not the
    // newcomer's load, here or as announced to the other replicas; the
    // same address back in its slot keeps them (they run on what answers
    // there).
    let previous = shared.current().urls.get(slot).cloned();
    if previous.is_some_and(|u| !u.is_empty() && !same_url(&u, &b.url)) {
        shared.tracker.retire(id(slot));
    }
    // A new endpoint in the slot: decisions of generations built before
    // (which name the slot's previous endpoint, if any) no longer take it.
    state.epoch.fetch_add(1, Ordering::AcqRel);
    state.present.store(true, Ordering::Release);
    if let Some(h) = &shared.handle {
        background::start_endpoint(shared, h, slot, &b, &stop);
    }
    tracing::info!(rule = %shared.settings.name, endpoint = %b.url, slot, "endpoint added");
    if let Some(s) = slots.get_mut(slot) {
        *s = Some(SlotRuntime {
            backend: b,
            stop,
            followers: metrics,
        });
    }
    Ok(slot)
}

fn remove(shared: &Shared, slots: &mut [Option<SlotRuntime>], url: &str) -> Result<(), BuildError> {
    let Some(slot) = member_slot(slots, url) else {
        return Err(BuildError::Membership(url.to_owned(), "not present"));
    };
    if let Some(h) = shared.slots.get(slot) {
        h.present.store(false, Ordering::Release);
        let mut ingest = h.ingest.write();
        if let Some(old) = ingest.take() {
            old.lock().retire();
        }
        // Under the slot's lock: calls naming the endpoint by URL that
        // looked it up before now find it gone ([`at_url`]).
        h.epoch.fetch_add(1, Ordering::AcqRel);
        drop(ingest);
        h.health.set(InventoryHealth::default());
    }
    // Stops its background work (SlotRuntime's drop), then forgets its keys.
    if let Some(s) = slots.get_mut(slot) {
        *s = None;
    }
    if let Err(err) = shared.index.clear_endpoint(id(slot)) {
        tracing::warn!(%err, slot, "clearing a removed endpoint's inventory");
    }
    shared.reported.invalidate(id(slot));
    // Sessions, trie nodes and predicted entries naming the slot, its
    // delivery evidence and modelled queue were this endpoint's, as was the
    // bound its engine reported.
    shared.current().rule.forget_endpoint(id(slot));
    if let Err(err) = shared.index.reset_capacity(id(slot)) {
        tracing::warn!(%err, slot, "resetting a removed endpoint's inventory bound");
    }
    // The other replicas' load there was on this endpoint: a later endpoint
    // in the slot must not inherit it (their deltas for this URL are refused
    // from now on, so it would never be corrected).
    if let Some(r) = &shared.replicas {
        r.remote().clear_endpoint(id(slot));
    }
    shared.outliers.set_present(id(slot), false, shared.now());
    tracing::info!(rule = %shared.settings.name, endpoint = url, slot, "endpoint removed");
    Ok(())
}

pub(crate) fn apply(shared: &Arc<Shared>, change: Change) -> Result<(), BuildError> {
    let mut slots = shared.membership.lock();
    match change {
        Change::Insert(b) => {
            let url = b.url.clone();
            insert(shared, &mut slots, b)?;
            if let Err(e) = rebuild(shared, &slots) {
                let _ = remove(shared, &mut slots, &url);
                return Err(e);
            }
        }
        Change::Remove(url) => {
            remove(shared, &mut slots, &url)?;
            rebuild(shared, &slots)?;
        }
    }
    Ok(())
}

fn same_url(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// The slot of the endpoint at `url` among `members` (the membership).
fn member_slot(members: &[Option<SlotRuntime>], url: &str) -> Option<usize> {
    members
        .iter()
        .position(|s| s.as_ref().is_some_and(|s| same_url(&s.backend.url, url)))
}

pub(crate) fn slot_of(shared: &Shared, url: &str) -> Option<usize> {
    member_slot(&shared.membership.lock(), url)
}

/// [`slot_of`] for each of `urls`, with the slot's epoch (for
/// [`at_epoch`]), under one look at the membership.
pub(crate) fn slots_of(shared: &Shared, urls: &[&str]) -> Vec<Option<(usize, u64)>> {
    let slots = shared.membership.lock();
    let with_epoch = |slot: usize| {
        let epoch = shared.slots.get(slot)?.epoch.load(Ordering::Acquire);
        Some((slot, epoch))
    };
    // A few names: a scan each; more: one table of the endpoints present.
    if urls.len() <= 4 {
        return urls
            .iter()
            .map(|u| member_slot(&slots, u).and_then(with_epoch))
            .collect();
    }
    let present: std::collections::HashMap<&str, usize> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((s.as_ref()?.backend.url.trim_end_matches('/'), i)))
        .collect();
    urls.iter()
        .map(|u| {
            present
                .get(u.trim_end_matches('/'))
                .copied()
                .and_then(with_epoch)
        })
        .collect()
}

/// Runs `f` with the slot of the endpoint at `url` (and its ingest, if it
/// follows events) while that endpoint stays in it; `None` when `url` is
/// not present. The slot and its epoch are read together under the
/// membership lock, and the epoch is checked again under the slot's ingest
/// lock, which a removal holds while it retires the endpoint and moves the
/// epoch on: a call racing a removal acts on the leaving endpoint before it
/// leaves, or on nothing, never on a newcomer in its slot.
pub(crate) fn at_url<T>(
    shared: &Shared,
    url: &str,
    f: impl FnOnce(usize, Option<&SharedIngest>) -> T,
) -> Option<T> {
    let (slot, epoch) = {
        let slot = member_slot(&shared.membership.lock(), url)?;
        (slot, shared.slots.get(slot)?.epoch.load(Ordering::Acquire))
    };
    at_epoch(shared, slot, epoch, f)
}

/// [`at_url`] past the lookup: `f` runs only while the slot's epoch is
/// still `epoch`.
pub(crate) fn at_epoch<T>(
    shared: &Shared,
    slot: usize,
    epoch: u64,
    f: impl FnOnce(usize, Option<&SharedIngest>) -> T,
) -> Option<T> {
    let state = shared.slots.get(slot)?;
    let guard = state.ingest.read();
    (state.epoch.load(Ordering::Acquire) == epoch).then(|| f(slot, guard.as_ref()))
}

pub(crate) fn ingest(shared: &Shared, url: &str, batch: &kvroute_ingest::EventBatch) -> bool {
    at_url(shared, url, |_, ingest| apply_batch(shared, ingest, batch)).unwrap_or(false)
}

pub(crate) fn ingest_slot(
    shared: &Shared,
    slot: usize,
    batch: &kvroute_ingest::EventBatch,
) -> bool {
    shared
        .slots
        .get(slot)
        .is_some_and(|state| apply_batch(shared, state.ingest.read().as_ref(), batch))
}

/// Applies `batch` through the slot's `ingest`; `false` when the slot
/// follows no events.
fn apply_batch(
    shared: &Shared,
    ingest: Option<&SharedIngest>,
    batch: &kvroute_ingest::EventBatch,
) -> bool {
    ingest.is_some_and(|i| {
        let _ = i.lock().apply_batch(batch, &shared.index);
        true
    })
}

pub(crate) fn set_admin_down(shared: &Shared, url: &str, down: bool) -> bool {
    at_url(shared, url, |slot, _| {
        shared.slots.get(slot).is_some_and(|s| {
            s.admin_down.store(down, Ordering::Release);
            true
        })
    })
    .unwrap_or(false)
}

/// The tracker, index and ingest of `shared` (for the followers).
pub(crate) fn index_of(shared: &Shared) -> &Arc<SharedIndex> {
    &shared.index
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvroute_engines::engine::{Engine, Sglang};
    use kvroute_engines::prompt::Dialect;

    use super::super::test_support::host_router;
    use crate::{Backend, Change};

    /// Prompts render as the present endpoints' engines do: a router built
    /// without SGLang endpoints that gets only SGLang ones renders SGLang's
    /// way, and goes back when one of another engine joins or they leave.
    #[test]
    fn the_prompt_dialect_follows_the_present_engines() {
        let router = host_router(0).build().expect("router");
        let dialect = || router.prompt_options(None).dialect;
        assert_eq!(dialect(), Dialect::Vllm);
        let sglang: Arc<dyn Engine> = Arc::new(Sglang);
        for url in ["http://s0", "http://s1"] {
            router
                .apply(Change::Insert(
                    Backend::new(Arc::clone(&sglang), url.to_owned()).host_events(),
                ))
                .expect("insert");
        }
        assert_eq!(dialect(), Dialect::Sglang);
        assert_eq!(router.prompt_options(None).engines.len(), 1);
        let other: Arc<dyn Engine> = Arc::new(super::super::test_support::HostEngine);
        router
            .apply(Change::Insert(
                Backend::new(other, "http://h".to_owned()).host_events(),
            ))
            .expect("insert");
        assert_eq!(dialect(), Dialect::Vllm);
        router
            .apply(Change::Remove("http://h".to_owned()))
            .expect("remove");
        assert_eq!(dialect(), Dialect::Sglang);
    }
}
