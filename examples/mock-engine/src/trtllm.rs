//! TensorRT-LLM mode: events queue up as `trtllm-serve` JSON ("classic" schema,
//! golden/trtllm-events/README.md) until a `POST /kv_cache_events` drains them.

use kvroute_ingest::KvEvent;
use parking_lot::Mutex;
use serde_json::{json, Value};

/// The pending drain.
pub struct TrtllmQueue {
    inner: Mutex<Inner>,
    window_size: u64,
    max_pending: usize,
}

struct Inner {
    next_id: u64,
    pending: Vec<Value>,
    dropped: u64,
}

impl TrtllmQueue {
    /// A queue that first reports a `created` event with `capacity_blocks`
    /// (as the engine does at start-up) and keeps at most `max_pending` events.
    #[must_use]
    pub fn new(capacity_blocks: u32, window_size: u64, max_pending: usize) -> Self {
        let created = json!({
            "event_id": 0,
            "data": {"type": "created", "num_blocks_per_cache_level": [capacity_blocks, 0]},
            "window_size": window_size,
        });
        Self {
            inner: Mutex::new(Inner {
                next_id: 1,
                pending: vec![created],
                dropped: 0,
            }),
            window_size,
            max_pending,
        }
    }

    /// Appends events in engine order.
    pub fn push(&self, events: &[KvEvent]) {
        let mut q = self.inner.lock();
        for e in events {
            let data = match e {
                KvEvent::Stored(s) => {
                    let bs = s.block_size.max(1) as usize;
                    let blocks: Vec<Value> = s
                        .keys
                        .iter()
                        .enumerate()
                        .map(|(i, k)| {
                            let tokens: Vec<Value> = s
                                .token_ids
                                .iter()
                                .skip(i * bs)
                                .take(bs)
                                .map(|t| json!({"type": "unique_token", "token_id": t, "token_extra_id": 0}))
                                .collect();
                            json!({"type": "stored_block", "block_hash": k.0, "tokens": tokens,
                                   "cache_level": 0, "priority": 35})
                        })
                        .collect();
                    json!({"type": "stored", "parent_hash": s.parent.map(|p| p.0), "blocks": blocks})
                }
                KvEvent::Removed(r) => {
                    let keys: Vec<u64> = r.keys.iter().map(|k| k.0).collect();
                    json!({"type": "removed", "block_hashes": keys})
                }
                // TensorRT-LLM has no "cleared" event; a restarted engine starts over
                // with `created`.
                KvEvent::AllCleared => {
                    json!({"type": "created", "num_blocks_per_cache_level": [0, 0]})
                }
                KvEvent::Moved(_) => continue,
            };
            if q.pending.len() >= self.max_pending {
                q.dropped += 1;
                continue;
            }
            let id = q.next_id;
            q.next_id += 1;
            q.pending
                .push(json!({"event_id": id, "data": data, "window_size": self.window_size}));
        }
    }

    /// Takes everything queued (the destructive drain).
    pub fn drain(&self) -> Vec<Value> {
        std::mem::take(&mut self.inner.lock().pending)
    }
}
