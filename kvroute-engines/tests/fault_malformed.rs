//! Fault injection and the subscriber's message size limit: a real
//! pyzmq publisher interleaves valid vLLM 0.33 batches with garbage payloads,
//! payloads of the wrong msgpack shape, messages with the wrong number of frames,
//! seq frames of the wrong length, and batches larger than the subscriber's
//! `max_message_bytes`. Every valid batch is applied; every bad message is dropped
//! and counted, with its seq where it has a readable one. An oversized batch is
//! refused by the socket on its declared length, before it is buffered: the
//! connection is dropped (`oversized_peers_dropped`) and redialled, so the
//! publisher waits for the new subscription before going on (what it publishes
//! meanwhile is lost, as with any reconnect; tests/hostile_zmq.rs has the attacks).
//!
//! Real peer: tests/python/kv_fault_publisher.py.
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::time::Duration;

use fault::{synthetic_key, Rig, RigConfig};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};

const T: Duration = Duration::from_secs(10);
const LIMIT: usize = 256 << 10;

#[test]
fn malformed_and_oversized_messages_are_dropped_counted_and_valid_ones_applied() {
    let port = free_port_pair();
    let rig = Rig::start(RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://127.0.0.1:{port}")))
            .max_message_bytes(LIMIT),
    ));
    let mut publisher = Peer::spawn(
        "kv_fault_publisher.py",
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
    );
    // Seqs: valid 0-2, garbage 3, valid 4-5, [four malformed shapes, a wrong-shape
    // payload claiming seq 6], valid 6-7, oversized 8, valid 9-10, garbage 11,
    // valid 12, oversized 13, valid 14-15.
    let seq6 = format!("{:016x}", 6u64);
    publisher.send_line(
        &format!(
            r#"[{{"op":"wait_subscriber"}},
            {{"op":"publish","count":3}},
            {{"op":"garbage","count":1}},
            {{"op":"publish","count":2}},
            {{"op":"frames","frames":["00"]}},
            {{"op":"frames","frames":["","0102","90"]}},
            {{"op":"frames","frames":["","{seq6}","90","00"]}},
            {{"op":"frames","frames":["","00{seq6}","90"]}},
            {{"op":"frames","frames":["","{seq6}","93c0c0c0"]}},
            {{"op":"publish","count":2}},
            {{"op":"oversized","bytes":{big}}},
            {{"op":"wait_subscriber","count":2}},
            {{"op":"publish","count":2}},
            {{"op":"garbage","count":1}},
            {{"op":"publish","count":1}},
            {{"op":"oversized","bytes":{big}}},
            {{"op":"wait_subscriber","count":3}},
            {{"op":"publish","count":2}},
            {{"op":"serve","ms":3000}}]"#,
            big = LIMIT + 1
        )
        .replace('\n', " "),
    );
    publisher.expect("SUBSCRIBED", T);
    rig.wait_for("the last valid batch", T, |r| {
        r.observed().last_seq == Some(15)
    });
    let valid = [0u64, 1, 2, 4, 5, 6, 7, 9, 10, 12, 14, 15];
    for s in valid {
        assert!(rig.has(synthetic_key(0, s)), "valid seq {s} applied");
    }
    let o = rig.observed();
    let (m, sink) = rig.finish();
    println!(
        "FAULT malformed/oversized: decode errors at seqs {:?}; metrics {m:?}",
        o.decode_error_seqs
    );
    assert_eq!(o.decode_error_seqs, [3, 6, 11]);
    assert_eq!(m.decode_errors, 3);
    assert_eq!(m.malformed_frames, 4);
    assert_eq!(m.oversized_frames, 2);
    assert_eq!(m.oversized_peers_dropped, 2);
    // The oversized batches were refused at their payload's header, before their
    // seq reached us: the last readable rejected seq is the garbage at 11.
    assert_eq!(m.last_rejected_seq, Some(11));
    // Valid + undecodable frames reached the sink; the window saw four kept gaps
    // (the seqs of the dropped garbage / oversized batches).
    assert_eq!(m.frames_live, valid.len() as u64 + 3);
    assert_eq!((m.gaps, m.clears), (4, 0));
    assert_eq!(
        sink.inner.ingest().index().inventory(fault::EP).total(),
        valid.len() as u64
    );
}
