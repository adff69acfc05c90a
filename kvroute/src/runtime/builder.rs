//! [`KvRouterBuilder`]: everything a router is built from, with production
//! defaults, and the settings of its background work (engine load polling,
//! health probes, replica load sharing).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{HashContract, LoraAdapter};
use kvroute_engines::prompt::{ModelOptions, TokenizerPool};
use kvroute_ingest::IndexConfig;
use kvroute_select::{
    BreakerConfig, Choice, CostScorer, OutlierConfig, PredictedConfig, ScorerRef, SelectorKind,
    Thresholds, Topology,
};

use super::outlier::HeaderTimeouts;
use super::replicas::ReplicaConfig;
use super::{BuildError, KvRouter};
use crate::admission::{AdmissionLimits, TokenizeAdmission, TokenizeOverload};
use crate::backend::Backend;
use crate::clock::{Clock, SystemClock};
use crate::prompt::PromptOptions;

/// Polling of each engine's own load report (`GET /metrics` in the engine's
/// dialect): running and waiting requests, KV usage and capacity, and (vLLM)
/// the prefill counters the cost scorer's drain model reads. What the
/// engines report covers every gateway replica's requests; the router
/// composes it with its own counts without counting a request twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLoadConfig {
    /// How often each engine is polled.
    pub interval: Duration,
    /// Longest wait for one poll.
    pub timeout: Duration,
    /// How long a report is trusted; older ones are ignored.
    pub max_age: Duration,
}

impl Default for EngineLoadConfig {
    /// `kvroute serve`'s: every 500 ms, 500 ms timeout, reports trusted
    /// for 5 s.
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(500),
            timeout: Duration::from_millis(500),
            max_age: Duration::from_secs(5),
        }
    }
}

/// Active health probes: `GET url + path` on every endpoint each
/// `interval`. Failures and connect failures of requests feed the same
/// circuit breaker; a successful probe closes it, so an engine that comes
/// back is used again without a request risking it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    /// The probed path (vLLM, SGLang and TensorRT-LLM serve `/health`).
    pub path: String,
    /// Time between probes of one endpoint.
    pub interval: Duration,
    /// Longest wait for one probe.
    pub timeout: Duration,
}

impl Default for ProbeConfig {
    /// `kvroute serve`'s: `/health` every 5 s, 1 s timeout.
    fn default() -> Self {
        Self {
            path: "/health".to_owned(),
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(1),
        }
    }
}

/// Builds a [`KvRouter`]; see [`KvRouter::builder`].
#[derive(Debug)]
#[must_use]
pub struct KvRouterBuilder {
    pub(super) contract: Option<HashContract>,
    /// A contract the host hashes itself: its name and block size.
    pub(super) host_keys: Option<(String, u32)>,
    pub(super) name: String,
    pub(super) models: Vec<(String, PathBuf, ModelOptions)>,
    pub(super) lora: HashMap<String, LoraAdapter>,
    pub(super) backends: Vec<Backend>,
    pub(super) topology: Topology,
    pub(super) choice: Choice,
    pub(super) scorer: ScorerRef,
    pub(super) fallback: SelectorKind,
    pub(super) thresholds: Thresholds,
    pub(super) predicted: PredictedConfig,
    pub(super) seed: u64,
    pub(super) breaker: BreakerConfig,
    pub(super) options: PromptOptions,
    pub(super) max_endpoints: usize,
    pub(super) index: IndexConfig,
    pub(super) admission: AdmissionLimits,
    pub(super) shared_admission: Option<Arc<TokenizeAdmission>>,
    pub(super) tokenizers: Option<Arc<TokenizerPool>>,
    pub(super) overload: TokenizeOverload,
    pub(super) tokenize_wait: Duration,
    pub(super) engine_load: Option<EngineLoadConfig>,
    pub(super) probes: Option<ProbeConfig>,
    pub(super) outlier: OutlierConfig,
    pub(super) header_timeouts: HeaderTimeouts,
    pub(super) replicas: Option<ReplicaConfig>,
    pub(super) burst_order: Duration,
    pub(super) clock: Arc<dyn Clock>,
}

