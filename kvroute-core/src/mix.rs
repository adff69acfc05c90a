//! The one 64-bit mixer of kvroute's own (non-contract) hashing: selection's
//! pseudo-random draws and consistent-hash points, the inventory index's
//! table hash, event-batch fingerprints, hash tables keyed by block keys, and
//! the simulator's synthetic keys. Engine block keys never go through it;
//! they follow their contracts.
//!
//! * [`splitmix64`]: SplitMix64's step and finaliser ([`GAMMA`] is its
//!   state increment), for draws and points from small or sequential inputs.
//! * [`fmix64`]: MurmurHash3's finaliser, the table hash of block keys
//!   ([`KeyHasher`]); a bijection, so distinct keys never collide in it.
//! * [`fold`]: one multiply per word of an order-sensitive accumulator,
//!   finished with [`fmix64`].

use std::hash::{BuildHasherDefault, Hasher};

/// The golden-ratio increment of SplitMix64 (2^64 / φ, odd): the step of a
/// SplitMix64 generator's state and the multiplier of [`fold`].
pub const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 step: adds the golden-ratio increment to `z` and applies
/// its finaliser, so consecutive or small inputs come out spread over all 64
/// bits. `splitmix64(0)` is the first output of SplitMix64 seeded with 0.
///
/// ```
/// use kvroute_core::mix::splitmix64;
/// assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
/// assert_ne!(splitmix64(1), splitmix64(2));
/// ```
#[inline]
#[must_use]
pub const fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// MurmurHash3's 64-bit finaliser (`fmix64`): every input bit reaches every
/// output bit, so small or sequential block keys (tests, some engines) spread
/// over a table like digests do. A bijection: distinct keys keep distinct
/// hashes, which the index's fingerprints rely on.
///
/// ```
/// use kvroute_core::mix::fmix64;
/// assert_eq!(fmix64(0), 0);
/// assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
/// ```
#[inline]
#[must_use]
pub const fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// One step of an order-sensitive accumulator over 64-bit words:
/// `((acc ^ word) · GAMMA) rotl 29`, one multiply per word. Finish with
/// [`fmix64`]. It detects accidental differences (a changed, missing or
/// reordered word); it does not resist crafted collisions.
///
/// ```
/// use kvroute_core::mix::{fmix64, fold};
/// let ab = fmix64(fold(fold(0, 1), 2));
/// let ba = fmix64(fold(fold(0, 2), 1));
/// assert_ne!(ab, ba);
/// ```
#[inline]
#[must_use]
pub const fn fold(acc: u64, word: u64) -> u64 {
    (acc ^ word).wrapping_mul(GAMMA).rotate_left(29)
}

/// A [`Hasher`] for keys made of 64-bit words, block keys first: each word
/// goes through [`fmix64`] with the state, so a `u64` key hashes to
/// `fmix64(key)`. Unseeded on purpose, for maps whose keys no peer chooses
/// (models, simulations, prompt-side keys: digests of the engines' hash
/// contracts, so a client cannot aim prompts at colliding buckets), where
/// runs must repeat and SipHash would dominate the cost of a lookup. The
/// inventory index and the ingest's maps, whose keys arrive in engine event
/// streams, hash under a per-process secret instead.
///
/// ```
/// use std::collections::HashMap;
/// use kvroute_core::mix::{fmix64, BuildKeyHasher};
/// use std::hash::BuildHasher;
/// let mut m: HashMap<u64, u32, BuildKeyHasher> = HashMap::default();
/// m.insert(7, 1);
/// assert_eq!(BuildKeyHasher::default().hash_one(7u64), fmix64(7));
/// ```
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write_u64(&mut self, k: u64) {
        self.0 = fmix64(self.0 ^ k);
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

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher")
    }
}

/// The `BuildHasher` of [`KeyHasher`] (a map's third type parameter).
pub type BuildKeyHasher = BuildHasherDefault<KeyHasher>;

#[cfg(test)]
mod tests {
    use super::{splitmix64, GAMMA};

    /// The reference generator (Vigna's `splitmix64.c`): the state advances by
    /// the increment, the output is the finalised state.
    #[test]
    fn matches_the_reference_sequence() {
        let mut state = 0u64;
        let mut next = || {
            let out = splitmix64(state);
            state = state.wrapping_add(GAMMA);
            out
        };
        assert_eq!(next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(next(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(next(), 0x06c4_5d18_8009_454f);
    }
}
