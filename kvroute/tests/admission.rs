//! The router's tokenization admission: a pick that finds every
//! tokenization slot taken is routed at once without KV (a counted
//! `tokenize_overloaded` miss, its model and usage rewrite kept), or waits for
//! room under `TokenizeOverload::Wait`. Endpoints need no engine: the
//! decision is the fallback's either way, the miss reason tells them apart.

use kvroute_testkit as support;

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use kvroute::admission::TokenizeOverload;
use kvroute::{ApiKind, Backend, KvRouter, MissReason};
use support::*;

fn router(overload: TokenizeOverload, wait: Duration) -> KvRouter {
    KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(format!("http://127.0.0.1:{}", closed_port())))
        .max_concurrent_tokenizations(1)
        .tokenize_overload(overload)
        .tokenize_wait(wait)
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_beyond_the_bound_skips_kv_routing_and_is_counted() {
    let r = router(TokenizeOverload::Skip, Duration::from_secs(60));
    let body = chat("admission", true);
    // Another request's tokenization holds the only slot.
    let held = r.tokenize_admission().admit_now(1).unwrap();
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(pick.decision().miss(), Some(MissReason::TokenizeOverloaded));
    assert_eq!(pick.model(), Some(MODEL), "the model is still read");
    assert_ne!(pick.upstream_body(&body), body, "include_usage still added");
    let s = r.tokenize_counters();
    assert_eq!((s.admitted, s.overloaded, s.in_flight), (1, 1, 1));
    drop((pick, held));

    // With the slot free the prompt is tokenized: a KV miss of another kind.
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_ne!(pick.decision().miss(), Some(MissReason::TokenizeOverloaded));
    assert!(pick.decision().miss().is_some(), "no engine holds blocks");
    let s = r.tokenize_counters();
    assert_eq!((s.admitted, s.overloaded, s.in_flight), (2, 1, 0));
    assert_eq!(s.peak_in_flight, 1);
    assert_eq!(s.max_concurrent, 1);
    assert_eq!(s.max_bytes_in_flight, 8 << 20, "the default byte bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_pick_takes_the_released_slot() {
    let r = router(TokenizeOverload::Wait, Duration::from_secs(60));
    let body = chat("admission", false);
    let held = r.tokenize_admission().admit_now(1).unwrap();
    let mut pick = std::pin::pin!(r.pick(ApiKind::Chat, &body));
    // One poll reaches the admission and parks there (the slot is taken).
    let first = std::future::poll_fn(|cx| Poll::Ready(pick.as_mut().poll(cx).is_pending())).await;
    assert!(first, "the pick waits for room");
    drop(held);
    let pick = pick.await.unwrap();
    assert_ne!(pick.decision().miss(), Some(MissReason::TokenizeOverloaded));
    let s = r.tokenize_counters();
    assert_eq!((s.admitted, s.admitted_after_wait, s.overloaded), (2, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_pick_gives_up_after_its_bound() {
    let r = router(TokenizeOverload::Wait, Duration::from_millis(20));
    let body = chat("admission", false);
    let _held = r.tokenize_admission().admit_now(1).unwrap();
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(pick.decision().miss(), Some(MissReason::TokenizeOverloaded));
    let s = r.tokenize_counters();
    assert_eq!((s.admitted_after_wait, s.overloaded), (0, 1));
}

/// A small body (≤ `INLINE_PREPARE_BYTES`) with a free slot is prepared on
/// the calling task: the pick is ready at its first poll, with no hand-off
/// to the blocking pool. A larger one goes to the pool (pending at first).
#[tokio::test(flavor = "current_thread")]
async fn a_small_body_is_prepared_inline_and_a_large_one_on_the_pool() {
    let r = router(TokenizeOverload::Wait, Duration::from_secs(60));
    let small = chat("inline", false);
    assert!(small.len() <= kvroute::prompt::INLINE_PREPARE_BYTES);
    // Large enough that its tokenization (tens of ms) cannot finish on the
    // blocking pool before the first poll, even on a busy machine.
    let long = "the committee discusses the budget at length ".repeat(20_000);
    let large = bytes::Bytes::from(
        serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": long}]})
            .to_string(),
    );
    assert!(large.len() > kvroute::prompt::INLINE_PREPARE_BYTES);
    for (body, inline) in [(&small, true), (&large, false)] {
        let mut pick = std::pin::pin!(r.pick(ApiKind::Chat, body));
        let ready = std::future::poll_fn(|cx| Poll::Ready(pick.as_mut().poll(cx).is_ready())).await;
        assert_eq!(ready, inline, "{} bytes", body.len());
        if !ready {
            let p = pick.await.unwrap();
            assert!(p.decision().miss().is_some(), "no engine holds blocks");
        }
    }
    let s = r.tokenize_counters();
    assert_eq!((s.admitted, s.overloaded, s.in_flight), (2, 0, 0));
}

/// A small body whose chat template makes it a long prompt (one that
/// pretty-prints a deeply nested tool schema writes hundreds of bytes per
/// byte of it) is not tokenized on the calling task: past
/// `INLINE_PROMPT_CHARS` it goes to the blocking pool under the permit it
/// took, and is tokenized there in full.
#[tokio::test(flavor = "current_thread")]
async fn a_small_body_that_renders_a_long_prompt_goes_to_the_pool() {
    let staged = std::env::temp_dir().join(format!("kvroute-inline-bound-{}", std::process::id()));
    std::fs::create_dir_all(&staged).unwrap();
    for f in ["tokenizer.json.gz", "tokenizer_config.json"] {
        std::fs::copy(model_dir().join(f), staged.join(f)).unwrap();
    }
    std::fs::write(
        staged.join("chat_template.jinja"),
        "{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}\
         {% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let r = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, &staged)
        .endpoint(Backend::vllm(format!("http://127.0.0.1:{}", closed_port())))
        .spawn()
        .unwrap();
    let depth = 40;
    let nested = format!(
        "{}{}{}",
        "[".repeat(depth),
        vec!["0"; 400].join(","),
        "]".repeat(depth)
    );
    let body = bytes::Bytes::from(format!(
        r#"{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}],
            "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {{"a": {nested}}}}}}}]}}"#
    ));
    assert!(body.len() <= kvroute::prompt::INLINE_PREPARE_BYTES);
    let mut pick = std::pin::pin!(r.pick(ApiKind::Chat, &body));
    let first = std::future::poll_fn(|cx| Poll::Ready(pick.as_mut().poll(cx))).await;
    if let Poll::Ready(p) = first {
        let d = p.unwrap().decision().clone();
        panic!(
            "prepared on the calling task: {:?}, {} tokens",
            d.miss(),
            d.prompt_tokens()
        );
    }
    let p = pick.await.unwrap();
    // Tokenized in full, not refused as too long.
    assert_ne!(p.decision().miss(), Some(MissReason::PromptTooLong));
    assert!(p.decision().prompt_tokens() > 1_000);
    let s = r.tokenize_counters();
    assert_eq!((s.admitted, s.in_flight), (1, 0));
    let _ = std::fs::remove_dir_all(&staged);
}
