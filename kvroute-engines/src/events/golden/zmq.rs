//! ZeroMQ captures and stream indexes: frame sets, live messages, replay
//! replies and the cases a stream lists.

use std::path::Path;

use serde_json::Value;

use super::payload::payload_matches;
use super::{check_file, decode, unhex, Engine, Format, GoldenFailure, GoldenReport};
use crate::events::{DecodeStats, LiveMessage, ReplayReply};

fn frames_of(v: &Value) -> Option<Vec<Vec<u8>>> {
    v.as_array()?
        .iter()
        .map(|f| {
            let b = unhex(f.get("hex")?.as_str()?)?;
            match f.get("len").and_then(Value::as_u64) {
                Some(n) if n != b.len() as u64 => None,
                _ => Some(b),
            }
        })
        .collect()
}

/// Checks live messages; returns (seq, payload) of each for replay comparison.
fn live_messages(
    r: &mut GoldenReport,
    engine: Engine,
    name: &str,
    msgs: &[Value],
) -> Vec<(u64, Vec<u8>)> {
    let mut seen = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("{name}[{i}]");
        let Some(frames) = m.get("frames").and_then(frames_of) else {
            r.fail(format!("{at}: frames"), "missing or bad hex/len");
            continue;
        };
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        match LiveMessage::parse(&refs) {
            Ok(msg) => {
                if let Some(want) = m.get("seq").and_then(Value::as_u64) {
                    r.eq(format!("{at}: seq"), want, msg.seq);
                }
                if let Some(want) = m.pointer("/frames/1/as_u64_be").and_then(Value::as_u64) {
                    r.eq(format!("{at}: seq frame"), want, msg.seq);
                }
                let prev = seen.last().map(|(s, _): &(u64, Vec<u8>)| *s);
                r.eq(
                    format!("{at}: seq follows"),
                    prev.map_or(0, |p| p + 1),
                    msg.seq,
                );
                r.check(
                    format!("{at}: topic is UTF-8"),
                    std::str::from_utf8(msg.topic).is_ok(),
                    "utf-8",
                    msg.topic,
                );
                match m.get("decoded_payload") {
                    Some(exp) => payload_matches(r, &at, engine, msg.payload, msg.seq, exp, None),
                    None => r.fail(format!("{at}: decoded_payload"), "missing"),
                }
                seen.push((msg.seq, msg.payload.to_vec()));
            }
            Err(e) => r.fail(format!("{at}: parse"), e),
        }
    }
    seen
}

fn replay_replies(
    r: &mut GoldenReport,
    engine: Engine,
    at: &str,
    start: Option<u64>,
    replies: &[Vec<Vec<u8>>],
    live: &[(u64, Vec<u8>)],
) {
    for (j, frames) in replies.iter().enumerate() {
        let at = format!("{at} reply {j}");
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        match ReplayReply::parse(&refs) {
            Ok(ReplayReply::End) => {
                r.eq(format!("{at}: end marker is last"), replies.len() - 1, j);
            }
            Ok(ReplayReply::Batch(msg)) => {
                if let Some(start) = start {
                    r.check(
                        format!("{at}: seq >= start"),
                        msg.seq >= start,
                        start,
                        msg.seq,
                    );
                }
                let original = live
                    .iter()
                    .find(|(s, _)| *s == msg.seq)
                    .map(|(_, p)| p.as_slice());
                r.eq(
                    format!("{at}: payload equals live seq {}", msg.seq),
                    Some(msg.payload),
                    original,
                );
                let mut stats = DecodeStats::default();
                if let Err(e) = decode(engine, msg.payload, msg.seq, &mut stats) {
                    r.fail(format!("{at}: decode"), e);
                }
            }
            Err(e) => r.fail(format!("{at}: parse"), e),
        }
    }
}

