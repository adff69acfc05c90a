//! Replica load sharing (`[replicas]`): the transport that carries each
//! rule's [`LoadTracker`] outbox to the other `kvroute serve` replicas and
//! applies theirs to the rule's [`RemoteLoad`], so every replica's load view
//! counts the requests the others have in flight
//! ([`kvroute_select::replica_sync`] holds the logic; this module only moves
//! bytes).
//!
//! * **Sending.** Every `sync_interval_ms` one task drains each rule's
//!   outbox (changed endpoints only; every endpoint each `heartbeat_ms`,
//!   which also keeps this replica alive at its peers) into one batch. Each
//!   peer has its own task and a bounded queue: the task merges whatever
//!   batches queued while it was posting into one `POST
//!   /admin/replica-sync` (≤ [`MAX_BODY`] bytes each), with this replica's
//!   admin token. A full queue drops the batch (counted) and a failed post is
//!   counted; either makes the next successful post trigger a full resend,
//!   because deltas carry totals and a resend repairs anything lost.
//! * **Wire form.** Endpoints are named by URL, not index: replicas may list
//!   a rule's endpoints in another order. The origin id is per rule instance
//!   (random), because a replaced rule's new tracker numbers its deltas from
//!   1 again and would look stale under the old id; a replaced or deleted
//!   instance is still drained until its last request ends.
//! * **Receiving.** [`ReplicaSync::receive`] maps rule name and URL to the
//!   local rule and endpoint and applies each delta; duplicates, reordering,
//!   unknown rules or endpoints and a full origin table are counted, never
//!   errors. An origin silent for `remote_ttl_ms` stops counting (a killed
//!   replica's load goes away) and is forgotten by the sync task.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kvroute_core::EndpointId;
use kvroute_select::{Applied, Load, LoadDelta, LoadTracker, RemoteConfig, RemoteLoad};
use parking_lot::Mutex;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::config::{ConfigError, ReplicasConfig};
use super::state::{Gateway, RuleRuntime};

/// The admin route peers post to.
pub const PATH: &str = "/admin/replica-sync";

/// Largest body accepted (and sent: larger batches are split).
pub const MAX_BODY: usize = 1 << 20;

/// Batches queued per peer while its previous post is under way.
const PEER_QUEUE: usize = 32;

/// Other replicas' rule instances one rule counts at most (the library
/// refuses and counts more until one expires).
const MAX_ORIGINS: usize = 64;

/// Replaced or deleted rule instances still drained until their requests end
/// (beyond it, peers keep an old instance's last totals until its TTL).
const MAX_RETIRING: usize = 16;

/// One replica's load changes, as posted to a peer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    /// The sender's `[replicas] id` (for logs; not trusted for anything).
    pub replica: String,
    /// Per rule, the endpoints whose load changed.
    pub rules: Vec<RuleDeltas>,
}

/// One rule's changes in a [`SyncBatch`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleDeltas {
    /// Rule name (replicas share their rule set).
    pub rule: String,
    /// The rule instance's origin id at the sender.
    pub origin: u64,
    /// Changed endpoints.
    pub endpoints: Vec<EndpointDelta>,
}

/// One endpoint's totals at the sender ([`LoadDelta`] with the endpoint
/// named by its URL).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointDelta {
    /// The endpoint's `url` in the rule.
    pub url: String,
    /// Sequence number (per origin, increasing).
    pub seq: u64,
    /// The sender's requests in flight there.
    pub in_flight: u32,
    /// The sender's predicted queued prefill tokens there.
    pub queued_prefill_tokens: u64,
    /// Change of `in_flight` since the sender's previous delta.
    pub requests: i64,
    /// Change of `queued_prefill_tokens` since then.
    pub prefill_tokens: i64,
    /// The sender's predicted prefill tokens ever charged there (monotonic;
    /// absent from older senders).
    #[serde(default)]
    pub charged_prefill_tokens: u64,
}

/// What one received batch did, per delta (the answer to the post).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Receipt {
    /// Deltas applied.
    pub applied: u64,
    /// Duplicates and older deltas ignored.
    pub stale: u64,
    /// This replica's own deltas ignored.
    pub own: u64,
    /// Deltas for a rule this replica does not have.
    pub unknown_rule: u64,
    /// Deltas for a URL the rule does not list.
    pub unknown_endpoint: u64,
    /// Deltas refused because the rule already counts the most origins.
    pub origins_full: u64,
}

/// A peer and what happened to the posts to it.
#[derive(Debug)]
struct Peer {
    /// The configured admin base URL.
    base: String,
    target: reqwest::Url,
    sent: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    /// Something meant for this peer was lost since its last successful post.
    lost: AtomicBool,
    last_error: Mutex<Option<String>>,
}

