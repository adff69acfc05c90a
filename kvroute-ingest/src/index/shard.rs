//! One lock-protected slice of a bank: per-tier maps from block key to the mask of
//! endpoints (of this bank) holding it, plus the rare duplicate-store counts.

use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashMap;

/// Finalizer of MurmurHash3: block keys are already hashes, but tests and some
/// engines use small or sequential keys, which this spreads over all bits.
#[inline]
pub(crate) const fn mix(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// Hasher for `u64` block keys (one multiply-xorshift chain, no seed).
///
/// Unseeded on purpose: block keys are digests chosen by the engines' hash
/// contracts, so a client cannot aim prompts at colliding buckets.
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write_u64(&mut self, k: u64) {
        self.0 = mix(self.0 ^ k);
    }

    #[inline]
    fn write_u32(&mut self, k: u32) {
        self.write_u64(u64::from(k));
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word.iter_mut().zip(chunk).for_each(|(w, b)| *w = *b);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
}

pub(crate) type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// `(block key, endpoint bit << 2 | tier)` → stores beyond the first.
type DupKey = (u64, u32);

/// Result of storing one (endpoint, tier, key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StoreEffect {
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

#[derive(Default)]
pub(crate) struct Shard {
    tiers: [KeyMap<u64>; 4],
    dups: HashMap<DupKey, u32, BuildHasherDefault<KeyHasher>>,
}

#[inline]
fn dup_key(key: u64, bit: u32, tier: usize) -> DupKey {
    (key, (bit << 2) | (tier as u32 & 3))
}

impl Shard {
    /// Holder masks of `key` in the four tiers.
    #[inline]
    pub(crate) fn masks(&self, key: u64) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (slot, map) in out.iter_mut().zip(&self.tiers) {
            if !map.is_empty() {
                *slot = map.get(&key).copied().unwrap_or(0);
            }
        }
        out
    }

    pub(crate) fn store(&mut self, tier: usize, key: u64, bit: u32) -> StoreEffect {
        let flag = 1u64 << (bit & 63);
        let Some(map) = self.tiers.get_mut(tier) else {
            return StoreEffect::Duplicate;
        };
        let mask = map.entry(key).or_insert(0);
        if *mask & flag == 0 {
            *mask |= flag;
            return StoreEffect::Inserted;
        }
        let count = self.dups.entry(dup_key(key, bit, tier)).or_insert(0);
        *count = count.saturating_add(1);
        StoreEffect::Duplicate
    }

    pub(crate) fn remove(&mut self, tier: usize, key: u64, bit: u32) -> RemoveEffect {
        let flag = 1u64 << (bit & 63);
        let Some(map) = self.tiers.get_mut(tier) else {
            return RemoveEffect::Absent;
        };
        let Some(mask) = map.get_mut(&key) else {
            return RemoveEffect::Absent;
        };
        if *mask & flag == 0 {
            return RemoveEffect::Absent;
        }
        if !self.dups.is_empty() {
            let dk = dup_key(key, bit, tier);
            if let Some(count) = self.dups.get_mut(&dk) {
                *count -= 1;
                if *count == 0 {
                    self.dups.remove(&dk);
                }
                return RemoveEffect::Decremented;
            }
        }
        *mask &= !flag;
        if *mask == 0 {
            map.remove(&key);
        }
        RemoveEffect::Removed
    }

    /// Drops (endpoint, tier, key) whatever its reference count; true if it was present.
    pub(crate) fn purge(&mut self, tier: usize, key: u64, bit: u32) -> bool {
        let flag = 1u64 << (bit & 63);
        let Some(map) = self.tiers.get_mut(tier) else {
            return false;
        };
        let Some(mask) = map.get_mut(&key) else {
            return false;
        };
        if *mask & flag == 0 {
            return false;
        }
        *mask &= !flag;
        if *mask == 0 {
            map.remove(&key);
        }
        if !self.dups.is_empty() {
            self.dups.remove(&dup_key(key, bit, tier));
        }
        true
    }

    pub(crate) fn contains(&self, tier: usize, key: u64, bit: u32) -> bool {
        self.tiers
            .get(tier)
            .and_then(|m| m.get(&key))
            .is_some_and(|m| m & (1u64 << (bit & 63)) != 0)
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

    pub(crate) fn allocation_bytes(&self) -> usize {
        self.tiers
            .iter()
            .map(|m| m.allocation_size())
            .sum::<usize>()
            + self.dups.allocation_size()
    }
}
