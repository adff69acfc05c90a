//! Bit-sliced counters: 64 per-endpoint counters updated by one mask at a time.
//!
//! Adding a holder mask costs a short ripple-carry over bit planes instead of one
//! increment per set bit, so scoring a key held by all 64 endpoints costs about
//! as much as scoring one held by a single endpoint.

/// 64 counters of up to 32 bits, stored as bit planes (`planes[i]` bit `e` is bit
/// `i` of counter `e`).
#[derive(Clone, Copy)]
pub(crate) struct SlicedCounters {
    planes: [u64; 32],
}

impl SlicedCounters {
    pub(crate) const ZERO: Self = Self { planes: [0; 32] };

    /// Adds 1 to every counter whose bit is set in `mask`.
    #[inline]
    pub(crate) fn add(&mut self, mut carry: u64) {
        for plane in &mut self.planes {
            if carry == 0 {
                return;
            }
            let old = *plane;
            *plane = old ^ carry;
            carry &= old;
        }
    }

    /// The value of counter `bit` (0..64).
    pub(crate) fn get(&self, bit: u32) -> u32 {
        let mut value = 0u32;
        for (i, plane) in self.planes.iter().enumerate() {
            value |= (((plane >> (bit & 63)) & 1) as u32) << i;
        }
        value
    }

    /// Writes every counter into `out` (indexed by bit). Visits only set bits, so
    /// a bank where few endpoints hold any key costs a handful of steps.
    #[inline]
    pub(crate) fn spread(&self, out: &mut [u32; 64]) {
        for (i, plane) in self.planes.iter().enumerate() {
            let mut rest = *plane;
            while rest != 0 {
                if let Some(slot) = out.get_mut(rest.trailing_zeros() as usize) {
                    *slot |= 1 << i;
                }
                rest &= rest - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_match_naive_per_bit_increments() {
        let mut sliced = SlicedCounters::ZERO;
        let mut naive = [0u32; 64];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            sliced.add(x);
            for (bit, n) in naive.iter_mut().enumerate() {
                *n += ((x >> bit) & 1) as u32;
            }
        }
        let mut spread = [0u32; 64];
        sliced.spread(&mut spread);
        for (bit, n) in naive.iter().enumerate() {
            assert_eq!(sliced.get(bit as u32), *n, "counter {bit}");
            assert_eq!(spread[bit], *n, "spread counter {bit}");
        }
    }
}
