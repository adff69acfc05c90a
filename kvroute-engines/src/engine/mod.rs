//! Engines as values: everything kvroute needs to know about one inference
//! engine, behind one object-safe trait, [`Engine`], with one module per
//! engine and a [`Registry`] that hosts look engines up in by name.
//!
//! | engine ([`Engine::name`]) | value | transport ([`Engine::followers`]) | window ([`Engine::window`]) | metrics dialect | prompt dialect | events carry tokens |
//! |---|---|---|---|---|---|---|
//! | `vllm` | [`VLLM`] | ZeroMQ SUB per DP rank + ROUTER replay, msgpack [`vllm::VllmDecoder`] | replay socket: [`RestartPolicy::Replay`], else the default | [`MetricsDialect::Vllm`] | [`Dialect::Vllm`] | yes |
//! | `sglang` | [`SGLANG`] | ZeroMQ SUB per DP rank + ROUTER replay, msgpack [`sglang::SglangDecoder`] | replay socket: [`RestartPolicy::Replay`], else the default | [`MetricsDialect::Sglang`] | [`Dialect::Sglang`] | yes |
//! | `trtllm` | [`TRTLLM`] | HTTP drain of `{url}/kv_cache_events` | [`SeqWindowConfig::destructive_drain`] | [`MetricsDialect::TrtllmPrometheus`] | [`Dialect::Vllm`] | yes |
//! | `llama.cpp` (alias `llamacpp`) | [`LLAMA_CPP`] | none: [`Engine::kv_events`] is [`TransportError::Unsupported`] | the default | none | [`Dialect::Vllm`] | no |
//!
//! A host describes one endpoint it follows with a [`Follow`] (base URL,
//! the events and replay endpoints as the engine's own configuration writes
//! them, topic, DP ranks, block size) and gets back from
//! [`Engine::followers`] the tasks to spawn on its own runtime, each with its
//! [`SubscriberMetrics`]; [`Engine::window`] gives the sequence-window policy
//! of that endpoint's [`kvroute_ingest::EndpointIngest`]. Nothing else in a
//! host depends on which engine it talks to: the request side asks
//! [`Engine::prompt_dialect`] (combined over a pool by [`prompt_dialect_of`])
//! and [`Engine::token_ids_equivalent`], the load side
//! [`Engine::metrics_dialect`], re-keying [`Engine::events_carry_tokens`].
//!
//! ## Looking an engine up
//!
//! ```
//! use kvroute_engines::engine::{self, Follow};
//! use kvroute_engines::transport::SocketRole;
//! use kvroute_ingest::RestartPolicy;
//!
//! let vllm = engine::by_name("vllm")?;
//! // vllm serve ... --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557",
//! //   "replay_endpoint": "tcp://*:5558"}' --data-parallel-size 2
//! let follow = Follow::new("http://10.0.0.7:8000", 16)
//!     .events("tcp://*:5557")
//!     .replay("tcp://*:5558")
//!     .dp_ranks(2);
//! assert_eq!(vllm.window(&follow).on_restart, RestartPolicy::Replay);
//! let streams = vllm.streams(&follow)?;
//! assert_eq!(streams.len(), 2); // one subscriber per DP rank
//! let engine::Stream::Zmq(rank1) = &streams[1] else { unreachable!() };
//! assert_eq!((rank1.endpoint.address.as_str(), rank1.endpoint.role), ("tcp://10.0.0.7:5558", SocketRole::Connect));
//! assert_eq!(rank1.replay.as_deref(), Some("tcp://10.0.0.7:5559"));
//!
//! assert!(engine::by_name("llama.cpp")?.kv_events().is_err());
//! assert!(engine::by_name("tgi").is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Implementing one
//!
//! An engine with its own payload format over the ZeroMQ transport needs a
//! [`FrameDecoder`] and four methods; registered under its name, a host
//! that parses `engine = "..."` through its [`Registry`] runs it like the
//! built-in ones. An engine without a transport (a simulator that applies
//! [`kvroute_ingest::EventBatch`]es itself) keeps the default
//! [`Engine::streams`] and [`Engine::followers`], which follow nothing.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute_engines::engine::{self, Engine, Follow, FrameDecoder, Registry, Stream};
//! use kvroute_engines::events::{DecodeError, DecodeStats};
//! use kvroute_engines::transport::TransportError;
//! use kvroute_core::BlockKey;
//! use kvroute_ingest::{BlockStored, EventBatch, KvEvent};
//!
//! /// Payload: the stored block keys, 8 bytes big-endian each.
//! #[derive(Debug)]
//! struct KeysDecoder;
//!
//! impl FrameDecoder for KeysDecoder {
//!     fn decode_into(&mut self, payload: &[u8], seq: u64, out: &mut EventBatch, stats: &mut DecodeStats) -> Result<(), DecodeError> {
//!         if payload.len() % 8 != 0 {
//!             stats.malformed_payloads += 1;
//!             return Err(DecodeError::BadLayout { what: "not a multiple of 8 bytes" });
//!         }
//!         let keys = payload.chunks_exact(8).map(|c| BlockKey(u64::from_be_bytes(c.try_into().unwrap_or_default())));
//!         out.seq = seq;
//!         out.events.clear();
//!         out.events.push(KvEvent::Stored(BlockStored { keys: keys.collect(), block_size: 16, ..BlockStored::default() }));
//!         stats.batches += 1;
//!         Ok(())
//!     }
//! }
//!
//! #[derive(Debug)]
//! struct Keys;
//!
//! impl Engine for Keys {
//!     fn name(&self) -> &str { "keys" }
//!     fn events_carry_tokens(&self) -> bool { false }
//!     fn frame_decoder(&self) -> Option<Box<dyn FrameDecoder>> { Some(Box::new(KeysDecoder)) }
//!     fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
//!         engine::zmq_streams(follow) // the ZeroMQ transport, DP ranks and replay included
//!     }
//! }
//!
//! let mut registry = Registry::builtin();
//! registry.register(Arc::new(Keys))?;
//! let keys = registry.get("keys")?;
//! let follow = Follow::new("http://10.0.0.8:9000", 16).events("tcp://*:7000");
//! assert_eq!(keys.streams(&follow)?.len(), 1);
//! assert!(registry.get("vllm").is_ok());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvroute_ingest::SharedIndex;

