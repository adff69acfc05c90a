//! The OpenAI proxy: body read once (size limit, read timeout) → the facade's
//! prompt step (`kvroute::prompt::prepare_admitted`: tokens and block keys
//! for the rule's model, the usage rewrite) → the library's decision → the
//! chosen upstream (P/D: the two-step), retry with exclusion on connect
//! failure → response streamed back.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use kvroute::prompt::{prepare_admitted, PromptHost, PromptOptions};
use kvroute::{NoEndpoint, Pick};
use kvroute_engines::prompt::{model_of, parse_json_fields, ApiKind, TokenizerPool};
use kvroute_select::{Decision, Leg};

use super::metrics::Outcome;
use super::passthrough::{self, Forward};
use super::pd;
use super::state::{Gateway, RuleRuntime};
use super::upstream::{read_small, IdleTimeout, UpstreamError};

/// Session header for P/D session affinity.
const SESSION_HEADER: &str = "x-session-id";
/// Largest prefill answer read (it carries one token and the transfer params).
const PREFILL_ANSWER_CAP: usize = 1 << 20;

/// An OpenAI-style error response.
pub fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"error": {"message": message.into(), "type": kind, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

/// The `model` of a pass-through body, if it is JSON naming one, and whether
/// it asks for a stream (parsed on the blocking pool: bodies can be
/// megabytes).
async fn model_only(body: &Bytes) -> (Option<String>, bool) {
    if body.is_empty() {
        return (None, false);
    }
    let body = body.clone();
    tokio::task::spawn_blocking(move || {
        let value = parse_json_fields(&body, &["model", "stream"]).ok();
        let model = value.as_ref().and_then(|v| model_of(v).map(str::to_owned));
        (model, kvroute::prompt::streamed(value.as_ref()))
    })
    .await
    .unwrap_or((None, false))
}

/// The facade's prompt step ([`kvroute::prompt::prepare`]) under each
/// request's rule: the options of the rule's runtime for the request's model
/// (its contract's keys, hashed while the prompt tokenizes, its LoRA
/// adapter, its engines' request validators, `forward_token_ids`, the
/// gateway's limits).
impl PromptHost for Gateway {
    fn tokenizers(&self) -> &TokenizerPool {
        &self.tokenizers
    }

    fn options(&self, model: Option<&str>) -> PromptOptions {
        match self.rule_for_model(model) {
            Some(rt) => rt.router.prompt_options(model),
            None => {
                let mut o = PromptOptions::default();
                o.max_prompt_chars = self.limits.max_prompt_chars;
                o.max_prompt_tokens = self.limits.max_prompt_tokens;
                o.include_usage = self.limits.include_usage;
                o
            }
        }
    }
}

/// Marks the answer to a request whose client left mid-body (no one reads it).
#[derive(Clone, Copy)]
struct ClientLeft;

/// Whether reading a request body failed because the client closed its
/// connection before the body was complete (it will never see an answer).
fn client_left(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_closed() || h.is_canceled() {
                return true;
            }
        }
        // hyper reports a body cut short as a body error caused by an
        // unexpected end of file (or a reset).
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{
                BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof,
            };
            return matches!(
                io.kind(),
                UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
            );
        }
        cur = err.source();
    }
    false
}

/// Reads the body once: Content-Length checked first, then a bounded,
/// time-limited collect.
async fn read_body(gw: &Gateway, headers: &HeaderMap, body: Body) -> Result<Bytes, Response> {
    let limit = gw.limits.max_body_bytes;
    let declared = headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("request body exceeds {limit} bytes"),
        )
    };
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(
        gw.limits.body_read_timeout(),
        Limited::new(body, limit).collect(),
    )
    .await
    {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Ok(Err(e)) if client_left(&*e) => {
            let mut gone = error(
                StatusCode::BAD_REQUEST,
                "client_gone",
                "the client closed its connection before its body was complete",
            );
            gone.extensions_mut().insert(ClientLeft);
            Err(gone)
        }
        Ok(Err(_)) => Err(error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "request body could not be read",
        )),
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "request body not received in time",
        )),
    }
}

