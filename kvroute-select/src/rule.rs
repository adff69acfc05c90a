//! Rule configuration and the shared per-rule state.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::affinity::{AffinityConfig, PrefixTrie, SessionMap};
use crate::chwbl::Ring;
use crate::counters::RuleCounters;
use crate::endpoint::Endpoint;
use crate::keys::{ContractId, KeyMode, PromptKeys};
use crate::scoring::{CostScorer, ScorerRef};
use crate::selector::{SelectorKind, SelectorState};

/// The routing choice of a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Choice {
    /// Spread requests round robin.
    RoundRobin,
    /// Consistent hashing with bounded loads over a request-derived key.
    ContentAffinity,
    /// Match the prompt's block keys against endpoint inventories.
    #[default]
    KvExact,
}

/// How the rule's endpoints are organised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Topology {
    /// One role-less pool: KV-exact scores every endpoint; a miss uses the rule's
    /// fallback selector.
    #[default]
    Converged,
    /// Prefill/decode: session and trie affinity, then KV-exact over prefill
    /// endpoints, then P/D minimum load; every decision names a decode endpoint too.
    PrefillDecode,
}

/// Numeric knobs of a rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    /// Fewest overlapping blocks that count as a KV-exact hit (≥ 1).
    pub min_overlap_blocks: u32,
    /// CHWBL load bound `c` (≥ 1; 1.25 lets an endpoint reach 125 % of the mean).
    pub chwbl_load_factor: f64,
    /// CHWBL virtual nodes per unit of weight.
    pub chwbl_virtual_nodes: u32,
    /// Tokens of the prompt that form the CHWBL key when there is no session id.
    pub chwbl_prefix_tokens: usize,
    /// Retries after connect failures before the decision gives up.
    pub max_retries: u32,
    /// Consecutive zero-cached receipts after predicted hits that raise the
    /// drift alarm.
    pub drift_alarm_after: u64,
    /// Most cached tokens a receipt may claim: the bound that remains when
    /// neither the decision nor the engine's answer gives the prompt's
    /// length (default 2^24, beyond every engine's context window).
    pub max_receipt_tokens: u32,
    /// Candidate sampling on large pools: a KV-exact decision over more
    /// than `4 · sample_size` endpoints scores every endpoint that may save
    /// more prefill than most of the pool (a longer cached prefix, or more
    /// of it in a faster tier), and `sample_size` of the others drawn at
    /// random (the best of `d` random choices; each decider draws its own),
    /// instead of every endpoint. 0: always score every endpoint. Converged
    /// rules whose scorer reads the cached prefix only; a decision that
    /// falls back to the rule's selector gives it the whole pool.
    pub sample_size: u32,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            min_overlap_blocks: 1,
            chwbl_load_factor: 1.25,
            chwbl_virtual_nodes: 64,
            chwbl_prefix_tokens: 256,
            max_retries: 3,
            drift_alarm_after: 8,
            max_receipt_tokens: 1 << 24,
            sample_size: 64,
        }
    }
}

/// Predicted entries: at decision time the chosen endpoint is credited with the
/// prompt's block keys for `ttl`, so a burst of requests sharing a new prefix
/// co-locates before the engine's first `BlockStored` arrives. They extend the
/// prefix the scorers see, are superseded by the engine's own events, and are
/// never evidence (receipts, hit accounting and the drift alarm read the
/// engine-reported inventory only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PredictedConfig {
    /// How long a prediction stands (covers the engine's queueing and the
    /// event path; a stale one costs a lost optimisation, never a wrong answer).
    pub ttl: std::time::Duration,
    /// Most keys remembered per rule (oldest dropped first); 0 disables.
    pub capacity: usize,
    /// Most leading keys of one prompt recorded.
    pub max_keys_per_request: usize,
    /// One key in `stride` is recorded (plus the prompt's last): predicted
    /// prefixes are credited in steps of `stride` blocks.
    pub stride: usize,
}

impl Default for PredictedConfig {
    fn default() -> Self {
        Self {
            ttl: std::time::Duration::from_secs(5),
            capacity: 1 << 16,
            max_keys_per_request: 8192,
            stride: 8,
        }
    }
}

