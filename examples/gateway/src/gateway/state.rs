//! Shared gateway state: the rule table (replaced atomically by the admin API),
//! each rule's library [`Rule`], inventory, subscribers, per-endpoint load and
//! breakers, and the tokenizer pool.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::EndpointId;
use kvroute_engines::prompt::{ParallelConfig, ParallelEncoder, TokenizerPool};
use kvroute_engines::transport::{
    DecodingSink, IndexIngest, SubscriberMetrics, TrtllmPoller, TrtllmPollerConfig, TrtllmSink,
    ZmqSubscriber, ZmqSubscriberConfig,
};
use kvroute_select::{
    AdminState, Availability, BreakerConfig, BreakerState, CircuitBreaker, ContractKeys, Endpoint,
    EndpointLoad, Health, Load, LoadGuard, LoadTracker, PromptKeys, RemoteLoad, ReportedLoad, Rule,
    RuleConfig, Thresholds,
};
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use super::config::{
    check_rule_set, ConfigError, EndpointSpec, HealthConfig, LimitsConfig, RuleSpec, ServeConfig,
};
use super::inventory::{RuleInventory, SlotSpec};
use super::metrics::GatewayMetrics;
use super::upstream::UpstreamClient;

/// One endpoint's live state.
#[derive(Debug)]
pub struct EndpointRuntime {
    /// Its configuration.
    pub spec: EndpointSpec,
    breaker: Mutex<CircuitBreaker>,
    admin_down: AtomicBool,
    /// Last active probe verdict (`None` before the first probe).
    pub probe_ok: Mutex<Option<bool>>,
    /// One per DP rank subscriber, in `spec.events` order.
    pub subscribers: Vec<Arc<SubscriberMetrics>>,
    /// The TensorRT-LLM drain poller's metrics (`spec.drain` set).
    pub drain: Option<Arc<SubscriberMetrics>>,
    /// Polls of the engine's own load report (`/metrics`), by outcome.
    pub load_polls: LoadPolls,
}

/// Outcomes of one endpoint's engine-load poller (see `engine_load.rs`):
/// a failing poller means selection runs on this replica's own counts only.
#[derive(Debug, Default)]
pub struct LoadPolls {
    /// Polls that gave a report.
    pub ok: std::sync::atomic::AtomicU64,
    /// Polls that failed (connect, timeout, status, unparsable page).
    pub failed: std::sync::atomic::AtomicU64,
}

impl EndpointRuntime {
    /// Breaker state at `now`.
    #[must_use]
    pub fn breaker_state(&self, now: Duration) -> BreakerState {
        self.breaker.lock().state(now)
    }

    /// Whether the operator drained it.
    #[must_use]
    pub fn is_admin_down(&self) -> bool {
        self.admin_down.load(Ordering::Relaxed)
    }

    /// Drains or restores it.
    pub fn set_admin_down(&self, down: bool) {
        self.admin_down.store(down, Ordering::Relaxed);
    }

    /// A request or probe reached it.
    pub fn success(&self) {
        self.breaker.lock().on_success();
    }

    /// A request or probe failed at `now`.
    pub fn failure(&self, now: Duration) {
        self.breaker.lock().on_failure(now);
    }
}

/// A running rule. Dropping it stops its subscribers and probes.
pub struct RuleRuntime {
    /// Validated configuration.
    pub spec: RuleSpec,
    /// The library rule.
    pub rule: Rule,
    /// Its contract's prompt keys (KV-exact rules): the tokenizing job hashes
    /// with them and hands the rule the keys.
    pub keys: Option<Arc<ContractKeys>>,
    /// Inventories (slot `i` = endpoint `i`).
    pub inventory: Arc<RuleInventory>,
    /// Endpoints, in rule order.
    pub endpoints: Vec<EndpointRuntime>,
    /// Requests in flight and predicted prefill tokens per endpoint, counted
    /// from the decision until the response body ends or is dropped.
    pub tracker: Arc<LoadTracker>,
    /// The engines' own running / waiting counts, when polled.
    pub reported: ReportedLoad,
    /// The other gateway replicas' requests in flight here (`[replicas]`
    /// configured; fed by [`super::replica_sync`]).
    pub remote: Option<RemoteLoad>,
    /// Its request and decision counters (`/metrics`), shared with any
    /// earlier rule of the same name.
    pub counters: Arc<super::metrics::RuleCounters>,
    epoch: Instant,
    /// Set to `true` when the rule is removed or replaced.
    stop: watch::Sender<bool>,
}

