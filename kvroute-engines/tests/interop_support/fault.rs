//! Helpers of the fault-injection tests (tests/fault_*.rs): the real ingest path
//! behind our ZeroMQ subscriber, an observing sink wrapper, a TCP relay that can cut
//! the subscriber off, and the process's resident memory.
//!
//! Included with `#[path = "interop_support/fault.rs"] mod fault;` next to
//! `mod interop_support;`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::EndpointId;
use kvroute_engines::engine::VLLM;
use kvroute_engines::transport::{
    DecodingSink, Frame, FrameReport, FrameSink, IndexIngest, MetricsSnapshot, ReplayOutcome,
    SinkAction, SubscriberMetrics, ZmqSubscriber, ZmqSubscriberConfig,
};
use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};

/// The endpoint every rig writes.
pub const EP: EndpointId = EndpointId(0);

/// Key the publishers derive for (epoch, seq): see `synthetic_batch` in
/// tests/python/kv_publisher.py.
pub fn synthetic_key(epoch: u64, seq: u64) -> u64 {
    ((epoch + 1) << 40) | (seq + 1)
}

/// What the observing wrapper saw, in arrival order.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// Frames handed to the sink (live and replayed).
    pub frames: u64,
    /// Highest seq seen (reset by a seq that goes backwards: restart).
    pub last_seq: Option<u64>,
    /// Forward jumps in the seq (`seq > last + 1`).
    pub discontinuities: u64,
    /// Batches skipped by those jumps.
    pub missed: u64,
    /// Seqs whose payload the decoder rejected.
    pub decode_error_seqs: Vec<u64>,
    /// Reports with `gap` set (the ingest window's view).
    pub gap_reports: u64,
    /// Reports with `cleared` set.
    pub cleared_reports: u64,
}

/// Wraps the real sink: records [`Observed`] and optionally sleeps per frame to
/// play a slow consumer (the subscriber calls the sink synchronously on its task,
/// so a slow sink stops the socket from being read).
pub struct ObservingSink<S> {
    pub inner: S,
    pub observed: Arc<Mutex<Observed>>,
    pub delay_per_frame: Duration,
}

impl<S: FrameSink> FrameSink for ObservingSink<S> {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        if !self.delay_per_frame.is_zero() {
            std::thread::sleep(self.delay_per_frame);
        }
        let report = self.inner.on_frame(frame);
        let mut o = self.observed.lock().unwrap();
        o.frames += 1;
        match o.last_seq {
            Some(last) if frame.seq > last + 1 => {
                o.discontinuities += 1;
                o.missed += frame.seq - last - 1;
                o.last_seq = Some(frame.seq);
            }
            Some(last) if frame.seq <= last && !report.restart => {}
            _ => o.last_seq = Some(frame.seq),
        }
        if report.decode_error {
            o.decode_error_seqs.push(frame.seq);
        }
        o.gap_reports += u64::from(report.gap);
        o.cleared_reports += u64::from(report.cleared);
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

/// The sink a gateway runs per vLLM endpoint, observed.
pub type RigSink = ObservingSink<DecodingSink<IndexIngest>>;

/// How to build a [`Rig`].
pub struct RigConfig {
    pub subscriber: ZmqSubscriberConfig,
    pub ingest: IngestConfig,
    pub index: IndexConfig,
    /// Ask for a replay on every (re)connect (needs a replay endpoint).
    pub bootstrap: bool,
    pub delay_per_frame: Duration,
}

impl RigConfig {
    pub fn new(subscriber: ZmqSubscriberConfig) -> Self {
        Self {
            subscriber,
            ingest: IngestConfig::default(),
            index: IndexConfig::default(),
            bootstrap: false,
            delay_per_frame: Duration::ZERO,
        }
    }
}

/// A running subscriber → decoder → ingest → shared index, on its own runtime.
pub struct Rig {
    pub index: Arc<SharedIndex>,
    pub metrics: Arc<SubscriberMetrics>,
    pub observed: Arc<Mutex<Observed>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<RigSink>>,
    rt: tokio::runtime::Runtime,
}

impl Rig {
    pub fn start(config: RigConfig) -> Rig {
        let rt = super::interop_support::runtime();
        let index = Arc::new(SharedIndex::new(1, config.index));
        let ingest = EndpointIngest::new(EP, config.ingest, Keying::Engine);
        let observed = Arc::new(Mutex::new(Observed::default()));
        let sink = ObservingSink {
            inner: DecodingSink::for_engine(
                &VLLM,
                IndexIngest::new(ingest, Arc::clone(&index), Some(0), config.bootstrap),
            )
            .unwrap(),
            observed: Arc::clone(&observed),
            delay_per_frame: config.delay_per_frame,
        };
        let subscriber = ZmqSubscriber::new(config.subscriber);
        let metrics = subscriber.metrics();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(subscriber.run(sink, async move {
            let _ = stopped.await;
        }));
        Rig {
            index,
            metrics,
            observed,
            stop: Some(stop),
            task: Some(task),
            rt,
        }
    }

    pub fn observed(&self) -> Observed {
        self.observed.lock().unwrap().clone()
    }

    pub fn has(&self, key: u64) -> bool {
        self.index
            .contains(EP, kvroute_core::BlockKey(key), kvroute_core::Medium::Gpu)
    }

    /// Polls `cond` every millisecond; panics with the metrics after `timeout`.
    /// Returns how long it took.
    pub fn wait_for(&self, what: &str, timeout: Duration, cond: impl Fn(&Rig) -> bool) -> Duration {
        let start = Instant::now();
        while !cond(self) {
            assert!(
                start.elapsed() < timeout,
                "timed out after {timeout:?} waiting for {what}: {:?}\n{:?}",
                self.metrics.snapshot(),
                self.observed()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        start.elapsed()
    }

    /// Stops the subscriber; returns its final metrics and the sink (ingest counters).
    pub fn finish(mut self) -> (MetricsSnapshot, RigSink) {
        let _ = self.stop.take().unwrap().send(());
        let task = self.task.take().unwrap();
        let sink = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
            .expect("subscriber stops on shutdown")
            .unwrap();
        (self.metrics.snapshot(), sink)
    }
}

/// A TCP relay between the subscriber and the publisher. [`Relay::sever`] closes
/// every relayed connection and refuses new ones (a network cut: the publisher
/// sees its subscriber leave and drops what it publishes meanwhile) until
/// [`Relay::resume`].
pub struct Relay {
    pub port: u16,
    severed: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    pub fn start(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let severed = Arc::new(AtomicBool::new(false));
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let acceptor = {
            let (severed, stopping, conns) = (severed.clone(), stopping.clone(), conns.clone());
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    if severed.load(Ordering::SeqCst) {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(upstream) else {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    {
                        let mut c = conns.lock().unwrap();
                        c.push(client.try_clone().unwrap());
                        c.push(server.try_clone().unwrap());
                    }
                    pump(client.try_clone().unwrap(), server.try_clone().unwrap());
                    pump(server, client);
                }
            })
        };
        Relay {
            port,
            severed,
            stopping,
            conns,
            acceptor: Some(acceptor),
        }
    }

    pub fn sever(&self) {
        self.severed.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn resume(&self) {
        self.severed.store(false, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.sever();
        // Wake the blocking accept.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// Resident memory of this process in bytes (Linux `/proc/self/status`).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}