#[derive(Debug, Default)]
struct Counters {
    deltas_sent: AtomicU64,
    heartbeats: AtomicU64,
    accepted: AtomicU64,
    rejected: AtomicU64,
    applied: AtomicU64,
    stale: AtomicU64,
    own: AtomicU64,
    unknown_rule: AtomicU64,
    unknown_endpoint: AtomicU64,
    origins_full: AtomicU64,
    expired: AtomicU64,
}

/// The replica-sync transport of one gateway; `None` in the gateway when
/// `[replicas] peers` is empty.
#[derive(Debug)]
pub struct ReplicaSync {
    id: String,
    peers: Vec<Arc<Peer>>,
    interval: Duration,
    heartbeat: Duration,
    ttl: Duration,
    token: Option<String>,
    client: reqwest::Client,
    /// The next tick resends every endpoint (a peer came back).
    resync: AtomicBool,
    counters: Counters,
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Checks `[replicas]` and returns each peer's post target.
///
/// # Errors
/// A zero interval, a TTL not above the heartbeat, a peer that is not a plain
/// `http(s)://host:port` base URL, a duplicate, or this replica's own admin
/// listener.
pub fn validate(
    cfg: &ReplicasConfig,
    admin_listen: SocketAddr,
) -> Result<Vec<(String, reqwest::Url)>, ConfigError> {
    if cfg.sync_interval_ms == 0 {
        return Err(invalid("replicas.sync_interval_ms", "must be at least 1"));
    }
    if cfg.heartbeat_ms == 0 {
        return Err(invalid("replicas.heartbeat_ms", "must be at least 1"));
    }
    if cfg.remote_ttl_ms <= cfg.heartbeat_ms {
        return Err(invalid(
            "replicas.remote_ttl_ms",
            format!(
                "must exceed replicas.heartbeat_ms ({}): an idle replica would expire at its peers between two heartbeats",
                cfg.heartbeat_ms
            ),
        ));
    }
    if let Some(id) = &cfg.id {
        if id.trim().is_empty() || id.len() > 256 {
            return Err(invalid("replicas.id", "must be 1 to 256 characters"));
        }
    }
    let mut out: Vec<(String, reqwest::Url)> = Vec::new();
    for (i, p) in cfg.peers.iter().enumerate() {
        let field = format!("replicas.peers[{i}]");
        let url = reqwest::Url::parse(p).map_err(|e| invalid(&field, format!("{p:?}: {e}")))?;
        let plain = matches!(url.scheme(), "http" | "https")
            && url.host_str().is_some()
            && url.username().is_empty()
            && url.password().is_none()
            && matches!(url.path(), "" | "/")
            && url.query().is_none()
            && url.fragment().is_none();
        if !plain {
            return Err(invalid(
                &field,
                format!("{p:?} must be a peer's admin base URL, http(s)://host:port (no path, query or credentials)"),
            ));
        }
        let port = url.port_or_known_default().unwrap_or(0);
        let own_ip = url.host_str().and_then(|h| {
            h.trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<IpAddr>()
                .ok()
        });
        let is_self = admin_listen.port() != 0
            && port == admin_listen.port()
            && own_ip.is_some_and(|ip| {
                ip == admin_listen.ip() || (admin_listen.ip().is_unspecified() && ip.is_loopback())
            });
        if is_self {
            return Err(invalid(
                &field,
                format!("{p:?} is this replica's own admin listener"),
            ));
        }
        let target = url
            .join(PATH.trim_start_matches('/'))
            .map_err(|e| invalid(&field, format!("{p:?}: {e}")))?;
        if out.iter().any(|(_, t)| *t == target) {
            return Err(invalid(&field, format!("{p:?} is listed twice")));
        }
        out.push((p.clone(), target));
    }
    Ok(out)
}

impl ReplicaSync {
    /// The transport for `cfg`, or `None` without peers. `listen` names this
    /// replica when `id` is unset; `token` is sent to the peers (replicas of
    /// one deployment share the admin token).
    ///
    /// # Errors
    /// See [`validate`]; an HTTP client that cannot be built.
    pub fn new(
        cfg: &ReplicasConfig,
        listen: SocketAddr,
        admin_listen: SocketAddr,
        token: Option<String>,
    ) -> Result<Option<Self>, ConfigError> {
        let targets = validate(cfg, admin_listen)?;
        if targets.is_empty() {
            return Ok(None);
        }
        let heartbeat = Duration::from_millis(cfg.heartbeat_ms);
        // A post slower than a heartbeat is as good as lost: the next
        // heartbeat carries everything again.
        let timeout = heartbeat.clamp(Duration::from_millis(100), Duration::from_secs(2));
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(timeout)
            .timeout(timeout)
            .pool_max_idle_per_host(2)
            .build()
            .map_err(|e| invalid("replicas", format!("HTTP client: {e}")))?;
        let peers = targets
            .into_iter()
            .map(|(base, target)| {
                Arc::new(Peer {
                    base,
                    target,
                    sent: AtomicU64::new(0),
                    failed: AtomicU64::new(0),
                    dropped: AtomicU64::new(0),
                    lost: AtomicBool::new(false),
                    last_error: Mutex::new(None),
                })
            })
            .collect();
        Ok(Some(Self {
            id: cfg.id.clone().unwrap_or_else(|| listen.to_string()),
            peers,
            interval: Duration::from_millis(cfg.sync_interval_ms),
            heartbeat,
            ttl: Duration::from_millis(cfg.remote_ttl_ms),
            token,
            client,
            resync: AtomicBool::new(false),
            counters: Counters::default(),
        }))
    }

