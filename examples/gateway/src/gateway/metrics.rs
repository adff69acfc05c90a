//! Prometheus text exposition (format 0.0.4) of the gateway's own counters, the
//! library's per-rule evidence, subscriber health and inventory sizes.
//!
//! Counters live where they are produced (library atomics, subscriber metrics);
//! `/metrics` reads snapshots, so scraping costs nothing on the request path.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::sync::Arc;

use kvroute_select::{MissReason, Role, Source};
use parking_lot::RwLock;

use super::state::Gateway;

/// Decision-latency bucket bounds, seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// A fixed-bucket histogram of atomics.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (b, le) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            if secs <= le {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, le) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {}",
                b.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {count}");
    }
}

/// Request outcome classes the gateway counts itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Forwarded and answered by an upstream (any status).
    Proxied,
    /// A non-completion request (`/v1/models`, `/v1/embeddings`, ...) forwarded
    /// without a KV decision, so it is not a KV miss.
    Passthrough,
    /// Body over the size limit.
    TooLarge,
    /// Body not received in time.
    BodyTimeout,
    /// No rule serves the request.
    NoRule,
    /// No endpoint could be reached.
    NoEndpoint,
    /// An upstream failed after the connection (bad gateway).
    UpstreamError,
    /// Not under `/v1/`, or a malformed request.
    Rejected,
}

impl Outcome {
    /// Every outcome, in exposition order.
    const ALL: [Outcome; 8] = [
        Outcome::Proxied,
        Outcome::Passthrough,
        Outcome::TooLarge,
        Outcome::BodyTimeout,
        Outcome::NoRule,
        Outcome::NoEndpoint,
        Outcome::UpstreamError,
        Outcome::Rejected,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::Proxied => "proxied",
            Outcome::Passthrough => "passthrough",
            Outcome::TooLarge => "body_too_large",
            Outcome::BodyTimeout => "body_timeout",
            Outcome::NoRule => "no_rule",
            Outcome::NoEndpoint => "no_endpoint",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Rejected => "rejected",
        }
    }
}

/// Tier labels, in exposition order; [`tier_index`] maps a source here.
const TIERS: [&str; 5] = [
    "exhausted",
    "fallback",
    "kv_exact",
    "session_affinity",
    "trie_affinity",
];

fn tier_index(source: Source) -> usize {
    match source {
        Source::Exhausted => 0,
        Source::Fallback(_) => 1,
        Source::KvExact => 2,
        Source::SessionAffinity => 3,
        Source::TrieAffinity => 4,
    }
}

/// The tier label of a decision source.
#[must_use]
pub fn tier_label(source: Source) -> &'static str {
    TIERS[tier_index(source)]
}

/// One rule's request and decision counters: plain atomics, so the request
/// path counts without a lock or an allocation. Registered once per rule
/// name ([`GatewayMetrics::rule`]) and held by the rule's runtime; a rule
/// replaced under the same name keeps counting on the same counters.
#[derive(Debug, Default)]
pub struct RuleCounters {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    tiers: [AtomicU64; TIERS.len()],
}

impl RuleCounters {
    /// Counts one request outcome.
    pub fn outcome(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one decision by tier.
    pub fn tier(&self, source: Source) {
        self.tiers[tier_index(source)].fetch_add(1, Ordering::Relaxed);
    }

    fn outcome_count(&self, outcome: Outcome) -> u64 {
        self.outcomes[outcome as usize].load(Ordering::Relaxed)
    }
}

/// Counters the gateway keeps beside the library's.
#[derive(Debug, Default)]
pub struct GatewayMetrics {
    /// Requests no rule took (label `rule=""`).
    unrouted: RuleCounters,
    /// Every rule name's counters, registered when the rule is built; read
    /// by scrapes and [`GatewayMetrics::rule`], never on the request path.
    rules: RwLock<BTreeMap<String, Arc<RuleCounters>>>,
    /// Time from body received to decision (parse, tokenize, hash, decide).
    pub decision_latency: Histogram,
    /// P/D prefill legs sent.
    pub prefill_requests: AtomicU64,
    /// Upstream responses aborted mid-body (engine died, idle timeout).
    pub aborted_streams: AtomicU64,
    /// Active health probes that failed.
    pub probe_failures: AtomicU64,
    /// Proxy listener connections (see `connections`).
    pub proxy_connections: std::sync::Arc<super::connections::ConnectionMetrics>,
    /// Admin listener connections.
    pub admin_connections: std::sync::Arc<super::connections::ConnectionMetrics>,
}

impl GatewayMetrics {
    /// The counters of rule `name`, registered on first use (when the rule
    /// is built; the request path uses the rule runtime's handle).
    pub fn rule(&self, name: &str) -> Arc<RuleCounters> {
        if let Some(c) = self.rules.read().get(name) {
            return Arc::clone(c);
        }
        Arc::clone(self.rules.write().entry(name.to_owned()).or_default())
    }