impl KvRouterBuilder {
    pub(super) fn new(contract: Option<HashContract>) -> Self {
        Self {
            contract,
            host_keys: None,
            name: "kvroute".to_owned(),
            models: Vec::new(),
            lora: HashMap::new(),
            backends: Vec::new(),
            topology: Topology::Converged,
            choice: Choice::KvExact,
            scorer: Arc::new(CostScorer::default()),
            fallback: SelectorKind::LeastPrefill,
            thresholds: Thresholds::default(),
            predicted: PredictedConfig::default(),
            seed: 0,
            breaker: BreakerConfig::default(),
            options: PromptOptions::default(),
            max_endpoints: 64,
            index: IndexConfig::default(),
            admission: AdmissionLimits {
                max_count: std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
                max_bytes: 8 << 20,
            },
            shared_admission: None,
            tokenizers: None,
            overload: TokenizeOverload::Wait,
            tokenize_wait: Duration::from_millis(250),
            // `kvroute serve`'s defaults, where this build can poll.
            engine_load: cfg!(feature = "trtllm-http").then(EngineLoadConfig::default),
            probes: cfg!(feature = "trtllm-http").then(ProbeConfig::default),
            outlier: OutlierConfig::default(),
            header_timeouts: HeaderTimeouts::default(),
            replicas: None,
            burst_order: kvroute_select::DEFAULT_BURST_ORDER,
            clock: Arc::new(SystemClock::new()),
        }
    }

    /// A rule name (metrics label, replica pool name; default `kvroute`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A model the router tokenizes for: `dir` holds `tokenizer.json` (or
    /// `.json.gz`) and `tokenizer_config.json`, whose `chat_template` renders
    /// chat requests (`chat_template.jinja` / `.json` in `dir` win over it, as
    /// in transformers). `slug` is the body's `model`. Tokenizers load when
    /// the router spawns; a directory without a tokenizer is an error then.
    pub fn model(self, slug: impl Into<String>, dir: impl Into<PathBuf>) -> Self {
        self.model_with(slug, dir, ModelOptions::default())
    }

    /// [`Self::model`] with per-model options: above all the engine's
    /// `max_model_len` where it is not the model's `config.json`
    /// `max_position_embeddings` (an engine started with `--max-model-len`,
    /// or a directory without `config.json`). Prompts longer than it are not
    /// KV-routed, and `truncate_prompt_tokens: -1` cuts prompts to it as the
    /// engine does (one token less, room for the first generated one), so
    /// the keys match the engine's only with the engine's figure.
    ///
    /// ```
    /// use kvroute::prompt::ModelOptions;
    /// let contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    /// let b = kvroute::KvRouter::builder(contract).model_with(
    ///     "qwen3",
    ///     "/models/qwen3",
    ///     ModelOptions { max_model_len: Some(8192), ..ModelOptions::default() },
    /// );
    /// # let _ = b;
    /// ```
    pub fn model_with(
        mut self,
        slug: impl Into<String>,
        dir: impl Into<PathBuf>,
        options: ModelOptions,
    ) -> Self {
        self.models.push((slug.into(), dir.into(), options));
        self
    }

