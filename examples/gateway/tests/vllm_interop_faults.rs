//! Engine faults reproduced with engines that run vLLM 0.33.0's own cache code
//! (`tests/python/vllm_standin.py`, see `vllm_interop.rs`): a late bootstrap
//! over warm engines, one engine on another hash seed, contracts that differ
//! by seed, algorithm or block size, P/D with an exact hit, and an engine
//! restart. Each test asserts what an operator sees.

mod gateway_support;

use gateway_support::*;
use serde_json::Value;

fn config(topology: &str, contract: &str, endpoints: &str) -> String {
    format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ntopology = \"{topology}\"\nscorer = \"load_aware\"\ncontract = \"{contract}\"\n\n{endpoints}",
        config_head("[health]\ninterval_ms = 0\n")
    )
}

const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";

/// Whether any string anywhere in `v` equals `s`.
fn has_str(v: &Value, s: &str) -> bool {
    match v {
        Value::String(x) => x == s,
        Value::Array(a) => a.iter().any(|x| has_str(x, s)),
        Value::Object(o) => o.values().any(|x| has_str(x, s)),
        _ => false,
    }
}

fn log_file() -> (tempfile::NamedTempFile, std::fs::File) {
    let f = tempfile::NamedTempFile::new().unwrap();
    let w = f.reopen().unwrap();
    (f, w)
}

/// Log lines at WARN (ANSI colour codes stripped).
fn warn_lines(log: &tempfile::NamedTempFile) -> Vec<String> {
    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
    text.lines()
        .map(|l| {
            let mut out = String::new();
            let mut esc = false;
            for c in l.chars() {
                match (esc, c) {
                    (false, '\u{1b}') => esc = true,
                    (true, 'm') => esc = false,
                    (true, _) => {}
                    (false, c) => out.push(c),
                }
            }
            out
        })
        .filter(|l| l.contains("WARN"))
        .collect()
}

fn small_workload(sessions: usize, turns: usize) -> ChatWorkload {
    ChatWorkload {
        sessions,
        turns,
        systems: 2,
        user_words: 14,
        max_tokens: 16,
        concurrency: 3,
    }
}

/// A gateway started over warm engines whose replay buffer no
/// longer reaches back must say its inventory is partial (admin API, a WARN
/// naming the endpoint's URL), not look complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_bootstrap_replay_reads_partial() {
    let opts = StandinOpts {
        buffer_steps: 20,
        ..StandinOpts::default()
    };
    let engines = [Standin::start(opts.clone()), Standin::start(opts)];
    // Warm the engines directly: far more than 20 steps with events each.
    for e in &engines {
        let r = small_workload(6, 5)
            .run(&format!("http://{}", e.http))
            .await;
        assert_eq!(r.requests, 30);
        let batches = e.stats().await["batches"].as_u64().unwrap();
        assert!(batches > 30, "{batches} batches");
    }
    let eps_toml: String = engines.iter().map(|e| e.endpoint_toml("both")).collect();
    let (log, w) = log_file();
    let gw = Gateway::start_logged(&config("converged", CONTRACT, &eps_toml), "info", w);
    wait_subscribed(&gw).await;
    // Let the bootstrap replay finish.
    eventually("replay requested and answered", || async {
        let eps = endpoints(&gw).await;
        eps.iter()
            .all(|e| e["subscribers"][0]["last_seq"].as_u64().is_some())
            .then_some(())
    })
    .await;
    let inv = inventory(&gw).await;
    for (i, e) in engines.iter().enumerate() {
        let held = e.cached_keys().await.len() as u64;
        // The replay buffer held only the last 20 batches: the gateway cannot know all.
        assert!(inv[i] < held, "endpoint {i}: {} of {held}", inv[i]);
    }
    let eps = endpoints(&gw).await;
    for (i, e) in eps.iter().enumerate() {
        assert!(has_str(e, "partial"), "endpoint {i} must read partial: {e}");
    }
    let warns = warn_lines(&log);
    for e in &engines {
        let url = format!("http://{}", e.http);
        assert!(
            warns.iter().any(|l| l.contains(&url)),
            "no WARN names {url}: {warns:?}"
        );
    }
}

