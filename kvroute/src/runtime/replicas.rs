//! Load sharing between replicas of one router (several gateways, or
//! several embedding processes, in front of the same engines).
//!
//! Each replica counts the requests it routed ([`kvroute_select::LoadTracker`]);
//! the engines' own reports add everyone's, but only per poll and only as
//! request counts. So replicas tell each other what they charged: the
//! tracker's outbox (changed endpoints, each with its totals and a sequence
//! number, [`kvroute_select::replica_sync`]) goes out as a [`ReplicaBatch`]:
//! a decision at once when nothing went out during the last
//! [`ReplicaConfig::sync_interval`] (the first decision of a burst reaches
//! the others while they decide theirs) or when it was made in its turn
//! ([`crate::KvRouter::turn`]: the next rank decides one
//! [`ReplicaConfig::stagger`] later), otherwise with the changes
//! coalesced one interval after the previous message; every endpoint's totals every
//! [`ReplicaConfig::heartbeat`] (which also keeps the replica alive at the
//! others). A receiving replica applies each delta to its
//! [`kvroute_select::RemoteLoad`] table: totals with sequence numbers make
//! duplicates and reordering harmless and repair a lost message with the
//! next one; a replica silent for [`ReplicaConfig::ttl`] stops counting, so a
//! killed replica's load goes away. Endpoints are named by URL on the wire
//! (replicas may list them in another order). Every refused delta and
//! undecodable or oversized message is counted ([`ReplicaCounters`]).
//!
//! Replicas find each other by their messages: there is no peer list. The
//! bytes travel over a [`ReplicaTransport`]: NATS in production (feature
//! `nats`, [`crate::nats::NatsReplicas`]); the simulator moves batches itself
//! through [`crate::KvRouter::drain_replica_batch`] and
//! [`crate::KvRouter::apply_replica_batch`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// How one router's replicas share load.
#[derive(Clone)]
pub struct ReplicaConfig {
    /// What carries the batches.
    pub transport: Arc<dyn ReplicaTransport>,
    /// The pool's name on the transport (default: the router's name):
    /// replicas of one pool share it, and only they.
    pub pool: Option<String>,
    /// At most one message of changed endpoints per this interval (default
    /// 2 ms): a decision after a quiet interval, or made in its turn, is
    /// sent at once, later changes one interval after the previous message.
    /// An interval longer than `heartbeat` counts as `heartbeat`. Between
    /// changes the publishing task sleeps (it checks heartbeats,
    /// reconnections and expiry every 100 ms).
    pub sync_interval: Duration,
    /// How often every endpoint is sent (default 1 s): repairs anything
    /// lost and keeps this replica alive at the others.
    pub heartbeat: Duration,
    /// A replica silent this long stops counting (default 5 s).
    pub ttl: Duration,
    /// Other replicas counted at most (default 64; more are refused and
    /// counted until one expires).
    pub max_origins: usize,
    /// Largest message sent or accepted (default 1 MiB; larger batches are
    /// split, larger messages refused). Batches are also split to the
    /// transport's own limit ([`ReplicaTransport::max_payload`]).
    pub max_message_bytes: usize,
    /// This router's origin id among the replicas (`None`, the default: an
    /// unpredictable one per router instance). Ids must differ between
    /// replicas: they order the replicas, each one's rank spreading bursts
    /// (the cost scorer's zones). A host that needs the same ranks in every
    /// run (the simulator) fixes them; 0 counts as 1. A router that takes
    /// the id of one that just stopped (a restart with fixed ids) numbers
    /// its messages from 1 again: the others ignore them as old until the
    /// stopped one's entries have been quiet for `ttl` and then its last
    /// sequence number kept for another `ttl`.
    pub origin: Option<u64>,
    /// This replica's place among the replicas (`None`, the default: ranked
    /// by its random origin id). The replicas rank themselves in this
    /// order, lowest first: set it, different on every replica, where the
    /// ranks (turns within a burst, zones, where each one's rotations
    /// start) must be the same in every run. Unlike a fixed
    /// [`ReplicaConfig::origin`], each router instance still draws an id of
    /// its own beneath it, so a router that replaces another (a rule
    /// rebuilt) is news at once, never mistaken for the one retiring.
    /// Ignored when `origin` is set.
    pub order: Option<u32>,
    /// Turns within a burst (default 2 ms; zero: none): while this
    /// replica's decisions come in bursts, the replica of rank `k` holds
    /// each request `k · stagger` before deciding it, so that it decides
    /// after the lower ranks' decisions of the same burst have reached it
    /// ([`kvroute_select::burst_turn`]; [`crate::KvRouter::turn`]), and a
    /// request without a home in a burst waits at least this long for the
    /// burst's requests with one ([`crate::KvRouterBuilder::burst_order`]).
    /// Set it above the time a message takes between replicas.
    pub stagger: Duration,
}

