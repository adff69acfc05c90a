//! The upstream side: an HTTP/1 client that only ever talks to configured
//! endpoints, request rewriting (hop-by-hop headers dropped, `Host` set to the
//! upstream), and the response body: streamed through unbuffered under an idle
//! limit, the engine's cached-token receipt read by the library's
//! [`ReceiptBody`].

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue, HOST};
use hyper::{Method, Request, Response, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute::receipt::{BodyKind, OnReceipt, ReceiptBody};

/// Error type of bodies handed to the client.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// TCP connect refused, unreachable or timed out: safe to retry elsewhere
    /// (nothing reached the engine).
    #[error("connect failed: {0}")]
    Connect(String),
    /// The exchange failed after connecting (reset, malformed response).
    #[error("upstream request failed: {0}")]
    Request(String),
    /// No response headers within the response-header timeout: the engine
    /// holds the request (a hung or overloaded engine). Nothing reached the
    /// client yet, so another endpoint may be tried.
    #[error("no response headers within {0:?}")]
    HeaderTimeout(Duration),
    /// The router gave up waiting for the response headers (its
    /// response-header or streamed-header timeout, or outlier detection
    /// ejected the endpoint meanwhile): nothing reached the client, so
    /// another endpoint may be tried.
    #[error("{0}")]
    Stalled(kvroute::Stall),
    /// The request could not be built.
    #[error("bad upstream request: {0}")]
    Build(String),
    /// An answer the gateway reads itself (a P/D prefill leg's) failed or
    /// went silent before its end: nothing reached the client, so another
    /// endpoint may be tried.
    #[error("answer cut short: {0}")]
    AnswerCut(String),
}

impl UpstreamError {
    /// The connection could not be made: the endpoint never saw the request.
    #[must_use]
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }

    /// Whether another endpoint may be tried: nothing reached the client,
    /// and the engine either never got the request (connect) or is given up
    /// on before it answered.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect(_)
                | UpstreamError::HeaderTimeout(_)
                | UpstreamError::Stalled(_)
                | UpstreamError::AnswerCut(_)
        )
    }
}

/// The pooled upstream client.
#[derive(Clone, Debug)]
pub struct UpstreamClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Copies end-to-end headers ([`kvroute::headers::copy_end_to_end`]).
pub use kvroute::headers::copy_end_to_end as copy_headers;

impl UpstreamClient {
    /// A client with a TCP connect timeout and how long an idle connection
    /// is kept for reuse (each request says how long it waits for headers).
    #[must_use]
    pub fn new(connect_timeout: Duration, pool_idle: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(pool_idle)
            .build(connector);
        Self { client }
    }

    /// Sends `body` to `base` + `path_and_query` and waits up to `wait`
    /// for the answer's headers (the response-header timeout, or a streamed
    /// request's shorter one). Only the configured `base` decides where the
    /// request goes: the client's `Host` and any absolute URI were
    /// discarded before. The engine is asked for an uncompressed answer
    /// ([`kvroute::headers::copy_to_engine`]).
    ///
    /// # Errors
    /// [`UpstreamError`]; `Connect` means nothing reached the engine.
    pub async fn send(
        &self,
        wait: Duration,
        base: &Uri,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let sent = tokio::time::timeout(
            wait,
            self.request(base, method, path_and_query, headers, body),
        )
        .await;
        sent.unwrap_or(Err(UpstreamError::HeaderTimeout(wait)))
    }

    /// [`UpstreamClient::send`] without a limit of its own on the wait for
    /// headers: for a request whose wait the router's
    /// [`kvroute::Pick::await_headers`] bounds.
    ///
    /// # Errors
    /// [`UpstreamError`]; `Connect` means nothing reached the engine.
    pub async fn request(
        &self,
        base: &Uri,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let authority = base
            .authority()
            .ok_or_else(|| UpstreamError::Build("endpoint has no authority".into()))?;
        let uri = Uri::builder()
            .scheme("http")
            .authority(authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| UpstreamError::Build(e.to_string()))?;
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .body(Full::new(body))
            .map_err(|e| UpstreamError::Build(e.to_string()))?;
        kvroute::headers::copy_to_engine(headers, req.headers_mut());
        if let Ok(h) = HeaderValue::from_str(authority.as_str()) {
            req.headers_mut().insert(HOST, h);
        }
        self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                // hyper-util's own text ("client error (Connect)") repeats
                // what `Connect` already says: start at its cause.
                let cause =
                    std::error::Error::source(&e).map_or_else(|| e.to_string(), error_chain);
                UpstreamError::Connect(cause)
            } else {
                UpstreamError::Request(error_chain(&e))
            }
        })
    }
}

/// `e: source: source...` without secrets (errors carry no headers or bodies).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Reads a whole (small) upstream body, e.g. the P/D prefill answer.
///
/// # Errors
/// Over `limit` bytes, an upstream read error, or silence beyond `idle`.
pub async fn read_small(
    body: Incoming,
    limit: usize,
    idle: Duration,
) -> Result<Bytes, UpstreamError> {
    match tokio::time::timeout(idle, Limited::new(body, limit).collect()).await {
        Ok(Ok(c)) => Ok(c.to_bytes()),
        // Another engine would answer as much: not worth another try.
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(UpstreamError::Request(e.to_string()))
        }
        Ok(Err(e)) => Err(UpstreamError::AnswerCut(e.to_string())),
        Err(_) => Err(UpstreamError::AnswerCut(format!(
            "not complete within {idle:?}"
        ))),
    }
}

