//! Documents → typed, checked specs. Every error names the dotted field at
//! fault (`rules[0].endpoints[1].url`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use hyper::Uri;
use kvroute::engine::{Engine, Follow, Stream};
use kvroute_core::{HashContract, HashError, LoraAdapter, RequestExtras};
use kvroute_select::{
    Choice, CostConfig, CostScorer, LoadAwareConfig, LoadAwareScorer, Role, ScorerKind, ScorerRef,
    SelectorKind, Topology,
};

use super::{
    invalid, ConfigError, CostDoc, DecisionsConfig, EndpointDoc, FileConfig, HealthConfig,
    LimitsConfig, ModelConfig, ReplicasConfig, RuleDoc,
};

/// A validated endpoint.
#[derive(Clone, Debug)]
pub struct EndpointSpec {
    /// Base URL as configured.
    pub url: String,
    /// `scheme://authority` of the upstream; requests go only there.
    pub base: Uri,
    /// P/D role.
    pub role: Role,
    /// Engine.
    pub engine: Arc<dyn Engine>,
    /// What the runtime follows for this endpoint, as its engine plans it
    /// (one ZeroMQ stream per DP rank, or the drain).
    pub streams: Vec<Stream>,
    /// The engine's KV-event endpoint as configured.
    pub zmq: Option<String>,
    /// The engine's replay endpoint as configured.
    pub replay: Option<String>,
    /// Data-parallel ranks.
    pub dp_ranks: u32,
    /// ZeroMQ topic.
    pub topic: String,
    /// TensorRT-LLM drain URL (`<url>/kv_cache_events`) when `drain = true`.
    pub drain: Option<String>,
    /// Weight.
    pub weight: u32,
    /// Capacity.
    pub capacity: u32,
}

/// A validated rule.
#[derive(Clone, Debug)]
pub struct RuleSpec {
    /// The document it came from (listed back by the admin API).
    pub doc: RuleDoc,
    /// Choice.
    pub choice: Choice,
    /// Topology.
    pub topology: Topology,
    /// Contract (KV-exact rules).
    pub contract: Option<HashContract>,
    /// Scorer.
    pub scorer: ScorerRef,
    /// Miss selector.
    pub selector: SelectorKind,
    /// Endpoints.
    pub endpoints: Vec<EndpointSpec>,
    /// LoRA adapters by the model name requests use for them.
    pub lora: BTreeMap<String, LoraAdapter>,
    /// Each adapter's base model, whose tokenizer its requests use.
    pub lora_base: BTreeMap<String, String>,
}

/// The validated file.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Proxy listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin_listen: SocketAddr,
    /// Bearer token for `/admin/*` (never logged).
    pub admin_token: Option<String>,
    /// Limits.
    pub limits: LimitsConfig,
    /// Health checks.
    pub health: HealthConfig,
    /// Decision headers and log sampling.
    pub decisions: DecisionsConfig,
    /// Models (directories resolved).
    pub models: Vec<ModelConfig>,
    /// Rules.
    pub rules: Vec<RuleSpec>,
    /// Replica load sharing over NATS (`[replicas]`).
    pub replicas: ReplicasConfig,
}