    /// A syncing tracker for a new rule instance of `endpoints` endpoints and
    /// the table of the other replicas' load on them (the instance's fresh
    /// origin id is its own, ignored when a peer echoes it).
    #[must_use]
    pub fn rule_tables(&self, endpoints: usize) -> (LoadTracker, RemoteLoad) {
        let origin: u64 = rand::random();
        let remote = RemoteLoad::new(
            RemoteConfig {
                endpoints,
                max_origins: MAX_ORIGINS,
                ttl: self.ttl,
            },
            origin,
        );
        (LoadTracker::with_sync(endpoints, origin), remote)
    }

    /// Starts the sync task and one sender per peer; they end when the
    /// gateway is dropped.
    pub fn spawn(self: &Arc<Self>, gw: &Arc<Gateway>) {
        let mut queues = Vec::with_capacity(self.peers.len());
        for peer in &self.peers {
            let (tx, rx) = mpsc::channel(PEER_QUEUE);
            queues.push(tx);
            tokio::spawn(peer_loop(Arc::clone(self), Arc::clone(peer), rx));
        }
        tracing::info!(replica = %self.id, peers = ?self.peers.iter().map(|p| &p.base).collect::<Vec<_>>(),
            interval_ms = self.interval.as_millis() as u64, heartbeat_ms = self.heartbeat.as_millis() as u64,
            ttl_ms = self.ttl.as_millis() as u64, "replica load sharing on");
        tokio::spawn(sync_loop(Arc::clone(self), Arc::downgrade(gw), queues));
    }

    /// One batch of every rule's drained outbox (`full`: every endpoint).
    fn collect(
        &self,
        rules: &[Arc<RuleRuntime>],
        full: bool,
        buf: &mut Vec<LoadDelta>,
    ) -> SyncBatch {
        let mut batch = SyncBatch {
            replica: self.id.clone(),
            rules: Vec::new(),
        };
        for rt in rules {
            let Some(origin) = rt.tracker.origin() else {
                continue;
            };
            if full {
                rt.tracker.resync();
            }
            buf.clear();
            if rt.tracker.drain_deltas(buf) == 0 {
                continue;
            }
            let endpoints: Vec<EndpointDelta> = buf
                .iter()
                .filter_map(|d| {
                    rt.endpoint(d.endpoint).map(|e| EndpointDelta {
                        url: e.spec.url.clone(),
                        seq: d.seq,
                        in_flight: d.in_flight,
                        queued_prefill_tokens: d.queued_prefill_tokens,
                        requests: d.requests,
                        prefill_tokens: d.prefill_tokens,
                        charged_prefill_tokens: d.charged_prefill_tokens,
                    })
                })
                .collect();
            self.counters
                .deltas_sent
                .fetch_add(endpoints.len() as u64, Ordering::Relaxed);
            batch.rules.push(RuleDeltas {
                rule: rt.spec.doc.name.clone(),
                origin,
                endpoints,
            });
        }
        batch
    }

