//! A tower [`Layer`] that routes OpenAI requests with a [`KvRouter`]: the
//! request body is buffered (bounded), the router decides, the inner service
//! (an HTTP client such as hyper-util's) is called with the request
//! re-targeted at the chosen endpoint and awaited with [`crate::Pick::await_headers`]
//! (the router's header timeouts and outlier detection), a failed connect or
//! a stall is retried on the next endpoint with [`crate::Pick::retry`], and
//! the response body becomes a [`ReceiptBody`] (receipt recorded and load
//! released at its end or drop).
//!
//! Two failures are retried, as `kvroute serve` retries them: a connect the
//! inner service reports as failed (hyper-util's connect errors, an I/O
//! error such as `ConnectionRefused` in the error's chain), which the engine
//! never saw, and a stall (no headers within the router's timeout, or the
//! endpoint ejected meanwhile), an engine given up on before it answered.
//! Any other error of the inner service (a reset after the request was
//! sent) comes back to the caller, uncounted by the endpoint's breaker: the
//! engine may have acted on the request, and a generation must not run
//! twice. A response, whatever its status, is the
//! engine's answer and goes to the client. Hop-by-hop headers (RFC 9110
//! §7.6.1, including those a `Connection` header names) cross in neither
//! direction. Requests to paths
//! other than `/v1/completions` and `/v1/chat/completions` carry no prompt:
//! they are routed by the rule's fallback selector and counted as a
//! `no_model` miss.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use kvroute::tower::KvRouteLayer;
//! use tower::{Layer, ServiceExt};
//! # async fn run(router: kvroute::KvRouter) -> Result<(), tower::BoxError> {
//! let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let service = KvRouteLayer::new(router).layer(client);
//! let req = http::Request::post("/v1/completions")
//!     .body(Full::new(Bytes::from_static(br#"{"model": "m", "prompt": "hello"}"#)))?;
//! let response = service.oneshot(req).await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};
use tower::{BoxError, Layer, Service, ServiceExt};

use crate::receipt::ReceiptBody;
use crate::ApiKind;
use crate::{KvRouter, Leg};

/// Default [`KvRouteLayer::max_body_bytes`]: 32 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

/// Wraps an HTTP client service with KV-exact routing; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct KvRouteLayer {
    router: KvRouter,
    max_body_bytes: usize,
}

impl KvRouteLayer {
    /// A layer deciding with `router`.
    #[must_use]
    pub fn new(router: KvRouter) -> Self {
        Self {
            router,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }

    /// Largest request body buffered (larger: an error, nothing forwarded).
    #[must_use]
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }
}

impl<S> Layer<S> for KvRouteLayer {
    type Service = KvRoute<S>;

    fn layer(&self, inner: S) -> KvRoute<S> {
        KvRoute {
            inner,
            router: self.router.clone(),
            max_body_bytes: self.max_body_bytes,
        }
    }
}

/// The service [`KvRouteLayer`] builds.
#[derive(Clone, Debug)]
pub struct KvRoute<S> {
    inner: S,
    router: KvRouter,
    max_body_bytes: usize,
}

/// Why [`KvRoute`] answered no response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvRouteError {
    /// The request body could not be read or exceeded the limit.
    #[error("request body: {0}")]
    Body(BoxError),
    /// No endpoint was available. (When endpoints were tried and every
    /// attempt failed to connect, the last attempt's own error comes back.)
    #[error(transparent)]
    NoEndpoint(#[from] crate::NoEndpoint),
    /// The upstream request could not be built for the chosen endpoint.
    #[error("upstream request: {0}")]
    Build(#[from] http::Error),
    /// The last endpoint sent no response headers in time, or was ejected
    /// by outlier detection while the request waited on it
    /// ([`crate::Pick::await_headers`]).
    #[error(transparent)]
    Stalled(#[from] crate::Stall),
}

fn upstream_request(
    method: &http::Method,
    url: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<http::Request<Full<Bytes>>, http::Error> {
    let mut b = http::Request::builder()
        .method(method.clone())
        .uri(format!("{url}{path_and_query}"));
    if let Some(h) = b.headers_mut() {
        crate::headers::copy_to_engine(headers, h);
        h.insert(header::CONTENT_LENGTH, body.len().into());
    }
    b.body(Full::new(body))
}

/// Whether an error of the inner service says the request never reached
/// the engine (a failed connect), so another endpoint may be tried.
fn never_sent(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind;
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::HostUnreachable
                    | ErrorKind::AddrNotAvailable
            ) {
                return true;
            }
        }
        // hyper-util's legacy client: "client error (Connect)".
        if err.to_string() == "client error (Connect)" {
            return true;
        }
        next = err.source();
    }
    false
}

impl<S, B, RB> Service<http::Request<B>> for KvRoute<S>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    RB: http_body::Body + Send + 'static,
{
    type Response = http::Response<ReceiptBody<RB>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call drives its own clone of the inner service (a retry may
        // call it several times), which checks readiness itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let router = self.router.clone();
        let limit = self.max_body_bytes;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = Limited::new(body, limit)
                .collect()
                .await
                .map_err(KvRouteError::Body)?
                .to_bytes();
            let path_and_query: Arc<str> = parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path(), |p| p.as_str())
                .into();
            let api = if parts.method == http::Method::POST {
                ApiKind::from_path(parts.uri.path())
            } else {
                None
            };
            let mut pick = match api {
                Some(api) => router.pick(api, &bytes).await,
                None => router.pick_unrouted(),
            }
            .map_err(KvRouteError::from)?;
            // The one retry driver: each attempt's wait for headers under the
            // router's header timeouts and outlier detection; a failed
            // connect or a stall moves to the next endpoint.
            let response = loop {
                let upstream = upstream_request(
                    &parts.method,
                    pick.url(),
                    &path_and_query,
                    &parts.headers,
                    pick.upstream_body(&bytes),
                )
                .map_err(KvRouteError::from)?;
                let attempt = inner.clone().oneshot(upstream);
                let failure: BoxError = match pick.await_headers(Leg::Endpoint, attempt).await {
                    Ok(Ok(response)) => break response,
                    Ok(Err(e)) => {
                        let e: BoxError = e.into();
                        if !never_sent(&*e) {
                            // Sent, then failed: the engine may have acted.
                            return Err(e);
                        }
                        e
                    }
                    // An unrouted request that is not idempotent (an upload,
                    // a tool call) may have acted on the engine that took it
                    // and stalled: not sent again, as `kvroute serve`'s
                    // pass-through does.
                    Err(stall) if api.is_none() && !parts.method.is_idempotent() => {
                        return Err(KvRouteError::Stalled(stall).into());
                    }
                    Err(stall) => KvRouteError::Stalled(stall).into(),
                };
                match pick.retry() {
                    Some(next) => {
                        tracing::debug!(%next, error = %failure, "upstream failed; retrying on the next endpoint");
                    }
                    None => return Err(failure),
                }
            };
            pick.connected();
            let (mut head, body) = response.into_parts();
            let upstream = std::mem::take(&mut head.headers);
            crate::headers::copy_end_to_end(&upstream, &mut head.headers, false);
            let body = pick.into_body(&head.headers, body);
            Ok(http::Response::from_parts(head, body))
        })
    }
}
