//! The engine-neutral ingest against vLLM 0.33.0's real event stream
//! (golden/vllm-events/v0.33.0: one publisher's history, seq 0..5, plus DP rank 1
//! and replay exchanges).

mod common;

use std::sync::Arc;

use common::{capture_rank, contract_attestor, load, vllm_batch};
use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_ingest::fuzzing::{check, Model};
use kvroute_ingest::ContractStatus;
use kvroute_ingest::{BlockRekeyer, XxhChainRekeyer};
use kvroute_ingest::{ClearReason, ReplayEnd, SeqAction};
use kvroute_ingest::{
    EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent, SharedIndex,
};

const EP: EndpointId = EndpointId(0);

fn engine_ingest() -> EndpointIngest {
    EndpointIngest::new(EP, IngestConfig::default(), Keying::Engine)
}

fn stored_keys(events: &[KvEvent]) -> Vec<BlockKey> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored(s) => Some(s.keys.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn removed_keys(events: &[KvEvent]) -> Vec<BlockKey> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Removed(r) => Some(r.keys.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn live_stream_matches_reference_model_step_by_step() {
    let batches = capture_rank(0);
    assert!(batches.len() >= 5, "capture has the 01..05 history");
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    let mut model = Model::new(IngestConfig::default().window);
    let mut saw_clear = false;
    for batch in &batches {
        let outcome = ingest.apply_batch(batch, &index);
        assert_eq!(outcome.action, model.decide(0, batch.dp_rank, batch));
        assert_eq!(outcome.action, SeqAction::Apply, "the capture is gap-free");
        model.apply(0, &batch.events);
        // check() compares refcounts of small keys only; compare real keys here.
        let mut want: Vec<BlockKey> = model
            .counts
            .keys()
            .filter(|(_, t, _)| *t == Medium::Gpu.index())
            .map(|(_, _, k)| BlockKey(*k))
            .collect();
        want.sort_unstable();
        assert_eq!(index.keys(EP, Medium::Gpu), want, "after seq {}", batch.seq);
        for k in stored_keys(&batch.events)
            .into_iter()
            .chain(removed_keys(&batch.events))
        {
            let want = model.counts.get(&(0, 0, k.0)).copied().unwrap_or(0);
            assert_eq!(u64::from(index.refcount(EP, k, Medium::Gpu)), want);
        }
        if batch.events.contains(&KvEvent::AllCleared) {
            saw_clear = true;
            if batch.events.len() == 1 {
                assert!(index.keys(EP, Medium::Gpu).is_empty());
            }
        }
        check(&index, &model, &[0]);
    }
    assert!(saw_clear);
    assert_eq!(ingest.seq_counters().in_order as usize, batches.len() - 1);
}

#[test]
fn evicted_blocks_leave_the_inventory() {
    let batches = capture_rank(0);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    let evict = batches
        .iter()
        .find(|b| !removed_keys(&b.events).is_empty() && !stored_keys(&b.events).is_empty())
        .expect("03_evict_then_store is in the capture");
    for b in batches.iter().take_while(|b| b.seq <= evict.seq) {
        let _ = ingest.apply_batch(b, &index);
    }
    for k in removed_keys(&evict.events) {
        assert!(!index.contains(EP, k, Medium::Gpu), "{k:?} was evicted");
    }
    for k in stored_keys(&evict.events) {
        assert!(index.contains(EP, k, Medium::Gpu), "{k:?} was stored");
    }
    assert_eq!(
        ingest.counters().writes.removed as usize,
        removed_keys(&evict.events).len()
    );
}

#[test]
fn duplicate_store_then_single_remove_keeps_the_block() {
    let fixture = load("vllm-events/v0.33.0/stream/05_duplicate_store_single_remove.json");
    let still_cached = fixture["still_cached_after_remove"].as_bool().unwrap();
    let batch = vllm_batch(0, &fixture["decoded_payload"]);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    let _ = ingest.apply_batch(&batch, &index);
    let stores = stored_keys(&batch.events);
    let removes = removed_keys(&batch.events);
    assert!(stores.len() == 2 && stores[0] == stores[1] && removes == stores[..1]);
    assert_eq!(index.contains(EP, stores[0], Medium::Gpu), still_cached);
    assert_eq!(ingest.counters().writes.duplicate_stores, 1);
    assert_eq!(ingest.counters().writes.still_referenced, 1);
    // The second copy's eviction removes it.
    let mut second = batch.clone();
    second.seq = 1;
    second.events.retain(|e| matches!(e, KvEvent::Removed(_)));
    let _ = ingest.apply_batch(&second, &index);
    assert!(!index.contains(EP, stores[0], Medium::Gpu));
}

fn fixture_contract() -> String {
    let f = load("vllm-events/v0.33.0/stream/01_store_prompt_two_blocks.json");
    let h = &f["hash"];
    format!(
        "vllm@{}:{}:block={}:seed={}",
        f["engine_version"].as_str().unwrap(),
        h["hash_algo"].as_str().unwrap(),
        h["hash_block_size"].as_u64().unwrap(),
        h["pythonhashseed"].as_str().unwrap()
    )
}

#[test]
fn attestation_verifies_every_block_under_the_engines_contract() {
    let batches = capture_rank(0);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest =
        engine_ingest().with_attestor(Arc::new(contract_attestor(&fixture_contract())));
    for b in &batches {
        let _ = ingest.apply_batch(b, &index);
    }
    let total: usize = batches.iter().map(|b| stored_keys(&b.events).len()).sum();
    let a = ingest.attest_counters();
    assert_eq!(a.mismatched_blocks, 0);
    assert_eq!(
        a.unverifiable_events, 0,
        "chained events use remembered digests"
    );
    assert_eq!(a.verified_blocks as usize, total);
    assert_eq!(
        ingest.contract_status(),
        ContractStatus::Verified {
            blocks: total as u64
        }
    );
}

#[test]
fn attestation_flags_a_wrong_seed_loudly() {
    let batches = capture_rank(0);
    let spec = fixture_contract().replace("seed=0", "seed=42");
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest().with_attestor(Arc::new(contract_attestor(&spec)));
    for b in &batches {
        let _ = ingest.apply_batch(b, &index);
    }
    let chained_events = batches
        .iter()
        .flat_map(|b| &b.events)
        .filter(|e| matches!(e, KvEvent::Stored(s) if s.parent.is_some()))
        .count();
    let a = ingest.attest_counters();
    assert_eq!(a.verified_blocks, 0);
    assert!(a.mismatched_blocks > 0);
    // A mismatched block leaves no digest to continue its chain from.
    assert_eq!(a.unverifiable_events as usize, chained_events);
    assert!(matches!(
        ingest.contract_status(),
        ContractStatus::Mismatch { .. }
    ));
}

#[test]
fn rekey_mode_keys_blocks_by_tokens_and_still_applies_removes() {
    let f1 = load("vllm-events/v0.33.0/stream/01_store_prompt_two_blocks.json");
    let f2 = load("vllm-events/v0.33.0/stream/02_store_third_block_after_decode.json");
    let mut tokens: Vec<u32> = f1["token_ids_of_request"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    tokens.extend(
        f2["appended_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32),
    );
    let rekeyer = XxhChainRekeyer::default();
    let mut internal = Vec::new();
    rekeyer.rekey(None, &tokens, 16, &mut internal);

    let batches = capture_rank(0);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(
        EP,
        IngestConfig::default(),
        Keying::Rekey(Arc::new(rekeyer)),
    );
    let _ = ingest.apply_batch(&batches[0], &index);
    let _ = ingest.apply_batch(&batches[1], &index);
    assert_eq!(index.keys(EP, Medium::Gpu).len(), 3);
    for k in &internal[..3] {
        assert!(index.contains(EP, *k, Medium::Gpu), "internal key {k:?}");
    }
    for k in stored_keys(&batches[0].events) {
        assert!(
            !index.contains(EP, k, Medium::Gpu),
            "engine keys are not stored"
        );
    }
    // Batch 2 evicts all three by engine key.
    let _ = ingest.apply_batch(&batches[2], &index);
    for k in &internal[..3] {
        assert!(!index.contains(EP, *k, Medium::Gpu));
    }
    assert_eq!(ingest.counters().remove_unmapped, 0);
    assert_eq!(ingest.counters().rekey_orphan_blocks, 0);
    for b in &batches[3..] {
        let _ = ingest.apply_batch(b, &index);
    }
    let c = ingest.counters();
    assert_eq!(c.remove_unmapped, 0);
    assert_eq!(
        c.writes.still_referenced, 1,
        "duplicate store + single remove"
    );
}

#[test]
fn rekeyer_reproduces_the_independent_python_vectors() {
    let v = load("rekey/kvroute_xxh3_chain_vectors.json");
    let rekeyer = XxhChainRekeyer {
        seed: v["xxh3_seed"].as_u64().unwrap(),
    };
    let vectors = v["vectors"].as_array().unwrap();
    assert!(!vectors.is_empty());
    for case in vectors {
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<BlockKey> = case["seq_hash_u64"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| BlockKey(k.as_u64().unwrap()))
            .collect();
        let mut got = Vec::new();
        let bs = case["kv_block_size"].as_u64().unwrap() as u32;
        rekeyer.rekey(None, &tokens, bs, &mut got);
        assert_eq!(got, want, "block size {bs}, {} tokens", tokens.len());
    }
}

#[test]
fn dp_ranks_have_independent_windows() {
    let rank0 = capture_rank(0);
    let rank1 = capture_rank(1);
    assert!(!rank1.is_empty() && rank1[0].dp_rank != rank0[0].dp_rank);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    for b in &rank0 {
        let _ = ingest.apply_batch(b, &index);
    }
    // Rank 1 starts at its own seq 0: a first batch, not a restart of rank 0.
    let outcome = ingest.apply_batch(&rank1[0], &index);
    assert_eq!(outcome.action, SeqAction::Apply);
    assert_eq!(ingest.seq_counters().restarts, 0);
    assert_eq!(ingest.seq_counters().first, 2);
}

#[test]
fn bootstrap_replay_after_buffer_overflow_applies_what_is_left() {
    let capture = load("vllm-events/v0.33.0/zmq_capture.json");
    let exchange = capture["replay_exchanges"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "dealer_start_seq_0_after_buffer_overflow")
        .unwrap();
    let live = capture_rank(0);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    let from = ingest.on_bootstrap(Some(0)).unwrap();
    let requested = exchange["request_frames_sent"][1]["as_u64_be"]
        .as_u64()
        .unwrap();
    assert_eq!(from, requested);
    let mut replayed = 0;
    for msg in exchange["reply_messages"].as_array().unwrap() {
        let seq = msg["frames"][2]["as_u64_be"].as_u64().unwrap();
        if seq == u64::MAX {
            ingest.on_replay_done(Some(0));
            break;
        }
        let batch = live.iter().find(|b| b.seq == seq).unwrap();
        let outcome = ingest.apply_batch(batch, &index);
        assert!(
            outcome.action.applies(),
            "replayed seq {seq}: {:?}",
            outcome.action
        );
        replayed += 1;
    }
    assert!(replayed > 0);
    let w = ingest.stream(Some(0)).unwrap();
    assert!(!w.replaying());
    // Live traffic that overlaps the replay is dropped, not a restart.
    let last = live.last().unwrap();
    assert!(matches!(
        ingest.apply_batch(last, &index).action,
        SeqAction::Drop(_)
    ));
    assert_eq!(ingest.seq_counters().replays_done, 1);
}

/// The capture up to the batch after which the inventory is largest (the full
/// capture ends with everything evicted).
fn fullest_prefix(batches: Vec<EventBatch>) -> Vec<EventBatch> {
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    let mut best = (0, 0);
    for (i, b) in batches.iter().enumerate() {
        let _ = ingest.apply_batch(b, &index);
        best = best.max((index.inventory(EP).total(), i));
    }
    batches[..=best.1].to_vec()
}

#[test]
fn resume_keeps_the_captured_inventory_when_the_engine_replays_our_last_batch() {
    let batches = fullest_prefix(capture_rank(0));
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    for b in &batches {
        let _ = ingest.apply_batch(b, &index);
    }
    let held = index.inventory(EP);
    assert!(held.total() > 0);
    let last = batches.last().unwrap();
    assert_eq!(ingest.on_resume(Some(0)), Some(last.seq));
    // Same process: its replay starts with the identical batch.
    let outcome = ingest.apply_batch(last, &index);
    assert!(matches!(outcome.action, SeqAction::Drop(_)));
    assert!(ingest
        .on_replay_finished(Some(0), true, &index)
        .eq(&ReplayEnd::Continue));
    assert_eq!(index.inventory(EP), held);
    assert_eq!(ingest.seq_counters().resumes_verified, 1);
}

#[test]
fn resume_clears_when_a_restarted_engine_numbers_another_batch_like_our_last() {
    let batches = fullest_prefix(capture_rank(0));
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = engine_ingest();
    for b in &batches {
        let _ = ingest.apply_batch(b, &index);
    }
    let last = batches.last().unwrap();
    assert_eq!(ingest.on_resume(Some(0)), Some(last.seq));
    // The new process's batch with our last number: its first captured batch,
    // renumbered.
    let mut impostor = batches[0].clone();
    impostor.seq = last.seq;
    let outcome = ingest.apply_batch(&impostor, &index);
    assert_eq!(
        outcome.action,
        SeqAction::ClearThenApply(ClearReason::Restart)
    );
    let mut model = Model::new(IngestConfig::default().window);
    model.apply(EP.0, &impostor.events);
    check(&index, &model, &[EP.0]);

    // An empty complete replay after a resume clears too.
    assert!(ingest.on_resume(Some(0)).is_some());
    let verdict = ingest.on_replay_finished(Some(0), true, &index);
    assert_eq!(verdict, ReplayEnd::Clear(ClearReason::Restart));
    assert_eq!(index.inventory(EP).total(), 0);
    assert_eq!(ingest.seq_counters().resume_restarts, 2);
}
