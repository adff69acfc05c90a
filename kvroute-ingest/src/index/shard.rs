//! One lock-protected slice of a bank: per-tier tables from block key to the set
//! of endpoints (of this bank) holding it, plus the rare duplicate-store counts.
//!
//! # Entry layout
//!
//! An entry is 12 bytes: the 64-bit key split in two `u32` halves and a 32-bit
//! *holder code*, five to a 64-byte bucket (`table.rs`).
//! Most keys are held by one or a few endpoints, so the code lists up to
//! [`INLINE_HOLDERS`] endpoint bits inline; a key held by more spills its 64-bit
//! mask into the tier's side vector and the code names the slot. At 10 M
//! (endpoint, key) pairs with no sharing this is what keeps the index near
//! 12.8 bytes per slot instead of 16 (see the crate's memory notes).

use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;

use super::runs::{RunTable, RUN_ID_BITS};
use super::table::BucketTable;
use super::universal::Universal;

// Block keys are already hashes, but tests and some engines use small or
// sequential keys, which `fmix64` spreads over all bits.
pub(crate) use kvroute_core::mix::fmix64 as mix;

/// Maps keyed by engine block keys. hashbrown's default hasher is seeded
/// per process: the keys come from the engines' event streams, so a hostile
/// publisher could otherwise send keys that all land in one bucket chain.
pub(crate) type KeyMap<V> = HashMap<u64, V>;

/// `(block key, endpoint bit << 2 | tier)` → stores beyond the first.
type DupKey = (u64, u32);

/// Holders listed inline in a code; more spill to the side vector.
pub(crate) const INLINE_HOLDERS: u32 = 4;
const SPILLED: u32 = 1 << 31;
const COUNT_SHIFT: u32 = 24;
/// A single-holder code keeps `run id + 1` in the bits of the unused holder
/// slots (see `runs.rs`); other codes never name a run.
const RUN_SHIFT: u32 = 6;
const RUN_BITS_MASK: u32 = ((1 << RUN_ID_BITS) - 1) << RUN_SHIFT;
const SOLE: u32 = 1 << COUNT_SHIFT;

/// The run a code names, if any.
#[inline]
pub(crate) fn run_of(code: u32) -> Option<u32> {
    if code & !(RUN_BITS_MASK | 63) != SOLE {
        return None;
    }
    ((code & RUN_BITS_MASK) >> RUN_SHIFT).checked_sub(1)
}

/// Result of storing one (endpoint, tier, key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreEffect {
    /// The key had no entry in the tier; the endpoint is now its only holder
    /// (so it may join a run).
    InsertedSole,
    /// The key was absent for this endpoint and tier; it is now present.
    Inserted,
    /// Already present: only the reference count went up.
    Duplicate,
}

/// Result of removing one (endpoint, tier, key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RemoveEffect {
    /// The last reference went away; the key is no longer present.
    Removed,
    /// A duplicate store still holds it.
    Decremented,
    /// It was not present (already evicted, cleared, or never seen).
    Absent,
}

/// The index's hash of a block key: where it is stored (shard, home bucket)
/// and its ring fingerprint. `fmix64` alone can be inverted, so a hostile
/// publisher could choose keys that share a shard and a home bucket and
/// make every insert, rebuild and probe of that shard walk all of them; so
/// the key goes through a secret drawn once per process first. Still a
/// bijection (an xor and an odd multiply are), so distinct keys never share
/// a hash.
#[inline]
pub(crate) fn entry_hash(key: u64) -> u64 {
    let (xor, mul) = secret();
    mix((key ^ xor).wrapping_mul(mul))
}

/// [`entry_hash`]'s secret: an xor and an odd multiplier.
#[inline]
fn secret() -> (u64, u64) {
    static SECRET: OnceLock<(u64, u64)> = OnceLock::new();
    *SECRET.get_or_init(|| {
        use std::hash::BuildHasher;
        // std's RandomState is seeded from the operating system.
        let seed = std::collections::hash_map::RandomState::new();
        (
            seed.hash_one(0x6b76_726f_7574_6531_u64),
            seed.hash_one(0x6b76_726f_7574_6532_u64) | 1,
        )
    })
}