use crate::transport::{replay_address, SharedIngest, SubscriberMetrics, ZmqEndpoint};

// Everything an `Engine` implementation names, so an implementer needs this
// module only.
pub use crate::events::{DecodeError, DecodeStats};
pub use crate::prompt::{Dialect, PyValue};
pub use crate::transport::TransportError;
pub use crate::{ApiKind, MetricsDialect};
pub use kvroute_ingest::{BlockStored, EventBatch, KvEvent, RestartPolicy, SeqWindowConfig};

mod llamacpp;
mod registry;
mod sglang;
mod token_ids;
mod trtllm;
mod vllm;

pub use llamacpp::{LlamaCpp, LLAMA_CPP};
pub use registry::{builtin, by_name, EngineNameTaken, Registry, UnknownEngine};
pub use sglang::{Sglang, SglangDecoder, SGLANG};
pub use token_ids::KeepText;
pub use trtllm::{Trtllm, TRTLLM};
pub use vllm::{Vllm, VllmDecoder, VLLM};

/// Decodes one engine payload (a ZeroMQ message's last frame) into an
/// engine-neutral batch: what [`crate::transport::DecodingSink`] runs per
/// frame.
///
/// Must be total: any byte sequence yields a batch or a [`DecodeError`],
/// never a panic, with work bounded by the payload's length.
pub trait FrameDecoder: Send + fmt::Debug {
    /// Decodes `payload`, received with transport sequence number `seq`, into
    /// `out` (replacing its contents; `out.seq` must be `seq`), counting what
    /// it skipped in `stats`.
    ///
    /// # Errors
    /// A [`DecodeError`] for a payload that is not a batch; `out` is then
    /// unspecified.
    fn decode_into(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut EventBatch,
        stats: &mut DecodeStats,
    ) -> Result<(), DecodeError>;
}

