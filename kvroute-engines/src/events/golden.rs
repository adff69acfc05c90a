//! Checks KV-event wire fixtures (the `golden/*-events` files, or captures from a
//! user's own engine in the same format) against the decoders.
//!
//! For every fixture the checker verifies, independently of how it was produced:
//! * the payload file's bytes match `payload_hex`, `payload_len` and the SHA-256;
//! * a generic msgpack→JSON reading of the payload equals `decoded_payload`;
//! * the engine decoder's neutral events equal the events read from
//!   `decoded_payload` by field name (a second, JSON-side interpretation);
//! * TensorRT-LLM: every drain decodes cleanly, and replaying the drains of a
//!   directory in name order yields each `.meta.json`'s resident full-block set and
//!   per-block parents / token counts;
//! * ZeroMQ captures: every frame set parses (topic, big-endian seq, payload) and
//!   decodes, replay replies carry the live payloads and end with the end marker;
//! * stream indexes: the listed cases exist, in sequence order, and decode.
//!
//! ```no_run
//! use kvroute_engines::events::golden;
//! let report = golden::check_file(std::path::Path::new(
//!     "golden/vllm-events/v0.33.0/stream/01_store_prompt_two_blocks.json",
//! ));
//! assert!(report.passed(), "{report}");
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use kvroute_core::{BlockKey, Medium};
use kvroute_ingest::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::msgpack::{hex_lower, to_json, Reader};
use super::trtllm::TrtllmDecoder;
use super::{sglang, vllm, DecodeStats, LiveMessage, ReplayReply};

/// The kind of event fixture a JSON file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// A vLLM payload fixture (`NAME.json` + `NAME.msgpack`).
    VllmEvents,
    /// An SGLang payload fixture.
    SglangEvents,
    /// A vLLM ZeroMQ capture (`zmq_capture.json`).
    VllmZmqCapture,
    /// An SGLang ZeroMQ capture.
    SglangZmqCapture,
    /// An SGLang `stream_index.json`.
    StreamIndex,
    /// A TensorRT-LLM drain body (JSON array of events).
    TrtllmDrain,
    /// A TensorRT-LLM `.meta.json` with expected resident sets.
    TrtllmMeta,
}

/// Recognises an event fixture by its shape; `None` for anything else.
///
/// ```
/// use kvroute_engines::events::golden::{detect, Format};
/// let drain = serde_json::json!([{"event_id": 0, "data": {"type": "created"}}]);
/// assert_eq!(detect(&drain), Some(Format::TrtllmDrain));
/// assert_eq!(detect(&serde_json::json!({"x": 1})), None);
/// ```
#[must_use]
pub fn detect(v: &Value) -> Option<Format> {
    if let Some(arr) = v.as_array() {
        let is_event = |e: &Value| e.get("event_id").is_some() && e.get("data").is_some();
        return arr.iter().all(is_event).then_some(Format::TrtllmDrain);
    }
    let engine = v.get("engine").and_then(Value::as_str);
    let has = |k: &str| v.get(k).is_some();
    match engine {
        Some("vllm") if has("decoded_payload") && has("payload_file") => Some(Format::VllmEvents),
        Some("vllm") if has("live_messages_rank0") => Some(Format::VllmZmqCapture),
        Some("sglang") if has("decoded_payload") && has("zmq_multipart") => {
            Some(Format::SglangEvents)
        }
        Some("sglang") if has("live_sub_frames") => Some(Format::SglangZmqCapture),
        Some("tensorrt-llm") if has("tokens_per_block") => Some(Format::TrtllmMeta),
        None if v.get("batches").is_some_and(Value::is_array) && has("engine_version") => {
            Some(Format::StreamIndex)
        }
        _ => None,
    }
}

/// One failed expectation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenFailure {
    /// What was checked (with the position inside the fixture).
    pub what: String,
    /// What the fixture says.
    pub expected: String,
    /// What the decoder produced.
    pub actual: String,
}