impl std::fmt::Debug for RuleRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleRuntime")
            .field("name", &self.spec.doc.name)
            .finish_non_exhaustive()
    }
}

impl Drop for RuleRuntime {
    fn drop(&mut self) {
        let _ = self.stop.send_replace(true);
    }
}

impl RuleRuntime {
    /// Whether endpoint `i` is eligible at `now`.
    #[must_use]
    pub fn is_available(&self, i: usize, now: Duration) -> bool {
        self.availability(EndpointId(u32::try_from(i).unwrap_or(u32::MAX)), now)
            .is_available()
    }

    /// The endpoint with id `id`.
    #[must_use]
    pub fn endpoint(&self, id: EndpointId) -> Option<&EndpointRuntime> {
        self.endpoints.get(id.index())
    }

    /// The gateway's monotonic time (the library's `now`).
    #[must_use]
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Charges a request without a KV decision (pass-through) to `id`.
    #[must_use]
    pub fn start_request(&self, id: EndpointId) -> LoadGuard {
        self.tracker.charge(
            kvroute_select::Target {
                endpoint: id,
                decode: None,
            },
            0,
        )
    }

    /// What selection sees of endpoint `id`: this gateway's own in-flight
    /// accounting plus the other replicas' (when shared), corrected by the
    /// engine's reported queue when polled.
    #[must_use]
    pub fn load_of(&self, id: EndpointId) -> EndpointLoad {
        let now = self.epoch.elapsed();
        match &self.remote {
            Some(remote) => self
                .reported
                .view(&remote.view(&*self.tracker, now), now)
                .load(id),
            None => self.reported.view(&*self.tracker, now).load(id),
        }
    }

    /// Every replica's own accounting on `id`, without engine reports: what
    /// an engine report is compared with, so that requests it already counts
    /// are not counted twice.
    #[must_use]
    pub fn replicas_load(&self, id: EndpointId) -> EndpointLoad {
        match &self.remote {
            Some(remote) => remote.view(&*self.tracker, self.epoch.elapsed()).load(id),
            None => self.tracker.load(id),
        }
    }

    /// The index of the endpoint whose `url` is `url` (trailing `/` ignored).
    #[must_use]
    pub fn endpoint_index(&self, url: &str) -> Option<EndpointId> {
        let url = url.trim_end_matches('/');
        self.endpoints
            .iter()
            .position(|e| e.spec.url.trim_end_matches('/') == url)
            .and_then(|i| u32::try_from(i).ok())
            .map(EndpointId)
    }

    /// A receiver that turns `true` when the rule goes away.
    #[must_use]
    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

impl Load for RuleRuntime {
    fn load(&self, endpoint: EndpointId) -> EndpointLoad {
        self.load_of(endpoint)
    }

    /// Every replica's charges (the cost scorer's drain times them).
    fn charged_prefill_tokens(&self, endpoint: EndpointId) -> Option<u64> {
        let local = self.tracker.charged_tokens(endpoint);
        Some(
            self.remote
                .as_ref()
                .map_or(local, |r| local.saturating_add(r.remote_charged(endpoint))),
        )
    }

