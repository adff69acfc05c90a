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

use kvroute_select::{SelectorKind, Source};
use parking_lot::RwLock;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
    MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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
    /// The client went away (or the shutdown grace ran out) before the
    /// response's head was ready: tokenizing, waiting for its turn, or
    /// waiting for an upstream's headers.
    ClientGone,
}

impl Outcome {
    /// Every outcome, in exposition order.
    const ALL: [Outcome; 9] = [
        Outcome::Proxied,
        Outcome::Passthrough,
        Outcome::TooLarge,
        Outcome::BodyTimeout,
        Outcome::NoRule,
        Outcome::NoEndpoint,
        Outcome::UpstreamError,
        Outcome::Rejected,
        Outcome::ClientGone,
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
            Outcome::ClientGone => "client_gone",
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
}

impl RuleCounters {
    fn register(
        rule: &str,
        requests: &Family<RequestLabels, Counter>,
        decisions: &Family<DecisionLabels, Counter>,
    ) -> Self {
        let (outcomes, tiers) = Self::labels(rule);
        Self {
            outcomes: outcomes.map(|l| requests.get_or_create(&l).clone()),
            tiers: tiers.map(|l| decisions.get_or_create(&l).clone()),
        }
    }

    /// Every series label set of rule `rule`: one per outcome, one per tier.
    fn labels(
        rule: &str,
    ) -> (
        [RequestLabels; Outcome::ALL.len()],
        [DecisionLabels; TIERS.len()],
    ) {
        let rule = LabelText(Arc::from(rule));
        (
            Outcome::ALL.map(|outcome| RequestLabels {
                rule: rule.clone(),
                outcome,
            }),
            std::array::from_fn(|i| DecisionLabels {
                rule: rule.clone(),
                tier: Tier(i),
            }),
        )
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

/// One rule instance's decisions by tier, for `/admin/counters`: a rule
/// deleted or replaced and created again starts from zero here, as the
/// library's counters of its new runtime do (`/metrics` keeps counting per
/// rule name across replacements, and forgets a deleted rule).
#[derive(Debug, Default)]
pub struct InstanceTiers([AtomicU64; TIERS.len()]);

impl InstanceTiers {
    /// Counts one decision by tier.
    pub fn count(&self, source: Source) {
        self.0[tier_index(source)].fetch_add(1, Ordering::Relaxed);
    }

    /// Every tier's label and count, in exposition order.
    pub fn counts(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        TIERS
            .iter()
            .zip(&self.0)
            .map(|(t, n)| (*t, n.load(Ordering::Relaxed)))
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
        let gateway = Arc::new(OnceLock::new());
        registry.register_collector(Box::new(Scraped {
            gateway: Arc::clone(&gateway),
        }));
        // Every rule's runtime: decisions, inventories, followers, load,
        // replica sharing, tokenization admission (the library's families).
        let rules = Arc::clone(&gateway);
        registry.register_collector(Box::new(kvroute::metrics::Routers::new(move || {
            rules
                .get()
                .and_then(Weak::upgrade)
                .map(|gw| {
                    gw.rules_snapshot()
                        .iter()
                        .map(|rt| rt.router.clone())
                        .collect()
                })
                .unwrap_or_default()
        })));
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

    /// The rule named `name` was deleted: its series leave `/metrics` (a
    /// rule created again under the name starts from zero, a counter reset
    /// Prometheus handles). Call it under the rule table's lock, so a rule
    /// created under the same name meanwhile cannot lose its series.
    pub fn forget_rule(&self, name: &str) {
        if self.rules.write().remove(name).is_none() {
            return;
        }
        let (outcomes, tiers) = RuleCounters::labels(name);
        for l in &outcomes {
            self.requests.remove(l);
        }
        for l in &tiers {
            self.decisions.remove(l);
        }
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

fn encode_gateway(gw: &Gateway, enc: &mut DescriptorEncoder) -> std::fmt::Result {
    encode_connections(
        enc,
        &[
            ("proxy", &gw.metrics.proxy_connections),
            ("admin", &gw.metrics.admin_connections),
        ],
    )
}

/// Both listeners' connection counters.
fn encode_connections(
    enc: &mut DescriptorEncoder,
    listeners: &[(&str, &super::connections::ConnectionMetrics)],
) -> std::fmt::Result {
    type Field = fn(&super::connections::ConnectionMetrics) -> &AtomicU64;
    let families: [(&str, MetricType, &str, Field); 8] = [
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
            "kvroute_connections_write_stalls",
            MetricType::Counter,
            "Connections closed because the client accepted no response bytes for the write-stall timeout (limits.upstream_idle_timeout_ms), or did not finish closing within it after a GOAWAY.",
            |m| &m.write_stalls,
        ),
        (
            "kvroute_connections_idle_closed",
            MetricType::Counter,
            "HTTP/2 connections closed after limits.header_read_timeout_ms with no request in flight (counted when they end, if no request began after the GOAWAY).",
            |m| &m.idle_closed,
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
        kvroute::metrics::family(
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

    /// A deleted rule's series leave the exposition; the other rules' stay.
    #[test]
    fn a_deleted_rule_leaves_the_exposition() {
        let m = GatewayMetrics::default();
        m.rule("gone").outcome(Outcome::Proxied);
        m.rule("kept").outcome(Outcome::Proxied);
        m.forget_rule("gone");
        m.forget_rule("never-was");
        let text = m.text();
        assert!(!text.contains("rule=\"gone\""), "{text}");
        assert!(
            text.contains("kvroute_requests_total{rule=\"kept\",outcome=\"proxied\"} 1"),
            "{text}"
        );
        // Created again: from zero.
        assert_eq!(m.outcome_count("gone", Outcome::Proxied), 0);
        m.rule("gone").outcome(Outcome::Proxied);
        assert_eq!(m.outcome_count("gone", Outcome::Proxied), 1);
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
