//! Prometheus metrics of routers (feature `metrics`): one
//! `prometheus-client` [`Collector`] that reads every router's counters and
//! state at scrape time — decisions and misses by reason, per-endpoint hits,
//! predicted, delivered, reachable, achieved and lost (by cause) cached
//! tokens, inventories, event followers, ingest health, load, engine
//! reports, replica sharing and tokenization admission — so the request
//! path pays nothing for them.
//!
//! Each router is labelled `rule` by its name; per-endpoint families add
//! `endpoint` (its URL) and `role`, follower families `rank` (the DP rank,
//! or `drain` for a TensorRT-LLM drain poller).
//!
//! ```
//! use prometheus_client::registry::Registry;
//! # fn run(router: kvroute::KvRouter) {
//! let mut registry = Registry::default();
//! kvroute::metrics::register(&mut registry, router);
//! let mut text = String::new();
//! prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
//! assert!(text.contains("kvroute_kv_misses_total"));
//! # }
//! ```

mod tables;

use std::sync::Arc;

use kvroute_select::{LostCause, MissReason};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::KvRouter;
pub use tables::family;
use tables::{
    role_label, single, CauseLabels, EndpointLabels, Esc, Rank, ENDPOINT_METRICS, INGEST_METRICS,
    SUBSCRIBER_METRICS,
};

/// Registers `router`'s metrics in `registry`.
pub fn register(registry: &mut Registry, router: KvRouter) {
    registry.register_collector(Box::new(Routers::new(move || vec![router.clone()])));
}

/// The metrics of a changing set of routers (a host with several pools):
/// `routers` is called at each scrape.
pub struct Routers {
    routers: Arc<dyn Fn() -> Vec<KvRouter> + Send + Sync>,
}

impl std::fmt::Debug for Routers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Routers")
    }
}

impl Routers {
    /// A collector over what `routers` returns at each scrape.
    pub fn new(routers: impl Fn() -> Vec<KvRouter> + Send + Sync + 'static) -> Self {
        Self {
            routers: Arc::new(routers),
        }
    }
}

/// One endpoint's values for one scrape.
struct EndpointRow<'a> {
    labels: EndpointLabels<'a>,
    values: [u64; ENDPOINT_METRICS.len()],
    ingest: [u64; INGEST_METRICS.len()],
    lost: [u64; LostCause::COUNT],
    reported: Option<kvroute_select::EngineReport>,
    probe_failures: u64,
    remote: Option<kvroute_select::EndpointLoad>,
}

/// One follower's values for one scrape.
struct FollowerRow<'a> {
    labels: EndpointLabels<'a>,
    values: [u64; SUBSCRIBER_METRICS.len()],
    last_rejected_seq: Option<u64>,
}

/// One router's values for one scrape.
struct RouterRow<'a> {
    rule: &'a str,
    misses: [u64; MissReason::ALL.len()],
    retries: u64,
    exhausted: u64,
    implausible_receipts: u64,
    held: u64,
    held_us: u64,
    memory_bytes: u64,
    /// match, mismatch, unverifiable.
    attestations: [u64; 3],
    /// Routers with token-id forwarding only.
    token_ids: Option<crate::prompt::TokenIdSnapshot>,
    replicas: Option<crate::ReplicaCounters>,
    admission: crate::admission::AdmissionSnapshot,
}

