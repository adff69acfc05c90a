//! A hold between the gateway and each mock engine, so that a wave's placement
//! does not depend on this machine's speed.
//!
//! The gateway charges an endpoint when it decides and ends the prefill part
//! of that charge at the engine's first byte. If the engines answered while a
//! wave was still being decided, whether an earlier request's short cached
//! prefill had ended before the next decision would be a race, and near-ties
//! between endpoints holding the same tenant would go either way from run to
//! run. Held here, every completion the gateway forwards waits until the demo
//! has seen the whole wave decided; then each engine gets its requests in
//! decision order, one after the engine admitted the previous, as if the wave
//! had arrived at once. Everything else (health probes) passes straight through.
//!
//! The holds listen on fixed loopback ports when those are free: CHWBL's ring
//! is seeded by the endpoint URLs, so ephemeral ports would give it a
//! different ring, and a different placement, in every run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use tokio::sync::{oneshot, watch};

/// Largest request body forwarded (the demo's chats are a few KiB).
const MAX_BODY: usize = 16 << 20;

/// First ports tried for the holds (`base + engine`), in order; ephemeral
/// ports if every range is taken.
const PORT_BASES: [u16; 4] = [47_300, 48_300, 49_300, 50_300];

/// A completion waiting for its wave's release: the engine it is for, and
/// where to send the channel on which it reports that the engine admitted it.
struct Held {
    engine: usize,
    go: oneshot::Sender<oneshot::Sender<()>>,
}

struct Shared {
    held: Mutex<Vec<Held>>,
    /// Completions held since the last release.
    count: watch::Sender<usize>,
    /// When an engine last admitted a request of the current wave.
    last_admitted: Mutex<Option<Instant>>,
    client: reqwest::Client,
}

struct Front {
    engine: usize,
    base: String,
    shared: Arc<Shared>,
}

/// The holds in front of a fleet; dropping it stops them.
pub struct Hold {
    shared: Arc<Shared>,
    /// Address the gateway uses for each engine, in engine order.
    pub fronts: Vec<SocketAddr>,
    servers: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

impl Hold {
    /// One hold per engine HTTP address, on fixed loopback ports if free.
    pub async fn start(engines: &[SocketAddr]) -> anyhow::Result<Self> {
        let shared = Arc::new(Shared {
            held: Mutex::new(Vec::new()),
            count: watch::channel(0).0,
            last_admitted: Mutex::new(None),
            client: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()?,
        });
        let listeners = listeners(engines.len()).await?;
        let mut fronts = Vec::with_capacity(engines.len());
        let mut servers = Vec::with_capacity(engines.len());
        for ((engine, addr), listener) in engines.iter().enumerate().zip(listeners) {
            let front = Arc::new(Front {
                engine,
                base: format!("http://{addr}"),
                shared: Arc::clone(&shared),
            });
            let app = axum::Router::new().fallback(pass).with_state(front);
            fronts.push(listener.local_addr()?);
            // As the engines do: without it each streamed chunk after the
            // headers waits for the gateway's delayed ACK (~40 ms on Linux).
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            servers.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::warn!(error = %e, "demo hold stopped");
                }
            }));
        }
        Ok(Self {
            shared,
            fronts,
            servers,
        })
    }

    /// Waits until `n` completions are held, or fails if `sent` (the requests
    /// sent so far) ended before getting here — the gateway answered them
    /// without an engine — or nothing arrives within 10 s.
    pub async fn wait_held<T>(
        &self,
        n: usize,
        sent: &[tokio::task::JoinHandle<T>],
    ) -> anyhow::Result<()> {
        let mut count = self.shared.count.subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        // Bounded: one pass per change of the count or per 20 ms tick.
        for _ in 0..1000 {
            if *count.borrow_and_update() >= n {
                return Ok(());
            }
            if sent.iter().any(tokio::task::JoinHandle::is_finished) {
                anyhow::bail!("a request ended before reaching an engine");
            }
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            let _ = tokio::time::timeout(Duration::from_millis(20), count.changed()).await;
        }
        anyhow::bail!("the gateway did not forward request {n} of the wave within 10 s")
    }

    /// Lets every held completion go; returns the moment of release and
    /// the engine of each held completion in the order the gateway forwarded
    /// them. Each engine receives its requests in the order the gateway
    /// decided them, the next once the engine admitted (answered the headers
    /// of) the previous, so its queue and cache see the same order in every
    /// run.
    pub fn release(&self) -> (Instant, Vec<usize>) {
        let held = std::mem::take(&mut *self.shared.held.lock());
        self.shared.count.send_replace(0);
        *self.shared.last_admitted.lock() = None;
        let at = Instant::now();
        let engines = held.iter().map(|h| h.engine).collect();
        let mut queues: Vec<Vec<oneshot::Sender<oneshot::Sender<()>>>> =
            (0..self.fronts.len()).map(|_| Vec::new()).collect();
        for h in held {
            if let Some(q) = queues.get_mut(h.engine) {
                q.push(h.go);
            }
        }
        for queue in queues.into_iter().filter(|q| !q.is_empty()) {
            let shared = Arc::clone(&self.shared);
            tokio::spawn(async move {
                for go in queue {
                    let (admitted, wait) = oneshot::channel();
                    if go.send(admitted).is_ok() {
                        // Err: the request ended without an answer; go on.
                        let _ = wait.await;
                        let now = Instant::now();
                        let mut last = shared.last_admitted.lock();
                        *last = Some(last.map_or(now, |l| l.max(now)));
                    }
                }
            });
        }
        (at, engines)
    }

    /// When the last request of the released wave was admitted by its
    /// engine (read once every response of the wave has ended).
    pub fn last_admitted(&self) -> Option<Instant> {
        *self.shared.last_admitted.lock()
    }
}

