//! SGLang Model Gateway's `cache_aware` policy.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::BuildHasherDefault;

use kvroute_core::BlockKey;
use kvroute_engine_model::cache::KeyHasher;

use super::{PeerPolicy, PeerRequest, WorkerView};

type KeyMap<V> = HashMap<BlockKey, V, BuildHasherDefault<KeyHasher>>;

/// One block of one worker's approximate tree.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TreeNode {
    /// The previous block of the prompts that reached this one (None at the
    /// first block).
    pub(crate) parent: Option<BlockKey>,
    /// Children present in this worker's tree; 0 makes the node a leaf.
    pub(crate) children: u32,
    /// Insert counter value of the last insert through this node (LRU order).
    stamp: u64,
}

/// How many leading `keys` one worker's tree holds, and the stamp of the
/// deepest of them.
pub(crate) fn tree_depth(tree: &KeyMap<TreeNode>, keys: &[BlockKey]) -> (usize, u64) {
    let mut depth = 0;
    let mut stamp = 0;
    for k in keys {
        match tree.get(k) {
            Some(node) => {
                depth += 1;
                stamp = node.stamp;
            }
            None => break,
        }
    }
    (depth, stamp)
}

/// SGLang Model Gateway's `cache_aware` policy over an approximate per-worker
/// prefix tree (see the source file's module comment).
#[derive(Debug)]
pub struct SmgCacheAware {
    cache_threshold: f32,
    balance_abs_threshold: u32,
    balance_rel_threshold: f32,
    balance_token_usage_threshold: f64,
    overload_token_usage_threshold: f64,
    eviction_interval_us: u64,
    max_tree_tokens: u64,
    /// One tree per worker: what the router sent there.
    pub(crate) trees: Vec<KeyMap<TreeNode>>,
    /// Requests routed to each worker so far (SMG's `processed`, the second
    /// key of its least-loaded tie-break).
    processed: Vec<u64>,
    epoch: u64,
    next_eviction_us: Option<u64>,
    evictions: u64,
    heap: BinaryHeap<Reverse<(u64, u64)>>,
}

/// SMG's default `--max-tree-size` in characters.
pub const SMG_MAX_TREE_CHARS: u64 = 1 << 26;
/// Characters per token assumed to turn SMG's character bound into tokens.
pub const CHARS_PER_TOKEN: u64 = 4;

