//! Fuzzing and model-based testing support (not a stable API).
//!
//! [`seq_window`] decodes a byte string into a random stream of batches (stores,
//! removes, moves, clears; duplicate, gapped and regressed sequence numbers;
//! reconnects, bootstraps and replay ends; several endpoints across two index
//! banks and several DP ranks; verified resumes with exact re-sends), applies it to [`EndpointIngest`]s over one
//! [`SharedIndex`] and to a naive [`Model`], and asserts after every step that the
//! window decisions, every (endpoint, tier, key) reference count and the scores
//! of a few prompts agree. [`rekey_map`] does the same for the re-key map of an
//! endpoint whose engine keys are re-keyed from tokens (see [`rekey`]).
//! [`index_walk`] checks the prefix walk of banks full of a shared root
//! against a naive store-count model.
//! Asserting is the point of this module: the fuzzer and the property tests
//! report a failing input through the panic.

pub mod index_walk;
pub mod rekey;
pub use index_walk::index_walk;
pub use rekey::rekey_map;

use std::collections::{BTreeMap, BTreeSet};

use kvroute_core::{BlockKey, EndpointId, Medium};

use crate::event::{BlockMoved, BlockRemoved, BlockStored, EventBatch, KvEvent};
use crate::index::{IndexConfig, SharedIndex};
use crate::ingest::{EndpointIngest, IngestConfig, Keying};
use crate::seq::{ClearReason, DropReason, ReplayEnd, RestartPolicy, SeqAction, SeqWindowConfig};
use crate::view::{InventoryView, Overlap};

/// Keys are drawn from `0..KEY_UNIVERSE`.
pub const KEY_UNIVERSE: u64 = 24;
const TIERS: [Medium; 2] = [Medium::Gpu, Medium::Cpu];
const RANKS: u32 = 2;

/// What the model window expects after a reconnect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum ModelResume {
    #[default]
    Steady,
    Reconnected,
    Verifying,
}

/// The naive sequence window: the rules tables of [`crate::SeqWindow`], restated with
/// signed differences, keeping the whole last accepted batch (compared with
/// `==` where the implementation compares digests).
#[derive(Clone, Debug, Default)]
pub struct ModelWindow {
    last: Option<u64>,
    last_batch: Option<EventBatch>,
    resume: ModelResume,
    replaying: bool,
    jump_candidate: Option<u64>,
    /// Batches of the current publisher the inventory lacks.
    pub missing: u64,
    /// A batch with events was applied since the endpoint was last cleared.
    written: bool,
}

impl ModelWindow {
    fn restart(&mut self, policy: RestartPolicy, seq: Option<u64>) -> SeqAction {
        match policy {
            RestartPolicy::Clear => {
                self.last = seq;
                if seq.is_none() {
                    self.last_batch = None;
                }
                SeqAction::ClearThenApply(ClearReason::Restart)
            }
            RestartPolicy::Replay => {
                self.last = None;
                self.last_batch = None;
                self.replaying = true;
                SeqAction::ClearThenReplay { from: 0 }
            }
        }
    }
}

/// Naive model of a set of endpoint inventories and their windows.
#[derive(Clone, Debug, Default)]
pub struct Model {
    /// (endpoint, tier index, key) → outstanding stores.
    pub counts: BTreeMap<(u32, usize, u64), u64>,
    windows: BTreeMap<(u32, Option<u32>), ModelWindow>,
    /// Every store's (group, attention kind) per endpoint, in order.
    kinds: BTreeMap<u32, Vec<(u32, Option<bool>)>>,
    window: u64,
    policy: RestartPolicy,
    max_seq: u64,
    max_jump: u64,
}

impl Model {
    /// An empty model with the given window settings.
    #[must_use]
    pub fn new(config: SeqWindowConfig) -> Self {
        Self {
            window: config.window,
            policy: config.on_restart,
            max_seq: config.max_seq,
            max_jump: config.max_jump,
            ..Self::default()
        }
    }

