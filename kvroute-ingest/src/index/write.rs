//! The write path: stores (single keys and chains), removes, eviction under
//! the capacity bound, and clearing an endpoint.

use std::sync::atomic::Ordering;

use kvroute_core::{BlockKey, EndpointId, Medium};
use parking_lot::RwLock;

use super::chain::{ChainWriter, GroupLocks, OpenRun};
use super::prefetch::prefetch_line;
use super::runs::RunTable;
use super::shard::{entry_hash, RemoveEffect, Shard, StoreEffect};
use super::{
    table, Bank, EndpointKeys, IndexError, KeyMap, SharedIndex, Tail, WriteStats, LOCK_GROUP,
    PREFETCH_LINES, PURGE_BATCH, RING_SLACK, UNBOUNDED,
};

impl SharedIndex {
    /// Stores `keys` for endpoint `e` in tier `medium`.
    pub fn store(
        &self,
        e: EndpointId,
        medium: Medium,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut guard = slot.lock();
        let slot: &mut EndpointKeys = &mut guard;
        let mut stats = WriteStats::default();
        for key in keys {
            // Bound first: a guard in the match scrutinee would live through the
            // arms, and eviction takes shard locks.
            let effect = self.shard(bank, key.0).write().store(
                tier,
                key.0,
                entry_hash(key.0),
                bit,
                &bank.runs,
                None,
            );
            match effect {
                StoreEffect::Inserted | StoreEffect::InsertedSole => {
                    stats.inserted += 1;
                    self.account_insert(bank, bit, tier, slot, key.0, &mut stats);
                }
                StoreEffect::Duplicate => stats.duplicate_stores += 1,
            }
        }
        Ok(stats)
    }

    /// Stores `keys`, consecutive blocks of one chain (each key a hash of its
    /// block and of the key before it; `parent` is the key before `keys[0]`,
    /// if known), for endpoint `e` in tier `medium`.
    ///
    /// The inventory changes exactly as with [`Self::store`]. In the GPU tier
    /// the index also records *runs*: consecutive keys that this endpoint
    /// alone holds, up to 32 per run, continued across calls whose `parent`
    /// ends a run (an engine storing one block per event while decoding).
    /// [`InventoryView::score_prefix`](crate::InventoryView::score_prefix) then verifies a whole run with one
    /// lookup when only this endpoint still matches. A run is void as soon
    /// as any member leaves (remove, eviction, clear) or gains a second
    /// holder; the walk then looks its keys up one by one.
    ///
    /// Only pass real chain segments (the blocks of one engine
    /// `BlockStored`, in order): a run's claim rests on equal chained keys
    /// having equal histories, so keys that are not chained would let a
    /// prompt be credited with the keys between two members.
    ///
    /// ```
    /// use kvroute_core::{BlockKey, EndpointId, Medium};
    /// use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
    ///
    /// let index = SharedIndex::new(1, IndexConfig::default());
    /// let chain: Vec<BlockKey> = (1..=40u64).map(|k| BlockKey(k * 0x9e37_79b9)).collect();
    /// index.store_chain(EndpointId(0), Medium::Gpu, None, &chain[..24])?;
    /// index.store_chain(EndpointId(0), Medium::Gpu, Some(chain[23]), &chain[24..])?;
    /// let mut out = [Overlap::default()];
    /// index.score_prefix(&chain, &mut out);
    /// assert_eq!(out[0].prefix, 40);
    /// # Ok::<(), kvroute_ingest::IndexError>(())
    /// ```
    pub fn store_chain(
        &self,
        e: EndpointId,
        medium: Medium,
        parent: Option<BlockKey>,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        if medium != Medium::Gpu {
            return self.store(e, medium, keys);
        }
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut guard = slot.lock();
        let slot: &mut EndpointKeys = &mut guard;
        let mut stats = WriteStats::default();
        let n = u32::try_from(keys.len()).unwrap_or(u32::MAX - 2);
        let mut chain = ChainWriter::default();
        if let Some(p) = parent {
            match slot.find_tail(p.0) {
                Some(Tail { run: Some(run), .. }) => {
                    // The reservation covers every key of the call plus one
                    // held until the run is published.
                    if let Some(len) = bank.runs.try_extend(run, bit, p.0, n + 1) {
                        chain.cur = Some(OpenRun {
                            run,
                            len,
                            end: p.0,
                            left: n + 1,
                        });
                    }
                }
                Some(Tail { run: None, .. }) => chain.pending = Some(p.0),
                None => {}
            }
        }
        // A bounded tier takes the grouped path too when the call cannot
        // reach the bound (every key new): nothing is evicted, so the ring
        // gets the same entries in the same order as key by key. Engines
        // report their own evictions, so a correct stream stays on it.
        let room = slot
            .capacity
            .get(tier)
            .copied()
            .unwrap_or(UNBOUNDED)
            .saturating_sub(slot.live.get(tier).copied().unwrap_or(0));
        let grouped = !slot.bounded(tier) || u64::try_from(keys.len()).is_ok_and(|n| n <= room);
        if grouped {
            self.store_chain_grouped(bank, bit, tier, slot, keys, &mut chain, &mut stats);
            self.maybe_compact(bank, bit, tier, slot);
        }
        let per_key = if grouped { &[] } else { keys };
        for (i, key) in per_key.iter().enumerate() {
            let remaining = n.saturating_sub(u32::try_from(i).unwrap_or(u32::MAX));
            let (effect, head) = {
                let mut g = self.shard(bank, key.0).write();
                let candidate = chain.candidate();
                let effect = g.store(tier, key.0, entry_hash(key.0), bit, &bank.runs, candidate);
                let head = if effect == StoreEffect::InsertedSole && candidate.is_some() {
                    chain.joined(key.0);
                    None
                } else if effect == StoreEffect::InsertedSole {
                    chain.join(&mut g, &bank.runs, key.0, bit, remaining)
                } else {
                    chain.close(&bank.runs);
                    chain.pending = None;
                    None
                };
                (effect, head)
            };
            if let Some(head) = head {
                // The key before this one heads the run; it lives in another
                // shard, locked only after this one is released.
                if self
                    .shard(bank, head)
                    .write()
                    .attach_run(head, bit, chain.run_id())
                {
                    chain.head_attached();
                }
            }
            match effect {
                StoreEffect::Inserted | StoreEffect::InsertedSole => {
                    stats.inserted += 1;
                    self.account_insert(bank, bit, tier, slot, key.0, &mut stats);
                }
                StoreEffect::Duplicate => stats.duplicate_stores += 1,
            }
        }
        let last = keys.last().map(|k| k.0);
        match chain.cur.take() {
            Some(c) => {
                bank.runs.finish(c.run, c.end, c.len, c.left);
                slot.push_tail(c.end, Some(c.run));
            }
            None => {
                if let (Some(p), Some(l)) = (chain.pending, last) {
                    if p == l {
                        slot.push_tail(l, None);
                    }
                }
            }
        }
        Ok(stats)
    }

