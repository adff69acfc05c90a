//! Following an endpoint's KV events: its engine's transport feeding the
//! endpoint's ingest, and the sequence-window policy its stream needs — both
//! the engine unit's ([`kvroute_engines::engine::Engine`]).

use std::sync::Arc;

use kvroute_engines::engine::{IngestTarget, Stream};
use kvroute_engines::transport::{SharedIngest, SubscriberMetrics};
use kvroute_ingest::SeqWindowConfig;
use tokio::sync::watch;

use super::slots::{index_of, SlotRuntime};
use super::{BuildError, Shared};
use crate::backend::Backend;

fn endpoint_err(url: &str, reason: impl std::fmt::Display) -> BuildError {
    BuildError::Endpoint {
        url: url.to_owned(),
        reason: reason.to_string(),
    }
}

/// What the router follows for `b`: its engine's streams (empty when `b`
/// configures nothing to follow).
///
/// # Errors
/// An endpoint whose events cannot be followed.
pub(crate) fn streams(b: &Backend, block_size: u32) -> Result<Vec<Stream>, BuildError> {
    if !b.follow_events {
        return Ok(Vec::new());
    }
    b.engine
        .streams(&b.follow(block_size))
        .map_err(|e| endpoint_err(&b.url, e))
}

/// Whether `b` keeps an inventory: it can prefill and its events reach the
/// router (through its engine's transport, or pushed by the host).
pub(crate) fn has_inventory(b: &Backend, block_size: u32) -> bool {
    b.role.can_prefill() && (b.host_events || streams(b, block_size).is_ok_and(|s| !s.is_empty()))
}

/// The sequence-window policy of `b`'s event stream.
pub(crate) fn window(b: &Backend, block_size: u32) -> SeqWindowConfig {
    b.engine.window(&b.follow(block_size))
}

/// Checks that `b`'s events could be followed (what a router that starts
/// nothing still refuses).
pub(crate) fn check(b: &Backend, block_size: u32) -> Result<(), BuildError> {
    if b.host_events {
        return Ok(());
    }
    b.engine.kv_events().map_err(|e| endpoint_err(&b.url, e))?;
    streams(b, block_size).map(|_| ())
}

/// Starts `b`'s followers on `handle`; they stop with the slot.
pub(crate) fn start(
    shared: &Shared,
    handle: &tokio::runtime::Handle,
    b: &Backend,
    ingest: &SharedIngest,
    stop: &watch::Sender<bool>,
) -> Result<Vec<(Stream, Arc<SubscriberMetrics>)>, BuildError> {
    check(b, shared.contract.block_size)?;
    if b.host_events || !b.follow_events {
        return Ok(Vec::new());
    }
    let target = IngestTarget::new(Arc::clone(ingest), Arc::clone(index_of(shared)));
    let followers = b
        .engine
        .followers(&b.follow(shared.contract.block_size), &target)
        .map_err(|e| endpoint_err(&b.url, e))?;
    let mut out = Vec::with_capacity(followers.len());
    for f in followers {
        out.push((f.stream().clone(), Arc::clone(f.metrics())));
        tracing::info!(rule = %shared.settings.name, endpoint = %b.url,
            stream = f.stream().address(), rank = ?f.stream().rank(), "following KV events");
        handle.spawn(f.run(SlotRuntime::stopped(stop)));
    }
    Ok(out)
}

/// The dialect of `b`'s engine's load report (`None`: it exports none the
/// router reads).
#[cfg(feature = "trtllm-http")]
pub(crate) fn metrics_dialect(b: &Backend) -> Option<kvroute_engines::MetricsDialect> {
    b.engine.metrics_dialect()
}
