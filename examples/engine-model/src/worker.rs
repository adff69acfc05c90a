//! One engine worker as a deterministic, sans-IO state machine: a FIFO of waiting
//! requests, a concurrency limit, the prefix cache and the cost model.
//!
//! The caller owns time. It calls [`Worker::advance`] with the current time
//! before [`Worker::submit`] (times must never go backwards), sleeps until
//! [`Worker::next_completion_us`], and drains [`Worker::drain_admissions`] and
//! [`Worker::drain_events`]. The real-time mock engine and the discrete-event
//! simulator drive the same type.
//!
//! Lifecycle of a request: waiting → admitted when a running slot is free and its
//! blocks fit (prefix hit pinned, the rest stored, LRU blocks evicted) → prefill
//! in the worker's serial prefill pipeline → decode → finished at the time
//! fixed on admission, when its blocks are released.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::KvEvent;

use super::cache::{AllocRequest, PrefixCache};
use super::cost::CostModel;

/// Static configuration of a worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV capacity in blocks.
    pub capacity_blocks: u32,
    /// Requests running at once (vLLM `max_num_seqs`).
    pub max_running: u32,
    /// Timing.
    pub cost: CostModel,
    /// Tier the cache reports in its events.
    pub medium: Medium,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            capacity_blocks: 8192,
            max_running: 64,
            cost: CostModel::default(),
            medium: Medium::Gpu,
        }
    }
}

/// One request as the worker sees it.
#[derive(Clone, Copy, Debug)]
pub struct RequestSpec<'a> {
    /// Keys of the prompt's full blocks, in chain order.
    pub keys: &'a [BlockKey],
    /// The prompt's token ids (for `BlockStored.token_ids`); may be empty.
    pub tokens: &'a [TokenId],
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens to generate (at least one is generated).
    pub output_tokens: u32,
    /// P/D decode side: the prompt's KV arrives from a prefill worker, so the
    /// request pays no prefill.
    pub kv_transferred: bool,
    /// The request's `cache_salt` (reported on block 0's stored event).
    pub cache_salt: Option<&'a str>,
}

/// Why a request was refused outright.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Prompt plus output need more blocks than the whole cache holds.
    #[error("request needs {needed} blocks, capacity is {capacity}")]
    TooLarge {
        /// Blocks needed.
        needed: u64,
        /// Worker capacity.
        capacity: u32,
    },
}

/// A request that left the queue, with its whole timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission<T> {
    /// The caller's handle.
    pub tag: T,
    /// Leading prompt blocks found in the cache.
    pub cached_blocks: u32,
    /// `cached_blocks × block_size` (what `usage.prompt_tokens_details.cached_tokens` reports).
    pub cached_tokens: u32,
    /// Blocks evicted to admit it.
    pub evicted_blocks: u32,
    /// When it was submitted.
    pub submitted_us: u64,
    /// When it got its slot and blocks.
    pub admitted_us: u64,
    /// When its prefill began (the pipeline was free); `first_token_us` for a
    /// request whose KV cache was transferred in.
    pub prefill_start_us: u64,
    /// Prompt tokens it prefilled (uncached; 0 when the KV was transferred).
    pub computed_tokens: u32,
    /// When the first output token exists.
    pub first_token_us: u64,
    /// When the last output token exists and its blocks are freed.
    pub finish_us: u64,
}

struct Waiting<T> {
    tag: T,
    submitted_us: u64,
    keys: Vec<BlockKey>,
    tokens: Vec<TokenId>,
    prompt_tokens: u32,
    output_tokens: u32,
    kv_transferred: bool,
    cache_salt: Option<Box<str>>,
}

struct Running {
    keys: Vec<BlockKey>,
    anonymous: u32,
    epoch: u64,
}

/// The worker model.
///
/// ```
/// # use kvroute_core::BlockKey;
/// # use kvroute_engine_model::{RequestSpec, Worker, WorkerConfig};
/// let mut w: Worker<u32> = Worker::new(WorkerConfig::default());
/// let keys = [BlockKey(1), BlockKey(2)];
/// let spec = RequestSpec { keys: &keys, tokens: &[], prompt_tokens: 40,
///                          output_tokens: 4, kv_transferred: false, cache_salt: None };
/// w.submit(0, 7, &spec).unwrap();
/// let a = w.drain_admissions().next().unwrap();
/// assert_eq!(a.cached_tokens, 0);
/// w.advance(a.finish_us);
/// w.submit(a.finish_us, 8, &spec).unwrap();
/// assert_eq!(w.drain_admissions().next().unwrap().cached_tokens, 32);
/// ```
pub struct Worker<T> {
    config: WorkerConfig,
    cache: PrefixCache,
    waiting: VecDeque<Waiting<T>>,
    running: Vec<Option<Running>>,
    free_slots: Vec<u32>,
    running_count: u32,
    completions: BinaryHeap<Reverse<(u64, u64, u32)>>,
    completion_seq: u64,
    prefill_free_us: u64,
    now_us: u64,
    epoch: u64,
    spare_keys: Vec<Vec<BlockKey>>,
    spare_tokens: Vec<Vec<TokenId>>,
    admissions: Vec<Admission<T>>,
    events: Vec<KvEvent>,
}

