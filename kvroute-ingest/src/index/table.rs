//! A key → holder-code table whose every lookup and insert touches one cache
//! line.
//!
//! # Why not `hashbrown`
//!
//! A `hashbrown` table keeps control bytes and entries in two arrays, so a
//! store of a key new to a large table misses twice (control group, then the
//! entry line), and whether the home slot is free is a data-dependent branch
//! that stalls the next insert's loads. Loading 64 engines × 100 K blocks
//! spent most of its time in those misses (`examples/bench-dynamo`, `load`).
//! Here a bucket is one 64-byte line holding five entries and its own
//! length, so a lookup reads one line, and a group of inserts can fetch all
//! its lines first with one plain load each (see [`BucketTable::home_lines`]).
//!
//! # Layout and probing
//!
//! A key's home bucket is its hash scaled to the bucket count (`home`);
//! a bucket's entries are packed at its front. A key that finds its home
//! full goes to the next bucket with room, and every full bucket it passed
//! is marked *overflowed*: a lookup continues past a bucket only when that
//! bucket is marked, so an absent key usually costs its home line alone.
//! Removing an entry moves the bucket's last entry into its place and keeps
//! the marks (a key further on may still need them); marks that no longer
//! lead anywhere are dropped when the table is rebuilt, which also happens
//! when more than half the buckets carry one (see `overflow_limit`) and
//! removals since the last rebuild may have left some stale (see `removed`:
//! without removals every mark leads somewhere, and loading 64 engines ×
//! 100 K blocks spent as many entry moves on such futile rebuilds as on
//! growth).

/// Entries per bucket: 5 × 12 bytes plus the bucket's 4-byte header fill a line.
const SLOTS: usize = 5;
/// Header bit: some key homed at or before this bucket lives after it.
const OVERFLOW: u32 = 1 << 8;
/// Header bits holding the number of entries.
const LEN_MASK: u32 = 0xff;
/// Most entries per bucket on average before the table doubles (7/8 of 5).
const MAX_LOAD_NUM: usize = 35;
const MAX_LOAD_DEN: usize = 8;
/// Buckets of the first allocation.
const MIN_BUCKETS: usize = 2;

/// The bucket count after growing from `n`: half again (a table is 58–88 %
/// full, 14.6–22 bytes per entry, against 44–88 % when doubling).
fn grown(n: usize) -> usize {
    (n + n / 2).max(MIN_BUCKETS)
}

#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Bucket {
    key_lo: [u32; SLOTS],
    key_hi: [u32; SLOTS],
    code: [u32; SLOTS],
    /// Entry count in the low byte, [`OVERFLOW`] above it.
    header: u32,
}

impl Bucket {
    #[inline]
    fn len(&self) -> usize {
        ((self.header & LEN_MASK) as usize).min(SLOTS)
    }

    #[inline]
    fn overflowed(&self) -> bool {
        self.header & OVERFLOW != 0
    }

    /// The slot holding `key`, if any. Every slot is compared and the
    /// result masked by the length, with no branch per slot: a probe's
    /// branches then depend on whether the key is there, not on where.
    #[inline]
    fn slot_of(&self, key: u64) -> Option<usize> {
        let (lo, hi) = (key as u32, (key >> 32) as u32);
        let mut hits = 0u32;
        for (s, (l, h)) in self.key_lo.iter().zip(&self.key_hi).enumerate() {
            hits |= u32::from((*l == lo) & (*h == hi)) << s;
        }
        hits &= (1u32 << self.len()) - 1;
        (hits != 0).then(|| hits.trailing_zeros() as usize)
    }

    #[inline]
    fn key(&self, s: usize) -> u64 {
        let lo = self.key_lo.get(s).copied().unwrap_or(0);
        let hi = self.key_hi.get(s).copied().unwrap_or(0);
        (u64::from(hi) << 32) | u64::from(lo)
    }

    /// Appends an entry; false when the bucket is full.
    #[inline]
    fn push(&mut self, key: u64, code: u32) -> bool {
        let s = self.len();
        let (Some(lo), Some(hi), Some(c)) = (
            self.key_lo.get_mut(s),
            self.key_hi.get_mut(s),
            self.code.get_mut(s),
        ) else {
            return false;
        };
        *lo = key as u32;
        *hi = (key >> 32) as u32;
        *c = code;
        self.header += 1;
        true
    }

    /// Drops slot `s`, moving the last entry into it.
    fn remove(&mut self, s: usize) {
        let last = self.len().saturating_sub(1);
        if s > last {
            return;
        }
        self.key_lo.swap(s, last);
        self.key_hi.swap(s, last);
        self.code.swap(s, last);
        self.header -= 1;
    }
}