impl ServeConfig {
    /// Reads and validates a TOML file.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, line or field at fault.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or_else(|| Path::new("."));
        Self::from_toml(&text, base)
    }

    /// Parses and validates TOML text; relative model dirs resolve against `base`.
    ///
    /// # Errors
    /// [`ConfigError`].
    pub fn from_toml(text: &str, base: &Path) -> Result<Self, ConfigError> {
        Self::validate(FileConfig::from_toml(text)?, base)
    }

    fn validate(file: FileConfig, base: &Path) -> Result<Self, ConfigError> {
        let listen = parse_addr("listen", &file.listen)?;
        let admin_listen = parse_addr("admin.listen", &file.admin.listen)?;
        let replicas = validate_replicas(file.replicas.clone(), base)?;
        let admin_token = match (&file.admin.token, &file.admin.token_env) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "admin",
                    "set either `token` or `token_env`, not both",
                ))
            }
            (Some(t), None) => Some(t.clone()),
            (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
                invalid(
                    "admin.token_env",
                    format!("environment variable {var:?} is not set"),
                )
            })?),
            (None, None) => None,
        };
        if admin_token.as_deref().is_some_and(str::is_empty) {
            return Err(invalid("admin.token", "the bearer token is empty"));
        }
        if !admin_listen.ip().is_loopback() {
            if !file.admin.allow_remote {
                return Err(invalid(
                    "admin.listen",
                    format!("{admin_listen} is not a loopback address; set admin.allow_remote = true (and a token) to expose the admin API"),
                ));
            }
            if admin_token.is_none() {
                return Err(invalid(
                    "admin.token",
                    "a non-loopback admin listener requires a bearer token",
                ));
            }
        }
        let limits = file.limits;
        for (name, v) in [
            ("limits.max_body_bytes", limits.max_body_bytes),
            ("limits.max_prompt_tokens", limits.max_prompt_tokens),
            ("limits.max_prompt_chars", limits.max_prompt_chars),
            (
                "limits.max_concurrent_tokenizations",
                limits.max_concurrent_tokenizations,
            ),
            (
                "limits.max_tokenize_bytes_in_flight",
                limits.max_tokenize_bytes_in_flight,
            ),
        ] {
            if v == 0 {
                return Err(invalid(name, "must be at least 1"));
            }
        }
        for (name, v) in [
            (
                "limits.header_read_timeout_ms",
                limits.header_read_timeout_ms,
            ),
            ("limits.body_read_timeout_ms", limits.body_read_timeout_ms),
            ("limits.connect_timeout_ms", limits.connect_timeout_ms),
            (
                "limits.upstream_idle_timeout_ms",
                limits.upstream_idle_timeout_ms,
            ),
            ("limits.upstream_pool_idle_ms", limits.upstream_pool_idle_ms),
            (
                "limits.response_header_timeout_ms",
                limits.response_header_timeout_ms,
            ),
            (
                "limits.stream_header_timeout_ms",
                limits.stream_header_timeout_ms,
            ),
            (
                "health.outlier_ejection_ms",
                file.health.outlier_ejection_ms,
            ),
        ] {
            if v == 0 {
                return Err(invalid(name, "must be at least 1 ms"));
            }
        }
        let rate = file.decisions.log_sample_rate;
        if !(0.0..=1.0).contains(&rate) {
            return Err(invalid(
                "decisions.log_sample_rate",
                format!("{rate} is not between 0 and 1"),
            ));
        }
        if file.decisions.ring > super::MAX_DECISION_RING {
            return Err(invalid(
                "decisions.ring",
                format!(
                    "{} is above {} decisions",
                    file.decisions.ring,
                    super::MAX_DECISION_RING
                ),
            ));
        }
        if file.health.outlier_max_ejection_ms < file.health.outlier_ejection_ms {
            return Err(invalid(
                "health.outlier_max_ejection_ms",
                format!(
                    "{} is below health.outlier_ejection_ms ({})",
                    file.health.outlier_max_ejection_ms, file.health.outlier_ejection_ms
                ),
            ));
        }
        if !file.health.path.starts_with('/') {
            return Err(invalid("health.path", "must start with '/'"));
        }
        let mut slugs = BTreeSet::new();
        let mut models = Vec::new();
        for (i, m) in file.models.into_iter().enumerate() {
            if m.slug.is_empty() {
                return Err(invalid(format!("models[{i}].slug"), "is empty"));
            }
            if !slugs.insert(m.slug.clone()) {
                return Err(invalid(
                    format!("models[{i}].slug"),
                    format!("model {:?} is staged twice", m.slug),
                ));
            }
            let dir = if m.dir.is_absolute() {
                m.dir
            } else {
                base.join(m.dir)
            };
            if !dir.is_dir() {
                return Err(invalid(
                    format!("models[{i}].dir"),
                    format!("{} is not a directory", dir.display()),
                ));
            }
            if m.max_model_len == Some(0) {
                return Err(invalid(format!("models[{i}].max_model_len"), "is 0"));
            }
            models.push(ModelConfig {
                slug: m.slug,
                dir,
                max_model_len: m.max_model_len,
                content_format: m.content_format,
            });
        }
        let mut rules = Vec::new();
        for (i, doc) in file.rules.into_iter().enumerate() {
            rules.push(RuleSpec::validate(doc, &format!("rules[{i}]"))?);
        }
        check_rule_set(&rules)?;
        Ok(Self {
            listen,
            admin_listen,
            admin_token,
            limits,
            health: file.health,
            decisions: file.decisions,
            replicas,
            models,
            rules,
        })
    }
}

