//! The mock engine end to end on 127.0.0.1 with real sockets: HTTP in, ZeroMQ
//! (and the TensorRT-LLM drain) out, decoded by an independent msgpack reader and
//! by kvroute-engines' vLLM decoder.

use kvroute_mock_engine as mock_engine;

use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use kvroute_core::{BlockKey, HashContract, RequestExtras};
use kvroute_engines::events::{vllm, DecodeStats};
use kvroute_ingest::KvEvent;
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const LIMIT: Duration = Duration::from_secs(20);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: mock_engine::Args,
}

/// Fast costs so requests finish in milliseconds; ephemeral ports.
fn args(extra: &[&str]) -> mock_engine::Args {
    let mut argv = vec![
        "mock-engine",
        "--port",
        "0",
        "--zmq-port",
        "0",
        "--replay-port",
        "0",
        "--prefill-step-us",
        "100",
        "--prefill-us-per-token",
        "10",
        "--decode-us-per-token",
        "1000",
    ];
    argv.extend_from_slice(extra);
    Cli::parse_from(argv).args
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog while the prefix cache keeps every full block of sixteen bytes.";

/// What the engine should hash: one token per byte (no --model-dir), vLLM 0.33
/// sha256_cbor, PYTHONHASHSEED=0, block 16 — computed here through kvroute-core.
fn expected_keys(prompt: &str) -> Vec<BlockKey> {
    let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0"
        .parse::<HashContract>()
        .unwrap()
        .hasher()
        .unwrap();
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let mut keys = Vec::new();
    hasher
        .hash_prompt(&tokens, &RequestExtras::NONE, &mut keys)
        .unwrap();
    keys
}

async fn post(base: &str, path: &str, body: Value) -> Value {
    let resp = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
    resp.json().await.unwrap()
}

async fn subscribe(port: u16) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    // PUB drops messages until the subscription has reached it (slow joiner).
    tokio::time::sleep(Duration::from_millis(300)).await;
    sub
}

async fn next_batch(sub: &mut SubSocket) -> (u64, Bytes) {
    let m = tokio::time::timeout(LIMIT, sub.recv())
        .await
        .unwrap()
        .unwrap()
        .into_vec();
    assert_eq!(m.len(), 3, "frames: {m:?}");
    assert!(m[0].is_empty(), "default topic is empty");
    let seq = u64::from_be_bytes(m[1].as_ref().try_into().unwrap());
    (seq, m[2].clone())
}

