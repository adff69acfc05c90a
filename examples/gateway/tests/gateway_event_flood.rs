//! An event flood at gateway level: a real pyzmq/libzmq publisher
//! (`tests/python/kv_fault_publisher.py` from the repo's `.venv`) sends 50 000
//! undecodable `[topic, seq, payload]` messages to a running `kvroute serve`.
//! The gateway must count every one exactly on `/metrics`, keep its log
//! rate-limited (before the fix: 50 010 WARN lines, 11.4 MB in 3 s), and serve
//! a normal request in the middle of the flood.

mod gateway_support;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use gateway_support::*;

/// Messages per half of the flood.
const HALF: u64 = 25_000;

/// WARN lines allowed for the whole flood: the subscriber logs the first 10
/// bad messages of each 10 s window and one summary line per window; the rest
/// of the gateway logs a few lines at start. 50 000 lines before the fix.
const MAX_WARN_LINES: usize = 100;

/// The publisher, killed on drop.
struct Publisher {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Publisher {
    /// Binds an XPUB on 127.0.0.1:`port` (as an engine with `tcp://*:port`),
    /// waits for the gateway's subscription, sends `HALF` garbage messages,
    /// waits for a stdin line, sends `HALF` more.
    fn start(port: u16) -> Self {
        let script = format!(
            r#"[{{"op": "wait_subscriber", "timeout_s": 60}},
                {{"op": "garbage", "count": {HALF}}},
                {{"op": "wait_stdin"}},
                {{"op": "garbage", "count": {HALF}}},
                {{"op": "serve", "ms": 200}}]"#
        );
        let mut child = Command::new(venv_python())
            .arg(repo().join("tests/python/kv_fault_publisher.py"))
            .args(["--endpoint", &format!("tcp://127.0.0.1:{port}")])
            .args([
                "--socket",
                "xpub",
                "--watchdog-s",
                "300",
                "--script",
                &script,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kv_fault_publisher.py");
        let stdin = child.stdin.take();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines: rx,
        }
    }

    /// Blocks until a stdout line starts with `prefix` (at most `WAIT`).
    fn until(&self, prefix: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("publisher printed no {prefix:?} within {WAIT:?}"));
            assert!(!line.starts_with("ERROR"), "publisher: {line}");
            if line.starts_with(prefix) {
                return;
            }
        }
    }

    fn go_on(&mut self) {
        let stdin = self.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }
}

fn config(echo: SocketAddr, zmq: u16) -> String {
    format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\n\
         [[rules.endpoints]]\nurl = \"http://{echo}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{zmq}\"\n\n",
        config_head("[health]\ninterval_ms = 0\n"),
    )
}

/// Sum of `kvroute_subscriber_decode_errors_total` over its label sets.
async fn decode_errors(gw: &Gateway) -> u64 {
    let text = metrics_text(gw).await;
    text.lines()
        .filter(|l| l.starts_with("kvroute_subscriber_decode_errors_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

async fn wait_decode_errors(gw: &Gateway, want: u64) {
    eventually(&format!("decode_errors = {want}"), || async {
        let n = decode_errors(gw).await;
        assert!(n <= want, "{n} decode errors counted, {want} sent");
        (n == want).then_some(())
    })
    .await;
}

/// Log lines at WARN (ANSI colour codes stripped).
fn warn_lines(path: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let mut out = String::new();
            let mut esc = false;
            for c in l.chars() {
                match (esc, c) {
                    (false, '\u{1b}') => esc = true,
                    (true, 'm') => esc = false,
                    (true, _) => {}
                    (false, c) => out.push(c),
                }
            }
            out
        })
        .filter(|l| l.contains("WARN"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_thousand_undecodable_payloads_are_counted_exactly_and_logged_sparingly() {
    let echo = echo_upstream().await;
    let zmq = closed_port();
    let mut publisher = Publisher::start(zmq);
    publisher.until("READY");
    let log = tempfile::NamedTempFile::new().unwrap();
    let gw = Gateway::start_logged(&config(echo, zmq), "info", log.reopen().unwrap());
    let started = Instant::now();

    // First half, then the flood pauses (the publisher waits on its stdin).
    publisher.until(&format!("SENT_BAD seq={}", HALF - 1));
    wait_decode_errors(&gw, HALF).await;

    // In the middle of the flood a normal request is routed and answered.
    let (status, v) = complete(&gw, &prompt("mid-flood", 40), 1).await;
    assert_eq!(status, 200, "{v}");

    publisher.go_on();
    publisher.until(&format!("SENT_BAD seq={}", 2 * HALF - 1));
    publisher.until("DONE");
    wait_decode_errors(&gw, 2 * HALF).await;
    let elapsed = started.elapsed();

    let (status, v) = complete(&gw, &prompt("after-flood", 40), 1).await;
    assert_eq!(status, 200, "{v}");

    let warns = warn_lines(log.path());
    let log_bytes = std::fs::metadata(log.path()).map_or(0, |m| m.len());
    let undecodable = warns
        .iter()
        .filter(|l| l.contains("undecodable KV event payload dropped"))
        .count();
    eprintln!(
        "attack 10: {} undecodable messages in {elapsed:.1?}: decode_errors = {}, {} WARN lines \
         ({undecodable} per-message, the rest summaries or start-up), log {log_bytes} B",
        2 * HALF,
        decode_errors(&gw).await,
        warns.len()
    );
    assert!(
        warns.len() <= MAX_WARN_LINES,
        "{} WARN lines for {} bad messages; first: {:?}",
        warns.len(),
        2 * HALF,
        warns.iter().take(5).collect::<Vec<_>>()
    );
    // The per-message warning exists (the subscriber saw the garbage) but is
    // rate-limited.
    assert!(undecodable >= 1, "{warns:?}");
}
