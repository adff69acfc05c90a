//! `[decisions]`: what an operator sees of each routing decision.

use serde::{Deserialize, Serialize};

/// `[decisions]`: what an operator sees of each routing decision.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecisionsConfig {
    /// Add `x-kvroute-endpoint`, `x-kvroute-tier`,
    /// `x-kvroute-predicted-cached-tokens` and (on a miss)
    /// `x-kvroute-miss-reason` to every proxied response, and
    /// `x-kvroute-decision-id` while the ring keeps decisions. Off hides the
    /// fleet's layout from clients (and keeps no decision in the ring).
    pub headers: bool,
    /// Fraction of decisions logged as one INFO line each (0 = none, 1 =
    /// every decision); evenly spaced, the first one always logged.
    pub log_sample_rate: f64,
    /// How many of the last decisions `GET /admin/decisions/{id}` explains
    /// (each response then carries `x-kvroute-decision-id`, unless
    /// `headers` is off); the oldest is dropped beyond. 0 keeps none,
    /// records no explanation and sends no id.
    pub ring: usize,
    /// Memory the ring may hold, in bytes: the oldest decisions are dropped
    /// beyond it too. An explanation holds a row per rule endpoint (about
    /// 200 bytes each), so on a large rule this, not `ring`, bounds it.
    pub ring_bytes: usize,
    /// A request carrying `x-kvroute-explain: 1` gets its decision's
    /// explanation in a compact `x-kvroute-explain` response header.
    pub explain: bool,
}

/// The largest `[decisions] ring`: explanations are kept in memory, one
/// row per rule endpoint each.
pub const MAX_DECISION_RING: usize = 65_536;

impl Default for DecisionsConfig {
    fn default() -> Self {
        Self {
            headers: true,
            log_sample_rate: 0.01,
            ring: 1024,
            ring_bytes: 32 << 20,
            explain: false,
        }
    }
}
