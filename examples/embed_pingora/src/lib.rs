//! kvroute embedded in a [pingora](https://github.com/cloudflare/pingora)
//! proxy: [`KvProxy`] implements pingora's `ProxyHttp` with the phase
//! mapping the `kvroute` crate documents, and [`server`] hosts it.
//!
//! | `ProxyHttp` phase | kvroute call |
//! |---|---|
//! | `request_filter` | buffer the body (bounded), `KvRouter::pick` |
//! | `upstream_peer` | the address of `Pick::url` |
//! | `fail_to_connect` | `Pick::retry`; the error is marked retryable while an endpoint is left |
//! | `connected_to_upstream` | `Pick::connected` |
//! | `upstream_request_filter` / `request_body_filter` | `Pick::upstream_body` (the target's body) |
//! | `response_filter` | `Pick::into_receipt`: the `Pick` becomes the response's `ReceiptTracker` |
//! | `response_body_filter` | `ReceiptTracker::on_chunk` each chunk, `ReceiptTracker::on_end` at `end_of_stream` (the receipt is recorded, the load charge released) |
//!
//! The load charge lives in the request context (in the `Pick`, then in its
//! `ReceiptTracker`), so it also ends when pingora drops the context after
//! `logging`: a failed request or a client that went away records no
//! receipt.
//!
//! Pingora 0.9 has no hook that reads the request body before
//! `upstream_peer` (cloudflare/pingora#780), and a body read in
//! `request_filter` is consumed. What it does resend to every upstream
//! attempt is its retry buffer (64 KiB), through `request_body_filter`.
//! [`KvProxy`] therefore reads the body itself, keeping the retry buffer
//! filled with the body's tail so that pingora makes that call, and replaces
//! the tail with the whole upstream body there. A body whose tail cannot be
//! kept (chunked transfer encoding past 64 KiB) is refused with 413: send it
//! with `Content-Length`.
//!
//! Endpoints are plain `http://` (this example builds pingora without TLS).
//! The router's event subscribers run on a tokio runtime of the host's own
//! (see `main.rs`): pingora owns its service runtimes, so do not enable its
//! daemon mode, whose fork would leave that runtime behind.
#![deny(missing_docs)]

use bytes::{Bytes, BytesMut};
use kvroute::receipt::ReceiptTracker;
use kvroute::{ApiKind, KvRouter, Pick};
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{ProxyHttp, Session};

/// Pingora's request-body retry buffer (`BODY_BUF_LIMIT`, not exported).
const RETRY_BUFFER: usize = 64 << 10;

/// A pingora server listening on `listen` (`host:port`) that routes every
/// request with `router`. Start it with `run_forever()`, or `run(..)` with a
/// shutdown signal of your own.
///
/// ```no_run
/// use kvroute::{Backend, KvRouter};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The router's subscribers run here; pingora's services on its own runtimes.
/// let runtime = tokio::runtime::Runtime::new()?;
/// let router = KvRouter::builder("vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?)
///     .model("Qwen/Qwen3-8B", "/models/qwen3")
///     .endpoint(Backend::vllm("http://10.0.0.7:8000").events("tcp://*:5557"))
///     .endpoint(Backend::vllm("http://10.0.0.8:8000").events("tcp://*:5557"))
///     .spawn_on(runtime.handle().clone())?;
/// kvroute_embed_pingora::server(router, "0.0.0.0:9000")?.run_forever()
/// # }
/// ```
///
/// # Errors
/// Pingora's default configuration cannot be built.
pub fn server(router: KvRouter, listen: &str) -> Result<Server> {
    let mut server = Server::new(None)?;
    server.bootstrap();
    let mut service =
        pingora_proxy::http_proxy_service(&server.configuration, KvProxy::new(router));
    service.add_tcp(listen);
    server.add_service(service);
    Ok(server)
}

/// The proxy: every request is routed by its [`KvRouter`].
pub struct KvProxy {
    router: KvRouter,
    max_body: usize,
}

impl KvProxy {
    /// A proxy over `router`, accepting request bodies up to 32 MiB.
    #[must_use]
    pub fn new(router: KvRouter) -> Self {
        Self {
            router,
            max_body: 32 << 20,
        }
    }
}

