//! The gateway's `/metrics`: one `prometheus-client` [`Registry`] in the
//! OpenMetrics text format.
//!
//! Two kinds of families, by where the value lives:
//! * counted by the gateway on the request path (requests, decisions,
//!   decision latency, P/D prefill legs, aborted streams, probe failures):
//!   `Family<Labels, Counter>` members resolved once per rule name when the
//!   rule is built, so a request increments an atomic, with no lock, label
//!   lookup or allocation;
//! * counted elsewhere (the library rule's evidence, subscribers, inventories,
//!   load tracker, listeners, tokenization admission): a [`Collector`] reads
//!   their snapshots at scrape time, so they cost the request path nothing.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use kvroute_select::{MissReason, Role, SelectorKind, Source};
use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeLabelValue, EncodeMetric,
    LabelSetEncoder, LabelValueEncoder, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::state::Gateway;

/// The `Content-Type` of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Decision-latency bucket bounds, seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0,
];

/// Writes `v` as a label value: prometheus-client writes values verbatim, the
/// text format needs `\`, `"` and newlines escaped.
fn write_escaped(out: &mut LabelValueEncoder, v: &str) -> std::fmt::Result {
    let mut rest = v;
    while let Some(i) = rest.find(['\\', '"', '\n']) {
        out.write_str(&rest[..i])?;
        out.write_str(match rest.as_bytes()[i] {
            b'\\' => "\\\\",
            b'"' => "\\\"",
            _ => "\\n",
        })?;
        rest = &rest[i + 1..];
    }
    out.write_str(rest)
}

/// A label value held by a request-path family member (a rule name).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct LabelText(Arc<str>);

impl EncodeLabelValue for LabelText {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        write_escaped(out, &self.0)
    }
}

/// A borrowed label value of a scrape-time family.
#[derive(Clone, Copy, Debug)]
struct Esc<'a>(&'a str);

impl EncodeLabelValue for Esc<'_> {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        write_escaped(out, self.0)
    }
}

/// A fixed-bucket histogram of atomics: prometheus-client's `Histogram` takes
/// a write lock per observation, and this one is observed by every request.
#[derive(Clone, Debug, Default)]
pub struct Histogram(Arc<HistogramCells>);

#[derive(Debug, Default)]
struct HistogramCells {
    /// Observations per bucket (not cumulative), the last one past every bound.
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|le| secs <= *le)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.0.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum_ns.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        let mut buckets = [(0.0, 0); LATENCY_BUCKETS.len() + 1];
        for (i, (slot, cell)) in buckets.iter_mut().zip(&self.0.buckets).enumerate() {
            // The encoder writes `f64::MAX` as `+Inf`.
            *slot = (
                LATENCY_BUCKETS.get(i).copied().unwrap_or(f64::MAX),
                cell.load(Ordering::Relaxed),
            );
        }
        let count = buckets.iter().map(|(_, n)| n).sum();
        #[allow(clippy::cast_precision_loss)]
        let sum = self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Request outcome classes the gateway counts itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
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

    fn as_str(self) -> &'static str {
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

impl EncodeLabelValue for Outcome {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        out.write_str(self.as_str())
    }
}

/// Tier labels ([`Source::as_str`]), in exposition order; [`tier_index`]
/// maps a source here.
const TIERS: [&str; 5] = [
    Source::Exhausted.as_str(),
    Source::Fallback(SelectorKind::RoundRobin).as_str(),
    Source::KvExact.as_str(),
    Source::SessionAffinity.as_str(),
    Source::TrieAffinity.as_str(),
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

/// A ladder tier as a label value (an index into [`TIERS`]).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Tier(usize);

impl EncodeLabelValue for Tier {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        out.write_str(TIERS.get(self.0).copied().unwrap_or("unknown"))
    }
}

/// Labels of `kvroute_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    rule: LabelText,
    outcome: Outcome,
}

/// Labels of `kvroute_decisions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    rule: LabelText,
    tier: Tier,
}

