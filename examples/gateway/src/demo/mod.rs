//! `kvroute demo`: mock engines and the gateway on loopback, one multi-tenant
//! shared-prefix chat workload driven through RR, CHWBL and KV-exact, a
//! comparison table on stdout (progress goes to stderr) and the same results
//! as charts in an HTML report.

mod embedded;
mod hold;
mod html;
mod table;
mod workload;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;

use crate::gateway::{self, ServeConfig};
use hold::Hold;
use kvroute_mock_engine as mock_engine;
use table::PolicyReport;

/// Model slug the engines serve and the gateway routes.
const MODEL: &str = "qwen3";
/// Hash contract of the mock engines' defaults (vLLM 0.33, sha256_cbor, 16-token blocks).
const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";
/// Prefill time per uncached prompt token of the mock engines: large enough
/// that what a cache hit saves shows in TTFT, as on a real GPU (~10-20 K
/// prefill tokens/s for a mid-size model).
const PREFILL_US_PER_TOKEN: u32 = 60;
/// Tenants, each with its own long system prompt.
const TENANTS: usize = 8;

/// `kvroute demo` options.
#[derive(Clone, Debug, clap::Args)]
pub struct DemoArgs {
    /// Mock engines to start.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Chat requests per policy.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Requests per wave: sent one after another, in flight together.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Model directory (tokenizer); defaults to the repo's golden/tokenizers/qwen3.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Workload seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// KV capacity of each engine, in 16-token blocks (small so eviction matters).
    #[arg(long, default_value_t = 160)]
    pub capacity_blocks: u32,
    /// Decode time per output token of the mock engines, µs. Placement is
    /// the same in every run as long as no request of a wave ends before the
    /// wave's last request reached its engine (the demo warns otherwise).
    #[arg(long, default_value_t = 10_000)]
    pub decode_us_per_token: u32,
    /// Also run KV-exact through the library alone: a `KvRouter` with the
    /// builder's defaults in the embedding example's axum proxy, on the
    /// same engines and workload (`kv-exact (embedded)`).
    #[arg(long)]
    pub embedded: bool,
    /// Where to write the HTML report (charts of the table's results);
    /// default: kvroute-demo.html in the system's temporary directory.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Write no HTML report.
    #[arg(long, conflicts_with = "html")]
    pub no_html: bool,
}

impl DemoArgs {
    /// Where the HTML report goes, if anywhere.
    fn html_path(&self) -> Option<PathBuf> {
        if self.no_html {
            return None;
        }
        Some(
            self.html
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("kvroute-demo.html")),
        )
    }
}

