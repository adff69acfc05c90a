//! Replica-synced load reaches the KV-exact scorers, not only `least_load`
//! (`gateway_replica_sync.rs`): two `kvroute serve` replicas in front of two
//! real mock engines that both cache the same prefix. Requests replica 1
//! holds on one engine make replica 2's KV-exact decisions — the default
//! cost scorer and `load_aware` — pick the other engine, although both hold
//! the prompt's prefix. Without `[replicas]` the same requests split between
//! the engines: the avoidance comes from the synced load alone.
//!
//! Load is shared over a real `nats-server`. Engine-load polling is off, so
//! the sync is the only way replica 2 can see
//! replica 1's requests. The replicas list the endpoints in opposite orders.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gateway_support::*;
use serde_json::Value;

const TOKEN: &str = "replica-sync-kv-test-token";

/// Words of the prefix both engines cache (a few hundred tokens: many blocks).
const SHARED_WORDS: usize = 120;

/// A real mock engine behind a front that holds every completion until the
/// gate opens, then passes it on: the gateway sees a request in flight as
/// long as the test wants, the engine's cache and KV events are its own.
struct HeldEngine {
    engine: Engine,
    front: SocketAddr,
    received: Arc<AtomicUsize>,
}

impl HeldEngine {
    fn endpoint_toml(&self) -> String {
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{}\"\n{}\n",
            self.front,
            self.engine.zmq,
            self.engine
                .replay
                .map(|r| format!("replay = \"tcp://127.0.0.1:{r}\"\n"))
                .unwrap_or_default(),
        )
    }

    fn received(&self) -> usize {
        self.received.load(Ordering::SeqCst)
    }
}

