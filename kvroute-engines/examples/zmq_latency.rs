//! Publish → applied latency over loopback ZeroMQ, split into where the time goes.
//!
//! A pyzmq/msgspec publisher (tests/python/kv_publisher.py, real libzmq) streams
//! vLLM 0.33 batches at a fixed rate, each stamped with `time.time()` just before
//! encoding (the engine timestamp field). Our subscriber receives them and the real
//! ingest path applies them: [`DecodingSink`] (vLLM decoder) → [`IndexIngest`]
//! (sequence window) → [`SharedIndex`], exactly as a gateway wires it.
//!
//! Three figures per batch:
//! * publish → received: from the publisher's stamp to the moment the subscriber
//!   hands the message to the sink (publisher encode + libzmq + loopback TCP +
//!   wake-up of our task + zeromq-rs framing);
//! * received → applied: decode + sequence window + index writes (our code only);
//! * publish → applied: the sum, the figure of the latency target.
//!
//! It also reads each thread's scheduler statistics (`/proc/<pid>/task/*/schedstat`:
//! time spent runnable but waiting for a CPU) for our process and the publisher, which
//! shows whether a tail comes from CPU contention rather than from code.
//!
//! ```text
//! scripts/python-env.sh
//! cargo run --release -p kvroute-engines --example zmq_latency -- [rate] [seconds] [spin|sleep] [multi|current]
//! ```
//! What it showed on the shared 2-core machine (numbers in the lead's BENCHMARKS.md):
//! received → applied (all of our decode + window + index work) has p99 ≈ 5–8 µs in
//! every run; the whole p99 tail is publish → received and moves with the CPU time
//! the publisher's libzmq I/O thread spent waiting for a core (schedstat), i.e.
//! with CPU contention on the host, not with anything on our side of the socket.
//! Run under `chrt -f 1` (both processes get a core when woken) the same pipeline
//! meets p99 < 1 ms at the same machine load.
//!
//! `spin` (default) is the publisher's own busy-polling pacer; `sleep` paces with
//! short sleeps (tests/python/kv_latency_publisher.py) like an engine whose publisher
//! thread blocks between steps. `multi` (default) runs the subscriber on a
//! one-worker multi-thread tokio runtime, `current` on a current-thread runtime.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_core::EndpointId;
use kvroute_engines::engine::VLLM;
use kvroute_engines::transport::{
    DecodingSink, Frame, FrameReport, FrameSink, IndexIngest, ReplayOutcome, SinkAction,
    ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
};
use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};

/// One batch: publisher stamp, received, applied (seconds since the epoch).
#[derive(Clone, Copy)]
struct Sample {
    published: f64,
    received: f64,
    applied: f64,
}

/// The real sink, timed from the outside.
struct TimedSink {
    inner: DecodingSink<IndexIngest>,
    samples: Arc<Mutex<Vec<Sample>>>,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

impl FrameSink for TimedSink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let received = now();
        let report = self.inner.on_frame(frame);
        let applied = now();
        if let Some(published) = report.engine_timestamp {
            self.samples.lock().unwrap().push(Sample {
                published,
                received,
                applied,
            });
        }
        report
    }
    fn on_connected(&mut self) -> SinkAction {
        self.inner.on_connected()
    }
    fn on_disconnected(&mut self) {
        self.inner.on_disconnected();
    }
    fn on_replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        self.inner.on_replay_done(outcome)
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summary(name: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    println!(
        "{name:<22} p50 {:>6.0} us  p99 {:>6.0} us  p99.9 {:>6.0} us  max {:>6.0} us",
        percentile(&v, 0.50),
        percentile(&v, 0.99),
        percentile(&v, 0.999),
        v[v.len() - 1]
    );
}

/// Per thread name: (ns runnable but waiting for a CPU, ns running).
fn sched_waits(pid: u32) -> BTreeMap<String, (u64, u64)> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let f: Vec<u64> = stat
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if let [run, wait, ..] = f[..] {
            let e = out.entry(comm.trim().to_owned()).or_insert((0, 0));
            e.0 += wait;
            e.1 += run;
        }
    }
    out
}

