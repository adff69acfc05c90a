//! An engine implemented outside kvroute: its own payload format (text
//! lines), its own decoder, registered by name in a host's registry, and
//! followed over the real ZeroMQ transport from a pyzmq (libzmq) publisher
//! into a `SharedIndex` — without editing any kvroute source.
//! Needs the venv from scripts/python-env.sh; fails when it is missing.
#![cfg(feature = "zmq")]

mod interop_support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use interop_support::{free_port_pair, python, runtime};
use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_engines::engine::{self, Engine, Follow, FrameDecoder, IngestTarget, Registry, Stream};
use kvroute_engines::events::{DecodeError, DecodeStats};
use kvroute_engines::transport::{
    DecodingSink, Frame, FrameSink, FrameSource, IndexIngest, SocketRole, TransportError,
};
use kvroute_ingest::{
    BlockRemoved, BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig,
    InventoryView, Keying, KvEvent, Overlap, SharedIndex,
};

/// The fake engine's payload: one event per line, `S <key>...` (stored, one
/// chain of 16-token blocks), `R <key>...` (removed) or `C` (all cleared),
/// keys in decimal.
#[derive(Debug, Default)]
struct LinesDecoder;

impl FrameDecoder for LinesDecoder {
    fn decode_into(
        &mut self,
        payload: &[u8],
        seq: u64,
        out: &mut EventBatch,
        stats: &mut DecodeStats,
    ) -> Result<(), DecodeError> {
        let Ok(text) = std::str::from_utf8(payload) else {
            return bad(stats, "not UTF-8");
        };
        out.seq = seq;
        out.timestamp = 0.0;
        out.dp_rank = None;
        out.events.clear();
        for line in text.lines() {
            let mut words = line.split_ascii_whitespace();
            let op = words.next();
            let mut keys = Vec::new();
            for w in words {
                match w.parse::<u64>() {
                    Ok(k) => keys.push(BlockKey(k)),
                    Err(_) => return bad(stats, "a key is not a decimal u64"),
                }
            }
            out.events.push(match op {
                Some("S") => KvEvent::Stored(BlockStored {
                    keys,
                    block_size: 16,
                    ..BlockStored::default()
                }),
                Some("R") => KvEvent::Removed(BlockRemoved {
                    keys,
                    ..BlockRemoved::default()
                }),
                Some("C") => KvEvent::AllCleared,
                _ => return bad(stats, "unknown event"),
            });
            stats.events += 1;
        }
        stats.batches += 1;
        Ok(())
    }
}

fn bad(stats: &mut DecodeStats, what: &'static str) -> Result<(), DecodeError> {
    stats.malformed_payloads += 1;
    Err(DecodeError::BadLayout { what })
}

/// The fake engine: the ZeroMQ transport of vLLM/SGLang with its own
/// payloads; everything else defaulted.
#[derive(Debug)]
struct Lines;

impl Engine for Lines {
    fn name(&self) -> &str {
        "lines"
    }
    fn aliases(&self) -> &[&str] {
        &["lines-engine"]
    }
    fn events_carry_tokens(&self) -> bool {
        false
    }
    fn frame_decoder(&self) -> Option<Box<dyn FrameDecoder>> {
        Some(Box::new(LinesDecoder))
    }
    fn streams(&self, follow: &Follow) -> Result<Vec<Stream>, TransportError> {
        engine::zmq_streams(follow)
    }
}

fn registry() -> Registry {
    let mut r = Registry::builtin();
    r.register(Arc::new(Lines)).unwrap();
    r
}

fn target(engine: &dyn Engine, follow: &Follow, index: &Arc<SharedIndex>) -> IngestTarget {
    let config = IngestConfig {
        expected_block_size: Some(follow.block_size),
        window: engine.window(follow),
        ..IngestConfig::default()
    };
    let ingest = EndpointIngest::new(EndpointId(0), config, Keying::Engine);
    IngestTarget::new(IndexIngest::share(ingest), Arc::clone(index))
}

fn holds(index: &SharedIndex, key: u64) -> bool {
    index.contains(EndpointId(0), BlockKey(key), Medium::Gpu)
}

