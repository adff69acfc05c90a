//! What the gateway logs when an upstream fails after the request reached
//! it: the failure once, as what it is, and no retry (the engine may have
//! acted on the request). Read from the real binary's log.

mod gateway_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gateway_support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reads each request's head and answers with `reply`, then closes the
/// connection; counts the requests.
async fn closing_upstream(reply: &'static [u8]) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The request head (the body follows it; its bytes do not matter).
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = s.write_all(reply).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (addr, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_mid_response_is_logged_once_and_not_retried() {
    // Closes inside the status line, and inside the body.
    let (mid_head, head_seen) = closing_upstream(b"HTTP/1.1 200 OK\r\nContent-Ty").await;
    let (mid_body, body_seen) = closing_upstream(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"partial\":",
    )
    .await;
    let (good, good_seen) = closing_upstream(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    let mut toml = config_head("[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n");
    toml.push_str(
        "[[rules]]\nname = \"rr\"\ndefault = true\nchoice = \"round_robin\"\nselector = \"round_robin\"\n\n",
    );
    for e in [mid_head, good, mid_body] {
        toml.push_str(&format!("[[rules.endpoints]]\nurl = \"http://{e}\"\n\n"));
    }
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(&toml, "info", log.reopen().unwrap());
    eventually("ready", || async {
        let r = client().get(gw.admin_url("/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    let mut outcomes = Vec::new();
    for i in 0..3 {
        let body = serde_json::json!({"model": MODEL, "prompt": format!("p{i}"), "max_tokens": 1});
        let r = client()
            .post(gw.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        outcomes.push((status, r.bytes().await.is_ok()));
    }
    outcomes.sort_unstable();
    // 502 from the status-line cut; 200 with a body error from the body cut;
    // 200 whole from the good one.
    assert_eq!(
        outcomes,
        vec![(200, false), (200, true), (502, true)],
        "{outcomes:?}"
    );
    assert_eq!(
        [&head_seen, &good_seen, &body_seen].map(|c| c.load(Ordering::SeqCst)),
        [1, 1, 1],
        "each request reached one upstream once: nothing retried"
    );
    let text = eventually("the failures logged", || async {
        let text = std::fs::read_to_string(log.path()).unwrap();
        (text.contains("upstream failed") && text.contains("upstream body failed mid-stream"))
            .then_some(text)
    })
    .await;
    let lines = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(lines("upstream failed"), 1, "{text}");
    assert_eq!(lines("upstream body failed mid-stream"), 1, "{text}");
    assert_eq!(lines("retrying elsewhere"), 0, "{text}");
    assert_eq!(lines("connect failed"), 0, "{text}");
    let failed = text
        .lines()
        .find(|l| l.contains("upstream failed"))
        .unwrap_or_default();
    assert!(failed.contains(&mid_head.to_string()), "{failed}");
}
