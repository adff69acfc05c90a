//! The prompt step's keys (`kvroute::prompt::prepare` with the rule's
//! contract keys: each tokenized piece hashed while later pieces encode)
//! equal the keys selection computes from the same ids, and the decisions
//! they give are the ones the ids alone give — for chat and completions
//! bodies, salted and LoRA requests, id and list prompts, truncation, long
//! texts split on the parallel encoder, and every contract family.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvroute::prompt::{prepare, PreparedPrompt, PromptHost, PromptOptions};
use kvroute_core::{BlockKey, EndpointId, LoraAdapter, RequestExtras};
use kvroute_engines::prompt::{ParallelConfig, ParallelEncoder, TokenizerPool};
use kvroute_engines::ApiKind;
use kvroute_select::{
    AlwaysAvailable, Choice, ContractId, ContractKeys, Endpoint, KeySetInventory, LoadTable,
    PromptInput, PromptKeys, Request, Role, Rule, RuleConfig, SelectorKind, Topology,
};
use proptest::prelude::*;
use serde_json::json;

const MODEL: &str = "Qwen/Qwen3-8B";
const CONTRACTS: [&str; 5] = [
    "vllm@0.33.0:sha256_cbor:block=16:seed=0",
    "vllm@0.33.0:xxhash_cbor:block=16:seed=0",
    "sglang@0.5.5:legacy_pyhash:block=16",
    "sglang@0.5.23:sha256_page_chain:page=4",
    "rekey:xxh3_64_chain:block=16:seed=1337",
];

struct Host {
    pool: &'static TokenizerPool,
    options: PromptOptions,
}

impl PromptHost for Host {
    fn tokenizers(&self) -> &TokenizerPool {
        self.pool
    }
    fn options(&self, _model: Option<&str>) -> PromptOptions {
        self.options.clone()
    }
}

/// The model's tokenizers, loaded once per test binary (with and without
/// a parallel encoder).
fn pool(parallel: bool) -> &'static TokenizerPool {
    static POOLS: [OnceLock<TokenizerPool>; 2] = [OnceLock::new(), OnceLock::new()];
    POOLS[usize::from(parallel)].get_or_init(|| new_pool(parallel))
}

fn new_pool(parallel: bool) -> TokenizerPool {
    let pool = TokenizerPool::new();
    pool.register(
        MODEL,
        concat!(env!("CARGO_MANIFEST_DIR"), "/../golden/tokenizers/qwen3"),
    );
    if parallel {
        // Small pieces, so even test-sized texts arrive in several parts.
        let encoder = ParallelEncoder::new(ParallelConfig {
            threads: 2,
            min_bytes: 256,
            pieces_per_thread: 4,
            window_bytes: 64,
        })
        .unwrap();
        pool.set_parallel(Some(Arc::new(encoder)));
    }
    pool
}

fn host(contract: &str, parallel: bool, lora: bool) -> Host {
    let mut options = PromptOptions::default();
    options.keys = Some(Arc::new(
        ContractKeys::new(&contract.parse().unwrap()).unwrap(),
    ));
    if lora {
        options.extras = RequestExtras {
            lora: Some(LoraAdapter {
                name: "sql".into(),
                path: "/adapters/sql".into(),
            }),
            ..RequestExtras::NONE
        };
    }
    Host {
        pool: pool(parallel),
        options,
    }
}

/// What selection hashes from the prepared ids and extras.
fn selection_keys(host: &Host, p: &PreparedPrompt) -> Result<Vec<BlockKey>, String> {
    let keys = host.options.keys.as_ref().unwrap();
    let mut out = Vec::new();
    keys.keys_with_extras(
        p.tokens().map_err(|m| format!("{m:?}"))?,
        p.extras(),
        &mut out,
    )
    .map_err(|e| e.to_string())?;
    Ok(out)
}

