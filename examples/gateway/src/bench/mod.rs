//! `kvroute bench gateway`: the gateway's own cost, measured on loopback.
//!
//! Starts `--engines` mock engines (real prefix caches, the real tokenizer,
//! KV events over ZeroMQ) and the gateway in this process, then sends the same
//! bounded list of completions twice with `--concurrency` closed-loop clients:
//! once straight to the engines (round robin) and once through the gateway
//! (KV-exact routing: parse, tokenize, hash, score, proxy). The engines' service
//! time is fixed (`--service-us` per request, no per-token cost), so the
//! difference between the two runs is what the gateway adds.
//!
//! ```text
//! kvroute bench gateway --engines 4 --concurrency 64 --requests 20000
//! ```
//!
//! `--fresh` sends fresh long chat prompts instead (`--prompt-tokens`, a new
//! document per request, so neither the gateway's span cache nor any engine
//! holds a prefix of it) through a relay in front of each engine that notes
//! when each request's first byte arrives ([`relay`]): the report gives the
//! latency before the first upstream byte, p50 / p99, direct and through the
//! gateway (which parses, renders, tokenizes on `--tokenizer-threads`, hashes
//! and scores first), beside a single-threaded tokenization of the same text.
//!
//! ```text
//! kvroute bench gateway --fresh --prompt-tokens 32768 --tokenizer-threads 2 \
//!     --engines 2 --concurrency 1 --requests 20
//! ```

mod load;
mod prompt;
mod relay;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde::Serialize;
use serde_json::json;

use crate::gateway::metrics::Outcome;
use crate::gateway::{self, ServeConfig};
use kvroute_mock_engine as mock_engine;
use load::{Job, RunStats};

/// Model slug the engines serve and the gateway routes.
const MODEL: &str = "qwen3";
/// The mock engines' default contract (vLLM 0.33, sha256_cbor, 16-token blocks).
const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
/// Rule name in the generated gateway configuration.
const RULE: &str = "bench";
/// Tenants whose prompts share a prefix (so KV-exact routing has hits).
const TENANTS: usize = 8;

/// `kvroute bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Load-test the gateway against mock engines on loopback: the same requests
    /// direct and through the gateway; prints requests/s, errors, p50/p99 of
    /// both and what the gateway adds.
    Gateway(GatewayBenchArgs),
    /// Fresh chat bodies of 1 K–128 K tokens → block keys, step by step
    /// (parse, render, tokenize, hash, score), beside a plain single-threaded
    /// tokenizer encode of the same text; `--threads` adds the parallel
    /// tokenizer.
    Prompt(prompt::PromptBenchArgs),
}

