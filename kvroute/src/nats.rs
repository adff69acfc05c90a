//! Replica load sharing over NATS (feature `nats`): what several gateway
//! replicas, or several embedding processes, run to share their load on the
//! engines over a bus the operator already runs.
//!
//! Every router publishes its [`crate::ReplicaBatch`]es on
//! `{prefix}.{pool}.load` and subscribes to the same subject; replicas find
//! each other by their messages (no peer list) and a replica's own messages
//! are recognised by their origin id. The server sends a connection none of
//! its own messages back (`no_echo`): every message crosses the network once
//! per other process, and the routers subscribed through the same
//! connection (this router, a rule's instance being replaced) get it from
//! the publishing call itself. Publishing never blocks a decision:
//! batches go through a bounded queue to one publishing task (a full queue
//! drops the batch, counted; the next heartbeat repairs it). The client
//! reconnects by itself and resubscribes; after a reconnect every router
//! sends all its endpoints at its next check (every 100 ms), so the others
//! resynchronise at once instead of at the next heartbeat. While NATS is away each replica
//! routes on its own view and the others' last totals until they expire.
//!
//! ```no_run
//! use kvroute::nats::{NatsOptions, NatsReplicas};
//! use kvroute::{KvRouter, ReplicaConfig};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let bus = NatsReplicas::connect(NatsOptions::new("nats://127.0.0.1:4222")).await?;
//! let router = KvRouter::builder("vllm@0.33.0:sha256_cbor:block=16:seed=0".parse()?)
//!     .replicas(ReplicaConfig::new(bus))
//!     .spawn()?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::runtime::replicas::{ReplicaError, ReplicaSink, ReplicaSubscription, ReplicaTransport};

/// How to reach NATS.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsOptions {
    /// Server URL(s), comma-separated (`nats://host:4222`, `tls://...`).
    pub url: String,
    /// Subject prefix (default `kvroute`): subjects are
    /// `{prefix}.{pool}.load`.
    pub subject_prefix: String,
    /// A NATS credentials file (`.creds`: JWT and NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// A token (never logged).
    pub token: Option<String>,
    /// User and password (never logged).
    pub user_password: Option<(String, String)>,
    /// Require TLS.
    pub require_tls: bool,
    /// PEM root certificates to trust, in place of the system's (the
    /// client loads the system's only without this file).
    pub tls_root_certificates: Option<PathBuf>,
    /// PEM client certificate and key (mutual TLS).
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Batches queued for publishing at most (default 1024).
    pub queue: usize,
    /// Received messages buffered at most while this router applies earlier
    /// ones (default 1024); beyond it the client drops them (counted in
    /// [`NatsCounters::slow_consumer`]). With the server's largest message
    /// this bounds the receive buffer: 1024 × 1 MiB by default.
    pub subscription_capacity: usize,
    /// Client name shown by the server (default `kvroute`).
    pub name: String,
}

impl NatsOptions {
    /// Defaults for the server at `url`.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            subject_prefix: "kvroute".to_owned(),
            credentials_file: None,
            token: None,
            user_password: None,
            require_tls: false,
            tls_root_certificates: None,
            tls_client: None,
            queue: 1024,
            subscription_capacity: 1024,
            name: "kvroute".to_owned(),
        }
    }
}

/// Counters of the NATS transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NatsCounters {
    /// Messages handed to the client.
    pub published: u64,
    /// Messages the client refused (connection gone): repaired by the next
    /// heartbeat.
    pub publish_failed: u64,
    /// Messages dropped because the publishing queue was full.
    pub queue_full: u64,
    /// Messages not sent to the server because the client had no
    /// connection when they were published or came to be sent (the routers
    /// subscribed through this connection still got them): the reconnection makes every rule
    /// resend its whole load, so sending them late would only replay
    /// outdated load (and fill the queue ahead of that resync).
    pub offline: u64,
    /// Messages received from the server on the subscribed subjects (the
    /// other processes'; this connection's own are handed over locally).
    pub received: u64,
    /// Times the client dropped a received message because this router's
    /// buffer ([`NatsOptions::subscription_capacity`]) was full: a peer sends
    /// faster than the router applies. A lower bound (the client reports
    /// them on a bounded event channel); the next heartbeats repair.
    pub slow_consumer: u64,
    /// Connections made again after a disconnect (the first connection
    /// not counted).
    pub reconnects: u64,
    /// Whether the client is connected now.
    pub connected: bool,
}

