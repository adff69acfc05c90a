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
use crate::engine_model::{Admission, RequestSpec, SubmitError, Worker, WorkerConfig};

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
            ..
        } = st;
        for a in worker.drain_admissions() {
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
