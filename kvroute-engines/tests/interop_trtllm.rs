//! Real-peer interop: the TensorRT-LLM drain poller against a Python HTTP server
//! serving scripted `/kv_cache_events` drains (golden bodies, 500s, a timeout,
//! garbage). Needs the venv from scripts/python-env.sh; fails when it is missing.
#![cfg(feature = "trtllm-http")]

mod interop_support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use interop_support::{golden, runtime, Peer};
use kvroute_core::EndpointId;
use kvroute_engines::transport::{
    BatchApplier, DrainSink, IndexIngest, IngestOutcome, TrtllmPoller, TrtllmPollerConfig,
    TrtllmSink,
};
use kvroute_ingest::SeqWindowConfig;
use kvroute_ingest::{EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, SharedIndex};

const T: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    Apply(u64),
    Clear,
}

/// The real ingest (sequence window with the destructive-drain policy) with a
/// log of what it did, so the test sees the window's decisions.
struct Log {
    ops: Arc<Mutex<Vec<Op>>>,
    ingest: IndexIngest,
}

impl Log {
    fn new() -> (Self, Arc<Mutex<Vec<Op>>>) {
        let ops = Arc::new(Mutex::new(Vec::new()));
        let config = IngestConfig {
            window: SeqWindowConfig::destructive_drain(),
            ..IngestConfig::default()
        };
        let ingest = EndpointIngest::new(EndpointId(0), config, Keying::Engine);
        let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
        let ingest = IndexIngest::new(ingest, index, None, false);
        (
            Self {
                ops: Arc::clone(&ops),
                ingest,
            },
            ops,
        )
    }
}

impl BatchApplier for Log {
    fn apply(&mut self, batch: &EventBatch) -> IngestOutcome {
        let outcome = self.ingest.apply(batch);
        let mut ops = self.ops.lock().unwrap();
        if outcome.cleared {
            ops.push(Op::Clear);
        }
        ops.push(Op::Apply(batch.seq));
        outcome
    }
    fn clear(&mut self) {
        self.ops.lock().unwrap().push(Op::Clear);
        self.ingest.clear();
    }
}

