//! The push-style receipt ([`ReceiptTracker`]) as a pingora or callback host
//! drives it: chunks in, end or drop. Against a real load tracker, then
//! against a real vLLM stand-in through the facade, whose streamed answer is
//! handed to the tracker chunk by chunk as it arrives from the socket.

use kvroute_testkit as support;

use std::sync::{mpsc, Arc};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute::receipt::{BodyKind, Receipt, ReceiptBody, ReceiptTracker};
use kvroute::{ApiKind, KvRouter};
use kvroute_core::EndpointId;
use kvroute_select::{Load, LoadTracker, Target};
use support::*;

const USAGE: &str = r#"{"id":"x","choices":[],"usage":{"prompt_tokens":48,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#;

/// A tracker charged 100 prefill tokens on endpoint 0 of `load`; the channel
/// gets every completion it runs.
fn tracker(load: &Arc<LoadTracker>, kind: BodyKind) -> (ReceiptTracker, mpsc::Receiver<Receipt>) {
    let guard = load.charge(
        Target {
            endpoint: EndpointId(0),
            decode: None,
        },
        100,
    );
    let (tx, rx) = mpsc::channel();
    let t = ReceiptTracker::new(kind, Some(guard), Box::new(move |r| tx.send(r).unwrap()));
    (t, rx)
}

/// (in flight, prefill tokens still charged) on endpoint 0.
fn charged(load: &LoadTracker) -> (u32, u64) {
    let l = load.load(EndpointId(0));
    (l.in_flight, l.queued_prefill_tokens)
}

/// The single completion a tracker ran (a second one would be a bug).
fn only(rx: &mpsc::Receiver<Receipt>) -> Receipt {
    let r = rx.try_recv().expect("the completion ran");
    assert!(rx.try_recv().is_err(), "the completion ran once");
    r
}

/// Hosts keep the tracker in per-request state shared across threads
/// (pingora's `CTX: Send + Sync`).
#[test]
fn the_tracker_can_live_in_a_hosts_request_context() {
    fn shareable<T: Send + Sync>() {}
    shareable::<ReceiptTracker>();
    shareable::<ReceiptBody<Full<Bytes>>>();
}

fn sse(events: &[&str]) -> Vec<u8> {
    events
        .iter()
        .flat_map(|e| format!("data: {e}\n\n").into_bytes())
        .collect()
}

/// Feeds `body` in chunks of `step` bytes, then ends.
fn drive(t: &mut ReceiptTracker, body: &[u8], step: usize) {
    for chunk in body.chunks(step) {
        t.on_chunk(chunk);
    }
    t.on_end();
}

#[test]
fn a_json_answer_gives_its_receipt_at_the_end_and_releases_the_charge() {
    let load = Arc::new(LoadTracker::new(1));
    let (mut t, rx) = tracker(&load, BodyKind::Json);
    assert_eq!(charged(&load), (1, 100));
    t.on_chunk(b"");
    assert_eq!(charged(&load), (1, 100), "an empty chunk is no first byte");
    let (a, b) = USAGE.as_bytes().split_at(30);
    t.on_chunk(a);
    assert_eq!(
        charged(&load),
        (1, 0),
        "the first byte ends the prefill charge"
    );
    t.on_chunk(b);
    assert!(rx.try_recv().is_err(), "nothing before the end");
    t.on_end();
    assert_eq!(
        only(&rx),
        Receipt {
            cached_tokens: Some(32),
            prompt_tokens: Some(48),
            complete: true
        }
    );
    assert_eq!(
        charged(&load),
        (0, 0),
        "released at the end, before the drop"
    );
    assert!(t.is_ended());
    t.on_chunk(USAGE.as_bytes());
    t.on_end();
    t.on_error();
    drop(t);
    assert!(
        rx.try_recv().is_err(),
        "later calls and the drop do nothing"
    );
    assert_eq!(charged(&load), (0, 0));
}

#[test]
fn an_sse_stream_with_usage_gives_the_last_usage_event_whatever_the_chunking() {
    let body = sse(&[
        r#"{"choices":[{"delta":{"content":"usage"}}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":16}}}"#,
        USAGE,
        "[DONE]",
    ]);
    let load = Arc::new(LoadTracker::new(1));
    for step in [1, 2, 7, 64, body.len()] {
        let (mut t, rx) = tracker(&load, BodyKind::Sse);
        drive(&mut t, &body, step);
        assert_eq!(
            only(&rx),
            Receipt {
                cached_tokens: Some(32),
                prompt_tokens: Some(48),
                complete: true
            },
            "step {step}"
        );
        assert_eq!(charged(&load), (0, 0));
    }
}

