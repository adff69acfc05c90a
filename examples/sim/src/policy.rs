//! The routing policies the simulator compares, each a real `kvroute-select`
//! rule.
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

use std::sync::Arc;

use kvroute_select::{
    Choice, ContractId, CostConfig, CostScorer, Endpoint, LoadAwareConfig, LoadAwareScorer,
    LongestPrefixScorer, OverlapCountScorer, Role, RuleConfig, SelectorKind, Topology,
};

use super::peers::PeerScorer;

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

    /// The rule for a fleet of `workers` workers.
    #[must_use]
    pub fn rule_config(self, workers: usize, block_size: u32, seed: u64, t: Tuning) -> RuleConfig {
        let endpoints = (0..workers)
            .map(|i| {
                let e = Endpoint::new(format!("sim-worker-{i}"), Role::Both);
                match (self.uses_inventory(), u32::try_from(i)) {
                    (true, Ok(slot)) => e.with_inventory_slot(slot),
                    _ => e,
                }
            })
            .collect();
        let mut cfg = RuleConfig::kv_exact(
            self.name(),
            Topology::Converged,
            endpoints,
            block_size,
            ContractId::new(SIM_CONTRACT),
        );
        cfg.seed = seed;
        cfg.thresholds.chwbl_load_factor = t.chwbl_factor;
        match self {
            Policy::RoundRobin => cfg.choice = Choice::RoundRobin,
            Policy::Chwbl => cfg.choice = Choice::ContentAffinity,
            Policy::LeastLoad => cfg.fallback = SelectorKind::LeastLoad,
            Policy::PowerOfTwo => cfg.fallback = SelectorKind::PowerOfTwoChoices,
            Policy::KvExact => {
                cfg.scorer = Arc::new(CostScorer(t.cost));
                if !t.predicted {
                    cfg.predicted.capacity = 0;
                }
            }
            Policy::DynamoCost | Policy::SmgCacheAware | Policy::LlmdWeighted => {
                cfg.scorer = Arc::new(match self {
                    Policy::DynamoCost => PeerScorer::dynamo(workers, seed),
                    Policy::SmgCacheAware => PeerScorer::smg(workers, seed),
                    _ => PeerScorer::llmd(workers, seed),
                });
                cfg.predicted.capacity = 0;
            }
            Policy::KvOverlap => {
                cfg.scorer = Arc::new(OverlapCountScorer);
                cfg.fallback = SelectorKind::RoundRobin;
            }
            Policy::KvPrefix => {
                cfg.scorer = Arc::new(LongestPrefixScorer);
                cfg.fallback = SelectorKind::RoundRobin;
            }
            Policy::KvBounded => {
                cfg.scorer = Arc::new(LoadAwareScorer(LoadAwareConfig {
                    epsilon: t.epsilon,
                    tokens_per_in_flight: t.tokens_per_in_flight,
                    ..LoadAwareConfig::default()
                }));
                cfg.fallback = t.bounded_fallback;
            }
        }
        cfg
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