/// Everything that defines a rule.
#[derive(Clone, Debug)]
pub struct RuleConfig {
    /// Rule name (metrics label).
    pub name: String,
    /// Endpoints; position `i` is `EndpointId(i)`.
    pub endpoints: Vec<Endpoint>,
    /// Routing choice.
    pub choice: Choice,
    /// Converged or P/D.
    pub topology: Topology,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The hash contract prompt keys and inventories follow.
    pub contract: ContractId,
    /// Engine keys or re-keyed.
    pub key_mode: KeyMode,
    /// KV-exact scorer.
    pub scorer: ScorerRef,
    /// Converged fallback selector (used when `choice` is KV-exact).
    pub fallback: SelectorKind,
    /// Numeric knobs.
    pub thresholds: Thresholds,
    /// P/D affinity bounds.
    pub affinity: AffinityConfig,
    /// Predicted entries (KV-exact rules).
    pub predicted: PredictedConfig,
    /// Seed of the pseudo-random selectors (decisions are reproducible per seed).
    pub seed: u64,
    /// Endpoints the rule's per-endpoint state (counters, the drain model) is
    /// sized for, at least `endpoints.len()`: a host that adds endpoints
    /// later and rebuilds the rule ([`Rule::rebuild`]) keeps that state as
    /// long as the endpoint count stays within it.
    pub endpoint_capacity: usize,
}

impl RuleConfig {
    /// A KV-exact rule with default scorer, thresholds and affinity bounds.
    #[must_use]
    pub fn kv_exact(
        name: &str,
        topology: Topology,
        endpoints: Vec<Endpoint>,
        block_size: u32,
        contract: ContractId,
    ) -> Self {
        Self {
            name: name.to_owned(),
            endpoints,
            choice: Choice::KvExact,
            topology,
            block_size,
            contract,
            key_mode: KeyMode::Engine,
            scorer: Arc::new(CostScorer::default()),
            fallback: SelectorKind::LeastPrefill,
            thresholds: Thresholds::default(),
            affinity: AffinityConfig::default(),
            predicted: PredictedConfig::default(),
            seed: 0,
            endpoint_capacity: 0,
        }
    }
}

/// A rule that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    /// No endpoints.
    #[error("rule {0:?} has no endpoints")]
    NoEndpoints(String),
    /// More endpoints than dense ids allow.
    #[error("rule has {0} endpoints; at most {max} are supported", max = u32::MAX)]
    TooManyEndpoints(usize),
    /// `block_size` is 0.
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    /// A P/D rule without a prefill-capable or decode-capable endpoint.
    #[error("a prefill/decode rule needs at least one prefill and one decode endpoint")]
    IncompletePrefillDecode,
    /// Two endpoints claim the same inventory slot.
    #[error("inventory slot {0} is mapped to two endpoints")]
    DuplicateInventorySlot(u32),
    /// The key provider follows another contract than the rule.
    #[error("key provider follows contract {provider}, the rule expects {rule}")]
    ContractMismatch {
        /// The rule's contract.
        rule: ContractId,
        /// The provider's contract.
        provider: ContractId,
    },
    /// The key provider's block size or key mode differs from the rule's.
    #[error("key provider geometry (block size {provider_block_size}, {provider_mode:?}) differs from the rule's")]
    GeometryMismatch {
        /// Provider block size.
        provider_block_size: u32,
        /// Provider key mode.
        provider_mode: KeyMode,
    },
}

/// A built rule: configuration plus the state decisions share (counters,
/// round-robin turns, affinity maps). Decisions take `&self`; the rule is `Sync`.
/// Concurrent decisions score against the inventory in parallel; from reading
/// the predicted entries to recording their own (KV-exact) they take turns, so
/// each sees every decision that finished before it, as when decided one
/// after another.
pub struct Rule {
    pub(crate) config: RuleConfig,
    pub(crate) keys: Option<Arc<dyn PromptKeys>>,
    pub(crate) selector: SelectorState,
    // What decisions accumulate, shared with the rules rebuilt from this one.
    pub(crate) counters: Arc<RuleCounters>,
    pub(crate) decode_turns: Arc<std::sync::atomic::AtomicU64>,
    /// Rotates the cost scorer's exact ties (apart from the selector's
    /// round-robin turn, which only fallback decisions advance).
    pub(crate) tie_turns: Arc<std::sync::atomic::AtomicU64>,
    /// Seeds sampled decisions' draws ([`Thresholds::sample_size`]).
    pub(crate) sample_turns: Arc<std::sync::atomic::AtomicU64>,
    /// This rule's decisions seen as bursts, when the scorer reads them.
    pub(crate) burst: Option<Arc<Mutex<crate::burst::BurstTracker>>>,
    pub(crate) sessions: Arc<Mutex<SessionMap>>,
    pub(crate) trie: Arc<Mutex<PrefixTrie>>,
    pub(crate) predicted: Arc<Mutex<crate::bounded::BoundedMap<u64>>>,
    /// The cost scorer's prefill-queue drain model (`CostConfig::drain_queue`).
    pub(crate) drain: Option<Arc<crate::drain::PrefillDrain>>,
    /// Endpoints `counters` and `drain` are sized for.
    capacity: usize,
    /// Every endpoint `i` reads inventory slot `i`.
    pub(crate) identity_slots: bool,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("config", &self.config)
            .field("has_key_provider", &self.keys.is_some())
            .finish_non_exhaustive()
    }
}

