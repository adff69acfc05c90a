//! Outlier detection: the cases it exists for, and the detector against its
//! naive model on random histories.

use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{EngineEvidence, OutlierConfig, OutlierDetector};
use proptest::prelude::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const HOLE: EndpointId = EndpointId(0);
const GOOD: EndpointId = EndpointId(1);

/// The round-robin case: requests to the hole wait while the good endpoint
/// answers requests sent after them, and the hole's load report hangs (or
/// reports nothing running). The hole is ejected once the oldest has waited
/// `stall_after`, not before.
#[test]
fn a_hole_whose_reports_accuse_it_is_ejected_at_the_stall_age() {
    for evidence in [
        EngineEvidence::Unreachable,
        EngineEvidence::Report { busy: 0 },
    ] {
        let mut d = OutlierDetector::new(2, OutlierConfig::default());
        let mut held = Vec::new();
        for i in 0..10u64 {
            let t = ms(200 * i);
            if i % 2 == 0 {
                let a = d.sent(GOOD, t).unwrap();
                d.answered(GOOD, a, t + ms(10));
            } else {
                held.push(d.sent(HOLE, t).unwrap());
            }
        }
        // Reports every 500 ms.
        let mut ejected_at = None;
        for k in 1..40u64 {
            let t = ms(500 * k);
            d.evidence(HOLE, t, evidence);
            if !d.evaluate(t).is_empty() {
                ejected_at = Some(t);
                break;
            }
        }
        // The first hole request went at 200 ms: 5 s later, with the
        // report at 5.5 s the first evaluation after.
        assert_eq!(ejected_at, Some(ms(5500)), "{evidence:?}");
        assert!(d.is_ejected(HOLE, ms(5500)));
        assert!(!d.is_ejected(GOOD, ms(5500)));
    }
}

/// An engine generating long non-streamed answers reports them running: it
/// is never ejected, however long they take, and whatever the others do.
#[test]
fn a_busy_engine_that_reports_its_requests_is_never_ejected() {
    let mut d = OutlierDetector::new(2, OutlierConfig::default());
    for i in 0..3 {
        d.sent(HOLE, ms(i * 100)).unwrap();
    }
    for k in 1..1200u64 {
        let t = ms(500 * k);
        let a = d.sent(GOOD, t).unwrap();
        d.answered(GOOD, a, t + ms(5));
        // Other replicas' requests count too: busy may exceed ours.
        d.evidence(
            HOLE,
            t,
            EngineEvidence::Report {
                busy: 3 + (k % 2) as u32,
            },
        );
        assert!(d.evaluate(t).is_empty(), "ejected at {t:?}");
    }
    // One hung report among good ones does not eject it either.
    d.evidence(HOLE, ms(600_100), EngineEvidence::Unreachable);
    assert!(d.evaluate(ms(600_200)).is_empty());
}

/// Without evidence from the engine (no load reports, or reports that are
/// not readable) a stall alone ejects nothing; timeouts in a row do.
#[test]
fn without_engine_evidence_only_consecutive_timeouts_eject() {
    let cfg = OutlierConfig::default();
    let mut d = OutlierDetector::new(2, cfg);
    let a = d.sent(GOOD, ms(0)).unwrap();
    d.answered(GOOD, a, ms(1));
    let mut t = ms(0);
    for i in 0..cfg.consecutive_timeouts {
        let x = d.sent(HOLE, t).unwrap();
        let g = d.sent(GOOD, t).unwrap();
        d.answered(GOOD, g, t + ms(5));
        t += ms(120_000);
        assert!(d.evaluate(t).is_empty(), "a stall without evidence");
        let ejected = d.timed_out(HOLE, x, t);
        assert_eq!(ejected, i + 1 == cfg.consecutive_timeouts, "timeout {i}");
    }
    assert!(d.is_ejected(HOLE, t));
    assert_eq!(d.status(HOLE, t).ejected_for, cfg.base_ejection);
}

/// Nobody else answers (a pool-wide outage, or a single endpoint): nothing
/// is ejected, since nothing would be gained.
#[test]
fn the_last_endpoint_in_rotation_is_never_ejected() {
    let mut d = OutlierDetector::new(1, OutlierConfig::default());
    let x = d.sent(HOLE, ms(0)).unwrap();
    d.evidence(HOLE, ms(3000), EngineEvidence::Unreachable);
    assert!(d.evaluate(ms(60_000)).is_empty());
    for _ in 0..5 {
        let y = d.sent(HOLE, ms(60_000)).unwrap();
        assert!(!d.timed_out(HOLE, y, ms(180_000)));
    }
    d.abandoned(HOLE, x);

    // Two endpoints, both silent: the one answering nothing is not "the
    // pool answering" for the other.
    let mut d = OutlierDetector::new(2, OutlierConfig::default());
    d.sent(HOLE, ms(0)).unwrap();
    d.sent(GOOD, ms(0)).unwrap();
    d.evidence(HOLE, ms(3000), EngineEvidence::Unreachable);
    d.evidence(GOOD, ms(3000), EngineEvidence::Unreachable);
    assert!(d.evaluate(ms(10_000)).is_empty());
}

