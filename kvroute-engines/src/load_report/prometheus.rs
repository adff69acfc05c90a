//! The Prometheus text exposition format (0.0.4, as Python's `prometheus_client`
//! writes it for vLLM and SGLang; OpenMetrics' `# EOF` and timestamps tolerated)
//! and the vLLM / SGLang / TensorRT-LLM-Prometheus dialects on top of it.
//!
//! Hand-written because the crate that parses this format, `prometheus-parse`
//! 0.2, cannot read these bodies: its metric-name pattern `\w+` stops at the colon
//! of every `vllm:` / `sglang:` name, and it splits labels on `,` and `=` without
//! honouring quotes or escapes (vLLM's `cache_config_info` carries list-valued
//! labels such as `kv_cache_dtype_skip_layers="['a', 'b']"`). A differential test
//! checks this parser against it on the subset it handles.

use std::borrow::Cow;

use super::{
    combine, max_opt, EngineLoadReport, LoadReportError, MetricsDialect, RankLoad, MAX_RANKS,
};

/// Labels one sample line may carry (vLLM's `cache_config_info` has ~40).
const MAX_LABELS: usize = 256;

/// What a metric feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Running,
    Waiting,
    /// Usage in preference order: a lower index wins when a rank has both.
    KvUsage(u8),
    CapacityBlocks,
    BlockSize,
    CapacityTokens,
    /// vLLM's `cache_config_info`: capacity and block size are labels.
    VllmCacheInfo,
    /// A histogram's `_sum` of uncached tokens prefilled per request.
    PrefillTokens,
    /// A histogram's `_sum` of seconds spent prefilling per request.
    PrefillSeconds,
}

/// One dialect: which names feed which field, and how series group into ranks.
pub(super) struct Spec {
    metrics: &'static [(&'static str, Field)],
    /// Label whose value names the rank; series without it are rank "".
    rank_label: Option<&'static str>,
    /// Series with a non-empty value of this label are skipped (breakdowns of a total).
    skip_label: Option<&'static str>,
    running: &'static str,
    waiting: &'static str,
}

/// vLLM 0.33.0 `vllm/v1/metrics/loggers.py`.
pub(super) const VLLM: Spec = Spec {
    metrics: &[
        ("vllm:num_requests_running", Field::Running),
        ("vllm:num_requests_waiting", Field::Waiting),
        ("vllm:kv_cache_usage_perc", Field::KvUsage(0)),
        ("vllm:gpu_cache_usage_perc", Field::KvUsage(1)),
        ("vllm:cache_config_info", Field::VllmCacheInfo),
        (
            "vllm:request_prefill_kv_computed_tokens_sum",
            Field::PrefillTokens,
        ),
        (
            "vllm:request_prefill_time_seconds_sum",
            Field::PrefillSeconds,
        ),
    ],
    rank_label: Some("engine"),
    skip_label: None,
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
};

/// SGLang 0.5.23 `sglang/srt/observability/metrics_collector.py`.
pub(super) const SGLANG: Spec = Spec {
    metrics: &[
        ("sglang:num_running_reqs", Field::Running),
        ("sglang:num_queue_reqs", Field::Waiting),
        ("sglang:token_usage", Field::KvUsage(0)),
        ("sglang:num_pages", Field::CapacityBlocks),
        ("sglang:page_size", Field::BlockSize),
        ("sglang:max_total_num_tokens", Field::CapacityTokens),
    ],
    rank_label: Some("dp_rank"),
    skip_label: Some("priority"),
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
};

/// TensorRT-LLM `tensorrt_llm/metrics/collector.py`.
pub(super) const TRTLLM_PROMETHEUS: Spec = Spec {
    metrics: &[
        ("trtllm_num_requests_running", Field::Running),
        ("trtllm_num_requests_waiting", Field::Waiting),
        ("trtllm_kv_cache_utilization", Field::KvUsage(0)),
        ("trtllm_kv_cache_max_blocks", Field::CapacityBlocks),
        ("trtllm_kv_cache_tokens_per_block", Field::BlockSize),
    ],
    rank_label: None,
    skip_label: None,
    running: "trtllm_num_requests_running",
    waiting: "trtllm_num_requests_waiting",
};

/// One parsed sample line.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Sample<'a> {
    pub(super) name: &'a str,
    pub(super) labels: Vec<(&'a str, Cow<'a, str>)>,
    pub(super) value: f64,
}

