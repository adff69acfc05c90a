//! # kvroute-select
//!
//! The routing decision: rules, the guard ladder, KV-exact scorers, fallback
//! selectors (round robin, least load, power of two choices, CHWBL, random,
//! weighted), post-filtering, retry with exclusion, and decision/delivery
//! evidence — behind small traits any proxy can host.
//!
//! Sans-IO: no sockets, clocks or threads. Time (`now`) is an argument; load and
//! health come from the host through [`Load`] and [`Health`].
//!
//! ## The ladder
//!
//! * **Converged**: KV-exact over every endpoint → on a miss the rule's selector.
//! * **P/D**: session affinity → prefix-trie affinity → KV-exact over prefill
//!   endpoints → P/D minimum load (round robin only breaks ties). Every P/D
//!   target also names the least-loaded decode endpoint.
//!
//! Every KV-exact miss has a [`MissReason`], counted per rule in [`RuleCounters`].
//!
//! ## Driving a decision yourself (sans-IO)
//!
//! ```
//! use std::time::Duration;
//! use kvroute_core::{BlockKey, EndpointId};
//! use kvroute_select::*;
//!
//! let contract = ContractId::new("example/bs4");
//! let endpoints = vec![
//!     Endpoint::new("10.0.0.1:8000", Role::Prefill).with_inventory_slot(0),
//!     Endpoint::new("10.0.0.2:8000", Role::Decode),
//!     Endpoint::new("10.0.0.3:8000", Role::Prefill).with_inventory_slot(1),
//! ];
//! let cfg = RuleConfig::kv_exact("pd", Topology::PrefillDecode, endpoints, 4, contract.clone());
//! let rule = Rule::new(cfg, None).unwrap();
//!
//! let mut inventory = KeySetInventory::new(2);
//! inventory.store(0, [BlockKey(11), BlockKey(12)]);
//! let keys = [BlockKey(11), BlockKey(12), BlockKey(13)];
//! let req = Request::new(PromptInput::Keys { keys: &keys, contract: &contract, prompt_tokens: 12 });
//! let (load, health, now) = (LoadTable::new(3), AlwaysAvailable, Duration::ZERO);
//!
//! let mut d = rule.decide(&req, &inventory, &load, &health, now);
//! assert_eq!(d.target(), Some(Target { endpoint: EndpointId(0), decode: Some(EndpointId(1)) }));
//! // Connection refused: the next best prefill endpoint, never the decode one.
//! let next = rule.retry(&mut d, Leg::Endpoint, &req, &load, &health, now);
//! assert_eq!(next.map(|t| t.endpoint), Some(EndpointId(2)));
//! ```
//!
//! The `kvroute` crate's `KvRouter` is the driver most hosts use (load,
//! health, retries and receipts included); hosts deciding many requests in a
//! loop themselves keep one [`Decision`] and call [`Rule::decide_into`]: no
//! allocation per decision.
//!
//! ## Per-request hash extras
//!
//! Engines mix more than tokens into block keys (vLLM: `cache_salt` into block
//! 0, the LoRA adapter into every block). A host passes them with
//! [`Request::with_extras`]; [`ContractKeys`] hashes them with the contract's
//! rules. A provider or contract that cannot reproduce an extra refuses it
//! ([`KeysError::ExtraNotSupported`]) and the decision records the miss
//! [`MissReason::ExtrasUnsupported`] instead of predicting hits with wrong keys.
//!
//! ## Why a decision went where it did
//!
//! Every decision keeps its cached-token account ([`Decision::account`]):
//! the prompt tokens some candidate held, what the chosen endpoint is
//! credited with, and what each ladder step gave up ([`LostCause`]); a
//! receipt settles it ([`Rule::settle`]) and the rule's counters sum it per
//! endpoint ([`EndpointEvidence::reachable_tokens`]). A host that asks
//! ([`Decision::set_explain`]) also gets the whole [`Explanation`]: every
//! endpoint's cached prefix and load, each pick, and the scorer's terms
//! ([`Scorer::explain`]).
//!
//! Feature `fuzzing` adds the entry points of the `select_ladder`,
//! `outlier` and `replica_sync` cargo-fuzz targets in `fuzz/` (not a stable
//! API).
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

mod affinity;
mod bounded;
mod burst;
mod chwbl;
mod contract_keys;
mod convert;
mod counters;
mod decision;
mod drain;
mod endpoint;
mod explain;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod health;
mod keys;
mod load;
mod memory_view;
mod names;
mod outlier;
mod pool;
pub mod replica_sync;
mod report_cell;
mod rule;
mod scoring;
mod selector;
mod tracker;
mod turn;

pub use affinity::AffinityConfig;
pub use contract_keys::ContractKeys;
pub use counters::{CountersSnapshot, EndpointEvidence, MissReason, RuleCounters};
pub use decision::{Decision, Leg, Settlement, Source, Target};
pub use drain::PrefillRate;
pub use endpoint::{Endpoint, Role};
pub use explain::{
    CapSummary, EndpointExplain, Explanation, Ineligible, LostCause, PickStep, ScoreExplain,
    ScoreSummary, ScoreTerms, TokenAccount, Verdict,
};
pub use health::{
    AdminState, AlwaysAvailable, Availability, BreakerConfig, BreakerState, CircuitBreaker, Health,
    HealthTable,
};
pub use keys::{ContractId, KeyMode, KeysError, PromptInput, PromptKeys, Request};
pub use load::{
    CombinedLoad, Deciders, EndpointLoad, EngineReport, Load, LoadTable, PrefillProgress,
    ReportedLoad,
};
pub use memory_view::KeySetInventory;
pub use names::{ScorerKind, UnknownName};
pub use outlier::{
    AttemptId, EjectionCause, EngineEvidence, OutlierConfig, OutlierDetector, OutlierStatus,
};
pub use pool::LoadBound;
pub use replica_sync::{
    Applied, LoadDelta, OutboxCounters, RemoteConfig, RemoteCounters, RemoteLoad, WithRemote,
    MAX_DELTA_TOKENS,
};
pub use rule::{Choice, PredictedConfig, Rule, RuleConfig, RuleError, Thresholds, Topology};
pub use scoring::{
    BurstStats, Candidate, CostConfig, CostScorer, LoadAwareConfig, LoadAwareScorer,
    LongestPrefixScorer, OverlapCountScorer, ScoreInput, ScorePick, Scorer, ScorerRef,
};
pub use selector::SelectorKind;
pub use tracker::{LoadGuard, LoadTracker};
pub use turn::{
    burst_turn, Turn, TurnConfig, DEFAULT_BURST_ORDER, TURN_MAX_CACHED, TURN_MIN_OTHERS,
};
