//! TensorRT-LLM drains and their `.meta.json`: every drain decodes, and
//! replaying a directory's drains yields each meta's resident blocks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kvroute_ingest::KvEvent;
use serde_json::Value;

use super::GoldenReport;
use crate::events::trtllm::TrtllmDecoder;
use crate::events::DecodeStats;

fn tokens_per_block_near(drain: &Path) -> u32 {
    let meta = drain.with_extension("meta.json");
    std::fs::read(meta)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|m| m.get("tokens_per_block").and_then(Value::as_u64))
        .and_then(|t| u32::try_from(t).ok())
        .unwrap_or(0)
}

/// A drain alone: decodes cleanly and carries exactly the JSON's blocks.
pub(super) fn trtllm_drain(r: &mut GoldenReport, v: &Value, path: &Path) {
    let mut dec = TrtllmDecoder::new(tokens_per_block_near(path));
    let mut stats = DecodeStats::default();
    let batches = match dec.decode_value(v, &mut stats) {
        Ok(b) => b,
        Err(e) => return r.fail("decode drain", e),
    };
    let events = v.as_array().map(Vec::as_slice).unwrap_or_default();
    r.eq("one batch per event", events.len(), batches.len());
    r.eq(
        "skipped or malformed",
        (0, 0, 0),
        (
            stats.unknown_fields,
            stats.unknown_event_tags,
            stats.malformed_events,
        ),
    );
    for (i, (ev, b)) in events.iter().zip(&batches).enumerate() {
        r.eq(
            format!("event {i}: seq"),
            ev.get("event_id").and_then(Value::as_u64),
            Some(b.seq),
        );
        let rank = ev
            .get("attention_dp_rank")
            .and_then(Value::as_u64)
            .map(|x| x as u32);
        r.eq(format!("event {i}: rank"), rank, b.dp_rank);
        // Blocks (hash, tokens) as the JSON lists them vs as decoded.
        let want: Vec<(u64, Vec<u64>)> = ev
            .pointer("/data/blocks")
            .and_then(Value::as_array)
            .map(|blocks| {
                blocks
                    .iter()
                    .map(|bl| {
                        let h = bl
                            .get("block_hash")
                            .and_then(Value::as_u64)
                            .unwrap_or_default();
                        let toks = bl
                            .get("tokens")
                            .and_then(Value::as_array)
                            .map(|t| {
                                t.iter()
                                    .filter_map(|t| t.get("token_id").and_then(Value::as_u64))
                                    .collect()
                            })
                            .unwrap_or_default();
                        (h, toks)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut got = Vec::new();
        for e in &b.events {
            if let KvEvent::Stored(s) = e {
                let mut rest = s.token_ids.as_slice();
                for k in &s.keys {
                    let n = (s.block_size as usize).min(rest.len());
                    let (head, tail) = rest.split_at(n);
                    got.push((k.0, head.iter().map(|t| u64::from(*t)).collect::<Vec<_>>()));
                    rest = tail;
                }
            }
        }
        r.eq(format!("event {i}: stored blocks"), want, got);
        let removed: Vec<u64> = ev
            .pointer("/data/block_hashes")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let got_removed: Vec<u64> = b
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::Removed(x) => Some(x.keys.iter().map(|k| k.0)),
                _ => None,
            })
            .flatten()
            .collect();
        r.eq(format!("event {i}: removed blocks"), removed, got_removed);
    }
}

/// Replays every drain of the directory up to this case and compares the resident
/// set of full blocks and the per-block facts.
pub(super) fn trtllm_meta(r: &mut GoldenReport, v: &Value, path: &Path) {
    let Some(tpb) = v
        .get("tokens_per_block")
        .and_then(Value::as_u64)
        .and_then(|t| u32::try_from(t).ok())
    else {
        return r.fail("tokens_per_block", "missing");
    };
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let case = name.strip_suffix(".meta.json").unwrap_or(name).to_owned();
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let mut drains: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n.ends_with(".json")
                            && !n.ends_with(".meta.json")
                            && n <= format!("{case}.json").as_str()
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    drains.sort();
    let own = dir.join(format!("{case}.json"));
    r.check(
        "drain file exists",
        drains.last() == Some(&own),
        own.display().to_string(),
        drains.last(),
    );

    let mut dec = TrtllmDecoder::new(tpb);
    let mut resident: BTreeSet<u64> = BTreeSet::new();
    let mut last = Vec::new();
    for d in &drains {
        let bytes = match std::fs::read(d) {
            Ok(b) => b,
            Err(e) => return r.fail(format!("read {}", d.display()), e),
        };
        let mut stats = DecodeStats::default();
        match dec.decode_drain(&bytes, &mut stats) {
            Ok(batches) => {
                for b in &batches {
                    apply_resident(&mut resident, &b.events);
                }
                last = batches;
            }
            Err(e) => return r.fail(format!("decode {}", d.display()), e),
        }
    }
    if let Some(want) = v
        .get("resident_full_block_hashes_after")
        .and_then(Value::as_array)
    {
        let want: BTreeSet<u64> = want.iter().filter_map(Value::as_u64).collect();
        r.eq("resident full blocks after drain", want, resident.clone());
    }
    let checks = v
        .get("stored_blocks_check")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    // (hash → parent used for hashing (0 = none), tokens, full) as decoded.
    let mut facts = Vec::new();
    for b in &last {
        for e in &b.events {
            if let KvEvent::Stored(s) = e {
                let mut parent = s.parent.map_or(0, |p| p.0);
                let mut rest = s.token_ids.len();
                for (i, k) in s.keys.iter().enumerate() {
                    let n = (s.block_size as usize).min(rest);
                    rest -= n;
                    let full = !(s.partial_last_block && i + 1 == s.keys.len());
                    facts.push((k.0, parent, n as u64, full));
                    parent = k.0;
                }
            }
        }
    }
    for (i, c) in checks.iter().enumerate() {
        let want = (
            c.get("block_hash")
                .and_then(Value::as_u64)
                .unwrap_or_default(),
            c.get("parent_for_hashing")
                .and_then(Value::as_u64)
                .unwrap_or_default(),
            c.get("num_tokens")
                .and_then(Value::as_u64)
                .unwrap_or_default(),
            c.get("full_block")
                .and_then(Value::as_bool)
                .unwrap_or_default(),
        );
        let got = facts.iter().find(|f| f.0 == want.0).copied();
        r.eq(format!("stored block {i}"), Some(want), got);
    }
    if checks.is_empty() && v.get("resident_full_block_hashes_after").is_none() {
        // Nothing to replay against: at least the drain itself must check out.
        if let Ok(bytes) = std::fs::read(&own) {
            if let Ok(drain) = serde_json::from_slice::<Value>(&bytes) {
                trtllm_drain(r, &drain, &own);
            }
        }
    }
}

fn apply_resident(set: &mut BTreeSet<u64>, events: &[KvEvent]) {
    for e in events {
        match e {
            KvEvent::Stored(s) => {
                let full = if s.partial_last_block {
                    s.keys.len().saturating_sub(1)
                } else {
                    s.keys.len()
                };
                set.extend(s.keys.iter().take(full).map(|k| k.0));
            }
            KvEvent::Removed(x) => {
                for k in &x.keys {
                    set.remove(&k.0);
                }
            }
            KvEvent::Moved(_) => {}
            KvEvent::AllCleared => set.clear(),
        }
    }
}
