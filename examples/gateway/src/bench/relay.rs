//! A loopback TCP relay in front of one engine that notes when the first byte
//! of each request reaches it: what `bench gateway --fresh` measures the
//! gateway's added latency before the first upstream byte with.
//!
//! HTTP/1.1 without pipelining sends a connection's next request only after
//! the previous answer, so the first client-to-engine bytes after engine
//! bytes (or on a new connection) start a request. The request is named by
//! the bench's `x-bench-id` header, which the gateway forwards; requests
//! without it (load polls) are not noted.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Request header naming a bench request.
pub const ID_HEADER: &str = "x-bench-id";

/// Most request bytes looked through for [`ID_HEADER`] (the head is far
/// shorter; the body is not searched).
const HEAD_LIMIT: usize = 16 << 10;

/// Request id → when its first byte reached the relay.
pub type Arrivals = Arc<Mutex<HashMap<u64, Instant>>>;

/// A running relay.
pub struct Relay {
    /// Where clients connect.
    pub addr: SocketAddr,
    /// First-byte times of the requests seen so far.
    pub arrivals: Arrivals,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// Listens on an ephemeral 127.0.0.1 port and relays to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let arrivals: Arrivals = Arc::default();
        let noted = Arc::clone(&arrivals);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let noted = Arc::clone(&noted);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(client, server, noted).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            arrivals,
            task,
        })
    }
}

/// The value of `x-bench-id` in a request head, if complete in `head`.
fn bench_id(head: &[u8]) -> Option<u64> {
    let name = ID_HEADER.as_bytes();
    let at = head
        .windows(name.len() + 1)
        .position(|w| w[..name.len()].eq_ignore_ascii_case(name) && w[name.len()] == b':')?;
    let rest = head.get(at + name.len() + 1..)?;
    let end = rest.iter().position(|&b| b == b'\r')?;
    std::str::from_utf8(rest.get(..end)?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

async fn relay(client: TcpStream, server: TcpStream, arrivals: Arrivals) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Set by engine bytes: the next client bytes start a new request.
    let fresh = Arc::new(AtomicBool::new(true));
    let answered = Arc::clone(&fresh);
    let up = async move {
        let mut buf = vec![0u8; 64 << 10];
        let mut head: Option<(Instant, Vec<u8>)> = None;
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = buf.get(..n).unwrap_or_default();
            if fresh.swap(false, Ordering::AcqRel) {
                head = Some((Instant::now(), Vec::new()));
            }
            if let Some((at, bytes)) = &mut head {
                bytes.extend_from_slice(
                    chunk
                        .get(..HEAD_LIMIT.saturating_sub(bytes.len()).min(n))
                        .unwrap_or_default(),
                );
                if let Some(id) = bench_id(bytes) {
                    arrivals.lock().insert(id, *at);
                    head = None;
                } else if bytes.len() >= HEAD_LIMIT || bytes.windows(4).any(|w| w == b"\r\n\r\n") {
                    head = None;
                }
            }
            if sw.write_all(chunk).await.is_err() {
                break;
            }
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            answered.store(true, Ordering::Release);
            if cw
                .write_all(buf.get(..n).unwrap_or_default())
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = cw.shutdown().await;
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bench_id_is_read_from_a_complete_header_line_only() {
        let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nX-Bench-Id: 42\r\n\r\n{}";
        assert_eq!(bench_id(head), Some(42));
        assert_eq!(bench_id(b"POST / HTTP/1.1\r\nx-bench-id: 4"), None);
        assert_eq!(bench_id(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"), None);
    }

    #[tokio::test]
    async fn the_first_byte_of_each_request_on_a_kept_alive_connection_is_noted() {
        // An upstream that answers each request head with one short line.
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up_addr = upstream.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = upstream.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            for _ in 0..2 {
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0);
                    got.extend_from_slice(&buf[..n]);
                }
                s.write_all(b"ok\n").await.unwrap();
            }
        });
        let relay = Relay::start(up_addr).await.unwrap();
        let mut c = TcpStream::connect(relay.addr).await.unwrap();
        let mut buf = [0u8; 16];
        for id in [7u64, 8] {
            let sent = Instant::now();
            c.write_all(format!("POST / HTTP/1.1\r\nx-bench-id: {id}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let n = c.read(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], b"ok\n");
            let at = relay.arrivals.lock().get(&id).copied();
            assert!(at.is_some_and(|t| t >= sent), "{id}: {at:?}");
        }
        assert_eq!(relay.arrivals.lock().len(), 2);
    }
}
