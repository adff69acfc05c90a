//! `kvroute serve --config FILE`: the HTTP full proxy for the OpenAI API with
//! KV-cache-aware routing, its admin API and Prometheus metrics.
//!
//! The gateway is a host of the library's runtime: each rule is one
//! [`kvroute::KvRouter`] (inventories, event followers, breakers, health
//! probes, engine load polling, replica load sharing over NATS). What the
//! server adds:
//!
//! | module | role |
//! |---|---|
//! | [`config`] | TOML file + admin rule documents → validated specs |
//! | [`state`] | the rule table: one runtime per rule, rebuilt on reload |
//! | [`proxy`] | `/v1/*`: body → the runtime's prompt step and pick → upstream, retries through the pick |
//! | [`upstream`] | client, header hygiene, idle limit on response bodies |
//! | [`passthrough`] | non-completion `/v1/*` requests, no KV decision |
//! | [`pd`] | vLLM disaggregated two-step bodies |
//! | [`admin`] | REST admin API + `/metrics` |
//! | [`connections`] | first-byte deadline, connection cap, accept errors |
//! | [`idle`] | a connection's life: requests in flight, idle HTTP/2 and stalled responses closed |
//! | [`metrics`] | Prometheus exposition (the runtimes' families + the server's) |
//! | [`observe`] | readiness, decision headers, sampled decision log |
//!
//! Security posture: the admin API binds loopback unless told otherwise (then a
//! token is mandatory); requests go only to configured upstreams (the client's
//! `Host` and absolute-URI targets are ignored); bodies are size- and
//! time-limited; a new connection must send its first byte in time and headers
//! have a read timeout; open connections are capped below the descriptor limit
//! ([`connections`]); secrets (the admin token, client `Authorization`) are
//! never logged.

pub mod admin;
pub mod config;
pub mod connections;
#[cfg(test)]
mod contract_hints;
pub mod decisions;
pub mod extensions;
pub mod idle;
pub mod metrics;
pub mod observe;
pub mod passthrough;
pub mod pd;
pub mod proxy;
pub mod state;
pub mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::ServeConfig;
pub use state::Gateway;

/// `kvroute serve` options.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see examples/gateway/config/).
    #[arg(long)]
    pub config: PathBuf,
}

