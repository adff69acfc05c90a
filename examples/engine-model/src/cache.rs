//! A block-level prefix cache with finite capacity and LRU eviction, shaped like
//! vLLM's `BlockPool`.
//!
//! Facts from vLLM's v1 block pool this model keeps:
//! * a block held by a running request (reference count > 0) is never evicted;
//! * a block whose count drops to 0 stays cached and joins the tail of a free
//!   queue; allocation evicts from the head (least recently freed first);
//! * a request frees its blocks tail-first, so its last blocks are evicted first;
//! * a cache hit on a free block takes it out of the free queue;
//! * a block may be evicted while its children stay cached — lookups walk the
//!   chain from the first block, so orphaned children simply stop matching;
//! * every eviction of a cached block is one `BlockRemoved` event; newly computed
//!   blocks are one `BlockStored` per request with the parent of the first one.
//!
//! Simplification: one physical block per key. vLLM can hold two copies of the same
//! hash when two requests computed it in the same scheduler step; here the second
//! request shares the first one's block.

use std::collections::HashMap;

use kvroute_core::mix::BuildKeyHasher;
use kvroute_core::{BlockKey, Medium, TokenId};
use kvroute_ingest::{BlockRemoved, BlockStored, ExtraKey, KvEvent};

const NIL: u32 = u32::MAX;

/// The hasher of block-key maps (the simulator's too): block keys are
/// already uniform hashes, so kvroute's unseeded [`kvroute_core::mix::fmix64`]
/// table hash keeps lookups cheap where SipHash would dominate the profile.
pub use kvroute_core::mix::KeyHasher;

type KeyMap = HashMap<u64, u32, BuildKeyHasher>;

#[derive(Clone, Copy, Debug)]
struct Node {
    key: u64,
    refs: u32,
    prev: u32,
    next: u32,
}

/// Not enough free or evictable blocks for an allocation right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("need {needed} blocks, only {available} free or evictable")]
pub struct OutOfBlocks {
    /// Blocks the allocation needs.
    pub needed: u32,
    /// Blocks that could be made free.
    pub available: u32,
}

/// One request's demand on the cache.
#[derive(Clone, Copy, Debug)]
pub struct AllocRequest<'a> {
    /// Keys of the prompt's full blocks, in chain order.
    pub keys: &'a [BlockKey],
    /// At most this many leading cached blocks count as a hit.
    pub hit_limit: usize,
    /// Key-less blocks (partial prompt block, output) to hold as well.
    pub anonymous: u32,
    /// The prompt's tokens, `block_size` per key (or empty).
    pub tokens: &'a [TokenId],
    /// Tokens per block.
    pub block_size: u32,
    /// The request's `cache_salt`, if any.
    pub cache_salt: Option<&'a str>,
}

impl<'a> AllocRequest<'a> {
    /// Keys only: no hit cap, no extra blocks, no tokens.
    #[must_use]
    pub fn keys(keys: &'a [BlockKey]) -> Self {
        Self {
            keys,
            hit_limit: usize::MAX,
            anonymous: 0,
            tokens: &[],
            block_size: 16,
            cache_salt: None,
        }
    }
}

/// What an allocation found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Allocation {
    /// Leading blocks that were already cached (the prefix hit).
    pub hit_blocks: u32,
    /// Blocks evicted to make room.
    pub evicted: u32,
}

/// The prefix cache of one worker.
///
/// ```
/// # use kvroute_core::{BlockKey, Medium};
/// # use kvroute_engine_model::{AllocRequest, PrefixCache};
/// let mut cache = PrefixCache::new(4, Medium::Gpu);
/// let mut events = Vec::new();
/// let keys = [BlockKey(1), BlockKey(2)];
/// cache.allocate(&AllocRequest::keys(&keys), &mut events).unwrap();
/// cache.release(&keys, 0);
/// assert_eq!(cache.longest_prefix(&keys), 2);
/// ```
#[derive(Clone, Debug)]
pub struct PrefixCache {
    capacity: u32,
    anonymous: u32,
    index: KeyMap,
    nodes: Vec<Node>,
    spare_nodes: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    evictable: u32,
    medium: Medium,
}

impl PrefixCache {
    /// An empty cache holding at most `capacity` blocks.
    #[must_use]
    pub fn new(capacity: u32, medium: Medium) -> Self {
        let prealloc = capacity.min(1 << 20) as usize;
        let mut index = KeyMap::default();
        index.reserve(prealloc);
        Self {
            capacity,
            anonymous: 0,
            index,
            nodes: Vec::with_capacity(prealloc),
            spare_nodes: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            evictable: 0,
            medium,
        }
    }

    /// Capacity in blocks.
    #[must_use]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Blocks holding a key (pinned or evictable).
    #[must_use]
    pub fn cached_blocks(&self) -> u32 {
        self.index.len() as u32
    }

    /// Blocks in use: cached ones plus key-less blocks of running requests.
    #[must_use]
    pub fn used_blocks(&self) -> u32 {
        self.cached_blocks().saturating_add(self.anonymous)
    }

