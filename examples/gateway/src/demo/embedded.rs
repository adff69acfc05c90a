//! The demo's embedded arm: KV-exact through the library alone, a
//! `KvRouter` with the builder's defaults (engine load polling off, as in
//! the demo's gateway rule) hosted by the axum proxy of the embedding
//! example (`examples/embed_axum`), on the same engines, holds and workload
//! as the gateway's arms.

use std::net::SocketAddr;
use std::time::Duration;

use kvroute::{Backend, KvRouter, Source};
use kvroute_mock_engine as mock_engine;

use super::{engine_cached_blocks, CONTRACT, MODEL};

/// A running embedded proxy.
pub(super) struct Embedded {
    pub(super) router: KvRouter,
    pub(super) addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl Embedded {
    /// The router over the engines' holds (`fronts`), following each
    /// engine's KV events, served on an ephemeral loopback port.
    pub(super) async fn start(
        model_dir: &std::path::Path,
        engines: &[mock_engine::Running],
        fronts: &[SocketAddr],
    ) -> anyhow::Result<Self> {
        let mut builder = KvRouter::builder(CONTRACT.parse()?)
            .model(MODEL, model_dir)
            // As the demo's gateway rule: no engine load polling, so that
            // placement does not depend on when a poll lands.
            .no_engine_load();
        for (e, front) in engines.iter().zip(fronts) {
            let mut backend = Backend::vllm(format!("http://{front}"));
            if let Some(zmq) = e.zmq_port {
                backend = backend.events(format!("tcp://*:{zmq}"));
            }
            builder = builder.endpoint(backend);
        }
        let router = builder.spawn()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = kvroute_embed_axum::app(router.clone());
        let server = tokio::spawn(async move {
            let _ = kvroute_embed_axum::serve(listener, app).await;
        });
        Ok(Self {
            router,
            addr,
            server,
        })
    }

    /// Waits until every KV-event subscriber is connected.
    pub(super) async fn wait_subscribed(&self) -> anyhow::Result<()> {
        for _ in 0..200 {
            let connected = self.router.endpoint_statuses().iter().all(|e| {
                !e.followers.is_empty() && e.followers.iter().all(|f| f.metrics.connected)
            });
            if connected {
                // As for the gateway: the PUB/SUB handshake's first events.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("the embedded router's KV-event subscribers did not connect")
    }

    /// Between waves, as for the gateway: charges released and every
    /// inventory equal to its engine's cache.
    pub(super) async fn settled(
        &self,
        client: &reqwest::Client,
        engines: &[mock_engine::Running],
    ) -> anyhow::Result<()> {
        for _ in 0..400 {
            let statuses = self.router.endpoint_statuses();
            let idle = statuses
                .iter()
                .all(|e| e.local.in_flight == 0 && e.local.queued_prefill_tokens == 0);
            if idle {
                let cached = engine_cached_blocks(client, engines).await?;
                let mirrored: Vec<u64> = statuses.iter().map(|e| e.inventory_blocks).collect();
                if mirrored == cached {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        anyhow::bail!(
            "within 2 s the embedded router did not release its charges or its inventories did \
             not catch up with the engines' caches"
        )
    }

    /// Decisions by tier, and Σ predicted / delivered cached tokens.
    pub(super) fn evidence(&self) -> (Vec<(String, u64)>, u64, u64) {
        let c = self.router.counters();
        // Every decision not made by another tier was KV-exact's (its
        // winners with no cached block too, which `hits` leaves out).
        let kv = c
            .decisions
            .saturating_sub(c.fallbacks + c.session_affinity + c.trie_affinity + c.exhausted);
        let tiers = [
            (Source::KvExact.as_str().to_owned(), kv),
            ("fallback".to_owned(), c.fallbacks),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
        let predicted = c.endpoints.iter().map(|e| e.predicted_tokens).sum();
        let delivered = c.endpoints.iter().map(|e| e.delivered_tokens).sum();
        (tiers, predicted, delivered)
    }

    /// Stops the proxy.
    pub(super) fn stop(self) {
        self.server.abort();
    }
}
