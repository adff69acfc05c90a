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
use std::sync::{Arc, OnceLock};

use kvroute_ingest::{EventBatch, RestartPolicy, SeqWindowConfig, SharedIndex};

use crate::events::{DecodeError, DecodeStats};
use crate::prompt::{Dialect, PyValue};
use crate::transport::{
    replay_address, SharedIngest, SubscriberMetrics, TransportError, ZmqEndpoint,
};
use crate::{ApiKind, MetricsDialect, UnknownName};

mod llamacpp;
mod sglang;
mod token_ids;
mod trtllm;
mod vllm;

pub use llamacpp::{LlamaCpp, LLAMA_CPP};
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

// ---------------------------------------------------------------------------
// The registry.

/// A name no engine of a [`Registry`] answers to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine {name:?}; expected {}", list(expected))]
pub struct UnknownEngine {
    /// The name given.
    pub name: String,
    /// The registry's engine names.
    pub expected: Vec<String>,
}

fn list(names: &[String]) -> String {
    match names {
        [] => "none (the registry is empty)".to_owned(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// An engine registered under a name (or alias) another engine already has.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("engine name {name:?} is already registered")]
pub struct EngineNameTaken {
    /// The name.
    pub name: String,
}

/// Engines by name: the built-in ones ([`Registry::builtin`]) plus any a
/// host registers. Hosts parse an endpoint's `engine = "..."` with
/// [`Registry::get`].
///
/// ```
/// use kvroute_engines::engine::Registry;
/// let r = Registry::builtin();
/// assert_eq!(r.names().collect::<Vec<_>>(), ["vllm", "sglang", "trtllm", "llama.cpp"]);
/// assert_eq!(r.get("llamacpp")?.name(), "llama.cpp");
/// let err = r.get("tgi").unwrap_err();
/// assert_eq!(err.to_string(), r#"unknown engine "tgi"; expected vllm, sglang, trtllm or llama.cpp"#);
/// # Ok::<(), kvroute_engines::engine::UnknownEngine>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Registry {
    engines: Vec<Arc<dyn Engine>>,
}

impl Registry {
    /// A registry without engines.
    #[must_use]
    pub fn empty() -> Self {
        Self::default()
    }

    /// vLLM, SGLang, TensorRT-LLM and llama.cpp.
    #[must_use]
    pub fn builtin() -> Self {
        Self {
            engines: vec![
                Arc::new(Vllm),
                Arc::new(Sglang),
                Arc::new(Trtllm),
                Arc::new(LlamaCpp),
            ],
        }
    }

    /// Adds `engine` under its name and aliases.
    ///
    /// # Errors
    /// [`EngineNameTaken`] when one of them is already registered.
    pub fn register(&mut self, engine: Arc<dyn Engine>) -> Result<&mut Self, EngineNameTaken> {
        let names = std::iter::once(engine.name()).chain(engine.aliases().iter().copied());
        for name in names {
            if self.find(name).is_some() {
                return Err(EngineNameTaken {
                    name: name.to_owned(),
                });
            }
        }
        self.engines.push(engine);
        Ok(self)
    }

    /// The engine named (or aliased) `name`.
    ///
    /// # Errors
    /// [`UnknownEngine`] listing the registered names.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Engine>, UnknownEngine> {
        self.find(name).cloned().ok_or_else(|| UnknownEngine {
            name: name.to_owned(),
            expected: self.names().map(str::to_owned).collect(),
        })
    }

    fn find(&self, name: &str) -> Option<&Arc<dyn Engine>> {
        self.engines
            .iter()
            .find(|e| e.name() == name || e.aliases().contains(&name))
    }

    /// The engines' names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.engines.iter().map(|e| e.name())
    }

    /// The engines, in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Engine>> {
        self.engines.iter()
    }
}

/// The built-in engines ([`Registry::builtin`]), built once.
#[must_use]
pub fn builtin() -> &'static Registry {
    static BUILTIN: OnceLock<Registry> = OnceLock::new();
    BUILTIN.get_or_init(Registry::builtin)
}

/// The built-in engine named (or aliased) `name`.
///
/// ```
/// use kvroute_engines::engine;
/// assert_eq!(engine::by_name("trtllm")?.name(), "trtllm");
/// let err = engine::by_name("tgi").unwrap_err();
/// assert_eq!(err.to_string(), r#"unknown engine "tgi"; expected vllm, sglang, trtllm or llama.cpp"#);
/// # Ok::<(), kvroute_engines::UnknownName>(())
/// ```
///
/// # Errors
/// [`UnknownName`] for any other name.
pub fn by_name(name: &str) -> Result<Arc<dyn Engine>, UnknownName> {
    builtin().get(name).map_err(|_| UnknownName {
        what: "engine",
        name: name.to_owned(),
        expected: BUILTIN_NAMES,
    })
}

