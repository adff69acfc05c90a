//! The library's `KvRouter`, built by an embedding proxy, and `kvroute
//! serve` decide alike: with the same configuration, the same engines and
//! the same requests, every decision names the same endpoint (and the same
//! tier, predicted cached tokens and miss reason).
//!
//! One TOML text per replica (they differ in `[replicas] order` only): a KV-exact rule over four `kvroute mock-engine`s (real
//! prefix caches publishing vLLM KV events over ZeroMQ, vLLM's `/metrics`),
//! engine load polled every 50 ms, load shared between replicas over a real
//! `nats-server`. World A runs it as two `kvroute serve` processes. World B
//! parses the same text (the gateway's parser; nothing else of the gateway
//! runs) and builds two `KvRouter`s from it as an embedder does —
//! `KvRouter::builder` with each setting the file states, its own NATS
//! connection per replica — and forwards each pick with its own HTTP client,
//! the response body wrapped in `Pick::into_body`. The worlds run one after the other on the same engines,
//! restarted in between (cache, queue and event sequence emptied).
//!
//! The requests alternate between the two replicas: multi-turn
//! conversations over shared system prompts (KV hits), streamed answers held
//! open across later decisions (each replica's own load, and the other's
//! through NATS and the engines' reports), and requests the test sends
//! straight to one engine (load only that engine's report shows). Before
//! each request every replica's view is settled — inventories equal to the
//! engines' caches, each replica's requests counted where they are, at the
//! other replica and in a fresh engine report, no prefill queued — so each
//! decision depends on that state, not on timing.

mod gateway_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use gateway_support::*;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvroute::nats::{NatsOptions, NatsReplicas};
use kvroute::{
    ApiKind, Backend, BreakerConfig, EngineLoadConfig, KvRouter, KvRouterBuilder, ProbeConfig,
    ReplicaConfig, ReplicaTransport, Thresholds,
};
use kvroute_engines::prompt::TokenizerPool;
use kvroute_gateway::gateway::config::{RuleSpec, ServeConfig};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// The engines decode 10 tokens/s: a held answer of [`HELD_TOKENS`] streams
/// for ten minutes, far beyond either world; a short one (one token) ends
/// with its prefill. Capacity leaves room for every held answer's blocks.
const ENGINE_FLAGS: &[&str] = &[
    "--decode-us-per-token",
    "100000",
    "--capacity-blocks",
    "32768",
];
const HELD_TOKENS: u32 = 6000;
const ENGINES: usize = 4;
const RULE: &str = "kv";

// ---------------------------------------------------------------------------------------
// The request sequence.

fn system_prompt(desk: &str) -> String {
    let mut s = format!("You are the {desk} desk of the kvroute parity fleet.");
    for k in 0..12 {
        s.push_str(&format!(
            " Rule {k} of the {desk} desk: answer briefly and cite source {desk}-{k}."
        ));
    }
    s
}

/// A conversation's messages up to its `turns`-th user message; `branch`
/// makes the last one differ between requests sharing the history.
fn messages(desk: &str, conv: &str, turns: usize, branch: &str) -> Vec<Value> {
    let mut m = vec![json!({"role": "system", "content": system_prompt(desk)})];
    for t in 1..turns {
        m.push(json!({"role": "user", "content": format!(
            "Conversation {conv}, turn {t}: what does item {conv}-{t} say about the schedule and the budget?")}));
        m.push(json!({"role": "assistant", "content": format!(
            "Item {conv}-{t} moves the schedule by {t} weeks and keeps the budget within the plan.")}));
    }
    m.push(json!({"role": "user", "content": format!(
        "Conversation {conv}, turn {turns}{branch}: and what does item {conv}-{turns} say about the risks?")}));
    m
}

fn body(desk: &str, conv: &str, turns: usize, branch: &str, held: bool) -> Value {
    if held {
        json!({"model": MODEL, "messages": messages(desk, conv, turns, branch),
               "max_tokens": HELD_TOKENS, "stream": true})
    } else {
        json!({"model": MODEL, "messages": messages(desk, conv, turns, branch), "max_tokens": 1})
    }
}

