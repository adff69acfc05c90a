//! The pingora embedding example routing real engines: vLLM stand-ins (vLLM
//! 0.33.0's own KV-cache code) behind the example's pingora server on
//! 127.0.0.1, run in-process by pingora's own `Server`.

use kvroute_testkit as support;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::Full;
use kvroute::{Backend, KvRouter, SelectorKind};
use pingora_core::server::{RunArgs, ShutdownSignal, ShutdownSignalWatch};
use support::*;

/// Never asks pingora to stop: its threads end with the test process.
struct Never;

#[async_trait::async_trait]
impl ShutdownSignalWatch for Never {
    async fn recv(&self) -> ShutdownSignal {
        std::future::pending().await
    }
}

/// Serves `router` through the example's pingora server; its address.
async fn serve(router: &KvRouter) -> String {
    let addr = format!("127.0.0.1:{}", closed_port());
    let server = kvroute_embed_pingora::server(router.clone(), &addr).expect("pingora server");
    std::thread::spawn(move || {
        server.run(RunArgs {
            shutdown_signal: Box::new(Never),
        })
    });
    listening(&addr).await;
    addr
}

async fn listening(addr: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{addr} never listened"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn router(engines: &[&Standin], fallback: Option<SelectorKind>) -> KvRouter {
    let mut b = KvRouter::builder(CONTRACT.parse().unwrap()).model(MODEL, model_dir());
    for e in engines {
        b = b.endpoint(e.backend());
    }
    if let Some(f) = fallback {
        b = b.fallback(f);
    }
    b.spawn().unwrap()
}

/// Sends `body` to `/v1/chat/completions` through the proxy: the status, the
/// endpoint the proxy named, and the body.
async fn send<B>(proxy: &str, body: B) -> (http::StatusCode, String, Bytes)
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    // Bounded: a body the proxy forwards short leaves the engine waiting.
    let resp = tokio::time::timeout(WAIT, client.request(req))
        .await
        .expect("the proxy answers in time")
        .expect("proxy answers");
    let endpoint = resp
        .headers()
        .get("x-kvroute-endpoint")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let status = resp.status();
    let body = tokio::time::timeout(WAIT, read_all(resp.into_body()))
        .await
        .expect("the whole answer in time");
    (status, endpoint, body)
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

/// The receipt of an SSE answer, read line by line (independently of the
/// proxy's scanner).
fn sse_cached_tokens(body: &[u8]) -> Option<u32> {
    String::from_utf8_lossy(body)
        .lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data: "))
        .find_map(|d| {
            let v: serde_json::Value = serde_json::from_str(d).ok()?;
            kvroute::receipt::cached_tokens(&v)
        })
}

/// The second identical chat, streamed this time, is decided as a KV-exact
/// hit on the engine that cached the first; the engine's own receipt in the
/// stream (there only because the proxy forwarded the rewritten body, with
/// `include_usage` and its new length) equals the predicted tokens, and the
/// proxy recorded it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_chat_twice_hits_the_engine_that_cached_it() {
    let engines = [Standin::start(), Standin::start()];
    let router = router(&[&engines[0], &engines[1]], None);
    let proxy = serve(&router).await;

    let (status, first, body) = send(&proxy, Full::new(chat("pingora", false))).await;
    assert!(status.is_success(), "{status}");
    assert_eq!(kvroute::receipt::cached_tokens(&json(&body)), Some(0));
    wait_until("the first engine's blocks", || router.blocks(&first) > 0).await;
    let before = router.counters();

    let (status, second, body) = send(&proxy, Full::new(chat("pingora", true))).await;
    assert!(status.is_success(), "{status}");
    assert_eq!(second, first);
    let cached = sse_cached_tokens(&body).expect("usage in the stream");
    assert!(cached >= 16, "{}", String::from_utf8_lossy(&body));
    let slot = router.endpoint_id(&second).unwrap().index();
    // The receipt is recorded in `logging`, just after the last byte is sent.
    wait_until("the receipt", || {
        router.counters().endpoints[slot].receipts > before.endpoints[slot].receipts
    })
    .await;
    let after = router.counters();
    let (b, a) = (&before.endpoints[slot], &after.endpoints[slot]);
    assert_eq!(a.hits - b.hits, 1, "a KV-exact hit");
    assert_eq!(a.predicted_tokens - b.predicted_tokens, u64::from(cached));
    assert_eq!(a.delivered_tokens - b.delivered_tokens, u64::from(cached));
    assert_eq!(router.in_flight(&second), 0);
}

