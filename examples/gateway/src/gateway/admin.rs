//! The admin REST API (loopback by default; bearer token when configured):
//!
//! | method | path | |
//! |---|---|---|
//! | GET | `/admin/rules` | every rule document |
//! | GET | `/admin/rules/{name}` | one rule document |
//! | POST | `/admin/rules` | create (409 if the name exists) |
//! | PUT | `/admin/rules/{name}` | create or replace |
//! | DELETE | `/admin/rules/{name}` | remove |
//! | PUT | `/admin/rules/{name}/endpoints/{i}/admin` | `{"down": bool}` drain / restore |
//! | GET | `/admin/endpoints` | endpoints with subscriber health, inventory size, contract status |
//! | GET | `/admin/counters` | per-rule decision and delivery counters, replica sharing |
//! | GET | `/admin/decisions/{id}` | why decision `id` (a response's `x-kvroute-decision-id`) went where it did |
//! | GET | `/metrics` | Prometheus (no token needed: loopback scrape) |
//! | GET | `/healthz` | liveness: 200 while the process serves (no token) |
//! | GET | `/readyz` | readiness: 200 once every tokenizer loaded, 503 before and while shutting down; per rule its live subscribers and verified contracts (no token) |
//!
//! `docs/admin.md` is the reference with example outputs.
//! A posted rule starts its runtime at once (event followers keep retrying
//! until the engine is up). Invalid documents get 400 with the field at
//! fault.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use kvroute::engine::Stream;
use kvroute_select::{BreakerState, MissReason};
use serde_json::{json, Value};

use super::config::{rule_from_json, ConfigError};
use super::metrics::render;
use super::observe::TokenizerState;
use super::proxy::error;
use super::state::Gateway;

/// The admin router.
pub fn router(gw: Arc<Gateway>) -> Router {
    let admin = Router::new()
        .route("/admin/rules", get(list_rules).post(create_rule))
        .route(
            "/admin/rules/{name}",
            get(get_rule).put(put_rule).delete(delete_rule),
        )
        .route(
            "/admin/rules/{name}/endpoints/{index}/admin",
            put(set_admin),
        )
        .route("/admin/endpoints", get(endpoints))
        .route("/admin/counters", get(counters))
        .route("/admin/decisions/{id}", get(decision))
        .layer(middleware::from_fn_with_state(Arc::clone(&gw), auth));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(admin)
        .with_state(gw)
}

/// Equal-time comparison, so the token cannot be guessed byte by byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    if let Some(token) = &gw.admin_token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
            let mut resp = error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required",
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return resp;
        }
    }
    next.run(req).await
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    (
        [(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)],
        render(&gw),
    )
        .into_response()
}

async fn healthz() -> Response {
    Json(json!({"status": "live"})).into_response()
}

/// Ready means the proxy routes: every staged tokenizer has loaded. Engines
/// being down does not make the gateway unready (their rules fall back or
/// answer 503 per request), so subscribers and contracts are reported, not
/// required.
async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    let tokenizers: serde_json::Map<String, Value> = gw
        .observe
        .tokenizers()
        .into_iter()
        .map(|(m, s)| {
            let v = match &s {
                TokenizerState::Failed(e) => json!({"state": s.as_str(), "error": e}),
                _ => json!({"state": s.as_str()}),
            };
            (m, v)
        })
        .collect();
    let all_loaded = tokenizers
        .values()
        .all(|v| v["state"] == TokenizerState::Loaded.as_str());
    let rules: Vec<Value> = gw
        .rules_snapshot()
        .iter()
        .map(|rt| {
            let r = rt.router.readiness();
            let mut statuses = serde_json::Map::new();
            for e in rt.router.endpoint_statuses() {
                let n = statuses
                    .get(e.contract_status)
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                statuses.insert(e.contract_status.to_owned(), json!(n + 1));
            }
            json!({
                "rule": rt.spec.doc.name,
                "models": rt.spec.doc.models,
                "contract": rt.spec.contract.as_ref().map(ToString::to_string),
                "endpoints": r.endpoints,
                "endpoints_available": r.endpoints_available,
                "subscribers": r.followers,
                "subscribers_connected": r.followers_connected,
                "contract_status": statuses,
            })
        })
        .collect();
    // `routing`: the proxy has stopped answering 503 not_ready (every load
    // finished); `ready` also needs every load to have succeeded.
    let routing = gw.observe.is_ready();
    let draining = gw.observe.is_draining();
    let ready = routing && all_loaded && !draining;
    let body = json!({
        "ready": ready,
        "routing": routing,
        "draining": draining,
        "tokenizers": tokenizers,
        "requests_refused_before_ready": gw.observe.refused_not_ready(),
        "rules": rules,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

fn bad(e: &ConfigError) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_rule", e.to_string())
}

async fn list_rules(State(gw): State<Arc<Gateway>>) -> Response {
    let docs: Vec<_> = gw
        .rules_snapshot()
        .iter()
        .map(|r| r.spec.doc.clone())
        .collect();
    Json(json!({ "rules": docs })).into_response()
}

async fn get_rule(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    match gw.rule(&name) {
        Some(r) => Json(&r.spec.doc).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no rule {name:?}"),
        ),
    }
}

