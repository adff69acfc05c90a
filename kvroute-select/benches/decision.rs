//! A routing decision over 64 endpoints for an 8K-token prompt.
//! Run: `cargo bench -p kvroute-select --bench decision -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_core::BlockKey;
use std::sync::Arc;

use kvroute_ingest::SharedIndex;

use kvroute_select::{
    AlwaysAvailable, ContractId, CostConfig, CostScorer, Endpoint, EndpointLoad, KeySetInventory,
    LoadTable, PromptInput, Request, Role, Rule, RuleConfig, Topology,
};

const ENDPOINTS: usize = 64;
const TOKENS: usize = 8192;
const BLOCK: usize = 16;

fn setup() -> (Rule, KeySetInventory, LoadTable, Vec<BlockKey>, ContractId) {
    let contract = ContractId::new("bench/bs16");
    let endpoints: Vec<Endpoint> = (0..ENDPOINTS)
        .map(|i| {
            Endpoint::new(format!("10.0.{}.{}:8000", i / 256, i % 256), Role::Both)
                .with_inventory_slot(i as u32)
        })
        .collect();
    let cfg = RuleConfig::kv_exact(
        "bench",
        Topology::Converged,
        endpoints,
        BLOCK as u32,
        contract.clone(),
    );
    let rule = Rule::new(cfg, None).unwrap();
    let keys: Vec<BlockKey> = (0..TOKENS / BLOCK)
        .map(|i| BlockKey(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)))
        .collect();
    let mut inv = KeySetInventory::new(ENDPOINTS);
    // Every endpoint holds a different-length prefix of the prompt plus unrelated blocks.
    for slot in 0..ENDPOINTS {
        let held = (slot * 7) % keys.len();
        inv.store(slot, keys[..held].iter().copied());
        inv.store(slot, (0..2000u64).map(|j| BlockKey(j << 20 | slot as u64)));
    }
    let mut load = LoadTable::new(ENDPOINTS);
    for i in 0..ENDPOINTS {
        load.set(
            kvroute_core::EndpointId(i as u32),
            EndpointLoad {
                in_flight: (i % 5) as u32,
                queued_prefill_tokens: 0,
            },
        );
    }
    (rule, inv, load, keys, contract)
}

fn decision_from_keys(c: &mut Criterion) {
    let (rule, inv, load, keys, contract) = setup();
    c.bench_function("decide/precomputed_keys/8k_tokens/64_endpoints", |b| {
        b.iter(|| {
            let req = Request::new(PromptInput::Keys {
                keys: &keys,
                contract: &contract,
                prompt_tokens: TOKENS as u32,
            });
            black_box(
                rule.decide(
                    black_box(&req),
                    &inv,
                    &load,
                    &AlwaysAvailable,
                    Duration::ZERO,
                )
                .target(),
            )
        })
    });
}

fn decision_from_keys_shared_index(c: &mut Criterion) {
    let (rule, _, load, keys, contract) = setup();
    let index = kvroute_ingest::SharedIndex::new(ENDPOINTS, kvroute_ingest::IndexConfig::default());
    for slot in 0..ENDPOINTS {
        let e = kvroute_core::EndpointId(slot as u32);
        let held = (slot * 7) % keys.len();
        index
            .store(e, kvroute_core::Medium::Gpu, &keys[..held])
            .unwrap();
        let other: Vec<BlockKey> = (0..2000u64)
            .map(|j| BlockKey(j << 20 | slot as u64))
            .collect();
        index.store(e, kvroute_core::Medium::Gpu, &other).unwrap();
    }
    c.bench_function(
        "decide/precomputed_keys/shared_index/8k_tokens/64_endpoints",
        |b| {
            b.iter(|| {
                let req = Request::new(PromptInput::Keys {
                    keys: &keys,
                    contract: &contract,
                    prompt_tokens: TOKENS as u32,
                });
                black_box(
                    rule.decide(
                        black_box(&req),
                        &index,
                        &load,
                        &AlwaysAvailable,
                        Duration::ZERO,
                    )
                    .target(),
                )
            })
        },
    );
}