/// Runs the demo; exit 0 when every policy completed.
pub fn run(args: &DemoArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute demo: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let run = match runtime.block_on(demo(args)) {
        Ok(run) => run,
        Err(e) => {
            eprintln!("\nkvroute demo: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    print!("{}{}", run.header, run.table);
    if let Some(path) = args.html_path() {
        let page = html::render(&run.header, &run.table, &run.reports, args.engines);
        if let Err(e) = std::fs::write(&path, page) {
            eprintln!(
                "kvroute demo: cannot write the HTML report {}: {e}",
                path.display()
            );
            return ExitCode::FAILURE;
        }
        eprintln!("kvroute demo: HTML report: {}", path.display());
    }
    ExitCode::SUCCESS
}

/// What a demo run measured: the description, the table and the per-policy
/// results behind both.
struct Run {
    header: String,
    table: String,
    reports: Vec<PolicyReport>,
}

/// The policies compared: label, the scorer / selector named in the table,
/// and the rule keys that select it. `kv-exact` names no scorer or selector:
/// it is exactly what `kvroute serve` runs for a KV-exact rule by default.
const POLICIES: &[(&str, &str, &str)] = &[
    (
        "rr",
        "round robin",
        "choice = \"round_robin\"\nselector = \"round_robin\"\n",
    ),
    (
        "chwbl",
        "consistent hashing, bounded loads (c = 1.25)",
        "choice = \"content_affinity\"\nselector = \"chwbl\"\n",
    ),
    (
        "kv-exact",
        "default: cost scorer, least_prefill on a miss",
        "choice = \"kv_exact\"\n",
    ),
];

async fn demo(args: &DemoArgs) -> anyhow::Result<Run> {
    let model_dir = args.model_dir.clone().unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/tokenizers/qwen3")
    });
    let model_dir = model_dir
        .canonicalize()
        .with_context(|| format!("model directory {}", model_dir.display()))?;
    let engines = start_engines(args, &model_dir).await?;
    let hold = Hold::start(&engines.iter().map(|e| e.http).collect::<Vec<_>>()).await?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let requests = workload::generate(TENANTS, args.requests, args.seed);
    let mut reports = Vec::new();
    let arms = POLICIES
        .iter()
        .map(|(policy, scorer, keys)| (*policy, *scorer, Some(*keys)))
        .chain(args.embedded.then_some((
            "kv-exact (embedded)",
            "KvRouter defaults in the embedding example",
            None,
        )));
    for (policy, scorer, keys) in arms {
        for e in &engines {
            let url = format!("http://{}/admin/restart-publisher", e.http);
            client.post(&url).send().await?.error_for_status()?;
        }
        let before = engine_requests(&client, &engines).await?;
        let kv = policy.starts_with("kv-exact");
        let host = match keys {
            Some(keys) => {
                let toml = gateway_toml(&model_dir, &engines, &hold.fronts, keys, kv);
                let config =
                    ServeConfig::from_toml(&toml, &model_dir).context("demo gateway config")?;
                let gw = gateway::start(&config).await?;
                let admin = format!("http://{}", gw.admin);
                if kv {
                    wait_subscribed(&client, &admin).await?;
                }
                Host::Gateway(gw, admin)
            }
            None => {
                let e = embedded::Embedded::start(&model_dir, &engines, &hold.fronts).await?;
                e.wait_subscribed().await?;
                Host::Embedded(e)
            }
        };
        let url = format!("http://{}/v1/chat/completions", host.proxy());
        let total = requests.len();
        let settle = || host.settled(&client, &engines, kv);
        let (outcomes, raced) = workload::drive(
            &client,
            &url,
            MODEL,
            &requests,
            args.concurrency,
            &hold,
            settle,
            |n| {
                eprint!("\r[{policy}] {n}/{total}   ");
                let _ = std::io::stderr().flush();
            },
        )
        .await?;
        eprintln!();
        if raced > 0 {
            eprintln!(
                "kvroute demo: [{policy}] in {raced} waves a request ended before the last one \
                 reached its engine: placement may differ between runs on this machine \
                 (raise --decode-us-per-token)"
            );
        }
        let after = engine_requests(&client, &engines).await?;
        let (tiers, predicted, delivered) = host.evidence(&client).await?;
        host.stop().await;
        reports.push(PolicyReport {
            policy,
            scorer,
            outcomes,
            per_endpoint: after
                .iter()
                .zip(&before)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            tiers,
            predicted,
            delivered,
        });
    }
    for e in engines {
        e.server.abort();
    }
    let header = format!(
        "kvroute demo: {} multi-turn chat requests over {TENANTS} tenants' system prompts (seed {}), \
         in waves of {} (decided one after another while held in front of the engines, then released together; \
         events applied between waves), through the gateway to {} mock engines (real Qwen3 tokenizer, vLLM sha256_cbor \
         block keys, {} KV blocks of 16 tokens each, prefill {} µs per uncached token)\n\n",
        args.requests,
        args.seed,
        args.concurrency,
        args.engines,
        args.capacity_blocks,
        PREFILL_US_PER_TOKEN,
    );
    Ok(Run {
        header,
        table: table::render(&reports),
        reports,
    })
}

/// What serves one arm: the gateway, or the library in the embedding example.
enum Host {
    Gateway(gateway::Running, String),
    Embedded(embedded::Embedded),
}

impl Host {
    fn proxy(&self) -> std::net::SocketAddr {
        match self {
            Self::Gateway(gw, _) => gw.proxy,
            Self::Embedded(e) => e.addr,
        }
    }

    async fn settled(
        &self,
        client: &reqwest::Client,
        engines: &[mock_engine::Running],
        kv: bool,
    ) -> anyhow::Result<()> {
        match self {
            Self::Gateway(_, admin) => settled(client, admin, engines, kv).await,
            Self::Embedded(e) => e.settled(client, engines).await,
        }
    }

    /// Decisions by tier, Σ predicted and Σ delivered cached tokens.
    async fn evidence(
        &self,
        client: &reqwest::Client,
    ) -> anyhow::Result<(Vec<(String, u64)>, u64, u64)> {
        let admin = match self {
            Self::Gateway(_, admin) => admin,
            Self::Embedded(e) => return Ok(e.evidence()),
        };
        let counters: Value = get_json(client, &format!("{admin}/admin/counters")).await?;
        let endpoints: Value = get_json(client, &format!("{admin}/admin/endpoints")).await?;
        let tiers = counters["rules"]["demo"]["tiers"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_u64().filter(|n| *n > 0).map(|n| (k.clone(), n)))
                    .collect()
            })
            .unwrap_or_default();
        let sum = |key: &str| -> u64 {
            endpoints["endpoints"]
                .as_array()
                .map(|a| a.iter().filter_map(|e| e[key].as_u64()).sum())
                .unwrap_or(0)
        };
        Ok((
            tiers,
            sum("predicted_cached_tokens"),
            sum("delivered_cached_tokens"),
        ))
    }

    async fn stop(self) {
        match self {
            Self::Gateway(gw, _) => gw.shutdown().await,
            Self::Embedded(e) => e.stop(),
        }
    }
}