/// One inference engine, as kvroute needs to know it: its names, whether it
/// supports KV-exact routing, how one endpoint of it is followed (transport,
/// decoder, sequence-window policy), and how requests and load reports are
/// read for it.
///
/// Object safe: hosts hold `Arc<dyn Engine>` from a [`Registry`]. The
/// built-in engines are [`VLLM`], [`SGLANG`], [`TRTLLM`] and [`LLAMA_CPP`];
/// see the [module documentation](self) for implementing another.
pub trait Engine: Send + Sync + fmt::Debug + 'static {
    /// The name in configuration files and metrics labels (`vllm`, `sglang`,
    /// `trtllm`, `llama.cpp`).
    fn name(&self) -> &str;

    /// Other names configuration may use for it (`llamacpp`).
    fn aliases(&self) -> &[&str] {
        &[]
    }

    /// Whether the engine publishes the KV events KV-exact routing needs.
    ///
    /// # Errors
    /// [`TransportError::Unsupported`], saying why and what to configure
    /// instead, for an engine without them (llama.cpp).
    fn kv_events(&self) -> Result<(), TransportError> {
        Ok(())
    }

    /// Whether its stored-block events carry the blocks' token ids, which
    /// re-keying (`rekey:` contracts) recomputes keys from.
    fn events_carry_tokens(&self) -> bool;

    /// The sequence-window policy of one endpoint followed as `follow` says:
    /// the `window` of its [`kvroute_ingest::IngestConfig`]. By default
    /// [`replay_window`]: a replay socket replays a restarted engine's buffer
    /// from 0, without one a restart clears.
    fn window(&self, follow: &Follow) -> SeqWindowConfig {
        replay_window(follow)
    }

    /// The decoder of the payloads it publishes over ZeroMQ (`None`: it
    /// publishes none).
    fn frame_decoder(&self) -> Option<Box<dyn FrameDecoder>> {
        None
    }

    /// What following one endpoint means, without starting anything: one
    /// [`Stream`] per subscriber or poller. Empty when `follow` configures
    /// nothing to follow (no events endpoint) or the engine has no
    /// transport of its own (the host applies its batches itself).
    ///
    /// # Errors
    /// [`TransportError`] for a `follow` this engine cannot follow (a bad
    /// endpoint string, a replay endpoint without events, an events endpoint
    /// on an engine that is drained over HTTP, an engine without events).
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        let _ = follow;
        Ok(Vec::new())
    }

    /// The followers of one endpoint, writing `target`: the host spawns each
    /// [`Follower::run`] on its runtime with a future that completes when
    /// the endpoint is removed or the host stops. By default, one follower
    /// per [`Engine::streams`] entry ([`followers_of_streams`]): a ZeroMQ
    /// subscriber decoding with [`Engine::frame_decoder`] per
    /// [`Stream::Zmq`], a TensorRT-LLM drain poller per [`Stream::Drain`].
    ///
    /// # Errors
    /// As [`Engine::streams`], and [`TransportError::NotCompiled`] when the
    /// transport's feature (`zmq`, `trtllm-http`) is not in this build.
    fn followers(
        &self,
        follow: &Follow,
        target: &IngestTarget,
    ) -> Result<Vec<Follower>, TransportError> {
        let streams = self.streams(follow)?;
        followers_of_streams(self.name(), &|| self.frame_decoder(), streams, target)
    }

    /// Its `/metrics` dialect, for engine-reported load (`None`: it exports
    /// none kvroute reads).
    fn metrics_dialect(&self) -> Option<MetricsDialect> {
        None
    }

    /// Whose OpenAI request validators apply to requests for it.
    fn prompt_dialect(&self) -> Dialect {
        Dialect::Vllm
    }

    /// Whether it runs a request whose `prompt` is replaced by the token ids
    /// kvroute computed exactly as the original (`body`, the request parsed as
    /// the engine parses it, posted to `api`). `Ok(())` only when provably
    /// so; by default never ([`KeepText::Chat`] for chat requests,
    /// [`KeepText::Engine`] otherwise).
    ///
    /// # Errors
    /// The [`KeepText`] reason the request must go as text.
    fn token_ids_equivalent(&self, api: ApiKind, body: &PyValue) -> Result<(), KeepText> {
        let _ = body;
        Err(match api {
            ApiKind::Chat => KeepText::Chat,
            ApiKind::Completions => KeepText::Engine,
        })
    }
}

