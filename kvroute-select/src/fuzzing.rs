//! Fuzz entry points (used by `fuzz/fuzz_targets/select_ladder.rs`, the corpus
//! replay test and the property tests). The assertions here are the oracle:
//! they state the ladder's invariants.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::InventoryView;

use crate::{
    Availability, Choice, ContractId, CostConfig, CostScorer, Decision, Endpoint, EndpointLoad,
    Health, KeySetInventory, Leg, LoadAwareConfig, LoadAwareScorer, LoadTable, LongestPrefixScorer,
    MissBeforeKeys, OverlapCountScorer, PromptInput, Request, Role, Rule, RuleConfig, SelectorKind,
    Source, Topology,
};

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
}

/// Availability per endpoint, read from fuzz bytes.
struct FuzzHealth(Vec<Availability>);

impl Health for FuzzHealth {
    fn availability(&self, endpoint: EndpointId, _now: Duration) -> Availability {
        self.0.get(endpoint.index()).copied().unwrap_or_default()
    }
}

/// Builds a random rule, inventory, loads and health from `data`, decides, retries
/// a few times, and checks the ladder's invariants after every step.
pub fn select_ladder(data: &[u8]) {
    let mut b = Bytes(data);
    let n = 1 + usize::from(b.next() % 10);
    let topology = if b.next() & 1 == 0 {
        Topology::Converged
    } else {
        Topology::PrefillDecode
    };
    let mut endpoints = Vec::with_capacity(n);
    let mut slot = 0u32;
    for i in 0..n {
        let role = match b.next() % 3 {
            0 => Role::Prefill,
            1 => Role::Decode,
            _ => Role::Both,
        };
        let mut e = Endpoint::new(format!("ep{i}"), role)
            .with_weight(u32::from(b.next() % 4))
            .with_capacity(u32::from(b.next() % 4));
        if b.next() & 1 == 1 {
            e = e.with_inventory_slot(slot);
            slot += 1;
        }
        endpoints.push(e);
    }
    if topology == Topology::PrefillDecode {
        // Guarantee the P/D precondition so the rule builds.
        if let Some(e) = endpoints.first_mut() {
            e.role = Role::Prefill;
        }
        if let Some(e) = endpoints.last_mut() {
            e.role = if n == 1 { Role::Both } else { Role::Decode };
        }
    }
    let contract = ContractId::new("fuzz");
    let mut cfg = RuleConfig::kv_exact("fuzz", topology, endpoints, 4, contract.clone());
    cfg.choice = match b.next() % 4 {
        0 => Choice::RoundRobin,
        1 => Choice::ContentAffinity,
        _ => Choice::KvExact,
    };
    cfg.scorer = match b.next() % 4 {
        0 => Arc::new(OverlapCountScorer),
        1 => Arc::new(LongestPrefixScorer),
        2 => Arc::new(LoadAwareScorer(LoadAwareConfig {
            epsilon: f64::from(b.next() % 8) / 4.0,
            ..LoadAwareConfig::default()
        })),
        _ => Arc::new(CostScorer(CostConfig {
            load_factor: 1.0 + f64::from(b.next() % 8) / 4.0,
            affinity_slack: f64::from(b.next() % 4) / 4.0,
            ..CostConfig::default()
        })),
    };
    cfg.fallback = match b.next() % 7 {
        0 => SelectorKind::RoundRobin,
        1 => SelectorKind::LeastLoad,
        6 => SelectorKind::LeastPrefill,
        2 => SelectorKind::PowerOfTwoChoices,
        3 => SelectorKind::Chwbl,
        4 => SelectorKind::Random,
        _ => SelectorKind::Weighted,
    };
    cfg.thresholds.min_overlap_blocks = 1 + u32::from(b.next() % 3);
    cfg.thresholds.max_retries = u32::from(b.next() % 8);
    cfg.seed = u64::from(b.next());
    let Ok(rule) = Rule::new(cfg, None) else {
        return;
    };

    let universe: Vec<BlockKey> = (1..=12u64).map(BlockKey).collect();
    let mut inv = KeySetInventory::new(slot as usize);
    for s in 0..slot as usize {
        let mask = u16::from_le_bytes([b.next(), b.next()]);
        inv.store(
            s,
            universe
                .iter()
                .enumerate()
                .filter(|(k, _)| mask >> k & 1 == 1)
                .map(|(_, k)| *k),
        );
    }
    let prompt_len = usize::from(b.next() % 9);
    let keys: Vec<BlockKey> = (0..prompt_len)
        .map(|_| BlockKey(1 + u64::from(b.next() % 14)))
        .collect();
    let mut load = LoadTable::new(n);
    let mut health = Vec::with_capacity(n);
    for i in 0..n {
        let id = EndpointId(u32::try_from(i).unwrap_or(0));
        load.set(
            id,
            EndpointLoad {
                in_flight: u32::from(b.next() % 8),
                queued_prefill_tokens: u64::from(b.next()) * 16,
            },
        );
        health.push(match b.next() % 6 {
            0 => Availability::AdminDown,
            1 => Availability::BreakerOpen,
            _ => Availability::Available,
        });
    }
    let health = FuzzHealth(health);
    let other = ContractId::new("other");
    let prompt = match b.next() % 8 {
        0 => PromptInput::Missing(MissBeforeKeys::NotJson),
        1 => PromptInput::Keys {
            keys: &keys,
            contract: &other,
            prompt_tokens: 4,
        },
        _ => PromptInput::Keys {
            keys: &keys,
            contract: &contract,
            prompt_tokens: u32::try_from(keys.len() * 4).unwrap_or(0),
        },
    };
    let text = "the shared system preamble of every request in this fuzz case";
    let mut request = Request::new(prompt);
    if b.next() & 1 == 1 {
        request = request.with_session("session");
    }
    if b.next() & 1 == 1 {
        request = request.with_text(text);
    }
    let now = Duration::from_secs(u64::from(b.next()));

    let mut d = rule.decide(&request, &inv, &load, &health, now);
    check(&rule, &d, &inv, &load, &health, now, true);
    for _ in 0..(b.next() % 6) {
        let leg = if b.next() & 1 == 0 {
            Leg::Endpoint
        } else {
            Leg::Decode
        };
        let before = d.target();
        let kv_before = d.source() == Source::KvExact;
        let next = rule.retry(&mut d, leg, &request, &load, &health, now);
        if let (Some(prev), Some(next)) = (before, next) {
            if leg == Leg::Endpoint {
                assert_ne!(
                    prev.endpoint, next.endpoint,
                    "retry returned the failed endpoint"
                );
                if kv_before {
                    assert_eq!(d.source(), Source::KvExact, "a KV retry left the tier");
                }
            }
        }
        check(&rule, &d, &inv, &load, &health, now, false);
    }
    let _ = rule.record_receipt(&d, u32::from(b.next()));
}

