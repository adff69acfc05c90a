//! The insertion ring of a bounded (endpoint, tier): a FIFO of 4-byte key
//! fingerprints in fixed 4 KiB chunks.
//!
//! A `VecDeque` doubles its buffer, so a ring just past a power of two held
//! up to twice its entries (4–8 bytes per key) and copied all of them while
//! growing; in chunks the slack is under one chunk and growth copies
//! nothing.

use std::collections::VecDeque;

/// Entries per chunk (4 KiB).
const CHUNK: usize = 1024;

/// FIFO of `u32` in chunks of [`CHUNK`].
#[derive(Default)]
pub(crate) struct Ring {
    chunks: VecDeque<Box<[u32; CHUNK]>>,
    /// Position of the first entry in the first chunk.
    head: usize,
    len: usize,
}

impl Ring {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn push_back(&mut self, v: u32) {
        let end = self.head + self.len;
        if end / CHUNK >= self.chunks.len() {
            self.chunks.push_back(Box::new([0; CHUNK]));
        }
        if let Some(slot) = self
            .chunks
            .get_mut(end / CHUNK)
            .and_then(|c| c.get_mut(end % CHUNK))
        {
            *slot = v;
            self.len += 1;
        }
    }

    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let v = self.chunks.front().and_then(|c| c.get(self.head)).copied();
        self.head += 1;
        self.len -= 1;
        if self.head == CHUNK || self.len == 0 {
            // An empty ring keeps no chunk; a drained chunk is freed.
            if self.len == 0 {
                self.chunks = VecDeque::new();
            } else {
                self.chunks.pop_front();
            }
            self.head = 0;
        }
        v
    }

    /// Entries, oldest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| c.iter().copied())
            .skip(self.head)
            .take(self.len)
    }

    /// Keeps the entries `keep` accepts, in order, in as few chunks as they need.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let old = std::mem::take(self);
        for v in old.iter() {
            if keep(v) {
                self.push_back(v);
            }
        }
        self.chunks.shrink_to_fit();
    }

    /// Heap bytes held.
    pub(crate) fn allocation_bytes(&self) -> usize {
        self.chunks.len() * std::mem::size_of::<[u32; CHUNK]>()
            + self.chunks.capacity() * std::mem::size_of::<Box<[u32; CHUNK]>>()
    }
}

impl FromIterator<u32> for Ring {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let mut r = Ring::default();
        for v in iter {
            r.push_back(v);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a `VecDeque`: pushes, pops and retains across chunk edges.
    #[test]
    fn matches_a_vecdeque() {
        let mut ring = Ring::default();
        let mut model: VecDeque<u32> = VecDeque::new();
        let mut x = 0x9e37_79b9u32;
        for step in 0..60_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            match x % 10 {
                0..=5 => {
                    ring.push_back(step);
                    model.push_back(step);
                }
                6..=8 => assert_eq!(ring.pop_front(), model.pop_front()),
                _ if step % 97 == 0 => {
                    ring.retain(|v| v % 3 != 0);
                    model.retain(|v| v % 3 != 0);
                }
                _ => {}
            }
            assert_eq!(ring.len(), model.len());
        }
        assert!(ring.iter().eq(model.iter().copied()));
        let bytes = ring.allocation_bytes();
        assert!(
            bytes <= (model.len() / CHUNK + 2) * CHUNK * 4 + 64 * 8,
            "{bytes}"
        );
        while ring.pop_front().is_some() {}
        assert_eq!(ring.allocation_bytes(), 0, "an empty ring holds no chunk");
    }
}
