//! Publish → applied latency over loopback ZeroMQ.
//!
//! A pyzmq/msgspec publisher (tests/python/kv_publisher.py, real libzmq) streams
//! vLLM 0.33 batches at a fixed rate, each stamped with `time.time()` just before
//! encoding (the engine timestamp field). Our subscriber receives, decodes with the
//! vLLM decoder and applies every batch to an inventory; latency = wall clock at
//! apply − the batch's timestamp.
//!
//! ```text
//! scripts/python-env.sh
//! cargo run --release -p kvroute-engines --example zmq_latency -- [rate] [seconds]
//! ```

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_engines::events::{vllm, DecodeStats};
use kvroute_engines::transport::{
    Frame, FrameReport, FrameSink, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
};
use kvroute_ingest::KvEvent;

#[derive(Default)]
struct Measure {
    latencies_us: Vec<f64>,
    inventory: HashSet<u64>,
    stats: DecodeStats,
}

#[derive(Clone, Default)]
struct LatencySink(Arc<Mutex<Measure>>);

impl FrameSink for LatencySink {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let mut m = self.0.lock().unwrap();
        let m = &mut *m;
        let Ok(batch) = vllm::decode(frame.payload, frame.seq, &mut m.stats) else {
            return FrameReport {
                decode_error: true,
                ..FrameReport::default()
            };
        };
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) => m.inventory.extend(s.keys.iter().map(|k| k.0)),
                KvEvent::Removed(r) => r.keys.iter().for_each(|k| {
                    m.inventory.remove(&k.0);
                }),
                KvEvent::AllCleared => m.inventory.clear(),
                KvEvent::Moved(_) => {}
            }
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        m.latencies_us.push((now - batch.timestamp) * 1e6);
        FrameReport {
            events_applied: batch.events.len() as u32,
            engine_timestamp: Some(batch.timestamp),
            ..FrameReport::default()
        }
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rate: u64 = args.next().map_or(10_000, |a| a.parse().unwrap());
    let seconds: u64 = args.next().map_or(3, |a| a.parse().unwrap());
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

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sink = LatencySink::default();
    let subscriber = ZmqSubscriber::new(ZmqSubscriberConfig::new(ZmqEndpoint::connect(
        endpoint.clone(),
    )));
    let metrics = subscriber.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(subscriber.run(sink.clone(), async move {
        let _ = stopped.await;
    }));

    let mut child = Command::new(python)
        .arg(root.join("tests/python/kv_publisher.py"))
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
        r#"[{{"op":"wait_subscriber"}},{{"op":"publish","count":{count},"rate":{rate}}},{{"op":"serve","ms":300}}]"#
    )
    .unwrap();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.starts_with("DONE") || line.starts_with("ERROR") {
            break;
        }
    }
    let _ = child.wait();
    let _ = stop.send(());
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), task).await })
        .unwrap()
        .unwrap();

    let m = sink.0.lock().unwrap();
    let mut lat = m.latencies_us.clone();
    lat.sort_by(f64::total_cmp);
    let snap = metrics.snapshot();
    println!(
        "rate {rate}/s for {seconds}s: received {} / {count}, decode errors {}, inventory {} keys",
        lat.len(),
        snap.decode_errors,
        m.inventory.len()
    );
    if !lat.is_empty() {
        println!(
            "publish -> applied latency: p50 {:.0} us, p99 {:.0} us, p99.9 {:.0} us, max {:.0} us",
            percentile(&lat, 0.50),
            percentile(&lat, 0.99),
            percentile(&lat, 0.999),
            lat[lat.len() - 1]
        );
    }
}
