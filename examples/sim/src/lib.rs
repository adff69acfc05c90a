//! `kvroute sim`: a deterministic discrete-event simulation of a fleet, to
//! measure what each routing policy buys on a workload.
//!
//! * [`trace`]: Mooncake JSONL traces and the block keys derived from them;
//! * [`workload`]: synthetic generators writing the same format;
//! * [`fleet`]: the event loop — mock-engine workers, the real ingest path, the
//!   real `kvroute-select` rule;
//! * [`policy`]: the compared policies as rule configurations;
//! * [`report`]: table, JSON and SVG;
//! * [`html`]: the HTML report, drawn with [`chart`] (also the demo's).
//!
//! ```text
//! kvroute sim gen --kind tenants --requests 10000 --seed 1 --out tenants.jsonl
//! kvroute sim run --trace tenants.jsonl --workers 8 --policies all --json out.json --html out.html
//! ```

mod bounds;
pub mod chart;
pub mod fleet;
pub mod html;
pub mod peers;
pub mod policy;
pub mod report;
pub mod trace;
pub mod workload;

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};

use fleet::FleetConfig;
use kvroute_engine_model::{CostModel, WorkerConfig};
use policy::{Policy, Tuning};
use report::{FleetReport, SimReport, WorkloadReport};
use trace::Workload;
use workload::{GenConfig, Kind, Shape};

/// `kvroute sim`.
#[derive(Args, Debug)]
pub struct SimArgs {
    #[command(subcommand)]
    command: SimCommand,
}

#[derive(Subcommand, Debug)]
enum SimCommand {
    /// Write a synthetic workload as Mooncake JSONL.
    Gen(Box<GenArgs>),
    /// Simulate a fleet under each policy and compare them.
    Run(Box<RunArgs>),
}

/// `kvroute sim gen`.
#[derive(Args, Debug)]
pub struct GenArgs {
    /// Workload kind.
    #[arg(long, value_enum)]
    kind: Kind,
    /// Requests to generate.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// RNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean arrival rate, requests per second (default: 24, sized for 8
    /// workers; `chat-bursts`: 12 031 in 3 537 s).
    #[arg(long)]
    rate: Option<f64>,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Output file (JSONL).
    #[arg(long)]
    out: PathBuf,
}

/// Statistics of the bursty kinds (`chat-bursts`, `agent-bursts`); unset
/// values take the kind's defaults ([`workload::Shape::for_kind`]).
#[derive(Args, Debug, Default)]
pub struct ShapeArgs {
    /// Bursty kinds: span of the arrivals in seconds (overrides --rate).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Bursty kinds: shortest prompt, tokens.
    #[arg(long)]
    prompt_min: Option<u32>,
    /// Bursty kinds: longest prompt, tokens.
    #[arg(long)]
    prompt_max: Option<u32>,
    /// Bursty kinds: mean prompt length, tokens.
    #[arg(long)]
    prompt_mean: Option<f64>,
    /// Bursty kinds: median prompt length, tokens.
    #[arg(long)]
    prompt_median: Option<f64>,
    /// Bursty kinds: ideal prefix reuse (fraction of prompt tokens).
    #[arg(long)]
    reuse: Option<f64>,
    /// Bursty kinds: mean requests per distinct arrival millisecond.
    #[arg(long)]
    burst_mean: Option<f64>,
    /// Bursty kinds: how requests share the instants (poisson: batches of
    /// 1 + Poisson; pareto: heavy-tailed).
    #[arg(long, value_enum)]
    burst_sizes: Option<workload::BurstSizes>,
    /// Bursty kinds: Pareto shape of `--burst-sizes pareto` (> 1).
    #[arg(long)]
    burst_alpha: Option<f64>,
    /// Bursty kinds: instants evenly spaced (periodic) or uniform (random).
    #[arg(long, value_enum)]
    spacing: Option<workload::Spacing>,
    /// Bursty kinds: tokens of the root prefix every prompt starts with.
    #[arg(long)]
    root_tokens: Option<u32>,
    /// Bursty kinds: least seconds between two turns of a conversation.
    #[arg(long)]
    think_s: Option<f64>,
    /// Bursty kinds: seconds after which an idle conversation ends.
    #[arg(long)]
    idle_s: Option<f64>,
}