    /// The model window's decision for `batch` of stream `(ep, rank)`, and
    /// the clear it implies (carried out on the model).
    pub fn decide(&mut self, ep: u32, rank: Option<u32>, batch: &EventBatch) -> SeqAction {
        let (max_seq, max_jump) = (self.max_seq, self.max_jump);
        let w = self.windows.entry((ep, rank)).or_default();
        let seq = batch.seq;
        // Implausible numbers: checked before anything else, `last` untouched.
        let candidate = w.jump_candidate.take();
        if seq > max_seq {
            return SeqAction::Drop(DropReason::Implausible);
        }
        if let Some(last) = w.last {
            let jump = i128::from(seq) - i128::from(last) - 1;
            let confirmed = candidate.is_some_and(|c| i128::from(c) + 1 == i128::from(seq));
            if jump > i128::from(max_jump) && !confirmed {
                w.jump_candidate = Some(seq);
                return SeqAction::Drop(DropReason::Implausible);
            }
        }
        let first = w.last.is_none();
        let action = Self::judge(w, self.window, self.policy, batch);
        if action.applies() {
            w.last_batch = Some(batch.clone());
        }
        match action {
            SeqAction::Apply if first => w.missing = seq,
            SeqAction::ApplyAfterGap { missed } => w.missing += missed,
            SeqAction::ClearThenApply(_) => w.missing = seq,
            _ => {}
        }
        // A window's clear removes what its stream wrote: nothing to do when
        // it wrote nothing since the endpoint was last cleared.
        if action.clears() && w.written {
            self.clear(ep);
            self.lost(ep, rank);
        }
        if action.applies()
            && batch
                .events
                .iter()
                .any(|e| matches!(e, KvEvent::AllCleared))
        {
            self.lost(ep, rank);
            if let Some(w) = self.windows.get_mut(&(ep, rank)) {
                w.missing = 0;
            }
        }
        if action.applies() && !batch.events.is_empty() {
            if let Some(w) = self.windows.get_mut(&(ep, rank)) {
                w.written = true;
            }
        }
        action
    }

    /// Endpoint `ep` was cleared for stream `except`'s reason (or none): every
    /// other stream's accepted batches are gone from the inventory.
    pub fn lost(&mut self, ep: u32, except: Option<u32>) {
        self.lost_except(ep, Some(except));
    }

    fn lost_except(&mut self, ep: u32, except: Option<Option<u32>>) {
        for ((e, r), w) in &mut self.windows {
            if *e != ep {
                continue;
            }
            w.written = false;
            if Some(*r) != except {
                if let Some(last) = w.last {
                    w.missing = last.saturating_add(1);
                }
            }
        }
    }

    /// Endpoint `ep` was cleared by the host: every stream lost its batches.
    pub fn lost_all(&mut self, ep: u32) {
        self.lost_except(ep, None);
    }

    /// The model's missing-batch count of stream `(ep, rank)`.
    #[must_use]
    pub fn missing(&self, ep: u32, rank: Option<u32>) -> Option<u64> {
        self.windows.get(&(ep, rank)).map(|w| w.missing)
    }

    fn judge(
        w: &mut ModelWindow,
        window: u64,
        policy: RestartPolicy,
        batch: &EventBatch,
    ) -> SeqAction {
        let (seq, window) = (batch.seq, i128::from(window));
        let resume = std::mem::take(&mut w.resume);
        let Some(last) = w.last else {
            w.last = Some(seq);
            return SeqAction::Apply;
        };
        if resume == ModelResume::Verifying {
            if seq == last && w.last_batch.as_ref() == Some(batch) {
                return SeqAction::Drop(DropReason::Duplicate);
            }
            return w.restart(policy, Some(seq));
        }
        let d = i128::from(seq) - i128::from(last);
        if d >= 1 {
            w.last = Some(seq);
            let missed = d - 1;
            return if missed > window {
                SeqAction::ClearThenApply(ClearReason::GapBeyondWindow {
                    missed: missed as u64,
                })
            } else if missed == 0 {
                SeqAction::Apply
            } else {
                SeqAction::ApplyAfterGap {
                    missed: missed as u64,
                }
            };
        }
        let restart = resume == ModelResume::Reconnected
            || (!w.replaying && (-d > window || (seq == 0 && last > 0)));
        if restart {
            return w.restart(policy, Some(seq));
        }
        SeqAction::Drop(if d == 0 {
            DropReason::Duplicate
        } else {
            DropReason::Old
        })
    }

    /// The model's answer to a resume of stream `(ep, rank)`.
    pub fn resume(&mut self, ep: u32, rank: Option<u32>) -> Option<u64> {
        let w = self.windows.entry((ep, rank)).or_default();
        let last = w.last?;
        w.resume = ModelResume::Verifying;
        w.replaying = true;
        Some(last)
    }