/// Round robin sends each fresh prompt to the dead endpoint first: pingora's
/// connect error goes through `fail_to_connect`, the router's retry names
/// the live engine, and both answers arrive from it with their receipts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_endpoint_is_retried_on_the_other() {
    let engine = Standin::start();
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let router = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(dead.clone()))
        .endpoint(engine.backend())
        .fallback(SelectorKind::RoundRobin)
        .spawn()
        .unwrap();
    let proxy = serve(&router).await;
    for topic in ["first topic", "second topic"] {
        let (status, endpoint, body) = send(&proxy, Full::new(chat(topic, false))).await;
        assert!(status.is_success(), "{status}");
        assert_eq!(endpoint, engine.url());
        assert_eq!(kvroute::receipt::cached_tokens(&json(&body)), Some(0));
    }
    let live = router.endpoint_id(&engine.url()).unwrap().index();
    wait_until("both receipts", || {
        router.counters().endpoints[live].receipts == 2
    })
    .await;
    assert_eq!(router.counters().retries, 2);
    assert_eq!(
        (router.in_flight(&dead), router.in_flight(&engine.url())),
        (0, 0)
    );
}

/// Every endpoint refuses: pingora answers 502 once the router has none
/// left, and nothing stays charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_live_endpoint_is_a_bad_gateway() {
    let dead: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let router = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(dead[0].clone()))
        .endpoint(Backend::vllm(dead[1].clone()))
        .spawn()
        .unwrap();
    let proxy = serve(&router).await;
    let (status, _, _) = send(&proxy, Full::new(chat("nobody", false))).await;
    assert_eq!(status, http::StatusCode::BAD_GATEWAY);
    assert_eq!(router.counters().retries, 2);
    assert_eq!(
        (router.in_flight(&dead[0]), router.in_flight(&dead[1])),
        (0, 0)
    );
}

/// A body in chunks of unknown total length (hyper sends it chunked).
struct Chunked(VecDeque<Bytes>);

impl Body for Chunked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

/// `chat` padded with JSON whitespace to `len` bytes: the same request.
fn padded(len: usize) -> Bytes {
    let mut v = chat("a long body", false).to_vec();
    v.resize(len, b' ');
    Bytes::from(v)
}

/// Bodies past pingora's 64 KiB retry buffer: with `Content-Length` the
/// engine gets the whole body (and answers it), also on the retry after a
/// dead endpoint; chunked, the proxy refuses it with 413 rather than forward
/// a truncated body. A small chunked body is forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_past_the_retry_buffer() {
    let engine = Standin::start();
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let router = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(dead))
        .endpoint(engine.backend())
        .fallback(SelectorKind::RoundRobin)
        .spawn()
        .unwrap();
    let proxy = serve(&router).await;

    let big = padded(300 << 10);
    let (status, endpoint, body) = send(&proxy, Full::new(big.clone())).await;
    assert!(
        status.is_success(),
        "{status} {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(endpoint, engine.url());
    assert_eq!(kvroute::receipt::cached_tokens(&json(&body)), Some(0));
    assert_eq!(
        router.counters().retries,
        1,
        "the first went to the dead one"
    );

    let halves = VecDeque::from([big.slice(..150 << 10), big.slice(150 << 10..)]);
    let (status, _, _) = send(&proxy, Chunked(halves)).await;
    assert_eq!(status, http::StatusCode::PAYLOAD_TOO_LARGE);

    let small = chat("a chunked body", false);
    let halves = VecDeque::from([small.slice(..40), small.slice(40..)]);
    let (status, _, body) = send(&proxy, Chunked(halves)).await;
    assert!(
        status.is_success(),
        "{status} {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(kvroute::receipt::cached_tokens(&json(&body)), Some(0));
}

/// A client that goes away mid-stream: pingora ends the request, `logging`
/// drops the pick, and the engine's load charge ends without a receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_ends_the_load_charge() {
    let engine = Standin::start();
    let router = router(&[&engine], None);
    let proxy = serve(&router).await;
    let mut v = json(&chat("a long answer", true));
    v["max_tokens"] = 3000.into();
    let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .unwrap();
    let mut resp = client().request(req).await.expect("proxy answers");
    assert!(resp.status().is_success());
    let first = http_body_util::BodyExt::frame(resp.body_mut()).await;
    assert!(first.is_some_and(|f| f.is_ok()), "the stream started");
    assert_eq!(router.in_flight(&engine.url()), 1, "still streaming");
    drop(resp);
    wait_until("the charge to end", || router.in_flight(&engine.url()) == 0).await;
    assert_eq!(router.counters().endpoints[0].receipts, 0);
}

/// The example program itself (arguments, its own runtime for the router,
/// `run_forever`) proxies to an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_binary_serves() {
    let engine = Standin::start();
    let listen = format!("127.0.0.1:{}", closed_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_embed_pingora"))
        .arg(&listen)
        .arg(CONTRACT)
        .arg(format!("{MODEL}={}", model_dir().display()))
        .arg(format!(
            "{},tcp://*:{},tcp://127.0.0.1:{}",
            engine.url(),
            engine.zmq,
            engine.replay
        ))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn embed_pingora");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), format!("embed_pingora: serving on {listen}"));
    listening(&listen).await;
    let (status, endpoint, body) = send(&listen, Full::new(chat("the binary", false))).await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(status.is_success(), "{status}");
    assert_eq!(endpoint, engine.url());
    assert_eq!(kvroute::receipt::cached_tokens(&json(&body)), Some(0));
}
