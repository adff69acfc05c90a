//! The file's shape as serde reads it: `listen`, `[admin]`, `[limits]`,
//! `[health]`, `[decisions]`, `[[models]]`, `[[rules]]`, `[replicas]`.
//! Unknown fields are refused everywhere so a typo is an error, not a default.

use std::path::PathBuf;
use std::time::Duration;

use kvroute_select::{Choice, Role, ScorerKind, SelectorKind, Topology};
use serde::{Deserialize, Serialize};

use super::{ConfigError, DecisionsConfig, TextPosition};

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Proxy listener, e.g. `0.0.0.0:8080` (port 0 = ephemeral).
    pub listen: String,
    /// Admin API and `/metrics`.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Size and time limits.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Active health checks and circuit breakers.
    #[serde(default)]
    pub health: HealthConfig,
    /// How routing decisions are shown (response headers, sampled log lines).
    #[serde(default)]
    pub decisions: DecisionsConfig,
    /// Staged tokenizers: model slug → directory.
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Routing rules.
    #[serde(default)]
    pub rules: Vec<RuleDoc>,
    /// Other `kvroute serve` replicas in front of the same engines.
    #[serde(default)]
    pub replicas: ReplicasConfig,
}

impl FileConfig {
    /// Reads a TOML text. Anything serde refuses (bad syntax, an unknown,
    /// missing or mistyped field, a name no enum variant has) is a
    /// [`ConfigError::Syntax`] with the field's dotted path and its line and
    /// column.
    ///
    /// # Errors
    /// [`ConfigError::Syntax`].
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
            let field = field_path(e.path(), None);
            let inner = e.into_inner();
            ConfigError::Syntax {
                field,
                message: inner.message().to_owned(),
                position: inner.span().map(|s| TextPosition::of_offset(text, s.start)),
            }
        })
    }
}

impl RuleDoc {
    /// Reads one rule as the admin API receives it: JSON with the fields of a
    /// `[[rules]]` table. Errors name the field as `rule.<path>`.
    ///
    /// # Errors
    /// [`ConfigError::Syntax`].
    pub fn from_json(body: &[u8]) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let doc = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = field_path(e.path(), Some("rule"));
            json_error(field, &e.into_inner())
        })?;
        de.end().map_err(|e| json_error(None, &e))?;
        Ok(doc)
    }
}

/// `prefix.path`, the bare path, or the prefix alone for the document root.
fn field_path(path: &serde_path_to_error::Path, prefix: Option<&str>) -> Option<String> {
    let path = (path.iter().next().is_some()).then(|| path.to_string());
    match (prefix, path) {
        (Some(p), Some(path)) => Some(format!("{p}.{path}")),
        (Some(p), None) => Some(p.to_owned()),
        (None, path) => path,
    }
}

fn json_error(field: Option<String>, e: &serde_json::Error) -> ConfigError {
    // serde_json has no accessor for the bare message: its text ends with
    // " at line L column C" whenever it knows the place (line 0 otherwise).
    let text = e.to_string();
    let (message, position) = if e.line() == 0 {
        (text, None)
    } else {
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let message = text.strip_suffix(&suffix).unwrap_or(&text).to_owned();
        let position = TextPosition {
            line: e.line(),
            column: e.column(),
        };
        (message, Some(position))
    };
    ConfigError::Syntax {
        field,
        message,
        position,
    }
}

/// `[replicas]`: replicas of this gateway in front of the same engines share
/// their load over NATS, so that each one's load view counts the others'
/// requests (`kvroute::ReplicaConfig`). Replicas find each other by their
/// messages; there is no peer list.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicasConfig {
    /// NATS server URL(s), comma-separated (`nats://host:4222`,
    /// `tls://host:4222`). Absent: no sharing.
    pub nats: Option<String>,
    /// Subject prefix: each rule's load travels on `{prefix}.{rule}.load`.
    pub subject_prefix: String,
    /// A NATS credentials file (`.creds`), relative to the configuration
    /// file.
    pub credentials_file: Option<String>,
    /// Name of an environment variable holding a NATS token.
    pub token_env: Option<String>,
    /// Require TLS to the server.
    pub tls_required: bool,
    /// PEM root certificates to trust for the server, relative to the
    /// configuration file.
    pub tls_ca_file: Option<String>,
    /// PEM client certificate (mutual TLS), with `tls_key_file`.
    pub tls_cert_file: Option<String>,
    /// PEM client key (mutual TLS), with `tls_cert_file`.
    pub tls_key_file: Option<String>,
    /// At most one message of load changes per rule per this interval: a
    /// decision after a quiet interval is published at once.
    pub sync_interval_ms: u64,
    /// Turns within a burst: while requests come in bursts, the replica of
    /// rank `k` holds each one `k · stagger_ms` before deciding it, after
    /// the lower ranks' decisions of the burst have reached it. 0: no turns.
    pub stagger_ms: u64,
    /// Every endpoint's totals are published at least this often, so a
    /// restarted replica or a lost message heals.
    pub heartbeat_ms: u64,
    /// A replica not heard from for this long has its requests dropped from
    /// the load view.
    pub remote_ttl_ms: u64,
    /// Received messages buffered at most while earlier ones are applied;
    /// beyond it the NATS client drops them (counted as `slow_consumer`).
    pub receive_buffer: usize,
    /// This replica's place among the replicas (unset: a random one each
    /// start). The replicas rank themselves in this order: set it, different
    /// on every replica, where the ranks must be the same in every run.
    pub order: Option<u32>,
}

