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
//!
//! # Growth
//!
//! A table grows by rebuilding itself at the next size of its *growth
//! lattice*: `1.5^(k + phase)` buckets, `phase` differing from shard to
//! shard ([`BucketTable::new`]). A table's load therefore swings between
//! 57 and 85 %, but at any inventory size the 64 shards' tables are spread
//! over that swing, so the bytes per key of an index stay at the swing's
//! mean, ~19 per unshared key, at every size. Tables that all grow at the
//! same moment make the figure follow the swing: 64 engines × 30 to 195
//! conversations of 512 blocks then cost 15.6 to 22.2 bytes per pair
//! unbounded, 19.8 to 26.3 with insertion rings (`bench-dynamo`, `memory`).
//!
//! A table can also be split into [`REGIONS`] regions by the top
//! [`REGION_BITS`] bits of the hash (the home within a region takes the
//! bits after them, so hash order is kept), each growing on its own with
//! its own phase: a rebuild then moves a region, not the table, and holds
//! the shard's write lock that much shorter. It is one region: with 16, the
//! many mid-sized buffers freed as regions grow stay in glibc's heap (a
//! process that loads 64 × 100 K blocks resides 29 bytes per pair for 23
//! in `memory_bytes`; with one region, 23.8 for 23.0), and loading is no
//! faster.

/// Entries per bucket: 5 × 12 bytes plus the bucket's 4-byte header fill a line.
const SLOTS: usize = 5;
/// Header bit: some key homed at or before this bucket lives after it.
const OVERFLOW: u32 = 1 << 8;
/// Header bits holding the number of entries.
const LEN_MASK: u32 = 0xff;
/// Most entries per bucket on average before a region grows: 85 % of 5.
/// Linear probing's clusters lengthen fast near the bound: at 7/8 (what a
/// table kept before regions), 15 % of the inserts of a 64 x 100 K-block
/// load were placed two or more buckets past their home and 3.6 % seven or
/// more, each bucket past the two read ahead a likely cache miss; 85 %
/// loaded ~5 % faster for +0.5 byte per key (`bench-dynamo`, `load`,
/// `memory`).
const MAX_LOAD_NUM: usize = 17;
const MAX_LOAD_DEN: usize = 4;
/// Capacity (entries) up to which a table is never shrunk (its allocation
/// is small), shared out among its regions.
pub(crate) const KEEP_CAPACITY: usize = 64;
/// Most heap bytes a table may hold whatever its entries: each region at
/// the largest size never shrunk (capacity up to its share of
/// [`KEEP_CAPACITY`]).
pub(crate) const SMALLEST_BYTES: usize = REGIONS
    * ((KEEP_CAPACITY / REGIONS) * MAX_LOAD_DEN / MAX_LOAD_NUM + 2)
    * std::mem::size_of::<Bucket>();

/// Bits of a hash (its top ones) choosing its region of a table: none, one
/// region (see the module's "Growth" for what 4 measured).
const REGION_BITS: u32 = 0;
/// Regions per table.
const REGIONS: usize = 1 << REGION_BITS;
/// Growth factor of a region: half again (a region is 57–85 % full,
/// 15–22.6 bytes per entry, against 43–85 % when doubling).
const GROWTH: f64 = 1.5;

/// Size `k` of the growth lattice at `phase` (in 1/65536 of a step):
/// `GROWTH^(k + phase)` buckets, rounded up.
fn lattice_size(k: i32, phase: u16) -> usize {
    let exponent = f64::from(k) + f64::from(phase) / 65536.0;
    // Saturating float-to-int cast: sizes beyond `usize` cannot be allocated
    // anyway.
    GROWTH.powf(exponent).ceil() as usize
}

/// The bucket count a region of `n` buckets grows to: the next size of its
/// lattice (about `n * GROWTH` once sizes are past the rounding of the
/// first few steps; a first allocation is one or two buckets).
fn next_size(n: usize, phase: u16) -> usize {
    let from = (n.max(1) as f64).ln() / GROWTH.ln() - f64::from(phase) / 65536.0;
    // Start a step below the estimate (float rounding) and walk up: the
    // first few sizes round to the same count, later ones are 1.5x apart.
    let mut k = (from.floor() as i32).saturating_sub(1);
    for _ in 0..8 {
        let size = lattice_size(k, phase);
        if size > n {
            return size;
        }
        k = k.saturating_add(1);
    }
    n.saturating_add(1)
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

/// Where a key was found: bucket and slot of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    bucket: usize,
    slot: usize,
}

