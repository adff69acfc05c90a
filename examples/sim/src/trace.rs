//! Mooncake-format request traces (JSONL) and the block keys derived from them.
//!
//! One JSON object per line, as in the published Mooncake traces:
//!
//! ```text
//! {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}
//! ```
//!
//! * `timestamp`: arrival in milliseconds since the start of the trace (an
//!   integer in the published traces; fractions are accepted);
//! * `input_length` / `output_length`: prompt and generated tokens;
//! * `hash_ids`: one id per 512-token block of the prompt (the last one may be
//!   partial). Equal ids at equal positions mean equal content *and* equal
//!   prefix: the id identifies the prefix chain up to and including its block.
//!
//! Blank lines are skipped; unknown fields are ignored; anything else that does
//! not fit is an error naming the line. Requests are replayed in timestamp
//! order (a stable sort, so equal timestamps keep file order).
//!
//! # Block keys at another block size
//!
//! Engines cache in blocks of `B` tokens (16 in vLLM by default), not 512.
//! [`block_keys`] derives one key per *full* `B`-token block of the prompt:
//! key `j` covers tokens `[j·B, (j+1)·B)` and is
//! `chain(key_{j-1}, id_m …, j·B)` over every 512-token id `m` that the block
//! touches (`key_{-1}` is a fixed root). So key `j` depends on every id up to
//! the one holding its last token, and two prompts share key `j` exactly when
//! they share all those ids: prefixes still chain, at any `B` (smaller than,
//! equal to, or larger than 512). Sharing is only as fine as the trace: a
//! `B`-block inside a 512-token block that differs between two prompts never
//! matches, even if its own tokens were equal. Tokens past the last id (a trace
//! with too few ids) get no keys: they are never cached.

use std::io::{BufRead, Write};

use kvroute_core::BlockKey;
use serde::Deserialize;

/// Tokens per Mooncake `hash_ids` block.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One request of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, microseconds since the start of the trace.
    pub arrival_us: u64,
    /// Prompt length in tokens.
    pub input_tokens: u32,
    /// Tokens to generate.
    pub output_tokens: u32,
    ids_start: usize,
    ids_len: usize,
}

/// A whole workload: requests in arrival order, their ids in one flat buffer (no
/// allocation per request).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Workload {
    requests: Vec<TraceRequest>,
    ids: Vec<u64>,
}

impl Workload {
    /// An empty workload.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a request (keep arrivals non-decreasing, or call [`Self::sort`]).
    pub fn push(&mut self, arrival_us: u64, input_tokens: u32, output_tokens: u32, ids: &[u64]) {
        self.requests.push(TraceRequest {
            arrival_us,
            input_tokens,
            output_tokens,
            ids_start: self.ids.len(),
            ids_len: ids.len(),
        });
        self.ids.extend_from_slice(ids);
    }

    /// Stable sort by arrival.
    pub fn sort(&mut self) {
        self.requests.sort_by_key(|r| r.arrival_us);
    }

    /// The requests, in arrival order.
    #[must_use]
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// Number of requests.
    #[must_use]
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// True without requests.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The 512-token block ids of `r`.
    #[must_use]
    pub fn ids(&self, r: &TraceRequest) -> &[u64] {
        self.ids
            .get(r.ids_start..r.ids_start + r.ids_len)
            .unwrap_or_default()
    }

    /// Keeps the first `n` requests.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }

    /// Spreads the requests that share one arrival timestamp evenly over the
    /// `span_us` after it: the `i`-th of `n` arrives `i · span / n` later,
    /// always before the next timestamp. A trace's timestamps are whole
    /// milliseconds and a generator's bursts share one instant, whereas a
    /// real front end delivers a burst over some span; 0 keeps the instants.
    pub fn spread_instants(&mut self, span_us: u64) {
        if span_us == 0 {
            return;
        }
        let mut i = 0;
        while let Some(t) = self.requests.get(i).map(|r| r.arrival_us) {
            let n = self.requests[i..]
                .iter()
                .take_while(|r| r.arrival_us == t)
                .count();
            let next = self.requests.get(i + n).map(|r| r.arrival_us);
            let span = next.map_or(span_us, |next| span_us.min(next.saturating_sub(t)));
            for (m, r) in self.requests[i..i + n].iter_mut().enumerate() {
                r.arrival_us = t + m as u64 * span / n as u64;
            }
            i += n;
        }
    }