    /// Counts one outcome of a request no rule took.
    pub fn unrouted(&self, outcome: Outcome) {
        self.unrouted.outcome(outcome);
    }

    fn counters_of(&self, rule: &str) -> Option<Arc<RuleCounters>> {
        self.rules.read().get(rule).cloned()
    }

    /// Requests of `rule` (`""` when none) with `outcome` so far.
    #[must_use]
    pub fn outcome_count(&self, rule: &str, outcome: Outcome) -> u64 {
        if rule.is_empty() {
            return self.unrouted.outcome_count(outcome);
        }
        self.counters_of(rule)
            .map_or(0, |c| c.outcome_count(outcome))
    }

    /// Decisions of `rule` made by `tier` so far.
    #[must_use]
    pub fn tier_count(&self, rule: &str, tier: &str) -> u64 {
        let Some(i) = TIERS.iter().position(|t| *t == tier) else {
            return 0;
        };
        if rule.is_empty() {
            self.unrouted.tiers[i].load(Ordering::Relaxed)
        } else {
            self.counters_of(rule)
                .map_or(0, |c| c.tiers[i].load(Ordering::Relaxed))
        }
    }
}

/// Escapes a label value.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn role_label(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}

/// Subscriber metric families, in the order `render` fills them.
const SUBSCRIBER_METRICS: [(&str, &str, &str); 11] = [
    (
        "kvroute_subscriber_connected",
        "gauge",
        "1 while the KV-event subscriber has its engine connected.",
    ),
    (
        "kvroute_subscriber_events_applied_total",
        "counter",
        "KV events applied to the inventory.",
    ),
    (
        "kvroute_subscriber_gaps_total",
        "counter",
        "Sequence gaps seen.",
    ),
    (
        "kvroute_subscriber_clears_total",
        "counter",
        "Inventory clears (gap beyond window, restart, AllBlocksCleared).",
    ),
    (
        "kvroute_subscriber_restarts_total",
        "counter",
        "Engine restarts detected.",
    ),
    (
        "kvroute_subscriber_decode_errors_total",
        "counter",
        "Event payloads that did not decode.",
    ),
    (
        "kvroute_subscriber_dial_failures_total",
        "counter",
        "Failed dials or binds.",
    ),
    (
        "kvroute_subscriber_replays_total",
        "counter",
        "Replay requests sent.",
    ),
    (
        "kvroute_subscriber_malformed_frames_total",
        "counter",
        "Messages without the [topic, seq, payload] shape, dropped.",
    ),
    (
        "kvroute_subscriber_oversized_frames_total",
        "counter",
        "Messages over the subscriber's size limit, dropped.",
    ),
    (
        "kvroute_subscriber_polls_total",
        "counter",
        "TensorRT-LLM drains attempted (HTTP poller only).",
    ),
];

/// Per-endpoint ingest (sequence window) metric families, in the order
/// `render` fills them.
const INGEST_METRICS: [(&str, &str, &str); 16] = [
    (
        "kvroute_ingest_resumes_total",
        "counter",
        "Reconnects that resumed from the last applied batch (something to verify).",
    ),
    (
        "kvroute_ingest_resumes_verified_total",
        "counter",
        "Resumes whose replayed last batch matched the one applied.",
    ),
    (
        "kvroute_ingest_resume_restarts_total",
        "counter",
        "Engine restarts found by a resume check (also counted as restarts).",
    ),
    (
        "kvroute_ingest_rekey_orphan_blocks_total",
        "counter",
        "Re-key rules: stored blocks skipped because their parent is unknown.",
    ),
    (
        "kvroute_ingest_rekey_untokenized_blocks_total",
        "counter",
        "Re-key rules: stored blocks skipped because the event lacks their tokens.",
    ),
    (
        "kvroute_ingest_inventory_partial",
        "gauge",
        "1 while the endpoint's inventory is known to lack engine batches (late or failed bootstrap replay, gap, clear) until an AllBlocksCleared or an engine restart seen from batch 0.",
    ),
    (
        "kvroute_ingest_missing_batches",
        "gauge",
        "Engine batches the endpoint's inventory is known to lack (summed over DP ranks).",
    ),
    (
        "kvroute_ingest_partial_episodes_total",
        "counter",
        "Transitions of the endpoint's inventory to partial.",
    ),
    (
        "kvroute_ingest_replays_late_total",
        "counter",
        "Replays whose first batch came after the requested one (the engine's buffer no longer reached back).",
    ),
    (
        "kvroute_ingest_replays_incomplete_total",
        "counter",
        "Replays that failed or timed out before the engine's end marker.",
    ),
    (
        "kvroute_ingest_implausible_batches_total",
        "counter",
        "Batches dropped because their sequence number is implausible (beyond max_seq, or an unconfirmed far jump).",
    ),
    (
        "kvroute_ingest_contract_mismatch",
        "gauge",
        "1 when the endpoint's engine keys provably differ from the rule's contract (attestation or block size).",
    ),
    (
        "kvroute_ingest_verified_blocks_total",
        "counter",
        "Stored blocks of this endpoint whose keys the rule's contract reproduces.",
    ),
    (
        "kvroute_ingest_mismatched_blocks_total",
        "counter",
        "Stored blocks of this endpoint whose keys differ from the rule's contract (or whose block size does).",
    ),
    (
        "kvroute_ingest_capacity_blocks",
        "gauge",
        "Bound of the endpoint's GPU-tier inventory (the engine's reported capacity, else the default).",
    ),
    (
        "kvroute_ingest_rekey_map_full_total",
        "counter",
        "Re-key rules: stored blocks skipped because the re-key map was at its bound.",
    ),
];

/// Renders every metric.
#[must_use]
pub fn render(gw: &Gateway) -> String {
    let mut out = String::with_capacity(16 << 10);
    let m = &gw.metrics;
    let rules = gw.rules_snapshot();

    header(
        &mut out,
        "kvroute_requests_total",
        "counter",
        "Requests by rule and outcome.",
    );
    // Counters never counted stay out, as before they had their first count.
    let registered: Vec<(String, Arc<RuleCounters>)> = m
        .rules
        .read()
        .iter()
        .map(|(r, c)| (esc(r), Arc::clone(c)))
        .collect();
    let all = std::iter::once(("", &m.unrouted))
        .chain(registered.iter().map(|(r, c)| (r.as_str(), &**c)));
    for (rule, c) in all.clone() {
        for o in Outcome::ALL {
            let n = c.outcome_count(o);
            if n > 0 {
                let _ = writeln!(
                    out,
                    "kvroute_requests_total{{rule=\"{rule}\",outcome=\"{}\"}} {n}",
                    o.label()
                );
            }
        }
    }
    header(
        &mut out,
        "kvroute_decisions_total",
        "counter",
        "Routing decisions by rule and ladder tier.",
    );
    for (rule, c) in all {
        for (tier, n) in TIERS.iter().zip(&c.tiers) {
            let n = n.load(Ordering::Relaxed);
            if n > 0 {
                let _ = writeln!(
                    out,
                    "kvroute_decisions_total{{rule=\"{rule}\",tier=\"{tier}\"}} {n}"
                );
            }
        }
    }
    header(
        &mut out,
        "kvroute_decision_latency_seconds",
        "histogram",
        "Body received to decision: parse, tokenize, hash, decide.",
    );
    m.decision_latency
        .render(&mut out, "kvroute_decision_latency_seconds", "");
    header(
        &mut out,
        "kvroute_prefill_requests_total",
        "counter",
        "P/D prefill legs sent.",
    );
    let _ = writeln!(
        out,
        "kvroute_prefill_requests_total {}",
        m.prefill_requests.load(Ordering::Relaxed)
    );
    header(
        &mut out,
        "kvroute_aborted_streams_total",
        "counter",
        "Upstream bodies that failed mid-stream.",
    );
    let _ = writeln!(
        out,
        "kvroute_aborted_streams_total {}",
        m.aborted_streams.load(Ordering::Relaxed)
    );
    header(
        &mut out,
        "kvroute_probe_failures_total",
        "counter",
        "Failed active health probes.",
    );
    let _ = writeln!(
        out,
        "kvroute_probe_failures_total {}",
        m.probe_failures.load(Ordering::Relaxed)
    );

    let mut hits = String::new();
    let mut misses = String::new();
    let mut retries = String::new();
    let mut exhausted = String::new();
    let mut predicted = String::new();
    let mut delivered = String::new();
    let mut receipts = String::new();
    let mut drift = String::new();
    let mut inventory = String::new();
    let mut subs: [String; SUBSCRIBER_METRICS.len()] = Default::default();
    let mut ingest: [String; INGEST_METRICS.len()] = Default::default();
    let mut rejected_seq = String::new();
    let mut breaker = String::new();
    let mut inflight = String::new();
    let mut queued = String::new();
    let mut contract = String::new();
    let mut memory = String::new();
    let now = gw.now();
    for rt in &rules {
        let rule = esc(&rt.spec.doc.name);
        let snap = rt.rule.counters().snapshot();
        for reason in MissReason::ALL {
            let _ = writeln!(
                misses,
                "kvroute_kv_misses_total{{rule=\"{rule}\",reason=\"{}\"}} {}",
                reason.label(),
                snap.misses_for(reason)
            );
        }
        let _ = writeln!(
            retries,
            "kvroute_retries_total{{rule=\"{rule}\"}} {}",
            snap.retries
        );
        let _ = writeln!(
            exhausted,
            "kvroute_exhausted_total{{rule=\"{rule}\"}} {}",
            snap.exhausted
        );
        let _ = writeln!(
            memory,
            "kvroute_inventory_memory_bytes{{rule=\"{rule}\"}} {}",
            rt.inventory.memory_bytes()
        );
        let att = rt.inventory.attestation();
        let _ = writeln!(
            contract,
            "kvroute_contract_attestations_total{{rule=\"{rule}\",result=\"match\"}} {}\nkvroute_contract_attestations_total{{rule=\"{rule}\",result=\"mismatch\"}} {}\nkvroute_contract_attestations_total{{rule=\"{rule}\",result=\"unverifiable\"}} {}",
            att.verified_blocks, att.mismatched_blocks, att.unverifiable_events
        );
        for (i, (ep, ev)) in rt.endpoints.iter().zip(&snap.endpoints).enumerate() {
            let l = format!(
                "rule=\"{rule}\",endpoint=\"{}\",role=\"{}\"",
                esc(&ep.spec.url),
                role_label(ep.spec.role)
            );
            let _ = writeln!(hits, "kvroute_kv_hits_total{{{l}}} {}", ev.hits);
            let _ = writeln!(
                predicted,
                "kvroute_predicted_cached_tokens_total{{{l}}} {}",
                ev.predicted_tokens
            );
            let _ = writeln!(
                delivered,
                "kvroute_delivered_cached_tokens_total{{{l}}} {}",
                ev.delivered_tokens
            );
            let _ = writeln!(receipts, "kvroute_receipts_total{{{l}}} {}", ev.receipts);
            let _ = writeln!(
                drift,
                "kvroute_contract_drift_alarm{{{l}}} {}",
                u8::from(ev.drift_alarm)
            );
            let _ = writeln!(
                inventory,
                "kvroute_inventory_blocks{{{l}}} {}",
                rt.inventory.blocks(i)
            );
            let id = kvroute_core::EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
            let own = kvroute_select::Load::load(&*rt.tracker, id);
            let _ = writeln!(inflight, "kvroute_in_flight{{{l}}} {}", own.in_flight);
            let _ = writeln!(
                queued,
                "kvroute_queued_prefill_tokens{{{l}}} {}",
                own.queued_prefill_tokens
            );
            let _ = writeln!(
                breaker,
                "kvroute_endpoint_available{{{l}}} {}",
                u8::from(rt.is_available(i, now))
            );
            let seq = rt.inventory.seq_counters(i);
            let counters = rt.inventory.ingest_counters(i);
            let health = kvroute_ingest::InventoryView::health(&*rt.inventory, i);
            let att = rt.inventory.endpoint_attestation(i);
            let values = [
                seq.resumes,
                seq.resumes_verified,
                seq.resume_restarts,
                counters.rekey_orphan_blocks,
                counters.rekey_untokenized_blocks,
                u64::from(health.partial()),
                health.missing_batches,
                counters.partial_episodes,
                counters.replays_late,
                counters.replays_incomplete,
                seq.implausible,
                u64::from(health.contract_mismatch),
                att.verified_blocks,
                att.mismatched_blocks,
                rt.inventory
                    .capacity(i, kvroute_core::Medium::Gpu)
                    .unwrap_or(u64::MAX),
                counters.rekey_map_full,
            ];
            for (body, v) in ingest.iter_mut().zip(values) {
                let _ = writeln!(body, "{{{l}}} {v}");
            }
            let ranks = ep
                .spec
                .events
                .iter()
                .zip(&ep.subscribers)
                .map(|(src, m)| (src.rank.to_string(), m))
                .chain(ep.drain.iter().map(|m| ("drain".to_owned(), m)));
            for (rank, m) in ranks {
                let s = m.snapshot();
                let sl = format!("{l},rank=\"{rank}\"");
                let values = [
                    u64::from(s.connected),
                    s.events_applied,
                    s.gaps,
                    s.clears,
                    s.restarts,
                    s.decode_errors,
                    s.dial_failures,
                    s.replays_requested,
                    s.malformed_frames,
                    s.oversized_frames,
                    s.polls,
                ];
                for (body, v) in subs.iter_mut().zip(values) {
                    let _ = writeln!(body, "{{{sl}}} {v}");
                }
                if let Some(seq) = s.last_rejected_seq {
                    let _ = writeln!(
                        rejected_seq,
                        "kvroute_subscriber_last_rejected_seq{{{sl}}} {seq}"
                    );
                }
            }
        }
    }
    for (name, kind, help, body) in [
        (
            "kvroute_kv_hits_total",
            "counter",
            "KV-exact decisions with a predicted overlap, per endpoint.",
            &hits,
        ),
        (
            "kvroute_kv_misses_total",
            "counter",
            "KV-exact misses by reason.",
            &misses,
        ),
        (
            "kvroute_retries_total",
            "counter",
            "Retries after upstream connect failures.",
            &retries,
        ),
        (
            "kvroute_exhausted_total",
            "counter",
            "Decisions or retries that found no eligible endpoint.",
            &exhausted,
        ),
        (
            "kvroute_predicted_cached_tokens_total",
            "counter",
            "Cached tokens the decision predicted, over receipts.",
            &predicted,
        ),
        (
            "kvroute_delivered_cached_tokens_total",
            "counter",
            "Cached tokens the engine reported (usage.prompt_tokens_details.cached_tokens).",
            &delivered,
        ),
        (
            "kvroute_receipts_total",
            "counter",
            "Responses that carried a cached-token receipt.",
            &receipts,
        ),
        (
            "kvroute_contract_drift_alarm",
            "gauge",
            "1 while predicted hits keep delivering zero cached tokens.",
            &drift,
        ),
        (
            "kvroute_contract_attestations_total",
            "counter",
            "Stored KV blocks re-hashed with the rule's contract (match, mismatch); stored events that cannot be re-hashed (unverifiable).",
            &contract,
        ),
        (
            "kvroute_inventory_blocks",
            "gauge",
            "Blocks in the endpoint's inventory (all DP ranks).",
            &inventory,
        ),
        (
            "kvroute_inventory_memory_bytes",
            "gauge",
            "Heap bytes of the rule's inventory index and ingest maps (bounded by the endpoints' capacities).",
            &memory,
        ),
        (
            "kvroute_in_flight",
            "gauge",
            "Requests this gateway has in flight per endpoint, from the routing decision until the response body ends or is dropped.",
            &inflight,
        ),
        (
            "kvroute_queued_prefill_tokens",
            "gauge",
            "Predicted uncached prompt tokens of this gateway's requests not yet at their first response byte, per endpoint.",
            &queued,
        ),
        (
            "kvroute_endpoint_available",
            "gauge",
            "1 when the endpoint is eligible (admin up, breaker not open).",
            &breaker,
        ),
    ] {
        header(&mut out, name, kind, help);
        out.push_str(body);
    }
    for ((name, kind, help), body) in SUBSCRIBER_METRICS
        .iter()
        .zip(&subs)
        .chain(INGEST_METRICS.iter().zip(&ingest))
    {
        header(&mut out, name, kind, help);
        for line in body.lines() {
            let _ = writeln!(out, "{name}{line}");
        }
    }
    header(
        &mut out,
        "kvroute_subscriber_last_rejected_seq",
        "gauge",
        "Sequence number of the last message dropped as malformed, oversized or undecodable (absent until one carried a readable sequence).",
    );
    out.push_str(&rejected_seq);
    super::connections::render(
        &mut out,
        &[
            ("proxy", &m.proxy_connections),
            ("admin", &m.admin_connections),
        ],
    );
    render_admission(&mut out, &gw.tokenize_admission.snapshot());
    out
}

/// Appends the Prometheus families of `s` to `out`.
fn render_admission(out: &mut String, s: &kvroute::admission::AdmissionSnapshot) {
    use std::fmt::Write as _;
    let families: [(&str, &str, &str, u64); 9] = [
        (
            "kvroute_tokenize_max_concurrent",
            "gauge",
            "Configured bound on tokenizations running at once (limits.max_concurrent_tokenizations).",
            s.max_concurrent as u64,
        ),
        (
            "kvroute_tokenize_max_bytes_in_flight",
            "gauge",
            "Configured bound on request bytes being tokenized at once (limits.max_tokenize_bytes_in_flight).",
            s.max_bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_in_flight",
            "gauge",
            "Tokenizations running now.",
            s.in_flight as u64,
        ),
        (
            "kvroute_tokenize_bytes_in_flight",
            "gauge",
            "Request bytes charged by the running tokenizations.",
            s.bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_peak_in_flight",
            "gauge",
            "Most tokenizations ever running at once.",
            s.peak_in_flight as u64,
        ),
        (
            "kvroute_tokenize_peak_bytes_in_flight",
            "gauge",
            "Most request bytes ever charged by tokenizations at once.",
            s.peak_bytes_in_flight as u64,
        ),
        (
            "kvroute_tokenize_admitted_total",
            "counter",
            "Completion requests admitted to tokenization.",
            s.admitted,
        ),
        (
            "kvroute_tokenize_admitted_after_wait_total",
            "counter",
            "Admitted only after waiting for room (tokenize_overload = \"wait\").",
            s.admitted_after_wait,
        ),
        (
            "kvroute_tokenize_overloaded_total",
            "counter",
            "Completion requests that found no tokenization room (in time) and skipped KV routing.",
            s.overloaded,
        ),
    ];
    for (name, kind, help, v) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {v}");
    }
}