/// Rule names unique, at most one default, a model served by one rule only.
///
/// # Errors
/// [`ConfigError::Invalid`] naming the conflict.
pub fn check_rule_set(rules: &[RuleSpec]) -> Result<(), ConfigError> {
    let mut names = BTreeSet::new();
    let mut models = BTreeSet::new();
    let mut default: Option<&str> = None;
    for r in rules {
        if !names.insert(r.doc.name.as_str()) {
            return Err(invalid(
                format!("rule {:?}", r.doc.name),
                "a rule with this name already exists",
            ));
        }
        for m in &r.doc.models {
            if !models.insert(m.as_str()) {
                return Err(invalid(
                    format!("rule {:?}.models", r.doc.name),
                    format!("model {m:?} is already served by another rule"),
                ));
            }
        }
        if r.doc.default {
            if let Some(other) = default {
                return Err(invalid(
                    format!("rule {:?}.default", r.doc.name),
                    format!("rule {other:?} is already the default rule"),
                ));
            }
            default = Some(&r.doc.name);
        }
    }
    Ok(())
}

fn parse_addr(field: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|_| invalid(field, format!("{s:?} is not an ip:port socket address")))
}

impl RuleSpec {
    /// Validates one rule document; `at` prefixes field names in errors.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`].
    pub fn validate(doc: RuleDoc, at: &str) -> Result<Self, ConfigError> {
        let f = |name: &str| format!("{at}.{name}");
        if doc.name.len() > MAX_RULE_NAME {
            return Err(invalid(
                f("name"),
                format!(
                    "is {} bytes; at most {MAX_RULE_NAME} (it names metrics and admin URLs)",
                    doc.name.len()
                ),
            ));
        }
        if doc.name.is_empty()
            || !doc
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(invalid(
                f("name"),
                format!(
                    "{:?} must be non-empty ASCII letters, digits, '-', '_' or '.'",
                    doc.name
                ),
            ));
        }
        if doc.models.is_empty() && !doc.default {
            return Err(invalid(
                f("models"),
                "a rule needs at least one model slug or `default = true`",
            ));
        }
        let (choice, topology, selector) = (doc.choice, doc.topology, doc.selector);
        let kind = doc.scorer.parse::<ScorerKind>().ok();
        let scorer: ScorerRef = match kind {
            Some(ScorerKind::LoadAware) => Arc::new(LoadAwareScorer(load_aware_config(
                doc.load_slack,
                &f("load_slack"),
            )?)),
            Some(ScorerKind::Cost) => {
                Arc::new(CostScorer(cost_config(doc.cost.as_ref(), &f("cost"))?))
            }
            Some(kind) => kind.build(),
            None => crate::gateway::extensions::scorer(&doc.scorer).ok_or_else(|| {
                invalid(
                    f("scorer"),
                    format!(
                        "unknown scorer {:?}; expected {}",
                        doc.scorer,
                        crate::gateway::extensions::scorer_names().join(", ")
                    ),
                )
            })?,
        };
        if doc.cost.is_some() && kind != Some(ScorerKind::Cost) {
            return Err(invalid(
                f("cost"),
                format!(
                    "only applies to scorer = \"cost\" (this rule uses \"{}\")",
                    doc.scorer
                ),
            ));
        }
        if doc.load_slack.is_some() && kind != Some(ScorerKind::LoadAware) {
            return Err(invalid(
                f("load_slack"),
                format!(
                    "only applies to scorer = \"load_aware\" (this rule uses \"{}\")",
                    doc.scorer
                ),
            ));
        }
        let contract = match (&doc.contract, choice) {
            (Some(c), _) => Some(c.parse::<HashContract>().map_err(|e| {
                invalid(f("contract"), format!("{c:?}: {e}"))
            })?),
            (None, Choice::KvExact) => {
                return Err(invalid(
                    f("contract"),
                    "a kv_exact rule needs a hash contract, e.g. \"vllm@0.33.0:sha256_cbor:block=16:seed=0\" (there is no default)",
                ))
            }
            (None, _) => None,
        };
        if let Some(c) = &contract {
            c.hasher()
                .map_err(|e| invalid(f("contract"), format!("cannot hash with {c}: {e}")))?;
        }
        if doc.endpoints.is_empty() {
            return Err(invalid(
                f("endpoints"),
                "a rule needs at least one endpoint",
            ));
        }
        let mut urls = BTreeSet::new();
        let mut endpoints = Vec::new();
        for (i, e) in doc.endpoints.iter().enumerate() {
            let at = format!("{at}.endpoints[{i}]");
            let spec = EndpointSpec::validate(e, &at, choice)?;
            if !urls.insert(spec.base.to_string()) {
                return Err(invalid(
                    format!("{at}.url"),
                    format!("{} is listed twice in this rule", e.url),
                ));
            }
            endpoints.push(spec);
        }
        // The listing (admin API) gives each engine by its canonical name,
        // whatever alias the document used.
        let mut doc = doc;
        for (e, spec) in doc.endpoints.iter_mut().zip(&endpoints) {
            spec.engine.name().clone_into(&mut e.engine);
        }
        if topology == Topology::PrefillDecode {
            if !endpoints.iter().any(|e| e.role.can_prefill())
                || !endpoints.iter().any(|e| e.role.can_decode())
            {
                return Err(invalid(
                    f("endpoints"),
                    "a prefill_decode rule needs at least one prefill and one decode endpoint",
                ));
            }
        } else if endpoints.iter().any(|e| e.role != Role::Both) {
            return Err(invalid(
                f("endpoints"),
                "endpoint roles prefill/decode need topology = \"prefill_decode\"",
            ));
        }
        if choice == Choice::KvExact
            && !endpoints
                .iter()
                .any(|e| e.role.can_prefill() && !e.streams.is_empty())
        {
            return Err(invalid(
                f("endpoints"),
                "a kv_exact rule needs at least one prefill-capable endpoint with a `zmq` KV-event endpoint (or `drain = true` for trtllm)",
            ));
        }
        if let (Some(n), true) = (doc.min_overlap_blocks, choice == Choice::KvExact) {
            if n == 0 {
                return Err(invalid(f("min_overlap_blocks"), "must be at least 1"));
            }
        }
        if let Some(ms) = doc.burst_order_ms.filter(|ms| *ms > MAX_BURST_ORDER_MS) {
            return Err(invalid(
                f("burst_order_ms"),
                format!("{ms} is out of range; expected 0 to {MAX_BURST_ORDER_MS}"),
            ));
        }
        let (lora, lora_base) = lora_adapters(&doc, contract.as_ref(), at)?;
        Ok(Self {
            doc,
            choice,
            topology,
            contract,
            scorer,
            selector,
            endpoints,
            lora,
            lora_base,
        })
    }
}