enum Step {
    /// A request through replica `replica` (0 or 1); `held`: streamed and
    /// kept open until the world ends. `probe`: also asked of a router that
    /// sees only its own load (world B).
    Ask {
        replica: usize,
        label: String,
        body: Value,
        held: bool,
        probe: bool,
    },
    /// Held requests the test sends straight to the engine after (in the
    /// rule's order) the one decision `beside` chose: load no replica routed.
    Direct { beside: usize, bodies: Vec<Value> },
}

/// Appends a request through replica `replica` for conversation `conv`
/// (system prompt of `desk`) at `turns` user messages.
fn ask(
    s: &mut Vec<Step>,
    replica: usize,
    desk: &str,
    conv: &str,
    turns: usize,
    branch: &str,
    held: bool,
) {
    s.push(Step::Ask {
        replica,
        label: format!("{conv}{turns}{branch}{}", if held { " (held)" } else { "" }),
        body: body(desk, conv, turns, branch, held),
        held,
        probe: false,
    });
}

/// The decision index (not counting [`Step::Direct`]) of replica 1's first
/// held answer of conversation a: the endpoint holding a's history.
const HOT: usize = 8;

fn script() -> Vec<Step> {
    let mut s = Vec::new();
    let (r1, r2) = (0, 1);
    // Conversations a, b, e open with the alpha desk's system prompt; c, d,
    // f with bravo's: the first of a desk misses, the others hit the shared
    // system prompt, later turns hit their history.
    ask(&mut s, r1, "alpha", "a", 1, "", false);
    ask(&mut s, r2, "bravo", "c", 1, "", false);
    ask(&mut s, r1, "alpha", "b", 1, "", false);
    ask(&mut s, r2, "bravo", "d", 1, "", false);
    ask(&mut s, r1, "bravo", "c", 2, "", false);
    ask(&mut s, r2, "alpha", "a", 2, "", false);
    ask(&mut s, r1, "bravo", "d", 2, "", false);
    ask(&mut s, r2, "alpha", "b", 2, "", false);
    // Replica 1 holds seven answers of conversation a where its history is
    // (the first is decision HOT), while replica 2's requests come and go.
    let between = [
        ("bravo", "c", 3),
        ("bravo", "d", 3),
        ("alpha", "b", 3),
        ("alpha", "e", 1),
        ("bravo", "f", 1),
        ("alpha", "e", 2),
    ];
    for h in 0..7 {
        ask(&mut s, r1, "alpha", "a", 3, &format!("-h{h}"), true);
        if let Some((desk, conv, turns)) = between.get(h) {
            ask(&mut s, r2, desk, conv, *turns, "", false);
        }
    }
    // Replica 2 continues conversation a: only replica 1's load there (which
    // it knows through NATS and the engine's report) can move it off a's
    // history.
    s.push(Step::Ask {
        replica: r2,
        label: "a3-probe".into(),
        body: body("alpha", "a", 3, "-probe", false),
        held: false,
        probe: true,
    });
    // Three requests no replica routed, held on the engine after HOT's.
    s.push(Step::Direct {
        beside: HOT,
        bodies: (0..3)
            .map(|k| body("charlie", "g", 1, &format!("-direct{k}"), true))
            .collect(),
    });
    ask(&mut s, r1, "delta", "h", 1, "", false);
    ask(&mut s, r2, "delta", "i", 1, "", false);
    ask(&mut s, r1, "bravo", "c", 4, "", true);
    ask(&mut s, r2, "charlie", "g", 2, "", true);
    ask(&mut s, r1, "alpha", "e", 3, "", false);
    ask(&mut s, r2, "bravo", "d", 4, "", true);
    ask(&mut s, r1, "bravo", "f", 2, "", true);
    ask(&mut s, r2, "alpha", "b", 4, "", false);
    ask(&mut s, r1, "echo", "j", 1, "", false);
    ask(&mut s, r2, "foxtrot", "k", 1, "", false);
    ask(&mut s, r1, "delta", "h", 2, "", false);
    ask(&mut s, r2, "delta", "i", 2, "", true);
    ask(&mut s, r1, "alpha", "a", 4, "", false);
    ask(&mut s, r2, "charlie", "g", 3, "", false);
    s
}

