//! # kvroute-core
//!
//! The hashing contract of kvroute: token blocks → block keys bit-identical to the
//! ones vLLM, SGLang and TensorRT-LLM publish in their KV-cache events, plus the
//! vocabulary types shared by every kvroute crate.
//!
//! No async runtime, no I/O: everything here is a pure function or a `&mut self`
//! state machine.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod types;

pub use types::{BlockKey, EndpointId, Medium, TokenId};