impl Collector for Routers {
    #[allow(clippy::too_many_lines)]
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let routers = (self.routers)();
        let names: Vec<String> = routers.iter().map(|r| r.name().to_owned()).collect();
        let statuses: Vec<Vec<crate::EndpointStatus>> =
            routers.iter().map(KvRouter::endpoint_statuses).collect();
        let mut rows = Vec::with_capacity(routers.len());
        let mut endpoints = Vec::new();
        let mut followers = Vec::new();
        for ((router, rule), statuses) in routers.iter().zip(&names).zip(&statuses) {
            let snap = router.counters();
            let mut att = [0u64; 3];
            for s in statuses {
                att[0] += s.attestation.verified_blocks;
                att[1] += s.attestation.mismatched_blocks;
                att[2] += s.attestation.unverifiable_events;
            }
            rows.push(RouterRow {
                rule,
                misses: MissReason::ALL.map(|r| snap.misses_for(r)),
                retries: snap.retries,
                exhausted: snap.exhausted,
                implausible_receipts: snap.implausible_receipts,
                held: snap.held,
                held_us: snap.held_us,
                memory_bytes: router.memory_bytes() as u64,
                attestations: att,
                token_ids: router
                    .forwards_token_ids()
                    .then(|| router.token_id_counters()),
                replicas: router.replica_counters(),
                admission: router.tokenize_counters(),
            });
            for s in statuses {
                let labels = EndpointLabels {
                    rule,
                    endpoint: &s.url,
                    role: role_label(s.role),
                    rank: None,
                };
                let ev = s.evidence;
                let partial =
                    matches!(s.completeness, kvroute_ingest::Completeness::Partial { .. });
                let missing = match s.completeness {
                    kvroute_ingest::Completeness::Partial { missing_batches } => missing_batches,
                    _ => 0,
                };
                endpoints.push(EndpointRow {
                    labels,
                    values: [
                        ev.hits,
                        ev.predicted_tokens,
                        ev.delivered_tokens,
                        ev.reachable_tokens,
                        ev.achieved_tokens,
                        ev.receipts,
                        u64::from(ev.drift_alarm),
                        s.inventory_blocks,
                        u64::from(s.local.in_flight),
                        s.local.queued_prefill_tokens,
                        u64::from(s.available),
                        s.load_polls.ok,
                        s.load_polls.failed,
                        u64::from(s.outlier.ejected),
                        s.outlier.ejections,
                    ],
                    ingest: [
                        s.seq.resumes,
                        s.seq.resumes_verified,
                        s.seq.resume_restarts,
                        s.ingest.rekey_orphan_blocks,
                        s.ingest.rekey_untokenized_blocks,
                        u64::from(partial),
                        missing,
                        s.ingest.partial_episodes,
                        s.ingest.replays_late,
                        s.ingest.replays_incomplete,
                        s.seq.implausible,
                        u64::from(s.contract_status == "mismatch"),
                        s.attestation.verified_blocks,
                        s.attestation.mismatched_blocks,
                        s.capacity_blocks.unwrap_or(u64::MAX),
                        s.ingest.rekey_map_full,
                        s.ingest.clears_not_needed,
                    ],
                    lost: ev.lost_tokens,
                    reported: s.engine_report,
                    probe_failures: s.probe_failures,
                    remote: s.remote,
                });
                for f in &s.followers {
                    let rank = match &f.stream {
                        kvroute_engines::engine::Stream::Drain(_) => Rank::Drain,
                        other => Rank::Dp(other.rank().unwrap_or(0)),
                    };
                    let m = &f.metrics;
                    followers.push(FollowerRow {
                        labels: EndpointLabels {
                            rank: Some(rank),
                            ..labels
                        },
                        values: [
                            u64::from(m.connected),
                            m.events_applied,
                            m.gaps,
                            m.clears,
                            m.restarts,
                            m.decode_errors,
                            m.dial_failures,
                            m.replays_requested,
                            m.malformed_frames,
                            m.oversized_frames,
                            m.polls,
                            m.decode.malformed_events,
                            m.decode.unknown_event_tags,
                            m.decode.smaller_window_events,
                            m.decode.untracked_offloaded_blocks,
                        ],
                        last_rejected_seq: m.last_rejected_seq,
                    });
                }
            }
        }
        encode_rows(&mut enc, &rows, &endpoints, &followers)
    }
}