impl ShapeArgs {
    /// The kind's [`Shape`] with the given values applied.
    ///
    /// # Errors
    /// A value out of range, or a shape flag given for a kind that does not
    /// read it.
    pub fn shape(&self, kind: Kind) -> anyhow::Result<Shape> {
        let d = Shape::for_kind(kind);
        let s = Shape {
            duration_s: self.duration_s.or(d.duration_s),
            prompt_min: self.prompt_min.unwrap_or(d.prompt_min),
            prompt_max: self.prompt_max.unwrap_or(d.prompt_max),
            prompt_mean: self.prompt_mean.unwrap_or(d.prompt_mean),
            prompt_median: self.prompt_median.unwrap_or(d.prompt_median),
            reuse: self.reuse.unwrap_or(d.reuse),
            burst_mean: self.burst_mean.unwrap_or(d.burst_mean),
            burst_sizes: self.burst_sizes.unwrap_or(d.burst_sizes),
            burst_alpha: self.burst_alpha.unwrap_or(d.burst_alpha),
            spacing: self.spacing.unwrap_or(d.spacing),
            root_tokens: self.root_tokens.unwrap_or(d.root_tokens),
            output: d.output,
            think_s: self.think_s.unwrap_or(d.think_s),
            idle_s: self.idle_s.unwrap_or(d.idle_s),
        };
        anyhow::ensure!(
            kind.is_shaped() || s == d,
            "the shape flags apply to chat-bursts and agent-bursts only"
        );
        s.check()?;
        Ok(s)
    }
}