impl Sample<'_> {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// Lines of `body` without their terminators (`\n`, optionally preceded by `\r`).
pub(super) fn lines(body: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    body.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .enumerate()
        .map(|(i, l)| (i + 1, l))
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn skip_blanks(line: &[u8], mut at: usize) -> usize {
    while line.get(at).copied().is_some_and(is_blank) {
        at += 1;
    }
    at
}

/// The metric name a sample line starts with, and where it ends. `None` for
/// blank and comment lines and for lines that do not start with a valid name.
pub(super) fn line_name(line: &[u8]) -> Option<(&str, usize)> {
    let start = skip_blanks(line, 0);
    let first = *line.get(start)?;
    if !(first.is_ascii_alphabetic() || first == b'_' || first == b':') {
        return None;
    }
    let len = line[start..]
        .iter()
        .take_while(|&&b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
        .count();
    let end = start + len;
    // `vllm:x-y 1` is not a sample of `vllm:x`: a name ends at a blank, `{` or the end.
    if line.get(end).is_some_and(|&b| !is_blank(b) && b != b'{') {
        return None;
    }
    // ASCII by construction.
    let name = std::str::from_utf8(&line[start..end]).ok()?;
    Some((name, end))
}

fn syntax(line: usize, reason: &'static str) -> LoadReportError {
    LoadReportError::Syntax { line, reason }
}

/// Parses a whole sample line whose name ends at `name_end`.
pub(super) fn parse_sample<'a>(
    raw: &'a [u8],
    name_end: usize,
    lineno: usize,
) -> Result<Sample<'a>, LoadReportError> {
    let line = std::str::from_utf8(raw).map_err(|_| syntax(lineno, "not UTF-8"))?;
    let bytes = line.as_bytes();
    let name_start = skip_blanks(bytes, 0);
    let name = &line[name_start..name_end];
    let mut at = skip_blanks(bytes, name_end);
    let mut labels = Vec::new();
    if bytes.get(at) == Some(&b'{') {
        at = parse_labels(line, at + 1, lineno, &mut labels)?;
    }
    let value_start = skip_blanks(bytes, at);
    let value_end = value_start
        + bytes[value_start..]
            .iter()
            .take_while(|&&b| !is_blank(b))
            .count();
    if value_start == value_end {
        return Err(syntax(lineno, "sample without a value"));
    }
    let value = parse_float(&line[value_start..value_end])
        .ok_or_else(|| syntax(lineno, "value is not a number"))?;
    // An optional timestamp, then nothing.
    let ts_start = skip_blanks(bytes, value_end);
    let ts_end = ts_start
        + bytes[ts_start..]
            .iter()
            .take_while(|&&b| !is_blank(b))
            .count();
    if ts_end > ts_start && line[ts_start..ts_end].parse::<f64>().is_err() {
        return Err(syntax(lineno, "timestamp is not a number"));
    }
    if skip_blanks(bytes, ts_end) != bytes.len() {
        return Err(syntax(lineno, "trailing characters after the sample"));
    }
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Go-style floats: `NaN`, `+Inf`, `-Inf` and decimal / exponent notation (Rust's
/// parser reads all of them, case-insensitively, as Go's does).
fn parse_float(s: &str) -> Option<f64> {
    s.parse::<f64>().ok()
}

/// Reads `name="value",...}` starting after `{`; returns the index after `}`.
fn parse_labels<'a>(
    line: &'a str,
    mut at: usize,
    lineno: usize,
    out: &mut Vec<(&'a str, Cow<'a, str>)>,
) -> Result<usize, LoadReportError> {
    let bytes = line.as_bytes();
    loop {
        at = skip_blanks(bytes, at);
        match bytes.get(at) {
            Some(b'}') => return Ok(at + 1),
            None => return Err(syntax(lineno, "unterminated label set")),
            _ => {}
        }
        let name_start = at;
        match bytes.get(at) {
            Some(b) if b.is_ascii_alphabetic() || *b == b'_' => {}
            _ => return Err(syntax(lineno, "invalid label name")),
        }
        while bytes
            .get(at)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            at += 1;
        }
        let name = &line[name_start..at];
        at = skip_blanks(bytes, at);
        if bytes.get(at) != Some(&b'=') {
            return Err(syntax(lineno, "label without '='"));
        }
        at = skip_blanks(bytes, at + 1);
        if bytes.get(at) != Some(&b'"') {
            return Err(syntax(lineno, "label value not quoted"));
        }
        let (value, next) = parse_label_value(line, at + 1, lineno)?;
        if out.len() == MAX_LABELS {
            return Err(syntax(lineno, "too many labels"));
        }
        out.push((name, value));
        at = skip_blanks(bytes, next);
        match bytes.get(at) {
            Some(b',') => at += 1,
            Some(b'}') => return Ok(at + 1),
            _ => return Err(syntax(lineno, "expected ',' or '}' after a label")),
        }
    }
}

