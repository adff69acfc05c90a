//! Connection hygiene of `kvroute serve`, over real
//! sockets on 127.0.0.1 in front of an in-test echo upstream:
//!
//! - connections that never send a byte, or stop inside the HTTP/2 preface, are
//!   closed after `limits.first_byte_timeout_ms` and counted;
//! - at `limits.max_connections` a new connection sheds the oldest silent one,
//!   so a normal request succeeds while an attacker holds silent connections;
//!   when every open connection has spoken, a new one gets `503` and is
//!   counted; once connections close, normal requests succeed again;
//! - the descriptor headroom is logged at start.

mod gateway_support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use gateway_support::*;

/// A round-robin rule over the echo upstream (no KV events involved).
fn config(echo: SocketAddr, limits: &str) -> String {
    format!(
        "{}[[rules]]\nname = \"rr\"\nmodels = [\"m\"]\ndefault = true\nchoice = \"round_robin\"\n\
         [[rules.endpoints]]\nurl = \"http://{echo}\"\n",
        config_head(&format!("[limits]\n{limits}\n[health]\ninterval_ms = 0\n")),
    )
}

/// One request on a fresh connection (no pooling: the connection closes after).
async fn normal_request(gw: &Gateway) -> u16 {
    let client = reqwest::Client::builder()
        .timeout(WAIT)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    client
        .post(gw.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(r#"{"model": "m", "prompt": "hello", "max_tokens": 1}"#)
        .send()
        .await
        .map_or_else(
            |e| {
                println!("CONN normal request failed: {e:?}");
                0
            },
            |r| r.status().as_u16(),
        )
}

async fn metric(gw: &Gateway, line_prefix: &str) -> u64 {
    let text = metrics_text(gw).await;
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line_prefix:?} in /metrics:\n{text}"))
}

/// Whether the server closed `s` (EOF or reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Sends one keep-alive request on a raw connection and reads the response
/// (headers + `content-length` body); the connection stays open.
fn raw_request(s: &mut TcpStream, path: &str) -> String {
    s.set_read_timeout(Some(WAIT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: keep-alive\r\n\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + WAIT;
    loop {
        let text = String::from_utf8_lossy(&response).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            if response.len() >= end + 4 + len {
                return text;
            }
        }
        assert!(Instant::now() < deadline, "no full response: {text:?}");
        match s.read(&mut buf) {
            Ok(0) => return text,
            Ok(n) => response.extend_from_slice(&buf[..n]),
            Err(e) => panic!("reading the response: {e}; so far {text:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_after_the_first_byte_timeout() {
    let echo = echo_upstream().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(
        &config(echo, "first_byte_timeout_ms = 500\n"),
        "info",
        log.reopen().unwrap(),
    );
    assert_eq!(normal_request(&gw).await, 200);
    let proxy = gw.proxy;
    let held = tokio::task::spawn_blocking(move || {
        let mut held: Vec<TcpStream> = (0..200)
            .map(|_| TcpStream::connect(proxy).unwrap())
            .collect();
        // Stalls inside the HTTP/2 preface: bytes arrived, protocol unknown.
        for prefix in [&b"P"[..], b"PRI * HTTP/2.0\r\n"] {
            let mut s = TcpStream::connect(proxy).unwrap();
            s.write_all(prefix).unwrap();
            held.push(s);
        }
        let started = Instant::now();
        let open: Vec<usize> = held
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| (!closed_within(s, Duration::from_secs(10))).then_some(i))
            .collect();
        (open, started.elapsed())
    });
    let (still_open, took) = held.await.unwrap();
    println!("CONN 202 silent/stalled connections closed within {took:?}");
    assert!(
        still_open.is_empty(),
        "connections {still_open:?} (of 200 silent + 2 preface stalls) still open 10 s after a 500 ms first-byte timeout"
    );
    assert_eq!(
        metric(
            &gw,
            "kvroute_connections_first_byte_timeouts_total{listener=\"proxy\"}"
        )
        .await,
        202
    );
    // The gateway keeps serving.
    assert_eq!(normal_request(&gw).await, 200);
    // A complete HTTP/2 preface passes the guard: the server answers with its
    // SETTINGS frame and the first-byte deadline no longer applies.
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(proxy).unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).unwrap(); // empty SETTINGS
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut frame = [0u8; 9];
        s.read_exact(&mut frame).unwrap();
        assert_eq!(
            frame[3], 4,
            "the server's first HTTP/2 frame is SETTINGS: {frame:?}"
        );
        // It allows one request at a time on the connection, as HTTP/1
        // (SETTINGS_MAX_CONCURRENT_STREAMS, id 3): the connection cap bounds
        // requests in flight.
        let len = usize::from(frame[0]) << 16 | usize::from(frame[1]) << 8 | usize::from(frame[2]);
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).unwrap();
        let streams = payload
            .chunks_exact(6)
            .find(|e| e[0..2] == [0, 3])
            .map(|e| u32::from_be_bytes([e[2], e[3], e[4], e[5]]));
        assert_eq!(streams, Some(1), "settings: {payload:?}");
        assert!(
            !closed_within(&mut s, Duration::from_millis(1500)),
            "an HTTP/2 connection past its preface is not cut by the first-byte deadline"
        );
    })
    .await
    .unwrap();
    let text = std::fs::read_to_string(log.path()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("descriptor headroom"))
        .unwrap_or_else(|| panic!("no descriptor headroom line in the log:\n{text}"));
    assert!(
        line.contains("soft_nofile") && line.contains("effective_max_connections"),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_silent_connections_are_shed_and_talkers_refused() {
    const CAP: usize = 20;
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(
        echo,
        &format!(
            "max_connections = {CAP}\nfirst_byte_timeout_ms = 60000\nheader_read_timeout_ms = 60000\n"
        ),
    ));
    let open_gauge = "kvroute_connections_open{listener=\"proxy\"}";
    let proxy = gw.proxy;

    // An attacker fills the cap with silent connections.
    let mut silent: Vec<TcpStream> = (0..CAP)
        .map(|_| TcpStream::connect(proxy).unwrap())
        .collect();
    eventually("the silent connections accepted", || async {
        (metric(&gw, open_gauge).await == CAP as u64).then_some(())
    })
    .await;
    // A normal request still succeeds: the oldest silent connection is shed.
    assert_eq!(normal_request(&gw).await, 200);
    assert_eq!(
        metric(&gw, "kvroute_connections_shed_total{listener=\"proxy\"}").await,
        1
    );
    let oldest = silent.remove(0);
    let mut oldest = oldest;
    assert!(
        tokio::task::spawn_blocking(move || closed_within(&mut oldest, Duration::from_secs(10)))
            .await
            .unwrap(),
        "the oldest silent connection was shed"
    );
    drop(silent);
    eventually("the silent connections gone", || async {
        (metric(&gw, open_gauge).await == 0).then_some(())
    })
    .await;

    // Clients that have spoken are never shed: with CAP of them open, a new
    // connection is refused with a 503.
    let refused = tokio::task::spawn_blocking(move || {
        let talkers: Vec<TcpStream> = (0..CAP)
            .map(|_| {
                let mut s = TcpStream::connect(proxy).unwrap();
                let r = raw_request(&mut s, "/v1/models");
                assert!(r.starts_with("HTTP/1.1 200"), "{r}");
                s
            })
            .collect();
        let mut extra = TcpStream::connect(proxy).unwrap();
        let answer = raw_request(&mut extra, "/v1/models");
        (talkers, answer)
    });
    let (talkers, answer) = refused.await.unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 503") && answer.contains("connection limit reached"),
        "{answer}"
    );
    assert_eq!(
        metric(&gw, "kvroute_connections_refused_total{listener=\"proxy\"}").await,
        1
    );
    // The admin API has its own cap: still reachable.
    assert_eq!(metric(&gw, open_gauge).await, CAP as u64);
    // Once they leave, normal requests succeed again.
    drop(talkers);
    eventually("the talkers gone", || async {
        (metric(&gw, open_gauge).await == 0).then_some(())
    })
    .await;
    assert_eq!(normal_request(&gw).await, 200);
}

