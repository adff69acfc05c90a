//! Chain runs: consecutive keys of one chain that one endpoint stored together,
//! so the prefix walk can verify many of them with one lookup.
//!
//! Engine block keys are chained (each key is a hash of its block and the key
//! before it), so two equal keys have equal histories. If prompt key `i` is a
//! member of run `r` and a later prompt key equals `r`'s last member, every
//! prompt key between them is a member too. While `r` is *valid* (no member has
//! left its owner's GPU tier since it joined), the walk credits all of them to
//! the owner after one lookup and a scan of the prompt for the end key.
//!
//! A member's table entry names its run in the spare bits of a single-holder
//! code (see `shard.rs`); the run itself is one 16-byte slot here. Whenever an
//! entry loses its run id (its key is removed, evicted, cleared or gains a
//! second holder) the run is invalidated for good and its member count drops;
//! the slot is reused only once no entry names it. Writers reserve member
//! counts before attaching keys, so the count never falls below the entries
//! that name the slot, and a reader that holds the shard lock of one member
//! can read the slot knowing it is not reused under it.
//!
//! Slots are bounded ([`MAX_RUNS`] per bank, allocated in chunks); when none is
//! free, stores make no runs and the walk looks keys up one by one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

/// Most members of one run: the walk scans at most this many prompt keys per
/// jump, and a prompt leaving a run part-way costs at most this many single
/// lookups.
pub(crate) const MAX_RUN: u32 = 32;
/// Bits of a run id in an entry code.
pub(crate) const RUN_ID_BITS: u32 = 18;
/// Runs per bank (ids `0..MAX_RUNS`; a code stores `id + 1`, 0 meaning none).
pub(crate) const MAX_RUNS: u32 = (1 << RUN_ID_BITS) - 1;
const SLOTS_PER_CHUNK: usize = 4096;
const CHUNKS: usize = (MAX_RUNS as usize).div_ceil(SLOTS_PER_CHUNK);

const MEMBERS_MASK: u64 = 0xffff_ffff;
const LEN_SHIFT: u32 = 32;
const LEN_MASK: u64 = 0xffff << LEN_SHIFT;
const OWNER_SHIFT: u32 = 48;
const VALID: u64 = 1 << 63;

/// One run: its current last member and packed state (member references,
/// published length, owner bit, valid flag).
#[derive(Default)]
struct Slot {
    end: AtomicU64,
    state: AtomicU64,
}

#[derive(Default)]
struct Alloc {
    next: u32,
    free: Vec<u32>,
}

/// What a reader needs to try a jump from one member.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RunHint {
    /// The run's id (so a failed scan is not retried on every member).
    pub(crate) run: u32,
    /// Its last member.
    pub(crate) end: u64,
    /// Members (bounds the scan for `end`).
    pub(crate) len: u32,
    /// The owner's bit in the bank.
    pub(crate) owner: u32,
}

/// The run slots of one bank.
pub(crate) struct RunTable {
    chunks: Box<[OnceLock<Box<[Slot]>>]>,
    alloc: Mutex<Alloc>,
}

impl Default for RunTable {
    fn default() -> Self {
        Self {
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            alloc: Mutex::new(Alloc::default()),
        }
    }
}

impl RunTable {
    #[inline]
    fn slot(&self, run: u32) -> Option<&Slot> {
        let run = run as usize;
        self.chunks
            .get(run / SLOTS_PER_CHUNK)?
            .get()?
            .get(run % SLOTS_PER_CHUNK)
    }

    /// The jump data of `run` if it is valid, owned by endpoint bit `owner` and
    /// has at least two members. Call while holding the shard lock of an entry
    /// that names `run`.
    #[inline]
    pub(crate) fn hint(&self, run: u32, owner: u32) -> Option<RunHint> {
        let slot = self.slot(run)?;
        let state = slot.state.load(Ordering::Acquire);
        let len = ((state & LEN_MASK) >> LEN_SHIFT) as u32;
        if state & VALID == 0 || ((state >> OWNER_SHIFT) & 63) as u32 != owner || len < 2 {
            return None;
        }
        Some(RunHint {
            run,
            end: slot.end.load(Ordering::Acquire),
            len,
            owner,
        })
    }