impl AsRef<dyn Engine> for dyn Engine {
    fn as_ref(&self) -> &(dyn Engine + 'static) {
        self
    }
}

// ---------------------------------------------------------------------------
// What a host knows of one endpoint, and what following it yields.

/// What a host knows of one endpoint it follows: where it answers HTTP and
/// where it publishes KV events, written as in the engine's own
/// configuration.
///
/// ```
/// use kvroute_engines::engine::Follow;
/// let f = Follow::new("http://[fd00::7]:8000/", 16).events("tcp://*:5557").dp_ranks(0);
/// assert_eq!(f.url, "http://[fd00::7]:8000");
/// assert_eq!(f.host().as_deref(), Some("fd00::7"));
/// assert_eq!(f.dp_ranks, 1); // at least one
/// assert!(!f.has_replay());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Follow {
    /// `http://host:port` (no path): a wildcard events or replay endpoint
    /// (`tcp://*:5557`) is dialled on its host; TensorRT-LLM is drained at
    /// `{url}/kv_cache_events`.
    pub url: String,
    /// The engine's KV-event endpoint as configured in the engine (vLLM/SGLang
    /// `--kv-events-config` `endpoint`); `None`: nothing to subscribe to.
    pub events: Option<String>,
    /// The engine's replay endpoint as configured in the engine
    /// (`replay_endpoint`).
    pub replay: Option<String>,
    /// ZeroMQ topic (the engines' default is empty).
    pub topic: String,
    /// Data-parallel ranks; rank `r` publishes on `port + r`.
    pub dp_ranks: u32,
    /// Tokens per KV block of the engine (the contract's block size).
    pub block_size: u32,
}

impl Follow {
    /// An endpoint at `url` (a trailing `/` is dropped) with `block_size`
    /// tokens per block, one DP rank, empty topic, no events endpoint yet.
    #[must_use]
    pub fn new(url: impl Into<String>, block_size: u32) -> Self {
        Self {
            url: url.into().trim_end_matches('/').to_owned(),
            events: None,
            replay: None,
            topic: String::new(),
            dp_ranks: 1,
            block_size,
        }
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

    /// ZeroMQ topic.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Data-parallel ranks (at least 1).
    #[must_use]
    pub fn dp_ranks(mut self, ranks: u32) -> Self {
        self.dp_ranks = ranks.max(1);
        self
    }

    /// Whether the followed streams have the engine's replay socket (an events
    /// and a replay endpoint).
    #[must_use]
    pub fn has_replay(&self) -> bool {
        self.events.is_some() && self.replay.is_some()
    }

    /// The host of [`Follow::url`], without IPv6 brackets (`None`: the URL
    /// names none).
    #[must_use]
    pub fn host(&self) -> Option<String> {
        let rest = self
            .url
            .split_once("://")
            .map_or(self.url.as_str(), |(_, r)| r);
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
        let host = if let Some(v6) = authority.strip_prefix('[') {
            v6.split_once(']').map(|(h, _)| h)?
        } else {
            authority.split_once(':').map_or(authority, |(h, _)| h)
        };
        (!host.is_empty()).then(|| host.to_owned())
    }

    fn invalid(field: &'static str, reason: impl Into<String>) -> TransportError {
        TransportError::Follow {
            field,
            reason: reason.into(),
        }
    }
}

/// Where one followed endpoint's batches go: its
/// [`kvroute_ingest::EndpointIngest`] (shared by the streams of its DP ranks)
/// and the index scoring reads.
#[derive(Clone, Debug)]
pub struct IngestTarget {
    /// The endpoint's ingest state ([`crate::transport::IndexIngest::share`]).
    pub ingest: SharedIngest,
    /// The index it writes.
    pub index: Arc<SharedIndex>,
}

impl IngestTarget {
    /// `ingest` writing `index`.
    #[must_use]
    pub fn new(ingest: SharedIngest, index: Arc<SharedIndex>) -> Self {
        Self { ingest, index }
    }
}

/// One stream of one followed endpoint, as [`Engine::streams`] plans it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stream {
    /// A ZeroMQ subscription (one DP rank), decoded by the engine's
    /// [`FrameDecoder`].
    Zmq(ZmqStream),
    /// A TensorRT-LLM `POST /kv_cache_events` drain (all attention-DP ranks).
    Drain(DrainStream),
    /// A transport of the engine's own: its [`Engine::followers`] builds the
    /// follower ([`Follower::new`]).
    Other {
        /// What it follows, for logs and the admin API.
        address: String,
        /// The DP rank it follows, if one.
        rank: Option<u32>,
    },
}

