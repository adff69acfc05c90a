//! `kvroute serve` ingest modes end to end over real sockets: re-key contracts
//! (engine keys the gateway cannot reproduce), TensorRT-LLM drains over HTTP,
//! and the subscriber / ingest counters in `/metrics` and `/admin/endpoints`.
//! Mock engines run as `kvroute mock-engine` child processes with the real
//! qwen3 tokenizer on both sides.

mod gateway_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::Value;

/// A `kvroute mock-engine` child process with extra flags, killed on drop.
struct MockEngine {
    child: Child,
    http: SocketAddr,
    zmq: Option<u16>,
    replay: Option<u16>,
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn port_after(line: &str, key: &str) -> Option<u16> {
    let rest = line.split(key).nth(1)?;
    rest.chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

impl MockEngine {
    fn start(flags: &[&str]) -> Self {
        let dir = model_dir();
        let mut args = vec![
            "mock-engine",
            "--port",
            "0",
            "--zmq-port",
            "0",
            "--replay-port",
            "0",
            "--model-dir",
            dir.to_str().unwrap(),
            "--model",
            MODEL,
            "--decode-us-per-token",
            "500",
            "--prefill-step-us",
            "100",
        ];
        args.extend_from_slice(flags);
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mock engine");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + WAIT;
        let line = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = rx.recv_timeout(left).expect("mock-engine start line");
            if line.starts_with("mock-engine:") {
                break line;
            }
        };
        let http = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("bad mock-engine line {line:?}"));
        Self {
            child,
            http,
            zmq: port_after(&line, "zmq="),
            replay: port_after(&line, "replay="),
        }
    }

    /// `[[rules.endpoints]]` for a vLLM engine publishing over ZeroMQ.
    fn vllm_endpoint(&self) -> String {
        let zmq = self.zmq.expect("a ZeroMQ engine");
        let replay = self
            .replay
            .map(|r| format!("replay = \"tcp://127.0.0.1:{r}\"\n"))
            .unwrap_or_default();
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{zmq}\"\n{replay}\n",
            self.http
        )
    }

    /// `[[rules.endpoints]]` for a TensorRT-LLM engine drained over HTTP.
    fn trtllm_endpoint(&self) -> String {
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nengine = \"trtllm\"\ndrain = true\n\n",
            self.http
        )
    }
}

fn rule(contract: &str) -> String {
    format!(
        "[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{contract}\"\n\n"
    )
}

fn config(contract: &str, endpoints: &[String]) -> String {
    format!(
        "{}{}{}",
        config_head("[health]\ninterval_ms = 0\n"),
        rule(contract),
        endpoints.concat()
    )
}

/// The one endpoint index holding blocks, once exactly one does.
async fn single_holder(gw: &Gateway) -> usize {
    eventually("one endpoint holding the prompt", || async {
        let inv = inventory(gw).await;
        let holders: Vec<usize> = (0..inv.len()).filter(|&i| inv[i] > 0).collect();
        (holders.len() == 1).then(|| holders[0])
    })
    .await
}

/// A cold request fills one engine; warm follow-ups must all be KV-exact hits
/// on that holder, confirmed by the engine's own cached-token receipt.
async fn warm_requests_land_on_the_holder(gw: &Gateway, seed: &str) -> usize {
    let p = prompt(seed, 150);
    let (status, cold) = complete(gw, &p, 2).await;
    assert_eq!(status, 200, "{cold}");
    assert_eq!(cached_tokens(&cold), 0, "first request cannot hit: {cold}");
    let holder = single_holder(gw).await;
    let before = counters(gw, "kv").await["hits"][holder].as_u64().unwrap();
    for k in 0..3 {
        let (status, warm) = complete(gw, &format!("{p} follow-up {k}"), 2).await;
        assert_eq!(status, 200, "{warm}");
        assert!(
            cached_tokens(&warm) >= 16,
            "warm request {k} missed the cache: {warm}"
        );
    }
    let after = counters(gw, "kv").await;
    assert_eq!(
        after["hits"][holder].as_u64().unwrap(),
        before + 3,
        "{after}"
    );
    assert_eq!(after["hits"][1 - holder].as_u64().unwrap(), 0, "{after}");
    holder
}

