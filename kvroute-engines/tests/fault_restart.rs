//! Fault injection: the engine's publisher is killed with SIGKILL
//! and a new process starts on the same ports with its sequence back at 0. The
//! inventory of the dead process must not survive: after the new process's first
//! batches the index holds exactly what the new process stored.
//!
//! Real peers: tests/python/kv_publisher.py (pyzmq XPUB + ROUTER replay). The time
//! from the new process's first batch to the corrected inventory is printed
//! (`--nocapture`), never asserted.
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::time::{Duration, Instant};

use fault::{synthetic_key, Rig, RigConfig, EP};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};
use kvroute_ingest::IngestConfig;
use kvroute_ingest::{RestartPolicy, SeqWindowConfig};

const T: Duration = Duration::from_secs(10);
const BEFORE: u64 = 100;
const AFTER: u64 = 10;

fn publisher(port: u16, replay_port: Option<u16>, count: u64) -> Peer {
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let replay = replay_port.map(|p| format!("tcp://127.0.0.1:{p}"));
    let mut args = vec![
        "--engine",
        "vllm",
        "--socket",
        "xpub",
        "--endpoint",
        &endpoint,
    ];
    if let Some(r) = &replay {
        args.extend(["--replay-endpoint", r]);
    }
    Peer::publisher(
        &args,
        &format!(
            r#"[{{"op":"wait_subscriber"}},{{"op":"publish","count":{count},"rate":500}},
                {{"op":"serve","ms":30000}}]"#
        ),
    )
}

fn sigkill_and_restart(policy: RestartPolicy, with_replay: bool) {
    let port = free_port_pair();
    let replay_port = with_replay.then(free_port_pair);
    let mut subscriber =
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
            .retry(Duration::from_millis(10), Duration::from_millis(50));
    if let Some(p) = replay_port {
        subscriber = subscriber.replay_endpoint(format!("tcp://127.0.0.1:{p}"));
    }
    let mut config = RigConfig::new(subscriber);
    config.ingest = IngestConfig {
        window: SeqWindowConfig {
            on_restart: policy,
            ..SeqWindowConfig::default()
        },
        ..IngestConfig::default()
    };
    config.bootstrap = with_replay;
    let rig = Rig::start(config);

    let mut first = publisher(port, replay_port, BEFORE);
    first.expect("PUBLISHED", T);
    rig.wait_for("the first process's blocks", T, |r| {
        (0..BEFORE).all(|s| r.has(synthetic_key(0, s)))
    });

    // SIGKILL (Child::kill) and reap: no goodbye on the wire beyond the kernel's FIN.
    drop(first);
    let mut second = publisher(port, replay_port, AFTER);
    // The new process publishes its first batch right after it sees our subscription.
    second.expect("SUBSCRIBED", T);
    let first_new_batch = Instant::now();
    rig.wait_for("only the new process's blocks", T, |r| {
        (0..AFTER).all(|s| r.has(synthetic_key(0, s)))
            && (AFTER..BEFORE).all(|s| !r.has(synthetic_key(0, s)))
    });
    let settled = first_new_batch.elapsed();
    second.expect("PUBLISHED", T);

    let (m, sink) = rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!(
        "FAULT sigkill-restart policy={policy:?} replay={with_replay}: inventory correct \
         {:.1} ms after the new process's first batch; metrics {m:?}; seq counters {seq:?}",
        settled.as_secs_f64() * 1e3
    );
    assert_eq!(rig_total(&sink), AFTER);
    assert!(m.disconnects >= 1 && m.connects >= 2, "{m:?}");
    assert!(m.restarts >= 1 && m.clears >= 1, "{m:?}");
    assert!(seq.restarts >= 1, "{seq:?}");
    if with_replay {
        assert!(m.replays_requested >= 2, "{m:?}");
    }
}

fn rig_total(sink: &fault::RigSink) -> u64 {
    sink.inner.ingest().index().inventory(EP).total()
}

#[test]
fn sigkill_restart_clear_policy_without_replay_clears_the_dead_process_inventory() {
    sigkill_and_restart(RestartPolicy::Clear, false);
}

#[test]
fn sigkill_restart_replay_policy_rebuilds_from_the_new_process_buffer() {
    sigkill_and_restart(RestartPolicy::Replay, true);
}
