//! Shared helpers of the gateway end-to-end tests: the `kvroute` binary run as
//! `serve` and `mock-engine` child processes on 127.0.0.1 with ephemeral ports,
//! and bounded polling of the admin API.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Upper bound of any wait in these tests (debug builds load the tokenizer slowly).
pub const WAIT: Duration = Duration::from_secs(60);

pub const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
pub const MODEL: &str = "qwen3";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn model_dir() -> PathBuf {
    repo().join("golden/tokenizers/qwen3")
}

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn spawn(args: &[String]) -> Self {
        let stderr = if std::env::var_os("KVROUTE_TEST_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        Self::spawn_with(args, "info", stderr)
    }

    /// Spawns with `RUST_LOG=rust_log` and stderr (the tracing output) sent to `stderr`.
    fn spawn_with(args: &[String], rust_log: &str, stderr: Stdio) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .env("RUST_LOG", rust_log)
            .spawn()
            .expect("spawn kvroute");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines: rx }
    }

    /// The first stdout line starting with `prefix`.
    fn line(&self, prefix: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no {prefix:?} line within {WAIT:?}"));
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `kvroute mock-engine`.
pub struct Engine {
    pub proc: Proc,
    pub http: SocketAddr,
    pub zmq: u16,
    pub replay: Option<u16>,
}

fn port_after(line: &str, key: &str) -> Option<u16> {
    let rest = line.split(key).nth(1)?;
    let digits: String = rest
        .trim_start_matches("Some(")
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

impl Engine {
    /// Starts a mock engine with the qwen3 tokenizer; `role` is both/prefill/decode.
    /// `ports` = (http, zmq, replay), 0 for ephemeral.
    pub fn start_on(role: &str, ports: (u16, u16, u16)) -> Self {
        let args: Vec<String> = [
            "mock-engine",
            "--port",
            &ports.0.to_string(),
            "--zmq-port",
            &ports.1.to_string(),
            "--replay-port",
            &ports.2.to_string(),
            "--model-dir",
            model_dir().to_str().unwrap(),
            "--model",
            MODEL,
            "--role",
            role,
            "--decode-us-per-token",
            "500",
            "--prefill-step-us",
            "100",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        let proc = Proc::spawn(&args);
        let line = proc.line("mock-engine:");
        let http: SocketAddr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("bad mock-engine line {line:?}"));
        let zmq = port_after(&line, "zmq=").unwrap_or_else(|| panic!("no zmq port in {line:?}"));
        let replay = port_after(&line, "replay=");
        Self {
            proc,
            http,
            zmq,
            replay,
        }
    }

    pub fn start(role: &str) -> Self {
        Self::start_on(role, (0, 0, 0))
    }

    /// A `[[rules.endpoints]]` table for this engine.
    pub fn endpoint_toml(&self, role: &str) -> String {
        let replay = self
            .replay
            .map(|r| format!("replay = \"tcp://127.0.0.1:{r}\"\n"))
            .unwrap_or_default();
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"{role}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{}\"\n{replay}\n",
            self.http, self.zmq
        )
    }
}

/// A running `kvroute serve`.
pub struct Gateway {
    pub proc: Proc,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    _config: tempfile::NamedTempFile,
}

impl Gateway {
    /// Starts `kvroute serve` with `toml` (listeners are forced to ephemeral
    /// loopback ports by the caller's text).
    pub fn start(toml: &str) -> Self {
        Self::start_inner(toml, None)
    }

    /// Like [`Gateway::start`] with `RUST_LOG=rust_log` and the tracing output
    /// (stderr) written to `log`.
    pub fn start_logged(toml: &str, rust_log: &str, log: std::fs::File) -> Self {
        Self::start_inner(toml, Some((rust_log, log)))
    }

    fn start_inner(toml: &str, logged: Option<(&str, std::fs::File)>) -> Self {
        let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        file.write_all(toml.as_bytes()).unwrap();
        file.flush().unwrap();
        let args = vec![
            "serve".to_owned(),
            "--config".to_owned(),
            file.path().to_str().unwrap().to_owned(),
        ];
        let proc = match logged {
            Some((level, log)) => Proc::spawn_with(&args, level, Stdio::from(log)),
            None => Proc::spawn(&args),
        };
        let line = proc.line("kvroute serve: proxy=");
        let addr = |key: &str| -> SocketAddr {
            line.split(key)
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("bad serve line {line:?}"))
        };
        Self {
            proxy: addr("proxy=http://"),
            admin: addr("admin=http://"),
            proc,
            _config: file,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }
}

/// The config header: ephemeral listeners, the qwen3 model staged; `extra` holds
/// further tables (`[health]`, `[limits]`).
pub fn config_head(extra: &str) -> String {
    config_head_with_admin("", extra)
}

/// Like [`config_head`] with extra `[admin]` keys.
pub fn config_head_with_admin(admin: &str, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n{admin}\n{extra}\n[[models]]\nslug = \"{MODEL}\"\ndir = \"{}\"\n\n",
        model_dir().display()
    )
}

