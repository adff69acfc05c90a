//! The read path: scoring a prompt's keys against every endpoint, by shard-
//! grouped lookups and the prefix walk.

use std::sync::atomic::Ordering;

use kvroute_core::BlockKey;

use super::runs::RunHint;
use super::shard::{entry_hash, Shard};
use super::sliced::SlicedCounters;
use super::universal::TRACKED_BANKS;
use super::{Bank, SharedIndex, BANK_WIDTH, DIRECT_LOOKUPS, SCORE_CHUNK, SORT_BUCKETS};
use crate::view::{InventoryView, Overlap};

impl SharedIndex {
    /// Looks up the tier masks of `chunk` in `bank`, taking each shard's read lock
    /// once: keys are bucketed by shard (a counting sort on the stack) and visited
    /// shard by shard; `masks[i]` receives key `i`'s masks, and `hints[i]`
    /// (if given) its run's jump data (`len` 0: none).
    fn lookup_chunk(
        &self,
        bank: &Bank,
        chunk: &[BlockKey],
        masks: &mut [[u64; 4]; SCORE_CHUNK],
        mut hints: Option<&mut [RunHint; SCORE_CHUNK]>,
    ) {
        let mut shard_of = [0u16; SCORE_CHUNK];
        let mut hashes = [0u64; SCORE_CHUNK];
        let mut starts = [0u16; SORT_BUCKETS + 1];
        for ((slot, h), key) in shard_of.iter_mut().zip(&mut hashes).zip(chunk) {
            *h = entry_hash(key.0);
            // Above SORT_BUCKETS shards, several shards share a bucket; the walk
            // below then re-locks when the shard changes, which stays correct.
            *slot = (self.shard_of_hash(*h) % (1 << 16)) as u16;
            if let Some(c) = starts.get_mut(usize::from(*slot) % SORT_BUCKETS + 1) {
                *c += 1;
            }
        }
        for b in 1..starts.len() {
            let prev = starts.get(b - 1).copied().unwrap_or(0);
            if let Some(c) = starts.get_mut(b) {
                *c += prev;
            }
        }
        let mut order = [0u16; SCORE_CHUNK];
        for (i, s) in shard_of.iter().enumerate().take(chunk.len()) {
            if let Some(next) = starts.get_mut(usize::from(*s) % SORT_BUCKETS) {
                if let Some(o) = order.get_mut(usize::from(*next)) {
                    *o = i as u16;
                }
                *next += 1;
            }
        }
        let mut held: Option<(u16, parking_lot::RwLockReadGuard<'_, Shard>)> = None;
        for &i in order.iter().take(chunk.len()) {
            let i = usize::from(i);
            let (Some(key), Some(h), Some(s), Some(dst)) = (
                chunk.get(i),
                hashes.get(i),
                shard_of.get(i),
                masks.get_mut(i),
            ) else {
                continue;
            };
            let guard = match &mut held {
                Some((cur, guard)) if *cur == *s => guard,
                _ => {
                    drop(held.take());
                    let lock = &bank.shards[usize::from(*s) & (bank.shards.len() - 1)].0;
                    &mut held.insert((*s, lock.read())).1
                }
            };
            match hints.as_deref_mut().and_then(|h| h.get_mut(i)) {
                Some(hint) => {
                    let (m, run) = guard.masks_and_run(*h, key.0);
                    *dst = m;
                    // Read under the shard lock: the entry naming the run
                    // keeps its slot from being reused meanwhile.
                    *hint = run
                        .and_then(|(r, owner)| bank.runs.hint(r, owner))
                        .unwrap_or_default();
                }
                None => *dst = guard.masks(*h, key.0),
            }
        }
    }

    /// One key looked up alone: its masks and run jump data.
    #[inline]
    fn lookup_one(&self, bank: &Bank, key: u64) -> ([u64; 4], RunHint) {
        let hash = entry_hash(key);
        let guard = bank.shards[self.shard_of_hash(hash) & (bank.shards.len() - 1)]
            .0
            .read();
        let (masks, run) = guard.masks_and_run(hash, key);
        let hint = run
            .and_then(|(r, owner)| bank.runs.hint(r, owner))
            .unwrap_or_default();
        (masks, hint)
    }

    /// The prefix-only walk of one bank ([`InventoryView::score_prefix`]).
    ///
    /// Keys are visited in prompt order: [`DIRECT_LOOKUPS`] lookups one key at
    /// a time (a prompt nobody holds costs one), then shard-sorted chunks of
    /// [`SCORE_CHUNK`] keys, so a long match shared by many endpoints takes
    /// each shard lock about once per chunk. Once a single endpoint still
    /// matches and the key names one of its valid runs, the walk jumps to
    /// the run's last member if the prompt holds it further on (see
    /// [`SharedIndex::store_chain`]), then looks the next key up alone. The
    /// walk ends when no endpoint of the bank still matches from block 0.
    ///
    /// The walk starts at key `start`, all of whose predecessors every
    /// endpoint of the bank holds in the GPU tier (see `universal`).
    /// `hidden` is the bank's endpoints being cleared, read before the
    /// table that gave `start`.
    fn score_bank_prefix(
        &self,
        bank: &Bank,
        keys: &[BlockKey],
        out: &mut [Overlap],
        start: usize,
        hidden: u64,
    ) -> bool {
        let n = out.len().min(BANK_WIDTH);
        let out = out.get_mut(..n).unwrap_or_default();
        let mut walk = PrefixWalk::new(bank.active & !hidden, out);
        let mut at = start.min(keys.len());
        let mut failed = u32::MAX;
        let mut lookups = 0;
        while walk.alive != 0 && at < keys.len() && lookups < DIRECT_LOOKUPS {
            lookups += 1;
            match self.direct_step(bank, keys, at, &mut walk, &mut failed) {
                Some(next) => at = next,
                None => break,
            }
        }
        if walk.alive != 0 && at < keys.len() {
            self.prefix_chunks(bank, keys, at, &mut walk, &mut failed);
        }
        walk.finish(keys.len())
    }

    /// Visits key `at` alone; the next position to visit, or `None` once no
    /// endpoint is left.
    #[inline]
    fn direct_step(
        &self,
        bank: &Bank,
        keys: &[BlockKey],
        at: usize,
        walk: &mut PrefixWalk<'_>,
        failed: &mut u32,
    ) -> Option<usize> {
        let key = keys.get(at)?;
        let (masks, hint) = self.lookup_one(bank, key.0);
        if !walk.visit(at, masks) {
            return None;
        }
        Some(jump_target(keys, at, &hint, walk.alive, failed).unwrap_or(at) + 1)
    }

    /// The chunked part of [`Self::score_bank_prefix`], from key `start` on; its
    /// own frame so the short walks never initialise the lookup buffers.
    #[inline(never)]
    fn prefix_chunks(
        &self,
        bank: &Bank,
        keys: &[BlockKey],
        start: usize,
        walk: &mut PrefixWalk<'_>,
        failed: &mut u32,
    ) {
        let mut masks = [[0u64; 4]; SCORE_CHUNK];
        let mut hints = [RunHint::default(); SCORE_CHUNK];
        let mut start = start;
        'walk: while walk.alive != 0 && start < keys.len() {
            let end = start.saturating_add(SCORE_CHUNK).min(keys.len());
            let chunk = keys.get(start..end).unwrap_or_default();
            self.lookup_chunk(bank, chunk, &mut masks, Some(&mut hints));
            let mut j = 0;
            while j < chunk.len() {
                let (Some(m), Some(h)) = (masks.get(j), hints.get(j)) else {
                    break;
                };
                if !walk.visit(start + j, *m) {
                    break 'walk;
                }
                let Some(last) = jump_target(keys, start + j, h, walk.alive, failed) else {
                    j += 1;
                    continue;
                };
                if last + 1 < end {
                    j = last + 1 - start;
                    continue;
                }
                // Past this chunk: the key after a run usually heads the
                // next one, so look keys up alone while jumps keep coming.
                let mut next = last + 1;
                while walk.alive != 0 && next < keys.len() {
                    let before = next;
                    match self.direct_step(bank, keys, next, walk, failed) {
                        Some(after) => next = after,
                        None => break 'walk,
                    }
                    if next == before + 1 {
                        break;
                    }
                }
                start = next;
                continue 'walk;
            }
            start = end;
        }
    }