/// Outcome of checking one fixture file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GoldenReport {
    /// The fixture file.
    pub file: PathBuf,
    /// The detected format (`None`: not an event fixture).
    pub format: Option<Format>,
    /// Number of expectations checked.
    pub checks: usize,
    /// The expectations that failed.
    pub failures: Vec<GoldenFailure>,
}

impl GoldenReport {
    /// True when something was checked and nothing failed.
    #[must_use]
    pub fn passed(&self) -> bool {
        self.checks > 0 && self.failures.is_empty()
    }

    /// The same outcome as a [`kvroute_core::golden::GoldenReport`] (one passed
    /// "case" per successful check, one failure per failed check), so `kvroute
    /// parity` can merge event fixtures with hash vectors.
    #[must_use]
    pub fn to_core(&self) -> kvroute_core::golden::GoldenReport {
        let file = self.file.display().to_string();
        let mut core = kvroute_core::golden::GoldenReport::new();
        core.passed = self.checks.saturating_sub(self.failures.len());
        for f in &self.failures {
            core.fail(
                &file,
                &f.what,
                format!("expected {} got {}", f.expected, f.actual),
            );
        }
        core
    }

    fn check(
        &mut self,
        what: impl Into<String>,
        ok: bool,
        expected: impl fmt::Debug,
        actual: impl fmt::Debug,
    ) {
        self.checks += 1;
        if !ok {
            self.failures.push(GoldenFailure {
                what: what.into(),
                expected: format!("{expected:?}"),
                actual: format!("{actual:?}"),
            });
        }
    }

    fn eq<T: PartialEq + fmt::Debug>(&mut self, what: impl Into<String>, expected: T, actual: T) {
        let ok = expected == actual;
        self.check(what, ok, expected, actual);
    }

    fn fail(&mut self, what: impl Into<String>, detail: impl fmt::Display) {
        self.checks += 1;
        self.failures.push(GoldenFailure {
            what: what.into(),
            expected: "ok".into(),
            actual: detail.to_string(),
        });
    }
}

impl fmt::Display for GoldenReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {:?}, {} checks, {} failures",
            self.file.display(),
            self.format,
            self.checks,
            self.failures.len()
        )?;
        for x in &self.failures {
            writeln!(f, "  {}: expected {} got {}", x.what, x.expected, x.actual)?;
        }
        Ok(())
    }
}

/// Reads, detects and checks one fixture file.
#[must_use]
pub fn check_file(path: &Path) -> GoldenReport {
    match std::fs::read(path) {
        Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
            Ok(v) => check(&v, path),
            Err(e) => {
                let mut r = report_for(path, None);
                r.fail("parse JSON", e);
                r
            }
        },
        Err(e) => {
            let mut r = report_for(path, None);
            r.fail("read file", e);
            r
        }
    }
}

/// Checks an already parsed fixture; `path` is the fixture's own path (its
/// directory holds the companion payload files and sibling drains).
#[must_use]
pub fn check(v: &Value, path: &Path) -> GoldenReport {
    let format = detect(v);
    let mut r = report_for(path, format);
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    match format {
        Some(Format::VllmEvents) => payload_fixture(&mut r, v, dir, Engine::Vllm),
        Some(Format::SglangEvents) => payload_fixture(&mut r, v, dir, Engine::Sglang),
        Some(Format::VllmZmqCapture) => vllm_capture(&mut r, v),
        Some(Format::SglangZmqCapture) => sglang_capture(&mut r, v),
        Some(Format::StreamIndex) => stream_index(&mut r, v, dir),
        Some(Format::TrtllmDrain) => trtllm_drain(&mut r, v, path),
        Some(Format::TrtllmMeta) => trtllm_meta(&mut r, v, path),
        None => r.fail("detect format", "not a KV-event fixture"),
    }
    r
}

