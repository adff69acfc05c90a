//! The file's shape as serde reads it: `[listen]`, `[admin]`, `[limits]`,
//! `[health]`, `[decisions]`, `[[models]]`, `[[rules]]`, `[replicas]`.
//! Unknown fields are refused everywhere so a typo is an error, not a default.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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

/// `[replicas]`: replicas of this gateway in front of the same engines share
/// their in-flight load so that each one's load view counts the others'
/// requests (`kvroute_select::replica_sync`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicasConfig {
    /// This replica's name in the others' load views (default: the proxy
    /// listener address).
    pub id: Option<String>,
    /// Admin base URLs of the other replicas, e.g. `http://10.0.0.2:9090`.
    /// Empty: no sharing.
    pub peers: Vec<String>,
    /// How often coalesced load changes are sent to each peer.
    pub sync_interval_ms: u64,
    /// A full resend of this replica's totals at least this often, so a
    /// restarted peer or a lost batch heals.
    pub heartbeat_ms: u64,
    /// A peer not heard from for this long has its requests dropped from the
    /// load view.
    pub remote_ttl_ms: u64,
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            id: None,
            peers: Vec::new(),
            sync_interval_ms: 2,
            heartbeat_ms: 1_000,
            remote_ttl_ms: 5_000,
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

/// `[decisions]`: what an operator sees of each routing decision.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecisionsConfig {
    /// Add `x-kvroute-endpoint`, `x-kvroute-tier`,
    /// `x-kvroute-predicted-cached-tokens` and (on a miss)
    /// `x-kvroute-miss-reason` to every proxied response. Off hides the
    /// fleet's layout from clients.
    pub headers: bool,
    /// Fraction of decisions logged as one INFO line each (0 = none, 1 =
    /// every decision); evenly spaced, the first one always logged.
    pub log_sample_rate: f64,
}

impl Default for DecisionsConfig {
    fn default() -> Self {
        Self {
            headers: true,
            log_sample_rate: 0.01,
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
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            upstream_idle_timeout_ms: 300_000,
            response_header_timeout_ms: 120_000,
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
    pub fn upstream_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.upstream_idle_timeout_ms)
    }
    /// As a duration.
    #[must_use]
    pub fn response_header_timeout(&self) -> Duration {
        Duration::from_millis(self.response_header_timeout_ms)
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
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 5_000,
            path: "/health".to_owned(),
            timeout_ms: 1_000,
            failure_threshold: 3,
            cool_down_ms: 5_000,
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
    pub choice: String,
    /// `converged` or `prefill_decode`.
    #[serde(default = "default_topology")]
    pub topology: String,
    /// Hash contract, e.g. `vllm@0.33.0:sha256_cbor:block=16:seed=0` (KV-exact).
    #[serde(default)]
    pub contract: Option<String>,
    /// `cost` (the default: least predicted time to first token, see
    /// `kvroute_select::CostConfig`), `overlap_count`, `longest_prefix` or
    /// `load_aware`.
    #[serde(default = "default_scorer")]
    pub scorer: String,
    /// Converged miss selector: `least_prefill` (default), `round_robin`,
    /// `least_load`, `p2c`, `chwbl`, `random`, `weighted`.
    #[serde(default = "default_selector")]
    pub selector: String,
    /// Fewest overlapping blocks that count as a hit.
    #[serde(default)]
    pub min_overlap_blocks: Option<u32>,
    /// Retries after connect failures.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// Bounded-load slack ε of the `load_aware` scorer (default 0.25): no
    /// endpoint takes a request that would put it above `⌈(1+ε)·mean⌉`
    /// capacity-weighted load unless every eligible one would be. 0 balances
    /// strictly; larger values favour cache affinity over balance.
    #[serde(default)]
    pub load_slack: Option<f64>,
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
}

fn default_choice() -> String {
    "kv_exact".to_owned()
}
fn default_topology() -> String {
    "converged".to_owned()
}
fn default_scorer() -> String {
    "cost".to_owned()
}
fn default_selector() -> String {
    "least_prefill".to_owned()
}

/// One endpoint of a rule.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EndpointDoc {
    /// Base URL of the engine's OpenAI server, `http://host:port`.
    pub url: String,
    /// `both`, `prefill` or `decode`.
    #[serde(default = "default_role")]
    pub role: String,
    /// `vllm`, `sglang`, `trtllm` or `llama.cpp`.
    #[serde(default = "default_engine")]
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

fn default_role() -> String {
    "both".to_owned()
}
fn default_engine() -> String {
    "vllm".to_owned()
}
fn one() -> u32 {
    1
}
