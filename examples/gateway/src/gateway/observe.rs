//! What an operator sees of the gateway's own state: readiness (every staged
//! tokenizer loaded before the proxy routes), the `x-kvroute-*` decision
//! headers and the sampled INFO line per decision.
//!
//! Readiness is a 503 rather than a delayed accept: a client (or a load
//! balancer) connecting during start-up gets an immediate, explained refusal
//! it can retry, instead of a connection that hangs in the listen backlog for
//! as long as the tokenizers take to load.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use axum::http::{HeaderMap, HeaderValue};
use kvroute_select::Decision;
use parking_lot::Mutex;

use super::config::DecisionsConfig;
use super::state::RuleRuntime;

/// Response header naming the endpoint the request went to.
pub const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";
/// Response header naming the decode endpoint of a P/D decision.
pub const DECODE_HEADER: &str = "x-kvroute-decode-endpoint";
/// Response header naming the ladder tier that chose the endpoint.
pub const TIER_HEADER: &str = "x-kvroute-tier";
/// Response header with the cached prefix tokens the decision expects.
pub const PREDICTED_HEADER: &str = "x-kvroute-predicted-cached-tokens";
/// Response header with the reason KV-exact did not decide.
pub const MISS_HEADER: &str = "x-kvroute-miss-reason";
/// Response header naming the rule that served the request.
pub const RULE_HEADER: &str = "x-kvroute-rule";

/// Where one staged tokenizer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerState {
    /// Not loaded yet.
    Loading,
    /// Loaded and usable.
    Loaded,
    /// Failed to load (the message): its rules miss with `no_tokenizer`.
    Failed(String),
}

impl TokenizerState {
    /// The word `/readyz` shows.
    #[must_use]
    pub fn as_str(&self) -> &'static str {
        match self {
            TokenizerState::Loading => "loading",
            TokenizerState::Loaded => "loaded",
            TokenizerState::Failed(_) => "failed",
        }
    }
}

/// Readiness, decision headers and decision-log sampling, shared by the
/// proxy and admin listeners.
#[derive(Debug)]
pub struct Observe {
    decisions: DecisionsConfig,
    ring: super::decisions::DecisionRing,
    seen: AtomicU64,
    tokenizers: Mutex<BTreeMap<String, TokenizerState>>,
    ready: AtomicBool,
    /// Shutting down: the proxy listener no longer accepts.
    draining: AtomicBool,
    refused_not_ready: AtomicU64,
    admin: OnceLock<SocketAddr>,
}

impl Observe {
    /// Nothing loaded yet for `models`; not ready unless there are none.
    #[must_use]
    pub fn new(decisions: DecisionsConfig, models: &[String]) -> Self {
        Self {
            ring: super::decisions::DecisionRing::new(decisions.ring, decisions.ring_bytes),
            decisions,
            seen: AtomicU64::new(0),
            tokenizers: Mutex::new(
                models
                    .iter()
                    .map(|m| (m.clone(), TokenizerState::Loading))
                    .collect(),
            ),
            ready: AtomicBool::new(models.is_empty()),
            draining: AtomicBool::new(false),
            refused_not_ready: AtomicU64::new(0),
            admin: OnceLock::new(),
        }
    }

    /// The last decisions' explanations (`GET /admin/decisions/{id}`).
    #[must_use]
    pub fn ring(&self) -> &super::decisions::DecisionRing {
        &self.ring
    }

    /// Whether a request with these headers gets its explanation in
    /// `x-kvroute-explain` (`[decisions] explain` on, and it asked).
    #[must_use]
    pub fn explain_header(&self, request: &HeaderMap) -> bool {
        self.decisions.explain && super::decisions::asked(request)
    }

    /// Whether a decision records its explanation: the ring keeps it (the
    /// client gets its id with the other decision headers), or the request
    /// gets it in a header.
    #[must_use]
    pub fn records(&self, explain_header: bool) -> bool {
        explain_header || (self.decisions.headers && self.ring.enabled())
    }

