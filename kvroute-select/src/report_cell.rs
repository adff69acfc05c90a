//! One endpoint's last engine report, readable without a lock.
//!
//! A decision reads every endpoint's report (for its load, its prefill
//! counters and the scorer's candidates), so a lock per endpoint per read is
//! a shared cache line written by every deciding thread: on a 1 024-endpoint
//! rule it was a fifth of a decision. Reports change once per poll. The cell
//! is a sequence lock over atomic words: the writer (one at a time, behind a
//! mutex) makes the sequence odd, stores the words and makes it even again;
//! a reader takes the words when the sequence was even and unchanged around
//! them, else tries again — a bounded number of times, then reads under the
//! writers' mutex.

use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::load::{EndpointLoad, EngineReport, PrefillProgress};

/// Optimistic reads tried before a reader takes the writers' mutex.
const TRIES: usize = 16;

/// A report with what the host had in flight when it was taken.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Reported {
    pub(crate) report: EngineReport,
    /// This host's own in-flight count and prefill tokens on the endpoint
    /// when the report was taken.
    pub(crate) local_at_report: EndpointLoad,
    pub(crate) at: Duration,
    pub(crate) valid: bool,
}

const VALID: u64 = 1;
const KV_USAGE: u64 = 2;
const PREFILL: u64 = 4;
const KV_CAPACITY: u64 = 8;

type Words = [u64; 8];

fn encode(r: &Reported) -> Words {
    let e = &r.report;
    let mut flags = 0;
    if r.valid {
        flags |= VALID;
    }
    if e.kv_usage.is_some() {
        flags |= KV_USAGE;
    }
    if e.prefill.is_some() {
        flags |= PREFILL;
    }
    if e.kv_capacity_blocks.is_some() {
        flags |= KV_CAPACITY;
    }
    let prefill = e.prefill.unwrap_or_default();
    [
        u64::from(e.running) | u64::from(e.waiting) << 32,
        e.kv_usage.unwrap_or(0.0).to_bits(),
        prefill.tokens,
        prefill.seconds.to_bits(),
        e.kv_capacity_blocks.unwrap_or(0),
        u64::from(r.local_at_report.in_flight) | flags << 32,
        r.local_at_report.queued_prefill_tokens,
        u64::try_from(r.at.as_nanos()).unwrap_or(u64::MAX),
    ]
}

fn decode(w: &Words) -> Reported {
    let [counts, kv_usage, tokens, seconds, kv_capacity, local, queued, at] = *w;
    let flags = local >> 32;
    let has = |f: u64| flags & f != 0;
    Reported {
        report: EngineReport {
            running: counts as u32,
            waiting: (counts >> 32) as u32,
            kv_usage: has(KV_USAGE).then(|| f64::from_bits(kv_usage)),
            prefill: has(PREFILL).then(|| PrefillProgress {
                tokens,
                seconds: f64::from_bits(seconds),
            }),
            kv_capacity_blocks: has(KV_CAPACITY).then_some(kv_capacity),
        },
        local_at_report: EndpointLoad {
            in_flight: local as u32,
            queued_prefill_tokens: queued,
        },
        at: Duration::from_nanos(at),
        valid: has(VALID),
    }
}

/// The cell.
#[derive(Debug, Default)]
pub(crate) struct ReportCell {
    /// Even: the words are consistent; odd: a writer is storing them.
    seq: AtomicU64,
    words: [AtomicU64; 8],
    writer: Mutex<()>,
}

impl ReportCell {
    pub(crate) fn get(&self) -> Reported {
        for _ in 0..TRIES {
            if let Some(r) = self.try_get() {
                return r;
            }
            std::hint::spin_loop();
        }
        // A writer kept the words busy: wait for it.
        let _w = self.writer.lock();
        self.try_get().unwrap_or_default()
    }

    fn try_get(&self) -> Option<Reported> {
        let before = self.seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            return None;
        }
        let words = self.load_words();
        // Orders the word loads before the second sequence load.
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == before).then(|| decode(&words))
    }

    fn load_words(&self) -> Words {
        let mut words = [0u64; 8];
        for (w, cell) in words.iter_mut().zip(&self.words) {
            *w = cell.load(Ordering::Relaxed);
        }
        words
    }

    pub(crate) fn set(&self, r: &Reported) {
        self.update(|_| *r);
    }

    /// Replaces the report with `f` of it.
    pub(crate) fn update(&self, f: impl FnOnce(Reported) -> Reported) {
        let _w = self.writer.lock();
        let seq = self.seq.load(Ordering::Relaxed);
        let current = decode(&self.load_words());
        let words = encode(&f(current));
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd sequence before the word stores.
        fence(Ordering::Release);
        for (cell, w) in self.words.iter().zip(words) {
            cell.store(w, Ordering::Relaxed);
        }
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reported() -> impl Strategy<Value = Reported> {
        (
            (
                any::<u32>(),
                any::<u32>(),
                proptest::option::of(0.0f64..1.0),
            ),
            proptest::option::of((any::<u64>(), 0.0f64..1e9)),
            proptest::option::of(any::<u64>()),
            (any::<u32>(), any::<u64>(), any::<u64>(), any::<bool>()),
        )
            .prop_map(
                |((running, waiting, kv_usage), prefill, kv_capacity_blocks, (f, q, at, valid))| {
                    Reported {
                        report: EngineReport {
                            running,
                            waiting,
                            kv_usage,
                            prefill: prefill
                                .map(|(tokens, seconds)| PrefillProgress { tokens, seconds }),
                            kv_capacity_blocks,
                        },
                        local_at_report: EndpointLoad {
                            in_flight: f,
                            queued_prefill_tokens: q,
                        },
                        at: Duration::from_nanos(at),
                        valid,
                    }
                },
            )
    }

    proptest! {
        /// The cell gives back what was set, field for field.
        #[test]
        fn a_report_reads_back_as_set(r in reported()) {
            let cell = ReportCell::default();
            prop_assert_eq!(cell.get(), Reported::default());
            cell.set(&r);
            prop_assert_eq!(cell.get(), r);
            cell.update(|mut x| { x.valid = false; x });
            prop_assert_eq!(cell.get(), Reported { valid: false, ..r });
        }
    }

    /// Readers racing a writer see whole reports only: every field of a
    /// report the writer sets is derived from one counter.
    #[test]
    fn readers_never_see_half_a_report() {
        let cell = std::sync::Arc::new(ReportCell::default());
        let of = |n: u64| Reported {
            report: EngineReport {
                running: n as u32,
                waiting: (n as u32).wrapping_mul(3),
                kv_usage: Some(n as f64),
                prefill: Some(PrefillProgress {
                    tokens: n * 7,
                    seconds: n as f64 / 2.0,
                }),
                kv_capacity_blocks: Some(n + 11),
            },
            local_at_report: EndpointLoad {
                in_flight: (n as u32).wrapping_add(1),
                queued_prefill_tokens: n * 5,
            },
            at: Duration::from_nanos(n),
            valid: true,
        };
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (cell, stop) = (cell.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let r = cell.get();
                        if r.valid {
                            let n = r.at.as_nanos() as u64;
                            assert_eq!(r, of(n), "a torn report");
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        for n in 1..200_000u64 {
            cell.set(&of(n));
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().expect("reader") > 0);
        }
    }
}