impl<T: Copy> Worker<T> {
    /// An idle worker with an empty cache.
    #[must_use]
    pub fn new(config: WorkerConfig) -> Self {
        let config = WorkerConfig {
            block_size: config.block_size.max(1),
            max_running: config.max_running.max(1),
            ..config
        };
        Self {
            cache: PrefixCache::new(config.capacity_blocks, config.medium),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free_slots: Vec::new(),
            running_count: 0,
            completions: BinaryHeap::new(),
            completion_seq: 0,
            prefill_free_us: 0,
            now_us: 0,
            epoch: 0,
            spare_keys: Vec::new(),
            spare_tokens: Vec::new(),
            admissions: Vec::new(),
            events: Vec::new(),
        }
    }

    /// The configuration in force.
    #[must_use]
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// The prefix cache (read-only).
    #[must_use]
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Requests waiting for a slot or blocks.
    #[must_use]
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted and not finished.
    #[must_use]
    pub fn running(&self) -> u32 {
        self.running_count
    }

    /// Leading prompt blocks a request with `keys` would find cached right now
    /// (before vLLM's "recompute the last token" cap).
    #[must_use]
    pub fn peek_hit(&self, keys: &[BlockKey]) -> usize {
        self.cache.longest_prefix(keys)
    }

    /// Queues a request at `now_us` and admits whatever fits.
    pub fn submit(
        &mut self,
        now_us: u64,
        tag: T,
        spec: &RequestSpec<'_>,
    ) -> Result<(), SubmitError> {
        self.advance(now_us);
        let needed = self.blocks_needed(spec.keys.len(), spec.prompt_tokens, spec.output_tokens);
        if needed > u64::from(self.config.capacity_blocks) {
            return Err(SubmitError::TooLarge {
                needed,
                capacity: self.config.capacity_blocks,
            });
        }
        let mut keys = self.spare_keys.pop().unwrap_or_default();
        keys.clear();
        keys.extend_from_slice(spec.keys);
        let mut tokens = self.spare_tokens.pop().unwrap_or_default();
        tokens.clear();
        tokens.extend_from_slice(spec.tokens);
        self.waiting.push_back(Waiting {
            tag,
            submitted_us: self.now_us,
            keys,
            tokens,
            prompt_tokens: spec.prompt_tokens,
            output_tokens: spec.output_tokens,
            kv_transferred: spec.kv_transferred,
            cache_salt: spec.cache_salt.map(Box::from),
        });
        self.admit_waiting(self.now_us);
        Ok(())
    }

    /// Finishes every request due by `now_us` (in time order, admitting waiting
    /// requests as blocks free up). A `now_us` earlier than the last one is
    /// treated as the last one.
    pub fn advance(&mut self, now_us: u64) {
        let now_us = now_us.max(self.now_us);
        while let Some(&Reverse((finish, _, slot))) = self.completions.peek() {
            if finish > now_us {
                break;
            }
            self.completions.pop();
            self.finish(slot);
            self.admit_waiting(finish);
        }
        self.now_us = now_us;
    }

    /// When the next running request finishes.
    #[must_use]
    pub fn next_completion_us(&self) -> Option<u64> {
        self.completions.peek().map(|Reverse((t, _, _))| *t)
    }