/// A started gateway.
pub struct Running {
    /// Bound proxy address.
    pub proxy: SocketAddr,
    /// Bound admin address.
    pub admin: SocketAddr,
    /// The shared state.
    pub gateway: Arc<Gateway>,
    /// Stops the proxy listener, then the admin listener.
    stop: [watch::Sender<bool>; 2],
    /// The proxy's and the admin's serving tasks.
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Running {
    /// Stops accepting proxy connections and lets in-flight requests finish
    /// (up to the grace period) while the admin API stays up, `/readyz`
    /// answering 503 `draining` and `/metrics` still scraped; then stops the
    /// admin listener, subscribers and probes.
    pub async fn shutdown(self) {
        self.gateway.observe.set_draining();
        let [proxy_stop, admin_stop] = self.stop;
        let [proxy, admin] = self.tasks;
        let _ = proxy_stop.send(true);
        let _ = proxy.await;
        let _ = admin_stop.send(true);
        let _ = admin.await;
        self.gateway.stop_all();
    }
}

/// Binds both listeners, starts serving on the current runtime and returns
/// once every staged tokenizer has loaded (until then the proxy answers 503
/// `not_ready` and the admin `/readyz` says what is loading).
///
/// # Errors
/// A listener that cannot be bound or a rule the library refuses.
pub async fn start(config: &ServeConfig) -> anyhow::Result<Running> {
    let nats = match &config.replicas.nats {
        Some(url) => Some(connect_nats(url, &config.replicas).await?),
        None => None,
    };
    let gateway = Gateway::start(config, nats)?;
    let gw = Arc::clone(&gateway);
    // Loaded before routing: the first requests must not stall on the load.
    let warm = tokio::task::spawn_blocking(move || {
        for slug in &gw.models {
            let state = match gw.tokenizers.get(slug) {
                Ok(_) => observe::TokenizerState::Loaded,
                Err(e) => {
                    tracing::warn!(model = %slug, error = %e, "tokenizer not usable: its rules miss with no_tokenizer");
                    observe::TokenizerState::Failed(e.to_string())
                }
            };
            gw.observe.tokenizer_done(slug, state);
        }
    });
    let proxy_listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding proxy listener {}", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("binding admin listener {}", config.admin_listen))?;
    let proxy = proxy_listener.local_addr()?;
    let admin = admin_listener.local_addr()?;
    gateway.observe.set_admin_addr(admin);
    let proxy_router = Router::new()
        .fallback(proxy::handle)
        .with_state(Arc::clone(&gateway));
    let admin_router = admin::router(Arc::clone(&gateway));
    let stop = [watch::channel(false).0, watch::channel(false).0];
    let limits = &config.limits;
    anyhow::ensure!(
        limits.max_connections > 0 && limits.first_byte_timeout_ms > 0,
        "limits.max_connections and limits.first_byte_timeout_ms must be at least 1"
    );
    let fds = connections::fd_limits();
    let proxy_cap = connections::effective_cap(limits.max_connections, fds.map(|f| f.0));
    log_fd_headroom(fds, limits.max_connections, proxy_cap);
    let listener = |cap: usize, metrics: &Arc<connections::ConnectionMetrics>| Listening {
        admission: Arc::new(connections::Admission::new(cap)),
        metrics: Arc::clone(metrics),
        header_timeout: limits.header_read_timeout(),
        first_byte_timeout: limits.first_byte_timeout(),
        // As long as an engine may be silent between two chunks.
        write_stall: limits.upstream_idle_timeout(),
        grace: Duration::from_millis(limits.shutdown_grace_ms),
    };
    let tasks = [
        tokio::spawn(serve(
            proxy_listener,
            proxy_router,
            listener(proxy_cap, &gateway.metrics.proxy_connections),
            stop[0].subscribe(),
        )),
        tokio::spawn(serve(
            admin_listener,
            admin_router,
            listener(
                connections::ADMIN_MAX_CONNECTIONS,
                &gateway.metrics.admin_connections,
            ),
            stop[1].subscribe(),
        )),
    ];
    tracing::info!(%proxy, %admin, rules = gateway.rules_snapshot().len(),
        "kvroute serve listening; loading tokenizers");
    if let Err(e) = warm.await {
        tracing::warn!(error = %e, "tokenizer loading task failed");
        for slug in &gateway.models {
            gateway
                .observe
                .tokenizer_done(slug, observe::TokenizerState::Failed(e.to_string()));
        }
    }
    tracing::info!(%proxy, %admin, tokenizers = gateway.models.len(), "kvroute serve ready");
    Ok(Running {
        proxy,
        admin,
        gateway,
        stop,
        tasks,
    })
}

/// The replica transport `[replicas]` names. The client keeps reconnecting
/// on its own: a NATS server that is down at start delays nothing (replicas
/// route on their own view until it is up).
async fn connect_nats(
    url: &str,
    cfg: &config::ReplicasConfig,
) -> anyhow::Result<Arc<kvroute::nats::NatsReplicas>> {
    let mut o = kvroute::nats::NatsOptions::new(url);
    o.subject_prefix.clone_from(&cfg.subject_prefix);
    o.subscription_capacity = cfg.receive_buffer;
    o.credentials_file = cfg.credentials_file.as_ref().map(PathBuf::from);
    o.token = cfg.token_env.as_ref().and_then(|v| std::env::var(v).ok());
    o.require_tls = cfg.tls_required;
    o.tls_root_certificates = cfg.tls_ca_file.as_ref().map(PathBuf::from);
    o.tls_client = cfg
        .tls_cert_file
        .as_ref()
        .zip(cfg.tls_key_file.as_ref())
        .map(|(c, k)| (PathBuf::from(c), PathBuf::from(k)));
    Ok(kvroute::nats::NatsReplicas::connect(o).await?)
}

/// How one listener treats its connections.
struct Listening {
    admission: Arc<connections::Admission>,
    metrics: Arc<connections::ConnectionMetrics>,
    header_timeout: Duration,
    first_byte_timeout: Duration,
    /// A client that accepts no response bytes for this long is dropped.
    write_stall: Duration,
    grace: Duration,
}

/// Logs the descriptor limit against the connection cap: the figure an
/// operator needs when connections are refused.
fn log_fd_headroom(fds: Option<(u64, Option<u64>)>, configured: usize, cap: usize) {
    match fds {
        Some((soft, hard)) => {
            tracing::info!(soft_nofile = soft, hard_nofile = ?hard, max_connections = configured,
                effective_max_connections = cap,
                admin_max_connections = connections::ADMIN_MAX_CONNECTIONS,
                "descriptor headroom");
            if cap < configured {
                tracing::warn!(soft_nofile = soft, max_connections = configured,
                    effective_max_connections = cap,
                    "limits.max_connections lowered so each client connection can also hold an upstream one within RLIMIT_NOFILE; raise `ulimit -n` to allow more");
            }
        }
        None => tracing::info!(
            max_connections = configured,
            "descriptor limit unknown (no /proc/self/limits); connection cap as configured"
        ),
    }
}

/// Requests an HTTP/2 client may have in flight on one connection.
const H2_STREAMS: u32 = 1;
/// Interval of HTTP/2 keep-alive pings, and how long one may go unanswered.
const H2_PING: Duration = Duration::from_secs(20);

/// Accepts connections until `stop`, then drains them for at most `grace`;
/// see [`connections`] for what happens to each.
async fn serve(
    listener: TcpListener,
    router: Router,
    how: Listening,
    mut stop: watch::Receiver<bool>,
) {
    // Connection tasks: drained at shutdown for the grace period, then
    // aborted (dropping the set aborts what is left).
    let mut open = tokio::task::JoinSet::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(how.header_timeout);
    // One request at a time per HTTP/2 connection, as HTTP/1's: the
    // connection cap (sized from the descriptor limit, one upstream socket per
    // client connection) then bounds requests in flight and their bodies'
    // memory. Pings drop peers that went away without closing.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_STREAMS)
        .keep_alive_interval(Some(H2_PING))
        .keep_alive_timeout(H2_PING);
    let builder = Arc::new(builder);
    let mut backoff = connections::AcceptBackoff::default();
    let mut errors = connections::AcceptErrorLog::default();
    loop {
        // Finished connection tasks are reaped as they end, so a burst of
        // closed connections frees its task memory at once.
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
            Some(_) = open.join_next(), if !open.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((s, _)) => {
                backoff.reset();
                s
            }
            Err(e) => {
                // EMFILE and friends: count, say it once per window, back off
                // instead of retrying (and logging) in a tight loop.
                how.metrics.accept_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = errors.admit(std::time::Instant::now()) {
                    tracing::warn!(error = %e, suppressed_since_last = suppressed,
                        open = how.metrics.open.load(Ordering::Relaxed),
                        "accept failed (counted in kvroute_accept_errors_total)");
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    _ = stop.changed() => break,
                }
                continue;
            }
        };
        let accepted_at = tokio::time::Instant::now();
        let Some(permit) = how.admission.admit(&how.metrics).await else {
            how.admission.refuse(stream, &how.metrics);
            continue;
        };
        how.metrics.accepted.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let activity = idle::Activity::default();
        let service =
            TowerToHyperService::new(idle::Tracked::new(router.clone(), activity.clone()));
        let builder = Arc::clone(&builder);
        let shed = how.admission.register_silent();
        let metrics = Arc::clone(&how.metrics);
        let mut stop = stop.clone();
        let deadline = accepted_at + how.first_byte_timeout;
        let write_stall = how.write_stall;
        let idle_timeout = how.header_timeout;
        open.spawn(async move {
            let _permit = permit;
            let _open = OpenGuard::new(&metrics);
            match connections::first_byte(&stream, shed, deadline, &mut stop).await {
                connections::Prelude::Spoke => {}
                connections::Prelude::TimedOut => {
                    metrics.first_byte_timeouts.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                connections::Prelude::Closed => return,
            }
            let io = connections::PrefaceDeadline::new(stream, deadline, Arc::clone(&metrics))
                .with_write_stall(write_stall)
                .with_activity(activity.clone());
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new(io), service)
                .into_owned();
            idle::drive(
                conn,
                &activity,
                &mut stop,
                &metrics,
                idle_timeout,
                write_stall,
            )
            .await;
        });
    }
    drop(listener);
    let drained = tokio::time::timeout(how.grace, async {
        while open.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = open.len(),
            "shutdown grace period over; closing remaining connections"
        );
        open.shutdown().await;
    }
}

