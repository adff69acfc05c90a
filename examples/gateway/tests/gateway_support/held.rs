//! Engine stand-ins that hold completions until the test opens a gate: the
//! gateway sees a request in flight for as long as a test needs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::watch;

use super::{get_json, Gateway};

/// Opens for every request that arrived before [`Gate::open`].
#[derive(Clone)]
pub struct Gate(Arc<watch::Sender<u64>>);

impl Gate {
    pub fn new() -> Self {
        Self(Arc::new(watch::channel(0).0))
    }

    pub fn open(&self) {
        self.0.send_modify(|g| *g += 1);
    }

    /// Counts a request in `received`, then waits for the next opening.
    pub async fn hold(&self, received: &AtomicUsize) {
        let mut rx = self.0.subscribe();
        let arrived = *rx.borrow();
        received.fetch_add(1, Ordering::SeqCst);
        let _ = rx.wait_for(|g| *g > arrived).await;
    }
}

/// An engine stand-in answering every `/v1/*` request once the gate opens
/// (headers and body together, as a non-streaming engine does); 404
/// elsewhere.
pub struct HeldEngine {
    pub addr: SocketAddr,
    pub received: Arc<AtomicUsize>,
}

pub async fn held_engine(gate: &Gate) -> HeldEngine {
    use axum::body::Body;
    use axum::http::Request;
    use axum::response::IntoResponse;
    let received = Arc::new(AtomicUsize::new(0));
    let (count, gate) = (Arc::clone(&received), gate.clone());
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let (count, gate) = (Arc::clone(&count), gate.clone());
        async move {
            let completion = req.uri().path().starts_with("/v1/");
            let _ = axum::body::to_bytes(req.into_body(), 64 << 20).await;
            if !completion {
                return axum::http::StatusCode::NOT_FOUND.into_response();
            }
            gate.hold(&count).await;
            axum::Json(serde_json::json!({
                "choices": [{"text": "ok"}],
                "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}},
            }))
            .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    HeldEngine { addr, received }
}

/// The `/admin/endpoints` row of the endpoint at `url` in `gw`.
pub async fn endpoint_row(gw: &Gateway, token: &str, url: &str) -> Value {
    let v = get_json(&gw.admin_url("/admin/endpoints"), Some(token)).await;
    v["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == url)
        .cloned()
        .unwrap_or_else(|| panic!("no endpoint {url} in {v}"))
}
