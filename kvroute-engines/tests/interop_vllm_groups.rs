//! Events vLLM 0.33 publishes beyond a single full-attention group, encoded by
//! vLLM's own classes and encoder (`tests/python/vllm_group_events.py`),
//! decoded and applied as an endpoint's ingest does:
//!
//! * a hybrid model whose first layer uses a sliding window (Gemma 3,
//!   gpt-oss): vLLM numbers its groups in first-layer order, so group 0 is a
//!   sliding-window group and the full-attention group comes after; the
//!   inventory must follow the full-attention group;
//! * the offloading connector's placeholder stores (no token ids, block size
//!   0, `medium` CPU or STORAGE): keys of the host and disk tiers, with
//!   nothing to check against the contract.

mod interop_support;

use std::ffi::OsStr;

use interop_support::transformers::run_json;
use kvroute_core::{BlockKey, EndpointId, Medium};
use kvroute_engines::events::{vllm, DecodeStats};
use kvroute_ingest::{
    ContractStatus, EndpointIngest, EventBatch, IndexConfig, IngestConfig, Keying, KvEvent,
    SharedIndex,
};
use serde_json::{json, Value};

/// Each batch of `batches` encoded by vLLM, decoded by kvroute.
fn vllm_batches(batches: &Value) -> Vec<EventBatch> {
    let hex: Vec<String> =
        serde_json::from_value(run_json("vllm_group_events.py", &[], batches)).unwrap();
    hex.iter()
        .enumerate()
        .map(|(seq, h)| {
            let bytes = hex::decode(h).unwrap();
            let mut stats = DecodeStats::default();
            let batch = vllm::decode(&bytes, seq as u64, &mut stats).unwrap();
            assert_eq!(
                (
                    stats.malformed_events,
                    stats.unknown_fields,
                    stats.unknown_media
                ),
                (0, 0, 0),
                "{stats:?}"
            );
            batch
        })
        .collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, group: u32, kind: &str) -> Value {
    let tokens: Vec<u64> = (0..hashes.len() as u64 * 16).collect();
    json!({"type": "stored", "hashes": hashes, "parent": parent, "tokens": tokens,
        "block_size": 16, "medium": "GPU", "group": group, "kind": kind})
}

fn removed(hashes: &[u64], group: u32) -> Value {
    json!({"type": "removed", "hashes": hashes, "medium": "GPU", "group": group})
}

/// The offloading connector's store of one block's copy in `medium`.
fn placeholder(hash: u64, medium: &str) -> Value {
    json!({"type": "placeholder", "hash": hash, "medium": medium, "group": 0})
}

/// The removal of the copies in `medium` (group 0).
fn removed_from(hashes: &[u64], medium: &str) -> Value {
    json!({"type": "removed", "hashes": hashes, "medium": medium, "group": 0})
}

fn ingest_all(batches: &[EventBatch], config: IngestConfig) -> (SharedIndex, EndpointIngest) {
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(EndpointId(0), config, Keying::Engine);
    for b in batches {
        let _ = ingest.apply_batch(b, &index);
    }
    (index, ingest)
}

fn held(index: &SharedIndex, medium: Medium) -> Vec<u64> {
    (1..=8)
        .filter(|k| index.contains(EndpointId(0), BlockKey(*k), medium))
        .collect()
}

#[test]
fn every_vllm_attention_kind_is_classified() {
    let kinds: Vec<String> = serde_json::from_value(run_json(
        "vllm_group_events.py",
        &[OsStr::new("--kinds")],
        &Value::Null,
    ))
    .unwrap();
    assert!(kinds.len() >= 10, "{kinds:?}");
    let batch: Vec<Value> = kinds.iter().map(|k| stored(&[1], None, 0, k)).collect();
    let decoded = vllm_batches(&json!([batch]));
    for (kind, event) in kinds.iter().zip(&decoded[0].events) {
        let KvEvent::Stored(s) = event else {
            panic!("{event:?}")
        };
        let want = match kind.as_str() {
            "full_attention" | "mla_attention" | "sink_full_attention" => Some(true),
            "unknown" => None,
            // Every other kind vLLM names: none holds a whole prefix.
            "sliding_window"
            | "sliding_window_mla"
            | "chunked_local_attention"
            | "mamba"
            | "encoder_only_attention"
            | "cross_attention" => Some(false),
            other => panic!("vLLM names a kind this test does not know: {other}"),
        };
        assert_eq!(s.full_attention, want, "{kind}");
    }
}

