//! `kvroute mock-engine`: an OpenAI-compatible stand-in for an inference engine
//! with a real block-level prefix cache, publishing KV events like the real one.
//!
//! Thin shell around [`kvroute_engine_model::Worker`] (the same model the fleet
//! simulator runs): HTTP in front (axum), ZeroMQ PUB + replay ROUTER (or the
//! TensorRT-LLM drain) behind, wall-clock sleeps for the modelled time.

mod engine;
mod http;
mod metrics;
mod publisher;
mod tokenize;
mod trtllm;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use axum::serve::ListenerExt as _;
use kvroute_core::{HashContract, Medium};

use engine::{Engine, EventSink};
use kvroute_engine_model::{CostModel, WorkerConfig};
pub use tokenize::{ByteTokens, ModelPrompts, PromptSource};
use wire::WireFormat;

/// Event wire format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// vLLM 0.33 msgpack over ZeroMQ.
    Vllm,
    /// SGLang 0.5.23 msgpack over ZeroMQ.
    Sglang,
    /// TensorRT-LLM JSON via `POST /kv_cache_events`.
    Trtllm,
}

/// P/D role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Serves whole requests; also answers both P/D steps.
    Both,
    /// Prefill side of vLLM's disaggregated two-step.
    Prefill,
    /// Decode side.
    Decode,
}

/// `kvroute mock-engine` options.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// HTTP port on 127.0.0.1 (0 = ephemeral).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// ZeroMQ PUB port on 127.0.0.1 (0 = ephemeral).
    #[arg(long, default_value_t = 5557)]
    pub zmq_port: u16,
    /// ZeroMQ replay ROUTER port (none if absent).
    #[arg(long)]
    pub replay_port: Option<u16>,
    /// ZeroMQ topic (frame 0).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub buffer_steps: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    pub capacity_blocks: u32,
    /// Requests running at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: u32,
    /// vLLM hash algorithm (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`) or a
    /// full contract spec such as `sglang@0.5.23:sha256_page_chain:block=16`.
    #[arg(long, default_value = "sha256_cbor")]
    pub hash: String,
    /// PYTHONHASHSEED the simulated vLLM runs with.
    #[arg(long, default_value = "0")]
    pub seed: String,
    /// vLLM version the events and hashes imitate.
    #[arg(long, default_value = "0.33.0")]
    pub engine_version: String,
    /// Model directory (tokenizer.json[.gz], tokenizer_config.json); without it
    /// prompts are tokenized one token per byte.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Model name served (default: the model directory's name, else `mock`).
    #[arg(long)]
    pub model: Option<String>,
    /// Event wire format.
    #[arg(long, value_enum, default_value_t = Format::Vllm)]
    pub format: Format,
    /// P/D role.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// Prefill time per uncached prompt token, µs.
    #[arg(long, default_value_t = 50.0)]
    pub prefill_us_per_token: f64,
    /// Fixed time per prefill step, µs.
    #[arg(long, default_value_t = 2000.0)]
    pub prefill_step_us: f64,
    /// Prompt tokens one prefill step takes.
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: u32,
    /// Time per output token, µs.
    #[arg(long, default_value_t = 20_000.0)]
    pub decode_us_per_token: f64,
    /// Append one JSON line per admitted request to this file: response id,
    /// prompt and cached tokens, blocks evicted, the engine's queue at
    /// submission and the request's timeline. For benchmark forensics
    /// (`scripts/bench_smg.sh TRACE=1`); off by default.
    #[arg(long)]
    pub request_log: Option<PathBuf>,
}

impl Args {
    /// The contract the engine hashes with.
    pub fn contract(&self) -> anyhow::Result<HashContract> {
        let spec = if self.hash.contains('@') {
            self.hash.clone()
        } else {
            format!(
                "vllm@{}:{}:block={}:seed={}",
                self.engine_version, self.hash, self.block_size, self.seed
            )
        };
        spec.parse::<HashContract>()
            .with_context(|| format!("hash contract {spec:?}"))
    }

    fn worker_config(&self) -> WorkerConfig {
        WorkerConfig {
            block_size: self.block_size,
            capacity_blocks: self.capacity_blocks,
            max_running: self.max_running,
            cost: CostModel {
                prefill_step_us: self.prefill_step_us,
                prefill_us_per_token: self.prefill_us_per_token,
                max_batched_tokens: self.max_batched_tokens,
                decode_us_per_token: self.decode_us_per_token,
            },
            medium: Medium::Gpu,
        }
    }
}

