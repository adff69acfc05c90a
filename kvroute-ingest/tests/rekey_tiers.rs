//! The re-key map's per-tier accounting against a naive model: engine keys
//! re-keyed from their tokens, copies of them without tokens in other tiers
//! (vLLM's offloading placeholders), removals per tier and tier moves
//! (TensorRT-LLM `updated`), each in its own batch. The model keeps the
//! copies per (engine key, tier); the index must hold a block's internal key
//! in exactly the tiers the model has a copy in.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::{
    BlockMoved, BlockRekeyer, BlockRemoved, BlockStored, EndpointIngest, EventBatch, IndexConfig,
    IngestConfig, Keying, KvEvent, SharedIndex, XxhChainRekeyer,
};
use proptest::prelude::*;

const KEYS: u64 = 5;
const TIERS: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Disk];
const BLOCK: u32 = 4;

#[derive(Clone, Debug)]
enum Op {
    /// A block stored with its tokens (re-keyed).
    Store(u64, usize),
    /// A copy stored without tokens.
    Copy(u64, usize),
    Remove(u64, usize),
    Move(u64, usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    let tier = 0..TIERS.len();
    prop_oneof![
        (key.clone(), tier.clone()).prop_map(|(k, t)| Op::Store(k, t)),
        (key.clone(), tier.clone()).prop_map(|(k, t)| Op::Copy(k, t)),
        (key.clone(), tier.clone()).prop_map(|(k, t)| Op::Remove(k, t)),
        (key, tier.clone(), tier).prop_map(|(k, a, b)| Op::Move(k, a, b)),
    ]
}

fn tokens(key: u64) -> Vec<u32> {
    (0..BLOCK).map(|i| key as u32 * BLOCK + i).collect()
}

fn event(op: &Op) -> KvEvent {
    match *op {
        Op::Store(k, t) => KvEvent::Stored(BlockStored {
            keys: vec![BlockKey(1000 + k)],
            token_ids: tokens(k),
            block_size: BLOCK,
            medium: TIERS[t],
            ..BlockStored::default()
        }),
        Op::Copy(k, t) => KvEvent::Stored(BlockStored {
            keys: vec![BlockKey(1000 + k)],
            medium: TIERS[t],
            ..BlockStored::default()
        }),
        Op::Remove(k, t) => KvEvent::Removed(BlockRemoved {
            keys: vec![BlockKey(1000 + k)],
            medium: TIERS[t],
            group: 0,
        }),
        Op::Move(k, a, b) => KvEvent::Moved(BlockMoved {
            key: BlockKey(1000 + k),
            from: TIERS[a],
            to: TIERS[b],
            group: 0,
        }),
    }
}

/// Copies per (engine key, tier); a key is mapped while it has one.
#[derive(Default)]
struct Model {
    copies: HashMap<(u64, usize), u32>,
}

impl Model {
    fn mapped(&self, k: u64) -> bool {
        (0..TIERS.len()).any(|t| self.held(k, t))
    }

    fn held(&self, k: u64, t: usize) -> bool {
        self.copies.get(&(k, t)).is_some_and(|c| *c > 0)
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            // A store of a block the tier holds already, with no parent, is
            // an engine's report of a cache hit (vLLM's full cache reports):
            // not a copy.
            Op::Store(k, t) if !self.held(k, t) => *self.copies.entry((k, t)).or_default() += 1,
            Op::Copy(k, t) if self.mapped(k) && !self.held(k, t) => {
                *self.copies.entry((k, t)).or_default() += 1;
            }
            Op::Remove(k, t) if self.held(k, t) => *self.copies.entry((k, t)).or_default() -= 1,
            Op::Move(k, a, b) if self.mapped(k) => {
                let from = self.copies.entry((k, a)).or_default();
                *from = from.saturating_sub(1);
                *self.copies.entry((k, b)).or_default() += 1;
            }
            _ => {}
        }
    }
}

proptest! {
    #[test]
    fn each_tiers_copies_are_kept_apart(ops in proptest::collection::vec(op(), 0..60)) {
        let rekeyer = XxhChainRekeyer { seed: 3 };
        let internal: Vec<BlockKey> = (0..KEYS)
            .map(|k| {
                let mut out = Vec::new();
                rekeyer.rekey(None, &tokens(k), BLOCK, &mut out);
                out[0]
            })
            .collect();
        let index = SharedIndex::new(1, IndexConfig::default());
        let mut ingest = EndpointIngest::new(
            EndpointId(0),
            IngestConfig::default(),
            Keying::Rekey(Arc::new(rekeyer)),
        );
        let mut model = Model::default();
        for (seq, op) in ops.iter().enumerate() {
            let batch = EventBatch {
                seq: seq as u64,
                events: vec![event(op)],
                ..EventBatch::default()
            };
            let _ = ingest.apply_batch(&batch, &index);
            model.apply(op);
            for k in 0..KEYS {
                for (t, medium) in TIERS.iter().enumerate() {
                    prop_assert_eq!(
                        index.contains(EndpointId(0), internal[k as usize], *medium),
                        model.held(k, t),
                        "key {} tier {:?} after {:?}", k, medium, &ops[..=seq]
                    );
                }
            }
        }
    }
}