    /// Admissions since the last drain, in admission order.
    pub fn drain_admissions(&mut self) -> std::vec::Drain<'_, Admission<T>> {
        self.admissions.drain(..)
    }

    /// KV events since the last drain, in engine order.
    pub fn drain_events(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.events.drain(..)
    }

    /// Moves pending KV events into `out` (keeps both buffers' capacity).
    pub fn take_events_into(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// An engine restart: drops the cache (one `AllCleared`), the queue and the
    /// running requests. Waiting requests are returned so the caller can fail them.
    pub fn restart(&mut self) -> Vec<T> {
        self.epoch += 1;
        self.cache.clear(&mut self.events);
        self.completions.clear();
        self.running.clear();
        self.free_slots.clear();
        self.running_count = 0;
        self.prefill_free_us = self.now_us;
        self.waiting.drain(..).map(|w| w.tag).collect()
    }

    fn blocks_needed(&self, full_blocks: usize, prompt: u32, output: u32) -> u64 {
        let total = u64::from(prompt) + u64::from(output.max(1));
        total
            .div_ceil(u64::from(self.config.block_size))
            .max(full_blocks as u64)
    }

    fn admit_waiting(&mut self, at_us: u64) {
        while self.running_count < self.config.max_running {
            let Some(front) = self.waiting.front() else {
                return;
            };
            let bs = self.config.block_size;
            let needed =
                self.blocks_needed(front.keys.len(), front.prompt_tokens, front.output_tokens);
            let anonymous =
                u32::try_from(needed.saturating_sub(front.keys.len() as u64)).unwrap_or(u32::MAX);
            // vLLM caps a hit at prompt_len - 1 tokens so the last token is recomputed.
            let hit_limit = (front.prompt_tokens.saturating_sub(1) / bs) as usize;
            let request = AllocRequest {
                keys: &front.keys,
                hit_limit,
                anonymous,
                tokens: &front.tokens,
                block_size: bs,
                cache_salt: front.cache_salt.as_deref(),
            };
            let Ok(alloc) = self.cache.allocate(&request, &mut self.events) else {
                return;
            };
            let Some(w) = self.waiting.pop_front() else {
                return;
            };
            let cached_tokens = alloc.hit_blocks.saturating_mul(bs).min(w.prompt_tokens);
            let cost = self.config.cost;
            let (prefill_start_us, computed_tokens, first_token_us) = if w.kv_transferred {
                let t = at_us.saturating_add(cost.decode_us(1));
                (t, 0, t)
            } else {
                let start = at_us.max(self.prefill_free_us);
                let computed = w.prompt_tokens - cached_tokens;
                let done = start.saturating_add(cost.prefill_us(computed));
                self.prefill_free_us = done;
                (start, computed, done)
            };
            let finish_us =
                first_token_us.saturating_add(cost.decode_us(w.output_tokens.saturating_sub(1)));
            self.admissions.push(Admission {
                tag: w.tag,
                cached_blocks: alloc.hit_blocks,
                cached_tokens,
                evicted_blocks: alloc.evicted,
                submitted_us: w.submitted_us,
                admitted_us: at_us,
                prefill_start_us,
                computed_tokens,
                first_token_us,
                finish_us,
            });
            let mut tokens = w.tokens;
            tokens.clear();
            self.spare_tokens.push(tokens);
            let run = Running {
                keys: w.keys,
                anonymous,
                epoch: self.epoch,
            };
            let slot = match self.free_slots.pop() {
                Some(s) => {
                    if let Some(entry) = self.running.get_mut(s as usize) {
                        *entry = Some(run);
                    }
                    s
                }
                None => {
                    self.running.push(Some(run));
                    (self.running.len() - 1) as u32
                }
            };
            self.running_count += 1;
            self.completion_seq += 1;
            self.completions
                .push(Reverse((finish_us, self.completion_seq, slot)));
        }
    }

    fn finish(&mut self, slot: u32) {
        let Some(run) = self.running.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        if run.epoch == self.epoch {
            self.cache.release(&run.keys, run.anonymous);
        }
        let mut keys = run.keys;
        keys.clear();
        self.spare_keys.push(keys);
        self.free_slots.push(slot);
        self.running_count = self.running_count.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> WorkerConfig {
        WorkerConfig {
            block_size: 4,
            capacity_blocks: 16,
            max_running: 2,
            cost: CostModel {
                prefill_step_us: 100.0,
                prefill_us_per_token: 10.0,
                max_batched_tokens: 1000,
                decode_us_per_token: 50.0,
            },
            medium: Medium::Gpu,
        }
    }

    fn spec(keys: &[BlockKey], prompt: u32, out: u32) -> RequestSpec<'_> {
        RequestSpec {
            keys,
            tokens: &[],
            prompt_tokens: prompt,
            output_tokens: out,
            kv_transferred: false,
            cache_salt: None,
        }
    }

    #[test]
    fn second_request_hits_and_is_faster() {
        let mut w: Worker<u8> = Worker::new(cfg());
        let keys: Vec<BlockKey> = (1..=3).map(BlockKey).collect();
        w.submit(0, 1, &spec(&keys, 14, 2)).unwrap();
        let a = w.drain_admissions().next().unwrap();
        assert_eq!(a.cached_tokens, 0);
        assert_eq!(a.first_token_us, 100 + 140);
        assert_eq!(a.finish_us, a.first_token_us + 50);
        w.advance(a.finish_us);
        w.submit(a.finish_us, 2, &spec(&keys, 14, 2)).unwrap();
        let b = w.drain_admissions().next().unwrap();
        assert_eq!(b.cached_tokens, 12);
        assert_eq!(b.first_token_us - b.admitted_us, 100 + 20);
    }

    #[test]
    fn concurrency_limit_queues_and_prefill_is_serial() {
        let mut w: Worker<u8> = Worker::new(cfg());
        let k: [Vec<BlockKey>; 3] = [vec![BlockKey(1)], vec![BlockKey(2)], vec![BlockKey(3)]];
        for (i, keys) in k.iter().enumerate() {
            w.submit(0, i as u8, &spec(keys, 4, 10)).unwrap();
        }
        let adm: Vec<_> = w.drain_admissions().collect();
        assert_eq!(adm.len(), 2);
        assert_eq!(adm[1].first_token_us, adm[0].first_token_us + 140);
        assert_eq!(w.waiting(), 1);
        w.advance(adm[0].finish_us);
        let third = w.drain_admissions().next().unwrap();
        assert_eq!(third.tag, 2);
        assert_eq!(third.admitted_us, adm[0].finish_us);
    }

    #[test]
    fn too_large_is_refused() {
        let mut w: Worker<u8> = Worker::new(cfg());
        let err = w.submit(0, 0, &spec(&[], 64, 10)).unwrap_err();
        assert!(matches!(
            err,
            SubmitError::TooLarge {
                needed: 19,
                capacity: 16
            }
        ));
    }
}