fn map_get<'a>(map: &'a rmpv::Value, key: &str) -> Option<&'a rmpv::Value> {
    map.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn cached_tokens(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_publishes_vllm_events_and_repeat_hits() {
    let engine = mock_engine::start(&args(&[])).await.unwrap();
    let base = format!("http://{}", engine.http);
    let mut sub = subscribe(engine.zmq_port.unwrap()).await;

    let body = json!({"model": "mock", "prompt": PROMPT, "max_tokens": 3});
    let first = post(&base, "/v1/completions", body.clone()).await;
    assert_eq!(first["object"], "text_completion");
    assert_eq!(
        first["usage"]["prompt_tokens"].as_u64().unwrap(),
        PROMPT.len() as u64
    );
    assert_eq!(first["usage"]["completion_tokens"], 3);
    assert_eq!(cached_tokens(&first), 0);

    let keys = expected_keys(PROMPT);
    assert_eq!(keys.len(), PROMPT.len() / 16);
    let (seq, payload) = next_batch(&mut sub).await;
    assert_eq!(seq, 0);
    // Independent msgpack reading of the vLLM 0.33 layout.
    let raw = rmpv::decode::read_value(&mut payload.as_ref()).unwrap();
    let batch = raw.as_array().unwrap();
    assert_eq!(batch.len(), 3);
    assert!(batch[0].as_f64().unwrap() > 1.6e9);
    assert_eq!(batch[2].as_u64(), Some(0));
    let event = &batch[1].as_array().unwrap()[0];
    let names: Vec<&str> = event
        .as_map()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
    assert_eq!(
        map_get(event, "type").unwrap().as_str(),
        Some("BlockStored")
    );
    let hashes: Vec<u64> = map_get(event, "block_hashes")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(hashes, keys.iter().map(|k| k.0).collect::<Vec<_>>());
    assert!(map_get(event, "parent_block_hash").unwrap().is_nil());
    let tokens: Vec<u64> = map_get(event, "token_ids")
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let want: Vec<u64> = PROMPT
        .bytes()
        .take(keys.len() * 16)
        .map(u64::from)
        .collect();
    assert_eq!(tokens, want);
    // And the gateway's own decoder agrees.
    let mut stats = DecodeStats::default();
    let decoded = vllm::decode(&payload, seq, &mut stats).unwrap();
    let KvEvent::Stored(stored) = &decoded.events[0] else {
        panic!("{decoded:?}")
    };
    assert_eq!(stored.keys, keys);

    let second = post(&base, "/v1/completions", body).await;
    // vLLM caps a hit at prompt_len - 1 tokens, in whole blocks.
    let hit_blocks = keys.len().min((PROMPT.len() - 1) / 16);
    assert_eq!(cached_tokens(&second), (hit_blocks * 16) as u64);
    assert!(cached_tokens(&second) > 0);
    engine.server.abort();
}

async fn read_sse(resp: reqwest::Response) -> (usize, Vec<Value>, bool) {
    let mut resp = resp;
    let mut text = String::new();
    let mut reads = 0;
    while let Some(chunk) = tokio::time::timeout(LIMIT, resp.chunk())
        .await
        .unwrap()
        .unwrap()
    {
        reads += 1;
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let mut events = Vec::new();
    let mut done = false;
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block.strip_prefix("data: ").unwrap();
        if data == "[DONE]" {
            done = true;
        } else {
            assert!(!done, "data after [DONE]");
            events.push(serde_json::from_str(data).unwrap());
        }
    }
    (reads, events, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_sse_with_final_usage_chunk() {
    let engine = mock_engine::start(&args(&[])).await.unwrap();
    let base = format!("http://{}", engine.http);
    let client = reqwest::Client::new();
    let body = json!({"model": "mock", "prompt": PROMPT, "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    for round in 0..2 {
        let resp = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let (reads, events, done) = read_sse(resp).await;
        assert!(done);
        assert!(reads > 1, "tokens arrive over time, not in one write");
        let (usage, tokens) = events.split_last().unwrap();
        assert_eq!(tokens.len(), 5);
        assert!(tokens.iter().all(|t| t["object"] == "text_completion"));
        assert_eq!(tokens[4]["choices"][0]["finish_reason"], "length");
        assert!(tokens[0]["choices"][0]["finish_reason"].is_null());
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 5);
        let cached = cached_tokens(usage);
        assert_eq!(cached > 0, round == 1, "round {round}: cached {cached}");
    }

    // Chat: role delta first, no usage chunk without include_usage.
    let chat = json!({"model": "mock", "stream": true, "max_tokens": 2,
                      "messages": [{"role": "user", "content": PROMPT}]});
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap();
    let (_, events, done) = read_sse(resp).await;
    assert!(done);
    assert_eq!(events.len(), 3);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk" && e.get("usage").is_none()));

    // Non-stream chat reports usage too, and a repeat hits.
    let chat = json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]});
    let r = post(&base, "/v1/chat/completions", chat).await;
    assert_eq!(r["object"], "chat.completion");
    assert!(cached_tokens(&r) > 0);
    engine.server.abort();
}

