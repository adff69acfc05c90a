//! Real engines for the facade's tests: `tests/python/vllm_standin.py` (vLLM
//! 0.33.0's own block hasher, `BlockPool` and `ZmqEventPublisher` behind an
//! OpenAI server) run from the repo's `.venv` (`scripts/python-env.sh`), on
//! 127.0.0.1 with ephemeral ports. A missing venv fails the test, never skips it.

pub mod receipt_oracle;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

/// Upper bound of every wait (the stand-in imports vLLM modules at start).
pub const WAIT: Duration = Duration::from_secs(60);
/// The stand-ins' hash contract (`--hash sha256_cbor`, `PYTHONHASHSEED=0`, block 16).
pub const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
pub const MODEL: &str = "qwen3";

/// The repository root: the nearest ancestor of this crate holding `golden/`
/// (this file is shared by crates at different depths).
pub fn repo() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|d| d.join("golden").is_dir() && d.join("tests/python").is_dir())
        .map(PathBuf::from)
        .unwrap_or(here)
}

pub fn model_dir() -> PathBuf {
    repo().join("golden/tokenizers/qwen3")
}

fn venv_python() -> PathBuf {
    let py = repo().join(".venv/bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args([
                "-c",
                // vLLM's package __init__ needs torch; the stand-in's loader avoids it.
                "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in \
                 ('vllm', 'zmq', 'msgspec', 'cbor2', 'tokenizers', 'jinja2')))",
            ])
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} with vllm==0.33.0 is missing: run scripts/python-env.sh",
        py.display()
    );
    py
}

/// One vLLM stand-in, killed on drop.
pub struct Standin {
    child: Child,
    pub http: SocketAddr,
    pub zmq: u16,
    pub replay: u16,
}

impl Drop for Standin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Standin {
    pub fn start() -> Self {
        let mut child = Command::new(venv_python())
            .arg(repo().join("tests/python/vllm_standin.py"))
            .args(["--port", "0", "--zmq-port", "0", "--replay-port", "0"])
            .args(["--model", MODEL, "--model-dir"])
            .arg(model_dir())
            .args(["--hash", "sha256_cbor", "--block-size", "16"])
            .args(["--num-blocks", "256", "--step-ms", "1"])
            .env("PYTHONHASHSEED", "0")
            .stdout(Stdio::piped())
            .stderr(if std::env::var_os("KVROUTE_TEST_STDERR").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("spawn vllm_standin.py");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + WAIT;
        let line = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.starts_with("vllm-standin: http=") => break l,
                Ok(_) => {}
                Err(_) => panic!("vllm_standin.py printed no start line within {WAIT:?}"),
            }
        };
        let field = |key: &str| -> String {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {line:?}"))
                .to_owned()
        };
        Self {
            http: field("http=").parse().expect("http addr"),
            zmq: field("zmq=").parse().expect("zmq port"),
            replay: field("replay=").parse().expect("replay port"),
            child,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// The backend as the engine configures it: PUB on `tcp://*:zmq`, replay ROUTER.
    pub fn backend(&self) -> kvroute::Backend {
        kvroute::Backend::vllm(self.url())
            .events(format!("tcp://*:{}", self.zmq))
            .replay(format!("tcp://127.0.0.1:{}", self.replay))
    }
}

/// A port nothing listens on.
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A chat body whose prompt spans several 16-token blocks.
pub fn chat(topic: &str, stream: bool) -> Bytes {
    let text = format!(
        "You are a careful assistant for {topic}. Answer in one sentence. \
         Background: the quick brown fox jumps over the lazy dog, again and again, \
         while the committee discusses {topic} at length and takes detailed notes."
    );
    Bytes::from(
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "stream": stream,
        })
        .to_string(),
    )
}

/// Polls `f` every 20 ms until it is true, for at most [`WAIT`].
pub async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads a whole response body.
pub async fn read_all<B>(body: B) -> Bytes
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    body.collect().await.expect("body").to_bytes()
}
