//! Every KV-event fixture under `golden/{vllm,sglang,trtllm}-events` passes the
//! golden checker, plus negative tests on the same real payloads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvroute_core::BlockKey;
use kvroute_engines::events::golden::{self, Format};
use kvroute_engines::events::trtllm::TrtllmDecoder;
use kvroute_engines::events::{sglang, vllm, DecodeError, DecodeStats};
use kvroute_ingest::KvEvent;
use serde_json::Value;

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden")
}

fn json_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            json_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "json") {
            out.push(p);
        }
    }
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Checks every JSON file of one engine directory; returns files per format.
fn check_all(engine_dir: &str, not_fixtures: &[&str]) -> BTreeMap<String, usize> {
    let mut files = Vec::new();
    json_files(&golden_dir().join(engine_dir), &mut files);
    let mut counts = BTreeMap::new();
    let mut failed = Vec::new();
    for f in &files {
        let name = f.file_name().unwrap().to_str().unwrap();
        if not_fixtures.contains(&name) {
            assert_eq!(
                golden::detect(&read_json(f)),
                None,
                "{name} is not an event fixture"
            );
            *counts.entry("not a fixture".to_string()).or_default() += 1;
            continue;
        }
        let report = golden::check_file(f);
        if !report.passed() {
            failed.push(report.to_string());
        }
        *counts.entry(format!("{:?}", report.format)).or_default() += 1;
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    counts
}

fn counts(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, v)| ((*k).to_string(), *v)).collect()
}

#[test]
fn every_vllm_fixture_passes() {
    assert_eq!(
        check_all("vllm-events", &[]),
        counts(&[("Some(VllmEvents)", 12), ("Some(VllmZmqCapture)", 1)])
    );
}

#[test]
fn every_sglang_fixture_passes() {
    assert_eq!(
        check_all("sglang-events", &[]),
        counts(&[
            ("Some(SglangEvents)", 26),
            ("Some(StreamIndex)", 4),
            ("Some(SglangZmqCapture)", 1),
        ])
    );
}

#[test]
fn every_trtllm_fixture_passes() {
    assert_eq!(
        check_all(
            "trtllm-events",
            &[
                "hash_vectors_v1_block_key.json",
                "hash_vectors_v1_block_key_empty_values.json"
            ]
        ),
        counts(&[
            ("Some(TrtllmDrain)", 9),
            ("Some(TrtllmMeta)", 9),
            ("not a fixture", 2),
        ])
    );
}

#[test]
fn the_checker_catches_a_wrong_expectation() {
    let path =
        golden_dir().join("vllm-events/v0.33.0/stream/02_store_third_block_after_decode.json");
    let mut v = read_json(&path);
    v["decoded_payload"][1][0]["block_hashes"][0] = Value::from(1u64);
    let report = golden::check(&v, &path);
    assert_eq!(report.format, Some(Format::VllmEvents));
    assert!(!report.passed());
    assert!(
        report.failures.iter().any(|f| f.what.contains("event 0")),
        "{report}"
    );
    let core = report.to_core();
    assert!(!core.is_clean());
    assert_eq!(core.passed + core.failed(), report.checks);
    let clean = golden::check_file(&path).to_core();
    assert!(clean.is_clean() && clean.passed > 0, "{}", clean.summary());

    let meta = golden_dir().join("trtllm-events/classic/06_eviction_removed_coalesced.meta.json");
    let mut m = read_json(&meta);
    m["resident_full_block_hashes_after"] = serde_json::json!([1]);
    assert!(!golden::check(&m, &meta).passed());
}

