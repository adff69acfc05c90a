//! Why a request went where it did, end to end over real sockets: `kvroute
//! serve` in front of two `kvroute mock-engine`s. Each response carries
//! `x-kvroute-decision-id`; `GET /admin/decisions/{id}` explains that
//! decision as it happened (tier, endpoint, cached prefixes, the cost
//! scorer's cap and terms, the cached-token account and its settlement by
//! the receipt); the ring forgets beyond `[decisions] ring`; the compact
//! `x-kvroute-explain` header comes only when enabled and asked; and the
//! counterfactual counters on `/metrics` add up.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

/// The load cap refuses an endpoint holding one request more than the
/// mean (factor 1, no headroom), so a request arriving while the prefix's
/// holder serves a long one goes elsewhere.
fn config(a: &Engine, b: &Engine, decisions: &str) -> String {
    format!(
        "{}{}[rules.cost]\nload_factor = 1.0\nload_headroom = 0\n\n{}{}",
        config_head(&format!(
            "[health]\ninterval_ms = 0\n[limits]\nengine_load_poll_ms = 0\n[decisions]\n{decisions}\n"
        )),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    )
}

/// POST /v1/completions with `headers`; the response's headers and body.
async fn send(
    gw: &Gateway,
    prompt: &str,
    max_tokens: u32,
    headers: &[(&str, &str)],
) -> (reqwest::header::HeaderMap, Value) {
    let mut req = client()
        .post(gw.url("/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let h = resp.headers().clone();
    (h, resp.json().await.unwrap())
}

fn header<'a>(h: &'a reqwest::header::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

async fn decision(gw: &Gateway, id: &str) -> (u16, Value) {
    let r = client()
        .get(gw.admin_url(&format!("/admin/decisions/{id}")))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Σ over rule `kv`'s samples of a `/metrics` family (`name` as written).
fn metric(text: &str, name: &str, with: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains("rule=\"kv\""))
        .filter(|l| l.contains(with))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

const CAUSES: [&str; 9] = [
    "load_cap",
    "affinity_slack",
    "scorer",
    "below_threshold",
    "pd_affinity",
    "failover",
    "stale_inventory",
    "contract_mismatch",
    "tokenize_overload",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_explained_as_they_happened_and_the_counters_add_up() {
    let a = Engine::start("both");
    let b = Engine::start("both");
    let gw = Gateway::start(&config(&a, &b, "ring = 4\nexplain = true"));
    wait_subscribed(&gw).await;

    // 1. Cold: nothing cached anywhere, the fallback chooses.
    let p = prompt("explain", 150);
    let (h, _) = send(&gw, &p, 2, &[]).await;
    assert!(header(&h, "x-kvroute-explain").is_none(), "not asked");
    let first = header(&h, "x-kvroute-decision-id")
        .expect("decision id")
        .to_owned();
    let (status, x) = decision(&gw, &first).await;
    assert_eq!(status, 200, "{x}");
    assert_eq!(x["rule"], "kv");
    assert_eq!(x["tier"], header(&h, "x-kvroute-tier").unwrap(), "{x}");
    assert_eq!(
        x["endpoint"],
        header(&h, "x-kvroute-endpoint").unwrap(),
        "{x}"
    );
    assert_eq!(
        x["miss_reason"],
        header(&h, "x-kvroute-miss-reason").unwrap(),
        "{x}"
    );
    assert_eq!(x["account"]["reachable"], 0, "{x}");
    assert_eq!(x["endpoints"].as_array().unwrap().len(), 2, "{x}");

    let holder = eventually("one endpoint holding the prompt", || async {
        let inv = inventory(&gw).await;
        let holders: Vec<usize> = (0..2).filter(|&i| inv[i] > 0).collect();
        (holders.len() == 1).then(|| holders[0])
    })
    .await;
    let other = 1 - holder;

    // 2. Warm and long: KV-exact keeps it on the holder, which then serves
    // it for a while.
    let long = {
        let url = gw.url("/v1/completions");
        let body = json!({"model": MODEL, "prompt": format!("{p} long"), "max_tokens": 4000});
        tokio::spawn(async move {
            let r = client().post(url).json(&body).send().await.unwrap();
            let h = r.headers().clone();
            let v: Value = r.json().await.unwrap();
            (h, v)
        })
    };
    eventually("the long request in flight on the holder", || async {
        let eps = endpoints(&gw).await;
        (eps[holder]["in_flight"] == 1).then_some(())
    })
    .await;

    // 3. Warm again while the holder is busy: the cap refuses it, the
    // request goes to the other endpoint, and the explanation says so.
    let (h, _) = send(
        &gw,
        &format!("{p} capped"),
        2,
        &[("x-kvroute-explain", "1")],
    )
    .await;
    let capped = header(&h, "x-kvroute-decision-id").unwrap().to_owned();
    let compact = header(&h, "x-kvroute-explain").expect("asked and enabled");
    assert!(compact.starts_with("tier=kv_exact;"), "{compact}");
    assert!(compact.contains(&format!("endpoint={other}")), "{compact}");
    assert!(compact.contains(";lost=load_cap:"), "{compact}");
    assert!(
        compact.contains(&format!("e{holder}=")) && compact.contains("/cap"),
        "{compact}"
    );
    let (_, x) = decision(&gw, &capped).await;
    assert_eq!(x["tier"], "kv_exact", "{x}");
    assert_eq!(x["endpoint_index"], other, "{x}");
    assert_eq!(
        x["endpoint"],
        header(&h, "x-kvroute-endpoint").unwrap(),
        "{x}"
    );
    let eps = x["endpoints"].as_array().unwrap();
    let held = eps[holder]["confirmed_prefix_blocks"].as_u64().unwrap();
    assert!(held > 0, "{x}");
    assert_eq!(eps[holder]["in_flight"], 1, "{x}");
    assert_eq!(eps[holder]["terms"]["under_cap"], false, "{x}");
    assert_eq!(eps[other]["terms"]["under_cap"], true, "{x}");
    assert_eq!(eps[other]["confirmed_prefix_blocks"], 0, "{x}");
    let cap = &x["scorer"]["cap"];
    assert_eq!(
        (cap["applied"].clone(), cap["refused"].clone()),
        (json!(true), json!(1)),
        "{x}"
    );
    assert_eq!(x["scorer"]["cheapest_index"], other, "{x}");
    let acct = &x["account"];
    let block = x["block_size"].as_u64().unwrap();
    let prompt_tokens = x["prompt_tokens"].as_u64().unwrap();
    assert_eq!(acct["reachable"], (held * block).min(prompt_tokens), "{x}");
    assert_eq!(acct["predicted"], 0, "{x}");
    assert_eq!(acct["lost"]["load_cap"], acct["reachable"], "{x}");
    assert_eq!(
        header(&h, "x-kvroute-predicted-cached-tokens"),
        Some("0"),
        "{x}"
    );

    // The long request's decision: KV-exact on the holder, its prediction
    // the holder's prefix, settled by its receipt.
    let (lh, lv) = long.await.unwrap();
    let long_id = header(&lh, "x-kvroute-decision-id").unwrap().to_owned();
    let x = eventually("the long request's receipt settled", || async {
        let (_, x) = decision(&gw, &long_id).await;
        (!x["settled_account"].is_null()).then_some(x)
    })
    .await;
    assert_eq!(x["tier"], "kv_exact", "{x}");
    assert_eq!(x["endpoint_index"], holder, "{x}");
    let predicted = x["account"]["predicted"].as_u64().unwrap();
    assert!(predicted > 0, "{x}");
    // Credited with its confirmed or predicted prefix, whichever is longer;
    // the header counts the confirmed part.
    let row = &x["endpoints"][holder];
    let blocks = row["confirmed_prefix_blocks"]
        .as_u64()
        .unwrap()
        .max(row["predicted_prefix_blocks"].as_u64().unwrap());
    let long_prompt = x["prompt_tokens"].as_u64().unwrap();
    assert_eq!(predicted, (blocks * block).min(long_prompt), "{x}");
    assert_eq!(x["picks"][0]["predicted_blocks"], blocks, "{x}");
    let confirmed: u64 = header(&lh, "x-kvroute-predicted-cached-tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        confirmed,
        (row["confirmed_prefix_blocks"].as_u64().unwrap() * block).min(long_prompt),
        "{x}"
    );
    let s = &x["settled_account"];
    assert_eq!(s["settled"], true, "{x}");
    assert_eq!(s["achieved"], cached_tokens(&lv).min(predicted), "{x} {lv}");
    let lost: u64 = CAUSES.iter().map(|c| s["lost"][c].as_u64().unwrap()).sum();
    assert_eq!(
        s["reachable"].as_u64().unwrap(),
        s["achieved"].as_u64().unwrap() + lost,
        "{x}"
    );

    // The counterfactual counters over every settled decision: reachable =
    // achieved + each cause, and the capped request's tokens are lost to
    // the cap.
    let m = eventually("three receipts counted", || async {
        let m = metrics_text(&gw).await;
        (metric(&m, "kvroute_receipts_total", "") == 3).then_some(m)
    })
    .await;
    let reachable = metric(&m, "kvroute_reachable_cached_tokens_total", "");
    let achieved = metric(&m, "kvroute_achieved_cached_tokens_total", "");
    let by_cause: Vec<u64> = CAUSES
        .iter()
        .map(|c| {
            metric(
                &m,
                "kvroute_lost_cached_tokens_total",
                &format!("cause=\"{c}\""),
            )
        })
        .collect();
    assert_eq!(
        reachable,
        achieved + by_cause.iter().sum::<u64>(),
        "{by_cause:?}\n{m}"
    );
    assert!(
        by_cause[0] >= (held * block).min(prompt_tokens),
        "{by_cause:?}"
    );
    assert!(achieved > 0, "{m}");

    // The ring keeps the last four: two more decisions push the first out.
    for k in 0..2 {
        send(&gw, &format!("{p} more {k}"), 2, &[]).await;
    }
    assert_eq!(decision(&gw, &first).await.0, 404);
    assert_eq!(decision(&gw, &capped).await.0, 200);
    assert_eq!(decision(&gw, "nonsense").await.0, 404);

    // Without `[decisions] explain`, asking gets no header (the id stays).
    let plain = Gateway::start(&config(&a, &b, ""));
    let (h, _) = send(&plain, &p, 2, &[("x-kvroute-explain", "1")]).await;
    assert!(header(&h, "x-kvroute-explain").is_none());
    let id = header(&h, "x-kvroute-decision-id").expect("ring on by default");
    assert_eq!(decision(&plain, id).await.0, 200);
}
