//! Real-peer interop: our ZeroMQ subscriber against pyzmq (libzmq) publishers that
//! emit byte-exact vLLM 0.33 / SGLang 0.5.23 frames (tests/python/kv_publisher.py).
//! Needs the venv from scripts/python-env.sh; fails when it is missing.
#![cfg(feature = "zmq")]

mod interop_support;

use std::time::Duration;

use interop_support::{free_port_pair, golden, runtime, Peer, Recorder};
use kvroute_engines::events::{sglang, vllm, DecodeStats};
use kvroute_engines::transport::{
    MetricsSnapshot, SocketRole, ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig,
};
use kvroute_ingest::KvEvent;

const T: Duration = Duration::from_secs(10);

/// Starts `config`'s subscriber with `sink` on `rt`; returns a stop function that
/// ends it and hands back the final metrics.
fn start(
    rt: &tokio::runtime::Runtime,
    config: ZmqSubscriberConfig,
    sink: Recorder,
) -> (
    std::sync::Arc<kvroute_engines::transport::SubscriberMetrics>,
    impl FnOnce() -> MetricsSnapshot + '_,
) {
    let subscriber = ZmqSubscriber::new(config);
    let metrics = subscriber.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(subscriber.run(sink, async move {
        let _ = stopped.await;
    }));
    let m = metrics.clone();
    let finish = move || {
        let _ = stop.send(());
        rt.block_on(async { tokio::time::timeout(T, task).await })
            .expect("subscriber stops on shutdown")
            .unwrap();
        m.snapshot()
    };
    (metrics, finish)
}

/// Key the publisher derives for (epoch, seq): see `synthetic_batch`.
fn synthetic_key(epoch: u64, seq: u64) -> u64 {
    ((epoch + 1) << 40) | (seq + 1)
}

fn stored_key(events: &[KvEvent]) -> u64 {
    match events {
        [KvEvent::Stored(s)] => s.keys[0].0,
        other => panic!("expected one BlockStored, got {other:?}"),
    }
}

#[test]
fn vllm_connect_mode_first_dial_retries_until_the_engine_is_up() {
    let rt = runtime();
    let port = free_port_pair();
    let sink = Recorder::new(false);
    let config = ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
        .topic("kv@vllm")
        .retry(Duration::from_millis(10), Duration::from_millis(50))
        .dial_timeout(Duration::from_millis(100));
    let (metrics, stop) = start(&rt, config, sink.clone());

    // The engine comes up only after the subscriber has failed to dial.
    let deadline = std::time::Instant::now() + T;
    while metrics.snapshot().dial_failures == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no dial failure recorded"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--topic",
            "kv@vllm",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":50,"rate":5000},{"op":"serve","ms":200}]"#,
    );
    publisher.expect("PUBLISHED", T);
    sink.wait_for("50 live frames", T, |r| r.live == 50);

    let m = stop();
    assert!(m.dial_failures >= 1);
    assert!(m.connects >= 1);
    assert_eq!(m.last_seq, Some(49));
    assert_eq!(m.frames_live, 50);
    assert_eq!(m.malformed_frames + m.decode_errors, 0);
    sink.snapshot(|r| {
        assert_eq!(r.epoch_seqs(0), (0..50).collect::<Vec<_>>());
        assert!(r.gaps.is_empty(), "{:?}", r.gaps);
        assert_eq!(r.topics.iter().collect::<Vec<_>>(), [&b"kv@vllm".to_vec()]);
        // The real-wire payloads decode with the vLLM decoder to the keys sent.
        for (seq, payload) in &r.applied[0] {
            let batch = vllm::decode(payload, *seq, &mut DecodeStats::default()).unwrap();
            assert_eq!(stored_key(&batch.events), synthetic_key(0, *seq));
            assert_eq!(batch.dp_rank, Some(0));
        }
    });
}