impl fmt::Debug for ReplicaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicaConfig")
            .field("transport", &self.transport)
            .field("pool", &self.pool)
            .field("sync_interval", &self.sync_interval)
            .field("heartbeat", &self.heartbeat)
            .field("ttl", &self.ttl)
            .field("stagger", &self.stagger)
            .field("origin", &self.origin)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

impl ReplicaConfig {
    /// Defaults over `transport`.
    #[must_use]
    pub fn new(transport: Arc<dyn ReplicaTransport>) -> Self {
        Self {
            transport,
            pool: None,
            sync_interval: Duration::from_millis(2),
            heartbeat: Duration::from_secs(1),
            ttl: Duration::from_secs(5),
            max_origins: 64,
            max_message_bytes: 1 << 20,
            origin: None,
            order: None,
            stagger: Duration::from_millis(2),
        }
    }
}

/// Delivers the other replicas' messages to a router.
pub type ReplicaSink = Arc<dyn Fn(Bytes) + Send + Sync>;

/// A live subscription; dropping it unsubscribes.
pub struct ReplicaSubscription(#[allow(dead_code)] Box<dyn Send + Sync>);

impl ReplicaSubscription {
    /// Wraps whatever keeps the transport's subscription alive (dropped to
    /// end it).
    pub fn new(guard: impl Send + Sync + 'static) -> Self {
        Self(Box::new(guard))
    }
}

impl fmt::Debug for ReplicaSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReplicaSubscription")
    }
}

/// Why a transport could not subscribe.
#[derive(Debug, thiserror::Error)]
#[error("replica transport: {0}")]
pub struct ReplicaError(pub String);

/// Moves replica messages: publish to every replica of a pool, deliver
/// theirs. Delivery is best effort (the protocol repairs losses); a
/// transport never blocks the caller of [`ReplicaTransport::publish`].
pub trait ReplicaTransport: Send + Sync + fmt::Debug + 'static {
    /// Sends `payload` to every replica of `pool` (this one may hear it
    /// back: its own messages are recognised and ignored). A transport may
    /// hand it to the sinks subscribed in this process before returning
    /// (as [`crate::nats::NatsReplicas`] does, its server echoing nothing
    /// back), so a caller holds no lock that applying a batch takes.
    fn publish(&self, pool: &str, payload: Bytes);

    /// Starts delivering the messages published to `pool` to `sink`, until
    /// the returned subscription is dropped.
    ///
    /// # Errors
    /// The transport cannot subscribe.
    fn subscribe(&self, pool: &str, sink: ReplicaSink)
        -> Result<ReplicaSubscription, ReplicaError>;

    /// How many times the transport has reconnected (monotonic; 0 for one
    /// that never does). After a change every router sends all its
    /// endpoints, so the others resynchronise at once.
    fn reconnects(&self) -> u64 {
        0
    }

    /// Whether the transport can send now. A reconnection's resend waits
    /// until it can (a transport may count the connection a moment before
    /// it takes messages again).
    fn connected(&self) -> bool {
        true
    }

    /// The largest payload the transport can carry now (a NATS server's
    /// `max_payload`), if it has one: batches are split to the smaller of
    /// it and [`ReplicaConfig::max_message_bytes`].
    fn max_payload(&self) -> Option<usize> {
        None
    }
}