#[derive(Debug, Default)]
struct Counts {
    published: AtomicU64,
    publish_failed: AtomicU64,
    offline: AtomicU64,
    queue_full: AtomicU64,
    received: AtomicU64,
    slow_consumer: AtomicU64,
    /// A connection attempt failed since the last connection: further
    /// failures are logged at DEBUG (the client retries every few seconds).
    failing: std::sync::atomic::AtomicBool,
}

/// The routers subscribed through one connection, by subject, each under
/// its own id: the server echoes nothing back to the connection, so what one
/// of them publishes is handed to the others (and to itself) here.
#[derive(Default)]
struct LocalSinks {
    next: AtomicU64,
    sinks: parking_lot::Mutex<Vec<(u64, String, ReplicaSink)>>,
}

impl LocalSinks {
    /// Hands `payload` to every router subscribed to `subject` here.
    fn deliver(&self, subject: &str, payload: &Bytes) {
        // Called outside the lock: a sink applies a batch, and a router
        // subscribing or going away meanwhile must not wait for that.
        let sinks: Vec<ReplicaSink> = self
            .sinks
            .lock()
            .iter()
            .filter(|(_, s, _)| s == subject)
            .map(|(_, _, sink)| Arc::clone(sink))
            .collect();
        for sink in sinks {
            sink(payload.clone());
        }
    }
}

/// Removes a router's local sink when its subscription ends.
struct LocalGuard {
    local: Arc<LocalSinks>,
    id: u64,
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        self.local.sinks.lock().retain(|(id, _, _)| *id != self.id);
    }
}

/// The NATS replica transport; see the [module docs](self).
pub struct NatsReplicas {
    client: async_nats::Client,
    prefix: String,
    queue: mpsc::Sender<(String, Bytes)>,
    counts: Arc<Counts>,
    local: Arc<LocalSinks>,
    handle: tokio::runtime::Handle,
}

