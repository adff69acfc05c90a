//! Software prefetch of table lines a writer will soon insert into, from a
//! hint read without the shard's lock.
//!
//! Loading an engine's inventory inserts keys new to a table far larger
//! than the caches, so nearly every insert waits for its bucket lines. A
//! group of inserts already fetches its lines together (see
//! `BucketTable::home_lines`), but only once it holds its shards' locks,
//! and each lock is a full fence that waits for every load before it. A
//! prefetch is not ordered by fences: issued for the group's lines before
//! its locks, the misses overlap the lock acquisitions instead of following
//! them. (Prefetching the *next* event's lines while one is stored, through
//! a batched `store_chains`, measured no better: see the history.)
//!
//! The lines' addresses come from a [`LineHint`] per shard (the GPU
//! table's buffer address and bucket count), published by writers while
//! they hold the shard's write lock and read with relaxed loads by writers
//! that do not hold it. A hint may be stale (the table rebuilt since) or
//! torn (address of one buffer, count of another): the prefetch then
//! fetches a line nobody reads, which costs bandwidth but is never
//! dereferenced, so no hint can make the index wrong.

use std::sync::atomic::{AtomicUsize, Ordering};

/// A shard's GPU table as last published: buffer address and bucket count
/// (0: nothing to prefetch).
#[derive(Default)]
pub(crate) struct LineHint {
    base: AtomicUsize,
    buckets: AtomicUsize,
}

impl LineHint {
    /// Publishes `(base, buckets)` (see `BucketTable::line_hint`); skips
    /// the stores when nothing changed, so the line stays shared.
    #[inline]
    pub(crate) fn publish(&self, (base, buckets): (usize, usize)) {
        if self.base.load(Ordering::Relaxed) != base {
            self.base.store(base, Ordering::Relaxed);
        }
        if self.buckets.load(Ordering::Relaxed) != buckets {
            self.buckets.store(buckets, Ordering::Relaxed);
        }
    }

    /// The published `(base, buckets)`.
    #[inline]
    pub(crate) fn get(&self) -> (usize, usize) {
        (
            self.base.load(Ordering::Relaxed),
            self.buckets.load(Ordering::Relaxed),
        )
    }
}

/// Asks the CPU to bring the cache line at `addr` into L1 (x86_64:
/// `PREFETCHT0`; elsewhere nothing).
#[inline(always)]
pub(crate) fn prefetch_line(addr: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    // SAFETY: `_mm_prefetch` is `unsafe` only for its `sse` target feature,
    // which this cfg requires to be enabled for the whole build (every
    // x86_64 target has it). PREFETCHT0 is a hint: it does not dereference
    // the address as far as the program can observe, never faults
    // whatever the address, and changes no architectural state, so any
    // `addr` (stale, unmapped, null) is sound.
    #[allow(unsafe_code)]
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(std::ptr::without_provenance(addr));
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = addr;
}
