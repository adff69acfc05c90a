//! The admin API's rule lifecycle: `/admin/counters` counts one rule
//! instance (a rule deleted and created again starts from zero in every
//! figure), and rule documents the gateway could not serve are refused with
//! the field named.

mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

async fn post_rule(gw: &Gateway, doc: &Value) -> (u16, String) {
    let r = client()
        .post(gw.admin_url("/admin/rules"))
        .json(doc)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn completions(gw: &Gateway, n: usize) {
    for i in 0..n {
        let body = json!({"model": MODEL, "prompt": format!("scope {i}"), "max_tokens": 1});
        let r = client()
            .post(gw.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
}

fn tiers_total(c: &Value) -> u64 {
    c["tiers"]
        .as_object()
        .map_or(0, |t| t.values().filter_map(Value::as_u64).sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_of_a_recreated_rule_count_that_rule_only() {
    let upstream = echo_upstream().await;
    let gw = Gateway::start(&config_head("[health]\ninterval_ms = 0\n"));
    let doc = json!({"name": "scoped", "default": true, "choice": "round_robin",
        "endpoints": [{"url": format!("http://{upstream}")}]});
    assert_eq!(post_rule(&gw, &doc).await.0, 201);
    eventually("ready", || async {
        let r = client().get(gw.admin_url("/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    completions(&gw, 5).await;
    let c = counters(&gw, "scoped").await;
    assert_eq!(
        (c["decisions"].as_u64(), tiers_total(&c)),
        (Some(5), 5),
        "{c}"
    );

    let r = client()
        .delete(gw.admin_url("/admin/rules/scoped"))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    // Deleted: its series leave /metrics.
    let text = metrics_text(&gw).await;
    assert!(!text.contains("rule=\"scoped\""), "{text}");
    assert_eq!(post_rule(&gw, &doc).await.0, 201);
    completions(&gw, 2).await;
    let c = counters(&gw, "scoped").await;
    assert_eq!(c["decisions"], 2, "{c}");
    assert_eq!(
        tiers_total(&c),
        2,
        "tiers count the same rule instance: {c}"
    );
    assert_eq!(c["tiers"]["fallback"], 2, "{c}");
    // Created again: /metrics counts from zero, as a counter reset.
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("kvroute_decisions_total{rule=\"scoped\",tier=\"fallback\"} 2"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_with_an_unservable_event_port_or_capacity_are_refused_naming_the_field() {
    let gw = Gateway::start(&config_head("[health]\ninterval_ms = 0\n"));
    let cases = [
        (
            json!({"url": "http://127.0.0.1:8000", "zmq": "tcp://*:0"}),
            "rule.endpoints[0].zmq",
        ),
        (
            json!({"url": "http://127.0.0.1:8000", "zmq": "tcp://127.0.0.1:5557", "replay": "tcp://*:0"}),
            "rule.endpoints[0].replay",
        ),
        (
            json!({"url": "http://127.0.0.1:8000", "capacity": 4_000_000_000u64}),
            "rule.endpoints[0].capacity",
        ),
    ];
    for (endpoint, field) in cases {
        let doc = json!({"name": "bad", "models": [MODEL], "choice": "round_robin",
            "endpoints": [endpoint]});
        let (status, body) = post_rule(&gw, &doc).await;
        assert_eq!(status, 400, "{endpoint}: {body}");
        assert!(body.contains(field), "{endpoint}: {body}");
    }
    let rules = get_json(&gw.admin_url("/admin/rules"), None).await;
    assert!(
        !rules.to_string().contains("\"bad\""),
        "nothing was created: {rules}"
    );
}
