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