/// One rule's request and decision counters: members of the registry's
/// families, resolved once, so the request path increments an atomic.
/// Registered once per rule name ([`GatewayMetrics::rule`]) and held by the
/// rule's runtime; a rule replaced under the same name keeps counting on the
/// same counters.
#[derive(Debug)]
pub struct RuleCounters {
    outcomes: [Counter; Outcome::ALL.len()],
    tiers: [Counter; TIERS.len()],
    /// Rule `forward_token_ids`: prompts sent as ids / kept as text by reason.
    pub token_ids: kvroute::prompt::TokenIdCounters,
}

impl RuleCounters {
    fn register(
        rule: &str,
        requests: &Family<RequestLabels, Counter>,
        decisions: &Family<DecisionLabels, Counter>,
    ) -> Self {
        let rule = LabelText(Arc::from(rule));
        Self {
            outcomes: Outcome::ALL.map(|outcome| {
                requests
                    .get_or_create(&RequestLabels {
                        rule: rule.clone(),
                        outcome,
                    })
                    .clone()
            }),
            tiers: std::array::from_fn(|i| {
                decisions
                    .get_or_create(&DecisionLabels {
                        rule: rule.clone(),
                        tier: Tier(i),
                    })
                    .clone()
            }),
            token_ids: kvroute::prompt::TokenIdCounters::default(),
        }
    }

    /// Counts one request outcome.
    pub fn outcome(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].inc();
    }

    /// Counts one decision by tier.
    pub fn tier(&self, source: Source) {
        self.tiers[tier_index(source)].inc();
    }

    fn outcome_count(&self, outcome: Outcome) -> u64 {
        self.outcomes[outcome as usize].get()
    }
}

/// The gateway's registry and the counters it keeps beside the library's.
#[derive(Debug)]
pub struct GatewayMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    decisions: Family<DecisionLabels, Counter>,
    /// Requests no rule took (label `rule=""`).
    unrouted: RuleCounters,
    /// Every rule name's counters, registered when the rule is built; read
    /// by [`GatewayMetrics::rule`] and the admin API, never on the request path.
    rules: RwLock<BTreeMap<String, Arc<RuleCounters>>>,
    /// The gateway the scrape-time collector reads (set by [`render`]).
    gateway: Arc<OnceLock<Weak<Gateway>>>,
    /// Time from body received to decision (parse, tokenize, hash, decide).
    pub decision_latency: Histogram,
    /// P/D prefill legs sent.
    pub prefill_requests: Counter,
    /// Upstream responses aborted mid-body (engine died, idle timeout,
    /// client gone).
    pub aborted_streams: Counter,
    /// Active health probes that failed.
    pub probe_failures: Counter,
    /// Proxy listener connections (see `connections`).
    pub proxy_connections: Arc<super::connections::ConnectionMetrics>,
    /// Admin listener connections.
    pub admin_connections: Arc<super::connections::ConnectionMetrics>,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        let decision_latency = Histogram::default();
        let prefill_requests = Counter::default();
        let aborted_streams = Counter::default();
        let probe_failures = Counter::default();
        // Counter names go in without `_total` and help texts without their
        // final period: the registry appends both.
        registry.register(
            "kvroute_requests",
            "Requests by rule and outcome",
            requests.clone(),
        );
        registry.register(
            "kvroute_decisions",
            "Routing decisions by rule and ladder tier",
            decisions.clone(),
        );
        registry.register(
            "kvroute_decision_latency_seconds",
            "Body received to decision: parse, tokenize, hash, decide",
            decision_latency.clone(),
        );
        registry.register(
            "kvroute_prefill_requests",
            "P/D prefill legs sent",
            prefill_requests.clone(),
        );
        registry.register(
            "kvroute_aborted_streams",
            "Upstream bodies that failed mid-stream or that the client dropped before their end",
            aborted_streams.clone(),
        );
        registry.register(
            "kvroute_probe_failures",
            "Failed active health probes",
            probe_failures.clone(),
        );
        let gateway = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(Scraped {
            gateway: Arc::clone(&gateway),
        }));
        let unrouted = RuleCounters::register("", &requests, &decisions);
        Self {
            registry,
            requests,
            decisions,
            unrouted,
            rules: RwLock::new(BTreeMap::new()),
            gateway,
            decision_latency,
            prefill_requests,
            aborted_streams,
            probe_failures,
            proxy_connections: Arc::default(),
            admin_connections: Arc::default(),
        }
    }
}