/// Adapters by model name, and each adapter's base model.
type LoraSpecs = (BTreeMap<String, LoraAdapter>, BTreeMap<String, String>);

/// Validates `[[rules.lora]]`: non-empty unique names that are among the
/// rule's `models`, non-empty paths, a base model among the rule's models
/// that is not an adapter, and a contract that keys LoRA adapters (asked of
/// the hasher itself, so the check follows kvroute-core exactly).
fn lora_adapters(
    doc: &RuleDoc,
    contract: Option<&HashContract>,
    at: &str,
) -> Result<LoraSpecs, ConfigError> {
    let mut out = BTreeMap::new();
    let mut bases = BTreeMap::new();
    let is_adapter = |m: &String| doc.lora.iter().any(|l| &l.model == m);
    for (i, l) in doc.lora.iter().enumerate() {
        let f = |name: &str| format!("{at}.lora[{i}].{name}");
        if l.model.is_empty() {
            return Err(invalid(f("model"), "is empty"));
        }
        if !doc.models.contains(&l.model) {
            return Err(invalid(
                f("model"),
                format!(
                    "{:?} is not in {at}.models; list it there so its requests reach this rule",
                    l.model
                ),
            ));
        }
        if l.path.is_empty() {
            return Err(invalid(
                f("path"),
                "is empty; give the adapter path exactly as the engine was given it",
            ));
        }
        let base = match &l.base {
            Some(b) if !doc.models.contains(b) || is_adapter(b) => {
                return Err(invalid(
                    f("base"),
                    format!("{b:?} is not one of {at}.models that is not an adapter"),
                ));
            }
            Some(b) => b.clone(),
            None => match doc.models.iter().find(|m| !is_adapter(m)) {
                Some(b) => b.clone(),
                None => {
                    return Err(invalid(
                        f("base"),
                        format!("{at}.models lists no base model for the adapter to tokenize as"),
                    ))
                }
            },
        };
        bases.insert(l.model.clone(), base);
        let adapter = LoraAdapter {
            name: l.model.clone(),
            path: l.path.clone(),
        };
        let Some(c) = contract else {
            return Err(invalid(
                format!("{at}.lora"),
                "LoRA adapters change block keys; they need a kv_exact rule with a `contract`",
            ));
        };
        let probe = RequestExtras {
            lora: Some(adapter.clone()),
            ..RequestExtras::NONE
        };
        let refused = c
            .hasher()
            .ok()
            .and_then(|h| h.hash_prompt(&[], &probe, &mut Vec::new()).err());
        if let Some(e @ HashError::ExtraNotSupported { .. }) = refused {
            return Err(invalid(format!("{at}.lora"), format!("contract {c}: {e}")));
        }
        if out.insert(l.model.clone(), adapter).is_some() {
            return Err(invalid(
                f("model"),
                format!("adapter {:?} is listed twice", l.model),
            ));
        }
    }
    Ok((out, bases))
}