#[test]
fn vllm_restart_mid_stream_is_seen_as_disconnect_reconnect_and_seq_reset() {
    let rt = runtime();
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let sink = Recorder::new(true);
    let config = ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
        .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"))
        .retry(Duration::from_millis(10), Duration::from_millis(50));
    let (_metrics, stop) = start(&rt, config, sink.clone());
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--replay-endpoint",
            &format!("tcp://127.0.0.1:{replay_port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":20,"rate":2000},{"op":"serve","ms":100},
            {"op":"restart","down_ms":150},
            {"op":"wait_subscriber"},{"op":"publish","count":30,"rate":2000},{"op":"serve","ms":5000}]"#,
    );
    publisher.expect("RESTARTED", T);
    sink.wait_for("second epoch complete", T, |r| r.epoch_seqs(1).len() == 30);
    let m = stop();
    sink.snapshot(|r| {
        assert_eq!(r.epoch_seqs(0), (0..20).collect::<Vec<_>>());
        assert_eq!(r.epoch_seqs(1), (0..30).collect::<Vec<_>>());
        assert_eq!(r.restarts, 1);
        assert!(r.disconnected >= 1);
        assert!(r.connected >= 2);
        for (seq, payload) in &r.applied[1] {
            let batch = vllm::decode(payload, *seq, &mut DecodeStats::default()).unwrap();
            assert_eq!(stored_key(&batch.events), synthetic_key(1, *seq));
        }
    });
    assert!(m.connects >= 2 && m.disconnects >= 1, "{m:?}");
}

#[test]
fn seq_jumps_inside_and_beyond_the_window_reach_the_sink_as_gaps() {
    let rt = runtime();
    let port = free_port_pair();
    let sink = Recorder::new(false);
    let config = ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")));
    let (_metrics, stop) = start(&rt, config, sink.clone());
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":5},{"op":"skip","count":3},
            {"op":"publish","count":5},{"op":"skip","count":100},{"op":"publish","count":5},
            {"op":"serve","ms":100}]"#,
    );
    publisher.expect("DONE", T);
    sink.wait_for("15 frames", T, |r| r.live == 15);
    let m = stop();
    assert_eq!(m.gaps, 2);
    sink.snapshot(|r| {
        assert_eq!(r.gaps, vec![(5, 8), (13, 113)]);
        let want: Vec<u64> = (0..5).chain(8..13).chain(113..118).collect();
        assert_eq!(r.epoch_seqs(0), want);
    });
}

/// Bootstrap replay: the engine published before we subscribed; the DEALER → ROUTER
/// exchange recovers it, in both reply layouts, and a buffer that lost the start
/// shows up as a gap.
#[test]
fn replay_bootstrap_recovers_history_in_both_reply_layouts() {
    for (layout, buffer_steps, first) in
        [("topic", 100, 0u64), ("legacy", 100, 0), ("topic", 10, 20)]
    {
        let rt = runtime();
        let port = free_port_pair();
        let replay_port = free_port_pair();
        let mut publisher = Peer::publisher(
            &[
                "--engine",
                "vllm",
                "--topic",
                "kv@vllm",
                "--replay-layout",
                layout,
                "--buffer-steps",
                &buffer_steps.to_string(),
                "--endpoint",
                &format!("tcp://127.0.0.1:{port}"),
                "--replay-endpoint",
                &format!("tcp://127.0.0.1:{replay_port}"),
            ],
            r#"[{"op":"publish","count":30},{"op":"serve","ms":8000}]"#,
        );
        publisher.expect("PUBLISHED", T);
        let sink = Recorder::new(true);
        let config =
            ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
                .topic("kv@vllm")
                .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"));
        let (_metrics, stop) = start(&rt, config, sink.clone());
        sink.wait_for("replay done", T, |r| !r.replays.is_empty());
        let m = stop();
        sink.snapshot(|r| {
            let outcome = r.replays[0];
            assert!(outcome.completed, "{layout}: {outcome:?}");
            assert_eq!(outcome.requested_from, 0);
            assert_eq!(outcome.first_seq, Some(first), "{layout}");
            assert_eq!(outcome.last_seq, Some(29));
            assert_eq!(r.epoch_seqs(0), (first..30).collect::<Vec<_>>());
            assert_eq!(r.replayed, 30 - first);
            for (seq, payload) in &r.applied[0] {
                let batch = vllm::decode(payload, *seq, &mut DecodeStats::default()).unwrap();
                assert_eq!(stored_key(&batch.events), synthetic_key(0, *seq));
            }
        });
        assert_eq!((m.replays_requested, m.replays_completed), (1, 1));
        assert_eq!(m.frames_replayed, 30 - first);
    }
}