/// An upstream body with an idle limit: silence beyond `idle` between two
/// frames ends it with an error (a hung engine must not hold the client, the
/// connection and the request's load charge forever).
pub struct IdleTimeout<B> {
    inner: B,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<B> IdleTimeout<B> {
    /// Wraps `inner`; the clock starts now.
    #[must_use]
    pub fn new(inner: B, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl<B> HttpBody for IdleTimeout<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + std::fmt::Display,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let deadline = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(deadline);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!(error = %e, "upstream body failed mid-stream");
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if this.timer.as_mut().poll(cx).is_ready() {
                    tracing::warn!("upstream body idle beyond the limit; aborting");
                    return Poll::Ready(Some(Err("upstream idle timeout".into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The body the client gets: the upstream's frames, unbuffered, under the
/// idle limit, through the library's [`ReceiptBody`] (usage scanned per
/// `kind`, the first byte marked on `guard`, `on_end` called once and the
/// guard released when the body ends, fails or is dropped).
pub fn response_body(
    inner: Incoming,
    kind: BodyKind,
    idle: Duration,
    guard: Option<kvroute_select::LoadGuard>,
    on_end: OnReceipt,
) -> ReceiptBody<IdleTimeout<Incoming>> {
    ReceiptBody::new(IdleTimeout::new(inner, idle), kind, guard, on_end)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures_util::StreamExt as _;
    use http_body_util::StreamBody;
    use kvroute::receipt::Receipt;
    use kvroute_core::EndpointId;
    use kvroute_select::{Load as _, LoadTracker, Target};

    use super::*;

    /// An engine that sends its first chunk and then nothing: the idle
    /// limit ends the body with an error, the receipt body reports it
    /// incomplete (no receipt even though a usage line passed) and the load
    /// charge is released; a body that keeps talking is never cut.
    #[tokio::test]
    async fn a_silent_upstream_is_cut_and_its_charge_released() {
        let usage =
            r#"data: {"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let first = Bytes::from(format!("{usage}\n\n"));
        let frames =
            futures_util::stream::iter([Ok::<_, std::convert::Infallible>(Frame::data(first))])
                .chain(futures_util::stream::pending());
        let tracker = Arc::new(LoadTracker::new(1));
        let target = Target {
            endpoint: EndpointId(0),
            decode: None,
        };
        let (tx, rx) = std::sync::mpsc::channel::<Receipt>();
        let body = ReceiptBody::new(
            IdleTimeout::new(StreamBody::new(frames), Duration::from_millis(100)),
            BodyKind::Sse,
            Some(tracker.charge(target, 100)),
            Box::new(move |r| tx.send(r).unwrap()),
        );
        assert_eq!(tracker.load(EndpointId(0)).in_flight, 1);
        // Bounded: without the idle limit the body would wait forever.
        let collected = tokio::time::timeout(Duration::from_secs(30), body.collect())
            .await
            .expect("the idle limit cut the body");
        assert!(
            collected.is_err(),
            "the idle limit ends the body with an error"
        );
        assert_eq!(
            rx.try_recv().unwrap(),
            Receipt {
                cached_tokens: None,
                prompt_tokens: None,
                complete: false
            }
        );
        assert_eq!(tracker.load(EndpointId(0)).in_flight, 0);
        assert_eq!(tracker.load(EndpointId(0)).queued_prefill_tokens, 0);

        // Each frame re-arms the limit: gaps under it pass even when the whole
        // body takes longer than it (10 × 150 ms under a 1 s limit).
        let slow = futures_util::stream::iter(0..10).then(|i| async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(format!("chunk {i}\n"))))
        });
        let body = IdleTimeout::new(StreamBody::new(Box::pin(slow)), Duration::from_secs(1));
        let bytes = body.collect().await.unwrap().to_bytes();
        let want: String = (0..10).map(|i| format!("chunk {i}\n")).collect();
        assert_eq!(&bytes[..], want.as_bytes());
    }

    #[test]
    fn hop_by_hop_and_connection_listed_headers_are_dropped() {
        let mut from = HeaderMap::new();
        from.insert(
            "connection",
            HeaderValue::from_static("x-secret-hop, keep-alive"),
        );
        from.insert("x-secret-hop", HeaderValue::from_static("1"));
        from.insert("host", HeaderValue::from_static("evil.example"));
        from.insert("authorization", HeaderValue::from_static("Bearer k"));
        let mut to = HeaderMap::new();
        copy_headers(&from, &mut to, true);
        assert!(to.get("x-secret-hop").is_none());
        assert!(to.get("host").is_none());
        assert!(to.get("connection").is_none());
        assert_eq!(to.get("authorization").unwrap(), "Bearer k");
    }
}
