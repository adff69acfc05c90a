//! Requests that are not completions (`GET /v1/models`, `/v1/embeddings`, ...):
//! forwarded to one available endpoint of the rule without a KV decision, so
//! they never count as KV misses (they are counted as the `passthrough` outcome).
//!
//! The endpoint is the least loaded available one (ties rotate); a connect
//! failure marks the endpoint's breaker and tries the next one, up to the rule's
//! retry budget. An endpoint that took the request and sent no answer within
//! the header timeout is tried again elsewhere only for an idempotent method
//! (`GET`, `HEAD`, ...): the engine may still be running a `POST`, and sending
//! it again would run its work twice; it is a 504. When every attempt failed
//! and one of them timed out, the answer is a 504 too (503 is for endpoints
//! that could not be reached at all).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::Response;
use bytes::Bytes;

use super::metrics::Outcome;
use super::proxy::error;
use super::state::{Gateway, RuleRuntime};
use super::upstream::{copy_headers, response_body};

/// What to forward.
pub struct Forward<'a> {
    /// Client method.
    pub method: Method,
    /// Path and query only (never the client's authority).
    pub path_and_query: &'a str,
    /// Client headers (hop-by-hop ones are dropped by the client).
    pub headers: &'a HeaderMap,
    /// The body read once.
    pub body: Bytes,
    /// The body asks for a stream (`"stream": true`): its headers come at
    /// once, so the stream header timeout applies.
    pub streamed: bool,
}

/// Forwards `req` through `rt` and streams the answer back.
pub async fn forward(gw: &Arc<Gateway>, rt: &Arc<RuleRuntime>, req: Forward<'_>) -> Response {
    let name = rt.spec.doc.name.as_str();
    let attempts = usize::try_from(rt.router.rule().config().thresholds.max_retries)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    let mut failures = Vec::new();
    // An engine took the request and did not answer in time: the gateway
    // gave up on it, which is a 504, not "nothing available".
    let mut timed_out = false;
    let turn = gw.passthrough_turn.fetch_add(1, Ordering::Relaxed) as usize;
    for url in rt.router.available_by_load(turn).into_iter().take(attempts) {
        let Some(ep) = rt.endpoint_by_url(&url) else {
            continue;
        };
        let guard = rt.router.charge_unrouted(&url);
        let wait = if req.streamed {
            gw.limits.stream_header_timeout()
        } else {
            gw.limits.response_header_timeout()
        };
        let sent = gw
            .client
            .send(
                wait,
                &ep.base,
                req.method.clone(),
                req.path_and_query,
                req.headers,
                req.body.clone(),
            )
            .await;
        match sent {
            Ok(resp) => {
                rt.router.record_connect(&url, true);
                rt.counters.outcome(Outcome::Passthrough);
                let (parts, incoming) = resp.into_parts();
                let gw2 = Arc::clone(gw);
                // No KV decision, so no receipt to read: the body is not scanned.
                let on_end: kvroute::receipt::OnReceipt = Box::new(move |r| {
                    if !r.complete {
                        gw2.metrics.aborted_streams.inc();
                    }
                });
                let tee = response_body(
                    incoming,
                    kvroute::receipt::BodyKind::Opaque,
                    gw.limits.upstream_idle_timeout(),
                    guard,
                    on_end,
                );
                let mut builder = Response::builder().status(parts.status);
                if let Some(h) = builder.headers_mut() {
                    copy_headers(&parts.headers, h, false);
                    super::observe::drop_engine_decision_headers(h);
                    super::observe::passthrough_headers(&gw.observe, name, &ep.url, h);
                }
                return builder.body(Body::new(tee)).unwrap_or_else(|_| {
                    error(
                        StatusCode::BAD_GATEWAY,
                        "upstream_error",
                        "bad upstream response",
                    )
                });
            }
            Err(e) if e.is_retryable() && (e.is_connect() || req.method.is_idempotent()) => {
                rt.router.record_connect(&url, false);
                tracing::warn!(rule = %name, endpoint = %ep.url, error = %e,
                    "pass-through attempt failed before any response; trying the next endpoint");
                timed_out |= !e.is_connect();
                failures.push(format!("{}: {e}", ep.url));
            }
            Err(e) if e.is_retryable() => {
                rt.router.record_connect(&url, false);
                rt.counters.outcome(Outcome::UpstreamError);
                tracing::warn!(rule = %name, endpoint = %ep.url, error = %e,
                    "pass-through upstream took the request and did not answer; not sent again");
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    e.to_string(),
                );
            }
            Err(e) => {
                rt.counters.outcome(Outcome::UpstreamError);
                tracing::warn!(rule = %name, endpoint = %ep.url, error = %e,
                    "pass-through upstream failed");
                return error(StatusCode::BAD_GATEWAY, "upstream_error", e.to_string());
            }
        }
    }
    if timed_out {
        rt.counters.outcome(Outcome::UpstreamError);
        return error(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            format!(
                "rule {name:?}: no endpoint answered a pass-through request in time [{}]",
                failures.join("; ")
            ),
        );
    }
    rt.counters.outcome(Outcome::NoEndpoint);
    let why = if failures.is_empty() {
        "every endpoint is admin down or behind an open circuit breaker".to_owned()
    } else {
        failures.join("; ")
    };
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "no_endpoint",
        format!("rule {name:?}: no endpoint available for a pass-through request [{why}]"),
    )
}
