//! Two gateway replicas subscribed to the same engines hold the same
//! inventories and make the same KV-exact decisions.

mod gateway_support;

use gateway_support::*;
use serde_json::Value;

fn hits(c: &Value) -> Vec<u64> {
    c["hits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

async fn same_inventories(g1: &Gateway, g2: &Gateway) -> Vec<u64> {
    eventually("replica inventories equal", || async {
        let (a, b) = (inventory(g1).await, inventory(g2).await);
        (a == b && a.iter().any(|&n| n > 0)).then_some(a)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_hold_the_same_inventories_and_decide_alike() {
    let a = Engine::start("both");
    let b = Engine::start("both");
    let config = format!(
        "{}{}{}{}",
        config_head("[health]\ninterval_ms = 0\n"),
        kv_rule("kv", "converged"),
        a.endpoint_toml("both"),
        b.endpoint_toml("both")
    );
    let g1 = Gateway::start(&config);
    let g2 = Gateway::start(&config);
    wait_subscribed(&g1).await;
    wait_subscribed(&g2).await;

    // Cold prompts through replica 1 only (round robin spreads them).
    let prompts: Vec<String> = (0..4)
        .map(|i| prompt(&format!("replica{i}"), 100))
        .collect();
    for p in &prompts {
        assert_eq!(complete(&g1, p, 1).await.0, 200);
    }
    let inv = same_inventories(&g1, &g2).await;
    assert!(
        inv.iter().all(|&n| n > 0),
        "both engines hold blocks: {inv:?}"
    );

    // Each warm prompt goes to replica 1, then (inventories equal again) the
    // very same prompt to replica 2: both pick the same endpoint.
    for (i, p) in prompts.iter().enumerate() {
        let warm = format!("{p} warm");
        let h1 = hits(&counters(&g1, "kv").await);
        assert_eq!(complete(&g1, &warm, 1).await.0, 200);
        let d1: Vec<u64> = hits(&counters(&g1, "kv").await)
            .iter()
            .zip(&h1)
            .map(|(x, y)| x - y)
            .collect();
        same_inventories(&g1, &g2).await;
        let h2 = hits(&counters(&g2, "kv").await);
        assert_eq!(complete(&g2, &warm, 1).await.0, 200);
        let d2: Vec<u64> = hits(&counters(&g2, "kv").await)
            .iter()
            .zip(&h2)
            .map(|(x, y)| x - y)
            .collect();
        assert_eq!(
            d1.iter().sum::<u64>(),
            1,
            "prompt {i}: replica 1 made a KV hit: {d1:?}"
        );
        assert_eq!(d1, d2, "prompt {i}: replicas decided differently");
    }
}