impl Default for ReplicasConfig {
    /// The library's timing defaults ([`kvroute::ReplicaConfig::new`]), in
    /// milliseconds: an embedder and `kvroute serve` share load alike.
    fn default() -> Self {
        let lib = kvroute::ReplicaConfig::new(std::sync::Arc::new(kvroute::HostTransport));
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Self {
            nats: None,
            subject_prefix: "kvroute".to_owned(),
            credentials_file: None,
            token_env: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            sync_interval_ms: ms(lib.sync_interval),
            stagger_ms: ms(lib.stagger),
            heartbeat_ms: ms(lib.heartbeat),
            remote_ttl_ms: ms(lib.ttl),
            receive_buffer: kvroute::nats::NatsOptions::new("").subscription_capacity,
            order: lib.order,
        }
    }
}

/// `[admin]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Admin listener; loopback by default.
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// Name of an environment variable holding the bearer token (preferred: keeps
    /// the secret out of the file).
    #[serde(default)]
    pub token_env: Option<String>,
    /// The bearer token itself.
    #[serde(default)]
    pub token: Option<String>,
    /// Allow a non-loopback admin listener (only with a token).
    #[serde(default)]
    pub allow_remote: bool,
}

fn default_admin_listen() -> String {
    "127.0.0.1:9090".to_owned()
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: default_admin_listen(),
            token_env: None,
            token: None,
            allow_remote: false,
        }
    }
}

