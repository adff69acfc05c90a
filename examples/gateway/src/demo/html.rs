//! The demo's HTML report: cached-token share per policy, the TTFT
//! distribution per policy, requests per engine in each wave per policy,
//! and the text table — one self-contained page (inline SVG, no script,
//! nothing fetched), drawn with the simulator's chart module.

use kvroute_sim::chart::{self, Bar, Page, Samples};

use super::table::PolicyReport;

/// Most bars in a requests-per-engine chart: beyond this, consecutive waves
/// share a bar.
const MAX_BARS: usize = 50;

/// The report page: `intro` is the run's description and `table` the text
/// table the demo prints.
pub fn render(intro: &str, table: &str, reports: &[PolicyReport], engines: usize) -> String {
    let mut page = Page::new("kvroute demo");
    let intro = intro.trim();
    page.paragraph(intro.strip_prefix("kvroute demo: ").unwrap_or(intro));
    let bars: Vec<Bar> = reports
        .iter()
        .map(|r| Bar {
            label: r.policy.to_owned(),
            value: r.cached_percent(),
            text: format!("{:.1}%", r.cached_percent()),
        })
        .collect();
    page.chart(
        &chart::bars(
            "Cached prompt tokens per policy",
            "% of prompt tokens",
            &bars,
            100.0,
            &[],
        ),
        "Prompt tokens the engines served from their prefix cache (their own usage receipts) over all prompt tokens.",
    );
    let ttft: Vec<Samples> = reports
        .iter()
        .map(|r| Samples {
            name: r.policy.to_owned(),
            values: r
                .outcomes
                .iter()
                .map(|o| o.ttft.as_secs_f64() * 1e3)
                .collect(),
        })
        .collect();
    page.chart(
        &chart::cdf("Time to first token", "TTFT, ms", &ttft),
        "Share of requests whose first streamed byte came within the time on the x axis, from their wave's release, through the gateway.",
    );

    page.heading("Requests per engine in each wave");
    page.paragraph(
        "Each bar is one wave of requests, sent together; its colours say which engine answered each request.",
    );
    let names: Vec<String> = (0..engines).map(|i| format!("engine {}", i + 1)).collect();
    for r in reports {
        let (bins, labels) = per_wave(r, engines);
        page.chart(
            &chart::stacked_bins(r.policy, "wave", &bins, &labels, &names),
            &format!(
                "{}: requests per engine {}.",
                r.policy,
                r.per_endpoint
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("/")
            ),
        );
    }

    page.heading("Table");
    page.preformatted(table);
    page.finish()
}

/// Requests per engine per wave (consecutive waves merged to at most
/// [`MAX_BARS`] bars), and each bar's label (its first wave, from 1).
fn per_wave(r: &PolicyReport, engines: usize) -> (Vec<Vec<u64>>, Vec<String>) {
    let waves = r.outcomes.iter().map(|o| o.wave + 1).max().unwrap_or(0);
    let per_bar = waves.div_ceil(MAX_BARS).max(1);
    let mut bins = vec![vec![0u64; engines]; waves.div_ceil(per_bar)];
    for o in &r.outcomes {
        if let Some(slot) = o
            .engine
            .and_then(|e| bins.get_mut(o.wave / per_bar)?.get_mut(e))
        {
            *slot += 1;
        }
    }
    let labels = (0..bins.len())
        .map(|b| (b * per_bar + 1).to_string())
        .collect();
    (bins, labels)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::workload::Outcome;
    use super::*;

    fn report(waves: &[(usize, usize)]) -> PolicyReport {
        PolicyReport {
            policy: "kv-exact",
            scorer: "",
            outcomes: waves
                .iter()
                .map(|&(wave, engine)| Outcome {
                    ttft: Duration::from_millis(5),
                    prompt_tokens: 100,
                    cached_tokens: 50,
                    wave,
                    engine: Some(engine),
                })
                .collect(),
            per_endpoint: vec![2, 1],
            tiers: vec![],
            predicted: 0,
            delivered: 0,
        }
    }

    #[test]
    fn waves_become_bars_of_requests_per_engine() {
        let (bins, labels) = per_wave(&report(&[(0, 0), (0, 1), (1, 0)]), 2);
        assert_eq!(bins, vec![vec![1, 1], vec![1, 0]]);
        assert_eq!(labels, ["1", "2"]);
        // 100 waves: two per bar.
        let many: Vec<(usize, usize)> = (0..100).map(|w| (w, w % 2)).collect();
        let (bins, labels) = per_wave(&report(&many), 2);
        assert_eq!(bins.len(), MAX_BARS);
        assert!(bins.iter().all(|b| b == &vec![1, 1]));
        assert_eq!(labels[1], "3");
    }

    #[test]
    fn the_page_holds_every_chart_and_the_table() {
        let html = render(
            "intro",
            "| policy |",
            &[report(&[(0, 0), (0, 1), (1, 0)])],
            2,
        );
        assert_eq!(html.matches("<svg").count(), 3, "{html}");
        assert!(html.contains("<pre>| policy |</pre>"));
        assert!(html.contains("50.0%"));
        assert!(!html.contains("<script"));
    }
}