/// The value of the first `/metrics` sample of `name` whose labels contain `with`.
fn sample(metrics: &str, name: &str, with: &str) -> Option<u64> {
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(with))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rekey_rule_routes_engines_whose_keys_it_cannot_reproduce() {
    // The engines hash with a PYTHONHASHSEED the gateway is never told: their
    // block keys are unpredictable, only their token ids are usable.
    let flags = ["--seed", "2718281828"];
    let (a, b) = (MockEngine::start(&flags), MockEngine::start(&flags));
    let gw = Gateway::start(&config(
        "rekey:xxh3_64_chain:block=16:seed=1337",
        &[a.vllm_endpoint(), b.vllm_endpoint()],
    ));
    wait_subscribed(&gw).await;
    let holder = warm_requests_land_on_the_holder(&gw, "rekey").await;

    let eps = endpoints(&gw).await;
    let h = &eps[holder];
    assert_eq!(h["contract_status"], "rekeyed", "{h}");
    assert_eq!(h["ingest"]["key_mode"], "rekey", "{h}");
    assert_eq!(h["ingest"]["rekey_orphan_blocks"], 0, "{h}");
    assert_eq!(h["ingest"]["rekey_untokenized_blocks"], 0, "{h}");
    assert!(h["inventory_blocks"].as_u64().unwrap() > 0, "{h}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_drain_feeds_the_inventory_with_engine_keys() {
    let flags = [
        "--format",
        "trtllm",
        "--hash",
        "trtllm@1.1.0:v1_block_key:block=16",
    ];
    let (a, b) = (MockEngine::start(&flags), MockEngine::start(&flags));
    assert!(a.zmq.is_none() && b.zmq.is_none());
    let gw = Gateway::start(&config(
        "trtllm:v1_block_key:block=16",
        &[a.trtllm_endpoint(), b.trtllm_endpoint()],
    ));
    wait_subscribed(&gw).await;
    let holder = warm_requests_land_on_the_holder(&gw, "trtdrain").await;

    let eps = endpoints(&gw).await;
    let h = &eps[holder];
    let drain = &h["subscribers"][0];
    assert_eq!(drain["transport"], "trtllm_drain", "{h}");
    assert_eq!(
        drain["address"],
        format!(
            "http://{}/kv_cache_events",
            if holder == 0 { a.http } else { b.http }
        ),
        "{h}"
    );
    assert!(drain["polls"].as_u64().unwrap() > 0, "{h}");
    assert!(drain["events_applied"].as_u64().unwrap() > 0, "{h}");
    assert_eq!(
        drain["gaps"], 0,
        "a single consumer sees no event_id gaps: {h}"
    );
    assert_eq!(h["contract_status"], "verified", "{h}");
    let metrics = metrics_text(&gw).await;
    let url = h["url"].as_str().unwrap();
    let polls = sample(
        &metrics,
        "kvroute_subscriber_polls_total",
        &format!("endpoint=\"{url}\",role=\"both\",rank=\"drain\""),
    )
    .expect("drain poller in /metrics");
    assert!(polls > 0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_drain_with_a_rekey_rule() {
    let flags = [
        "--format",
        "trtllm",
        "--hash",
        "trtllm@1.1.0:v1_block_key:block=16",
    ];
    let (a, b) = (MockEngine::start(&flags), MockEngine::start(&flags));
    let gw = Gateway::start(&config(
        "rekey:xxh3_64_chain:block=16:seed=1337",
        &[a.trtllm_endpoint(), b.trtllm_endpoint()],
    ));
    wait_subscribed(&gw).await;
    let holder = warm_requests_land_on_the_holder(&gw, "trtrekey").await;
    let eps = endpoints(&gw).await;
    assert_eq!(eps[holder]["contract_status"], "rekeyed", "{}", eps[holder]);
    assert_eq!(
        eps[holder]["ingest"]["rekey_orphan_blocks"], 0,
        "{}",
        eps[holder]
    );
}

#[test]
fn drain_needs_trtllm_and_trtllm_needs_drain() {
    let dir = tempfile::tempdir().unwrap();
    for (endpoint, field) in [
        (
            "[[rules.endpoints]]\nurl = \"http://127.0.0.1:1\"\nengine = \"vllm\"\ndrain = true\n",
            "drain",
        ),
        (
            "[[rules.endpoints]]\nurl = \"http://127.0.0.1:1\"\nengine = \"trtllm\"\nzmq = \"tcp://*:5557\"\n",
            "zmq",
        ),
    ] {
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            config("trtllm:v1_block_key:block=16", &[endpoint.to_owned()]),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--config", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("endpoints[0].{field}")),
            "{field}: {err}"
        );
    }
}

/// Sends `message` every 50 ms until `/admin/endpoints` shows `done` for the
/// first subscriber (a PUB drops what it sends before the subscription lands).
async fn send_until(
    gw: &Gateway,
    publisher: &mut zeromq::PubSocket,
    message: impl Fn() -> zeromq::ZmqMessage,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    use zeromq::SocketSend;
    let deadline = Instant::now() + WAIT;
    loop {
        publisher.send(message()).await.unwrap();
        let eps = endpoints(gw).await;
        let s = eps[0]["subscribers"][0].clone();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn message(frames: Vec<Vec<u8>>) -> zeromq::ZmqMessage {
    let mut frames = frames.into_iter();
    let mut m = zeromq::ZmqMessage::from(frames.next().unwrap_or_default());
    for f in frames {
        m.push_back(f.into());
    }
    m
}

/// A fake engine: a ZeroMQ PUB the gateway subscribes to, sending a real vLLM
/// batch, garbage, and then restarting its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_frames_and_resume_counters_are_exported() {
    use zeromq::{PubSocket, Socket};

    let upstream = echo_upstream().await;
    let mut publisher = PubSocket::new();
    let bound = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let address = bound.to_string();
    let port = address.rsplit(':').next().unwrap().to_owned();
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(
        &config(
            gateway_support::CONTRACT,
            &[format!(
                "[[rules.endpoints]]\nurl = \"http://{upstream}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{port}\"\n\n"
            )],
        ),
        "warn",
        log.reopen().unwrap(),
    );
    wait_subscribed(&gw).await;

    // A real vLLM 0.33 batch (seq 0) so the ingest has a last batch to resume from.
    let batch = std::fs::read(
        repo().join("golden/vllm-events/v0.33.0/stream/01_store_prompt_two_blocks.msgpack"),
    )
    .unwrap();
    send_until(
        &gw,
        &mut publisher,
        || message(vec![Vec::new(), 0u64.to_be_bytes().to_vec(), batch.clone()]),
        "the batch applied",
        |s| s["events_applied"].as_u64().unwrap_or(0) > 0,
    )
    .await;
    // Two frames (no payload) with a readable sequence number 7: malformed.
    let seen = send_until(
        &gw,
        &mut publisher,
        || message(vec![Vec::new(), 7u64.to_be_bytes().to_vec()]),
        "a malformed frame counted",
        |s| s["malformed_frames"].as_u64().unwrap_or(0) > 0,
    )
    .await;
    assert_eq!(seen["last_rejected_seq"], 7, "{seen}");
    // A flood of garbage is counted exactly but logged at most a burst per
    // window (10 lines per 10 s; a slow run may straddle two windows).
    let flood = 200;
    let before = seen["malformed_frames"].as_u64().unwrap();
    for _ in 0..flood {
        zeromq::SocketSend::send(&mut publisher, message(vec![b"x".to_vec()]))
            .await
            .unwrap();
    }
    eventually("the flood counted", || async {
        let eps = endpoints(&gw).await;
        let n = eps[0]["subscribers"][0]["malformed_frames"]
            .as_u64()
            .unwrap();
        (n >= before + flood).then_some(())
    })
    .await;
    let logged = std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .filter(|l| l.contains("zmq subscriber: message without [topic, seq, payload] dropped"))
        .count();
    assert!(
        (1..=20).contains(&logged),
        "{logged} warning lines for a flood of {flood}"
    );
    // Over the 16 MiB limit, carrying sequence number 9: the peer is dropped
    // and redialled.
    let seen = send_until(
        &gw,
        &mut publisher,
        || {
            message(vec![
                Vec::new(),
                9u64.to_be_bytes().to_vec(),
                vec![0u8; (16 << 20) + 1],
            ])
        },
        "an oversized frame counted",
        |s| s["oversized_frames"].as_u64().unwrap_or(0) > 0,
    )
    .await;
    // Refused at its frame header, before a byte of it is buffered (the
    // ZeroMQ fork's framing limit): its sequence number is never read.
    assert_eq!(seen["last_rejected_seq"], 7, "{seen}");

    // The engine's socket goes away and comes back: the subscriber reconnects.
    // This endpoint has no replay socket, so the reconnect is judged by
    // sequence numbers alone (resuming would wait for a replay that never
    // comes and clear the inventory on the next batch); no resume.
    drop(publisher);
    let mut publisher = PubSocket::new();
    let deadline = Instant::now() + WAIT;
    while publisher.bind(&address).await.is_err() {
        assert!(Instant::now() < deadline, "cannot rebind {address}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let eps = eventually("a reconnect", || async {
        let eps = endpoints(&gw).await;
        (eps[0]["ingest"]["reconnects"].as_u64().unwrap_or(0) > 0).then_some(eps)
    })
    .await;
    assert_eq!(eps[0]["ingest"]["resumes"], 0, "{}", eps[0]);
    assert_eq!(eps[0]["inventory_clears"], 0, "{}", eps[0]);
    let ingest = &eps[0]["ingest"];
    let sub = &eps[0]["subscribers"][0];

    let metrics = metrics_text(&gw).await;
    let labels = format!("endpoint=\"http://{upstream}\",role=\"both\",rank=\"0\"");
    let ep_labels = format!("endpoint=\"http://{upstream}\",role=\"both\"}}");
    for (name, want) in [
        (
            "kvroute_subscriber_oversized_frames_total",
            &sub["oversized_frames"],
        ),
        (
            "kvroute_subscriber_malformed_frames_total",
            &sub["malformed_frames"],
        ),
        (
            "kvroute_subscriber_last_rejected_seq",
            &sub["last_rejected_seq"],
        ),
    ] {
        // Read after the admin snapshot: a counter can only have grown (an
        // oversized message still queued at the publisher may arrive after
        // the redial and be refused again).
        let got = sample(&metrics, name, &labels);
        assert!(
            got.is_some() && got >= want.as_u64(),
            "{name}: {got:?} vs {want}\n{metrics}"
        );
    }
    assert_eq!(
        sample(&metrics, "kvroute_subscriber_last_rejected_seq", &labels),
        Some(7)
    );
    let resumes = sample(&metrics, "kvroute_ingest_resumes_total", &ep_labels).unwrap();
    assert!(resumes >= ingest["resumes"].as_u64().unwrap(), "{metrics}");
    for name in [
        "kvroute_ingest_resumes_verified_total",
        "kvroute_ingest_resume_restarts_total",
    ] {
        assert!(
            sample(&metrics, name, &ep_labels).is_some(),
            "{name}: {metrics}"
        );
    }
    for key in ["resumes_verified", "resume_restarts"] {
        assert!(ingest[key].is_u64(), "{key}: {ingest}");
    }
}
