//! Experiment + regression test: what a publisher restart costs with the `zeromq`
//! crate's built-in SUB reconnect versus our subscriber loop (with and without the
//! replay bootstrap). The publisher (pyzmq) streams at 2000 batches/s, restarts
//! (socket closed, 300 ms down, seq back to 0), streams 1000 more without waiting
//! for anyone, restarts again (1500 ms down) and streams 1000 more; three
//! subscribers listen at once. The numbers are printed; the assertion is that our
//! loop with replay loses nothing.
#![cfg(feature = "zmq")]

mod interop_support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use interop_support::{free_port_pair, runtime, Peer, Recorder};
use kvroute_engines::transport::{ZmqEndpoint, ZmqSubscriber, ZmqSubscriberConfig};
use zeromq::{Socket, SocketRecv, SubSocket};

const T: Duration = Duration::from_secs(15);
const AFTER_RESTART: u64 = 1000;

#[test]
fn publisher_restart_loss_builtin_reconnect_vs_our_loop() {
    let rt = runtime();
    let port = free_port_pair();
    let replay_port = free_port_pair();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let replay = format!("tcp://127.0.0.1:{replay_port}");

    // A: the crate's own reconnect (connect once, then just recv).
    let builtin: Arc<Mutex<Vec<u64>>> = Arc::default();
    let (stop_a, stopped_a) = tokio::sync::oneshot::channel::<()>();
    let seen = builtin.clone();
    let ep = endpoint.clone();
    let task_a = rt.spawn(async move {
        let mut sub = SubSocket::new();
        sub.subscribe("").await.unwrap();
        // First dial with the crate's own retry (engine may not be up yet).
        sub.connect(&ep).await.unwrap();
        let mut stopped = std::pin::pin!(stopped_a);
        loop {
            tokio::select! {
                _ = &mut stopped => return,
                m = sub.recv() => if let Ok(m) = m {
                    let seq = u64::from_be_bytes(m.get(1).unwrap()[..].try_into().unwrap());
                    seen.lock().unwrap().push(seq);
                }
            }
        }
    });

    // B: our loop without replay; C: our loop with replay.
    let mut ours = Vec::new();
    for with_replay in [false, true] {
        let mut config = ZmqSubscriberConfig::new(ZmqEndpoint::connect(endpoint.clone()));
        if with_replay {
            config = config.replay_endpoint(replay.clone());
        }
        let sink = Recorder::new(with_replay);
        let subscriber = ZmqSubscriber::new(config);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = rt.spawn(subscriber.run(sink.clone(), async move {
            let _ = stopped.await;
        }));
        ours.push((sink, stop, task));
    }

    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--socket",
            "xpub",
            "--endpoint",
            &endpoint,
            "--replay-endpoint",
            &replay,
        ],
        &format!(
            r#"[{{"op":"wait_subscriber","count":3}},{{"op":"publish","count":400,"rate":2000}},
                {{"op":"restart","down_ms":300}},
                {{"op":"publish","count":{AFTER_RESTART},"rate":2000}},{{"op":"serve","ms":200}},
                {{"op":"restart","down_ms":1500}},
                {{"op":"publish","count":{AFTER_RESTART},"rate":2000}},{{"op":"serve","ms":1500}}]"#
        ),
    );
    publisher.expect("DONE", T);

    let _ = stop_a.send(());
    rt.block_on(async { tokio::time::timeout(T, task_a).await })
        .unwrap()
        .unwrap();
    let mut results = Vec::new();
    for (sink, stop, task) in ours {
        let _ = stop.send(());
        rt.block_on(async { tokio::time::timeout(T, task).await })
            .unwrap()
            .unwrap();
        results.push(sink);
    }

    // Split the built-in subscriber's stream into publisher processes at seq resets.
    let builtin = builtin.lock().unwrap().clone();
    let mut epochs: Vec<BTreeSet<u64>> = vec![BTreeSet::new()];
    let mut last = None;
    for seq in builtin {
        if last.is_some_and(|l| seq < l) {
            epochs.push(BTreeSet::new());
        }
        epochs.last_mut().unwrap().insert(seq);
        last = Some(seq);
    }
    let lost = |got: usize| AFTER_RESTART - got as u64;
    let mut lost_replay = 0;
    for (epoch, down) in [(1usize, 300), (2, 1500)] {
        // A process whose frames all went missing leaves no epoch behind.
        let lost_builtin = epochs.get(epoch).map_or(AFTER_RESTART, |e| lost(e.len()));
        let lost_no_replay = lost(results[0].snapshot(|r| r.epoch_seqs(epoch).len()));
        let with_replay = lost(results[1].snapshot(|r| r.epoch_seqs(epoch).len()));
        lost_replay += with_replay;
        eprintln!(
            "publisher restart ({down} ms down, 2000 batches/s, {AFTER_RESTART} after restart): \
             lost with zeromq built-in reconnect = {lost_builtin}, our loop without replay = \
             {lost_no_replay}, our loop with replay = {with_replay}"
        );
    }
    assert_eq!(
        lost_replay, 0,
        "our loop with replay must recover every batch"
    );
    results[1].snapshot(|r| {
        assert_eq!(r.epoch_seqs(0), (0..400).collect::<Vec<_>>());
        assert_eq!(r.restarts, 2);
    });
}
