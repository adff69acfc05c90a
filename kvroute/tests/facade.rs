//! The facade against real engines (vLLM 0.33.0's own KV-cache code in
//! `tests/python/vllm_standin.py`): decisions follow the engines' events,
//! receipts come from their `usage`, load charges end with the body, retries
//! exclude the failed endpoint, endpoints come and go at run time.

use kvroute_testkit as support;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use kvroute::{ApiKind, Backend, Change, KvRouter, Pick};
use kvroute_select::Source;
use support::*;

fn router(backends: Vec<Backend>) -> KvRouter {
    let mut b = KvRouter::builder(CONTRACT.parse().unwrap()).model(MODEL, model_dir());
    for be in backends {
        b = b.endpoint(be);
    }
    b.spawn().unwrap()
}

/// Sends `body` to the pick's endpoint and reads the answer through the
/// receipt body; returns (the engine's cached tokens as the receipt saw them,
/// the response JSON or SSE text).
async fn forward(pick: Pick, path: &str, body: &Bytes) -> (Option<u32>, Bytes) {
    let req = http::Request::post(format!("{}{path}", pick.url()))
        .header("content-type", "application/json")
        .body(Full::new(pick.upstream_body(body)))
        .unwrap();
    let resp = client().request(req).await.expect("engine answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    let (head, incoming) = resp.into_parts();
    let (tx, rx) = std::sync::mpsc::channel();
    let body = pick.into_body_with(&head.headers, incoming, move |r| {
        tx.send(r).unwrap();
    });
    let bytes = read_all(body).await;
    let receipt = rx.recv().unwrap();
    assert!(receipt.complete);
    (receipt.cached_tokens, bytes)
}

fn json_cached(bytes: &Bytes) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
    kvroute::receipt::cached_tokens(&v)
}

/// The same chat twice: the second goes where the first left its blocks, as
/// a KV-exact hit, and the engine's receipt shows the cached tokens the
/// decision predicted (the engine reuses full blocks up to `num_tokens - 1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_chat_goes_where_its_blocks_are_and_the_receipt_confirms_it() {
    let engines = [Standin::start(), Standin::start()];
    let r = router(engines.iter().map(Standin::backend).collect());
    let body = chat("routing", false);

    let first = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert!(
        matches!(first.decision().source(), Source::Fallback(_)),
        "nothing cached yet"
    );
    let url = first.url().to_owned();
    let (cached, answer) = forward(first, "/v1/chat/completions", &body).await;
    assert_eq!(cached, json_cached(&answer));
    assert_eq!(cached, Some(0));
    wait_until("the engine's BlockStored", || r.blocks(&url) > 0).await;

    let second = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(second.url(), url);
    assert_eq!(second.decision().source(), Source::KvExact);
    let predicted = second.decision().predicted_cached_tokens(r.block_size());
    assert!(predicted >= 16, "{predicted}");
    let slot = second.endpoint_id().unwrap().index();
    let (cached, answer) = forward(second, "/v1/chat/completions", &body).await;
    assert_eq!(cached, json_cached(&answer));
    assert_eq!(cached, Some(predicted));
    let c = r.counters();
    assert_eq!(c.endpoints[slot].receipts, 2);
    assert_eq!(c.endpoints[slot].delivered_tokens, u64::from(predicted));
    assert_eq!(r.in_flight(&url), 0);
}

/// A streamed request: the facade adds `stream_options.include_usage`, so the
/// SSE stream carries usage and the receipt is read from it; with the option
/// turned off the stream has no usage and the receipt is honestly `None`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_receipts_with_and_without_usage() {
    let engine = Standin::start();
    let body = chat("streams", true);
    let r = router(vec![engine.backend()]);
    let first = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_ne!(first.upstream_body(&body), body, "include_usage was added");
    let (cached, sse) = forward(first, "/v1/chat/completions", &body).await;
    assert!(sse.starts_with(b"data: "), "{sse:?}");
    assert_eq!(cached, Some(0));
    wait_until("blocks", || r.blocks(&engine.url()) > 0).await;
    let second = r.pick(ApiKind::Chat, &body).await.unwrap();
    let predicted = second.decision().predicted_cached_tokens(r.block_size());
    let (cached, _) = forward(second, "/v1/chat/completions", &body).await;
    assert_eq!(cached, Some(predicted));
    assert!(predicted > 0);

    let quiet = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(Backend::vllm(engine.url()))
        .include_usage(false)
        .spawn()
        .unwrap();
    let pick = quiet.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(pick.upstream_body(&body), body);
    let (cached, sse) = forward(pick, "/v1/chat/completions", &body).await;
    assert!(sse.ends_with(b"data: [DONE]\n\n"), "{sse:?}");
    assert_eq!(cached, None);
}

