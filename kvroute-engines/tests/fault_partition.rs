//! Fault injection (issue #9 §2b): the subscriber is cut off from a live publisher
//! for ~5 s by a TCP relay (every relayed connection closed, new ones refused),
//! while the publisher keeps publishing. libzmq's PUB drops what it publishes
//! while the subscriber is gone, so the subscriber comes back to a sequence gap:
//!
//! * near: fewer batches missed than the window (64) → inventory kept, gap counted;
//! * far: more than the window missed → inventory cleared, gap and clear counted.
//!
//! Real peer: tests/python/kv_publisher.py (pyzmq XPUB). The number of missed
//! batches follows from the publish rate × the cut; each test checks that its
//! precondition held (near < 64 ≤ far) before checking the outcome.
#![cfg(feature = "zmq")]

#[path = "interop_support/fault.rs"]
mod fault;
mod interop_support;

use std::time::Duration;

use fault::{synthetic_key, Relay, Rig, RigConfig};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriberConfig};

const T: Duration = Duration::from_secs(10);
const CUT: Duration = Duration::from_secs(5);
const WINDOW: u64 = 64;

struct Cut {
    before_cut: Vec<u64>,
    after: Vec<u64>,
    missed: u64,
    rig: Rig,
}

/// Publishes at `rate` for `CUT` + ~4 s, cuts the subscriber off for `CUT` once
/// it holds a few batches, and returns once batches after the cut arrived.
fn cut_off_while_publishing(rate: u64) -> Cut {
    let port = free_port_pair();
    let relay = Relay::start(([127, 0, 0, 1], port).into());
    let rig = Rig::start(RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!(
            "tcp://127.0.0.1:{}",
            relay.port
        )))
        .retry(Duration::from_millis(10), Duration::from_millis(100)),
    ));
    let count = rate * (CUT.as_secs() + 4);
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
        &format!(
            r#"[{{"op":"wait_subscriber"}},{{"op":"publish","count":{count},"rate":{rate}}},
                {{"op":"serve","ms":2000}}]"#
        ),
    );
    publisher.expect("SUBSCRIBED", T);
    rig.wait_for("a few batches before the cut", T, |r| {
        r.observed().last_seq.is_some_and(|s| s >= 5)
    });
    relay.sever();
    let before_cut: Vec<u64> = (0..=rig.observed().last_seq.unwrap()).collect();
    std::thread::sleep(CUT);
    let cut_end = rig.observed().last_seq.unwrap();
    relay.resume();
    rig.wait_for("batches after the cut", T, |r| {
        r.observed().last_seq.is_some_and(|s| s >= cut_end + 3)
    });
    let o = rig.observed();
    let after = ((cut_end + o.missed + 1)..=o.last_seq.unwrap()).collect();
    assert_eq!(o.discontinuities, 1, "one gap: {o:?}");
    Cut {
        before_cut,
        after,
        missed: o.missed,
        rig,
    }
}

#[test]
fn near_cut_keeps_the_inventory_and_counts_the_gap() {
    let cut = cut_off_while_publishing(5);
    assert!(
        cut.missed > 0 && cut.missed <= WINDOW,
        "precondition: a near gap, missed {}",
        cut.missed
    );
    for &s in cut.before_cut.iter().chain(&cut.after) {
        assert!(cut.rig.has(synthetic_key(0, s)), "seq {s} kept/applied");
    }
    let (m, sink) = cut.rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!(
        "FAULT near cut: missed {} batches; metrics {m:?}; seq counters {seq:?}",
        cut.missed
    );
    assert_eq!((m.gaps, m.clears), (1, 0), "{m:?}");
    assert!(m.disconnects >= 1 && m.connects >= 2, "{m:?}");
    assert_eq!((seq.gaps_kept, seq.gaps_cleared), (1, 0), "{seq:?}");
    assert_eq!(seq.missed_in_kept_gaps, cut.missed);
    assert!(seq.near_reconnects >= 1, "{seq:?}");
}

#[test]
fn far_cut_clears_the_inventory_and_counts_it() {
    let cut = cut_off_while_publishing(40);
    assert!(
        cut.missed > WINDOW,
        "precondition: a far gap, missed {}",
        cut.missed
    );
    for &s in &cut.before_cut {
        assert!(!cut.rig.has(synthetic_key(0, s)), "seq {s} cleared");
    }
    for &s in &cut.after {
        assert!(cut.rig.has(synthetic_key(0, s)), "seq {s} applied");
    }
    let (m, sink) = cut.rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!(
        "FAULT far cut: missed {} batches; metrics {m:?}; seq counters {seq:?}",
        cut.missed
    );
    assert_eq!((m.gaps, m.clears), (1, 1), "{m:?}");
    assert_eq!((seq.gaps_kept, seq.gaps_cleared), (0, 1), "{seq:?}");
}