#[test]
fn dp_rank_1_is_followed_on_port_plus_one() {
    let rt = runtime();
    let port = free_port_pair();
    let replay_port = free_port_pair();
    // The engine binds every interface: the subscriber dials the engine host.
    let endpoint = ZmqEndpoint::for_engine(&format!("tcp://*:{port}"), "127.0.0.1", 1).unwrap();
    assert_eq!(endpoint.role, SocketRole::Connect);
    assert_eq!(endpoint.address, format!("tcp://127.0.0.1:{}", port + 1));
    let sink = Recorder::new(true);
    let config = ZmqSubscriberConfig::new(endpoint)
        .replay_endpoint(format!("tcp://127.0.0.1:{}", replay_port + 1));
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--dp-rank",
            "1",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://*:{port}"),
            "--replay-endpoint",
            &format!("tcp://*:{replay_port}"),
        ],
        r#"[{"op":"publish","count":3},{"op":"wait_subscriber"},{"op":"publish","count":7},{"op":"serve","ms":5000}]"#,
    );
    publisher.expect("READY", T);
    let (_metrics, stop) = start(&rt, config, sink.clone());
    sink.wait_for("10 frames", T, |r| r.epoch_seqs(0).len() == 10);
    stop();
    sink.snapshot(|r| {
        for (seq, payload) in &r.applied[0] {
            let batch = vllm::decode(payload, *seq, &mut DecodeStats::default()).unwrap();
            assert_eq!(batch.dp_rank, Some(1));
        }
    });
}

/// vLLM's default for a non-wildcard endpoint: the engine's PUB connects, we bind.
/// Its restart reconnects to us; the seq reset triggers a replay from 0.
#[test]
fn bind_mode_engine_connects_and_restart_is_recovered_by_replay() {
    let rt = runtime();
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let endpoint =
        ZmqEndpoint::for_engine(&format!("tcp://127.0.0.1:{port}"), "unused", 0).unwrap();
    assert_eq!(endpoint.role, SocketRole::Bind);
    let sink = Recorder::new(true);
    let config = ZmqSubscriberConfig::new(endpoint)
        .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"));
    let (metrics, stop) = start(&rt, config, sink.clone());
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--mode",
            "connect",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--replay-endpoint",
            &format!("tcp://127.0.0.1:{replay_port}"),
        ],
        // No wait after the restart: frames published before the new connection's
        // subscription lands are dropped by the PUB and must come back by replay.
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":10,"rate":2000},{"op":"serve","ms":100},
            {"op":"restart","down_ms":50},{"op":"publish","count":3},{"op":"serve","ms":300},
            {"op":"publish","count":37,"rate":2000},{"op":"serve","ms":3000}]"#,
    );
    publisher.expect("RESTARTED", T);
    sink.wait_for("second epoch complete", T, |r| {
        r.applied.len() == 2 && r.epoch_seqs(1) == (0..40).collect::<Vec<_>>()
    });
    assert!(metrics.snapshot().connected);
    let m = stop();
    sink.snapshot(|r| {
        assert_eq!(r.epoch_seqs(0), (0..10).collect::<Vec<_>>());
        assert_eq!(r.restarts, 1);
    });
    assert!(m.replays_requested >= 1);
    assert_eq!(m.malformed_frames + m.decode_errors, 0);
}