    /// A fresh valid run of endpoint bit `owner` with `reserve` member
    /// references held by the caller; `None` when every slot is in use.
    pub(crate) fn alloc(&self, owner: u32, reserve: u32) -> Option<u32> {
        let run = {
            let mut a = self.alloc.lock();
            match a.free.pop() {
                Some(run) => run,
                None if a.next < MAX_RUNS => {
                    a.next += 1;
                    a.next - 1
                }
                None => return None,
            }
        };
        let chunk = self.chunks.get(run as usize / SLOTS_PER_CHUNK)?;
        let slots = chunk.get_or_init(|| (0..SLOTS_PER_CHUNK).map(|_| Slot::default()).collect());
        let slot = slots.get(run as usize % SLOTS_PER_CHUNK)?;
        slot.end.store(0, Ordering::Relaxed);
        slot.state.store(
            VALID | (u64::from(owner & 63) << OWNER_SHIFT) | u64::from(reserve),
            Ordering::Release,
        );
        Some(run)
    }

    /// Extends the caller's reservation on `run` if it is still valid, owned by
    /// `owner`, ends at `end` and has room; returns its published length.
    pub(crate) fn try_extend(&self, run: u32, owner: u32, end: u64, reserve: u32) -> Option<u32> {
        let slot = self.slot(run)?;
        if slot.end.load(Ordering::Acquire) != end {
            return None;
        }
        // Only from a live count: a run whose last reference went is being
        // freed and must not be revived.
        let before = slot
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                let len = ((s & LEN_MASK) >> LEN_SHIFT) as u32;
                let usable = s & VALID != 0
                    && ((s >> OWNER_SHIFT) & 63) as u32 == owner
                    && s & MEMBERS_MASK != 0
                    && len < MAX_RUN;
                usable.then(|| s + u64::from(reserve))
            })
            .ok()?;
        Some(((before & LEN_MASK) >> LEN_SHIFT) as u32)
    }

    /// Publishes `run`'s last member and length (readers may see either
    /// before the other: both only bound a scan) and returns `unused`
    /// reserved references.
    pub(crate) fn finish(&self, run: u32, end: u64, len: u32, unused: u32) {
        if let Some(slot) = self.slot(run) {
            slot.end.store(end, Ordering::Release);
            let _ = slot
                .state
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                    Some((s & !LEN_MASK) | (u64::from(len.min(0xffff)) << LEN_SHIFT))
                });
        }
        if unused > 0 {
            self.release(run, unused);
        }
    }

    /// An entry stopped naming `run`: the run is no longer complete.
    pub(crate) fn member_lost(&self, run: u32) {
        if let Some(slot) = self.slot(run) {
            slot.state.fetch_and(!VALID, Ordering::AcqRel);
        }
        self.release(run, 1);
    }

    /// Drops `n` references; the slot is free once none is left.
    fn release(&self, run: u32, n: u32) {
        let Some(slot) = self.slot(run) else {
            return;
        };
        let n = u64::from(n);
        let before = slot.state.fetch_sub(n, Ordering::AcqRel);
        if before & MEMBERS_MASK == n {
            slot.state.store(0, Ordering::Release);
            self.alloc.lock().free.push(run);
        }
    }

    /// Heap bytes of the allocated chunks and the free list.
    pub(crate) fn allocation_bytes(&self) -> usize {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        chunks * SLOTS_PER_CHUNK * std::mem::size_of::<Slot>()
            + self.alloc.lock().free.capacity() * std::mem::size_of::<u32>()
    }

    /// Most heap bytes a bank's runs can take.
    pub(crate) const fn max_bytes() -> usize {
        CHUNKS * SLOTS_PER_CHUNK * std::mem::size_of::<Slot>()
            + MAX_RUNS as usize * std::mem::size_of::<u32>()
    }
}