    /// The engine's own prefill counters, from its last fresh load report.
    fn prefill_progress(&self, endpoint: EndpointId) -> Option<kvroute_select::PrefillProgress> {
        self.reported
            .view(&*self.tracker, self.epoch.elapsed())
            .prefill_progress(endpoint)
    }
}

impl Health for RuleRuntime {
    fn availability(&self, endpoint: EndpointId, now: Duration) -> Availability {
        let Some(e) = self.endpoint(endpoint) else {
            return Availability::Available;
        };
        let admin = if e.is_admin_down() {
            AdminState::Down
        } else {
            AdminState::Up
        };
        Availability::from_states(admin, e.breaker_state(now))
    }
}

/// The gateway.
pub struct Gateway {
    /// Limits.
    pub limits: LimitsConfig,
    /// Health-check settings.
    pub health: HealthConfig,
    /// Admin bearer token.
    pub admin_token: Option<String>,
    /// Tokenizers by model slug.
    pub tokenizers: TokenizerPool,
    /// Staged model slugs.
    pub models: Vec<String>,
    rules: RwLock<BTreeMap<String, Arc<RuleRuntime>>>,
    /// Upstream HTTP client.
    pub client: UpstreamClient,
    /// Gateway counters.
    pub metrics: GatewayMetrics,
    /// Bound on concurrent tokenizations and their bytes.
    pub tokenize_admission: Arc<kvroute::admission::TokenizeAdmission>,
    /// Rotates the starting endpoint of pass-through requests among equally
    /// loaded ones.
    pub passthrough_turn: AtomicU32,
    /// Readiness, decision headers and the sampled decision log.
    pub observe: super::observe::Observe,
    /// Load sharing with the other replicas (`[replicas] peers` set).
    pub replica_sync: Option<Arc<super::replica_sync::ReplicaSync>>,
    epoch: Instant,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

impl Gateway {
    /// Builds the gateway and starts every configured rule (must run inside a
    /// tokio runtime: subscribers and probes are spawned).
    ///
    /// # Errors
    /// A rule the library refuses.
    pub fn start(config: &ServeConfig) -> Result<Arc<Self>, ConfigError> {
        let replica_sync = super::replica_sync::ReplicaSync::new(
            &config.replicas,
            config.listen,
            config.admin_listen,
            config.admin_token.clone(),
        )?
        .map(Arc::new);
        let tokenizers = TokenizerPool::new();
        for m in &config.models {
            tokenizers.register(m.slug.clone(), m.dir.clone());
        }
        // One pool shared by every model: concurrent long prompts queue on
        // it, so splitting never multiplies the gateway's threads.
        let threads = config.limits.tokenizer_threads.max(1);
        if threads > 1 {
            let encoder = ParallelEncoder::new(ParallelConfig {
                threads,
                ..ParallelConfig::default()
            })
            .map_err(|e| ConfigError::Invalid {
                field: "limits.tokenizer_threads".into(),
                message: e.to_string(),
            })?;
            tokenizers.set_parallel(Some(Arc::new(encoder)));
        }
        let gw = Arc::new(Self {
            limits: config.limits.clone(),
            health: config.health.clone(),
            admin_token: config.admin_token.clone(),
            tokenizers,
            models: config.models.iter().map(|m| m.slug.clone()).collect(),
            rules: RwLock::new(BTreeMap::new()),
            client: UpstreamClient::new(
                config.limits.connect_timeout(),
                config.limits.response_header_timeout(),
            ),
            metrics: GatewayMetrics::default(),
            tokenize_admission: Arc::new(kvroute::admission::TokenizeAdmission::new(
                kvroute::admission::AdmissionLimits {
                    max_count: config.limits.max_concurrent_tokenizations,
                    max_bytes: config.limits.max_tokenize_bytes_in_flight,
                },
            )),
            passthrough_turn: AtomicU32::new(0),
            observe: super::observe::Observe::new(
                config.decisions.clone(),
                &config
                    .models
                    .iter()
                    .map(|m| m.slug.clone())
                    .collect::<Vec<_>>(),
            ),
            replica_sync,
            epoch: Instant::now(),
        });
        for spec in &config.rules {
            gw.put_rule(spec.clone(), true)?;
        }
        if let Some(sync) = &gw.replica_sync {
            sync.spawn(&gw);
        }
        Ok(gw)
    }

    /// Monotonic time since start (the library's `now`).
    #[must_use]
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// The rules, by name.
    #[must_use]
    pub fn rules_snapshot(&self) -> Vec<Arc<RuleRuntime>> {
        self.rules.read().values().cloned().collect()
    }

    /// One rule.
    #[must_use]
    pub fn rule(&self, name: &str) -> Option<Arc<RuleRuntime>> {
        self.rules.read().get(name).cloned()
    }

    /// The rule serving `model`, else the default rule.
    #[must_use]
    pub fn rule_for_model(&self, model: Option<&str>) -> Option<Arc<RuleRuntime>> {
        let rules = self.rules.read();
        if let Some(m) = model {
            if let Some(r) = rules
                .values()
                .find(|r| r.spec.doc.models.iter().any(|x| x == m))
            {
                return Some(Arc::clone(r));
            }
        }
        rules.values().find(|r| r.spec.doc.default).cloned()
    }