/// One request's state across the phases.
#[derive(Default)]
pub struct Ctx {
    body: Bytes,
    pick: Option<Pick>,
    receipt: Option<ReceiptTracker>,
}

impl KvProxy {
    /// Reads the whole body (at most `max_body`), keeping its last
    /// [`RETRY_BUFFER`] bytes in pingora's retry buffer. `None`: too large.
    async fn read_body(&self, session: &mut Session) -> Result<Option<Bytes>> {
        let declared = session
            .req_header()
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.max_body) {
            return Ok(None);
        }
        let mut body = BytesMut::new();
        // Ends: every read either returns bytes (bounded by `max_body`) or None.
        loop {
            if declared.is_none_or(|n| n.saturating_sub(body.len()) <= RETRY_BUFFER) {
                session.enable_retry_buffering();
            }
            match session.read_request_body().await? {
                Some(chunk) if body.len() + chunk.len() > self.max_body => return Ok(None),
                Some(chunk) => body.extend_from_slice(&chunk),
                None => break,
            }
        }
        if !body.is_empty() && session.get_retry_buffer().is_none() {
            return Ok(None);
        }
        Ok(Some(body.freeze()))
    }
}

/// `host:port` of an `http://host:port` endpoint URL.
fn authority(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("http://")?;
    Some(rest.split('/').next().unwrap_or(rest))
}

#[async_trait::async_trait]
impl ProxyHttp for KvProxy {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::default()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let Some(body) = self.read_body(session).await? else {
            session.respond_error(413).await?;
            return Ok(true);
        };
        let pick = match ApiKind::from_path(session.req_header().uri.path()) {
            Some(api) => self.router.pick(api, &body).await,
            None => self.router.pick_unrouted(),
        };
        let Ok(pick) = pick else {
            session.respond_error(503).await?;
            return Ok(true);
        };
        ctx.body = body;
        ctx.pick = Some(pick);
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let pick = ctx
            .pick
            .as_mut()
            .ok_or_else(|| Error::explain(ErrorType::InternalError, "no pick"))?;
        // Ends: each failed endpoint is excluded by `retry`, which gives up
        // once none is left or its retries are spent.
        loop {
            let host = authority(pick.url()).unwrap_or_default().to_owned();
            match tokio::net::lookup_host(&host).await.map(|mut a| a.next()) {
                Ok(Some(addr)) => return Ok(Box::new(HttpPeer::new(addr, false, host))),
                _ if pick.retry().is_some() => {}
                _ => return Error::e_explain(ErrorType::ConnectNoRoute, "no endpoint resolves"),
            }
        }
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if ctx.pick.as_mut().and_then(Pick::retry).is_some() {
            e.set_retry(true);
        }
        e
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        _reused: bool,
        _peer: &HttpPeer,
        _fd: std::os::unix::io::RawFd,
        _digest: Option<&pingora_core::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(pick) = &ctx.pick {
            pick.connected();
        }
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let Some(pick) = &ctx.pick {
            if !ctx.body.is_empty() {
                let len = pick.upstream_body(&ctx.body).len();
                req.remove_header(&http::header::TRANSFER_ENCODING);
                req.insert_header(http::header::CONTENT_LENGTH, len.to_string())?;
            }
            req.insert_header(
                http::header::HOST,
                authority(pick.url()).unwrap_or_default(),
            )?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // `body` is the retry buffer's tail; the target gets its own body.
        if let (Some(pick), false) = (&ctx.pick, ctx.body.is_empty()) {
            *body = end_of_stream.then(|| pick.upstream_body(&ctx.body));
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // A `100 Continue` is not the answer: its headers say nothing of the body.
        if resp.status.is_informational() {
            return Ok(());
        }
        if let Some(pick) = ctx.pick.take() {
            resp.insert_header("x-kvroute-endpoint", pick.url())?;
            ctx.receipt = Some(pick.into_receipt(&resp.headers));
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<std::time::Duration>> {
        if let Some(receipt) = ctx.receipt.as_mut() {
            receipt.on_chunk(body.as_deref().unwrap_or_default());
            if end_of_stream {
                receipt.on_end();
            }
        }
        Ok(None)
    }
}
