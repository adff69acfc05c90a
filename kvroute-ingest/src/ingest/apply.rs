//! A batch's events applied to the index: the window's decision carried out,
//! stores (re-keyed and attested when configured), removes, moves and the
//! re-key map's upkeep.

use kvroute_core::{BlockKey, EndpointId, Medium};

use super::{EndpointIngest, FullGroup, Outcome, Rekeying, ScoredGroup};
use crate::attest::ParentLink;
use crate::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{KeyMap, SharedIndex, WriteStats};
use crate::seq::{DropReason, SeqAction};

impl EndpointIngest {
    /// Runs `batch` through its stream's window and applies it to `index`.
    pub fn apply_batch(&mut self, batch: &EventBatch, index: &SharedIndex) -> Outcome {
        self.apply_batch_on(batch.dp_rank, batch, index)
    }

    /// [`Self::apply_batch`] on the window of stream `dp_rank`, whatever rank the
    /// payload names (a subscriber per DP rank knows its rank from its socket;
    /// older engines leave it out of the payload).
    pub fn apply_batch_on(
        &mut self,
        dp_rank: Option<u32>,
        batch: &EventBatch,
        index: &SharedIndex,
    ) -> Outcome {
        self.counters.batches += 1;
        if self.is_retired() {
            return Outcome {
                action: SeqAction::Drop(DropReason::Retired),
                writes: WriteStats::default(),
                events_applied: 0,
                cleared: false,
            };
        }
        let Some(pos) = self.stream_pos(dp_rank) else {
            self.counters.stream_limit_drops += 1;
            return Outcome {
                action: SeqAction::Drop(DropReason::StreamLimit),
                writes: WriteStats::default(),
                events_applied: 0,
                cleared: false,
            };
        };
        let action = match self.streams.get_mut(pos) {
            Some(s) => s
                .window
                .on_batch_with_digest(batch.seq, batch.fingerprint()),
            None => SeqAction::Drop(DropReason::StreamLimit),
        };
        let clears = self.counters.clears;
        let mut writes = WriteStats::default();
        if action.clears() {
            writes += self.clear_for_stream(index, pos);
        }
        let mut events_applied = 0;
        if action.applies() {
            // Sized by the largest batch seen, not kept at it.
            if self.batch_keys.capacity() > 1 << 14 {
                self.batch_keys = hashbrown::HashSet::new();
            }
            self.batch_keys.clear();
            for event in &batch.events {
                if let Some(w) = self.apply_event(event, index, pos) {
                    writes += w;
                    events_applied += 1;
                }
            }
            if !batch.events.is_empty() {
                if let Some(s) = self.streams.get_mut(pos) {
                    s.written = true;
                }
            }
        }
        self.counters.writes += writes;
        if writes.evicted > 0 {
            self.after_evictions(writes.evicted, index);
        }
        self.check_completeness();
        Outcome {
            action,
            writes,
            events_applied,
            cleared: self.counters.clears > clears,
        }
    }

    /// Whether an event of `group` is applied; `full`: what a store says of
    /// its group's attention (`None` for removes and engines that do not say).
    fn in_scored_group(&mut self, group: u32, full: Option<bool>) -> bool {
        let keep = match self.config.scored_group {
            ScoredGroup::All => true,
            ScoredGroup::Group(g) => g == group,
            // The first full-attention group named is the one scored
            // (hybrid models may split full attention over several groups,
            // each holding the same blocks).
            ScoredGroup::FullAttention => match (full, self.full_group) {
                (Some(true), FullGroup::Unknown | FullGroup::NotYet) => {
                    self.full_group = FullGroup::Group(group);
                    true
                }
                (Some(false), FullGroup::Unknown) => {
                    self.full_group = FullGroup::NotYet;
                    false
                }
                (Some(false), _) | (None, FullGroup::NotYet) => false,
                (_, FullGroup::Group(g)) => g == group,
                (None, FullGroup::Unknown) => group == 0,
            },
        };
        if !keep {
            self.counters.other_group_events += 1;
        }
        keep
    }

