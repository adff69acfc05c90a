//! The one 64-bit mixer of kvroute's own (non-contract) hashing: selection's
//! pseudo-random draws and consistent-hash points, and the simulator's
//! synthetic keys. Engine block keys never go through it; they follow their
//! contracts.

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
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::splitmix64;

    /// The reference generator (Vigna's `splitmix64.c`): the state advances by
    /// the increment, the output is the finalised state.
    #[test]
    fn matches_the_reference_sequence() {
        let mut state = 0u64;
        let mut next = || {
            let out = splitmix64(state);
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            out
        };
        assert_eq!(next(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(next(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(next(), 0x06c4_5d18_8009_454f);
    }
}
