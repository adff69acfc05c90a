//! kvroute as a dependent crate sees it: this crate is outside the kvroute
//! workspace, depends on `kvroute` by path and has no `[patch]`, so it builds
//! kvroute's ZeroMQ transport exactly as a downstream crate does.
//!
//! Two `kvroute mock-engine` processes (the workspace's binary, named by
//! `KVROUTE_BIN`: a real tokenizer and prefix cache, vLLM KV events over
//! ZeroMQ, `usage.prompt_tokens_details.cached_tokens` in every answer) stand
//! in for the engines. The same chat is picked twice: the second pick is a
//! KV-exact hit on the engine that cached the first, and that engine's
//! receipt equals the prediction. A hostile "engine" then completes the ZMTP
//! handshake as a PUB and declares a 2^40-byte frame: the receive limits of
//! this build drop and count it (without them the decoder's allocation aborts
//! the process), the subscriber dials again and routing goes on.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute::{ApiKind, Backend, KvRouter, Pick};

/// Upper bound of every wait.
const WAIT: Duration = Duration::from_secs(60);
/// What the mock engine hashes with by default.
const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
const MODEL: &str = "qwen3";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_dir() -> PathBuf {
    repo().join("golden/tokenizers/qwen3")
}

/// The workspace's `kvroute` binary; the test fails (never skips) without it.
fn kvroute_bin() -> PathBuf {
    let Some(bin) = std::env::var_os("KVROUTE_BIN") else {
        panic!(
            "KVROUTE_BIN is not set: build the workspace binary (cargo build -p kvroute-gateway) \
             and run with KVROUTE_BIN=$PWD/target/debug/kvroute"
        );
    };
    let bin = PathBuf::from(bin);
    assert!(bin.is_file(), "KVROUTE_BIN={} is not a file", bin.display());
    bin
}

/// One `kvroute mock-engine` on ephemeral loopback ports, killed on drop.
struct MockEngine {
    child: Child,
    http: SocketAddr,
    zmq: u16,
    replay: u16,
}

impl MockEngine {
    fn start() -> MockEngine {
        let mut child = Command::new(kvroute_bin())
            .args([
                "mock-engine",
                "--port",
                "0",
                "--zmq-port",
                "0",
                "--replay-port",
                "0",
            ])
            .args(["--model", MODEL, "--model-dir"])
            .arg(model_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvroute mock-engine");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // "mock-engine: http://127.0.0.1:P zmq=Z replay=R"
        let line = loop {
            match rx.recv_timeout(WAIT) {
                Ok(l) if l.starts_with("mock-engine: http://") => break l,
                Ok(_) => {}
                Err(_) => panic!("kvroute mock-engine printed no start line within {WAIT:?}"),
            }
        };
        let field = |key: &str| -> String {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {line:?}"))
                .to_owned()
        };
        MockEngine {
            http: field("http://").parse().expect("http address"),
            zmq: field("zmq=").parse().expect("zmq port"),
            replay: field("replay=").parse().expect("replay port"),
            child,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// As the engine configures it: PUB bound on every interface, replay ROUTER.
    fn backend(&self) -> Backend {
        Backend::vllm(self.url())
            .events(format!("tcp://*:{}", self.zmq))
            .replay(format!("tcp://127.0.0.1:{}", self.replay))
    }
}

impl Drop for MockEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn router(backends: impl IntoIterator<Item = Backend>) -> KvRouter {
    let mut builder =
        KvRouter::builder(CONTRACT.parse().expect("contract")).model(MODEL, model_dir());
    for backend in backends {
        builder = builder.endpoint(backend);
    }
    builder.spawn().expect("router")
}

/// A chat whose prompt spans several 16-token blocks.
fn chat() -> Bytes {
    let text = "You are a careful assistant for routing. Answer in one sentence. Background: \
                the quick brown fox jumps over the lazy dog, again and again, while the \
                committee discusses routing at length and takes detailed notes.";
    Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
        })
        .to_string(),
    )
}