const BUILTIN_NAMES: &str = "vllm, sglang, trtllm or llama.cpp";

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::EndpointId;
    use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying};

    use crate::transport::{IndexIngest, SocketRole};

    fn builtins() -> [&'static dyn Engine; 4] {
        [&VLLM, &SGLANG, &TRTLLM, &LLAMA_CPP]
    }

    fn target() -> IngestTarget {
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        IngestTarget::new(
            IndexIngest::share(ingest),
            Arc::new(SharedIndex::new(1, IndexConfig::default())),
        )
    }

    fn zmq(stream: &Stream) -> &ZmqStream {
        match stream {
            Stream::Zmq(z) => z,
            other => panic!("not a ZeroMQ stream: {other:?}"),
        }
    }

    #[test]
    fn registry_names_aliases_and_unknown_names() {
        let r = builtin();
        for (name, want) in [
            ("vllm", "vllm"),
            ("sglang", "sglang"),
            ("trtllm", "trtllm"),
            ("llama.cpp", "llama.cpp"),
            ("llamacpp", "llama.cpp"),
        ] {
            assert_eq!(r.get(name).unwrap().name(), want);
            assert_eq!(by_name(name).unwrap().name(), want);
        }
        for bad in ["tgi", "VLLM", "", "tensorrt-llm"] {
            let err = by_name(bad).unwrap_err();
            assert_eq!(err.name, bad);
            assert_eq!(err.expected, "vllm, sglang, trtllm or llama.cpp");
            let err = r.get(bad).unwrap_err();
            assert_eq!(err.expected, ["vllm", "sglang", "trtllm", "llama.cpp"]);
        }
        assert_eq!(
            Registry::empty().get("vllm").unwrap_err().to_string(),
            r#"unknown engine "vllm"; expected none (the registry is empty)"#
        );
    }

    #[derive(Debug)]
    struct Named(&'static str, &'static [&'static str]);

    impl Engine for Named {
        fn name(&self) -> &str {
            self.0
        }
        fn aliases(&self) -> &[&str] {
            self.1
        }
        fn events_carry_tokens(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_host_registers_its_own_engines_without_shadowing() {
        let mut r = Registry::builtin();
        r.register(Arc::new(Named("sim", &["simulated"]))).unwrap();
        assert_eq!(r.get("simulated").unwrap().name(), "sim");
        assert_eq!(r.names().last(), Some("sim"));
        for clash in [
            Named("vllm", &[]),
            Named("x", &["llamacpp"]),
            Named("y", &["sim"]),
        ] {
            let taken = clash.1.first().copied().unwrap_or(clash.0);
            let err = r.register(Arc::new(clash)).unwrap_err();
            assert_eq!(err.name, taken);
        }
        assert_eq!(r.iter().count(), 5);
        // The built-in registry is not changed by a copy's registrations.
        assert!(builtin().get("sim").is_err());
        // A defaulted engine follows nothing and keeps the text.
        let sim = r.get("sim").unwrap();
        let f = Follow::new("http://h:1", 16).events("tcp://*:5557");
        assert!(sim.streams(&f).unwrap().is_empty());
        assert!(sim.followers(&f, &target()).unwrap().is_empty());
        assert!(sim.kv_events().is_ok());
        assert_eq!(sim.window(&f), SeqWindowConfig::default());
        let body = crate::prompt::parse_json(br#"{"prompt": "x"}"#).unwrap();
        assert_eq!(
            sim.token_ids_equivalent(ApiKind::Completions, &body),
            Err(KeepText::Engine)
        );
        assert_eq!(
            sim.token_ids_equivalent(ApiKind::Chat, &body),
            Err(KeepText::Chat)
        );
    }

    #[test]
    fn window_policy_per_follow_config() {
        let bare = Follow::new("http://10.0.0.7:8000", 16);
        let events = bare.clone().events("tcp://*:5557");
        let replay = events.clone().replay("tcp://*:5558");
        let replay_only = bare.clone().replay("tcp://*:5558");
        let replaying = SeqWindowConfig {
            on_restart: RestartPolicy::Replay,
            ..SeqWindowConfig::default()
        };
        for e in [&VLLM as &dyn Engine, &SGLANG] {
            assert_eq!(e.window(&bare), SeqWindowConfig::default(), "{e:?}");
            assert_eq!(e.window(&events), SeqWindowConfig::default(), "{e:?}");
            assert_eq!(e.window(&replay), replaying, "{e:?}");
            assert_eq!(e.window(&replay_only), SeqWindowConfig::default(), "{e:?}");
        }
        for f in [&bare, &events, &replay] {
            assert_eq!(TRTLLM.window(f), SeqWindowConfig::destructive_drain());
            assert_eq!(LLAMA_CPP.window(f), SeqWindowConfig::default());
        }
    }

    #[test]
    fn dialects_tokens_and_kv_support_of_each_engine() {
        let want = [
            (
                "vllm",
                Some(MetricsDialect::Vllm),
                Dialect::Vllm,
                true,
                true,
                true,
            ),
            (
                "sglang",
                Some(MetricsDialect::Sglang),
                Dialect::Sglang,
                true,
                true,
                true,
            ),
            (
                "trtllm",
                Some(MetricsDialect::TrtllmPrometheus),
                Dialect::Vllm,
                true,
                true,
                false,
            ),
            ("llama.cpp", None, Dialect::Vllm, false, false, false),
        ];
        for (e, (name, metrics, prompt, tokens, kv, zmq)) in builtins().into_iter().zip(want) {
            assert_eq!(e.name(), name);
            assert_eq!(e.metrics_dialect(), metrics, "{name}");
            assert_eq!(e.prompt_dialect(), prompt, "{name}");
            assert_eq!(e.events_carry_tokens(), tokens, "{name}");
            assert_eq!(e.kv_events().is_ok(), kv, "{name}");
            assert_eq!(e.frame_decoder().is_some(), zmq, "{name}");
        }
        let err = LLAMA_CPP.kv_events().unwrap_err().to_string();
        assert!(
            err.starts_with("llama.cpp does not support KV-exact routing"),
            "{err}"
        );
        assert!(err.contains("no KV-cache events") && err.contains("content affinity"));

        let pool = |es: &[&'static dyn Engine]| prompt_dialect_of(es.iter().copied());
        assert_eq!(pool(&[&SGLANG, &SGLANG]), Dialect::Sglang);
        assert_eq!(pool(&[&SGLANG, &VLLM]), Dialect::Vllm);
        assert_eq!(pool(&[&SGLANG, &LLAMA_CPP]), Dialect::Vllm);
        assert_eq!(pool(&[]), Dialect::Vllm);
        let arcs = vec![by_name("sglang").unwrap()];
        assert_eq!(prompt_dialect_of(&arcs), Dialect::Sglang);
    }

    #[test]
    fn zmq_streams_per_rank_with_one_replay_rewrite() {
        let f = Follow::new("http://10.0.0.7:8000/", 16)
            .events("tcp://*:5557")
            .replay("tcp://*:5558")
            .topic("kv")
            .dp_ranks(3);
        let streams = VLLM.streams(&f).unwrap();
        assert_eq!(streams, SGLANG.streams(&f).unwrap());
        assert_eq!(streams.len(), 3);
        for (rank, s) in streams.iter().enumerate() {
            let z = zmq(s);
            let port = 5557 + rank;
            assert_eq!(z.rank as usize, rank);
            assert_eq!(s.rank(), Some(z.rank));
            assert_eq!(s.address(), format!("tcp://10.0.0.7:{port}"));
            assert_eq!(z.endpoint.role, SocketRole::Connect);
            assert_eq!(z.replay, Some(format!("tcp://10.0.0.7:{}", port + 1)));
            assert_eq!(z.topic, "kv");
        }
        // Every wildcard spelling of the replay host is the endpoint's host.
        for wildcard in [
            "tcp://*:6000",
            "tcp://0.0.0.0:6000",
            "tcp://[::]:6000",
            "tcp://:6000",
        ] {
            let f = Follow::new("http://[fd00::7]:8000", 16)
                .events("tcp://*:5557")
                .replay(wildcard);
            let s = VLLM.streams(&f).unwrap();
            assert_eq!(
                zmq(&s[0]).replay.as_deref(),
                Some("tcp://[fd00::7]:6000"),
                "{wildcard}"
            );
            assert_eq!(s[0].address(), "tcp://[fd00::7]:5557");
        }
        // The engine dials us: we bind what it dials.
        let f = Follow::new("http://10.0.0.7:8000", 16).events("tcp://10.0.0.1:5557");
        let s = VLLM.streams(&f).unwrap();
        assert_eq!(
            zmq(&s[0]).endpoint,
            ZmqEndpoint::bind("tcp://10.0.0.1:5557")
        );
        assert_eq!(zmq(&s[0]).replay, None);
    }

    #[test]
    fn what_cannot_be_followed_names_its_field() {
        let field = |r: Result<Vec<Stream>, TransportError>| match r {
            Err(TransportError::Follow { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let base = Follow::new("http://10.0.0.7:8000", 16);
        assert!(VLLM.streams(&base).unwrap().is_empty());
        assert_eq!(
            field(VLLM.streams(&base.clone().replay("tcp://*:1"))),
            "replay"
        );
        assert_eq!(
            field(VLLM.streams(&base.clone().events("ipc:///kv").dp_ranks(2))),
            "events"
        );
        assert_eq!(
            field(VLLM.streams(&base.clone().events("inproc://kv"))),
            "events"
        );
        assert_eq!(
            field(VLLM.streams(&base.clone().events("tcp://*:1").replay("udp://x:1"))),
            "replay"
        );
        assert_eq!(
            field(SGLANG.streams(&Follow::new("http://:8000", 16).events("tcp://*:1"))),
            "url"
        );
        assert_eq!(
            field(TRTLLM.streams(&base.clone().events("tcp://*:1"))),
            "events"
        );
        assert_eq!(
            field(TRTLLM.streams(&base.clone().replay("tcp://*:1"))),
            "replay"
        );
        assert_eq!(field(TRTLLM.streams(&Follow::new("", 16))), "url");
        assert!(matches!(
            LLAMA_CPP.streams(&base.clone().events("tcp://*:1")),
            Err(TransportError::Unsupported { .. })
        ));
    }

    #[derive(Debug)]
    struct OwnTransport;

    impl Engine for OwnTransport {
        fn name(&self) -> &str {
            "own"
        }
        fn events_carry_tokens(&self) -> bool {
            true
        }
        fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
            Ok(vec![Stream::Other {
                address: format!("{}/events", follow.url),
                rank: Some(0),
            }])
        }
    }

    #[test]
    fn a_stream_of_an_engines_own_transport_is_its_to_follow() {
        let f = Follow::new("http://h:1", 16);
        let s = OwnTransport.streams(&f).unwrap();
        assert_eq!(
            (s[0].address(), s[0].rank()),
            ("http://h:1/events", Some(0))
        );
        let err = OwnTransport.followers(&f, &target()).unwrap_err();
        assert!(matches!(err, TransportError::Unsupported { .. }), "{err}");
        // Its followers, built with Follower::new, are run by the host like any.
        let stream = s[0].clone();
        let follower = Follower::new(stream, Arc::default(), |stop| stop);
        assert_eq!(follower.stream().address(), "http://h:1/events");
        drop(follower.run(std::future::ready(())));
    }

    #[test]
    fn follow_host_parsing() {
        let host = |u: &str| Follow::new(u, 1).host();
        assert_eq!(host("http://10.0.0.7:8000").as_deref(), Some("10.0.0.7"));
        assert_eq!(
            host("http://engine-0.svc:8000/").as_deref(),
            Some("engine-0.svc")
        );
        assert_eq!(host("http://[::1]:8000").as_deref(), Some("::1"));
        assert_eq!(host("http://user@h:1").as_deref(), Some("h"));
        assert_eq!(host("h:1").as_deref(), Some("h"));
        assert_eq!(host("http://:8000"), None);
        assert_eq!(host("http://[::1"), None);
    }

    #[cfg(all(feature = "zmq", feature = "trtllm-http"))]
    #[test]
    fn followers_are_built_without_starting_anything() {
        let f = Follow::new("http://127.0.0.1:8000", 16)
            .events("tcp://*:5557")
            .replay("tcp://*:5558")
            .dp_ranks(2);
        let followers = VLLM.followers(&f, &target()).unwrap();
        assert_eq!(followers.len(), 2);
        assert_eq!(followers[1].stream().address(), "tcp://127.0.0.1:5558");
        assert_eq!(followers[0].metrics().snapshot().frames_live, 0);
        let drains = TRTLLM
            .followers(&Follow::new("http://127.0.0.1:8000", 32), &target())
            .unwrap();
        assert_eq!(drains.len(), 1);
        assert_eq!(
            drains[0].stream(),
            &Stream::Drain(DrainStream {
                url: "http://127.0.0.1:8000/kv_cache_events".into(),
                tokens_per_block: 32
            })
        );
        assert!(format!("{:?}", drains[0]).contains("kv_cache_events"));
        assert!(LLAMA_CPP
            .followers(&Follow::new("http://h:1", 16), &target())
            .unwrap()
            .is_empty());
    }

    #[cfg(not(feature = "zmq"))]
    #[test]
    fn a_transport_left_out_of_the_build_is_a_clear_error() {
        let f = Follow::new("http://127.0.0.1:8000", 16).events("tcp://*:5557");
        let err = VLLM.followers(&f, &target()).unwrap_err();
        assert!(
            matches!(err, TransportError::NotCompiled { feature: "zmq", .. }),
            "{err}"
        );
        assert!(err.to_string().contains("enable the `zmq` feature"));
    }

    #[cfg(not(feature = "trtllm-http"))]
    #[test]
    fn the_drain_left_out_of_the_build_is_a_clear_error() {
        let err = TRTLLM
            .followers(&Follow::new("http://127.0.0.1:8000", 16), &target())
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::NotCompiled {
                    feature: "trtllm-http",
                    ..
                }
            ),
            "{err}"
        );
    }
}