#[test]
fn a_stream_or_answer_without_usage_ends_with_no_receipt() {
    let load = Arc::new(LoadTracker::new(1));
    let stream = sse(&[r#"{"choices":[{"delta":{"content":"hi"}}]}"#, "[DONE]"]);
    let answer = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":48}}"#;
    for (kind, body) in [
        (BodyKind::Sse, &stream[..]),
        (BodyKind::Json, &answer[..]),
        (BodyKind::Json, &b""[..]),
    ] {
        let (mut t, rx) = tracker(&load, kind);
        drive(&mut t, body, 5);
        assert_eq!(
            only(&rx),
            Receipt {
                cached_tokens: None,
                prompt_tokens: None,
                complete: true
            }
        );
        assert_eq!(charged(&load), (0, 0));
    }
}

/// A client that goes away: the host drops the tracker (pingora drops the
/// request context) before the end. The usage already seen is not a
/// receipt, and the charge ends all the same; an upstream error likewise.
#[test]
fn a_disconnect_or_an_error_before_the_end_records_nothing_and_releases_the_charge() {
    let load = Arc::new(LoadTracker::new(1));
    let (mut t, rx) = tracker(&load, BodyKind::Sse);
    t.on_chunk(&sse(&[USAGE]));
    assert_eq!(charged(&load), (1, 0));
    drop(t);
    assert_eq!(
        only(&rx),
        Receipt {
            cached_tokens: None,
            prompt_tokens: None,
            complete: false
        }
    );
    assert_eq!(charged(&load), (0, 0));

    let (t, rx) = tracker(&load, BodyKind::Json);
    drop(t);
    assert_eq!(
        only(&rx),
        Receipt {
            cached_tokens: None,
            prompt_tokens: None,
            complete: false
        }
    );
    assert_eq!(charged(&load), (0, 0), "also before any byte");

    let (mut t, rx) = tracker(&load, BodyKind::Json);
    t.on_chunk(USAGE.as_bytes());
    t.on_error();
    assert_eq!(
        only(&rx),
        Receipt {
            cached_tokens: None,
            prompt_tokens: None,
            complete: false
        }
    );
    assert_eq!(charged(&load), (0, 0));
    t.on_end();
    drop(t);
    assert!(rx.try_recv().is_err());
}

/// `ReceiptBody` is the tracker driven by a body: the same receipt for the
/// same bytes.
#[tokio::test]
async fn the_body_wrapper_and_the_tracker_agree() {
    let load = Arc::new(LoadTracker::new(1));
    for (kind, body) in [
        (BodyKind::Sse, sse(&[r#"{"choices":[]}"#, USAGE, "[DONE]"])),
        (BodyKind::Json, USAGE.as_bytes().to_vec()),
        (BodyKind::Sse, sse(&["[DONE]"])),
    ] {
        let (mut t, pushed) = tracker(&load, kind);
        drive(&mut t, &body, 3);
        let (t, polled) = tracker(&load, kind);
        let wrapped: ReceiptBody<_> = t.body(Full::new(Bytes::from(body.clone())));
        let out = wrapped.collect().await.unwrap().to_bytes();
        assert_eq!(out, body, "the body passes through untouched");
        assert_eq!(only(&pushed), only(&polled));
        assert_eq!(charged(&load), (0, 0));
    }
}

/// Reads a response body frame by frame into `receipt`, as a push-style
/// host's callback sees it; stops after `limit` frames (`None`: to the end).
async fn push<B>(mut body: B, receipt: &mut ReceiptTracker, limit: Option<usize>) -> Vec<u8>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let mut all = Vec::new();
    let mut frames = 0;
    // Ends: the body ends, or `limit` frames were read.
    while limit.is_none_or(|l| frames < l) {
        let Some(frame) = body.frame().await else {
            receipt.on_end();
            break;
        };
        if let Some(data) = frame.expect("frame").data_ref() {
            receipt.on_chunk(data);
            all.extend_from_slice(data);
        }
        frames += 1;
    }
    all
}

async fn send(pick: &kvroute::Pick, body: &Bytes) -> http::Response<hyper::body::Incoming> {
    let req = http::Request::post(format!("{}/v1/chat/completions", pick.url()))
        .header("content-type", "application/json")
        .body(Full::new(pick.upstream_body(body)))
        .unwrap();
    let resp = client().request(req).await.expect("engine answers");
    assert!(resp.status().is_success(), "{}", resp.status());
    resp
}

/// The facade's `Pick::into_receipt` against a real engine: a streamed chat
/// (usage there because the facade added `include_usage`) pushed through the
/// tracker records the engine's own `cached_tokens` and ends the charge; a
/// second stream abandoned after its first chunk records nothing and ends
/// the charge too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_becomes_a_tracker_that_records_the_engines_receipt() {
    let engine = Standin::start();
    let r = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .endpoint(engine.backend())
        .spawn()
        .unwrap();
    let url = engine.url();
    let body = chat("push-style hosts", true);

    let warm = r.pick(ApiKind::Chat, &body).await.unwrap();
    let resp = send(&warm, &body).await;
    let mut t = warm.into_receipt(resp.headers());
    push(resp.into_body(), &mut t, None).await;
    drop(t);
    wait_until("the engine's blocks", || r.blocks(&url) > 0).await;

    let pick = r.pick(ApiKind::Chat, &body).await.unwrap();
    let predicted = pick.decision().predicted_cached_tokens(r.block_size());
    assert!(predicted >= 16, "{predicted}");
    let resp = send(&pick, &body).await;
    assert_eq!(BodyKind::of(resp.headers()), BodyKind::Sse);
    assert_eq!(r.in_flight(&url), 1);
    let (tx, rx) = mpsc::channel();
    let mut t = pick.into_receipt_with(resp.headers(), move |rc| tx.send(rc).unwrap());
    let before = r.counters().endpoints[0].receipts;
    let stream = push(resp.into_body(), &mut t, None).await;
    let seen = only(&rx);
    // The engine's own words, read independently of the scanner.
    let usage = String::from_utf8_lossy(&stream)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| kvroute::receipt::cached_tokens(v).is_some())
        .expect("a usage event");
    let sent = kvroute::receipt::cached_tokens(&usage);
    assert_eq!(sent, Some(predicted));
    assert_eq!(
        seen,
        Receipt {
            cached_tokens: Some(predicted),
            prompt_tokens: kvroute::receipt::prompt_tokens(&usage),
            complete: true
        }
    );
    assert!(seen.prompt_tokens.is_some());
    let c = r.counters();
    assert_eq!(c.endpoints[0].receipts, before + 1);
    assert_eq!(
        r.in_flight(&url),
        0,
        "released at the end, the tracker still alive"
    );
    drop(t);

    let mut v: serde_json::Value =
        serde_json::from_slice(&chat("an abandoned stream", true)).unwrap();
    v["max_tokens"] = 3000.into();
    let long = Bytes::from(v.to_string());
    let pick = r.pick(ApiKind::Chat, &long).await.unwrap();
    let resp = send(&pick, &long).await;
    let mut t = pick.into_receipt(resp.headers());
    let first = push(resp.into_body(), &mut t, Some(1)).await;
    assert!(first.starts_with(b"data: "), "the stream started");
    assert_eq!(r.in_flight(&url), 1, "still streaming");
    drop(t);
    assert_eq!(r.in_flight(&url), 0);
    assert_eq!(
        r.counters().endpoints[0].receipts,
        before + 1,
        "no receipt for it"
    );
}

/// A body already at its end (a HEAD answer, a 204 or 304, an empty body
/// with `content-length: 0`) is never polled by a server, only dropped: its
/// request ends complete when the body is built, not as a broken stream.
#[test]
fn a_body_already_at_its_end_completes_without_being_polled() {
    let load = Arc::new(LoadTracker::new(1));
    let (t, rx) = tracker(&load, BodyKind::Json);
    let body = t.body(Full::new(Bytes::new()));
    assert_eq!(charged(&load), (0, 0));
    drop(body);
    let r = only(&rx);
    assert!(r.complete, "{r:?}");
    // A body with something in it still ends only when it is read.
    let (t, rx) = tracker(&load, BodyKind::Json);
    let body = t.body(Full::new(Bytes::from_static(USAGE.as_bytes())));
    assert_eq!(charged(&load), (1, 100));
    drop(body);
    assert!(!only(&rx).complete);
}
