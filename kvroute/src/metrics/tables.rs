//! The families a router exports and how one sample is written.

use std::fmt::Write as _;

use kvroute_select::Role;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabel, EncodeLabelSet, EncodeLabelValue, EncodeMetric,
    LabelSetEncoder, LabelValueEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// Writes `v` as a label value: prometheus-client writes values verbatim, the
/// text format needs `\`, `"` and newlines escaped.
pub(super) fn write_escaped(out: &mut LabelValueEncoder, v: &str) -> std::fmt::Result {
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

/// A borrowed label value, escaped.
#[derive(Clone, Copy, Debug)]
pub(super) struct Esc<'a>(pub(super) &'a str);

impl EncodeLabelValue for Esc<'_> {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        write_escaped(out, self.0)
    }
}

pub(super) fn role_label(r: Role) -> &'static str {
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
pub(super) const SUBSCRIBER_METRICS: [(&str, MetricType, &str); 15] = [
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
    (
        "kvroute_subscriber_malformed_events",
        MetricType::Counter,
        "Single events with invalid fields dropped from otherwise valid payloads.",
    ),
    (
        "kvroute_subscriber_unknown_event_types",
        MetricType::Counter,
        "Events of a type the decoder does not know, skipped (a newer engine?).",
    ),
    (
        "kvroute_subscriber_smaller_window_events",
        MetricType::Counter,
        "TensorRT-LLM events of an attention window smaller than the largest seen, skipped.",
    ),
    (
        "kvroute_subscriber_untracked_offloaded_blocks",
        MetricType::Counter,
        "TensorRT-LLM blocks that left the GPU while the decoder's tier map was full.",
    ),
];

/// Per-endpoint ingest (sequence window) metric families, in the order
/// the collector fills them.
pub(super) const INGEST_METRICS: [(&str, MetricType, &str); 17] = [
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
    (
        "kvroute_ingest_clears_not_needed",
        MetricType::Counter,
        "Clears a stream's sequence asked for that were skipped: nothing of that stream was in the inventory since its last clear (an engine's DP ranks showing one restart).",
    ),
];

/// Emits one counter or gauge family: its descriptor, then a sample per row
/// (no rows: the descriptor alone, so every family is always described).
/// Gauge values above `i64::MAX` are written as `i64::MAX`.
///
/// # Errors
/// The encoder's.
pub fn family<L: EncodeLabelSet>(
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
pub(super) fn single(
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
pub(super) enum Rank {
    Dp(u32),
    Drain,
}

/// The labels of a per-endpoint (and per-subscriber) sample, borrowed from
/// the rule runtime for the scrape.
#[derive(Clone, Copy, Debug)]
pub(super) struct EndpointLabels<'a> {
    pub(super) rule: &'a str,
    pub(super) endpoint: &'a str,
    pub(super) role: &'static str,
    pub(super) rank: Option<Rank>,
}

impl EncodeLabelSet for EndpointLabels<'_> {
    fn encode(&self, mut enc: LabelSetEncoder) -> std::fmt::Result {
        self.encode_into(&mut enc)
    }
}

/// An endpoint's labels and the `cause` of lost cached tokens.
#[derive(Clone, Copy, Debug)]
pub(super) struct CauseLabels<'a> {
    pub(super) endpoint: EndpointLabels<'a>,
    pub(super) cause: &'static str,
}

impl EncodeLabelSet for CauseLabels<'_> {
    fn encode(&self, mut enc: LabelSetEncoder) -> std::fmt::Result {
        self.endpoint.encode_into(&mut enc)?;
        ("cause", self.cause).encode(enc.encode_label())
    }
}

impl EndpointLabels<'_> {
    fn encode_into(&self, enc: &mut LabelSetEncoder) -> std::fmt::Result {
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
pub(super) const ENDPOINT_METRICS: [(&str, MetricType, &str); 15] = [
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
        "kvroute_reachable_cached_tokens",
        MetricType::Counter,
        "Cached prompt tokens the best eligible endpoint held at decision time, over settled receipts (attributed to the endpoint the request went to): achieved plus every lost cause.",
    ),
    (
        "kvroute_achieved_cached_tokens",
        MetricType::Counter,
        "Of the reachable cached tokens, those the engine delivered (its receipt, up to the prediction).",
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
        "Requests this replica has in flight per endpoint, from the routing decision until the response body ends or is dropped.",
    ),
    (
        "kvroute_queued_prefill_tokens",
        MetricType::Gauge,
        "Predicted uncached prompt tokens of this replica's requests not yet at their first response byte, per endpoint.",
    ),
    (
        "kvroute_endpoint_available",
        MetricType::Gauge,
        "1 when the endpoint is eligible (admin up, breaker not open, not ejected by outlier detection).",
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
    (
        "kvroute_endpoint_ejected",
        MetricType::Gauge,
        "1 while outlier detection keeps the endpoint out of rotation (its requests stalled while the others answered and its engine's load report did not count them, or consecutive response-header timeouts).",
    ),
    (
        "kvroute_outlier_ejections",
        MetricType::Counter,
        "Times outlier detection took the endpoint out of rotation.",
    ),
];
