//! The real-time driver around the sans-IO [`Worker`]: maps wall-clock time to
//! model microseconds, wakes up at completions, hands admissions to waiting HTTP
//! handlers and turns each event outbox into one published batch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_ingest::KvEvent;
use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use super::publisher::Publisher;
use super::trtllm::TrtllmQueue;
use super::wire::{encode_batch, WireFormat};
use kvroute_engine_model::{Admission, RequestSpec, SubmitError, Worker, WorkerConfig};

/// Where event batches go.
pub enum EventSink {
    /// ZeroMQ PUB in vLLM or SGLang msgpack.
    Zmq {
        /// Payload layout.
        format: WireFormat,
        /// The sockets.
        publisher: Publisher,
    },
    /// TensorRT-LLM's `/kv_cache_events` drain.
    Trtllm(Arc<TrtllmQueue>),
}

struct State {
    worker: Worker<u64>,
    waiters: HashMap<u64, oneshot::Sender<Admission<u64>>>,
    next_tag: u64,
    events: Vec<KvEvent>,
    payload: Vec<u8>,
    /// Admitted requests whose prefill has not ended: (first token, tokens,
    /// prefill µs). At most the running requests.
    prefilling: Vec<(u64, u64, u64)>,
    /// Requests whose prefill has ended: uncached tokens and µs, summed.
    prefilled_requests: u64,
    prefilled_tokens: u64,
    prefilled_us: u64,
}

/// The load figures `GET /metrics` exports, read from the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSnapshot {
    /// Admitted, unfinished requests.
    pub running: u32,
    /// Queued requests.
    pub waiting: u32,
    /// Blocks held by requests (pinned cached blocks plus key-less ones).
    pub in_use_blocks: u32,
    /// KV capacity in blocks.
    pub capacity_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Requests running at once at most.
    pub max_running: u32,
    /// Requests past their first token.
    pub prefilled_requests: u64,
    /// Their uncached prompt tokens, summed.
    pub prefilled_tokens: u64,
    /// Their prefill time (first token − prefill start), summed, µs.
    pub prefilled_us: u64,
}

/// A running engine model.
pub struct Engine {
    state: Mutex<State>,
    wake: Notify,
    clock: Instant,
    sink: EventSink,
}

impl Engine {
    /// Builds the engine and spawns its completion driver.
    pub fn start(config: WorkerConfig, sink: EventSink) -> Arc<Self> {
        let engine = Arc::new(Self {
            state: Mutex::new(State {
                worker: Worker::new(config),
                waiters: HashMap::new(),
                next_tag: 0,
                events: Vec::new(),
                payload: Vec::new(),
                prefilling: Vec::new(),
                prefilled_requests: 0,
                prefilled_tokens: 0,
                prefilled_us: 0,
            }),
            wake: Notify::new(),
            clock: Instant::now(),
            sink,
        });
        tokio::spawn(drive(Arc::downgrade(&engine)));
        engine
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The wall-clock instant of model time `us`.
    pub fn instant(&self, us: u64) -> Instant {
        self.clock + Duration::from_micros(us)
    }

    /// Queues a request; the receiver yields its admission (timeline included).
    pub fn submit(
        &self,
        spec: &RequestSpec<'_>,
    ) -> Result<oneshot::Receiver<Admission<u64>>, SubmitError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.state.lock();
            let tag = st.next_tag;
            st.next_tag += 1;
            st.waiters.insert(tag, tx);
            let now = self.now_us();
            if let Err(e) = st.worker.submit(now, tag, spec) {
                st.waiters.remove(&tag);
                return Err(e);
            }
            self.dispatch(&mut st);
        }
        self.wake.notify_one();
        Ok(rx)
    }

    /// Drops the cache (publishing `AllBlocksCleared`) and every waiting request.
    pub fn clear(&self) {
        let mut st = self.state.lock();
        for tag in st.worker.restart() {
            st.waiters.remove(&tag);
        }
        self.dispatch(&mut st);
    }

    /// Running and waiting requests and block use right now (finishes what is due
    /// first, so a scrape never reports a request that has already completed).
    pub fn load(&self) -> LoadSnapshot {
        let snapshot = {
            let mut st = self.state.lock();
            let now = self.now_us();
            st.worker.advance(now);
            self.dispatch(&mut st);
            // vLLM counts a request's prefill when it finishes; counting it at
            // its first token reports the same sums earlier.
            let State {
                prefilling,
                prefilled_requests,
                prefilled_tokens,
                prefilled_us,
                ..
            } = &mut *st;
            prefilling.retain(|&(first, tokens, us)| {
                if first > now {
                    return true;
                }
                *prefilled_requests += 1;
                *prefilled_tokens = prefilled_tokens.saturating_add(tokens);
                *prefilled_us = prefilled_us.saturating_add(us);
                false
            });
            let w = &st.worker;
            let cache = w.cache();
            LoadSnapshot {
                running: w.running(),
                waiting: u32::try_from(w.waiting()).unwrap_or(u32::MAX),
                in_use_blocks: cache.used_blocks().saturating_sub(cache.evictable_blocks()),
                capacity_blocks: cache.capacity(),
                block_size: w.config().block_size,
                max_running: w.config().max_running,
                prefilled_requests: st.prefilled_requests,
                prefilled_tokens: st.prefilled_tokens,
                prefilled_us: st.prefilled_us,
            }
        };
        // Advancing may have admitted requests that finish before the driver's timer.
        self.wake.notify_one();
        snapshot
    }

    /// Cached blocks right now.
    pub fn cached_blocks(&self) -> u32 {
        self.state.lock().worker.cache().cached_blocks()
    }

    /// The event sink.
    pub fn sink(&self) -> &EventSink {
        &self.sink
    }

    fn dispatch(&self, st: &mut State) {
        let State {
            worker,
            waiters,
            events,
            payload,
            prefilling,
            ..
        } = st;
        for a in worker.drain_admissions() {
            prefilling.push((
                a.first_token_us,
                u64::from(a.computed_tokens),
                a.first_token_us.saturating_sub(a.prefill_start_us),
            ));
            if let Some(tx) = waiters.remove(&a.tag) {
                let _ = tx.send(a);
            }
        }
        worker.take_events_into(events);
        if events.is_empty() {
            return;
        }
        match &self.sink {
            EventSink::Zmq { format, publisher } => {
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                match encode_batch(*format, ts, events, Some(0), payload) {
                    Ok(()) => publisher.publish(std::mem::take(payload)),
                    Err(e) => tracing::warn!(error = %e, "event batch not encodable"),
                }
            }
            EventSink::Trtllm(queue) => queue.push(events),
        }
        events.clear();
    }
}

async fn drive(engine: std::sync::Weak<Engine>) {
    loop {
        let Some(e) = engine.upgrade() else {
            return;
        };
        let next = {
            let mut st = e.state.lock();
            let now = e.now_us();
            st.worker.advance(now);
            e.dispatch(&mut st);
            st.worker.next_completion_us()
        };
        let notified = e.wake.notified();
        match next {
            Some(t) => {
                let at = tokio::time::Instant::from_std(e.instant(t));
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = notified => {}
                }
            }
            None => {
                // Re-check liveness now and then so a dropped engine ends the task.
                let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
            }
        }
    }
}