    /// Requests naming `model` run under this LoRA adapter: the engines mix
    /// it into their block keys (vLLM: every block), so the prompt's keys
    /// are hashed with it. They tokenize with the first [`Self::model`]
    /// (the adapter's base) unless a tokenizer is staged under `model`
    /// itself; a host sharing its own pool says which base with
    /// [`TokenizerPool::alias`](kvroute_engines::prompt::TokenizerPool::alias).
    pub fn lora(mut self, model: impl Into<String>, adapter: LoraAdapter) -> Self {
        self.lora.insert(model.into(), adapter);
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

    /// The KV-exact scorer (default: [`kvroute_select::CostScorer`]); a
    /// host's own [`kvroute_select::Scorer`] runs here as the built-ins do.
    pub fn scorer(mut self, scorer: ScorerRef) -> Self {
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

    /// Predicted entries (each decision credits its endpoint with the
    /// prompt's keys until the engine's own events arrive).
    pub fn predicted(mut self, predicted: PredictedConfig) -> Self {
        self.predicted = predicted;
        self
    }

    /// Seed of the pseudo-random selectors.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Circuit breaker of every endpoint, fed by [`crate::Pick::retry`],
    /// [`crate::Pick::connected`] and the health probes.
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

    /// Endpoint slots the inventory index, load tracker and counters are
    /// sized for: the most endpoints present at once, including ones added
    /// later.
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

    /// One tokenization bound shared with other routers (a host with several
    /// pools bounds its tokenizers once); replaces the two limits above.
    pub fn tokenize_admission(mut self, admission: Arc<TokenizeAdmission>) -> Self {
        self.shared_admission = Some(admission);
        self
    }

    /// One tokenizer pool shared with other routers (a host with several
    /// pools loads each model once). The router registers its
    /// [`KvRouterBuilder::model`]s in it.
    pub fn tokenizers(mut self, pool: Arc<TokenizerPool>) -> Self {
        self.tokenizers = Some(pool);
        self
    }

    /// What a request does when tokenization is at either bound: wait up to
    /// [`KvRouterBuilder::tokenize_wait`] for room (default), or skip KV
    /// routing at once (a `tokenize_overloaded` miss routed by the fallback).
    /// A wait that runs out skips too.
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
    /// provably the same request to the target's engine (see
    /// [`crate::prompt`]); every other request goes as text, counted by
    /// reason in [`KvRouter::token_id_counters`].
    pub fn forward_token_ids(mut self, on: bool) -> Self {
        self.options.forward_token_ids = on;
        self
    }

    /// Poll every engine's own load report (default: on, with
    /// [`EngineLoadConfig::default`], in builds with the `trtllm-http`
    /// feature, which carries the HTTP client); see [`EngineLoadConfig`].
    pub fn engine_load(mut self, config: EngineLoadConfig) -> Self {
        self.engine_load = Some(config);
        self
    }

    /// Never poll the engines' load reports: the router counts only its own
    /// requests (and its replicas').
    pub fn no_engine_load(mut self) -> Self {
        self.engine_load = None;
        self
    }

    /// Probe every endpoint's health (default: on, with
    /// [`ProbeConfig::default`], in builds with the `trtllm-http` feature);
    /// see [`ProbeConfig`].
    pub fn health_probes(mut self, config: ProbeConfig) -> Self {
        self.probes = Some(config);
        self
    }

    /// Never probe: only request failures open an endpoint's breaker.
    pub fn no_health_probes(mut self) -> Self {
        self.probes = None;
        self
    }

    /// Outlier detection (default: [`OutlierConfig::default`]): an endpoint
    /// whose requests get no response headers while the other endpoints
    /// answer is taken out of rotation when its engine's load reports
    /// ([`KvRouterBuilder::engine_load`]) do not count them, or after
    /// consecutive header timeouts; see [`kvroute_select::OutlierDetector`].
    /// It follows the attempts a host waits on with
    /// [`crate::Pick::await_headers`].
    pub fn outlier_detection(mut self, config: OutlierConfig) -> Self {
        self.outlier = config;
        self
    }

    /// How long [`crate::Pick::await_headers`] waits for response headers
    /// (default: [`HeaderTimeouts::default`], `kvroute serve`'s).
    pub fn header_timeouts(mut self, timeouts: HeaderTimeouts) -> Self {
        self.header_timeouts = timeouts;
        self
    }

    /// Within a burst, requests whose prompt has no home wait this long
    /// (default 1 ms; zero: off) so that the burst's requests whose cache
    /// decides where they go are placed first, and the others after them on a
    /// view that holds those placements ([`kvroute_select::burst_turn`],
    /// [`KvRouter::turn`]). Only while this router's decisions come in
    /// bursts (several at one instant); with replicas the wait is at least
    /// [`ReplicaConfig::stagger`]. Set it above the time over which one
    /// burst reaches this router. Holds are counted in
    /// [`kvroute_select::CountersSnapshot::held`].
    pub fn burst_order(mut self, order: Duration) -> Self {
        self.burst_order = order;
        self
    }

    /// Share load with the other replicas of this router over `config`'s
    /// transport (off by default); see [`ReplicaConfig`].
    pub fn replicas(mut self, config: ReplicaConfig) -> Self {
        self.replicas = Some(config);
        self
    }

    /// The time source (default: the host's monotonic clock). The simulator
    /// and tests pass a [`crate::ManualClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Builds the router and starts, on the current tokio runtime, every
    /// endpoint's event followers (they keep retrying until their engine is
    /// up), the tokenizer loads, and the configured probes, pollers and
    /// replica sharing. The library never starts a runtime.
    ///
    /// # Errors
    /// [`BuildError`]: among others a model directory without a tokenizer,
    /// an endpoint whose events cannot be followed, and
    /// [`BuildError::NoRuntime`] outside a runtime.
    pub fn spawn(self) -> Result<KvRouter, BuildError> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| BuildError::NoRuntime)?;
        self.spawn_on(handle)
    }

    /// [`KvRouterBuilder::spawn`] on the runtime behind `handle`.
    ///
    /// # Errors
    /// [`BuildError`].
    pub fn spawn_on(self, handle: tokio::runtime::Handle) -> Result<KvRouter, BuildError> {
        KvRouter::assemble(self, Some(handle))
    }

    /// Builds the router without starting anything: no followers, probes,
    /// pollers or replica tasks, and tokenizers load on first use. The host
    /// drives it — [`KvRouter::ingest`] for engine events,
    /// [`KvRouter::report_engine_load`] for engine reports,
    /// [`KvRouter::drain_replica_batch`] / [`KvRouter::apply_replica_batch`]
    /// for replica sharing — as the simulator does with simulated time.
    /// Decisions are made with [`KvRouter::pick_keys`] or
    /// [`KvRouter::pick_prepared`].
    ///
    /// # Errors
    /// [`BuildError`].
    pub fn build(self) -> Result<KvRouter, BuildError> {
        KvRouter::assemble(self, None)
    }
}