/// The proxy handler for everything under `/v1/`.
pub async fn handle(State(gw): State<Arc<Gateway>>, req: Request<Body>) -> Response {
    let mut gone = Gone {
        gw: Arc::clone(&gw),
        rule: None,
        armed: true,
    };
    let resp = route(gw, req, &mut gone).await;
    gone.armed = false;
    resp
}

/// Counts a request whose handler was dropped before it had a response
/// (the client went away, or the shutdown grace ran out): every path that
/// finishes counts its own outcome, and this one would otherwise count
/// nowhere. Per rule once the rule is known.
struct Gone {
    gw: Arc<Gateway>,
    rule: Option<Arc<RuleRuntime>>,
    armed: bool,
}

impl Drop for Gone {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match &self.rule {
            Some(rt) => rt.counters.outcome(Outcome::ClientGone),
            None => self.gw.metrics.unrouted(Outcome::ClientGone),
        }
    }
}

/// [`handle`]'s work; `gone` learns the request's rule.
async fn route(gw: Arc<Gateway>, req: Request<Body>, gone: &mut Gone) -> Response {
    let (parts, body) = req.into_parts();
    // Only the path and query are used: neither `Host` nor an absolute-URI
    // request target can choose the upstream.
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    if !parts.uri.path().starts_with("/v1/") {
        gw.metrics.unrouted(Outcome::Rejected);
        let admin = gw.observe.admin_addr().map_or_else(
            || "the admin listener".to_owned(),
            |a| format!("http://{a}"),
        );
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("only /v1/* is proxied here; /metrics, /healthz, /readyz and /admin/* are served on {admin}"),
        );
    }
    if !gw.observe.is_ready() {
        gw.metrics.unrouted(Outcome::Rejected);
        let loading = gw.observe.refuse_not_ready();
        let mut resp = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!(
                "kvroute is starting: tokenizers still loading ({}); GET /readyz on the admin listener says when it routes",
                loading.join(", ")
            ),
        );
        resp.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("1"),
        );
        return resp;
    }
    if ambiguous_path(parts.uri.path()) {
        // An engine (or a proxy behind it) may resolve `..` and reach what
        // `/v1/` was meant to fence off: refuse rather than forward.
        gw.metrics.unrouted(Outcome::Rejected);
        return error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the path has dot segments, empty segments or an encoded separator",
        );
    }
    let body = match read_body(&gw, &parts.headers, body).await {
        Ok(b) => b,
        Err(resp) => {
            let outcome = if resp.extensions().get::<ClientLeft>().is_some() {
                Outcome::ClientGone
            } else if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
                Outcome::TooLarge
            } else if resp.status() == StatusCode::REQUEST_TIMEOUT {
                Outcome::BodyTimeout
            } else {
                Outcome::Rejected
            };
            gw.metrics.unrouted(outcome);
            return resp;
        }
    };
    let started = Instant::now();
    let api = if parts.method == Method::POST {
        match parts.uri.path().trim_end_matches('/') {
            "/v1/completions" => Some(ApiKind::Completions),
            "/v1/chat/completions" => Some(ApiKind::Chat),
            _ => None,
        }
    } else {
        None
    };
    let Some(api) = api else {
        // Not a completion: no prompt to route on, so no KV decision either.
        let (model, streamed) = model_only(&body).await;
        let Some(rt) = gw.rule_for_model(model.as_deref()) else {
            gw.metrics.unrouted(Outcome::NoRule);
            return error(
                StatusCode::NOT_FOUND,
                "no_route",
                no_rule_message(model.as_deref()),
            );
        };
        gone.rule = Some(Arc::clone(&rt));
        let req = Forward {
            method: parts.method.clone(),
            path_and_query: &path_and_query,
            headers: &parts.headers,
            body,
            streamed,
        };
        return passthrough::forward(&gw, &rt, req).await;
    };
    // Parse, tokenize and hash on the blocking pool, within the per-request
    // limits and the tokenization admission across requests.
    let mut prompt = prepare_admitted(
        &gw,
        &tokio::runtime::Handle::current(),
        &gw.tokenize_admission,
        gw.limits.tokenize_overload,
        gw.limits.tokenize_wait(),
        api,
        &body,
    )
    .await;
    let Some(rt) = gw.rule_for_model(prompt.model()) else {
        gw.metrics.unrouted(Outcome::NoRule);
        return error(
            StatusCode::NOT_FOUND,
            "no_route",
            no_rule_message(prompt.model()),
        );
    };
    gone.rule = Some(Arc::clone(&rt));
    let session = parts
        .headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let name = rt.spec.doc.name.clone();
    let explain = gw.observe.explain_header(&parts.headers);
    // This replica's turn in a burst (zero alone or between bursts).
    rt.router.take_turn(&mut prompt).await;
    let picked = if gw.observe.records(explain) {
        rt.router.pick_explained(prompt, session.as_deref())
    } else {
        rt.router.pick_prepared(prompt, session.as_deref())
    };
    let mut pick = match picked {
        Ok(p) => p,
        Err(NoEndpoint { mut decision }) => {
            gw.metrics.decision_latency.observe(started.elapsed());
            rt.count_tier(decision.source());
            rt.counters.outcome(Outcome::NoEndpoint);
            let reason = unavailable_reason(&rt, &decision, &[]).to_string();
            tracing::warn!(rule = %name, %reason, "no endpoint");
            let mut resp = error(StatusCode::SERVICE_UNAVAILABLE, "no_endpoint", reason);
            gw.observe.decision(&rt, &decision, resp.headers_mut());
            let x = decision.take_explanation();
            gw.observe.file(&rt, x, explain, resp.headers_mut());
            return resp;
        }
    };
    gw.metrics.decision_latency.observe(started.elapsed());
    rt.count_tier(pick.decision().source());
    tracing::debug!(rule = %name, source = ?pick.decision().source(),
        target = ?pick.decision().target(), miss = ?pick.decision().miss(),
        predicted_blocks = pick.decision().predicted_blocks(), "decision");
    let mut ctx = Ctx {
        method: parts.method.clone(),
        path_and_query,
        headers: parts.headers.clone(),
        body,
        prefill: None,
        receipts: Vec::new(),
        failures: Vec::new(),
        timed_out: false,
        pd: None,
    };
    // The one retry driver: the library's `Pick`.
    loop {
        match connect(&gw, &rt, &mut ctx, &mut pick).await {
            Ok(conn) => {
                match conn.answered {
                    None => pick.connected(),
                    Some(leg) => pick.connected_leg(leg),
                }
                rt.counters.outcome(Outcome::Proxied);
                return respond(&gw, &rt, conn, pick, explain);
            }
            Err(failure) if failure.retryable => {
                let failed = match failure.leg {
                    Leg::Endpoint => pick.url().to_owned(),
                    Leg::Decode => pick.decode_url().unwrap_or_default().to_owned(),
                };
                ctx.timed_out |= !failure.error.is_connect();
                ctx.failures
                    .push((failed.clone(), failure.error.to_string()));
                // A decode endpoint that got the request may have pulled the
                // prefilled blocks (and the prefill engine freed them): the
                // next decode endpoint gets a fresh prefill leg, not the
                // same transfer. Only a refused connect leaves it unused.
                let transfer_spent = failure.leg == Leg::Decode
                    && !matches!(failure.error, UpstreamError::Connect(_))
                    && matches!(ctx.pd, Some(Some(_)));
                let prefill_url = pick.url().to_owned();
                if pick.retry_leg(failure.leg).is_some() {
                    if transfer_spent {
                        ctx.prefill = None;
                        if pick.url() == prefill_url {
                            pick.prefill_again();
                        }
                    }
                    tracing::warn!(rule = %name, endpoint = %failed, error = %failure.error,
                        next = pick.url(), "upstream attempt failed before any response; retrying elsewhere");
                    continue;
                }
                let reason = unavailable_reason(&rt, pick.decision(), &ctx.failures)
                    .with_timeout(ctx.timed_out);
                tracing::warn!(rule = %name, endpoint = %failed, error = %failure.error, %reason,
                    "upstream attempt failed before any response; no endpoint left");
                // An engine that took the request and did not answer in time
                // makes it a gateway timeout; 503 is for endpoints that could
                // not be reached at all.
                let mut resp = if ctx.timed_out {
                    rt.counters.outcome(Outcome::UpstreamError);
                    error(StatusCode::GATEWAY_TIMEOUT, "upstream_timeout", reason)
                } else {
                    rt.counters.outcome(Outcome::NoEndpoint);
                    error(StatusCode::SERVICE_UNAVAILABLE, "no_endpoint", reason)
                };
                gw.observe
                    .decision(&rt, pick.decision(), resp.headers_mut());
                let x = pick.take_explanation();
                gw.observe.file(&rt, x, explain, resp.headers_mut());
                return resp;
            }
            Err(failure) => {
                rt.counters.outcome(Outcome::UpstreamError);
                tracing::warn!(rule = %name, endpoint = %pick.url(), error = %failure.error,
                    "upstream failed");
                let mut resp = error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    failure.error.to_string(),
                );
                gw.observe
                    .decision(&rt, pick.decision(), resp.headers_mut());
                let x = pick.take_explanation();
                gw.observe.file(&rt, x, explain, resp.headers_mut());
                return resp;
            }
        }
    }
}