// ---------------------------------------------------------------------------------------
// World B: the routers an embedding proxy builds from the same file.

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// `rule` as an embedder builds it from `config` with the library's
/// builder: every setting the file states, each mapped by hand. `own_view`:
/// without engine load polling and replicas (a router that sees only the
/// load it routes itself).
fn embedded(
    config: &ServeConfig,
    rule: &RuleSpec,
    tokenizers: &Arc<TokenizerPool>,
    own_view: bool,
) -> KvRouterBuilder {
    let contract = rule
        .contract
        .clone()
        .unwrap_or_else(|| panic!("rule {} has no contract", rule.doc.name));
    let limits = &config.limits;
    let mut b = KvRouter::builder(contract)
        .name(rule.doc.name.clone())
        .tokenizers(Arc::clone(tokenizers))
        .choice(rule.choice)
        .topology(rule.topology)
        .scorer(Arc::clone(&rule.scorer))
        .fallback(rule.selector)
        .breaker(BreakerConfig {
            failure_threshold: config.health.failure_threshold,
            cool_down: ms(config.health.cool_down_ms),
        })
        .max_prompt_chars(limits.max_prompt_chars)
        .max_prompt_tokens(limits.max_prompt_tokens)
        .max_concurrent_tokenizations(limits.max_concurrent_tokenizations)
        .max_tokenize_bytes_in_flight(limits.max_tokenize_bytes_in_flight)
        .tokenize_overload(limits.tokenize_overload)
        .tokenize_wait(ms(limits.tokenize_wait_ms))
        .include_usage(limits.include_usage)
        .forward_token_ids(rule.doc.forward_token_ids);
    for m in &config.models {
        b = b.model(m.slug.clone(), m.dir.clone());
    }
    if rule.doc.min_overlap_blocks.is_some()
        || rule.doc.max_retries.is_some()
        || rule.doc.sample_size.is_some()
    {
        let mut t = Thresholds::default();
        if let Some(n) = rule.doc.min_overlap_blocks {
            t.min_overlap_blocks = n;
        }
        if let Some(n) = rule.doc.max_retries {
            t.max_retries = n;
        }
        if let Some(n) = rule.doc.sample_size {
            t.sample_size = n;
        }
        b = b.thresholds(t);
    }
    for e in &rule.endpoints {
        assert_eq!(e.engine.name(), "vllm", "{}", e.url);
        let mut backend = Backend::vllm(e.url.clone());
        if let Some(z) = &e.zmq {
            backend = backend.events(z.clone());
        }
        if let Some(r) = &e.replay {
            backend = backend.replay(r.clone());
        }
        b = b.endpoint(backend);
    }
    let health = &config.health;
    if health.interval_ms > 0 {
        b = b.health_probes(ProbeConfig {
            path: health.path.clone(),
            interval: ms(health.interval_ms),
            timeout: ms(health.timeout_ms),
        });
    } else {
        b = b.no_health_probes();
    }
    // The builder polls engine load and probes health by default (as
    // `kvroute serve` does): a setting the file turns off is turned off here.
    if limits.engine_load_poll_ms > 0 && !own_view {
        b = b.engine_load(EngineLoadConfig {
            interval: ms(limits.engine_load_poll_ms),
            ..EngineLoadConfig::default()
        });
    } else {
        b = b.no_engine_load();
    }
    b
}

/// `[replicas]` as an embedder maps it: its own NATS connection.
async fn embedded_replicas(config: &ServeConfig) -> ReplicaConfig {
    let r = &config.replicas;
    let url = r
        .nats
        .clone()
        .unwrap_or_else(|| panic!("the configuration names no NATS server"));
    let mut options = NatsOptions::new(url);
    options.subject_prefix.clone_from(&r.subject_prefix);
    let transport = NatsReplicas::connect(options)
        .await
        .unwrap_or_else(|e| panic!("NATS: {e}"));
    let mut c = ReplicaConfig::new(transport as Arc<dyn ReplicaTransport>);
    c.sync_interval = ms(r.sync_interval_ms);
    c.heartbeat = ms(r.heartbeat_ms);
    c.ttl = ms(r.remote_ttl_ms);
    c.order = r.order;
    c
}