async fn held_engine(gate: &Gate) -> HeldEngine {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    let engine = Engine::start("both");
    let base = format!("http://{}", engine.http);
    let received = Arc::new(AtomicUsize::new(0));
    let (count, gate) = (Arc::clone(&received), gate.clone());
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (count, gate, base) = (Arc::clone(&count), gate.clone(), base.clone());
        async move {
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, 64 << 20).await.unwrap();
            if parts.uri.path().starts_with("/v1/") {
                gate.hold(&count).await;
            }
            let resp = client()
                .request(parts.method, format!("{base}{}", parts.uri))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await;
            match resp {
                Ok(r) => {
                    let status = r.status();
                    (status, r.bytes().await.unwrap_or_default()).into_response()
                }
                Err(e) => (axum::http::StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    HeldEngine {
        engine,
        front,
        received,
    }
}

/// A replica's config: sharing load over the NATS server at `nats` when
/// given, one KV-exact rule with `scorer` (none: the default).
fn replica(nats: Option<&str>, scorer: Option<&str>, endpoints: &[&HeldEngine]) -> String {
    let replicas = match nats {
        Some(url) => {
            format!("[replicas]\nnats = \"{url}\"\nheartbeat_ms = 200\nremote_ttl_ms = 30000\n")
        }
        None => String::new(),
    };
    let scorer = scorer
        .map(|s| format!("scorer = \"{s}\"\n"))
        .unwrap_or_default();
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n\
         [limits]\nengine_load_poll_ms = 0\n\
         [health]\ninterval_ms = 0\n\
         {replicas}\
         [[models]]\nslug = \"{MODEL}\"\ndir = \"{}\"\n\n{}{scorer}\n",
        model_dir().display(),
        kv_rule("kv", "converged"),
    );
    for e in endpoints {
        s.push_str(&e.endpoint_toml());
    }
    s
}

async fn admin_get(gw: &Gateway, path: &str) -> Value {
    get_json(&gw.admin_url(path), Some(TOKEN)).await
}

/// `(remote_in_flight, load.in_flight)` of `engine`'s endpoint at `gw`.
async fn remote_at(gw: &Gateway, engine: &HeldEngine) -> (u64, u64) {
    let ep = endpoint_row(gw, TOKEN, &format!("http://{}", engine.front)).await;
    (
        ep["remote_in_flight"].as_u64().unwrap_or(0),
        ep["load"]["in_flight"].as_u64().unwrap(),
    )
}

/// `/admin/endpoints` rows of `gw`.
async fn endpoint_rows(gw: &Gateway) -> Vec<Value> {
    admin_get(gw, "/admin/endpoints").await["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until every KV-event subscriber of `gw` is connected.
async fn subscribed(gw: &Gateway) {
    eventually("subscribers connected", || async {
        endpoint_rows(gw)
            .await
            .iter()
            .all(|e| {
                e["subscribers"]
                    .as_array()
                    .is_some_and(|s| !s.is_empty() && s.iter().all(|s| s["connected"] == true))
            })
            .then_some(())
    })
    .await;
}

/// Both engines' inventories at `gw` hold at least `blocks` blocks.
async fn wait_inventory(gw: &Gateway, blocks: u64) {
    eventually(
        "both engines' prefix in the gateway's inventory",
        || async {
            let rows = endpoint_rows(gw).await;
            (rows.len() == 2
                && rows
                    .iter()
                    .all(|e| e["inventory_blocks"].as_u64() >= Some(blocks)))
            .then_some(())
        },
    )
    .await;
}

fn send(gw: &Gateway, shared: &str, tag: &str) -> tokio::task::JoinHandle<Option<u16>> {
    let url = gw.url("/v1/completions");
    let body = serde_json::json!({
        "model": MODEL,
        // The tag comes right after the shared prefix, so prompts with tags
        // that differ in their first word share no block beyond the prefix
        // (else a predicted entry of the first makes the others' longest
        // prefix there, and affinity keeps them together).
        "prompt": format!("{shared} {tag}: what now?"),
        "max_tokens": 2,
    });
    tokio::spawn(async move {
        let resp = client().post(url).json(&body).send().await.ok()?;
        Some(resp.status().as_u16())
    })
}

/// Where replica 2's four requests went, as `(busy, idle)`, after replica 1
/// put four on the busy engine.
async fn replica_two_split(sync: bool, scorer: Option<&str>) -> (usize, usize) {
    let gate = Gate::new();
    let (busy, idle) = (held_engine(&gate).await, held_engine(&gate).await);
    let nats = sync.then(NatsServer::start);
    let url = nats.as_ref().map(NatsServer::url);
    let g1 = Gateway::start(&replica(url.as_deref(), scorer, &[&busy, &idle]));
    let g2 = Gateway::start(&replica(url.as_deref(), scorer, &[&idle, &busy]));
    subscribed(&g1).await;
    subscribed(&g2).await;

    // Both engines cache the same prefix, straight from the test: the
    // caches tie for every prompt below.
    let shared = prompt("shared", SHARED_WORDS);
    for e in [&busy, &idle] {
        let resp = client()
            .post(format!("http://{}/v1/completions", e.engine.http))
            .json(&serde_json::json!({"model": MODEL, "prompt": shared, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    let blocks = {
        let v = get_json(&format!("http://{}/admin/cache", busy.engine.http), None).await;
        v["cached_blocks"].as_u64().unwrap()
    };
    assert!(blocks >= 8, "the shared prefix is {blocks} blocks");
    wait_inventory(&g1, blocks).await;
    wait_inventory(&g2, blocks).await;

    // Replica 1 may only use `busy`: its requests pile up there.
    let resp = client()
        .put(g1.admin_url("/admin/rules/kv/endpoints/1/admin"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"down": true}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let first: Vec<_> = (0..4)
        .map(|i| send(&g1, &shared, &format!("one-{i}")))
        .collect();
    eventually("replica 1's requests at the busy engine", || async {
        (busy.received() == 4).then_some(())
    })
    .await;
    let want = if sync { (4, 4) } else { (0, 0) };
    eventually("replica 2's view of the busy engine", || async {
        (remote_at(&g2, &busy).await == want).then_some(())
    })
    .await;

    // Replica 2 routes one request at a time.
    let mut second = Vec::new();
    for (i, word) in ["alpha", "bravo", "charlie", "delta"]
        .into_iter()
        .enumerate()
    {
        second.push(send(&g2, &shared, word));
        eventually("replica 2's request at an engine", || async {
            (busy.received() + idle.received() == 4 + i + 1).then_some(())
        })
        .await;
    }
    let split = (busy.received() - 4, idle.received());
    // The KV tier decided every one of them: both engines held the prefix.
    let tiers = admin_get(&g2, "/admin/counters").await["rules"]["kv"]["tiers"].clone();
    assert_eq!(
        tiers["kv_exact"], 4,
        "replica 2's decisions by tier: {tiers}"
    );

    gate.open();
    for r in first.into_iter().chain(second) {
        assert_eq!(r.await.unwrap(), Some(200));
    }
    split
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_cost_scorer_avoids_an_engine_another_replica_loads() {
    assert_eq!(
        replica_two_split(true, None).await,
        (0, 4),
        "(busy, idle) of replica 2's requests with replica sync"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_avoids_an_engine_another_replica_loads() {
    assert_eq!(
        replica_two_split(true, Some("load_aware")).await,
        (0, 4),
        "(busy, idle) of replica 2's requests with replica sync"
    );
}

/// The control: without the sync replica 2 counts only its own requests and
/// the two engines look alike, so the busy engine gets some of them — the
/// two tests above fail with `[replicas]` off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replica_sync_the_loaded_engine_gets_its_share() {
    for scorer in [None, Some("load_aware")] {
        let (busy, idle) = replica_two_split(false, scorer).await;
        assert_eq!(busy + idle, 4);
        assert!(
            busy > 0,
            "scorer {scorer:?}: (busy, idle) = ({busy}, {idle}) without replica sync"
        );
    }
}
