//! The re-key map against a naive model of copies per (engine key, tier).
//!
//! [`rekey_map`] decodes a byte string into batches of stores with tokens
//! (re-keyed), copies without tokens (vLLM's offloading placeholders), removals,
//! tier moves (TensorRT-LLM `updated`) and cache clears, applies them to an
//! [`EndpointIngest`] that re-keys into a [`SharedIndex`], and asserts after
//! every batch that the index holds each block's internal key in every tier
//! exactly as many times as the model counts copies there.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvroute_core::{BlockKey, EndpointId, Medium};

use super::Bytes;
use crate::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{IndexConfig, SharedIndex};
use crate::ingest::{EndpointIngest, IngestConfig, Keying};
use crate::rekey::{BlockRekeyer, XxhChainRekeyer};

/// Engine keys are `ENGINE_BASE + 0..KEYS`.
pub const KEYS: u64 = 5;
const ENGINE_BASE: u64 = 1000;
/// Tokens per block.
pub const BLOCK: u32 = 4;
/// Batches applied per input at most.
const MAX_BATCHES: usize = 64;
/// Events per batch at most.
const MAX_EVENTS: usize = 6;

/// One engine event over engine keys `0..KEYS` and tiers ([`Medium::ALL`]
/// indices).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RekeyOp {
    /// Block `key` stored with its tokens (re-keyed), followed in the same
    /// event by copies without tokens of `untokenized`.
    Store {
        /// The block stored with tokens.
        key: u64,
        /// Tier index.
        tier: usize,
        /// Keys listed after it without tokens.
        untokenized: Vec<u64>,
    },
    /// Copies stored without tokens (offloading placeholders).
    Copy(Vec<u64>, usize),
    /// Removals from one tier.
    Remove(Vec<u64>, usize),
    /// A tier move of one block.
    Move(u64, usize, usize),
    /// The engine emptied its cache.
    Clear,
}

/// The tokens of engine key `key`'s block: distinct per key, so each key has
/// one internal key.
#[must_use]
pub fn tokens(key: u64) -> Vec<u32> {
    let k = u32::try_from(key).unwrap_or(u32::MAX);
    (0..BLOCK)
        .map(|i| k.wrapping_mul(BLOCK).wrapping_add(i))
        .collect()
}

fn engine(key: u64) -> BlockKey {
    BlockKey(ENGINE_BASE + key)
}

fn medium(tier: usize) -> Medium {
    Medium::ALL.get(tier).copied().unwrap_or(Medium::Gpu)
}

/// The engine event `op` stands for.
#[must_use]
pub fn event(op: &RekeyOp) -> KvEvent {
    match op {
        RekeyOp::Store {
            key,
            tier,
            untokenized,
        } => KvEvent::Stored(BlockStored {
            keys: std::iter::once(*key)
                .chain(untokenized.iter().copied())
                .map(engine)
                .collect(),
            token_ids: tokens(*key),
            block_size: BLOCK,
            medium: medium(*tier),
            ..BlockStored::default()
        }),
        RekeyOp::Copy(keys, tier) => KvEvent::Stored(BlockStored {
            keys: keys.iter().copied().map(engine).collect(),
            block_size: BLOCK,
            medium: medium(*tier),
            ..BlockStored::default()
        }),
        RekeyOp::Remove(keys, tier) => KvEvent::Removed(BlockRemoved {
            keys: keys.iter().copied().map(engine).collect(),
            medium: medium(*tier),
            group: 0,
        }),
        RekeyOp::Move(key, from, to) => KvEvent::Moved(BlockMoved {
            key: engine(*key),
            from: medium(*from),
            to: medium(*to),
            group: 0,
        }),
        RekeyOp::Clear => KvEvent::AllCleared,
    }
}

/// Copies per (engine key, tier); a key is mapped while it has one.
#[derive(Clone, Debug, Default)]
pub struct RekeyModel {
    copies: BTreeMap<(u64, usize), u64>,
    /// (tier, key) stored in the current batch.
    batch: BTreeSet<(usize, u64)>,
}

impl RekeyModel {
    fn mapped(&self, k: u64) -> bool {
        self.copies
            .range((k, 0)..=(k, usize::MAX))
            .any(|(_, c)| *c > 0)
    }

    /// Copies of engine key `k` in tier `t`.
    #[must_use]
    pub fn copies(&self, k: u64, t: usize) -> u64 {
        self.copies.get(&(k, t)).copied().unwrap_or(0)
    }

    fn add(&mut self, k: u64, t: usize) {
        *self.copies.entry((k, t)).or_default() += 1;
    }

    fn take(&mut self, k: u64, t: usize) {
        if let Some(c) = self.copies.get_mut(&(k, t)) {
            *c = c.saturating_sub(1);
        }
    }

