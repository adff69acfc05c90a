//! The OpenAI-compatible HTTP surface: completions and chat (JSON and SSE),
//! models, health, the engine's load gauges (`GET /metrics`), the TensorRT-LLM
//! drain and a restart hook for tests.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_core::{BlockHasher, RequestExtras};
use serde_json::{json, Value};

use super::engine::{Engine, EventSink};
use super::metrics::{render, Flavor};
use super::tokenize::PromptSource;
use super::wire::WireFormat;
use super::Role;
use kvroute_engine_model::{Admission, RequestSpec};

/// Shared state of the HTTP handlers.
pub struct App {
    /// The engine model driver.
    pub engine: Arc<Engine>,
    /// The hash contract in force.
    pub hasher: BlockHasher,
    /// Request → prompt tokens.
    pub tokens: Box<dyn PromptSource>,
    /// Served model name.
    pub model: String,
    /// P/D role.
    pub role: Role,
    /// HTTP port (reported as the P/D side channel).
    pub port: u16,
    /// Request id counter.
    pub next_id: AtomicU64,
    /// `GET /metrics` calls (the TensorRT-LLM flavour's `iter`).
    pub scrapes: AtomicU64,
    /// `--request-log`: one JSON line per admitted request.
    pub request_log: Option<parking_lot::Mutex<std::fs::File>>,
}

/// All routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/kv_cache_events", post(kv_cache_events))
        .route("/admin/restart-publisher", post(restart))
        .route("/admin/cache", get(cache_state))
        .route("/metrics", get(metrics))
        .with_state(app)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

const WORDS: [&str; 8] = [
    " the", " cache", " holds", " a", " prefix", " of", " blocks", ".",
];

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    (
        status,
        Json(
            json!({"object": "error", "message": message, "type": "BadRequestError",
                     "code": status.as_u16()}),
        ),
    )
        .into_response()
}

async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Response {
    serve(app, Kind::Completion, &body).await
}

async fn chat(State(app): State<Arc<App>>, body: Bytes) -> Response {
    serve(app, Kind::Chat, &body).await
}

async fn models(State(app): State<Arc<App>>) -> Response {
    Json(json!({"object": "list", "data": [{
        "id": app.model, "object": "model", "created": unix_secs(), "owned_by": "kvroute-mock",
        "root": app.model, "parent": null,
    }]}))
    .into_response()
}

async fn kv_cache_events(State(app): State<Arc<App>>) -> Response {
    match app.engine.sink() {
        EventSink::Trtllm(queue) => Json(Value::Array(queue.drain())).into_response(),
        _ => error(StatusCode::NOT_FOUND, "KV events are published over ZeroMQ"),
    }
}

async fn restart(State(app): State<Arc<App>>) -> Response {
    if let EventSink::Zmq { publisher, .. } = app.engine.sink() {
        publisher.restart().await;
    }
    app.engine.clear();
    Json(json!({"status": "restarted"})).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let flavor = match app.engine.sink() {
        EventSink::Zmq {
            format: WireFormat::Sglang,
            ..
        } => Flavor::Sglang,
        EventSink::Zmq { .. } => Flavor::Vllm,
        EventSink::Trtllm(_) => Flavor::Trtllm,
    };
    let iteration = app.scrapes.fetch_add(1, Ordering::Relaxed);
    let (body, content_type) = render(flavor, &app.model, iteration, &app.engine.load());
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn cache_state(State(app): State<Arc<App>>) -> Response {
    Json(json!({
        "cached_blocks": app.engine.cached_blocks(),
        "requests": app.next_id.load(Ordering::Relaxed),
    }))
    .into_response()
}

fn unix_secs_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One `--request-log` line. Times are µs after submission, so a reader can
/// put the engine's share of a client-measured latency beside the rest
/// (gateway, client, scheduling) without sharing a clock beyond `unix_s`.
fn log_request(
    log: &parking_lot::Mutex<std::fs::File>,
    id: &str,
    unix_s: f64,
    load: super::engine::LoadSnapshot,
    prompt_tokens: u32,
    a: &Admission<u64>,
) {
    use std::io::Write as _;
    let since = |t: u64| t.saturating_sub(a.submitted_us);
    let line = json!({
        "id": id, "unix_s": unix_s, "prompt_tokens": prompt_tokens,
        "cached_tokens": a.cached_tokens, "evicted_blocks": a.evicted_blocks,
        "running_at_submit": load.running, "waiting_at_submit": load.waiting,
        "admitted_us": since(a.admitted_us), "first_token_us": since(a.first_token_us),
        "finish_us": since(a.finish_us),
    });
    // One write per line on an O_APPEND file: lines stay whole even if the
    // process is killed mid-run. A failed write loses a log line, never a reply.
    let mut text = line.to_string();
    text.push('\n');
    if let Err(e) = log.lock().write_all(text.as_bytes()) {
        tracing::warn!(error = %e, "request log write failed");
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Everything a response needs once the request is admitted.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    output_tokens: u32,
    admission: Admission<u64>,
    kv_transfer_params: Option<Value>,
}

impl Reply {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.output_tokens,
            "completion_tokens": self.output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.admission.cached_tokens},
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Model time at which output token `i` exists.
    fn token_time_us(&self, i: u32) -> u64 {
        let a = &self.admission;
        let span = a.finish_us.saturating_sub(a.first_token_us);
        let steps = u64::from(self.output_tokens.saturating_sub(1)).max(1);
        a.first_token_us + span * u64::from(i) / steps
    }

    fn text(&self) -> String {
        (0..self.output_tokens).map(word).collect()
    }

    fn full(&self) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": self.text(), "logprobs": null,
                                       "finish_reason": "length", "stop_reason": null}),
            Kind::Chat => json!({"index": 0,
                                 "message": {"role": "assistant", "content": self.text()},
                                 "logprobs": null, "finish_reason": "length", "stop_reason": null}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created,
               "model": self.model, "choices": [choice], "usage": self.usage(),
               "kv_transfer_params": self.kv_transfer_params})
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "choices": [choice]})
    }

    fn token_chunk(&self, i: u32) -> Value {
        let last = i + 1 == self.output_tokens;
        let finish = if last { json!("length") } else { Value::Null };
        match self.kind {
            Kind::Completion => self.chunk(json!({"index": 0, "text": word(i), "logprobs": null,
                                                  "finish_reason": finish, "stop_reason": null})),
            Kind::Chat => self.chunk(json!({"index": 0, "delta": {"content": word(i)},
                                            "logprobs": null, "finish_reason": finish})),
        }
    }
}