    /// Applies a posted batch received at the gateway's `now`.
    ///
    /// # Errors
    /// The body is not a [`SyncBatch`] (counted as rejected).
    pub fn receive(&self, gw: &Gateway, body: &[u8]) -> Result<Receipt, serde_json::Error> {
        let batch: SyncBatch = match serde_json::from_slice(body) {
            Ok(b) => b,
            Err(e) => {
                self.reject();
                return Err(e);
            }
        };
        self.counters.accepted.fetch_add(1, Ordering::Relaxed);
        let now = gw.now();
        let mut r = Receipt::default();
        for rd in &batch.rules {
            let rule = gw.rule(&rd.rule);
            let Some((rt, remote)) = rule
                .as_ref()
                .and_then(|rt| rt.remote.as_ref().map(|remote| (rt, remote)))
            else {
                r.unknown_rule += rd.endpoints.len() as u64;
                continue;
            };
            for ed in &rd.endpoints {
                let Some(i) = rt.endpoint_index(&ed.url) else {
                    r.unknown_endpoint += 1;
                    continue;
                };
                let delta = LoadDelta {
                    origin: rd.origin,
                    seq: ed.seq,
                    endpoint: i,
                    requests: ed.requests,
                    prefill_tokens: ed.prefill_tokens,
                    in_flight: ed.in_flight,
                    queued_prefill_tokens: ed.queued_prefill_tokens,
                    charged_prefill_tokens: ed.charged_prefill_tokens,
                };
                match remote.apply(&delta, now) {
                    Applied::Applied => r.applied += 1,
                    Applied::Stale => r.stale += 1,
                    Applied::Own => r.own += 1,
                    Applied::UnknownEndpoint => r.unknown_endpoint += 1,
                    Applied::OriginsFull => r.origins_full += 1,
                }
            }
            // The cost scorer's drain model times the other replica's
            // charges from their arrival, not from this replica's next
            // decision.
            rt.rule.observe_load(&**rt, now);
        }
        let c = &self.counters;
        for (counter, n) in [
            (&c.applied, r.applied),
            (&c.stale, r.stale),
            (&c.own, r.own),
            (&c.unknown_rule, r.unknown_rule),
            (&c.unknown_endpoint, r.unknown_endpoint),
            (&c.origins_full, r.origins_full),
        ] {
            counter.fetch_add(n, Ordering::Relaxed);
        }
        if r.unknown_rule + r.unknown_endpoint > 0 {
            tracing::debug!(replica = %batch.replica, unknown_rule = r.unknown_rule,
                unknown_endpoint = r.unknown_endpoint, "replica sync: deltas for rules or endpoints not configured here");
        }
        Ok(r)
    }