impl GatewayMetrics {
    /// The counters of rule `name`, registered on first use (when the rule
    /// is built; the request path uses the rule runtime's handle).
    pub fn rule(&self, name: &str) -> Arc<RuleCounters> {
        if let Some(c) = self.rules.read().get(name) {
            return Arc::clone(c);
        }
        let mut rules = self.rules.write();
        let c = rules.entry(name.to_owned()).or_insert_with(|| {
            Arc::new(RuleCounters::register(
                name,
                &self.requests,
                &self.decisions,
            ))
        });
        Arc::clone(c)
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
            self.unrouted.tiers[i].get()
        } else {
            self.counters_of(rule).map_or(0, |c| c.tiers[i].get())
        }
    }
}

/// Renders every family of `gw`'s registry (OpenMetrics text, `# EOF` last).
#[must_use]
pub fn render(gw: &Arc<Gateway>) -> String {
    // The collector reads the gateway that owns it: a weak handle, so the
    // registry does not keep its gateway alive.
    let _ = gw.metrics.gateway.set(Arc::downgrade(gw));
    gw.metrics.text()
}

impl GatewayMetrics {
    /// The registry's exposition (the gateway's families only until
    /// [`render`] attached the gateway).
    fn text(&self) -> String {
        let mut out = String::with_capacity(32 << 10);
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            // Every gauge is clamped to what the encoder takes, so only a
            // bug gets here: say so rather than serve a silent cut.
            tracing::error!("metrics encoding failed; the exposition is truncated");
        }
        out
    }
}

fn role_label(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    }
}

/// A gauge value as the encoder takes it (it refuses `u64::MAX` and would
/// wrap values past `i64::MAX`).
fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Subscriber metric families, in the order the collector fills them (counter names without the `_total` the encoder appends).
const SUBSCRIBER_METRICS: [(&str, MetricType, &str); 11] = [
    (
        "kvroute_subscriber_connected",
        MetricType::Gauge,
        "1 while the KV-event subscriber has its engine connected.",
    ),
    (
        "kvroute_subscriber_events_applied",
        MetricType::Counter,
        "KV events applied to the inventory.",
    ),
    (
        "kvroute_subscriber_gaps",
        MetricType::Counter,
        "Sequence gaps seen.",
    ),
    (
        "kvroute_subscriber_clears",
        MetricType::Counter,
        "Inventory clears (gap beyond window, restart, AllBlocksCleared).",
    ),
    (
        "kvroute_subscriber_restarts",
        MetricType::Counter,
        "Engine restarts detected.",
    ),
    (
        "kvroute_subscriber_decode_errors",
        MetricType::Counter,
        "Event payloads that did not decode.",
    ),
    (
        "kvroute_subscriber_dial_failures",
        MetricType::Counter,
        "Failed dials or binds.",
    ),
    (
        "kvroute_subscriber_replays",
        MetricType::Counter,
        "Replay requests sent.",
    ),
    (
        "kvroute_subscriber_malformed_frames",
        MetricType::Counter,
        "Messages without the [topic, seq, payload] shape, dropped.",
    ),
    (
        "kvroute_subscriber_oversized_frames",
        MetricType::Counter,
        "Messages over the subscriber's size limit, dropped.",
    ),
    (
        "kvroute_subscriber_polls",
        MetricType::Counter,
        "TensorRT-LLM drains attempted (HTTP poller only).",
    ),
];