/// `.` / `..` segments (also percent-encoded), empty segments (`//`) and
/// encoded `/` or `\\`: paths another server may resolve differently.
fn ambiguous_path(path: &str) -> bool {
    // Every proxied request passes here: no allocation.
    let bytes = path.as_bytes();
    let encoded = |pat: &[u8]| bytes.windows(3).any(|w| w.eq_ignore_ascii_case(pat));
    if bytes.contains(&b'\\') || encoded(b"%2f") || encoded(b"%5c") {
        return true;
    }
    let mut segments = path.split('/').skip(1).peekable();
    while let Some(s) = segments.next() {
        let last = segments.peek().is_none();
        if (s.is_empty() && !last) || dot_segment(s.as_bytes()) {
            return true;
        }
    }
    false
}

/// `.` or `..`, each dot written as `.` or `%2e` (any case).
fn dot_segment(mut s: &[u8]) -> bool {
    let mut dots = 0;
    while !s.is_empty() {
        if s[0] == b'.' {
            s = &s[1..];
        } else if s.len() >= 3 && s[..3].eq_ignore_ascii_case(b"%2e") {
            s = &s[3..];
        } else {
            return false;
        }
        dots += 1;
    }
    dots == 1 || dots == 2
}

fn no_rule_message(model: Option<&str>) -> String {
    match model {
        Some(m) => format!("no rule serves model {m:?} and there is no default rule"),
        None => "the request names no model and there is no default rule".to_owned(),
    }
}