#[test]
fn a_hybrid_model_is_scored_on_its_full_attention_group() {
    // Gemma 3's layout: group 0 (sliding window) stores the prompt's blocks
    // and frees those before its window; group 1 (full attention) keeps all.
    let batches = vllm_batches(&json!([
        [
            stored(&[1, 2, 3, 4], None, 0, "sliding_window"),
            stored(&[1, 2, 3, 4], None, 1, "full_attention"),
        ],
        [removed(&[1, 2], 0)],
        [
            stored(&[5], Some(4), 0, "sliding_window"),
            stored(&[5], Some(4), 1, "full_attention"),
        ],
        [removed(&[3], 0), removed(&[5], 1)],
    ]));
    let (index, ingest) = ingest_all(&batches, IngestConfig::default());
    assert_eq!(held(&index, Medium::Gpu), vec![1, 2, 3, 4]);
    // Group 0's three stores and two removes are another group's.
    assert_eq!(ingest.counters().other_group_events, 4);

    // A single-group model (group 0, full attention) is scored as before.
    let batches = vllm_batches(&json!([
        [stored(&[1, 2, 3], None, 0, "full_attention")],
        [removed(&[2], 0)],
    ]));
    let (index, _) = ingest_all(&batches, IngestConfig::default());
    assert_eq!(held(&index, Medium::Gpu), vec![1, 3]);
}

#[test]
fn offloading_placeholders_fill_the_host_and_disk_tiers_and_check_nothing() {
    let batches = vllm_batches(&json!([
        [stored(&[1, 2, 3], None, 0, "full_attention")],
        [
            placeholder(1, "CPU"),
            placeholder(2, "CPU"),
            placeholder(3, "STORAGE")
        ],
        [removed_from(&[2], "CPU")],
    ]));
    let config = IngestConfig {
        expected_block_size: Some(16),
        ..IngestConfig::default()
    };
    let (index, ingest) = ingest_all(&batches, config);
    assert_eq!(held(&index, Medium::Gpu), vec![1, 2, 3]);
    assert_eq!(held(&index, Medium::Cpu), vec![1]);
    assert_eq!(held(&index, Medium::Disk), vec![3]);
    assert_eq!(ingest.counters().block_size_mismatches, 0);
    assert!(
        !matches!(ingest.contract_status(), ContractStatus::Mismatch { .. }),
        "{:?}",
        ingest.contract_status()
    );
}

/// The same offloading under a `rekey` contract: a placeholder names the
/// engine key of a block re-keyed from its tokens before, so it lands in
/// its tier under that block's internal key; removing the host copy leaves
/// the device copy mapped, so the device copy's removal still finds it.
#[test]
fn offloading_placeholders_under_rekey_keep_each_tiers_copy_apart() {
    use kvroute_ingest::{BlockRekeyer, XxhChainRekeyer};
    let batches = vllm_batches(&json!([
        [stored(&[1, 2, 3], None, 0, "full_attention")],
        [
            placeholder(1, "CPU"),
            placeholder(2, "CPU"),
            placeholder(9, "CPU")
        ],
        [removed_from(&[1, 2], "CPU")],
        [removed(&[2], 0)],
    ]));
    let rekeyer = XxhChainRekeyer { seed: 5 };
    let tokens: Vec<u32> = (0..48).collect();
    let mut internal = Vec::new();
    rekeyer.rekey(None, &tokens, 16, &mut internal);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(
        EndpointId(0),
        IngestConfig::default(),
        Keying::Rekey(std::sync::Arc::new(rekeyer)),
    );
    let held = |index: &SharedIndex, medium| -> Vec<usize> {
        (0..3)
            .filter(|i| index.contains(EndpointId(0), internal[*i], medium))
            .collect()
    };
    let mut apply = |b: &EventBatch| {
        let _ = ingest.apply_batch(b, &index);
    };
    apply(&batches[0]);
    apply(&batches[1]);
    assert_eq!(held(&index, Medium::Gpu), [0, 1, 2]);
    assert_eq!(
        held(&index, Medium::Cpu),
        [0, 1],
        "the copies of blocks 1 and 2"
    );
    apply(&batches[2]);
    assert_eq!(held(&index, Medium::Cpu), Vec::<usize>::new());
    assert_eq!(held(&index, Medium::Gpu), [0, 1, 2]);
    apply(&batches[3]);
    assert_eq!(
        held(&index, Medium::Gpu),
        [0, 2],
        "block 2's device copy removed"
    );
    let c = ingest.counters();
    assert_eq!((c.rekey_untokenized_blocks, c.remove_unmapped), (1, 0));
}