impl Rule {
    /// Validates `config` and builds the rule. `keys` hashes token ids; without
    /// it the rule accepts only precomputed keys.
    ///
    /// # Errors
    /// [`RuleError`] for an inconsistent configuration.
    pub fn new(config: RuleConfig, keys: Option<Arc<dyn PromptKeys>>) -> Result<Self, RuleError> {
        Self::validate(&config, keys.as_deref())?;
        let capacity = config.endpoint_capacity.max(config.endpoints.len());
        let ring = Ring::new(&config.endpoints, config.thresholds.chwbl_virtual_nodes);
        Ok(Self {
            counters: Arc::new(RuleCounters::new(capacity)),
            selector: SelectorState::new(ring, config.seed),
            decode_turns: Arc::default(),
            tie_turns: Arc::default(),
            sample_turns: Arc::default(),
            burst: (config.scorer.burst_window().is_some() && config.choice == Choice::KvExact)
                .then(Arc::default),
            sessions: Arc::new(Mutex::new(SessionMap::new(&config.affinity))),
            trie: Arc::new(Mutex::new(PrefixTrie::new(&config.affinity))),
            predicted: Arc::new(Mutex::new(crate::bounded::BoundedMap::new(
                config.predicted.capacity,
                config.predicted.ttl,
            ))),
            drain: (config.scorer.drains_queue() && config.choice == Choice::KvExact)
                .then(|| Arc::new(crate::drain::PrefillDrain::new(capacity))),
            keys,
            identity_slots: identity_slots(&config.endpoints),
            config,
            capacity,
        })
    }

    /// A rule for `config` that carries on this one's state — decision
    /// counters, turns, predicted entries, the drain model's rates and the
    /// P/D affinity maps — as a host does when its endpoint set changes: the
    /// endpoint ids must keep naming the same endpoints (a removed endpoint
    /// stays, never available, until its id is reused). When `config` has
    /// more endpoints than this rule's [`RuleConfig::endpoint_capacity`], or
    /// changes the choice, scorer kind or predicted-entry bounds, the state
    /// starts afresh.
    ///
    /// # Errors
    /// [`RuleError`] for an inconsistent configuration.
    pub fn rebuild(
        &self,
        config: RuleConfig,
        keys: Option<Arc<dyn PromptKeys>>,
    ) -> Result<Self, RuleError> {
        let compatible = config.endpoints.len() <= self.capacity
            && config.choice == self.config.choice
            && config.scorer.drains_queue() == self.config.scorer.drains_queue()
            && config.predicted == self.config.predicted
            && config.affinity == self.config.affinity;
        if !compatible {
            return Self::new(config, keys);
        }
        Self::validate(&config, keys.as_deref())?;
        let ring = Ring::new(&config.endpoints, config.thresholds.chwbl_virtual_nodes);
        Ok(Self {
            counters: Arc::clone(&self.counters),
            selector: self.selector.carried(ring, config.seed),
            decode_turns: Arc::clone(&self.decode_turns),
            tie_turns: Arc::clone(&self.tie_turns),
            sample_turns: Arc::clone(&self.sample_turns),
            burst: match (&self.burst, config.scorer.burst_window()) {
                (Some(b), Some(_)) => Some(Arc::clone(b)),
                (None, Some(_)) if config.choice == Choice::KvExact => Some(Arc::default()),
                _ => None,
            },
            sessions: Arc::clone(&self.sessions),
            trie: Arc::clone(&self.trie),
            predicted: Arc::clone(&self.predicted),
            drain: self.drain.clone(),
            keys,
            identity_slots: identity_slots(&config.endpoints),
            config,
            capacity: self.capacity,
        })
    }

