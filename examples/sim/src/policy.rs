//! The routing policies the simulator compares, each a real `kvroute-select`
//! rule.
//!
//! Each policy is the rule of a [`kvroute::KvRouter`] built by
//! [`PolicySpec::router`]; a host's own scorer runs as [`PolicySpec::Custom`].
//!
//! | policy | rule |
//! |---|---|
//! | `rr` | `Choice::RoundRobin` |
//! | `least-load` | KV-exact rule whose endpoints publish no inventory, so every request takes the `LeastLoad` fallback |
//! | `p2c` | the same with `PowerOfTwoChoices` |
//! | `chwbl` | `Choice::ContentAffinity` (bounded-load consistent hashing over the key covering the first 256 tokens) |
//! | `kv-overlap` | KV-exact, `Scorer::OverlapCount`, round-robin fallback (the reference behaviour) |
//! | `kv-prefix` | KV-exact, `Scorer::LongestPrefix`, round-robin fallback |
//! | `kv-bounded` | KV-exact, `Scorer::LoadAware` (bounded load, ε = 0.25 by default), round-robin fallback (`--bounded-fallback`) |
//! | `kv-exact` | **the default**: exactly what `kvroute serve` runs for a KV-exact rule that names no scorer — `RuleConfig::kv_exact` untouched (`Scorer::Cost`, least-load fallback, predicted entries) |
//! | `dynamo-cost` | KV-exact with NVIDIA Dynamo's KV router cost function as the scorer, re-implemented in [`super::peers`] |
//! | `smg-cache-aware` | KV-exact with SGLang Model Gateway's `cache_aware` policy as the scorer (approximate tree, no events), [`super::peers`] |
//! | `llmd-weighted` | KV-exact with llm-d's weighted prefix / queue / KV-utilisation scorers as the scorer, [`super::peers`] |
//!
//! The peers' policies are scorers of a real rule ([`super::peers::PeerScorer`]),
//! without predicted entries (the peers have none).

use std::sync::{Arc, Mutex};

use kvroute::{KvRouter, KvRouterBuilder};
use kvroute_select::{
    Choice, CostConfig, CostScorer, LoadAwareConfig, LoadAwareScorer, LongestPrefixScorer,
    OverlapCountScorer, PredictedConfig, ScorerRef, SelectorKind, Thresholds,
};

use super::peers::{ActiveSequences, PeerScorer};

/// One compared policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Round robin.
    RoundRobin,
    /// Least in-flight requests.
    LeastLoad,
    /// Power of two choices.
    PowerOfTwo,
    /// Consistent hashing with bounded loads.
    Chwbl,
    /// KV-exact, overlap-count argmax (reference).
    KvOverlap,
    /// KV-exact, longest prefix.
    KvPrefix,
    /// KV-exact, load-aware with a bounded-load cap.
    KvBounded,
    /// KV-exact with the library's default scorer (what `serve` runs).
    KvExact,
    /// NVIDIA Dynamo's cost function.
    DynamoCost,
    /// SGLang Model Gateway's `cache_aware`.
    SmgCacheAware,
    /// llm-d's weighted scorers.
    LlmdWeighted,
}

/// Knobs of the load-bounded policies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    /// ε of the `kv-bounded` scorer.
    pub epsilon: f64,
    /// CHWBL load factor `c`.
    pub chwbl_factor: f64,
    /// `kv-bounded`: prefill tokens one in-flight request is assumed to cost.
    pub tokens_per_in_flight: f64,
    /// `kv-bounded`: the selector used when no worker holds any of the prompt.
    pub bounded_fallback: SelectorKind,
    /// `kv-exact`: the cost scorer's parameters (the library default unless
    /// overridden on the command line).
    pub cost: CostConfig,
    /// `kv-exact`: predicted entries on (the library default) or off.
    pub predicted: bool,
    /// Candidate sampling on large pools ([`Thresholds::sample_size`]; 0:
    /// every endpoint is scored).
    pub sample_size: u32,
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            epsilon: LoadAwareConfig::default().epsilon,
            chwbl_factor: 1.25,
            tokens_per_in_flight: LoadAwareConfig::default().tokens_per_in_flight,
            bounded_fallback: SelectorKind::RoundRobin,
            cost: CostConfig::default(),
            predicted: true,
            sample_size: Thresholds::default().sample_size,
        }
    }
}

