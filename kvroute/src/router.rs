//! [`KvRouter`]: one rule, its inventories and subscribers, built from one
//! contract and a list of [`Backend`]s; [`Pick`]: one request's decision with
//! its load charge and retry.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_core::{EndpointId, HashContract};
use kvroute_engines::prompt::TokenizerPool;
use kvroute_engines::transport::{EngineKind, IndexIngest, MetricsSnapshot, SharedIngest};
use kvroute_engines::ApiKind;
use kvroute_ingest::{ContractAttestor, ContractStatus, KeyAttestor};
use kvroute_ingest::{
    EndpointIngest, IndexConfig, IngestConfig, InventoryHealth, InventoryView, Keying, Overlap,
    SharedIndex,
};
use kvroute_ingest::{RestartPolicy, SeqWindowConfig};
use kvroute_select::{
    AdminState, Availability, BreakerConfig, Choice, CircuitBreaker, ContractKeys,
    CountersSnapshot, Decision, Endpoint, Health, Leg, Load, LoadGuard, LoadTracker, PromptKeys,
    Request, Role, Rule, RuleConfig, Scorer, SelectorKind, Target, Thresholds, Topology,
};
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::admission::{AdmissionLimits, AdmissionSnapshot, TokenizeAdmission, TokenizeOverload};
use crate::backend::Backend;
use crate::prompt::{
    dialect_of, prepare_admitted, KeepText, PreparedPrompt, PromptHost, PromptOptions,
    TokenIdCounters, TokenIdSnapshot,
};
use crate::receipt::{BodyKind, OnReceipt, Receipt, ReceiptBody, ReceiptTracker};

