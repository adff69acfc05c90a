//! Per-request hash extras (vLLM `cache_salt`, LoRA adapters, multimodal items)
//! flow from [`Request::with_extras`] through [`ContractKeys`] into the
//! decision: checked against vLLM's own vectors and against the ladder.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{BlockKey, HashContract, LoraAdapter, MmFeature, RequestExtras, TokenId};
use kvroute_select::{
    AlwaysAvailable, ContractId, ContractKeys, Endpoint, KeySetInventory, KeysError, LoadTable,
    MissReason, PromptInput, PromptKeys, Request, Role, Rule, RuleConfig, Source, Topology,
};
use serde_json::Value;

fn golden_cases() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../golden/vllm/hash_vectors_v0.33.0.json"
    );
    let text = std::fs::read_to_string(path).expect("golden vLLM vectors");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn extras_of(case: &Value) -> RequestExtras {
    let lora = case["lora"].as_object().map(|l| LoraAdapter {
        name: l["name"].as_str().unwrap().to_owned(),
        path: l["path"].as_str().unwrap().to_owned(),
    });
    let mm_features = case["mm_features"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|m| MmFeature {
                    identifier: m["identifier"].as_str().unwrap().to_owned(),
                    offset: m["offset"].as_u64().unwrap(),
                    length: m["length"].as_u64().unwrap(),
                })
                .collect()
        })
        .unwrap_or_default();
    RequestExtras {
        lora,
        mm_features,
        cache_salt: case["cache_salt"].as_str().map(str::to_owned),
        ..RequestExtras::NONE
    }
}

fn contract_of(case: &Value) -> HashContract {
    // PYTHONHASHSEED is recorded as the environment string ("0"), or null when unset.
    let seed = match case["pythonhashseed"].as_str() {
        Some(s) => format!(":seed={s}"),
        None => String::new(),
    };
    format!(
        "vllm@0.33.0:{}:block={}{seed}",
        case["hash_algo"].as_str().unwrap(),
        case["block_size"].as_u64().unwrap()
    )
    .parse()
    .unwrap()
}

