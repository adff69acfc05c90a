//! `kvroute sim run --html FILE`: the run as a self-contained HTML page —
//! prefix-hit ratio per policy, the TTFT distribution per policy, requests
//! per worker over simulated time per policy, and the text table.

use crate::chart::{self, Bar, Page, Reference, Samples};
use crate::report::SimReport;

/// Time bins of the requests-per-worker charts.
const TIME_BINS: usize = 40;

/// The HTML report of `report`; `table` is the text table printed beside it.
#[must_use]
pub fn render(report: &SimReport, table: &str) -> String {
    let w = &report.workload;
    let f = &report.fleet;
    let mut page = Page::new("kvroute sim run");
    page.paragraph(&format!(
        "Workload {}: {} requests, {} prompt tokens. {} workers, KV blocks of {} tokens, {} blocks each; \
         {} gateway replica(s); seed {}. Time is simulated: the same inputs give the same figures on any machine.",
        w.source, w.requests, w.prompt_tokens, f.workers, f.block_size, f.capacity_blocks, f.replicas, f.seed
    ));

    let bars: Vec<Bar> = report
        .policies
        .iter()
        .map(|p| Bar {
            label: p.policy.clone(),
            value: p.prefix_hit_ratio * 100.0,
            text: format!("{:.1}", p.prefix_hit_ratio * 100.0),
        })
        .collect();
    let refs = [
        Reference {
            value: w.ideal_prefix_hit_ratio * 100.0,
            label: format!(
                "ideal: one infinite cache ({:.1}%)",
                w.ideal_prefix_hit_ratio * 100.0
            ),
        },
        Reference {
            value: w.pooled_prefix_hit_ratio * 100.0,
            label: format!(
                "pooled: one LRU cache of the fleet's capacity ({:.1}%)",
                w.pooled_prefix_hit_ratio * 100.0
            ),
        },
    ];
    page.chart(
        &chart::bars(
            "Prefix-hit ratio per policy",
            "% of prompt tokens",
            &bars,
            100.0,
            &refs,
        ),
        "Prompt tokens served from a worker's prefix cache over all prompt tokens.",
    );
    let ttft: Vec<Samples> = report
        .policies
        .iter()
        .map(|p| Samples {
            name: p.policy.clone(),
            #[allow(clippy::cast_precision_loss)]
            values: p
                .samples
                .ttft_us
                .iter()
                .map(|us| *us as f64 / 1000.0)
                .collect(),
        })
        .collect();
    page.chart(
        &chart::cdf("Time to first token", "TTFT, ms", &ttft),
        "Share of served requests whose first token came within the time on the x axis (arrival to first token).",
    );

    page.heading("Requests per worker over time");
    page.paragraph(&format!(
        "Placements by arrival time ({TIME_BINS} equal spans of simulated time from the first \
         arrival to the last), stacked by worker: how each policy spreads the load as it runs."
    ));
    let workers: Vec<String> = (0..f.workers).map(|i| format!("worker {i}")).collect();
    for p in &report.policies {
        #[allow(clippy::cast_precision_loss)]
        let events: Vec<(f64, usize)> = p
            .samples
            .routed
            .iter()
            .map(|(t, w)| (*t as f64 / 1e6, *w as usize))
            .collect();
        let (bins, starts) = chart::bin_by_time(&events, workers.len(), TIME_BINS);
        let labels: Vec<String> = starts.iter().map(|s| chart::fmt_num(*s)).collect();
        page.chart(
            &chart::stacked_bins(
                &p.policy,
                "arrival, s (simulated)",
                &bins,
                &labels,
                &workers,
            ),
            &format!(
                "{}: {} requests served, routed max/mean {:.2}.",
                p.policy, p.served, p.load.routed_max_over_mean
            ),
        );
    }

    page.heading("Table");
    page.preformatted(table);
    page.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{FleetReport, PolicyReport, PolicySamples, WorkloadReport};

    fn policy(name: &str, hit: f64, routed: Vec<(u64, u32)>) -> PolicyReport {
        PolicyReport {
            policy: name.to_owned(),
            prefix_hit_ratio: hit,
            served: routed.len() as u64,
            samples: PolicySamples {
                ttft_us: vec![1_000, 2_000, 40_000],
                routed,
            },
            ..PolicyReport::default()
        }
    }

    #[test]
    fn the_page_holds_each_policys_charts_the_bounds_and_the_table() {
        let report = SimReport {
            workload: WorkloadReport {
                source: "tenants".into(),
                ideal_prefix_hit_ratio: 0.8,
                pooled_prefix_hit_ratio: 0.7,
                ..WorkloadReport::default()
            },
            fleet: FleetReport {
                workers: 3,
                ..FleetReport::default()
            },
            policies: vec![
                policy("rr", 0.25, vec![(0, 0), (500_000, 1), (1_000_000, 2)]),
                policy("kv-exact", 0.5, vec![(0, 2), (1_000_000, 2)]),
            ],
        };
        let html = render(&report, "| policy | <table> |");
        // Hit ratio, TTFT, and one requests-per-worker chart per policy.
        assert_eq!(html.matches("<svg").count(), 4, "{html}");
        assert!(html.contains("ideal: one infinite cache (80.0%)"), "{html}");
        assert!(html.contains("pooled: one LRU cache of the fleet&#39;s capacity (70.0%)"));
        assert!(html.contains(">25.0<") && html.contains(">50.0<"), "{html}");
        assert!(html.contains("worker 2"));
        assert!(html.contains("kv-exact: 2 requests served"));
        assert!(html.contains("<pre>| policy | &lt;table&gt; |</pre>"));
        assert!(!html.contains("<script"));
    }
}