/// A key whose [`entry_hash`] is `hash` (tests craft colliding keys).
#[cfg(test)]
pub(crate) fn key_with_hash(hash: u64) -> u64 {
    fn inverse(c: u64) -> u64 {
        // Newton's iteration for the inverse of an odd number mod 2^64.
        let mut y = c;
        for _ in 0..6 {
            y = y.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(y)));
        }
        y
    }
    let mut h = hash;
    h ^= h >> 33;
    h = h.wrapping_mul(inverse(0xc4ce_b9fe_1a85_ec53));
    h ^= h >> 33;
    h = h.wrapping_mul(inverse(0xff51_afd7_ed55_8ccd));
    h ^= h >> 33;
    let (xor, mul) = secret();
    h.wrapping_mul(inverse(mul)) ^ xor
}

/// Duplicate-count maps at most this large are never shrunk (as tables,
/// see `table::KEEP_CAPACITY`).
const SHRINK_ABOVE: usize = super::table::KEEP_CAPACITY;

/// One tier's table: key → holder code, plus the masks of widely held keys.
#[derive(Default)]
struct TierTable {
    entries: BucketTable,
    spill: Vec<u64>,
    free: Vec<u32>,
}

impl TierTable {
    #[inline]
    fn decode(&self, code: u32) -> u64 {
        if code & SPILLED != 0 {
            return self
                .spill
                .get((code & !SPILLED) as usize)
                .copied()
                .unwrap_or(0);
        }
        let mut mask = 0u64;
        for i in 0..(code >> COUNT_SHIFT).min(INLINE_HOLDERS) {
            mask |= 1u64 << ((code >> (6 * i)) & 63);
        }
        mask
    }

    /// The code for `mask` (non-empty), reusing `old`'s spill slot if it had one.
    fn encode(&mut self, mask: u64, old: Option<u32>) -> u32 {
        let old_slot = old.filter(|c| c & SPILLED != 0).map(|c| c & !SPILLED);
        if mask.count_ones() <= INLINE_HOLDERS {
            if let Some(slot) = old_slot {
                self.release(slot);
            }
            let mut code = mask.count_ones() << COUNT_SHIFT;
            let mut rest = mask;
            let mut i = 0;
            while rest != 0 {
                code |= rest.trailing_zeros() << (6 * i);
                rest &= rest - 1;
                i += 1;
            }
            return code;
        }
        if let Some(slot) = old_slot {
            if let Some(m) = self.spill.get_mut(slot as usize) {
                *m = mask;
                return SPILLED | slot;
            }
        }
        let slot = match self.free.pop() {
            Some(slot) => {
                if let Some(m) = self.spill.get_mut(slot as usize) {
                    *m = mask;
                }
                slot
            }
            None => {
                self.spill.push(mask);
                (self.spill.len() - 1) as u32
            }
        };
        SPILLED | slot
    }

    fn release(&mut self, slot: u32) {
        if let Some(m) = self.spill.get_mut(slot as usize) {
            *m = 0;
        }
        self.free.push(slot);
        if self.free.len() == self.spill.len() {
            self.free.clear();
            self.spill.clear();
        }
    }

    /// The holders of `key`, whose [`entry_hash`] is `hash`.
    #[inline]
    fn mask(&self, hash: u64, key: u64) -> u64 {
        if self.entries.is_empty() {
            return 0;
        }
        self.entries
            .get(hash, key)
            .map_or(0, |code| self.decode(code))
    }