    /// Cached blocks no running request holds.
    #[must_use]
    pub fn evictable_blocks(&self) -> u32 {
        self.evictable
    }

    /// True if `key` is cached.
    #[must_use]
    pub fn contains(&self, key: BlockKey) -> bool {
        self.index.contains_key(&key.0)
    }

    /// Every cached key, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.index.keys().map(|&k| BlockKey(k))
    }

    /// Number of leading `keys` that are cached.
    #[must_use]
    pub fn longest_prefix(&self, keys: &[BlockKey]) -> usize {
        keys.iter()
            .take_while(|k| self.index.contains_key(&k.0))
            .count()
    }

    /// Pins `keys` for a request and allocates `anonymous` key-less blocks.
    ///
    /// The first `hit_limit` cached leading keys count as the prefix hit; every key
    /// after the hit is (re)computed and reported in one `BlockStored` (tokens from
    /// `tokens`, which holds `block_size` tokens per key, or is empty; a
    /// `cache_salt` is reported as block 0's extra key, as vLLM does). Evictions
    /// needed to make room are reported first, one `BlockRemoved` each. On error
    /// nothing changes.
    pub fn allocate(
        &mut self,
        req: &AllocRequest<'_>,
        outbox: &mut Vec<KvEvent>,
    ) -> Result<Allocation, OutOfBlocks> {
        let AllocRequest {
            keys,
            hit_limit,
            anonymous,
            tokens,
            block_size,
            cache_salt,
        } = *req;
        let hit = self.longest_prefix(keys).min(hit_limit);
        let mut new_blocks: u32 = 0;
        let mut pinned_from_free: u32 = 0;
        for key in keys {
            match self
                .index
                .get(&key.0)
                .and_then(|&i| self.nodes.get(i as usize))
            {
                Some(node) if node.refs == 0 => pinned_from_free += 1,
                Some(_) => {}
                None => new_blocks = new_blocks.saturating_add(1),
            }
        }
        let needed = new_blocks.saturating_add(anonymous);
        let free = self.capacity.saturating_sub(self.used_blocks());
        // A key listed twice counts twice in `pinned_from_free`; clamp so the
        // check stays conservative instead of underflowing.
        let available = free.saturating_add(self.evictable.saturating_sub(pinned_from_free));
        if needed > available {
            return Err(OutOfBlocks { needed, available });
        }

        for key in keys {
            if let Some(&i) = self.index.get(&key.0) {
                self.pin(i);
            }
        }
        let mut evicted = 0;
        while self.capacity.saturating_sub(self.used_blocks()) < needed {
            if !self.evict_one(outbox) {
                break;
            }
            evicted += 1;
        }
        for key in keys.iter().skip(hit) {
            if !self.index.contains_key(&key.0) {
                let i = self.new_node(key.0);
                self.index.insert(key.0, i);
            }
        }
        self.anonymous = self.anonymous.saturating_add(anonymous);

        if let Some(stored) = keys.get(hit..).filter(|k| !k.is_empty()) {
            let bs = block_size as usize;
            let span = hit * bs..(hit + stored.len()) * bs;
            let token_ids = tokens
                .get(span)
                .map(<[TokenId]>::to_vec)
                .unwrap_or_default();
            let mut extra_keys = vec![None; stored.len()];
            let salt = cache_salt.filter(|s| hit == 0 && !s.is_empty());
            if let (Some(salt), Some(first)) = (salt, extra_keys.first_mut()) {
                *first = Some(vec![ExtraKey::Text(salt.to_owned())]);
            }
            outbox.push(KvEvent::Stored(BlockStored {
                keys: stored.to_vec(),
                parent: hit.checked_sub(1).and_then(|p| keys.get(p)).copied(),
                token_ids,
                block_size,
                medium: self.medium,
                extra_keys,
                cache_salt: cache_salt.map(str::to_owned),
                ..BlockStored::default()
            }));
        }
        Ok(Allocation {
            hit_blocks: hit as u32,
            evicted,
        })
    }

    /// Unpins a request's `keys` (tail first, as vLLM frees them) and returns its
    /// `anonymous` blocks. Keys that are no longer cached (after a reset) are skipped.
    pub fn release(&mut self, keys: &[BlockKey], anonymous: u32) {
        for key in keys.iter().rev() {
            if let Some(&i) = self.index.get(&key.0) {
                self.unpin(i);
            }
        }
        self.anonymous = self.anonymous.saturating_sub(anonymous);
    }

    /// Drops every block, pinned or not, and reports one `AllCleared`
    /// (an engine restart or `reset_prefix_cache`).
    pub fn clear(&mut self, outbox: &mut Vec<KvEvent>) {
        self.index.clear();
        self.nodes.clear();
        self.spare_nodes.clear();
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.evictable = 0;
        self.anonymous = 0;
        outbox.push(KvEvent::AllCleared);
    }

    fn new_node(&mut self, key: u64) -> u32 {
        let node = Node {
            key,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        if let Some(i) = self.spare_nodes.pop() {
            if let Some(slot) = self.nodes.get_mut(i as usize) {
                *slot = node;
                return i;
            }
        }
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }

    fn pin(&mut self, i: u32) {
        let Some(refs) = self.nodes.get(i as usize).map(|n| n.refs) else {
            return;
        };
        if refs == 0 {
            self.unlink(i);
            self.evictable = self.evictable.saturating_sub(1);
        }
        if let Some(n) = self.nodes.get_mut(i as usize) {
            n.refs = refs.saturating_add(1);
        }
    }

    fn unpin(&mut self, i: u32) {
        let Some(n) = self.nodes.get_mut(i as usize) else {
            return;
        };
        if n.refs == 0 {
            return;
        }
        n.refs -= 1;
        if n.refs == 0 {
            self.push_tail(i);
            self.evictable += 1;
        }
    }

    fn evict_one(&mut self, outbox: &mut Vec<KvEvent>) -> bool {
        let i = self.lru_head;
        let Some(key) = self.nodes.get(i as usize).map(|n| n.key) else {
            return false;
        };
        self.unlink(i);
        self.evictable = self.evictable.saturating_sub(1);
        self.index.remove(&key);
        self.spare_nodes.push(i);
        outbox.push(KvEvent::Removed(BlockRemoved {
            keys: vec![BlockKey(key)],
            medium: self.medium,
            group: 0,
        }));
        true
    }

    fn unlink(&mut self, i: u32) {
        let Some(&Node { prev, next, .. }) = self.nodes.get(i as usize) else {
            return;
        };
        match self.nodes.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => self.lru_head = next,
        }
        match self.nodes.get_mut(next as usize) {
            Some(n) => n.prev = prev,
            None => self.lru_tail = prev,
        }
        if let Some(n) = self.nodes.get_mut(i as usize) {
            n.prev = NIL;
            n.next = NIL;
        }
    }

    fn push_tail(&mut self, i: u32) {
        let tail = self.lru_tail;
        if let Some(n) = self.nodes.get_mut(i as usize) {
            n.prev = tail;
            n.next = NIL;
        }
        match self.nodes.get_mut(tail as usize) {
            Some(t) => t.next = i,
            None => self.lru_head = i,
        }
        self.lru_tail = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[u64]) -> Vec<BlockKey> {
        v.iter().copied().map(BlockKey).collect()
    }

    #[test]
    fn hit_limit_and_stored_event_parent() {
        let mut c = PrefixCache::new(8, Medium::Gpu);
        let mut out = Vec::new();
        let k = keys(&[1, 2, 3]);
        let toks: Vec<TokenId> = (0..48).collect();
        let all = AllocRequest {
            tokens: &toks,
            ..AllocRequest::keys(&k)
        };
        c.allocate(&all, &mut out).unwrap();
        c.release(&k, 0);
        out.clear();
        let a = c
            .allocate(
                &AllocRequest {
                    tokens: &toks,
                    hit_limit: 2,
                    ..AllocRequest::keys(&k)
                },
                &mut out,
            )
            .unwrap();
        assert_eq!(a.hit_blocks, 2);
        let [KvEvent::Stored(s)] = out.as_slice() else {
            panic!("{out:?}")
        };
        assert_eq!(s.keys, keys(&[3]));
        assert_eq!(s.parent, Some(BlockKey(2)));
        assert_eq!(s.token_ids, (32..48).collect::<Vec<_>>());
    }

    #[test]
    fn evicts_least_recently_freed_tail_first() {
        let mut c = PrefixCache::new(4, Medium::Gpu);
        let mut out = Vec::new();
        let a = keys(&[1, 2]);
        let b = keys(&[3, 4]);
        c.allocate(&AllocRequest::keys(&a), &mut out).unwrap();
        c.allocate(&AllocRequest::keys(&b), &mut out).unwrap();
        c.release(&a, 0);
        c.release(&b, 0);
        out.clear();
        c.allocate(&AllocRequest::keys(&keys(&[9])), &mut out)
            .unwrap();
        assert_eq!(
            out.first(),
            Some(&KvEvent::Removed(BlockRemoved {
                keys: keys(&[2]),
                medium: Medium::Gpu,
                group: 0
            }))
        );
        // Block 1 lost its child but is still a valid prefix of length 1.
        assert_eq!(c.longest_prefix(&a), 1);
    }

    #[test]
    fn pinned_blocks_are_not_evicted() {
        let mut c = PrefixCache::new(2, Medium::Gpu);
        let mut out = Vec::new();
        c.allocate(&AllocRequest::keys(&keys(&[1, 2])), &mut out)
            .unwrap();
        let err = c
            .allocate(&AllocRequest::keys(&keys(&[3])), &mut out)
            .unwrap_err();
        assert_eq!(err.needed, 1);
        assert_eq!(err.available, 0);
        assert_eq!(c.cached_blocks(), 2);
    }
}