/// Prepared keys equal selection's, under the host's contract; returns how
/// many blocks they had.
fn check(host: &Host, api: ApiKind, body: &serde_json::Value) -> usize {
    let bytes = serde_json::to_vec(body).unwrap();
    let what = String::from_utf8_lossy(&bytes[..bytes.len().min(120)]).into_owned();
    let p = prepare(host, api, &bytes);
    let want = selection_keys(host, &p);
    let contract = host.options.keys.as_ref().unwrap().contract();
    match (p.keys(), want) {
        (Some((keys, c)), Ok(want)) => {
            assert_eq!(c, contract);
            assert_eq!(keys, &want[..], "{what}");
            // The same prompt without hashing: same ids, text and extras.
            let mut plain = Host {
                pool: pool(false),
                options: host.options.clone(),
            };
            plain.options.keys = None;
            let q = prepare(&plain, api, &bytes);
            assert_eq!(q.tokens(), p.tokens());
            assert_eq!((q.text(), q.extras()), (p.text(), p.extras()));
            assert!(q.keys().is_none());
            keys.len()
        }
        // Selection refuses the same requests (an extra the contract lacks).
        (None, Err(_)) => 0,
        (got, want) => panic!("{what}: prepared {got:?}, selection {want:?}"),
    }
}

fn chat(text: &str) -> serde_json::Value {
    json!({"model": MODEL, "messages": [
        {"role": "system", "content": "You answer questions about routing."},
        {"role": "user", "content": text}]})
}

