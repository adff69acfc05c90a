//! What a host shows of a router: readiness and, per endpoint, everything
//! the router knows (the gateway's admin API and metrics read these).

use std::sync::atomic::Ordering;

use std::sync::Arc;

use kvroute_engines::engine::{Engine, Stream};
use kvroute_engines::transport::MetricsSnapshot;
use kvroute_ingest::{
    AttestCounters, Completeness, ContractStatus, EndpointIngest, IngestCounters, KeyMode,
    SeqCounters,
};
use kvroute_select::{
    BreakerState, EndpointEvidence, EndpointLoad, EngineReport, Health, Load, OutlierStatus, Role,
};
use serde::Serialize;

use super::view::RouterView;
use super::{id, Shared};

/// A model's tokenizer, as loading left it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerState {
    /// Still loading.
    Loading,
    /// Loaded: requests for the model are tokenized.
    Loaded,
    /// Failed (the reason): requests for the model miss with `no_tokenizer`.
    Failed(String),
}

/// Whether the router routes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// Each model's tokenizer.
    pub tokenizers: Vec<(String, TokenizerState)>,
    /// Endpoints present.
    pub endpoints: usize,
    /// Endpoints a request may go to now (present, not drained, breaker not
    /// open, not ejected).
    pub endpoints_available: usize,
    /// Event followers (one per DP rank, or a drain poller) connected.
    pub followers_connected: usize,
    /// Event followers in all.
    pub followers: usize,
}

impl Readiness {
    /// Every tokenizer loaded and at least one endpoint available.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.tokenizers
            .iter()
            .all(|(_, s)| *s == TokenizerState::Loaded)
            && self.endpoints_available > 0
    }

    /// No tokenizer is still loading.
    #[must_use]
    pub fn tokenizers_settled(&self) -> bool {
        self.tokenizers
            .iter()
            .all(|(_, s)| *s != TokenizerState::Loading)
    }
}

/// Outcomes of one endpoint's engine load polls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadPolls {
    /// Polls that gave a report.
    pub ok: u64,
    /// Polls that failed (connect, timeout, status, unparsable page).
    pub failed: u64,
}

/// One event follower of an endpoint (a DP rank's subscriber, a drain
/// poller, or an engine's own transport).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FollowerStatus {
    /// What it follows.
    pub stream: Stream,
    /// Its counters.
    pub metrics: MetricsSnapshot,
}

/// Everything the router knows about one endpoint.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EndpointStatus {
    /// Its URL.
    pub url: String,
    /// Its slot (rule endpoint id).
    pub slot: usize,
    /// Its engine.
    pub engine: Arc<dyn Engine>,
    /// Its P/D role.
    pub role: Role,
    /// A request may go to it now.
    pub available: bool,
    /// Drained by the operator.
    pub admin_down: bool,
    /// Its circuit breaker.
    pub breaker: BreakerState,
    /// Outlier detection: ejected or not, ejections so far, attempts
    /// waiting for headers there.
    pub outlier: OutlierStatus,
    /// The last health probe's verdict (`None` before the first, or without
    /// probes).
    pub probe_ok: Option<bool>,
    /// Health probes that failed.
    pub probe_failures: u64,
    /// This replica's own requests there.
    pub local: EndpointLoad,
    /// The other replicas' announced requests there (`None` without
    /// replica sharing).
    pub remote: Option<EndpointLoad>,
    /// What selection sees there (own + other replicas, corrected by the
    /// engine's report).
    pub load: EndpointLoad,
    /// The engine's last fresh report.
    pub engine_report: Option<EngineReport>,
    /// Engine load polls.
    pub load_polls: LoadPolls,
    /// Its event followers (one per DP rank, or the drain poller).
    pub followers: Vec<FollowerStatus>,
    /// Blocks its inventory holds (all ranks, all tiers).
    pub inventory_blocks: u64,
    /// Clears its ingest made.
    pub inventory_clears: u64,
    /// Whether the inventory holds everything the engine reported.
    pub completeness: Completeness,
    /// Its inventory bound in the device tier (engine-reported or the
    /// index default).
    pub capacity_blocks: Option<u64>,
    /// `unverified`, `unverifiable`, `verified`, `mismatch`, or `rekeyed`.
    pub contract_status: &'static str,
    /// The likely cause of a mismatch.
    pub mismatch_cause: Option<&'static str>,
    /// Attestation counts (blocks of another engine block size count as
    /// mismatched).
    pub attestation: AttestCounters,
    /// Sequence-window counters, summed over its DP ranks.
    pub seq: SeqCounters,
    /// Event-level ingest counters.
    pub ingest: IngestCounters,
    /// Decision evidence: hits, predicted and delivered cached tokens, the
    /// drift alarm.
    pub evidence: EndpointEvidence,
}