    /// Files a decision's explanation ([`super::decisions::file`]): into the
    /// ring with its id in `x-kvroute-decision-id` unless `[decisions]
    /// headers = false`, and in `x-kvroute-explain` when `explain_header`.
    /// Returns the ring id.
    pub fn file(
        &self,
        rt: &std::sync::Arc<RuleRuntime>,
        x: Option<Box<kvroute_select::Explanation>>,
        explain_header: bool,
        headers: &mut HeaderMap,
    ) -> Option<u64> {
        let ring = self.decisions.headers.then_some(&self.ring);
        super::decisions::file(ring, rt, x, explain_header, headers)
    }

    /// Records the outcome of loading `model`; the gateway becomes ready once
    /// no staged tokenizer is still loading.
    pub fn tokenizer_done(&self, model: &str, state: TokenizerState) {
        let mut t = self.tokenizers.lock();
        t.insert(model.to_owned(), state);
        if !t.values().any(|s| *s == TokenizerState::Loading) {
            self.ready.store(true, Ordering::Release);
        }
    }

    /// Whether the proxy routes (every staged tokenizer has loaded or failed).
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The gateway is shutting down: `/readyz` says `draining` (503) while
    /// the proxy's requests finish.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the gateway is shutting down.
    #[must_use]
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Each staged tokenizer's state.
    #[must_use]
    pub fn tokenizers(&self) -> BTreeMap<String, TokenizerState> {
        self.tokenizers.lock().clone()
    }

    /// Counts a request refused because the gateway was not ready; returns
    /// the models still loading (for the 503 message).
    pub fn refuse_not_ready(&self) -> Vec<String> {
        self.refused_not_ready.fetch_add(1, Ordering::Relaxed);
        self.tokenizers
            .lock()
            .iter()
            .filter(|(_, s)| **s == TokenizerState::Loading)
            .map(|(m, _)| m.clone())
            .collect()
    }

    /// Requests answered 503 before the gateway was ready.
    #[must_use]
    pub fn refused_not_ready(&self) -> u64 {
        self.refused_not_ready.load(Ordering::Relaxed)
    }

    /// Remembers the bound admin address (named in the proxy's 404s).
    pub fn set_admin_addr(&self, addr: SocketAddr) {
        let _ = self.admin.set(addr);
    }

    /// The bound admin address, once known.
    #[must_use]
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.get().copied()
    }

    /// Whether this decision gets its INFO line: evenly spaced at the
    /// configured rate, the first decision always (so a fresh gateway shows
    /// one at once).
    fn sampled(&self) -> bool {
        let rate = self.decisions.log_sample_rate;
        if rate <= 0.0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        // Precision: exact for any count a gateway reaches (< 2^53).
        #[allow(clippy::cast_precision_loss)]
        let n = n as f64;
        (n * rate).floor() != ((n - 1.0) * rate).floor()
    }

    /// Adds the decision headers (unless `[decisions] headers = false`) and
    /// logs the sampled INFO line for one answered decision.
    pub fn decision(&self, rt: &RuleRuntime, d: &Decision, headers: &mut HeaderMap) {
        let shown = Shown::of(rt, d);
        if self.sampled() {
            tracing::info!(rule = %shown.rule, endpoint = shown.endpoint.unwrap_or("none"),
                decode_endpoint = shown.decode, tier = shown.tier,
                predicted_cached_tokens = shown.predicted_cached_tokens,
                miss_reason = shown.miss.unwrap_or("none"), prompt_tokens = d.prompt_tokens(),
                retries = d.retries(), "decision");
        }
        if self.decisions.headers {
            shown.write(headers);
        }
    }
}

/// One decision as the headers and the log line show it.
struct Shown<'a> {
    rule: &'a str,
    endpoint: Option<&'a str>,
    decode: Option<&'a str>,
    tier: &'static str,
    predicted_cached_tokens: u32,
    miss: Option<&'static str>,
}

