//! Interop with SGLang's own cache code: `kvroute serve` in front of engine
//! stand-ins (`tests/python/sglang_standin.py`) whose radix cache
//! (`RadixCache`: prefix match, node splits, LRU eviction of leaves), page
//! hashing (its `hash_binding.cpp` SHA-256 chain, salt seed and namespacing),
//! `KVCacheEventRecorder` (default and `dynamo` formats) and
//! `ZmqEventPublisher` (PUB + replay ROUTER) are SGLang 0.5.23's, loaded from
//! the wheel `scripts/python-env.sh` installs; torch is replaced by a
//! list-backed holder of KV slot indices (`tests/python/sglang_loader.py`).
//! The scheduler loop around the tree and the OpenAI server are the stand-in's
//! own. Nothing on the engine side is kvroute's code: a key that differs, an
//! event the gateway misapplies or a cached-token prediction that is off
//! shows up here.

mod gateway_support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::{json, Value};

const SGLANG: &str = "sglang@0.5.23:sha256_page_chain:block=16";
const SGLANG_DYNAMO: &str = "sglang@0.5.23:sha256_page_chain:block=16:format=dynamo";

/// The venv interpreter with SGLang's wheel; fails (never skips) when missing.
fn sglang_python() -> std::path::PathBuf {
    let py = repo().join(".venv/bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args([
                "-c",
                "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('sglang', 'zmq', 'msgspec', 'pydantic', 'pybind11', 'tokenizers', 'jinja2')))",
            ])
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} with sglang==0.5.23 and its light dependencies is missing: run scripts/python-env.sh",
        py.display()
    );
    py
}

/// How one SGLang stand-in runs.
#[derive(Clone, Debug)]
struct SglOpts {
    /// `--kv-events-config` `format`: `default` or `dynamo`.
    format: &'static str,
    /// KV pool size in tokens.
    max_total_tokens: u32,
    page_size: u32,
    /// `--lora-paths` entries, `name=path`.
    lora: Vec<&'static str>,
    topic: &'static str,
}

impl Default for SglOpts {
    fn default() -> Self {
        Self {
            format: "default",
            max_total_tokens: 2560,
            page_size: 16,
            lora: Vec::new(),
            topic: "",
        }
    }
}

/// A running stand-in, killed on drop.
struct Sgl {
    child: Child,
    http: SocketAddr,
    zmq: u16,
    replay: u16,
    opts: SglOpts,
}

impl Drop for Sgl {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Sgl {
    fn start(opts: SglOpts) -> Self {
        Self::start_on(opts, (0, 0, 0))
    }

    /// `ports` = (http, zmq, replay), 0 = chosen by the stand-in.
    ///
    /// One stand-in starts at a time across the tests running in parallel:
    /// each imports SGLang's modules (compiling them on a fresh venv), and
    /// ten doing so at once on two cores can each take past the start
    /// wait, while one alone takes seconds.
    fn start_on(opts: SglOpts, ports: (u16, u16, u16)) -> Self {
        static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one_at_a_time = STARTING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut cmd = Command::new(sglang_python());
        cmd.arg(repo().join("tests/python/sglang_standin.py"))
            .args(["--port", &ports.0.to_string()])
            .args(["--zmq-port", &ports.1.to_string()])
            .args(["--replay-port", &ports.2.to_string()])
            .args(["--model", MODEL, "--model-dir"])
            .arg(model_dir())
            .args(["--format", opts.format])
            .args(["--page-size", &opts.page_size.to_string()])
            .args(["--max-total-tokens", &opts.max_total_tokens.to_string()])
            .args(["--topic", opts.topic])
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("KVROUTE_TEST_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        for l in &opts.lora {
            cmd.args(["--lora", l]);
        }
        let mut child = cmd.spawn().expect("spawn sglang_standin.py");
        let (http, zmq, replay) = standin_ports(&mut child, "sglang-standin:");
        Self {
            http,
            zmq,
            replay,
            child,
            opts,
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the process and starts a fresh one on the same ports (an engine restart).
    fn restart(&mut self) {
        self.kill();
        let fresh = Self::start_on(self.opts.clone(), (self.http.port(), self.zmq, self.replay));
        *self = fresh;
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// A `[[rules.endpoints]]` table: the engine's own `--kv-events-config`
    /// endpoints and topic.
    fn endpoint_toml(&self) -> String {
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nengine = \"sglang\"\nzmq = \"tcp://*:{}\"\nreplay = \"tcp://127.0.0.1:{}\"\ntopic = \"{}\"\n\n",
            self.http, self.zmq, self.replay, self.opts.topic
        )
    }

    /// The page keys (u64) SGLang's radix tree holds, as its recorder publishes them.
    async fn cached_keys(&self) -> Vec<u64> {
        let v = get_json(&self.url("/debug/cached_blocks"), None).await;
        v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_u64().unwrap())
            .collect()
    }

    async fn stats(&self) -> Value {
        get_json(&self.url("/debug/stats"), None).await
    }

    /// `POST /flush_cache` (`RadixCache.reset`: `AllBlocksCleared`).
    async fn flush(&self) {
        let resp = client()
            .post(self.url("/flush_cache"))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "flush_cache: {}", resp.status());
    }
}

fn kv_config(contract: &str, engines: &[&Sgl], lora: &str) -> String {
    let mut s = config_head("[health]\ninterval_ms = 0\n");
    s.push_str(&format!(
        "[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"{}]\ndefault = true\nchoice = \"kv_exact\"\ntopology = \"converged\"\nscorer = \"load_aware\"\ncontract = \"{contract}\"\n\n",
        if lora.is_empty() { String::new() } else { format!(", \"{MODEL}:sql\"") }
    ));
    s.push_str(lora);
    for e in engines {
        s.push_str(&e.endpoint_toml());
    }
    s
}

