//! Bucket-level behaviour: rebuilds, hinted lines, the line size, range
//! scans, and agreement with a map through growth, churn and shrinking.

use super::*;

/// A third of the keys keep 8 hash bits: at most 256 homes, so long
/// overflow chains.
const CLUSTER: u64 = 0xff00_0000_0000_0000;

fn h(k: u64) -> u64 {
    let full = super::super::shard::mix(k);
    if k.is_multiple_of(3) {
        full & CLUSTER
    } else {
        full
    }
}

/// Without removals every overflow mark leads to a key, so a rebuild at
/// the same size would recreate them all: an insert-only table only
/// rebuilds to grow, while churn still drops marks (the limit is met).
#[test]
fn only_removals_trigger_same_size_rebuilds() {
    let mut t = Region::default();
    let mut limit_passed = 0;
    for key in 0..200_000u64 {
        assert_eq!(t.find_or_insert(h(key), key, || 1, h, 0), None);
        limit_passed += usize::from(t.overflowed > t.overflow_limit);
    }
    assert!(limit_passed > 1000, "marks above the limit: {limit_passed}");
    assert_eq!(t.same_size_rebuilds, 0);
    for key in 0..200_000u64 {
        assert_eq!(t.get(h(key), key), Some(1), "{key}");
    }
    // Churn at the load bound (one remove, one insert): removals make
    // marks stale, and rebuilds at the same size drop them.
    let mut next = 200_000u64;
    while (t.len as usize) < t.capacity() {
        t.find_or_insert(h(next), next, || 1, h, 0);
        next += 1;
    }
    let (full, buckets) = (t.len, t.buckets.len());
    let mut oldest = 0u64;
    for _ in 0..2_000_000 {
        if t.same_size_rebuilds > 0 {
            break;
        }
        if let Some(at) = t.find(h(oldest), oldest) {
            t.remove(at, 64, h, 0);
        }
        oldest += 1;
        t.find_or_insert(h(next), next, || 2, h, 0);
        next += 1;
    }
    assert!(t.same_size_rebuilds > 0, "churn still rebuilds");
    assert_eq!((t.len, t.buckets.len()), (full, buckets));
    for key in oldest..next {
        assert!(t.get(h(key), key).is_some(), "{key}");
    }
}

/// The prefetch hint names the very lines `home_lines` reads, at every
/// size the table passes through, clustered homes and the last bucket
/// (whose next line wraps to the first) included.
#[test]
fn hinted_lines_are_the_home_lines() {
    let mut t = BucketTable::new(7);
    assert_eq!(hinted_lines::<2>(t.line_hint(), 1), [None; 2]);
    let line = |p: Option<&u32>| p.map(|p| p as *const u32 as usize & !63);
    for key in 0..20_000u64 {
        t.find_or_insert(h(key), key, || 1, h);
        if key % 97 == 0 || key < 64 {
            let hint = t.line_hint();
            for probe in [h(key), h(key + 1), 0, u64::MAX, CLUSTER] {
                assert_eq!(
                    t.home_lines(probe).map(line),
                    hinted_lines::<2>(hint, probe),
                    "key {key} probe {probe:#x}"
                );
            }
        }
    }
}

#[test]
fn a_bucket_is_one_line() {
    assert_eq!(std::mem::size_of::<Bucket>(), 64);
    assert_eq!(std::mem::align_of::<Bucket>(), 64);
}

/// A range scan (what ring fingerprints use) reaches every key whose
/// hash lies in the range, clustered homes and wrapped chains included.
fn ranges_reach_every_key<'a>(t: &BucketTable, keys: impl Iterator<Item = &'a u64>) {
    for key in keys {
        let hash = h(*key);
        for low_bits in [0u32, 16, 40, 62] {
            let mask = (1u64 << low_bits) - 1;
            let (lo, hi) = (hash & !mask, hash | mask);
            assert!(
                t.find_in_range(lo, hi, |k, _| k == *key).is_some(),
                "{key} in {lo:#x}..={hi:#x}"
            );
        }
    }
}

/// Against a `std` map: inserts, removes and shrinks in an order that
/// forces overflow chains (all keys of a small table share few homes).
#[test]
fn matches_a_map_through_growth_churn_and_shrink() {
    let mut t = BucketTable::default();
    let mut model = std::collections::HashMap::new();
    let mut peak = 0;
    let mut x = 0x1234_5678_u64;
    for step in 0..200_000u64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Phases: grow to ~30 K keys with churn, then drain to a few.
        let key = x % 40_000;
        let hash = h(key);
        let remove = step >= 100_000 || x.is_multiple_of(5);
        match (t.find(hash, key), model.contains_key(&key)) {
            (Some(at), true) => {
                assert_eq!(t.code(at), model[&key] as u32);
                let again = t.find_or_insert(hash, key, || unreachable!("present"), h);
                assert_eq!(again, Some(at), "a present key is found, not inserted");
                if remove {
                    t.remove(at, h);
                    model.remove(&key);
                } else {
                    t.set_code(at, step as u32);
                    model.insert(key, step);
                }
            }
            (None, false) => {
                if !remove {
                    assert_eq!(t.find_or_insert(hash, key, || step as u32, h), None);
                    model.insert(key, step);
                }
            }
            (found, present) => {
                panic!("step {step}: key {key} found {found:?}, model {present}")
            }
        }
        assert_eq!(t.len(), model.len());
        peak = peak.max(t.allocation_size());
        if step == 99_999 {
            ranges_reach_every_key(&t, model.keys());
        }
    }
    let mut got: Vec<(u64, u32)> = t.iter().collect();
    got.sort_unstable();
    let mut want: Vec<(u64, u32)> = model.iter().map(|(k, v)| (*k, *v as u32)).collect();
    want.sort_unstable();
    assert_eq!(got, want);
    ranges_reach_every_key(&t, model.keys());
    assert!(model.len() < 40_000 / 8, "drained: {}", model.len());
    assert!(t.allocation_size() < peak / 3, "shrunk after the drain");
}