/// One DP rank's ZeroMQ subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZmqStream {
    /// The rank.
    pub rank: u32,
    /// Where our SUB dials or listens.
    pub endpoint: ZmqEndpoint,
    /// The replay ROUTER address our client dials.
    pub replay: Option<String>,
    /// The topic.
    pub topic: String,
}

impl ZmqStream {
    /// DP rank `rank`'s subscription at `endpoint`, with its replay address.
    #[must_use]
    pub fn new(
        rank: u32,
        endpoint: ZmqEndpoint,
        replay: Option<String>,
        topic: impl Into<String>,
    ) -> Self {
        Self {
            rank,
            endpoint,
            replay,
            topic: topic.into(),
        }
    }
}

/// One HTTP drain.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainStream {
    /// The URL polled (`{url}/kv_cache_events`).
    pub url: String,
    /// Tokens per block (the decoder needs it to split blocks).
    pub tokens_per_block: u32,
}

impl DrainStream {
    /// A drain of `url` for an engine with `tokens_per_block` tokens per block.
    #[must_use]
    pub fn new(url: impl Into<String>, tokens_per_block: u32) -> Self {
        Self {
            url: url.into(),
            tokens_per_block,
        }
    }
}

impl Stream {
    /// The address it follows (ZeroMQ endpoint or drain URL), for logs and
    /// the admin API.
    #[must_use]
    pub fn address(&self) -> &str {
        match self {
            Stream::Zmq(z) => &z.endpoint.address,
            Stream::Drain(d) => &d.url,
            Stream::Other { address, .. } => address,
        }
    }

    /// The DP rank it follows (`None`: a drain interleaving every rank).
    #[must_use]
    pub fn rank(&self) -> Option<u32> {
        match self {
            Stream::Zmq(z) => Some(z.rank),
            Stream::Drain(_) => None,
            Stream::Other { rank, .. } => *rank,
        }
    }
}

/// The future a host gives a follower to stop it.
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
/// A follower's task, for the host to spawn.
pub type FollowerTask = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

type Start = Box<dyn FnOnce(StopSignal) -> FollowerTask + Send>;

/// One subscriber or poller of one endpoint, not started: its [`Stream`],
/// its live [`SubscriberMetrics`], and the task [`Follower::run`] returns for
/// the host to spawn on its runtime (the library never starts one).
pub struct Follower {
    stream: Stream,
    metrics: Arc<SubscriberMetrics>,
    start: Start,
}

impl fmt::Debug for Follower {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Follower")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Follower {
    /// A follower of `stream` whose task is `run(stop)`, keeping `metrics`.
    /// Engines with their own transport build theirs with this.
    #[must_use]
    pub fn new<F, Fut>(stream: Stream, metrics: Arc<SubscriberMetrics>, run: F) -> Self
    where
        F: FnOnce(StopSignal) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Self {
            stream,
            metrics,
            start: Box::new(move |stop| Box::pin(run(stop))),
        }
    }

    /// What it follows.
    #[must_use]
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Its metrics, live while it runs.
    #[must_use]
    pub fn metrics(&self) -> &Arc<SubscriberMetrics> {
        &self.metrics
    }

    /// The task to spawn; it runs until `stop` completes.
    #[must_use]
    pub fn run(self, stop: impl Future<Output = ()> + Send + 'static) -> FollowerTask {
        (self.start)(Box::pin(stop))
    }
}

// ---------------------------------------------------------------------------
// The shared pieces engines are built from.