/// Largest accepted `burst_order_ms`: a burst arrives within milliseconds,
/// and every request without a home in one waits this long.
const MAX_BURST_ORDER_MS: u64 = 1000;

/// Largest accepted `load_slack`: beyond it the bound never binds in practice.
const MAX_LOAD_SLACK: f64 = 100.0;

/// The load-aware scorer's parameters with the rule's slack, if given.
fn load_aware_config(slack: Option<f64>, field: &str) -> Result<LoadAwareConfig, ConfigError> {
    let mut cfg = LoadAwareConfig::default();
    if let Some(eps) = slack {
        if !eps.is_finite() || !(0.0..=MAX_LOAD_SLACK).contains(&eps) {
            return Err(invalid(
                field,
                format!("{eps} is out of range; expected a number from 0 to {MAX_LOAD_SLACK}"),
            ));
        }
        cfg.epsilon = eps;
    }
    Ok(cfg)
}

/// Largest accepted token figure of `[rules.cost]` (a slack or per-request
/// weight beyond it decides nothing a smaller one would not).
const MAX_COST_TOKENS: f64 = 1e9;

/// The cost scorer's parameters with the rule's `[rules.cost]` overrides.
fn cost_config(doc: Option<&CostDoc>, at: &str) -> Result<CostConfig, ConfigError> {
    let mut cfg = CostConfig::default();
    let Some(doc) = doc else {
        return Ok(cfg);
    };
    let number =
        |name: &str, v: Option<f64>, lo: f64, hi: f64| -> Result<Option<f64>, ConfigError> {
            match v {
                Some(x) if !(x >= lo && x <= hi) => Err(invalid(
                    format!("{at}.{name}"),
                    format!("{x} is out of range; expected a number from {lo} to {hi}"),
                )),
                other => Ok(other),
            }
        };
    if let Some(x) = number("affinity_slack", doc.affinity_slack, 0.0, 100.0)? {
        cfg.affinity_slack = x;
    }
    if let Some(x) = number("affinity_tokens", doc.affinity_tokens, 0.0, MAX_COST_TOKENS)? {
        cfg.affinity_tokens = x;
    }
    if let Some(x) = number(
        "decode_tokens_per_request",
        doc.decode_tokens_per_request,
        0.0,
        MAX_COST_TOKENS,
    )? {
        cfg.decode_tokens_per_request = x;
    }
    if let Some(x) = number("prefill_weight", doc.prefill_weight, 1.0, 100.0)? {
        cfg.prefill_weight = x;
    }
    if let Some(x) = number("load_factor", doc.load_factor, 1.0, f64::INFINITY)? {
        cfg.load_factor = x;
    }
    if let Some(x) = number("tie_tokens", doc.tie_tokens, 0.0, MAX_COST_TOKENS)? {
        cfg.tie_tokens = x;
    }
    if let Some(h) = doc.load_headroom {
        cfg.load_headroom = h;
    }
    if let Some(d) = doc.drain_queue {
        cfg.drain_queue = d;
    }
    if let Some(x) = number("eviction_weight", doc.eviction_weight, 0.0, 100.0)? {
        cfg.eviction_weight = x;
    }
    Ok(cfg)
}