/// Where a key was found: bucket and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct At {
    bucket: usize,
    slot: usize,
}

/// Open-addressed table of `(u64 key, u32 code)` in one-line buckets.
#[derive(Default)]
pub(crate) struct BucketTable {
    buckets: Vec<Bucket>,
    len: usize,
    /// Buckets carrying [`OVERFLOW`].
    overflowed: usize,
    /// `overflowed` above which the table is rebuilt at its size: half the
    /// buckets, or a quarter more than a rebuild left (a table near its load
    /// bound may carry many marks that all lead somewhere), so each rebuild
    /// follows a quarter of the bucket count of new marks.
    overflow_limit: usize,
    /// Entries removed since the last rebuild: only a removal can leave a
    /// mark that leads nowhere, so without removals a rebuild at the same
    /// size would recreate every mark it drops.
    removed: usize,
    /// Rebuilds that kept the bucket count (what `removed` rations).
    #[cfg(test)]
    same_size_rebuilds: usize,
}

impl BucketTable {
    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries the table holds before it grows.
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len() * MAX_LOAD_NUM / MAX_LOAD_DEN
    }

    pub(crate) fn allocation_size(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket>()
    }

    /// The bucket of the hash's fraction of the table (its high bits: any
    /// bucket count works, so the table grows by half rather than doubles,
    /// and the mapping keeps hash order, so a rebuild walks the old buckets
    /// and fills the new ones front to back).
    #[inline]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.buckets.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 >= self.buckets.len() {
            0
        } else {
            i + 1
        }
    }

    /// The header words of `hash`'s home line and of the line after it,
    /// not read yet: a group of inserts first finds all its lines
    /// (arithmetic only), then reads them in a tight loop of plain loads
    /// whose values are discarded, so every miss of the group is in flight
    /// at once, then inserts into cached lines. The next line is read too
    /// because near the load bound a home bucket is often full or marked
    /// (an insert of a new key then visits ~2 buckets on average, and
    /// reading the second line only once the first arrived doubled the
    /// wait); the line after that no longer paid for its load (measured,
    /// `examples/bench-dynamo` load).
    #[inline]
    pub(crate) fn home_lines(&self, hash: u64) -> [Option<&u32>; 2] {
        let home = self.home(hash);
        [home, self.next(home)].map(|i| self.buckets.get(i).map(|b| &b.header))
    }

    /// Where `key` (whose hash is `hash`) is, if present.
    #[inline]
    pub(crate) fn find(&self, hash: u64, key: u64) -> Option<At> {
        let n = self.buckets.len();
        let mut i = self.home(hash);
        for _ in 0..n {
            let b = self.buckets.get(i)?;
            if let Some(slot) = b.slot_of(key) {
                return Some(At { bucket: i, slot });
            }
            if !b.overflowed() {
                return None;
            }
            i = self.next(i);
        }
        None
    }

    /// Calls `visit` with every entry whose key's hash may lie in
    /// `lo..=hi` (the home buckets of that range and the overflow chain past
    /// them), until it returns true; where it did.
    pub(crate) fn find_in_range(
        &self,
        lo: u64,
        hi: u64,
        mut visit: impl FnMut(u64, u32) -> bool,
    ) -> Option<At> {
        let n = self.buckets.len();
        let mut i = self.home(lo);
        // Home buckets of the range after the first (`home` keeps order).
        let span = self.home(hi).saturating_sub(i);
        for step in 0..n {
            let b = self.buckets.get(i)?;
            for slot in 0..b.len() {
                if visit(b.key(slot), b.code.get(slot).copied().unwrap_or(0)) {
                    return Some(At { bucket: i, slot });
                }
            }
            // Keys homed in the range lie at or before the first bucket from
            // its last home that no key passed.
            if step >= span && !b.overflowed() {
                return None;
            }
            i = self.next(i);
        }
        None
    }

    /// The key at `at`.
    #[inline]
    pub(crate) fn key_at(&self, at: At) -> u64 {
        self.buckets.get(at.bucket).map_or(0, |b| b.key(at.slot))
    }

    #[inline]
    pub(crate) fn code(&self, at: At) -> u32 {
        self.buckets
            .get(at.bucket)
            .and_then(|b| b.code.get(at.slot))
            .copied()
            .unwrap_or(0)
    }

    #[inline]
    pub(crate) fn set_code(&mut self, at: At, code: u32) {
        if let Some(c) = self
            .buckets
            .get_mut(at.bucket)
            .and_then(|b| b.code.get_mut(at.slot))
        {
            *c = code;
        }
    }

    /// The code of `key`, if present.
    #[inline]
    pub(crate) fn get(&self, hash: u64, key: u64) -> Option<u32> {
        self.find(hash, key).map(|at| self.code(at))
    }

    /// Where `key` is, if present; otherwise inserts it with the code
    /// `code` makes (`None`). One walk from the home bucket both looks the
    /// key up and finds where it goes: the first bucket with room, as a
    /// walk from home would find it (the full buckets before it were
    /// passed because they carry the overflow mark), or, when the lookup
    /// stopped at a full bucket, the walk goes on from there instead of
    /// starting over.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        key: u64,
        code: impl FnOnce() -> u32,
        rehash: impl Fn(u64) -> u64,
    ) -> Option<At> {
        let n = self.buckets.len();
        let mut i = self.home(hash);
        let mut room = None;
        for _ in 0..n {
            let Some(b) = self.buckets.get(i) else {
                break;
            };
            if let Some(slot) = b.slot_of(key) {
                return Some(At { bucket: i, slot });
            }
            if room.is_none() && b.len() < SLOTS {
                room = Some(i);
            }
            if !b.overflowed() {
                break;
            }
            i = self.next(i);
        }
        let code = code();
        let grow = self.len + 1 > self.capacity();
        if grow || (self.overflowed > self.overflow_limit && self.removed > self.buckets.len() / 4)
        {
            #[cfg(test)]
            if !grow {
                self.same_size_rebuilds += 1;
            }
            let buckets = if grow {
                grown(self.buckets.len())
            } else {
                self.buckets.len()
            };
            self.rebuild(buckets, &rehash);
            room = None;
            i = self.home(hash);
        }
        self.place_from(room.unwrap_or(i), key, code);
        self.len += 1;
        None
    }

    /// Puts an entry in the first bucket with room from `start`, marking
    /// the full buckets passed. The load bound keeps a bucket with room.
    fn place_from(&mut self, start: usize, key: u64, code: u32) {
        let n = self.buckets.len();
        let mut i = start;
        for _ in 0..n {
            let Some(b) = self.buckets.get_mut(i) else {
                return;
            };
            if b.push(key, code) {
                return;
            }
            if !b.overflowed() {
                b.header |= OVERFLOW;
                self.overflowed += 1;
            }
            i = self.next(i);
        }
    }

    /// Removes the entry at `at`; shrinks the table when three quarters of
    /// it are free (see `TierTable::unset` for why).
    pub(crate) fn remove(&mut self, at: At, shrink_above: usize, rehash: impl Fn(u64) -> u64) {
        if let Some(b) = self.buckets.get_mut(at.bucket) {
            if at.slot < b.len() {
                b.remove(at.slot);
                self.len -= 1;
                self.removed += 1;
            }
        }
        let capacity = self.capacity();
        if capacity > shrink_above && self.len < capacity / 4 {
            self.shrink_to(self.len * 2, &rehash);
        }
    }

    /// Rebuilds with the fewest buckets holding `min_capacity` entries (and
    /// the present ones) under the load bound.
    fn shrink_to(&mut self, min_capacity: usize, rehash: &impl Fn(u64) -> u64) {
        let want = min_capacity.max(self.len);
        let mut buckets = MIN_BUCKETS;
        while buckets * MAX_LOAD_NUM / MAX_LOAD_DEN < want {
            buckets = grown(buckets);
        }
        if buckets < self.buckets.len() {
            self.rebuild(buckets, rehash);
        }
    }

    fn rebuild(&mut self, buckets: usize, rehash: &impl Fn(u64) -> u64) {
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::default(); buckets]);
        self.overflowed = 0;
        self.removed = 0;
        for b in &old {
            for s in 0..b.len() {
                let key = b.key(s);
                let code = b.code.get(s).copied().unwrap_or(0);
                self.place_from(self.home(rehash(key)), key, code);
            }
        }
        self.overflow_limit = (buckets / 2).max(self.overflowed + buckets / 4);
    }

    /// Every `(key, code)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.buckets.iter().flat_map(|b| {
            (0..b.len()).map(move |s| (b.key(s), b.code.get(s).copied().unwrap_or(0)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A third of the keys keep 8 hash bits: at most 256 homes, so long
    /// overflow chains.
    const CLUSTER: u64 = 0xff00_0000_0000_0000;

    fn h(k: u64) -> u64 {
        let full = super::super::shard::mix(k);
        if k.is_multiple_of(3) {
            full & CLUSTER
        } else {
            full
        }
    }

    /// Without removals every overflow mark leads to a key, so a rebuild at
    /// the same size would recreate them all: an insert-only table only
    /// rebuilds to grow, while churn still drops marks (the limit is met).
    #[test]
    fn only_removals_trigger_same_size_rebuilds() {
        let mut t = BucketTable::default();
        let mut limit_passed = 0;
        for key in 0..200_000u64 {
            assert_eq!(t.find_or_insert(h(key), key, || 1, h), None);
            limit_passed += usize::from(t.overflowed > t.overflow_limit);
        }
        assert!(limit_passed > 1000, "marks above the limit: {limit_passed}");
        assert_eq!(t.same_size_rebuilds, 0);
        for key in 0..200_000u64 {
            assert_eq!(t.get(h(key), key), Some(1), "{key}");
        }
        // Churn at the load bound (one remove, one insert): removals make
        // marks stale, and rebuilds at the same size drop them.
        let mut next = 200_000u64;
        while t.len() < t.capacity() {
            t.find_or_insert(h(next), next, || 1, h);
            next += 1;
        }
        let (full, buckets) = (t.len(), t.buckets.len());
        let mut oldest = 0u64;
        for _ in 0..2_000_000 {
            if t.same_size_rebuilds > 0 {
                break;
            }
            if let Some(at) = t.find(h(oldest), oldest) {
                t.remove(at, 64, h);
            }
            oldest += 1;
            t.find_or_insert(h(next), next, || 2, h);
            next += 1;
        }
        assert!(t.same_size_rebuilds > 0, "churn still rebuilds");
        assert_eq!((t.len(), t.buckets.len()), (full, buckets));
        for key in oldest..next {
            assert!(t.get(h(key), key).is_some(), "{key}");
        }
    }

    #[test]
    fn a_bucket_is_one_line() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Bucket>(), 64);
    }

    /// A range scan (what ring fingerprints use) reaches every key whose
    /// hash lies in the range, clustered homes and wrapped chains included.
    fn ranges_reach_every_key<'a>(t: &BucketTable, keys: impl Iterator<Item = &'a u64>) {
        for key in keys {
            let hash = h(*key);
            for low_bits in [0u32, 16, 40, 62] {
                let mask = (1u64 << low_bits) - 1;
                let (lo, hi) = (hash & !mask, hash | mask);
                assert!(
                    t.find_in_range(lo, hi, |k, _| k == *key).is_some(),
                    "{key} in {lo:#x}..={hi:#x}"
                );
            }
        }
    }

    /// Against a `std` map: inserts, removes and shrinks in an order that
    /// forces overflow chains (all keys of a small table share few homes).
    #[test]
    fn matches_a_map_through_growth_churn_and_shrink() {
        let mut t = BucketTable::default();
        let mut model = std::collections::HashMap::new();
        let mut peak = 0;
        let mut x = 0x1234_5678_u64;
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Phases: grow to ~30 K keys with churn, then drain to a few.
            let key = x % 40_000;
            let hash = h(key);
            let remove = step >= 100_000 || x.is_multiple_of(5);
            match (t.find(hash, key), model.contains_key(&key)) {
                (Some(at), true) => {
                    assert_eq!(t.code(at), model[&key] as u32);
                    let again = t.find_or_insert(hash, key, || unreachable!("present"), h);
                    assert_eq!(again, Some(at), "a present key is found, not inserted");
                    if remove {
                        t.remove(at, 64, h);
                        model.remove(&key);
                    } else {
                        t.set_code(at, step as u32);
                        model.insert(key, step);
                    }
                }
                (None, false) => {
                    if !remove {
                        assert_eq!(t.find_or_insert(hash, key, || step as u32, h), None);
                        model.insert(key, step);
                    }
                }
                (found, present) => {
                    panic!("step {step}: key {key} found {found:?}, model {present}")
                }
            }
            assert_eq!(t.len(), model.len());
            peak = peak.max(t.allocation_size());
            if step == 99_999 {
                ranges_reach_every_key(&t, model.keys());
            }
        }
        let mut got: Vec<(u64, u32)> = t.iter().collect();
        got.sort_unstable();
        let mut want: Vec<(u64, u32)> = model.iter().map(|(k, v)| (*k, *v as u32)).collect();
        want.sort_unstable();
        assert_eq!(got, want);
        ranges_reach_every_key(&t, model.keys());
        assert!(model.len() < 40_000 / 8, "drained: {}", model.len());
        assert!(t.allocation_size() < peak / 4, "shrunk after the drain");
    }
}