/// A started mock engine.
pub struct Running {
    /// HTTP address.
    pub http: SocketAddr,
    /// ZeroMQ PUB port (None in TensorRT-LLM mode).
    pub zmq_port: Option<u16>,
    /// Replay ROUTER port.
    pub replay_port: Option<u16>,
    /// Resolves when the HTTP server stops.
    pub server: tokio::task::JoinHandle<()>,
}

/// Starts `count` engines on ephemeral loopback ports (HTTP and ZeroMQ) serving
/// `model` from `model_dir`, each configured by the `mock-engine` command-line
/// flags in `flags` (in-process fleets for `kvroute demo` and `kvroute bench`).
pub async fn start_local_fleet(
    count: usize,
    model_dir: &std::path::Path,
    model: &str,
    flags: &[&str],
) -> anyhow::Result<Vec<Running>> {
    #[derive(clap::Parser)]
    struct EngineCli {
        #[command(flatten)]
        args: Args,
    }
    let dir = model_dir.display().to_string();
    let mut argv = vec![
        "mock-engine",
        "--port",
        "0",
        "--zmq-port",
        "0",
        "--model-dir",
        &dir,
        "--model",
        model,
    ];
    argv.extend_from_slice(flags);
    let cli = <EngineCli as clap::Parser>::try_parse_from(&argv)?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        out.push(start(&cli.args).await?);
    }
    Ok(out)
}

/// Binds everything and starts serving on the current tokio runtime.
pub async fn start(args: &Args) -> anyhow::Result<Running> {
    let contract = args.contract()?;
    let hasher = contract.hasher().context("hash contract")?;
    if hasher.block_size() != args.block_size as usize {
        anyhow::bail!(
            "contract block size {} differs from --block-size {}",
            hasher.block_size(),
            args.block_size
        );
    }
    let tokens: Box<dyn PromptSource> = match &args.model_dir {
        Some(dir) => Box::new(ModelPrompts::load(dir)?),
        None => Box::new(ByteTokens),
    };
    let model = args.model.clone().unwrap_or_else(|| {
        args.model_dir
            .as_ref()
            .and_then(|d| d.file_name())
            .map_or_else(|| "mock".to_owned(), |n| n.to_string_lossy().into_owned())
    });

    let (sink, zmq_port, replay_port) = match args.format {
        Format::Vllm | Format::Sglang => {
            let publisher = publisher::Publisher::start(
                args.zmq_port,
                args.replay_port,
                args.topic.clone(),
                args.buffer_steps,
            )
            .await
            .context("binding ZeroMQ sockets")?;
            let format = if args.format == Format::Vllm {
                WireFormat::Vllm
            } else {
                WireFormat::Sglang
            };
            let (p, r) = (publisher.port, publisher.replay_port);
            (EventSink::Zmq { format, publisher }, Some(p), r)
        }
        Format::Trtllm => (
            EventSink::Trtllm(Arc::new(trtllm::TrtllmQueue::new(
                args.capacity_blocks,
                u64::from(args.capacity_blocks) * u64::from(args.block_size),
                1 << 20,
            ))),
            None,
            None,
        ),
    };
    let engine = Engine::start(args.worker_config(), sink);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .with_context(|| format!("binding HTTP port {}", args.port))?;
    let http = listener.local_addr()?;
    let request_log = match &args.request_log {
        Some(path) => Some(parking_lot::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening request log {}", path.display()))?,
        )),
        None => None,
    };
    let app = Arc::new(http::App {
        engine,
        hasher,
        tokens,
        model,
        role: args.role,
        port: http.port(),
        next_id: std::sync::atomic::AtomicU64::new(0),
        scrapes: std::sync::atomic::AtomicU64::new(0),
        request_log,
    });
    let router = http::router(app);
    let server = tokio::spawn(async move {
        // Like uvicorn under vLLM and SGLang: no Nagle, or each streamed chunk after
        // the first waits for the client's delayed ACK (~40 ms on Linux).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "mock engine HTTP server failed");
        }
    });
    tracing::info!(%http, ?zmq_port, ?replay_port, "mock engine up");
    Ok(Running {
        http,
        zmq_port,
        replay_port,
        server,
    })
}

/// Runs `kvroute mock-engine` until the server stops.
pub fn run(args: &Args) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mock-engine: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        match start(args).await {
            Ok(running) => {
                let port = |p: Option<u16>| p.map_or_else(|| "off".to_owned(), |p| p.to_string());
                println!(
                    "mock-engine: http://{} zmq={} replay={}",
                    running.http,
                    port(running.zmq_port),
                    port(running.replay_port)
                );
                let _ = running.server.await;
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("mock-engine: {e:#}");
                std::process::ExitCode::FAILURE
            }
        }
    })
}