fn decision_from_tokens(c: &mut Criterion) {
    for spec in [
        "vllm@0.33.0:sha256_cbor:block=16:seed=0",
        "vllm@0.33.0:xxhash_cbor:block=16:seed=0",
    ] {
        let contract: kvroute_core::HashContract = spec.parse().unwrap();
        let provider = std::sync::Arc::new(kvroute_select::ContractKeys::new(&contract).unwrap());
        let (_, inv, load, _, _) = setup();
        let endpoints: Vec<Endpoint> = (0..ENDPOINTS)
            .map(|i| Endpoint::new(format!("ep{i}"), Role::Both).with_inventory_slot(i as u32))
            .collect();
        let cfg = RuleConfig::kv_exact(
            "bench",
            Topology::Converged,
            endpoints,
            BLOCK as u32,
            ContractId::from(&contract),
        );
        let rule = Rule::new(cfg, Some(provider)).unwrap();
        let tokens: Vec<u32> = (0..TOKENS as u32)
            .map(|t| t.wrapping_mul(2654435761) % 151_000)
            .collect();
        let name = format!(
            "decide/tokens/{}/8k_tokens/64_endpoints",
            spec.split(':').nth(1).unwrap()
        );
        c.bench_function(&name, |b| {
            b.iter(|| {
                let req = Request::new(PromptInput::Tokens(&tokens));
                black_box(
                    rule.decide(
                        black_box(&req),
                        &inv,
                        &load,
                        &AlwaysAvailable,
                        Duration::ZERO,
                    )
                    .target(),
                )
            })
        });
    }
}

/// Simulator-like shape: many endpoints, a short prompt, so the per-decision
/// buffers (one entry per endpoint) rather than scoring dominate.
const MANY: usize = 256;

fn many_endpoints() -> (Rule, KeySetInventory, LoadTable, Vec<BlockKey>, ContractId) {
    let contract = ContractId::new("bench/bs16");
    let endpoints: Vec<Endpoint> = (0..MANY)
        .map(|i| Endpoint::new(format!("w{i}"), Role::Both).with_inventory_slot(i as u32))
        .collect();
    let cfg = RuleConfig::kv_exact(
        "bench",
        Topology::Converged,
        endpoints,
        BLOCK as u32,
        contract.clone(),
    );
    let rule = Rule::new(cfg, None).unwrap();
    let keys: Vec<BlockKey> = (0..128u64)
        .map(|i| BlockKey(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1)))
        .collect();
    let mut inv = KeySetInventory::new(MANY);
    for slot in 0..MANY {
        inv.store(slot, keys[..slot % keys.len()].iter().copied());
    }
    let mut load = LoadTable::new(MANY);
    for i in 0..MANY {
        load.set(
            kvroute_core::EndpointId(i as u32),
            EndpointLoad {
                in_flight: (i % 5) as u32,
                queued_prefill_tokens: 0,
            },
        );
    }
    (rule, inv, load, keys, contract)
}

fn decision_many_endpoints(c: &mut Criterion) {
    let (rule, inv, load, keys, contract) = many_endpoints();
    let req = Request::new(PromptInput::Keys {
        keys: &keys,
        contract: &contract,
        prompt_tokens: 2048,
    });
    c.bench_function("decide/precomputed_keys/2k_tokens/256_endpoints", |b| {
        b.iter(|| {
            black_box(
                rule.decide(
                    black_box(&req),
                    &inv,
                    &load,
                    &AlwaysAvailable,
                    Duration::ZERO,
                )
                .target(),
            )
        })
    });
    let mut d = kvroute_select::Decision::new();
    c.bench_function(
        "decide_into/reused/precomputed_keys/2k_tokens/256_endpoints",
        |b| {
            b.iter(|| {
                rule.decide_into(
                    &mut d,
                    black_box(&req),
                    &inv,
                    &load,
                    &AlwaysAvailable,
                    Duration::ZERO,
                );
                black_box(d.target())
            })
        },
    );
}

