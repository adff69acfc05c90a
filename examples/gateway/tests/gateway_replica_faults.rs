//! Replica load sharing under faults, with real `kvroute serve` replicas and
//! a real `nats-server`:
//!
//! * the NATS server restarts while a replica has requests in flight: both
//!   replicas keep routing on their own view meanwhile, and once they are
//!   reconnected the other replica counts those requests again — once, not
//!   twice;
//! * one replica is cut off from NATS (a TCP relay between it and the
//!   server drops every connection): the other stops counting its requests
//!   after `remote_ttl_ms`, and counts them again once the link is back;
//!   replicas taking turns within bursts stop taking them once the other is
//!   gone from their view (each alone then decides at once), and take them
//!   again, in the same order, once the link is back;
//! * a replica that publishes garbage or an oversized message on the
//!   subject: each is refused and counted, nothing is applied, routing goes
//!   on; one that floods the subject faster than a replica applies: beyond
//!   `receive_buffer` messages are dropped and counted.
//!
//! Engine-load polling is off and the engines export nothing: the sharing is
//! the only way one replica sees the other's requests.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gateway_support::*;
use serde_json::Value;
use tokio::sync::watch;

const TOKEN: &str = "replica-faults-test-token";

/// A replica sharing load over the NATS server at `nats`; the other
/// replicas' load expires after `ttl_ms` of silence.
fn replica(nats: &str, endpoints: &[SocketAddr], ttl_ms: u64) -> String {
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\n\
         [limits]\nengine_load_poll_ms = 0\n\
         [health]\ninterval_ms = 0\n\
         [replicas]\nnats = \"{nats}\"\nheartbeat_ms = 200\nremote_ttl_ms = {ttl_ms}\n\
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

/// `(own in_flight, remote_in_flight)` of the endpoint at `engine` in `gw`.
async fn load_at(gw: &Gateway, engine: &HeldEngine) -> (u64, u64) {
    let ep = endpoint_row(gw, TOKEN, &format!("http://{}", engine.addr)).await;
    (
        ep["in_flight"].as_u64().unwrap(),
        ep["remote_in_flight"].as_u64().unwrap_or(0),
    )
}

async fn eventually_load(what: &str, gw: &Gateway, engine: &HeldEngine, want: (u64, u64)) {
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
}

async fn replica_counters(gw: &Gateway) -> Value {
    admin_get(gw, "/admin/counters").await["rules"]["kv"]["replicas"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_resyncs_the_replicas_without_counting_twice() {
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let mut nats = NatsServer::start();
    let g1 = Gateway::start(&replica(&nats.url(), &[engine.addr], 60_000));
    let g2 = Gateway::start(&replica(&nats.url(), &[engine.addr], 60_000));
    let first: Vec<_> = (0..2).map(|i| send(&g1, &format!("a-{i}"))).collect();
    received("replica 1's requests", &engine, 2).await;
    eventually_load("replica 2 sees them", &g2, &engine, (0, 2)).await;

    // NATS goes away: both replicas still route, on their own view.
    nats.stop();
    let during = send(&g2, "during");
    received("replica 2's request during the outage", &engine, 3).await;
    let more = send(&g1, "a-2");
    received("replica 1's request during the outage", &engine, 4).await;
    eventually_load("replica 1 counts its own", &g1, &engine, (3, 0)).await;
    // What replica 1 publishes meanwhile (its decision, its heartbeats) is
    // dropped, not queued to replay outdated load once the server is back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let c = admin_get(&g1, "/admin/counters").await["nats"].clone();
        if c["offline"].as_u64().unwrap_or(0) >= 1 {
            assert_eq!(c["queue_full"], 0, "{c}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing dropped offline: {c}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // Back: replica 2 learns replica 1's three requests — three, not the
    // two it knew plus three.
    nats.restart();
    eventually_load("replica 2 resynchronised", &g2, &engine, (1, 3)).await;
    eventually_load("replica 1 resynchronised", &g1, &engine, (3, 1)).await;
    let c = admin_get(&g2, "/admin/counters").await["nats"].clone();
    assert!(c["reconnects"].as_u64().unwrap() >= 1, "{c}");

    gate.open();
    for r in first.into_iter().chain([during, more]) {
        assert_eq!(r.await.unwrap(), Some(200));
    }
    eventually_load("replica 2: released", &g2, &engine, (0, 0)).await;
    eventually_load("replica 1: released", &g1, &engine, (0, 0)).await;
}

/// A TCP relay between a replica and the NATS server that can drop every
/// connection and refuse new ones (a network partition), then heal.
struct Relay {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    epoch: Arc<watch::Sender<u64>>,
}

impl Relay {
    async fn start(upstream: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let epoch = Arc::new(watch::channel(0u64).0);
        let (c, e) = (Arc::clone(&cut), Arc::clone(&epoch));
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: refused while cut
                }
                let mut cut_now = e.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_now.changed() => {}
                    }
                });
            }
        });
        Self { addr, cut, epoch }
    }

    fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.epoch.send_modify(|e| *e += 1);
    }

    fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// Two replicas over one engine (answers held until the gate opens) and a
