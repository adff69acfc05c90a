//! `docs/grafana/kvroute.json`, the Grafana dashboard, against a live
//! gateway: every metric name its PromQL queries (and its variables' queries)
//! read is a family of `kvroute serve`'s `/metrics`, with samples, once the
//! gateway served a few requests. The gateway runs in front of two mock
//! engines (real Qwen3 tokenizer, KV events over ZeroMQ), polls their load
//! reports and shares its load with other replicas over a real
//! `nats-server`, so the engine-load and replica families have samples too.
//!
//! Names are read by tokenizing each expression: strings, label matchers
//! `{...}`, ranges `[...]`, Grafana variables `$x` / `${x}`, numbers and
//! durations are skipped, as are the label lists of `by`, `without`, `on`,
//! `ignoring`, `group_left` and `group_right`; an identifier followed by `(`
//! must be a PromQL function or aggregation; every other identifier that is
//! not a keyword is a metric name. A counter is queried as `<family>_total`,
//! a histogram as `<family>_bucket`, `_sum` or `_count`, a gauge by its
//! family name.

mod gateway_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::{json, Value};

/// PromQL functions and aggregation operators.
const FUNCTIONS: &[&str] = &[
    "abs",
    "absent",
    "absent_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "avg",
    "avg_over_time",
    "bottomk",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "cos",
    "cosh",
    "count",
    "count_over_time",
    "count_values",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "deg",
    "delta",
    "deriv",
    "exp",
    "floor",
    "group",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_stddev",
    "histogram_stdvar",
    "histogram_sum",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "limit_ratio",
    "limitk",
    "ln",
    "log10",
    "log2",
    "mad_over_time",
    "max",
    "max_over_time",
    "min",
    "min_over_time",
    "minute",
    "month",
    "pi",
    "predict_linear",
    "present_over_time",
    "quantile",
    "quantile_over_time",
    "rad",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sin",
    "sinh",
    "sort",
    "sort_by_label",
    "sort_by_label_desc",
    "sort_desc",
    "sqrt",
    "stddev",
    "stddev_over_time",
    "stdvar",
    "stdvar_over_time",
    "sum",
    "sum_over_time",
    "tan",
    "tanh",
    "time",
    "timestamp",
    "topk",
    "vector",
    "year",
];

/// Clauses followed by a parenthesized list of label names.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Binary operators and modifiers written as words, and the float literals.
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "atan2", "bool", "offset", "start", "end", "inf", "nan",
];

