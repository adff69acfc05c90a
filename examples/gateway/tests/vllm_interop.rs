//! Interop with vLLM's own cache code: `kvroute serve` in front of engine
//! stand-ins (`tests/python/vllm_standin.py`) whose block hashing, `BlockPool`
//! (LRU eviction) and `ZmqEventPublisher` (PUB + replay ROUTER) are vLLM
//! 0.33.0's, loaded from the wheel `scripts/python-env.sh` installs. Nothing on
//! the engine side is kvroute's code: a key that differs, an event the gateway
//! misapplies or a cached-token prediction that is off shows up here.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn rule(name: &str, choice: &str, contract: Option<&str>) -> String {
    let contract = contract
        .map(|c| format!("contract = \"{c}\"\n"))
        .unwrap_or_default();
    format!(
        "[[rules]]\nname = \"{name}\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"{choice}\"\ntopology = \"converged\"\nscorer = \"load_aware\"\n{contract}\n"
    )
}

fn kv_config(contract: &str, engines: &[&Standin]) -> String {
    let mut s = config_head("[health]\ninterval_ms = 0\n");
    s.push_str(&rule("kv", "kv_exact", Some(contract)));
    for e in engines {
        s.push_str(&e.endpoint_toml("both"));
    }
    s
}

fn rr_config(engines: &[&Standin]) -> String {
    let mut s = config_head("[health]\ninterval_ms = 0\n");
    s.push_str(&rule("rr", "round_robin", None));
    for e in engines {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\n\n",
            e.http
        ));
    }
    s
}