/// A transport that moves nothing: the host moves the batches itself
/// ([`crate::KvRouter::drain_replica_batch`] on one replica,
/// [`crate::KvRouter::apply_replica_batch`] on the others), as the simulator
/// does with simulated delays.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostTransport;

impl ReplicaTransport for HostTransport {
    fn publish(&self, _pool: &str, _payload: Bytes) {}

    fn subscribe(
        &self,
        _pool: &str,
        _sink: ReplicaSink,
    ) -> Result<ReplicaSubscription, ReplicaError> {
        Ok(ReplicaSubscription::new(()))
    }
}

/// One replica's load changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaBatch {
    /// The sending replica (one process lifetime of one router).
    pub origin: u64,
    /// The endpoints whose load changed (all of them in a heartbeat).
    pub endpoints: Vec<EndpointDelta>,
    /// The sender decides no more: a router replaced (its rule reloaded) or
    /// dropped, announcing the ends of the requests it routed. Its load
    /// counts until they end; it is not one of the deciders
    /// ([`kvroute_select::RemoteLoad::set_retiring`]). Left out when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub retiring: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One endpoint's totals at the sender
/// ([`kvroute_select::LoadDelta`] with the endpoint named by its URL).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointDelta {
    /// The endpoint's URL.
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
    /// The sender's predicted prefill tokens ever charged to this URL since
    /// it took its slot (monotonic while it keeps the slot).
    #[serde(default)]
    pub charged_prefill_tokens: u64,
}

/// What replica sharing did, since the router started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplicaCounters {
    /// Batches published.
    pub sent_batches: u64,
    /// Of those, published at once on a change (a decision, a request's
    /// first byte or end): one that came after a quiet
    /// [`ReplicaConfig::sync_interval`], or a decision in its turn (the rest
    /// waited for the interval).
    pub sent_at_once: u64,
    /// Endpoint deltas published.
    pub sent_deltas: u64,
    /// Messages received (this replica's own, oversized and undecodable
    /// ones included).
    pub received: u64,
    /// Deltas applied.
    pub applied: u64,
    /// Duplicates and older deltas ignored.
    pub stale: u64,
    /// This replica's own messages ignored.
    pub own: u64,
    /// Deltas for a URL this router does not have.
    pub unknown_endpoint: u64,
    /// Deltas refused because [`ReplicaConfig::max_origins`] replicas count.
    pub origins_full: u64,
    /// Deltas refused as implausible: a queue or charged-counter step above
    /// [`kvroute_select::MAX_DELTA_TOKENS`] (a corrupt or forged message).
    pub implausible: u64,
    /// Messages that did not decode.
    pub undecodable: u64,
    /// Messages over [`ReplicaConfig::max_message_bytes`], refused unread.
    pub oversized: u64,
    /// Deltas not sent: one alone is larger than
    /// [`ReplicaConfig::max_message_bytes`] (an endpoint URL of about that
    /// size); the others do not see this replica's load there.
    pub unsendable: u64,
    /// Replicas forgotten after [`ReplicaConfig::ttl`] of silence.
    pub expired: u64,
    /// Other replicas counted now.
    pub replicas: u64,
    /// Times the publishing task woke to send: on a change, when a change
    /// held back by the sync interval was due, and every 100 ms (at most
    /// every heartbeat) to check heartbeats, reconnections and expiry.
    /// Without traffic, about ten a second.
    pub wakes: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counting {
    pub(crate) sent_batches: AtomicU64,
    pub(crate) sent_at_once: AtomicU64,
    pub(crate) sent_deltas: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) own: AtomicU64,
    pub(crate) unknown_endpoint: AtomicU64,
    pub(crate) origins_full: AtomicU64,
    pub(crate) implausible: AtomicU64,
    pub(crate) undecodable: AtomicU64,
    pub(crate) oversized: AtomicU64,
    pub(crate) unsendable: AtomicU64,
    pub(crate) wakes: AtomicU64,
}