/// `kvroute bench gateway`.
#[derive(Args, Debug, Clone)]
pub struct GatewayBenchArgs {
    /// Mock engines to start.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Concurrent clients (closed loop: each sends its next request when the
    /// previous answer is read).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Requests per run (each run sends exactly this many).
    #[arg(long, default_value_t = 2_000)]
    pub requests: usize,
    /// Words per prompt (about 1.5 tokens each); half is a per-tenant prefix.
    #[arg(long, default_value_t = 96)]
    pub prompt_words: usize,
    /// Fixed engine service time per prefill step, µs (no per-token cost).
    #[arg(long, default_value_t = 200)]
    pub service_us: u32,
    /// Model directory (tokenizer); defaults to the repo's golden/tokenizers/qwen3.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Fresh long chat prompts of `--prompt-tokens` tokens (a new document
    /// each) instead of short shared-prefix completions; reports the latency
    /// before the first upstream byte.
    #[arg(long)]
    pub fresh: bool,
    /// Prompt size of `--fresh`, tokens (approximate: sized by a calibration
    /// encode; the report gives the count).
    #[arg(long, default_value_t = 32_768)]
    pub prompt_tokens: usize,
    /// The gateway's `limits.tokenizer_threads` (default: the config's).
    #[arg(long)]
    pub tokenizer_threads: Option<usize>,
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct GatewayBenchReport {
    /// Engines started.
    pub engines: usize,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Engine service time per prefill step, µs.
    pub service_us: u32,
    /// Straight to the engines.
    pub direct: RunStats,
    /// Through the gateway.
    pub gateway: RunStats,
    /// gateway p50 − direct p50, ms.
    pub added_p50_ms: f64,
    /// gateway p99 − direct p99, ms.
    pub added_p99_ms: f64,
    /// Requests the gateway counted as proxied.
    pub gateway_proxied: u64,
    /// Gateway decisions by ladder tier.
    pub decisions: serde_json::Map<String, serde_json::Value>,
    /// `--fresh`: latency before the first upstream byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fresh: Option<FreshReport>,
}

/// What `--fresh` adds to the report; times in ms.
#[derive(Debug, Serialize)]
pub struct FreshReport {
    /// Tokens of a prompt (median of the sampled requests).
    pub prompt_tokens: usize,
    /// The gateway's `limits.tokenizer_threads`.
    pub tokenizer_threads: usize,
    /// Client send → first byte at the engine, straight to the engines.
    pub direct_first_byte_p50_ms: f64,
    /// 99th percentile of the same.
    pub direct_first_byte_p99_ms: f64,
    /// Client send → first byte at the engine, through the gateway.
    pub gateway_first_byte_p50_ms: f64,
    /// 99th percentile of the same.
    pub gateway_first_byte_p99_ms: f64,
    /// gateway − direct, p50.
    pub added_first_byte_p50_ms: f64,
    /// gateway − direct, p99.
    pub added_first_byte_p99_ms: f64,
    /// A plain single-threaded `Tokenizer::encode` of a request's rendered
    /// prompt, in this process (the mean of two medians, over half the
    /// gateway run's prompts timed right before it and the other half right
    /// after; at most 25 each).
    pub tokenize_single_ms: f64,
    /// `added_first_byte_p50_ms / tokenize_single_ms`.
    pub added_p50_ratio: f64,
    /// Requests whose first byte the relays did not see (0 when all went well).
    pub unmatched: usize,
}

/// Runs `kvroute bench ...`.
pub fn run(args: &BenchArgs) -> ExitCode {
    let g = match &args.command {
        BenchCommand::Gateway(g) => g,
        BenchCommand::Prompt(p) => return run_prompt(p),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = if g.fresh {
        runtime.block_on(bench_gateway_fresh(g))
    } else {
        runtime.block_on(bench_gateway(g))
    };
    match result {
        Ok(report) => {
            if g.json {
                match serde_json::to_string_pretty(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("kvroute bench: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                print!("{}", render(&report));
            }
            let unmatched = report.fresh.as_ref().map_or(0, |f| f.unmatched);
            if report.direct.errors + report.gateway.errors + unmatched > 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("kvroute bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_prompt(args: &prompt::PromptBenchArgs) -> ExitCode {
    match prompt::run_prompt_bench(args) {
        Ok(report) => {
            print!("{}", prompt::render_prompt_report(&report));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvroute bench prompt: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Vocabulary of the generated prompts.
const WORDS: [&str; 16] = [
    "cache", "prefix", "block", "token", "engine", "router", "policy", "tenant", "request",
    "answer", "budget", "window", "shard", "replica", "latency", "batch",
];

/// `n` words picked deterministically from `seed`.
fn words(seed: u64, n: usize) -> String {
    let mut out = String::new();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let w = WORDS.get((x % WORDS.len() as u64) as usize).unwrap_or(&"x");
        out.push(' ');
        out.push_str(w);
    }
    out
}

/// Request `i`'s body: a per-tenant prefix, then words unique to `i`.
fn body(i: usize, prompt_words: usize) -> Vec<u8> {
    let tenant = (i % TENANTS) as u64;
    let half = prompt_words / 2;
    let prompt = format!(
        "Tenant {tenant} instructions:{} Question {i}:{}",
        words(tenant + 1, half),
        words(i as u64 + 1_000, prompt_words - half)
    );
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 1})
        .to_string()
        .into_bytes()
}

async fn start_engines(
    args: &GatewayBenchArgs,
    model_dir: &Path,
) -> anyhow::Result<Vec<mock_engine::Running>> {
    let step = args.service_us.to_string();
    let running = args.concurrency.max(1).to_string();
    let flags = [
        "--max-running",
        &running,
        "--prefill-us-per-token",
        "0",
        "--prefill-step-us",
        &step,
        "--decode-us-per-token",
        "0",
    ];
    mock_engine::start_local_fleet(args.engines, model_dir, MODEL, &flags).await
}

fn gateway_toml(model_dir: &Path, engines: &[mock_engine::Running]) -> String {
    let urls: Vec<_> = engines.iter().map(|e| e.http).collect();
    gateway_toml_with(model_dir, engines, &urls, None)
}

/// The bench gateway's configuration: `engines`' events, requests sent to
/// `urls` (the engines or relays in front of them, in the same order).
fn gateway_toml_with(
    model_dir: &Path,
    engines: &[mock_engine::Running],
    urls: &[std::net::SocketAddr],
    tokenizer_threads: Option<usize>,
) -> String {
    let limits = tokenizer_threads
        .map(|n| format!("[limits]\ntokenizer_threads = {n}\n"))
        .unwrap_or_default();
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[health]\ninterval_ms = 0\n{limits}\n\
         [[models]]\nslug = \"{MODEL}\"\ndir = {:?}\n\n\
         [[rules]]\nname = \"{RULE}\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\n\
         contract = \"{CONTRACT}\"\nscorer = \"load_aware\"\nselector = \"least_load\"\n\n",
        model_dir.display().to_string()
    );
    for (e, url) in engines.iter().zip(urls) {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{url}\"\nengine = \"vllm\"\n"
        ));
        if let Some(zmq) = e.zmq_port {
            s.push_str(&format!("zmq = \"tcp://*:{zmq}\"\n"));
        }
        s.push('\n');
    }
    s
}

/// Waits (bounded) for the tokenizer and every KV-event subscriber.
async fn wait_ready(gw: &Arc<gateway::Gateway>) -> anyhow::Result<()> {
    let g = Arc::clone(gw);
    tokio::task::spawn_blocking(move || g.tokenizers.get(MODEL).map(|_| ()))
        .await?
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    for _ in 0..400 {
        let connected = gw.rules_snapshot().iter().all(|rt| {
            let r = rt.router.readiness();
            r.followers_connected == r.followers
        });
        if connected {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    anyhow::bail!("the gateway's KV-event subscribers did not connect within 10 s")
}

/// Runs both passes and collects the report.
pub async fn bench_gateway(args: &GatewayBenchArgs) -> anyhow::Result<GatewayBenchReport> {
    let model_dir = model_dir_of(args)?;
    let engines = start_engines(args, &model_dir).await?;
    let config = ServeConfig::from_toml(&gateway_toml(&model_dir, &engines), &model_dir)
        .context("bench gateway config")?;
    let gw = gateway::start(&config).await?;
    wait_ready(&gw.gateway).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(args.concurrency.max(1))
        .build()?;
    let n = args.requests;
    let direct_jobs: Vec<Job> = (0..n)
        .map(|i| Job {
            url: format!(
                "http://{}/v1/completions",
                engines.get(i % engines.len()).map_or(gw.proxy, |e| e.http)
            ),
            body: body(i, args.prompt_words),
            id: None,
        })
        .collect();
    let gateway_jobs: Vec<Job> = (0..n)
        .map(|i| Job {
            url: format!("http://{}/v1/completions", gw.proxy),
            body: body(i, args.prompt_words),
            id: None,
        })
        .collect();
    eprintln!("kvroute bench: direct, {n} requests ...");
    let direct = load::run(&client, Arc::new(direct_jobs), args.concurrency).await;
    eprintln!("kvroute bench: through the gateway, {n} requests ...");
    let through = load::run(&client, Arc::new(gateway_jobs), args.concurrency).await;
    let gateway_proxied = gw.gateway.metrics.outcome_count(RULE, Outcome::Proxied);
    let decisions = ["kv_exact", "fallback", "exhausted"]
        .iter()
        .map(|t| {
            let count = gw.gateway.metrics.tier_count(RULE, t);
            ((*t).to_owned(), json!(count))
        })
        .collect();
    gw.shutdown().await;
    for e in engines {
        e.server.abort();
    }
    Ok(GatewayBenchReport {
        engines: args.engines.max(1),
        concurrency: args.concurrency.max(1),
        service_us: args.service_us,
        added_p50_ms: through.p50_ms - direct.p50_ms,
        added_p99_ms: through.p99_ms - direct.p99_ms,
        direct,
        gateway: through,
        gateway_proxied,
        decisions,
        fresh: None,
    })
}

fn model_dir_of(args: &GatewayBenchArgs) -> anyhow::Result<PathBuf> {
    let model_dir = args.model_dir.clone().unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/tokenizers/qwen3")
    });
    model_dir
        .canonicalize()
        .with_context(|| format!("model directory {}", model_dir.display()))
}

/// Client send → first byte at a relay, per request of one run, sorted;
/// and how many requests no relay saw.
fn first_byte_latencies(
    starts: &[Option<std::time::Instant>],
    ids: impl Iterator<Item = u64>,
    relays: &[relay::Relay],
) -> (Vec<Duration>, usize) {
    let mut out = Vec::with_capacity(starts.len());
    let mut unmatched = 0;
    for (start, id) in starts.iter().zip(ids) {
        let arrival = relays
            .iter()
            .find_map(|r| r.arrivals.lock().get(&id).copied());
        match (start, arrival) {
            (Some(s), Some(a)) => out.push(a.saturating_duration_since(*s)),
            _ => unmatched += 1,
        }
    }
    out.sort_unstable();
    (out, unmatched)
}

/// `--fresh`: fresh long chat prompts, first upstream byte timed at relays.
pub async fn bench_gateway_fresh(args: &GatewayBenchArgs) -> anyhow::Result<GatewayBenchReport> {
    let model_dir = model_dir_of(args)?;
    let cal = {
        let (dir, size) = (model_dir.clone(), args.prompt_tokens.max(1));
        Arc::new(tokio::task::spawn_blocking(move || prompt::Calibrated::new(&dir, size)).await??)
    };
    // The single-threaded reference is timed right before and right after
    // the gateway run, in this process, so it sees the same machine load.
    // Half the gateway run's prompts before it, the other half after.
    let samples = (args.requests / 2).clamp(1, 25);
    let reference = |from: usize| {
        let cal = Arc::clone(&cal);
        tokio::task::spawn_blocking(move || {
            cal.single_thread_encode_ms((from..from + samples).map(|i| i as u64))
        })
    };
    let engines = start_engines(args, &model_dir).await?;
    let mut relays = Vec::with_capacity(engines.len());
    for e in &engines {
        relays.push(relay::Relay::start(e.http).await?);
    }
    let urls: Vec<_> = relays.iter().map(|r| r.addr).collect();
    let toml = gateway_toml_with(&model_dir, &engines, &urls, args.tokenizer_threads);
    let config = ServeConfig::from_toml(&toml, &model_dir).context("bench gateway config")?;
    let tokenizer_threads = config.limits.tokenizer_threads;
    let gw = gateway::start(&config).await?;
    wait_ready(&gw.gateway).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(args.concurrency.max(1))
        .build()?;
    let n = args.requests;
    // Direct bodies are ids 0..n, gateway bodies n..2n: no document twice.
    let jobs = |offset: usize, url: &dyn Fn(usize) -> String| -> Vec<Job> {
        (0..n)
            .map(|i| Job {
                url: url(i),
                body: cal.body((offset + i) as u64),
                id: Some((offset + i) as u64),
            })
            .collect()
    };
    let direct_jobs = jobs(0, &|i| {
        format!(
            "http://{}/v1/chat/completions",
            urls.get(i % urls.len().max(1)).map_or(gw.proxy, |u| *u)
        )
    });
    let gateway_jobs = jobs(n, &|_| format!("http://{}/v1/chat/completions", gw.proxy));
    eprintln!(
        "kvroute bench: fresh {}-token chats, direct, {n} requests ...",
        cal.tokens
    );
    let (direct, direct_starts) =
        load::run_with_starts(&client, Arc::new(direct_jobs), args.concurrency).await;
    let before = reference(n).await??;
    eprintln!("kvroute bench: through the gateway, {n} requests ...");
    let (through, gateway_starts) =
        load::run_with_starts(&client, Arc::new(gateway_jobs), args.concurrency).await;
    let after = reference(n + samples).await??;
    let (d_lat, d_missing) = first_byte_latencies(&direct_starts, 0..n as u64, &relays);
    let (g_lat, g_missing) = first_byte_latencies(&gateway_starts, n as u64..2 * n as u64, &relays);
    let gateway_proxied = gw.gateway.metrics.outcome_count(RULE, Outcome::Proxied);
    let decisions = ["kv_exact", "fallback", "exhausted"]
        .iter()
        .map(|t| {
            (
                (*t).to_owned(),
                json!(gw.gateway.metrics.tier_count(RULE, t)),
            )
        })
        .collect();
    gw.shutdown().await;
    for e in engines {
        e.server.abort();
    }
    drop(relays);
    let tokenize_single_ms = ((before.0 + after.0) / 2.0, before.1);
    let p = |lat: &[Duration], q: f64| load::percentile_ms(lat, q);
    let added_p50 = p(&g_lat, 50.0) - p(&d_lat, 50.0);
    let fresh = FreshReport {
        prompt_tokens: tokenize_single_ms.1,
        tokenizer_threads,
        direct_first_byte_p50_ms: p(&d_lat, 50.0),
        direct_first_byte_p99_ms: p(&d_lat, 99.0),
        gateway_first_byte_p50_ms: p(&g_lat, 50.0),
        gateway_first_byte_p99_ms: p(&g_lat, 99.0),
        added_first_byte_p50_ms: added_p50,
        added_first_byte_p99_ms: p(&g_lat, 99.0) - p(&d_lat, 99.0),
        tokenize_single_ms: tokenize_single_ms.0,
        added_p50_ratio: if tokenize_single_ms.0 > 0.0 {
            added_p50 / tokenize_single_ms.0
        } else {
            0.0
        },
        unmatched: d_missing + g_missing,
    };
    Ok(GatewayBenchReport {
        engines: args.engines.max(1),
        concurrency: args.concurrency.max(1),
        service_us: args.service_us,
        added_p50_ms: through.p50_ms - direct.p50_ms,
        added_p99_ms: through.p99_ms - direct.p99_ms,
        direct,
        gateway: through,
        gateway_proxied,
        decisions,
        fresh: Some(fresh),
    })
}

fn render(r: &GatewayBenchReport) -> String {
    let mut s = format!(
        "kvroute bench gateway: {} engines (service {} µs/request), {} concurrent clients\n\n",
        r.engines, r.service_us, r.concurrency
    );
    s.push_str(&format!(
        "{:<8} {:>9} {:>7} {:>10} {:>9} {:>9}\n",
        "path", "requests", "errors", "req/s", "p50 ms", "p99 ms"
    ));
    for (name, run) in [("direct", &r.direct), ("gateway", &r.gateway)] {
        s.push_str(&format!(
            "{name:<8} {:>9} {:>7} {:>10.0} {:>9.3} {:>9.3}\n",
            run.requests, run.errors, run.requests_per_second, run.p50_ms, run.p99_ms
        ));
    }
    s.push_str(&format!(
        "\ngateway adds: p50 {:+.3} ms, p99 {:+.3} ms\n",
        r.added_p50_ms, r.added_p99_ms
    ));
    let tiers: Vec<String> = r
        .decisions
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    s.push_str(&format!(
        "gateway decisions: {} (proxied {})\n",
        tiers.join(", "),
        r.gateway_proxied
    ));
    if let Some(f) = &r.fresh {
        s.push_str(&format!(
            "\nfresh {}-token chats, gateway tokenizer_threads = {}\n\
             first upstream byte  {:>9} {:>9}\n\
             {:<20} {:>9.3} {:>9.3}\n{:<20} {:>9.3} {:>9.3}\n\
             gateway adds before the first upstream byte: p50 {:+.3} ms, p99 {:+.3} ms\n\
             single-threaded tokenization of the prompt: {:.3} ms; added p50 = {:.2}x it\n",
            f.prompt_tokens,
            f.tokenizer_threads,
            "p50 ms",
            "p99 ms",
            "direct",
            f.direct_first_byte_p50_ms,
            f.direct_first_byte_p99_ms,
            "gateway",
            f.gateway_first_byte_p50_ms,
            f.gateway_first_byte_p99_ms,
            f.added_first_byte_p50_ms,
            f.added_first_byte_p99_ms,
            f.tokenize_single_ms,
            f.added_p50_ratio,
        ));
        if f.unmatched > 0 {
            s.push_str(&format!("requests no relay saw: {}\n", f.unmatched));
        }
    }
    for (name, run) in [("direct", &r.direct), ("gateway", &r.gateway)] {
        if let Some(e) = &run.first_error {
            s.push_str(&format!("first {name} error: {e}\n"));
        }
    }
    s
}