    /// Multiplies every arrival by `scale` (0.5 replays twice as fast).
    pub fn scale_time(&mut self, scale: f64) {
        if !(scale.is_finite() && scale >= 0.0) || scale == 1.0 {
            return;
        }
        for r in &mut self.requests {
            #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
            let scaled = (r.arrival_us as f64 * scale).round() as u64;
            r.arrival_us = scaled;
        }
    }

    /// Total prompt tokens.
    #[must_use]
    pub fn prompt_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| u64::from(r.input_tokens))
            .sum()
    }

    /// Writes the workload as Mooncake JSONL.
    ///
    /// # Errors
    /// The writer's I/O errors.
    pub fn write_jsonl<W: Write>(&self, mut out: W) -> std::io::Result<()> {
        let mut line = String::new();
        for r in &self.requests {
            line.clear();
            line.push_str("{\"timestamp\": ");
            if r.arrival_us % 1000 == 0 {
                line.push_str(&(r.arrival_us / 1000).to_string());
            } else {
                #[allow(clippy::cast_precision_loss)]
                line.push_str(&(r.arrival_us as f64 / 1000.0).to_string());
            }
            line.push_str(", \"input_length\": ");
            line.push_str(&r.input_tokens.to_string());
            line.push_str(", \"output_length\": ");
            line.push_str(&r.output_tokens.to_string());
            line.push_str(", \"hash_ids\": [");
            for (i, id) in self.ids(r).iter().enumerate() {
                if i > 0 {
                    line.push_str(", ");
                }
                line.push_str(&id.to_string());
            }
            line.push_str("]}\n");
            out.write_all(line.as_bytes())?;
        }
        out.flush()
    }
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// One line does not fit the format.
    #[error("line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// No request in the trace.
    #[error("the trace holds no requests")]
    Empty,
}

#[derive(Deserialize)]
struct RawRecord {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Parses Mooncake JSONL. See the [module docs](self) for the format.
///
/// # Errors
/// [`TraceError::Line`] with the 1-based line number of the first bad line,
/// [`TraceError::Empty`] without requests, [`TraceError::Io`] on read errors.
pub fn parse_jsonl<R: BufRead>(mut input: R) -> Result<Workload, TraceError> {
    let mut workload = Workload::new();
    let mut buf = String::new();
    let mut line = 0usize;
    let mut sorted = true;
    let mut last = 0u64;
    loop {
        buf.clear();
        if input.read_line(&mut buf)? == 0 {
            break;
        }
        line += 1;
        let text = buf.trim();
        if text.is_empty() {
            continue;
        }
        let bad = |message: String| TraceError::Line { line, message };
        let raw: RawRecord = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if !(raw.timestamp.is_finite() && raw.timestamp >= 0.0) {
            return Err(bad(format!(
                "timestamp must be a non-negative number of milliseconds, got {}",
                raw.timestamp
            )));
        }
        let input_tokens = u32::try_from(raw.input_length)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                bad(format!(
                    "input_length must be between 1 and {}, got {}",
                    u32::MAX,
                    raw.input_length
                ))
            })?;
        let output_tokens = u32::try_from(raw.output_length).map_err(|_| {
            bad(format!(
                "output_length must be at most {}, got {}",
                u32::MAX,
                raw.output_length
            ))
        })?;
        let blocks = input_tokens.div_ceil(MOONCAKE_BLOCK_TOKENS) as usize;
        if raw.hash_ids.len() > blocks {
            return Err(bad(format!(
                "{} hash_ids for input_length {} (at most {blocks} blocks of {MOONCAKE_BLOCK_TOKENS} tokens)",
                raw.hash_ids.len(),
                input_tokens
            )));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let arrival_us = (raw.timestamp * 1000.0).round() as u64;
        sorted &= arrival_us >= last;
        last = arrival_us;
        workload.push(arrival_us, input_tokens, output_tokens, &raw.hash_ids);
    }
    if workload.is_empty() {
        return Err(TraceError::Empty);
    }
    if !sorted {
        workload.sort();
    }
    Ok(workload)
}