/// The index just past the `close` that ends the text opened before `i`
/// (strings inside skipped).
fn skip_to(e: &[u8], mut i: usize, close: u8) -> Result<usize, String> {
    while i < e.len() {
        match e[i] {
            q @ (b'"' | b'\'' | b'`') => i = skip_string(e, i + 1, q)?,
            c if c == close => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err(format!("unclosed `{}`", close as char))
}

/// The index just past the string quoted by `q` whose text starts at `i`.
fn skip_string(e: &[u8], mut i: usize, q: u8) -> Result<usize, String> {
    while i < e.len() {
        match e[i] {
            b'\\' if q != b'`' => i += 2,
            c if c == q => return Ok(i + 1),
            _ => i += 1,
        }
    }
    Err("unclosed string".to_owned())
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// The metric names a PromQL expression reads.
fn metric_names(expr: &str) -> Result<BTreeSet<String>, String> {
    let e = expr.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < e.len() {
        let c = e[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if matches!(c, b'"' | b'\'' | b'`') {
            i = skip_string(e, i + 1, c)?;
        } else if c == b'{' {
            i = skip_to(e, i + 1, b'}')?;
        } else if c == b'[' {
            i = skip_to(e, i + 1, b']')?;
        } else if c == b'#' {
            // A comment runs to the end of the line.
            while i < e.len() && e[i] != b'\n' {
                i += 1;
            }
        } else if c == b'$' {
            // A Grafana variable: $name or ${name...}.
            i += 1;
            if e.get(i) == Some(&b'{') {
                i = skip_to(e, i + 1, b'}')?;
            } else {
                while i < e.len() && is_ident(e[i]) {
                    i += 1;
                }
            }
        } else if c.is_ascii_digit() || (c == b'.' && e.get(i + 1).is_some_and(u8::is_ascii_digit))
        {
            // A number or a duration (1e15, 0.99, 5m, 1h30m).
            while i < e.len() && (e[i].is_ascii_alphanumeric() || e[i] == b'.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < e.len() && is_ident(e[i]) {
                i += 1;
            }
            let word = &expr[start..i];
            let mut k = i;
            while k < e.len() && e[k].is_ascii_whitespace() {
                k += 1;
            }
            let call = e.get(k) == Some(&b'(');
            if GROUPING.contains(&word) {
                if call {
                    i = skip_to(e, k + 1, b')')?;
                }
            } else if FUNCTIONS.contains(&word) {
                // An aggregation may put its `by (...)` before the parenthesis.
            } else if call {
                return Err(format!("`{word}(` is not a PromQL function"));
            } else if !KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                out.insert(word.to_owned());
            }
        } else {
            i += 1;
        }
    }
    Ok(out)
}

/// Every PromQL query of the dashboard, with where it is: the panels'
/// targets and the query variables (`label_values(<selector>, <label>)`).
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let empty = Vec::new();
    for p in dashboard["panels"].as_array().unwrap_or(&empty) {
        let title = p["title"].as_str().unwrap_or("?");
        for t in p["targets"].as_array().unwrap_or(&empty) {
            let expr = t["expr"].as_str().unwrap_or_default().to_owned();
            out.push((format!("panel {title:?} {}", t["refId"]), expr));
        }
    }
    for v in dashboard["templating"]["list"].as_array().unwrap_or(&empty) {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default();
        let selector = q
            .trim()
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'))
            .and_then(|args| args.rsplit_once(','))
            .map_or(q, |(selector, _label)| selector);
        out.push((format!("variable {}", v["name"]), selector.to_owned()));
    }
    out
}

/// A `/metrics` text: family → type, and the names that have samples.
struct Exposition {
    families: BTreeMap<String, String>,
    samples: BTreeSet<String>,
}

fn exposition(text: &str) -> Exposition {
    let mut families = BTreeMap::new();
    let mut samples = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (w.next(), w.next()) {
                families.insert(name.to_owned(), kind.to_owned());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            samples.insert(name.to_owned());
        }
    }
    Exposition { families, samples }
}

/// Why `name` cannot be queried from `m`, if it cannot.
fn unresolved(name: &str, m: &Exposition) -> Option<String> {
    let kind = |family: &str| m.families.get(family).map(String::as_str);
    let resolved = kind(name) == Some("gauge")
        || name
            .strip_suffix("_total")
            .is_some_and(|f| kind(f) == Some("counter"))
        || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .is_some_and(|f| kind(f) == Some("histogram"))
        });
    if !resolved {
        let hint = m
            .families
            .get(name)
            .filter(|k| *k == "counter")
            .map(|_| format!(" (`{name}` is a counter: query `{name}_total`)"))
            .unwrap_or_default();
        return Some(format!("`{name}` is no metric of /metrics{hint}"));
    }
    (!m.samples.contains(name)).then(|| format!("`{name}` has no sample"))
}

/// Every problem of `dashboard`'s queries against the exposition `text`.
fn problems(dashboard: &Value, text: &str) -> Vec<String> {
    let m = exposition(text);
    let mut out = Vec::new();
    for (at, expr) in queries(dashboard) {
        if expr.trim().is_empty() {
            out.push(format!("{at}: empty query"));
            continue;
        }
        match metric_names(&expr) {
            Ok(names) if names.is_empty() => out.push(format!("{at}: reads no metric: {expr}")),
            Ok(names) => out.extend(
                names
                    .iter()
                    .filter_map(|n| unresolved(n, &m))
                    .map(|p| format!("{at}: {p}")),
            ),
            Err(e) => out.push(format!("{at}: {e}: {expr}")),
        }
    }
    out
}