    /// The model's verdict when the replay of stream `(ep, rank)` ends.
    pub fn replay_finished(&mut self, ep: u32, rank: Option<u32>, completed: bool) -> ReplayEnd {
        let policy = self.policy;
        let w = self.windows.entry((ep, rank)).or_default();
        w.replaying = false;
        if !(completed && w.resume == ModelResume::Verifying) {
            return ReplayEnd::Continue;
        }
        w.resume = ModelResume::Steady;
        let end = match w.restart(policy, None) {
            SeqAction::ClearThenReplay { from } => ReplayEnd::ClearThenReplay { from },
            _ => ReplayEnd::Clear(ClearReason::Restart),
        };
        if w.written {
            self.clear(ep);
            self.lost(ep, rank);
        }
        end
    }

    /// Empties endpoint `ep`.
    pub fn clear(&mut self, ep: u32) {
        self.counts.retain(|(e, _, _), _| *e != ep);
    }

    fn store(&mut self, ep: u32, tier: usize, key: u64) {
        *self.counts.entry((ep, tier, key)).or_insert(0) += 1;
    }

    fn remove(&mut self, ep: u32, tier: usize, key: u64) {
        if let Some(c) = self.counts.get_mut(&(ep, tier, key)) {
            *c -= 1;
            if *c == 0 {
                self.counts.remove(&(ep, tier, key));
            }
        }
    }

    /// The group whose events endpoint `ep` applies, from the kinds its
    /// stores named so far: the first named full attention's; none while
    /// kinds were named but no full one; 0 while none was named.
    fn scored_group(&self, ep: u32) -> Option<u32> {
        let kinds = self.kinds.get(&ep).map_or(&[][..], Vec::as_slice);
        if let Some((g, _)) = kinds.iter().find(|(_, k)| *k == Some(true)) {
            return Some(*g);
        }
        if kinds.iter().any(|(_, k)| k.is_some()) {
            return None;
        }
        Some(0)
    }

    /// Applies `events` (one batch) to endpoint `ep`.
    ///
    /// A store with no parent of keys all held in its tier before this
    /// batch changes nothing (a request reporting the blocks it found
    /// cached) on an endpoint with one stream; every other store counts,
    /// also of a key the batch stored already (another copy), and any store
    /// on an endpoint with several streams (each rank's copy).
    pub fn apply(&mut self, ep: u32, events: &[KvEvent]) {
        let mut stored_here: BTreeSet<(usize, u64)> = BTreeSet::new();
        for ev in events {
            match ev {
                KvEvent::Stored(s) => {
                    self.kinds
                        .entry(ep)
                        .or_default()
                        .push((s.group, s.full_attention));
                    if s.full_attention == Some(false) || self.scored_group(ep) != Some(s.group) {
                        continue;
                    }
                    let tier = s.medium.index();
                    let streams = self.windows.keys().filter(|(e, _)| *e == ep).count();
                    let report = streams <= 1
                        && s.parent.is_none()
                        && !s.keys.is_empty()
                        && s.keys.iter().all(|k| {
                            !stored_here.contains(&(tier, k.0))
                                && self.counts.contains_key(&(ep, tier, k.0))
                        });
                    if report {
                        continue;
                    }
                    for k in &s.keys {
                        stored_here.insert((tier, k.0));
                        self.store(ep, tier, k.0);
                    }
                }
                KvEvent::Removed(r) if self.scored_group(ep) == Some(r.group) => {
                    for k in &r.keys {
                        self.remove(ep, r.medium.index(), k.0);
                    }
                }
                KvEvent::Moved(m) if self.scored_group(ep) == Some(m.group) => {
                    self.remove(ep, m.from.index(), m.key.0);
                    self.store(ep, m.to.index(), m.key.0);
                }
                KvEvent::AllCleared => self.clear(ep),
                _ => {}
            }
        }
    }

    /// Naive overlap of `prompt` with endpoint `ep`.
    #[must_use]
    pub fn overlap(&self, ep: u32, prompt: &[u64]) -> Overlap {
        let held = |k: u64, t: usize| self.counts.contains_key(&(ep, t, k));
        let mut out = Overlap::default();
        let mut in_prefix = true;
        for &k in prompt {
            let fastest = (0..4).find(|t| held(k, *t));
            if fastest.is_some() {
                out.blocks += 1;
            }
            match (in_prefix, fastest) {
                (true, Some(t)) => {
                    out.prefix += 1;
                    if let Some(slot) = out.prefix_by_medium.get_mut(t) {
                        *slot += 1;
                    }
                }
                _ => in_prefix = false,
            }
        }
        out
    }
}