/// `kvroute sim run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Mooncake-format JSONL trace to replay.
    #[arg(long, conflicts_with = "kind", required_unless_present = "kind")]
    trace: Option<PathBuf>,
    /// Generate this synthetic workload in memory instead of reading a trace.
    #[arg(long, value_enum)]
    kind: Option<Kind>,
    /// Requests: how many to generate, or the first N of the trace.
    #[arg(long)]
    requests: Option<usize>,
    /// Seed of the generator, the rule's random selectors and event loss.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Generator arrival rate, requests per second (default: 24;
    /// `chat-bursts`: 12 031 in 3 537 s).
    #[arg(long)]
    rate: Option<f64>,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Workers in the fleet.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Tokens per KV block (keys are derived from the 512-token hash_ids).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV capacity per worker, tokens (rounded down to whole blocks).
    #[arg(long, default_value_t = 262_144)]
    capacity_tokens: u64,
    /// Requests running at once per worker.
    #[arg(long, default_value_t = 64)]
    max_running: u32,
    /// Prefill: fixed µs per batched step.
    #[arg(long, default_value_t = CostModel::default().prefill_step_us)]
    prefill_step_us: f64,
    /// Prefill: µs per uncached prompt token.
    #[arg(long, default_value_t = CostModel::default().prefill_us_per_token)]
    prefill_us_per_token: f64,
    /// Prefill batching budget: tokens per step.
    #[arg(long, default_value_t = CostModel::default().max_batched_tokens)]
    max_batched_tokens: u32,
    /// Decode: µs per output token.
    #[arg(long, default_value_t = CostModel::default().decode_us_per_token)]
    decode_us_per_token: f64,
    /// Multiply trace timestamps by this (0.5 replays twice as fast).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Requests sharing one arrival timestamp (a trace's millisecond, a
    /// bursty generator's instant) arrive spread evenly over this many µs
    /// after it, as a front end delivers a burst; 0 = at the same instant.
    #[arg(long, default_value_t = 0)]
    arrival_spread_us: u64,
    /// Closed loop: keep N requests outstanding, ignoring timestamps.
    #[arg(long)]
    concurrency: Option<u32>,
    /// KV events reach the router this many ms after the worker emits them.
    /// The default is what the real path adds: vLLM publishes a step's
    /// events when the step ends (one decode step of the cost model, 20 ms)
    /// plus the ZeroMQ publish → applied median measured in BENCHMARKS.md
    /// (≈ 0.06 ms).
    #[arg(long, default_value_t = DEFAULT_EVENT_DELAY_MS)]
    event_delay_ms: f64,
    /// Gateway replicas behind a random front end, each with its own
    /// in-flight view.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Poll the engines' running/waiting counts and KV capacity this often
    /// (ms; 0 = never), as the gateway polls them. Default: 100 ms.
    #[arg(long)]
    load_poll_ms: Option<f64>,
    /// Replicas share their decisions (in-flight and predicted prefill
    /// deltas), each arriving this many ms after the change (0 = they do
    /// not share). Default: 1 ms with several replicas.
    #[arg(long)]
    replica_sync_ms: Option<f64>,
    /// Replicas take turns within a burst: the replica of rank k holds a
    /// request k times this many ms before deciding it (the gateway's
    /// `[replicas] stagger_ms`; 0 = no turns). Default: the replica sync
    /// delay plus 0.1 ms, so a turn starts after the previous one's
    /// decisions have arrived.
    #[arg(long)]
    replica_stagger_ms: Option<f64>,
    /// Within a burst, a request whose prompt has no home waits this many ms
    /// so the burst's requests with one are placed first (the gateway's
    /// `rules.burst_order_ms`; 0 = off). Default: the library's, 1 ms.
    #[arg(long)]
    burst_order_ms: Option<f64>,
    /// The peers' policies read the engines' gauges this often (ms), as
    /// their own scrapers do (llm-d's endpoint picker: 50 ms); 0 = exactly at
    /// each decision, seeing what other replicas placed at the same instant.
    #[arg(long, default_value_t = DEFAULT_PEER_POLL_MS)]
    peer_poll_ms: f64,
    /// Fraction of KV event batches lost (0..1).
    #[arg(long, default_value_t = 0.0)]
    event_loss: f64,
    /// Sequence window: missed batches that keep an inventory.
    #[arg(long, default_value_t = 64)]
    seq_window: u64,
    /// Bounded-load slack ε of `kv-bounded`.
    #[arg(long, default_value_t = 0.25)]
    epsilon: f64,
    /// CHWBL load factor c.
    #[arg(long, default_value_t = 1.25)]
    chwbl_factor: f64,
    /// `kv-bounded`: prefill tokens one in-flight request is assumed to cost
    /// (the queued prefill tokens of each worker are always counted).
    #[arg(long, default_value_t = kvroute_select::LoadAwareConfig::default().tokens_per_in_flight)]
    tokens_per_in_flight: f64,
    /// `kv-bounded`: selector when no worker holds any of the prompt (rr,
    /// least-load, p2c).
    #[arg(long, default_value = "rr", value_parser = policy::parse_fallback)]
    bounded_fallback: kvroute_select::SelectorKind,
    /// `kv-exact`: bounded-load factor c of the cost scorer (inf = no cap).
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().load_factor)]
    cost_load_factor: f64,
    /// `kv-exact`: requests above the bounded-load cap an endpoint may hold.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().load_headroom)]
    cost_load_headroom: u32,
    /// `kv-exact`: relative cost slack within which the longest prefix is kept.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().affinity_slack)]
    cost_affinity_slack: f64,
    /// `kv-exact`: absolute cost slack (prefill tokens) within which the
    /// longest prefix is kept.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().affinity_tokens)]
    cost_affinity_tokens: f64,
    /// `kv-exact`: prefill-token equivalent of one request in flight.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().decode_tokens_per_request)]
    cost_decode_tokens: f64,
    /// `kv-exact`: decisions closer than this (ms) to a burst's first count
    /// as one burst, spread over the replicas' zones (0: decisions at the
    /// same instant only).
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().burst_window.as_secs_f64() * 1e3)]
    cost_burst_window_ms: f64,
    /// `kv-exact`: prefill-token equivalent of a cached token evicted while
    /// another worker has room for the request (0: off).
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().eviction_weight)]
    cost_eviction_weight: f64,
    /// Candidate sampling on pools of more than four times this many
    /// workers: a decision scores the workers holding more of the prompt
    /// than most, plus this many others at random (0: every worker).
    #[arg(long, default_value_t = kvroute_select::Thresholds::default().sample_size)]
    sample_size: u32,
    /// `kv-exact`: weight of the request's own uncached prefill.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().prefill_weight)]
    cost_prefill_weight: f64,
    /// `kv-exact`: costs closer than this many tokens are ties.
    #[arg(long, default_value_t = kvroute_select::CostConfig::default().tie_tokens)]
    cost_tie_tokens: f64,
    /// `kv-exact`: turn predicted entries off.
    #[arg(long)]
    no_predicted: bool,
    /// `kv-exact`: read the tracker's queued prefill as it is (no drain
    /// model of the queue still ahead).
    #[arg(long)]
    cost_no_drain: bool,
    /// Comma-separated policies: all, rr, least-load, p2c, chwbl, kv-overlap,
    /// kv-prefix, kv-bounded, kv-exact (the default scorer), dynamo-cost,
    /// smg-cache-aware, llmd-weighted.
    #[arg(long, default_value = "all")]
    policies: String,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write a bar chart (hit ratio, TTFT p50/p99 per policy) as SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Write a self-contained HTML report: hit ratio and the TTFT
    /// distribution per policy, requests per worker over time, the table.
    #[arg(long, value_name = "FILE")]
    html: Option<PathBuf>,
}

