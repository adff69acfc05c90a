//! Shared gateway state: the rule table (replaced atomically by the admin
//! API), one library [`KvRouter`] per rule — the runtime that owns the rule's
//! inventories, event followers, breakers, probes, load view and replica
//! sharing — and what the server adds around them (tokenizer pool,
//! tokenization bound, upstream client, metrics, readiness).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use kvroute::nats::NatsReplicas;
use kvroute::{
    Backend, EngineLoadConfig, HeaderTimeouts, KvRouter, KvRouterBuilder, OutlierConfig,
    ProbeConfig, ReplicaConfig, ReplicaTransport,
};
use kvroute_engines::prompt::{ParallelConfig, ParallelEncoder, TokenizerPool};
use kvroute_select::{BreakerConfig, Thresholds};
use parking_lot::RwLock;

use super::config::{
    check_rule_set, ConfigError, EndpointSpec, HealthConfig, LimitsConfig, ReplicasConfig,
    RuleSpec, ServeConfig,
};
use super::metrics::GatewayMetrics;
use super::upstream::UpstreamClient;

/// A running rule: its validated configuration, the library runtime that
/// routes it, and the server's per-rule counters. Dropping the last handle
/// stops the runtime's background work (requests in flight keep theirs).
pub struct RuleRuntime {
    /// Validated configuration.
    pub spec: RuleSpec,
    /// The rule's runtime.
    pub router: KvRouter,
    /// Its request and decision counters (`/metrics`), shared with any
    /// earlier rule of the same name.
    pub counters: Arc<super::metrics::RuleCounters>,
    /// Its decisions by tier since this runtime was built
    /// (`/admin/counters`, beside the runtime's own counters).
    pub tiers: super::metrics::InstanceTiers,
}

impl std::fmt::Debug for RuleRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleRuntime")
            .field("name", &self.spec.doc.name)
            .finish_non_exhaustive()
    }
}

impl RuleRuntime {
    /// Counts one decision by tier: on `/metrics` (per rule name) and for
    /// this instance.
    pub fn count_tier(&self, source: kvroute_select::Source) {
        self.counters.tier(source);
        self.tiers.count(source);
    }

    /// The endpoint configured at position `index`.
    #[must_use]
    pub fn endpoint(&self, index: usize) -> Option<&EndpointSpec> {
        self.spec.endpoints.get(index)
    }

    /// The configured endpoint whose URL is `url` (trailing `/` ignored).
    #[must_use]
    pub fn endpoint_by_url(&self, url: &str) -> Option<&EndpointSpec> {
        let url = url.trim_end_matches('/');
        self.spec
            .endpoints
            .iter()
            .find(|e| e.url.trim_end_matches('/') == url)
    }
}

/// The library backend of a configured endpoint.
fn backend(e: &EndpointSpec) -> Backend {
    let mut b = Backend::new(Arc::clone(&e.engine), e.url.clone())
        .role(e.role)
        .weight(e.weight)
        .capacity(e.capacity)
        .dp_ranks(e.dp_ranks)
        .topic(e.topic.clone())
        .follow_events(e.zmq.is_some() || e.drain.is_some());
    if let Some(z) = &e.zmq {
        b = b.events(z.clone());
    }
    if let Some(r) = &e.replay {
        b = b.replay(r.clone());
    }
    b
}

/// The gateway.
pub struct Gateway {
    /// Limits.
    pub limits: LimitsConfig,
    /// Health-check settings.
    pub health: HealthConfig,
    /// Admin bearer token.
    pub admin_token: Option<String>,
    /// Tokenizers by model slug, shared by every rule.
    pub tokenizers: Arc<TokenizerPool>,
    /// Staged model slugs.
    pub models: Vec<String>,
    rules: RwLock<BTreeMap<String, Arc<RuleRuntime>>>,
    /// Upstream HTTP client.
    pub client: UpstreamClient,
    /// Gateway counters.
    pub metrics: GatewayMetrics,
    /// Bound on concurrent tokenizations and their bytes, shared by every rule.
    pub tokenize_admission: Arc<kvroute::admission::TokenizeAdmission>,
    /// Rotates the starting endpoint of pass-through requests among equally
    /// loaded ones.
    pub passthrough_turn: AtomicU32,
    /// Readiness, decision headers and the sampled decision log.
    pub observe: super::observe::Observe,
    /// Replica load sharing (`[replicas] nats` set): the NATS transport
    /// every rule's runtime shares, and its settings.
    pub replicas: Option<(Arc<NatsReplicas>, ReplicasConfig)>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").finish_non_exhaustive()
    }
}

