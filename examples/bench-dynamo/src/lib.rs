//! One inventory and one set of prompts, loaded into kvroute's
//! [`SharedIndex`] and into NVIDIA Dynamo's indexers (`dynamo-kv-router`'s
//! `RadixTree` and `ConcurrentRadixTreeCompressed`), so the side-by-side
//! benchmark (`benches/side_by_side.rs`) times both on the same work and
//! checks that both give the same answers first.
//!
//! # Workload
//!
//! `workers` engines. Every engine holds the same `shared_blocks`-block system
//! prompt, then `sequences` conversations of `seq_blocks` blocks hanging off
//! it, each its own: `workers × (shared_blocks + sequences × seq_blocks)`
//! (worker, block) pairs. Engines report stores in events of `event_blocks`
//! blocks (one event names its parent block, as vLLM's `BlockStored` does).
//!
//! A block has a *local* hash (Dynamo's `LocalBlockHash`, the hash of its
//! tokens alone) and a *chained* hash (of the local hash and the parent's
//! chained hash: vLLM's block hash, Dynamo's `ExternalSequenceBlockHash`,
//! kvroute's `BlockKey`). Dynamo's tree walks local hashes from the root;
//! kvroute looks chained keys up directly.
//!
//! # Prompts (512 blocks each by default)
//!
//! * `miss`: no block cached anywhere.
//! * `shared`: the system prompt, then blocks no engine holds: every engine
//!   matches `shared_blocks`.
//! * `deep`: the system prompt and most of one engine's conversation, then new
//!   blocks: that engine matches `prompt_blocks - 32`, the others
//!   `shared_blocks`.

use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree, SyncIndexer};
use kvroute_core::{BlockKey, EndpointId};
use kvroute_ingest::{
    BlockStored, EndpointIngest, EventBatch, IndexConfig, IngestConfig, InventoryView, Keying,
    KvEvent, Overlap, SharedIndex,
};

/// Shape of the inventory and prompts.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Engines (64: one kvroute bank).
    pub workers: u32,
    /// Blocks of the system prompt every engine holds.
    pub shared_blocks: usize,
    /// Conversations per engine.
    pub sequences: usize,
    /// Blocks per conversation.
    pub seq_blocks: usize,
    /// Blocks per store event.
    pub event_blocks: usize,
    /// Blocks per prompt.
    pub prompt_blocks: usize,
}

impl Workload {
    /// 64 engines × 100 032 blocks = 6.40 M (worker, block) pairs, 512-block
    /// prompts.
    pub const FULL: Self = Self {
        workers: 64,
        shared_blocks: 32,
        sequences: 195,
        seq_blocks: 512,
        event_blocks: 16,
        prompt_blocks: 512,
    };

    /// (worker, block) pairs of the inventory.
    #[must_use]
    pub fn pairs(&self) -> u64 {
        u64::from(self.workers) * (self.shared_blocks + self.sequences * self.seq_blocks) as u64
    }
}

/// One block's two hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Hash of the block's tokens alone (Dynamo's tree edge label).
    pub local: u64,
    /// Hash of the block and everything before it (the key both sides store).
    pub chained: u64,
}

/// One store event: the parent's chained hash and the blocks, in order.
pub type StoreEvent = (Option<u64>, Vec<Block>);

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn chain(parent: Option<u64>, local: u64) -> u64 {
    let mut s = parent.unwrap_or(0x5851_f42d_4c95_7f2d) ^ local.rotate_left(23);
    splitmix(&mut s)
}

/// Extends a chain from `parent` with `n` blocks whose local hashes come from
/// the generator seeded by `seed`.
fn blocks(parent: Option<u64>, seed: u64, n: usize) -> Vec<Block> {
    let mut state = seed;
    let mut prev = parent;
    (0..n)
        .map(|_| {
            let local = splitmix(&mut state);
            let chained = chain(prev, local);
            prev = Some(chained);
            Block { local, chained }
        })
        .collect()
}

impl Workload {
    fn system_prompt(&self) -> Vec<Block> {
        blocks(None, 0xC0FFEE, self.shared_blocks)
    }

    fn conversation(&self, worker: u32, s: usize, parent: Option<u64>) -> Vec<Block> {
        let seed = (u64::from(worker) << 32) ^ (s as u64) ^ 0xABCD_0000_0000_0000;
        blocks(parent, seed, self.seq_blocks)
    }

