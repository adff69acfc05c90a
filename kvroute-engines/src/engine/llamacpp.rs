//! llama.cpp server: keeps a prompt cache per slot but publishes no KV
//! events and has no block-hash contract, so KV-exact routing cannot follow
//! it ([`Engine::kv_events`] says so, with the alternative that works);
//! content affinity and the other selectors route to it fine.
//!
//! ```
//! use kvroute_engines::engine::{Engine, Follow, LLAMA_CPP};
//! use kvroute_engines::transport::TransportError;
//!
//! let err = LLAMA_CPP.kv_events().unwrap_err();
//! assert!(matches!(err, TransportError::Unsupported { .. }));
//! assert!(err.to_string().contains("content affinity"));
//! // Nothing to follow; asked to subscribe anyway, the same error.
//! assert!(LLAMA_CPP.streams(&Follow::new("http://h:8080", 16)).unwrap().is_empty());
//! assert!(LLAMA_CPP.streams(&Follow::new("http://h:8080", 16).events("tcp://*:5557")).is_err());
//! ```

use kvroute_ingest::SeqWindowConfig;

use super::{Engine, Follow, Stream};
use crate::transport::TransportError;

/// llama.cpp's server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LlamaCpp;

/// The llama.cpp engine.
pub static LLAMA_CPP: LlamaCpp = LlamaCpp;

impl Engine for LlamaCpp {
    fn name(&self) -> &str {
        "llama.cpp"
    }

    fn aliases(&self) -> &[&str] {
        &["llamacpp"]
    }

    fn kv_events(&self) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            engine: self.name().to_owned(),
            feature: "KV-exact routing",
            reason: "llama.cpp publishes no KV-cache events and has no block-hash contract, \
                     so its cache inventory cannot be followed",
            suggestion: "use content affinity (CHWBL over a request-derived prefix), which \
                         keeps a prompt prefix on the same server without engine events",
        })
    }

    /// No events.
    fn events_carry_tokens(&self) -> bool {
        false
    }

    /// The default: nothing is ever followed.
    fn window(&self, _follow: &Follow) -> SeqWindowConfig {
        SeqWindowConfig::default()
    }

    /// Nothing, unless events are configured: then [`Engine::kv_events`]'s
    /// error.
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        if follow.events.is_some() || follow.replay.is_some() {
            self.kv_events()?;
        }
        Ok(Vec::new())
    }
}