/// Payload files of one engine directory (vLLM `.msgpack` next to a fixture).
fn payloads(engine_dir: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    json_files(&golden_dir().join(engine_dir), &mut files);
    files
        .into_iter()
        .filter(|f| f.with_extension("msgpack").exists())
        .map(|f| {
            let p = f.with_extension("msgpack");
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

type Decode = fn(&[u8], u64, &mut DecodeStats) -> Result<kvroute_ingest::EventBatch, DecodeError>;

fn truncations_and_flips(engine_dir: &str, decode: Decode, expected_files: usize) {
    let files = payloads(engine_dir);
    assert_eq!(files.len(), expected_files);
    for (path, bytes) in &files {
        let mut stats = DecodeStats::default();
        decode(bytes, 0, &mut stats).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for cut in 0..bytes.len() {
            let mut s = DecodeStats::default();
            assert!(
                decode(&bytes[..cut], 0, &mut s).is_err(),
                "{} cut at {cut} decoded",
                path.display()
            );
            assert_eq!(s.malformed_payloads, 1);
            assert_eq!(s.batches, 0);
        }
        // One extra byte is rejected too.
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(
            decode(&longer, 0, &mut DecodeStats::default()),
            Err(DecodeError::TrailingBytes { count: 1, .. })
        ));
        for i in 0..bytes.len() {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= mask;
                let mut s = DecodeStats::default();
                match decode(&b, 0, &mut s) {
                    Ok(_) => assert_eq!((s.batches, s.malformed_payloads), (1, 0)),
                    Err(_) => assert_eq!((s.batches, s.malformed_payloads), (0, 1)),
                }
            }
        }
    }
}

#[test]
fn vllm_truncated_or_flipped_payloads_never_panic() {
    truncations_and_flips("vllm-events", vllm::decode, 12);
}

#[test]
fn sglang_truncated_or_flipped_payloads_never_panic() {
    truncations_and_flips("sglang-events", sglang::decode, 26);
}

#[test]
fn trtllm_truncated_drains_are_errors() {
    let mut files = Vec::new();
    json_files(&golden_dir().join("trtllm-events"), &mut files);
    let drains: Vec<_> = files
        .iter()
        .filter(|f| golden::detect(&read_json(f)) == Some(Format::TrtllmDrain))
        .collect();
    assert_eq!(drains.len(), 9);
    for f in drains {
        let bytes = std::fs::read(f).unwrap();
        let body = bytes.trim_ascii_end();
        let step = (body.len() / 200).max(1);
        for cut in (0..body.len()).step_by(step) {
            let mut s = DecodeStats::default();
            assert!(TrtllmDecoder::new(32)
                .decode_drain(&body[..cut], &mut s)
                .is_err());
            assert_eq!(s.malformed_payloads, 1);
        }
        for i in (0..body.len()).step_by(step) {
            let mut b = body.to_vec();
            b[i] ^= 0x04;
            let _ = TrtllmDecoder::new(32).decode_drain(&b, &mut DecodeStats::default());
        }
    }
}

#[test]
fn bin_hashes_route_like_int_hashes() {
    // VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the 32-byte digest's last 8 bytes,
    // big-endian, are the key the int mode publishes.
    let path = golden_dir().join("vllm-events/v0.33.0/standalone/12_bytes_block_hashes");
    let fixture = read_json(&path.with_extension("json"));
    let digest = fixture["decoded_payload"][1][0]["block_hashes"][0]["bytes_hex"]
        .as_str()
        .unwrap();
    let tail = hex::decode(&digest[48..]).unwrap();
    let want = BlockKey(u64::from_be_bytes(tail.try_into().unwrap()));

    let bytes = std::fs::read(path.with_extension("msgpack")).unwrap();
    let batch = vllm::decode(&bytes, 0, &mut DecodeStats::default()).unwrap();
    let (KvEvent::Stored(first), KvEvent::Stored(second)) = (&batch.events[0], &batch.events[1])
    else {
        panic!("expected two stores: {:?}", batch.events);
    };
    assert_eq!(first.keys, vec![want]);
    assert_eq!(second.parent, Some(want));
}

#[test]
fn sglang_i64_and_u64_hashes_keep_their_bits() {
    // 0.5.16 stream: -8240527162454267520 arrives as int64 (0xd3).
    let bytes =
        std::fs::read(golden_dir().join("sglang-events/v0.5.16/03_store_then_evict.msgpack"))
            .unwrap();
    assert!(bytes
        .windows(9)
        .any(|w| w[0] == 0xd3
            && i64::from_be_bytes(w[1..9].try_into().unwrap()) == -8240527162454267520));
    let batch = sglang::decode(&bytes, 3, &mut DecodeStats::default()).unwrap();
    let KvEvent::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.keys, vec![BlockKey::from_i64(-8240527162454267520)]);
    let KvEvent::Removed(r) = &batch.events[2] else {
        panic!()
    };
    assert_eq!(r.keys[0], BlockKey::from_i64(-8240527162454267520));
}

#[test]
fn sglang_cpu_pinned_is_the_host_tier() {
    let bytes = std::fs::read(
        golden_dir().join("sglang-events/v0.5.23/stream/06_host_tier_then_gpu_evict.msgpack"),
    )
    .unwrap();
    let batch = sglang::decode(&bytes, 6, &mut DecodeStats::default()).unwrap();
    let KvEvent::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.medium, kvroute_core::Medium::Cpu);
    assert_eq!(s.token_ids.len(), s.keys.len() * s.block_size as usize);
}