/// `[limits]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Time allowed to receive the request headers.
    pub header_read_timeout_ms: u64,
    /// Time allowed to receive the whole request body (408 beyond).
    pub body_read_timeout_ms: u64,
    /// Upstream TCP connect timeout (a timeout counts as a connect failure).
    pub connect_timeout_ms: u64,
    /// Longest silence between two upstream body chunks before the response is
    /// aborted.
    pub upstream_idle_timeout_ms: u64,
    /// How long an idle upstream connection is kept for the next request.
    /// Below the engine's own keep-alive (5 s for vLLM and SGLang), or a
    /// request can be sent on a connection the engine is closing and fail
    /// unanswered.
    pub upstream_pool_idle_ms: u64,
    /// Poll each engine's own metrics (running / waiting requests, KV
    /// capacity) this often, in ms; 0 turns it off. The reports correct this
    /// gateway's in-flight counts for requests other replicas sent, and bound
    /// each endpoint's inventory to the engine's KV capacity.
    pub engine_load_poll_ms: u64,
    /// Longest wait for an upstream's status line and headers after sending
    /// the request. Beyond it the attempt is a retryable connect failure
    /// (nothing reached the client yet) counted against the endpoint's
    /// breaker. Non-streamed engines send headers only when the whole answer
    /// is ready, so this must exceed the longest non-streamed generation.
    pub response_header_timeout_ms: u64,
    /// Longest wait for the response headers of a streamed request
    /// (`"stream": true`), at most `response_header_timeout_ms`: streaming
    /// engines send their headers as soon as they accept a request, before
    /// generating. Beyond it the attempt is retried elsewhere (nothing
    /// reached the client yet) and counts as a timeout of the endpoint for
    /// outlier detection.
    pub stream_header_timeout_ms: u64,
    /// Prompts with more tokens than this are not routed by KV (a
    /// `prompt_too_long` miss; the request is still proxied by the rule's
    /// selector). Applies to token-id prompts and to tokenizer output.
    pub max_prompt_tokens: usize,
    /// Prompt text with more characters than this is not even tokenized (a
    /// `prompt_too_long` miss, still proxied): bounds the tokenizing work one
    /// request can cost the gateway. Chat requests count their message strings
    /// before rendering and the rendered prompt after.
    pub max_prompt_chars: usize,
    /// Time in-flight requests get to finish on shutdown.
    pub shutdown_grace_ms: u64,
    /// Time a new client connection gets to send its first byte (for HTTP/2,
    /// its whole preface) before it is closed; hyper's header timeout only
    /// starts after that.
    pub first_byte_timeout_ms: u64,
    /// Most client connections open at once on the proxy listener, lowered at
    /// start to `(RLIMIT_NOFILE − 256) / 2` (room for one upstream connection
    /// per client connection). At the cap the
    /// oldest connection that has not sent a byte is closed for the new one,
    /// else the new one gets 503.
    pub max_connections: usize,
    /// Most completion requests parsed and tokenized at once (default: the
    /// CPU count, at least 2). Beyond it `tokenize_overload` applies.
    pub max_concurrent_tokenizations: usize,
    /// Most request-body bytes being parsed and tokenized at once (a larger
    /// body is charged this much: it runs alone). Tokenizing costs about
    /// 280 bytes of memory per prompt byte, so the default 8 MiB bounds the
    /// tokenizers near 2.3 GB whatever the CPU count.
    pub max_tokenize_bytes_in_flight: usize,
    /// At either bound: `"wait"` (default) waits up to `tokenize_wait_ms` for
    /// room, then routes the request without KV (the rule's selector, a
    /// `tokenize_overloaded` miss); `"skip"` does so at once.
    pub tokenize_overload: kvroute::admission::TokenizeOverload,
    /// Longest wait for tokenization room under `tokenize_overload = "wait"`.
    pub tokenize_wait_ms: u64,
    /// Threads one long prompt's tokenization may be split across (exact:
    /// the pieces' ids equal one whole encode). 1 = never split. Default: the
    /// CPU count, at most 8; prompt text under 16 KiB is never split.
    pub tokenizer_threads: usize,
    /// Add `stream_options.include_usage = true` to streamed completion
    /// requests that do not say (default `true`), so the engine's last chunk
    /// carries `usage.prompt_tokens_details.cached_tokens` and the decision
    /// gets its receipt; such clients then also see that usage chunk. A
    /// client's own `include_usage` (`false` too) is never changed. `false`:
    /// streamed receipts only for clients that ask for usage.
    pub include_usage: bool,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            upstream_idle_timeout_ms: 300_000,
            upstream_pool_idle_ms: 4_000,
            response_header_timeout_ms: 120_000,
            stream_header_timeout_ms: 10_000,
            engine_load_poll_ms: 500,
            max_prompt_tokens: 262_144,
            max_prompt_chars: 1 << 20,
            shutdown_grace_ms: 10_000,
            first_byte_timeout_ms: 10_000,
            max_connections: 10_000,
            max_concurrent_tokenizations: std::thread::available_parallelism()
                .map_or(2, |n| n.get().max(2)),
            max_tokenize_bytes_in_flight: 8 << 20,
            tokenize_overload: kvroute::admission::TokenizeOverload::Wait,
            tokenize_wait_ms: 250,
            tokenizer_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            include_usage: true,
        }
    }
}

