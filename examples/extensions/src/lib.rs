//! A host's own engine and scorer, written against the `kvroute` crate's
//! public API and nothing else, as a user's crate would write them:
//!
//! * [`TaggedVllm`]: an engine registered under its own name that speaks
//!   vLLM's KV-event format (its ZeroMQ streams, replay and decoder are
//!   vLLM's) and counts the frames it decodes — the shape of any engine
//!   with a wire format of its own;
//! * [`LastCandidate`]: a scorer that sends every keyed request to the
//!   eligible endpoint listed last, crediting that endpoint's cached prefix,
//!   and counts its calls — a policy no built-in scorer reproduces, so a
//!   test sees whose decision it was.
//!
//! The tests run both in the three hosts of the router runtime: an embedded
//! `KvRouter`, the gateway (registered by name, named in its
//! configuration) and the simulator.
//!
//! ```
//! use std::sync::Arc;
//! use kvroute::{Backend, Engine, KvRouter};
//! use kvroute_extensions::{LastCandidate, TaggedVllm};
//!
//! let engine = Arc::new(TaggedVllm::new("tagged-vllm"));
//! let scorer = Arc::new(LastCandidate::default());
//! let router = KvRouter::builder("vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?)
//!     .scorer(scorer.clone())
//!     .endpoint(Backend::new(engine.clone(), "http://10.0.0.7:8000").events("tcp://*:5557"))
//!     .build()?;
//! assert_eq!(router.endpoints(), ["http://10.0.0.7:8000"]);
//! assert_eq!(engine.name(), "tagged-vllm");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvroute::engine::Dialect;
use kvroute::engine::{
    zmq_streams, DecodeError, DecodeStats, EventBatch, Follow, FrameDecoder, SeqWindowConfig,
    Stream, VLLM,
};
use kvroute::{Engine, MetricsDialect, ScoreInput, ScorePick, Scorer, TransportError};

/// An engine that publishes vLLM's KV events under a name of its own.
#[derive(Debug)]
pub struct TaggedVllm {
    name: String,
    frames: Arc<AtomicU64>,
}

impl TaggedVllm {
    /// The engine, answering to `name`.
    #[must_use]
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            frames: Arc::default(),
        }
    }

    /// Frames its decoders have decoded, over every endpoint it follows.
    #[must_use]
    pub fn frames(&self) -> u64 {
        self.frames.load(Ordering::Relaxed)
    }
}

impl Engine for TaggedVllm {
    fn name(&self) -> &str {
        &self.name
    }

    fn events_carry_tokens(&self) -> bool {
        VLLM.events_carry_tokens()
    }

    fn window(&self, follow: &Follow) -> SeqWindowConfig {
        VLLM.window(follow)
    }

    fn frame_decoder(&self) -> Option<Box<dyn FrameDecoder>> {
        let inner = VLLM.frame_decoder()?;
        Some(Box::new(Counting {
            inner,
            frames: Arc::clone(&self.frames),
        }))
    }

    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        zmq_streams(follow)
    }

    fn metrics_dialect(&self) -> Option<MetricsDialect> {
        VLLM.metrics_dialect()
    }

    fn prompt_dialect(&self) -> Dialect {
        VLLM.prompt_dialect()
    }
}

/// vLLM's decoder, counting what it decodes.
#[derive(Debug)]
struct Counting {
    inner: Box<dyn FrameDecoder>,
    frames: Arc<AtomicU64>,
}

impl FrameDecoder for Counting {
    fn decode_into(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut EventBatch,
        stats: &mut DecodeStats,
    ) -> Result<(), DecodeError> {
        let decoded = self.inner.decode_into(payload, seq, out, stats);
        if decoded.is_ok() {
            self.frames.fetch_add(1, Ordering::Relaxed);
        }
        decoded
    }
}

/// Sends every keyed request to the eligible endpoint listed last.
#[derive(Debug, Default)]
pub struct LastCandidate {
    calls: AtomicU64,
}

impl LastCandidate {
    /// Decisions it made.
    #[must_use]
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl Scorer for LastCandidate {
    fn name(&self) -> &str {
        "last-candidate"
    }

    fn pick(&self, input: &ScoreInput<'_>) -> ScorePick {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match input.candidates().max_by_key(|c| c.index) {
            Some(c) => ScorePick::Winner {
                index: c.index,
                predicted_blocks: c.prefix(),
                diverted: false,
            },
            None => ScorePick::Miss(kvroute::MissReason::AllCandidatesFiltered),
        }
    }
}