/// One region of a [`BucketTable`]: an open-addressed table of
/// `(u64 key, u32 code)` in one-line buckets, over the hashes of one
/// [`REGIONS`]th of the hash space (given to it shifted left by
/// [`REGION_BITS`], so its "hash" is the position within the region).
///
/// 32 bytes (counters in `u32`: a region of 2^32 entries would be a 64 GiB
/// allocation), so the state a lookup reads stays small: with 16 regions a
/// tier's filled 8 lines and a bank's GPU tier 32 KiB, where 64-byte
/// regions had made full walks ~20 % slower (`bench-dynamo`, `score`).
#[derive(Default)]
struct Region {
    buckets: Box<[Bucket]>,
    len: u32,
    /// Buckets carrying [`OVERFLOW`].
    overflowed: u32,
    /// `overflowed` above which the table is rebuilt at its size: half the
    /// buckets, or a quarter more than a rebuild left (a table near its load
    /// bound may carry many marks that all lead somewhere), so each rebuild
    /// follows a quarter of the bucket count of new marks.
    overflow_limit: u32,
    /// Entries removed since the last rebuild: only a removal can leave a
    /// mark that leads nowhere, so without removals a rebuild at the same
    /// size would recreate every mark it drops.
    removed: u32,
    /// Rebuilds that kept the bucket count (what `removed` rations).
    #[cfg(test)]
    same_size_rebuilds: usize,
}

impl Region {
    /// Entries the region holds before it grows.
    #[inline]
    fn capacity(&self) -> usize {
        self.buckets.len() * MAX_LOAD_NUM / MAX_LOAD_DEN
    }

    fn allocation_size(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<Bucket>()
    }

    /// The bucket of the hash's fraction of the table (its high bits: any
    /// bucket count works, so the table grows by half rather than doubles,
    /// and the mapping keeps hash order, so a rebuild walks the old buckets
    /// and fills the new ones front to back).
    #[inline]
    fn home(&self, hash: u64) -> usize {
        home_of(hash, self.buckets.len())
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        next_of(i, self.buckets.len())
    }

    /// The header words of `hash`'s home line and of the line after it,
    /// not read yet: a group of inserts first finds all its lines
    /// (arithmetic only), then reads them in a tight loop of plain loads
    /// whose values are discarded, so every miss of the group is in flight
    /// at once, then inserts into cached lines. The next line is read too
    /// because near the load bound a home bucket is often full or marked
    /// (an insert of a new key then visits ~2 buckets on average, and
    /// reading the second line only once the first arrived doubled the
    /// wait); the line after that does not pay for its load (measured,
    /// `examples/bench-dynamo` load).
    #[inline]
    fn home_lines(&self, hash: u64) -> [Option<&u32>; 2] {
        let home = self.home(hash);
        [home, self.next(home)].map(|i| self.buckets.get(i).map(|b| &b.header))
    }

