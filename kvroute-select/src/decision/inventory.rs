//! The prompt against the inventories: block keys (computed once per
//! decision), each endpoint's overlap and contract status, and the predicted
//! entries recent decisions left.

use std::time::Duration;

use kvroute_core::{EndpointId, TokenId};
use kvroute_ingest::{InventoryHealth, InventoryView, Overlap};

use super::Decision;
use crate::bounded::{chain, hash_bytes, BoundedMap};
use crate::counters::MissReason;
use crate::keys::{KeysError, PromptInput, Request};
use crate::rule::{Choice, Rule};

/// The key positions predicted entries use: every `stride`-th key and the
/// last. Keys are chained, so an entry at position `j` stands for the whole
/// prefix `0..=j`: recording one key in `stride` keeps the hot path's work
/// (and the lock) per decision small at the cost of crediting prefixes in
/// steps of `stride` blocks (an exact repeat of a prompt still matches whole).
fn predicted_positions(len: usize, stride: usize) -> impl Iterator<Item = usize> {
    let last = len.checked_sub(1);
    (stride - 1..len)
        .step_by(stride)
        .chain(last.filter(|l| (l + 1) % stride != 0))
}

/// A predicted entry: the endpoint and the low 32 bits of its inventory's
/// clear count when the prediction was made.
fn pack(endpoint: u32, clears: u32) -> u64 {
    (u64::from(clears) << 32) | u64::from(endpoint)
}

fn unpack(entry: u64) -> (u32, u32) {
    ((entry & 0xffff_ffff) as u32, (entry >> 32) as u32)
}

/// The endpoint a predicted entry credits.
pub(crate) fn predicted_endpoint(entry: u64) -> usize {
    unpack(entry).0 as usize
}

/// Folds the first `n` tokens into a 64-bit CHWBL key.
fn token_prefix_key(tokens: &[TokenId], n: usize) -> u64 {
    tokens
        .iter()
        .take(n)
        .fold(0u64, |h, t| chain(h, u64::from(*t)))
}