    /// Sets `flag` for `key` (whose [`entry_hash`] is `hash`): `None` if it
    /// was already set, else whether the key is new to the table, the run
    /// its old code named (a second holder ends a run's claim on the entry)
    /// and its holders before. A new entry names `join`.
    #[inline]
    fn set(
        &mut self,
        hash: u64,
        key: u64,
        flag: u64,
        join: Option<u32>,
    ) -> Option<(bool, Option<u32>, u64)> {
        // A lone holder is always inline (what `encode` gives).
        let code = || {
            let mut code = SOLE | (flag.trailing_zeros() & 63);
            if let Some(run) = join.filter(|r| *r < (1 << RUN_ID_BITS) - 1) {
                code |= (run + 1) << RUN_SHIFT;
            }
            code
        };
        let Some(at) = self.entries.find_or_insert(hash, key, code, entry_hash) else {
            return Some((true, None, 0));
        };
        let old_code = self.entries.code(at);
        let mask = self.decode(old_code);
        if mask & flag != 0 {
            return None;
        }
        let code = self.encode(mask | flag, Some(old_code));
        self.entries.set_code(at, code);
        Some((false, run_of(old_code), mask))
    }

    /// Names `run` in `key`'s entry if `flag` is its only holder and it names
    /// no run yet.
    fn attach(&mut self, key: u64, flag: u64, run: u32) -> bool {
        let Some(at) = self.entries.find(entry_hash(key), key) else {
            return false;
        };
        let sole = SOLE | flag.trailing_zeros();
        if self.entries.code(at) != sole || run >= (1 << RUN_ID_BITS) - 1 {
            return false;
        }
        self.entries.set_code(at, sole | ((run + 1) << RUN_SHIFT));
        true
    }

    /// Clears `flag` for `key`: `None` if it was not set, else the run the
    /// entry named, which it no longer does, and its holders before.
    fn unset(&mut self, key: u64, flag: u64) -> Option<(Option<u32>, u64)> {
        let hash = entry_hash(key);
        let at = self.entries.find(hash, key)?;
        let code = self.entries.code(at);
        let mask = self.decode(code);
        if mask & flag == 0 {
            return None;
        }
        let rest = mask & !flag;
        if rest == 0 {
            // A table keeps its largest size otherwise: keys that fill one shard,
            // are evicted, then fill the next (chosen by a peer that knows the
            // shard hash) would grow every shard to the endpoint's capacity.
            // Halving when three quarters are free keeps the index within its
            // budget; the hysteresis keeps the rehash cost amortised O(1).
            self.entries.remove(at, entry_hash);
            if code & SPILLED != 0 {
                self.release(code & !SPILLED);
            }
        } else {
            let new = self.encode(rest, Some(code));
            self.entries.set_code(at, new);
        }
        Some((run_of(code), mask))
    }

