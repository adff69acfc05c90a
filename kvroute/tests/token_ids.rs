//! Token-id forwarding ("tokenize once"): the body rewrite against a
//! reference model on random bodies, and the facade against the vLLM
//! stand-in (`tests/python/vllm_standin.py`: vLLM 0.33.0's block hasher and
//! pool behind its OpenAI schema), which reports the form a completions
//! `prompt` arrived in and the ids it ran.

use kvroute_testkit as support;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute::engine::{Engine, SGLANG, TRTLLM, VLLM};
use kvroute::prompt::{with_token_ids, IdsBody, KeepText};
use kvroute::{ApiKind, Backend, KvRouter, Pick};
use kvroute_engines::prompt::parse_json;
use kvroute_select::Source;
use proptest::prelude::*;
use serde_json::{json, Value};
use support::*;

// ---------------------------------------------------------------------------
// The rewrite vs a reference model.

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|i| json!(i)),
        (-1e9f64..1e9).prop_map(|f| json!(f)),
        "[a-z \"\\\\é\u{1F600}\n]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A random body: fields other than `prompt` (nested ones may be called
/// `prompt`), the string `prompt` at a random position, serialized compactly
/// or with whitespace.
fn body() -> impl Strategy<Value = (Vec<u8>, Value)> {
    (
        prop::collection::vec(("[a-z_]{1,10}", json_value()), 0..6),
        "[a-zA-Z0-9 \"\\\\\u{4E2D}\n]{1,40}",
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(|(fields, prompt, at, pretty)| {
            let mut fields: Vec<(String, Value)> =
                fields.into_iter().filter(|(k, _)| k != "prompt").collect();
            fields.dedup_by(|a, b| a.0 == b.0);
            let mut seen = std::collections::HashSet::new();
            fields.retain(|(k, _)| seen.insert(k.clone()));
            let i = at.index(fields.len() + 1);
            fields.insert(i, ("prompt".into(), Value::String(prompt)));
            let v = Value::Object(fields.into_iter().collect());
            let bytes = if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            };
            (bytes, v)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// `prompt` becomes exactly the ids; every other field, and the key
    /// order, are the same values; and the bytes around the `prompt` value
    /// are the client's own.
    #[test]
    fn prompt_is_replaced_by_the_ids_and_nothing_else_changes(
        (bytes, v) in body(),
        ids in prop::collection::vec(any::<u32>(), 1..64),
    ) {
        let out = with_token_ids(&bytes, &ids).expect("a strict JSON object with one prompt");
        let got: Value = serde_json::from_slice(&out).unwrap();
        // The reference parses the client's bytes the same way (floats
        // included) and replaces one field.
        let mut want: Value = serde_json::from_slice(&bytes).unwrap();
        prop_assert_eq!(&want["prompt"], &v["prompt"]);
        want["prompt"] = json!(ids);
        prop_assert_eq!(&got, &want);
        let got_keys: Vec<&String> = got.as_object().unwrap().keys().collect();
        let want_keys: Vec<&String> = want.as_object().unwrap().keys().collect();
        prop_assert_eq!(got_keys, want_keys);
        // Outside the value: byte for byte. The two bodies agree up to the
        // value's first byte (`[` against the string's `"`), then the ids,
        // then the client's bytes again; what they replaced is the prompt.
        let ids_text = serde_json::to_string(&ids).unwrap();
        let start = out.iter().zip(&bytes).take_while(|(a, b)| a == b).count();
        prop_assert_eq!(&out[start..start + ids_text.len()], ids_text.as_bytes());
        let tail = out.len() - start - ids_text.len();
        prop_assert_eq!(&out[start + ids_text.len()..], &bytes[bytes.len() - tail..]);
        let replaced: Value = serde_json::from_slice(&bytes[start..bytes.len() - tail]).unwrap();
        prop_assert_eq!(&replaced, &v["prompt"]);
    }

    /// Bodies the rewrite cannot do exactly are left alone, never guessed.
    #[test]
    fn a_second_prompt_or_no_object_is_refused((bytes, _v) in body(), ids in prop::collection::vec(any::<u32>(), 1..8)) {
        let mut twice = bytes.clone();
        let close = twice.iter().rposition(|&b| b == b'}').unwrap();
        twice.splice(close..close, br#","prompt":"again""#.iter().copied());
        prop_assert_eq!(with_token_ids(&twice, &ids), None);
        let list = [b"[".as_slice(), &bytes, b"]"].concat();
        prop_assert_eq!(with_token_ids(&list, &ids), None);
    }
}

#[test]
fn escaped_keys_and_python_only_json() {
    // `\u0070rompt` is `prompt` to the engine's json.loads too.
    let out = with_token_ids(br#"{"\u0070rompt": "hi", "n": 1}"#, &[7, 8]).unwrap();
    assert_eq!(out, br#"{"\u0070rompt": [7,8], "n": 1}"#.to_vec());
    // A nested `prompt` is not the request's.
    let out = with_token_ids(br#"{"x": {"prompt": "a"}, "prompt": "b"}"#, &[1]).unwrap();
    assert_eq!(out, br#"{"x": {"prompt": "a"}, "prompt": [1]}"#.to_vec());
    // NaN is JSON to Python, not to a strict parser: kept as text.
    assert_eq!(with_token_ids(br#"{"prompt": "a", "t": NaN}"#, &[1]), None);
}

/// The built-in engines a pool may run.
fn engines() -> Vec<std::sync::Arc<dyn Engine>> {
    ["vllm", "sglang", "trtllm"]
        .iter()
        .map(|n| kvroute::engine::by_name(n).unwrap())
        .collect()
}

#[test]
fn each_reason_keeps_the_text() {
    let ids = [1u32, 2, 3];
    type Case<'a> = (&'a str, ApiKind, &'a dyn Engine, Result<(), KeepText>);
    let cases: [Case<'_>; 12] = [
        (
            r#"{"model":"m","prompt":"x"}"#,
            ApiKind::Completions,
            &VLLM,
            Ok(()),
        ),
        (
            r#"{"model":"m","prompt":"x","add_special_tokens":false}"#,
            ApiKind::Completions,
            &VLLM,
            Ok(()),
        ),
        (
            r#"{"model":"m","prompt":"x","echo":false,"suffix":null}"#,
            ApiKind::Completions,
            &SGLANG,
            Ok(()),
        ),
        (
            r#"{"model":"m","messages":[]}"#,
            ApiKind::Chat,
            &VLLM,
            Err(KeepText::Chat),
        ),
        (
            r#"{"model":"m","prompt":[1,2]}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::PromptNotText),
        ),
        (
            r#"{"model":"m","prompt":["a","b"]}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::PromptNotText),
        ),
        (
            r#"{"model":"m","prompt":"x","echo":true}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::Echo),
        ),
        (
            r#"{"model":"m","prompt":"x","suffix":"y"}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::Suffix),
        ),
        (
            r#"{"model":"m","prompt":"x","truncate_prompt_tokens":8}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::Truncation),
        ),
        (
            r#"{"model":"m","prompt":"x","return_token_offsets":true}"#,
            ApiKind::Completions,
            &VLLM,
            Err(KeepText::TokenOffsets),
        ),
        (
            r#"{"model":"m","prompt":"x","add_special_tokens":true}"#,
            ApiKind::Completions,
            &SGLANG,
            Err(KeepText::AddSpecialTokens),
        ),
        (
            r#"{"model":"m","prompt":"x"}"#,
            ApiKind::Completions,
            &TRTLLM,
            Err(KeepText::Engine),
        ),
    ];
    for (body, api, engine, want) in cases {
        let value = parse_json(body.as_bytes()).unwrap();
        let p = IdsBody::prepare(api, body.as_bytes(), &value, Some(&ids), false, &engines());
        let got = p.for_engine(engine).map(|b| {
            let v: Value = serde_json::from_slice(b).unwrap();
            assert_eq!(v["prompt"], json!(ids), "{body}");
        });
        assert_eq!(got, want, "{body} on {}", engine.name());
    }
    let plain = br#"{"model":"m","prompt":"x"}"#;
    let value = parse_json(plain).unwrap();
    let truncated = IdsBody::prepare(
        ApiKind::Completions,
        plain,
        &value,
        Some(&ids),
        true,
        &engines(),
    );
    assert_eq!(
        truncated.for_engine(&VLLM).unwrap_err(),
        KeepText::Truncation
    );
    let missed = IdsBody::prepare(ApiKind::Completions, plain, &value, None, false, &engines());
    assert_eq!(missed.for_engine(&VLLM).unwrap_err(), KeepText::NoTokens);
}

// ---------------------------------------------------------------------------
// The facade against the vLLM stand-in.

fn router(forward: bool, backends: Vec<Backend>) -> KvRouter {
    let mut b = KvRouter::builder(CONTRACT.parse().unwrap())
        .model(MODEL, model_dir())
        .forward_token_ids(forward);
    for be in backends {
        b = b.endpoint(be);
    }
    b.spawn().unwrap()
}

async fn post_json(url: String, body: Bytes) -> Value {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = client().request(req).await.expect("engine answers");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(status.is_success(), "{status}: {bytes:?}");
    serde_json::from_slice(&bytes).unwrap()
}

async fn get_json(url: String) -> Value {
    let resp = client().get(url.parse().unwrap()).await.unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

/// Sends the pick's upstream body; returns the receipt's cached tokens.
async fn forward(pick: Pick, path: &str, body: &Bytes) -> Option<u32> {
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
    let _ = read_all(body).await;
    rx.recv().unwrap().cached_tokens
}

fn completion(text: &str, extra: Value) -> Bytes {
    let mut v = json!({"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0.0});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    Bytes::from(serde_json::to_vec(&v).unwrap())
}

/// With forwarding on, the engine receives the ids — exactly the ones its
/// own `/tokenize` gives for the text — runs them as a KV hit of the
/// predicted size on the repeat, and chat and `echo` requests go as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_runs_the_forwarded_ids_as_it_would_the_text() {
    let engine = Standin::start();
    let r = router(true, vec![engine.backend()]);
    let text = "Tokenize once: the router already knows these ids. ".repeat(6);
    let body = completion(&text, json!({}));
    let own = post_json(
        engine.url() + "/tokenize",
        Bytes::from(serde_json::to_vec(&json!({"model": MODEL, "prompt": text})).unwrap()),
    )
    .await;
    let own_ids: Vec<u32> = serde_json::from_value(own["tokens"].clone()).unwrap();
    assert!(own_ids.len() > 32, "{}", own_ids.len());

    let first = r.pick(ApiKind::Completions, &body).await.unwrap();
    assert_eq!(first.ids_outcome(), Some(Ok(())));
    assert_eq!(forward(first, "/v1/completions", &body).await, Some(0));
    let stats = get_json(engine.url() + "/debug/stats").await;
    assert_eq!(stats["completion_prompts_ids"], 1, "{stats}");
    assert_eq!(stats["completion_prompts_text"], 0, "{stats}");
    assert_eq!(stats["last_completion_prompt"]["form"], "ids");
    assert_eq!(stats["last_completion_prompt"]["token_ids"], json!(own_ids));

    wait_until("the engine's BlockStored", || r.blocks(&engine.url()) > 0).await;
    let second = r.pick(ApiKind::Completions, &body).await.unwrap();
    assert_eq!(second.decision().source(), Source::KvExact);
    let predicted = second.decision().predicted_cached_tokens(r.block_size());
    assert!(predicted >= 32, "{predicted}");
    assert_eq!(
        forward(second, "/v1/completions", &body).await,
        Some(predicted)
    );

    // Kept as text: echo (the engine would echo decoded ids), and chat.
    let echo = completion(&text, json!({"echo": true}));
    let pick = r.pick(ApiKind::Completions, &echo).await.unwrap();
    assert_eq!(pick.ids_outcome(), Some(Err(KeepText::Echo)));
    assert_eq!(pick.upstream_body(&echo), echo);
    forward(pick, "/v1/completions", &echo).await;
    let chat = chat("unaffected", false);
    let pick = r.pick(ApiKind::Chat, &chat).await.unwrap();
    assert_eq!(pick.upstream_body(&chat), chat);
    forward(pick, "/v1/chat/completions", &chat).await;

    let stats = get_json(engine.url() + "/debug/stats").await;
    assert_eq!(stats["completion_prompts_ids"], 2, "{stats}");
    assert_eq!(stats["completion_prompts_text"], 1, "{stats}");
    let c = r.token_id_counters();
    assert_eq!(c.forwarded, 2);
    assert_eq!(c.kept(KeepText::Echo), 1);
    assert_eq!(c.kept(KeepText::Chat), 1);
}

/// Off by default: the engine gets the client's text, and nothing is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_by_default_the_text_is_forwarded() {
    let engine = Standin::start();
    let r = router(false, vec![engine.backend()]);
    let body = completion("plain text stays plain text", json!({}));
    let pick = r.pick(ApiKind::Completions, &body).await.unwrap();
    assert_eq!(pick.ids_outcome(), None);
    assert_eq!(pick.upstream_body(&body), body);
    forward(pick, "/v1/completions", &body).await;
    let stats = get_json(engine.url() + "/debug/stats").await;
    assert_eq!(stats["completion_prompts_text"], 1, "{stats}");
    assert_eq!(stats["completion_prompts_ids"], 0, "{stats}");
    assert_eq!(r.token_id_counters(), Default::default());
}

/// A streamed request gets both rewrites: usage included, prompt as ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_rewrite_and_the_ids_compose() {
    let engine = Standin::start();
    let r = router(true, vec![engine.backend()]);
    let body = completion("streamed with ids", json!({"stream": true}));
    let pick = r.pick(ApiKind::Completions, &body).await.unwrap();
    let up: Value = serde_json::from_slice(&pick.upstream_body(&body)).unwrap();
    assert_eq!(up["stream_options"]["include_usage"], true);
    assert!(up["prompt"].is_array(), "{up}");
    assert_eq!(forward(pick, "/v1/completions", &body).await, Some(0));
    let stats = get_json(engine.url() + "/debug/stats").await;
    assert_eq!(stats["completion_prompts_ids"], 1, "{stats}");
}