    /// The grouped part of [`Self::store_chain`] (an unbounded tier, or a
    /// bounded one the call cannot fill): keys in groups of
    /// [`LOCK_GROUP`], each group's shards write-locked together (in
    /// ascending order, so writers cannot deadlock; readers hold one lock at
    /// a time) and released together. Each shard lock is a full fence that
    /// waits for the previous insert's cache misses; with one lock per key
    /// the inserts run one after the other, under a group's locks they
    /// overlap.
    #[allow(clippy::too_many_arguments)]
    fn store_chain_grouped(
        &self,
        bank: &Bank,
        bit: u32,
        tier: usize,
        slot: &mut EndpointKeys,
        keys: &[BlockKey],
        chain: &mut ChainWriter,
        stats: &mut WriteStats,
    ) {
        let n = u32::try_from(keys.len()).unwrap_or(u32::MAX - 2);
        let bounded = slot.bounded(tier);
        let mut done = 0u32;
        for group in keys.chunks(LOCK_GROUP) {
            // One hash per key names its shard, its home bucket and its
            // ring fingerprint.
            let mut hashes = [0u64; LOCK_GROUP];
            for (h, key) in hashes.iter_mut().zip(group) {
                *h = entry_hash(key.0);
            }
            let hashes = hashes.get(..group.len()).unwrap_or_default();
            // The lines' misses start before the locks, whose fences would
            // otherwise wait for them one group at a time.
            self.prefetch_hashes(bank, hashes);
            // A run started at the group's first key is headed by the pending
            // key, whose shard is locked with the group's.
            let pending = chain.pending.map(|p| self.shard_index(p));
            let mut locks = GroupLocks::lock(
                bank,
                hashes.iter().map(|h| self.shard_of_hash(*h)).chain(pending),
            );
            // Every line's address first (arithmetic only), then one plain
            // load each in a tight loop: all of the group's misses are in
            // flight at once, and the inserts find their lines cached.
            let mut lines: [[Option<&u32>; 2]; LOCK_GROUP] = [[None; 2]; LOCK_GROUP];
            for (h, line) in hashes.iter().zip(&mut lines) {
                if let Some(g) = locks.get(self.shard_of_hash(*h)) {
                    *line = g.home_lines(tier, *h);
                }
            }
            let mut touched = 0u32;
            for line in lines.iter().take(group.len()).flatten().flatten() {
                touched ^= **line;
            }
            // Kept: the touches exist for their loads alone.
            std::hint::black_box(touched);
            for (key, h) in group.iter().zip(hashes) {
                let remaining = n.saturating_sub(done);
                done += 1;
                let Some(g) = locks.get_mut(self.shard_of_hash(*h)) else {
                    continue;
                };
                let candidate = chain.candidate();
                let effect = g.store(tier, key.0, *h, bit, &bank.runs, candidate);
                if effect == StoreEffect::InsertedSole && candidate.is_some() {
                    chain.joined(key.0);
                } else if effect == StoreEffect::InsertedSole {
                    if let Some(head) = chain.join(g, &bank.runs, key.0, bit, remaining) {
                        let run = chain.run_id();
                        let attached = locks
                            .get_mut(self.shard_index(head))
                            .is_some_and(|h| h.attach_run(head, bit, run));
                        if attached {
                            chain.head_attached();
                        }
                    }
                } else {
                    chain.close(&bank.runs);
                    chain.pending = None;
                }
                match effect {
                    StoreEffect::Inserted | StoreEffect::InsertedSole => {
                        stats.inserted += 1;
                        if let Some(live) = slot.live.get_mut(tier) {
                            *live += 1;
                        }
                        if bounded {
                            if let Some(ring) = slot.rings.get_mut(tier) {
                                ring.push_back(self.fingerprint_of_hash(*h));
                            }
                        }
                    }
                    StoreEffect::Duplicate => stats.duplicate_stores += 1,
                }
            }
            locks.publish_hints(bank);
        }
    }

