//! Replica decision sharing against its reference model
//! (`kvroute_select::fuzzing::replica_sync`): real [`LoadTracker`]s (one
//! per origin replica) charge, answer, retarget and release requests; their
//! outboxes are drained into a "network" from which messages are delivered
//! in any order, duplicated, late, or never; forged deltas join them; time
//! jumps expire silent origins. After every step the [`RemoteLoad`] table
//! must agree with a model that keeps, per origin and endpoint, the totals of
//! the newest message, and counts an origin only within its TTL of the last
//! news: what each delta did, the load and charged tokens per endpoint, the
//! deciders (this replica's rank among the live ones) and the counters.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{Load, LoadDelta, LoadTracker, RemoteConfig, RemoteLoad, Target};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn remote_load_follows_the_reference_model(data in proptest::collection::vec(any::<u8>(), 0..1600)) {
        kvroute_select::fuzzing::replica_sync(&data);
    }
}

/// A sequence number 0 is never news: it neither loads an endpoint nor
/// makes its origin count among the deciders (which would change this
/// replica's rank, and so its turns, until the TTL).
#[test]
fn a_zero_sequence_number_is_stale_and_adds_no_decider() {
    let now = Duration::from_secs(1);
    let table = RemoteLoad::new(
        RemoteConfig {
            endpoints: 1,
            ..RemoteConfig::default()
        },
        5,
    );
    let forged = LoadDelta {
        origin: 3,
        seq: 0,
        endpoint: EndpointId(0),
        requests: 1,
        prefill_tokens: 0,
        in_flight: 1,
        queued_prefill_tokens: 0,
        charged_prefill_tokens: 0,
    };
    assert_eq!(table.apply(&forged, now), kvroute_select::Applied::Stale);
    assert_eq!(table.remote(EndpointId(0), now).in_flight, 0);
    let d = table.deciders(now);
    assert_eq!((d.count, d.rank), (1, 0), "no phantom replica ranks below");
    assert_eq!(table.counters().origins, 0);
}

/// Engine reports compose over local + remote without counting a request
/// twice: requests the engine already counted at the poll stay counted once,
/// requests any replica decided since are added once.
#[test]
fn engine_reports_over_local_and_remote_count_each_request_once() {
    use kvroute_select::{EngineReport, ReportedLoad};
    let e = EndpointId(0);
    let target = Target {
        endpoint: e,
        decode: None,
    };
    let me = Arc::new(LoadTracker::with_sync(1, 1));
    let peer = Arc::new(LoadTracker::with_sync(1, 2));
    let remote = RemoteLoad::new(
        RemoteConfig {
            endpoints: 1,
            ..RemoteConfig::default()
        },
        1,
    );
    let reported = ReportedLoad::new(1, Duration::from_secs(5));
    let now = Duration::from_secs(1);
    let sync = |remote: &RemoteLoad| {
        let mut out = Vec::new();
        peer.drain_deltas(&mut out);
        for d in &out {
            remote.apply(d, now);
        }
    };
    let _a = me.charge(target, 100);
    let _b = peer.charge(target, 100);
    sync(&remote);
    // The engine runs both plus one from a replica that does not sync.
    let at_poll = remote.view(&*me, now).load(e);
    assert_eq!(at_poll.in_flight, 2);
    reported.update(
        e,
        EngineReport {
            running: 3,
            ..EngineReport::default()
        },
        at_poll,
        now,
    );
    let view = |remote: &RemoteLoad| {
        let mine = remote.view(&*me, now);
        reported.view(&mine, now).load(e).in_flight
    };
    assert_eq!(view(&remote), 3);
    // One more from the peer after the poll: counted once.
    let _c = peer.charge(target, 100);
    sync(&remote);
    assert_eq!(view(&remote), 4);
}