/// Default KV event delay of `kvroute sim run`, ms (see `--event-delay-ms`).
pub const DEFAULT_EVENT_DELAY_MS: f64 = 20.06;

/// Default gauge scrape interval of the peers' policies, ms (see
/// `--peer-poll-ms`): llm-d's endpoint picker's `--refresh-metrics-interval`
/// default, and its minimum.
pub const DEFAULT_PEER_POLL_MS: f64 = 50.0;

/// Runs `kvroute sim`.
pub fn run(args: &SimArgs) -> ExitCode {
    let result = match &args.command {
        SimCommand::Gen(g) => gen(g),
        SimCommand::Run(r) => run_cli(r),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn gen(args: &GenArgs) -> anyhow::Result<()> {
    let rate = args.rate.unwrap_or(args.kind.default_rate());
    check_rate(rate)?;
    let shape = args.shape.shape(args.kind)?;
    let w = workload::generate_shaped(
        &GenConfig {
            kind: args.kind,
            requests: args.requests,
            seed: args.seed,
            rate,
        },
        &shape,
    );
    let file =
        File::create(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    w.write_jsonl(BufWriter::new(file))
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote {} requests ({} prompt tokens) to {}",
        w.len(),
        w.prompt_tokens(),
        args.out.display()
    );
    Ok(())
}

fn check_rate(rate: f64) -> anyhow::Result<()> {
    anyhow::ensure!(
        rate.is_finite() && rate > 0.0,
        "--rate must be a positive number of requests per second"
    );
    Ok(())
}

/// Reads a Mooncake trace file.
///
/// # Errors
/// I/O and format errors, naming the file (and the line).
pub fn load_trace(path: &std::path::Path) -> anyhow::Result<Workload> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    trace::parse_jsonl(BufReader::new(file)).with_context(|| format!("{}", path.display()))
}

/// Everything a run needs besides the workload.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// Fleet and event path.
    pub fleet: FleetConfig,
    /// Policies, in report order.
    pub policies: Vec<Policy>,
    /// Arrival time scale (already applied to the workload by [`simulate_all`]).
    pub time_scale: f64,
    /// Requests of one instant spread over this many µs
    /// ([`Workload::spread_instants`], applied by [`simulate_all`] after the
    /// time scale).
    pub arrival_spread_us: u64,
}