#[cfg(test)]
mod tests {
    use kvroute_select::SelectorKind;

    use super::*;

    /// Counter slots are indexed by discriminant and tier index: each
    /// outcome and tier has its own slot, and the label tables agree.
    #[test]
    fn every_outcome_and_tier_has_its_own_slot() {
        for (i, o) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(o as usize, i, "{o:?}");
        }
        let sources = [
            Source::Exhausted,
            Source::Fallback(SelectorKind::Random),
            Source::KvExact,
            Source::SessionAffinity,
            Source::TrieAffinity,
        ];
        let m = GatewayMetrics::default();
        let c = m.rule("r");
        for (i, s) in sources.into_iter().enumerate() {
            assert_eq!(tier_index(s), i);
            for _ in 0..=i {
                c.tier(s);
            }
        }
        for (i, t) in TIERS.iter().enumerate() {
            assert_eq!(m.tier_count("r", t), i as u64 + 1, "{t}");
            assert_eq!(m.tier_count("", t), 0);
        }
        for (i, o) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=i {
                c.outcome(o);
            }
            m.unrouted(o);
        }
        for (i, o) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(m.outcome_count("r", o), i as u64 + 1);
            assert_eq!(m.outcome_count("", o), 1);
            assert_eq!(m.outcome_count("other", o), 0);
        }
    }

    /// A rule replaced under the same name keeps counting where it was.
    #[test]
    fn a_rule_name_registers_once() {
        let m = GatewayMetrics::default();
        m.rule("r").outcome(Outcome::Proxied);
        m.rule("r").outcome(Outcome::Proxied);
        assert!(Arc::ptr_eq(&m.rule("r"), &m.rule("r")));
        assert_eq!(m.outcome_count("r", Outcome::Proxied), 2);
    }
}