/// Waits until `gw` has counted one write stall and released the endpoint's
/// load charge.
async fn stall_counted_and_released(gw: &Gateway) {
    eventually("the stall is counted and the charge released", || async {
        let stalls = metric(
            gw,
            "kvroute_connections_write_stalls_total{listener=\"proxy\"}",
        )
        .await;
        let eps = endpoints(gw).await;
        (stalls == 1 && eps[0]["in_flight"] == 0).then_some(())
    })
    .await;
}

/// An engine stand-in answering every request with the stream `chunks`
/// makes, as server-sent events.
async fn sse_upstream<F, S>(chunks: F) -> SocketAddr
where
    F: Fn() -> S + Clone + Send + Sync + 'static,
    S: futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static,
{
    let app = axum::Router::new().fallback(move || {
        let chunks = chunks.clone();
        async move {
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from_stream(chunks()))
                .unwrap()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    upstream
}

/// 256 MiB in 64 KiB chunks, as fast as they are taken.
fn endless() -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> {
    let chunk = bytes::Bytes::from(vec![b'x'; 64 << 10]);
    futures_util::stream::iter((0..4096).map(move |_| Ok(chunk.clone())))
}

/// The client side of one HTTP/2 connection: the request handle (dropping
/// it lets the client close the connection once its streams end), the
/// response (head read, body not) and the connection's task.
type H2Client = (
    hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    http::Response<hyper::body::Incoming>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
);

/// A streamed completion over a fresh HTTP/2 connection to `gw`.
async fn h2_streamed_request(gw: &Gateway) -> H2Client {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let stream = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let body = r#"{"model": "m", "prompt": "hello", "stream": true}"#;
    let req = http::Request::post(format!("http://{}/v1/completions", gw.proxy))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    (send, resp, conn)
}

/// A client that stops reading a large streamed answer (its TCP window shut)
/// is dropped once it has accepted no bytes for the write-stall timeout
/// (`limits.upstream_idle_timeout_ms`): its connection, upstream request and
/// load charge are released, counted in `kvroute_connections_write_stalls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_dropped_after_the_write_stall_timeout() {
    let upstream = sse_upstream(endless).await;
    let gw = Gateway::start(&config(upstream, "upstream_idle_timeout_ms = 800"));
    let proxy = gw.proxy;
    // Sends a streamed request and reads nothing until the gateway has
    // counted the stall; then reads what is left.
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let client = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(proxy).unwrap();
        let body = r#"{"model": "m", "prompt": "hello", "stream": true}"#;
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let _ = wait.recv_timeout(WAIT);
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut total = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
        total
    });
    stall_counted_and_released(&gw).await;
    go.send(()).unwrap();
    // What was buffered before the cut, far short of the 256 MiB answer.
    let read = client.await.unwrap();
    assert!(
        read < 128 << 20,
        "read {read} bytes: the stream was not cut"
    );
}