fn rr_config(engines: &[&Sgl]) -> String {
    let mut s = config_head("[health]\ninterval_ms = 0\n");
    s.push_str(&format!(
        "[[rules]]\nname = \"rr\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"round_robin\"\ntopology = \"converged\"\n\n"
    ));
    for e in engines {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nengine = \"sglang\"\n\n",
            e.http
        ));
    }
    s
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

fn assert_verified(eps: &[Value]) {
    for e in eps {
        assert_eq!(e["contract_status"], "verified", "{e}");
    }
}

/// `kvroute tokenize --json` of `body` under `contract` with the staged
/// model and `extra` arguments; panics unless it succeeds.
fn kvroute_tokenize(contract: &str, body: &Value, extra: &[&str]) -> Value {
    let mut f = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
    std::io::Write::write_all(&mut f, body.to_string().as_bytes()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["tokenize", "--json", "--contract", contract, "--model-dir"])
        .arg(model_dir())
        .arg("--request")
        .arg(f.path())
        .args(extra)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert!(
        out.status.success(),
        "{body}: {} {v}",
        String::from_utf8_lossy(&out.stderr)
    );
    v
}

/// `kvroute tokenize --json` block keys of one request under `contract`.
fn kvroute_keys(contract: &str, body: &Value) -> Vec<u64> {
    let v = kvroute_tokenize(contract, body, &[]);
    v["engine_prompts"][0]["block_keys_u64"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_u64().unwrap())
        .collect()
}

/// `kvroute tokenize --engine` against SGLang's own `/tokenize` (the
/// stand-in runs the wheel's `TokenizeRequest` and `_tokenize_chat_request`)
/// agrees on bodies carrying fields SGLang's chat and completions requests
/// do not have but its `/tokenize` honours (`add_generation_prompt`,
/// `add_special_tokens`), and on a continued assistant message.
fn assert_tokenize_agrees(engine: &Sgl) {
    let user = json!({"role": "user", "content": "Which pages do we share?"});
    let bodies = [
        json!({"model": MODEL, "messages": [user.clone()]}),
        json!({"model": MODEL, "messages": [user.clone()], "add_generation_prompt": false}),
        json!({"model": MODEL, "messages": [user.clone()], "add_special_tokens": true}),
        json!({"model": MODEL, "continue_final_message": true, "add_generation_prompt": false,
            "messages": [user.clone(), {"role": "assistant", "content": "Once upon"}]}),
        json!({"model": MODEL, "messages": [user, {"role": "assistant", "content": "left last"}]}),
        json!({"model": MODEL, "prompt": "Hello there", "add_special_tokens": false}),
    ];
    let url = engine.url("");
    for body in &bodies {
        let v = kvroute_tokenize(SGLANG, body, &["--engine", &url]);
        assert_eq!(v["engine"]["identical"], json!(true), "{body}: {v}");
    }
}

