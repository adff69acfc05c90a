//! Sequence integrity: a real pyzmq publisher whose replay ROUTER
//! answers one extra batch numbered u64::MAX − 1, or that injects one live batch
//! at such a number. Before the fix the number became the stream's high-water
//! mark (and the subscriber's "already replayed" range), so every later live
//! batch was dropped as a duplicate (18 sent, 0 applied). Now the window drops
//! the implausible batch, counts it, and applies every real one.
//!
//! Real peer: tests/python/kv_fault_publisher.py (`poison_replay`, `inject`).
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::time::Duration;

use fault::{synthetic_key, Rig, RigConfig};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};

const T: Duration = Duration::from_secs(15);
const POISON: u64 = u64::MAX - 1;

fn publisher(port: u16, replay_port: Option<u16>, script: &str) -> Peer {
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
    let mut p = Peer::spawn("kv_fault_publisher.py", &args);
    p.send_line(&script.replace('\n', " "));
    p
}

#[test]
fn a_replayed_batch_at_u64_max_does_not_discard_the_live_stream() {
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let mut config = RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
            .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}")),
    );
    config.bootstrap = true;
    // Batches 0-2 are buffered before the subscriber comes; the bootstrap replay
    // answers them and the poisoned one, then 18 live batches follow.
    let mut publisher = publisher(
        port,
        Some(replay_port),
        &format!(
            r#"[{{"op":"publish","count":3}},
            {{"op":"poison_replay","seq":{POISON}}},
            {{"op":"wait_subscriber"}},
            {{"op":"serve","ms":700}},
            {{"op":"publish","count":18,"rate":200}},
            {{"op":"serve","ms":5000}}]"#
        ),
    );
    let rig = Rig::start(config);
    publisher.expect("REPLAYED", T);
    rig.wait_for("every live batch", T, |r| {
        (0..21).all(|s| r.has(synthetic_key(0, s)))
    });
    let (m, sink) = rig.finish();
    println!("SEQ INTEGRITY replay at u64::MAX-1: {m:?}");
    let ingest = sink.inner.ingest().endpoint_ingest();
    assert!(!sink.inner.ingest().index().contains(
        fault::EP,
        kvroute_core::BlockKey(synthetic_key(0, 999_999)),
        kvroute_core::Medium::Gpu
    ));
    assert_eq!(ingest.seq_counters().implausible, 1);
    assert_eq!(m.implausible_frames, 1);
    assert_eq!(m.replay_duplicates_dropped, 0, "{m:?}");
    assert_eq!(m.last_seq, Some(20));
    assert_eq!(ingest.counters().clears, 0);
}

#[test]
fn an_injected_live_batch_at_u64_max_is_dropped_and_counted() {
    let port = free_port_pair();
    let rig = Rig::start(RigConfig::new(ZmqSubscriberConfig::new(
        ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")),
    )));
    let mut publisher = publisher(
        port,
        None,
        &format!(
            r#"[{{"op":"wait_subscriber"}},
            {{"op":"publish","count":3,"rate":200}},
            {{"op":"inject","seq":{POISON}}},
            {{"op":"inject","seq":{big}}},
            {{"op":"publish","count":18,"rate":200}},
            {{"op":"serve","ms":5000}}]"#,
            big = 1u64 << 50
        ),
    );
    publisher.expect("SUBSCRIBED", T);
    rig.wait_for("every live batch", T, |r| {
        (0..21).all(|s| r.has(synthetic_key(0, s)))
    });
    let (m, sink) = rig.finish();
    println!("SEQ INTEGRITY live at u64::MAX-1 and 2^50: {m:?}");
    let ingest = sink.inner.ingest().endpoint_ingest();
    assert_eq!(ingest.seq_counters().implausible, 2);
    assert_eq!((m.implausible_frames, m.clears), (2, 0), "{m:?}");
    assert_eq!(m.last_seq, Some(20));
}

/// A replay whose only answer is a plausible but far number (2^40, below
/// `max_seq`) becomes the stream's first batch; the live stream below it is
/// then a restart (cleared once, applied), never swallowed as "already
/// replayed" (the subscriber's dedupe covers only the replayed range).
#[test]
fn a_replay_answering_only_a_far_number_is_followed_by_a_restart() {
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let mut config = RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
            .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}")),
    );
    config.bootstrap = true;
    let mut publisher = publisher(
        port,
        Some(replay_port),
        &format!(
            r#"[{{"op":"poison_replay","seq":{far}}},
            {{"op":"wait_subscriber"}},
            {{"op":"serve","ms":700}},
            {{"op":"publish","count":18,"rate":200}},
            {{"op":"serve","ms":5000}}]"#,
            far = 1u64 << 40
        ),
    );
    let rig = Rig::start(config);
    publisher.expect("REPLAYED", T);
    rig.wait_for("every live batch", T, |r| {
        (0..18).all(|s| r.has(synthetic_key(0, s)))
    });
    let (m, sink) = rig.finish();
    println!("SEQ INTEGRITY replay answering only 2^40: {m:?}");
    let ingest = sink.inner.ingest().endpoint_ingest();
    assert_eq!(m.replay_duplicates_dropped, 0, "{m:?}");
    assert_eq!(ingest.seq_counters().restarts, 1);
    assert!(!sink.inner.ingest().index().contains(
        fault::EP,
        kvroute_core::BlockKey(synthetic_key(0, 999_999)),
        kvroute_core::Medium::Gpu
    ));
    assert_eq!(m.last_seq, Some(17));
}