fn ids(case: &Value) -> Vec<TokenId> {
    case["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

#[test]
fn salted_and_lora_keys_equal_vllm_event_keys_and_differ_from_plain_ones() {
    let cases: Vec<Value> = golden_cases()
        .into_iter()
        .filter(|c| !c["cache_salt"].is_null() || !c["lora"].is_null())
        .filter(|c| c["num_hash_lookahead_tokens"].as_u64() == Some(0))
        .filter(|c| c["prompt_embeds_block_digests"].is_null())
        .collect();
    // The v0.33.0 set has salt, LoRA and LoRA+mm+salt cases for every algorithm.
    assert!(cases.len() >= 6, "only {} extras cases", cases.len());
    for case in &cases {
        let id = case["id"].as_str().unwrap();
        let provider = ContractKeys::new(&contract_of(case)).unwrap();
        let tokens = ids(case);
        let want: Vec<BlockKey> = case["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| BlockKey(b["event_key_u64"].as_u64().unwrap()))
            .collect();
        assert!(!want.is_empty(), "{id}");

        let mut got = Vec::new();
        provider
            .keys_with_extras(&tokens, &extras_of(case), &mut got)
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        assert_eq!(got, want, "{id}");

        let mut plain = Vec::new();
        provider.keys(&tokens, &mut plain).unwrap();
        assert_eq!(plain.len(), want.len(), "{id}");
        // Block 0 carries the salt (and LoRA is on every block): the chain differs throughout.
        for (i, (p, w)) in plain.iter().zip(&want).enumerate() {
            assert_ne!(p, w, "{id}: block {i} did not change with the extras");
        }
        // No extras is exactly the plain hash.
        let mut none = Vec::new();
        provider
            .keys_with_extras(&tokens, &RequestExtras::NONE, &mut none)
            .unwrap();
        assert_eq!(none, plain, "{id}");
    }
}

/// Every block of `tokens` under `extras`.
fn keys_for(provider: &ContractKeys, tokens: &[TokenId], extras: &RequestExtras) -> Vec<BlockKey> {
    let mut out = Vec::new();
    provider.keys_with_extras(tokens, extras, &mut out).unwrap();
    out
}

fn salted(salt: &str) -> RequestExtras {
    RequestExtras {
        cache_salt: Some(salt.to_owned()),
        ..RequestExtras::NONE
    }
}

fn rule_with(provider: Arc<dyn PromptKeys>, contract: ContractId) -> Rule {
    let endpoints = vec![
        Endpoint::new("plain:1", Role::Both).with_inventory_slot(0),
        Endpoint::new("salted:1", Role::Both).with_inventory_slot(1),
    ];
    let cfg = RuleConfig::kv_exact("extras", Topology::Converged, endpoints, 16, contract);
    Rule::new(cfg, Some(provider)).unwrap()
}

#[test]
fn a_salted_request_routes_to_the_endpoint_holding_the_salted_blocks() {
    let contract: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    let provider = Arc::new(ContractKeys::new(&contract).unwrap());
    let rule = rule_with(provider.clone(), ContractId::from(&contract));
    let tokens: Vec<TokenId> = (1000..1064).collect();
    let tenant_a = salted("tenant-a");
    let mut inv = KeySetInventory::new(2);
    inv.store(0, keys_for(&provider, &tokens, &RequestExtras::NONE));
    inv.store(1, keys_for(&provider, &tokens, &tenant_a));
    let (load, now) = (LoadTable::new(2), Duration::ZERO);

    let decide = |req: &Request<'_>| rule.decide(req, &inv, &load, &AlwaysAvailable, now);
    let plain = decide(&Request::new(PromptInput::Tokens(&tokens)));
    assert_eq!(plain.target().map(|t| t.endpoint.index()), Some(0));
    assert_eq!(plain.predicted_blocks(), 4);

    let salted_req = Request::new(PromptInput::Tokens(&tokens)).with_extras(&tenant_a);
    let d = decide(&salted_req);
    assert_eq!(d.source(), Source::KvExact);
    assert_eq!(d.target().map(|t| t.endpoint.index()), Some(1));
    assert_eq!(d.predicted_blocks(), 4);
    assert_eq!(d.keys(), keys_for(&provider, &tokens, &tenant_a).as_slice());

    // Another tenant's salt shares nothing with either inventory.
    let tenant_b = salted("tenant-b");
    let other = decide(&Request::new(PromptInput::Tokens(&tokens)).with_extras(&tenant_b));
    assert_eq!(other.miss(), Some(MissReason::ZeroOverlap));
    assert_eq!(
        rule.counters().snapshot().misses[MissReason::ZeroOverlap.index()],
        1
    );
}

/// A provider that only hashes token ids (the trait's default for extras).
struct TokensOnly(ContractKeys);

impl PromptKeys for TokensOnly {
    fn contract(&self) -> &ContractId {
        self.0.contract()
    }
    fn block_size(&self) -> u32 {
        self.0.block_size()
    }
    fn keys(&self, tokens: &[TokenId], out: &mut Vec<BlockKey>) -> Result<(), KeysError> {
        self.0.keys(tokens, out)
    }
}

#[test]
fn extras_a_provider_or_contract_cannot_hash_are_a_counted_miss_never_wrong_keys() {
    let tokens: Vec<TokenId> = (1..=64).collect();
    let tenant_a = salted("tenant-a");
    let lora = RequestExtras {
        lora: Some(LoraAdapter {
            name: "sql".into(),
            path: "/adapters/sql".into(),
        }),
        ..RequestExtras::NONE
    };
    let vllm: HashContract = "vllm@0.33.0:sha256_cbor:block=16:seed=0".parse().unwrap();
    // TensorRT-LLM keys a salt by `cache_salt_id`, and vLLM < 0.31 has another
    // extra-key layout: both refuse what they cannot reproduce.
    let trtllm: HashContract = "trtllm:v1_block_key:block=16".parse().unwrap();
    let old_vllm: HashContract = "vllm@0.30.0:sha256_cbor:block=16:seed=0".parse().unwrap();

    let cases: Vec<(Arc<dyn PromptKeys>, ContractId, &RequestExtras, &str)> = vec![
        (
            Arc::new(TokensOnly(ContractKeys::new(&vllm).unwrap())),
            ContractId::from(&vllm),
            &tenant_a,
            "cache_salt",
        ),
        (
            Arc::new(TokensOnly(ContractKeys::new(&vllm).unwrap())),
            ContractId::from(&vllm),
            &lora,
            "lora",
        ),
        (
            Arc::new(ContractKeys::new(&trtllm).unwrap()),
            ContractId::from(&trtllm),
            &tenant_a,
            "cache_salt",
        ),
        (
            Arc::new(ContractKeys::new(&old_vllm).unwrap()),
            ContractId::from(&old_vllm),
            &lora,
            "lora",
        ),
    ];
    for (provider, contract, extras, field) in cases {
        let mut out = vec![BlockKey(7)];
        match provider.keys_with_extras(&tokens, extras, &mut out) {
            Err(KeysError::ExtraNotSupported { field: f, .. }) => {
                assert_eq!(f, field, "{contract}")
            }
            other => panic!("{contract}: expected ExtraNotSupported, got {other:?}"),
        }
        assert_eq!(out, [BlockKey(7)], "{contract}: keys left behind");

        let rule = rule_with(provider.clone(), contract.clone());
        let mut inv = KeySetInventory::new(2);
        let mut plain = Vec::new();
        provider.keys(&tokens, &mut plain).unwrap();
        inv.store(1, plain);
        let req = Request::new(PromptInput::Tokens(&tokens)).with_extras(extras);
        let d = rule.decide(
            &req,
            &inv,
            &LoadTable::new(2),
            &AlwaysAvailable,
            Duration::ZERO,
        );
        assert_eq!(d.miss(), Some(MissReason::ExtrasUnsupported), "{contract}");
        assert!(d.keys().is_empty(), "{contract}");
        assert!(matches!(d.source(), Source::Fallback(_)), "{contract}");
        let snap = rule.counters().snapshot();
        assert_eq!(
            snap.misses[MissReason::ExtrasUnsupported.index()],
            1,
            "{contract}"
        );
        // The same request without extras still hashes and hits.
        let d = rule.decide(
            &Request::new(PromptInput::Tokens(&tokens)),
            &inv,
            &LoadTable::new(2),
            &AlwaysAvailable,
            Duration::ZERO,
        );
        assert_eq!(d.source(), Source::KvExact, "{contract}");
        assert_eq!(MissReason::ExtrasUnsupported.as_str(), "extras_unsupported");
    }
}