/// Sends a chat request to `engine` itself, bypassing the gateway; it must
/// succeed.
async fn chat_directly(engine: &Sgl, body: &Value) {
    let resp = client()
        .post(engine.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
}

/// Key parity on a cold engine: the page keys SGLang's tree holds after one
/// chat request (`max_tokens` 1, so only prompt pages are owned) equal the
/// keys `kvroute tokenize` computes for the same body; the engine is flushed
/// afterwards. `extra` adds fields (`cache_salt`, ...) to the body.
async fn assert_key_parity(engine: &Sgl, contract: &str, extra: Value) {
    let messages = vec![
        json!({"role": "system", "content": prompt("parity-system", 90)}),
        json!({"role": "user", "content": "Which pages do we share? Tell me. ünïcødé ✓"}),
    ];
    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 1});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    assert_body_parity(engine, contract, &body, &extra.to_string()).await;
}

/// Key parity for chat shapes SGLang renders its own way (text parts joined
/// with a space, tools with `defer_loading`, a last assistant message asked
/// again as a user message, a continued assistant message encoded on its
/// own): the engine's pages equal kvroute's keys for each.
async fn assert_sglang_chat_shapes_parity(engine: &Sgl, contract: &str) {
    let system = json!({"role": "system", "content": [
        {"type": "text", "text": prompt("shapes-system", 60)},
        {"type": "text", "text": prompt("shapes-more", 30)},
    ]});
    let tool = json!({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}});
    let bodies = [
        json!({"model": MODEL, "max_tokens": 1, "tools": [tool], "messages": [
            system.clone(),
            {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
            {"role": "assistant", "content": "an answer left last"},
        ]}),
        json!({"model": MODEL, "max_tokens": 1, "continue_final_message": true, "messages": [
            system,
            {"role": "user", "content": "Continue this:"},
            {"role": "assistant", "content": "\nOnce upon"},
        ]}),
    ];
    for body in &bodies {
        assert_body_parity(engine, contract, body, "SGLang chat shapes").await;
    }
}

/// The pages SGLang's tree holds after `body` (`max_tokens` 1) equal the
/// keys `kvroute tokenize` computes for it; the engine is flushed afterwards.
async fn assert_body_parity(engine: &Sgl, contract: &str, body: &Value, what: &str) {
    chat_directly(engine, body).await;
    let mut engine_keys = engine.cached_keys().await;
    let mut ours = kvroute_keys(contract, body);
    assert!(ours.len() >= 8, "{ours:?}");
    engine_keys.sort_unstable();
    ours.sort_unstable();
    assert_eq!(
        engine_keys, ours,
        "SGLang's page keys vs kvroute's under {contract} for {what}"
    );
    engine.flush().await;
}

/// Waits until every endpoint's inventory holds exactly as many keys as its
/// engine's radix tree (events settled); returns (inventory, engine) counts.
async fn wait_inventories_match(gw: &Gateway, engines: &[&Sgl]) -> Vec<(u64, u64)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let inv = inventory(gw).await;
        let mut pairs = Vec::new();
        for (i, e) in engines.iter().enumerate() {
            pairs.push((inv[i], e.cached_keys().await.len() as u64));
        }
        if pairs.iter().all(|(a, b)| a == b) {
            return pairs;
        }
        assert!(
            Instant::now() < deadline,
            "inventories never matched the engines' trees (inventory, engine): {pairs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn workload() -> ChatWorkload {
    ChatWorkload {
        sessions: 24,
        turns: 8,
        systems: 3,
        user_words: 16,
        max_tokens: 24,
        concurrency: 4,
    }
}