    fn score_bank(&self, bank: &Bank, keys: &[BlockKey], out: &mut [Overlap]) {
        let active = bank.active & !bank.hidden.load(Ordering::Acquire);
        let mut blocks = SlicedCounters::ZERO;
        let mut by_tier = [SlicedCounters::ZERO; 4];
        let mut alive = active;
        if active != 0 {
            let mut masks = [[0u64; 4]; SCORE_CHUNK];
            for chunk in keys.chunks(SCORE_CHUNK) {
                self.lookup_chunk(bank, chunk, &mut masks, None);
                for &[gpu, cpu, disk, ext] in masks.iter().take(chunk.len()) {
                    let any = (gpu | cpu | disk | ext) & active;
                    blocks.add(any);
                    alive &= any;
                    if alive != 0 {
                        // Each prefix block counts once, in the fastest tier holding it.
                        by_tier[0].add(gpu & alive);
                        by_tier[1].add(cpu & alive & !gpu);
                        by_tier[2].add(disk & alive & !(gpu | cpu));
                        by_tier[3].add(ext & alive & !(gpu | cpu | disk));
                    }
                }
            }
        }
        let mut block_counts = [0u32; BANK_WIDTH];
        blocks.spread(&mut block_counts);
        let mut tier_counts = [[0u32; BANK_WIDTH]; 4];
        for (counter, dst) in by_tier.iter().zip(&mut tier_counts) {
            counter.spread(dst);
        }
        for (bit, slot) in out.iter_mut().enumerate().take(BANK_WIDTH) {
            let mut overlap = Overlap {
                blocks: block_counts.get(bit).copied().unwrap_or(0),
                ..Overlap::default()
            };
            for (dst, src) in overlap.prefix_by_medium.iter_mut().zip(&tier_counts) {
                *dst = src.get(bit).copied().unwrap_or(0);
            }
            overlap.prefix = overlap.prefix_by_medium.iter().sum();
            *slot = overlap;
        }
    }
}

