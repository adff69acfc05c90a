//! Replica load sharing between two real `kvroute serve` processes over a
//! real `nats-server` (`[replicas] nats`): requests one replica has in flight
//! count in the other's load view and steer its least-load picks away from
//! the busy engine; the shared load returns to 0 when the answers end, and a
//! killed replica's load expires after `remote_ttl_ms`. The replicas find
//! each other by their messages: neither names the other.
//!
//! The two replicas list the endpoints in opposite orders, so the sync must
//! name endpoints by URL. Engine-load polling is off and the engines export
//! nothing: the sync is the only way one replica can see the other's requests.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use gateway_support::*;
use serde_json::Value;

const TOKEN: &str = "replica-sync-test-token";

/// A replica sharing load over the NATS server at `nats`, with the rule's
/// endpoints in the order given. Every request is a KV miss (no engine
/// publishes events) placed by `least_load`, which reads the load view.
pub fn replica(nats: &str, endpoints: &[SocketAddr]) -> String {
    replica_timed(nats, endpoints, 1500)
}

/// [`replica`] with the other replicas' load expiring after `ttl_ms` of silence.
pub fn replica_timed(nats: &str, endpoints: &[SocketAddr], ttl_ms: u64) -> String {
    replica_with(
        nats,
        endpoints,
        &format!("heartbeat_ms = 200\nremote_ttl_ms = {ttl_ms}\n"),
    )
}

/// [`replica`] with these `[replicas]` settings (besides `nats`).
fn replica_with(nats: &str, endpoints: &[SocketAddr], replicas: &str) -> String {
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n\
         [limits]\nengine_load_poll_ms = 0\n\
         [health]\ninterval_ms = 0\n\
         [replicas]\nnats = \"{nats}\"\n{replicas}\
         [[models]]\nslug = \"{MODEL}\"\ndir = \"{}\"\n\n{}selector = \"least_load\"\n\n",
        model_dir().display(),
        kv_rule("kv", "converged"),
    );
    for e in endpoints {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{e}\"\nzmq = \"tcp://127.0.0.1:{}\"\n\n",
            closed_port()
        ));
    }
    s
}

async fn admin_get(gw: &Gateway, path: &str) -> Value {
    get_json(&gw.admin_url(path), Some(TOKEN)).await
}

/// `(own in_flight, remote_in_flight, load.in_flight)` of the endpoint at
/// `engine` in `gw`'s `/admin/endpoints`.
async fn load_at(gw: &Gateway, engine: &HeldEngine) -> (u64, u64, u64) {
    let ep = endpoint_row(gw, TOKEN, &format!("http://{}", engine.addr)).await;
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a number: {ep}"));
    (
        n(&ep["in_flight"]),
        n(&ep["remote_in_flight"]),
        n(&ep["load"]["in_flight"]),
    )
}

async fn eventually_load(what: &str, gw: &Gateway, engine: &HeldEngine, want: (u64, u64, u64)) {
    eventually(what, || async {
        (load_at(gw, engine).await == want).then_some(())
    })
    .await;
}

fn send(gw: &Gateway, tag: &str) -> tokio::task::JoinHandle<Option<u16>> {
    let url = gw.url("/v1/completions");
    let body = serde_json::json!({"model": MODEL, "prompt": prompt(tag, 20), "max_tokens": 2});
    tokio::spawn(async move {
        let resp = client().post(url).json(&body).send().await.ok()?;
        Some(resp.status().as_u16())
    })
}