impl LimitsConfig {
    /// As durations.
    #[must_use]
    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn body_read_timeout(&self) -> Duration {
        Duration::from_millis(self.body_read_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn upstream_pool_idle(&self) -> Duration {
        Duration::from_millis(self.upstream_pool_idle_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn upstream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream_idle_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn response_header_timeout(&self) -> Duration {
        Duration::from_millis(self.response_header_timeout_ms)
    }
    /// The streamed limit as a duration (never above the response-header
    /// timeout).
    #[must_use]
    pub fn stream_header_timeout(&self) -> Duration {
        Duration::from_millis(
            self.stream_header_timeout_ms
                .min(self.response_header_timeout_ms),
        )
    }
    /// As a duration.
    #[must_use]
    pub fn tokenize_wait(&self) -> Duration {
        Duration::from_millis(self.tokenize_wait_ms)
    }
}

/// `[health]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Probe interval; 0 disables active checks.
    pub interval_ms: u64,
    /// Path probed with `GET` on every endpoint.
    pub path: String,
    /// Probe timeout.
    pub timeout_ms: u64,
    /// Consecutive failures (probes or requests) that open an endpoint's breaker.
    pub failure_threshold: u32,
    /// How long an open breaker stays open.
    pub cool_down_ms: u64,
    /// Outlier detection: a request still without response headers after
    /// this long takes its endpoint out of rotation when the other endpoints
    /// answered requests sent after it and the engine's own load report
    /// (`limits.engine_load_poll_ms`) hangs or does not count the requests
    /// waiting there; its waiting requests are then retried elsewhere. An
    /// engine whose report counts them (a long non-streamed generation) is
    /// never ejected this way. 0 turns it off.
    pub outlier_stall_ms: u64,
    /// Outlier detection: response-header timeouts in a row (no answer in
    /// between) that take the endpoint out of rotation, whatever its engine
    /// reports. 0 turns it off.
    pub outlier_consecutive_timeouts: u32,
    /// How long a first ejection lasts; the n-th in a row without an answer
    /// in between lasts n times this, up to `outlier_max_ejection_ms`. An
    /// ejected endpoint that answers is back at once.
    pub outlier_ejection_ms: u64,
    /// Longest ejection.
    pub outlier_max_ejection_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 5_000,
            path: "/health".to_owned(),
            timeout_ms: 1_000,
            failure_threshold: 3,
            cool_down_ms: 5_000,
            outlier_stall_ms: 5_000,
            outlier_consecutive_timeouts: 3,
            outlier_ejection_ms: 10_000,
            outlier_max_ejection_ms: 300_000,
        }
    }
}

/// `[[models]]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The slug clients send as `model`.
    pub slug: String,
    /// Directory with `tokenizer.json[.gz]` and `tokenizer_config.json`
    /// (relative paths are relative to the config file).
    pub dir: PathBuf,
    /// The engines' `max_model_len` when it is not `config.json`'s
    /// `max_position_embeddings` (`vllm serve --max-model-len`, or no
    /// `config.json` in `dir`): longer prompts are not KV-routed, and
    /// `truncate_prompt_tokens: -1` cuts prompts to it as the engine does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
    /// The engines' `--chat-template-content-format` when they set one:
    /// `string` or `openai` (by default detected from the template, as
    /// vLLM's `auto` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_format: Option<ContentFormatDoc>,
}

/// `[[models]] content_format`.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ContentFormatDoc {
    /// Message content reaches the template as a string.
    String,
    /// As a list of `{"type": "text", "text": ...}` parts.
    Openai,
}

impl From<ContentFormatDoc> for kvroute::prompt::ContentFormat {
    fn from(f: ContentFormatDoc) -> Self {
        match f {
            ContentFormatDoc::String => Self::String,
            ContentFormatDoc::Openai => Self::OpenAi,
        }
    }
}

/// A rule as written in the file or posted to the admin API.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleDoc {
    /// Unique name (metrics label).
    pub name: String,
    /// Model slugs this rule serves.
    #[serde(default)]
    pub models: Vec<String>,
    /// Serves requests whose model matches no rule (and non-JSON bodies).
    #[serde(default)]
    pub default: bool,
    /// `kv_exact`, `round_robin` or `content_affinity`.
    #[serde(default = "default_choice")]
    pub choice: Choice,
    /// `converged` or `prefill_decode`.
    #[serde(default = "default_topology")]
    pub topology: Topology,
    /// Hash contract, e.g. `vllm@0.33.0:sha256_cbor:block=16:seed=0` (KV-exact).
    #[serde(default)]
    pub contract: Option<String>,
    /// `cost` (the default: least predicted time to first token, see
    /// `kvroute_select::CostConfig`), `overlap_count`, `longest_prefix` or
    /// `load_aware`.
    #[serde(
        default = "default_scorer",
        deserialize_with = "scorer_name::deserialize"
    )]
    pub scorer: String,
    /// Converged miss selector: `least_prefill` (default), `round_robin`,
    /// `least_load`, `p2c`, `chwbl`, `random`, `weighted`.
    #[serde(default = "default_selector")]
    pub selector: SelectorKind,
    /// Fewest overlapping blocks that count as a hit.
    #[serde(default)]
    pub min_overlap_blocks: Option<u32>,
    /// Retries after connect failures.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// Candidate sampling on large pools: endpoints drawn at random besides
    /// those holding more of the prompt than most (`Thresholds::sample_size`;
    /// default 64, 0 scores every endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_size: Option<u32>,
    /// Within a burst, requests without a home wait this long so that the
    /// burst's requests with one are placed first
    /// (`kvroute::KvRouterBuilder::burst_order`; default 1, 0 turns it off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_order_ms: Option<u64>,
    /// Bounded-load slack ε of the `load_aware` scorer (default 0.25): no
    /// endpoint takes a request that would put it above `⌈(1+ε)·mean⌉`
    /// capacity-weighted load unless every eligible one would be. 0 balances
    /// strictly; larger values favour cache affinity over balance.
    #[serde(default)]
    pub load_slack: Option<f64>,
    /// Parameters of the `cost` scorer (`[rules.cost]`); whatever is left out
    /// keeps `kvroute_select::CostConfig`'s default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<CostDoc>,
    /// On `/v1/completions`, send the engine the token ids kvroute computed
    /// (`prompt` as a list of ints) instead of the text, so it does not
    /// tokenize the prompt again.
    #[serde(default)]
    pub forward_token_ids: bool,
    /// LoRA adapters the rule's engines serve (`[[rules.lora]]`). vLLM runs a
    /// request whose `model` is an adapter's name on that adapter and keys its
    /// KV blocks with the adapter's name and path, so KV-exact must hash them
    /// too. Per rule because the hash contract is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora: Vec<LoraDoc>,
    /// Endpoints.
    pub endpoints: Vec<EndpointDoc>,
}