/// Reads a label value after its opening quote; returns it and the index after
/// the closing quote. Escapes: `\\`, `\"`, `\n`; any other backslash is literal.
fn parse_label_value(
    line: &str,
    start: usize,
    lineno: usize,
) -> Result<(Cow<'_, str>, usize), LoadReportError> {
    let bytes = line.as_bytes();
    let mut at = start;
    let mut owned: Option<String> = None;
    let mut plain_from = start;
    loop {
        match bytes.get(at) {
            None => return Err(syntax(lineno, "unterminated label value")),
            Some(b'"') => {
                let value = match owned {
                    Some(mut s) => {
                        s.push_str(&line[plain_from..at]);
                        Cow::Owned(s)
                    }
                    None => Cow::Borrowed(&line[start..at]),
                };
                return Ok((value, at + 1));
            }
            Some(b'\\') => {
                let s = owned.get_or_insert_with(String::new);
                s.push_str(&line[plain_from..at]);
                match bytes.get(at + 1) {
                    Some(b'\\') => s.push('\\'),
                    Some(b'"') => s.push('"'),
                    Some(b'n') => s.push('\n'),
                    Some(_) => {
                        // Unknown escape: keep the backslash, re-read the next char.
                        s.push('\\');
                        at += 1;
                        plain_from = at;
                        continue;
                    }
                    None => return Err(syntax(lineno, "unterminated label value")),
                }
                at += 2;
                plain_from = at;
            }
            Some(_) => at += 1,
        }
    }
}

/// One rank while reading a body.
struct RankEntry {
    key: String,
    load: RankLoad,
    /// Usage under the fallback name (`vllm:gpu_cache_usage_perc`).
    fallback_usage: Option<f64>,
    /// Reported running or waiting: a rank, not only constants.
    counted: bool,
}

/// Per-rank state while reading a body.
struct Ranks {
    ranks: Vec<RankEntry>,
    /// vLLM `cache_config_info` per rank label: (blocks, block size).
    info: Vec<(String, Option<f64>, Option<f64>)>,
}

impl Ranks {
    fn rank(&mut self, key: &str) -> Result<&mut RankEntry, LoadReportError> {
        if let Some(i) = self.ranks.iter().position(|r| r.key == key) {
            return Ok(&mut self.ranks[i]);
        }
        if self.ranks.len() == MAX_RANKS {
            return Err(LoadReportError::TooManyRanks { limit: MAX_RANKS });
        }
        self.ranks.push(RankEntry {
            key: key.to_owned(),
            load: RankLoad::default(),
            fallback_usage: None,
            counted: false,
        });
        let last = self.ranks.len() - 1;
        Ok(&mut self.ranks[last])
    }
}

fn count_value(
    sample: &Sample<'_>,
    metric: &'static str,
    line: usize,
) -> Result<f64, LoadReportError> {
    if sample.value.is_finite() && sample.value >= 0.0 {
        Ok(sample.value)
    } else {
        Err(LoadReportError::InvalidValue { metric, line })
    }
}

/// An integer label such as `num_gpu_blocks="81767"`; `"None"` (not yet known) is `None`.
fn int_label(
    sample: &Sample<'_>,
    label: &str,
    metric: &'static str,
    line: usize,
) -> Result<Option<f64>, LoadReportError> {
    match sample.label(label) {
        None | Some("None") | Some("") => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u64>()
            .map(|n| Some(n as f64))
            .map_err(|_| LoadReportError::InvalidValue { metric, line }),
    }
}

