//! Receipt plausibility: a receipt is bounded by the prompt's length when
//! the decision knows it, by the engine's own prompt count when its answer
//! carries one, and by `Thresholds::max_receipt_tokens` always.

use std::time::Duration;

use kvroute_core::BlockKey;
use kvroute_select::*;

fn rule() -> (Rule, ContractId) {
    let c = ContractId::new("receipts");
    let eps = vec![Endpoint::new("ep0", Role::Both).with_inventory_slot(0)];
    let cfg = RuleConfig::kv_exact("r", Topology::Converged, eps, 16, c.clone());
    (Rule::new(cfg, None).unwrap(), c)
}

fn decide(rule: &Rule, req: &Request<'_>) -> Decision {
    let inv = KeySetInventory::new(1);
    let d = rule.decide(
        req,
        &inv,
        &LoadTable::new(1),
        &AlwaysAvailable,
        Duration::ZERO,
    );
    assert!(d.target().is_some());
    d
}

#[test]
fn an_unknown_prompt_length_still_bounds_receipts() {
    let (r, _) = rule();
    // No tokenizer for the model: the decision does not know the length.
    let d = decide(
        &r,
        &Request::new(PromptInput::Missing(MissReason::NoTokenizer)),
    );
    assert_eq!(d.prompt_tokens(), 0);
    assert!(
        !r.record_usage(&d, 4_294_967_295, Some(10)),
        "above the engine's count"
    );
    assert!(
        !r.record_usage(&d, u32::MAX, None),
        "beyond any context window"
    );
    let ceiling = Thresholds::default().max_receipt_tokens;
    assert!(!r.record_receipt(&d, ceiling + 1));
    r.record_usage(&d, 8, Some(10));
    r.record_receipt(&d, ceiling);
    let s = r.counters().snapshot();
    assert_eq!(s.implausible_receipts, 3);
    assert_eq!(s.endpoints[0].receipts, 2);
    assert_eq!(s.endpoints[0].delivered_tokens, 8 + u64::from(ceiling));
}

#[test]
fn a_known_prompt_length_bounds_receipts_with_the_engines_count() {
    let (r, c) = rule();
    let keys = [BlockKey(1), BlockKey(2)];
    let d = decide(
        &r,
        &Request::new(PromptInput::Keys {
            keys: &keys,
            contract: &c,
            prompt_tokens: 40,
        }),
    );
    assert!(!r.record_usage(&d, 41, None), "above the prompt");
    assert!(
        !r.record_usage(&d, 32, Some(30)),
        "above the engine's own count"
    );
    r.record_usage(&d, 32, None);
    let s = r.counters().snapshot();
    assert_eq!(s.implausible_receipts, 2);
    assert_eq!(s.endpoints[0].delivered_tokens, 32);
}
