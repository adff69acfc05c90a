//! Fault injection: the consumer is slower than the publisher. The
//! sink sleeps 1 ms per frame (≤ 1000 frames/s) while a pyzmq publisher floods
//! ~20 KB batches as fast as it can, ~120 MB in all.
//!
//! Where the backpressure goes: our subscriber calls the sink synchronously on its
//! task and the `zeromq` crate reads a SUB socket only when polled (no background
//! reader, no queue of its own), so a slow sink stops reading the TCP socket. The
//! kernel socket buffers fill, then libzmq's per-subscriber pipe on the publisher
//! (SNDHWM, 200 messages here), and from then on the PUB socket *drops* whole
//! messages for this subscriber. Nothing accumulates in our process.
//!
//! What the test checks: (1) every published seq is either applied or part of a
//! gap the ingest window saw and counted — nothing is lost silently; (2) the
//! process's resident memory grows by far less than what was published.
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::cell::Cell;
use std::time::Duration;

use fault::{rss_bytes, Rig, RigConfig};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};

const T: Duration = Duration::from_secs(20);
const FLOOD: u64 = 6000;
const TAIL: u64 = 5;
const TOKENS: u64 = 4000;

#[test]
fn slow_consumer_stays_bounded_and_counts_what_the_publisher_dropped() {
    let port = free_port_pair();
    let mut config = RigConfig::new(ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!(
        "tcp://127.0.0.1:{port}"
    ))));
    config.delay_per_frame = Duration::from_millis(1);
    let rig = Rig::start(config);
    let mut publisher = Peer::spawn(
        "kv_fault_publisher.py",
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--hwm",
            "200",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
    );
    // Flood, let the backlog drain, then a few paced batches that must all arrive.
    publisher.send_line(
        &format!(
            r#"[{{"op":"wait_subscriber"}},{{"op":"flood_big","count":{FLOOD},"tokens":{TOKENS}}},
            {{"op":"serve","ms":2500}},{{"op":"publish","count":{TAIL},"rate":50}},
            {{"op":"serve","ms":5000}}]"#
        )
        .replace('\n', " "),
    );
    publisher.expect("SUBSCRIBED", T);
    let rss_before = rss_bytes();
    let flooded = publisher.expect("FLOODED", T);
    let bytes_each: u64 = flooded
        .rsplit_once("bytes_each=")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap();
    let last = FLOOD + TAIL - 1;
    let rss_max = Cell::new(rss_before);
    rig.wait_for("the last paced batch", T, |r| {
        rss_max.set(rss_max.get().max(rss_bytes()));
        r.observed().last_seq == Some(last)
    });
    let rss_max = rss_max.get().max(rss_bytes());
    let o = rig.observed();
    let (m, sink) = rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    let published_bytes = FLOOD * bytes_each;
    println!(
        "FAULT slow consumer: published {} batches ({} MB), received {}, missed {} in {} gaps; \
         RSS {} MB -> {} MB; metrics {m:?}; seq counters {seq:?}",
        last + 1,
        published_bytes >> 20,
        o.frames,
        o.missed,
        o.discontinuities,
        rss_before >> 20,
        rss_max >> 20
    );
    // Precondition: the consumer really was too slow (the publisher dropped).
    assert!(o.missed > 0, "{o:?}");
    // Nothing lost silently: every seq was applied or counted in a gap.
    assert_eq!(o.frames + o.missed, last + 1, "{o:?}");
    assert_eq!(m.frames_live, o.frames);
    assert_eq!(m.gaps, o.discontinuities, "{m:?}");
    assert_eq!(
        seq.gaps_kept + seq.gaps_cleared,
        o.discontinuities,
        "{seq:?}"
    );
    assert_eq!(m.decode_errors + m.malformed_frames + m.oversized_frames, 0);
    // Bounded: far less memory than the flood (nothing queued in our process).
    assert!(published_bytes > 100 << 20, "flood too small to tell");
    let grew = rss_max.saturating_sub(rss_before);
    assert!(
        grew < 32 << 20,
        "resident memory grew {} MB during a {} MB flood",
        grew >> 20,
        published_bytes >> 20
    );
}
