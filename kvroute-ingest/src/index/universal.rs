//! Keys every endpoint of a bank holds: where the prefix walk of a large
//! pool starts.
//!
//! On a large fleet a prompt's first blocks are often held everywhere (a
//! system prompt every engine has cached). The per-bank prefix walk then
//! looks each of those keys up in every bank only to find every endpoint
//! still matching: at 1 024 endpoints, 16 lookups per key, each under its
//! shard's lock. This table records, per key, the banks in which every
//! endpoint holds it in the GPU tier ("full" banks), as the shards' writers
//! see the holder masks change; the walk reads the prompt's leading keys here
//! once, under one lock, and each bank starts its own walk where its bit
//! drops out.
//!
//! Only banks of at least [`TRACKED_MIN`] endpoints are tracked (in a bank of
//! one endpoint every key it holds would be "full"), and only the first 64
//! banks (one bit each). Entries exist only for keys full in some tracked
//! bank: each is held by an endpoint of that bank, so the table is bounded
//! by the endpoints' capacities.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::RwLock;

use super::shard::KeyMap;

/// Fewest endpoints a bank must have for its full keys to be tracked.
pub(super) const TRACKED_MIN: u32 = 16;

/// Banks with a bit in the table.
pub(super) const TRACKED_BANKS: usize = 64;

/// Per key, the tracked banks in which every endpoint holds it (GPU tier).
#[derive(Default)]
pub(super) struct Universal {
    map: RwLock<KeyMap<u64>>,
    /// Entries in `map`, read without its lock: a walk skips the table
    /// while it is empty.
    len: AtomicUsize,
}

impl Universal {
    /// Every endpoint of bank `bank` now holds `key`. Called under the
    /// key's shard write lock in that bank, so one bank's transitions of
    /// one key arrive in order.
    pub(super) fn entered(&self, key: u64, bank: usize) {
        let Some(bit) = bank_bit(bank) else { return };
        let mut map = self.map.write();
        *map.entry(key).or_insert(0) |= bit;
        self.len.store(map.len(), Ordering::Release);
    }

    /// Some endpoint of bank `bank` no longer holds `key`.
    pub(super) fn left(&self, key: u64, bank: usize) {
        let Some(bit) = bank_bit(bank) else { return };
        let mut map = self.map.write();
        if let Some(m) = map.get_mut(&key) {
            *m &= !bit;
            if *m == 0 {
                map.remove(&key);
                // Shrinks like the shards' tables: a burst of shared keys
                // must not pin its peak.
                let len = map.len();
                if map.capacity() > 64 && len < map.capacity() / 4 {
                    map.shrink_to(len * 2);
                }
            }
        }
        self.len.store(map.len(), Ordering::Release);
    }

    /// Where each tracked bank's walk of `keys` may start: `starts[b]` is
    /// the number of leading keys every endpoint of bank `b` holds (for the
    /// banks in `banks`; the others' entries are left as they are).
    pub(super) fn starts(&self, keys: &[kvroute_core::BlockKey], banks: u64, starts: &mut [u32]) {
        if banks == 0 || self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let map = self.map.read();
        let mut alive = banks;
        let mut at = 0usize;
        while alive != 0 {
            let held = match keys.get(at) {
                Some(k) => map.get(&k.0).copied().unwrap_or(0) & alive,
                None => 0,
            };
            let mut dropped = alive & !held;
            while dropped != 0 {
                let b = dropped.trailing_zeros() as usize;
                dropped &= dropped - 1;
                if let Some(s) = starts.get_mut(b) {
                    *s = u32::try_from(at).unwrap_or(u32::MAX);
                }
            }
            alive = held;
            at += 1;
        }
    }

    /// Heap bytes of the table.
    pub(super) fn allocation_bytes(&self) -> usize {
        // hashbrown: one control byte per bucket besides the entry.
        self.map.read().capacity() * (std::mem::size_of::<(u64, u64)>() + 1)
    }
}

fn bank_bit(bank: usize) -> Option<u64> {
    (bank < TRACKED_BANKS).then(|| 1u64 << bank)
}
