//! `kvroute demo` end to end: real mock engines (real qwen3 tokenizer, real
//! prefix caches publishing KV events) behind the in-process gateway.

use std::collections::BTreeMap;
use std::process::Command;

/// Table rows keyed by policy: the cells after the policy name.
fn rows(table: &str) -> BTreeMap<String, Vec<String>> {
    table
        .lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|-"))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect();
            (cells[0].clone(), cells[1..].to_vec())
        })
        .collect()
}

/// Cells after the policy name: scorer, cached-token %, TTFT p50, TTFT p99,
/// requests per endpoint, decisions by tier, predicted / delivered.
fn cached_percent(cells: &[String]) -> f64 {
    cells[1].trim_end_matches('%').parse().unwrap()
}

#[test]
fn demo_compares_three_policies_and_kv_exact_reuses_more_than_round_robin() {
    // The HTML report goes to the temporary directory by default.
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["demo", "--requests", "40", "--engines", "3"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stderr.contains("[kv-exact] 40/40"), "no progress: {stderr}");
    let page = tmp.path().join("kvroute-demo.html");
    assert!(
        stderr.contains(&format!("kvroute demo: HTML report: {}", page.display())),
        "{stderr}"
    );
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("<pre>| policy"), "{html}");
    let rows = rows(&stdout);
    for policy in ["rr", "chwbl", "kv-exact"] {
        assert!(rows.contains_key(policy), "no {policy} row:\n{stdout}");
    }
    // Every request was served by exactly one of the three engines.
    for (policy, cells) in &rows {
        if policy == "policy" {
            continue;
        }
        let served: u64 = cells[4].split('/').map(|n| n.parse::<u64>().unwrap()).sum();
        assert_eq!(served, 40, "{policy}:\n{stdout}");
    }
    let rr = cached_percent(&rows["rr"]);
    let kv = cached_percent(&rows["kv-exact"]);
    assert!(kv > rr, "kv-exact {kv}% <= rr {rr}%:\n{stdout}");
    // The rows say what they run, and the run says what it showed.
    assert!(rows["kv-exact"][0].starts_with("default"), "{stdout}");
    assert!(
        stdout.starts_with("kvroute demo: 40 multi-turn chat requests"),
        "{stdout}"
    );
    assert!(stdout.contains("\nresult: "), "{stdout}");
    assert!(
        rows["kv-exact"][5].contains("kv_exact="),
        "kv-exact made no KV-exact decisions:\n{stdout}"
    );
}