/// real `nats-server`, replica 1 reaching it through a [`Relay`]; each
/// expires the other after 1.5 s of silence.
struct Pair {
    gate: Gate,
    engine: HeldEngine,
    relay: Relay,
    g1: Gateway,
    g2: Gateway,
    _nats: NatsServer,
}

impl Pair {
    async fn start() -> Self {
        let gate = Gate::new();
        let engine = held_engine(&gate).await;
        let nats = NatsServer::start();
        let relay = Relay::start(nats.port).await;
        let g1 = Gateway::start(&replica(&relay.url(), &[engine.addr], 1_500));
        let g2 = Gateway::start(&replica(&nats.url(), &[engine.addr], 1_500));
        Self {
            gate,
            engine,
            relay,
            g1,
            g2,
            _nats: nats,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_expires_at_the_others_and_resyncs_when_back() {
    let Pair {
        gate,
        engine,
        relay,
        g1,
        g2,
        _nats,
    } = Pair::start().await;
    let held: Vec<_> = (0..2).map(|i| send(&g1, &format!("p-{i}"))).collect();
    received("replica 1's requests", &engine, 2).await;
    eventually_load("replica 2 sees them", &g2, &engine, (0, 2)).await;

    relay.cut();
    eventually_load(
        "replica 1's load expired at replica 2 during the partition",
        &g2,
        &engine,
        (0, 0),
    )
    .await;
    eventually("the expiry is counted", || async {
        (replica_counters(&g2).await["expired"].as_u64() >= Some(1)).then_some(())
    })
    .await;
    // Replica 1 still routes, on its own view.
    let during = send(&g1, "p-2");
    received("replica 1's request during the partition", &engine, 3).await;

    relay.heal();
    eventually_load("replica 2 counts replica 1 again", &g2, &engine, (0, 3)).await;

    gate.open();
    for r in held.into_iter().chain([during]) {
        assert_eq!(r.await.unwrap(), Some(200));
    }
    eventually_load("released", &g2, &engine, (0, 0)).await;
}

impl Pair {
    /// Sends `n` bursts, each four requests at once to each replica, waiting
    /// for each whole burst at the engine before letting it answer; then
    /// both replicas' sharing counters.
    async fn bursts(&self, tag: &str, n: usize, sent: &mut usize) -> (Value, Value) {
        for b in 0..n {
            let mut answers = Vec::new();
            for (g, gw) in [&self.g1, &self.g2].into_iter().enumerate() {
                for i in 0..4 {
                    answers.push(send(gw, &format!("{tag}-{b}-g{g}-{i}")));
                }
            }
            *sent += answers.len();
            received(tag, &self.engine, *sent).await;
            self.gate.open();
            for a in answers {
                assert_eq!(a.await.unwrap(), Some(200));
            }
        }
        self.counters().await
    }

    async fn counters(&self) -> (Value, Value) {
        (
            replica_counters(&self.g1).await,
            replica_counters(&self.g2).await,
        )
    }

    /// Waits until each replica counts `n` others.
    async fn replicas(&self, what: &str, n: u64) {
        eventually(what, || async {
            let (a, b) = self.counters().await;
            (a["replicas"] == n && b["replicas"] == n).then_some(())
        })
        .await;
    }
}

/// `(held, held_us)` of a replica's rule: requests held for their turn in a
/// burst, and those holds summed.
async fn holds(gw: &Gateway) -> (u64, u64) {
    let rule = admin_get(gw, "/admin/counters").await["rules"]["kv"].clone();
    (
        rule["held"].as_u64().unwrap(),
        rule["held_us"].as_u64().unwrap(),
    )
}

/// The mean hold (µs) of the requests held between two readings of
/// [`holds`] (0 if none).
fn mean_hold(before: (u64, u64), after: (u64, u64)) -> u64 {
    (after.1 - before.1)
        .checked_div(after.0 - before.0)
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_takes_no_turns_once_alone_and_takes_them_again_when_back() {
    // Two replicas taking turns within bursts (the default 2 ms stagger and
    // 1 ms burst ordering), replica 1 behind a relay. In a burst of fresh
    // prompts every request waits one stagger for the requests with a home
    // (there are none), and the higher-ranked replica (origin ids are
    // random, so the test finds out which) one stagger more: 2 and 4 ms.
    // Cut off, each expires the other after the TTL and, alone, waits only
    // for the ordering: 1 ms. Healed, the same replica takes its turns
    // after the other again.
    let pair = Pair::start().await;
    pair.replicas("each replica hears the other", 1).await;
    let mut sent = 0;
    let start = (holds(&pair.g1).await, holds(&pair.g2).await);
    pair.bursts("before", 12, &mut sent).await;
    let before = (holds(&pair.g1).await, holds(&pair.g2).await);
    let (m1, m2) = (mean_hold(start.0, before.0), mean_hold(start.1, before.1));
    let mut ranks = [m1, m2];
    ranks.sort_unstable();
    assert_eq!(ranks, [2_000, 4_000], "turns: {before:?}");
    let higher_is_g1 = m1 > m2;

    pair.relay.cut();
    pair.replicas("each replica expires the other", 0).await;
    let cut_start = (holds(&pair.g1).await, holds(&pair.g2).await);
    pair.bursts("cut", 6, &mut sent).await;
    let cut = (holds(&pair.g1).await, holds(&pair.g2).await);
    assert_eq!(
        (mean_hold(cut_start.0, cut.0), mean_hold(cut_start.1, cut.1)),
        (1_000, 1_000),
        "alone, each only orders its bursts: {cut:?}"
    );

    pair.relay.heal();
    pair.replicas("each replica hears the other again", 1).await;
    let heal_start = (holds(&pair.g1).await, holds(&pair.g2).await);
    pair.bursts("healed", 6, &mut sent).await;
    let healed = (holds(&pair.g1).await, holds(&pair.g2).await);
    let (h1, h2) = (
        mean_hold(heal_start.0, healed.0),
        mean_hold(heal_start.1, healed.1),
    );
    let (higher, lower) = if higher_is_g1 { (h1, h2) } else { (h2, h1) };
    assert_eq!(
        (higher, lower),
        (4_000, 2_000),
        "the same replica takes its turn after the other again: {healed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_oversized_messages_are_refused_and_counted() {
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let nats = NatsServer::start();
    let gw = Gateway::start(&replica(&nats.url(), &[engine.addr], 60_000));
    eventually("the replica is subscribed", || async {
        (admin_get(&gw, "/admin/counters").await["nats"]["connected"] == true).then_some(())
    })
    .await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let subject = "kvroute.kv.load";
    let url = format!("http://{}", engine.addr);
    let foreign = |endpoint: &str, in_flight: u32| {
        serde_json::json!({"origin": 7, "endpoints": [{"url": endpoint, "seq": 1,
            "in_flight": in_flight, "queued_prefill_tokens": 0, "requests": 1,
            "prefill_tokens": 0}]})
        .to_string()
    };
    bus.publish(subject, "not json".into()).await.unwrap();
    bus.publish(subject, foreign("http://127.0.0.1:1", 9).into())
        .await
        .unwrap();
    // Over the replicas' 1 MiB bound (the test server takes up to 4 MiB).
    let huge = format!(
        "{{\"origin\": 8, \"endpoints\": [], \"pad\": \"{}\"}}",
        "x".repeat(2 << 20)
    );
    bus.publish(subject, huge.into()).await.unwrap();
    bus.flush().await.unwrap();
    eventually("every message is counted", || async {
        let c = replica_counters(&gw).await;
        (c["undecodable"] == 1 && c["unknown_endpoint"] == 1 && c["oversized"] == 1).then_some(c)
    })
    .await;
    let c = replica_counters(&gw).await;
    assert_eq!(c["applied"], 0, "{c}");
    assert_eq!(load_at(&gw, &engine).await, (0, 0));
    // A well-formed one from another replica is applied, and routing goes on.
    bus.publish(subject, foreign(&url, 1).into()).await.unwrap();
    bus.flush().await.unwrap();
    eventually_load("the other replica's request counts", &gw, &engine, (0, 1)).await;
    let r = send(&gw, "after");
    received("the request reached the engine", &engine, 1).await;
    gate.open();
    assert_eq!(r.await.unwrap(), Some(200));
    let metrics = metrics_text(&gw).await;
    for family in [
        "kvroute_replica_undecodable_total{rule=\"kv\"} 1",
        "kvroute_replica_oversized_total{rule=\"kv\"} 1",
        "kvroute_replica_unknown_endpoint_total{rule=\"kv\"} 1",
    ] {
        assert!(metrics.contains(family), "{family} in\n{metrics}");
    }
}

/// A peer floods the subject faster than this replica applies its messages:
/// the replica buffers at most `receive_buffer` of them, the NATS client
/// drops the rest and the replica counts the drops (`slow_consumer`);
/// routing goes on and a well-formed message afterwards is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_beyond_the_receive_buffer_is_dropped_and_counted() {
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let nats = NatsServer::start();
    let config = replica(&nats.url(), &[engine.addr], 60_000)
        .replace("[replicas]\n", "[replicas]\nreceive_buffer = 2\n");
    let gw = Gateway::start(&config);
    eventually("the replica is subscribed", || async {
        (admin_get(&gw, "/admin/counters").await["nats"]["connected"] == true).then_some(())
    })
    .await;
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let subject = "kvroute.kv.load";
    // Each message names 1 000 endpoints this replica does not have: sent
    // as fast as the server takes it, decoded and looked up to be applied.
    let endpoints: Vec<Value> = (0..1_000)
        .map(|e| {
            serde_json::json!({"url": format!("http://10.9.{}.{}:8000", e / 250, e % 250),
                "seq": e + 1, "in_flight": 1, "queued_prefill_tokens": 0,
                "requests": 1, "prefill_tokens": 0})
        })
        .collect();
    let flood =
        bytes::Bytes::from(serde_json::json!({"origin": 9, "endpoints": endpoints}).to_string());
    const FLOOD: u64 = 1_500;
    for _ in 0..FLOOD {
        bus.publish(subject, flood.clone()).await.unwrap();
    }
    bus.flush().await.unwrap();
    let nats_counters = eventually("drops are counted", || async {
        let c = admin_get(&gw, "/admin/counters").await["nats"].clone();
        (c["slow_consumer"].as_u64().unwrap_or(0) > 0).then_some(c)
    })
    .await;
    let delivered = nats_counters["received"].as_u64().unwrap();
    assert!(delivered < FLOOD, "{nats_counters}");
    // Routing goes on, and the others' news is still applied.
    let url = format!("http://{}", engine.addr);
    let news = serde_json::json!({"origin": 7, "endpoints": [{"url": url, "seq": 1,
        "in_flight": 1, "queued_prefill_tokens": 0, "requests": 1, "prefill_tokens": 0}]})
    .to_string();
    // The buffer may still be draining the flood: retried until applied.
    eventually("the other replica's request counts", || async {
        bus.publish(subject, news.clone().into()).await.unwrap();
        bus.flush().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        (load_at(&gw, &engine).await == (0, 1)).then_some(())
    })
    .await;
    let r = send(&gw, "after");
    received("the request reached the engine", &engine, 1).await;
    gate.open();
    assert_eq!(r.await.unwrap(), Some(200));
}

/// A NATS server that takes smaller messages than the replicas' own bound
/// (`max_payload` 1 KiB here): a heartbeat carrying every endpoint's totals
/// (about 4 KiB for 31 endpoints) is split to the server's limit, so every
/// endpoint is announced and the client refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_split_to_the_servers_max_payload() {
    let gate = Gate::new();
    let engine = held_engine(&gate).await;
    let nats = NatsServer::start_with_max_payload(1024);
    let bus = async_nats::connect(nats.url()).await.unwrap();
    let mut sub = bus.subscribe("kvroute.kv.load").await.unwrap();
    bus.flush().await.unwrap();
    // 30 endpoints nobody serves (health probes are off) and the engine.
    let mut endpoints: Vec<SocketAddr> = closed_ports(30)
        .into_iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect();
    endpoints.push(engine.addr);
    let gw = Gateway::start(&replica(&nats.url(), &endpoints, 60_000));
    let mut announced = std::collections::BTreeSet::new();
    let mut largest = 0;
    let deadline = tokio::time::Instant::now() + WAIT;
    while announced.len() < endpoints.len() {
        let msg = tokio::time::timeout_at(deadline, futures_util::StreamExt::next(&mut sub))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} of {} endpoints announced",
                    announced.len(),
                    endpoints.len()
                )
            })
            .unwrap();
        largest = largest.max(msg.payload.len());
        let batch: Value = serde_json::from_slice(&msg.payload).unwrap();
        for e in batch["endpoints"].as_array().unwrap() {
            announced.insert(e["url"].as_str().unwrap().to_owned());
        }
    }
    println!("REPLICA every endpoint announced in messages of at most {largest} bytes");
    assert!(largest <= 1024, "{largest}");
    let c = admin_get(&gw, "/admin/counters").await["nats"].clone();
    assert_eq!(c["publish_failed"], 0, "{c}");
    assert!(c["published"].as_u64().unwrap() >= 4, "{c}");
}