/// The fuzz input, read a byte at a time (0 once it runs out).
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn next(&mut self) -> Option<u8> {
        let (first, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*first)
    }

    fn byte(&mut self) -> u8 {
        self.next().unwrap_or(0)
    }

    fn keys(&mut self) -> Vec<BlockKey> {
        let n = self.byte() % 5;
        (0..n)
            .map(|_| BlockKey(u64::from(self.byte()) % KEY_UNIVERSE))
            .collect()
    }
}

fn random_event(b: &mut Bytes<'_>) -> KvEvent {
    let medium = TIERS[usize::from(b.byte() % 2)];
    let group = u32::from(b.byte().is_multiple_of(5));
    match b.byte() % 8 {
        0..=3 => KvEvent::Stored(BlockStored {
            keys: b.keys(),
            medium,
            group,
            block_size: 4,
            // Mostly engines that name no kind; some name one per group
            // (group 0 a sliding window, as in Gemma 3), some a wrong one.
            full_attention: match b.byte() % 8 {
                0 => Some(group == 1),
                1 => Some(group == 0),
                _ => None,
            },
            ..BlockStored::default()
        }),
        4..=5 => KvEvent::Removed(BlockRemoved {
            keys: b.keys(),
            medium,
            group,
        }),
        6 => KvEvent::Moved(BlockMoved {
            key: BlockKey(u64::from(b.byte()) % KEY_UNIVERSE),
            from: medium,
            to: TIERS[usize::from(b.byte() % 2)],
            group,
        }),
        _ => KvEvent::AllCleared,
    }
}

const PROMPTS: [&[u64]; 4] = [&[0, 1, 2, 3, 4, 5, 6, 7], &[3, 2, 1], &[9, 9, 10, 23], &[]];