/// An HTTP/2 connection is closed (GOAWAY) once it has had no request in
/// flight for `limits.header_read_timeout_ms`, as hyper closes an idle
/// HTTP/1 keep-alive connection, and counted; a response streaming for
/// longer than that timeout is not cut. Otherwise connections that spoke
/// once and sat idle would hold slots of the connection cap forever
/// (keep-alive pings are answered by any live client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_after_the_header_timeout() {
    use http_body_util::BodyExt;
    // An engine stand-in streaming 5 chunks 400 ms apart (1.6 s in all).
    let upstream = sse_upstream(|| {
        futures_util::StreamExt::then(futures_util::stream::iter(0..5), |i| async move {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            Ok::<_, std::io::Error>(bytes::Bytes::from(format!("data: {i}\n\n")))
        })
    })
    .await;
    let gw = Gateway::start(&config(upstream, "header_read_timeout_ms = 700"));
    let sent = Instant::now();
    let (_send, resp, conn) = h2_streamed_request(&gw).await;
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&text).contains("data: 4"),
        "a response streaming past the idle timeout is whole: {text:?}"
    );
    tokio::time::timeout(WAIT, conn)
        .await
        .expect("the idle HTTP/2 connection is closed")
        .unwrap()
        .unwrap();
    // Not before the 1.6 s answer plus the 0.7 s of idleness (a bound the
    // machine's load cannot break).
    let took = sent.elapsed();
    println!("CONN idle HTTP/2 connection closed {took:?} after its request was sent");
    assert!(took >= Duration::from_millis(2200), "closed after {took:?}");
    assert_eq!(
        metric(
            &gw,
            "kvroute_connections_idle_closed_total{listener=\"proxy\"}"
        )
        .await,
        1
    );
}