/// `[rules.cost]`: the `cost` scorer's parameters (`kvroute_select::CostConfig`
/// documents the formula and each one). The defaults hold across the
/// simulator's workloads (`BENCHMARKS.md`); an operator who values cache
/// reuse over time to first token raises `affinity_tokens` (a conversation
/// then moves only when staying costs that many prefill tokens more).
///
/// ```toml
/// [rules.cost]
/// affinity_tokens = 256       # absolute affinity slack, prefill tokens (default 128)
/// affinity_slack = 0.1        # relative affinity slack (default 0.1)
/// decode_tokens_per_request = 128   # ranks endpoints by requests in flight (default 128)
/// load_factor = 1.25          # bounded-load cap factor (inf: no cap)
/// load_headroom = 4
/// eviction_weight = 1         # cost of a cached token evicted while another cache has room (0: off)
/// ```
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostDoc {
    /// Keep the longest-prefix endpoint while its predicted time to first
    /// token is at most `(1 + affinity_slack)` times the winner's plus
    /// `affinity_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_slack: Option<f64>,
    /// The absolute part of that slack, in prefill tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity_tokens: Option<f64>,
    /// Prefill-token equivalent of one request in flight (ranks endpoints;
    /// not part of the affinity test).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_tokens_per_request: Option<f64>,
    /// Weight of the request's own uncached prefill (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_weight: Option<f64>,
    /// Bounded-load factor (at least 1; `inf`: no cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_factor: Option<f64>,
    /// Requests an endpoint may hold above the cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_headroom: Option<u32>,
    /// Costs closer than this many prefill tokens are ties.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_tokens: Option<f64>,
    /// Drain the queued prefill at the measured rate (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_queue: Option<bool>,
    /// Prefill-token equivalent of one cached token a placement evicts
    /// while another endpoint's cache has room for the request (default 1;
    /// 0: off). Needs the engines' reported KV capacity
    /// (`limits.engine_load_poll_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eviction_weight: Option<f64>,
}

/// One `[[rules.lora]]` entry: vLLM's `--lora-modules <model>=<path>`.
///
/// ```toml
/// [[rules.lora]]
/// model = "sql-lora"            # the adapter name clients send as `model`
/// path = "/adapters/sql-lora"   # the path exactly as given to vLLM
/// ```
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LoraDoc {
    /// The adapter's `lora_name`: the `model` requests name. Must also be
    /// listed in the rule's `models` (that is how requests reach the rule).
    pub model: String,
    /// The adapter's `lora_path`, byte for byte as the engine was given it:
    /// vLLM ≥ 0.31 hashes it into every block key.
    pub path: String,
    /// The model whose tokenizer the adapter's requests use (one of the
    /// rule's `models`, not an adapter); default: the rule's first model
    /// that is not an adapter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

// The gateway's defaults, spelled out rather than taken from the library
// enums' `Default`: a rule file's meaning must not change when a library
// default does.
fn default_choice() -> Choice {
    Choice::KvExact
}
fn default_topology() -> Topology {
    Topology::Converged
}
fn default_scorer() -> String {
    ScorerKind::Cost.as_str().to_owned()
}
fn default_selector() -> SelectorKind {
    SelectorKind::LeastPrefill
}

/// One endpoint of a rule.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointDoc {
    /// Base URL of the engine's OpenAI server, `http://host:port`.
    pub url: String,
    /// `both`, `prefill` or `decode`.
    #[serde(default = "default_role")]
    pub role: Role,
    /// `vllm`, `sglang`, `trtllm` or `llama.cpp` (or an engine the hosting
    /// program registered).
    #[serde(
        default = "default_engine",
        deserialize_with = "engine_name::deserialize"
    )]
    pub engine: String,
    /// The engine's KV-event endpoint string (`--kv-events-config endpoint`).
    #[serde(default)]
    pub zmq: Option<String>,
    /// The engine's replay endpoint string.
    #[serde(default)]
    pub replay: Option<String>,
    /// ZeroMQ topic.
    #[serde(default)]
    pub topic: String,
    /// TensorRT-LLM only: poll `<url>/kv_cache_events` for KV events. The drain
    /// is destructive — exactly one consumer per engine in the whole fleet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
    /// Data-parallel ranks publishing (rank r on port + r).
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Relative weight.
    #[serde(default = "one")]
    pub weight: u32,
    /// Concurrent requests the endpoint is sized for.
    #[serde(default = "one")]
    pub capacity: u32,
}