#[allow(clippy::too_many_lines)]
fn encode_rows(
    enc: &mut DescriptorEncoder,
    rows: &[RouterRow<'_>],
    endpoints: &[EndpointRow<'_>],
    followers: &[FollowerRow<'_>],
) -> std::fmt::Result {
    family(
        enc,
        "kvroute_kv_misses",
        "KV-exact misses by reason.",
        MetricType::Counter,
        rows.iter().flat_map(|r| {
            MissReason::ALL
                .iter()
                .zip(r.misses)
                .map(|(reason, n)| ([("rule", Esc(r.rule)), ("reason", Esc(reason.as_str()))], n))
        }),
    )?;
    family(
        enc,
        "kvroute_prompt_token_ids",
        "Completions prompts of forward_token_ids rules sent to the engine as token ids (outcome forwarded), or as text and why.",
        MetricType::Counter,
        rows.iter().flat_map(|r| {
            r.token_ids.into_iter().flat_map(move |t| {
                let kept = crate::prompt::KeepText::ALL
                    .into_iter()
                    .map(move |k| ([("rule", Esc(r.rule)), ("outcome", Esc(k.as_str()))], t.kept(k)));
                std::iter::once(([("rule", Esc(r.rule)), ("outcome", Esc("forwarded"))], t.forwarded))
                    .chain(kept)
            })
        }),
    )?;
    family(
        enc,
        "kvroute_retries",
        "Retries after upstream connect failures.",
        MetricType::Counter,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.retries)),
    )?;
    family(
        enc,
        "kvroute_exhausted",
        "Decisions or retries that found no eligible endpoint.",
        MetricType::Counter,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.exhausted)),
    )?;
    family(
        enc,
        "kvroute_burst_held",
        "Requests held for their turn in a burst: without a home, after the burst's requests with one (burst_order), and after the lower-ranked replicas.",
        MetricType::Counter,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.held)),
    )?;
    family(
        enc,
        "kvroute_burst_held_microseconds",
        "Time requests were held for their turn in a burst, summed.",
        MetricType::Counter,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.held_us)),
    )?;
    family(
        enc,
        "kvroute_implausible_receipts",
        "Engine receipts refused as implausible (more cached tokens than the prompt, than the engine's own prompt_tokens, or than any context window), never counted as delivered.",
        MetricType::Counter,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.implausible_receipts)),
    )?;
    family(
        enc,
        "kvroute_contract_attestations",
        "Stored KV blocks re-hashed with the rule's contract (match, mismatch); stored events that cannot be re-hashed (unverifiable).",
        MetricType::Counter,
        rows.iter().flat_map(|r| {
            ["match", "mismatch", "unverifiable"]
                .into_iter()
                .zip(r.attestations)
                .map(|(result, n)| ([("rule", Esc(r.rule)), ("result", Esc(result))], n))
        }),
    )?;
    family(
        enc,
        "kvroute_inventory_memory_bytes",
        "Heap bytes of the rule's inventory index and ingest maps (bounded by the endpoints' capacities).",
        MetricType::Gauge,
        rows.iter().map(|r| ([("rule", Esc(r.rule))], r.memory_bytes)),
    )?;
    for (k, (name, kind, help)) in ENDPOINT_METRICS.iter().enumerate() {
        family(
            enc,
            name,
            help,
            *kind,
            endpoints.iter().map(|e| (e.labels, e.values[k])),
        )?;
    }
    family(
        enc,
        "kvroute_lost_cached_tokens",
        "Reachable cached tokens a request did not reuse, by cause (load_cap, affinity_slack, scorer, below_threshold, pd_affinity, failover, stale_inventory, contract_mismatch, tokenize_overload), over settled receipts, per endpoint the request went to.",
        MetricType::Counter,
        endpoints.iter().flat_map(|e| {
            LostCause::ALL.iter().map(move |c| {
                (
                    CauseLabels {
                        endpoint: e.labels,
                        cause: c.as_str(),
                    },
                    e.lost[c.index()],
                )
            })
        }),
    )?;
    family(
        enc,
        "kvroute_remote_in_flight",
        "Requests the other replicas announced in flight per endpoint (absent without replica sharing).",
        MetricType::Gauge,
        endpoints
            .iter()
            .filter_map(|e| Some((e.labels, u64::from(e.remote?.in_flight)))),
    )?;
    family(
        enc,
        "kvroute_remote_queued_prefill_tokens",
        "Predicted queued prefill tokens the other replicas announced per endpoint (absent without replica sharing).",
        MetricType::Gauge,
        endpoints
            .iter()
            .filter_map(|e| Some((e.labels, e.remote?.queued_prefill_tokens))),
    )?;
    family(
        enc,
        "kvroute_probe_failures",
        "Active health probes of the endpoint that failed (each also counts against its circuit breaker).",
        MetricType::Counter,
        endpoints.iter().map(|e| (e.labels, e.probe_failures)),
    )?;
    family(
        enc,
        "kvroute_engine_reported_running",
        "Requests the engine says it is running (all replicas' requests), from its last fresh load report; absent without one.",
        MetricType::Gauge,
        endpoints
            .iter()
            .filter_map(|e| Some((e.labels, u64::from(e.reported?.running)))),
    )?;
    family(
        enc,
        "kvroute_engine_reported_waiting",
        "Requests the engine says are waiting in its queue, from its last fresh load report; absent without one.",
        MetricType::Gauge,
        endpoints
            .iter()
            .filter_map(|e| Some((e.labels, u64::from(e.reported?.waiting)))),
    )?;
    for (k, (name, kind, help)) in SUBSCRIBER_METRICS.iter().enumerate() {
        family(
            enc,
            name,
            help,
            *kind,
            followers.iter().map(|s| (s.labels, s.values[k])),
        )?;
    }
    family(
        enc,
        "kvroute_subscriber_last_rejected_seq",
        "Sequence number of the last message dropped as malformed, oversized or undecodable (absent until one carried a readable sequence).",
        MetricType::Gauge,
        followers
            .iter()
            .filter_map(|s| Some((s.labels, s.last_rejected_seq?))),
    )?;
    for (k, (name, kind, help)) in INGEST_METRICS.iter().enumerate() {
        family(
            enc,
            name,
            help,
            *kind,
            endpoints.iter().map(|e| (e.labels, e.ingest[k])),
        )?;
    }
    encode_replicas(enc, rows)?;
    // Routers may share one admission bound: it is exported once, from the
    // first router's view.
    if let Some(r) = rows.first() {
        encode_admission(enc, &r.admission)?;
    }
    Ok(())
}

