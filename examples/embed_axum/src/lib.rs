//! kvroute embedded in an axum proxy: the whole integration is [`app`] (the
//! handler) and [`router`] (the builder). Everything else is axum and hyper.
//!
//! The proxy buffers the request body, asks the router where it goes,
//! forwards it with hyper's client (retrying on the next endpoint when a
//! connect fails, or when the router gives up waiting for headers: its
//! header timeouts and outlier detection), and streams the answer back through the router's receipt
//! body, which records the engine's `cached_tokens` and ends the request's
//! load charge when the body ends or the client goes away. The chosen
//! endpoint is echoed in `x-kvroute-endpoint`.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvroute::{ApiKind, Backend, KvRouter};

/// A router for `contract` over `endpoints` (`URL[,EVENTS[,REPLAY]]`, the
/// engine's own `--kv-events-config` endpoints), tokenizing `model` with the
/// tokenizer and chat template in `dir`. Must run inside a tokio runtime.
///
/// # Errors
/// The contract or an endpoint cannot be used.
pub fn router(
    contract: &str,
    model: &str,
    dir: &str,
    endpoints: &[String],
) -> Result<KvRouter, Box<dyn std::error::Error>> {
    let mut b = KvRouter::builder(contract.parse()?).model(model, dir);
    for e in endpoints {
        let mut parts = e.split(',');
        let mut backend = Backend::vllm(parts.next().unwrap_or_default());
        if let Some(events) = parts.next() {
            backend = backend.events(events);
        }
        if let Some(replay) = parts.next() {
            backend = backend.replay(replay);
        }
        b = b.endpoint(backend);
    }
    Ok(b.spawn()?)
}

/// Serves `app` on `listener` with TCP_NODELAY on every accepted
/// connection (see [`app`]).
///
/// # Errors
/// The listener fails.
pub async fn serve(listener: tokio::net::TcpListener, app: axum::Router) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}

#[derive(Clone)]
struct App {
    router: KvRouter,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// The proxy: every `/v1/...` request is routed by `router`.
pub fn app(router: KvRouter) -> axum::Router {
    // Streamed answers are many small writes: without TCP_NODELAY, Nagle's
    // algorithm and the peer's delayed ACK hold each one up to ~40 ms.
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(connector);
    axum::Router::new()
        .fallback(proxy)
        .with_state(App { router, client })
}

async fn proxy(State(app): State<App>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 32 << 20).await else {
        return StatusCode::PAYLOAD_TOO_LARGE.into_response();
    };
    let pick = match ApiKind::from_path(parts.uri.path()) {
        Some(api) => app.router.pick(api, &body).await,
        None => app.router.pick_unrouted(),
    };
    let Ok(mut pick) = pick else {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    let upstream_body = pick.upstream_body(&body);
    loop {
        let mut upstream = hyper::Request::new(Full::new(upstream_body.clone()));
        *upstream.method_mut() = parts.method.clone();
        *upstream.uri_mut() = match format!("{}{}", pick.url(), parts.uri).parse() {
            Ok(uri) => uri,
            Err(_) => return StatusCode::BAD_REQUEST.into_response(),
        };
        if let Some(ct) = parts.headers.get("content-type") {
            upstream.headers_mut().insert("content-type", ct.clone());
        }
        // The wait for headers under the router's header timeouts and
        // outlier detection: a stall is retried like a failed connect.
        let answer = pick
            .await_headers(kvroute::Leg::Endpoint, app.client.request(upstream))
            .await;
        match answer {
            Ok(Ok(resp)) => {
                pick.connected();
                let (mut head, incoming) = resp.into_parts();
                if let Ok(v) = pick.url().parse() {
                    head.headers.insert("x-kvroute-endpoint", v);
                }
                let body = pick.into_body(&head.headers, incoming);
                return Response::from_parts(head, Body::new(body));
            }
            Ok(Err(_)) | Err(_) if pick.retry().is_some() => {}
            Ok(Err(_)) | Err(_) => return StatusCode::BAD_GATEWAY.into_response(),
        }
    }
}