#[test]
fn sglang_frames_and_topic_are_exact_matched() {
    let rt = runtime();
    let port = free_port_pair();
    // ZeroMQ topic filtering is by prefix: "kv" lets "kv@sglang" through, our exact
    // check must drop it.
    let sink_prefix = Recorder::new(false);
    let sink_exact = Recorder::new(false);
    let ep = format!("tcp://127.0.0.1:{port}");
    let (_m1, stop_prefix) = start(
        &rt,
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(ep.clone())).topic("kv"),
        sink_prefix.clone(),
    );
    let (_m2, stop_exact) = start(
        &rt,
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(ep.clone())).topic("kv@sglang"),
        sink_exact.clone(),
    );
    let fixtures: Vec<String> = (0..8)
        .map(|i| {
            let dir = golden("sglang-events/v0.5.23/stream");
            let name = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .find(|n| n.starts_with(&format!("{i:02}_")) && n.ends_with(".msgpack"))
                .unwrap();
            dir.join(name).display().to_string()
        })
        .collect();
    let steps: Vec<String> = fixtures
        .iter()
        .map(|p| format!(r#"{{"op":"publish_fixture","path":{p:?}}}"#))
        .collect();
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "sglang",
            "--socket",
            "xpub",
            "--topic",
            "kv@sglang",
            "--endpoint",
            &ep,
        ],
        &format!(
            r#"[{{"op":"wait_subscriber","count":2}},{},{{"op":"serve","ms":200}}]"#,
            steps.join(",")
        ),
    );
    publisher.expect("DONE", T);
    sink_exact.wait_for("8 frames", T, |r| r.live == 8);
    let m_prefix = stop_prefix();
    stop_exact();
    assert_eq!(m_prefix.other_topic_frames, 8);
    assert_eq!(sink_prefix.snapshot(|r| r.live), 0);
    sink_exact.snapshot(|r| {
        for (seq, payload) in &r.applied[0] {
            let want = std::fs::read(&fixtures[*seq as usize]).unwrap();
            assert_eq!(
                payload, &want,
                "payload of seq {seq} crossed the wire unchanged"
            );
            sglang::decode(payload, *seq, &mut DecodeStats::default()).unwrap();
        }
    });
}

/// End to end with the real decoder and ingest state: after a restart (replay
/// policy), the shared index holds exactly the new process's blocks.
#[test]
fn restart_through_decoder_and_ingest_leaves_only_the_new_process_blocks() {
    use std::sync::Arc;

    use kvroute_core::{BlockKey, EndpointId, Medium};
    use kvroute_engines::engine::VLLM;
    use kvroute_engines::transport::{DecodingSink, IndexIngest};
    use kvroute_ingest::{EndpointIngest, IndexConfig, IngestConfig, Keying, SharedIndex};
    use kvroute_ingest::{RestartPolicy, SeqWindowConfig};

    let rt = runtime();
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let index = Arc::new(SharedIndex::new(1, IndexConfig::default()));
    let config = IngestConfig {
        window: SeqWindowConfig {
            on_restart: RestartPolicy::Replay,
            ..SeqWindowConfig::default()
        },
        ..IngestConfig::default()
    };
    let ingest = EndpointIngest::new(EndpointId(0), config, Keying::Engine);
    let sink = DecodingSink::for_engine(
        &VLLM,
        IndexIngest::new(ingest, index.clone(), Some(0), true),
    )
    .unwrap();
    let subscriber = ZmqSubscriber::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
            .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}")),
    );
    let metrics = subscriber.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(subscriber.run(sink, async move {
        let _ = stopped.await;
    }));
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
            "--replay-endpoint",
            &format!("tcp://127.0.0.1:{replay_port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":10,"rate":2000},{"op":"serve","ms":100},
            {"op":"restart","down_ms":100},{"op":"publish","count":5},{"op":"serve","ms":300},
            {"op":"publish","count":5},{"op":"serve","ms":3000}]"#,
    );
    publisher.expect("RESTARTED", T);
    let has = |epoch, seq| {
        index.contains(
            EndpointId(0),
            BlockKey(synthetic_key(epoch, seq)),
            Medium::Gpu,
        )
    };
    let deadline = std::time::Instant::now() + T;
    // The first 5 batches of the new process are published before anyone is
    // subscribed; the 6th (seq 5) reveals the restart and the replay brings 0..=5.
    while !(0..10).all(|s| has(1, s)) {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            metrics.snapshot()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = stop.send(());
    let sink = rt
        .block_on(async { tokio::time::timeout(T, task).await })
        .unwrap()
        .unwrap();
    assert!(
        (0..10).all(|s| !has(0, s)),
        "old process blocks were cleared"
    );
    assert_eq!(index.inventory(EndpointId(0)).total(), 10);
    let m = metrics.snapshot();
    assert!(
        m.restarts >= 1 && m.clears >= 1 && m.replays_requested >= 2,
        "{m:?}"
    );
    assert!(sink.ingest().endpoint_ingest().seq_counters().restarts >= 1);
}