fn start_seq(frames: &[Vec<u8>]) -> Option<u64> {
    // Big-endian of any length, as the publishers parse it.
    let f = frames.last()?;
    (f.len() <= 8).then(|| f.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
}

pub(super) fn vllm_capture(r: &mut GoldenReport, v: &Value) {
    let mut live_all = Vec::new();
    for name in ["live_messages_rank0", "live_messages_rank1"] {
        let msgs = v
            .get(name)
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        r.check(
            format!("{name}: present"),
            !msgs.is_empty(),
            "messages",
            msgs.len(),
        );
        let live = live_messages(r, Engine::Vllm, name, msgs);
        if name == "live_messages_rank0" {
            live_all = live;
        }
    }
    let exchanges = v
        .get("replay_exchanges")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    r.check(
        "replay_exchanges: present",
        !exchanges.is_empty(),
        "exchanges",
        exchanges.len(),
    );
    for (i, ex) in exchanges.iter().enumerate() {
        let name = ex.get("name").and_then(Value::as_str).unwrap_or("?");
        let at = format!("replay {i} ({name})");
        let Some(req) = ex.get("request_frames_sent").and_then(frames_of) else {
            r.fail(format!("{at}: request frames"), "missing");
            continue;
        };
        let replies: Option<Vec<Vec<Vec<u8>>>> = ex
            .get("reply_messages")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|m| m.get("frames").and_then(frames_of))
                    .collect::<Option<_>>()
            })
            .unwrap_or(None);
        let Some(replies) = replies else {
            r.fail(format!("{at}: reply frames"), "missing or bad");
            continue;
        };
        // A well-formed DEALER request is [delimiter, start]; the REQ socket adds the
        // delimiter itself. Anything else gets no reply.
        let dealer = ex.get("client_socket").and_then(Value::as_str) == Some("DEALER");
        let well_formed = if dealer {
            req.len() == 2 && req.first().is_some_and(Vec::is_empty)
        } else {
            req.len() == 1
        };
        if !well_formed {
            r.eq(
                format!("{at}: malformed request gets no reply"),
                0,
                replies.len(),
            );
            continue;
        }
        replay_replies(r, Engine::Vllm, &at, start_seq(&req), &replies, &live_all);
        if dealer {
            let last_is_end = replies
                .last()
                .map(|f| f.iter().map(Vec::as_slice).collect::<Vec<_>>())
                .is_some_and(|f| ReplayReply::parse(&f) == Ok(ReplayReply::End));
            r.check(
                format!("{at}: DEALER sees the end marker"),
                last_is_end,
                true,
                last_is_end,
            );
        }
    }
}

pub(super) fn sglang_capture(r: &mut GoldenReport, v: &Value) {
    let msgs = v
        .get("live_sub_frames")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    r.check(
        "live_sub_frames: present",
        !msgs.is_empty(),
        "messages",
        msgs.len(),
    );
    let live = live_messages(r, Engine::Sglang, "live_sub_frames", msgs);
    let req = v.pointer("/replay_request/frames_sent").and_then(frames_of);
    let replies: Option<Vec<Vec<Vec<u8>>>> = v
        .get("replay_reply_frames_as_seen_by_DEALER")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(frames_of).collect::<Option<_>>())
        .unwrap_or(None);
    match (req, replies) {
        (Some(req), Some(replies)) => {
            r.check(
                "replay: replies present",
                !replies.is_empty(),
                "replies",
                replies.len(),
            );
            replay_replies(
                r,
                Engine::Sglang,
                "replay",
                start_seq(&req),
                &replies,
                &live,
            );
            let last_is_end = replies
                .last()
                .map(|f| f.iter().map(Vec::as_slice).collect::<Vec<_>>())
                .is_some_and(|f| ReplayReply::parse(&f) == Ok(ReplayReply::End));
            r.check(
                "replay: ends with the end marker",
                last_is_end,
                true,
                last_is_end,
            );
        }
        _ => r.fail("replay frames", "missing or bad"),
    }
}

pub(super) fn stream_index(r: &mut GoldenReport, v: &Value, dir: &Path) {
    let batches = v
        .get("batches")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    r.check(
        "batches: present",
        !batches.is_empty(),
        "batches",
        batches.len(),
    );
    for (i, b) in batches.iter().enumerate() {
        let at = format!("batch {i}");
        let (Some(seq), Some(case)) = (
            b.get("seq").and_then(Value::as_u64),
            b.get("case").and_then(Value::as_str),
        ) else {
            r.fail(format!("{at}: seq/case"), "missing");
            continue;
        };
        r.eq(format!("{at}: seq in order"), i as u64, seq);
        let sub = check_file(&dir.join(format!("{case}.json")));
        r.checks += sub.checks;
        r.eq(
            format!("{at}: fixture format"),
            Some(Format::SglangEvents),
            sub.format,
        );
        for f in sub.failures {
            r.failures.push(GoldenFailure {
                what: format!("{case}: {}", f.what),
                ..f
            });
        }
        let fixture = std::fs::read(dir.join(format!("{case}.json")))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        let frame_seq = fixture
            .as_ref()
            .and_then(|f| f.pointer("/zmq_multipart/frame1_seq"))
            .and_then(Value::as_u64);
        r.eq(format!("{at}: fixture frame1_seq"), Some(seq), frame_seq);
    }
}
