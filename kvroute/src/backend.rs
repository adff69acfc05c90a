//! One inference backend as the host describes it: what it is, where it
//! answers HTTP and where it publishes KV events.

use kvroute_engines::transport::EngineKind;
use kvroute_select::Role;

/// One engine behind the router: its HTTP base URL, engine kind, where it
/// publishes KV events (written as in the engine's own configuration), its
/// data-parallel ranks and its P/D role.
///
/// ```
/// use kvroute::Backend;
/// use kvroute_select::Role;
/// // vllm serve ... --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
/// //   "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}' --data-parallel-size 2
/// let b = Backend::vllm("http://10.0.0.7:8000")
///     .events("tcp://*:5557")
///     .replay("tcp://*:5558")
///     .dp_ranks(2);
/// assert_eq!(b.role, Role::Both);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backend {
    /// `http://host:port` (no path): requests go to `url + path`, and a
    /// wildcard event endpoint (`tcp://*:5557`) is dialled on this host.
    pub url: String,
    /// The engine (vLLM, SGLang, TensorRT-LLM).
    pub engine: EngineKind,
    /// P/D role; `Both` in a converged pool. Decode-only endpoints are not
    /// subscribed (KV-exact scores prefill-capable endpoints).
    pub role: Role,
    /// The engine's KV-event PUB endpoint as configured in the engine
    /// (vLLM/SGLang `endpoint`); `None`: no events, the endpoint is only
    /// reached by the fallback selector. TensorRT-LLM needs none: its events
    /// are drained from `url + /kv_cache_events`.
    pub events: Option<String>,
    /// The engine's replay ROUTER endpoint (`replay_endpoint`): bootstraps the
    /// inventory on connect and proves continuity on reconnect.
    pub replay: Option<String>,
    /// Data-parallel ranks (each publishes on `port + rank`).
    pub dp_ranks: u32,
    /// TensorRT-LLM: drain the engine's events from `url + /kv_cache_events`
    /// (default `true` for TensorRT-LLM; the drain consumes them, so only
    /// one router may drain an engine).
    pub drain: bool,
    /// ZeroMQ topic (the engines' default is empty).
    pub topic: String,
    /// Relative weight (weighted / CHWBL selectors).
    pub weight: u32,
    /// Concurrent requests the endpoint is sized for (load normalisation).
    pub capacity: u32,
}

impl Backend {
    /// A backend of `engine` at `url`, role `Both`, one DP rank, no events yet.
    #[must_use]
    pub fn new(engine: EngineKind, url: impl Into<String>) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            engine,
            role: Role::Both,
            events: None,
            replay: None,
            dp_ranks: 1,
            drain: engine == EngineKind::TensorRtLlm,
            topic: String::new(),
            weight: 1,
            capacity: 1,
        }
    }

    /// A vLLM backend.
    #[must_use]
    pub fn vllm(url: impl Into<String>) -> Self {
        Self::new(EngineKind::Vllm, url)
    }

    /// An SGLang backend.
    #[must_use]
    pub fn sglang(url: impl Into<String>) -> Self {
        Self::new(EngineKind::Sglang, url)
    }

    /// A TensorRT-LLM backend (`trtllm-serve`), its events drained over HTTP.
    #[must_use]
    pub fn trtllm(url: impl Into<String>) -> Self {
        Self::new(EngineKind::TensorRtLlm, url)
    }

    /// The engine's KV-event endpoint, as in its configuration.
    #[must_use]
    pub fn events(mut self, endpoint: impl Into<String>) -> Self {
        self.events = Some(endpoint.into());
        self
    }

    /// The engine's replay endpoint, as in its configuration.
    #[must_use]
    pub fn replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay = Some(endpoint.into());
        self
    }

    /// Whether a TensorRT-LLM engine's events are drained (see
    /// [`Backend::drain`]).
    #[must_use]
    pub fn drained(mut self, on: bool) -> Self {
        self.drain = on;
        self
    }

    /// Data-parallel ranks (at least 1).
    #[must_use]
    pub fn dp_ranks(mut self, ranks: u32) -> Self {
        self.dp_ranks = ranks.max(1);
        self
    }

    /// P/D role.
    #[must_use]
    pub fn role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// ZeroMQ topic.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Relative weight.
    #[must_use]
    pub fn weight(mut self, weight: u32) -> Self {
        self.weight = weight.max(1);
        self
    }

    /// Concurrent-request capacity.
    #[must_use]
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// The host of `url`, for wildcard event endpoints.
    #[cfg(feature = "zmq")]
    pub(crate) fn host(&self) -> Option<String> {
        let uri: http::Uri = self.url.parse().ok()?;
        let host = uri.host()?;
        Some(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        )
    }
}