fn trtllm_drain(name: &str) -> Vec<u8> {
    std::fs::read(golden_dir().join("trtllm-events").join(name)).unwrap()
}

#[test]
fn trtllm_partial_block_and_high_hashes() {
    let mut dec = TrtllmDecoder::new(32);
    let mut stats = DecodeStats::default();
    let b = dec
        .decode_drain(
            &trtllm_drain("classic/03_release_stores_rest_incl_partial.json"),
            &mut stats,
        )
        .unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].seq, 2);
    let KvEvent::Stored(s) = &b[0].events[0] else {
        panic!()
    };
    assert!(s.partial_last_block);
    assert_eq!((s.token_ids.len(), s.block_size), (13, 32));
    // 13121859508051604645 > 2^63.
    assert_eq!(s.parent, Some(BlockKey(13121859508051604645)));
}

#[test]
fn trtllm_created_updated_and_dp_ranks() {
    let mut dec = TrtllmDecoder::new(32);
    let mut stats = DecodeStats::default();
    let b = dec
        .decode_drain(&trtllm_drain("classic/01_startup_created.json"), &mut stats)
        .unwrap();
    assert_eq!((b.len(), b[0].events.len()), (1, 0));
    assert_eq!(dec.capacity(), Some(&[7454u64, 2048][..]));
    assert_eq!(stats.capacity_events, 1);

    let b = dec
        .decode_drain(
            &trtllm_drain("classic/07_offload_updated_cache_level.json"),
            &mut stats,
        )
        .unwrap();
    assert_eq!(
        b[0].events,
        vec![KvEvent::Moved(kvroute_ingest::BlockMoved {
            key: BlockKey(6281115329494198917),
            from: kvroute_core::Medium::Gpu,
            to: kvroute_core::Medium::Cpu,
            group: 0,
        })]
    );

    let b = TrtllmDecoder::new(32)
        .decode_drain(
            &trtllm_drain("classic/08_attention_dp_two_ranks.json"),
            &mut stats,
        )
        .unwrap();
    let ids: Vec<_> = b.iter().map(|x| (x.dp_rank, x.seq)).collect();
    assert_eq!(
        ids,
        vec![(Some(0), 0), (Some(0), 1), (Some(1), 0), (Some(1), 1)]
    );
}

#[test]
fn trtllm_keeps_only_the_largest_window() {
    let body = br#"[
      {"event_id": 0, "window_size": 512, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]}},
      {"event_id": 1, "window_size": 8192, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]}},
      {"event_id": 2, "window_size": 512, "data": {"type": "removed", "block_hashes": [1]}},
      {"event_id": 3, "window_size": 8192, "data": {"type": "removed", "block_hashes": [2]}}
    ]"#;
    let mut dec = TrtllmDecoder::new(32);
    let mut stats = DecodeStats::default();
    let b = dec.decode_drain(body, &mut stats).unwrap();
    assert_eq!(
        b.iter().map(|x| x.seq).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert!(b[2].events.is_empty());
    assert_eq!(b[3].events.len(), 1);
    assert_eq!(stats.smaller_window_events, 2);
    assert_eq!(dec.largest_window(), Some(8192));
    // The window is remembered across drains.
    let later = br#"[{"event_id": 4, "window_size": 512, "data": {"type": "removed", "block_hashes": [3]}}]"#;
    assert!(dec.decode_drain(later, &mut stats).unwrap()[0]
        .events
        .is_empty());
}

#[test]
fn trtllm_malformed_event_keeps_its_sequence_slot() {
    let body = br#"[
      {"event_id": 7, "data": {"type": "removed", "block_hashes": [-1]}},
      {"event_id": 8, "data": {"type": "teleported"}},
      {"data": {"type": "removed", "block_hashes": [1]}},
      {"event_id": 9, "extra": true, "data": {"type": "removed", "block_hashes": [5]}}
    ]"#;
    let mut stats = DecodeStats::default();
    let b = TrtllmDecoder::new(32)
        .decode_drain(body, &mut stats)
        .unwrap();
    assert_eq!(b.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![7, 8, 9]);
    assert!(b[0].events.is_empty() && b[1].events.is_empty());
    assert_eq!(b[2].events.len(), 1);
    assert_eq!(
        (
            stats.malformed_events,
            stats.unknown_event_tags,
            stats.unknown_fields
        ),
        (2, 1, 1)
    );
}