impl SmgCacheAware {
    /// SMG's CLI defaults (what `smg --policy cache_aware` runs with).
    /// Deterministic: SMG's HTTP path draws no random number once its tree
    /// exists, so `seed` is unused.
    #[must_use]
    pub fn new(workers: usize, _seed: u64) -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            balance_token_usage_threshold: 1.0,
            overload_token_usage_threshold: 1.0,
            eviction_interval_us: 120_000_000,
            max_tree_tokens: SMG_MAX_TREE_CHARS / CHARS_PER_TOKEN,
            trees: (0..workers).map(|_| KeyMap::default()).collect(),
            processed: vec![0; workers],
            epoch: 0,
            next_eviction_us: None,
            evictions: 0,
            heap: BinaryHeap::new(),
        }
    }

    /// `cache_threshold`: match rate above which the deepest match wins.
    #[must_use]
    pub fn with_cache_threshold(mut self, threshold: f32) -> Self {
        self.cache_threshold = threshold;
        self
    }

    /// `balance_abs_threshold`: in-flight spread (max − min) above which,
    /// together with the relative one, load decides.
    #[must_use]
    pub fn with_balance_abs_threshold(mut self, threshold: u32) -> Self {
        self.balance_abs_threshold = threshold;
        self
    }

    /// `balance_rel_threshold`: max > min × this, together with the absolute
    /// one, means imbalanced.
    #[must_use]
    pub fn with_balance_rel_threshold(mut self, threshold: f32) -> Self {
        self.balance_rel_threshold = threshold;
        self
    }

    /// `balance_token_usage_threshold`: KV-usage spread above which load
    /// decides (≥ 1 disables).
    #[must_use]
    pub fn with_balance_token_usage_threshold(mut self, threshold: f64) -> Self {
        self.balance_token_usage_threshold = threshold;
        self
    }

    /// `overload_token_usage_threshold`: KV usage of the hottest worker above
    /// which load decides (≥ 1 disables).
    #[must_use]
    pub fn with_overload_token_usage_threshold(mut self, threshold: f64) -> Self {
        self.overload_token_usage_threshold = threshold;
        self
    }

    /// `eviction_interval`, in µs; 0 never evicts.
    #[must_use]
    pub fn with_eviction_interval_us(mut self, interval_us: u64) -> Self {
        self.eviction_interval_us = interval_us;
        self
    }

    /// `max_tree_size`, in tokens per worker (SMG counts characters).
    #[must_use]
    pub fn with_max_tree_tokens(mut self, tokens: u64) -> Self {
        self.max_tree_tokens = tokens;
        self
    }

    /// Blocks in `worker`'s approximate tree.
    #[must_use]
    pub fn tree_blocks(&self, worker: usize) -> usize {
        self.trees.get(worker).map_or(0, HashMap::len)
    }

    /// Eviction runs so far.
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn ensure_workers(&mut self, n: usize) {
        if self.trees.len() < n {
            self.trees.resize_with(n, KeyMap::default);
            self.processed.resize(n, 0);
        }
    }

    /// Deepest match of `keys` over the first `n` trees: (blocks, worker).
    /// Among workers at the same depth the most recently stamped one wins.
    pub(crate) fn longest_match(&self, keys: &[BlockKey], n: usize) -> (usize, Option<usize>) {
        let mut best: (usize, Option<usize>, u64) = (0, None, 0);
        for (w, tree) in self.trees.iter().take(n).enumerate() {
            let (depth, stamp) = tree_depth(tree, keys);
            if depth > 0 && (depth > best.0 || (depth == best.0 && stamp > best.2)) {
                best = (depth, Some(w), stamp);
            }
        }
        (best.0, best.1)
    }

    pub(crate) fn insert(&mut self, worker: usize, keys: &[BlockKey]) {
        self.epoch += 1;
        let stamp = self.epoch;
        let Some(tree) = self.trees.get_mut(worker) else {
            return;
        };
        let mut parent: Option<BlockKey> = None;
        for &k in keys {
            let mut created = false;
            tree.entry(k)
                .and_modify(|n| n.stamp = stamp)
                .or_insert_with(|| {
                    created = true;
                    TreeNode {
                        parent,
                        children: 0,
                        stamp,
                    }
                });
            if created {
                if let Some(p) = parent.and_then(|p| tree.get_mut(&p)) {
                    p.children += 1;
                }
            }
            parent = Some(k);
        }
    }

    /// SMG's `evict_tenant_by_size`: each tree above `max_blocks` loses its
    /// least recently used leaves until it fits.
    pub(crate) fn evict(&mut self, max_blocks: usize) {
        self.evictions += 1;
        for tree in &mut self.trees {
            if tree.len() <= max_blocks {
                continue;
            }
            self.heap.clear();
            self.heap.extend(
                tree.iter()
                    .filter(|(_, n)| n.children == 0)
                    .map(|(k, n)| Reverse((n.stamp, k.0))),
            );
            while tree.len() > max_blocks {
                let Some(Reverse((_, key))) = self.heap.pop() else {
                    break;
                };
                let Some(node) = tree.remove(&BlockKey(key)) else {
                    continue;
                };
                if let Some(p) = node.parent {
                    if let Some(pn) = tree.get_mut(&p) {
                        pn.children = pn.children.saturating_sub(1);
                        if pn.children == 0 {
                            self.heap.push(Reverse((pn.stamp, p.0)));
                        }
                    }
                }
            }
        }
    }

    fn maybe_evict(&mut self, block_size: u32, now_us: u64) {
        if self.eviction_interval_us == 0 {
            return;
        }
        match self.next_eviction_us {
            None => self.next_eviction_us = Some(now_us.saturating_add(self.eviction_interval_us)),
            Some(due) if now_us >= due => {
                let max_blocks = self.max_tree_tokens / u64::from(block_size.max(1));
                self.evict(usize::try_from(max_blocks).unwrap_or(usize::MAX));
                self.next_eviction_us = Some(now_us.saturating_add(self.eviction_interval_us));
            }
            Some(_) => {}
        }
    }

    fn is_imbalanced(&self, workers: &[WorkerView]) -> bool {
        let (min_usage, max_usage) = workers
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), w| {
                (lo.min(w.kv_usage), hi.max(w.kv_usage))
            });
        if max_usage > self.overload_token_usage_threshold
            || max_usage - min_usage > self.balance_token_usage_threshold
        {
            return true;
        }
        let (min, max) = workers.iter().fold((u32::MAX, 0), |(lo, hi), w| {
            (lo.min(w.in_flight), hi.max(w.in_flight))
        });
        // SMG compares the relative spread in f32.
        #[allow(clippy::cast_precision_loss)]
        let rel = (max as f32) > (min as f32) * self.balance_rel_threshold;
        max.saturating_sub(min) > self.balance_abs_threshold && rel
    }

    /// Least in flight, then fewest routed so far, then lowest index.
    fn min_load(&self, workers: &[WorkerView]) -> usize {
        workers
            .iter()
            .enumerate()
            .min_by_key(|&(i, w)| (w.in_flight, self.processed[i], i))
            .map_or(0, |(i, _)| i)
    }
}

impl PeerPolicy for SmgCacheAware {
    fn name(&self) -> &'static str {
        "smg-cache-aware"
    }

    fn pick(&mut self, req: &PeerRequest<'_>, workers: &[WorkerView], now_us: u64) -> usize {
        let n = workers.len();
        if n == 0 {
            return 0;
        }
        self.ensure_workers(n);
        self.maybe_evict(req.block_size, now_us);
        let chosen = if self.is_imbalanced(workers) {
            self.min_load(workers)
        } else {
            let (matched, owner) = self.longest_match(req.keys, n);
            let matched_tokens = matched as u64 * u64::from(req.block_size);
            #[allow(clippy::cast_precision_loss)]
            let rate = if req.prompt_tokens == 0 {
                0.0
            } else {
                matched_tokens as f32 / req.prompt_tokens as f32
            };
            match owner {
                Some(w) if rate > self.cache_threshold => w,
                _ => self.min_load(workers),
            }
        };
        self.insert(chosen, req.keys);
        self.processed[chosen] += 1;
        chosen
    }
}