fn default_role() -> Role {
    Role::Both
}
fn default_engine() -> String {
    "vllm".to_owned()
}

/// An engine name, checked when the file is read: a built-in engine or one
/// the hosting program registered (`super::super::extensions`).
mod engine_name {
    use serde::{de::Error as _, Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let name = String::deserialize(d)?;
        crate::gateway::extensions::engine(&name).map_err(D::Error::custom)?;
        Ok(name)
    }
}

/// A scorer name, checked when the file is read: a built-in scorer or one
/// the hosting program registered.
mod scorer_name {
    use serde::{de::Error as _, Deserialize, Deserializer};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let name = String::deserialize(d)?;
        let known = crate::gateway::extensions::scorer_names();
        if known.contains(&name) {
            return Ok(name);
        }
        let expected = match known.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => known.join(", "),
        };
        Err(D::Error::custom(format!(
            "unknown scorer {name:?}; expected {expected}"
        )))
    }
}

fn one() -> u32 {
    1
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const CHOICES: [Choice; 3] = [Choice::KvExact, Choice::RoundRobin, Choice::ContentAffinity];
    const TOPOLOGIES: [Topology; 2] = [Topology::Converged, Topology::PrefillDecode];
    const SCORERS: [ScorerKind; 4] = [
        ScorerKind::Cost,
        ScorerKind::OverlapCount,
        ScorerKind::LongestPrefix,
        ScorerKind::LoadAware,
    ];
    const SELECTORS: [SelectorKind; 7] = [
        SelectorKind::RoundRobin,
        SelectorKind::LeastLoad,
        SelectorKind::LeastPrefill,
        SelectorKind::PowerOfTwoChoices,
        SelectorKind::Chwbl,
        SelectorKind::Random,
        SelectorKind::Weighted,
    ];
    const ROLES: [Role; 3] = [Role::Both, Role::Prefill, Role::Decode];
    const ENGINES: [&str; 4] = ["vllm", "sglang", "trtllm", "llama.cpp"];

    fn endpoint() -> impl Strategy<Value = EndpointDoc> {
        (
            (0..ROLES.len(), 0..ENGINES.len(), "[a-z0-9:/.]{1,20}"),
            (
                proptest::option::of("tcp://[a-z*]{1,8}:[0-9]{1,5}"),
                proptest::option::of("tcp://[a-z*]{1,8}:[0-9]{1,5}"),
                "[a-z]{0,6}",
                any::<bool>(),
            ),
            (1..8u32, 1..8u32, 1..64u32),
        )
            .prop_map(
                |(
                    (role, engine, url),
                    (zmq, replay, topic, drain),
                    (dp_ranks, weight, capacity),
                )| {
                    EndpointDoc {
                        url,
                        role: ROLES[role],
                        engine: ENGINES[engine].to_owned(),
                        zmq,
                        replay,
                        topic,
                        drain,
                        dp_ranks,
                        weight,
                        capacity,
                    }
                },
            )
    }

    fn rule() -> impl Strategy<Value = RuleDoc> {
        (
            (
                "[a-z_.-]{1,12}",
                proptest::collection::vec("[a-z0-9-]{1,10}", 0..3),
                any::<bool>(),
                proptest::option::of("[a-z0-9@.:=_]{1,40}"),
            ),
            (
                0..CHOICES.len(),
                0..TOPOLOGIES.len(),
                0..SCORERS.len(),
                0..SELECTORS.len(),
            ),
            (
                proptest::option::of(any::<u32>()),
                (
                    proptest::option::of(any::<u32>()),
                    proptest::option::of(any::<u32>()),
                ),
                proptest::option::of(0..2000u64),
                // Finite and exactly representable in TOML and JSON text.
                proptest::option::of((0..4000u32).prop_map(|n| f64::from(n) / 8.0)),
                any::<bool>(),
                proptest::option::of(
                    (
                        proptest::option::of((0..4000u32).prop_map(|n| f64::from(n) / 8.0)),
                        proptest::option::of(0..16u32),
                        proptest::option::of(any::<bool>()),
                    )
                        .prop_map(
                            |(affinity_tokens, load_headroom, drain_queue)| CostDoc {
                                affinity_tokens,
                                load_headroom,
                                drain_queue,
                                ..CostDoc::default()
                            },
                        ),
                ),
            ),
            proptest::collection::vec(("[a-z-]{1,8}", "/[a-z/]{1,12}"), 0..3),
            proptest::collection::vec(endpoint(), 1..4),
        )
            .prop_map(
                |(
                    (name, models, default, contract),
                    (choice, topology, scorer, selector),
                    (
                        min_overlap_blocks,
                        (max_retries, sample_size),
                        burst_order_ms,
                        load_slack,
                        forward_token_ids,
                        cost,
                    ),
                    lora,
                    endpoints,
                )| RuleDoc {
                    name,
                    models,
                    default,
                    choice: CHOICES[choice],
                    topology: TOPOLOGIES[topology],
                    contract,
                    scorer: SCORERS[scorer].as_str().to_owned(),
                    selector: SELECTORS[selector],
                    min_overlap_blocks,
                    max_retries,
                    sample_size,
                    burst_order_ms,
                    load_slack,
                    cost,
                    forward_token_ids,
                    lora: lora
                        .into_iter()
                        .map(|(model, path)| LoraDoc {
                            model,
                            path,
                            base: None,
                        })
                        .collect(),
                    endpoints,
                },
            )
    }

    proptest! {
        /// The admin API lists `RuleDoc`s as JSON and takes them back: every
        /// document, whatever its enum values, reads back equal from its JSON
        /// and from its TOML `[[rules]]` table.
        #[test]
        fn rule_docs_round_trip_through_json_and_toml(doc in rule()) {
            let json = serde_json::to_vec(&doc).unwrap();
            prop_assert_eq!(&RuleDoc::from_json(&json).unwrap(), &doc);
            let file = FileConfig {
                listen: "127.0.0.1:0".to_owned(),
                admin: AdminConfig::default(),
                limits: LimitsConfig::default(),
                health: HealthConfig::default(),
                decisions: DecisionsConfig::default(),
                models: Vec::new(),
                rules: vec![doc.clone()],
                replicas: ReplicasConfig::default(),
            };
            let text = toml::to_string(&file).unwrap();
            let back = FileConfig::from_toml(&text).unwrap();
            prop_assert_eq!(&back.rules, &file.rules);
        }

        /// The byte offset → line / column mapping agrees with counting
        /// characters one by one.
        #[test]
        fn text_positions_count_lines_and_characters(
            text in "[a-zé\n€]{0,40}",
            offset in 0..60usize,
        ) {
            let (mut line, mut column) = (1, 1);
            // A character counts once all of its bytes are before the offset.
            for (i, c) in text.char_indices() {
                if i + c.len_utf8() > offset {
                    break;
                }
                if c == '\n' {
                    line += 1;
                    column = 1;
                } else {
                    column += 1;
                }
            }
            prop_assert_eq!(TextPosition::of_offset(&text, offset), TextPosition { line, column });
        }
    }

    /// The listing shows each enum by its configuration name, the spelling
    /// the file takes.
    #[test]
    fn enum_fields_serialize_as_their_configuration_names() {
        let doc = RuleDoc::from_json(
            br#"{"name": "r", "choice": "round_robin", "topology": "prefill_decode",
                 "scorer": "load_aware", "selector": "p2c",
                 "endpoints": [{"url": "http://a:1", "role": "decode", "engine": "llamacpp"}]}"#,
        )
        .unwrap();
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(json["choice"], "round_robin");
        assert_eq!(json["topology"], "prefill_decode");
        assert_eq!(json["scorer"], "load_aware");
        assert_eq!(json["selector"], "p2c");
        assert_eq!(json["endpoints"][0]["role"], "decode");
        // `llamacpp` is accepted; the validated rule lists the canonical name.
        assert_eq!(json["endpoints"][0]["engine"], "llamacpp");
        let spec = crate::gateway::config::rule_from_json(
            br#"{"name": "r", "models": ["m"], "choice": "round_robin",
                 "endpoints": [{"url": "http://a:1", "engine": "llamacpp"}]}"#,
        )
        .unwrap();
        let listed = serde_json::to_value(&spec.doc).unwrap();
        assert_eq!(listed["endpoints"][0]["engine"], "llama.cpp");
        // Omitted fields list the gateway's defaults.
        let doc =
            RuleDoc::from_json(br#"{"name": "r", "endpoints": [{"url": "http://a:1"}]}"#).unwrap();
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(
            [
                &json["choice"],
                &json["topology"],
                &json["scorer"],
                &json["selector"]
            ],
            ["kv_exact", "converged", "cost", "least_prefill"]
        );
        assert_eq!(json["endpoints"][0]["role"], "both");
        assert_eq!(json["endpoints"][0]["engine"], "vllm");
    }

    /// What serde refuses names the field, the line and column, and for an
    /// enum the accepted names: golden texts for each enum field, in TOML and
    /// in the admin API's JSON.
    #[test]
    fn refused_documents_name_field_position_and_accepted_names() {
        let text = "listen = \"127.0.0.1:0\"\n\
                    [[rules]]\n\
                    name = \"r\"\n\
                    choice = \"fastest\"\n\
                    [[rules.endpoints]]\n\
                    url = \"http://a:1\"\n";
        let err = FileConfig::from_toml(text).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rules[0].choice: unknown choice \"fastest\"; expected kv_exact, round_robin or content_affinity (line 4, column 10)"
        );
        assert!(matches!(
            err,
            ConfigError::Syntax {
                position: Some(TextPosition {
                    line: 4,
                    column: 10
                }),
                ..
            }
        ));
        let toml_cases = [
            (
                "topology = \"star\"",
                "",
                "rules[0].topology: unknown topology \"star\"; expected converged or prefill_decode (line 3, column 12)",
            ),
            (
                "scorer = \"best\"",
                "",
                "rules[0].scorer: unknown scorer \"best\"; expected cost, overlap_count, longest_prefix or load_aware (line 3, column 10)",
            ),
            (
                "selector = \"p3c\"",
                "",
                "rules[0].selector: unknown selector \"p3c\"; expected round_robin, least_load, least_prefill, p2c, chwbl, random or weighted (line 3, column 12)",
            ),
            (
                "",
                "role = \"prefil\"",
                "rules[0].endpoints[0].role: unknown role \"prefil\"; expected both, prefill or decode (line 6, column 8)",
            ),
            (
                "",
                "engine = \"tgi\"",
                "rules[0].endpoints[0].engine: unknown engine \"tgi\"; expected vllm, sglang, trtllm or llama.cpp (line 6, column 10)",
            ),
            (
                "",
                "engine = 3",
                "rules[0].endpoints[0].engine: invalid type: integer `3`, expected a string (line 6, column 10)",
            ),
            (
                "choise = \"kv_exact\"",
                "",
                "rules[0].choise: unknown field `choise`, expected one of",
            ),
        ];
        for (rule, endpoint, want) in toml_cases {
            let text = format!(
                "listen = \"127.0.0.1:0\"\n[[rules]]\n{rule}\nname = \"r\"\n[[rules.endpoints]]\n{endpoint}\nurl = \"http://a:1\"\n"
            );
            let err = FileConfig::from_toml(&text).unwrap_err().to_string();
            assert!(err.starts_with(want), "want {want:?}, got {err:?}");
        }
        // serde_json places an error at or just after the end of the value.
        let json_cases: [(&[u8], &str); 4] = [
            (
                br#"{"name": "r", "endpoints": [{"url": "http://a:1", "role": "prefil"}]}"#,
                "rule.endpoints[0].role: unknown role \"prefil\"; expected both, prefill or decode (line 1, column 67)",
            ),
            (
                b"{\"name\": \"r\",\n \"selector\": \"p3c\", \"endpoints\": []}",
                "rule.selector: unknown selector \"p3c\"; expected round_robin, least_load, least_prefill, p2c, chwbl, random or weighted (line 2, column 18)",
            ),
            (
                br#"{"name": "r", "endpoints": []} {}"#,
                "trailing characters (line 1, column 32)",
            ),
            (br#"{"name": "r"}"#, "rule: missing field `endpoints` (line 1, column 13)"),
        ];
        for (body, want) in json_cases {
            let err = RuleDoc::from_json(body).unwrap_err().to_string();
            assert_eq!(err, want);
        }
    }
}