fn report_for(path: &Path, format: Option<Format>) -> GoldenReport {
    GoldenReport {
        file: path.to_path_buf(),
        format,
        ..GoldenReport::default()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Engine {
    Vllm,
    Sglang,
}

fn decode(
    engine: Engine,
    payload: &[u8],
    seq: u64,
    stats: &mut DecodeStats,
) -> Result<EventBatch, super::DecodeError> {
    match engine {
        Engine::Vllm => vllm::decode(payload, seq, stats),
        Engine::Sglang => sglang::decode(payload, seq, stats),
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|p| u8::from_str_radix(p, 16).ok()))
        .collect()
}

fn sha256_hex(b: &[u8]) -> String {
    hex_lower(&Sha256::digest(b))
}

fn str_at<'a>(v: &'a Value, ptr: &str) -> Option<&'a str> {
    v.pointer(ptr).and_then(Value::as_str)
}

/// A payload fixture: bytes, generic decode, neutral decode.
fn payload_fixture(r: &mut GoldenReport, v: &Value, dir: &Path, engine: Engine) {
    let (file, len, sha, seq) = match engine {
        Engine::Vllm => (
            str_at(v, "/payload_file"),
            v.get("payload_len").and_then(Value::as_u64),
            str_at(v, "/payload_sha256"),
            None,
        ),
        Engine::Sglang => (
            str_at(v, "/zmq_multipart/frame2_payload_file"),
            v.pointer("/zmq_multipart/frame2_payload_len")
                .and_then(Value::as_u64),
            str_at(v, "/zmq_multipart/frame2_payload_sha256"),
            v.pointer("/zmq_multipart/frame1_seq")
                .and_then(Value::as_u64),
        ),
    };
    let Some(file) = file else {
        return r.fail("payload file name", "missing");
    };
    let payload = match std::fs::read(dir.join(file)) {
        Ok(p) => p,
        Err(e) => return r.fail(format!("read {file}"), e),
    };
    if let Some(hex) = str_at(v, "/payload_hex") {
        r.eq(
            "payload file == payload_hex",
            Some(payload.clone()),
            unhex(hex),
        );
    }
    if let Some(len) = len {
        r.eq("payload length", len, payload.len() as u64);
    }
    match sha {
        Some(sha) => r.eq("payload sha256", sha.to_string(), sha256_hex(&payload)),
        None => r.fail("payload sha256", "missing"),
    }
    if let (Some(seq), Some(hex)) = (seq, str_at(v, "/zmq_multipart/frame1_seq_hex_be_u64")) {
        r.eq(
            "frame1 seq hex",
            hex.to_string(),
            hex_lower(&seq.to_be_bytes()),
        );
    }
    if engine == Engine::Vllm {
        legacy_field_names(r, v);
    }
    let Some(expected) = v.get("decoded_payload") else {
        return r.fail("decoded_payload", "missing");
    };
    let names = v.get("array_field_names");
    payload_matches(
        r,
        "payload",
        engine,
        &payload,
        seq.unwrap_or(0),
        expected,
        names,
    );
}