impl fmt::Debug for NatsReplicas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsReplicas")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Whether `prefix` can start this transport's subjects: dot-separated
/// tokens of ASCII letters, digits, `-` and `_` (no wildcard `*` or `>`,
/// which would subscribe to other deployments' subjects, and no whitespace,
/// which the server refuses).
///
/// ```
/// use kvroute::nats::valid_subject_prefix;
/// assert!(valid_subject_prefix("kvroute"));
/// assert!(valid_subject_prefix("prod.kv-route_1"));
/// for bad in ["", "kv.*", "kv.>", "kv..x", "kv route", ".kv"] {
///     assert!(!valid_subject_prefix(bad), "{bad:?}");
/// }
/// ```
#[must_use]
pub fn valid_subject_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.split('.').all(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

/// A subject token for `pool`: NATS subjects are dot-separated tokens of
/// printable characters without `*`, `>` or whitespace, so anything else is
/// written as `_xx` (hex), and `_` itself as `__`.
fn token(pool: &str) -> String {
    let mut out = String::with_capacity(pool.len());
    for b in pool.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(char::from(b));
        } else if b == b'_' {
            out.push_str("__");
        } else {
            out.push_str(&format!("_{b:02x}"));
        }
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// The largest message sent before the server's first `INFO` says its
/// `max_payload`: batches queued while the server is unreachable are split to
/// this (a server refusing a larger message closes the connection, and the
/// client refuses one past the limit it learns meanwhile). Small: such
/// batches are few, and the full resend at the first connection supersedes
/// them.
pub const PAYLOAD_BEFORE_INFO: usize = 1 << 10;

impl NatsReplicas {
    /// Starts the client on the current tokio runtime. It connects in the
    /// background and keeps reconnecting for as long as it lives, so an
    /// unreachable server (or one refusing the credentials or the TLS
    /// handshake) is no error here: the router routes on its local view
    /// meanwhile, each failed attempt is logged at WARN, and
    /// [`NatsCounters::connected`] says whether it is connected.
    ///
    /// # Errors
    /// The subject prefix is not [`valid_subject_prefix`], or a credentials
    /// or TLS file cannot be read.
    pub async fn connect(options: NatsOptions) -> Result<Arc<Self>, ReplicaError> {
        let err = |e: &dyn fmt::Display| ReplicaError(format!("NATS {}: {e}", options.url));
        if !valid_subject_prefix(&options.subject_prefix) {
            return Err(err(&format!(
                "subject prefix {:?}: expected dot-separated tokens of letters, digits, `-` and `_`",
                options.subject_prefix
            )));
        }
        let tls_files = options
            .tls_root_certificates
            .iter()
            .chain(options.tls_client.iter().flat_map(|(c, k)| [c, k]));
        for path in tls_files {
            std::fs::File::open(path)
                .map_err(|e| err(&format!("TLS file {}: {e}", path.display())))?;
        }
        let counts = Arc::new(Counts::default());
        let events = Arc::clone(&counts);
        let mut opts = async_nats::ConnectOptions::new()
            .name(&options.name)
            .retry_on_initial_connect()
            // The routers of this process get their messages from `publish`.
            .no_echo()
            .subscription_capacity(options.subscription_capacity.max(1))
            // Connections are counted by the client itself
            // (`Statistics::connects`), which no lost event can skew; the
            // events are only logged, and slow-consumer drops counted.
            .event_callback(move |event| {
                let c = Arc::clone(&events);
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            c.failing.store(false, Ordering::Relaxed);
                            tracing::info!("NATS connected");
                        }
                        async_nats::Event::Disconnected => {
                            tracing::warn!("NATS disconnected; routing on the local view");
                        }
                        async_nats::Event::SlowConsumer(_) => {
                            c.slow_consumer.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!("NATS dropped a replica message: receiving behind");
                        }
                        // A failed connection attempt (unreachable server,
                        // refused credentials, TLS) says why replicas are
                        // not shared: the first of a row at WARN, the
                        // others (the client retries with a backoff) at
                        // DEBUG.
                        async_nats::Event::ClientError(_) | async_nats::Event::ServerError(_) => {
                            if c.failing.swap(true, Ordering::Relaxed) {
                                tracing::debug!(%event, "NATS connection still failing");
                            } else {
                                tracing::warn!(%event, "NATS connection failed; retrying, routing on the local view meanwhile");
                            }
                        }
                        other => tracing::debug!(event = %other, "NATS event"),
                    }
                }
            });
        if let Some(path) = &options.credentials_file {
            opts = opts
                .credentials_file(path)
                .await
                .map_err(|e| err(&format!("credentials {}: {e}", path.display())))?;
        }
        if let Some(t) = &options.token {
            opts = opts.token(t.clone());
        }
        if let Some((u, p)) = &options.user_password {
            opts = opts.user_and_password(u.clone(), p.clone());
        }
        if options.require_tls {
            opts = opts.require_tls(true);
        }
        if let Some(ca) = &options.tls_root_certificates {
            opts = opts.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &options.tls_client {
            opts = opts.add_client_certificate(cert.clone(), key.clone());
        }
        let client = opts
            .connect(options.url.as_str())
            .await
            .map_err(|e| err(&e))?;
        let (queue, mut rx) = mpsc::channel::<(String, Bytes)>(options.queue.max(1));
        let publisher = client.clone();
        let pcounts = Arc::clone(&counts);
        tokio::spawn(async move {
            while let Some((subject, payload)) = rx.recv().await {
                if publisher.connection_state() != async_nats::connection::State::Connected {
                    pcounts.offline.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                match publisher.publish(subject, payload).await {
                    Ok(()) => pcounts.published.fetch_add(1, Ordering::Relaxed),
                    Err(_) => pcounts.publish_failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        });
        tracing::info!(url = %options.url, prefix = %options.subject_prefix, "NATS replica transport started");
        Ok(Arc::new(Self {
            client,
            prefix: options.subject_prefix.clone(),
            queue,
            counts,
            local: Arc::default(),
            handle: tokio::runtime::Handle::current(),
        }))
    }

    /// The subject a pool's batches travel on.
    #[must_use]
    pub fn subject(&self, pool: &str) -> String {
        format!("{}.{}.load", self.prefix, token(pool))
    }

    /// The transport's counters.
    #[must_use]
    pub fn counters(&self) -> NatsCounters {
        let c = &self.counts;
        NatsCounters {
            published: c.published.load(Ordering::Relaxed),
            publish_failed: c.publish_failed.load(Ordering::Relaxed),
            queue_full: c.queue_full.load(Ordering::Relaxed),
            offline: c.offline.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
            slow_consumer: c.slow_consumer.load(Ordering::Relaxed),
            reconnects: self.connects().saturating_sub(1),
            connected: self.client.connection_state() == async_nats::connection::State::Connected,
        }
    }

    /// Connections made, the first included (the client's own count).
    fn connects(&self) -> u64 {
        self.client.statistics().connects.load(Ordering::Relaxed)
    }
}

impl ReplicaTransport for NatsReplicas {
    fn publish(&self, pool: &str, payload: Bytes) {
        let subject = self.subject(pool);
        // Queued for the server first: the local hand-over decodes and
        // applies the message, the network send need not wait for that.
        if self.client.connection_state() != async_nats::connection::State::Connected {
            self.counts.offline.fetch_add(1, Ordering::Relaxed);
        } else if self
            .queue
            .try_send((subject.clone(), payload.clone()))
            .is_err()
        {
            self.counts.queue_full.fetch_add(1, Ordering::Relaxed);
        }
        self.local.deliver(&subject, &payload);
    }

    fn subscribe(
        &self,
        pool: &str,
        sink: ReplicaSink,
    ) -> Result<ReplicaSubscription, ReplicaError> {
        let client = self.client.clone();
        let subject = self.subject(pool);
        let counts = Arc::clone(&self.counts);
        let id = self.local.next.fetch_add(1, Ordering::Relaxed);
        self.local
            .sinks
            .lock()
            .push((id, subject.clone(), Arc::clone(&sink)));
        let local = LocalGuard {
            local: Arc::clone(&self.local),
            id,
        };
        let task = self.handle.spawn(async move {
            let mut sub = match client.subscribe(subject.clone()).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%subject, error = %e, "NATS subscribe failed; replica load not received");
                    return;
                }
            };
            while let Some(msg) = sub.next().await {
                counts.received.fetch_add(1, Ordering::Relaxed);
                sink(msg.payload);
            }
        });
        Ok(ReplicaSubscription::new((AbortOnDrop(task), local)))
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    fn reconnects(&self) -> u64 {
        self.connects()
    }

    /// The server's `max_payload` (from its `INFO`, kept current by the
    /// client across reconnects): a larger message would be refused, and
    /// the server would close the connection. Before the first `INFO` (the
    /// server down at start) the client's figure is its own default, so
    /// messages stay within [`PAYLOAD_BEFORE_INFO`] until the server has said.
    fn max_payload(&self) -> Option<usize> {
        // The client may have read the first `INFO` before its connect
        // event reached us: its figure counts as soon as it is smaller.
        if self.connects() == 0 {
            return Some(PAYLOAD_BEFORE_INFO.min(self.client.max_payload()));
        }
        Some(self.client.max_payload())
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::{token, NatsOptions, NatsReplicas};

    /// What the client cannot fix by retrying is refused at once: a
    /// wildcard prefix (it would subscribe to other deployments' subjects),
    /// one the server refuses, a TLS file that cannot be read. An
    /// unreachable server is not: the client connects in the background.
    #[tokio::test]
    async fn what_retrying_cannot_fix_is_refused_at_once() {
        let unreachable = "nats://127.0.0.1:1";
        for prefix in ["kv.*", "kv.>", "kv route", ""] {
            let mut o = NatsOptions::new(unreachable);
            o.subject_prefix = prefix.into();
            let e = NatsReplicas::connect(o).await.err();
            assert!(
                e.is_some_and(|e| e.to_string().contains("subject prefix")),
                "{prefix:?}"
            );
        }
        let mut o = NatsOptions::new(unreachable);
        o.tls_root_certificates = Some("/nonexistent/ca.pem".into());
        let e = NatsReplicas::connect(o).await.err();
        assert!(e.is_some_and(|e| e.to_string().contains("/nonexistent/ca.pem")));
        let bus = NatsReplicas::connect(NatsOptions::new(unreachable)).await;
        assert!(bus.is_ok_and(|b| !b.counters().connected));
    }

    #[test]
    fn pool_names_become_one_subject_token() {
        assert_eq!(token("qwen3"), "qwen3");
        assert_eq!(token("a.b c*>"), "a_2eb_20c_2a_3e");
        assert_eq!(token("a_b"), "a__b");
        assert_eq!(token(""), "_");
        // Distinct names stay distinct.
        assert_ne!(token("a_2e"), token("a.")); // "a__2e" vs "a_2e"
    }
}