/// Sends `body` where `pick` says; returns the cached tokens of the receipt.
async fn forward(pick: Pick, body: &Bytes) -> Option<u32> {
    let req = http::Request::post(format!("{}/v1/chat/completions", pick.url()))
        .header("content-type", "application/json")
        .body(Full::new(pick.upstream_body(body)))
        .expect("request");
    let client = Client::builder(TokioExecutor::new()).build_http();
    let resp = client.request(req).await.expect("the engine answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    let (head, incoming) = resp.into_parts();
    let (tx, rx) = mpsc::channel();
    let body = pick.into_body_with(&head.headers, incoming, move |receipt| {
        let _ = tx.send(receipt);
    });
    let answer = body.collect().await.expect("body").to_bytes();
    let receipt = rx.recv().expect("a receipt at the end of the body");
    assert!(receipt.complete);
    let json: serde_json::Value = serde_json::from_slice(&answer).expect("JSON answer");
    assert_eq!(
        receipt.cached_tokens,
        kvroute::receipt::cached_tokens(&json)
    );
    receipt.cached_tokens
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_to_the_cached_prefix_and_drops_an_oversized_zmtp_peer() {
    let engines = [MockEngine::start(), MockEngine::start()];
    let r = router(engines.iter().map(MockEngine::backend));
    for e in &engines {
        // An event published before the subscription reaches the PUB is lost.
        wait_until("the subscriber connected", || {
            r.subscriber_metrics(&e.url()).iter().all(|m| m.connected)
        })
        .await;
    }
    let body = chat();

    let first = r.pick(ApiKind::Chat, &body).await.expect("a pick");
    assert!(first.decision().miss().is_some(), "nothing is cached yet");
    let url = first.url().to_owned();
    assert_eq!(forward(first, &body).await, Some(0));
    wait_until("the engine's BlockStored", || r.blocks(&url) > 0).await;

    let second = r.pick(ApiKind::Chat, &body).await.expect("a pick");
    assert_eq!(second.url(), url, "the engine that cached the first");
    assert_eq!(second.decision().miss(), None, "a KV-exact hit");
    let predicted = second.decision().predicted_cached_tokens(r.block_size());
    assert!(predicted >= 16, "{predicted}");
    let slot = second.endpoint_id().expect("endpoint").index();
    assert_eq!(forward(second, &body).await, Some(predicted));
    let counters = r.counters();
    assert_eq!(counters.endpoints[slot].hits, 1);
    assert_eq!(
        counters.endpoints[slot].delivered_tokens,
        u64::from(predicted)
    );

    // A hostile engine: a router whose only endpoint publishes from our listener.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let events = format!("tcp://*:{}", listener.local_addr().expect("addr").port());
    let hostile_url = format!("http://127.0.0.1:{}", closed_port());
    let hostile = router([Backend::vllm(hostile_url.clone()).events(events)]);
    let attacker = tokio::task::spawn_blocking(move || {
        let mut s = accept(&listener, "the subscriber's dial");
        handshake_as_pub(&mut s);
        // A long data frame declaring 2^40 bytes, no body.
        let mut header = vec![0b0000_0010u8];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let _ = s.write_all(&header);
        assert_closed_by_peer(&mut s);
        // The subscriber keeps following its engine: it dials again.
        drop(accept(&listener, "the redial after the dropped peer"));
    });
    attacker.await.expect("the attack ran");
    wait_until("the dropped peer counted", || {
        hostile
            .subscriber_metrics(&hostile_url)
            .iter()
            .any(|m| m.oversized_peers_dropped == 1)
    })
    .await;
    let m = &hostile.subscriber_metrics(&hostile_url)[0];
    assert!(m.oversized_frames >= 1, "{m:?}");

    // The process survived, and routing goes on.
    let third = r.pick(ApiKind::Chat, &body).await.expect("a pick");
    assert_eq!(third.url(), url);
    assert_eq!(third.decision().miss(), None);
    assert_eq!(forward(third, &body).await, Some(predicted));
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn accept(listener: &TcpListener, what: &str) -> TcpStream {
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + WAIT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).expect("blocking");
                return s;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("no connection for {what}: {e}"),
        }
    }
}

// ZMTP 3.0 (rfc.zeromq.org/spec/23), NULL mechanism, by hand.

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Greeting and READY both ways, as a PUB; the peer's READY must name a SUB.
fn handshake_as_pub(s: &mut TcpStream) {
    s.set_read_timeout(Some(WAIT)).expect("timeout");
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut ready = vec![0b0000_0100u8, u8::try_from(body.len()).expect("short")];
    ready.extend_from_slice(&body);
    s.write_all(&greeting()).expect("greeting");
    s.write_all(&ready).expect("READY");
    let mut peer = [0u8; 64];
    s.read_exact(&mut peer).expect("the subscriber's greeting");
    assert_eq!((peer[0], peer[9]), (0xff, 0x7f));
    let mut header = [0u8; 2];
    s.read_exact(&mut header).expect("the subscriber's READY");
    assert_eq!(header[0], 0b0000_0100, "a short command frame");
    let mut command = vec![0u8; usize::from(header[1])];
    s.read_exact(&mut command).expect("READY body");
    assert!(command.starts_with(b"\x05READY"));
    assert!(command.windows(3).any(|w| w == b"SUB"));
}

/// Reads (the subscription, then nothing) until the subscriber closes the
/// connection; panics if it is still open after [`WAIT`].
fn assert_closed_by_peer(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let deadline = Instant::now() + WAIT;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
        assert!(
            Instant::now() < deadline,
            "the subscriber kept the connection of a peer declaring 2^40 bytes open"
        );
    }
}