/// One engine of four on another PYTHONHASHSEED: only that
/// endpoint is `mismatch` (the others `verified`), and one WARN names its URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_on_another_seed_is_the_only_mismatch() {
    let good = StandinOpts::default();
    let bad = StandinOpts {
        seed: Some("1"),
        ..StandinOpts::default()
    };
    let engines = [
        Standin::start(good.clone()),
        Standin::start(good.clone()),
        Standin::start(good),
        Standin::start(bad),
    ];
    let eps_toml: String = engines.iter().map(|e| e.endpoint_toml("both")).collect();
    let (log, w) = log_file();
    let gw = Gateway::start_logged(&config("converged", CONTRACT, &eps_toml), "info", w);
    wait_subscribed(&gw).await;
    // Cold engines each get sessions: warm the bad one directly so it has stored events.
    let r = small_workload(4, 3)
        .run(&format!("http://{}", engines[3].http))
        .await;
    assert_eq!(r.requests, 12);
    let r = small_workload(12, 4).run(&gw.url("")).await;
    assert_eq!(r.requests, 48);
    let eps = eventually("the bad endpoint attested", || async {
        let eps = endpoints(&gw).await;
        (eps[3]["contract_status"] != "unverified").then_some(eps)
    })
    .await;
    for e in &eps[..3] {
        assert_eq!(e["contract_status"], "verified", "{e}");
    }
    assert_eq!(eps[3]["contract_status"], "mismatch", "{}", eps[3]);
    let bad_url = format!("http://{}", engines[3].http);
    let warns = warn_lines(&log);
    let naming: Vec<&String> = warns.iter().filter(|l| l.contains(&bad_url)).collect();
    assert_eq!(naming.len(), 1, "one WARN names {bad_url}: {warns:?}");
    for e in &engines[..3] {
        let url = format!("http://{}", e.http);
        assert!(
            !warns
                .iter()
                .any(|l| l.contains(&url) && l.contains("mismatch")),
            "a good endpoint named as mismatched: {warns:?}"
        );
    }
}

/// The three ways an engine's contract differs from the rule's:
/// (what, engine options, the word the mismatch cause must name).
fn wrong_contracts() -> [(&'static str, StandinOpts, &'static str); 3] {
    [
        (
            "PYTHONHASHSEED=1",
            StandinOpts {
                seed: Some("1"),
                ..StandinOpts::default()
            },
            "seed",
        ),
        (
            "--prefix-caching-hash-algo sha256",
            StandinOpts {
                hash: "sha256",
                ..StandinOpts::default()
            },
            "algorithm",
        ),
        (
            "--block-size 32",
            StandinOpts {
                block_size: 32,
                ..StandinOpts::default()
            },
            "block size",
        ),
    ]
}

/// Two engines with `opts` behind a `CONTRACT` rule, 12 chat requests through it.
async fn mismatched_fleet(opts: &StandinOpts) -> ([Standin; 2], Gateway) {
    let engines = [Standin::start(opts.clone()), Standin::start(opts.clone())];
    let eps_toml: String = engines.iter().map(|e| e.endpoint_toml("both")).collect();
    let gw = Gateway::start(&config("converged", CONTRACT, &eps_toml));
    wait_subscribed(&gw).await;
    let r = small_workload(4, 3).run(&gw.url("")).await;
    assert_eq!(r.requests, 12);
    (engines, gw)
}

/// The status side: a seed, algorithm or block size that differs
/// from the contract reads `mismatch` on every endpoint with the likely cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_contract_reads_mismatch_with_its_cause() {
    for (what, opts, word) in wrong_contracts() {
        let (_engines, gw) = mismatched_fleet(&opts).await;
        let eps = eventually("mismatch detected", || async {
            let eps = endpoints(&gw).await;
            eps.iter()
                .all(|e| e["contract_status"] == "mismatch")
                .then_some(eps)
        })
        .await;
        for e in &eps {
            let cause = e["contract_mismatch_cause"].as_str().unwrap_or_default();
            assert!(
                cause.contains(word),
                "{what}: cause {cause:?} should name {word:?}: {e}"
            );
        }
    }
}

/// The counting side: under a wrong seed, algorithm or block
/// size the misses are counted as `contract_mismatch`, not `zero_overlap`, and
/// no hit is claimed. (Observed on the tree of 2026-12-01 10:10 UTC with a
/// wrong seed: every endpoint reads `mismatch`, yet the rule counts kv_exact
/// decisions, hits and predicted_blocks while each endpoint's
/// predicted_cached_tokens stays 0: the hits come from the speculative
/// overlap, the gateway's memory of keys it routed itself (`KvScoring::
/// speculative` in kvroute-select), which engine events never confirm under
/// a mismatched contract; receipts use the confirmed prefix only.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_contract_misses_are_contract_mismatch() {
    for (what, opts, _) in wrong_contracts() {
        let (_engines, gw) = mismatched_fleet(&opts).await;
        eventually("mismatch detected", || async {
            let eps = endpoints(&gw).await;
            eps.iter()
                .all(|e| e["contract_status"] == "mismatch")
                .then_some(())
        })
        .await;
        let before = counters(&gw, "kv").await;
        // The engines hit (their own keys); the gateway cannot predict anything.
        let r = small_workload(6, 4).run(&gw.url("")).await;
        assert!(r.cached_tokens > 0, "{what}: {r:?}");
        let after = counters(&gw, "kv").await;
        let delta =
            |k: &str| after["misses"][k].as_u64().unwrap() - before["misses"][k].as_u64().unwrap();
        assert_eq!(delta("zero_overlap"), 0, "{what}: {before} -> {after}");
        assert!(
            delta("contract_mismatch") >= 24,
            "{what}: {before} -> {after}"
        );
        // No key can match: the counters must not claim hits the receipts do not.
        let hits = |c: &Value| -> u64 {
            c["hits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .sum()
        };
        assert_eq!(hits(&after), hits(&before), "{what}: {before} -> {after}");
        assert_eq!(
            after["predicted_blocks"], before["predicted_blocks"],
            "{what}: {after}"
        );
        for e in endpoints(&gw).await {
            assert_eq!(e["predicted_cached_tokens"], 0, "{what}: {e}");
        }
    }
}