/// Keeps the open-connections gauge while a connection task lives.
struct OpenGuard(Arc<connections::ConnectionMetrics>);

impl OpenGuard {
    fn new(metrics: &Arc<connections::ConnectionMetrics>) -> Self {
        metrics.open.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(metrics))
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The `RUST_LOG` filter (default `info`). The tokenizer library logs prompt
/// text character by character at trace level — user data in the log and a
/// large slowdown — so it stays at `warn` unless `RUST_LOG` names it.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let spec = rust_log.filter(|s| !s.trim().is_empty()).unwrap_or("info");
    let filter = tracing_subscriber::EnvFilter::try_new(spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if spec.contains("tokenizers") {
        return filter;
    }
    match "tokenizers=warn".parse() {
        Ok(d) => filter.add_directive(d),
        Err(_) => filter,
    }
}

/// Runs `kvroute serve` until SIGINT / SIGTERM.
pub fn run(args: &ServeArgs) -> ExitCode {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    // Colour codes only for a person at a terminal, not in a redirected log.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let config = match ServeConfig::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute serve: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvroute serve: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let running = match start(&config).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("kvroute serve: {e:#}");
                return ExitCode::FAILURE;
            }
        };
        // Tests and scripts read the bound addresses from this line.
        println!(
            "kvroute serve: proxy=http://{} admin=http://{}",
            running.proxy, running.admin
        );
        shutdown_signal().await;
        println!("kvroute serve: shutting down");
        running.shutdown().await;
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn tokenizer_trace_stays_off_unless_asked_for() {
        for spec in [None, Some(""), Some("trace"), Some("debug,kvroute=trace")] {
            let f = log_filter(spec).to_string();
            assert!(f.contains("tokenizers=warn"), "{spec:?}: {f}");
        }
        let f = log_filter(Some("info,tokenizers=trace")).to_string();
        assert!(!f.contains("tokenizers=warn"), "{f}");
        assert!(f.contains("tokenizers=trace"), "{f}");
    }
}