async fn create_rule(State(gw): State<Arc<Gateway>>, body: Bytes) -> Response {
    let spec = match rule_from_json(&body) {
        Ok(s) => s,
        Err(e) => return bad(&e),
    };
    if gw.rule(&spec.doc.name).is_some() {
        return error(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "rule {:?} already exists (use PUT to replace it)",
                spec.doc.name
            ),
        );
    }
    let name = spec.doc.name.clone();
    match gw.put_rule(spec, false) {
        Ok(_) => {
            tracing::info!(rule = %name, "rule created");
            (StatusCode::CREATED, Json(json!({"created": name}))).into_response()
        }
        Err(e) => bad(&e),
    }
}

async fn put_rule(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let spec = match rule_from_json(&body) {
        Ok(s) => s,
        Err(e) => return bad(&e),
    };
    if spec.doc.name != name {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_rule",
            format!(
                "rule.name {:?} differs from the path's {name:?}",
                spec.doc.name
            ),
        );
    }
    match gw.put_rule(spec, true) {
        Ok(true) => {
            tracing::info!(rule = %name, "rule replaced");
            Json(json!({"replaced": name})).into_response()
        }
        Ok(false) => {
            tracing::info!(rule = %name, "rule created");
            (StatusCode::CREATED, Json(json!({"created": name}))).into_response()
        }
        Err(e) => bad(&e),
    }
}

async fn delete_rule(State(gw): State<Arc<Gateway>>, Path(name): Path<String>) -> Response {
    if gw.delete_rule(&name) {
        tracing::info!(rule = %name, "rule deleted");
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no rule {name:?}"),
        )
    }
}

async fn set_admin(
    State(gw): State<Arc<Gateway>>,
    Path((name, index)): Path<(String, usize)>,
    body: Bytes,
) -> Response {
    let Some(rt) = gw.rule(&name) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no rule {name:?}"),
        );
    };
    let Some(ep) = rt.endpoint(index) else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("rule {name:?} has no endpoint {index}"),
        );
    };
    let Some(down) = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("down").and_then(Value::as_bool))
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "expected {\"down\": true|false}",
        );
    };
    let url = ep.url.clone();
    rt.router.set_admin_down(&url, down);
    // A PUT of the rule may have replaced its runtime meanwhile, copying the
    // drains before this one: the replacement gets it too (bounded: each pass
    // follows one replacement).
    let mut applied = rt;
    for _ in 0..8 {
        match gw.rule(&name) {
            Some(now) if !Arc::ptr_eq(&now, &applied) => {
                now.router.set_admin_down(&url, down);
                applied = now;
            }
            _ => break,
        }
    }
    tracing::info!(rule = %name, endpoint = %url, index, down,
        "{}", if down { "endpoint drained (admin down)" } else { "endpoint restored (admin up)" });
    Json(json!({"endpoint": url, "down": down})).into_response()
}

fn breaker_label(s: BreakerState) -> &'static str {
    match s {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half_open",
    }
}

async fn endpoints(State(gw): State<Arc<Gateway>>) -> Response {
    let mut out = Vec::new();
    for rt in gw.rules_snapshot() {
        for st in rt.router.endpoint_statuses() {
            let Some(ep) = rt.endpoint_by_url(&st.url) else {
                continue;
            };
            out.push(endpoint_json(&rt, ep, &st));
        }
    }
    Json(json!({ "endpoints": out })).into_response()
}