impl Gateway {
    /// Builds the gateway and starts every configured rule (must run inside a
    /// tokio runtime: each rule's runtime spawns its background work).
    /// `nats` is the replica transport when `[replicas] nats` names one.
    ///
    /// # Errors
    /// A rule the library refuses.
    pub fn start(
        config: &ServeConfig,
        nats: Option<Arc<NatsReplicas>>,
    ) -> Result<Arc<Self>, ConfigError> {
        let gw = Self::without_rules(config, nats)?;
        for spec in &config.rules {
            gw.put_rule(spec.clone(), true)?;
        }
        Ok(gw)
    }

    /// The gateway's shared parts (tokenizers, admission, limits) without any
    /// rule started: what [`Gateway::rule_router`] builds rules from.
    ///
    /// # Errors
    /// `limits.tokenizer_threads` the tokenizer pool refuses.
    pub fn without_rules(
        config: &ServeConfig,
        nats: Option<Arc<NatsReplicas>>,
    ) -> Result<Arc<Self>, ConfigError> {
        let tokenizers = Arc::new(TokenizerPool::new());
        for m in &config.models {
            let options = kvroute::prompt::ModelOptions {
                max_model_len: m.max_model_len,
                content_format: m.content_format.map(Into::into),
                ..kvroute::prompt::ModelOptions::default()
            };
            tokenizers.register_with(m.slug.clone(), m.dir.clone(), options);
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
                config.limits.upstream_pool_idle(),
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
            replicas: nats.map(|t| (t, config.replicas.clone())),
        });
        Ok(gw)
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
    /// replaced rule's runtime stops once its last request finishes.
    ///
    /// # Errors
    /// [`ConfigError`] when the name exists (and `!replace`), the rule set
    /// becomes inconsistent, or the library refuses the rule.
    pub fn put_rule(&self, spec: RuleSpec, replace: bool) -> Result<bool, ConfigError> {
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
        let runtime = Arc::new(self.build_rule(spec)?);
        // An operator's drains outlive the rule's edits: an endpoint drained
        // in the replaced rule stays drained in its replacement (a drain racing
        // this swap is carried over by `set_admin`).
        if let Some(old) = rules.get(&runtime.spec.doc.name) {
            for e in old.router.endpoint_statuses() {
                if e.admin_down {
                    runtime.router.set_admin_down(&e.url, true);
                }
            }
        }
        rules.insert(runtime.spec.doc.name.clone(), runtime);
        Ok(existed)
    }

    /// Removes a rule; `false` when it did not exist.
    pub fn delete_rule(&self, name: &str) -> bool {
        let mut rules = self.rules.write();
        let existed = rules.remove(name).is_some();
        if existed {
            self.metrics.forget_rule(name);
        }
        existed
    }

    /// Drops every rule (their runtimes stop once their requests finish).
    pub fn stop_all(&self) {
        self.rules.write().clear();
    }

    fn build_rule(&self, spec: RuleSpec) -> Result<RuleRuntime, ConfigError> {
        let router = self
            .rule_router(&spec)
            .spawn()
            .map_err(|e| ConfigError::Invalid {
                field: format!("rule {:?}", spec.doc.name),
                message: e.to_string(),
            })?;
        Ok(RuleRuntime {
            counters: self.metrics.rule(&spec.doc.name),
            tiers: super::metrics::InstanceTiers::default(),
            spec,
            router,
        })
    }