/// Predicted vs delivered cached tokens within 2 % of delivered.
fn assert_prediction(eps: &[Value]) -> (u64, u64) {
    let (predicted, delivered) = predicted_delivered(eps);
    assert!(delivered > 0, "{eps:?}");
    let drift = predicted.abs_diff(delivered) as f64 / delivered as f64;
    assert!(
        drift < 0.02,
        "predicted {predicted} vs delivered {delivered} cached tokens ({:.2} %)",
        drift * 100.0
    );
    (predicted, delivered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_sglang_engines_default_format() {
    let opts = SglOpts::default();
    let mut engines: Vec<Sgl> = (0..4).map(|_| Sgl::start(opts.clone())).collect();
    // Plain, salted, and an empty salt (SGLang: no salt at all).
    for extra in [
        json!({}),
        json!({"cache_salt": "tenant-a"}),
        json!({"cache_salt": ""}),
    ] {
        assert_key_parity(&engines[0], SGLANG, extra).await;
    }
    assert_tokenize_agrees(&engines[0]);
    let refs: Vec<&Sgl> = engines.iter().collect();
    let gw = Gateway::start(&kv_config(SGLANG, &refs, ""));
    wait_subscribed(&gw).await;

    let kv = workload().run(&gw.url("")).await;
    assert_eq!(kv.requests, 192);
    // The trees evicted (the fleet holds far less than the workload's pages),
    // so the inventories followed real BlockRemoved events.
    let mut evicted = 0;
    for e in &engines {
        evicted += e.stats().await["removed_blocks"].as_u64().unwrap();
    }
    assert!(evicted > 0, "the workload must make the engines evict");
    let pairs = wait_inventories_match(&gw, &refs).await;
    assert!(pairs.iter().all(|(a, _)| *a > 0), "{pairs:?}");
    let eps = endpoints(&gw).await;
    assert_verified(&eps);
    let (predicted, delivered) = assert_prediction(&eps);
    let c = counters(&gw, "kv").await;
    assert!(c["tiers"]["kv_exact"].as_u64().unwrap() > 100, "{c}");
    eprintln!(
        "sglang interop: kv_exact cached {:.2} % of {} prompt tokens; predicted {predicted}, delivered {delivered}; evicted {evicted} pages; inventories {pairs:?}",
        kv.cached_fraction() * 100.0,
        kv.prompt_tokens
    );

    // Streamed (SSE): the final usage chunk is the engine's receipt, booked
    // as exactly what the gateway predicted.
    let system = json!({"role": "system", "content": ChatWorkload::system_prompt(0)});
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

    // An engine's flush_cache (AllBlocksCleared) empties only its inventory.
    let before = inventory(&gw).await;
    engines[2].flush().await;
    eventually("endpoint 2 cleared", || async {
        (inventory(&gw).await[2] == 0).then_some(())
    })
    .await;
    let after = inventory(&gw).await;
    for i in [0, 1, 3] {
        assert_eq!(after[i], before[i], "only endpoint 2 may change: {after:?}");
    }

    // A restart of one engine (a new process: empty tree, sequence from 0)
    // clears only its inventory, and what the new process stores is learnt.
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
    eventually("the restart seen", || async {
        let eps = endpoints(&gw).await;
        (eps[1]["inventory_clears"].as_u64().unwrap() > clears_before[1]).then_some(())
    })
    .await;
    let refs: Vec<&Sgl> = engines.iter().collect();
    let pairs = wait_inventories_match(&gw, &refs).await;
    assert!(pairs[1].0 > 0, "{pairs:?}");
    let eps = endpoints(&gw).await;
    for i in [0, 2, 3] {
        assert_eq!(
            eps[i]["inventory_clears"].as_u64().unwrap(),
            clears_before[i],
            "restart of engine 1 cleared endpoint {i}: {}",
            eps[i]
        );
    }
    assert_verified(&eps);
    drop(gw);

    // The same workload round robin, from empty trees, and on one engine
    // whose pool never evicts (the ideal: every reusable prefix is hit).
    for e in &engines {
        e.flush().await;
    }
    let rr_gw = Gateway::start(&rr_config(&refs));
    let rr = workload().run(&rr_gw.url("")).await;
    drop(rr_gw);
    let big = Sgl::start(SglOpts {
        max_total_tokens: 1 << 20,
        ..SglOpts::default()
    });
    let ideal = workload().run(&format!("http://{}", big.http)).await;
    eprintln!(
        "sglang interop: ideal {:.2} %, kv_exact {:.2} %, round_robin {:.2} %",
        ideal.cached_fraction() * 100.0,
        kv.cached_fraction() * 100.0,
        rr.cached_fraction() * 100.0
    );
    assert_eq!(rr.prompt_tokens, kv.prompt_tokens, "same workload");
    assert_eq!(ideal.prompt_tokens, kv.prompt_tokens, "same workload");
    assert!(
        kv.cached_tokens > rr.cached_tokens,
        "kv_exact {kv:?} vs round robin {rr:?}"
    );
    assert!(
        kv.cached_fraction() >= 0.9 * ideal.cached_fraction(),
        "kv_exact {:.4} is not near the ideal {:.4}",
        kv.cached_fraction(),
        ideal.cached_fraction()
    );
}

/// One class of sessions in [`run_sessions`]: fields every body carries.
struct SessionClass {
    name: &'static str,
    /// Merged into every request body (`cache_salt`, `model`, ...).
    extra: Value,
    sessions: usize,
}

/// What the engines reported and the gateway predicted for one class.
#[derive(Debug, Default, Clone)]
struct ClassResult {
    requests: u64,
    prompt_tokens: u64,
    /// The engines' receipts (`usage.prompt_tokens_details.cached_tokens`).
    cached_tokens: u64,
    /// `x-kvroute-predicted-cached-tokens`, summed.
    predicted: u64,
    /// `x-kvroute-miss-reason` values seen.
    misses: Vec<String>,
}

/// Multi-turn chat sessions of every class through `base`, `concurrency`
/// sessions at a time (turns of one session are sequential); results by class.
async fn run_sessions(
    base: &str,
    classes: &[SessionClass],
    turns: usize,
    concurrency: usize,
) -> Vec<ClassResult> {
    let mut jobs = Vec::new();
    for (c, class) in classes.iter().enumerate() {
        for s in 0..class.sessions {
            jobs.push((c, s, class.name, class.extra.clone()));
        }
    }
    // Interleave the classes so they share the engines at the same time.
    jobs.sort_by_key(|(c, s, ..)| (*s, *c));
    let jobs = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::from(
        jobs,
    )));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let jobs = jobs.clone();
        let base = base.to_owned();
        let n = classes.len();
        tasks.push(tokio::spawn(async move {
            let client = client();
            let mut out = vec![ClassResult::default(); n];
            loop {
                let Some((c, s, name, extra)) = jobs.lock().unwrap().pop_front() else {
                    return out;
                };
                let mut messages = vec![json!({
                    "role": "system", "content": ChatWorkload::system_prompt(s % 2)
                })];
                for t in 0..turns {
                    messages.push(json!({
                        "role": "user",
                        "content": format!("{name} session {s} turn {t}: {}", prompt(&format!("{name}{s}t{t}"), 12))
                    }));
                    let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 16});
                    for (k, v) in extra.as_object().unwrap() {
                        body[k] = v.clone();
                    }
                    let resp = client
                        .post(format!("{base}/v1/chat/completions"))
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    let header = |h: &str| {
                        resp.headers()
                            .get(h)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                    };
                    let predicted = header("x-kvroute-predicted-cached-tokens")
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                    let miss = header("x-kvroute-miss-reason");
                    let status = resp.status().as_u16();
                    let v: Value = resp.json().await.unwrap_or(Value::Null);
                    assert_eq!(status, 200, "{name} session {s} turn {t}: {v}");
                    let r = &mut out[c];
                    r.requests += 1;
                    r.prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
                    r.cached_tokens += cached_tokens(&v);
                    r.predicted += predicted;
                    if let Some(m) = miss {
                        r.misses.push(m);
                    }
                    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
                    messages.push(json!({"role": "assistant", "content": reply}));
                }
            }
        }));
    }
    let mut total = vec![ClassResult::default(); classes.len()];
    for t in tasks {
        for (i, r) in t.await.unwrap().into_iter().enumerate() {
            let acc = &mut total[i];
            acc.requests += r.requests;
            acc.prompt_tokens += r.prompt_tokens;
            acc.cached_tokens += r.cached_tokens;
            acc.predicted += r.predicted;
            acc.misses.extend(r.misses);
        }
    }
    total
}