/// A body that sends one chunk and then never ends (a long stream the client
/// abandons).
struct Endless(Option<Bytes>);

impl Body for Endless {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.0.take() {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
            None => Poll::Pending,
        }
    }
}

/// The load charge lives from the decision until the response body ends or
/// is dropped: a client that disconnects mid-stream releases it, and no
/// receipt is recorded for a body that never ended. Endpoints without events
/// need no engine: the decision is the fallback's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_releases_the_load_charge() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let r = router(vec![Backend::vllm(url.clone())]);
    let pick = r.pick(ApiKind::Chat, &chat("x", true)).await.unwrap();
    assert_eq!(r.in_flight(&url), 1, "charged at the decision");
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "text/event-stream".parse().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let mut body = pick.into_body_with(
        &headers,
        Endless(Some(Bytes::from_static(b"data: {\"choices\":[]}\n\n"))),
        move |r| tx.send(r).unwrap(),
    );
    let frame = body.frame().await.unwrap().unwrap();
    assert!(frame.is_data());
    assert_eq!(r.in_flight(&url), 1, "still streaming");
    drop(body); // the client went away
    assert_eq!(r.in_flight(&url), 0);
    let receipt = rx.recv().unwrap();
    assert!(!receipt.complete);
    assert_eq!(receipt.cached_tokens, None);
    assert_eq!(r.counters().endpoints[0].receipts, 0);
}

/// A connect failure: `retry` excludes the failed endpoint, moves the load
/// charge to the next one, and gives up (releasing the charge) when none is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_moves_to_the_next_endpoint_and_gives_up_when_none_is_left() {
    let urls: Vec<String> = (0..2)
        .map(|_| format!("http://127.0.0.1:{}", closed_port()))
        .collect();
    let r = router(urls.iter().map(|u| Backend::vllm(u.clone())).collect());
    let mut pick = r.pick(ApiKind::Chat, &chat("x", false)).await.unwrap();
    let first = pick.url().to_owned();
    assert_eq!(r.in_flight(&first), 1);
    let next = pick.retry().expect("another endpoint").to_owned();
    assert_ne!(next, first);
    assert_eq!((r.in_flight(&first), r.in_flight(&next)), (0, 1));
    assert!(pick.decision().is_excluded(r.endpoint_id(&first).unwrap()));
    assert_eq!(pick.retry(), None, "both failed");
    assert_eq!((r.in_flight(&first), r.in_flight(&next)), (0, 0));
    // Both retry calls count, the one that found nothing too.
    assert_eq!(r.counters().retries, 2);
}

/// Endpoints change at run time as changes, not a rebuild: an added engine's
/// subscriber starts and its inventory fills; a removed one is never picked
/// again and its inventory is forgotten; its slot is reused by the next
/// insert, which starts empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_are_added_and_removed_at_run_time() {
    let a = Standin::start();
    let b = Standin::start();
    let r = router(vec![a.backend()]);
    let body = chat("membership", false);
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(pick.url(), a.url());
    let _ = forward(pick, "/v1/chat/completions", &body).await;
    wait_until("a's blocks", || r.blocks(&a.url()) > 0).await;

    r.apply(Change::Insert(b.backend())).unwrap();
    assert_eq!(r.endpoints(), vec![a.url(), b.url()]);
    assert!(
        r.apply(Change::Insert(b.backend())).is_err(),
        "duplicate URL"
    );
    // a's inventory survived the change: the repeat is still a hit there.
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(
        (pick.url(), pick.decision().source()),
        (a.url().as_str(), Source::KvExact)
    );
    drop(pick);
    // b's subscriber is live: a prompt sent to b is stored in b's inventory.
    let other = chat("something else entirely", false);
    let req = http::Request::post(format!("{}/v1/chat/completions", b.url()))
        .header("content-type", "application/json")
        .body(Full::new(other.clone()))
        .unwrap();
    let _ = read_all(client().request(req).await.unwrap().into_body()).await;
    wait_until("b's blocks", || r.blocks(&b.url()) > 0).await;
    let pick = r.pick(ApiKind::Chat, &other).await.unwrap();
    assert_eq!(
        (pick.url(), pick.decision().source()),
        (b.url().as_str(), Source::KvExact)
    );
    drop(pick);

    r.apply(Change::Remove(a.url())).unwrap();
    assert_eq!(r.endpoints(), vec![b.url()]);
    assert_eq!(r.blocks(&a.url()), 0);
    for _ in 0..4 {
        let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
        assert_eq!(pick.url(), b.url(), "a removed endpoint is never picked");
    }
    assert!(r.apply(Change::Remove(a.url())).is_err(), "not present");
    // The freed slot 0 is reused, empty.
    let c = Standin::start();
    r.apply(Change::Insert(c.backend())).unwrap();
    assert_eq!(r.endpoint_id(&c.url()).map(|i| i.index()), Some(0));
    assert_eq!(r.blocks(&c.url()), 0);
}