/// The invariants every decision state satisfies.
pub fn check<V: InventoryView + ?Sized>(
    rule: &Rule,
    d: &Decision,
    _view: &V,
    load: &LoadTable,
    health: &dyn Health,
    now: Duration,
    first: bool,
) {
    use crate::Load;
    let Some(t) = d.target() else {
        assert_eq!(d.source(), Source::Exhausted);
        return;
    };
    let eps = rule.endpoints();
    let pd = rule.config().topology == Topology::PrefillDecode;
    let eligible = |i: EndpointId| {
        eps.get(i.index())
            .is_some_and(|e| !pd || e.role.can_prefill())
            && !d.is_excluded(i)
            && health.availability(i, now).is_available()
    };
    assert!(eligible(t.endpoint), "ineligible endpoint chosen: {t:?}");
    match (pd, t.decode) {
        (true, Some(dec)) => {
            assert!(eps.get(dec.index()).is_some_and(|e| e.role.can_decode()));
            assert!(health.availability(dec, now).is_available());
        }
        (false, None) => {}
        other => panic!("decode leg does not match topology: {other:?}"),
    }
    if d.source() == Source::KvExact {
        let ids = (0..eps.len()).filter_map(|i| u32::try_from(i).ok().map(EndpointId));
        let figure = |i: EndpointId| {
            let o = d.overlaps().get(i.index()).copied().unwrap_or_default();
            if rule.config().scorer.reads_any_position() {
                o.blocks
            } else {
                let spec = d.speculative_prefix().get(i.index()).copied().unwrap_or(0);
                o.prefix.max(spec)
            }
        };
        let scorer: &dyn std::any::Any = &*rule.config().scorer;
        let load_aware = scorer.downcast_ref::<LoadAwareScorer>().map(|s| s.0);
        let cost = scorer.downcast_ref::<CostScorer>().map(|s| s.0);
        match (load_aware, cost) {
            (None, None) => {
                let best = ids.filter(|i| eligible(*i)).map(figure).max().unwrap_or(0);
                assert_eq!(figure(t.endpoint), best, "KV winner is not the argmax");
                if first {
                    assert!(best >= rule.config().thresholds.min_overlap_blocks.max(1));
                }
            }
            _ => {
                let (factor, headroom) = match (load_aware, cost) {
                    (Some(cfg), _) => (1.0 + cfg.epsilon.max(0.0), 0),
                    (_, Some(cfg)) => (cfg.load_factor, cfg.load_headroom),
                    _ => (1.0, 0),
                };
                let (mut total, mut cap) = (0u64, 0u64);
                let cands: Vec<EndpointId> = ids.filter(|i| eligible(*i)).collect();
                for i in &cands {
                    total += u64::from(load.load(*i).in_flight);
                    cap += u64::from(eps[i.index()].capacity.max(1));
                }
                let bound = crate::LoadBound {
                    total_in_flight: total,
                    total_capacity: cap.max(1),
                    factor: factor.max(1.0),
                };
                let admits = |i: EndpointId| {
                    !factor.is_finite()
                        || bound.admits(
                            load.load(i).in_flight.saturating_sub(headroom),
                            eps[i.index()].capacity.max(1),
                        )
                };
                if !admits(t.endpoint) {
                    assert!(
                        !cands.iter().any(|i| admits(*i)),
                        "load cap violated while others were under it"
                    );
                }
            }
        }
    }
}