    fn allocation_bytes(&self) -> usize {
        self.entries.allocation_size()
            + self.spill.capacity() * std::mem::size_of::<u64>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[derive(Default)]
#[repr(C)]
pub(crate) struct Shard {
    /// Bit `t`: tier `t`'s table holds an entry. Lookups test it before
    /// reading a tier's table: most inventories are GPU-only, and this word
    /// (first, next to the shard's lock word) spares a lookup the other
    /// three tables' lines.
    present: u8,
    tiers: [TierTable; 4],
    dups: HashMap<DupKey, u32>,
    /// Where GPU keys every endpoint of the bank holds are recorded, for a
    /// bank the table tracks.
    full: Option<Full>,
}

/// A tracked bank's shard's link to the [`Universal`] table.
pub(crate) struct Full {
    /// The bank's endpoints: a key whose GPU holders are all of them is full.
    pub(crate) mask: u64,
    pub(crate) bank: usize,
    pub(crate) table: Arc<Universal>,
}

impl Shard {
    /// An empty shard; `seed` (its index) offsets its tables' growth
    /// steps from other shards' (see `BucketTable`).
    pub(crate) fn new(seed: u32, full: Option<Full>) -> Self {
        Self {
            tiers: std::array::from_fn(|_| TierTable {
                entries: BucketTable::new(seed),
                ..TierTable::default()
            }),
            dups: HashMap::default(),
            present: 0,
            full,
        }
    }

    /// GPU holders of `key` went from `before` to `after`: tells the
    /// universal table when that makes the key full in the bank or ends it.
    #[inline]
    fn note_holders(&self, tier: usize, key: u64, before: u64, after: u64) {
        let Some(f) = self.full.as_ref().filter(|_| tier == 0) else {
            return;
        };
        match (before == f.mask, after == f.mask) {
            (false, true) => f.table.entered(key, f.bank),
            (true, false) => f.table.left(key, f.bank),
            _ => {}
        }
    }

    /// Updates `present` after a removal from `tier`'s table.
    #[inline]
    fn note_removal(&mut self, tier: usize) {
        if self.tiers.get(tier).is_some_and(|t| t.entries.is_empty()) {
            self.present &= !(1u8 << (tier & 3));
        }
    }
}

#[inline]
fn dup_key(key: u64, bit: u32, tier: usize) -> DupKey {
    (key, (bit << 2) | (tier as u32 & 3))
}

impl Shard {
    /// Holder masks of `key` (whose [`entry_hash`] is `hash`: callers have
    /// it from choosing the shard) in the four tiers.
    #[inline]
    pub(crate) fn masks(&self, hash: u64, key: u64) -> [u64; 4] {
        let mut out = [0u64; 4];
        if self.present & 1 != 0 {
            if let Some((gpu, code)) = self.gpu_code(hash, key) {
                out[0] = gpu.decode(code);
            }
        }
        if self.present & !1 != 0 {
            self.slower_tiers(hash, key, &mut out);
        }
        out
    }

    /// The GPU table and `key`'s code in it, if present.
    #[inline]
    fn gpu_code(&self, hash: u64, key: u64) -> Option<(&TierTable, u32)> {
        let gpu = self.tiers.first()?;
        Some((gpu, gpu.entries.get(hash, key)?))
    }

    /// The CPU, disk and external tiers' masks of `key`: out of line, as
    /// most inventories are GPU-only and the lookup loops stay small.
    #[inline(never)]
    fn slower_tiers(&self, hash: u64, key: u64, out: &mut [u64; 4]) {
        for ((t, slot), table) in out.iter_mut().enumerate().zip(&self.tiers).skip(1) {
            if self.present & (1 << t) != 0 {
                *slot = table.mask(hash, key);
            }
        }
    }

    /// Like [`Self::masks`], plus the run the GPU entry names and its holder
    /// bit, if any.
    #[inline]
    pub(crate) fn masks_and_run(&self, hash: u64, key: u64) -> ([u64; 4], Option<(u32, u32)>) {
        let mut out = [0u64; 4];
        let mut run = None;
        if self.present & 1 != 0 {
            if let Some((gpu, code)) = self.gpu_code(hash, key) {
                out[0] = gpu.decode(code);
                run = run_of(code).map(|r| (r, code & 63));
            }
        }
        if self.present & !1 != 0 {
            self.slower_tiers(hash, key, &mut out);
        }
        (out, run)
    }

    /// The header words of the lines a store into `tier` of the key whose
    /// [`entry_hash`] is `hash` reads first (see
    /// `BucketTable::home_lines`), not read yet.
    ///
    /// A group's inserts are preceded by a read of every key's words: one
    /// plain load each, independent of one another and of any branch, so
    /// their cache misses overlap and the inserts then find their lines
    /// cached instead of each waiting out its own miss.
    #[inline]
    pub(crate) fn home_lines(&self, tier: usize, hash: u64) -> [Option<&u32>; 2] {
        self.tiers
            .get(tier)
            .map_or([None; 2], |t| t.entries.home_lines(hash))
    }

    /// The GPU table's `BucketTable::line_hint`, for the shard's
    /// `prefetch::LineHint`.
    #[inline]
    pub(crate) fn line_hint(&self) -> (usize, usize) {
        self.tiers.first().map_or((0, 0), |t| t.entries.line_hint())
    }

    /// See `TierTable::attach` (GPU tier only).
    pub(crate) fn attach_run(&mut self, key: u64, bit: u32, run: u32) -> bool {
        self.tiers
            .first_mut()
            .is_some_and(|t| t.attach(key, 1u64 << (bit & 63), run))
    }

    /// Stores (endpoint, tier, key); `hash` is the key's [`entry_hash`]. A
    /// key new to the tier's table (so this endpoint is its only holder)
    /// names run `join` in the GPU tier, saving a second probe to attach it.
    #[inline]
    pub(crate) fn store(
        &mut self,
        tier: usize,
        key: u64,
        hash: u64,
        bit: u32,
        runs: &RunTable,
        join: Option<u32>,
    ) -> StoreEffect {
        let flag = 1u64 << (bit & 63);
        let join = join.filter(|_| tier == 0);
        let Some(table) = self.tiers.get_mut(tier) else {
            return StoreEffect::Duplicate;
        };
        if let Some((fresh, lost, before)) = table.set(hash, key, flag, join) {
            if let Some(run) = lost {
                runs.member_lost(run);
            }
            self.note_holders(tier, key, before, before | flag);
            self.present |= 1 << (tier & 3);
            return if fresh {
                StoreEffect::InsertedSole
            } else {
                StoreEffect::Inserted
            };
        }
        let count = self.dups.entry(dup_key(key, bit, tier)).or_insert(0);
        *count = count.saturating_add(1);
        StoreEffect::Duplicate
    }

    pub(crate) fn remove(
        &mut self,
        tier: usize,
        key: u64,
        bit: u32,
        runs: &RunTable,
    ) -> RemoveEffect {
        let flag = 1u64 << (bit & 63);
        let Some(table) = self.tiers.get_mut(tier) else {
            return RemoveEffect::Absent;
        };
        if table.mask(entry_hash(key), key) & flag == 0 {
            return RemoveEffect::Absent;
        }
        if !self.dups.is_empty() {
            let dk = dup_key(key, bit, tier);
            if let Some(count) = self.dups.get_mut(&dk) {
                *count -= 1;
                if *count == 0 {
                    self.dups.remove(&dk);
                    self.shrink_dups();
                }
                return RemoveEffect::Decremented;
            }
        }
        if let Some((lost, before)) = table.unset(key, flag) {
            if let Some(run) = lost {
                runs.member_lost(run);
            }
            self.note_holders(tier, key, before, before & !flag);
        }
        self.note_removal(tier);
        RemoveEffect::Removed
    }

    /// A key endpoint `bit` holds in `tier` whose entry hash has `tag` in
    /// its top `tag_bits` bits (`tag_bits` in 1..=32), if any; `skip` such
    /// keys are passed over first.
    pub(crate) fn key_by_tag(
        &self,
        tier: usize,
        tag: u32,
        tag_bits: u32,
        bit: u32,
        skip: u32,
    ) -> Option<u64> {
        let table = self.tiers.get(tier)?;
        let tag_bits = tag_bits.clamp(1, 32);
        let lo = u64::from(tag) << (64 - tag_bits);
        let hi = lo | (u64::MAX >> tag_bits);
        let flag = 1u64 << (bit & 63);
        let mut left = skip;
        let at = table.entries.find_in_range(lo, hi, |key, code| {
            if entry_hash(key) >> (64 - tag_bits) != u64::from(tag)
                || table.decode(code) & flag == 0
            {
                return false;
            }
            if left == 0 {
                return true;
            }
            left -= 1;
            false
        })?;
        Some(table.entries.key_at(at))
    }

    /// Keys endpoint `bit` holds in `tier` with `tag` (see
    /// [`Self::key_by_tag`]).
    pub(crate) fn count_by_tag(&self, tier: usize, tag: u32, tag_bits: u32, bit: u32) -> u32 {
        let Some(table) = self.tiers.get(tier) else {
            return 0;
        };
        let tag_bits = tag_bits.clamp(1, 32);
        let lo = u64::from(tag) << (64 - tag_bits);
        let hi = lo | (u64::MAX >> tag_bits);
        let flag = 1u64 << (bit & 63);
        let mut n = 0u32;
        table.entries.find_in_range(lo, hi, |key, code| {
            if entry_hash(key) >> (64 - tag_bits) == u64::from(tag)
                && table.decode(code) & flag != 0
            {
                n = n.saturating_add(1);
            }
            false
        });
        n
    }

    /// Drops (endpoint, tier, key) whatever its reference count; true if it was present.
    pub(crate) fn purge(&mut self, tier: usize, key: u64, bit: u32, runs: &RunTable) -> bool {
        let flag = 1u64 << (bit & 63);
        let Some(table) = self.tiers.get_mut(tier) else {
            return false;
        };
        let Some((lost, before)) = table.unset(key, flag) else {
            return false;
        };
        if let Some(run) = lost {
            runs.member_lost(run);
        }
        self.note_holders(tier, key, before, before & !flag);
        self.note_removal(tier);
        if !self.dups.is_empty() && self.dups.remove(&dup_key(key, bit, tier)).is_some() {
            self.shrink_dups();
        }
        true
    }

    /// The duplicate counts shrink like the tables (see `TierTable::unset`).
    fn shrink_dups(&mut self) {
        let capacity = self.dups.capacity();
        if capacity > SHRINK_ABOVE && self.dups.len() < capacity / 4 {
            self.dups.shrink_to(self.dups.len() * 2);
        }
    }

    pub(crate) fn contains(&self, tier: usize, key: u64, bit: u32) -> bool {
        self.tiers
            .get(tier)
            .is_some_and(|t| t.mask(entry_hash(key), key) & (1u64 << (bit & 63)) != 0)
    }

    /// Reference count of (endpoint, tier, key): 0 when absent.
    pub(crate) fn refcount(&self, tier: usize, key: u64, bit: u32) -> u32 {
        if !self.contains(tier, key, bit) {
            return 0;
        }
        let extra = self
            .dups
            .get(&dup_key(key, bit, tier))
            .copied()
            .unwrap_or(0);
        extra.saturating_add(1)
    }

    /// Appends the keys endpoint `bit` holds in `tier` (a scan of the tier's table).
    pub(crate) fn collect_keys(&self, tier: usize, bit: u32, out: &mut Vec<u64>) {
        let flag = 1u64 << (bit & 63);
        if let Some(table) = self.tiers.get(tier) {
            out.extend(
                table
                    .entries
                    .iter()
                    .filter(|(_, code)| table.decode(*code) & flag != 0)
                    .map(|(key, _)| key),
            );
        }
    }

    pub(crate) fn allocation_bytes(&self) -> usize {
        self.tiers
            .iter()
            .map(TierTable::allocation_bytes)
            .sum::<usize>()
            + self.dups.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_lives_only_in_single_holder_codes() {
        let mut table = TierTable::default();
        let runs = RunTable::default();
        let run = runs.alloc(9, 3).unwrap();
        let h = entry_hash(5);
        assert_eq!(table.set(h, 5, 1 << 9, Some(run)), Some((true, None, 0)));
        assert_eq!(table.mask(h, 5), 1 << 9, "run bits are not holders");
        // A second holder takes the run out of the entry, and says so.
        assert_eq!(
            table.set(h, 5, 1 << 2, None),
            Some((false, Some(run), 1 << 9))
        );
        assert_eq!(table.mask(h, 5), (1 << 9) | (1 << 2));
        assert!(!table.attach(5, 1 << 9, run), "two holders: no run");
        assert_eq!(table.unset(5, 1 << 2), Some((None, (1 << 9) | (1 << 2))));
        assert!(table.attach(5, 1 << 9, run));
        assert!(!table.attach(5, 1 << 9, run), "already names one");
        assert_eq!(table.unset(5, 1 << 9), Some((Some(run), 1 << 9)));
        assert_eq!(table.unset(5, 1 << 9), None);
    }

    #[test]
    fn holder_sets_round_trip_inline_and_spilled() {
        let mut table = TierTable::default();
        let mut naive = 0u64;
        // Grow past the inline limit, then shrink back, checking every step.
        let bits = [3u32, 63, 0, 17, 42, 5, 9, 3, 63, 0, 17, 42, 5, 9];
        for (step, bit) in bits.iter().enumerate() {
            let flag = 1u64 << bit;
            if step < 7 {
                assert!(table.set(entry_hash(77), 77, flag, None).is_some());
                naive |= flag;
            } else {
                assert!(table.unset(77, flag).is_some());
                naive &= !flag;
            }
            assert_eq!(table.mask(entry_hash(77), 77), naive, "step {step}");
        }
        assert!(table.entries.is_empty());
        assert!(table.spill.is_empty() && table.free.is_empty());
    }
}