/// Everything prompt-side is derived from the contract: a re-key contract
/// routes engines whose keys it does not reproduce, from the tokens their
/// events carry (the stand-in hashes with sha256_cbor; the router keys with
/// xxh3 on both sides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rekey_contract_routes_from_the_events_tokens() {
    let engine = Standin::start();
    let r = KvRouter::builder("rekey:xxh3_64_chain:block=16:seed=1337".parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(engine.backend())
        .endpoint(Backend::vllm(format!("http://127.0.0.1:{}", closed_port())))
        .spawn()
        .unwrap();
    let body = chat("rekeying", false);
    let mut pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    if pick.url() != engine.url() {
        pick.retry().unwrap();
    }
    let _ = forward(pick, "/v1/chat/completions", &body).await;
    wait_until("re-keyed blocks", || r.blocks(&engine.url()) > 0).await;
    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    assert_eq!(
        (pick.url(), pick.decision().source()),
        (engine.url().as_str(), Source::KvExact)
    );
    let predicted = pick.decision().predicted_cached_tokens(r.block_size());
    let (cached, _) = forward(pick, "/v1/chat/completions", &body).await;
    assert_eq!(cached, Some(predicted));
}

/// A LoRA adapter requested by its own name tokenizes as the router's model
/// and hashes with the adapter: the keys equal vLLM's own for the same ids
/// and adapter (the golden vector its hashing code produced).
#[tokio::test]
async fn a_lora_adapter_tokenizes_as_its_base_and_hashes_as_vllm() {
    let golden = model_dir().join("../../vllm/hash_vectors_v0.33.0.json");
    let vectors: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden).unwrap()).unwrap();
    let case = vectors["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "sha256_cbor-bs16-seed0-lora")
        .unwrap();
    let adapter = kvroute_core::LoraAdapter {
        name: case["lora"]["name"].as_str().unwrap().to_owned(),
        path: case["lora"]["path"].as_str().unwrap().to_owned(),
    };
    let r = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .lora(adapter.name.clone(), adapter)
        .endpoint(Backend::vllm("http://127.0.0.1:9"))
        .build()
        .unwrap();
    let body = serde_json::json!({"model": "sql-lora", "prompt": case["token_ids"]});
    let prepared = r
        .prepare(ApiKind::Completions, &Bytes::from(body.to_string()))
        .await;
    let keys: Vec<u64> = prepared.keys().unwrap().0.iter().map(|k| k.0).collect();
    let expected: Vec<u64> = case["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["event_key_u64"].as_u64().unwrap())
        .collect();
    assert_eq!(keys, expected);
}

/// A model's `max_model_len` given to the router (the engines run with
/// `--max-model-len`; the staged directory has no `config.json`):
/// `truncate_prompt_tokens: -1` keeps one token less (room for the first
/// generated one), as vLLM does, and a longer prompt is not KV-routed.
/// Without it nothing is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_max_model_len_truncates_and_bounds_its_prompts() {
    use kvroute::prompt::ModelOptions;
    let build = |options: ModelOptions| {
        KvRouter::builder(CONTRACT.parse().unwrap())
            .model_with(MODEL, model_dir(), options)
            .endpoint(Backend::vllm("http://127.0.0.1:9"))
            .build()
            .unwrap()
    };
    let long: String = (0..200).map(|i| format!("word{i} ")).collect();
    let body = |truncate: Option<i64>| {
        let mut b = serde_json::json!({"model": MODEL, "prompt": long});
        if let Some(t) = truncate {
            b["truncate_prompt_tokens"] = t.into();
        }
        Bytes::from(b.to_string())
    };
    let plain = build(ModelOptions::default());
    let all = plain.prepare(ApiKind::Completions, &body(Some(-1))).await;
    let n = all.tokens().unwrap().len();
    assert!(n > 64 && !all.truncated(), "{n} tokens");

    let bounded = build(ModelOptions {
        max_model_len: Some(64),
        ..ModelOptions::default()
    });
    let cut = bounded.prepare(ApiKind::Completions, &body(Some(-1))).await;
    assert_eq!(cut.tokens().unwrap(), &all.tokens().unwrap()[n - 63..]);
    assert!(cut.truncated());
    let too_long = bounded.prepare(ApiKind::Completions, &body(None)).await;
    // The engine refuses it with 400: a client error, not KV-routed.
    assert_eq!(
        too_long.tokens(),
        Err(kvroute_select::MissReason::InvalidRequest)
    );
}
