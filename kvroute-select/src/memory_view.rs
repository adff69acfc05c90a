//! A plain in-memory [`InventoryView`]: an inverted index from block key to the
//! set of slots holding it. For examples, tests, fuzzing, benchmarks and hosts
//! with one writer; production hosts use the concurrent index of
//! `kvroute-ingest`.

use hashbrown::HashMap;
use kvroute_core::mix::BuildKeyHasher;
use kvroute_core::BlockKey;
use kvroute_ingest::{InventoryView, Overlap};

/// Block key → bitset of slots holding it; every block counts as device-resident.
///
/// Scoring costs one hash lookup and a few word operations per prompt key,
/// whatever the number of slots.
///
/// ```
/// use kvroute_core::BlockKey;
/// use kvroute_ingest::{InventoryView, Overlap};
/// use kvroute_select::KeySetInventory;
/// let mut inv = KeySetInventory::new(2);
/// inv.store(1, [BlockKey(7), BlockKey(8)]);
/// let mut out = [Overlap::default(); 2];
/// inv.score(&[BlockKey(7), BlockKey(9), BlockKey(8)], &mut out);
/// assert_eq!((out[1].blocks, out[1].prefix), (2, 1));
/// assert_eq!(out[0].blocks, 0);
/// ```
#[derive(Clone, Debug, Default)]
pub struct KeySetInventory {
    slots: usize,
    words: usize,
    rows: HashMap<BlockKey, u32, BuildKeyHasher>,
    /// `words` bitset words per row.
    bits: Vec<u64>,
    free_rows: Vec<u32>,
}

impl KeySetInventory {
    /// `slots` empty inventories.
    #[must_use]
    pub fn new(slots: usize) -> Self {
        Self {
            slots,
            words: slots.div_ceil(64),
            ..Self::default()
        }
    }

    fn row(&self, key: &BlockKey) -> Option<&[u64]> {
        let r = *self.rows.get(key)? as usize;
        self.bits.get(r * self.words..(r + 1) * self.words)
    }

    /// Adds keys to one slot (ignored for unknown slots).
    pub fn store(&mut self, slot: usize, keys: impl IntoIterator<Item = BlockKey>) {
        if slot >= self.slots {
            return;
        }
        for k in keys {
            let row = match self.rows.get(&k) {
                Some(r) => *r,
                None => {
                    let r = match self.free_rows.pop() {
                        Some(r) => r,
                        None => {
                            let r = u32::try_from(self.bits.len() / self.words.max(1))
                                .unwrap_or(u32::MAX);
                            self.bits.resize(self.bits.len() + self.words, 0);
                            r
                        }
                    };
                    self.rows.insert(k, r);
                    r
                }
            };
            if let Some(w) = self.bits.get_mut(row as usize * self.words + slot / 64) {
                *w |= 1 << (slot % 64);
            }
        }
    }

    /// Removes keys from one slot.
    pub fn remove(&mut self, slot: usize, keys: impl IntoIterator<Item = BlockKey>) {
        for k in keys {
            let Some(&row) = self.rows.get(&k) else {
                continue;
            };
            let start = row as usize * self.words;
            if let Some(w) = self.bits.get_mut(start + slot / 64) {
                *w &= !(1 << (slot % 64));
            }
            let empty = self
                .bits
                .get(start..start + self.words)
                .is_none_or(|ws| ws.iter().all(|w| *w == 0));
            if empty {
                self.rows.remove(&k);
                self.free_rows.push(row);
            }
        }
    }

    /// Empties one slot.
    pub fn clear(&mut self, slot: usize) {
        let keys: Vec<BlockKey> = self.rows.keys().copied().collect();
        self.remove(slot, keys);
    }
}

/// Adds a 64-lane bitmask to bit-sliced counters (`planes[p]` holds bit `p` of
/// every lane's count): a ripple-carry add costing a few word operations.
fn add_lanes(planes: &mut [u64], mut carry: u64) {
    for p in planes.iter_mut() {
        if carry == 0 {
            return;
        }
        let next = *p & carry;
        *p ^= carry;
        carry = next;
    }
}

const PLANES: usize = 32;

impl InventoryView for KeySetInventory {
    fn endpoint_count(&self) -> usize {
        self.slots
    }

    /// Marks the runs it scored alike by comparing their entries: the
    /// plain reference for what a faster view marks as it scores.
    fn score_prefix_uniform(&self, keys: &[BlockKey], out: &mut [Overlap], uniform: &mut [bool]) {
        self.score_prefix(keys, out);
        uniform.fill(false);
        let scored = out.get(..self.slots.min(out.len())).unwrap_or_default();
        for (u, run) in uniform
            .iter_mut()
            .zip(scored.chunks(kvroute_ingest::UNIFORM_RUN))
        {
            *u = run.iter().all(|o| Some(o) == run.first());
        }
    }

    fn score(&self, keys: &[BlockKey], out: &mut [Overlap]) {
        for wi in 0..self.words {
            let mut planes = [0u64; PLANES];
            let mut run = u64::MAX;
            let mut prefix_of = [0u32; 64];
            for (i, k) in keys.iter().enumerate() {
                let bits = self.row(k).and_then(|r| r.get(wi)).copied().unwrap_or(0);
                add_lanes(&mut planes, bits);
                let mut dropped = run & !bits;
                run &= bits;
                while dropped != 0 {
                    let lane = dropped.trailing_zeros() as usize;
                    dropped &= dropped - 1;
                    if let Some(p) = prefix_of.get_mut(lane) {
                        *p = u32::try_from(i).unwrap_or(u32::MAX);
                    }
                }
            }
            let full = u32::try_from(keys.len()).unwrap_or(u32::MAX);
            for lane in 0..64 {
                let slot = wi * 64 + lane;
                if slot >= self.slots {
                    break;
                }
                let Some(o) = out.get_mut(slot) else { break };
                let blocks = planes.iter().enumerate().fold(0u32, |acc, (p, plane)| {
                    acc | (u32::from((plane >> lane) & 1 == 1) << p)
                });
                let prefix = if run >> lane & 1 == 1 {
                    full
                } else {
                    prefix_of.get(lane).copied().unwrap_or(0)
                };
                *o = Overlap {
                    blocks,
                    prefix,
                    prefix_by_medium: [prefix, 0, 0, 0],
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Bit-sliced scoring equals a naive per-slot count.
        #[test]
        fn scoring_matches_naive_model(
            sets in proptest::collection::vec(proptest::collection::hash_set(0u64..16, 0..10), 1..70),
            prompt in proptest::collection::vec(0u64..20, 0..24),
            removed in proptest::collection::vec((0usize..70, 0u64..16), 0..10),
        ) {
            let mut sets = sets;
            let mut inv = KeySetInventory::new(sets.len());
            for (i, s) in sets.iter().enumerate() {
                inv.store(i, s.iter().map(|k| BlockKey(*k)));
            }
            for (slot, key) in removed {
                if let Some(s) = sets.get_mut(slot) {
                    s.remove(&key);
                    inv.remove(slot, [BlockKey(key)]);
                }
            }
            let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
            let mut out = vec![Overlap::default(); sets.len()];
            inv.score(&keys, &mut out);
            for (s, o) in sets.iter().zip(&out) {
                let blocks = prompt.iter().filter(|k| s.contains(k)).count() as u32;
                let prefix = prompt.iter().take_while(|k| s.contains(k)).count() as u32;
                prop_assert_eq!((o.blocks, o.prefix), (blocks, prefix));
            }
        }
    }
}