/// Why a router could not be built or changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The contract has no prompt-side hasher here.
    #[error("hash contract {contract}: {reason}")]
    Contract {
        /// The contract.
        contract: String,
        /// Why.
        reason: String,
    },
    /// The rule refused the configuration (no endpoints, P/D without a prefill
    /// or decode endpoint, ...).
    #[error(transparent)]
    Rule(#[from] kvroute_select::RuleError),
    /// An endpoint's events cannot be followed (bad endpoint string, llama.cpp,
    /// a transport this build lacks).
    #[error("endpoint {url}: {reason}")]
    Endpoint {
        /// The endpoint's URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// More endpoints than [`KvRouterBuilder::max_endpoints`].
    #[error("at most {0} endpoints (KvRouterBuilder::max_endpoints)")]
    TooManyEndpoints(usize),
    /// An endpoint URL given twice, or removed without being present.
    #[error("endpoint {0}: {1}")]
    Membership(String, &'static str),
    /// No tokio runtime to spawn subscribers on.
    #[error("spawn() must be called inside a tokio runtime (or use spawn_on)")]
    NoRuntime,
}

/// One change of the endpoint set, as tower's `discover::Change`.
#[derive(Clone, Debug)]
pub enum Change {
    /// A new endpoint: its inventory slot is allocated and its subscribers start.
    Insert(Backend),
    /// The endpoint with this URL leaves: its subscribers stop, its inventory
    /// is cleared, and it is never chosen again (requests in flight finish).
    Remove(String),
}

/// Builds a [`KvRouter`]; see [`KvRouter::builder`].
#[derive(Debug)]
#[must_use]
pub struct KvRouterBuilder {
    contract: HashContract,
    name: String,
    models: Vec<(String, std::path::PathBuf)>,
    backends: Vec<Backend>,
    topology: Topology,
    choice: Choice,
    scorer: Scorer,
    fallback: SelectorKind,
    thresholds: Thresholds,
    breaker: BreakerConfig,
    options: PromptOptions,
    max_endpoints: usize,
    index: IndexConfig,
    admission: AdmissionLimits,
    overload: TokenizeOverload,
    tokenize_wait: Duration,
}

/// Production defaults: 1 M characters of prompt text, 128 Ki tokens, 64
/// endpoint slots, `stream_options.include_usage` added to streamed requests,
/// at most as many tokenizations at once as CPUs (at least 2) holding at most
/// 8 MiB of request bytes, and a request finding no room waiting up to 250 ms
/// for it before it is routed without KV ([`TokenizeOverload::Wait`]) — the
/// gateway's defaults.
impl KvRouterBuilder {
    /// A rule name (metrics label; default `kvroute`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A model the router tokenizes for: `dir` holds `tokenizer.json` (or
    /// `.json.gz`) and `tokenizer_config.json`, whose `chat_template` renders
    /// chat requests (`chat_template.jinja` / `.json` in `dir` win over it, as
    /// in transformers). `slug` is the body's `model`.
    pub fn model(mut self, slug: impl Into<String>, dir: impl Into<std::path::PathBuf>) -> Self {
        self.models.push((slug.into(), dir.into()));
        self
    }

    /// An endpoint.
    pub fn endpoint(mut self, backend: Backend) -> Self {
        self.backends.push(backend);
        self
    }

    /// Converged (default) or prefill/decode.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// KV-exact (default), round robin or content affinity.
    pub fn choice(mut self, choice: Choice) -> Self {
        self.choice = choice;
        self
    }

    /// The KV-exact scorer (default: the cost scorer).
    pub fn scorer(mut self, scorer: Scorer) -> Self {
        self.scorer = scorer;
        self
    }

    /// The converged miss selector (default: least prefill).
    pub fn fallback(mut self, fallback: SelectorKind) -> Self {
        self.fallback = fallback;
        self
    }

    /// Numeric knobs (minimum overlap, retries, CHWBL, drift alarm).
    pub fn thresholds(mut self, thresholds: Thresholds) -> Self {
        self.thresholds = thresholds;
        self
    }

    /// Circuit breaker of every endpoint, fed by [`Pick::retry`] and
    /// [`Pick::connected`].
    pub fn breaker(mut self, breaker: BreakerConfig) -> Self {
        self.breaker = breaker;
        self
    }

    /// Most prompt characters tokenized per request (longer: a
    /// `prompt_too_long` miss, routed by the fallback).
    pub fn max_prompt_chars(mut self, chars: usize) -> Self {
        self.options.max_prompt_chars = chars;
        self
    }

    /// Most prompt tokens hashed per request.
    pub fn max_prompt_tokens(mut self, tokens: usize) -> Self {
        self.options.max_prompt_tokens = tokens;
        self
    }

    /// Endpoint slots the inventory index and load tracker are sized for:
    /// the most endpoints present at once, including ones added later.
    pub fn max_endpoints(mut self, n: usize) -> Self {
        self.max_endpoints = n.max(1);
        self
    }

    /// The inventory index settings (per-endpoint capacity, shards).
    pub fn index(mut self, config: IndexConfig) -> Self {
        self.index = config;
        self
    }

    /// Most tokenizations running at once across every request (default: the
    /// CPU count, at least 2). A request beyond it follows
    /// [`KvRouterBuilder::tokenize_overload`]. 0 is taken as 1.
    pub fn max_concurrent_tokenizations(mut self, n: usize) -> Self {
        self.admission.max_count = n;
        self
    }

    /// Most request-body bytes being parsed and tokenized at once (default 8
    /// MiB: tokenizing costs about 280 bytes of memory per prompt byte, so
    /// this bounds the tokenizers near 2.3 GB whatever the CPU count). A
    /// larger body is charged this much: it runs alone. 0 is taken as 1.
    pub fn max_tokenize_bytes_in_flight(mut self, bytes: usize) -> Self {
        self.admission.max_bytes = bytes;
        self
    }

    /// What a request does when tokenization is at either bound: wait up to
    /// [`KvRouterBuilder::tokenize_wait`] for room (default: an ordinary burst
    /// of normal prompts waits a few ms rather than losing KV routing), or
    /// skip KV routing at once (a `tokenize_overloaded` miss routed by the
    /// fallback). A wait that runs out skips too.
    pub fn tokenize_overload(mut self, overload: TokenizeOverload) -> Self {
        self.overload = overload;
        self
    }

    /// Longest wait for tokenization room under [`TokenizeOverload::Wait`]
    /// (default 250 ms).
    pub fn tokenize_wait(mut self, wait: Duration) -> Self {
        self.tokenize_wait = wait;
        self
    }

    /// Whether streamed requests get `stream_options.include_usage` (default
    /// `true`; see [`crate::receipt`]). Off: streamed receipts exist only for
    /// clients that ask for usage themselves.
    pub fn include_usage(mut self, on: bool) -> Self {
        self.options.include_usage = on;
        self
    }

    /// Whether `/v1/completions` requests whose `prompt` is one string are
    /// forwarded with `prompt` replaced by the token ids kvroute computed, so
    /// the engine does not tokenize it again (default `false`). Only where
    /// provably the same request to the target's engine (vLLM, SGLang; not
    /// with `echo`, `suffix`, `truncate_prompt_tokens`, ...: see
    /// [`crate::prompt`]); every other request goes as text, counted by
    /// reason in [`KvRouter::token_id_counters`].
    pub fn forward_token_ids(mut self, on: bool) -> Self {
        self.options.forward_token_ids = on;
        self
    }

    /// Builds the router and starts every endpoint's subscribers on the
    /// current tokio runtime (they keep retrying until their engine is up).
    ///
    /// # Errors
    /// [`BuildError`]; [`BuildError::NoRuntime`] outside a runtime.
    pub fn spawn(self) -> Result<KvRouter, BuildError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?;
        self.spawn_on(handle)
    }

    /// [`KvRouterBuilder::spawn`] on the runtime behind `handle`.
    ///
    /// # Errors
    /// [`BuildError`].
    pub fn spawn_on(self, handle: tokio::runtime::Handle) -> Result<KvRouter, BuildError> {
        let contract_err = |reason: String| BuildError::Contract {
            contract: self.contract.to_string(),
            reason,
        };
        let keys =
            Arc::new(ContractKeys::new(&self.contract).map_err(|e| contract_err(e.to_string()))?);
        // The ingest side's keying and the prompt side's key mode both come
        // from the contract, so they agree by construction.
        let keying = Keying::for_contract(&self.contract);
        // Engine keys are attested against the prompt side's hasher; re-keyed
        // inventories hold kvroute's own keys, nothing to attest.
        let attestor = match &keying {
            Keying::Engine => Some(Arc::new(ContractAttestor::from_hasher(
                self.contract
                    .hasher()
                    .map_err(|e| contract_err(e.to_string()))?,
            )) as Arc<dyn KeyAttestor>),
            Keying::Rekey(_) => None,
        };
        if self.backends.len() > self.max_endpoints {
            return Err(BuildError::TooManyEndpoints(self.max_endpoints));
        }
        let tokenizers = TokenizerPool::new();
        for (slug, dir) in &self.models {
            tokenizers.register(slug.clone(), dir.clone());
        }
        let mut options = self.options;
        options.dialect = dialect_of(self.backends.iter().map(|b| b.engine));
        // Hashed with the tokenization when the keys are what the rule routes on.
        if self.choice == Choice::KvExact {
            options.keys = Some(Arc::clone(&keys));
        }
        let n = self.max_endpoints;
        let shared = Arc::new(Shared {
            block_size: keys.block_size(),
            keys,
            contract: self.contract,
            keying,
            attestor,
            tokenizers,
            admission: Arc::new(TokenizeAdmission::new(self.admission)),
            overload: self.overload,
            tokenize_wait: self.tokenize_wait,
            options,
            token_ids: TokenIdCounters::default(),
            index: Arc::new(SharedIndex::new(n, self.index)),
            tracker: Arc::new(LoadTracker::new(n)),
            health: (0..n)
                .map(|_| SlotHealth {
                    present: AtomicBool::new(false),
                    breaker: Mutex::new(CircuitBreaker::new(self.breaker)),
                    ingest: RwLock::new(None),
                })
                .collect(),
            slots: Mutex::new(Vec::new()),
            settings: Settings {
                name: self.name,
                topology: self.topology,
                choice: self.choice,
                scorer: self.scorer,
                fallback: self.fallback,
                thresholds: self.thresholds,
            },
            generation: RwLock::new(None),
            generations: AtomicU64::new(0),
            epoch: Instant::now(),
            handle,
        });
        {
            let mut slots = shared.slots.lock();
            for b in self.backends {
                shared.insert(&mut slots, b)?;
            }
            shared.rebuild(&slots)?;
        }
        Ok(KvRouter { shared })
    }
}

struct Settings {
    name: String,
    topology: Topology,
    choice: Choice,
    scorer: Scorer,
    fallback: SelectorKind,
    thresholds: Thresholds,
}

/// What decisions read of one slot without the change lock.
struct SlotHealth {
    present: AtomicBool,
    breaker: Mutex<CircuitBreaker>,
    ingest: RwLock<Option<SharedIngest>>,
}

/// A slot's running endpoint (only touched by changes).
struct SlotRuntime {
    backend: Backend,
    stop: watch::Sender<bool>,
    metrics: Vec<Arc<kvroute_engines::transport::SubscriberMetrics>>,
}

impl Drop for SlotRuntime {
    fn drop(&mut self) {
        let _ = self.stop.send_replace(true);
    }
}

/// One rule built over the slots present at a change; requests keep the
/// generation they were decided in.
struct Generation {
    rule: Rule,
    /// URL of each rule endpoint (= slot).
    urls: Vec<Arc<str>>,
    /// Engine of each rule endpoint (= slot): which body it takes.
    engines: Vec<EngineKind>,
}

struct Shared {
    keys: Arc<ContractKeys>,
    contract: HashContract,
    block_size: u32,
    keying: Keying,
    attestor: Option<Arc<dyn KeyAttestor>>,
    tokenizers: TokenizerPool,
    admission: Arc<TokenizeAdmission>,
    overload: TokenizeOverload,
    tokenize_wait: Duration,
    options: PromptOptions,
    /// Requests forwarded as token ids / kept as text by reason.
    token_ids: TokenIdCounters,
    index: Arc<SharedIndex>,
    tracker: Arc<LoadTracker>,
    health: Box<[SlotHealth]>,
    /// `slots[i]`: the endpoint in slot `i` (= `EndpointId(i)`), `None` once removed.
    slots: Mutex<Vec<Option<SlotRuntime>>>,
    settings: Settings,
    generation: RwLock<Option<Arc<Generation>>>,
    generations: AtomicU64,
    epoch: Instant,
    handle: tokio::runtime::Handle,
}

fn id(slot: usize) -> EndpointId {
    EndpointId(u32::try_from(slot).unwrap_or(u32::MAX))
}

impl Shared {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn endpoint_err(url: &str, reason: impl std::fmt::Display) -> BuildError {
        BuildError::Endpoint {
            url: url.to_owned(),
            reason: reason.to_string(),
        }
    }

    /// Puts `b` in the lowest free slot and starts its subscribers.
    fn insert(&self, slots: &mut Vec<Option<SlotRuntime>>, b: Backend) -> Result<(), BuildError> {
        if slots.iter().flatten().any(|s| s.backend.url == b.url) {
            return Err(BuildError::Membership(b.url, "already present"));
        }
        let slot = match slots.iter().position(Option::is_none) {
            Some(i) => i,
            None if slots.len() < self.health.len() => {
                slots.push(None);
                slots.len() - 1
            }
            None => return Err(BuildError::TooManyEndpoints(self.health.len())),
        };
        let (stop, _) = watch::channel(false);
        let mut metrics = Vec::new();
        let ingest = if b.has_inventory() {
            let ingest = IndexIngest::share(self.new_ingest(slot, &b));
            self.start_subscribers(&b, &ingest, &stop, &mut metrics)?;
            Some(ingest)
        } else {
            None
        };
        let Some(h) = self.health.get(slot) else {
            return Err(BuildError::TooManyEndpoints(self.health.len()));
        };
        // A reused slot starts empty (its previous endpoint's keys were
        // cleared on removal) with a fresh breaker.
        *h.ingest.write() = ingest;
        h.breaker.lock().on_success();
        h.present.store(true, Ordering::Release);
        tracing::info!(rule = %self.settings.name, endpoint = %b.url, slot, "endpoint added");
        if let Some(s) = slots.get_mut(slot) {
            *s = Some(SlotRuntime {
                backend: b,
                stop,
                metrics,
            });
        }
        Ok(())
    }

    fn remove(&self, slots: &mut [Option<SlotRuntime>], url: &str) -> Result<(), BuildError> {
        let Some(slot) = slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.backend.url == url))
        else {
            return Err(BuildError::Membership(url.to_owned(), "not present"));
        };
        if let Some(h) = self.health.get(slot) {
            h.present.store(false, Ordering::Release);
            *h.ingest.write() = None;
        }
        // Stops its subscribers (SlotRuntime's drop), then forgets its keys.
        if let Some(s) = slots.get_mut(slot) {
            *s = None;
        }
        if let Err(err) = self.index.clear_endpoint(id(slot)) {
            tracing::warn!(%err, slot, "clearing a removed endpoint's inventory");
        }
        tracing::info!(rule = %self.settings.name, endpoint = url, slot, "endpoint removed");
        Ok(())
    }

    fn new_ingest(&self, slot: usize, b: &Backend) -> EndpointIngest {
        let window = if b.engine == EngineKind::TensorRtLlm {
            SeqWindowConfig::destructive_drain()
        } else if b.replay.is_some() {
            // A detected restart replays the new process's buffer from 0.
            SeqWindowConfig {
                on_restart: RestartPolicy::Replay,
                ..SeqWindowConfig::default()
            }
        } else {
            SeqWindowConfig::default()
        };
        let config = IngestConfig {
            // Engine blocks of another size never match the prompt side's keys.
            expected_block_size: Some(self.block_size),
            window,
            chained_keys: self.contract.keys_chained(),
            ..IngestConfig::default()
        };
        let ingest =
            EndpointIngest::new(id(slot), config, self.keying.clone()).with_name(b.url.as_str());
        match &self.attestor {
            Some(a) => ingest.with_attestor(Arc::clone(a)),
            None => ingest,
        }
    }

    #[cfg(any(feature = "zmq", feature = "trtllm-http"))]
    fn stopped(
        stop: &watch::Sender<bool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    // Without the transports `b`, `ingest` and `stop` go unused and `metrics`
    // is never pushed to (then a slice would do).
    #[cfg_attr(
        not(all(feature = "zmq", feature = "trtllm-http")),
        allow(unused_variables, clippy::ptr_arg)
    )]
    fn start_subscribers(
        &self,
        b: &Backend,
        ingest: &SharedIngest,
        stop: &watch::Sender<bool>,
        metrics: &mut Vec<Arc<kvroute_engines::transport::SubscriberMetrics>>,
    ) -> Result<(), BuildError> {
        match b.engine {
            EngineKind::Vllm | EngineKind::Sglang => {
                #[cfg(feature = "zmq")]
                {
                    use kvroute_engines::transport::{
                        DecodingSink, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
                    };
                    let Some(events) = &b.events else {
                        return Ok(());
                    };
                    let host = b
                        .host()
                        .ok_or_else(|| Self::endpoint_err(&b.url, "the URL names no host"))?;
                    // Every rank's stream is set up before any starts: a bad
                    // rank refuses the endpoint as a whole.
                    let mut ready = Vec::new();
                    for rank in 0..b.dp_ranks {
                        let ep = ZmqEndpoint::for_engine(b.engine, events, &host, rank)
                            .map_err(|e| Self::endpoint_err(&b.url, e))?;
                        let mut cfg = ZmqSubscriberConfig::new(ep).topic(b.topic.clone());
                        if let Some(r) = &b.replay {
                            let replay = ZmqEndpoint::for_engine(b.engine, r, &host, rank)
                                .map_err(|e| Self::endpoint_err(&b.url, e))?;
                            cfg = cfg.replay_endpoint(replay.address);
                        }
                        let sink = DecodingSink::new(
                            b.engine,
                            IndexIngest::shared(
                                Arc::clone(ingest),
                                Arc::clone(&self.index),
                                Some(rank),
                                b.replay.is_some(),
                            ),
                        )
                        .map_err(|e| Self::endpoint_err(&b.url, e))?;
                        ready.push((ZmqSubscriber::new(cfg), sink));
                    }
                    for (subscriber, sink) in ready {
                        metrics.push(subscriber.metrics());
                        let stopped = Self::stopped(stop);
                        self.handle.spawn(async move {
                            let _ = subscriber.run(sink, stopped).await;
                        });
                    }
                    Ok(())
                }
                #[cfg(not(feature = "zmq"))]
                Err(Self::endpoint_err(
                    &b.url,
                    "this build has no ZeroMQ transport (enable kvroute's `zmq` feature)",
                ))
            }
            EngineKind::TensorRtLlm => {
                #[cfg(feature = "trtllm-http")]
                {
                    use kvroute_engines::transport::{
                        TrtllmPoller, TrtllmPollerConfig, TrtllmSink,
                    };
                    let poller = TrtllmPoller::new(TrtllmPollerConfig::new(format!(
                        "{}/kv_cache_events",
                        b.url
                    )))
                    .map_err(|e| Self::endpoint_err(&b.url, e))?;
                    let sink = TrtllmSink::new(
                        self.block_size,
                        IndexIngest::shared(
                            Arc::clone(ingest),
                            Arc::clone(&self.index),
                            None,
                            false,
                        ),
                    );
                    metrics.push(poller.metrics());
                    tracing::warn!(endpoint = %b.url, "TensorRT-LLM drain poller: every POST to \
                        /kv_cache_events consumes the engine's events, so this router must be its only consumer");
                    let stopped = Self::stopped(stop);
                    self.handle.spawn(async move {
                        let _ = poller.run(sink, stopped).await;
                    });
                    Ok(())
                }
                #[cfg(not(feature = "trtllm-http"))]
                Err(Self::endpoint_err(
                    &b.url,
                    "this build has no TensorRT-LLM drain (enable kvroute's `trtllm-http` feature)",
                ))
            }
            other => Err(Self::endpoint_err(
                &b.url,
                kvroute_engines::transport::require_kv_events(other)
                    .err()
                    .map_or_else(|| format!("{other} is not supported"), |e| e.to_string()),
            )),
        }
    }

    /// A new rule over the slots in use. Its endpoint `i` is slot `i`; a
    /// removed slot keeps its last address but is never available.
    fn rebuild(&self, slots: &[Option<SlotRuntime>]) -> Result<(), BuildError> {
        let mut endpoints = Vec::with_capacity(slots.len());
        let mut urls = Vec::with_capacity(slots.len());
        let mut engines = Vec::with_capacity(slots.len());
        let previous = self.generation.read().clone();
        for (i, s) in slots.iter().enumerate() {
            match s {
                Some(s) => {
                    let b = &s.backend;
                    let mut ep = Endpoint::new(b.url.clone(), b.role)
                        .with_weight(b.weight)
                        .with_capacity(b.capacity);
                    if b.has_inventory() {
                        ep = ep.with_inventory_slot(u32::try_from(i).unwrap_or(u32::MAX));
                    }
                    urls.push(Arc::from(b.url.as_str()));
                    engines.push(b.engine);
                    endpoints.push(ep);
                }
                None => {
                    let old = previous
                        .as_ref()
                        .and_then(|g| g.urls.get(i).cloned())
                        .unwrap_or_else(|| Arc::from(""));
                    endpoints.push(Endpoint::new(old.to_string(), Role::Both));
                    urls.push(old);
                    // Never chosen again: the text body is the safe default.
                    engines.push(EngineKind::LlamaCpp);
                }
            }
        }
        let st = &self.settings;
        let mut cfg = RuleConfig::kv_exact(
            &st.name,
            st.topology,
            endpoints,
            self.block_size,
            self.keys.contract().clone(),
        );
        cfg.choice = st.choice;
        cfg.key_mode = self.keys.key_mode();
        cfg.scorer = st.scorer;
        cfg.fallback = st.fallback;
        cfg.thresholds = st.thresholds;
        let rule = Rule::new(cfg, Some(Arc::clone(&self.keys) as Arc<dyn PromptKeys>))?;
        *self.generation.write() = Some(Arc::new(Generation {
            rule,
            urls,
            engines,
        }));
        self.generations.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn current(&self) -> Option<Arc<Generation>> {
        self.generation.read().clone()
    }
}