impl Counting {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, remote: &kvroute_select::RemoteCounters) -> ReplicaCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ReplicaCounters {
            sent_batches: get(&self.sent_batches),
            sent_at_once: get(&self.sent_at_once),
            sent_deltas: get(&self.sent_deltas),
            received: get(&self.received),
            applied: get(&self.applied),
            stale: get(&self.stale),
            own: get(&self.own),
            unknown_endpoint: get(&self.unknown_endpoint),
            origins_full: get(&self.origins_full),
            implausible: get(&self.implausible),
            undecodable: get(&self.undecodable),
            oversized: get(&self.oversized),
            unsendable: get(&self.unsendable),
            expired: remote.expired,
            replicas: remote.origins,
            wakes: get(&self.wakes),
        }
    }
}

/// The origin id of a router configured with `config`: its fixed one, or an
/// unpredictable one, beneath its [`ReplicaConfig::order`] if it has one
/// (ids rank the replicas; never 0).
pub(crate) fn origin_of(config: &ReplicaConfig) -> u64 {
    match (config.origin, config.order) {
        (Some(o), _) => o,
        (None, Some(order)) => u64::from(order) << 32 | (new_origin() & u64::from(u32::MAX)),
        (None, None) => new_origin(),
    }
    .max(1)
}

/// A process-unique, unpredictable origin id (never 0, which means
/// "nobody" in the tracker).
pub(crate) fn new_origin() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish().max(1)
}

/// The largest message to send over `transport`: `configured`, lowered to
/// what the transport carries.
pub(crate) fn send_bound(configured: usize, transport: &dyn ReplicaTransport) -> usize {
    transport
        .max_payload()
        .map_or(configured, |m| configured.min(m))
}

/// Splits `batch` into encoded messages of at most `max_bytes` each; also
/// returns how many deltas were left out because one alone is larger than
/// that (a URL of about `max_bytes` would need it).
pub(crate) fn encode(batch: &ReplicaBatch, max_bytes: usize) -> (Vec<Bytes>, u64) {
    let mut out = Vec::new();
    let dropped = encode_into(batch, max_bytes, &mut out);
    (out, dropped)
}