/// A KV-exact rule header.
pub fn kv_rule(name: &str, topology: &str) -> String {
    format!(
        "[[rules]]\nname = \"{name}\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ntopology = \"{topology}\"\ncontract = \"{CONTRACT}\"\n\n"
    )
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(WAIT).build().unwrap()
}

pub async fn get_json(url: &str, token: Option<&str>) -> Value {
    let mut req = client().get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
    resp.json().await.unwrap()
}

/// Polls `f` every 50 ms until it returns `Some`, at most [`WAIT`].
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `/admin/endpoints` of a gateway.
pub async fn endpoints(gw: &Gateway) -> Vec<Value> {
    get_json(&gw.admin_url("/admin/endpoints"), None).await["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until every subscriber of the gateway is connected.
pub async fn wait_subscribed(gw: &Gateway) {
    eventually("subscribers connected", || async {
        let eps = endpoints(gw).await;
        let all = eps.iter().all(|e| {
            e["subscribers"]
                .as_array()
                .is_some_and(|s| s.iter().all(|s| s["connected"] == true))
        });
        all.then_some(())
    })
    .await;
}

/// Inventory blocks per endpoint index.
pub async fn inventory(gw: &Gateway) -> Vec<u64> {
    endpoints(gw)
        .await
        .iter()
        .map(|e| e["inventory_blocks"].as_u64().unwrap())
        .collect()
}

/// `/admin/counters` of one rule.
pub async fn counters(gw: &Gateway, rule: &str) -> Value {
    get_json(&gw.admin_url("/admin/counters"), None).await["rules"][rule].clone()
}

/// A prompt of about `words` words, distinct per `seed`.
pub fn prompt(seed: &str, words: usize) -> String {
    let mut s = format!("Document {seed}.");
    for i in 0..words {
        s.push_str(&format!(" {seed}-word{i}"));
    }
    s
}

/// POST /v1/completions, non-streaming; returns (status, body).
pub async fn complete(gw: &Gateway, prompt: &str, max_tokens: u32) -> (u16, Value) {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens});
    let resp = client()
        .post(gw.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let v = resp.json().await.unwrap_or(Value::Null);
    (status, v)
}

pub fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// An upstream that echoes what reached it (path, Host, body length, the
/// `authorization` header); `/v1/die` starts a stream and then drops the
/// connection.
pub async fn echo_upstream() -> SocketAddr {
    use axum::body::{Body, Bytes};
    use axum::http::Request;
    use axum::response::{IntoResponse, Response};

    async fn handle(req: Request<Body>) -> Response {
        let (parts, body) = req.into_parts();
        if parts.uri.path() == "/v1/die" {
            let chunks = futures_util::stream::unfold(0u8, |step| async move {
                match step {
                    0 => Some((
                        Ok::<Bytes, std::io::Error>(Bytes::from_static(
                            b"data: {\"partial\": true}\n\n",
                        )),
                        1,
                    )),
                    1 => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        Some((Err(std::io::Error::other("engine died")), 2))
                    }
                    _ => None,
                }
            });
            return Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(chunks))
                .unwrap();
        }
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let body = axum::body::to_bytes(body, 64 << 20)
            .await
            .unwrap_or_default();
        axum::Json(serde_json::json!({
            "path": parts.uri.path(),
            "host": header("host"),
            "authorization": header("authorization"),
            "len": body.len(),
            "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
        }))
        .into_response()
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(handle);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A port nothing listens on.
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