    /// Prefetches the GPU-table lines the keys whose [`entry_hash`]es are
    /// `hashes` will be inserted into, from their shards' [`LineHint`](super::prefetch::LineHint)s,
    /// without their locks (see [`prefetch`](super::prefetch)).
    #[inline]
    fn prefetch_hashes(&self, bank: &Bank, hashes: &[u64]) {
        let mask = bank.shards.len() - 1;
        for h in hashes {
            if let Some(shard) = bank.shards.get(self.shard_of_hash(*h) & mask) {
                for addr in table::hinted_lines::<PREFETCH_LINES>(shard.1.get(), *h)
                    .into_iter()
                    .flatten()
                {
                    prefetch_line(addr);
                }
            }
        }
    }

    /// Live count, ring and bound after `key` became present.
    fn account_insert(
        &self,
        bank: &Bank,
        bit: u32,
        tier: usize,
        slot: &mut EndpointKeys,
        key: u64,
        stats: &mut WriteStats,
    ) {
        if let Some(live) = slot.live.get_mut(tier) {
            *live += 1;
        }
        if !slot.bounded(tier) {
            return;
        }
        if let Some(ring) = slot.rings.get_mut(tier) {
            ring.push_back(self.fingerprint(key));
        }
        let cap = slot.capacity.get(tier).copied().unwrap_or(UNBOUNDED);
        if slot.live.get(tier).is_some_and(|l| *l > cap) {
            stats.evicted += self.evict_one(bank, bit, tier, slot);
        }
        // Repeated store/remove churn of present keys grows the ring
        // without removes to trigger a compaction.
        self.maybe_compact(bank, bit, tier, slot);
    }

    pub(super) fn evict_one(
        &self,
        bank: &Bank,
        bit: u32,
        tier: usize,
        slot: &mut EndpointKeys,
    ) -> u64 {
        let Some(ring) = slot.rings.get_mut(tier) else {
            return 0;
        };
        while let Some(fp) = ring.pop_front() {
            let (shard, tag, tag_bits) = self.split_fingerprint(fp);
            let purged = {
                let mut g = bank.shards[shard & (bank.shards.len() - 1)].0.write();
                g.key_by_tag(tier, tag, tag_bits, bit, 0)
                    .is_some_and(|key| g.purge(tier, key, bit, &bank.runs))
            };
            if purged {
                if let Some(live) = slot.live.get_mut(tier) {
                    *live -= 1;
                }
                slot.evictions += 1;
                return 1;
            }
        }
        0
    }