fn document(words: usize) -> String {
    (0..words)
        .map(|i| format!("w{i} the router's prefix {i}, 1 2 3"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn prepared_keys_equal_the_keys_selection_computes_from_the_ids() {
    let long = document(400);
    let bodies = [
        (ApiKind::Chat, chat("short")),
        (ApiKind::Chat, chat(&long)),
        (
            ApiKind::Chat,
            json!({"model": MODEL, "cache_salt": "tenant-a", "messages": [{"role": "user", "content": long}]}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": long}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": long, "truncate_prompt_tokens": 100}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": long, "truncate_prompt_tokens": 100, "truncation_side": "left"}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": (0..70).collect::<Vec<u32>>()}),
        ),
        (
            ApiKind::Completions,
            json!({"model": MODEL, "prompt": [long.clone(), "second"]}),
        ),
    ];
    let mut hashed = 0;
    for contract in CONTRACTS {
        for parallel in [false, true] {
            for lora in [false, true] {
                let h = host(contract, parallel, lora);
                for (api, body) in &bodies {
                    hashed += usize::from(check(&h, *api, body) > 0);
                }
            }
        }
    }
    // Every contract hashes plain requests; refusals (a salt or adapter a
    // contract does not key) are the only ones without keys.
    assert!(hashed >= CONTRACTS.len() * 2 * 6, "{hashed}");
}

#[test]
fn a_long_prompt_arrives_in_parts_and_still_hashes_to_the_same_keys() {
    // Enough text for the encoder's pieces: the pipeline overlapped.
    let text = document(3000);
    let h = host(CONTRACTS[0], true, false);
    let bytes = serde_json::to_vec(&chat(&text)).unwrap();
    let p = prepare(&h, ApiKind::Chat, &bytes);
    let ids = p.tokens().unwrap();
    let tok = h.pool.get(MODEL).unwrap();
    let mut parts = 0;
    tok.encode_each(p.text().unwrap(), false, |_| {
        parts += 1;
        Ok::<(), kvroute_engines::prompt::PromptError>(())
    })
    .unwrap();
    assert!(parts > 1, "{parts} parts");
    assert!(ids.len() > 16 * 100);
    assert_eq!(p.keys().unwrap().0, &selection_keys(&h, &p).unwrap()[..]);
}

/// Three endpoints; `holder` holds the first `blocks` keys of `keys`.
fn decide(
    choice: Choice,
    fallback: SelectorKind,
    contract: &ContractId,
    keys_provider: &Arc<ContractKeys>,
    inventory: &KeySetInventory,
    req: &Request<'_>,
) -> kvroute_select::Decision {
    let endpoints = (0..3)
        .map(|i| Endpoint::new(format!("10.0.0.{i}:8000"), Role::Both).with_inventory_slot(i))
        .collect();
    let mut cfg = RuleConfig::kv_exact("t", Topology::Converged, endpoints, 16, contract.clone());
    cfg.choice = choice;
    cfg.fallback = fallback;
    let rule = Rule::new(cfg, Some(Arc::clone(keys_provider) as Arc<dyn PromptKeys>)).unwrap();
    rule.decide(
        req,
        inventory,
        &LoadTable::new(3),
        &AlwaysAvailable,
        Duration::ZERO,
    )
}

#[test]
fn decisions_from_prepared_keys_are_the_decisions_from_the_ids() {
    let h = host(CONTRACTS[0], true, false);
    let provider = h.options.keys.clone().unwrap();
    let contract = provider.contract().clone();
    let body = serde_json::to_vec(&chat(&document(200))).unwrap();
    let p = prepare(&h, ApiKind::Chat, &body);
    let (keys, _) = p.keys().unwrap();
    assert!(keys.len() > 8);
    let ids = p.tokens().unwrap();
    let plain = Request::new(PromptInput::Tokens(ids)).with_text(p.text().unwrap());
    let mut held = KeySetInventory::new(3);
    held.store(2, keys[..keys.len() / 2].iter().copied());
    let empty = KeySetInventory::new(3);
    for (inv, what) in [(&held, "half held by 2"), (&empty, "a miss")] {
        for choice in [Choice::KvExact, Choice::ContentAffinity, Choice::RoundRobin] {
            for fallback in [SelectorKind::Chwbl, SelectorKind::LeastPrefill] {
                let a = decide(choice, fallback, &contract, &provider, inv, &p.request());
                let b = decide(choice, fallback, &contract, &provider, inv, &plain);
                let ctx = format!("{what}, {choice:?}, {fallback:?}");
                assert_eq!(a.target(), b.target(), "{ctx}");
                assert_eq!(a.source(), b.source(), "{ctx}");
                assert_eq!(a.miss(), b.miss(), "{ctx}");
                assert_eq!(a.keys(), b.keys(), "{ctx}");
                assert_eq!(a.predicted_blocks(), b.predicted_blocks(), "{ctx}");
                assert_eq!(a.prompt_tokens(), b.prompt_tokens(), "{ctx}");
            }
        }
    }
    let hit = decide(
        Choice::KvExact,
        SelectorKind::LeastPrefill,
        &contract,
        &provider,
        &held,
        &p.request(),
    );
    assert_eq!(hit.target().map(|t| t.endpoint), Some(EndpointId(2)));
    assert_eq!(hit.predicted_blocks() as usize, keys.len() / 2);

    // Keys of another contract are not used: the ids are hashed.
    let other = ContractId::new("some/other/contract");
    let wrong = [BlockKey(1), BlockKey(2)];
    let req = Request::new(PromptInput::Tokens(ids)).with_keys(&wrong, &other);
    let d = decide(
        Choice::KvExact,
        SelectorKind::LeastPrefill,
        &contract,
        &provider,
        &held,
        &req,
    );
    assert_eq!(d.keys(), keys);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Random texts of fragments that stress the encoder's seams (runs of
    /// spaces and newlines, digits, CJK, emoji, added-token look-alikes).
    #[test]
    fn random_prompts_hash_to_selection_keys(
        parts in proptest::collection::vec(
            prop_oneof![
                Just("the router "), Just("  \n\n "), Just("12345 678"), Just("路由器缓存"),
                Just("👩‍💻 ok "), Just("<|im_start|>"), Just("<|im_end"), Just("it's "),
                Just("\t\r\n"), Just("word"),
            ],
            1..400,
        ),
        completions in any::<bool>(),
    ) {
        let text: String = parts.concat();
        let h = host(CONTRACTS[0], true, false);
        let (api, body) = if completions {
            (ApiKind::Completions, json!({"model": MODEL, "prompt": text}))
        } else {
            (ApiKind::Chat, chat(&text))
        };
        check(&h, api, &body);
    }
}