    /// False (counted and logged) when `stored` has another block size than the
    /// contract's. A store without token ids says nothing of the blocks'
    /// size: vLLM's offloading connector announces host and disk copies by
    /// their keys alone, with block size 0 (attestation counts them
    /// unverifiable).
    fn block_size_matches(&mut self, stored: &BlockStored) -> bool {
        let Some(expected) = self.config.expected_block_size else {
            return true;
        };
        if stored.block_size == expected || stored.token_ids.is_empty() {
            return true;
        }
        let before = self.counters.block_size_mismatches;
        let after = before + stored.keys.len() as u64;
        self.counters.block_size_mismatches = after;
        tracing::debug!(
            endpoint = %self.name,
            engine_block_size = stored.block_size,
            expected,
            blocks = after,
            "engine block size differs from the contract's"
        );
        self.mismatch_seen();
        false
    }

    fn apply_event(
        &mut self,
        event: &KvEvent,
        index: &SharedIndex,
        stream: usize,
    ) -> Option<WriteStats> {
        let result = match event {
            KvEvent::Stored(s) => {
                if !self.in_scored_group(s.group, s.full_attention) {
                    return None;
                }
                self.counters.stored_events += 1;
                // A block of the wrong size is one mismatch, not also an attestation one.
                if self.block_size_matches(s) {
                    self.attest(s);
                }
                if self.reports_held_blocks(s, index) {
                    self.counters.reported_hits += 1;
                    return Some(WriteStats::default());
                }
                // Only a single-stream endpoint recognises reported hits.
                if self.streams.len() <= 1 {
                    let tier = s.medium.index();
                    self.batch_keys.extend(s.keys.iter().map(|k| (tier, k.0)));
                }
                self.store(s, index)
            }
            KvEvent::Removed(r) => {
                if !self.in_scored_group(r.group, None) {
                    return None;
                }
                self.counters.removed_events += 1;
                self.remove(r, index)
            }
            KvEvent::Moved(m) => {
                if !self.in_scored_group(m.group, None) {
                    return None;
                }
                self.counters.moved_events += 1;
                self.mov(m, index)
            }
            KvEvent::AllCleared => {
                self.counters.all_cleared_events += 1;
                let writes = self.clear_for(index, Some(stream));
                // The engine emptied its cache: nothing of this stream is missing.
                if let Some(s) = self.streams.get_mut(stream) {
                    s.window.mark_complete();
                }
                return Some(writes);
            }
        };
        match result {
            Ok(w) => Some(w),
            Err(err) => {
                tracing::warn!(%err, "event not applied");
                None
            }
        }
    }

    /// Whether `s` names only blocks the endpoint held before this batch,
    /// from the start of a chain: vLLM re-announces the blocks a request
    /// found cached (`emit_cached_block_events`, when the request sets
    /// `kv_cache_report_mode = "full"`) with events shaped like new stores
    /// and no parent, and never removes them twice. A store of a block
    /// already stored in the same batch is another physical copy (two
    /// requests computing it in one step), which vLLM does evict apart: it
    /// counts. So does a store on an endpoint with several streams (DP
    /// ranks): one rank's copy of a block another rank holds is its own,
    /// removed apart.
    fn reports_held_blocks(&self, s: &BlockStored, index: &SharedIndex) -> bool {
        if s.parent.is_some() || s.keys.is_empty() || self.streams.len() > 1 {
            return false;
        }
        let tier = s.medium.index();
        s.keys.iter().all(|k| {
            !self.batch_keys.contains(&(tier, k.0))
                && match &self.rekeying {
                    None => index.contains(self.endpoint, *k, s.medium),
                    Some(r) => r.map.get(&k.0).is_some_and(|(internal, _)| {
                        index.contains(self.endpoint, BlockKey(*internal), s.medium)
                    }),
                }
        })
    }