fn dashboard() -> Value {
    let path = repo().join("docs/grafana/kvroute.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every metric name the dashboard reads.
fn names_used(d: &Value) -> BTreeSet<String> {
    queries(d)
        .iter()
        .flat_map(|(at, e)| metric_names(e).unwrap_or_else(|err| panic!("{at}: {err}")))
        .collect()
}

#[test]
fn promql_metric_names_are_read_and_everything_else_skipped() {
    let names = |e: &str| -> Vec<String> { metric_names(e).unwrap().into_iter().collect() };
    assert_eq!(
        names(
            r#"histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$instance", x="y{z}"}[$__rate_interval])))"#
        ),
        ["a_bucket"]
    );
    assert_eq!(
        names("sum by (rule) (rate(a_total[5m])) / sum without (tier,role) (b_total offset 1h)"),
        ["a_total", "b_total"]
    );
    assert_eq!(
        names("max(c) > 0 and on (endpoint) group_left (role) d == bool 1e15"),
        ["c", "d"]
    );
    assert_eq!(names("e{a=\"b\"} < 1e15 unless f"), ["e", "f"]);
    assert_eq!(
        names("g:recorded:rate5m * ${factor} + $x"),
        ["g:recorded:rate5m"]
    );
    assert_eq!(names("count(h) # a comment naming nothing_here\n"), ["h"]);
    assert!(metric_names("rat(a_total[5m])")
        .unwrap_err()
        .contains("not a PromQL function"));
    assert!(metric_names("sum(a{rule=\"x\")").is_err());
}

#[test]
fn the_checker_refuses_unknown_names_and_counters_without_total() {
    let text = "# TYPE kvroute_requests counter\nkvroute_requests_total{rule=\"a\"} 1\n\
                # TYPE kvroute_in_flight gauge\nkvroute_in_flight{endpoint=\"e\"} 0\n\
                # TYPE kvroute_lat histogram\nkvroute_lat_bucket{le=\"+Inf\"} 1\nkvroute_lat_count 1\n\
                # TYPE kvroute_silent gauge\n# EOF\n";
    let d = |exprs: &[&str]| json!({"panels": [{"title": "p", "targets": exprs.iter().map(|e| json!({"refId": "A", "expr": e})).collect::<Vec<_>>()}]});
    assert_eq!(
        problems(
            &d(&[
                "sum(rate(kvroute_requests_total[5m]))",
                "kvroute_in_flight",
                "histogram_quantile(0.5, rate(kvroute_lat_bucket[5m])) / kvroute_lat_count",
            ]),
            text
        ),
        Vec::<String>::new()
    );
    let p = problems(
        &d(&[
            "rate(kvroute_requests[5m])",
            "kvroute_no_such_metric",
            "kvroute_in_flight_total",
            "kvroute_silent",
            "kvroute_lat_sum",
        ]),
        text,
    );
    assert_eq!(p.len(), 5, "{p:#?}");
    assert!(
        p[0].contains("is a counter: query `kvroute_requests_total`"),
        "{p:#?}"
    );
    assert!(
        p[1].contains("`kvroute_no_such_metric` is no metric"),
        "{p:#?}"
    );
    assert!(p[3].contains("`kvroute_silent` has no sample"), "{p:#?}");
    assert!(p[4].contains("`kvroute_lat_sum` has no sample"), "{p:#?}");
}

#[test]
fn the_dashboard_is_an_importable_grafana_dashboard_over_a_prometheus_variable() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64() >= Some(36),
        "Grafana 10 reads schema 36 and up"
    );
    assert!(d["uid"].is_string() && d["title"].is_string());
    let vars = d["templating"]["list"].as_array().unwrap();
    let ds = vars
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(ds["query"], "prometheus");
    let var = format!("${{{}}}", ds["name"].as_str().unwrap());
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "id of {title} repeats"
        );
        let g = &p["gridPos"];
        assert!(
            g["x"].as_u64().unwrap() + g["w"].as_u64().unwrap() <= 24,
            "{title} is wider than the grid"
        );
        if p["type"] == "row" {
            continue;
        }
        assert!(titles.insert(title), "two panels are titled {title:?}");
        assert!(
            p["description"].as_str().is_some_and(|s| !s.is_empty()),
            "{title}: no description"
        );
        assert_eq!(p["datasource"]["uid"], var.as_str(), "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], var.as_str(), "{title}");
        }
    }
    for v in vars.iter().filter(|v| v["type"] == "query") {
        assert_eq!(
            v["datasource"]["uid"],
            var.as_str(),
            "variable {}",
            v["name"]
        );
    }
    // What an operator looks for has a panel.
    let used = names_used(&d);
    for name in [
        "kvroute_kv_hits_total",
        "kvroute_decisions_total",
        "kvroute_kv_misses_total",
        "kvroute_predicted_cached_tokens_total",
        "kvroute_delivered_cached_tokens_total",
        "kvroute_inventory_blocks",
        "kvroute_subscriber_connected",
        "kvroute_ingest_inventory_partial",
        "kvroute_ingest_missing_batches",
        "kvroute_subscriber_gaps_total",
        "kvroute_in_flight",
        "kvroute_queued_prefill_tokens",
        "kvroute_remote_in_flight",
        "kvroute_remote_queued_prefill_tokens",
        "kvroute_engine_reported_running",
        "kvroute_engine_reported_waiting",
        "kvroute_tokenize_admitted_total",
        "kvroute_tokenize_overloaded_total",
        "kvroute_tokenize_in_flight",
        "kvroute_replicas",
        "kvroute_replica_received_total",
        "kvroute_endpoint_ejected",
        "kvroute_outlier_ejections_total",
        "kvroute_decision_latency_seconds_bucket",
    ] {
        assert!(used.contains(name), "no panel reads {name}");
    }
}