/// The only other endpoint is one the host routes nothing to (drained, or
/// its breaker open): the endpoint timing out is the last in rotation and
/// stays, by timeouts or by stall; once the other is back, it goes.
#[test]
fn an_endpoint_the_host_does_not_route_to_is_not_in_rotation() {
    let mut d = OutlierDetector::new(2, OutlierConfig::default());
    d.set_available(GOOD, false);
    for _ in 0..5 {
        let y = d.sent(HOLE, ms(0)).unwrap();
        assert!(!d.timed_out(HOLE, y, ms(1000)));
    }
    assert!(!d.is_ejected(HOLE, ms(1000)));
    d.set_available(GOOD, true);
    let y = d.sent(HOLE, ms(1000)).unwrap();
    assert!(d.timed_out(HOLE, y, ms(2000)));
    assert!(d.is_ejected(HOLE, ms(2000)));
}

/// Back in rotation after the ejection; still a hole, it is ejected again
/// for twice as long, judged on fresh evidence; once it answers, the
/// multiplier starts over.
#[test]
fn an_ejected_endpoint_returns_and_is_judged_again() {
    let cfg = OutlierConfig::default();
    let mut d = OutlierDetector::new(2, cfg);
    let good = |d: &mut OutlierDetector, t: Duration| {
        let a = d.sent(GOOD, t).unwrap();
        d.answered(GOOD, a, t + ms(1));
    };
    let x = d.sent(HOLE, ms(0)).unwrap();
    good(&mut d, ms(100));
    d.evidence(HOLE, ms(2500), EngineEvidence::Unreachable);
    assert_eq!(d.evaluate(ms(5000)), vec![HOLE]);
    d.abandoned(HOLE, x);
    let back = ms(5000) + cfg.base_ejection;
    assert!(d.is_ejected(HOLE, back - ms(1)));
    assert!(!d.is_ejected(HOLE, back));
    // A request that waited through the ejection counts from the return.
    let y = d.sent(HOLE, ms(6000)).unwrap();
    good(&mut d, back + ms(100));
    d.evidence(HOLE, back + ms(2500), EngineEvidence::Unreachable);
    assert!(d.evaluate(back + ms(4999)).is_empty());
    assert_eq!(d.evaluate(back + ms(5000)), vec![HOLE]);
    assert_eq!(
        d.status(HOLE, back + ms(5000)).ejected_for,
        cfg.base_ejection * 2
    );
    // It answers (a request sent before the ejection): back at once, and
    // the next ejection is a first one again.
    d.answered(HOLE, y, back + ms(6000));
    assert!(!d.is_ejected(HOLE, back + ms(6000)));
    let z = d.sent(HOLE, back + ms(7000)).unwrap();
    good(&mut d, back + ms(7100));
    d.evidence(HOLE, back + ms(9500), EngineEvidence::Unreachable);
    assert_eq!(d.evaluate(back + ms(12_000)), vec![HOLE]);
    assert_eq!(
        d.status(HOLE, back + ms(12_000)).ejected_for,
        cfg.base_ejection
    );
    d.abandoned(HOLE, z);
    assert_eq!(d.status(HOLE, back + ms(12_000)).ejections, 3);
}

/// Reports taken within the grace of a request's send neither accuse nor
/// vouch: the engine may not have admitted it yet.
#[test]
fn reports_inside_the_grace_are_no_evidence() {
    let cfg = OutlierConfig::default();
    let mut d = OutlierDetector::new(2, cfg);
    d.sent(HOLE, ms(0)).unwrap();
    let a = d.sent(GOOD, ms(100)).unwrap();
    d.answered(GOOD, a, ms(200));
    d.evidence(
        HOLE,
        cfg.report_grace - ms(1),
        EngineEvidence::Report { busy: 0 },
    );
    assert!(d.evaluate(ms(60_000)).is_empty());
    d.evidence(HOLE, ms(60_000), EngineEvidence::Report { busy: 0 });
    assert_eq!(d.evaluate(ms(60_000)), vec![HOLE]);
}

fn op_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..1600)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random histories (sends, answers, abandons, timeouts, reports,
    /// evaluations, endpoints leaving and joining, on a clock that moves
    /// forward): the detector and the naive model agree on every answer.
    #[test]
    fn the_detector_agrees_with_its_model(data in op_bytes()) {
        kvroute_select::fuzzing::outlier(&data);
    }

    /// Histories built around a stall (few endpoints, many sends and
    /// reports), where ejections are frequent.
    #[test]
    fn the_detector_agrees_with_its_model_around_stalls(
        head in proptest::collection::vec(0u8..3, 6),
        ops in proptest::collection::vec((0u8..8, 0u8..4, 0u8..2, 0u8..4, any::<u8>()), 0..300),
    ) {
        let mut data = head;
        for (op, dt, e, x, y) in ops {
            data.extend([op, dt, e, x, y]);
        }
        kvroute_select::fuzzing::outlier(&data);
    }
}