impl Rule {
    pub(super) fn prepare_keys<V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        view: &V,
    ) {
        if !self.score_prompt(d, request, view) {
            // Nothing was scored: no endpoint's inventory figures either.
            d.overlaps.fill(Overlap::default());
            d.mismatched.fill(false);
            d.clears.fill(None);
            d.gpu_blocks.fill(None);
        }
    }

    /// The prompt's keys and every endpoint's overlap; false when it stops
    /// before scoring (nothing per endpoint is then written).
    fn score_prompt<V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        request: &Request<'_>,
        view: &V,
    ) -> bool {
        let n_prefix = self.config.thresholds.chwbl_prefix_tokens;
        d.affinity_key = request.session.map(|s| hash_bytes(s.as_bytes()));
        let kv = self.config.choice == Choice::KvExact;
        let result: Result<(), MissReason> = match request.prompt {
            PromptInput::Missing(m) => Err(m),
            PromptInput::Tokens([]) => Err(MissReason::EmptyPrompt),
            PromptInput::Tokens(tokens) => {
                d.prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
                d.affinity_key
                    .get_or_insert_with(|| token_prefix_key(tokens, n_prefix));
                match (&self.keys, kv, request.keys) {
                    (_, false, _) => Ok(()),
                    (None, true, _) => Err(MissReason::NoHasher),
                    // The host hashed these tokens already, under this contract.
                    (Some(_), true, Some((keys, c))) if c == &self.config.contract => {
                        d.keys.extend_from_slice(keys);
                        Ok(())
                    }
                    (Some(p), true, _) => p
                        .keys_with_extras(tokens, request.extras(), &mut d.keys)
                        .map_err(|e| {
                            tracing::debug!(rule = %self.config.name, error = %e, "prompt hashing failed");
                            match e {
                                KeysError::ExtraNotSupported { .. } => {
                                    MissReason::ExtrasUnsupported
                                }
                                KeysError::Hashing(_) => MissReason::HashError,
                            }
                        }),
                }
            }
            PromptInput::Keys {
                keys,
                contract,
                prompt_tokens,
            } => {
                d.prompt_tokens = prompt_tokens;
                if contract == &self.config.contract {
                    d.keys.extend_from_slice(keys);
                    let per_block = usize::try_from(self.config.block_size).unwrap_or(1).max(1);
                    let k = n_prefix.div_ceil(per_block).min(keys.len());
                    if let Some(key) = k.checked_sub(1).and_then(|i| keys.get(i)) {
                        d.affinity_key.get_or_insert(key.0);
                    }
                    Ok(())
                } else {
                    Err(MissReason::ContractMismatch)
                }
            }
        };
        if d.affinity_key.is_none() {
            d.affinity_key = request.text.map(|t| {
                let end = t.len().min(n_prefix.saturating_mul(4));
                hash_bytes(t.as_bytes().get(..end).unwrap_or_default())
            });
        }
        if !kv {
            return false;
        }
        if let Err(miss) = result {
            d.key_miss = Some(miss);
            return false;
        }
        if d.keys.is_empty() {
            d.key_miss = Some(MissReason::NoKeys);
            return false;
        }
        let slots = view.endpoint_count();
        let mapped = self
            .config
            .endpoints
            .iter()
            .any(|e| e.inventory_slot.is_some_and(|s| (s as usize) < slots));
        if !mapped {
            d.key_miss = Some(MissReason::NoInventory);
            return false;
        }
        // Endpoint `i` on slot `i` (the usual mapping): the view scores
        // straight into the decision's overlaps (`score` writes
        // `endpoint_count()` entries: exactly the decision's), or, with
        // slots kept free beyond the rule's endpoints, into the scratch
        // whose head is the decision's overlaps. Either way its runs scored
        // alike are the decision's (a run of slots alike is alike over its
        // first endpoints).
        let n = d.overlaps.len();
        let direct = self.identity_slots && slots == n;
        let head = self.identity_slots && slots > n;
        let scored = if direct {
            &mut d.overlaps
        } else {
            d.slot_scratch.clear();
            d.slot_scratch.resize(slots, Overlap::default());
            &mut d.slot_scratch
        };
        d.uniform.clear();
        if self.config.scorer.reads_any_position() {
            view.score(&d.keys, scored);
        } else if direct || head {
            d.uniform
                .resize(slots.div_ceil(kvroute_ingest::UNIFORM_RUN), false);
            view.score_prefix_uniform(&d.keys, scored, &mut d.uniform);
        } else {
            view.score_prefix(&d.keys, scored);
        }
        if head {
            if let Some(first) = d.slot_scratch.get(..n) {
                d.overlaps.copy_from_slice(first);
            }
        } else if !direct {
            for (o, e) in d.overlaps.iter_mut().zip(&self.config.endpoints) {
                *o = e
                    .inventory_slot
                    .and_then(|s| d.slot_scratch.get(s as usize))
                    .copied()
                    .unwrap_or_default();
            }
        }
        true
    }

    /// Reads what the view knows of each scored endpoint's inventory (the
    /// sample's, or every endpoint's): its contract status and clears
    /// ([`InventoryView::health`]) and the blocks its cache holds
    /// ([`InventoryView::gpu_blocks`]). Reading them for the scored
    /// endpoints only keeps a sampled decision's cost off the pool size.
    pub(super) fn read_scored<V: InventoryView + ?Sized>(&self, d: &mut Decision, view: &V) {
        if !d.sampled.is_empty() && d.explain.is_some() {
            // The explanation's rows of the endpoints left out show no
            // figures of an earlier decision.
            d.mismatched.fill(false);
        }
        let (mut slotted, mut mismatched) = (0usize, 0usize);
        for i in crate::pool::Visit::new(&d.sampled, d.gpu_blocks.len()) {
            let slot = self.slot(i, view);
            let health = self.health(i, view);
            if let Some(held) = d.gpu_blocks.get_mut(i) {
                *held = slot.and_then(|s| view.gpu_blocks(s));
            }
            if let Some(c) = d.clears.get_mut(i) {
                *c = Some(health.clears);
            }
            if let Some(x) = d.mismatched.get_mut(i) {
                *x = health.contract_mismatch;
            }
            slotted += usize::from(slot.is_some());
            mismatched += usize::from(health.contract_mismatch);
        }
        d.all_mismatched = slotted > 0 && mismatched == slotted;
    }

    /// The view's slot of endpoint `i`, if it has one there.
    fn slot<V: InventoryView + ?Sized>(&self, i: usize, view: &V) -> Option<usize> {
        let slot = self.config.endpoints.get(i)?.inventory_slot? as usize;
        (slot < view.endpoint_count()).then_some(slot)
    }

    /// Endpoint `i`'s inventory health; an endpoint without an inventory
    /// claims nothing (no mismatch, no clears).
    fn health<V: InventoryView + ?Sized>(&self, i: usize, view: &V) -> InventoryHealth {
        self.slot(i, view)
            .map_or_else(InventoryHealth::default, |s| view.health(s))
    }

    /// Credits each endpoint with the prompt prefix its predicted entries
    /// cover. Keys are chained (key `j` depends on every earlier block), so an
    /// entry for key `j` on endpoint `e` stands for the whole prefix `0..=j`.
    /// The walk stops at the first key no entry names.
    pub(super) fn speculate<V: InventoryView + ?Sized>(
        &self,
        d: &mut Decision,
        now: Duration,
        map: &BoundedMap<u64>,
        view: &V,
    ) {
        if self.config.predicted.capacity == 0 || d.keys.is_empty() {
            return;
        }
        if map.len() == 0 {
            return;
        }
        let n = self.config.endpoints.len();
        let stride = self.config.predicted.stride.max(1);
        let mut last: Option<(u32, InventoryHealth)> = None;
        for j in predicted_positions(d.keys.len(), stride) {
            let Some(entry) = d.keys.get(j).and_then(|k| map.get(k.0, now)) else {
                break;
            };
            let (e, clears) = unpack(entry);
            // Entries of one endpoint follow each other (a conversation's
            // blocks): its health is read once while the lock is held.
            let health = match last {
                Some((at, h)) if at == e => h,
                _ => {
                    let h = self.health(e as usize, view);
                    last = Some((e, h));
                    h
                }
            };
            // The engine dropped its cache since: the prediction is void.
            if health.clears as u32 != clears {
                continue;
            }
            if d.speculative.is_empty() {
                d.speculative.resize(n, 0);
            }
            // An engine whose keys provably differ never confirms a
            // prediction: crediting it would claim hits that cannot exist.
            if health.contract_mismatch {
                continue;
            }
            if let Some(x) = d.speculative.get_mut(e as usize) {
                *x = u32::try_from(j + 1).unwrap_or(u32::MAX);
            }
        }
    }

    /// Records that `endpoint` will hold the prompt's blocks soon, in `held`
    /// (the map the decision already locked) or else in the rule's map.
    pub(super) fn predict(
        &self,
        d: &Decision,
        endpoint: EndpointId,
        now: Duration,
        held: Option<&mut BoundedMap<u64>>,
    ) {
        let cfg = &self.config.predicted;
        if cfg.capacity == 0 || d.keys.is_empty() {
            return;
        }
        // An endpoint a retry added beyond the sample (the host's view is
        // not at hand then): its clears were not read, and an entry that
        // could outlive a clear is not recorded.
        let Some(clears) = d.clears.get(endpoint.index()).copied().flatten() else {
            return;
        };
        let entry = pack(endpoint.0, clears as u32);
        let keys = &d.keys[..d.keys.len().min(cfg.max_keys_per_request)];
        let mut locked;
        let map = match held {
            Some(m) => m,
            None => {
                locked = self.predicted.lock();
                &mut *locked
            }
        };
        for j in predicted_positions(keys.len(), cfg.stride.max(1)) {
            if let Some(k) = keys.get(j) {
                map.insert(k.0, entry, now);
            }
        }
    }
}
