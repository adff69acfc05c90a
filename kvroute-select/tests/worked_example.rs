//! The reference document's worked example: P/D rule, prefill EP0 and EP2, decode
//! EP1, block size 16, vLLM sha256_cbor, a shared 32-token preamble.

mod common;

use std::time::Duration;

use kvroute_core::{EndpointId, Medium};
use kvroute_ingest::{BlockStored, IndexConfig, SharedIndex};
use kvroute_select::{
    AlwaysAvailable, Endpoint, Leg, LoadTable, MissReason, PromptInput, Request, Role, Rule,
    RuleConfig, Source, Target, Topology,
};

const EP0: EndpointId = EndpointId(0);
const EP1: EndpointId = EndpointId(1);
const EP2: EndpointId = EndpointId(2);

#[test]
fn cold_then_warm_then_refused() {
    let (contract, hasher, golden) = common::vllm_sha256_cbor_unset_seed();
    // Rule order EP0, EP1, EP2; the prefill endpoints publish into index slots 0 and 1.
    let endpoints = vec![
        Endpoint::new("ep0:8000", Role::Prefill).with_inventory_slot(0),
        Endpoint::new("ep1:8000", Role::Decode),
        Endpoint::new("ep2:8000", Role::Prefill).with_inventory_slot(1),
    ];
    let cfg = RuleConfig::kv_exact(
        "worked-example",
        Topology::PrefillDecode,
        endpoints,
        16,
        contract,
    );
    let rule = Rule::new(cfg, Some(hasher)).unwrap();
    // The real concurrent index of kvroute-ingest, one slot per prefill endpoint.
    let index = SharedIndex::new(2, IndexConfig::default());
    let (load, health, now) = (LoadTable::new(3), AlwaysAvailable, Duration::from_secs(1));

    let preamble = &golden.tokens[..32];
    let prompt_a: Vec<u32> = golden.tokens[..40].to_vec();
    let mut prompt_b: Vec<u32> = preamble.to_vec();
    prompt_b.extend_from_slice(&golden.tokens[48..54]);
    assert_eq!((prompt_a.len(), prompt_b.len()), (40, 38));

    // Cold: empty inventories → zero overlap → P/D minimum load (all idle, round
    // robin breaks the tie → the first prefill endpoint).
    let req_a = Request::new(PromptInput::Tokens(&prompt_a));
    let cold = rule.decide(&req_a, &index, &load, &health, now);
    assert_eq!(cold.miss(), Some(MissReason::ZeroOverlap));
    assert_eq!(
        cold.source(),
        // P/D minimum load, measured as the prefill work queued there.
        Source::Fallback(kvroute_select::SelectorKind::LeastPrefill)
    );
    assert_eq!(
        cold.target(),
        Some(Target {
            endpoint: EP0,
            decode: Some(EP1)
        })
    );
    // Prompt A hashes (kvroute-core, sha256_cbor) to the two full blocks vLLM
    // itself computed (partial B3 is not hashed).
    assert_eq!(cold.keys(), &golden.keys[..2]);

    // EP0 prefilled prompt A and published BlockStored{h1, h2}.
    let stored = BlockStored {
        keys: golden.keys[..2].to_vec(),
        ..BlockStored::default()
    };
    index
        .store(EndpointId(0), Medium::Gpu, &stored.keys)
        .unwrap();

    // Warm: prompt B shares the preamble → EP0 = 2, EP2 = 0 → EP0, hit counted.
    let req_b = Request::new(PromptInput::Tokens(&prompt_b));
    let mut warm = rule.decide(&req_b, &index, &load, &health, now);
    assert_eq!(warm.keys(), &golden.keys[..2]);
    assert_eq!(warm.overlaps()[0].blocks, 2);
    assert_eq!(warm.overlaps()[2].blocks, 0);
    assert_eq!(warm.source(), Source::KvExact);
    assert_eq!(
        warm.target(),
        Some(Target {
            endpoint: EP0,
            decode: Some(EP1)
        })
    );
    assert_eq!(warm.predicted_blocks(), 2);
    let snap = rule.counters().snapshot();
    assert_eq!(snap.hits_for(EP0), 1);
    assert_eq!(snap.hits_for(EP2), 0);
    assert_eq!(snap.misses_for(MissReason::ZeroOverlap), 1);

    // EP0 refuses the connection: retry inside the tier → EP2, never EP1.
    let keys_before = warm.keys().to_vec();
    let next = rule.retry(&mut warm, Leg::Endpoint, &req_b, &load, &health, now);
    assert_eq!(
        next,
        Some(Target {
            endpoint: EP2,
            decode: Some(EP1)
        })
    );
    assert_eq!(warm.source(), Source::KvExact);
    assert_eq!(
        warm.keys(),
        keys_before.as_slice(),
        "keys reused, not recomputed"
    );
    // Nothing eligible is left for prefill: exhausted rather than the decode endpoint.
    assert_eq!(
        rule.retry(&mut warm, Leg::Endpoint, &req_b, &load, &health, now),
        None
    );
    let snap = rule.counters().snapshot();
    assert_eq!((snap.retries, snap.exhausted), (2, 1));
    assert_eq!(snap.decisions, 2);
}