    /// Every store event of `worker`, in the order the engine would send them.
    #[must_use]
    pub fn events(&self, worker: u32) -> Vec<StoreEvent> {
        let system = self.system_prompt();
        let root = system.last().map(|b| b.chained);
        let mut out = Vec::new();
        let mut push = |parent: Option<u64>, run: &[Block]| {
            let mut parent = parent;
            for ev in run.chunks(self.event_blocks.max(1)) {
                out.push((parent, ev.to_vec()));
                parent = ev.last().map(|b| b.chained);
            }
        };
        push(None, &system);
        for s in 0..self.sequences {
            push(root, &self.conversation(worker, s, root));
        }
        out
    }

    /// The `miss`, `shared` and `deep` prompts, named.
    #[must_use]
    pub fn prompts(&self) -> Vec<(&'static str, Vec<Block>)> {
        let n = self.prompt_blocks;
        let system = self.system_prompt();
        let root = system.last().map(|b| b.chained);
        let miss = blocks(None, 0xDEAD_BEEF, n);
        let mut shared = system.clone();
        shared.extend(blocks(root, 0xFEED, n.saturating_sub(system.len())));
        let mut deep = system.clone();
        let held = n.saturating_sub(32).saturating_sub(system.len());
        let conv = self.conversation(7 % self.workers.max(1), 0, root);
        deep.extend(conv.iter().take(held));
        let tail_parent = deep.last().map(|b| b.chained);
        deep.extend(blocks(tail_parent, 0xBEEF, n.saturating_sub(deep.len())));
        vec![("miss", miss), ("shared", shared), ("deep", deep)]
    }
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`).
#[must_use]
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (0 if
/// unreadable): unlike wall time, not inflated when other processes share
/// the cores.
#[must_use]
pub fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// What loading an inventory cost.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// Time spent in the index's own apply calls (event building excluded).
    pub apply: Duration,
    /// CPU time of the loading thread over the same calls (`ZERO` when the
    /// work ran on another thread).
    pub cpu: Duration,
    /// Block updates applied.
    pub blocks: u64,
    /// Resident-set growth over the load.
    pub rss_growth: u64,
}

impl Load {
    /// Block updates per second.
    #[must_use]
    pub fn rate(&self) -> f64 {
        self.blocks as f64 / self.apply.as_secs_f64().max(1e-9)
    }

    /// Block updates per second of the loading thread's CPU time.
    #[must_use]
    pub fn cpu_rate(&self) -> f64 {
        self.blocks as f64 / self.cpu.as_secs_f64().max(1e-9)
    }
}

/// Loads the inventory into a kvroute index through each endpoint's
/// `EndpointIngest` (the gateway's path: sequence tracking, then the index),
/// one batch per conversation.
pub fn load_kvroute(w: &Workload, config: IndexConfig) -> (SharedIndex, Load) {
    let before = rss_bytes();
    let index = SharedIndex::new(w.workers as usize, config);
    let mut apply = Duration::ZERO;
    let mut cpu = Duration::ZERO;
    let mut count = 0u64;
    for worker in 0..w.workers {
        let mut ingest =
            EndpointIngest::new(EndpointId(worker), IngestConfig::default(), Keying::Engine);
        let events = w.events(worker);
        let per_batch = (w.seq_blocks / w.event_blocks.max(1)).max(1);
        let batches: Vec<EventBatch> = events
            .chunks(per_batch)
            .enumerate()
            .map(|(i, evs)| EventBatch {
                seq: i as u64,
                timestamp: 0.0,
                dp_rank: Some(0),
                events: evs
                    .iter()
                    .map(|(parent, bs)| {
                        count += bs.len() as u64;
                        KvEvent::Stored(BlockStored {
                            keys: bs.iter().map(|b| BlockKey(b.chained)).collect(),
                            parent: parent.map(BlockKey),
                            block_size: 16,
                            ..BlockStored::default()
                        })
                    })
                    .collect(),
            })
            .collect();
        let (t, c) = (Instant::now(), thread_cpu());
        for b in &batches {
            let _ = ingest.apply_batch(b, &index);
        }
        apply += t.elapsed();
        cpu += thread_cpu().saturating_sub(c);
    }
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        index,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

/// Loads the inventory straight into a kvroute index with
/// `SharedIndex::store_chain`, one call per store event (its parent and
/// blocks, as `EndpointIngest` passes them): the index's own apply cost, as
/// `load_dynamo_tree` measures Dynamo's `apply_event`.
pub fn load_kvroute_direct(w: &Workload, config: IndexConfig) -> (SharedIndex, Load) {
    let events: Vec<ChainEvents> = (0..w.workers).map(|wk| chain_events(w, wk)).collect();
    apply_kvroute_direct(w, config, &events)
}

/// One worker's store events as `store_chain` takes them: parent and keys.
pub type ChainEvents = Vec<(Option<BlockKey>, Vec<BlockKey>)>;

/// `worker`'s store events in kvroute's form.
#[must_use]
pub fn chain_events(w: &Workload, worker: u32) -> ChainEvents {
    w.events(worker)
        .iter()
        .map(|(parent, bs)| {
            (
                parent.map(BlockKey),
                bs.iter().map(|b| BlockKey(b.chained)).collect(),
            )
        })
        .collect()
}

/// [`load_kvroute_direct`] with the events built beforehand (`events[w]`:
/// worker `w`'s), so rounds of a benchmark reuse them.
pub fn apply_kvroute_direct(
    w: &Workload,
    config: IndexConfig,
    events: &[ChainEvents],
) -> (SharedIndex, Load) {
    let before = rss_bytes();
    let index = SharedIndex::new(w.workers as usize, config);
    let mut apply = Duration::ZERO;
    let mut cpu = Duration::ZERO;
    let mut count = 0u64;
    for (worker, events) in (0..w.workers).zip(events) {
        count += events.iter().map(|(_, e)| e.len() as u64).sum::<u64>();
        let (t, c) = (Instant::now(), thread_cpu());
        for (parent, keys) in events {
            let _ = index.store_chain(EndpointId(worker), kvroute_core::Medium::Gpu, *parent, keys);
        }
        apply += t.elapsed();
        cpu += thread_cpu().saturating_sub(c);
    }
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        index,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

/// [`apply_kvroute_direct`] with the workers' events interleaved, one event
/// of each worker in turn (as 64 engines publishing at once arrive), instead
/// of one worker's whole inventory after another's.
pub fn apply_kvroute_interleaved(
    w: &Workload,
    config: IndexConfig,
    events: &[ChainEvents],
) -> (SharedIndex, Load) {
    let before = rss_bytes();
    let index = SharedIndex::new(w.workers as usize, config);
    let count = events
        .iter()
        .flatten()
        .map(|(_, e)| e.len() as u64)
        .sum::<u64>();
    let longest = events.iter().map(Vec::len).max().unwrap_or(0);
    let (t, c) = (Instant::now(), thread_cpu());
    for i in 0..longest {
        for (worker, events) in (0..w.workers).zip(events) {
            if let Some((parent, keys)) = events.get(i) {
                let _ =
                    index.store_chain(EndpointId(worker), kvroute_core::Medium::Gpu, *parent, keys);
            }
        }
    }
    let (apply, cpu) = (t.elapsed(), thread_cpu().saturating_sub(c));
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        index,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

fn router_events(w: &Workload, worker: u32, next_id: &mut u64) -> Vec<RouterEvent> {
    w.events(worker)
        .into_iter()
        .map(|(parent, bs)| {
            *next_id += 1;
            RouterEvent::new(
                u64::from(worker),
                KvCacheEvent {
                    event_id: *next_id,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: bs
                            .iter()
                            .map(|b| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(b.chained),
                                tokens_hash: LocalBlockHash(b.local),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                    dp_rank: 0,
                },
            )
        })
        .collect()
}

/// Loads the inventory into Dynamo's single-threaded `RadixTree` with
/// `apply_event`, one event per store.
pub fn load_dynamo_tree(w: &Workload) -> (RadixTree, Load) {
    apply_dynamo_tree(dynamo_events(w))
}

/// Every worker's store events in Dynamo's form (`[w]`: worker `w`'s).
#[must_use]
pub fn dynamo_events(w: &Workload) -> Vec<Vec<RouterEvent>> {
    let mut next_id = 0u64;
    (0..w.workers)
        .map(|wk| router_events(w, wk, &mut next_id))
        .collect()
}

/// [`load_dynamo_tree`] with the events built beforehand (its `apply_event`
/// takes each event by value, so a round consumes its own copy).
pub fn apply_dynamo_tree(all: Vec<Vec<RouterEvent>>) -> (RadixTree, Load) {
    let before = rss_bytes();
    let mut tree = RadixTree::new();
    let mut apply = Duration::ZERO;
    let mut cpu = Duration::ZERO;
    let mut count = 0u64;
    for events in all {
        count += events
            .iter()
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) => s.blocks.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
        let (t, c) = (Instant::now(), thread_cpu());
        for e in events {
            let _ = tree.apply_event(e);
        }
        apply += t.elapsed();
        cpu += thread_cpu().saturating_sub(c);
    }
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        tree,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

/// [`apply_dynamo_tree`] in [`apply_kvroute_interleaved`]'s order: one event
/// of each worker in turn.
pub fn apply_dynamo_interleaved(all: Vec<Vec<RouterEvent>>) -> (RadixTree, Load) {
    let before = rss_bytes();
    let mut tree = RadixTree::new();
    let count = all
        .iter()
        .flatten()
        .map(|e| match &e.event.data {
            KvCacheEventData::Stored(s) => s.blocks.len() as u64,
            _ => 0,
        })
        .sum::<u64>();
    let mut streams: Vec<_> = all.into_iter().map(Vec::into_iter).collect();
    let (t, c) = (Instant::now(), thread_cpu());
    loop {
        let mut any = false;
        for s in &mut streams {
            if let Some(e) = s.next() {
                any = true;
                let _ = tree.apply_event(e);
            }
        }
        if !any {
            break;
        }
    }
    let (apply, cpu) = (t.elapsed(), thread_cpu().saturating_sub(c));
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        tree,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

/// Loads the inventory into Dynamo's `ConcurrentRadixTreeCompressed` through
/// its own writer loop (`SyncIndexer::worker` on one thread, fed by a
/// channel, as its thread pool does). The time covers queueing and applying.
pub fn load_dynamo_concurrent(
    w: &Workload,
) -> (std::sync::Arc<ConcurrentRadixTreeCompressed>, Load) {
    use dynamo_kv_router::indexer::WorkerTask;
    let before = rss_bytes();
    let tree = std::sync::Arc::new(ConcurrentRadixTreeCompressed::new());
    let mut apply = Duration::ZERO;
    // Applied on its writer thread: this thread's CPU says nothing.
    let cpu = Duration::ZERO;
    let mut count = 0u64;
    let mut next_id = 0u64;
    let mut all = Vec::new();
    for worker in 0..w.workers {
        let events = router_events(w, worker, &mut next_id);
        count += events
            .iter()
            .map(|e| match &e.event.data {
                KvCacheEventData::Stored(s) => s.blocks.len() as u64,
                _ => 0,
            })
            .sum::<u64>();
        all.push(events);
    }
    let (tx, rx) = flume::unbounded();
    let writer = {
        let tree = tree.clone();
        std::thread::spawn(move || tree.worker(rx, None))
    };
    let t = Instant::now();
    for events in all {
        for e in events {
            let _ = tx.send(WorkerTask::Event(e));
        }
    }
    drop(tx);
    let _ = writer.join();
    apply += t.elapsed();
    let rss_growth = rss_bytes().saturating_sub(before);
    (
        tree,
        Load {
            apply,
            cpu,
            blocks: count,
            rss_growth,
        },
    )
}

/// kvroute's prefix per worker for `prompt` (early-stopping walk).
#[must_use]
pub fn kvroute_prefix(index: &SharedIndex, keys: &[BlockKey]) -> Vec<u32> {
    let mut out = vec![Overlap::default(); index.endpoint_count()];
    index.score_prefix(keys, &mut out);
    out.iter().map(|o| o.prefix).collect()
}

/// kvroute's prefix per worker from the full walk.
#[must_use]
pub fn kvroute_full_prefix(index: &SharedIndex, keys: &[BlockKey]) -> Vec<u32> {
    let mut out = vec![Overlap::default(); index.endpoint_count()];
    index.score(keys, &mut out);
    out.iter().map(|o| o.prefix).collect()
}

/// Dynamo's scores as a dense per-worker vector (absent: 0).
#[must_use]
pub fn dense(scores: &OverlapScores, workers: u32) -> Vec<u32> {
    (0..workers)
        .map(|w| {
            scores
                .scores
                .get(&WorkerWithDpRank::new(u64::from(w), 0))
                .copied()
                .unwrap_or(0)
        })
        .collect()
}

/// The prompt as kvroute keys and as Dynamo local hashes.
#[must_use]
pub fn split(prompt: &[Block]) -> (Vec<BlockKey>, Vec<LocalBlockHash>) {
    (
        prompt.iter().map(|b| BlockKey(b.chained)).collect(),
        prompt.iter().map(|b| LocalBlockHash(b.local)).collect(),
    )
}

// `--features mimalloc`: the gateway binary's allocator, so both indexes can
// be measured the way the shipped binary runs them (benches link this
// library, so one declaration covers every bench).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The global allocator the benches run on (printed in their headers).
#[must_use]
pub fn allocator() -> &'static str {
    if cfg!(feature = "mimalloc") {
        "mimalloc"
    } else {
        "system"
    }
}