/// The contract name every simulated worker and prompt uses.
pub const SIM_CONTRACT: &str = "kvroute-sim/mooncake-chain";

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 11] = [
        Policy::RoundRobin,
        Policy::LeastLoad,
        Policy::PowerOfTwo,
        Policy::Chwbl,
        Policy::KvOverlap,
        Policy::KvPrefix,
        Policy::KvBounded,
        Policy::KvExact,
        Policy::DynamoCost,
        Policy::SmgCacheAware,
        Policy::LlmdWeighted,
    ];

    /// The CLI / report name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "rr",
            Policy::LeastLoad => "least-load",
            Policy::PowerOfTwo => "p2c",
            Policy::Chwbl => "chwbl",
            Policy::KvOverlap => "kv-overlap",
            Policy::KvPrefix => "kv-prefix",
            Policy::KvBounded => "kv-bounded",
            Policy::KvExact => "kv-exact",
            Policy::DynamoCost => "dynamo-cost",
            Policy::SmgCacheAware => "smg-cache-aware",
            Policy::LlmdWeighted => "llmd-weighted",
        }
    }

    /// True for the peers' policies (their view includes the engines' own
    /// reports, read at each decision).
    #[must_use]
    pub fn is_peer(self) -> bool {
        matches!(
            self,
            Policy::DynamoCost | Policy::SmgCacheAware | Policy::LlmdWeighted
        )
    }

    /// Parses a comma-separated list (`all` for every policy).
    ///
    /// # Errors
    /// Names an unknown policy.
    pub fn parse_list(list: &str) -> Result<Vec<Policy>, String> {
        let mut out = Vec::new();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if name == "all" {
                for p in Self::ALL {
                    if !out.contains(&p) {
                        out.push(p);
                    }
                }
                continue;
            }
            let p = Self::ALL
                .into_iter()
                .find(|p| p.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = Self::ALL.iter().map(|p| p.name()).collect();
                    format!("unknown policy {name:?} (known: all, {})", known.join(", "))
                })?;
            if !out.contains(&p) {
                out.push(p);
            }
        }
        if out.is_empty() {
            return Err("no policy given".to_owned());
        }
        Ok(out)
    }

    /// True for policies that score inventories.
    #[must_use]
    pub fn uses_inventory(self) -> bool {
        matches!(
            self,
            Policy::KvOverlap | Policy::KvPrefix | Policy::KvBounded | Policy::KvExact
        ) || self.is_peer()
    }

    /// The router for a fleet of `workers` workers (endpoints are added by
    /// the caller), its keys named `contract`. `active` is Dynamo's record of
    /// the blocks in flight (read by `dynamo-cost` only), which the host feeds
    /// ([`ActiveSequences`]).
    pub fn router(
        self,
        contract: &str,
        workers: usize,
        block_size: u32,
        seed: u64,
        t: Tuning,
        active: &Arc<Mutex<ActiveSequences>>,
    ) -> KvRouterBuilder {
        let thresholds = Thresholds {
            chwbl_load_factor: t.chwbl_factor,
            sample_size: t.sample_size,
            ..Thresholds::default()
        };
        let no_predictions = PredictedConfig {
            capacity: 0,
            ..PredictedConfig::default()
        };
        let b = KvRouter::builder_for_keys(contract, block_size)
            .name(self.name())
            .seed(seed)
            .max_endpoints(workers.max(1))
            .thresholds(thresholds);
        match self {
            Policy::RoundRobin => b.choice(Choice::RoundRobin),
            Policy::Chwbl => b.choice(Choice::ContentAffinity),
            Policy::LeastLoad => b.fallback(SelectorKind::LeastLoad),
            Policy::PowerOfTwo => b.fallback(SelectorKind::PowerOfTwoChoices),
            Policy::KvExact => {
                let b = b.scorer(Arc::new(CostScorer(t.cost)));
                if t.predicted {
                    b
                } else {
                    b.predicted(no_predictions)
                }
            }
            Policy::DynamoCost | Policy::SmgCacheAware | Policy::LlmdWeighted => {
                let scorer: ScorerRef = Arc::new(match self {
                    Policy::DynamoCost => PeerScorer::dynamo(workers, seed, Arc::clone(active)),
                    Policy::SmgCacheAware => PeerScorer::smg(workers, seed),
                    _ => PeerScorer::llmd(workers, seed),
                });
                b.scorer(scorer).predicted(no_predictions)
            }
            Policy::KvOverlap => b
                .scorer(Arc::new(OverlapCountScorer))
                .fallback(SelectorKind::RoundRobin),
            Policy::KvPrefix => b
                .scorer(Arc::new(LongestPrefixScorer))
                .fallback(SelectorKind::RoundRobin),
            Policy::KvBounded => b
                .scorer(Arc::new(LoadAwareScorer(LoadAwareConfig {
                    epsilon: t.epsilon,
                    tokens_per_in_flight: t.tokens_per_in_flight,
                    ..LoadAwareConfig::default()
                })))
                .fallback(t.bounded_fallback),
        }
    }
}