impl PromptHost for Shared {
    fn tokenizers(&self) -> &TokenizerPool {
        &self.tokenizers
    }

    fn options(&self, _model: Option<&str>) -> PromptOptions {
        self.options.clone()
    }
}

impl Health for Shared {
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability {
        let Some(h) = self.health.get(endpoint.index()) else {
            return Availability::AdminDown;
        };
        if !h.present.load(Ordering::Acquire) {
            return Availability::AdminDown;
        }
        Availability::from_states(AdminState::Up, h.breaker.lock().state(now))
    }
}

impl Load for Shared {
    fn load(&self, endpoint: EndpointId) -> kvroute_select::EndpointLoad {
        self.tracker.load(endpoint)
    }

    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        self.tracker.charged_prefill_tokens(endpoint)
    }
}

impl InventoryView for Shared {
    fn endpoint_count(&self) -> usize {
        self.index.endpoint_count()
    }

    fn score(&self, keys: &[kvroute_core::BlockKey], out: &mut [Overlap]) {
        self.index.score(keys, out);
    }

    fn health(&self, endpoint: usize) -> InventoryHealth {
        let Some(h) = self.health.get(endpoint) else {
            return InventoryHealth::default();
        };
        let guard = h.ingest.read();
        let Some(ingest) = guard.as_ref() else {
            return InventoryHealth::default();
        };
        let i = ingest.lock();
        InventoryHealth {
            contract_mismatch: matches!(i.contract_status(), ContractStatus::Mismatch { .. }),
            missing_batches: i.missing_batches(),
            clears: i.counters().clears,
        }
    }
}