fn print_sched(
    label: &str,
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) {
    for (name, (wait, run)) in after {
        let (w0, r0) = before.get(name).copied().unwrap_or((0, 0));
        println!(
            "  {label} thread {name:<16} ran {:>6.0} ms, waited for a CPU {:>6.1} ms",
            (run - r0) as f64 / 1e6,
            (wait - w0) as f64 / 1e6
        );
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rate: u64 = args.next().map_or(10_000, |a| a.parse().unwrap());
    let seconds: u64 = args.next().map_or(3, |a| a.parse().unwrap());
    let pace = args.next().unwrap_or_else(|| "spin".into());
    let runtime = args.next().unwrap_or_else(|| "multi".into());
    let count = rate * seconds;

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(python.exists(), "run scripts/python-env.sh first");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("tcp://127.0.0.1:{port}");

    let rt = match runtime.as_str() {
        "current" => tokio::runtime::Builder::new_current_thread(),
        _ => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(1);
            b
        }
    }
    .enable_all()
    .build()
    .unwrap();
    let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
    let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
    let samples = Arc::new(Mutex::new(Vec::with_capacity(count as usize)));
    let sink = TimedSink {
        inner: DecodingSink::for_engine(
            &VLLM,
            IndexIngest::new(ingest, Arc::clone(&index), Some(0), false),
        )
        .unwrap(),
        samples: Arc::clone(&samples),
    };
    let subscriber = ZmqSubscriber::new(ZmqSubscriberConfig::new(ZmqEndpoint::connect(
        endpoint.clone(),
    )));
    let metrics = subscriber.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // A current-thread runtime runs the subscriber on the thread that blocks on it;
    // a multi-thread one on its worker (spawned, as a gateway would), so the I/O
    // driver and the subscriber share one thread in both cases.
    let current = runtime == "current";
    let driver = std::thread::Builder::new()
        .name("subscriber".into())
        .spawn(move || {
            let run = subscriber.run(sink, async move {
                let _ = stopped.await;
            });
            let sink = if current {
                rt.block_on(run)
            } else {
                rt.block_on(async { tokio::spawn(run).await.unwrap() })
            };
            let _ = done_tx.send(());
            drop(sink);
        })
        .unwrap();

    let publisher_script = if pace == "sleep" {
        "tests/python/kv_latency_publisher.py"
    } else {
        "tests/python/kv_publisher.py"
    };
    let mut child = Command::new(python)
        .arg(root.join(publisher_script))
        .args([
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &endpoint,
            "--watchdog-s",
            "120",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(
        child.stdin.as_mut().unwrap(),
        r#"[{{"op":"wait_subscriber"}},{{"op":"wait_stdin"}},{{"op":"publish","count":{count},"rate":{rate}}},{{"op":"serve","ms":300}}]"#
    )
    .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().starts_with("SUBSCRIBED") {
            break;
        }
    }
    let (ours0, theirs0) = (sched_waits(std::process::id()), sched_waits(child.id()));
    writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
    let mut theirs1 = BTreeMap::new();
    for line in lines {
        let line = line.unwrap();
        if line.starts_with("PUBLISHED") {
            theirs1 = sched_waits(child.id());
        }
        if line.starts_with("DONE") || line.starts_with("ERROR") {
            break;
        }
    }
    let ours1 = sched_waits(std::process::id());
    let _ = child.wait();
    let _ = stop.send(());
    done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    driver.join().unwrap();

    let samples = samples.lock().unwrap();
    let snap = metrics.snapshot();
    println!(
        "rate {rate}/s for {seconds}s, publisher pacing {pace}, {runtime} runtime: \
         received {} / {count}, gaps {}, decode errors {}, inventory {} keys",
        samples.len(),
        snap.gaps,
        snap.decode_errors,
        index.inventory(EndpointId(0)).total()
    );
    if samples.is_empty() {
        return;
    }
    let us = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<_>>();
    summary(
        "publish -> applied",
        us(|s| (s.applied - s.published) * 1e6),
    );
    summary(
        "publish -> received",
        us(|s| (s.received - s.published) * 1e6),
    );
    summary(
        "received -> applied",
        us(|s| (s.applied - s.received) * 1e6),
    );
    // Batches that arrived in a clump: received within 20 us of the previous one
    // although published ≥ 80 us later, i.e. they waited somewhere upstream of us.
    let clumped = samples
        .windows(2)
        .filter(|w| {
            w[1].received - w[0].received < 20e-6 && w[1].published - w[0].published > 80e-6
        })
        .count();
    println!("batches received in a clump (upstream delay): {clumped}");
    let mut slowest: Vec<(usize, f64)> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| (i, (s.applied - s.received) * 1e6))
        .collect();
    slowest.sort_by(|a, b| b.1.total_cmp(&a.1));
    let slowest: Vec<String> = slowest
        .iter()
        .take(8)
        .map(|(i, us)| format!("#{i}: {us:.0} us"))
        .collect();
    println!("slowest applies: {}", slowest.join(", "));
    print_sched("subscriber", &ours0, &ours1);
    print_sched("publisher", &theirs0, &theirs1);
}