/// Why no endpoint served a request: the rule, the retries taken and the
/// why per endpoint, written by its `Display`.
struct Unavailable {
    rule: String,
    retries: u32,
    parts: Vec<String>,
    /// An attempt reached an engine that did not answer in time.
    timed_out: bool,
}

impl Unavailable {
    fn with_timeout(mut self, timed_out: bool) -> String {
        self.timed_out = timed_out;
        self.to_string()
    }
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.timed_out {
            "no endpoint answered in time"
        } else {
            "no endpoint available"
        };
        write!(
            f,
            "rule {:?}: {what} after {} retries [{}]",
            self.rule,
            self.retries,
            self.parts.join("; ")
        )
    }
}

/// "no eligible endpoint" with the why, per endpoint.
fn unavailable_reason(
    rt: &RuleRuntime,
    d: &Decision,
    failures: &[(String, String)],
) -> Unavailable {
    let mut parts = Vec::new();
    for (i, e) in rt.spec.endpoints.iter().enumerate() {
        let why = if let Some((_, f)) = failures.iter().rev().find(|(u, _)| *u == e.url) {
            // `f` already says what failed ("connect failed: ...").
            f.clone()
        } else {
            match rt.router.endpoint_status(&e.url) {
                None => "not present".to_owned(),
                Some(s) if s.admin_down => "admin down".to_owned(),
                Some(s) if s.breaker == kvroute_select::BreakerState::Open => {
                    "circuit breaker open".to_owned()
                }
                Some(s) if s.outlier.ejected => "ejected by outlier detection".to_owned(),
                Some(_)
                    if d.is_excluded(kvroute_core::EndpointId(
                        u32::try_from(i).unwrap_or(u32::MAX),
                    )) =>
                {
                    "excluded".to_owned()
                }
                Some(_) => "not eligible for this request".to_owned(),
            }
        };
        parts.push(format!("{}: {why}", e.url));
    }
    Unavailable {
        rule: rt.spec.doc.name.clone(),
        retries: d.retries(),
        parts,
        timed_out: false,
    }
}