/// Longest rule name: it is a metrics label and part of admin URLs.
const MAX_RULE_NAME: usize = 128;

/// Largest endpoint `capacity` (concurrent requests it is sized for): far
/// beyond any engine's batch, so a larger figure is a typo or an attack.
const MAX_CAPACITY: u32 = 1_000_000;

/// A `tcp://host:port` event endpoint must name its port: port 0 would have
/// the subscriber bind (or dial) a port no engine publishes on.
fn check_event_port(field: String, endpoint: &str) -> Result<(), ConfigError> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Ok(());
    };
    let port = rest.rsplit_once(':').map(|(_, p)| p);
    if port.and_then(|p| p.parse::<u32>().ok()) == Some(0) {
        return Err(invalid(
            field,
            format!("{endpoint:?}: needs the engine's non-zero port"),
        ));
    }
    Ok(())
}

impl EndpointSpec {
    fn validate(e: &EndpointDoc, at: &str, choice: Choice) -> Result<Self, ConfigError> {
        let f = |name: &str| format!("{at}.{name}");
        let uri: Uri = e
            .url
            .parse()
            .map_err(|_| invalid(f("url"), format!("{:?} is not a URL", e.url)))?;
        if uri.scheme_str() != Some("http") {
            return Err(invalid(
                f("url"),
                format!("{:?}: only http:// upstreams are supported", e.url),
            ));
        }
        let Some(authority) = uri.authority().cloned() else {
            return Err(invalid(f("url"), format!("{:?} has no host:port", e.url)));
        };
        if authority.host().is_empty() || authority.port_u16() == Some(0) {
            return Err(invalid(
                f("url"),
                format!("{:?}: needs a host and a non-zero port", e.url),
            ));
        }
        if e.weight == 0 {
            return Err(invalid(f("weight"), "must be at least 1"));
        }
        if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
            return Err(invalid(
                f("url"),
                format!("{:?}: give the server's base URL (no path)", e.url),
            ));
        }
        let base = Uri::builder()
            .scheme("http")
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|err| invalid(f("url"), err.to_string()))?;
        let role = e.role;
        let engine = crate::gateway::extensions::engine(&e.engine)
            .map_err(|err| invalid(f("engine"), err))?;
        if choice == Choice::KvExact && role.can_prefill() {
            engine
                .kv_events()
                .map_err(|err| invalid(f("engine"), err.to_string()))?;
        }
        if e.dp_ranks == 0 {
            return Err(invalid(f("dp_ranks"), "must be at least 1"));
        }
        if e.capacity > MAX_CAPACITY {
            return Err(invalid(
                f("capacity"),
                format!("{} is above {MAX_CAPACITY} concurrent requests", e.capacity),
            ));
        }
        if let Some(z) = &e.zmq {
            check_event_port(f("zmq"), z)?;
        }
        if let Some(r) = &e.replay {
            check_event_port(f("replay"), r)?;
        }
        if e.replay.is_some() && e.zmq.is_none() {
            return Err(invalid(f("replay"), "a replay endpoint needs `zmq` too"));
        }
        // What the engine would follow, planned by the engine itself (the
        // runtime follows exactly these streams).
        let mut follow = Follow::new(e.url.clone(), 16)
            .topic(e.topic.clone())
            .dp_ranks(e.dp_ranks);
        if let Some(z) = &e.zmq {
            follow = follow.events(z.clone());
        }
        if let Some(r) = &e.replay {
            follow = follow.replay(r.clone());
        }
        let streams = if e.zmq.is_some() || e.drain {
            engine.streams(&follow).map_err(|err| match &err {
                kvroute_engines::transport::TransportError::Follow { field, .. } => invalid(
                    f(match *field {
                        "events" => "zmq",
                        "replay" => "replay",
                        _ => "url",
                    }),
                    err.to_string(),
                ),
                _ => invalid(f("engine"), err.to_string()),
            })?
        } else {
            Vec::new()
        };
        let drain = streams.iter().find_map(|s| match s {
            Stream::Drain(d) => Some(d.url.clone()),
            _ => None,
        });
        if e.drain && drain.is_none() {
            return Err(invalid(
                f("drain"),
                format!(
                    "{} publishes its events over `zmq`; only engines drained over HTTP (TensorRT-LLM) take `drain`",
                    engine.name()
                ),
            ));
        }
        if !e.drain && drain.is_some() {
            return Err(invalid(
                f("zmq"),
                format!(
                    "{} publishes no ZeroMQ events; set `drain = true` to poll its /kv_cache_events",
                    engine.name()
                ),
            ));
        }
        Ok(Self {
            url: e.url.clone(),
            base,
            role,
            engine,
            streams,
            zmq: e.zmq.clone(),
            replay: e.replay.clone(),
            dp_ranks: e.dp_ranks,
            topic: e.topic.clone(),
            drain,
            weight: e.weight,
            capacity: e.capacity,
        })
    }
}