fn body(rel: &str) -> String {
    format!(r#"{{"body_file":{:?}}}"#, golden(rel).display().to_string())
}

/// What one scripted run left: the ingest's log, the poller's metrics and
/// the sink.
struct Run {
    ops: Vec<Op>,
    metrics: kvroute_engines::transport::MetricsSnapshot,
    sink: TrtllmSink<Log>,
}

/// Serves `steps` from the scripted drain server to a poller configured by
/// `config` until event `until` is applied.
fn run_script(
    steps: &[String],
    configure: impl FnOnce(TrtllmPollerConfig) -> TrtllmPollerConfig,
    until: u64,
) -> Run {
    let mut server = Peer::spawn("trtllm_drain_server.py", &[]);
    server.send_line(&format!("[{}]", steps.join(",")));
    let ready = server.expect("READY", T);
    let port: u16 = ready.trim_start_matches("READY port=").parse().unwrap();

    let rt = runtime();
    let config = TrtllmPollerConfig::new(format!("http://127.0.0.1:{port}/kv_cache_events"))
        .interval(Duration::from_millis(10))
        .backoff(Duration::from_millis(10), Duration::from_millis(40));
    let poller = TrtllmPoller::new(configure(config)).unwrap();
    let metrics = poller.metrics();
    let (log, ops) = Log::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(poller.run(TrtllmSink::new(32, log), async move {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + T;
    while !ops.lock().unwrap().contains(&Op::Apply(until)) {
        assert!(
            Instant::now() < deadline,
            "event {until} never applied: {:?}",
            ops.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = stop.send(());
    let sink = rt
        .block_on(async { tokio::time::timeout(T, task).await })
        .unwrap()
        .unwrap();
    let ops = ops.lock().unwrap().clone();
    Run {
        ops,
        metrics: metrics.snapshot(),
        sink,
    }
}

#[test]
fn drains_with_errors_timeouts_gaps_and_garbage() {
    let steps = [
        body("trtllm-events/classic/01_startup_created.json"),
        body("trtllm-events/classic/02_context_blocks_stored.json"),
        r#"{"status":500}"#.to_owned(),
        body("trtllm-events/classic/03_release_stores_rest_incl_partial.json"),
        // Drained but never delivered (client timeout): event_id 3 is lost.
        format!(
            r#"{{"delay_ms":1500,"body_file":{:?}}}"#,
            golden("trtllm-events/classic/04_shared_prefix_new_branch.json")
                .display()
                .to_string()
        ),
        body("trtllm-events/classic/05_empty_drain.json"),
        body("trtllm-events/classic/06_eviction_removed_coalesced.json"),
        r#"{"raw":"{not json"}"#.to_owned(),
        body("trtllm-events/classic/07_offload_updated_cache_level.json"),
    ];
    let Run {
        ops,
        metrics: m,
        sink,
    } = run_script(&steps, |c| c.request_timeout(Duration::from_millis(400)), 5);
    assert_eq!(
        ops,
        vec![
            Op::Apply(0),
            Op::Apply(1),
            Op::Apply(2),
            Op::Clear, // gap: event 3 died with the timed-out drain
            Op::Apply(4),
            Op::Clear, // garbage body: its events are gone
            Op::Apply(5),
        ]
    );
    assert_eq!(m.poll_failures, 2, "{m:?}");
    assert_eq!((m.gaps, m.decode_errors, m.clears), (1, 1, 2), "{m:?}");
    assert_eq!(m.last_seq, Some(5));
    assert!(m.connected);
    assert_eq!(sink.decode_stats().map(|s| s.malformed_payloads), Some(1));
}

/// A drain answered with a body over the size limit is dropped unread; the
/// engine has handed its events out, so they are lost: the inventory is
/// cleared and the drain counts as a decode error, not as an unreachable
/// engine. An event of a type the decoder does not know shows in the
/// metrics.
#[test]
fn a_drain_over_the_size_limit_clears_the_inventory() {
    let oversized = format!(r#"{{"raw":"[{}]"}}"#, " ".repeat(100_000));
    let steps = [
        body("trtllm-events/classic/01_startup_created.json"),
        body("trtllm-events/classic/02_context_blocks_stored.json"),
        oversized,
        body("trtllm-events/classic/03_release_stores_rest_incl_partial.json"),
        r#"{"body": [{"event_id": 3, "window_size": 8192, "data": {"type": "from_the_future"}}]}"#
            .to_owned(),
    ];
    let Run {
        ops, metrics: m, ..
    } = run_script(&steps, |c| c.max_body_bytes(64 << 10), 3);
    assert_eq!(
        ops,
        vec![
            Op::Apply(0),
            Op::Apply(1),
            Op::Clear,
            Op::Apply(2),
            Op::Apply(3)
        ]
    );
    assert_eq!(
        (m.poll_failures, m.decode_errors, m.clears),
        (0, 1, 1),
        "{m:?}"
    );
    assert_eq!(m.decode.unknown_event_tags, 1, "{m:?}");
    assert!(m.connected);
}

#[test]
fn unreachable_engine_is_retried_with_backoff_until_it_appears() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let rt = runtime();
    let config = TrtllmPollerConfig::new(format!("http://127.0.0.1:{port}/kv_cache_events"))
        .interval(Duration::from_millis(10))
        .request_timeout(Duration::from_millis(300))
        .backoff(Duration::from_millis(10), Duration::from_millis(40));
    let poller = TrtllmPoller::new(config).unwrap();
    let metrics = poller.metrics();
    let (log, ops) = Log::new();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(poller.run(TrtllmSink::new(32, log), async move {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + T;
    while metrics.snapshot().poll_failures < 3 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!metrics.snapshot().connected);
    let mut server = Peer::spawn("trtllm_drain_server.py", &["--port", &port.to_string()]);
    server.send_line(&format!(
        "[{}]",
        body("trtllm-events/classic/01_startup_created.json")
    ));
    server.expect("READY", T);
    while !ops.lock().unwrap().contains(&Op::Apply(0)) {
        assert!(
            Instant::now() < deadline,
            "never drained after the engine came up"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = stop.send(());
    rt.block_on(async { tokio::time::timeout(T, task).await })
        .unwrap()
        .unwrap();
    assert!(metrics.snapshot().connected);
}