/// The KV-exact router an embedding host keeps: decisions, inventories,
/// subscribers and load accounting for one pool of endpoints. Cheap to clone
/// (one `Arc`); dropping the last clone stops every subscriber.
#[derive(Clone)]
pub struct KvRouter {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for KvRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRouter")
            .field("rule", &self.shared.settings.name)
            .field("contract", &self.shared.contract.to_string())
            .finish_non_exhaustive()
    }
}

impl KvRouter {
    /// A builder for a router whose prompt keys, block size, key mode,
    /// attestation and ingest all follow `contract`.
    pub fn builder(contract: HashContract) -> KvRouterBuilder {
        KvRouterBuilder {
            contract,
            name: "kvroute".to_owned(),
            models: Vec::new(),
            backends: Vec::new(),
            topology: Topology::Converged,
            choice: Choice::KvExact,
            scorer: Scorer::default(),
            fallback: SelectorKind::LeastPrefill,
            thresholds: Thresholds::default(),
            breaker: BreakerConfig::default(),
            options: PromptOptions::default(),
            max_endpoints: 64,
            index: IndexConfig::default(),
            admission: AdmissionLimits {
                max_count: std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
                max_bytes: 8 << 20,
            },
            overload: TokenizeOverload::Wait,
            tokenize_wait: Duration::from_millis(250),
        }
    }

