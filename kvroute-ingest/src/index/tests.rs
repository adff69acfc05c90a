//! `store_chain` into a bounded tier against `store` of the same keys: the
//! inventory, its eviction order and the counters must not depend on which
//! path (grouped under several shard locks, or key by key) a call took.

use kvroute_core::{BlockKey, EndpointId, Medium};
use proptest::prelude::*;

use super::{IndexConfig, SharedIndex, WriteStats};

#[derive(Clone, Debug)]
enum Op {
    /// Keys `from..from + len` of the endpoint's chain, as one event.
    Store {
        ep: u32,
        from: u64,
        len: u64,
    },
    Remove {
        ep: u32,
        key: u64,
    },
    Clear {
        ep: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..3, 0u64..120, 1u64..48).prop_map(|(ep, from, len)| Op::Store { ep, from, len }),
        2 => (0u32..3, 0u64..160).prop_map(|(ep, key)| Op::Remove { ep, key }),
        1 => (0u32..3).prop_map(|ep| Op::Clear { ep }),
    ]
}

/// Chain keys of endpoint `ep` (a few shared between endpoints, so
/// duplicates and second holders occur).
fn key(ep: u32, i: u64) -> u64 {
    let owner = if i.is_multiple_of(7) {
        9
    } else {
        u64::from(ep)
    };
    super::mix(owner << 32 | i) | 1
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bounded_store_chain_equals_store(
        ops in proptest::collection::vec(op(), 1..80),
        capacity in 1usize..200,
        shards in prop_oneof![Just(1usize), 2usize..70],
    ) {
        let config = IndexConfig { capacity_per_endpoint: capacity, shards };
        let (chained, plain) = (SharedIndex::new(3, config.clone()), SharedIndex::new(3, config));
        for op in &ops {
            let (a, b): (WriteStats, WriteStats) = match *op {
                Op::Store { ep, from, len } => {
                    let keys: Vec<BlockKey> = (from..from + len).map(|i| BlockKey(key(ep, i))).collect();
                    let parent = from.checked_sub(1).map(|p| BlockKey(key(ep, p)));
                    (
                        chained.store_chain(EndpointId(ep), Medium::Gpu, parent, &keys).unwrap(),
                        plain.store(EndpointId(ep), Medium::Gpu, &keys).unwrap(),
                    )
                }
                Op::Remove { ep, key: i } => {
                    let k = [BlockKey(key(ep, i))];
                    (
                        chained.remove(EndpointId(ep), Medium::Gpu, &k).unwrap(),
                        plain.remove(EndpointId(ep), Medium::Gpu, &k).unwrap(),
                    )
                }
                Op::Clear { ep } => (
                    chained.clear_endpoint(EndpointId(ep)).unwrap(),
                    plain.clear_endpoint(EndpointId(ep)).unwrap(),
                ),
            };
            prop_assert_eq!(a, b, "{:?}", op);
            for ep in 0..3 {
                let e = EndpointId(ep);
                prop_assert_eq!(chained.inventory(e), plain.inventory(e));
                prop_assert_eq!(chained.keys(e, Medium::Gpu), plain.keys(e, Medium::Gpu));
                for k in chained.keys(e, Medium::Gpu) {
                    prop_assert_eq!(chained.refcount(e, k, Medium::Gpu), plain.refcount(e, k, Medium::Gpu));
                }
            }
        }
        // The rings hold the same order: shrinking evicts the same keys.
        for ep in 0..3 {
            let e = EndpointId(ep);
            for bound in [capacity / 2, 1, 0] {
                prop_assert_eq!(
                    chained.set_capacity(e, Medium::Gpu, bound).unwrap(),
                    plain.set_capacity(e, Medium::Gpu, bound).unwrap()
                );
                prop_assert_eq!(chained.keys(e, Medium::Gpu), plain.keys(e, Medium::Gpu));
            }
        }
    }
}