async fn reset(e: &Standin) {
    let resp = client()
        .post(e.url("/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert!(
        resp.status().is_success(),
        "reset_prefix_cache: {}",
        resp.status()
    );
}

/// Sum over endpoints of (predicted, delivered) cached tokens.
fn predicted_delivered(eps: &[Value]) -> (u64, u64) {
    eps.iter().fold((0, 0), |(p, d), e| {
        (
            p + e["predicted_cached_tokens"].as_u64().unwrap(),
            d + e["delivered_cached_tokens"].as_u64().unwrap(),
        )
    })
}

/// `kvroute tokenize --json` block keys of one request under `contract`.
fn kvroute_keys(contract: &str, body: &Value) -> Vec<u64> {
    let mut f = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    std::io::Write::write_all(&mut f, body.to_string().as_bytes()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--json", "--contract", contract, "--model-dir"])
        .arg(model_dir())
        .arg("--request")
        .arg(f.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["engine_prompts"][0]["block_keys_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_u64().unwrap())
        .collect()
}

/// Key parity on a cold engine: the keys vLLM's hasher gave the blocks of a
/// chat prompt (the pool's cached keys, `max_tokens` 1 so no output block is
/// cached) equal the keys kvroute computes for the same body; the engine is
/// reset afterwards.
async fn assert_key_parity(engine: &Standin, contract: &str) {
    let mut messages = vec![json!({"role": "system", "content": prompt("parity-system", 90)})];
    messages
        .push(json!({"role": "user", "content": "Which blocks do we share? Tell me. ünïcødé ✓"}));
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 1});
    let resp = client()
        .post(engine.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let mut engine_keys = engine.cached_keys().await;
    let mut ours = kvroute_keys(contract, &body);
    assert!(ours.len() >= 8, "{ours:?}");
    engine_keys.sort_unstable();
    ours.sort_unstable();
    assert_eq!(
        engine_keys, ours,
        "vLLM's block keys vs kvroute's under {contract}"
    );
    reset(engine).await;
}

fn assert_verified(eps: &[Value]) {
    for e in eps {
        assert_eq!(e["contract_status"], "verified", "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_vllm_engines_sha256_cbor_seed_0() {
    standin_selfcheck();
    let opts = StandinOpts {
        num_blocks: 160,
        ..StandinOpts::default()
    };
    let mut engines: Vec<Standin> = (0..4).map(|_| Standin::start(opts.clone())).collect();
    let refs: Vec<&Standin> = engines.iter().collect();
    let contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
    assert_key_parity(&engines[0], contract).await;
    let gw = Gateway::start(&kv_config(contract, &refs));
    wait_subscribed(&gw).await;

    let workload = ChatWorkload {
        sessions: 24,
        turns: 10,
        systems: 3,
        user_words: 16,
        max_tokens: 24,
        concurrency: 4,
    };
    let kv = workload.run(&gw.url("")).await;
    assert_eq!(kv.requests, 240);

    // The engines evicted (the fleet holds far less than the workload's
    // blocks), so the inventories followed real BlockRemoved events. The
    // admin API exposes counts, not keys: equal counts, plus predicted ≈
    // delivered below (a key the gateway held that the engine did not would
    // be predicted and not delivered), plus the key parity checked before.
    let (eps, evicted, pairs) = assert_evictions_followed(&gw, &refs).await;
    let (predicted, delivered) = predicted_delivered(&eps);
    assert!(delivered > 0, "{eps:?}");
    // The engines' own receipts are the delivered figure; the gateway predicted
    // them from its recomputed keys and the mirrored inventories.
    let drift = predicted.abs_diff(delivered) as f64 / delivered as f64;
    assert!(
        drift < 0.02,
        "predicted {predicted} vs delivered {delivered} cached tokens ({:.2} %)",
        drift * 100.0
    );
    let c = counters(&gw, "kv").await;
    assert!(c["tiers"]["kv_exact"].as_u64().unwrap() > 100, "{c}");
    eprintln!(
        "vllm interop: kv_exact cached {:.2} % of {} prompt tokens; predicted {predicted}, delivered {delivered}; evicted {evicted} blocks; inventories {pairs:?}",
        kv.cached_fraction() * 100.0,
        kv.prompt_tokens
    );

    // Streamed (SSE): the final usage chunk is the engine's receipt, and the
    // gateway books it as exactly what it predicted.
    let system = serde_json::json!({"role": "system", "content": ChatWorkload::system_prompt(0)});
    let body = json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true},
        "max_tokens": 4, "messages": [system, {"role": "user", "content": "A streamed question."}]});
    let text = client()
        .post(gw.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["usage"].is_object())
        .expect("usage chunk");
    let streamed = cached_tokens(&usage);
    assert!(
        streamed >= 16 * 10,
        "the shared system prompt is cached: {usage}"
    );
    let (p2, d2) = eventually("the streamed receipt booked", || async {
        let (p2, d2) = predicted_delivered(&endpoints(&gw).await);
        (d2 > delivered).then_some((p2, d2))
    })
    .await;
    assert_eq!(d2 - delivered, streamed);
    assert_eq!(p2 - predicted, streamed);

    // An engine's reset_prefix_cache (AllBlocksCleared) empties only its inventory.
    let before = inventory(&gw).await;
    reset(&engines[2]).await;
    eventually("endpoint 2 cleared", || async {
        (inventory(&gw).await[2] == 0).then_some(())
    })
    .await;
    let after = inventory(&gw).await;
    for i in [0, 1, 3] {
        assert_eq!(after[i], before[i], "only endpoint 2 may change: {after:?}");
    }

    // A restart of one engine (a new process: empty cache, sequence from 0)
    // clears only its inventory.
    let clears_before: Vec<u64> = endpoints(&gw)
        .await
        .iter()
        .map(|e| e["inventory_clears"].as_u64().unwrap())
        .collect();
    engines[1].restart();
    let fresh = json!({"model": MODEL, "prompt": prompt("after-restart", 120), "max_tokens": 2});
    let resp = client()
        .post(engines[1].url("/v1/completions"))
        .json(&fresh)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let eps = eventually("the restart seen", || async {
        let eps = endpoints(&gw).await;
        (eps[1]["inventory_clears"].as_u64().unwrap() > clears_before[1]).then_some(eps)
    })
    .await;
    let held = engines[1].cached_keys().await.len() as u64;
    assert!(
        eps[1]["inventory_blocks"].as_u64().unwrap() <= held,
        "{}",
        eps[1]
    );
    for i in [0, 2, 3] {
        assert_eq!(
            eps[i]["inventory_clears"].as_u64().unwrap(),
            clears_before[i],
            "{}",
            eps[i]
        );
        assert_eq!(
            eps[i]["inventory_blocks"].as_u64().unwrap(),
            if i == 2 { 0 } else { before[i] },
            "restart of engine 1 changed endpoint {i}"
        );
    }
    // (What the new process stored before the gateway re-dialled may be lost:
    // vllm_interop_faults.rs. An AllBlocksCleared makes both sides agree again.)
    reset(&engines[1]).await;
    let resp = client()
        .post(engines[1].url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt("after-reset", 80), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let refs: Vec<&Standin> = engines.iter().collect();
    let pairs = wait_inventories_match(&gw, &refs).await;
    assert!(pairs[1].0 > 0, "{pairs:?}");
    drop(gw);

    // The same workload round robin, from empty caches: KV-exact must cache more.
    for e in &engines {
        reset(e).await;
    }
    let rr_gw = Gateway::start(&rr_config(&refs));
    let rr = workload.run(&rr_gw.url("")).await;
    eprintln!(
        "vllm interop: round_robin cached {:.2} % vs kv_exact {:.2} %",
        rr.cached_fraction() * 100.0,
        kv.cached_fraction() * 100.0
    );
    assert_eq!(rr.prompt_tokens, kv.prompt_tokens, "same workload");
    assert!(
        kv.cached_tokens > rr.cached_tokens,
        "kv_exact {kv:?} vs round robin {rr:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_vllm_engines_default_sha256_seed_unset() {
    let opts = StandinOpts {
        hash: "sha256",
        seed: None,
        num_blocks: 120,
        ..StandinOpts::default()
    };
    let engines: Vec<Standin> = (0..3).map(|_| Standin::start(opts.clone())).collect();
    for e in &engines {
        let s = e.stats().await;
        // vLLM ≥ 0.29 roots sha256 at a fixed seed when PYTHONHASHSEED is unset.
        assert_eq!(s["none_hash_seed"], "vllm-none-hash", "{s}");
    }
    let refs: Vec<&Standin> = engines.iter().collect();
    assert_key_parity(&engines[0], "vllm@0.33.0:sha256:block=16").await;
    let gw = Gateway::start(&kv_config("vllm@0.33.0:sha256:block=16", &refs));
    wait_subscribed(&gw).await;
    let workload = ChatWorkload {
        sessions: 12,
        turns: 8,
        systems: 2,
        user_words: 14,
        max_tokens: 16,
        concurrency: 3,
    };
    let r = workload.run(&gw.url("")).await;
    assert_eq!(r.requests, 96);
    let pairs = wait_inventories_match(&gw, &refs).await;
    let eps = endpoints(&gw).await;
    assert_verified(&eps);
    let (predicted, delivered) = predicted_delivered(&eps);
    assert!(delivered > 0, "{eps:?}");
    let drift = predicted.abs_diff(delivered) as f64 / delivered as f64;
    assert!(
        drift < 0.02,
        "predicted {predicted} vs delivered {delivered} ({:.2} %)",
        drift * 100.0
    );
    eprintln!(
        "vllm interop (sha256, seed unset): cached {:.2} %, predicted {predicted}, delivered {delivered}, inventories {pairs:?}",
        r.cached_fraction() * 100.0
    );
}

/// Requests that ask vLLM for full cache reports
/// (`vllm_xargs.kv_cache_report_mode = "full"`): every prefix hit is
/// announced again as `BlockStored` events shaped like new stores (vLLM's
/// own `BlockPool.emit_cached_block_events`), which are never matched by a
/// second `BlockRemoved`. Under eviction the inventories still hold exactly
/// the engines' blocks: the reports are not counted as new copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_cache_reports_do_not_keep_evicted_blocks() {
    standin_selfcheck();
    let opts = StandinOpts {
        num_blocks: 48,
        ..StandinOpts::default()
    };
    let engines: Vec<Standin> = (0..2).map(|_| Standin::start(opts.clone())).collect();
    let refs: Vec<&Standin> = engines.iter().collect();
    let gw = Gateway::start(&kv_config("vllm@0.33.0:sha256_cbor:block=16:seed=0", &refs));
    wait_subscribed(&gw).await;
    for i in 0..40 {
        // Three shared prefixes (hits, so reports), each request its own tail.
        let text = format!(
            "{} {}",
            prompt(&format!("report-root-{}", i % 3), 60),
            prompt(&format!("report-tail-{i}"), 20)
        );
        let resp = client()
            .post(gw.url("/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 2,
                "vllm_xargs": {"kv_cache_report_mode": "full"}}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        assert!(
            status.is_success(),
            "{status}: {}",
            resp.text().await.unwrap()
        );
    }
    assert_evictions_followed(&gw, &refs).await;
}

/// The engines evicted blocks, and the gateway's inventories followed their
/// `BlockRemoved` events to the engines' own block counts, every endpoint's
/// contract verified; returns the endpoints' admin rows, the blocks evicted
/// and the (gateway, engine) block counts per endpoint.
async fn assert_evictions_followed(
    gw: &Gateway,
    engines: &[&Standin],
) -> (Vec<Value>, u64, Vec<(u64, u64)>) {
    let mut evicted = 0;
    for e in engines {
        evicted += e.stats().await["removed_blocks"].as_u64().unwrap();
    }
    assert!(evicted > 0, "the requests must make the engines evict");
    let pairs = wait_inventories_match(gw, engines).await;
    assert!(pairs.iter().all(|(a, _)| *a > 0), "{pairs:?}");
    let eps = endpoints(gw).await;
    assert_verified(&eps);
    (eps, evicted, pairs)
}
