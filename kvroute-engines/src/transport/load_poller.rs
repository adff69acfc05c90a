use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::load_report::{parse_load, EngineLoadReport, LoadReportError, MetricsDialect};

/// Configuration of one [`LoadPoller`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadPollerConfig {
    /// Full URL, e.g. `http://10.0.0.9:8000/metrics`
    /// (see [`MetricsDialect::default_path`]).
    pub url: String,
    /// Format of the body.
    pub dialect: MetricsDialect,
    /// Time between the starts of two polls.
    pub interval: Duration,
    /// Upper bound of one poll (connect, response, body).
    pub timeout: Duration,
    /// Bodies larger than this fail the poll (checked while streaming).
    pub max_body_bytes: usize,
}

impl LoadPollerConfig {
    /// Defaults: poll every 200 ms, 1 s timeout, 8 MiB body limit.
    #[must_use]
    pub fn new(url: impl Into<String>, dialect: MetricsDialect) -> Self {
        Self {
            url: url.into(),
            dialect,
            interval: Duration::from_millis(200),
            timeout: Duration::from_secs(1),
            max_body_bytes: 8 << 20,
        }
    }

    /// Sets the poll interval (at least 1 ms).
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Sets the per-poll timeout.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the body size limit (capped at [`crate::MAX_METRICS_BODY_BYTES`]).
    #[must_use]
    pub fn max_body_bytes(mut self, limit: usize) -> Self {
        self.max_body_bytes = limit.min(crate::MAX_METRICS_BODY_BYTES);
        self
    }
}

/// Why one poll gave no report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadPollError {
    /// Connect or transfer failed.
    #[error("request failed: {0}")]
    Request(#[source] reqwest::Error),
    /// No complete response within the timeout.
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
    /// The engine answered with a non-2xx status.
    #[error("HTTP status {0}")]
    Status(u16),
    /// The body exceeded the configured limit.
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    /// The body is not a metrics body of the configured dialect.
    #[error(transparent)]
    Parse(#[from] LoadReportError),
}

const NEVER: u64 = 0;

/// Counters of one poller, shared lock-free with whoever exports them.
#[derive(Debug, Default)]
pub struct LoadPollerMetrics {
    polls: AtomicU64,
    failures: AtomicU64,
    consecutive_failures: AtomicU64,
    timeouts: AtomicU64,
    request_errors: AtomicU64,
    status_errors: AtomicU64,
    too_large: AtomicU64,
    parse_errors: AtomicU64,
    last_success_unix_ms: AtomicU64,
    last_latency_us: AtomicU64,
}

/// A point-in-time copy of [`LoadPollerMetrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadPollSnapshot {
    /// Polls completed (successful or not).
    pub polls: u64,
    /// Polls that gave no report (sum of the kinds below).
    pub failures: u64,
    /// Failures since the last success (0 while the engine answers).
    pub consecutive_failures: u64,
    /// Polls that timed out.
    pub timeouts: u64,
    /// Polls whose connection or transfer failed.
    pub request_errors: u64,
    /// Polls answered with a non-2xx status.
    pub status_errors: u64,
    /// Bodies over the size limit.
    pub too_large: u64,
    /// Bodies that did not parse in the configured dialect.
    pub parse_errors: u64,
    /// Wall-clock time of the last successful poll.
    pub last_success: Option<SystemTime>,
    /// Duration of the last poll, µs.
    pub last_latency_us: u64,
}

impl LoadPollerMetrics {
    /// Copies every counter.
    #[must_use]
    pub fn snapshot(&self) -> LoadPollSnapshot {
        let last = self.last_success_unix_ms.load(Relaxed);
        LoadPollSnapshot {
            polls: self.polls.load(Relaxed),
            failures: self.failures.load(Relaxed),
            consecutive_failures: self.consecutive_failures.load(Relaxed),
            timeouts: self.timeouts.load(Relaxed),
            request_errors: self.request_errors.load(Relaxed),
            status_errors: self.status_errors.load(Relaxed),
            too_large: self.too_large.load(Relaxed),
            parse_errors: self.parse_errors.load(Relaxed),
            last_success: (last != NEVER).then(|| UNIX_EPOCH + Duration::from_millis(last)),
            last_latency_us: self.last_latency_us.load(Relaxed),
        }
    }

    fn record(&self, result: &Result<EngineLoadReport, LoadPollError>, took: Duration) {
        self.polls.fetch_add(1, Relaxed);
        self.last_latency_us
            .store(u64::try_from(took.as_micros()).unwrap_or(u64::MAX), Relaxed);
        let kind = match result {
            Ok(_) => {
                self.consecutive_failures.store(0, Relaxed);
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                self.last_success_unix_ms.store(now.max(1), Relaxed);
                return;
            }
            Err(LoadPollError::Timeout(_)) => &self.timeouts,
            Err(LoadPollError::Request(_)) => &self.request_errors,
            Err(LoadPollError::Status(_)) => &self.status_errors,
            Err(LoadPollError::TooLarge(_)) => &self.too_large,
            Err(LoadPollError::Parse(_)) => &self.parse_errors,
        };
        kind.fetch_add(1, Relaxed);
        self.failures.fetch_add(1, Relaxed);
        self.consecutive_failures.fetch_add(1, Relaxed);
    }
}