/// The fixture's positional names agree with [`vllm::array_layout`] for its version.
fn legacy_field_names(r: &mut GoldenReport, v: &Value) {
    let Some(names) = v.get("array_field_names") else {
        return;
    };
    let version = str_at(v, "/engine_version").unwrap_or_default();
    let Some(layout) = vllm::array_layout(version) else {
        return r.fail(
            "array layout",
            format!("no array layout known for vLLM {version}"),
        );
    };
    let list = |k: &str| -> Vec<String> {
        names
            .get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let own = |s: &[&str]| s.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    r.eq(
        "BlockStored array fields",
        list("BlockStored"),
        own(layout.block_stored),
    );
    r.eq(
        "BlockRemoved array fields",
        list("BlockRemoved"),
        own(layout.block_removed),
    );
}

/// Generic decode == `expected`, and neutral decode == events read from `expected`.
fn payload_matches(
    r: &mut GoldenReport,
    at: &str,
    engine: Engine,
    payload: &[u8],
    seq: u64,
    expected: &Value,
    names: Option<&Value>,
) {
    let mut reader = Reader::new(payload);
    match to_json(&mut reader, 0) {
        Ok(generic) => {
            let ok = generic == *expected && reader.is_empty();
            r.check(
                format!("{at}: msgpack reads as decoded_payload"),
                ok,
                expected,
                generic,
            );
        }
        Err(e) => r.fail(format!("{at}: generic msgpack read"), e),
    }
    let mut stats = DecodeStats::default();
    let batch = match decode(engine, payload, seq, &mut stats) {
        Ok(b) => b,
        Err(e) => return r.fail(format!("{at}: decode"), e),
    };
    r.eq(
        format!("{at}: skipped or malformed events"),
        (0, 0, 0),
        (
            stats.unknown_fields,
            stats.unknown_event_tags,
            stats.malformed_events,
        ),
    );
    match expected_batch(engine, expected, names) {
        Ok(want) => {
            r.eq(format!("{at}: timestamp"), want.timestamp, batch.timestamp);
            r.eq(format!("{at}: dp rank"), want.dp_rank, batch.dp_rank);
            r.eq(
                format!("{at}: event count"),
                want.events.len(),
                batch.events.len(),
            );
            for (i, (w, g)) in want.events.iter().zip(&batch.events).enumerate() {
                r.eq(format!("{at}: event {i}"), w, g);
            }
        }
        Err(e) => r.fail(format!("{at}: read decoded_payload"), e),
    }
}

// ---- the JSON-side reading of `decoded_payload` ----

fn json_key(v: &Value) -> Result<BlockKey, String> {
    if let Some(u) = v.as_u64() {
        return Ok(BlockKey(u));
    }
    if let Some(i) = v.as_i64() {
        return Ok(BlockKey::from_i64(i));
    }
    let bytes = str_at(v, "/bytes_hex")
        .and_then(unhex)
        .ok_or(format!("bad hash {v}"))?;
    let tail: [u8; 8] = bytes
        .len()
        .checked_sub(8)
        .and_then(|s| bytes.get(s..))
        .and_then(|t| t.try_into().ok())
        .ok_or(format!("digest shorter than 8 bytes: {v}"))?;
    Ok(BlockKey(u64::from_be_bytes(tail)))
}

fn json_extra(v: &Value) -> Result<ExtraKey, String> {
    Ok(match v {
        Value::String(s) => ExtraKey::Text(s.clone()),
        Value::Number(n) => ExtraKey::Int(n.as_i64().ok_or(format!("extra key int {n}"))?),
        Value::Array(a) => ExtraKey::List(a.iter().map(json_extra).collect::<Result<_, _>>()?),
        Value::Object(_) => ExtraKey::Bytes(
            str_at(v, "/bytes_hex")
                .and_then(unhex)
                .ok_or(format!("extra key {v}"))?,
        ),
        other => return Err(format!("extra key {other}")),
    })
}

const SGLANG_STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
];
const SGLANG_REMOVED: &[&str] = &["block_hashes", "medium"];