/// Runs the byte-driven op stream against the implementation and the model,
/// asserting equality after every step.
pub fn seq_window(data: &[u8]) {
    let mut b = Bytes(data);
    let flags = b.byte();
    let window = SeqWindowConfig {
        window: u64::from(b.byte() % 8),
        on_restart: if flags & 1 == 0 {
            RestartPolicy::Clear
        } else {
            RestartPolicy::Replay
        },
        // Small limits so that random streams cross them.
        max_seq: u64::MAX - u64::from(b.byte() % 4) * 1000,
        max_jump: 4 + u64::from(b.byte()),
    };
    // Endpoint slots 0, 1 and 65 exercise two banks of the index.
    let slots: [u32; 3] = [0, 1, 65];
    let index = SharedIndex::new(
        66,
        IndexConfig {
            capacity_per_endpoint: usize::MAX,
            shards: 1 + usize::from(flags >> 4),
        },
    );
    let config = IngestConfig {
        window,
        ..IngestConfig::default()
    };
    let mut ingests: Vec<EndpointIngest> = slots
        .iter()
        .map(|e| EndpointIngest::new(EndpointId(*e), config.clone(), Keying::Engine))
        .collect();
    let mut model = Model::new(window);
    let mut sent: BTreeMap<(u32, Option<u32>), EventBatch> = BTreeMap::new();

    let mut steps = 0;
    while let Some(op) = b.next() {
        steps += 1;
        if steps > 256 {
            break;
        }
        let which = usize::from(b.byte()) % slots.len();
        let ep = slots[which];
        let rank = match b.byte() % 3 {
            0 => None,
            r => Some(u32::from(r - 1) % RANKS),
        };
        let ingest = &mut ingests[which];
        match op % 16 {
            0 => {
                ingest.on_reconnect(rank);
                let w = model.windows.entry((ep, rank)).or_default();
                w.resume = if w.last.is_some() {
                    ModelResume::Reconnected
                } else {
                    ModelResume::Steady
                };
            }
            3 => {
                let from = ingest.on_resume(rank);
                assert_eq!(from, model.resume(ep, rank), "resume replay start");
            }
            4 => {
                let completed = b.byte() % 2 == 0;
                let verdict = ingest.on_replay_finished(rank, completed, &index);
                assert_eq!(
                    verdict,
                    model.replay_finished(ep, rank, completed),
                    "replay end verdict"
                );
            }
            1 => {
                let from = ingest.on_bootstrap(rank);
                let w = model.windows.entry((ep, rank)).or_default();
                w.replaying = true;
                assert_eq!(
                    from,
                    Some(w.last.map_or(0, |l| l.saturating_add(1))),
                    "bootstrap replay start"
                );
            }
            2 => {
                ingest.on_replay_done(rank);
                model.windows.entry((ep, rank)).or_default().replaying = false;
            }
            _ => {
                let prev = sent.get(&(ep, rank)).map(|b| b.seq);
                let base = prev.unwrap_or(0);
                let choice = b.byte() % 11;
                let batch = match (choice, sent.get(&(ep, rank))) {
                    // The publisher sends (or replays) the very same batch again.
                    (10, Some(previous)) => previous.clone(),
                    _ => {
                        let seq = match choice {
                            0..=4 => prev.map_or(0, |p| p.saturating_add(1)),
                            5 => base,
                            6 => base.saturating_add(2 + u64::from(b.byte() % 8)),
                            7 => base.saturating_add(9 + u64::from(b.byte())),
                            8 => base.saturating_sub(1 + u64::from(b.byte() % 12)),
                            // u64 extremes (a forged or corrupted number) and the
                            // successor of a previous one (a confirmed jump).
                            9 if b.byte() % 2 == 0 => u64::MAX - u64::from(b.byte()) * 13,
                            9 => prev.map_or(0, |p| p.saturating_add(1)),
                            _ => 0,
                        };
                        let n_events = b.byte() % 4;
                        let events: Vec<KvEvent> =
                            (0..n_events).map(|_| random_event(&mut b)).collect();
                        EventBatch {
                            seq,
                            timestamp: 0.0,
                            dp_rank: rank,
                            events,
                        }
                    }
                };
                sent.insert((ep, rank), batch.clone());
                let outcome = ingest.apply_batch(&batch, &index);
                let expected = model.decide(ep, rank, &batch);
                assert_eq!(
                    outcome.action, expected,
                    "window decision for seq {}",
                    batch.seq
                );
                if expected.applies() {
                    model.apply(ep, &batch.events);
                }
            }
        }
        for (i, &ep) in slots.iter().enumerate() {
            // What decisions read without the lock is what the ingest holds.
            assert_eq!(
                ingests[i].health_cell().get(),
                ingests[i].inventory_health(),
                "published health ep{ep}"
            );
            for rank in [None, Some(0), Some(1)] {
                let got = ingests[i].stream(rank).map(|w| w.missing_batches());
                assert_eq!(
                    got,
                    model.missing(ep, rank),
                    "missing batches ep{ep} {rank:?}"
                );
            }
        }
        check(&index, &model, &slots);
    }
}

/// Asserts that `index` and `model` agree on every (endpoint, tier, key) and on
/// the scores of a few prompts.
pub fn check(index: &SharedIndex, model: &Model, slots: &[u32]) {
    for &ep in slots {
        for medium in Medium::ALL {
            let t = medium.index();
            let expected_keys: Vec<BlockKey> = model
                .counts
                .keys()
                .filter(|(e, tier, _)| *e == ep && *tier == t)
                .map(|(_, _, k)| BlockKey(*k))
                .collect();
            let probes = (0..KEY_UNIVERSE)
                .map(BlockKey)
                .chain(expected_keys.iter().copied());
            for key in probes {
                let want = model.counts.get(&(ep, t, key.0)).copied().unwrap_or(0);
                let got = index.refcount(EndpointId(ep), key, medium);
                assert_eq!(u64::from(got), want, "refcount ep{ep} {medium:?} {key:?}");
            }
            assert_eq!(
                index.keys(EndpointId(ep), medium),
                expected_keys,
                "keys ep{ep} {medium:?}"
            );
            assert_eq!(
                index.inventory(EndpointId(ep)).keys_by_medium[t],
                expected_keys.len() as u64,
                "live count ep{ep} {medium:?}"
            );
        }
    }
    let mut out = vec![Overlap::default(); index.endpoint_count()];
    for prompt in PROMPTS {
        let keys: Vec<BlockKey> = prompt.iter().map(|k| BlockKey(*k)).collect();
        index.score(&keys, &mut out);
        for (e, got) in out.iter().enumerate() {
            let want = model.overlap(e as u32, prompt);
            assert_eq!(*got, want, "score of {prompt:?} for ep{e}");
        }
    }
}