    /// Counts a post refused before it was read (too large, truncated).
    pub fn reject(&self) {
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// The `replica_sync` object of `/admin/counters`.
    #[must_use]
    pub fn snapshot(&self, gw: &Gateway) -> Value {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let peers: Vec<Value> = self
            .peers
            .iter()
            .map(|p| {
                json!({
                    "url": p.base,
                    "sent": get(&p.sent),
                    "failed": get(&p.failed),
                    "dropped": get(&p.dropped),
                    "last_error": *p.last_error.lock(),
                })
            })
            .collect();
        let origins: BTreeMap<String, u64> = gw
            .rules_snapshot()
            .iter()
            .filter_map(|rt| {
                rt.remote
                    .as_ref()
                    .map(|r| (rt.spec.doc.name.clone(), r.counters().origins))
            })
            .collect();
        json!({
            "id": self.id,
            "peers": peers,
            "deltas_sent": get(&c.deltas_sent),
            "heartbeats": get(&c.heartbeats),
            "batches_accepted": get(&c.accepted),
            "batches_rejected": get(&c.rejected),
            "received": {
                "applied": get(&c.applied),
                "stale": get(&c.stale),
                "own": get(&c.own),
                "unknown_rule": get(&c.unknown_rule),
                "unknown_endpoint": get(&c.unknown_endpoint),
                "origins_full": get(&c.origins_full),
            },
            "expired_origins": get(&c.expired),
            "origins": origins,
        })
    }

    /// Encodes the replica-sync families into a `/metrics` scrape.
    ///
    /// # Errors
    /// The encoder's.
    pub fn encode(&self, enc: &mut DescriptorEncoder, gw: &Gateway) -> std::fmt::Result {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut m = enc.encode_descriptor(
            "kvroute_replica_sync_batches",
            "Batches of load changes for each peer replica: posted (sent), post failed or refused (failed), or dropped because the peer's queue was full (dropped). A loss triggers a full resend once the peer answers again.",
            None,
            MetricType::Counter,
        )?;
        for p in &self.peers {
            for (result, n) in [
                ("sent", get(&p.sent)),
                ("failed", get(&p.failed)),
                ("dropped", get(&p.dropped)),
            ] {
                let labels = [("peer", Esc(&p.base)), ("result", Esc(result))];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
        for (name, help, n) in [
            (
                "kvroute_replica_sync_deltas_sent",
                "Endpoint load deltas put into outgoing batches.",
                get(&c.deltas_sent),
            ),
            (
                "kvroute_replica_sync_heartbeats",
                "Full resends of this replica's totals (heartbeats and repairs).",
                get(&c.heartbeats),
            ),
            (
                "kvroute_replica_sync_expired_origins",
                "Peer rule instances forgotten after remote_ttl_ms of silence (their load stopped counting).",
                get(&c.expired),
            ),
        ] {
            let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(n).encode(m)?;
        }
        let mut m = enc.encode_descriptor(
            "kvroute_replica_sync_received_batches",
            "Batches posted by peers: parsed (accepted) or refused as malformed, too large or truncated (rejected).",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("accepted", get(&c.accepted)),
            ("rejected", get(&c.rejected)),
        ] {
            ConstCounter::new(n).encode(m.encode_family(&[("result", Esc(result))])?)?;
        }
        let mut m = enc.encode_descriptor(
            "kvroute_replica_sync_received_deltas",
            "Endpoint load deltas received from peers, by what applying them did (only applied ones change the load view).",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("applied", get(&c.applied)),
            ("stale", get(&c.stale)),
            ("own", get(&c.own)),
            ("unknown_rule", get(&c.unknown_rule)),
            ("unknown_endpoint", get(&c.unknown_endpoint)),
            ("origins_full", get(&c.origins_full)),
        ] {
            ConstCounter::new(n).encode(m.encode_family(&[("result", Esc(result))])?)?;
        }
        let now = gw.now();
        let rules = gw.rules_snapshot();
        let synced = || {
            rules
                .iter()
                .filter_map(|rt| rt.remote.as_ref().map(|r| (rt, r)))
        };
        let mut m = enc.encode_descriptor(
            "kvroute_replica_sync_origins",
            "Peer rule instances whose load this rule currently counts.",
            None,
            MetricType::Gauge,
        )?;
        for (rt, remote) in synced() {
            let labels = [("rule", Esc(&rt.spec.doc.name))];
            ConstGauge::new(gauge(remote.counters().origins)).encode(m.encode_family(&labels)?)?;
        }
        type Pick = fn(kvroute_select::EndpointLoad) -> u64;
        let families: [(&str, &str, Pick); 2] = [
            (
                "kvroute_remote_in_flight",
                "Requests the peer replicas have in flight per endpoint, as their last live deltas said.",
                |l| u64::from(l.in_flight),
            ),
            (
                "kvroute_remote_queued_prefill_tokens",
                "Predicted queued prefill tokens of the peer replicas' requests per endpoint.",
                |l| l.queued_prefill_tokens,
            ),
        ];
        for (name, help, pick) in families {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (rt, remote) in synced() {
                for (i, ep) in rt.endpoints.iter().enumerate() {
                    let id = EndpointId(u32::try_from(i).unwrap_or(u32::MAX));
                    let labels = [
                        ("rule", Esc(&rt.spec.doc.name)),
                        ("endpoint", Esc(&ep.spec.url)),
                    ];
                    ConstGauge::new(gauge(pick(remote.remote(id, now))))
                        .encode(m.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// A gauge value the encoder accepts.
fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A label value, escaped as the text format needs (prometheus-client
/// writes values verbatim).
#[derive(Clone, Copy, Debug)]
struct Esc<'a>(&'a str);

impl EncodeLabelValue for Esc<'_> {
    fn encode(&self, out: &mut LabelValueEncoder) -> std::fmt::Result {
        let mut rest = self.0;
        while let Some(i) = rest.find(['\\', '"', '\n']) {
            out.write_str(&rest[..i])?;
            out.write_str(match rest.as_bytes().get(i) {
                Some(b'\\') => "\\\\",
                Some(b'"') => "\\\"",
                _ => "\\n",
            })?;
            rest = rest.get(i + 1..).unwrap_or("");
        }
        out.write_str(rest)
    }
}

/// Every `interval`: heartbeat, expiry, drain, hand the batch to the peers.
async fn sync_loop(
    sync: Arc<ReplicaSync>,
    gw: Weak<Gateway>,
    queues: Vec<mpsc::Sender<Arc<SyncBatch>>>,
) {
    let mut tick = tokio::time::interval(sync.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_heartbeat = Duration::ZERO;
    let mut next_expiry = Duration::ZERO;
    let mut buf = Vec::new();
    // Rule instances replaced or deleted while requests were in flight: their
    // trackers are still drained, so peers see those requests end instead of
    // keeping the last totals until remote_ttl_ms.
    let mut known: Vec<Arc<RuleRuntime>> = Vec::new();
    let mut retiring: Vec<Arc<RuleRuntime>> = Vec::new();
    loop {
        tick.tick().await;
        let Some(gw) = gw.upgrade() else {
            return;
        };
        let now = gw.now();
        let mut rules = gw.rules_snapshot();
        for old in known.drain(..) {
            if !rules.iter().any(|r| Arc::ptr_eq(r, &old)) && retiring.len() < MAX_RETIRING {
                retiring.push(old);
            }
        }
        known.clone_from(&rules);
        // Idle before this drain: the drain below announces its last change.
        let done: Vec<bool> = retiring.iter().map(|rt| idle(rt)).collect();
        rules.extend(retiring.iter().cloned());
        let mut full = sync.resync.swap(false, Ordering::AcqRel);
        if now >= next_heartbeat {
            full = true;
            next_heartbeat = now + sync.heartbeat;
        }
        if full {
            sync.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        }
        if now >= next_expiry {
            // Expired origins stop counting at once; this frees them and
            // counts them, a few times per TTL.
            next_expiry = now + (sync.ttl / 4).max(sync.interval);
            for rt in &rules {
                if let Some(r) = &rt.remote {
                    let gone = r.expire(now);
                    if gone > 0 {
                        sync.counters
                            .expired
                            .fetch_add(gone as u64, Ordering::Relaxed);
                        tracing::info!(rule = %rt.spec.doc.name, origins = gone,
                            "replica sync: peer load expired (no message within remote_ttl_ms)");
                    }
                }
            }
        }
        let batch = sync.collect(&rules, full, &mut buf);
        let mut done = done.into_iter();
        retiring.retain(|_| !done.next().unwrap_or(true));
        drop((rules, gw));
        if batch.rules.is_empty() {
            continue;
        }
        let batch = Arc::new(batch);
        for (peer, q) in sync.peers.iter().zip(&queues) {
            if q.try_send(Arc::clone(&batch)).is_err() {
                peer.dropped.fetch_add(1, Ordering::Relaxed);
                peer.lost.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// Whether a rule instance has nothing charged.
fn idle(rt: &RuleRuntime) -> bool {
    (0..rt.endpoints.len()).all(|i| {
        let l = rt
            .tracker
            .load(EndpointId(u32::try_from(i).unwrap_or(u32::MAX)));
        l.in_flight == 0 && l.queued_prefill_tokens == 0
    })
}

/// Posts what queued for one peer, merged, until the sync task ends.
async fn peer_loop(
    sync: Arc<ReplicaSync>,
    peer: Arc<Peer>,
    mut rx: mpsc::Receiver<Arc<SyncBatch>>,
) {
    let mut pending = Vec::new();
    let mut failing = false;
    while let Some(first) = rx.recv().await {
        pending.clear();
        pending.push(first);
        while let Ok(b) = rx.try_recv() {
            pending.push(b);
        }
        let merged = merge(&sync.id, &pending);
        for body in split(&merged) {
            let mut req = sync
                .client
                .post(peer.target.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body);
            if let Some(t) = &sync.token {
                req = req.bearer_auth(t);
            }
            let result = match req.send().await {
                Ok(resp) if resp.status().is_success() => {
                    let _ = resp.bytes().await;
                    Ok(())
                }
                Ok(resp) => Err(format!("HTTP {}", resp.status())),
                Err(e) => Err(error_chain(&e)),
            };
            match result {
                Ok(()) => {
                    peer.sent.fetch_add(1, Ordering::Relaxed);
                    if peer.lost.swap(false, Ordering::AcqRel) {
                        // Totals repair what was lost: resend everything.
                        sync.resync.store(true, Ordering::Release);
                    }
                    if failing {
                        failing = false;
                        tracing::info!(peer = %peer.base, "replica sync: peer reachable again");
                    }
                }
                Err(e) => {
                    peer.failed.fetch_add(1, Ordering::Relaxed);
                    peer.lost.store(true, Ordering::Release);
                    if !failing {
                        failing = true;
                        tracing::warn!(peer = %peer.base, error = %e,
                            "replica sync: post to peer failed (counted; its view of this replica heals on the next successful post)");
                    }
                    *peer.last_error.lock() = Some(e);
                }
            }
        }
    }
}

/// `e` and its causes (reqwest's own message omits the refused connection).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    for _ in 0..8 {
        let Some(c) = cause else { break };
        let _ = write!(s, ": {c}");
        cause = c.source();
    }
    s
}

/// One batch of several: per (rule, origin, URL) the newest delta, with the
/// changes summed.
fn merge(replica: &str, batches: &[Arc<SyncBatch>]) -> SyncBatch {
    if let [one] = batches {
        return SyncBatch::clone(one);
    }
    let mut rules: Vec<RuleDeltas> = Vec::new();
    for b in batches {
        for rd in &b.rules {
            let pos = rules
                .iter()
                .position(|r| r.rule == rd.rule && r.origin == rd.origin);
            let Some(into) = (match pos {
                Some(p) => rules.get_mut(p),
                None => {
                    rules.push(RuleDeltas {
                        rule: rd.rule.clone(),
                        origin: rd.origin,
                        endpoints: Vec::new(),
                    });
                    rules.last_mut()
                }
            }) else {
                continue;
            };
            for ed in &rd.endpoints {
                match into.endpoints.iter_mut().find(|e| e.url == ed.url) {
                    Some(e) => {
                        let (requests, prefill) = (
                            e.requests.saturating_add(ed.requests),
                            e.prefill_tokens.saturating_add(ed.prefill_tokens),
                        );
                        if ed.seq > e.seq {
                            *e = ed.clone();
                        }
                        e.requests = requests;
                        e.prefill_tokens = prefill;
                    }
                    None => into.endpoints.push(ed.clone()),
                }
            }
        }
    }
    SyncBatch {
        replica: replica.to_owned(),
        rules,
    }
}

/// Serialized bodies of at most about [`MAX_BODY`] / 2 bytes each.
fn split(batch: &SyncBatch) -> Vec<Vec<u8>> {
    // Generous per-entry sizes (keys plus 20-digit numbers) keep each part
    // well under the peer's limit without serializing twice.
    const ENDPOINT: usize = 200;
    const RULE: usize = 80;
    let limit = MAX_BODY / 2;
    let mut parts: Vec<SyncBatch> = Vec::new();
    let mut cur = SyncBatch {
        replica: batch.replica.clone(),
        rules: Vec::new(),
    };
    let mut size = batch.replica.len() + RULE;
    for rd in &batch.rules {
        let mut part = RuleDeltas {
            rule: rd.rule.clone(),
            origin: rd.origin,
            endpoints: Vec::new(),
        };
        size += rd.rule.len() + RULE;
        for ed in &rd.endpoints {
            let n = ed.url.len() + ENDPOINT;
            if size + n > limit && (!part.endpoints.is_empty() || !cur.rules.is_empty()) {
                if !part.endpoints.is_empty() {
                    cur.rules.push(part.clone());
                    part.endpoints.clear();
                }
                parts.push(std::mem::replace(
                    &mut cur,
                    SyncBatch {
                        replica: batch.replica.clone(),
                        rules: Vec::new(),
                    },
                ));
                size = batch.replica.len() + 2 * RULE + rd.rule.len();
            }
            size += n;
            part.endpoints.push(ed.clone());
        }
        if !part.endpoints.is_empty() {
            cur.rules.push(part);
        }
    }
    if !cur.rules.is_empty() {
        parts.push(cur);
    }
    parts
        .iter()
        .filter_map(|p| serde_json::to_vec(p).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(peers: &[&str]) -> ReplicasConfig {
        ReplicasConfig {
            peers: peers.iter().map(ToString::to_string).collect(),
            ..ReplicasConfig::default()
        }
    }

    fn admin() -> SocketAddr {
        "127.0.0.1:9090".parse().unwrap()
    }

    fn field_of(e: &ConfigError) -> String {
        match e {
            ConfigError::Invalid { field, .. } => field.clone(),
            other => panic!("not an Invalid error: {other}"),
        }
    }

    #[test]
    fn peers_are_admin_base_urls_of_other_replicas() {
        let ok = validate(
            &cfg(&["http://10.0.0.2:9090", "https://gw-3:9443/"]),
            admin(),
        )
        .unwrap();
        assert_eq!(ok[0].1.as_str(), "http://10.0.0.2:9090/admin/replica-sync");
        assert_eq!(ok[1].1.as_str(), "https://gw-3:9443/admin/replica-sync");
        for bad in [
            "10.0.0.2:9090",
            "ftp://10.0.0.2:9090",
            "http://10.0.0.2:9090/admin",
            "http://u:p@10.0.0.2:9090",
            "http://10.0.0.2:9090/?x=1",
            "http://127.0.0.1:9090",
        ] {
            let e = validate(&cfg(&[bad]), admin()).unwrap_err();
            assert_eq!(field_of(&e), "replicas.peers[0]", "{bad}: {e}");
        }
        let e = validate(&cfg(&["http://a:1", "http://a:1/"]), admin()).unwrap_err();
        assert_eq!(field_of(&e), "replicas.peers[1]", "{e}");
        // A wildcard admin listener is reached over loopback too.
        let any: SocketAddr = "0.0.0.0:9090".parse().unwrap();
        assert!(validate(&cfg(&["http://127.0.0.1:9090"]), any).is_err());
        assert!(validate(&cfg(&["http://127.0.0.1:9091"]), any).is_ok());
    }

    #[test]
    fn the_serve_configuration_refuses_a_bad_peer() {
        let toml = "listen = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:9090\"\n\
                    [replicas]\npeers = [\"http://127.0.0.1:9090\"]\n";
        let e = super::super::config::ServeConfig::from_toml(toml, std::path::Path::new("."))
            .unwrap_err();
        assert!(e.to_string().starts_with("replicas.peers[0]:"), "{e}");
        let ok = toml.replace("9090\"]", "9091\"]");
        let c =
            super::super::config::ServeConfig::from_toml(&ok, std::path::Path::new(".")).unwrap();
        assert_eq!(c.replicas.peers, ["http://127.0.0.1:9091"]);
    }

    #[test]
    fn intervals_must_keep_an_idle_replica_alive() {
        let mut c = cfg(&[]);
        c.remote_ttl_ms = c.heartbeat_ms;
        assert_eq!(
            field_of(&validate(&c, admin()).unwrap_err()),
            "replicas.remote_ttl_ms"
        );
        let mut c = cfg(&[]);
        c.sync_interval_ms = 0;
        assert_eq!(
            field_of(&validate(&c, admin()).unwrap_err()),
            "replicas.sync_interval_ms"
        );
        let none = ReplicaSync::new(
            &ReplicasConfig::default(),
            "127.0.0.1:8080".parse().unwrap(),
            admin(),
            None,
        )
        .unwrap();
        assert!(none.is_none(), "no peers: no transport");
    }

    fn delta(url: &str, seq: u64, in_flight: u32, requests: i64) -> EndpointDelta {
        EndpointDelta {
            url: url.into(),
            seq,
            in_flight,
            queued_prefill_tokens: u64::from(in_flight) * 10,
            requests,
            prefill_tokens: requests * 10,
            charged_prefill_tokens: 0,
        }
    }

    fn batch(rule: &str, origin: u64, eps: Vec<EndpointDelta>) -> Arc<SyncBatch> {
        Arc::new(SyncBatch {
            replica: "r1".into(),
            rules: vec![RuleDeltas {
                rule: rule.into(),
                origin,
                endpoints: eps,
            }],
        })
    }

    #[test]
    fn merged_batches_keep_the_newest_totals_and_sum_the_changes() {
        let merged = merge(
            "r1",
            &[
                batch(
                    "kv",
                    7,
                    vec![delta("http://a", 1, 1, 1), delta("http://b", 2, 1, 1)],
                ),
                batch("kv", 7, vec![delta("http://a", 3, 3, 2)]),
                batch("kv", 8, vec![delta("http://a", 1, 5, 5)]),
                batch("other", 7, vec![delta("http://a", 4, 0, -1)]),
            ],
        );
        assert_eq!(merged.rules.len(), 3);
        let kv7 = &merged.rules[0];
        assert_eq!((kv7.rule.as_str(), kv7.origin), ("kv", 7));
        let a = kv7.endpoints.iter().find(|e| e.url == "http://a").unwrap();
        assert_eq!(
            (a.seq, a.in_flight, a.requests, a.prefill_tokens),
            (3, 3, 3, 30)
        );
        assert_eq!(kv7.endpoints.len(), 2);
        assert_eq!(
            merged.rules[1].endpoints[0].in_flight, 5,
            "origins stay apart"
        );
        assert_eq!(merged.rules[2].rule, "other");
        // Reordered: an older delta does not replace a newer one.
        let merged = merge(
            "r1",
            &[
                batch("kv", 7, vec![delta("http://a", 9, 4, 1)]),
                batch("kv", 7, vec![delta("http://a", 8, 2, 1)]),
            ],
        );
        assert_eq!(merged.rules[0].endpoints[0].in_flight, 4);
    }

    #[test]
    fn large_batches_are_split_below_the_body_limit_without_losing_a_delta() {
        let eps: Vec<EndpointDelta> = (0..12_000)
            .map(|i| delta(&format!("http://engine-{i}.example:8000"), i + 1, 3, 1))
            .collect();
        let big = SyncBatch::clone(&batch("kv", 7, eps));
        let bodies = split(&big);
        assert!(bodies.len() > 1, "{} bodies", bodies.len());
        let mut seen = 0;
        for b in &bodies {
            assert!(b.len() <= MAX_BODY, "{} bytes", b.len());
            let part: SyncBatch = serde_json::from_slice(b).unwrap();
            assert!(part.rules.iter().all(|r| r.rule == "kv" && r.origin == 7));
            seen += part.rules.iter().map(|r| r.endpoints.len()).sum::<usize>();
        }
        assert_eq!(seen, 12_000);
        let small = SyncBatch::clone(&batch("kv", 7, vec![delta("http://a", 1, 1, 1)]));
        let bodies = split(&small);
        assert_eq!(bodies.len(), 1);
        assert_eq!(
            serde_json::from_slice::<SyncBatch>(&bodies[0]).unwrap(),
            small
        );
    }
}