/// Per-endpoint ingest (sequence window) metric families, in the order
/// the collector fills them.
const INGEST_METRICS: [(&str, MetricType, &str); 16] = [
    (
        "kvroute_ingest_resumes",
        MetricType::Counter,
        "Reconnects that resumed from the last applied batch (something to verify).",
    ),
    (
        "kvroute_ingest_resumes_verified",
        MetricType::Counter,
        "Resumes whose replayed last batch matched the one applied.",
    ),
    (
        "kvroute_ingest_resume_restarts",
        MetricType::Counter,
        "Engine restarts found by a resume check (also counted as restarts).",
    ),
    (
        "kvroute_ingest_rekey_orphan_blocks",
        MetricType::Counter,
        "Re-key rules: stored blocks skipped because their parent is unknown.",
    ),
    (
        "kvroute_ingest_rekey_untokenized_blocks",
        MetricType::Counter,
        "Re-key rules: stored blocks skipped because the event lacks their tokens.",
    ),
    (
        "kvroute_ingest_inventory_partial",
        MetricType::Gauge,
        "1 while the endpoint's inventory is known to lack engine batches (late or failed bootstrap replay, gap, clear) until an AllBlocksCleared or an engine restart seen from batch 0.",
    ),
    (
        "kvroute_ingest_missing_batches",
        MetricType::Gauge,
        "Engine batches the endpoint's inventory is known to lack (summed over DP ranks).",
    ),
    (
        "kvroute_ingest_partial_episodes",
        MetricType::Counter,
        "Transitions of the endpoint's inventory to partial.",
    ),
    (
        "kvroute_ingest_replays_late",
        MetricType::Counter,
        "Replays whose first batch came after the requested one (the engine's buffer no longer reached back).",
    ),
    (
        "kvroute_ingest_replays_incomplete",
        MetricType::Counter,
        "Replays that failed or timed out before the engine's end marker.",
    ),
    (
        "kvroute_ingest_implausible_batches",
        MetricType::Counter,
        "Batches dropped because their sequence number is implausible (beyond max_seq, or an unconfirmed far jump).",
    ),
    (
        "kvroute_ingest_contract_mismatch",
        MetricType::Gauge,
        "1 when the endpoint's engine keys provably differ from the rule's contract (attestation or block size).",
    ),
    (
        "kvroute_ingest_verified_blocks",
        MetricType::Counter,
        "Stored blocks of this endpoint whose keys the rule's contract reproduces.",
    ),
    (
        "kvroute_ingest_mismatched_blocks",
        MetricType::Counter,
        "Stored blocks of this endpoint whose keys differ from the rule's contract (or whose block size does).",
    ),
    (
        "kvroute_ingest_capacity_blocks",
        MetricType::Gauge,
        "Bound of the endpoint's GPU-tier inventory (the engine's reported capacity, else the default).",
    ),
    (
        "kvroute_ingest_rekey_map_full",
        MetricType::Counter,
        "Re-key rules: stored blocks skipped because the re-key map was at its bound.",
    ),
];

/// Emits one counter or gauge family: its descriptor, then a sample per row
/// (no rows: the descriptor alone, so every family is always described).
fn family<L: EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (L, u64)>,
) -> std::fmt::Result {
    let mut metric = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        let sample = metric.encode_family(&labels)?;
        match kind {
            MetricType::Counter => ConstCounter::new(v).encode(sample)?,
            _ => ConstGauge::new(gauge_value(v)).encode(sample)?,
        }
    }
    Ok(())
}

/// One unlabelled sample (no `{}`: an empty label set is written as one).
fn single(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    v: u64,
) -> std::fmt::Result {
    let metric = enc.encode_descriptor(name, help, None, kind)?;
    match kind {
        MetricType::Counter => ConstCounter::new(v).encode(metric),
        _ => ConstGauge::new(gauge_value(v)).encode(metric),
    }
}

/// A subscriber's DP rank, or the TensorRT-LLM drain poller.
#[derive(Clone, Copy, Debug)]
enum Rank {
    Dp(u32),
    Drain,
}

/// The labels of a per-endpoint (and per-subscriber) sample, borrowed from
/// the rule runtime for the scrape.
#[derive(Clone, Copy, Debug)]
struct EndpointLabels<'a> {
    rule: &'a str,
    endpoint: &'a str,
    role: &'static str,
    rank: Option<Rank>,
}

impl EncodeLabelSet for EndpointLabels<'_> {
    fn encode(&self, mut enc: LabelSetEncoder) -> std::fmt::Result {
        ("rule", Esc(self.rule)).encode(enc.encode_label())?;
        ("endpoint", Esc(self.endpoint)).encode(enc.encode_label())?;
        ("role", self.role).encode(enc.encode_label())?;
        match self.rank {
            Some(Rank::Dp(r)) => ("rank", r).encode(enc.encode_label()),
            Some(Rank::Drain) => ("rank", "drain").encode(enc.encode_label()),
            None => Ok(()),
        }
    }
}

