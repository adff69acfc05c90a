//! Fault injection: the subscriber is cut off from a live publisher
//! for ~5 s by a TCP relay (every relayed connection closed, new ones refused),
//! while the publisher keeps publishing. libzmq's PUB drops what it publishes
//! while the subscriber is gone, so the subscriber comes back to a sequence gap:
//!
//! * near: fewer batches missed than the window (64) → inventory kept, gap counted;
//! * far: more than the window missed → inventory cleared, gap and clear counted;
//! * with a replay socket: the reconnect resumes from our last batch, recovering
//!   what the cut lost — or, if the engine restarted meanwhile and published past
//!   our last seq, proving the restart by that batch's digest.
//!
//! Real peer: tests/python/kv_publisher.py (pyzmq XPUB). The number of missed
//! batches follows from the publish rate × the cut; each test checks that its
//! precondition held (near < 64 ≤ far) before checking the outcome.
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

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

/// A subscriber behind a relay with a replay socket (bootstrap and resume), and a
/// publisher that publishes `BEFORE` batches, waits for a line on stdin, then runs
/// `during` (JSON steps) and serves replays. Returns once the subscriber holds
/// the first `BEFORE` batches.
fn replay_rig(during: &str) -> (Rig, Relay, Peer) {
    replay_rig_with(during, kvroute_ingest::RestartPolicy::Clear)
}

/// [`replay_rig`] whose window answers a restart with `on_restart`.
fn replay_rig_with(during: &str, on_restart: kvroute_ingest::RestartPolicy) -> (Rig, Relay, Peer) {
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let relay = Relay::start(([127, 0, 0, 1], port).into());
    let mut config = RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!(
            "tcp://127.0.0.1:{}",
            relay.port
        )))
        .replay_endpoint(format!("tcp://127.0.0.1:{replay_port}"))
        .retry(Duration::from_millis(10), Duration::from_millis(100)),
    );
    config.bootstrap = true;
    config.ingest.window.on_restart = on_restart;
    let rig = Rig::start(config);
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
        &format!(
            r#"[{{"op":"wait_subscriber"}},{{"op":"publish","count":{BEFORE},"rate":500}},
                {{"op":"wait_stdin"}},{during},{{"op":"serve","ms":15000}}]"#
        ),
    );
    publisher.expect("PUBLISHED", T);
    rig.wait_for("the blocks before the cut", T, |r| {
        (0..BEFORE).all(|s| r.has(synthetic_key(0, s)))
    });
    (rig, relay, publisher)
}

const BEFORE: u64 = 20;

/// None of the blocks the first process published before the cut is left.
fn assert_dead_process_cleared(rig: &Rig) {
    for s in 0..BEFORE {
        assert!(
            !rig.has(synthetic_key(0, s)),
            "dead process's seq {s} cleared"
        );
    }
}

/// The engine restarts while we are cut off and publishes past our last sequence
/// before we come back: by numbers alone its batch `last + 1` looks like the next
/// one and the dead process's blocks would stay. With a replay socket the
/// reconnect resumes from our *last* batch; the new process's batch at that seq
/// differs, which proves the restart: the old inventory goes and the new process's
/// buffer is applied.
#[test]
fn restart_during_a_cut_past_our_last_seq_is_detected_by_the_resume_digest() {
    const AFTER: u64 = 40;
    let (rig, relay, mut publisher) = replay_rig(&format!(
        r#"{{"op":"restart","down_ms":100}},{{"op":"publish","count":{AFTER},"rate":2000}}"#
    ));
    relay.sever();
    publisher.send_line("restart");
    publisher.expect("PUBLISHED epoch=1", T);
    relay.resume();
    rig.wait_for("the new process's blocks from our last seq on", T, |r| {
        (BEFORE - 1..AFTER).all(|s| r.has(synthetic_key(1, s)))
    });
    assert_dead_process_cleared(&rig);
    let (m, sink) = rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!("FAULT restart during cut: metrics {m:?}; seq counters {seq:?}");
    assert!(m.restarts >= 1 && m.clears >= 1, "{m:?}");
    assert!(
        seq.resumes >= 1 && seq.resume_restarts >= 1,
        "the resume found the restart: {seq:?}"
    );
}

/// The same restart with the window's `Replay` policy (what the runtime uses
/// with a replay socket): the replayed batch that proves the restart ends the
/// resume's replay, and the new process's whole buffer is replayed from 0, so
/// none of its blocks is missing.
#[test]
fn restart_found_in_a_resume_replay_is_replayed_from_the_new_process_start() {
    const AFTER: u64 = 40;
    let (rig, relay, mut publisher) = replay_rig_with(
        &format!(
            r#"{{"op":"restart","down_ms":100}},{{"op":"publish","count":{AFTER},"rate":2000}}"#
        ),
        kvroute_ingest::RestartPolicy::Replay,
    );
    relay.sever();
    publisher.send_line("restart");
    publisher.expect("PUBLISHED epoch=1", T);
    relay.resume();
    rig.wait_for("every block of the new process", T, |r| {
        (0..AFTER).all(|s| r.has(synthetic_key(1, s)))
    });
    assert_dead_process_cleared(&rig);
    let (m, sink) = rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!("FAULT restart found in a resume replay: metrics {m:?}; seq counters {seq:?}");
    assert!(seq.resume_restarts >= 1, "{seq:?}");
    assert_eq!(
        sink.inner.ingest().endpoint_ingest().missing_batches(),
        0,
        "nothing of the new process is missing"
    );
}

/// The same cut without a restart: the resume's replay starts with our last batch,
/// unchanged, so nothing is cleared and the batches published during the cut are
/// recovered from the engine's buffer (no gap at all).
#[test]
fn cut_with_replay_resumes_verified_and_recovers_the_missed_batches() {
    const DURING: u64 = 30;
    let (rig, relay, mut publisher) = replay_rig(&format!(
        r#"{{"op":"publish","count":{DURING},"rate":2000}}"#
    ));
    relay.sever();
    publisher.send_line("publish");
    publisher.expect("PUBLISHED", T);
    relay.resume();
    rig.wait_for(
        "every block, including those published during the cut",
        T,
        |r| (0..BEFORE + DURING).all(|s| r.has(synthetic_key(0, s))),
    );
    let (m, sink) = rig.finish();
    let seq = sink.inner.ingest().endpoint_ingest().seq_counters();
    println!("FAULT cut with replay: metrics {m:?}; seq counters {seq:?}");
    assert_eq!((m.clears, m.restarts, m.gaps), (0, 0, 0), "{m:?}");
    assert_eq!(
        (seq.resumes_verified, seq.resume_restarts),
        (1, 0),
        "{seq:?}"
    );
}