    /// Installs `spec`, replacing a rule of the same name when `replace`; the
    /// replaced rule's subscribers stop once its last request finishes.
    ///
    /// # Errors
    /// [`ConfigError`] when the name exists (and `!replace`), the rule set
    /// becomes inconsistent, or the library refuses the rule.
    pub fn put_rule(self: &Arc<Self>, spec: RuleSpec, replace: bool) -> Result<bool, ConfigError> {
        let mut rules = self.rules.write();
        let existed = rules.contains_key(&spec.doc.name);
        if existed && !replace {
            return Err(ConfigError::Invalid {
                field: format!("rule {:?}", spec.doc.name),
                message: "a rule with this name already exists (use PUT to replace it)".into(),
            });
        }
        let mut specs: Vec<RuleSpec> = rules
            .values()
            .filter(|r| r.spec.doc.name != spec.doc.name)
            .map(|r| r.spec.clone())
            .collect();
        specs.push(spec.clone());
        check_rule_set(&specs)?;
        let (runtime, pending) = self.build_rule(spec)?;
        let name = runtime.spec.doc.name.clone();
        if let Some(old) = rules.insert(name, Arc::clone(&runtime)) {
            // Its subscribers and probes stop now; in-flight requests keep their Arc.
            let _ = old.stop.send_replace(true);
        }
        drop(rules);
        self.spawn_background(&runtime, pending);
        Ok(existed)
    }

    /// Removes a rule; `false` when it did not exist.
    pub fn delete_rule(&self, name: &str) -> bool {
        let removed = self.rules.write().remove(name);
        if let Some(old) = &removed {
            let _ = old.stop.send_replace(true);
        }
        removed.is_some()
    }

    /// Stops every rule (subscribers and probes end).
    pub fn stop_all(&self) {
        let rules = std::mem::take(&mut *self.rules.write());
        for r in rules.values() {
            let _ = r.stop.send_replace(true);
        }
    }

    fn build_rule(&self, spec: RuleSpec) -> Result<(Arc<RuleRuntime>, Vec<Pending>), ConfigError> {
        let field = format!("rule {:?}", spec.doc.name);
        let lib_err = |e: &dyn std::fmt::Display| ConfigError::Invalid {
            field: field.clone(),
            message: e.to_string(),
        };
        let keys: Option<Arc<ContractKeys>> = match &spec.contract {
            Some(c) => Some(Arc::new(ContractKeys::new(c).map_err(|e| lib_err(&e))?)),
            None => None,
        };
        let endpoints: Vec<Endpoint> = spec
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let ep = Endpoint::new(e.url.clone(), e.role)
                    .with_weight(e.weight)
                    .with_capacity(e.capacity);
                if e.events.is_empty() && e.drain.is_none() {
                    ep
                } else {
                    ep.with_inventory_slot(u32::try_from(i).unwrap_or(u32::MAX))
                }
            })
            .collect();
        let (block_size, contract_id, key_mode) = match &keys {
            Some(k) => (k.block_size(), k.contract().clone(), k.key_mode()),
            None => (
                16,
                kvroute_select::ContractId::new("none"),
                kvroute_select::KeyMode::Engine,
            ),
        };
        let mut thresholds = Thresholds::default();
        if let Some(n) = spec.doc.min_overlap_blocks {
            thresholds.min_overlap_blocks = n;
        }
        if let Some(n) = spec.doc.max_retries {
            thresholds.max_retries = n;
        }
        let mut cfg = RuleConfig::kv_exact(
            &spec.doc.name,
            spec.topology,
            endpoints,
            block_size,
            contract_id,
        );
        cfg.choice = spec.choice;
        cfg.key_mode = key_mode;
        cfg.scorer = std::sync::Arc::clone(&spec.scorer);
        cfg.fallback = spec.selector;
        cfg.thresholds = thresholds;
        let provider = keys.clone().map(|k| k as Arc<dyn PromptKeys>);
        let rule = Rule::new(cfg, provider).map_err(|e| lib_err(&e))?;
        let slots: Vec<SlotSpec> = spec.endpoints.iter().map(SlotSpec::from).collect();
        let inventory = Arc::new(RuleInventory::new(&slots, spec.contract.as_ref()));
        let mut pending = Vec::new();
        let breaker = BreakerConfig {
            failure_threshold: self.health.failure_threshold,
            cool_down: Duration::from_millis(self.health.cool_down_ms),
        };
        let mut endpoints = Vec::new();
        for (slot, e) in spec.endpoints.iter().enumerate() {
            let mut subscribers = Vec::new();
            for src in &e.events {
                let mut cfg = ZmqSubscriberConfig::new(src.zmq.clone()).topic(src.topic.clone());
                if let Some(r) = &src.replay {
                    cfg = cfg.replay_endpoint(r.clone());
                }
                let subscriber = ZmqSubscriber::new(cfg);
                subscribers.push(subscriber.metrics());
                // Without a replay socket a reconnect is judged by sequence
                // numbers alone (a blip keeps the inventory).
                let sink = inventory
                    .zmq_sink(slot, src.rank, e.engine, src.replay.is_some())
                    .map_err(|err| lib_err(&err))?;
                pending.push(Pending::Zmq {
                    subscriber,
                    sink,
                    what: format!("{} rank {} ({})", e.url, src.rank, src.zmq.address),
                });
            }
            let mut drain = None;
            if let Some(url) = &e.drain {
                let poller = TrtllmPoller::new(TrtllmPollerConfig::new(url.clone()))
                    .map_err(|err| lib_err(&err))?;
                drain = Some(poller.metrics());
                let sink = inventory
                    .drain_sink(slot, block_size)
                    .map_err(|err| lib_err(&err))?;
                pending.push(Pending::Drain {
                    poller,
                    sink,
                    url: url.clone(),
                });
            }
            endpoints.push(EndpointRuntime {
                spec: e.clone(),
                breaker: Mutex::new(CircuitBreaker::new(breaker)),
                admin_down: AtomicBool::new(false),
                probe_ok: Mutex::new(None),
                subscribers,
                drain,
                load_polls: LoadPolls::default(),
            });
        }
        let (stop, _) = watch::channel(false);
        let n = endpoints.len();
        let counters = self.metrics.rule(&spec.doc.name);
        let (tracker, remote) = match &self.replica_sync {
            Some(sync) => {
                let (t, r) = sync.rule_tables(n);
                (t, Some(r))
            }
            None => (LoadTracker::new(n), None),
        };
        let rt = Arc::new(RuleRuntime {
            counters,
            spec,
            rule,
            keys,
            inventory,
            endpoints,
            tracker: Arc::new(tracker),
            reported: ReportedLoad::new(n, Duration::from_secs(5)),
            remote,
            epoch: self.epoch,
            stop,
        });
        Ok((rt, pending))
    }