fn load_json(l: kvroute_select::EndpointLoad) -> Value {
    json!({"in_flight": l.in_flight, "queued_prefill_tokens": l.queued_prefill_tokens})
}

fn endpoint_json(
    rt: &super::state::RuleRuntime,
    ep: &super::config::EndpointSpec,
    st: &kvroute::EndpointStatus,
) -> Value {
    let subscribers: Vec<Value> = st
        .followers
        .iter()
        .map(|f| {
            let s = &f.metrics;
            match &f.stream {
                Stream::Drain(d) => json!({
                    "transport": "trtllm_drain",
                    "rank": Value::Null, "address": d.url, "replay": Value::Null,
                    "connected": s.connected, "last_seq": s.last_seq,
                    "events_applied": s.events_applied, "gaps": s.gaps, "clears": s.clears,
                    "restarts": s.restarts, "decode_errors": s.decode_errors,
                    "polls": s.polls, "poll_failures": s.poll_failures,
                    "malformed_events": s.decode.malformed_events,
                    "unknown_event_types": s.decode.unknown_event_tags,
                    "smaller_window_events": s.decode.smaller_window_events,
                    "untracked_offloaded_blocks": s.decode.untracked_offloaded_blocks,
                }),
                other => {
                    let (transport, replay) = match other {
                        Stream::Zmq(z) => ("zmq", z.replay.clone()),
                        _ => ("engine", None),
                    };
                    json!({
                        "transport": transport,
                        "rank": other.rank(), "address": other.address(), "replay": replay,
                        "connected": s.connected, "last_seq": s.last_seq,
                        "events_applied": s.events_applied, "gaps": s.gaps, "clears": s.clears,
                        "restarts": s.restarts, "decode_errors": s.decode_errors,
                        "dial_failures": s.dial_failures, "replays_requested": s.replays_requested,
                        "malformed_frames": s.malformed_frames,
                        "oversized_frames": s.oversized_frames,
                        "malformed_events": s.decode.malformed_events,
                        "unknown_event_types": s.decode.unknown_event_tags,
                        "last_rejected_seq": s.last_rejected_seq,
                    })
                }
            }
        })
        .collect();
    let ev = st.evidence;
    // Per endpoint: one engine on another seed must not mark the others.
    let contract = if ev.drift_alarm {
        "drift_alarm"
    } else {
        st.contract_status
    };
    let missing = match st.completeness {
        kvroute_ingest::Completeness::Partial { missing_batches } => missing_batches,
        _ => 0,
    };
    let (seq, ingest, att) = (&st.seq, &st.ingest, &st.attestation);
    json!({
        "rule": rt.spec.doc.name,
        "index": st.slot,
        "url": ep.url,
        "role": st.role.as_str(),
        "engine": ep.engine.name(),
        "available": st.available,
        "admin_down": st.admin_down,
        "breaker": breaker_label(st.breaker),
        "ejected": st.outlier.ejected,
        "outlier": {
            "ejected_for_ms": u64::try_from(st.outlier.ejected_for.as_millis()).unwrap_or(u64::MAX),
            "ejections": st.outlier.ejections,
            "stall_ejections": st.outlier.stall_ejections,
            "waiting_for_headers": st.outlier.waiting,
            "consecutive_timeouts": st.outlier.consecutive_timeouts,
        },
        "probe_ok": st.probe_ok,
        "in_flight": st.local.in_flight,
        "queued_prefill_tokens": st.local.queued_prefill_tokens,
        "remote_in_flight": st.remote.map(|r| r.in_flight),
        "remote_queued_prefill_tokens": st.remote.map(|r| r.queued_prefill_tokens),
        "load": {
            "in_flight": st.load.in_flight,
            "queued_prefill_tokens": st.load.queued_prefill_tokens,
            "engine_reported": st.engine_report.map(|r| json!({
                "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                "kv_capacity_blocks": r.kv_capacity_blocks,
                "prefill_tokens": r.prefill.map(|p| p.tokens),
                "prefill_seconds": r.prefill.map(|p| p.seconds),
            })),
            "engine_load_polls": st.load_polls,
        },
        "own_load": load_json(st.local),
        "inventory_blocks": st.inventory_blocks,
        "inventory_clears": st.inventory_clears,
        "inventory_status": st.completeness.as_str(),
        "inventory_missing_batches": missing,
        "inventory_capacity_blocks": st.capacity_blocks,
        "contract_mismatch_cause": st.mismatch_cause,
        "attestation": {
            "verified_blocks": att.verified_blocks,
            "mismatched_blocks": att.mismatched_blocks,
            "unverifiable_events": att.unverifiable_events,
        },
        "ingest": {
            "replays_late": ingest.replays_late,
            "replays_incomplete": ingest.replays_incomplete,
            "partial_episodes": ingest.partial_episodes,
            "implausible_batches": seq.implausible,
            "rekey_map_full": ingest.rekey_map_full,
            "reconnects": seq.reconnects,
            "near_reconnects": seq.near_reconnects,
            "resumes": seq.resumes,
            "resumes_verified": seq.resumes_verified,
            "resume_restarts": seq.resume_restarts,
            "restarts": seq.restarts,
            "key_mode": if st.contract_status == "rekeyed" { "rekey" } else { "engine" },
            "rekey_orphan_blocks": ingest.rekey_orphan_blocks,
            "rekey_untokenized_blocks": ingest.rekey_untokenized_blocks,
            "remove_unmapped": ingest.remove_unmapped,
        },
        "contract": rt.spec.contract.as_ref().map(ToString::to_string),
        "contract_status": contract,
        "subscribers": subscribers,
        "hits": ev.hits,
        "receipts": ev.receipts,
        "predicted_cached_tokens": ev.predicted_tokens,
        "delivered_cached_tokens": ev.delivered_tokens,
        "reachable_cached_tokens": ev.reachable_tokens,
        "achieved_cached_tokens": ev.achieved_tokens,
        "lost_cached_tokens": kvroute_select::LostCause::ALL
            .iter()
            .map(|c| (c.as_str().to_owned(), json!(ev.lost_to(*c))))
            .collect::<serde_json::Map<String, Value>>(),
    })
}