/// Builds a fresh scorer for one router (a scorer may keep per-router state).
pub type ScorerFactory = Arc<dyn Fn() -> ScorerRef + Send + Sync>;

/// A policy the simulator runs: a built-in one, or a KV-exact rule with a
/// host's own scorer.
#[derive(Clone)]
pub enum PolicySpec {
    /// One of [`Policy::ALL`].
    Builtin(Policy),
    /// A KV-exact rule (the default fallback and predicted entries) whose
    /// scorer `scorer` builds, reported as `name`.
    Custom {
        /// Report name.
        name: String,
        /// Builds the scorer of each replica's router.
        scorer: ScorerFactory,
    },
}

impl std::fmt::Debug for PolicySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<Policy> for PolicySpec {
    fn from(p: Policy) -> Self {
        Self::Builtin(p)
    }
}

impl PolicySpec {
    /// The report name.
    #[must_use]
    pub fn name(&self) -> String {
        match self {
            Self::Builtin(p) => p.name().to_owned(),
            Self::Custom { name, .. } => name.clone(),
        }
    }

    /// True for policies that score inventories.
    #[must_use]
    pub fn uses_inventory(&self) -> bool {
        match self {
            Self::Builtin(p) => p.uses_inventory(),
            Self::Custom { .. } => true,
        }
    }

    /// True for policies whose view includes the engines' own reports, read
    /// at each decision (the peers').
    #[must_use]
    pub fn is_peer(&self) -> bool {
        matches!(self, Self::Builtin(p) if p.is_peer())
    }

    /// [`Policy::router`], or the custom scorer's KV-exact router.
    pub fn router(
        &self,
        contract: &str,
        workers: usize,
        block_size: u32,
        seed: u64,
        t: Tuning,
        active: &Arc<Mutex<ActiveSequences>>,
    ) -> KvRouterBuilder {
        match self {
            Self::Builtin(p) => p.router(contract, workers, block_size, seed, t, active),
            Self::Custom { name, scorer } => KvRouter::builder_for_keys(contract, block_size)
                .name(name.clone())
                .seed(seed)
                .max_endpoints(workers.max(1))
                .scorer(scorer()),
        }
    }
}

/// Parses a fallback selector name (`rr`, `least-load`, `p2c`).
///
/// # Errors
/// Names an unknown selector.
pub fn parse_fallback(name: &str) -> Result<SelectorKind, String> {
    match name {
        "rr" => Ok(SelectorKind::RoundRobin),
        "least-load" => Ok(SelectorKind::LeastLoad),
        "p2c" => Ok(SelectorKind::PowerOfTwoChoices),
        other => Err(format!(
            "unknown fallback {other:?} (known: rr, least-load, p2c)"
        )),
    }
}