    /// A store without a parent naming only blocks the tier held before
    /// this batch is an engine's report of a cache hit (vLLM's full cache
    /// reports): not a copy.
    fn reports_held(&self, keys: &[u64], t: usize) -> bool {
        !keys.is_empty()
            && keys
                .iter()
                .all(|k| !self.batch.contains(&(t, *k)) && self.copies(*k, t) > 0)
    }

    /// A new batch begins.
    pub fn begin_batch(&mut self) {
        self.batch.clear();
    }

    /// Applies one event.
    pub fn apply(&mut self, op: &RekeyOp) {
        match op {
            RekeyOp::Store {
                key,
                tier,
                untokenized,
            } => {
                let all: Vec<u64> = std::iter::once(*key)
                    .chain(untokenized.iter().copied())
                    .collect();
                if self.reports_held(&all, *tier) {
                    return;
                }
                self.batch.extend(all.iter().map(|k| (*tier, *k)));
                self.add(*key, *tier);
                for k in untokenized {
                    if self.mapped(*k) {
                        self.add(*k, *tier);
                    }
                }
            }
            RekeyOp::Copy(keys, tier) => {
                if self.reports_held(keys, *tier) {
                    return;
                }
                self.batch.extend(keys.iter().map(|k| (*tier, *k)));
                for k in keys {
                    if self.mapped(*k) {
                        self.add(*k, *tier);
                    }
                }
            }
            RekeyOp::Remove(keys, tier) => {
                for k in keys {
                    self.take(*k, *tier);
                }
            }
            RekeyOp::Move(k, from, to) => {
                if self.mapped(*k) {
                    self.take(*k, *from);
                    self.add(*k, *to);
                }
            }
            RekeyOp::Clear => self.copies.clear(),
        }
    }
}

/// Applies `batches` to a re-keying ingest and to the model, asserting after
/// every batch that the index holds each block's internal key in each tier as
/// often as the model counts copies.
pub fn run(batches: &[Vec<RekeyOp>]) {
    let rekeyer = XxhChainRekeyer { seed: 3 };
    let internal: Vec<BlockKey> = (0..KEYS)
        .map(|k| {
            let mut out = Vec::new();
            rekeyer.rekey(None, &tokens(k), BLOCK, &mut out);
            out.first().copied().unwrap_or_default()
        })
        .collect();
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(
        EndpointId(0),
        IngestConfig::default(),
        Keying::Rekey(Arc::new(rekeyer)),
    );
    let mut model = RekeyModel::default();
    for (seq, ops) in batches.iter().enumerate() {
        let batch = EventBatch {
            seq: seq as u64,
            events: ops.iter().map(event).collect(),
            ..EventBatch::default()
        };
        let _ = ingest.apply_batch(&batch, &index);
        model.begin_batch();
        for op in ops {
            model.apply(op);
        }
        for (k, key) in internal.iter().enumerate() {
            for medium in Medium::ALL {
                let t = medium.index();
                assert_eq!(
                    u64::from(index.refcount(EndpointId(0), *key, medium)),
                    model.copies(k as u64, t),
                    "engine key {k} tier {medium:?} after batch {seq}: {:?}",
                    &batches[..=seq]
                );
            }
        }
    }
}

impl Bytes<'_> {
    fn key(&mut self) -> u64 {
        u64::from(self.byte()) % KEYS
    }

    fn tier(&mut self) -> usize {
        usize::from(self.byte()) % Medium::ALL.len()
    }

    fn engine_keys(&mut self) -> Vec<u64> {
        let n = 1 + self.byte() % 3;
        (0..n).map(|_| self.key()).collect()
    }
}

/// Decodes `data` into batches of events and runs them ([`run`]).
pub fn rekey_map(data: &[u8]) {
    let mut b = Bytes(data);
    let mut batches = Vec::new();
    while batches.len() < MAX_BATCHES {
        let Some(len) = b.next() else { break };
        let ops: Vec<RekeyOp> = (0..usize::from(len) % (MAX_EVENTS + 1))
            .map(|_| match b.byte() % 8 {
                0..=2 => RekeyOp::Store {
                    key: b.key(),
                    tier: b.tier(),
                    untokenized: if b.byte() % 4 == 0 {
                        b.engine_keys()
                    } else {
                        Vec::new()
                    },
                },
                3 => RekeyOp::Copy(b.engine_keys(), b.tier()),
                4 | 5 => RekeyOp::Remove(b.engine_keys(), b.tier()),
                6 => RekeyOp::Move(b.key(), b.tier(), b.tier()),
                _ => RekeyOp::Clear,
            })
            .collect();
        batches.push(ops);
    }
    run(&batches);
}
