//! kvroute's ZeroMQ subscriber (`ZmqSubscriber` on kvroute-zeromq, the
//! zeromq 0.7 fork) against libzmq through the `zmq` crate (zmq-sys builds
//! libzmq from source), fed by the same libzmq publisher with the same vLLM
//! batches, interleaved round by round on this machine.
//!
//! ```text
//! cargo run --release --manifest-path examples/bench-zmq/Cargo.toml -- [rounds]
//! ```
//!
//! Subscribers, each in this process, each on a one-worker tokio runtime:
//! * `zeromq-rs`: `kvroute_engines::transport::ZmqSubscriber` as the gateway
//!   runs it (reconnect loop, monitor, receive limits, replay hooks);
//! * `libzmq-fd`: a `zmq` SUB driven by tokio through `ZMQ_FD` readiness
//!   (`AsyncFd`, then `recv(DONTWAIT)` until `EAGAIN`), no thread of ours;
//!   libzmq adds its own I/O thread;
//! * `libzmq-thread`: a `zmq` SUB read with blocking `recv` on a dedicated thread.
//!
//! Both libzmq subscribers set `ZMQ_MAXMSGSIZE` to the limit the kvroute
//! subscriber uses, and hand each `[topic, seq, payload]` to the sink through
//! the same `LiveMessage::parse`, so the sink side is identical.
//!
//! The publisher is a child process (this binary, `publish`): libzmq XPUB via the
//! `zmq` crate, `SNDHWM` 0 so it never drops, payloads the five
//! `golden/vllm-events/v0.33.0/stream` batches cycled (35–732 B, mean 382 B) or a
//! 16 KiB frame (a long prefill's batch), each batch's `ts` stamped just before
//! it is sent.
//!
//! Figures per run:
//! * throughput: the publisher sends N messages flat out; messages/s from the
//!   subscriber's first to its N-th message, and the subscriber process's CPU
//!   time per message (getrusage, so libzmq's I/O thread is counted);
//! * latency: 10 000 batches/s for 3 s (sleep-paced), each through the real
//!   ingest path (`DecodingSink` → `IndexIngest` → `SharedIndex`); publish →
//!   received and publish → applied percentiles.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::EndpointId;
use kvroute_engines::engine::VLLM;
use kvroute_engines::events::LiveMessage;
use kvroute_engines::transport::{
    DecodingSink, Frame, FrameReport, FrameSink, FrameSource, IndexIngest, ReplayOutcome,
    SinkAction, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig, DEFAULT_MAX_MESSAGE_BYTES,
};
use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};

const IMPLS: [&str; 3] = ["zeromq-rs", "libzmq-fd", "libzmq-thread"];

fn wall() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// User + system CPU time of this process (all threads), seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn golden_stream() -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../golden/vllm-events/v0.33.0/stream");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "msgpack"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

// ------------------------------------------------------------------------------
// Publisher (child process).

