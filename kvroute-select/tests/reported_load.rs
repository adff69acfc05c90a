//! A decision reads each endpoint's load and engine report in one call
//! (`Load::load_and_report`); the engine-report view answers it from one read
//! of the report. It must answer exactly what the two separate calls answer,
//! whatever the reports' ages, invalidations and the host's own load.

use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{EndpointLoad, EngineReport, Load, LoadTable, PrefillProgress, ReportedLoad};
use proptest::prelude::*;

const ENDPOINTS: usize = 6;
const MAX_AGE: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
enum Step {
    Report {
        endpoint: usize,
        running: u32,
        waiting: u32,
        prefill: Option<(u64, u32)>,
        local_in_flight: u32,
        at_ms: u64,
    },
    Invalidate(usize),
    Local {
        endpoint: usize,
        in_flight: u32,
        queued: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (
            0..ENDPOINTS,
            0u32..20,
            0u32..20,
            proptest::option::of((0u64..100_000, 0u32..1_000)),
            0u32..10,
            0u64..2_000,
        )
            .prop_map(
                |(endpoint, running, waiting, prefill, local_in_flight, at_ms)| Step::Report {
                    endpoint,
                    running,
                    waiting,
                    prefill,
                    local_in_flight,
                    at_ms,
                }
            ),
        (0..ENDPOINTS).prop_map(Step::Invalidate),
        (0..ENDPOINTS, 0u32..10, 0u64..50_000).prop_map(|(endpoint, in_flight, queued)| {
            Step::Local {
                endpoint,
                in_flight,
                queued,
            }
        }),
    ]
}

fn id(i: usize) -> EndpointId {
    EndpointId(u32::try_from(i).unwrap())
}

proptest! {
    #[test]
    fn one_read_answers_what_two_calls_answer(
        steps in proptest::collection::vec(step(), 0..40),
        now_ms in 0u64..2_500,
    ) {
        let reported = ReportedLoad::new(ENDPOINTS, MAX_AGE);
        let mut local = LoadTable::new(ENDPOINTS);
        for s in &steps {
            match *s {
                Step::Report { endpoint, running, waiting, prefill, local_in_flight, at_ms } => {
                    let report = EngineReport {
                        running,
                        waiting,
                        prefill: prefill.map(|(tokens, ms)| PrefillProgress {
                            tokens,
                            seconds: f64::from(ms) / 1e3,
                        }),
                        ..EngineReport::default()
                    };
                    let at = EndpointLoad { in_flight: local_in_flight, queued_prefill_tokens: 0 };
                    reported.update(id(endpoint), report, at, Duration::from_millis(at_ms));
                }
                Step::Invalidate(e) => reported.invalidate(id(e)),
                Step::Local { endpoint, in_flight, queued } => {
                    local.set(id(endpoint), EndpointLoad { in_flight, queued_prefill_tokens: queued });
                }
            }
        }
        let now = Duration::from_millis(now_ms);
        for e in 0..ENDPOINTS + 1 {
            let view = reported.view(&local, now);
            let fused = view.load_and_report(id(e));
            let apart = reported.view(&local, now);
            prop_assert_eq!(fused, (apart.load(id(e)), apart.report(id(e))), "endpoint {}", e);
        }
    }
}