    fn store(
        &mut self,
        s: &BlockStored,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let Some(r) = &mut self.rekeying else {
            // A stored event's blocks are consecutive in one chain after
            // `parent`; with chained keys that lets the index record runs.
            if !self.config.chained_keys {
                return index.store(self.endpoint, s.medium, &s.keys);
            }
            return index.store_chain(self.endpoint, s.medium, s.parent, &s.keys);
        };
        let parent = match s.parent {
            None => None,
            Some(p) => match r.map.get(&p.0) {
                Some((internal, _)) => Some(BlockKey(*internal)),
                None => {
                    self.counters.rekey_orphan_blocks += s.keys.len() as u64;
                    return Ok(WriteStats::default());
                }
            },
        };
        let bs = s.block_size as usize;
        let full = s
            .token_ids
            .len()
            .checked_div(bs)
            .map_or(0, |blocks| s.keys.len().min(blocks));
        let mut reset = WriteStats::default();
        if r.map.len().saturating_add(full) > r.limit {
            let held: u64 = Medium::ALL
                .iter()
                .map(|m| index.capacity(self.endpoint, *m).unwrap_or(0))
                .sum();
            let held = usize::try_from(held).unwrap_or(usize::MAX);
            r.limit = self.config.max_rekey_entries.max(held.saturating_add(1024));
        }
        if r.map.len().saturating_add(full) > r.limit {
            // Only evictions leave stale entries behind (removes drop theirs):
            // without one since the last compaction, another would free nothing.
            if r.evicted_since_compact > 0 {
                compact_rekey_map(r, self.endpoint, index);
            }
            if r.map.len().saturating_add(full) > r.limit {
                // More engine keys than the inventory can hold keys: only many
                // engine keys per internal key get here (a hostile or broken
                // publisher). Start the endpoint over rather than freeze it.
                self.counters.rekey_map_full += 1;
                r.map = KeyMap::default();
                r.evicted_since_compact = 0;
                tracing::warn!(
                    endpoint = %self.name,
                    limit = r.limit,
                    "re-key map full of live entries: endpoint inventory reset"
                );
                self.counters.clears += 1;
                for s in &mut self.streams {
                    s.window.mark_lost();
                    s.written = false;
                }
                reset = index.clear_endpoint(self.endpoint)?;
            }
        }
        self.scratch.clear();
        let tokens = s.token_ids.get(..full * bs).unwrap_or_default();
        r.rekeyer
            .rekey(parent, tokens, s.block_size, &mut self.scratch);
        let tier = s.medium.index();
        for (engine, internal) in s.keys.iter().zip(&self.scratch) {
            let entry = r.map.entry(engine.0).or_insert((internal.0, [0; 4]));
            if entry.0 != internal.0 {
                self.counters.rekey_conflicts += 1;
                entry.0 = internal.0;
            }
            add_copy(&mut entry.1, tier);
        }
        let n = full.min(self.scratch.len());
        let mut writes = index.store_chain(
            self.endpoint,
            s.medium,
            parent,
            self.scratch.get(..n).unwrap_or_default(),
        )?;
        // Blocks without token ids whose engine key is mapped already: a copy
        // of a block re-keyed before (the offloading connector's host and
        // disk placeholders), stored under the same internal key.
        self.scratch.clear();
        for engine in s.keys.get(full..).unwrap_or_default() {
            if let Some((internal, counts)) = r.map.get_mut(&engine.0) {
                add_copy(counts, tier);
                self.scratch.push(BlockKey(*internal));
            }
        }
        self.counters.rekey_untokenized_blocks +=
            (s.keys.len() - full).saturating_sub(self.scratch.len()) as u64;
        if !self.scratch.is_empty() {
            writes += index.store(self.endpoint, s.medium, &self.scratch)?;
        }
        writes += reset;
        Ok(writes)
    }

    fn remove(
        &mut self,
        rm: &BlockRemoved,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let Some(r) = &mut self.rekeying else {
            return index.remove(self.endpoint, rm.medium, &rm.keys);
        };
        self.scratch.clear();
        let tier = rm.medium.index();
        for engine in &rm.keys {
            // Nothing of this key was stored in this tier: another tier's
            // copy stays mapped.
            let Some(entry) = r
                .map
                .get_mut(&engine.0)
                .filter(|e| e.1.get(tier).is_some_and(|c| *c > 0))
            else {
                self.counters.remove_unmapped += 1;
                continue;
            };
            self.scratch.push(BlockKey(entry.0));
            take_copy(&mut entry.1, tier);
            if entry.1 == [0; 4] {
                r.map.remove(&engine.0);
            }
        }
        index.remove(self.endpoint, rm.medium, &self.scratch)
    }