/// The window of an endpoint whose engine replays on request: with a replay
/// socket ([`Follow::has_replay`]) a detected restart replays the new
/// process's buffer from 0 ([`RestartPolicy::Replay`]), so what it stored
/// before our re-dial is learned too; without one the default (a restart
/// clears).
#[must_use]
pub fn replay_window(follow: &Follow) -> SeqWindowConfig {
    if follow.has_replay() {
        SeqWindowConfig {
            on_restart: RestartPolicy::Replay,
            ..SeqWindowConfig::default()
        }
    } else {
        SeqWindowConfig::default()
    }
}

/// The ZeroMQ streams of `follow`, as vLLM and SGLang publish them: one per
/// DP rank on `port + rank` ([`ZmqEndpoint::for_engine`]: our SUB does the
/// opposite of the engine's bind/connect), each with its rank's replay
/// address ([`replay_address`]). Empty without an events endpoint.
///
/// # Errors
/// [`TransportError::Follow`] for a replay endpoint without an events
/// endpoint, an events endpoint on a URL without a host, or an endpoint
/// string that cannot be followed (field `events` or `replay`).
pub fn zmq_streams(follow: &Follow) -> Result<Vec<Stream>, TransportError> {
    let Some(events) = &follow.events else {
        if follow.replay.is_some() {
            return Err(Follow::invalid(
                "replay",
                "a replay endpoint needs an events endpoint too",
            ));
        }
        return Ok(Vec::new());
    };
    let host = follow
        .host()
        .ok_or_else(|| Follow::invalid("url", format!("{:?} names no host", follow.url)))?;
    let mut streams = Vec::with_capacity(follow.dp_ranks.max(1) as usize);
    for rank in 0..follow.dp_ranks.max(1) {
        let endpoint = ZmqEndpoint::for_engine(events, &host, rank)
            .map_err(|e| Follow::invalid("events", e.to_string()))?;
        let replay = match &follow.replay {
            Some(r) => Some(
                replay_address(r, &host, rank)
                    .map_err(|e| Follow::invalid("replay", e.to_string()))?,
            ),
            None => None,
        };
        streams.push(Stream::Zmq(ZmqStream {
            rank,
            endpoint,
            replay,
            topic: follow.topic.clone(),
        }));
    }
    Ok(streams)
}

/// The followers of `streams` (the default of [`Engine::followers`]):
/// per [`Stream::Zmq`] a `ZmqSubscriber` feeding a
/// [`crate::transport::DecodingSink`] with a decoder from `decoder`, per
/// [`Stream::Drain`] a `TrtllmPoller` feeding a
/// [`crate::transport::TrtllmSink`]; all write `target`. Every stream is set
/// up before any is returned: one that cannot be refuses the endpoint as a
/// whole.
///
/// # Errors
/// [`TransportError::Unsupported`] for a ZeroMQ stream without a decoder or
/// a [`Stream::Other`],
/// [`TransportError::NotCompiled`] for a transport this build lacks,
/// [`TransportError::Client`] when the HTTP client cannot be built.
pub fn followers_of_streams(
    engine: &str,
    decoder: &dyn Fn() -> Option<Box<dyn FrameDecoder>>,
    streams: Vec<Stream>,
    target: &IngestTarget,
) -> Result<Vec<Follower>, TransportError> {
    let mut out = Vec::with_capacity(streams.len());
    for stream in streams {
        out.push(match stream {
            Stream::Zmq(z) => {
                let decoder = decoder().ok_or_else(|| TransportError::Unsupported {
                    engine: engine.to_owned(),
                    feature: "ZeroMQ KV events",
                    reason: "this engine has no decoder of ZeroMQ payloads",
                    suggestion:
                        "give it an Engine::frame_decoder, or follow it with its own transport",
                })?;
                zmq_follower(engine, z, decoder, target)?
            }
            Stream::Drain(d) => drain_follower(engine, d, target)?,
            Stream::Other { .. } => {
                return Err(TransportError::Unsupported {
                    engine: engine.to_owned(),
                    feature: "following a stream of its own transport",
                    reason: "kvroute has no transport for a Stream::Other",
                    suggestion: "build its follower in the engine's Engine::followers",
                })
            }
        });
    }
    Ok(out)
}