/// An engine's receipt: its cached tokens and its own prompt count.
type Usage = (u32, Option<u32>);

/// What a successful connect hands back.
pub struct Connection {
    response: hyper::Response<Incoming>,
    /// Cached tokens the prefill leg reported (P/D), recorded as the receipt.
    prefill_cached: Option<Option<Usage>>,
    /// P/D: the one leg that was reached and answered (`None`: every leg
    /// of the target).
    answered: Option<Leg>,
}

/// A connect attempt that failed, and whether another endpoint may be
/// tried (the request never reached the engine).
struct ConnectFailure {
    leg: Leg,
    retryable: bool,
    error: UpstreamError,
}

fn refused(leg: Leg, e: UpstreamError) -> ConnectFailure {
    ConnectFailure {
        leg,
        retryable: e.is_retryable(),
        error: e,
    }
}

/// One upstream exchange up to its response headers, bounded by the
/// router's header timeouts and outlier detection ([`Pick::await_headers`]).
async fn exchange(
    gw: &Gateway,
    pick: &Pick,
    leg: Leg,
    base: &hyper::Uri,
    ctx: &Ctx,
    body: Bytes,
) -> Result<hyper::Response<Incoming>, ConnectFailure> {
    let send = gw.client.request(
        base,
        ctx.method.clone(),
        &ctx.path_and_query,
        &ctx.headers,
        body,
    );
    match pick.await_headers(leg, send).await {
        Ok(answer) => answer.map_err(|e| refused(leg, e)),
        Err(stall) => Err(refused(leg, UpstreamError::Stalled(stall))),
    }
}

/// Per-request state across connect attempts.
struct Ctx {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    /// The client's body, read once.
    body: Bytes,
    /// The prefill leg already done for a P/D target: (endpoint, params,
    /// its cached tokens and prompt tokens).
    prefill: Option<(String, Option<serde_json::Value>, Option<Usage>)>,
    /// The usage of the first prefill leg on each prefill endpoint, by URL:
    /// the receipt of a decision for that endpoint. A leg run again there
    /// (its transfer spent, or a retry that came back to it) finds the
    /// prompt it prefilled cached, which says nothing of the decision.
    receipts: Vec<(String, Option<Usage>)>,
    /// (endpoint url, error) of failed attempts, for the 503 / 504 reason.
    failures: Vec<(String, String)>,
    /// An attempt reached an engine that did not answer in time.
    timed_out: bool,
    /// P/D: the request parsed once for every leg and attempt (`None` until
    /// a P/D target is first connected; then `Some(None)` when the body is
    /// not a JSON object, so there is no two-step).
    pd: Option<Option<Arc<PdRequest>>>,
}

/// The two-step's view of one request, prepared on the blocking pool.
struct PdRequest {
    /// The request's fields (each decode attempt adds its `kv_transfer_params`).
    object: pd::Fields,
    /// The prefill leg's body.
    prefill: Bytes,
}

impl PdRequest {
    /// Parses `body` once, off the async worker (bodies can be megabytes).
    async fn prepare(body: &Bytes) -> Option<Arc<Self>> {
        let body = body.clone();
        tokio::task::spawn_blocking(move || {
            let object = pd::parse(&body)?;
            let prefill = pd::prefill_body_of(&object)?;
            Some(Arc::new(Self { object, prefill }))
        })
        .await
        .ok()
        .flatten()
    }

    /// The decode leg's body carrying the prefill's `params` (serialized on
    /// the blocking pool); the client's bytes when there are none.
    async fn decode_body(
        self: &Arc<Self>,
        original: &Bytes,
        params: Option<serde_json::Value>,
    ) -> Bytes {
        let Some(params) = params else {
            return original.clone();
        };
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || pd::decode_body_of(&this.object, &params))
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| original.clone())
    }
}