/// Per-endpoint families, in the order of [`EndpointRow::values`].
const ENDPOINT_METRICS: [(&str, MetricType, &str); 11] = [
    (
        "kvroute_kv_hits",
        MetricType::Counter,
        "KV-exact decisions with a predicted overlap, per endpoint.",
    ),
    (
        "kvroute_predicted_cached_tokens",
        MetricType::Counter,
        "Cached tokens the decision predicted, over receipts.",
    ),
    (
        "kvroute_delivered_cached_tokens",
        MetricType::Counter,
        "Cached tokens the engine reported (usage.prompt_tokens_details.cached_tokens).",
    ),
    (
        "kvroute_receipts",
        MetricType::Counter,
        "Responses that carried a cached-token receipt.",
    ),
    (
        "kvroute_contract_drift_alarm",
        MetricType::Gauge,
        "1 while predicted hits keep delivering zero cached tokens.",
    ),
    (
        "kvroute_inventory_blocks",
        MetricType::Gauge,
        "Blocks in the endpoint's inventory (all DP ranks).",
    ),
    (
        "kvroute_in_flight",
        MetricType::Gauge,
        "Requests this gateway has in flight per endpoint, from the routing decision until the response body ends or is dropped.",
    ),
    (
        "kvroute_queued_prefill_tokens",
        MetricType::Gauge,
        "Predicted uncached prompt tokens of this gateway's requests not yet at their first response byte, per endpoint.",
    ),
    (
        "kvroute_endpoint_available",
        MetricType::Gauge,
        "1 when the endpoint is eligible (admin up, breaker not open).",
    ),
    (
        "kvroute_engine_load_polls",
        MetricType::Counter,
        "Polls of the engine's own load report (its /metrics page) that gave a report.",
    ),
    (
        "kvroute_engine_load_poll_failures",
        MetricType::Counter,
        "Polls of the engine's own load report that failed (selection then uses this replica's own counts).",
    ),
];

/// One endpoint's values for one scrape.
struct EndpointRow<'a> {
    labels: EndpointLabels<'a>,
    values: [u64; ENDPOINT_METRICS.len()],
    ingest: [u64; INGEST_METRICS.len()],
    /// The engine's own fresh load report, if its poller has one.
    reported: Option<kvroute_select::EngineReport>,
}

/// One subscriber's values for one scrape.
struct SubscriberRow<'a> {
    labels: EndpointLabels<'a>,
    values: [u64; SUBSCRIBER_METRICS.len()],
    last_rejected_seq: Option<u64>,
}

/// One rule's values for one scrape.
struct RuleRow<'a> {
    rule: &'a str,
    misses: [u64; MissReason::ALL.len()],
    retries: u64,
    exhausted: u64,
    memory_bytes: u64,
    /// match, mismatch, unverifiable.
    attestations: [u64; 3],
    /// Rules with `forward_token_ids` only.
    token_ids: Option<kvroute::prompt::TokenIdSnapshot>,
}

/// Reads the library's and the subscribers' counters at scrape time.
#[derive(Debug)]
struct Scraped {
    gateway: Arc<OnceLock<Weak<Gateway>>>,
}

impl Collector for Scraped {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(gw) = self.gateway.get().and_then(Weak::upgrade) else {
            return Ok(());
        };
        encode_gateway(&gw, &mut enc)
    }
}