#[cfg(feature = "zmq")]
fn zmq_follower(
    _engine: &str,
    z: ZmqStream,
    decoder: Box<dyn FrameDecoder>,
    target: &IngestTarget,
) -> Result<Follower, TransportError> {
    use crate::transport::{DecodingSink, IndexIngest, ZmqSubscriber, ZmqSubscriberConfig};
    let mut cfg = ZmqSubscriberConfig::new(z.endpoint.clone()).topic(z.topic.clone());
    if let Some(r) = &z.replay {
        cfg = cfg.replay_endpoint(r.clone());
    }
    let sink = DecodingSink::with_decoder(
        decoder,
        IndexIngest::shared(
            Arc::clone(&target.ingest),
            Arc::clone(&target.index),
            Some(z.rank),
            z.replay.is_some(),
        ),
    );
    let subscriber = ZmqSubscriber::new(cfg);
    let metrics = subscriber.metrics();
    Ok(Follower::new(
        Stream::Zmq(z),
        metrics,
        move |stop| async move {
            let _sink = subscriber.run(sink, stop).await;
        },
    ))
}

#[cfg(not(feature = "zmq"))]
fn zmq_follower(
    engine: &str,
    _z: ZmqStream,
    _decoder: Box<dyn FrameDecoder>,
    _target: &IngestTarget,
) -> Result<Follower, TransportError> {
    Err(TransportError::NotCompiled {
        engine: engine.to_owned(),
        transport: "ZeroMQ transport",
        feature: "zmq",
    })
}

#[cfg(feature = "trtllm-http")]
fn drain_follower(
    engine: &str,
    d: DrainStream,
    target: &IngestTarget,
) -> Result<Follower, TransportError> {
    use crate::transport::{IndexIngest, TrtllmPoller, TrtllmPollerConfig, TrtllmSink};
    let poller = TrtllmPoller::new(TrtllmPollerConfig::new(d.url.clone())).map_err(|e| {
        TransportError::Client {
            engine: engine.to_owned(),
            reason: e.to_string(),
        }
    })?;
    // The drain interleaves the attention-DP ranks: each event names its own.
    let sink = TrtllmSink::new(
        d.tokens_per_block,
        IndexIngest::shared(
            Arc::clone(&target.ingest),
            Arc::clone(&target.index),
            None,
            false,
        ),
    );
    let metrics = poller.metrics();
    let url = d.url.clone();
    Ok(Follower::new(
        Stream::Drain(d),
        metrics,
        move |stop| async move {
            tracing::warn!(%url, "TensorRT-LLM drain poller: every POST to /kv_cache_events \
            consumes the engine's events, so this router must be its only consumer");
            let _sink = poller.run(sink, stop).await;
        },
    ))
}

#[cfg(not(feature = "trtllm-http"))]
fn drain_follower(
    engine: &str,
    _d: DrainStream,
    _target: &IngestTarget,
) -> Result<Follower, TransportError> {
    Err(TransportError::NotCompiled {
        engine: engine.to_owned(),
        transport: "TensorRT-LLM drain poller",
        feature: "trtllm-http",
    })
}

/// The request validators of a pool of `engines`: the dialect they all
/// share, else vLLM's (the stricter ones where they differ); vLLM's for an
/// empty pool.
///
/// ```
/// use kvroute_engines::engine::{prompt_dialect_of, Engine, SGLANG, TRTLLM};
/// use kvroute_engines::prompt::Dialect;
/// let sglang: &dyn Engine = &SGLANG;
/// let trtllm: &dyn Engine = &TRTLLM;
/// assert_eq!(prompt_dialect_of([sglang, sglang]), Dialect::Sglang);
/// assert_eq!(prompt_dialect_of([sglang, trtllm]), Dialect::Vllm);
/// assert_eq!(prompt_dialect_of(Vec::<&dyn Engine>::new()), Dialect::Vllm);
/// ```
#[must_use]
pub fn prompt_dialect_of<E: AsRef<dyn Engine>>(engines: impl IntoIterator<Item = E>) -> Dialect {
    let mut shared = None;
    for e in engines {
        let d = e.as_ref().prompt_dialect();
        match shared {
            None => shared = Some(d),
            Some(s) if s == d => {}
            Some(_) => return Dialect::Vllm,
        }
    }
    shared.unwrap_or(Dialect::Vllm)
}

#[cfg(test)]
mod tests;