/// A message crosses the network once per other process: the server sends a
/// connection none of its own messages back, and the routers subscribed
/// through that connection (a rule and the instance it replaces, here two
/// sinks) each get it once from the publishing call. Another process gets
/// it once over NATS, and its messages reach each local router once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_hands_its_own_messages_to_its_routers_once() {
    use kvroute::nats::{NatsOptions, NatsReplicas};
    use kvroute::ReplicaTransport;
    use std::time::Duration;

    let nats = NatsServer::start();
    let bus = NatsReplicas::connect(NatsOptions::new(nats.url()))
        .await
        .unwrap();
    // Each sink records the payloads it was handed.
    type Seen = Arc<parking_lot::Mutex<Vec<bytes::Bytes>>>;
    let seen: Vec<Seen> = (0..2).map(|_| Arc::default()).collect();
    let _subscriptions: Vec<_> = seen
        .iter()
        .map(|s| {
            let s = Arc::clone(s);
            bus.subscribe("pool", Arc::new(move |p| s.lock().push(p)))
                .unwrap()
        })
        .collect();
    let count = |payload: &[u8]| -> Vec<usize> {
        seen.iter()
            .map(|s| s.lock().iter().filter(|p| &p[..] == payload).count())
            .collect()
    };
    let other = async_nats::connect(nats.url()).await.unwrap();
    let mut outside = other.subscribe(bus.subject("pool")).await.unwrap();
    other.flush().await.unwrap();
    // The transport subscribes in the background: an outside message tells
    // when both subscriptions are in place at the server.
    eventually("the outside process's probe reaches both sinks", || async {
        other
            .publish(bus.subject("pool"), "probe".into())
            .await
            .unwrap();
        other.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        count(b"probe").iter().all(|&n| n > 0).then_some(())
    })
    .await;

    bus.publish("pool", "own".into());
    loop {
        let msg = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::StreamExt::next(&mut outside),
        )
        .await
        .expect("the outside process gets the message")
        .expect("subscription open");
        if &msg.payload[..] == b"own" {
            break;
        }
    }
    // An echo would arrive about when the outside copy did: give it time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(b"own"), [1, 1], "each local router once");
    assert_eq!(
        bus.counters().received,
        count(b"probe").iter().sum::<usize>() as u64,
        "nothing but the probes came from the server"
    );

    other
        .publish(bus.subject("pool"), "outside".into())
        .await
        .unwrap();
    other.flush().await.unwrap();
    eventually("the outside message reaches both local routers", || async {
        (count(b"outside") == [1, 1]).then_some(())
    })
    .await;
}