    /// Removes one reference of each of `keys` for endpoint `e` in tier `medium`.
    pub fn remove(
        &self,
        e: EndpointId,
        medium: Medium,
        keys: &[BlockKey],
    ) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let tier = medium.index();
        let mut slot = slot.lock();
        let mut stats = WriteStats::default();
        for key in keys {
            let effect = self
                .shard(bank, key.0)
                .write()
                .remove(tier, key.0, bit, &bank.runs);
            match effect {
                RemoveEffect::Removed => {
                    stats.removed += 1;
                    if let Some(live) = slot.live.get_mut(tier) {
                        *live -= 1;
                    }
                }
                RemoveEffect::Decremented => stats.still_referenced += 1,
                RemoveEffect::Absent => stats.remove_absent += 1,
            }
        }
        self.maybe_compact(bank, bit, tier, &mut slot);
        Ok(stats)
    }

    /// Removes the ring entries of keys no longer present (and repeated entries)
    /// once they outnumber the live keys, so churn cannot grow a ring unboundedly.
    fn maybe_compact(&self, bank: &Bank, bit: u32, tier: usize, slot: &mut EndpointKeys) {
        if !slot.bounded(tier) {
            return;
        }
        let live = slot.live.get(tier).copied().unwrap_or(0);
        let Some(ring) = slot.rings.get_mut(tier) else {
            return;
        };
        if (ring.len() as u64) <= live.saturating_mul(2) + RING_SLACK as u64 {
            return;
        }
        // Per fingerprint: entries kept so far, and this endpoint's keys
        // present with it (usually one or none). The oldest entries of a
        // fingerprint stay, as many as there are such keys.
        let mut seen: KeyMap<(u32, u32)> = KeyMap::default();
        seen.reserve(usize::try_from(live).unwrap_or(0));
        ring.retain(|fp| {
            let (kept, present) = seen.entry(u64::from(fp)).or_insert_with(|| {
                let (shard, tag, tag_bits) = self.split_fingerprint(fp);
                let present = bank.shards[shard & (bank.shards.len() - 1)]
                    .0
                    .read()
                    .count_by_tag(tier, tag, tag_bits, bit);
                (0, present)
            });
            if *kept < *present {
                *kept += 1;
                true
            } else {
                false
            }
        });
    }

    /// Empties endpoint `e` (all tiers). Readers see it empty immediately.
    pub fn clear_endpoint(&self, e: EndpointId) -> Result<WriteStats, IndexError> {
        let (bank, bit, slot) = self.locate(e)?;
        let flag = 1u64 << bit;
        let mut slot = slot.lock();
        bank.hidden.fetch_or(flag, Ordering::AcqRel);
        let mut stats = WriteStats::default();
        let mut batch = Vec::new();
        for tier in 0..4 {
            if slot.live.get(tier).is_some_and(|l| *l == 0) {
                continue;
            }
            let bounded = slot.bounded(tier);
            let ring = slot.rings.get_mut(tier).map(std::mem::take);
            match ring {
                Some(ring) if bounded => {
                    // Grouped by shard so each write lock covers a batch of keys.
                    let mut by_shard: Vec<(usize, u32)> = ring
                        .iter()
                        .map(|fp| (self.split_fingerprint(fp).0, fp))
                        .collect();
                    drop(ring);
                    by_shard.sort_unstable();
                    for group in by_shard.chunk_by(|a, b| a.0 == b.0) {
                        let Some((index, _)) = group.first() else {
                            continue;
                        };
                        let shard = &bank.shards[*index & (bank.shards.len() - 1)].0;
                        for fps in group.chunks(PURGE_BATCH) {
                            let mut guard = shard.write();
                            for (_, fp) in fps {
                                let (_, tag, tag_bits) = self.split_fingerprint(*fp);
                                if let Some(key) = guard.key_by_tag(tier, tag, tag_bits, bit, 0) {
                                    stats.cleared +=
                                        u64::from(guard.purge(tier, key, bit, &bank.runs));
                                }
                            }
                        }
                    }
                }
                _ => {
                    for shard in bank.shards.iter() {
                        stats.cleared += purge_scanned(&shard.0, tier, bit, &mut batch, &bank.runs);
                    }
                }
            }
            if let Some(live) = slot.live.get_mut(tier) {
                *live = 0;
            }
        }
        bank.hidden.fetch_and(!flag, Ordering::AcqRel);
        Ok(stats)
    }
}

/// Purges endpoint `bit`'s keys of `tier` from one shard: the keys are collected
/// under the read lock (readers keep going), then dropped [`PURGE_BATCH`] at a
/// time under the write lock, so a reader waits for at most one batch.
fn purge_scanned(
    shard: &RwLock<Shard>,
    tier: usize,
    bit: u32,
    batch: &mut Vec<u64>,
    runs: &RunTable,
) -> u64 {
    batch.clear();
    shard.read().collect_keys(tier, bit, batch);
    let mut purged = 0;
    for keys in batch.chunks(PURGE_BATCH) {
        let mut guard = shard.write();
        for key in keys {
            purged += u64::from(guard.purge(tier, *key, bit, runs));
        }
    }
    purged
}