async fn replay(port: u16, start: u64) -> Vec<(u64, Bytes)> {
    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(request).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(LIMIT, dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(m.len(), 4, "{m:?}");
        assert!(m[0].is_empty());
        let seq = u64::from_be_bytes(m[2].as_ref().try_into().unwrap());
        if seq == u64::MAX {
            assert!(m[1].is_empty() && m[3].is_empty(), "end marker");
            return out;
        }
        out.push((seq, m[3].clone()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_buffered_batches_and_restart_resets_sequence() {
    let engine = mock_engine::start(&args(&["--capacity-blocks", "8"]))
        .await
        .unwrap();
    let base = format!("http://{}", engine.http);
    let mut sub = subscribe(engine.zmq_port.unwrap()).await;
    let other =
        "A different prompt, long enough for several blocks of sixteen bytes each, to evict.";
    let mut live = Vec::new();
    for prompt in [PROMPT, other] {
        post(
            &base,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
        live.push(next_batch(&mut sub).await);
    }
    // 6 + 5 blocks + a partial block each in 8: the second request evicts.
    let mut stats = DecodeStats::default();
    let second = vllm::decode(&live[1].1, 1, &mut stats).unwrap();
    assert!(
        matches!(second.events[0], KvEvent::Removed(_)),
        "{second:?}"
    );
    let replayed = replay(engine.replay_port.unwrap(), 0).await;
    assert_eq!(replayed, live);
    let tail = replay(engine.replay_port.unwrap(), 1).await;
    assert_eq!(tail, live[1..]);

    let r = post(&base, "/admin/restart-publisher", json!({})).await;
    assert_eq!(r["status"], "restarted");
    let after = replay(engine.replay_port.unwrap(), 0).await;
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].0, 0, "sequence restarts at 0");
    let cleared = vllm::decode(&after[0].1, 0, &mut stats).unwrap();
    assert_eq!(cleared.events, vec![KvEvent::AllCleared]);
    let again = post(
        &base,
        "/v1/completions",
        json!({"prompt": other, "max_tokens": 1}),
    )
    .await;
    assert_eq!(cached_tokens(&again), 0, "cache was cleared");
    let mut sub = subscribe(engine.zmq_port.unwrap()).await;
    post(
        &base,
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1}),
    )
    .await;
    let (seq, _) = next_batch(&mut sub).await;
    assert_eq!(seq, 2);
    engine.server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_two_step() {
    // Prefill is so slow (1 s per token) that a decode engine paying it would time out.
    let prefill = mock_engine::start(&args(&["--role", "prefill"]))
        .await
        .unwrap();
    let mut decode_args = args(&["--role", "decode"]);
    decode_args.prefill_us_per_token = 1_000_000.0;
    let decode = mock_engine::start(&decode_args).await.unwrap();

    let step1 = post(
        &format!("http://{}", prefill.http),
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                                      "remote_engine_id": null, "remote_block_ids": null,
                                      "remote_host": null, "remote_port": null}}),
    )
    .await;
    let params = step1["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(
        params["remote_block_ids"].as_array().unwrap().len(),
        PROMPT.len() / 16
    );
    assert_eq!(
        params["remote_port"].as_u64().unwrap(),
        u64::from(prefill.http.port())
    );
    assert!(params["remote_engine_id"].is_string() && params["remote_host"].is_string());

    let step2 = tokio::time::timeout(
        Duration::from_secs(10),
        post(
            &format!("http://{}", decode.http),
            "/v1/completions",
            json!({"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}),
        ),
    )
    .await
    .expect("decode side must not pay prefill for transferred KV");
    assert_eq!(step2["usage"]["completion_tokens"], 4);
    assert!(step2["kv_transfer_params"].is_null());
    prefill.server.abort();
    decode.server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trtllm_mode_drains_events_over_http() {
    let engine = mock_engine::start(&args(&["--format", "trtllm"]))
        .await
        .unwrap();
    assert!(engine.zmq_port.is_none());
    let base = format!("http://{}", engine.http);
    post(
        &base,
        "/v1/completions",
        json!({"prompt": PROMPT, "max_tokens": 1}),
    )
    .await;
    let drained = post(&base, "/kv_cache_events", json!({})).await;
    let events = drained.as_array().unwrap();
    assert_eq!(events[0]["data"]["type"], "created");
    assert_eq!(events[1]["data"]["type"], "stored");
    let blocks = events[1]["data"]["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), PROMPT.len() / 16);
    assert_eq!(blocks[0]["tokens"].as_array().unwrap().len(), 16);
    assert_eq!(events[1]["event_id"].as_u64(), Some(1));
    let empty = post(&base, "/kv_cache_events", json!({})).await;
    assert_eq!(empty, json!([]), "the drain is destructive");
    engine.server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors() {
    let engine = mock_engine::start(&args(&[])).await.unwrap();
    let client = reqwest::Client::new();
    let base = format!("http://{}", engine.http);
    for body in [
        "not json",
        "[1]",
        "{}",
        r#"{"prompt": ""}"#,
        r#"{"prompt": [1, -2]}"#,
    ] {
        let r = client
            .post(format!("{base}/v1/completions"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
    }
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "mock");
    assert!(client
        .get(format!("{base}/health"))
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    engine.server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_dir_uses_the_gateway_tokenizer_and_template() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/tokenizers/qwen3");
    let dir_arg = dir.to_str().unwrap().to_owned();
    let engine = mock_engine::start(&args(&[
        "--model-dir",
        &dir_arg,
        "--model",
        "Qwen/Qwen3-8B",
    ]))
    .await
    .unwrap();
    let base = format!("http://{}", engine.http);
    let mut sub = subscribe(engine.zmq_port.unwrap()).await;
    let content = PROMPT.repeat(3);
    let body = json!({"model": "Qwen/Qwen3-8B", "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]});

    // What the gateway computes for the same body: kvroute-engines' prompt
    // pipeline, then the vLLM contract.
    let pool = kvroute_engines::prompt::TokenizerPool::new();
    pool.register("Qwen/Qwen3-8B", &dir);
    let p = pool
        .prompt_tokens(
            kvroute_engines::prompt::ApiKind::Chat,
            body.to_string().as_bytes(),
        )
        .unwrap();
    let tokens = &p.engine_prompts[0].token_ids;
    let hasher = "vllm@0.33.0:sha256_cbor:block=16:seed=0"
        .parse::<HashContract>()
        .unwrap()
        .hasher()
        .unwrap();
    let mut keys = Vec::new();
    hasher
        .hash_prompt(tokens, &RequestExtras::NONE, &mut keys)
        .unwrap();
    assert!(keys.len() >= 2);

    let r = post(&base, "/v1/chat/completions", body).await;
    assert_eq!(
        r["usage"]["prompt_tokens"].as_u64().unwrap(),
        tokens.len() as u64
    );
    let (_, payload) = next_batch(&mut sub).await;
    let mut stats = DecodeStats::default();
    let batch = vllm::decode(&payload, 0, &mut stats).unwrap();
    let KvEvent::Stored(stored) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(stored.keys, keys);
    assert_eq!(stored.token_ids, tokens[..keys.len() * 16]);
    engine.server.abort();
}