// ---------------------------------------------------------------------------------------
// Both worlds behind one interface.

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One replica: a `kvroute serve` process, or an embedded router with the
/// embedder's HTTP client.
enum Replica {
    Serve(Gateway),
    Embedded { router: KvRouter, http: HttpClient },
}

/// What a decision said.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Decided {
    endpoint: String,
    tier: String,
    predicted_cached_tokens: u32,
    miss: Option<String>,
}

/// One replica's view of one endpoint.
#[derive(Clone, Debug, Default)]
struct Seen {
    own: u64,
    own_queued: u64,
    remote: Option<u64>,
    remote_queued: Option<u64>,
    load: u64,
    load_queued: u64,
    /// The fresh engine report's running + waiting.
    reported: Option<u64>,
    polls_ok: u64,
    blocks: u64,
    followers_connected: bool,
}

fn num(v: &Value, what: &str) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

impl Replica {
    /// The replica's view of every endpoint, in `urls` order.
    async fn seen(&self, urls: &[String]) -> Vec<Seen> {
        match self {
            Replica::Serve(gw) => {
                let rows = endpoints(gw).await;
                urls.iter()
                    .map(|url| {
                        let row = rows
                            .iter()
                            .find(|r| r["url"] == url.as_str())
                            .unwrap_or_else(|| panic!("no endpoint {url} at the gateway"));
                        let load = &row["load"];
                        let reported = &load["engine_reported"];
                        Seen {
                            own: num(&row["in_flight"], "in_flight"),
                            own_queued: num(&row["queued_prefill_tokens"], "queued"),
                            remote: row["remote_in_flight"].as_u64(),
                            remote_queued: row["remote_queued_prefill_tokens"].as_u64(),
                            load: num(&load["in_flight"], "load.in_flight"),
                            load_queued: num(&load["queued_prefill_tokens"], "load.queued"),
                            reported: (!reported.is_null()).then(|| {
                                num(&reported["running"], "running")
                                    + num(&reported["waiting"], "waiting")
                            }),
                            polls_ok: num(&load["engine_load_polls"]["ok"], "polls"),
                            blocks: num(&row["inventory_blocks"], "inventory_blocks"),
                            followers_connected: row["subscribers"].as_array().is_some_and(|s| {
                                !s.is_empty() && s.iter().all(|s| s["connected"] == true)
                            }),
                        }
                    })
                    .collect()
            }
            Replica::Embedded { router, .. } => urls
                .iter()
                .map(|url| {
                    let st = router
                        .endpoint_status(url)
                        .unwrap_or_else(|| panic!("no endpoint {url} in the router"));
                    Seen {
                        own: u64::from(st.local.in_flight),
                        own_queued: st.local.queued_prefill_tokens,
                        remote: st.remote.map(|r| u64::from(r.in_flight)),
                        remote_queued: st.remote.map(|r| r.queued_prefill_tokens),
                        load: u64::from(st.load.in_flight),
                        load_queued: st.load.queued_prefill_tokens,
                        reported: st
                            .engine_report
                            .map(|r| u64::from(r.running) + u64::from(r.waiting)),
                        polls_ok: st.load_polls.ok,
                        blocks: st.inventory_blocks,
                        followers_connected: !st.followers.is_empty()
                            && st.followers.iter().all(|f| f.metrics.connected),
                    }
                })
                .collect(),
        }
    }