/// In P/D, KV-exact decides the prefill endpoint when it holds
/// the prefix; counters, receipts and the admin API agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_uses_the_exact_kv_signal() {
    let prefill = StandinOpts {
        role: "prefill",
        ..StandinOpts::default()
    };
    let decode = StandinOpts {
        role: "decode",
        ..StandinOpts::default()
    };
    let engines = [
        Standin::start(prefill.clone()),
        Standin::start(prefill),
        Standin::start(decode),
    ];
    let eps_toml = format!(
        "{}{}[[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"decode\"\n\n",
        engines[0].endpoint_toml("prefill"),
        engines[1].endpoint_toml("prefill"),
        engines[2].http
    );
    let gw = Gateway::start(&config("prefill_decode", CONTRACT, &eps_toml));
    wait_subscribed(&gw).await;
    let r = small_workload(10, 5).run(&gw.url("")).await;
    assert_eq!(r.requests, 50);
    let c = counters(&gw, "kv").await;
    let decisions = c["decisions"].as_u64().unwrap();
    let kv = c["tiers"]["kv_exact"].as_u64().unwrap();
    // Every turn after a session's first has its prefix on one prefill endpoint.
    assert!(kv * 2 >= decisions, "kv_exact {kv} of {decisions}: {c}");
    let hits: u64 = c["hits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .sum();
    // A kv_exact-tier decision diverted for load is not a hit.
    assert!(hits + c["load_diversions"].as_u64().unwrap() >= kv, "{c}");
    assert!(c["predicted_blocks"].as_u64().unwrap() > 0, "{c}");
    let eps = endpoints(&gw).await;
    let predicted: u64 = eps
        .iter()
        .map(|e| e["predicted_cached_tokens"].as_u64().unwrap())
        .sum();
    let delivered: u64 = eps[..2]
        .iter()
        .map(|e| e["delivered_cached_tokens"].as_u64().unwrap())
        .sum();
    assert!(delivered > 0, "{eps:?}");
    assert!(
        predicted.abs_diff(delivered) * 50 <= delivered,
        "predicted {predicted} vs delivered {delivered}"
    );
    // The counters' prediction is the receipts' prediction. Not to the token:
    // with concurrent sessions the two can differ by ~1.5 % (a decision and
    // its receipt straddle a block's eviction), exact when run alone.
    let counted = c["predicted_blocks"].as_u64().unwrap() * 16;
    assert!(
        counted.abs_diff(predicted) * 33 <= predicted,
        "counters {counted} vs receipts {predicted} predicted tokens: {c} vs {eps:?}"
    );
}

/// An engine restarts
/// while the gateway is subscribed and stores blocks before the subscriber has
/// re-dialled. The resume replay (from the old last sequence + 1) ends before
/// it, so the gateway judges a restart and clears, but never replays the new
/// process from 0: those blocks stay unknown although the engine holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_learns_what_the_new_process_stored_before_the_redial() {
    let mut engine = Standin::start(StandinOpts::default());
    let gw = Gateway::start(&config(
        "converged",
        CONTRACT,
        &engine.endpoint_toml("both"),
    ));
    wait_subscribed(&gw).await;
    // A last sequence well past what the new process will publish.
    let r = small_workload(3, 4).run(&gw.url("")).await;
    assert_eq!(r.requests, 12);
    engine.kill();
    // Down long enough that the subscriber's re-dial backoff has grown.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    engine.restart();
    let body =
        serde_json::json!({"model": MODEL, "prompt": prompt("new-process", 120), "max_tokens": 2});
    let resp = client()
        .post(engine.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let held = engine.cached_keys().await.len() as u64;
    assert!(held > 10);
    wait_inventories_match(&gw, &[&engine]).await;
}