    /// The router `spec` runs under this gateway's limits, health checks and
    /// replicas, not yet started: [`KvRouterBuilder::spawn`] serves it,
    /// [`KvRouterBuilder::build`] gives its prompt path and decisions
    /// without any background work (`kvroute tokenize --config`).
    pub fn rule_router(&self, spec: &RuleSpec) -> KvRouterBuilder {
        // An adapter without a `[[models]]` entry of its own tokenizes as
        // its base model (one tokenizer load for both).
        for (adapter, base) in &spec.lora_base {
            if !self.models.contains(adapter) {
                self.tokenizers.alias(adapter.clone(), base.clone());
            }
        }
        let mut thresholds = Thresholds::default();
        if let Some(n) = spec.doc.min_overlap_blocks {
            thresholds.min_overlap_blocks = n;
        }
        if let Some(n) = spec.doc.max_retries {
            thresholds.max_retries = n;
        }
        if let Some(n) = spec.doc.sample_size {
            thresholds.sample_size = n;
        }
        let limits = &self.limits;
        let mut b = match &spec.contract {
            Some(c) => KvRouter::builder(c.clone()),
            None => KvRouter::builder_without_contract(),
        }
        .name(spec.doc.name.clone())
        .topology(spec.topology)
        .choice(spec.choice)
        .scorer(Arc::clone(&spec.scorer))
        .fallback(spec.selector)
        .thresholds(thresholds)
        .burst_order(
            spec.doc
                .burst_order_ms
                .map_or(kvroute_select::DEFAULT_BURST_ORDER, Duration::from_millis),
        )
        .breaker(BreakerConfig {
            failure_threshold: self.health.failure_threshold,
            cool_down: Duration::from_millis(self.health.cool_down_ms),
        })
        .outlier_detection(outlier_config(&self.health))
        .header_timeouts(HeaderTimeouts {
            response: Some(limits.response_header_timeout()),
            streamed: Some(limits.stream_header_timeout()),
        })
        .max_endpoints(spec.endpoints.len().max(1))
        .tokenizers(Arc::clone(&self.tokenizers))
        .tokenize_admission(Arc::clone(&self.tokenize_admission))
        .tokenize_overload(limits.tokenize_overload)
        .tokenize_wait(limits.tokenize_wait())
        .max_prompt_chars(limits.max_prompt_chars)
        .max_prompt_tokens(limits.max_prompt_tokens)
        .include_usage(limits.include_usage)
        .forward_token_ids(spec.doc.forward_token_ids);
        for (model, adapter) in &spec.lora {
            b = b.lora(model.clone(), adapter.clone());
        }
        for e in &spec.endpoints {
            b = b.endpoint(backend(e));
        }
        b = if self.health.interval_ms > 0 {
            b.health_probes(ProbeConfig {
                path: self.health.path.clone(),
                interval: Duration::from_millis(self.health.interval_ms),
                timeout: Duration::from_millis(self.health.timeout_ms.max(1)),
            })
        } else {
            b.no_health_probes()
        };
        b = if limits.engine_load_poll_ms > 0 {
            let interval = Duration::from_millis(limits.engine_load_poll_ms);
            b.engine_load(EngineLoadConfig {
                interval,
                timeout: interval.max(Duration::from_millis(200)),
                max_age: Duration::from_secs(5),
            })
        } else {
            b.no_engine_load()
        };
        if let Some((transport, cfg)) = &self.replicas {
            let mut r = ReplicaConfig::new(Arc::clone(transport) as Arc<dyn ReplicaTransport>);
            r.pool = Some(spec.doc.name.clone());
            r.sync_interval = Duration::from_millis(cfg.sync_interval_ms.max(1));
            r.heartbeat = Duration::from_millis(cfg.heartbeat_ms.max(1));
            r.stagger = Duration::from_millis(cfg.stagger_ms);
            r.ttl = Duration::from_millis(cfg.remote_ttl_ms.max(1));
            r.order = cfg.order;
            b = b.replicas(r);
        }
        b
    }
}

/// `[health]`'s outlier keys as the library's configuration. A request's
/// engine must count it in its load report within the report grace: 2 s
/// (transfer and tokenization before its scheduler admits it), shorter only
/// for a stall limit under 4 s.
fn outlier_config(h: &super::config::HealthConfig) -> OutlierConfig {
    let stall = Duration::from_millis(h.outlier_stall_ms);
    OutlierConfig {
        stall_after: stall,
        report_grace: (stall / 2).min(Duration::from_secs(2)),
        consecutive_timeouts: h.outlier_consecutive_timeouts,
        base_ejection: Duration::from_millis(h.outlier_ejection_ms),
        max_ejection: Duration::from_millis(h.outlier_max_ejection_ms),
    }
}