/// One of the last `[decisions] ring` decisions, explained; 404 once it left
/// the ring (or when the ring keeps none).
async fn decision(State(gw): State<Arc<Gateway>>, Path(id): Path<String>) -> Response {
    let found = id
        .parse::<u64>()
        .ok()
        .and_then(|i| gw.observe.ring().get(i));
    match found {
        Some(v) => Json(v).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "decision {id} is not among the last {} kept ([decisions] ring)",
                gw.observe.ring().capacity()
            ),
        ),
    }
}

async fn counters(State(gw): State<Arc<Gateway>>) -> Response {
    let mut rules = serde_json::Map::new();
    for rt in gw.rules_snapshot() {
        let s = rt.router.counters();
        let misses: serde_json::Map<String, Value> = MissReason::ALL
            .iter()
            .map(|r| (r.as_str().to_owned(), json!(s.misses_for(*r))))
            .collect();
        let name = rt.spec.doc.name.clone();
        // This rule instance's, as every other figure here.
        let tiers: serde_json::Map<String, Value> = rt
            .tiers
            .counts()
            .map(|(t, n)| (t.to_owned(), json!(n)))
            .collect();
        rules.insert(
            name,
            json!({
                "decisions": s.decisions,
                "tiers": tiers,
                "misses": misses,
                "session_affinity": s.session_affinity,
                "trie_affinity": s.trie_affinity,
                "fallbacks": s.fallbacks,
                "retries": s.retries,
                "exhausted": s.exhausted,
                "load_diversions": s.load_diversions,
                // Requests held for their turn in a burst, and their holds
                // summed (µs).
                "held": s.held,
                "held_us": s.held_us,
                // Tokens/s per unit of capacity the cost scorer's queues
                // drain at (null: not measured yet, or no drain model).
                "prefill_rate": rt.router.rule().prefill_rate().map(|r| json!({
                    "tracked": r.tracked, "engine_reported": r.reported, "used": r.used,
                })),
                "predicted_blocks": s.predicted_blocks,
                "drift_alarms_raised": s.drift_alarms_raised,
                "implausible_receipts": s.implausible_receipts,
                "replicas": rt.router.replica_counters(),
                "hits": s.endpoints.iter().map(|e| e.hits).collect::<Vec<_>>(),
            }),
        );
    }
    Json(json!({
        "rules": rules,
        "tokenize": gw.tokenize_admission.snapshot(),
        "nats": gw.replicas.as_ref().map(|(n, _)| n.counters()),
    }))
    .into_response()
}