async fn start_engines(
    args: &DemoArgs,
    model_dir: &Path,
) -> anyhow::Result<Vec<mock_engine::Running>> {
    let capacity = args.capacity_blocks.to_string();
    let prefill = PREFILL_US_PER_TOKEN.to_string();
    let decode = args.decode_us_per_token.to_string();
    let flags = [
        "--capacity-blocks",
        &capacity,
        "--prefill-us-per-token",
        &prefill,
        "--prefill-step-us",
        "500",
        "--decode-us-per-token",
        &decode,
    ];
    mock_engine::start_local_fleet(args.engines, model_dir, MODEL, &flags).await
}

/// The gateway's configuration: `keys` select the policy; requests go to the
/// engines through their holds (`fronts`), KV events come from the engines.
/// Engine-load polling is off: with one gateway the engines' own counts add
/// nothing to its own in-flight accounting but the timing of the poll (a
/// report read while a wave ends would count its requests for a whole
/// interval), which would make placement depend on the clock.
fn gateway_toml(
    model_dir: &Path,
    engines: &[mock_engine::Running],
    fronts: &[std::net::SocketAddr],
    keys: &str,
    events: bool,
) -> String {
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[limits]\nengine_load_poll_ms = 0\n\n[[models]]\nslug = \"{MODEL}\"\ndir = {:?}\n\n[[rules]]\nname = \"demo\"\nmodels = [\"{MODEL}\"]\ndefault = true\ntopology = \"converged\"\ncontract = \"{CONTRACT}\"\n{keys}\n",
        model_dir.display().to_string()
    );
    for (e, front) in engines.iter().zip(fronts) {
        s.push_str(&format!(
            "[[rules.endpoints]]\nurl = \"http://{front}\"\nengine = \"vllm\"\n"
        ));
        if let (true, Some(zmq)) = (events, e.zmq_port) {
            s.push_str(&format!("zmq = \"tcp://*:{zmq}\"\n"));
        }
        s.push('\n');
    }
    s
}

async fn get_json(client: &reqwest::Client, url: &str) -> anyhow::Result<Value> {
    Ok(client
        .get(url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

/// Requests each engine has served so far.
async fn engine_requests(
    client: &reqwest::Client,
    engines: &[mock_engine::Running],
) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for e in engines {
        let v = get_json(client, &format!("http://{}/admin/cache", e.http)).await?;
        out.push(v["requests"].as_u64().unwrap_or(0));
    }
    Ok(out)
}

/// Blocks each engine caches now.
async fn engine_cached_blocks(
    client: &reqwest::Client,
    engines: &[mock_engine::Running],
) -> anyhow::Result<Vec<u64>> {
    let mut cached = Vec::with_capacity(engines.len());
    for e in engines {
        let v = get_json(client, &format!("http://{}/admin/cache", e.http)).await?;
        cached.push(v["cached_blocks"].as_u64().unwrap_or(0));
    }
    Ok(cached)
}

/// Between two waves: waits until the gateway has released every request's
/// charge (the client saw the last byte a moment before the gateway's guard
/// drops) and, with KV events, until its inventory of each endpoint holds
/// exactly the blocks the engine caches — so the next wave's decisions see
/// the same state in every run.
async fn settled(
    client: &reqwest::Client,
    admin: &str,
    engines: &[mock_engine::Running],
    kv: bool,
) -> anyhow::Result<()> {
    for _ in 0..400 {
        let v = get_json(client, &format!("{admin}/admin/endpoints")).await?;
        let eps = v["endpoints"].as_array().cloned().unwrap_or_default();
        let idle = eps.iter().all(|e| {
            e["in_flight"].as_u64() == Some(0) && e["queued_prefill_tokens"].as_u64() == Some(0)
        });
        let caught_up = if kv && idle {
            let cached = engine_cached_blocks(client, engines).await?;
            let mirrored: Vec<u64> = eps
                .iter()
                .map(|e| e["inventory_blocks"].as_u64().unwrap_or(0))
                .collect();
            mirrored == cached
        } else {
            idle
        };
        if caught_up {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    anyhow::bail!(
        "within 2 s the gateway did not release its charges or its inventories did not catch up \
         with the engines' caches"
    )
}

/// Waits until the gateway's KV-event subscribers are all connected.
async fn wait_subscribed(client: &reqwest::Client, admin: &str) -> anyhow::Result<()> {
    for _ in 0..200 {
        let v = get_json(client, &format!("{admin}/admin/endpoints")).await?;
        let connected = v["endpoints"].as_array().is_some_and(|eps| {
            eps.iter().all(|e| {
                e["subscribers"]
                    .as_array()
                    .is_some_and(|s| !s.is_empty() && s.iter().all(|x| x["connected"] == true))
            })
        });
        if connected {
            // Give the PUB/SUB handshake a moment so the first events are not lost.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the gateway's KV-event subscribers did not connect")
}