/// State of one bank's prefix walk; writes each endpoint's overlap into `out`
/// the moment its run ends (its figures are final then), so nothing
/// per endpoint is kept or initialised beyond the output itself.
struct PrefixWalk<'o> {
    /// Endpoints holding every key visited so far.
    alive: u64,
    /// Endpoints whose slot has been written.
    written: u64,
    /// Every slot holds one value: nothing written yet, or one whole-bank
    /// fill and nothing since.
    uniform: bool,
    /// Prefix blocks whose fastest tier is CPU, disk, external; created on
    /// the first such block (most inventories are GPU-only).
    slow: Option<[SlicedCounters; 3]>,
    out: &'o mut [Overlap],
}

impl<'o> PrefixWalk<'o> {
    fn new(alive: u64, out: &'o mut [Overlap]) -> Self {
        Self {
            alive,
            written: 0,
            uniform: true,
            slow: None,
            out,
        }
    }

    /// Writes the overlaps of the endpoints in `mask`, whose runs are `at` long.
    fn end(&mut self, mask: u64, at: usize) {
        let p = u32::try_from(at).unwrap_or(u32::MAX);
        self.written |= mask;
        // Still one value throughout only if this is a whole-bank fill
        // (below), which can only be the first write: every endpoint is
        // still in the run then.
        self.uniform = false;
        if self.slow.is_none() {
            // GPU-only: one value for every endpoint of the mask; a whole
            // bank ending at once (a miss) is a plain fill.
            let value = Overlap {
                blocks: p,
                prefix: p,
                prefix_by_medium: [p, 0, 0, 0],
            };
            let n = self.out.len();
            let all = if n >= BANK_WIDTH {
                u64::MAX
            } else {
                (1u64 << n) - 1
            };
            if mask & all == all {
                self.uniform = true;
                if p == 0 {
                    // A miss everywhere: a constant fill (a memset) instead
                    // of six stores per endpoint.
                    self.out.fill(Overlap::default());
                } else {
                    self.out.fill(value);
                }
                return;
            }
            let mut rest = mask;
            while rest != 0 {
                if let Some(slot) = self.out.get_mut(rest.trailing_zeros() as usize) {
                    *slot = value;
                }
                rest &= rest - 1;
            }
            return;
        }
        let mut rest = mask;
        while rest != 0 {
            let bit = rest.trailing_zeros();
            rest &= rest - 1;
            let Some(slot) = self.out.get_mut(bit as usize) else {
                continue;
            };
            let [cpu, disk, ext] = match &self.slow {
                Some(slow) => slow.each_ref().map(|c| c.get(bit)),
                None => [0; 3],
            };
            *slot = Overlap {
                blocks: p,
                prefix: p,
                // Each prefix block sits in exactly one "fastest tier": the
                // GPU share is what the slower tiers do not account for.
                prefix_by_medium: [p.saturating_sub(cpu + disk + ext), cpu, disk, ext],
            };
        }
    }