/// Root of every key chain.
const KEY_ROOT: u64 = 0x6b76_726f_7574_6553; // "kvrouteS"

use kvroute_core::mix::splitmix64 as mix;

fn chain(parent: u64, value: u64) -> u64 {
    mix(parent ^ mix(value))
}

/// Number of full `block_size` blocks whose tokens the ids cover.
#[must_use]
pub fn keyed_blocks(ids: &[u64], input_tokens: u32, block_size: u32) -> usize {
    let b = u64::from(block_size.max(1));
    let covered =
        (ids.len() as u64 * u64::from(MOONCAKE_BLOCK_TOKENS)).min(u64::from(input_tokens));
    usize::try_from(covered / b).unwrap_or(usize::MAX)
}

/// Replaces `out` with the keys of the prompt's full `block_size`-token blocks
/// (see the [module docs](self) for the derivation).
pub fn block_keys(ids: &[u64], input_tokens: u32, block_size: u32, out: &mut Vec<BlockKey>) {
    out.clear();
    let b = u64::from(block_size.max(1));
    let m = u64::from(MOONCAKE_BLOCK_TOKENS);
    let n = keyed_blocks(ids, input_tokens, block_size);
    out.reserve(n);
    let mut parent = KEY_ROOT;
    for j in 0..n as u64 {
        let start = j * b;
        let first = start / m;
        let last = (start + b - 1) / m;
        let mut acc = parent;
        for i in first..=last {
            let id = usize::try_from(i)
                .ok()
                .and_then(|i| ids.get(i))
                .copied()
                .unwrap_or(u64::MAX);
            acc = chain(acc, id);
        }
        parent = chain(acc, start);
        out.push(BlockKey(parent));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_of_one_instant_spread_before_the_next() {
        let mut w = Workload::default();
        for t in [0, 0, 0, 1000, 1000, 5000] {
            w.requests.push(TraceRequest {
                arrival_us: t,
                input_tokens: 1,
                output_tokens: 1,
                ids_start: 0,
                ids_len: 0,
            });
        }
        w.spread_instants(900);
        let at: Vec<u64> = w.requests.iter().map(|r| r.arrival_us).collect();
        assert_eq!(at, [0, 300, 600, 1000, 1450, 5000]);
        // A span longer than the gap stays below the next instant.
        w.spread_instants(5000);
        let at: Vec<u64> = w.requests.iter().map(|r| r.arrival_us).collect();
        assert!(at.windows(2).all(|p| p[0] < p[1]), "{at:?}");
    }

    #[test]
    fn keys_chain_and_share_only_with_equal_prefixes() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        block_keys(&[1, 2, 3], 1536, 16, &mut a);
        block_keys(&[1, 2, 4], 1536, 16, &mut b);
        assert_eq!(a.len(), 96);
        assert_eq!(a[..64], b[..64]);
        assert!(a[64..].iter().zip(&b[64..]).all(|(x, y)| x != y));
        // Different first id: nothing shared even though later ids agree.
        block_keys(&[9, 2, 3], 1536, 16, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    }

    #[test]
    fn large_blocks_depend_on_every_covered_id() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        block_keys(&[1, 2, 3, 4], 2048, 1024, &mut a);
        block_keys(&[1, 5, 3, 4], 2048, 1024, &mut b);
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn partial_and_missing_ids_limit_the_keys() {
        let mut a = Vec::new();
        block_keys(&[1, 2], 700, 64, &mut a);
        assert_eq!(a.len(), 10); // 700 / 64
        block_keys(&[1], 1500, 64, &mut a);
        assert_eq!(a.len(), 8); // only the first 512 tokens are identified
    }
}