/// True when a HELP line's text has every `"` and `\\` escaped.
fn help_is_escaped(help: &str) -> bool {
    let mut chars = help.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return false,
            '\\' if !matches!(chars.next(), Some('\\' | '"' | 'n')) => return false,
            _ => {}
        }
    }
    true
}

#[test]
fn help_texts_with_raw_quotes_or_backslashes_are_refused() {
    assert!(help_is_escaped(
        "Requests by rule (limits.x = \\\"wait\\\")."
    ));
    assert!(!help_is_escaped("Admitted after waiting (x = \"wait\")."));
    assert!(!help_is_escaped("a \\q b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_reads_is_in_a_live_gateways_metrics() {
    let d = dashboard();
    let nats = NatsServer::start();
    let a = Engine::start("both");
    let b = Engine::start("both");
    let gw = Gateway::start(&format!(
        "{}{}{}{}",
        config_head(&format!(
            "[limits]\nengine_load_poll_ms = 200\n[health]\ninterval_ms = 200\n\
             [replicas]\nnats = \"{}\"\nheartbeat_ms = 200\n",
            nats.url()
        )),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    ));
    wait_subscribed(&gw).await;
    // The same prompt twice (the second a KV hit once the first's blocks are
    // published), and another one.
    let p = prompt("dashboard", 120);
    for text in [p.clone(), p.clone(), format!("{p} again")] {
        let (status, v) = complete(&gw, &text, 2).await;
        assert_eq!(status, 200, "{v}");
        // Let the engine's KV events reach the inventory.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Engine load reports and receipts arrive after the answers: scrape
    // until every name has samples, or report what is missing.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (text, found) = loop {
        let text = metrics_text(&gw).await;
        let found = problems(&d, &text);
        if found.is_empty() || Instant::now() > deadline {
            break (text, found);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        found.is_empty(),
        "the dashboard reads what /metrics does not have:\n{}\n\n/metrics:\n{text}",
        found.join("\n")
    );
    // OpenMetrics HELP text escapes `"` and `\\` (and has no line feed):
    // strict parsers refuse anything else.
    let bad_help: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter(|h| !help_is_escaped(h))
        .collect();
    assert!(bad_help.is_empty(), "HELP texts not escaped: {bad_help:#?}");
    let used = names_used(&d);
    assert!(used.len() >= 60, "only {} names: {used:?}", used.len());
    assert!(text.contains("kvroute_kv_hits_total{rule=\"kv\""), "{text}");

    // The same check on this exposition fails for a panel that names a
    // metric the gateway does not export.
    let mut broken = d.clone();
    broken["panels"].as_array_mut().unwrap().push(json!({
        "type": "timeseries", "title": "broken", "id": 9999,
        "targets": [{"refId": "A", "expr": "sum(rate(kvroute_cached_tokens_total[5m])) / sum(kvroute_requests)"}]
    }));
    let p = problems(&broken, &text);
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(
        p.iter().all(|s| s.starts_with("panel \"broken\"")),
        "{p:#?}"
    );
}