/// Largest `replicas.stagger_ms`: the highest rank holds a request this many
/// times its rank; beyond a few tens of ms a turn costs more than the herd.
const MAX_STAGGER_MS: u64 = 50;

/// `[replicas]`: intervals consistent, files resolved against `base`, the
/// NATS URL and subject prefix usable.
fn validate_replicas(mut cfg: ReplicasConfig, base: &Path) -> Result<ReplicasConfig, ConfigError> {
    if cfg.sync_interval_ms == 0 {
        return Err(invalid("replicas.sync_interval_ms", "must be at least 1"));
    }
    if cfg.heartbeat_ms == 0 {
        return Err(invalid("replicas.heartbeat_ms", "must be at least 1"));
    }
    if cfg.receive_buffer == 0 {
        return Err(invalid("replicas.receive_buffer", "must be at least 1"));
    }
    if cfg.stagger_ms > MAX_STAGGER_MS {
        return Err(invalid(
            "replicas.stagger_ms",
            format!("at most {MAX_STAGGER_MS} (a turn holds requests rank times this long)"),
        ));
    }
    // A heartbeat goes out when due, but a change held back by
    // `sync_interval_ms` (at most `heartbeat_ms`) may delay it until the
    // held change goes out.
    let period = cfg
        .heartbeat_ms
        .saturating_add(cfg.sync_interval_ms.min(cfg.heartbeat_ms));
    if cfg.remote_ttl_ms <= period {
        return Err(invalid(
            "replicas.remote_ttl_ms",
            format!(
                "must exceed replicas.heartbeat_ms plus replicas.sync_interval_ms (at most the heartbeat), {period}: an idle replica would expire at the others between two heartbeats"
            ),
        ));
    }
    if let Some(url) = &cfg.nats {
        for u in url.split(',') {
            let ok = ["nats://", "tls://", "ws://", "wss://"]
                .iter()
                .any(|s| u.trim().starts_with(s))
                && u.trim().len() > 7;
            if !ok {
                return Err(invalid(
                    "replicas.nats",
                    format!("{u:?}: expected nats://host:port (or tls://, ws://, wss://)"),
                ));
            }
        }
    }
    if !kvroute::nats::valid_subject_prefix(&cfg.subject_prefix) {
        return Err(invalid(
            "replicas.subject_prefix",
            "dot-separated tokens of letters, digits, `-` and `_`",
        ));
    }
    if cfg.tls_cert_file.is_some() != cfg.tls_key_file.is_some() {
        return Err(invalid(
            "replicas.tls_cert_file",
            "a client certificate needs its key (tls_key_file), and the other way round",
        ));
    }
    for (field, value) in [
        ("replicas.credentials_file", &mut cfg.credentials_file),
        ("replicas.tls_ca_file", &mut cfg.tls_ca_file),
        ("replicas.tls_cert_file", &mut cfg.tls_cert_file),
        ("replicas.tls_key_file", &mut cfg.tls_key_file),
    ] {
        if let Some(v) = value {
            let p = base.join(&*v);
            if !p.is_file() {
                return Err(invalid(field, format!("{} is not a file", p.display())));
            }
            *v = p.to_string_lossy().into_owned();
        }
    }
    if let Some(var) = &cfg.token_env {
        if std::env::var(var).is_err() {
            return Err(invalid(
                "replicas.token_env",
                format!("environment variable {var} is not set"),
            ));
        }
    }
    Ok(cfg)
}

/// Rule documents as the admin API receives them (JSON with the same fields).
///
/// # Errors
/// [`ConfigError::Syntax`] for JSON that does not match, else validation errors.
pub fn rule_from_json(body: &[u8]) -> Result<RuleSpec, ConfigError> {
    RuleSpec::validate(RuleDoc::from_json(body)?, "rule")
}

#[cfg(test)]
mod tests;