/// Runs every policy of `plan` on `workload` (time scale applied here).
///
/// # Errors
/// A rule that cannot be built.
pub fn simulate_all(
    mut workload: Workload,
    source: &str,
    plan: &RunPlan,
) -> anyhow::Result<SimReport> {
    workload.scale_time(plan.time_scale);
    workload.spread_instants(plan.arrival_spread_us);
    let f = &plan.fleet;
    let block_size = f.worker.block_size.max(1);
    let mut report = SimReport {
        workload: WorkloadReport {
            source: source.to_owned(),
            requests: workload.len() as u64,
            prompt_tokens: workload.prompt_tokens(),
            ideal_prefix_hit_ratio: fleet::ideal_hit_ratio(&workload, block_size),
            pooled_prefix_hit_ratio: fleet::pooled_hit_ratio(
                &workload,
                block_size,
                u64::from(f.worker.capacity_blocks) * f.workers as u64,
            ),
        },
        fleet: FleetReport {
            workers: f.workers,
            block_size,
            capacity_blocks: f.worker.capacity_blocks,
            max_running: f.worker.max_running,
            prefill_step_us: f.worker.cost.prefill_step_us,
            prefill_us_per_token: f.worker.cost.prefill_us_per_token,
            max_batched_tokens: f.worker.cost.max_batched_tokens,
            decode_us_per_token: f.worker.cost.decode_us_per_token,
            #[allow(clippy::cast_precision_loss)]
            event_delay_ms: f.event_delay_us as f64 / 1000.0,
            event_loss: f.event_loss,
            seq_window: f.seq_window,
            concurrency: f.concurrency,
            time_scale: plan.time_scale,
            arrival_spread_us: plan.arrival_spread_us,
            epsilon: f.tuning.epsilon,
            chwbl_factor: f.tuning.chwbl_factor,
            sample_size: f.tuning.sample_size,
            tokens_per_in_flight: f.tuning.tokens_per_in_flight,
            bounded_fallback: format!("{:?}", f.tuning.bounded_fallback),
            seed: f.seed,
            replicas: f.replicas,
            #[allow(clippy::cast_precision_loss)]
            load_poll_ms: f.load_poll_us as f64 / 1000.0,
            #[allow(clippy::cast_precision_loss)]
            replica_sync_ms: f.replica_sync_us as f64 / 1000.0,
            #[allow(clippy::cast_precision_loss)]
            replica_stagger_ms: f.replica_stagger_us as f64 / 1000.0,
            #[allow(clippy::cast_precision_loss)]
            burst_order_ms: f.burst_order_us as f64 / 1000.0,
            #[allow(clippy::cast_precision_loss)]
            peer_poll_ms: f.peer_poll_us as f64 / 1000.0,
        },
        policies: Vec::with_capacity(plan.policies.len()),
    };
    let pooled = report.workload.pooled_prefix_hit_ratio;
    for &p in &plan.policies {
        let mut r = fleet::simulate(&workload, f, p)?;
        r.hit_over_pooled = if pooled > 0.0 {
            r.prefix_hit_ratio / pooled
        } else {
            0.0
        };
        report.policies.push(r);
    }
    Ok(report)
}

