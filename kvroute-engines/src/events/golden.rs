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
//! This module detects a fixture's format and reports; the checks live in
//! `payload` (vLLM and SGLang payload fixtures), `zmq` (ZeroMQ captures and
//! stream indexes) and `trtllm` (TensorRT-LLM drains and their metas).
//!
//! ```no_run
//! use kvroute_engines::events::golden;
//! let report = golden::check_file(std::path::Path::new(
//!     "golden/vllm-events/v0.33.0/stream/01_store_prompt_two_blocks.json",
//! ));
//! assert!(report.passed(), "{report}");
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use kvroute_ingest::EventBatch;
use serde_json::Value;
use sha2::{Digest, Sha256};

mod payload;
mod trtllm;
mod zmq;

use super::msgpack::hex_lower;
use super::{sglang, vllm, DecodeStats};
use payload::payload_fixture;
use trtllm::{trtllm_drain, trtllm_meta};
use zmq::{sglang_capture, stream_index, vllm_capture};

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