fn encode_replicas(enc: &mut DescriptorEncoder, rows: &[RouterRow<'_>]) -> std::fmt::Result {
    type Field = fn(&crate::ReplicaCounters) -> u64;
    let families: [(&str, MetricType, &str, Field); 15] = [
        (
            "kvroute_replica_sent_batches",
            MetricType::Counter,
            "Replica batches published.",
            |c| c.sent_batches,
        ),
        (
            "kvroute_replica_sent_at_once",
            MetricType::Counter,
            "Replica batches published at once on a change after a quiet sync interval.",
            |c| c.sent_at_once,
        ),
        (
            "kvroute_replica_wakes",
            MetricType::Counter,
            "Times the replica publishing task woke to send or check.",
            |c| c.wakes,
        ),
        (
            "kvroute_replica_sent_deltas",
            MetricType::Counter,
            "Endpoint deltas published to the other replicas.",
            |c| c.sent_deltas,
        ),
        (
            "kvroute_replica_received",
            MetricType::Counter,
            "Replica messages received (own ones included).",
            |c| c.received,
        ),
        (
            "kvroute_replica_applied",
            MetricType::Counter,
            "Other replicas' deltas applied.",
            |c| c.applied,
        ),
        (
            "kvroute_replica_stale",
            MetricType::Counter,
            "Duplicate or older deltas ignored.",
            |c| c.stale,
        ),
        (
            "kvroute_replica_unknown_endpoint",
            MetricType::Counter,
            "Deltas for an endpoint URL this router does not have.",
            |c| c.unknown_endpoint,
        ),
        (
            "kvroute_replica_origins_full",
            MetricType::Counter,
            "Deltas refused because the most replicas are counted.",
            |c| c.origins_full,
        ),
        (
            "kvroute_replica_implausible",
            MetricType::Counter,
            "Deltas refused for an implausible queue or charged-counter step.",
            |c| c.implausible,
        ),
        (
            "kvroute_replica_undecodable",
            MetricType::Counter,
            "Replica messages that did not decode.",
            |c| c.undecodable,
        ),
        (
            "kvroute_replica_oversized",
            MetricType::Counter,
            "Replica messages over the size limit, refused unread.",
            |c| c.oversized,
        ),
        (
            "kvroute_replica_unsendable",
            MetricType::Counter,
            "Deltas not sent: alone larger than the message size limit.",
            |c| c.unsendable,
        ),
        (
            "kvroute_replica_expired",
            MetricType::Counter,
            "Replicas forgotten after the TTL of silence.",
            |c| c.expired,
        ),
        (
            "kvroute_replicas",
            MetricType::Gauge,
            "Other replicas whose load is counted now.",
            |c| c.replicas,
        ),
    ];
    for (name, kind, help, f) in families {
        family(
            enc,
            name,
            help,
            kind,
            rows.iter()
                .filter_map(|r| Some(([("rule", Esc(r.rule))], f(r.replicas.as_ref()?)))),
        )?;
    }
    Ok(())
}

fn encode_admission(
    enc: &mut DescriptorEncoder,
    s: &crate::admission::AdmissionSnapshot,
) -> std::fmt::Result {
    let families: [(&str, MetricType, &str, u64); 10] = [
        (
            "kvroute_tokenize_max_concurrent",
            MetricType::Gauge,
            "Configured bound on tokenizations running at once (limits.max_concurrent_tokenizations).",
            s.max_concurrent as u64,
        ),
        (
            "kvroute_tokenize_max_bytes_in_flight",
            MetricType::Gauge,
            "Configured bound on request bytes being tokenized at once (limits.max_tokenize_bytes_in_flight).",
            s.max_bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_in_flight",
            MetricType::Gauge,
            "Tokenizations running now.",
            s.in_flight as u64,
        ),
        (
            "kvroute_tokenize_bytes_in_flight",
            MetricType::Gauge,
            "Request bytes charged by the running tokenizations.",
            s.bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_waiting",
            MetricType::Gauge,
            "Requests waiting for tokenization room now (tokenize_overload set to wait).",
            s.waiting as u64,
        ),
        (
            "kvroute_tokenize_peak_in_flight",
            MetricType::Gauge,
            "Most tokenizations ever running at once.",
            s.peak_in_flight as u64,
        ),
        (
            "kvroute_tokenize_peak_bytes_in_flight",
            MetricType::Gauge,
            "Most request bytes ever charged by tokenizations at once.",
            s.peak_bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_admitted",
            MetricType::Counter,
            "Completion requests admitted to tokenization.",
            s.admitted,
        ),
        (
            "kvroute_tokenize_admitted_after_wait",
            MetricType::Counter,
            "Admitted only after waiting for room (tokenize_overload set to wait).",
            s.admitted_after_wait,
        ),
        (
            "kvroute_tokenize_overloaded",
            MetricType::Counter,
            "Completion requests that found no tokenization room (in time) and skipped KV routing.",
            s.overloaded,
        ),
    ];
    for (name, kind, help, v) in families {
        single(enc, name, help, kind, v)?;
    }
    Ok(())
}