/// The admin/metrics label of a contract status.
fn status_label(status: ContractStatus, rekeyed: bool) -> &'static str {
    if rekeyed && !matches!(status, ContractStatus::Mismatch { .. }) {
        return "rekeyed";
    }
    match status {
        ContractStatus::Unknown => "unverified",
        ContractStatus::Unverifiable { .. } => "unverifiable",
        ContractStatus::Verified { .. } => "verified",
        ContractStatus::Mismatch { .. } => "mismatch",
    }
}

fn with_ingest<T: Default>(
    shared: &Shared,
    slot: usize,
    f: impl FnOnce(&EndpointIngest) -> T,
) -> T {
    let Some(s) = shared.slots.get(slot) else {
        return T::default();
    };
    let guard = s.ingest.read();
    guard.as_ref().map(|i| f(&i.lock())).unwrap_or_default()
}

pub(crate) fn endpoint(shared: &Shared, slot: usize) -> Option<EndpointStatus> {
    let (backend, followers) = {
        let m = shared.membership.lock();
        let s = m.get(slot)?.as_ref()?;
        (
            s.backend.clone(),
            s.followers
                .iter()
                .map(|(stream, m)| FollowerStatus {
                    stream: stream.clone(),
                    metrics: m.snapshot(),
                })
                .collect(),
        )
    };
    let state = shared.slots.get(slot)?;
    let now = shared.now();
    let e = id(slot);
    let view = RouterView::new(shared, now);
    let attestation = with_ingest(shared, slot, |i| {
        let mut c = i.attest_counters();
        c.mismatched_blocks += i.counters().block_size_mismatches;
        c
    });
    let rekeyed = shared.contract.keying.mode() == KeyMode::Rekey;
    Some(EndpointStatus {
        url: backend.url.clone(),
        slot,
        engine: Arc::clone(&backend.engine),
        role: backend.role,
        available: view.availability(e, now).is_available(),
        admin_down: state.admin_down.load(Ordering::Acquire),
        breaker: state.breaker.state(now),
        outlier: shared.outliers.status(e, now),
        probe_ok: *state.probe_ok.lock(),
        probe_failures: state.probe_failures.load(Ordering::Relaxed),
        local: shared.tracker.load(e),
        remote: shared.replicas.as_ref().map(|r| r.remote().remote(e, now)),
        load: view.load(e),
        engine_report: shared.reported.report(e, now),
        load_polls: LoadPolls {
            ok: state.polls_ok.load(Ordering::Relaxed),
            failed: state.polls_failed.load(Ordering::Relaxed),
        },
        followers,
        inventory_blocks: shared.index.inventory(e).total(),
        inventory_clears: with_ingest(shared, slot, |i| i.counters().clears),
        completeness: shared
            .slots
            .get(slot)
            .and_then(|s| s.ingest.read().as_ref().map(|i| i.lock().completeness()))
            .unwrap_or(Completeness::Unknown),
        capacity_blocks: shared.index.capacity(e, kvroute_core::Medium::Gpu),
        contract_status: status_label(attestation.status(), rekeyed),
        mismatch_cause: with_ingest(shared, slot, EndpointIngest::likely_mismatch_cause),
        attestation,
        seq: with_ingest(shared, slot, EndpointIngest::seq_counters),
        ingest: with_ingest(shared, slot, |i| *i.counters()),
        evidence: shared
            .current()
            .rule
            .counters()
            .snapshot()
            .endpoints
            .get(slot)
            .copied()
            .unwrap_or_default(),
    })
}

pub(crate) fn readiness(shared: &Shared) -> Readiness {
    let now = shared.now();
    let view = RouterView::new(shared, now);
    let (mut endpoints, mut available, mut followers, mut connected) = (0, 0, 0, 0);
    for (i, s) in shared.membership.lock().iter().enumerate() {
        let Some(s) = s else { continue };
        endpoints += 1;
        if view.availability(id(i), now).is_available() {
            available += 1;
        }
        for (_, f) in &s.followers {
            followers += 1;
            if f.snapshot().connected {
                connected += 1;
            }
        }
    }
    Readiness {
        tokenizers: shared.tokenizer_states.lock().clone(),
        endpoints,
        endpoints_available: available,
        followers_connected: connected,
        followers,
    }
}

pub(crate) fn memory_bytes(shared: &Shared) -> usize {
    shared.index.memory_bytes()
        + shared
            .slots
            .iter()
            .map(|s| {
                s.ingest
                    .read()
                    .as_ref()
                    .map_or(0, |i| i.lock().memory_bytes())
            })
            .sum::<usize>()
}
