//! Explained decisions through the facade, against real engines (vLLM
//! 0.33.0's KV-cache code in `tests/python/vllm_standin.py`): the
//! explanation of a pick says what the decision did, the receipt settles
//! its cached-token account into the router's counters, and a retry after
//! a connect failure is explained as a second pick.

use kvroute_testkit as support;

use http_body_util::Full;
use kvroute::{ApiKind, Backend, KvRouter, Leg, LostCause, Pick, Source, TokenAccount};
use kvroute_select::Ineligible;
use support::*;

fn router(backends: Vec<Backend>) -> KvRouter {
    let mut b = KvRouter::builder(CONTRACT.parse().unwrap()).model(MODEL, model_dir());
    for be in backends {
        b = b.endpoint(be);
    }
    b.spawn().unwrap()
}

/// Sends `body` to the pick's endpoint; returns the receipt's cached tokens
/// and the account it settled.
async fn forward(pick: Pick, body: &bytes::Bytes) -> (Option<u32>, Option<TokenAccount>) {
    let req = http::Request::post(format!("{}/v1/chat/completions", pick.url()))
        .header("content-type", "application/json")
        .body(Full::new(pick.upstream_body(body)))
        .unwrap();
    let resp = client().request(req).await.expect("engine answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    let (head, incoming) = resp.into_parts();
    let (tx, rx) = std::sync::mpsc::channel();
    let body = pick.into_body_settled(&head.headers, incoming, move |r, account| {
        tx.send((r, account)).unwrap();
    });
    read_all(body).await;
    let (receipt, account) = rx.recv().unwrap();
    assert!(receipt.complete);
    (receipt.cached_tokens, account)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explained_pick_says_what_it_did_and_its_receipt_settles_the_account() {
    let engines = [Standin::start(), Standin::start()];
    let r = router(engines.iter().map(Standin::backend).collect());
    let body = chat("explained", false);

    let first = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert!(first.decision().explanation().is_none(), "not asked");
    let url = first.url().to_owned();
    forward(first, &body).await;
    wait_until("the engine's BlockStored", || r.blocks(&url) > 0).await;

    let prompt = r.prepare(ApiKind::Chat, &body).await;
    let mut second = r.pick_explained(prompt, None).unwrap();
    assert_eq!(second.url(), url);
    let slot = second.endpoint_id().unwrap().index();
    let predicted = second.predicted_cached_tokens();
    assert!(predicted >= 16, "{predicted}");
    let x = second.take_explanation().expect("asked");
    assert_eq!(x.picks.len(), 1);
    let pick = x.picks[0];
    assert_eq!(pick.tier, Source::KvExact);
    assert_eq!(pick.endpoint, second.endpoint_id());
    assert_eq!(pick.failed, None);
    let held = x.endpoints[slot].prefix_blocks();
    assert_eq!(pick.predicted_blocks, held);
    assert_eq!((held * x.block_size).min(x.prompt_tokens), predicted);
    assert_eq!(x.endpoints[1 - slot].prefix_blocks(), 0);
    assert_eq!(
        (
            x.account.reachable,
            x.account.predicted,
            x.account.lost_total()
        ),
        (u64::from(predicted), u64::from(predicted), 0)
    );
    assert!(second.decision().explanation().is_none(), "taken");

    let (cached, account) = forward(second, &body).await;
    let a = account.expect("a counted receipt settles the account");
    assert!(a.settled);
    assert_eq!(a.achieved, u64::from(cached.unwrap()).min(a.predicted));
    assert_eq!(a.reachable, a.achieved + a.lost_total());
    let ev = &r.counters().endpoints[slot];
    assert_eq!(ev.reachable_tokens, a.reachable);
    assert_eq!(ev.achieved_tokens, a.achieved);
    assert_eq!(
        ev.lost_to(LostCause::StaleInventory),
        a.lost_to(LostCause::StaleInventory)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_explained_as_a_second_pick() {
    let urls: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let r = router(urls.iter().map(|u| Backend::vllm(u.clone())).collect());
    let prompt = r.prepare(ApiKind::Chat, &chat("x", false)).await;
    let mut pick = r.pick_explained(prompt, None).unwrap();
    let first = pick.endpoint_id().unwrap();
    pick.retry().expect("another endpoint");
    let next = pick.endpoint_id().unwrap();
    let x = pick.decision().explanation().expect("asked");
    assert_eq!(x.picks.len(), 2);
    assert_eq!(x.picks[0].endpoint, Some(first));
    assert_eq!(x.picks[1].failed, Some((first, Leg::Endpoint)));
    assert_eq!(x.picks[1].endpoint, Some(next));
    assert_eq!(
        x.endpoints[first.index()].ineligible,
        Some(Ineligible::ConnectFailed)
    );
    assert_eq!(x.endpoints[next.index()].ineligible, None);
}