pub(super) fn parse(
    spec: &Spec,
    dialect: MetricsDialect,
    body: &[u8],
) -> Result<EngineLoadReport, LoadReportError> {
    let mut state = Ranks {
        ranks: Vec::new(),
        info: Vec::new(),
    };
    let (mut saw_running, mut saw_waiting) = (false, false);
    for (lineno, raw) in lines(body) {
        let Some((name, name_end)) = line_name(raw) else {
            continue;
        };
        let Some(&(metric, field)) = spec.metrics.iter().find(|(n, _)| *n == name) else {
            continue;
        };
        let sample = parse_sample(raw, name_end, lineno)?;
        if let Some(skip) = spec.skip_label {
            if sample.label(skip).is_some_and(|v| !v.is_empty()) {
                continue;
            }
        }
        let key = spec.rank_label.and_then(|l| sample.label(l)).unwrap_or("");
        if field == Field::VllmCacheInfo {
            let blocks = int_label(
                &sample,
                "num_gpu_blocks",
                "vllm:cache_config_info/num_gpu_blocks",
                lineno,
            )?;
            let size = int_label(
                &sample,
                "block_size",
                "vllm:cache_config_info/block_size",
                lineno,
            )?;
            if state.info.len() == MAX_RANKS {
                return Err(LoadReportError::TooManyRanks { limit: MAX_RANKS });
            }
            state.info.push((key.to_owned(), blocks, size));
            continue;
        }
        let entry = state.rank(key)?;
        let rank = &mut entry.load;
        match field {
            Field::Running => {
                rank.running = max_opt(rank.running, count_value(&sample, metric, lineno)?);
                entry.counted = true;
                saw_running = true;
            }
            Field::Waiting => {
                rank.waiting = max_opt(rank.waiting, count_value(&sample, metric, lineno)?);
                entry.counted = true;
                saw_waiting = true;
            }
            Field::KvUsage(preference) => {
                // NaN usage (nothing measured yet) is "unknown", not an error.
                if sample.value.is_finite() {
                    let v = sample.value.clamp(0.0, 1.0);
                    let slot = if preference == 0 {
                        &mut rank.kv_usage
                    } else {
                        &mut entry.fallback_usage
                    };
                    *slot = max_opt(*slot, v);
                }
            }
            Field::CapacityBlocks => {
                rank.capacity_blocks =
                    max_opt(rank.capacity_blocks, count_value(&sample, metric, lineno)?);
            }
            Field::BlockSize => {
                rank.block_size = max_opt(rank.block_size, count_value(&sample, metric, lineno)?);
            }
            Field::CapacityTokens => {
                rank.capacity_tokens =
                    max_opt(rank.capacity_tokens, count_value(&sample, metric, lineno)?);
            }
            Field::PrefillTokens => {
                rank.prefill_computed_tokens = max_opt(
                    rank.prefill_computed_tokens,
                    count_value(&sample, metric, lineno)?,
                );
            }
            Field::PrefillSeconds => {
                rank.prefill_seconds =
                    max_opt(rank.prefill_seconds, count_value(&sample, metric, lineno)?);
            }
            Field::VllmCacheInfo => {}
        }
    }
    if !saw_running {
        return Err(LoadReportError::MissingMetric {
            dialect,
            metric: spec.running,
        });
    }
    if !saw_waiting {
        return Err(LoadReportError::MissingMetric {
            dialect,
            metric: spec.waiting,
        });
    }
    let shared_info = state
        .info
        .iter()
        .find(|(k, _, _)| k.is_empty())
        .map(|&(_, b, s)| (b, s));
    let mut ranks: Vec<RankLoad> = Vec::with_capacity(state.ranks.len());
    for entry in state.ranks {
        if !entry.counted {
            continue;
        }
        let mut rank = entry.load;
        rank.kv_usage = rank.kv_usage.or(entry.fallback_usage);
        let own = state
            .info
            .iter()
            .find(|(k, _, _)| *k == entry.key)
            .map(|&(_, b, s)| (b, s));
        // Before 0.10 one `cache_config_info` without an engine label described
        // every engine.
        if let Some((blocks, size)) = own.or(shared_info) {
            rank.capacity_blocks = blocks;
            rank.block_size = size;
        }
        ranks.push(rank);
    }
    Ok(combine(&ranks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(line: &str) -> Result<Sample<'_>, LoadReportError> {
        let (_, end) = line_name(line.as_bytes()).expect("a sample line");
        parse_sample(line.as_bytes(), end, 1)
    }

    #[test]
    fn names_colons_escapes_and_spacing() {
        let s = sample(
            "  vllm:cache_config_info{ a = \"x\\\"y\\\\z\\nw\" , b=\"['p, q=r']\",} 1.0 1733045000000",
        )
        .unwrap();
        assert_eq!(s.name, "vllm:cache_config_info");
        assert_eq!(s.label("a"), Some("x\"y\\z\nw"));
        assert_eq!(s.label("b"), Some("['p, q=r']"));
        assert_eq!(s.value, 1.0);
        let s = sample("x{} +Inf").unwrap();
        assert!(s.labels.is_empty() && s.value == f64::INFINITY);
        assert!(sample("x NaN").unwrap().value.is_nan());
        assert_eq!(sample("x\t-1.5e3").unwrap().value, -1500.0);
        // Unknown escapes stay literal.
        assert_eq!(
            sample(r#"x{a="c:\dir"} 1"#).unwrap().label("a"),
            Some(r"c:\dir")
        );
    }

    #[test]
    fn comments_blanks_and_other_names_are_not_samples() {
        for line in [
            "",
            "   ",
            "# HELP x y",
            "#x 1",
            "{a=\"b\"} 1",
            "1x 2",
            "x-y 1",
            "é 1",
        ] {
            assert!(line_name(line.as_bytes()).is_none(), "{line:?}");
        }
    }

    #[test]
    fn broken_sample_lines_name_the_problem() {
        for (line, reason) in [
            ("x", "sample without a value"),
            ("x{a=\"b\"}", "sample without a value"),
            ("x{a=\"b\" 1", "expected ',' or '}' after a label"),
            ("x{a=\"b 1", "unterminated label value"),
            ("x{a=b} 1", "label value not quoted"),
            ("x{a} 1", "label without '='"),
            ("x{1=\"b\"} 1", "invalid label name"),
            ("x{a=\"b\",", "unterminated label set"),
            ("x one", "value is not a number"),
            ("x 1 2 3", "trailing characters after the sample"),
            ("x 1 now", "timestamp is not a number"),
        ] {
            match sample(line) {
                Err(LoadReportError::Syntax { line: 1, reason: r }) => {
                    assert_eq!(r, reason, "{line:?}")
                }
                other => panic!("{line:?}: {other:?}"),
            }
        }
        let invalid_utf8 = b"x{a=\"\xff\"} 1";
        assert!(matches!(
            parse_sample(invalid_utf8, 1, 4),
            Err(LoadReportError::Syntax { line: 4, .. })
        ));
    }

    #[test]
    fn too_many_labels_are_refused() {
        let labels: Vec<String> = (0..=MAX_LABELS).map(|i| format!("l{i}=\"v\"")).collect();
        let line = format!("x{{{}}} 1", labels.join(","));
        assert!(matches!(
            sample(&line),
            Err(LoadReportError::Syntax {
                reason: "too many labels",
                ..
            })
        ));
    }

    fn simple_name() -> impl Strategy<Value = String> {
        "[a-zA-Z_][a-zA-Z0-9_]{0,20}"
    }

    fn simple_value() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9 ._/-]{1,20}"
    }

    proptest! {
        /// On the grammar `prometheus-parse` handles (no colons in names, no
        /// commas, equals signs, quotes or escapes in label values) both parsers
        /// read every line the same.
        #[test]
        fn agrees_with_prometheus_parse(
            lines in proptest::collection::vec(
                (simple_name(),
                 proptest::collection::btree_map("[a-zA-Z_][a-zA-Z0-9_]{0,10}", simple_value(), 0..5),
                 -1.0e12f64..1.0e12),
                1..20),
        ) {
            let text: Vec<String> = lines
                .iter()
                .map(|(name, labels, value)| {
                    let l: Vec<String> =
                        labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                    if l.is_empty() {
                        format!("{name} {value}")
                    } else {
                        format!("{name}{{{}}} {value}", l.join(","))
                    }
                })
                .collect();
            let theirs = prometheus_parse::Scrape::parse(
                text.iter().map(|l| Ok::<_, std::io::Error>(l.clone())),
            )
            .unwrap();
            prop_assert_eq!(theirs.samples.len(), text.len());
            for (line, t) in text.iter().zip(&theirs.samples) {
                let ours = sample(line).unwrap();
                prop_assert_eq!(ours.name, t.metric.as_str());
                let value = match t.value {
                    prometheus_parse::Value::Untyped(v) => v,
                    ref other => panic!("{other:?}"),
                };
                prop_assert_eq!(ours.value, value);
                prop_assert_eq!(ours.labels.len(), t.labels.len());
                for (k, v) in &ours.labels {
                    prop_assert_eq!(t.labels.get(k), Some(v.as_ref()));
                }
            }
        }

        /// Any line, parsed or refused, never panics, and a parsed value is what
        /// the line spelled.
        #[test]
        fn any_line_is_total(line in "\\PC{0,80}") {
            if let Some((_, end)) = line_name(line.as_bytes()) {
                let _ = parse_sample(line.as_bytes(), end, 1);
            }
        }
    }

    #[test]
    fn prometheus_parse_cannot_read_engine_names() {
        // Why this parser exists: the crate drops every `vllm:` sample.
        let text = ["vllm:num_requests_running{engine=\"0\"} 3.0".to_owned()];
        let theirs = prometheus_parse::Scrape::parse(
            text.iter().map(|l| Ok::<_, std::io::Error>(l.clone())),
        )
        .unwrap();
        assert!(theirs.samples.is_empty());
        assert_eq!(sample(&text[0]).unwrap().value, 3.0);
    }
}
