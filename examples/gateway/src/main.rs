//! `kvroute`: the example gateway binary — parity checker, tokenizer debugger,
//! HTTP gateway, mock engine, demo and fleet simulator.

mod bench;
mod demo;
mod gateway;
mod parity;
mod tokenize;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvroute_mock_engine as mock_engine;
use kvroute_sim as sim;

// glibc malloc/free were 17 % of the gateway's CPU samples at 32 concurrent
// streamed requests (per-request bodies, JSON values, token vectors freed on
// other threads); see BENCHMARKS.md for the before/after run.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware routing for LLM gateways"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Load-test components on loopback (`kvroute bench gateway`: mock engines
    /// direct vs through the gateway; bounded request count).
    Bench(bench::BenchArgs),
    /// Start mock engines and the gateway on loopback, drive a multi-tenant
    /// shared-prefix chat workload through RR, CHWBL and KV-exact, and print a
    /// comparison table.
    Demo(demo::DemoArgs),
    /// Verify golden vectors and fixtures (hash vectors, event fixtures, chat cases)
    /// against kvroute's implementation. Walks directories; prints one line per
    /// failing case and ends with `N passed, M failed`.
    Parity {
        /// Files or directories to verify.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Model directory (tokenizer.json[.gz], tokenizer_config.json) used for
        /// chat-case files. Without it, model directories found under the walked
        /// paths are matched to chat files by tokenizer checksum.
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Also print one line per passing case.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Run an OpenAI-compatible mock engine with a real prefix cache that publishes
    /// KV events (vLLM / SGLang over ZeroMQ, or the TensorRT-LLM HTTP drain).
    MockEngine(mock_engine::Args),
    /// Run the HTTP gateway: OpenAI full proxy with KV-cache-aware routing, admin
    /// API and Prometheus metrics (`kvroute serve --config FILE`).
    Serve(gateway::ServeArgs),
    /// Simulate a fleet (deterministic discrete events, real selection and
    /// ingest code) and compare routing policies on a workload
    /// (`kvroute sim gen ...`, `kvroute sim run ...`).
    Sim(sim::SimArgs),
    /// Show the rendered prompt, token ids and block keys kvroute computes for one
    /// OpenAI request (`--contract` adds the keys): the tool for debugging a 0 % hit rate.
    Tokenize(tokenize::TokenizeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Parity {
            paths,
            model_dir,
            verbose,
        } => parity::run(&paths, model_dir.as_deref(), verbose),
        Command::Bench(args) => bench::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::MockEngine(args) => mock_engine::run(&args),
        Command::Serve(args) => gateway::run(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Tokenize(args) => tokenize::run(&args),
    }
}
