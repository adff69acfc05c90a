use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::metrics::{RateMeter, SubscriberMetrics};
use super::sink::DrainSink;

/// Configuration of one [`TrtllmPoller`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TrtllmPollerConfig {
    /// Full URL of the drain route, e.g. `http://10.0.0.9:8000/kv_cache_events`.
    pub url: String,
    /// Pause between successful drains.
    pub interval: Duration,
    /// Upper bound of one request (connect + response + body).
    pub request_timeout: Duration,
    /// First pause after a failed drain; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Largest pause after failures.
    pub backoff_max: Duration,
    /// Bodies larger than this are dropped unread: their events are lost,
    /// so the sink clears the inventory ([`DrainSink::on_lost_drain`]), and
    /// the drain counts as a decode error.
    ///
    /// [`DrainSink::on_lost_drain`]: super::DrainSink::on_lost_drain
    pub max_body_bytes: usize,
}

impl TrtllmPollerConfig {
    /// Defaults: poll every 100 ms, 2 s request timeout, backoff 100 ms → 5 s,
    /// 64 MiB body limit.
    #[must_use]
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            interval: Duration::from_millis(100),
            request_timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_body_bytes: 64 << 20,
        }
    }

    /// Sets the poll interval.
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets the request timeout.
    #[must_use]
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets the failure backoff bounds.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.backoff_initial = initial;
        self.backoff_max = max.max(initial);
        self
    }

    /// Sets the body size limit.
    #[must_use]
    pub fn max_body_bytes(mut self, limit: usize) -> Self {
        self.max_body_bytes = limit;
        self
    }
}

/// Why one drain failed.
#[derive(Debug, thiserror::Error)]
enum DrainError {
    #[error("request failed: {0}")]
    Request(#[from] reqwest::Error),
    #[error("HTTP status {0}")]
    Status(reqwest::StatusCode),
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
}

/// Drains one TensorRT-LLM engine's KV events: `POST /kv_cache_events` on an interval.
///
/// # ⚠ Destructive drain: exactly ONE poller per engine
///
/// `trtllm-serve`'s handler drains the engine's event queue until it is empty and
/// returns what it drained: **every call consumes the events it returns**. Two
/// consumers of the same engine (two gateway replicas, a second kvroute instance,
/// a monitoring script, `curl` by hand) each see a disjoint, random part of the
/// stream and both inventories silently rot. Run exactly one poller per engine
/// endpoint (and attention-DP rank set) in the whole fleet; fan the resulting
/// inventory out from there. The sink notices a competing consumer only as
/// `event_id` gaps (each one clears the inventory, see
/// [`DrainReport::gap`](super::DrainReport::gap)) — a steady
/// gap counter in the metrics is the symptom to alert on.
///
/// Events exist only when the engine runs with a positive
/// `kv_cache_config.event_buffer_max_size` and block reuse enabled; an idle engine
/// answers `[]`. A slow poller loses
/// events once that buffer overflows (again visible as an `event_id` gap).
/// TensorRT-LLM block keys depend on salts and LoRA task ids the events do not
/// fully carry, so the sink re-keys stored blocks from their tokens.
///
/// ```no_run
/// use kvroute_engines::transport::{DrainReport, DrainSink, TrtllmPoller, TrtllmPollerConfig};
///
/// struct Count(usize);
/// impl DrainSink for Count {
///     fn on_drain(&mut self, body: &[u8]) -> DrainReport {
///         self.0 += body.len();
///         DrainReport::default()
///     }
/// }
///
/// # async fn host() {
/// let poller = TrtllmPoller::new(TrtllmPollerConfig::new("http://10.0.0.9:8000/kv_cache_events"))
///     .expect("client");
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let task = tokio::spawn(poller.run(Count(0), async move { let _ = stopped.await; }));
/// # let _ = (stop, task);
/// # }
/// ```
#[derive(Debug)]
pub struct TrtllmPoller {
    config: TrtllmPollerConfig,
    client: reqwest::Client,
    metrics: Arc<SubscriberMetrics>,
}

impl TrtllmPoller {
    /// Builds the HTTP client (no request is made yet).
    pub fn new(config: TrtllmPollerConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .connect_timeout(config.request_timeout)
            .pool_idle_timeout(crate::ENGINE_HTTP_IDLE)
            .build()?;
        Ok(Self {
            config,
            client,
            metrics: Arc::new(SubscriberMetrics::default()),
        })
    }

    /// Its metrics (`frames_live` counts successful drains, `last_seq` is the last
    /// `event_id` the sink reported).
    #[must_use]
    pub fn metrics(&self) -> Arc<SubscriberMetrics> {
        Arc::clone(&self.metrics)
    }

    /// Polls until `shutdown` completes, then returns the sink.
    pub async fn run<S, F>(self, mut sink: S, shutdown: F) -> S
    where
        S: DrainSink,
        F: Future<Output = ()>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = self.config.backoff_initial;
        let mut rate = RateMeter::new(std::time::Instant::now());
        let mut reachable = false;
        loop {
            let result = tokio::select! {
                () = &mut shutdown => return sink,
                r = self.drain_once() => r,
            };
            // An answer too large to read was still an answer: the engine
            // is reachable, and it handed out the events it held.
            let answered = matches!(result, Ok(_) | Err(DrainError::TooLarge(_)));
            self.metrics.poll(answered);
            if answered && !reachable {
                reachable = true;
                self.metrics.set_connected(true);
            }
            let pause = match result {
                Ok(body) => {
                    let report = sink.on_drain(&body);
                    self.metrics.drain(&report);
                    self.metrics.decoded(sink.decode_stats());
                    backoff = self.config.backoff_initial;
                    self.config.interval
                }
                Err(DrainError::TooLarge(limit)) => {
                    tracing::warn!(url = %self.config.url, limit,
                        "trtllm poller: drain body over the size limit dropped; its events are lost");
                    let report = sink.on_lost_drain();
                    self.metrics.drain(&report);
                    self.metrics.decoded(sink.decode_stats());
                    backoff = self.config.backoff_initial;
                    self.config.interval
                }
                Err(e) => {
                    tracing::debug!(url = %self.config.url, error = %e, retry_in = ?backoff,
                        "trtllm poller: drain failed");
                    if reachable {
                        reachable = false;
                        self.metrics.set_connected(false);
                        sink.on_unreachable();
                    }
                    let pause = backoff;
                    backoff = (backoff * 2).min(self.config.backoff_max);
                    pause
                }
            };
            rate.tick(&self.metrics, std::time::Instant::now());
            tokio::select! {
                () = &mut shutdown => return sink,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    async fn drain_once(&self) -> Result<Vec<u8>, DrainError> {
        let mut response = self.client.post(&self.config.url).send().await?;
        let status = response.status();
        if !status.is_success() {
            return Err(DrainError::Status(status));
        }
        let limit = self.config.max_body_bytes;
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await? {
            if body.len().saturating_add(chunk.len()) > limit {
                return Err(DrainError::TooLarge(limit));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }
}