    /// Sends one chat request; a held one's answer is read by a task that
    /// runs until the world ends (its load stays charged until then).
    async fn send(&self, body: &Value, held: bool) -> (Decided, Option<JoinHandle<()>>) {
        match self {
            Replica::Serve(gw) => {
                // Held answers stream for minutes: no overall timeout.
                let c = if held {
                    reqwest::Client::new()
                } else {
                    client()
                };
                let resp = c
                    .post(gw.url("/v1/chat/completions"))
                    .json(body)
                    .send()
                    .await
                    .unwrap_or_else(|e| panic!("kvroute serve: {e}"));
                assert_eq!(resp.status(), 200, "kvroute serve answered {resp:?}");
                let header = |name: &str| {
                    resp.headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                let decided = Decided {
                    endpoint: header("x-kvroute-endpoint")
                        .unwrap_or_else(|| panic!("no x-kvroute-endpoint: {resp:?}")),
                    tier: header("x-kvroute-tier").unwrap_or_default(),
                    predicted_cached_tokens: header("x-kvroute-predicted-cached-tokens")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or_else(|| panic!("no predicted cached tokens: {resp:?}")),
                    miss: header("x-kvroute-miss-reason"),
                };
                if held {
                    let mut resp = resp;
                    let reader =
                        tokio::spawn(async move { while let Ok(Some(_)) = resp.chunk().await {} });
                    (decided, Some(reader))
                } else {
                    let v: Value = resp.json().await.unwrap_or(Value::Null);
                    assert!(v["usage"].is_object(), "not a completion: {v}");
                    (decided, None)
                }
            }
            Replica::Embedded { router, http } => {
                let bytes = Bytes::from(body.to_string());
                let pick = router
                    .pick(ApiKind::Chat, &bytes)
                    .await
                    .unwrap_or_else(|e| panic!("no pick: {e}"));
                let d = pick.decision();
                let decided = Decided {
                    endpoint: pick.url().to_owned(),
                    tier: d.source().as_str().to_owned(),
                    predicted_cached_tokens: pick.predicted_cached_tokens(),
                    miss: d.miss().map(|m| m.as_str().to_owned()),
                };
                let req = axum::http::Request::post(format!("{}/v1/chat/completions", pick.url()))
                    .header("content-type", "application/json")
                    .body(Full::new(pick.upstream_body(&bytes)))
                    .unwrap_or_else(|e| panic!("request: {e}"));
                let resp = http
                    .request(req)
                    .await
                    .unwrap_or_else(|e| panic!("engine {}: {e}", decided.endpoint));
                assert_eq!(resp.status(), 200, "engine answered {resp:?}");
                pick.connected();
                let (head, incoming) = resp.into_parts();
                let answer = pick.into_body(&head.headers, incoming);
                if held {
                    let reader = tokio::spawn(async move {
                        let _ = answer.collect().await;
                    });
                    (decided, Some(reader))
                } else {
                    let bytes = answer
                        .collect()
                        .await
                        .unwrap_or_else(|e| panic!("answer: {e}"))
                        .to_bytes();
                    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
                    assert!(v["usage"].is_object(), "not a completion: {v}");
                    (decided, None)
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Settling.

/// Where the held requests are: per replica and endpoint, and sent straight
/// to each engine.
#[derive(Default)]
struct Held {
    routed: [[u64; ENGINES]; 2],
    direct: [u64; ENGINES],
}

async fn engine_blocks(engines: &[Engine]) -> Vec<u64> {
    let mut out = Vec::new();
    for e in engines {
        let v = get_json(&format!("http://{}/admin/cache", e.http), None).await;
        out.push(num(&v["cached_blocks"], "cached_blocks"));
    }
    out
}

/// Why `seen` (replica `r`'s view of endpoint `i`) is not settled, if it is not.
fn unsettled(seen: &Seen, r: usize, i: usize, held: &Held, blocks: u64) -> Option<String> {
    let own = held.routed[r][i];
    let remote = held.routed[1 - r][i];
    let total = own + remote + held.direct[i];
    let mut why = Vec::new();
    let mut expect = |what: &str, got: String, want: String| {
        if got != want {
            why.push(format!("{what} {got} (want {want})"));
        }
    };
    expect("own in flight", seen.own.to_string(), own.to_string());
    expect(
        "remote in flight",
        format!("{:?}", seen.remote),
        format!("{:?}", Some(remote)),
    );
    expect("load", seen.load.to_string(), total.to_string());
    expect(
        "engine report",
        format!("{:?}", seen.reported),
        format!("{:?}", Some(total)),
    );
    expect(
        "queued prefill (own, remote, load)",
        format!(
            "{:?}",
            (seen.own_queued, seen.remote_queued, seen.load_queued)
        ),
        format!("{:?}", (0, Some(0), 0)),
    );
    expect(
        "inventory blocks",
        seen.blocks.to_string(),
        blocks.to_string(),
    );
    expect(
        "followers connected",
        seen.followers_connected.to_string(),
        "true".into(),
    );
    (!why.is_empty()).then(|| format!("replica {} endpoint {i}: {}", r + 1, why.join(", ")))
}

/// Waits until both replicas (and `solo`'s inventory) agree with `held`
/// and the engines' caches.
async fn settle(
    what: &str,
    replicas: &[Replica; 2],
    solo: Option<&KvRouter>,
    engines: &[Engine],
    urls: &[String],
    held: &Held,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        let blocks = engine_blocks(engines).await;
        let mut why = Vec::new();
        for (r, replica) in replicas.iter().enumerate() {
            for (i, seen) in replica.seen(urls).await.iter().enumerate() {
                why.extend(unsettled(seen, r, i, held, blocks[i]));
            }
        }
        if let Some(solo) = solo {
            for (i, url) in urls.iter().enumerate() {
                if solo.blocks(url) != blocks[i] {
                    why.push(format!(
                        "own-view router endpoint {i}: inventory {} (want {})",
                        solo.blocks(url),
                        blocks[i]
                    ));
                }
            }
        }
        if why.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: views did not settle within {WAIT:?}: {}",
            why.join("; ")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------
// One world.

/// What a world decided, and what it showed of the engine reports.
struct Outcome {
    decided: Vec<(String, Decided)>,
    /// The own-view router's pick at each probe, by decision index (world B).
    probes: Vec<(usize, Decided)>,
    /// Engine load polls that succeeded, per replica (summed over endpoints).
    polls_ok: Vec<u64>,
}

/// Runs `script` through `replicas`; with `compare`, every decision must
/// equal the one with the same index there (the first divergence fails
/// with both).
async fn run_world(
    name: &str,
    replicas: &[Replica; 2],
    solo: Option<&KvRouter>,
    engines: &[Engine],
    urls: &[String],
    script: &[Step],
    compare: Option<&[(String, Decided)]>,
) -> Outcome {
    let mut held = Held::default();
    let mut readers: Vec<JoinHandle<()>> = Vec::new();
    let mut direct: Vec<reqwest::Response> = Vec::new();
    let mut out = Outcome {
        decided: Vec::new(),
        probes: Vec::new(),
        polls_ok: Vec::new(),
    };
    let index_of = |url: &str| {
        urls.iter()
            .position(|u| u == url)
            .unwrap_or_else(|| panic!("{url} is not a configured endpoint"))
    };
    settle(
        &format!("{name}: start"),
        replicas,
        solo,
        engines,
        urls,
        &held,
    )
    .await;
    for (n, step) in script.iter().enumerate() {
        match step {
            Step::Ask {
                replica,
                label,
                body,
                held: hold,
                probe,
            } => {
                let k = out.decided.len();
                if *probe {
                    if let Some(solo) = solo {
                        let bytes = Bytes::from(body.to_string());
                        let prompt = solo.prepare(ApiKind::Chat, &bytes).await;
                        let mut pick = solo
                            .pick_explained(prompt, None)
                            .unwrap_or_else(|e| panic!("own-view router: {e}"));
                        let seen = pick
                            .take_explanation()
                            .unwrap_or_else(|| panic!("an explained pick records its view"));
                        // What it must not see: engine reports (they count
                        // the held answers other routers placed).
                        assert!(
                            seen.endpoints.iter().all(|e| e.reported.is_none()),
                            "the own-view router read engine reports: {seen:?}"
                        );
                        let d = pick.decision();
                        out.probes.push((
                            k,
                            Decided {
                                endpoint: pick.url().to_owned(),
                                tier: d.source().as_str().to_owned(),
                                predicted_cached_tokens: pick.predicted_cached_tokens(),
                                miss: d.miss().map(|m| m.as_str().to_owned()),
                            },
                        ));
                        // Dropped unsent: its charge is released at once.
                    }
                }
                let (decided, reader) = replicas[*replica].send(body, *hold).await;
                let label = format!("step {n} (decision {k}): replica {} {label}", replica + 1);
                eprintln!(
                    "{name}: {label} -> endpoint {} {} predicted {}{}",
                    index_of(&decided.endpoint),
                    decided.tier,
                    decided.predicted_cached_tokens,
                    decided
                        .miss
                        .as_deref()
                        .map(|m| format!(" miss {m}"))
                        .unwrap_or_default()
                );
                if let Some(other) = compare.and_then(|c| c.get(k)) {
                    assert_eq!(
                        &decided, &other.1,
                        "{name} decided differently at {label} (left: {name}, right: the other world)"
                    );
                }
                if let Some(reader) = reader {
                    held.routed[*replica][index_of(&decided.endpoint)] += 1;
                    readers.push(reader);
                }
                out.decided.push((label.clone(), decided));
                settle(
                    &format!("{name}: after {label}"),
                    replicas,
                    solo,
                    engines,
                    urls,
                    &held,
                )
                .await;
            }
            Step::Direct { beside, bodies } => {
                let (_, hot) = out
                    .decided
                    .get(*beside)
                    .unwrap_or_else(|| panic!("step {n}: no decision {beside} before it"));
                let i = (index_of(&hot.endpoint) + 1) % urls.len();
                for b in bodies {
                    let resp = reqwest::Client::new()
                        .post(format!("{}/v1/chat/completions", urls[i]))
                        .json(b)
                        .send()
                        .await
                        .unwrap_or_else(|e| panic!("engine {i}: {e}"));
                    assert_eq!(resp.status(), 200, "engine {i} answered {resp:?}");
                    direct.push(resp);
                    held.direct[i] += 1;
                }
                eprintln!(
                    "{name}: step {n}: {} held straight at engine {i}",
                    bodies.len()
                );
                settle(
                    &format!("{name}: after step {n} (straight to engine {i})"),
                    replicas,
                    solo,
                    engines,
                    urls,
                    &held,
                )
                .await;
            }
        }
    }
    for replica in replicas {
        out.polls_ok
            .push(replica.seen(urls).await.iter().map(|s| s.polls_ok).sum());
    }
    for r in readers {
        r.abort();
    }
    out
}

async fn replica_applied(replica: &Replica) -> u64 {
    match replica {
        Replica::Serve(gw) => num(
            &counters(gw, RULE).await["replicas"]["applied"],
            "replicas.applied",
        ),
        Replica::Embedded { router, .. } => {
            router
                .replica_counters()
                .unwrap_or_else(|| panic!("replica sharing is off"))
                .applied
        }
    }
}

/// Empties every engine (cache, queue, running requests, event sequence):
/// what the next world starts from.
async fn restart_engines(engines: &[Engine]) {
    for e in engines {
        let resp = client()
            .post(format!("http://{}/admin/restart-publisher", e.http))
            .send()
            .await
            .unwrap_or_else(|err| panic!("restart {}: {err}", e.http));
        assert!(resp.status().is_success(), "{resp:?}");
    }
    eventually("engines emptied", || async {
        (engine_blocks(engines).await.iter().all(|b| *b == 0)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_facade_and_kvroute_serve_decide_alike() {
    let engines: Vec<Engine> = (0..ENGINES)
        .map(|_| Engine::start_with("both", ENGINE_FLAGS))
        .collect();
    let nats = NatsServer::start();
    // One text per replica, differing in its place only: the replicas rank
    // themselves in that order (where each one's rotations start), where
    // random ids per start would rank the two worlds' replicas differently.
    let text_of = |order: u32| {
        let mut text = config_head(&format!(
            "[limits]\nengine_load_poll_ms = 50\n\
             [replicas]\nnats = \"{}\"\nremote_ttl_ms = 60000\norder = {order}\n",
            nats.url()
        ));
        text.push_str(&kv_rule(RULE, "converged"));
        for e in &engines {
            text.push_str(&e.endpoint_toml("both"));
        }
        text
    };
    let texts = [text_of(0), text_of(1)];
    let configs = texts
        .each_ref()
        .map(|t| ServeConfig::from_toml(t, &repo()).unwrap_or_else(|e| panic!("{e}")));
    let config = &configs[0];
    let rule = &config.rules[0];
    let urls: Vec<String> = rule.endpoints.iter().map(|e| e.url.clone()).collect();
    let script = script();

    // World A: two `kvroute serve` processes.
    let serve = {
        let replicas = texts.each_ref().map(|t| Replica::Serve(Gateway::start(t)));
        let outcome = run_world(
            "kvroute serve",
            &replicas,
            None,
            &engines,
            &urls,
            &script,
            None,
        )
        .await;
        let mut applied = Vec::new();
        for r in &replicas {
            applied.push(replica_applied(r).await);
        }
        (outcome, applied)
    };
    restart_engines(&engines).await;

    // World B: two embedded routers, and one that sees only its own load.
    let embedded_world = {
        let tokenizers = Arc::new(TokenizerPool::new());
        let mut replicas = Vec::new();
        for config in &configs {
            let router = embedded(config, &config.rules[0], &tokenizers, false)
                .replicas(embedded_replicas(config).await)
                .spawn()
                .unwrap_or_else(|e| panic!("embedded router: {e}"));
            router.ready().await;
            replicas.push(Replica::Embedded {
                router,
                http: Client::builder(TokioExecutor::new()).build_http(),
            });
        }
        let solo = embedded(config, rule, &tokenizers, true)
            .spawn()
            .unwrap_or_else(|e| panic!("own-view router: {e}"));
        let replicas: [Replica; 2] = replicas
            .try_into()
            .unwrap_or_else(|_| panic!("two replicas"));
        let outcome = run_world(
            "embedded",
            &replicas,
            Some(&solo),
            &engines,
            &urls,
            &script,
            Some(&serve.0.decided),
        )
        .await;
        let mut applied = Vec::new();
        for r in &replicas {
            applied.push(replica_applied(r).await);
        }
        (outcome, applied)
    };

    let (a, b) = (&serve.0, &embedded_world.0);
    assert_eq!(
        a.decided.iter().map(|(_, d)| d).collect::<Vec<_>>(),
        b.decided.iter().map(|(_, d)| d).collect::<Vec<_>>(),
        "the two worlds' decisions"
    );

    // The sequence exercised what parity is about.
    let hits = a
        .decided
        .iter()
        .filter(|(_, d)| d.tier == "kv_exact" && d.predicted_cached_tokens > 0)
        .count();
    assert!(hits >= 10, "only {hits} KV hits: {:?}", a.decided);
    let endpoints_used: std::collections::BTreeSet<_> =
        a.decided.iter().map(|(_, d)| &d.endpoint).collect();
    assert!(endpoints_used.len() >= 3, "{endpoints_used:?}");
    // The probe: the router that sees only its own load stays with the
    // conversation's history; both worlds' replica 2 moved off it because of
    // replica 1's load there.
    assert_eq!(b.probes.len(), 1, "{:?}", b.probes);
    let (step, own_view) = &b.probes[0];
    let hot = &a.decided[HOT].1.endpoint;
    assert_eq!(
        &own_view.endpoint, hot,
        "the own-view router keeps the history's endpoint: {own_view:?}"
    );
    assert!(own_view.predicted_cached_tokens > 0, "{own_view:?}");
    assert_ne!(
        &a.decided[*step].1.endpoint, hot,
        "replica 2 ignored replica 1's load: {:?}",
        a.decided[*step]
    );
    // Both worlds read the engines' reports and the other replica's load.
    for (world, (o, applied)) in [("kvroute serve", &serve), ("embedded", &embedded_world)] {
        assert!(
            o.polls_ok.iter().all(|p| *p > 0),
            "{world}: engine load polls {:?}",
            o.polls_ok
        );
        assert!(
            applied.iter().all(|n| *n > 0),
            "{world}: replica deltas applied {applied:?}"
        );
    }
}