    /// Takes key `at`'s tier masks; false once no endpoint is left.
    #[inline]
    fn visit(&mut self, at: usize, [gpu, cpu, disk, ext]: [u64; 4]) -> bool {
        let alive = self.alive;
        let held = (gpu | cpu | disk | ext) & alive;
        if held != alive {
            self.end(alive & !held, at);
            self.alive = held;
            if held == 0 {
                return false;
            }
        }
        if (cpu | disk | ext) & held != 0 {
            let [c, d, x] = self.slow.get_or_insert([SlicedCounters::ZERO; 3]);
            c.add(cpu & held & !gpu);
            d.add(disk & held & !(gpu | cpu));
            x.add(ext & held & !(gpu | cpu | disk));
        }
        true
    }

    /// Ends the walk of a prompt of `len` keys: the endpoints still matching
    /// hold all of it; those never matching get the empty overlap. Returns
    /// whether every slot of the bank got one value.
    fn finish(mut self, len: usize) -> bool {
        if self.alive != 0 {
            self.end(self.alive, len);
        }
        let written = self.written;
        let n = self.out.len();
        let all = if n >= BANK_WIDTH {
            u64::MAX
        } else {
            (1u64 << n) - 1
        };
        if written & all == all {
            return self.uniform;
        }
        for (bit, slot) in self.out.iter_mut().enumerate() {
            if written & (1u64 << bit) == 0 {
                *slot = Overlap::default();
            }
        }
        // Endpoints being cleared were left out of the walk: not judged
        // alike with the others.
        false
    }
}

/// The last position the walk may credit after visiting key `at`: the
/// position of the run's last member if only the run's owner still matches
/// and the prompt holds that key within the run's length (equal chained
/// keys have equal histories, so every key between is a member). `None`
/// (and `failed` set, so later members do not rescan) when the prompt leaves
/// the run first.
#[inline]
fn jump_target(
    keys: &[BlockKey],
    at: usize,
    hint: &RunHint,
    alive: u64,
    failed: &mut u32,
) -> Option<usize> {
    if hint.len < 2 || alive != 1u64 << (hint.owner & 63) || hint.run == *failed {
        return None;
    }
    let window = keys.get(at + 1..)?;
    let window = window.get(..window.len().min(hint.len as usize - 1))?;
    match window.iter().position(|k| k.0 == hint.end) {
        Some(p) => Some(at + 1 + p),
        None => {
            *failed = hint.run;
            None
        }
    }
}

impl InventoryView for SharedIndex {
    fn endpoint_count(&self) -> usize {
        self.endpoints.len()
    }

    fn gpu_blocks(&self, endpoint: usize) -> Option<u64> {
        let e = kvroute_core::EndpointId(u32::try_from(endpoint).ok()?);
        (endpoint < self.endpoints.len()).then(|| SharedIndex::gpu_blocks(self, e))
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        let n = self.endpoints.len().min(out.len());
        let out = out.get_mut(..n).unwrap_or_default();
        for (bank, chunk) in self.banks.iter().zip(out.chunks_mut(BANK_WIDTH)) {
            self.score_bank(bank, keys, chunk);
        }
    }

    fn score_prefix(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        self.score_prefix_uniform(keys, out, &mut []);
    }

    fn score_prefix_uniform(&self, keys: &[BlockKey], out: &mut [Overlap], uniform: &mut [bool]) {
        uniform.fill(false);
        let n = self.endpoints.len().min(out.len());
        let out = out.get_mut(..n).unwrap_or_default();
        // Where each bank's walk starts: past the leading keys every
        // endpoint of the bank holds. An endpoint being cleared reads as
        // empty: its bank's hidden mask is read before the table, so a
        // clear that ends between the two (its keys purged, the table
        // already read) still leaves it out.
        let mut hidden = [0u64; TRACKED_BANKS];
        for (h, bank) in hidden.iter_mut().zip(self.banks.iter()) {
            *h = bank.hidden.load(Ordering::Acquire);
        }
        let mut starts = [0u32; TRACKED_BANKS];
        self.universal.starts(keys, self.tracked, &mut starts);
        for (b, (bank, chunk)) in self
            .banks
            .iter()
            .zip(out.chunks_mut(BANK_WIDTH))
            .enumerate()
        {
            let (start, hidden) = match (starts.get(b), hidden.get(b)) {
                (Some(s), Some(h)) => (*s as usize, *h),
                _ => (0, bank.hidden.load(Ordering::Acquire)),
            };
            // A bank is one run of `BANK_WIDTH` entries: the runs the
            // caller asks about.
            let one = self.score_bank_prefix(bank, keys, chunk, start, hidden);
            if let Some(u) = uniform.get_mut(b) {
                *u = one;
            }
        }
    }
}