    /// Where `key` (whose hash is `hash`) is, if present.
    #[inline]
    fn find(&self, hash: u64, key: u64) -> Option<Slot> {
        let n = self.buckets.len();
        let mut i = self.home(hash);
        for _ in 0..n {
            let b = self.buckets.get(i)?;
            if let Some(slot) = b.slot_of(key) {
                return Some(Slot { bucket: i, slot });
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
    fn find_in_range(
        &self,
        lo: u64,
        hi: u64,
        mut visit: impl FnMut(u64, u32) -> bool,
    ) -> Option<Slot> {
        let n = self.buckets.len();
        let mut i = self.home(lo);
        // Home buckets of the range after the first (`home` keeps order).
        let span = self.home(hi).saturating_sub(i);
        for step in 0..n {
            let b = self.buckets.get(i)?;
            for slot in 0..b.len() {
                if visit(b.key(slot), b.code.get(slot).copied().unwrap_or(0)) {
                    return Some(Slot { bucket: i, slot });
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
    fn key_at(&self, at: Slot) -> u64 {
        self.buckets.get(at.bucket).map_or(0, |b| b.key(at.slot))
    }

    #[inline]
    fn code(&self, at: Slot) -> u32 {
        self.buckets
            .get(at.bucket)
            .and_then(|b| b.code.get(at.slot))
            .copied()
            .unwrap_or(0)
    }

    #[inline]
    fn set_code(&mut self, at: Slot, code: u32) {
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
    fn get(&self, hash: u64, key: u64) -> Option<u32> {
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
    fn find_or_insert(
        &mut self,
        hash: u64,
        key: u64,
        code: impl FnOnce() -> u32,
        rehash: impl Fn(u64) -> u64,
        phase: u16,
    ) -> Option<Slot> {
        let n = self.buckets.len();
        let mut i = self.home(hash);
        let mut room = None;
        for _ in 0..n {
            let Some(b) = self.buckets.get(i) else {
                break;
            };
            if let Some(slot) = b.slot_of(key) {
                return Some(Slot { bucket: i, slot });
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
        let grow = self.len as usize + 1 > self.capacity();
        if grow
            || (self.overflowed > self.overflow_limit
                && self.removed as usize > self.buckets.len() / 4)
        {
            #[cfg(test)]
            if !grow {
                self.same_size_rebuilds += 1;
            }
            let buckets = if grow {
                next_size(self.buckets.len(), phase)
            } else {
                self.buckets.len()
            };
            self.rebuild(buckets, &rehash);
            room = None;
            i = self.home(hash);
        }
        self.place_from(room.unwrap_or(i), key, code);
        self.len = self.len.saturating_add(1);
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
                self.overflowed = self.overflowed.saturating_add(1);
            }
            i = self.next(i);
        }
    }

    /// Removes the entry at `at` (false: nothing there); shrinks the region
    /// when three quarters of it are free (see `TierTable::unset` for why).
    fn remove(
        &mut self,
        at: Slot,
        shrink_above: usize,
        rehash: impl Fn(u64) -> u64,
        phase: u16,
    ) -> bool {
        let removed = match self.buckets.get_mut(at.bucket) {
            Some(b) if at.slot < b.len() => {
                b.remove(at.slot);
                self.len = self.len.saturating_sub(1);
                self.removed = self.removed.saturating_add(1);
                true
            }
            _ => false,
        };
        let capacity = self.capacity();
        let len = self.len as usize;
        if capacity > shrink_above && len < capacity / 4 {
            self.shrink_to(len * 2, phase, &rehash);
        }
        removed
    }

    /// Rebuilds with the fewest buckets holding `min_capacity` entries (and
    /// the present ones) under the load bound.
    fn shrink_to(&mut self, min_capacity: usize, phase: u16, rehash: &impl Fn(u64) -> u64) {
        let want = min_capacity.max(self.len as usize);
        let mut buckets = next_size(0, phase);
        while buckets * MAX_LOAD_NUM / MAX_LOAD_DEN < want {
            buckets = next_size(buckets, phase);
        }
        if buckets < self.buckets.len() {
            self.rebuild(buckets, rehash);
        }
    }

    fn rebuild(&mut self, buckets: usize, rehash: &impl Fn(u64) -> u64) {
        let old = std::mem::replace(
            &mut self.buckets,
            vec![Bucket::default(); buckets].into_boxed_slice(),
        );
        self.overflowed = 0;
        self.removed = 0;
        for b in &old {
            for s in 0..b.len() {
                let key = b.key(s);
                let code = b.code.get(s).copied().unwrap_or(0);
                self.place_from(self.home(rehash(key)), key, code);
            }
        }
        let limit = (buckets / 2).max(self.overflowed as usize + buckets / 4);
        self.overflow_limit = u32::try_from(limit).unwrap_or(u32::MAX);
    }

    /// Every `(key, code)`.
    fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.buckets.iter().flat_map(|b| {
            (0..b.len()).map(move |s| (b.key(s), b.code.get(s).copied().unwrap_or(0)))
        })
    }
}

/// Where a key was found: region, bucket and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct At {
    region: usize,
    at: Slot,
}

/// The table of one (shard, tier): [`REGIONS`] independent [`Region`]s,
/// chosen by the top [`REGION_BITS`] bits of a key's hash, each growing on
/// its own (see the module's "Growth").
///
/// A region grows by rebuilding itself at the next size of its growth
/// lattice (1.5x apart), so its load swings between 57 and 85 %; the
/// lattices of different shards' tables (and regions) are offset from one
/// another (`phase`), so at any inventory size their loads are spread over
/// that range and the bytes per key of the whole index stay near their
/// mean instead of following one synchronised swing (tables that all grow
/// at once make 64 x 100 K blocks cost 19.8 to 26.3 bytes per pair,
/// depending on the inventory size).
pub(crate) struct BucketTable {
    regions: [Region; REGIONS],
    len: usize,
    /// Where each region's sizes sit on the growth lattice (see
    /// [`lattice_size`]), in 1/65536 of a step.
    phases: [u16; REGIONS],
}

impl Default for BucketTable {
    fn default() -> Self {
        Self::new(0)
    }
}

/// The addresses of `hash`'s home line and the `N - 1` lines after it (as
/// a walk from home visits them, wrapping at the end), from a
/// [`BucketTable::line_hint`] (arithmetic only: the hint may be stale, see
/// `index::prefetch`); none for an empty hint. The first two are the lines
/// [`BucketTable::home_lines`] reads.
#[inline]
pub(crate) fn hinted_lines<const N: usize>(
    (base, buckets): (usize, usize),
    hash: u64,
) -> [Option<usize>; N] {
    let mut out = [None; N];
    if buckets == 0 {
        return out;
    }
    // The walk `Region::home` / `Region::next` make (one region: the hash
    // unsplit).
    let mut i = home_of(hash, buckets);
    for line in &mut out {
        *line = Some(base.wrapping_add(i.wrapping_mul(std::mem::size_of::<Bucket>())));
        i = next_of(i, buckets);
    }
    out
}

/// A hash's home bucket among `buckets` (multiply-shift on the high bits).
#[inline]
fn home_of(hash: u64, buckets: usize) -> usize {
    ((u128::from(hash) * buckets as u128) >> 64) as usize
}

/// The bucket after `i` among `buckets`, wrapping to the first.
#[inline]
fn next_of(i: usize, buckets: usize) -> usize {
    if i + 1 >= buckets {
        0
    } else {
        i + 1
    }
}

/// The golden ratio's fraction in 1/65536: successive seeds' phases
/// (`seed * this`, modulo one step) are spread evenly over the step
/// whatever their count.
const PHASE_STRIDE: u32 = 40_503;

impl BucketTable {
    /// An empty table; `seed` (e.g. the shard's index) sets where its
    /// regions sit on the growth lattice.
    pub(crate) fn new(seed: u32) -> Self {
        Self {
            regions: std::array::from_fn(|_| Region::default()),
            len: 0,
            phases: std::array::from_fn(|r| {
                let n = seed.wrapping_mul(REGIONS as u32).wrapping_add(r as u32);
                n.wrapping_mul(PHASE_STRIDE) as u16
            }),
        }
    }

    /// The region of `hash` and the hash's position within it.
    #[inline]
    fn split(hash: u64) -> (usize, u64) {
        // `checked_shr`: a shift by 64 (one region) is no shift at all.
        let region = hash.checked_shr(64 - REGION_BITS).unwrap_or(0);
        (region as usize, hash << REGION_BITS)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn allocation_size(&self) -> usize {
        self.regions.iter().map(Region::allocation_size).sum()
    }

    /// See [`Region::home_lines`].
    #[inline]
    pub(crate) fn home_lines(&self, hash: u64) -> [Option<&u32>; 2] {
        let (r, inner) = Self::split(hash);
        self.regions
            .get(r)
            .map_or([None; 2], |region| region.home_lines(inner))
    }

    /// The table's buffer address and bucket count, for [`hinted_lines`]
    /// by a writer that does not hold the shard's lock (see
    /// `index::prefetch`): `(0, 0)`, nothing to prefetch, when the table
    /// is split into several regions or holds no buckets.
    #[inline]
    pub(crate) fn line_hint(&self) -> (usize, usize) {
        self.regions
            .first()
            .filter(|r| REGIONS == 1 && !r.buckets.is_empty())
            .map_or((0, 0), |r| (r.buckets.as_ptr() as usize, r.buckets.len()))
    }

    /// Where `key` (whose hash is `hash`) is, if present.
    #[inline]
    pub(crate) fn find(&self, hash: u64, key: u64) -> Option<At> {
        let (region, inner) = Self::split(hash);
        let at = self.regions.get(region)?.find(inner, key)?;
        Some(At { region, at })
    }

    /// Calls `visit` with every entry whose key's hash may lie in
    /// `lo..=hi` until it returns true; where it did.
    pub(crate) fn find_in_range(
        &self,
        lo: u64,
        hi: u64,
        mut visit: impl FnMut(u64, u32) -> bool,
    ) -> Option<At> {
        let (first, lo_inner) = Self::split(lo);
        let (last, hi_inner) = Self::split(hi);
        let regions = self.regions.iter().enumerate();
        for (region, r) in regions.take(last + 1).skip(first) {
            let lo = if region == first { lo_inner } else { 0 };
            // The low bits a shift dropped: every position up to the end.
            let hi = if region == last {
                hi_inner | ((1u64 << REGION_BITS) - 1)
            } else {
                u64::MAX
            };
            if let Some(at) = r.find_in_range(lo, hi, &mut visit) {
                return Some(At { region, at });
            }
        }
        None
    }

    /// The key at `at`.
    #[inline]
    pub(crate) fn key_at(&self, at: At) -> u64 {
        self.regions.get(at.region).map_or(0, |r| r.key_at(at.at))
    }

    #[inline]
    pub(crate) fn code(&self, at: At) -> u32 {
        self.regions.get(at.region).map_or(0, |r| r.code(at.at))
    }

    #[inline]
    pub(crate) fn set_code(&mut self, at: At, code: u32) {
        if let Some(r) = self.regions.get_mut(at.region) {
            r.set_code(at.at, code);
        }
    }

    /// The code of `key`, if present.
    #[inline]
    pub(crate) fn get(&self, hash: u64, key: u64) -> Option<u32> {
        let (region, inner) = Self::split(hash);
        self.regions.get(region)?.get(inner, key)
    }

    /// Where `key` is, if present; otherwise inserts it with the code
    /// `code` makes (`None`). See [`Region::find_or_insert`]; `rehash`
    /// gives any key's hash (for a rebuild).
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        key: u64,
        code: impl FnOnce() -> u32,
        rehash: impl Fn(u64) -> u64,
    ) -> Option<At> {
        let (region, inner) = Self::split(hash);
        let phase = self.phases.get(region).copied().unwrap_or(0);
        let r = self.regions.get_mut(region)?;
        match r.find_or_insert(inner, key, code, |k| rehash(k) << REGION_BITS, phase) {
            Some(at) => Some(At { region, at }),
            None => {
                self.len += 1;
                None
            }
        }
    }

    /// Removes the entry at `at`; its region shrinks when three quarters of
    /// it are free and it may hold more than its share of
    /// [`KEEP_CAPACITY`] (see `TierTable::unset` for why).
    pub(crate) fn remove(&mut self, at: At, rehash: impl Fn(u64) -> u64) {
        let phase = self.phases.get(at.region).copied().unwrap_or(0);
        let Some(r) = self.regions.get_mut(at.region) else {
            return;
        };
        if r.remove(
            at.at,
            KEEP_CAPACITY / REGIONS,
            |k| rehash(k) << REGION_BITS,
            phase,
        ) {
            self.len -= 1;
        }
    }

    /// Every `(key, code)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.regions.iter().flat_map(Region::iter)
    }
}

#[cfg(test)]
mod growth_tests;
#[cfg(test)]
mod tests;
