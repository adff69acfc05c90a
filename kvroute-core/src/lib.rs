//! # kvroute-core
//!
//! The hashing contract of kvroute: token blocks → block keys bit-identical to the
//! ones vLLM, SGLang and TensorRT-LLM publish in their KV-cache events, plus the
//! vocabulary types shared by every kvroute crate.
//!
//! No async runtime, no I/O: everything here is a pure function or a `&mut self`
//! state machine.
//!
//! ## Naming a contract and hashing a prompt
//!
//! The operator names the contract explicitly — engine, version, algorithm, root
//! seed, block size — in a rule's configuration (serde) or as a compact spec:
//!
//! ```
//! use kvroute_core::{HashContract, RequestExtras};
//!
//! // vLLM 0.33 with `--prefix-caching-hash-algo sha256_cbor`, PYTHONHASHSEED=0,
//! // block size 16.
//! let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?;
//! let hasher = contract.hasher()?;
//!
//! let tokens: Vec<u32> = (0..40).collect();
//! let mut keys = Vec::new();
//! hasher.hash_prompt(&tokens, &RequestExtras::NONE, &mut keys)?;
//! assert_eq!(keys.len(), 2); // 40 tokens = two full blocks + a partial tail
//!
//! // Contracts whose keys cannot be reproduced are refused with advice:
//! let err = "vllm@0.33.0:xxhash_cbor:block=16".parse::<HashContract>()?.hasher().unwrap_err();
//! assert!(err.to_string().contains("set PYTHONHASHSEED=0 on the engine"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Modules
//!
//! * [`HashContract`] (one of [`VllmContract`], [`SglangContract`],
//!   [`TrtllmContract`], [`RekeyContract`]): the contract descriptors and their validation.
//! * [`BlockHasher`] / [`PromptHasher`]: one-shot, incremental and chain-continuing hashing.
//! * [`vllm`], [`sglang`], [`trtllm`], [`rekey`]: the engines' raw rules.
//! * `golden` (feature `parity`): checkers for the golden hash-vector files (`kvroute parity`).
//!
//! ## Features
//!
//! None by default. `parity` adds the `golden` checkers; `fuzzing` adds the
//! entry points of the cargo-fuzz targets in `fuzz/` (not a stable API).
#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![deny(unsafe_code)]

mod contract;
mod digest;
mod error;
mod extras;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "parity")]
pub mod golden;
mod hasher;
mod miss;
pub mod mix;
mod names;
pub mod rekey;
pub mod sglang;
pub mod trtllm;
mod types;
mod version;
pub mod vllm;

pub use contract::{
    HashContract, KeyMode, PythonHashSeed, RekeyAlgorithm, RekeyContract, SglangAlgorithm,
    SglangContract, SglangEventsFormat, TrtllmAlgorithm, TrtllmContract, VllmContract,
};
pub use digest::Digest;
pub use error::{ContractError, HashError};
pub use extras::{LoraAdapter, MmFeature, PromptEmbedsDigest, RequestExtras};
pub use hasher::{BlockHasher, PromptHasher};
pub use miss::MissReason;
pub use names::UnknownName;
pub use types::{BlockKey, EndpointId, Medium, TokenId};
pub use version::{EngineVersion, VersionParseError};
pub use vllm::VllmAlgorithm;