/// Sends the request to the pick's target: one leg converged, the two-step
/// for a P/D target (the prefill leg once per prefill endpoint, even if the
/// decode leg is retried).
async fn connect(
    gw: &Arc<Gateway>,
    rt: &Arc<RuleRuntime>,
    ctx: &mut Ctx,
    pick: &mut Pick,
) -> Result<Connection, ConnectFailure> {
    let Some(main) = rt.endpoint_by_url(pick.url()) else {
        return Err(refused(
            Leg::Endpoint,
            UpstreamError::Build("unknown endpoint".into()),
        ));
    };
    let decode = pick.decode_url().and_then(|u| rt.endpoint_by_url(u));
    let prepared = match (&decode, &ctx.pd) {
        (None, _) => None,
        (Some(_), Some(p)) => p.clone(),
        (Some(_), None) => {
            let p = PdRequest::prepare(&pick.text_body(&ctx.body)).await;
            ctx.pd = Some(p.clone());
            p
        }
    };
    let (decode_ep, prepared) = match (decode, prepared) {
        (Some(d), Some(p)) => (d, p),
        (decode, _) => {
            if let Some(Err(why)) = pick.ids_outcome() {
                tracing::debug!(reason = why.as_str(), "prompt forwarded as text");
            }
            let body = pick.upstream_body(&ctx.body);
            let Some(decode_ep) = decode else {
                let response = exchange(gw, pick, Leg::Endpoint, &main.base, ctx, body).await?;
                return Ok(Connection {
                    response,
                    prefill_cached: None,
                    answered: None,
                });
            };
            // A P/D target whose body cannot be split into the two legs
            // (not a JSON object serde reads, e.g. a key that is a lone
            // surrogate escape): the decode endpoint serves it whole, prefill included,
            // as a decode engine serves a request without transfer
            // parameters. The prefill endpoint would run it as a full
            // generation; it is left out, and released.
            if let Some(g) = pick.guard_mut() {
                g.prefill_leg_done();
            }
            let response = exchange(gw, pick, Leg::Decode, &decode_ep.base, ctx, body).await?;
            return Ok(Connection {
                response,
                // Not the decision's receipt: that was for the prefill endpoint.
                prefill_cached: Some(None),
                answered: Some(Leg::Decode),
            });
        }
    };
    // Prefill leg (done once per prefill endpoint, even if decode retries).
    let reuse = ctx.prefill.as_ref().filter(|(e, _, _)| *e == main.url);
    let (params, cached) = match reuse {
        Some((_, p, c)) => (p.clone(), *c),
        None => {
            let body = prepared.prefill.clone();
            gw.metrics.prefill_requests.inc();
            let resp = exchange(gw, pick, Leg::Endpoint, &main.base, ctx, body).await?;
            if !resp.status().is_success() {
                // The engine refused the request itself: the client gets its
                // answer, from the prefill endpoint alone.
                if let Some(g) = pick.guard_mut() {
                    g.release_decode();
                }
                return Ok(Connection {
                    response: resp,
                    prefill_cached: None,
                    answered: Some(Leg::Endpoint),
                });
            }
            let answer = read_small(
                resp.into_body(),
                PREFILL_ANSWER_CAP,
                gw.limits.upstream_idle_timeout(),
            )
            .await
            // Cut short (reset, silent): the prefill runs on the next
            // prefill endpoint, as for a stall; nothing reached the client
            // and the decode leg has not started.
            .map_err(|e| refused(Leg::Endpoint, e))?;
            let params = pd::transfer_params(&answer);
            let usage = serde_json::from_slice::<serde_json::Value>(&answer).ok();
            let cached = usage.as_ref().and_then(|v| {
                let c = kvroute::receipt::cached_tokens(v)?;
                Some((c, kvroute::receipt::prompt_tokens(v)))
            });
            ctx.prefill = Some((main.url.clone(), params.clone(), cached));
            // The prefill endpoint is done with this request now, not when
            // the decode endpoint answers (a non-streamed decode answers
            // only after generating).
            if let Some(g) = pick.guard_mut() {
                g.prefill_leg_done();
            }
            (params, cached)
        }
    };
    let body = prepared
        .decode_body(&pick.text_body(&ctx.body), params)
        .await;
    let receipt = settle_receipt(&mut ctx.receipts, &main.url, cached);
    let response = exchange(gw, pick, Leg::Decode, &decode_ep.base, ctx, body).await?;
    Ok(Connection {
        response,
        prefill_cached: Some(receipt),
        answered: None,
    })
}