fn expected_batch(engine: Engine, v: &Value, names: Option<&Value>) -> Result<EventBatch, String> {
    let top = v.as_array().ok_or("decoded_payload is not an array")?;
    let ts = top.first().and_then(Value::as_f64).ok_or("no timestamp")?;
    let events = top.get(1).and_then(Value::as_array).ok_or("no events")?;
    let dp_rank = match top.get(2) {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or("bad rank")?,
        ),
    };
    let mut out = Vec::new();
    for ev in events {
        // Normalise both layouts to (tag, name → value).
        let (tag, fields): (String, Vec<(String, Value)>) = match ev {
            Value::Object(o) => (
                o.get("type")
                    .and_then(Value::as_str)
                    .ok_or("no type")?
                    .to_owned(),
                o.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            ),
            Value::Array(a) => {
                let tag = a
                    .first()
                    .and_then(Value::as_str)
                    .ok_or("no tag")?
                    .to_owned();
                let table: Vec<String> =
                    match (names.and_then(|n| n.get(&tag)), engine, tag.as_str()) {
                        (Some(n), _, _) => n
                            .as_array()
                            .ok_or("bad array_field_names")?
                            .iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect(),
                        (None, Engine::Sglang, "BlockStored") => {
                            SGLANG_STORED.iter().map(|s| (*s).to_owned()).collect()
                        }
                        (None, Engine::Sglang, "BlockRemoved") => {
                            SGLANG_REMOVED.iter().map(|s| (*s).to_owned()).collect()
                        }
                        _ => Vec::new(),
                    };
                let fields = table.into_iter().zip(a.iter().skip(1).cloned()).collect();
                (tag, fields)
            }
            _ => return Err("event neither map nor array".into()),
        };
        let get = |k: &str| fields.iter().find(|(n, _)| n == k).map(|(_, v)| v);
        let keys = |k: &str| -> Result<Vec<BlockKey>, String> {
            get(k)
                .and_then(Value::as_array)
                .ok_or(format!("no {k}"))?
                .iter()
                .map(json_key)
                .collect()
        };
        let medium = match get("medium") {
            None | Some(Value::Null) => Medium::Gpu,
            Some(m) => Medium::from_wire(m.as_str().ok_or("medium")?).unwrap_or(Medium::External),
        };
        let group = get("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32;
        let opt_str = |k: &str| get(k).and_then(Value::as_str).map(str::to_owned);
        match tag.as_str() {
            "BlockStored" => {
                let parent = match get("parent_block_hash") {
                    None | Some(Value::Null) => None,
                    Some(p) => Some(json_key(p)?),
                };
                let token_ids = get("token_ids")
                    .and_then(Value::as_array)
                    .ok_or("no token_ids")?
                    .iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or("token")
                    })
                    .collect::<Result<_, _>>()?;
                let extra_keys = match get("extra_keys") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(x) => x
                        .as_array()
                        .ok_or("extra_keys")?
                        .iter()
                        .map(|b| match b {
                            Value::Null => Ok(None),
                            Value::Array(a) => {
                                a.iter().map(json_extra).collect::<Result<_, _>>().map(Some)
                            }
                            other => Err(format!("extra_keys entry {other}")),
                        })
                        .collect::<Result<_, _>>()?,
                };
                out.push(KvEvent::Stored(BlockStored {
                    keys: keys("block_hashes")?,
                    parent,
                    token_ids,
                    block_size: get("block_size")
                        .and_then(Value::as_u64)
                        .ok_or("block_size")? as u32,
                    partial_last_block: false,
                    medium,
                    lora_name: opt_str("lora_name"),
                    extra_keys,
                    group,
                    cache_salt: opt_str("cache_salt"),
                }));
            }
            "BlockRemoved" => out.push(KvEvent::Removed(BlockRemoved {
                keys: keys("block_hashes")?,
                medium,
                group,
            })),
            "AllBlocksCleared" => out.push(KvEvent::AllCleared),
            other => return Err(format!("unknown tag {other}")),
        }
    }
    Ok(EventBatch {
        seq: 0,
        timestamp: ts,
        dp_rank,
        events: out,
    })
}

// ---- ZeroMQ captures ----

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

fn vllm_capture(r: &mut GoldenReport, v: &Value) {
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

fn sglang_capture(r: &mut GoldenReport, v: &Value) {
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

fn stream_index(r: &mut GoldenReport, v: &Value, dir: &Path) {
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

// ---- TensorRT-LLM ----

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
fn trtllm_drain(r: &mut GoldenReport, v: &Value, path: &Path) {
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
fn trtllm_meta(r: &mut GoldenReport, v: &Value, path: &Path) {
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