/// The cost scorer's drain model takes one lock per decision (and one per
/// charge). Two threads deciding on one rule at once, with the drain on and
/// off: if the lock contended, the two-thread time per decision would grow
/// more with the drain on than off. (2k-token prompts, so the decision's
/// share outside the lock is small and contention would show.)
fn decision_two_threads_drain(c: &mut Criterion) {
    let (_, inv, load, keys, contract) = setup();
    let keys = &keys[..2048 / BLOCK];
    for drain in [true, false] {
        let endpoints: Vec<Endpoint> = (0..ENDPOINTS)
            .map(|i| {
                Endpoint::new(format!("10.0.{}.{}:8000", i / 256, i % 256), Role::Both)
                    .with_inventory_slot(i as u32)
            })
            .collect();
        let mut cfg = RuleConfig::kv_exact(
            "bench",
            Topology::Converged,
            endpoints,
            BLOCK as u32,
            contract.clone(),
        );
        cfg.scorer = Arc::new(CostScorer(CostConfig {
            drain_queue: drain,
            ..CostConfig::default()
        }));
        let rule = Rule::new(cfg, None).unwrap();
        for threads in [1usize, 2] {
            let name = format!(
                "decide/threads={threads}/drain={}/2k_tokens/64_endpoints",
                if drain { "on" } else { "off" }
            );
            c.bench_function(&name, |b| {
                b.iter_custom(|iters| {
                    let start = std::time::Instant::now();
                    std::thread::scope(|s| {
                        for t in 0..threads {
                            let (rule, inv, load, contract) = (&rule, &inv, &load, &contract);
                            s.spawn(move || {
                                let mut d = kvroute_select::Decision::new();
                                for i in 0..iters {
                                    let req = Request::new(PromptInput::Keys {
                                        keys,
                                        contract,
                                        prompt_tokens: 2048,
                                    });
                                    // Distinct times: the drain's learning
                                    // step runs on every decision.
                                    let now = Duration::from_micros(i * 2 + t as u64);
                                    rule.decide_into(
                                        &mut d,
                                        &req,
                                        inv,
                                        load,
                                        &AlwaysAvailable,
                                        now,
                                    );
                                    black_box(d.target());
                                }
                            });
                        }
                    });
                    start.elapsed()
                });
            });
        }
    }
}