    /// Decides where `body` (an OpenAI `api` request) goes: parses and
    /// tokenizes it on the blocking pool (bounded per request by the
    /// builder's prompt limits, across requests by its tokenization
    /// admission: see [`KvRouter::tokenize_admission`]), hashes it under the contract, scores the inventories, and
    /// charges the chosen endpoint. Every prompt problem is a counted miss
    /// routed by the fallback, never an error.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub async fn pick(&self, api: ApiKind, body: &Bytes) -> Result<Pick, NoEndpoint> {
        self.pick_with(api, body, None).await
    }

    /// [`KvRouter::pick`] with a session id (P/D session affinity, CHWBL key).
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub async fn pick_with(
        &self,
        api: ApiKind,
        body: &Bytes,
        session: Option<&str>,
    ) -> Result<Pick, NoEndpoint> {
        let shared = &self.shared;
        let prompt = prepare_admitted(
            shared,
            &shared.handle,
            &shared.admission,
            shared.overload,
            shared.tokenize_wait,
            api,
            body,
        )
        .await;
        self.decide(prompt, session.map(str::to_owned))
    }

    /// A decision for a request without a prompt to route on (`/v1/models`,
    /// embeddings, ...): the rule's fallback selector picks, and the decision
    /// counts as a `no_model` miss.
    ///
    /// # Errors
    /// [`NoEndpoint`] when no endpoint is available.
    pub fn pick_unrouted(&self) -> Result<Pick, NoEndpoint> {
        self.decide(
            PreparedPrompt::missed(None, kvroute_select::MissReason::NoModel),
            None,
        )
    }

    fn decide(&self, prompt: PreparedPrompt, session: Option<String>) -> Result<Pick, NoEndpoint> {
        let Some(gen) = self.shared.current() else {
            return Err(NoEndpoint {
                decision: Box::new(Decision::new()),
            });
        };
        let mut pick = Pick {
            shared: Arc::clone(&self.shared),
            gen,
            decision: Decision::new(),
            guard: None,
            prompt,
            session,
        };
        let now = self.shared.now();
        let decision = {
            let req = pick.request();
            pick.gen
                .rule
                .decide(&req, &*self.shared, &*self.shared, &*self.shared, now)
        };
        pick.decision = decision;
        let Some(target) = pick.decision.target() else {
            return Err(NoEndpoint {
                decision: Box::new(pick.decision.clone()),
            });
        };
        let prefill = pick
            .decision
            .predicted_prefill_tokens(self.shared.block_size);
        pick.guard = Some(self.shared.tracker.charge(target, prefill));
        if let Some(outcome) = pick.ids_outcome() {
            self.shared.token_ids.record(outcome);
        }
        Ok(pick)
    }

    /// Applies one endpoint change. Only the changed endpoint's subscribers
    /// and inventory slot are touched; the rule is rebuilt over the new set
    /// (decisions in flight keep theirs; the rule's decision counters start
    /// again from zero, so read [`KvRouter::counters`] before a change if
    /// you export them as deltas).
    ///
    /// # Errors
    /// [`BuildError`]: a duplicate or unknown URL, no free slot, an endpoint
    /// whose events cannot be followed; the set is unchanged then.
    pub fn apply(&self, change: Change) -> Result<(), BuildError> {
        let mut slots = self.shared.slots.lock();
        match change {
            Change::Insert(b) => {
                let url = b.url.clone();
                self.shared.insert(&mut slots, b)?;
                if let Err(e) = self.shared.rebuild(&slots) {
                    let _ = self.shared.remove(&mut slots, &url);
                    return Err(e);
                }
            }
            Change::Remove(url) => {
                self.shared.remove(&mut slots, &url)?;
                self.shared.rebuild(&slots)?;
            }
        }
        Ok(())
    }

    /// The URLs of the endpoints present, in slot order.
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        self.shared
            .slots
            .lock()
            .iter()
            .flatten()
            .map(|s| s.backend.url.clone())
            .collect()
    }

    fn slot_of(&self, url: &str) -> Option<usize> {
        self.shared
            .slots
            .lock()
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.backend.url == url))
    }

    /// Blocks the inventory holds for endpoint `url` (0 when unknown).
    #[must_use]
    pub fn blocks(&self, url: &str) -> u64 {
        self.slot_of(url)
            .map_or(0, |i| self.shared.index.inventory(id(i)).total())
    }

    /// Endpoint `url`'s subscriber metrics, one per DP rank (or its drain poller).
    #[must_use]
    pub fn subscriber_metrics(&self, url: &str) -> Vec<MetricsSnapshot> {
        self.shared
            .slots
            .lock()
            .iter()
            .flatten()
            .find(|s| s.backend.url == url)
            .map(|s| s.metrics.iter().map(|m| m.snapshot()).collect())
            .unwrap_or_default()
    }

    /// Requests in flight on endpoint `url`.
    #[must_use]
    pub fn in_flight(&self, url: &str) -> u32 {
        self.slot_of(url)
            .map_or(0, |i| self.shared.tracker.load(id(i)).in_flight)
    }

    /// The current rule's counters: decisions, hits and misses by reason,
    /// predicted vs delivered cached tokens per endpoint (indexed by slot; see
    /// [`KvRouter::endpoints`] for the slot of a URL via [`Pick::endpoint_id`]).
    #[must_use]
    pub fn counters(&self) -> CountersSnapshot {
        self.shared
            .current()
            .map(|g| g.rule.counters().snapshot())
            .unwrap_or_default()
    }

    /// The slot (rule endpoint id) of `url`, if present.
    #[must_use]
    pub fn endpoint_id(&self, url: &str) -> Option<EndpointId> {
        self.slot_of(url).map(id)
    }

    /// The contract the router follows.
    #[must_use]
    pub fn contract(&self) -> &HashContract {
        &self.shared.contract
    }

    /// Requests forwarded with token ids and kept as text by reason
    /// ([`KvRouterBuilder::forward_token_ids`]; all zero while it is off).
    #[must_use]
    pub fn token_id_counters(&self) -> TokenIdSnapshot {
        self.shared.token_ids.snapshot()
    }

    /// The bound on tokenizations across requests: its
    /// [`TokenizeAdmission::snapshot`] is what a host exports (in flight,
    /// peaks, admitted, overloaded).
    #[must_use]
    pub fn tokenize_admission(&self) -> &Arc<TokenizeAdmission> {
        &self.shared.admission
    }

    /// [`TokenizeAdmission::snapshot`] of [`KvRouter::tokenize_admission`].
    #[must_use]
    pub fn tokenize_counters(&self) -> AdmissionSnapshot {
        self.shared.admission.snapshot()
    }

    /// Tokens per block (the contract's).
    #[must_use]
    pub fn block_size(&self) -> u32 {
        self.shared.block_size
    }
}