async fn received(what: &str, engine: &HeldEngine, n: usize) {
    eventually(what, || async {
        (engine.received.load(Ordering::SeqCst) >= n).then_some(())
    })
    .await;
    assert_eq!(engine.received.load(Ordering::SeqCst), n, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_see_and_avoid_each_others_in_flight_requests() {
    let gate = Gate::new();
    let (busy, idle) = (held_engine(&gate).await, held_engine(&gate).await);
    let nats = NatsServer::start();
    let mut g1 = Gateway::start(&replica(&nats.url(), &[busy.addr, idle.addr]));
    let g2 = Gateway::start(&replica(&nats.url(), &[idle.addr, busy.addr]));

    // Replica 1 may only use `busy`: its requests pile up there.
    let resp = client()
        .put(g1.admin_url("/admin/rules/kv/endpoints/1/admin"))
        .bearer_auth(TOKEN)
        .json(&serde_json::json!({"down": true}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let first: Vec<_> = (0..4).map(|i| send(&g1, &format!("one-{i}"))).collect();
    received("replica 1's requests at the busy engine", &busy, 4).await;
    eventually_load("replica 2 sees replica 1's requests", &g2, &busy, (0, 4, 4)).await;
    assert_eq!(load_at(&g2, &idle).await, (0, 0, 0));

    // Replica 2 routes one request at a time by least load: every one goes
    // to the idle engine (2 of 4 would reach the busy one if replica 2
    // counted only its own requests: least load alternates on ties).
    let mut second = Vec::new();
    for i in 0..4 {
        second.push(send(&g2, &format!("two-{i}")));
        let at = eventually("replica 2's request at an engine", || async {
            let at = (
                busy.received.load(Ordering::SeqCst),
                idle.received.load(Ordering::SeqCst),
            );
            (at.0 + at.1 == 4 + i + 1).then_some(at)
        })
        .await;
        assert_eq!(at, (4, i + 1), "(busy, idle) after replica 2's request {i}");
    }
    eventually_load("replica 1 sees replica 2's requests", &g1, &idle, (0, 4, 4)).await;
    eventually_load("replica 2 counts its own", &g2, &idle, (4, 0, 4)).await;

    // The answers end: nothing stays charged anywhere.
    gate.open();
    for r in first.into_iter().chain(second) {
        assert_eq!(r.await.unwrap(), Some(200));
    }
    for (gw, name) in [(&g1, "replica 1"), (&g2, "replica 2")] {
        for e in [&busy, &idle] {
            eventually_load(&format!("{name}: released"), gw, e, (0, 0, 0)).await;
        }
    }

    // What the sharing did is counted, on the admin API and /metrics.
    let c2 = admin_get(&g2, "/admin/counters").await["rules"]["kv"]["replicas"].clone();
    assert!(c2["applied"].as_u64().unwrap() >= 2, "{c2}");
    assert!(c2["sent_batches"].as_u64().unwrap() >= 1, "{c2}");
    assert_eq!(c2["unknown_endpoint"], 0, "same URLs: {c2}");
    assert_eq!(c2["replicas"], 1, "{c2}");
    let nats_counters = admin_get(&g2, "/admin/counters").await["nats"].clone();
    assert_eq!(nats_counters["connected"], true, "{nats_counters}");
    let metrics = metrics_text(&g2).await;
    assert!(
        metrics.contains("kvroute_replicas{rule=\"kv\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "kvroute_remote_in_flight{{rule=\"kv\",endpoint=\"http://{}\",role=\"both\"}} 0",
            busy.addr
        )),
        "{metrics}"
    );

    // Replica 1 dies with two requests in flight: replica 2 stops counting
    // them once replica 1 has been silent for remote_ttl_ms.
    let orphans: Vec<_> = (0..2).map(|i| send(&g1, &format!("orphan-{i}"))).collect();
    received("replica 1's last requests at the busy engine", &busy, 6).await;
    eventually_load("replica 2 sees them", &g2, &busy, (0, 2, 2)).await;
    g1.proc.kill();
    eventually_load(
        "replica 1's load expired at replica 2",
        &g2,
        &busy,
        (0, 0, 0),
    )
    .await;
    eventually("the expiry is counted", || async {
        let c = admin_get(&g2, "/admin/counters").await["rules"]["kv"]["replicas"].clone();
        (c["expired"].as_u64() >= Some(1) && c["replicas"] == 0).then_some(())
    })
    .await;
    gate.open();
    for o in orphans {
        // Their client connection died with replica 1.
        assert_ne!(o.await.unwrap(), Some(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_rule_still_announces_the_end_of_its_requests() {
    let gate = Gate::new();
    let (busy, idle) = (held_engine(&gate).await, held_engine(&gate).await);
    // Peers' load would expire only after 10 minutes: the old rule instance's
    // own deltas must bring replica 2's view back to 0.
    let ttl = 600_000;
    let nats = NatsServer::start();
    let g1 = Gateway::start(&replica_timed(&nats.url(), &[busy.addr], ttl));
    let g2 = Gateway::start(&replica_timed(&nats.url(), &[busy.addr, idle.addr], ttl));
    let held: Vec<_> = (0..2).map(|i| send(&g1, &format!("held-{i}"))).collect();
    received("replica 1's requests at the engine", &busy, 2).await;
    eventually_load("replica 2 sees them", &g2, &busy, (0, 2, 2)).await;

    // Replica 1's rule is replaced while they are in flight.
    let doc = admin_get(&g1, "/admin/rules/kv").await;
    let resp = client()
        .put(g1.admin_url("/admin/rules/kv"))
        .bearer_auth(TOKEN)
        .json(&doc)
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    gate.open();
    for r in held {
        assert_eq!(r.await.unwrap(), Some(200));
    }
    eventually_load(
        "replica 2 sees the replaced rule's requests end",
        &g2,
        &busy,
        (0, 0, 0),
    )
    .await;
    // The new instance is shared too.
    let next = send(&g1, "after-replace");
    received("the new rule's request at the engine", &busy, 3).await;
    eventually_load(
        "replica 2 sees the new instance's request",
        &g2,
        &busy,
        (0, 1, 1),
    )
    .await;
    gate.open();
    assert_eq!(next.await.unwrap(), Some(200));
    eventually_load("and its end", &g2, &busy, (0, 0, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_after_a_quiet_interval_reaches_the_others_at_once() {
    use std::time::{Duration, Instant};
    // A sync interval of 4 s: replica 1's messages go out on ticks 4 s
    // apart, each with what changed since the last. Its decision comes half
    // a second after a tick that had nothing to send: it must reach replica
    // 2 at once, not with the next tick 3.5 s later.
    let interval = Duration::from_secs(4);
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let nats = NatsServer::start();
    let slow = "sync_interval_ms = 4000\nheartbeat_ms = 600000\nremote_ttl_ms = 1200000\n";
    let g2 = Gateway::start(&replica_with(&nats.url(), &[engine.addr], slow));
    let g1 = Gateway::start(&replica_with(&nats.url(), &[engine.addr], slow));
    let sent = |c: &Value| {
        c["rules"]["kv"]["replicas"]["sent_batches"]
            .as_u64()
            .unwrap()
    };
    // Its start-up messages (the first tick, and one after NATS connects)
    // out, then a tick with nothing to send.
    let mut last = (
        sent(&admin_get(&g1, "/admin/counters").await),
        Instant::now(),
    );
    loop {
        assert!(last.1.elapsed() < WAIT, "replica 1 never went quiet");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n = sent(&admin_get(&g1, "/admin/counters").await);
        if n != last.0 {
            last = (n, Instant::now());
        } else if last.1.elapsed() >= interval + Duration::from_millis(500) {
            break;
        }
    }

    let request = send(&g1, "quiet");
    received("replica 1's request at the engine", &engine, 1).await;
    eventually_load(
        "replica 2 sees replica 1's request",
        &g2,
        &engine,
        (0, 1, 1),
    )
    .await;
    // It came in one message, sent at once (had it waited for the next
    // tick, 3.5 s later, that message would not count as sent at once).
    let c1 = admin_get(&g1, "/admin/counters").await;
    assert_eq!(sent(&c1), last.0 + 1, "one message for the decision: {c1}");
    assert_eq!(
        c1["rules"]["kv"]["replicas"]["sent_at_once"], 1,
        "counted as sent at once: {c1}"
    );
    assert!(
        metrics_text(&g1)
            .await
            .contains("kvroute_replica_sent_at_once_total{rule=\"kv\"} 1"),
        "on /metrics too"
    );
    gate.open();
    assert_eq!(request.await.unwrap(), Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_bursts_the_higher_ranked_replica_takes_its_turn_after_the_other() {
    // Two replicas, turns 20 ms apart, the rule's burst ordering at its
    // default (1 ms). Bursts of four fresh prompts at once to each: once
    // each has seen its decisions come in bursts, every request waits for
    // the burst's requests with a home (none here) — one stagger, the
    // ordering's wait with replicas — and the replica with the higher origin
    // id (rank 1 of 2) one stagger more: 20 and 40 ms. Which one ranks
    // higher is not known in advance (origin ids are random), so the test
    // reads both.
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let nats = NatsServer::start();
    let turns = "stagger_ms = 20\nheartbeat_ms = 200\nremote_ttl_ms = 60000\n";
    let g1 = Gateway::start(&replica_with(&nats.url(), &[engine.addr], turns));
    let g2 = Gateway::start(&replica_with(&nats.url(), &[engine.addr], turns));
    let replicas = |c: &Value| c["rules"]["kv"]["replicas"].clone();
    eventually("each replica hears the other", || async {
        let (c1, c2) = (
            admin_get(&g1, "/admin/counters").await,
            admin_get(&g2, "/admin/counters").await,
        );
        (replicas(&c1)["replicas"] == 1 && replicas(&c2)["replicas"] == 1).then_some(())
    })
    .await;
    let mut sent = 0;
    for burst in 0..12 {
        let mut answers = Vec::new();
        for (g, gw) in [&g1, &g2].into_iter().enumerate() {
            for i in 0..4 {
                answers.push(send(gw, &format!("b{burst}-g{g}-{i}")));
            }
        }
        sent += answers.len();
        received("the burst at the engine", &engine, sent).await;
        gate.open();
        for a in answers {
            assert_eq!(a.await.unwrap(), Some(200));
        }
    }
    let (c1, c2) = (
        admin_get(&g1, "/admin/counters").await,
        admin_get(&g2, "/admin/counters").await,
    );
    let rule = |c: &Value| c["rules"]["kv"].clone();
    let (r1, r2) = (rule(&c1), rule(&c2));
    let held = |r: &Value| r["held"].as_u64().unwrap();
    let held_us = |r: &Value| r["held_us"].as_u64().unwrap();
    assert!(held(&r1) > 0 && held(&r2) > 0, "both hold: {r1} {r2}");
    // Per request, 20 ms on the lower rank and 40 ms on the higher.
    let mut per_request = [held_us(&r1) / held(&r1), held_us(&r2) / held(&r2)];
    per_request.sort_unstable();
    assert_eq!(per_request, [20_000, 40_000], "{r1} {r2}");
    for (r, c) in [(&r1, &c1), (&r2, &c2)] {
        assert_eq!(held_us(r) % held(r), 0, "every hold the same: {c}");
    }
    let text = metrics_text(&g1).await;
    assert!(
        text.contains(&format!(
            "kvroute_burst_held_total{{rule=\"kv\"}} {}",
            held(&r1)
        )) && text.contains(&format!(
            "kvroute_burst_held_microseconds_total{{rule=\"kv\"}} {}",
            held_us(&r1)
        )),
        "on /metrics too"
    );
}