    /// `endpoint` left, and its id may name another endpoint later (a host
    /// reusing the slot): what this rule, and every rule rebuilt from it,
    /// remembers of it is forgotten — sessions and prefix-trie nodes pointing
    /// at it, predicted entries crediting it, its hits and delivery evidence
    /// (drift alarm included) and its modelled prefill queue.
    ///
    /// ```
    /// use kvroute_core::EndpointId;
    /// use kvroute_select::{ContractId, Endpoint, Role, Rule, RuleConfig, Topology};
    ///
    /// let endpoints = vec![
    ///     Endpoint::new("http://a:8000", Role::Both),
    ///     Endpoint::new("http://b:8000", Role::Both),
    /// ];
    /// let cfg = RuleConfig::kv_exact("r", Topology::Converged, endpoints, 16, ContractId::new("c"));
    /// let rule = Rule::new(cfg, None).unwrap();
    /// rule.forget_endpoint(EndpointId(1));
    /// assert_eq!(rule.counters().snapshot().endpoints[1].hits, 0);
    /// ```
    pub fn forget_endpoint(&self, endpoint: kvroute_core::EndpointId) {
        let e = endpoint.index();
        self.sessions.lock().forget(endpoint);
        self.trie.lock().forget(endpoint);
        self.predicted
            .lock()
            .retain_values(|v| crate::decision::predicted_endpoint(v) != e);
        self.counters.forget_endpoint(e);
        if let Some(d) = &self.drain {
            d.forget(e);
        }
    }

    fn validate(config: &RuleConfig, keys: Option<&dyn PromptKeys>) -> Result<(), RuleError> {
        if config.endpoints.is_empty() {
            return Err(RuleError::NoEndpoints(config.name.clone()));
        }
        if u32::try_from(config.endpoints.len()).is_err() {
            return Err(RuleError::TooManyEndpoints(config.endpoints.len()));
        }
        if config.block_size == 0 {
            return Err(RuleError::ZeroBlockSize);
        }
        if config.topology == Topology::PrefillDecode
            && !(config.endpoints.iter().any(|e| e.role.can_prefill())
                && config.endpoints.iter().any(|e| e.role.can_decode()))
        {
            return Err(RuleError::IncompletePrefillDecode);
        }
        let mut slots: Vec<u32> = config
            .endpoints
            .iter()
            .filter_map(|e| e.inventory_slot)
            .collect();
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| w.first() == w.get(1)) {
            return Err(RuleError::DuplicateInventorySlot(
                w.first().copied().unwrap_or(0),
            ));
        }
        if let Some(p) = keys {
            if p.contract() != &config.contract {
                return Err(RuleError::ContractMismatch {
                    rule: config.contract.clone(),
                    provider: p.contract().clone(),
                });
            }
            if p.block_size() != config.block_size || p.key_mode() != config.key_mode {
                return Err(RuleError::GeometryMismatch {
                    provider_block_size: p.block_size(),
                    provider_mode: p.key_mode(),
                });
            }
        }
        Ok(())
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &RuleConfig {
        &self.config
    }

    /// The endpoints, in id order.
    #[must_use]
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.config.endpoints
    }

    /// This rule's decisions seen as bursts so far ([`crate::BurstStats`]; the
    /// default when its scorer reads none): what a replica reads to know
    /// whether a burst is being decided ([`crate::burst_turn`]).
    #[must_use]
    pub fn burst_stats(&self) -> crate::scoring::BurstStats {
        self.burst
            .as_ref()
            .map(|b| b.lock().stats())
            .unwrap_or_default()
    }

    /// Live counters.
    #[must_use]
    pub fn counters(&self) -> &RuleCounters {
        &self.counters
    }

    /// Sessions currently remembered (bounded by the affinity config).
    #[must_use]
    pub fn session_count(&self) -> usize {
        self.sessions.lock().len()
    }

    /// Prefix-trie nodes currently held (bounded by the affinity config).
    #[must_use]
    pub fn trie_nodes(&self) -> usize {
        self.trie.lock().len()
    }
}

/// Whether every endpoint `i` reads inventory slot `i`.
fn identity_slots(endpoints: &[Endpoint]) -> bool {
    endpoints
        .iter()
        .enumerate()
        .all(|(i, e)| e.inventory_slot.is_some_and(|s| s as usize == i))
}