/// `n` loopback listeners on the first free range of [`PORT_BASES`], else on
/// ephemeral ports (placement by CHWBL then differs between runs).
async fn listeners(n: usize) -> anyhow::Result<Vec<tokio::net::TcpListener>> {
    'bases: for base in PORT_BASES {
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let Some(port) = u16::try_from(i).ok().and_then(|i| base.checked_add(i)) else {
                continue 'bases;
            };
            match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
                Ok(l) => out.push(l),
                Err(_) => continue 'bases,
            }
        }
        return Ok(out);
    }
    eprintln!(
        "kvroute demo: ports {}.. are taken; on ephemeral ports chwbl's placement differs from run to run",
        PORT_BASES[0]
    );
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(tokio::net::TcpListener::bind("127.0.0.1:0").await?);
    }
    Ok(out)
}

/// The hold's only handler: completions wait for their release, the rest
/// goes through.
async fn pass(State(front): State<Arc<Front>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (StatusCode::BAD_REQUEST, "body too large").into_response();
    };
    let mut admitted = None;
    if parts.method == Method::POST && parts.uri.path().starts_with("/v1/") {
        let (go, released) = oneshot::channel();
        front.shared.held.lock().push(Held {
            engine: front.engine,
            go,
        });
        front.shared.count.send_modify(|n| *n += 1);
        match released.await {
            Ok(a) => admitted = Some(a),
            Err(_) => {
                return (StatusCode::SERVICE_UNAVAILABLE, "demo hold stopped").into_response()
            }
        }
    }
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut upstream = front
        .shared
        .client
        .request(parts.method.clone(), format!("{}{path}", front.base))
        .body(body);
    for (k, v) in without_framing(&parts.headers) {
        upstream = upstream.header(k, v);
    }
    let resp = upstream.send().await;
    // The engine answers headers once it admitted the request.
    if let Some(a) = admitted {
        let _ = a.send(());
    }
    let resp = match resp {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let mut out = Response::builder().status(resp.status());
    for (k, v) in without_framing(resp.headers()) {
        out = out.header(k, v);
    }
    let chunks = futures_util::stream::unfold(Some(resp), |resp| async move {
        let mut resp = resp?;
        match resp.chunk().await {
            Ok(Some(c)) => Some((Ok(c), Some(resp))),
            Ok(None) => None,
            Err(e) => Some((Err(e), None)),
        }
    });
    out.body(Body::from_stream(chunks))
        .unwrap_or_else(|e| (StatusCode::BAD_GATEWAY, e.to_string()).into_response())
}

/// Headers to copy across the hold: not the ones that describe this hop's
/// connection or framing, which each side sets for itself.
fn without_framing(
    h: &HeaderMap,
) -> impl Iterator<Item = (&header::HeaderName, &header::HeaderValue)> {
    h.iter().filter(|(k, _)| {
        ![
            header::HOST,
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::CONNECTION,
        ]
        .contains(k)
    })
}