    fn mov(
        &mut self,
        m: &BlockMoved,
        index: &SharedIndex,
    ) -> Result<WriteStats, crate::IndexError> {
        let key = match &mut self.rekeying {
            None => m.key,
            // The move takes one of the key's stores from one tier to the
            // other (none to take when the source tier never counted it: the
            // engine's word for where it went still holds).
            Some(r) => match r.map.get_mut(&m.key.0) {
                Some((internal, counts)) => {
                    take_copy(counts, m.from.index());
                    add_copy(counts, m.to.index());
                    BlockKey(*internal)
                }
                None => {
                    self.counters.remove_unmapped += 1;
                    return Ok(WriteStats::default());
                }
            },
        };
        let mut w = index.remove(self.endpoint, m.from, &[key])?;
        w += index.store(self.endpoint, m.to, &[key])?;
        Ok(w)
    }

    /// Capacity evictions leave re-key map entries behind; once they could make up
    /// half of the map, drop the entries whose internal key is gone.
    fn after_evictions(&mut self, evicted: u64, index: &SharedIndex) {
        let Some(r) = &mut self.rekeying else {
            return;
        };
        r.evicted_since_compact += evicted;
        if r.evicted_since_compact.saturating_mul(2) < r.map.len() as u64 {
            return;
        }
        compact_rekey_map(r, self.endpoint, index);
    }

    fn attest(&mut self, s: &BlockStored) {
        let Some(a) = &mut self.attesting else {
            return;
        };
        a.keys.clear();
        a.digests.clear();
        let parent = match s.parent {
            None => ParentLink::Root,
            Some(p) => a
                .links
                .get(&p.0)
                .map_or(ParentLink::KeyOnly(p), ParentLink::Digest),
        };
        let result = a.attestor.recompute(parent, s, &mut a.keys, &mut a.digests);
        if let Err(err) = result {
            a.counters.unverifiable_events += 1;
            tracing::debug!(endpoint = %self.name, %err, "stored event not attestable");
            return;
        }
        if a.keys.is_empty() {
            a.counters.unverifiable_events += 1;
            return;
        }
        let before = a.counters.mismatched_blocks;
        if s.parent.is_none() && a.keys.first() != s.keys.first() {
            a.counters.mismatched_root_blocks += 1;
        }
        for (i, (mine, theirs)) in a.keys.iter().zip(&s.keys).enumerate() {
            if mine == theirs {
                a.counters.verified_blocks += 1;
                if let Some(d) = a.digests.get(i) {
                    if a.links.len() >= self.config.attest_links {
                        a.links.clear();
                    }
                    a.links.insert(theirs.0, *d);
                }
            } else {
                a.counters.mismatched_blocks += 1;
            }
        }
        let after = a.counters.mismatched_blocks;
        if after > before {
            self.mismatch_seen();
        }
    }

    /// Names a mismatched endpoint once, at WARN, with the most likely cause.
    fn mismatch_seen(&mut self) {
        if std::mem::replace(&mut self.mismatch_warned, true) {
            return;
        }
        let a = self.attest_counters();
        tracing::warn!(
            endpoint = %self.name,
            likely_cause = self.likely_mismatch_cause().unwrap_or("unknown"),
            block_size_mismatches = self.counters.block_size_mismatches,
            expected_block_size = ?self.config.expected_block_size,
            mismatched_blocks = a.mismatched_blocks,
            verified_blocks = a.verified_blocks,
            "hash contract mismatch: this engine's block keys differ from the rule's contract; \
             KV-exact routing misses on this endpoint (counted as contract_mismatch)"
        );
    }
}

/// One more copy of a re-keyed block in `tier` (a re-key map entry's counts).
fn add_copy(counts: &mut [u16; 4], tier: usize) {
    if let Some(c) = counts.get_mut(tier) {
        *c = c.saturating_add(1);
    }
}

/// One copy fewer in `tier`, if any was counted.
fn take_copy(counts: &mut [u16; 4], tier: usize) {
    if let Some(c) = counts.get_mut(tier) {
        *c = c.saturating_sub(1);
    }
}

/// Drops the re-key entries whose internal key is no longer in the index.
fn compact_rekey_map(r: &mut Rekeying, endpoint: EndpointId, index: &SharedIndex) {
    r.map.retain(|_, (internal, _)| {
        Medium::ALL
            .iter()
            .any(|m| index.contains(endpoint, BlockKey(*internal), *m))
    });
    r.evicted_since_compact = 0;
}
