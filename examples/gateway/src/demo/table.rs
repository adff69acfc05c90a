//! Per-policy results and the comparison table.

use std::fmt::Write as _;
use std::time::Duration;

use super::workload::Outcome;

/// One policy's measured results.
#[derive(Clone, Debug)]
pub struct PolicyReport {
    /// Policy label (`rr`, `chwbl`, `kv-exact`).
    pub policy: &'static str,
    /// The scorer / selector behind it, as shown in the table.
    pub scorer: &'static str,
    /// Per-request outcomes.
    pub outcomes: Vec<Outcome>,
    /// Requests each engine served, in engine order.
    pub per_endpoint: Vec<u64>,
    /// Non-zero decision tiers, `tier=count`.
    pub tiers: Vec<(String, u64)>,
    /// Σ predicted cached tokens the gateway recorded.
    pub predicted: u64,
    /// Σ delivered cached tokens the gateway recorded.
    pub delivered: u64,
}

impl PolicyReport {
    /// Cached prompt tokens as a percentage of all prompt tokens.
    pub fn cached_percent(&self) -> f64 {
        let prompt: u64 = self.outcomes.iter().map(|o| o.prompt_tokens).sum();
        let cached: u64 = self.outcomes.iter().map(|o| o.cached_tokens).sum();
        if prompt == 0 {
            0.0
        } else {
            100.0 * cached as f64 / prompt as f64
        }
    }

    /// TTFT at quantile `q` (nearest rank).
    pub fn ttft(&self, q: f64) -> Duration {
        let mut t: Vec<Duration> = self.outcomes.iter().map(|o| o.ttft).collect();
        t.sort();
        let rank = ((q * t.len() as f64).ceil() as usize).saturating_sub(1);
        t.get(rank.min(t.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }
}

/// Renders the comparison table.
pub fn render(reports: &[PolicyReport]) -> String {
    let mut rows = vec![[
        "policy".to_owned(),
        "scorer".to_owned(),
        "cached-token %".to_owned(),
        "TTFT p50".to_owned(),
        "TTFT p99".to_owned(),
        "requests per endpoint".to_owned(),
        "decisions by tier".to_owned(),
        "predicted / delivered cached".to_owned(),
    ]];
    for r in reports {
        let mut sorted: Vec<&(String, u64)> = r.tiers.iter().collect();
        sorted.sort();
        let tiers = sorted
            .iter()
            .map(|(t, n)| format!("{t}={n}"))
            .collect::<Vec<_>>()
            .join(" ");
        rows.push([
            r.policy.to_owned(),
            r.scorer.to_owned(),
            format!("{:.1}%", r.cached_percent()),
            format!("{:.1} ms", r.ttft(0.5).as_secs_f64() * 1e3),
            format!("{:.1} ms", r.ttft(0.99).as_secs_f64() * 1e3),
            r.per_endpoint
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            if tiers.is_empty() {
                "-".to_owned()
            } else {
                tiers
            },
            format!("{} / {}", r.predicted, r.delivered),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (i, row) in rows.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
        if i == 0 {
            let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
            let _ = writeln!(out, "|-{}-|", rule.join("-|-"));
        }
    }
    out.push_str(LEGEND);
    out.push_str(&verdict(reports));
    out
}

const LEGEND: &str = "\n\
cached-token %: prompt tokens the engines served from their prefix cache (their own \
usage.prompt_tokens_details.cached_tokens) over all prompt tokens. TTFT: the wave's release to the \
request's first streamed byte, through the gateway. requests per endpoint: what each engine answered. decisions \
by tier: which ladder step chose the endpoint. predicted / delivered: cached tokens the gateway \
predicted from the engines' KV events vs what the engines reported.\n";

/// The closing line: which row won on cache and latency. Figures are compared
/// as the table prints them (0.1 % and 0.1 ms), so rows the table shows equal
/// are named as a tie rather than ranked by noise below the printed digit.
fn verdict(reports: &[PolicyReport]) -> String {
    let leaders = |f: &dyn Fn(&PolicyReport) -> f64, max: bool| -> Vec<&'static str> {
        let key = |r: &PolicyReport| {
            let v = (f(r) * 10.0).round();
            if max {
                -v
            } else {
                v
            }
        };
        let best = reports.iter().map(key).fold(f64::INFINITY, f64::min);
        reports
            .iter()
            .filter(|r| key(r) == best)
            .map(|r| r.policy)
            .collect()
    };
    let cached = leaders(&|r| r.cached_percent(), true);
    let p50 = leaders(&|r| r.ttft(0.5).as_secs_f64() * 1e3, false);
    let p99 = leaders(&|r| r.ttft(0.99).as_secs_f64() * 1e3, false);
    let name = |v: &[&str]| match v {
        [one] => (*one).to_owned(),
        many => format!("{} (tie)", many.join(" and ")),
    };
    if cached.len() == 1 && p50 == cached && p99 == cached {
        format!(
            "\nresult: {} caches the most and has the lowest TTFT p50 and p99.\n",
            cached[0]
        )
    } else {
        format!(
            "\nresult: most cached {}; lowest TTFT p50 {}; lowest TTFT p99 {}.\n",
            name(&cached),
            name(&p50),
            name(&p99)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(policy: &'static str, cached: u64, ttft_us: u64) -> PolicyReport {
        PolicyReport {
            policy,
            scorer: "",
            outcomes: vec![
                Outcome {
                    ttft: Duration::from_micros(ttft_us),
                    prompt_tokens: 100,
                    cached_tokens: cached,
                    ..Outcome::default()
                };
                3
            ],
            per_endpoint: vec![],
            tiers: vec![],
            predicted: 0,
            delivered: 0,
        }
    }

    #[test]
    fn verdict_names_a_single_winner() {
        let r = [report("rr", 50, 9_000), report("kv-exact", 90, 4_000)];
        assert_eq!(
            verdict(&r),
            "\nresult: kv-exact caches the most and has the lowest TTFT p50 and p99.\n"
        );
    }

    #[test]
    fn verdict_calls_figures_the_table_prints_equal_a_tie() {
        // 4.21 and 4.24 ms both print as "4.2 ms".
        let r = [report("chwbl", 80, 4_240), report("kv-exact", 90, 4_210)];
        assert_eq!(
            verdict(&r),
            "\nresult: most cached kv-exact; lowest TTFT p50 chwbl and kv-exact (tie); \
             lowest TTFT p99 chwbl and kv-exact (tie).\n"
        );
        let r = [report("chwbl", 80, 4_140), report("kv-exact", 90, 4_210)];
        assert!(verdict(&r).contains("p50 chwbl;"), "{}", verdict(&r));
    }
}