/// Plain, salted, empty-salt and LoRA sessions side by side, in one format.
async fn salted_and_lora(format: &'static str, contract: &str) {
    let opts = SglOpts {
        format,
        lora: vec!["sql=/adapters/sql"],
        topic: "kv@sglang",
        ..SglOpts::default()
    };
    let engines: Vec<Sgl> = (0..3).map(|_| Sgl::start(opts.clone())).collect();
    for extra in [
        json!({}),
        json!({"cache_salt": "tenant-a"}),
        json!({"cache_salt": ""}),
    ] {
        assert_key_parity(&engines[0], contract, extra).await;
    }
    assert_sglang_chat_shapes_parity(&engines[0], contract).await;
    let refs: Vec<&Sgl> = engines.iter().collect();
    let gw = Gateway::start(&kv_config(contract, &refs, ""));
    wait_subscribed(&gw).await;
    // Salted and LoRA pages carry per-block extras the gateway cannot
    // recompute (unverifiable), and the sessions' placement decides which
    // engine gets plain ones: one plain prompt sent to each engine directly
    // gives every endpoint pages to verify its contract on, wherever the
    // sessions go.
    for (i, e) in engines.iter().enumerate() {
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "system", "content": prompt(&format!("attest-{i}"), 60)},
                         {"role": "user", "content": "Hello."}],
            "max_tokens": 1,
        });
        chat_directly(e, &body).await;
    }
    let classes = [
        SessionClass {
            name: "plain",
            extra: json!({}),
            sessions: 6,
        },
        SessionClass {
            name: "tenant-a",
            extra: json!({"cache_salt": "tenant-a"}),
            sessions: 6,
        },
        SessionClass {
            name: "tenant-b",
            extra: json!({"cache_salt": "tenant-b"}),
            sessions: 6,
        },
        SessionClass {
            name: "empty-salt",
            extra: json!({"cache_salt": ""}),
            sessions: 6,
        },
        SessionClass {
            name: "lora",
            extra: json!({"model": format!("{MODEL}:sql")}),
            sessions: 6,
        },
    ];
    let results = run_sessions(&gw.url(""), &classes, 6, 4).await;
    for (class, r) in classes.iter().zip(&results) {
        eprintln!(
            "sglang interop ({format}) {}: {} requests, cached {} of {} prompt tokens, predicted {}, misses {:?}",
            class.name, r.requests, r.cached_tokens, r.prompt_tokens, r.predicted,
            r.misses.iter().collect::<std::collections::BTreeSet<_>>()
        );
    }
    let pairs = wait_inventories_match(&gw, &refs).await;
    let eps = endpoints(&gw).await;
    assert_verified(&eps);
    eprintln!("sglang interop ({format}): inventories {pairs:?}");
    // LoRA: SGLang keys an adapter's pages in the adapter's namespace (its
    // radix `extra_key` is the adapter's `lora_id`, and both formats publish
    // namespaced hashes for it). kvroute has no SGLang LoRA contract input,
    // so the adapter's model name is not routed KV-exact: no prediction, one
    // miss per request; the engines still cache those sessions, and their
    // namespaced events entered the inventories counted equal above.
    let mut lora_requests = 0;
    for e in &engines {
        lora_requests += e.stats().await["lora_requests"].as_u64().unwrap();
    }
    let lora = &results[4];
    assert_eq!(lora_requests, lora.requests, "{lora:?}");
    assert_eq!(lora.predicted, 0, "{lora:?}");
    assert_eq!(lora.misses.len() as u64, lora.requests, "{lora:?}");
    assert!(lora.cached_tokens > 0, "{lora:?}");
    // Every routable class: the engines' receipts are what the gateway predicted.
    for (class, r) in classes.iter().zip(&results).take(4) {
        assert!(r.cached_tokens > 0, "{}: {r:?}", class.name);
        let drift = r.predicted.abs_diff(r.cached_tokens) as f64 / r.cached_tokens as f64;
        assert!(
            drift < 0.02,
            "{} predicted {} vs delivered {}",
            class.name,
            r.predicted,
            r.cached_tokens
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_and_lora_sessions_default_format() {
    salted_and_lora("default", SGLANG).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn salted_and_lora_sessions_dynamo_format() {
    salted_and_lora("dynamo", SGLANG_DYNAMO).await;
}