impl<'a> Shown<'a> {
    fn of(rt: &'a RuleRuntime, d: &Decision) -> Self {
        let url = |id: kvroute_core::EndpointId| rt.endpoint(id.index()).map(|e| e.url.as_str());
        let target = d.target();
        Self {
            rule: &rt.spec.doc.name,
            endpoint: target.and_then(|t| url(t.endpoint)),
            decode: target.and_then(|t| t.decode).and_then(url),
            tier: d.source().as_str(),
            predicted_cached_tokens: d.predicted_cached_tokens(rt.router.block_size()),
            miss: d.miss().map(kvroute_select::MissReason::as_str),
        }
    }

    fn write(&self, headers: &mut HeaderMap) {
        let mut put = |name: &'static str, value: &str| {
            // Configured URLs and rule names are validated ASCII; a value that
            // still is not a header value is left out rather than mangled.
            if let Ok(v) = HeaderValue::from_str(value) {
                headers.insert(name, v);
            }
        };
        put(RULE_HEADER, self.rule);
        if let Some(e) = self.endpoint {
            put(ENDPOINT_HEADER, e);
        }
        if let Some(e) = self.decode {
            put(DECODE_HEADER, e);
        }
        put(TIER_HEADER, self.tier);
        put(PREDICTED_HEADER, &self.predicted_cached_tokens.to_string());
        if let Some(m) = self.miss {
            put(MISS_HEADER, m);
        }
    }
}

/// Takes out of an engine's answer the headers that name this gateway's
/// decisions (`x-kvroute-*`): an engine behind another kvroute, or one that
/// sets them itself, must not pass off its own as this decision's when this
/// gateway sends none (`decisions.headers = false`, a miss without a reason).
pub fn drop_engine_decision_headers(headers: &mut HeaderMap) {
    let own: Vec<axum::http::HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("x-kvroute-"))
        .cloned()
        .collect();
    for k in own {
        headers.remove(k);
    }
}

/// The headers of a pass-through request (no KV decision): the endpoint and
/// the tier `passthrough`.
pub fn passthrough_headers(obs: &Observe, rule: &str, endpoint: &str, headers: &mut HeaderMap) {
    if !obs.decisions.headers {
        return;
    }
    for (name, value) in [
        (RULE_HEADER, rule),
        (ENDPOINT_HEADER, endpoint),
        (TIER_HEADER, "passthrough"),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.insert(name, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn observe(rate: f64) -> Observe {
        Observe::new(
            DecisionsConfig {
                headers: true,
                log_sample_rate: rate,
                ..DecisionsConfig::default()
            },
            &["a".to_owned(), "b".to_owned()],
        )
    }

    #[test]
    fn sampling_logs_the_first_and_then_evenly() {
        for (rate, n, expected) in [(0.01, 1000, 10), (1.0, 50, 50), (0.0, 50, 0), (0.25, 8, 2)] {
            let o = observe(rate);
            let picked: Vec<usize> = (0..n).filter(|_| o.sampled()).collect();
            assert_eq!(picked.len(), expected, "rate {rate}: {picked:?}");
            if expected > 0 {
                assert_eq!(picked[0], 0, "rate {rate}: the first decision is logged");
            }
        }
        let o = observe(0.25);
        let picked: Vec<usize> = (0..12).filter(|_| o.sampled()).collect();
        assert_eq!(picked, [0, 4, 8]);
    }

    #[test]
    fn ready_once_every_tokenizer_settled() {
        let o = observe(0.0);
        assert!(!o.is_ready());
        assert_eq!(o.refuse_not_ready(), ["a", "b"]);
        o.tokenizer_done("a", TokenizerState::Loaded);
        assert!(!o.is_ready());
        assert_eq!(o.refuse_not_ready(), ["b"]);
        o.tokenizer_done("b", TokenizerState::Failed("bad".into()));
        assert!(o.is_ready());
        assert_eq!(o.refused_not_ready(), 2);
        assert!(Observe::new(DecisionsConfig::default(), &[]).is_ready());
    }
}