#[allow(clippy::too_many_lines)]
fn encode_gateway(gw: &Gateway, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    let runtimes = gw.rules_snapshot();
    let now = gw.now();
    let mut rules = Vec::with_capacity(runtimes.len());
    let mut endpoints = Vec::new();
    let mut subscribers = Vec::new();
    for rt in &runtimes {
        let rule = rt.spec.doc.name.as_str();
        let snap = rt.rule.counters().snapshot();
        let att = rt.inventory.attestation();
        rules.push(RuleRow {
            rule,
            misses: MissReason::ALL.map(|r| snap.misses_for(r)),
            retries: snap.retries,
            exhausted: snap.exhausted,
            memory_bytes: rt.inventory.memory_bytes() as u64,
            attestations: [
                att.verified_blocks,
                att.mismatched_blocks,
                att.unverifiable_events,
            ],
            token_ids: rt
                .spec
                .doc
                .forward_token_ids
                .then(|| rt.counters.token_ids.snapshot()),
        });
        for (i, (ep, ev)) in rt.endpoints.iter().zip(&snap.endpoints).enumerate() {
            let labels = EndpointLabels {
                rule,
                endpoint: &ep.spec.url,
                role: role_label(ep.spec.role),
                rank: None,
            };
            let id = kvroute_core::EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
            let own = kvroute_select::Load::load(&*rt.tracker, id);
            let seq = rt.inventory.seq_counters(i);
            let counters = rt.inventory.ingest_counters(i);
            let health = kvroute_ingest::InventoryView::health(&*rt.inventory, i);
            let ep_att = rt.inventory.endpoint_attestation(i);
            endpoints.push(EndpointRow {
                labels,
                values: [
                    ev.hits,
                    ev.predicted_tokens,
                    ev.delivered_tokens,
                    ev.receipts,
                    u64::from(ev.drift_alarm),
                    rt.inventory.blocks(i),
                    u64::from(own.in_flight),
                    own.queued_prefill_tokens,
                    u64::from(rt.is_available(i, now)),
                    ep.load_polls.ok.load(std::sync::atomic::Ordering::Relaxed),
                    ep.load_polls
                        .failed
                        .load(std::sync::atomic::Ordering::Relaxed),
                ],
                ingest: [
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
                    ep_att.verified_blocks,
                    ep_att.mismatched_blocks,
                    rt.inventory
                        .capacity(i, kvroute_core::Medium::Gpu)
                        .unwrap_or(u64::MAX),
                    counters.rekey_map_full,
                ],
                reported: rt.reported.report(id, now),
            });
            let ranks = ep
                .spec
                .events
                .iter()
                .zip(&ep.subscribers)
                .map(|(src, m)| (Rank::Dp(src.rank), m))
                .chain(ep.drain.iter().map(|m| (Rank::Drain, m)));
            for (rank, m) in ranks {
                let s = m.snapshot();
                subscribers.push(SubscriberRow {
                    labels: EndpointLabels {
                        rank: Some(rank),
                        ..labels
                    },
                    values: [
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
                    ],
                    last_rejected_seq: s.last_rejected_seq,
                });
            }
        }
    }

    family(
        enc,
        "kvroute_kv_misses",
        "KV-exact misses by reason.",
        MetricType::Counter,
        rules.iter().flat_map(|r| {
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
        rules.iter().flat_map(|r| {
            r.token_ids.into_iter().flat_map(move |t| {
                let kept = kvroute::prompt::KeepText::ALL
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
        rules.iter().map(|r| ([("rule", Esc(r.rule))], r.retries)),
    )?;
    family(
        enc,
        "kvroute_exhausted",
        "Decisions or retries that found no eligible endpoint.",
        MetricType::Counter,
        rules.iter().map(|r| ([("rule", Esc(r.rule))], r.exhausted)),
    )?;
    family(
        enc,
        "kvroute_contract_attestations",
        "Stored KV blocks re-hashed with the rule's contract (match, mismatch); stored events that cannot be re-hashed (unverifiable).",
        MetricType::Counter,
        rules.iter().flat_map(|r| {
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
        rules.iter().map(|r| ([("rule", Esc(r.rule))], r.memory_bytes)),
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
            subscribers.iter().map(|s| (s.labels, s.values[k])),
        )?;
    }
    family(
        enc,
        "kvroute_subscriber_last_rejected_seq",
        "Sequence number of the last message dropped as malformed, oversized or undecodable (absent until one carried a readable sequence).",
        MetricType::Gauge,
        subscribers
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
    encode_connections(
        enc,
        &[
            ("proxy", &gw.metrics.proxy_connections),
            ("admin", &gw.metrics.admin_connections),
        ],
    )?;
    encode_admission(enc, &gw.tokenize_admission.snapshot())?;
    if let Some(sync) = &gw.replica_sync {
        sync.encode(enc, gw)?;
    }
    Ok(())
}

/// Both listeners' connection counters.
fn encode_connections(
    enc: &mut DescriptorEncoder,
    listeners: &[(&str, &super::connections::ConnectionMetrics)],
) -> std::fmt::Result {
    type Field = fn(&super::connections::ConnectionMetrics) -> &AtomicU64;
    let families: [(&str, MetricType, &str, Field); 6] = [
        (
            "kvroute_connections_open",
            MetricType::Gauge,
            "Client connections open.",
            |m| &m.open,
        ),
        (
            "kvroute_connections_accepted",
            MetricType::Counter,
            "Client connections accepted.",
            |m| &m.accepted,
        ),
        (
            "kvroute_connections_first_byte_timeouts",
            MetricType::Counter,
            "Connections closed for sending no first byte (or no complete protocol preface) in time.",
            |m| &m.first_byte_timeouts,
        ),
        (
            "kvroute_connections_shed",
            MetricType::Counter,
            "Silent connections closed to admit a new one at the connection cap.",
            |m| &m.shed_idle,
        ),
        (
            "kvroute_connections_refused",
            MetricType::Counter,
            "New connections refused at the connection cap.",
            |m| &m.refused,
        ),
        (
            "kvroute_accept_errors",
            MetricType::Counter,
            "accept() failures (e.g. EMFILE), logged at most once per 10 s.",
            |m| &m.accept_errors,
        ),
    ];
    for (name, kind, help, field) in families {
        family(
            enc,
            name,
            help,
            kind,
            listeners
                .iter()
                .map(|(l, m)| ([("listener", *l)], field(m).load(Ordering::Relaxed))),
        )?;
    }
    Ok(())
}

/// The tokenization bound's configuration and counters.
fn encode_admission(
    enc: &mut DescriptorEncoder,
    s: &kvroute::admission::AdmissionSnapshot,
) -> std::fmt::Result {
    let families: [(&str, MetricType, &str, u64); 9] = [
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
            "Admitted only after waiting for room (tokenize_overload = \"wait\").",
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

    /// The request-path families in the exposition: every registered rule's
    /// outcomes and tiers (zero until counted), labels escaped, the
    /// histogram cumulative up to `+Inf`, counters suffixed `_total`.
    #[test]
    fn the_registry_exposes_counted_and_registered_series() {
        let m = GatewayMetrics::default();
        let c = m.rule("qwen3");
        c.outcome(Outcome::Proxied);
        c.outcome(Outcome::Proxied);
        c.tier(Source::KvExact);
        m.rule("odd \"name\"\\\n");
        m.unrouted(Outcome::Rejected);
        m.decision_latency.observe(Duration::from_micros(70));
        m.decision_latency.observe(Duration::from_millis(3));
        m.decision_latency.observe(Duration::from_secs(5));
        m.prefill_requests.inc();
        let text = m.text();
        for line in [
            "# TYPE kvroute_requests counter",
            "kvroute_requests_total{rule=\"qwen3\",outcome=\"proxied\"} 2",
            "kvroute_requests_total{rule=\"qwen3\",outcome=\"no_rule\"} 0",
            "kvroute_requests_total{rule=\"\",outcome=\"rejected\"} 1",
            "kvroute_decisions_total{rule=\"qwen3\",tier=\"kv_exact\"} 1",
            "kvroute_decisions_total{rule=\"odd \\\"name\\\"\\\\\\n\",tier=\"fallback\"} 0",
            "# TYPE kvroute_decision_latency_seconds histogram",
            "kvroute_decision_latency_seconds_count 3",
            "kvroute_decision_latency_seconds_bucket{le=\"0.00005\"} 0",
            "kvroute_decision_latency_seconds_bucket{le=\"0.0001\"} 1",
            "kvroute_decision_latency_seconds_bucket{le=\"0.0025\"} 1",
            "kvroute_decision_latency_seconds_bucket{le=\"0.005\"} 2",
            "kvroute_decision_latency_seconds_bucket{le=\"1.0\"} 2",
            "kvroute_decision_latency_seconds_bucket{le=\"+Inf\"} 3",
            "kvroute_prefill_requests_total 1",
            "kvroute_aborted_streams_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        let sum: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kvroute_decision_latency_seconds_sum "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 5.003_07).abs() < 1e-9, "{sum}");
        assert!(text.contains("# HELP kvroute_requests Requests by rule and outcome.\n"));
        assert!(text.ends_with("# EOF\n"));
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
