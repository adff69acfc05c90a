//! Chain stores: the write guards of one lock group and the run a chain
//! store extends.

use parking_lot::RwLockWriteGuard;

use super::runs::{RunTable, MAX_RUN};
use super::shard::Shard;
use super::{Bank, LOCK_GROUP};

/// [`GroupLocks::position`] of a shard the group does not hold.
const NOT_LOCKED: u8 = u8::MAX;

/// The write guards of one `store_chain` lock group: its distinct shards,
/// locked in ascending order (the order every writer holding several
/// takes them in), released together when dropped.
pub(super) struct GroupLocks<'a> {
    /// The distinct shards, ascending.
    pub(super) shards: [usize; LOCK_GROUP + 1],
    pub(super) count: usize,
    /// For a bank of at most 64 shards, each shard's guard position
    /// ([`NOT_LOCKED`]: none), so finding a key's guard is one load, not a
    /// search.
    position: Option<[u8; 64]>,
    guards: [Option<RwLockWriteGuard<'a, Shard>>; LOCK_GROUP + 1],
}

impl<'a> GroupLocks<'a> {
    /// Write-locks the distinct shards among `shards` (at most
    /// `LOCK_GROUP + 1`; more are ignored).
    pub(super) fn lock(bank: &'a Bank, shards: impl Iterator<Item = usize>) -> Self {
        let mut out = Self {
            shards: [0; LOCK_GROUP + 1],
            count: 0,
            position: None,
            guards: std::array::from_fn(|_| None),
        };
        let mask = bank.shards.len() - 1;
        if bank.shards.len() <= 64 {
            // Ascending and distinct from a bit set: no sort.
            let mut set = 0u64;
            for s in shards.take(LOCK_GROUP + 1) {
                set |= 1u64 << (s & mask & 63);
            }
            let mut position = [NOT_LOCKED; 64];
            let mut rest = set;
            while rest != 0 {
                let s = rest.trailing_zeros() as usize;
                if let (Some(dst), Some(p)) = (out.shards.get_mut(out.count), position.get_mut(s)) {
                    *dst = s;
                    *p = out.count as u8;
                }
                rest &= rest - 1;
                out.count += 1;
            }
            out.position = Some(position);
        } else {
            for s in shards.take(LOCK_GROUP + 1) {
                if let Some(dst) = out.shards.get_mut(out.count) {
                    *dst = s & mask;
                    out.count += 1;
                }
            }
            let all = out.shards.get_mut(..out.count).unwrap_or_default();
            all.sort_unstable();
            let mut unique = 0;
            for i in 0..all.len() {
                let s = all.get(i).copied();
                if unique == 0 || s != all.get(unique - 1).copied() {
                    if let (Some(dst), Some(s)) = (all.get_mut(unique), s) {
                        *dst = s;
                    }
                    unique += 1;
                }
            }
            out.count = unique;
        }
        let locked = out.shards.get(..out.count).unwrap_or_default();
        for (g, s) in out.guards.iter_mut().zip(locked) {
            *g = bank.shards.get(*s).map(|shard| shard.0.write());
        }
        out
    }

    /// Where `shard`'s guard is, if the group holds it.
    #[inline]
    pub(super) fn position(&self, shard: usize) -> Option<usize> {
        match &self.position {
            Some(position) => position
                .get(shard)
                .filter(|p| **p != NOT_LOCKED)
                .map(|p| usize::from(*p)),
            None => self
                .shards
                .get(..self.count)
                .and_then(|s| s.binary_search(&shard).ok()),
        }
    }

    /// Publishes each held shard's [`LineHint`](super::prefetch::LineHint) (its table may have been
    /// rebuilt under the group's lock).
    pub(super) fn publish_hints(&self, bank: &Bank) {
        let held = self.shards.get(..self.count).unwrap_or_default();
        for (s, g) in held.iter().zip(&self.guards) {
            if let (Some(shard), Some(g)) = (bank.shards.get(*s), g) {
                shard.1.publish(g.line_hint());
            }
        }
    }

    #[inline]
    pub(super) fn get(&self, shard: usize) -> Option<&Shard> {
        self.position(shard)
            .and_then(|i| self.guards.get(i))
            .and_then(Option::as_deref)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, shard: usize) -> Option<&mut Shard> {
        self.position(shard)
            .and_then(|i| self.guards.get_mut(i))
            .and_then(Option::as_deref_mut)
    }
}

/// A run being written by one `store_chain` call.
#[derive(Clone, Copy)]
pub(super) struct OpenRun {
    pub(super) run: u32,
    /// Members attached so far (published ones included).
    pub(super) len: u32,
    /// Last member.
    pub(super) end: u64,
    /// Reserved member references not used yet (at least one until
    /// published, so the slot cannot be freed and reused under the writer).
    pub(super) left: u32,
}

/// Run bookkeeping of one `store_chain` call.
#[derive(Default)]
pub(super) struct ChainWriter {
    pub(super) cur: Option<OpenRun>,
    /// The previous key, stored by this endpoint alone and in no run: it can
    /// head a run if the next key joins it.
    pub(super) pending: Option<u64>,
}

impl ChainWriter {
    /// `key` (whose shard `g` is locked) was just inserted with this endpoint
    /// as its only holder: attach it to the open run, or start one headed by
    /// the pending key (returned: the caller attaches it after releasing `g`).
    pub(super) fn join(
        &mut self,
        g: &mut Shard,
        runs: &RunTable,
        key: u64,
        bit: u32,
        remaining: u32,
    ) -> Option<u64> {
        if let Some(c) = &mut self.cur {
            if c.len < MAX_RUN && c.left > 1 && g.attach_run(key, bit, c.run) {
                c.len += 1;
                c.end = key;
                c.left -= 1;
                return None;
            }
        }
        self.close(runs);
        let Some(head) = self.pending.take() else {
            self.pending = Some(key);
            return None;
        };
        // This key and the rest of the call, the head, one held back.
        let reserve = remaining.saturating_add(2);
        let Some(run) = runs.alloc(bit, reserve) else {
            self.pending = Some(key);
            return None;
        };
        let mut open = OpenRun {
            run,
            len: 0,
            end: key,
            left: reserve,
        };
        if g.attach_run(key, bit, run) {
            open.len = 1;
            open.left -= 1;
        }
        self.cur = Some(open);
        Some(head)
    }

    /// The open run a key new to the table can join as it is inserted.
    pub(super) fn candidate(&self) -> Option<u32> {
        self.cur
            .filter(|c| c.len < MAX_RUN && c.left > 1)
            .map(|c| c.run)
    }

    /// The key inserted with [`Self::candidate`]'s run named.
    pub(super) fn joined(&mut self, key: u64) {
        if let Some(c) = &mut self.cur {
            c.len += 1;
            c.end = key;
            c.left -= 1;
        }
    }

    pub(super) fn run_id(&self) -> u32 {
        self.cur.map_or(u32::MAX, |c| c.run)
    }

    pub(super) fn head_attached(&mut self) {
        if let Some(c) = &mut self.cur {
            c.len += 1;
            c.left = c.left.saturating_sub(1);
        }
    }

    /// Publishes the open run, if any.
    pub(super) fn close(&mut self, runs: &RunTable) {
        if let Some(c) = self.cur.take() {
            runs.finish(c.run, c.end, c.len, c.left);
        }
    }
}