/// An HTTP/2 client that grants a stream 1 byte of window and never more:
/// an answer the gateway writes itself (here a 502: the engine is down) is
/// handed to hyper whole, so its request ends, but its bytes wait in
/// HTTP/2's send queue; the connection the idle timeout then closes never
/// finishes closing and would hold a slot of the connection cap. It is
/// dropped a write-stall timeout after its GOAWAY, counted as a write stall,
/// not as an idle close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connection_stuck_after_its_goaway_is_dropped() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    // An engine address nothing listens on.
    let down = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let gw = Gateway::start(&config(
        down,
        "header_read_timeout_ms = 300\nupstream_idle_timeout_ms = 600",
    ));
    let stream = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(1)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let body = r#"{"model": "m", "prompt": "hello"}"#;
    let req = http::Request::post(format!("http://{}/v1/completions", gw.proxy))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert!(resp.status().is_server_error(), "{}", resp.status());
    // The body is never read: no window goes back.
    tokio::time::timeout(WAIT, conn)
        .await
        .expect("the stuck connection is dropped")
        .ok();
    assert_eq!(
        metric(
            &gw,
            "kvroute_connections_write_stalls_total{listener=\"proxy\"}"
        )
        .await,
        1
    );
    assert_eq!(
        metric(
            &gw,
            "kvroute_connections_idle_closed_total{listener=\"proxy\"}"
        )
        .await,
        0
    );
    drop(resp);
}

/// A client that goes away while its request waits for the engine's
/// headers (the handler is dropped) is counted as `client_gone`: every
/// request the gateway took counts under some outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_before_the_answer_is_counted() {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let app = axum::Router::new().fallback(|| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        "late"
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let gw = Gateway::start(&config(upstream, ""));
    let stream = tokio::net::TcpStream::connect(gw.proxy).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let body = r#"{"model": "m", "prompt": "hello"}"#;
    let req = http::Request::post(format!("http://{}/v1/completions", gw.proxy))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    // Given up on (the stream reset) while the engine holds its headers.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), send.send_request(req))
            .await
            .is_err()
    );
    let gone = "kvroute_requests_total{rule=\"rr\",outcome=\"client_gone\"}";
    let deadline = Instant::now() + WAIT;
    loop {
        let text = metrics_text(&gw).await;
        let n: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix(gone))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if n == 1 {
            // Counted once, and under no other outcome.
            let others: u64 = text
                .lines()
                .filter(|l| {
                    l.starts_with("kvroute_requests_total{rule=\"rr\"") && !l.starts_with(gone)
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            assert_eq!(others, 0, "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "no client_gone count:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The HTTP/2 form of the write stall: a client that stops reading a
/// streamed response grants no more window, so hyper holds the chunk it took
/// and stops polling the body (no socket write waits, the upstream idle timer
/// is never polled). The connection is closed after the write-stall timeout
/// all the same, releasing the upstream request and the load charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_grants_no_window_is_dropped_after_the_write_stall_timeout() {
    let upstream = sse_upstream(endless).await;
    let gw = Gateway::start(&config(upstream, "upstream_idle_timeout_ms = 800"));
    // The answer's head arrives; its body is never read, so its window is
    // never given back.
    let (_send, resp, conn) = h2_streamed_request(&gw).await;
    stall_counted_and_released(&gw).await;
    tokio::time::timeout(WAIT, conn)
        .await
        .expect("the stalled connection is closed")
        .ok();
    drop(resp);
}

/// A client that closes its connection half way through its request body
/// is counted as `client_gone`, not as a malformed request (`rejected`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_body_is_counted_as_gone() {
    let app = axum::Router::new().fallback(|| async { "ok" });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let gw = Gateway::start(&config(upstream, ""));
    {
        let mut s = TcpStream::connect(gw.proxy).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: 1000\r\n\r\n{{\"model\": "
        )
        .unwrap();
        s.flush().unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let count = |text: &str, outcome: &str| -> u64 {
        text.lines()
            .filter(|l| {
                l.starts_with("kvroute_requests_total{")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let deadline = Instant::now() + WAIT;
    loop {
        let text = metrics_text(&gw).await;
        if count(&text, "client_gone") == 1 {
            assert_eq!(count(&text, "rejected"), 0, "{text}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no client_gone count:\n{}",
            text.lines()
                .filter(|l| l.starts_with("kvroute_requests_total"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