/// The decision's cost as the pool grows: a 512-block prompt over 64, 256
/// and 1 024 endpoints of the ingest index, each holding a different-length
/// prefix of the prompt and 2 000 other blocks. Prints the index's memory
/// per size once.
fn decision_scale(c: &mut Criterion) {
    for n in [64usize, 256, 1024] {
        let contract = ContractId::new("bench/bs16");
        let endpoints: Vec<Endpoint> = (0..n)
            .map(|i| {
                Endpoint::new(format!("10.{}.{}.1:8000", i / 256, i % 256), Role::Both)
                    .with_inventory_slot(i as u32)
            })
            .collect();
        let cfg = RuleConfig::kv_exact(
            "bench",
            Topology::Converged,
            endpoints,
            BLOCK as u32,
            contract.clone(),
        );
        let rule = Rule::new(cfg, None).unwrap();
        let keys: Vec<BlockKey> = (0..TOKENS / BLOCK)
            .map(|i| BlockKey(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)))
            .collect();
        let index = kvroute_ingest::SharedIndex::new(n, kvroute_ingest::IndexConfig::default());
        let mut load = LoadTable::new(n);
        for slot in 0..n {
            let e = kvroute_core::EndpointId(slot as u32);
            let held = (slot * 7) % keys.len();
            index
                .store(e, kvroute_core::Medium::Gpu, &keys[..held])
                .unwrap();
            let other: Vec<BlockKey> = (0..2000u64)
                .map(|j| BlockKey(j << 20 | slot as u64))
                .collect();
            index.store(e, kvroute_core::Medium::Gpu, &other).unwrap();
            load.set(
                e,
                EndpointLoad {
                    in_flight: (slot % 5) as u32,
                    queued_prefill_tokens: 0,
                },
            );
        }
        eprintln!(
            "decide/scale: {n} endpoints, {} (endpoint, block) pairs, index {} MiB",
            n * 2000 + (0..n).map(|s| (s * 7) % keys.len()).sum::<usize>(),
            index.memory_bytes() >> 20
        );
        let shared_root = shared_root_index(n, &keys);
        let bench = |c: &mut Criterion, name: &str, rule: &Rule, view: &SharedIndex| {
            bench_decide(
                c,
                &format!("decide/scale/{name}/512_blocks/{n}_endpoints"),
                rule,
                view,
                &keys,
                &contract,
                &load,
            );
        };
        bench(c, "shared_root", &rule, &shared_root);
        // The same decision scoring every endpoint (`sample_size` 0):
        // what candidate sampling saves on a pool large enough for it.
        if n > 4 * kvroute_select::Thresholds::default().sample_size as usize {
            let mut cfg = rule.config().clone();
            cfg.thresholds.sample_size = 0;
            let unsampled = Rule::new(cfg, None).unwrap();
            bench(c, "unsampled", &unsampled, &shared_root);
        }
        // The same decision recording its explanation, as the gateway's
        // decision ring does for every request: a fresh decision each time
        // (the ring keeps the explanation it is handed).
        c.bench_function(
            &format!("decide/scale/explained/512_blocks/{n}_endpoints"),
            |b| {
                b.iter(|| {
                    let req = Request::new(PromptInput::Keys {
                        keys: &keys,
                        contract: &contract,
                        prompt_tokens: TOKENS as u32,
                    });
                    let mut d = kvroute_select::Decision::new();
                    d.set_explain(true);
                    rule.decide_into(
                        &mut d,
                        black_box(&req),
                        &shared_root,
                        &load,
                        &AlwaysAvailable,
                        Duration::ZERO,
                    );
                    black_box(d.take_explanation())
                })
            },
        );
        bench(c, "shared_index", &rule, &index);
    }
}

/// One decision from the prompt's `keys` by `rule` over `view`, into a
/// decision whose buffers the previous one sized (as a host deciding many
/// requests, and the runtime, reuse them).
fn bench_decide<V: kvroute_ingest::InventoryView>(
    c: &mut Criterion,
    name: &str,
    rule: &Rule,
    view: &V,
    keys: &[BlockKey],
    contract: &ContractId,
    load: &LoadTable,
) {
    c.bench_function(name, |b| {
        let mut d = kvroute_select::Decision::new();
        b.iter(|| {
            let req = Request::new(PromptInput::Keys {
                keys,
                contract,
                prompt_tokens: TOKENS as u32,
            });
            rule.decide_into(
                &mut d,
                black_box(&req),
                view,
                load,
                &AlwaysAvailable,
                Duration::ZERO,
            );
            black_box(d.target())
        })
    });
}

/// The shape of a large fleet's inventory: every endpoint holds the
/// prompt's first 32 blocks (a shared system prompt) and 2 000 other blocks;
/// endpoint 0 holds the whole 512-block prompt (the conversation's home) in
/// one stored chain.
fn shared_root_index(n: usize, keys: &[BlockKey]) -> kvroute_ingest::SharedIndex {
    let index = kvroute_ingest::SharedIndex::new(n, kvroute_ingest::IndexConfig::default());
    for slot in 0..n {
        let e = kvroute_core::EndpointId(slot as u32);
        let held = if slot == 0 { keys.len() } else { 32 };
        index
            .store_chain(e, kvroute_core::Medium::Gpu, None, &keys[..held])
            .unwrap();
        let other: Vec<BlockKey> = (0..2000u64)
            .map(|j| BlockKey(j << 20 | slot as u64))
            .collect();
        index.store(e, kvroute_core::Medium::Gpu, &other).unwrap();
    }
    index
}

criterion_group!(
    benches,
    decision_scale,
    decision_from_keys,
    decision_from_keys_shared_index,
    decision_from_tokens,
    decision_many_endpoints,
    decision_two_threads_drain
);
criterion_main!(benches);