/// The receipt of a decision whose prefill leg on `url` reported `cached`:
/// that endpoint's first report (see [`Ctx::receipts`]).
fn settle_receipt(
    receipts: &mut Vec<(String, Option<Usage>)>,
    url: &str,
    cached: Option<Usage>,
) -> Option<Usage> {
    if let Some((_, first)) = receipts.iter().find(|(u, _)| u == url) {
        return *first;
    }
    receipts.push((url.to_owned(), cached));
    cached
}

/// Streams the upstream response back; the receipt is recorded at its end
/// and the load charge released then (or when the client goes away).
/// The decision's explanation, when it recorded one, goes into the ring
/// (and the `x-kvroute-explain` header when `explain`); the receipt's
/// settled account joins it there.
fn respond(
    gw: &Arc<Gateway>,
    rt: &Arc<RuleRuntime>,
    conn: Connection,
    mut pick: Pick,
    explain: bool,
) -> Response {
    let (parts, incoming) = conn.response.into_parts();
    let mut prefill_account = None;
    if let Some(cached) = conn.prefill_cached {
        // The two-step's prefill leg answered inside `connect`: the prefill
        // endpoint is done with this request; the decode one stays charged,
        // and the prefill leg's answer is the receipt.
        if let Some(g) = pick.guard_mut() {
            g.prefill_leg_done();
        }
        match cached {
            Some((c, prompt)) => prefill_account = pick.settle(c, prompt).account,
            None => pick.skip_body_receipt(),
        }
    }
    let mut builder = Response::builder().status(parts.status);
    let mut id = None;
    if let Some(h) = builder.headers_mut() {
        super::upstream::copy_headers(&parts.headers, h, false);
        super::observe::drop_engine_decision_headers(h);
        gw.observe.decision(rt, pick.decision(), h);
        id = gw.observe.file(rt, pick.take_explanation(), explain, h);
    }
    if let (Some(id), Some(a)) = (id, prefill_account) {
        gw.observe.ring().settle(id, a);
    }
    let gw2 = Arc::clone(gw);
    let body = pick.into_body_settled(
        &parts.headers,
        IdleTimeout::new(incoming, gw.limits.upstream_idle_timeout()),
        move |r, account| {
            if !r.complete {
                gw2.metrics.aborted_streams.inc();
            }
            if let (Some(id), Some(a)) = (id, account) {
                gw2.observe.ring().settle(id, a);
            }
        },
    );
    builder.body(Body::new(body)).unwrap_or_else(|_| {
        error(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "bad upstream response",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{ambiguous_path, settle_receipt};

    /// The receipt is the first prefill leg's on each prefill endpoint: a
    /// leg run again on the same endpoint, or on one a retry came back to,
    /// finds its own prefill cached and leaves the receipt alone; a leg on
    /// another endpoint (the retry's decision) is that decision's receipt.
    #[test]
    fn the_receipt_is_the_first_leg_of_the_current_prefill_endpoint() {
        let mut r = Vec::new();
        assert_eq!(
            settle_receipt(&mut r, "http://a", Some((0, Some(100)))),
            Some((0, Some(100)))
        );
        assert_eq!(
            settle_receipt(&mut r, "http://a", Some((96, Some(100)))),
            Some((0, Some(100)))
        );
        assert_eq!(
            settle_receipt(&mut r, "http://b", Some((32, Some(100)))),
            Some((32, Some(100)))
        );
        assert_eq!(
            settle_receipt(&mut r, "http://b", None),
            Some((32, Some(100)))
        );
        assert_eq!(
            settle_receipt(&mut r, "http://a", None),
            Some((0, Some(100)))
        );
    }

    #[test]
    fn dot_segments_and_encoded_separators_are_refused() {
        for p in [
            "/v1/../health",
            "/v1/%2e%2e/health",
            "/v1/%2E%2e/x",
            "/v1//../../etc",
            "/v1/./chat/completions",
            "/v1/chat%2fcompletions",
            "/v1/a\\b",
            "/v1//chat/completions",
            "/v1/.%2E/x",
            "/v1/%2e",
            "/v1/chat%5Ccompletions",
        ] {
            assert!(ambiguous_path(p), "{p}");
        }
        for p in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models/",
            "/v1/a.b/..c",
            "/v1/.../x",
            "/v1/%2e%2e%2e",
            "/v1/%2ex",
        ] {
            assert!(!ambiguous_path(p), "{p}");
        }
    }
}
