//! The growth scheme against a plain map: keys present or absent, codes,
//! range scans and memory through many growth steps of every region,
//! interleaved with removals (which shrink regions) and clears.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// Keys of `class` 0 spread over the whole hash space; class 1 keep only
/// the top 12 bits (a few homes per region: long overflow chains that
/// wrap past a region's last bucket); class 2 share one region.
fn hash_of(key: u64) -> u64 {
    let full = super::super::shard::mix(key);
    match key % 8 {
        0 => full & 0xfff0_0000_0000_0000,
        1 => (full >> REGION_BITS) | 0b1010u64.checked_shl(64 - REGION_BITS).unwrap_or(0),
        _ => full,
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Keys `from..from + len`.
    Insert { from: u64, len: u64 },
    /// Every `step`th present key, from the `skip`th on.
    Remove { skip: usize, step: usize },
    /// Every key removed.
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u64..20_000, 1u64..3_000).prop_map(|(from, len)| Op::Insert { from, len }),
        3 => (0usize..7, 1usize..4).prop_map(|(skip, step)| Op::Remove { skip, step }),
        1 => Just(Op::Clear),
    ]
}

fn check(t: &BucketTable, model: &HashMap<u64, u32>, probe: &[u64]) {
    assert_eq!(t.len(), model.len());
    assert_eq!(t.is_empty(), model.is_empty());
    for (key, code) in model {
        let at = t.find(hash_of(*key), *key);
        assert_eq!(at.map(|at| t.code(at)), Some(*code), "key {key}");
        assert_eq!(at.map(|at| t.key_at(at)), Some(*key));
        // What a ring fingerprint's scan covers: a range of hashes
        // sharing the key's top bits.
        let hash = hash_of(*key);
        let mask = u64::MAX >> 26;
        assert!(
            t.find_in_range(hash & !mask, hash | mask, |k, _| k == *key)
                .is_some(),
            "key {key} out of its range scan"
        );
    }
    for key in probe {
        if !model.contains_key(key) {
            assert_eq!(t.find(hash_of(*key), *key), None, "absent key {key}");
        }
    }
    let mut all: Vec<(u64, u32)> = t.iter().collect();
    all.sort_unstable();
    let mut want: Vec<(u64, u32)> = model.iter().map(|(k, c)| (*k, *c)).collect();
    want.sort_unstable();
    assert_eq!(all, want);
    // Memory: each region at least a quarter of its bound full, else
    // at its smallest (which never shrinks).
    assert!(
        t.allocation_size() <= model.len() * 64 * 4 * MAX_LOAD_DEN / MAX_LOAD_NUM + SMALLEST_BYTES,
        "{} bytes for {} keys",
        t.allocation_size(),
        model.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn regions_match_a_map_through_growth_removals_and_clears(
        ops in proptest::collection::vec(op(), 1..24),
        seed in 0u32..4096,
    ) {
        let mut t = BucketTable::new(seed);
        let mut model: HashMap<u64, u32> = HashMap::new();
        let probe: Vec<u64> = (0..24_000).step_by(7).collect();
        for (step, op) in ops.iter().enumerate() {
            let code = step as u32 + 1;
            match *op {
                Op::Insert { from, len } => {
                    for key in from..from + len {
                        let found = t.find_or_insert(hash_of(key), key, || code, hash_of);
                        prop_assert_eq!(found.is_some(), model.contains_key(&key));
                        if let Some(at) = found {
                            t.set_code(at, code);
                        }
                        model.insert(key, code);
                    }
                }
                Op::Remove { skip, step } => {
                    let mut keys: Vec<u64> = model.keys().copied().collect();
                    keys.sort_unstable();
                    for key in keys.into_iter().skip(skip).step_by(step) {
                        let at = t.find(hash_of(key), key);
                        prop_assert!(at.is_some());
                        if let Some(at) = at {
                            t.remove(at, hash_of);
                        }
                        model.remove(&key);
                    }
                }
                Op::Clear => {
                    for key in model.keys() {
                        if let Some(at) = t.find(hash_of(*key), *key) {
                            t.remove(at, hash_of);
                        }
                    }
                    model.clear();
                }
            }
            check(&t, &model, &probe);
        }
    }
}

/// The lattice: sizes rise, by about half once past the first few, and
/// regions at different phases take different sizes.
#[test]
fn lattice_sizes_grow_by_half_and_differ_by_phase() {
    for phase in [0u16, 1, 12_345, 40_503, 65_535] {
        let mut n = 0;
        for _ in 0..60 {
            let next = next_size(n, phase);
            assert!(next > n, "phase {phase}: {n} -> {next}");
            if n >= 64 {
                let ratio = next as f64 / n as f64;
                assert!((1.45..=1.55).contains(&ratio), "{n} -> {next}");
            }
            n = next;
            if n > 1 << 40 {
                break;
            }
        }
    }
    let sizes: std::collections::BTreeSet<usize> = (0..16u16)
        .map(|r| {
            let mut n = next_size(0, r * 4096);
            while n < 10_000 {
                n = next_size(n, r * 4096);
            }
            n
        })
        .collect();
    assert_eq!(sizes.len(), 16, "{sizes:?}");
}

/// The point of the phases: 64 tables (a bank's shards) filled key by
/// key keep their bytes per key in a narrow band at every size, where
/// tables growing in step swing between 57 and 85 % full.
#[test]
fn staggered_tables_keep_bytes_per_key_flat() {
    let mut tables: Vec<BucketTable> = (0..64).map(BucketTable::new).collect();
    // Every region of every table at one phase: all grow together.
    let mut in_step: Vec<BucketTable> = (0..64)
        .map(|_| BucketTable {
            regions: std::array::from_fn(|_| Region::default()),
            len: 0,
            phases: [0; REGIONS],
        })
        .collect();
    let (mut lo, mut hi) = (f64::MAX, 0f64);
    let (mut step_lo, mut step_hi) = (f64::MAX, 0f64);
    for key in 0..1_200_000u64 {
        // Spread keys (class 2 of `hash_of`), sharded by their low bits
        // as the index shards them.
        let hash = hash_of(key * 8 + 2);
        let shard = (hash & 63) as usize;
        for set in [&mut tables, &mut in_step] {
            if let Some(t) = set.get_mut(shard) {
                t.find_or_insert(hash, key * 8 + 2, || 1, hash_of);
            }
        }
        if key >= 200_000 && key % 25_000 == 0 {
            let per_key = |set: &[BucketTable]| {
                set.iter().map(BucketTable::allocation_size).sum::<usize>() as f64 / key as f64
            };
            let (b, s) = (per_key(&tables), per_key(&in_step));
            (lo, hi) = (lo.min(b), hi.max(b));
            (step_lo, step_hi) = (step_lo.min(s), step_hi.max(s));
        }
    }
    println!("bytes per key: staggered {lo:.2}..{hi:.2}, in step {step_lo:.2}..{step_hi:.2}");
    assert!(
        lo > 16.0 && hi < 19.5,
        "staggered: {lo:.2}..{hi:.2} bytes per key"
    );
    assert!(
        step_hi - step_lo > 4.0,
        "in step: {step_lo:.2}..{step_hi:.2}"
    );
}