fn encode_into(batch: &ReplicaBatch, max_bytes: usize, out: &mut Vec<Bytes>) -> u64 {
    let Ok(whole) = serde_json::to_vec(batch) else {
        return batch.endpoints.len() as u64;
    };
    if whole.len() <= max_bytes {
        out.push(Bytes::from(whole));
        return 0;
    }
    if batch.endpoints.len() <= 1 {
        return batch.endpoints.len() as u64;
    }
    let (a, b) = batch.endpoints.split_at(batch.endpoints.len() / 2);
    let mut dropped = 0;
    for part in [a, b] {
        dropped += encode_into(
            &ReplicaBatch {
                origin: batch.origin,
                endpoints: part.to_vec(),
                retiring: batch.retiring,
            },
            max_bytes,
            out,
        );
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(url: &str, seq: u64) -> EndpointDelta {
        EndpointDelta {
            url: url.to_owned(),
            seq,
            in_flight: 1,
            ..EndpointDelta::default()
        }
    }

    fn golden(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/tests/golden/replicas/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The wire format every replica version must keep reading
    /// (`kvroute/tests/golden/replicas/README.md`): the committed message decodes to these
    /// values and the encoder writes exactly its bytes; an older sender's
    /// message without the charged counter and a newer one's with fields
    /// this version does not know are read too.
    #[test]
    fn replica_messages_golden() {
        let want = ReplicaBatch {
            origin: 11_400_714_819_323_198_485,
            retiring: false,
            endpoints: vec![
                EndpointDelta {
                    url: "http://10.0.0.1:8000".to_owned(),
                    seq: 41,
                    in_flight: 3,
                    queued_prefill_tokens: 5120,
                    requests: 1,
                    prefill_tokens: 2048,
                    charged_prefill_tokens: 918_528,
                },
                EndpointDelta {
                    url: "http://10.0.0.2:8000".to_owned(),
                    seq: 42,
                    in_flight: 0,
                    queued_prefill_tokens: 0,
                    requests: -2,
                    prefill_tokens: -4096,
                    charged_prefill_tokens: 1_048_576,
                },
            ],
        };
        let bytes = golden("batch.json");
        let got: ReplicaBatch = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(got, want);
        assert_eq!(encode(&want, 1 << 20), (vec![Bytes::from(bytes)], 0));

        let older: ReplicaBatch = serde_json::from_slice(&golden("without_charged.json")).unwrap();
        assert_eq!(older.endpoints[0].charged_prefill_tokens, 0);
        assert_eq!((older.origin, older.endpoints[0].seq), (7, 3));

        let newer: ReplicaBatch =
            serde_json::from_slice(&golden("with_unknown_fields.json")).unwrap();
        assert_eq!(
            newer.endpoints,
            vec![EndpointDelta {
                url: "http://10.0.0.1:8000".to_owned(),
                seq: 4,
                in_flight: 2,
                queued_prefill_tokens: 1024,
                requests: 1,
                prefill_tokens: 512,
                charged_prefill_tokens: 1536,
            }]
        );

        let retiring = golden("retiring.json");
        let got: ReplicaBatch = serde_json::from_slice(&retiring).unwrap();
        assert!(got.retiring);
        assert_eq!((got.origin, got.endpoints[0].in_flight), (9, 0));
        assert_eq!(encode(&got, 1 << 20), (vec![Bytes::from(retiring)], 0));
    }

    #[test]
    fn a_large_batch_is_split_under_the_bound_and_loses_nothing() {
        let batch = ReplicaBatch {
            origin: 7,
            retiring: false,
            endpoints: (0..100)
                .map(|i| delta(&format!("http://10.0.0.{i}:8000"), i))
                .collect(),
        };
        let (parts, dropped) = encode(&batch, 1000);
        assert!(parts.len() > 1);
        assert_eq!(dropped, 0);
        let mut seen = Vec::new();
        for p in &parts {
            assert!(p.len() <= 1000);
            let b: ReplicaBatch = serde_json::from_slice(p).unwrap();
            assert_eq!(b.origin, 7);
            seen.extend(b.endpoints);
        }
        assert_eq!(seen, batch.endpoints);
    }

    /// A delta that alone exceeds the bound is left out and counted; the
    /// others still go.
    #[test]
    fn a_delta_over_the_bound_alone_is_left_out_and_counted() {
        let mut endpoints: Vec<EndpointDelta> = (0..6)
            .map(|i| delta(&format!("http://10.0.0.{i}:8000"), i))
            .collect();
        endpoints[3].url = format!("http://{}:8000", "h".repeat(2000));
        let batch = ReplicaBatch {
            origin: 7,
            retiring: false,
            endpoints,
        };
        let (parts, dropped) = encode(&batch, 1000);
        assert_eq!(dropped, 1);
        let sent: usize = parts
            .iter()
            .map(|p| {
                serde_json::from_slice::<ReplicaBatch>(p)
                    .unwrap()
                    .endpoints
                    .len()
            })
            .sum();
        assert_eq!(sent, 5);
    }

    /// A place orders the ids (ranks follow it) while every router draws
    /// its own id beneath it: a router rebuilt under the same place is
    /// never the one retiring. A fixed origin is taken as it is.
    #[test]
    fn a_place_orders_the_ids_and_each_router_draws_its_own() {
        let mut c = ReplicaConfig::new(Arc::new(crate::HostTransport));
        let mut placed = |order| {
            c.order = Some(order);
            origin_of(&c)
        };
        let (a, b, later) = (placed(1), placed(1), placed(2));
        assert_ne!(a, b, "one place, two routers");
        assert_eq!((a >> 32, b >> 32, later >> 32), (1, 1, 2));
        assert!(a < later && b < later);
        assert!(placed(0) < a && placed(0) > 0);
        c.origin = Some(7);
        assert_eq!(origin_of(&c), 7);
    }

    #[test]
    fn origins_are_never_zero_and_differ() {
        let a = new_origin();
        let b = new_origin();
        assert!(a != 0 && b != 0 && a != b);
    }
}
