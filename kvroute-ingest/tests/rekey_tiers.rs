//! The re-key map's per-tier accounting against a naive model
//! ([`kvroute_ingest::fuzzing::rekey`]): engine keys re-keyed from their
//! tokens, copies of them without tokens in other tiers (vLLM's offloading
//! placeholders), removals per tier, tier moves (TensorRT-LLM `updated`) and
//! clears, several to a batch. The index must hold a block's internal key in
//! each tier exactly as often as the model counts copies there.

use kvroute_ingest::fuzzing::rekey::{run, RekeyOp, KEYS};
use proptest::prelude::*;

const TIERS: usize = 4;

fn keys() -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(0..KEYS, 1..3)
}

fn op() -> impl Strategy<Value = RekeyOp> {
    let key = 0..KEYS;
    let tier = 0..TIERS;
    prop_oneof![
        4 => (key.clone(), tier.clone(), proptest::collection::vec(0..KEYS, 0..2)).prop_map(
            |(key, tier, untokenized)| RekeyOp::Store { key, tier, untokenized }
        ),
        2 => (keys(), tier.clone()).prop_map(|(k, t)| RekeyOp::Copy(k, t)),
        3 => (keys(), tier.clone()).prop_map(|(k, t)| RekeyOp::Remove(k, t)),
        2 => (key, tier.clone(), tier).prop_map(|(k, a, b)| RekeyOp::Move(k, a, b)),
        1 => Just(RekeyOp::Clear),
    ]
}

proptest! {
    #[test]
    fn each_tiers_copies_are_kept_apart(
        batches in proptest::collection::vec(proptest::collection::vec(op(), 1..4), 0..40)
    ) {
        run(&batches);
    }
}

/// The shapes the model was written for, one event per batch: a host
/// placeholder removed while the device copy stays; a device block moved to
/// the host and back; a cache-hit report that is not a copy.
#[test]
fn placeholders_moves_and_reports() {
    use RekeyOp::*;
    let one = |op| vec![op];
    run(&[
        one(Store {
            key: 1,
            tier: 0,
            untokenized: vec![],
        }),
        one(Copy(vec![1], 1)),
        one(Remove(vec![1], 1)),
        one(Move(1, 0, 1)),
        one(Move(1, 1, 0)),
        one(Store {
            key: 1,
            tier: 0,
            untokenized: vec![],
        }),
        vec![
            Store {
                key: 2,
                tier: 0,
                untokenized: vec![],
            },
            Store {
                key: 2,
                tier: 0,
                untokenized: vec![],
            },
        ],
        one(Remove(vec![1, 2], 0)),
        one(Clear),
        // A removal from a tier without a copy, then a move from the tier
        // with one.
        one(Store {
            key: 4,
            tier: 0,
            untokenized: vec![],
        }),
        one(Remove(vec![4], 1)),
        one(Move(4, 0, 1)),
    ]);
}
