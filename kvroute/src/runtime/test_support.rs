//! Helpers shared by the runtime's unit tests.

use std::sync::Arc;

use kvroute_ingest::SeqWindowConfig;

use crate::engine::{Engine, Follow};
use crate::{Backend, KvRouter, KvRouterBuilder};

/// Endpoints whose events the test applies itself.
#[derive(Debug)]
pub(crate) struct HostEngine;

impl Engine for HostEngine {
    fn name(&self) -> &str {
        "test"
    }

    fn events_carry_tokens(&self) -> bool {
        false
    }

    fn window(&self, _follow: &Follow) -> SeqWindowConfig {
        SeqWindowConfig::default()
    }
}

/// A router over `n` endpoints `http://e0..` whose events the test applies,
/// deciding from keys of 4-token blocks, with no engine polls or probes.
pub(crate) fn host_router(n: usize) -> KvRouterBuilder {
    let engine: Arc<dyn Engine> = Arc::new(HostEngine);
    let mut b = KvRouter::builder_for_keys("test/bs4", 4)
        .no_engine_load()
        .no_health_probes();
    for e in 0..n {
        b = b.endpoint(Backend::new(Arc::clone(&engine), format!("http://e{e}")).host_events());
    }
    b
}

/// Records what the router publishes and keeps the sink it subscribes,
/// so a test can hand it messages as a transport would.
#[derive(Default)]
pub(crate) struct Loopback {
    pub(crate) sent: parking_lot::Mutex<Vec<bytes::Bytes>>,
    pub(crate) sink: parking_lot::Mutex<Option<crate::ReplicaSink>>,
}

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loopback")
    }
}

impl crate::ReplicaTransport for Loopback {
    fn publish(&self, _pool: &str, payload: bytes::Bytes) {
        self.sent.lock().push(payload);
    }

    fn subscribe(
        &self,
        _pool: &str,
        sink: crate::ReplicaSink,
    ) -> Result<crate::ReplicaSubscription, crate::ReplicaError> {
        *self.sink.lock() = Some(sink);
        Ok(crate::ReplicaSubscription::new(()))
    }
}