    /// Starts the rule's subscribers (they retry until their engine is up) and
    /// its health probes.
    fn spawn_background(self: &Arc<Self>, rt: &Arc<RuleRuntime>, pending: Vec<Pending>) {
        for p in pending {
            let mut stop = rt.stopped();
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            match p {
                Pending::Zmq {
                    subscriber,
                    sink,
                    what,
                } => {
                    tracing::info!(rule = %rt.spec.doc.name, subscriber = %what, "starting KV-event subscriber");
                    tokio::spawn(async move {
                        let _ = subscriber.run(sink, stopped).await;
                    });
                }
                Pending::Drain { poller, sink, url } => {
                    tracing::warn!(
                        rule = %rt.spec.doc.name,
                        %url,
                        "starting TensorRT-LLM KV-event DRAIN poller: every POST to /kv_cache_events \
                         CONSUMES the engine's events, so this must be the ONLY consumer of this engine \
                         (no second gateway replica, script or curl); a competing consumer shows up as \
                         steady event_id gaps and clears"
                    );
                    tokio::spawn(async move {
                        let _ = poller.run(sink, stopped).await;
                    });
                }
            }
        }
        super::health::spawn_probes(self, rt);
        if self.limits.engine_load_poll_ms > 0 {
            super::engine_load::spawn(rt, Duration::from_millis(self.limits.engine_load_poll_ms));
        }
    }
}

/// A subscriber built with its rule, started once the rule is installed.
enum Pending {
    /// One ZeroMQ subscriber (endpoint, DP rank).
    Zmq {
        subscriber: ZmqSubscriber,
        sink: DecodingSink<IndexIngest>,
        what: String,
    },
    /// One TensorRT-LLM drain poller (endpoint).
    Drain {
        poller: TrtllmPoller,
        sink: TrtllmSink<IndexIngest>,
        url: String,
    },
}