fn plan(args: &RunArgs) -> anyhow::Result<RunPlan> {
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    anyhow::ensure!(args.block_size >= 1, "--block-size must be at least 1");
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.event_loss),
        "--event-loss must be between 0 and 1"
    );
    anyhow::ensure!(
        args.event_delay_ms.is_finite() && args.event_delay_ms >= 0.0,
        "--event-delay-ms must be a non-negative number"
    );
    anyhow::ensure!(
        args.time_scale.is_finite() && args.time_scale >= 0.0,
        "--time-scale must be a non-negative number"
    );
    let capacity_blocks =
        u32::try_from(args.capacity_tokens / u64::from(args.block_size)).unwrap_or(u32::MAX);
    anyhow::ensure!(capacity_blocks >= 1, "--capacity-tokens holds no block");
    let policies = Policy::parse_list(&args.policies).map_err(anyhow::Error::msg)?;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let event_delay_us = (args.event_delay_ms * 1000.0).round() as u64;
    anyhow::ensure!(args.replicas >= 1, "--replicas must be at least 1");
    let poll_ms = args.load_poll_ms.unwrap_or(100.0);
    anyhow::ensure!(
        poll_ms.is_finite() && poll_ms >= 0.0,
        "--load-poll-ms must be a non-negative number"
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let load_poll_us = (poll_ms * 1000.0).round() as u64;
    let sync_ms = args
        .replica_sync_ms
        .unwrap_or(if args.replicas > 1 { 1.0 } else { 0.0 });
    anyhow::ensure!(
        sync_ms.is_finite() && sync_ms >= 0.0,
        "--replica-sync-ms must be a non-negative number"
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let replica_sync_us = (sync_ms * 1000.0).round() as u64;
    let stagger_ms = args.replica_stagger_ms.unwrap_or(if replica_sync_us > 0 {
        sync_ms + 0.1
    } else {
        0.0
    });
    anyhow::ensure!(
        stagger_ms.is_finite() && stagger_ms >= 0.0,
        "--replica-stagger-ms must be a non-negative number"
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let replica_stagger_us = (stagger_ms * 1000.0).round() as u64;
    #[allow(clippy::cast_precision_loss)]
    let order_ms = args
        .burst_order_ms
        .unwrap_or(kvroute_select::DEFAULT_BURST_ORDER.as_micros() as f64 / 1000.0);
    anyhow::ensure!(
        order_ms.is_finite() && order_ms >= 0.0,
        "--burst-order-ms must be a non-negative number"
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let burst_order_us = (order_ms * 1000.0).round() as u64;
    anyhow::ensure!(
        args.peer_poll_ms.is_finite() && args.peer_poll_ms >= 0.0,
        "--peer-poll-ms must be a non-negative number"
    );
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let peer_poll_us = (args.peer_poll_ms * 1000.0).round() as u64;
    Ok(RunPlan {
        fleet: FleetConfig {
            workers: args.workers,
            worker: WorkerConfig {
                block_size: args.block_size,
                capacity_blocks,
                max_running: args.max_running.max(1),
                cost: CostModel {
                    prefill_step_us: args.prefill_step_us,
                    prefill_us_per_token: args.prefill_us_per_token,
                    max_batched_tokens: args.max_batched_tokens.max(1),
                    decode_us_per_token: args.decode_us_per_token,
                },
                ..WorkerConfig::default()
            },
            event_delay_us,
            event_loss: args.event_loss,
            seq_window: args.seq_window,
            seed: args.seed,
            concurrency: args.concurrency,
            tuning: Tuning {
                epsilon: args.epsilon,
                chwbl_factor: args.chwbl_factor,
                tokens_per_in_flight: args.tokens_per_in_flight,
                bounded_fallback: args.bounded_fallback,
                cost: kvroute_select::CostConfig {
                    load_factor: args.cost_load_factor,
                    affinity_slack: args.cost_affinity_slack,
                    affinity_tokens: args.cost_affinity_tokens,
                    decode_tokens_per_request: args.cost_decode_tokens,
                    prefill_weight: args.cost_prefill_weight,
                    load_headroom: args.cost_load_headroom,
                    tie_tokens: args.cost_tie_tokens,
                    drain_queue: !args.cost_no_drain,
                    burst_window: std::time::Duration::from_secs_f64(
                        (args.cost_burst_window_ms / 1e3).max(0.0),
                    ),
                    eviction_weight: args.cost_eviction_weight,
                    ..kvroute_select::CostConfig::default()
                },
                predicted: !args.no_predicted,
                sample_size: args.sample_size,
            },
            replicas: args.replicas,
            load_poll_us,
            replica_sync_us,
            replica_stagger_us,
            burst_order_us,
            peer_poll_us,
        },
        policies,
        time_scale: args.time_scale,
        arrival_spread_us: args.arrival_spread_us,
    })
}

fn run_cli(args: &RunArgs) -> anyhow::Result<()> {
    let plan = plan(args)?;
    let (mut workload, source) = match (&args.trace, args.kind) {
        (Some(path), _) => (load_trace(path)?, path.display().to_string()),
        (None, Some(kind)) => {
            let rate = args.rate.unwrap_or(kind.default_rate());
            check_rate(rate)?;
            let shape = args.shape.shape(kind)?;
            let requests = args.requests.unwrap_or(10_000);
            let w = workload::generate_shaped(
                &GenConfig {
                    kind,
                    requests,
                    seed: args.seed,
                    rate,
                },
                &shape,
            );
            let source = format!("{} (seed {}, {rate} req/s)", kind.name(), args.seed);
            (w, source)
        }
        (None, None) => anyhow::bail!("give --trace FILE or --kind KIND"),
    };
    if let Some(n) = args.requests {
        workload.truncate(n);
    }
    anyhow::ensure!(!workload.is_empty(), "no request to simulate");
    // Wall time is for the operator only; it never enters the results.
    let started = std::time::Instant::now();
    let report = simulate_all(workload, &source, &plan)?;
    let elapsed = started.elapsed();
    let table = report.table();
    print!("{table}");
    println!(
        "simulated {} requests x {} policies on {} workers in {:.2} s wall time",
        report.workload.requests,
        report.policies.len(),
        plan.fleet.workers,
        elapsed.as_secs_f64()
    );
    if let Some(path) = &args.json {
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::new(file);
        serde_json::to_writer_pretty(&mut out, &report)
            .with_context(|| format!("writing {}", path.display()))?;
        std::io::Write::write_all(&mut out, b"\n")?;
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, report.svg())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.html {
        std::fs::write(path, html::render(&report, &table))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("kvroute sim: HTML report written to {}", path.display());
    }
    Ok(())
}