/// No endpoint was available for a request (all removed, excluded or behind
/// open breakers, or retries spent).
#[derive(Debug, thiserror::Error)]
#[error("no endpoint available")]
pub struct NoEndpoint {
    /// The decision as it ended (its miss reason, exclusions, retries).
    pub decision: Box<Decision>,
}

/// One request's routing: the decision, the load charge on its endpoint, and
/// what a retry needs. Forward to [`Pick::url`]; on a connect failure call
/// [`Pick::retry`] for the next endpoint; wrap the response body with
/// [`Pick::into_body`] so the receipt is recorded and the charge released
/// when the body ends or the client goes away.
pub struct Pick {
    shared: Arc<Shared>,
    gen: Arc<Generation>,
    decision: Decision,
    guard: Option<LoadGuard>,
    prompt: PreparedPrompt,
    session: Option<String>,
}

impl std::fmt::Debug for Pick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pick")
            .field("url", &self.url())
            .field("decision", &self.decision)
            .finish_non_exhaustive()
    }
}

impl Pick {
    fn request(&self) -> Request<'_> {
        let req = self.prompt.request();
        match &self.session {
            Some(s) => req.with_session(s),
            None => req,
        }
    }

    /// The decision (target, source, miss reason, predicted overlap).
    #[must_use]
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The endpoint that receives the request (the prefill endpoint in P/D):
    /// its `http://host:port`. Empty once [`Pick::retry`] has returned `None`.
    #[must_use]
    pub fn url(&self) -> &str {
        self.decision
            .target()
            .and_then(|t| self.gen.urls.get(t.endpoint.index()))
            .map_or("", |u| u)
    }

    /// P/D: the decode endpoint of the target.
    #[must_use]
    pub fn decode_url(&self) -> Option<&str> {
        let d = self.decision.target()?.decode?;
        self.gen.urls.get(d.index()).map(|u| &**u)
    }

    /// The target's endpoint id (its slot).
    #[must_use]
    pub fn endpoint_id(&self) -> Option<EndpointId> {
        self.decision.target().map(|t| t.endpoint)
    }

    /// The model the body named.
    #[must_use]
    pub fn model(&self) -> Option<&str> {
        self.prompt.model()
    }

    /// The body to forward to the current target: the client's, or the same
    /// with `stream_options.include_usage` added (streamed requests, unless
    /// the builder turned it off), and with
    /// [`KvRouterBuilder::forward_token_ids`] a completions `prompt` replaced
    /// by its token ids when the target's engine takes them as the same
    /// request (ask again after [`Pick::retry`]: the next endpoint may be of
    /// another engine).
    #[must_use]
    pub fn upstream_body(&self, original: &Bytes) -> Bytes {
        if let Some(Ok(b)) = self.ids_body() {
            return b.clone();
        }
        self.prompt
            .rewritten()
            .cloned()
            .unwrap_or_else(|| original.clone())
    }

    /// The id body for the current target, or why it gets the text; `None`
    /// while forwarding is off.
    fn ids_body(&self) -> Option<Result<&Bytes, KeepText>> {
        let ids = self.prompt.ids()?;
        let engine = self
            .decision
            .target()
            .and_then(|t| self.gen.engines.get(t.endpoint.index()).copied())
            .unwrap_or(EngineKind::LlamaCpp);
        Some(ids.for_engine(engine))
    }

    /// Whether [`Pick::upstream_body`] sends token ids to the current target
    /// (`Ok`), or the text and why; `None` while forwarding is off.
    #[must_use]
    pub fn ids_outcome(&self) -> Option<Result<(), KeepText>> {
        self.ids_body().map(|r| r.map(|_| ()))
    }

    /// The connection to the target failed (refused, unreachable, reset
    /// before a response): counts a failure on its breaker, excludes it, and
    /// returns the next endpoint (the next-best overlap inside the KV tier;
    /// never a decode-only endpoint for the prefill leg), or `None` when none
    /// is left or retries are spent (the load charge is released then).
    pub fn retry(&mut self) -> Option<&str> {
        self.retry_leg(Leg::Endpoint)?;
        Some(self.url())
    }

    /// [`Pick::retry`] for a given leg of a P/D target.
    pub fn retry_leg(&mut self, leg: Leg) -> Option<Target> {
        let now = self.shared.now();
        if let Some(t) = self.decision.target() {
            let failed = match leg {
                Leg::Endpoint => t.endpoint,
                Leg::Decode => t.decode.unwrap_or(t.endpoint),
            };
            if let Some(h) = self.shared.health.get(failed.index()) {
                h.breaker.lock().on_failure(now);
            }
        }
        let mut decision = std::mem::take(&mut self.decision);
        let next = {
            let req = self.request();
            self.gen
                .rule
                .retry(&mut decision, leg, &req, &*self.shared, &*self.shared, now)
        };
        self.decision = decision;
        match next {
            Some(t) => {
                let prefill = self
                    .decision
                    .predicted_prefill_tokens(self.shared.block_size);
                match self.guard.as_mut() {
                    Some(g) => g.retarget(t, prefill),
                    None => self.guard = Some(self.shared.tracker.charge(t, prefill)),
                }
            }
            None => self.guard = None,
        }
        next
    }

    /// The target answered (closes a half-open breaker).
    pub fn connected(&self) {
        if let Some(t) = self.decision.target() {
            if let Some(h) = self.shared.health.get(t.endpoint.index()) {
                h.breaker.lock().on_success();
            }
        }
    }

    /// Records the engine's cached-token receipt for this decision (what
    /// [`Pick::into_body`] does by itself at the body's end). `false` when
    /// the receipt was not counted (no target, or more than the prompt).
    pub fn record_receipt(&self, cached_tokens: u32) -> bool {
        self.gen.rule.record_receipt(&self.decision, cached_tokens)
    }

    /// The request's load charge (e.g. [`LoadGuard::prefill_leg_done`] after
    /// a P/D prefill leg).
    pub fn guard_mut(&mut self) -> Option<&mut LoadGuard> {
        self.guard.as_mut()
    }

    /// Wraps the upstream response body: the receipt in it is recorded
    /// against this decision when it ends, and the load charge is released
    /// when it ends, errors or is dropped (a client disconnect). `headers`
    /// are the response's (SSE or JSON).
    pub fn into_body<B>(self, headers: &http::HeaderMap, body: B) -> ReceiptBody<B> {
        self.into_receipt(headers).body(body)
    }

    /// [`Pick::into_body`] that also hands the [`Receipt`] to `on_end`.
    pub fn into_body_with<B>(
        self,
        headers: &http::HeaderMap,
        body: B,
        on_end: impl FnOnce(Receipt) + Send + 'static,
    ) -> ReceiptBody<B> {
        self.into_receipt_with(headers, on_end).body(body)
    }

    /// [`Pick::into_body`] for a host that is handed the response body in
    /// chunks (pingora's `response_body_filter`): feed the tracker each
    /// chunk and call [`ReceiptTracker::on_end`] at the end; the receipt is
    /// recorded against this decision then, and the load charge released
    /// then or when the tracker is dropped.
    pub fn into_receipt(self, headers: &http::HeaderMap) -> ReceiptTracker {
        self.into_receipt_with(headers, |_| {})
    }

    /// [`Pick::into_receipt`] that also hands the [`Receipt`] to `on_end`.
    pub fn into_receipt_with(
        mut self,
        headers: &http::HeaderMap,
        on_end: impl FnOnce(Receipt) + Send + 'static,
    ) -> ReceiptTracker {
        let guard = self.guard.take();
        let gen = Arc::clone(&self.gen);
        let decision = std::mem::take(&mut self.decision);
        let done: OnReceipt = Box::new(move |r: Receipt| {
            if let (true, Some(c)) = (r.complete, r.cached_tokens) {
                gen.rule.record_receipt(&decision, c);
            }
            on_end(r);
        });
        ReceiptTracker::new(BodyKind::of(headers), guard, done)
    }
}