/// Polls one engine's metrics endpoint.
///
/// Engine-reported load: `GET` an engine's metrics endpoint on an interval and
/// hand each parsed [`EngineLoadReport`] (or the reason there is none) to the host.
///
/// A thin shell around [`parse_load`]: the HTTP request, a deadline, a body limit
/// enforced while the body streams in, and counters. What the figures mean per
/// engine (names, ranks, the TensorRT-LLM drain) is documented on
/// [`MetricsDialect`]. Every poll reports, successful or not, so the host can age
/// out a report the engine stopped confirming.
///
/// vLLM and SGLang `/metrics` and TensorRT-LLM `/prometheus/metrics` can be read
/// by any number of pollers (one per gateway replica). TensorRT-LLM's JSON
/// `/metrics` ([`MetricsDialect::Trtllm`]) is a destructive drain of the
/// iteration-stats queue: pollers sharing it each see a part of the iterations.
///
/// Gated by the `trtllm-http` feature, the one that already brings `reqwest`.
///
/// ```no_run
/// use kvroute_engines::transport::{LoadPoller, LoadPollerConfig};
/// use kvroute_engines::MetricsDialect;
///
/// # async fn host() {
/// let config = LoadPollerConfig::new("http://10.0.0.9:8000/metrics", MetricsDialect::Vllm);
/// let poller = LoadPoller::new(config).expect("client");
/// let metrics = poller.metrics();
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let task = tokio::spawn(poller.run(
///     |report| match report {
///         Ok(r) => println!("running {} waiting {} usage {:?}", r.running, r.waiting, r.kv_usage),
///         Err(e) => eprintln!("no load report: {e}"),
///     },
///     async move { let _ = stopped.await; },
/// ));
/// # let _ = (stop, task, metrics);
/// # }
/// ```
#[derive(Debug)]
pub struct LoadPoller {
    config: LoadPollerConfig,
    client: reqwest::Client,
    metrics: Arc<LoadPollerMetrics>,
}

impl LoadPoller {
    /// Builds the HTTP client (no request is made yet).
    pub fn new(config: LoadPollerConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .pool_idle_timeout(crate::ENGINE_HTTP_IDLE)
            .build()?;
        Ok(Self {
            config,
            client,
            metrics: Arc::new(LoadPollerMetrics::default()),
        })
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &LoadPollerConfig {
        &self.config
    }

    /// Its counters.
    #[must_use]
    pub fn metrics(&self) -> Arc<LoadPollerMetrics> {
        Arc::clone(&self.metrics)
    }

    /// One poll, counted in the metrics.
    pub async fn poll_once(&self) -> Result<EngineLoadReport, LoadPollError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.config.timeout, self.fetch()).await {
            Ok(Ok(body)) => parse_load(self.config.dialect, &body).map_err(LoadPollError::from),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LoadPollError::Timeout(self.config.timeout)),
        };
        self.metrics.record(&result, started.elapsed());
        result
    }

    /// Polls every `interval` until `stop` completes, calling `on_report` with each
    /// outcome. A poll slower than the interval delays the next one (no bursts).
    pub async fn run<F, S>(self, mut on_report: F, stop: S)
    where
        F: FnMut(Result<EngineLoadReport, LoadPollError>),
        S: Future<Output = ()>,
    {
        let mut stop = std::pin::pin!(stop);
        let mut ticks = tokio::time::interval(self.config.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => return,
                _ = ticks.tick() => {}
            }
            let result = tokio::select! {
                () = &mut stop => return,
                r = self.poll_once() => r,
            };
            if let Err(e) = &result {
                tracing::debug!(url = %self.config.url, dialect = %self.config.dialect,
                    error = %e, "load poller: no report");
            }
            on_report(result);
        }
    }

    async fn fetch(&self) -> Result<Vec<u8>, LoadPollError> {
        let mut response = self
            .client
            .get(&self.config.url)
            .header(reqwest::header::ACCEPT, "text/plain, application/json")
            .send()
            .await
            .map_err(|e| self.request_error(e))?;
        let status = response.status();
        if !status.is_success() {
            return Err(LoadPollError::Status(status.as_u16()));
        }
        let limit = self.config.max_body_bytes;
        if response
            .content_length()
            .is_some_and(|len| len > limit as u64)
        {
            return Err(LoadPollError::TooLarge(limit));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.request_error(e))? {
            if body.len().saturating_add(chunk.len()) > limit {
                return Err(LoadPollError::TooLarge(limit));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    fn request_error(&self, e: reqwest::Error) -> LoadPollError {
        if e.is_timeout() {
            LoadPollError::Timeout(self.config.timeout)
        } else {
            LoadPollError::Request(e)
        }
    }
}