fn publish(port: u16, count: u64, rate: f64, payload: &str) {
    let ctx = zmq::Context::new();
    let socket = ctx.socket(zmq::XPUB).unwrap();
    socket.set_sndhwm(0).unwrap();
    socket.set_xpub_verbose(true).unwrap();
    socket.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    println!("READY");
    let sub = socket.recv_bytes(0).unwrap();
    assert_eq!(sub.first(), Some(&1));
    // The subscription is on the wire before the PUB side applies it.
    std::thread::sleep(Duration::from_millis(100));
    println!("SUBSCRIBED");
    let mut payloads = match payload {
        "big" => vec![vec![0x5au8; 16 << 10]],
        _ => golden_stream(),
    };
    let interval = if rate > 0.0 { 1.0 / rate } else { 0.0 };
    let start = Instant::now();
    for seq in 0..count {
        if interval > 0.0 {
            let due = start + Duration::from_secs_f64(seq as f64 * interval);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        let n = payloads.len();
        let p = &mut payloads[seq as usize % n];
        // [fixarray(3), float64 ts, ...]: stamp the batch's ts.
        if p.len() > 10 && p[0] == 0x93 && p[1] == 0xcb {
            p[2..10].copy_from_slice(&wall().to_bits().to_be_bytes());
        }
        socket.send(&b""[..], zmq::SNDMORE).unwrap();
        socket.send(&seq.to_be_bytes()[..], zmq::SNDMORE).unwrap();
        socket.send(&p[..], 0).unwrap();
    }
    println!("PUBLISHED {:.3}", start.elapsed().as_secs_f64());
    // Stay until the parent is done (stdin closes).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

struct Publisher {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Publisher {
    fn start(port: u16, count: u64, rate: f64, payload: &str) -> Publisher {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "publish",
                &port.to_string(),
                &count.to_string(),
                &rate.to_string(),
                payload,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let p = Publisher { child, lines };
        p.expect("READY");
        p
    }

    fn expect(&self, prefix: &str) -> String {
        loop {
            let line = self.lines.recv_timeout(Duration::from_secs(60)).unwrap();
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    fn finish(mut self) {
        let _ = self.child.stdin.take().map(|mut s| s.write_all(b"done\n"));
        let _ = self.child.wait();
    }
}

// ------------------------------------------------------------------------------
// Sinks.

/// Counts messages; signals when the `target`-th arrives.
struct CountSink {
    seen: u64,
    target: u64,
    first: Option<(Instant, f64)>,
    done: mpsc::Sender<(Instant, f64, Instant, f64)>,
}

impl FrameSink for CountSink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        std::hint::black_box(frame.payload);
        if self.first.is_none() {
            self.first = Some((Instant::now(), cpu_seconds()));
        }
        self.seen += 1;
        if self.seen == self.target {
            let (t0, c0) = self.first.unwrap();
            let _ = self.done.send((t0, c0, Instant::now(), cpu_seconds()));
        }
        FrameReport::default()
    }
    fn on_connected(&mut self) -> SinkAction {
        SinkAction::Continue
    }
    fn on_disconnected(&mut self) {}
    fn on_replay_done(&mut self, _: &ReplayOutcome) -> FrameReport {
        FrameReport::default()
    }
}

/// The real ingest path, timed: (published, received, applied) per batch.
struct TimedSink {
    inner: DecodingSink<IndexIngest>,
    samples: Arc<Mutex<Vec<(f64, f64, f64)>>>,
}

impl TimedSink {
    fn new(samples: Arc<Mutex<Vec<(f64, f64, f64)>>>) -> TimedSink {
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = EndpointIngest::new(EndpointId(0), IngestConfig::default(), Keying::Engine);
        TimedSink {
            inner: DecodingSink::for_engine(&VLLM, IndexIngest::new(ingest, index, Some(0), false))
                .unwrap(),
            samples,
        }
    }
}

impl FrameSink for TimedSink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let received = wall();
        let report = self.inner.on_frame(frame);
        let applied = wall();
        if let Some(published) = report.engine_timestamp {
            self.samples
                .lock()
                .unwrap()
                .push((published, received, applied));
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

// ------------------------------------------------------------------------------
// libzmq subscribers.

struct Fd(RawFd);
impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn libzmq_sub(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let socket = ctx.socket(zmq::SUB).unwrap();
    socket
        .set_maxmsgsize(DEFAULT_MAX_MESSAGE_BYTES as i64)
        .unwrap();
    socket.set_subscribe(b"").unwrap();
    socket.connect(endpoint).unwrap();
    socket
}

/// Receives one whole message into `parts` (reused); `Ok(None)` on EAGAIN.
fn recv_message(
    socket: &zmq::Socket,
    parts: &mut Vec<zmq::Message>,
    flags: i32,
) -> Result<Option<usize>, zmq::Error> {
    let mut n = 0;
    loop {
        if parts.len() == n {
            parts.push(zmq::Message::new());
        }
        match socket.recv(&mut parts[n], if n == 0 { flags } else { 0 }) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) if n == 0 => return Ok(None),
            Err(e) => return Err(e),
        }
        n += 1;
        if !parts[n - 1].get_more() {
            return Ok(Some(n));
        }
    }
}

fn deliver<S: FrameSink>(parts: &[zmq::Message], n: usize, sink: &mut S) {
    if n != 3 {
        return;
    }
    let frames = [&parts[0][..], &parts[1][..], &parts[2][..]];
    if let Ok(LiveMessage {
        topic,
        seq,
        payload,
    }) = LiveMessage::parse(&frames)
    {
        sink.on_frame(Frame {
            topic,
            seq,
            payload,
            source: FrameSource::Live,
        });
    }
}

async fn libzmq_fd<S: FrameSink>(endpoint: String, mut sink: S, stop: Arc<AtomicBool>) -> S {
    let ctx = zmq::Context::new();
    let socket = libzmq_sub(&ctx, &endpoint);
    // SAFETY: ZMQ_FD belongs to `socket`, which outlives `fd` (dropped first,
    // declared after it); nothing else closes it. This registration is the
    // `unsafe` a libzmq transport would add to kvroute-engines.
    let fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            Fd(socket.get_fd().unwrap()),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| e.to_string())
    .unwrap();
    let mut parts = Vec::new();
    loop {
        // ZMQ_FD is edge-like: clear our readiness first, then drain until
        // EAGAIN (which also processes libzmq's pending commands), so a signal
        // arriving after the drain wakes the next await.
        while let Some(n) = recv_message(&socket, &mut parts, zmq::DONTWAIT).unwrap() {
            deliver(&parts, n, &mut sink);
        }
        if stop.load(Ordering::Relaxed) {
            return sink;
        }
        tokio::select! {
            guard = fd.readable() => guard.unwrap().clear_ready(),
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

fn libzmq_thread<S: FrameSink>(endpoint: String, mut sink: S, stop: Arc<AtomicBool>) -> S {
    let ctx = zmq::Context::new();
    let socket = libzmq_sub(&ctx, &endpoint);
    socket.set_rcvtimeo(50).unwrap();
    let mut parts = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if let Some(n) = recv_message(&socket, &mut parts, 0).unwrap() {
            deliver(&parts, n, &mut sink);
        }
    }
    sink
}

/// Runs `sink` behind subscriber `which` until `stop` is set; returns the sink.
fn run_subscriber<S: FrameSink + Send + 'static>(
    which: &str,
    endpoint: String,
    sink: S,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<S> {
    let which = which.to_owned();
    std::thread::spawn(move || {
        if which == "libzmq-thread" {
            return libzmq_thread(endpoint, sink, stop);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            if which == "libzmq-fd" {
                return tokio::spawn(libzmq_fd(endpoint, sink, stop)).await.unwrap();
            }
            let subscriber =
                ZmqSubscriber::new(ZmqSubscriberConfig::new(ZmqEndpoint::connect(endpoint)));
            let shutdown = async move {
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::spawn(subscriber.run(sink, shutdown)).await.unwrap()
        })
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ------------------------------------------------------------------------------
// Runs.

/// (messages/s, CPU µs per message).
fn throughput(which: &str, count: u64, payload: &str) -> (f64, f64) {
    let port = free_port();
    let publisher = Publisher::start(port, count, 0.0, payload);
    let (done, finished) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let sink = CountSink {
        seen: 0,
        target: count,
        first: None,
        done,
    };
    let handle = run_subscriber(
        which,
        format!("tcp://127.0.0.1:{port}"),
        sink,
        Arc::clone(&stop),
    );
    publisher.expect("SUBSCRIBED");
    let (t0, c0, t1, c1) = finished.recv_timeout(Duration::from_secs(120)).unwrap();
    stop.store(true, Ordering::Relaxed);
    let _ = handle.join().unwrap();
    publisher.finish();
    let secs = (t1 - t0).as_secs_f64();
    (
        (count - 1) as f64 / secs,
        (c1 - c0) * 1e6 / (count - 1) as f64,
    )
}

/// (publish→received p50, p99, publish→applied p50, p99) in µs.
fn latency(which: &str, rate: f64, seconds: f64) -> [f64; 4] {
    let port = free_port();
    let count = (rate * seconds) as u64;
    let publisher = Publisher::start(port, count, rate, "stream");
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let handle = run_subscriber(
        which,
        format!("tcp://127.0.0.1:{port}"),
        TimedSink::new(Arc::clone(&samples)),
        Arc::clone(&stop),
    );
    publisher.expect("SUBSCRIBED");
    publisher.expect("PUBLISHED");
    let deadline = Instant::now() + Duration::from_secs(10);
    while (samples.lock().unwrap().len() as u64) < count && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = handle.join().unwrap();
    publisher.finish();
    let samples = samples.lock().unwrap();
    assert_eq!(samples.len() as u64, count, "{which}: batches lost");
    let pct = |mut v: Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    let recv: Vec<f64> = samples.iter().map(|s| (s.1 - s.0) * 1e6).collect();
    let appl: Vec<f64> = samples.iter().map(|s| (s.2 - s.0) * 1e6).collect();
    [
        pct(recv.clone(), 0.5),
        pct(recv, 0.99),
        pct(appl.clone(), 0.5),
        pct(appl, 0.99),
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("publish") {
        publish(
            args[1].parse().unwrap(),
            args[2].parse().unwrap(),
            args[3].parse().unwrap(),
            &args[4],
        );
        return;
    }
    let rounds: usize = args.first().map_or(5, |a| a.parse().unwrap());
    const SMALL: u64 = 200_000;
    const BIG: u64 = 40_000;
    // name -> figure -> per-round values
    let mut results: Vec<(&str, Vec<[f64; 8]>)> = IMPLS.iter().map(|i| (*i, vec![])).collect();
    for round in 0..rounds {
        // Rotate the order each round so no subscriber always runs first.
        for k in 0..IMPLS.len() {
            let i = (k + round) % IMPLS.len();
            let which = IMPLS[i];
            let (small, small_cpu) = throughput(which, SMALL, "stream");
            let (big, big_cpu) = throughput(which, BIG, "big");
            let lat = latency(which, 10_000.0, 3.0);
            println!(
                "round {round} {which:<14} stream {small:>9.0} msg/s {small_cpu:>5.2} us cpu/msg | \
                 16KiB {big:>8.0} msg/s {big_cpu:>5.2} us cpu/msg | publish->received p50 {:>5.0} p99 {:>6.0} us | \
                 publish->applied p50 {:>5.0} p99 {:>6.0} us",
                lat[0], lat[1], lat[2], lat[3]
            );
            results[i].1.push([
                small, small_cpu, big, big_cpu, lat[0], lat[1], lat[2], lat[3],
            ]);
        }
    }
    let med = |runs: &Vec<[f64; 8]>, f: usize| median(runs.iter().map(|r| r[f]).collect());
    println!("\nmedians over {rounds} interleaved rounds (ratio = libzmq / zeromq-rs)");
    let base = results[0].1.clone();
    let names = [
        "stream msg/s",
        "stream cpu us/msg",
        "16KiB msg/s",
        "16KiB cpu us/msg",
        "pub->recv p50 us",
        "pub->recv p99 us",
        "pub->applied p50 us",
        "pub->applied p99 us",
    ];
    for (f, name) in names.iter().enumerate() {
        let b = med(&base, f);
        let mut line = format!("{name:<20} zeromq-rs {b:>10.2}");
        for (which, runs) in &results[1..] {
            let m = med(runs, f);
            line += &format!(" | {which} {m:>10.2} ({:.2}x)", m / b);
        }
        println!("{line}");
    }
}