/// Publishes `[topic, seq, payload]` frames from an XPUB once our SUB has
/// subscribed, then waits for its stdin to close.
const PUBLISHER: &str = r#"
import struct, sys, zmq
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.bind(sys.argv[1])
print("READY", flush=True)
if pub.poll(20000) == 0:
    print("ERROR no subscriber", flush=True)
    sys.exit(1)
pub.recv()
frames = [b"S 11 12 13", b"\xff\xfe", b"R 12", b"S 14\nS 15", b"X 1"]
for seq, payload in enumerate(frames):
    pub.send_multipart([b"", struct.pack(">Q", seq), payload])
print("DONE", flush=True)
sys.stdin.read()
"#;

#[test]
fn a_fake_engine_runs_over_the_real_zeromq_transport_into_the_index() {
    let registry = registry();
    let lines = registry.get("lines-engine").unwrap();
    assert_eq!(lines.name(), "lines");
    let port = free_port_pair();
    // The engine binds every interface; we dial the endpoint's host.
    let follow = Follow::new("http://127.0.0.1:8000", 16).events(format!("tcp://*:{port}"));
    let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
    let target = target(&*lines, &follow, &index);
    let followers = lines.followers(&follow, &target).unwrap();
    assert_eq!(followers.len(), 1);
    let Stream::Zmq(z) = followers[0].stream() else {
        panic!("not a ZeroMQ stream")
    };
    assert_eq!(z.endpoint.role, SocketRole::Connect);
    assert_eq!(z.endpoint.address, format!("tcp://127.0.0.1:{port}"));

    let mut peer = Command::new(python())
        .arg("-c")
        .arg(PUBLISHER)
        .arg(format!("tcp://127.0.0.1:{port}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the pyzmq publisher");
    let mut out = BufReader::new(peer.stdout.take().unwrap()).lines();
    assert_eq!(out.next().unwrap().unwrap(), "READY");

    let rt = runtime();
    let metrics = Arc::clone(followers[0].metrics());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let follower = followers.into_iter().next().unwrap();
    let task = rt.spawn(follower.run(async move {
        let _ = stopped.await;
    }));

    assert_eq!(out.next().unwrap().unwrap(), "DONE");
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.snapshot().frames_live < 5 {
        assert!(
            Instant::now() < deadline,
            "frames: {:?}",
            metrics.snapshot()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = stop.send(());
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), task).await })
        .expect("the follower stops on its stop future")
        .unwrap();
    drop(peer.stdin.take());
    let _ = peer.wait();

    // Stored, removed, stored again; the two undecodable payloads counted.
    for (key, held) in [(11, true), (12, false), (13, true), (14, true), (15, true)] {
        assert_eq!(holds(&index, key), held, "key {key}");
    }
    let m = metrics.snapshot();
    assert_eq!((m.frames_live, m.decode_errors), (5, 2), "{m:?}");
    let mut scored = [Overlap::default()];
    index.score(&[BlockKey(11), BlockKey(13)], &mut scored);
    assert_eq!(scored[0].prefix, 2);
}

#[test]
fn the_fake_engines_decoder_drives_the_zeromq_sink_sans_io() {
    let lines = registry().get("lines").unwrap();
    let follow = Follow::new("http://h:1", 16);
    let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
    let t = target(&*lines, &follow, &index);
    let ingest = IndexIngest::shared(t.ingest, t.index, Some(0), false);
    let mut sink = DecodingSink::for_engine(&*lines, ingest).unwrap();
    let frame = |seq, payload| Frame {
        topic: b"",
        seq,
        payload,
        source: FrameSource::Live,
    };
    assert_eq!(sink.on_frame(frame(0, b"S 1 2")).events_applied, 1);
    assert!(sink.on_frame(frame(1, b"S x")).decode_error);
    assert_eq!(sink.on_frame(frame(2, b"C")).events_applied, 1);
    assert!(!holds(&index, 1));
    assert_eq!(sink.decode_stats().map(|s| s.malformed_payloads), Some(1));
    // A built-in engine without ZeroMQ payloads is refused by the same call.
    let trtllm = registry().get("trtllm").unwrap();
    let t = target(&*trtllm, &follow, &index);
    let ingest = IndexIngest::shared(t.ingest, t.index, Some(0), false);
    assert!(matches!(
        DecodingSink::for_engine(&*trtllm, ingest),
        Err(TransportError::Unsupported { .. })
    ));
}