fn word(i: u32) -> &'static str {
    WORDS.get(i as usize % WORDS.len()).copied().unwrap_or(".")
}

fn bool_at(v: &Value, pointer: &str) -> bool {
    v.pointer(pointer).and_then(Value::as_bool).unwrap_or(false)
}

async fn serve(app: Arc<App>, kind: Kind, body: &[u8]) -> Response {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "body must be a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")),
    };
    let prompt = match app.tokens.prompt(kind == Kind::Chat, body) {
        Ok(p) if !p.tokens.is_empty() => p,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "empty prompt"),
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let tokens = prompt.tokens;
    let max_tokens = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .clamp(1, 1 << 20) as u32;
    let remote_decode =
        app.role != Role::Decode && bool_at(&req, "/kv_transfer_params/do_remote_decode");
    let remote_prefill =
        app.role != Role::Prefill && bool_at(&req, "/kv_transfer_params/do_remote_prefill");

    let extras = RequestExtras {
        cache_salt: prompt.cache_salt.clone(),
        ..RequestExtras::NONE
    };
    let mut keys = Vec::new();
    if let Err(e) = app.hasher.hash_prompt(&tokens, &extras, &mut keys) {
        return error(StatusCode::BAD_REQUEST, format!("cannot hash prompt: {e}"));
    }
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let spec = RequestSpec {
        keys: &keys,
        tokens: &tokens,
        prompt_tokens,
        output_tokens: max_tokens,
        kv_transferred: remote_prefill,
        cache_salt: prompt.cache_salt.as_deref(),
    };
    // The queue this request joins, read before it is queued (log only: the
    // read advances the model, which the submit does anyway).
    let joined = app
        .request_log
        .as_ref()
        .map(|_| (unix_secs_f64(), app.engine.load()));
    let waiting = match app.engine.submit(&spec) {
        Ok(rx) => rx,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let Ok(admission) = waiting.await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine restarted");
    };

    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    // The port names the engine, so a client behind any gateway can tell which
    // engine answered (bench_smg.py's per-request trace reads it).
    let id = match kind {
        Kind::Completion => format!("cmpl-mock-{}-{n}", app.port),
        Kind::Chat => format!("chatcmpl-mock-{}-{n}", app.port),
    };
    let kv_transfer_params = remote_decode.then(|| {
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": (0..keys.len()).collect::<Vec<_>>(),
            "remote_engine_id": format!("mock-{}", app.port),
            "remote_request_id": id,
            "remote_host": "127.0.0.1",
            "remote_port": app.port,
            "tp_size": 1,
        })
    });
    if let (Some(log), Some((unix_s, load))) = (&app.request_log, joined) {
        log_request(log, &id, unix_s, load, prompt_tokens, &admission);
    }
    let reply = Reply {
        kind,
        id,
        created: unix_secs(),
        model: req
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(&app.model)
            .to_owned(),
        prompt_tokens,
        output_tokens: max_tokens,
        admission,
        kv_transfer_params,
    };
    if bool_at(&req, "/stream") {
        let include_usage = bool_at(&req, "/stream_options/include_usage");
        stream(app, reply, include_usage)
    } else {
        tokio::time::sleep_until(app.engine.instant(reply.admission.finish_us).into()).await;
        Json(reply.full()).into_response()
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream(app: Arc<App>, reply: Reply, include_usage: bool) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        if reply.kind == Kind::Chat {
            // vLLM sends the role chunk with the first output, i.e. after
            // prefill: what a client measures as time to first token.
            tokio::time::sleep_until(app.engine.instant(reply.token_time_us(0)).into()).await;
            let first = reply.chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": null, "finish_reason": null}),
            );
            if tx.send(sse(&first)).await.is_err() {
                return;
            }
        }
        for i in 0..reply.output_tokens {
            tokio::time::sleep_until(app.engine.instant(reply.token_time_us(i)).into()).await;
            if tx.send(sse(&reply.token_chunk(i))).await.is_err() {
                return;
            }
        }
        if include_usage {
            let mut usage = reply.chunk(Value::Null);
            usage["choices"] = json!([]);
            usage["usage"] = reply.usage();
            if let Some(p) = &reply.kv_transfer_params {
                usage["kv_transfer_params"] = p.clone();
            }
            if tx.send(sse(&usage)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "stream setup failed"))
}
