//! `kvroute parity`: walk golden files and verify each against the library.
//!
//! Every `*.json` file is a case file and must be recognised by one of the
//! checkers (hash vectors in `kvroute-core`, event fixtures and chat cases in
//! `kvroute-engines`); an unrecognised JSON file is a failure, never a skip.
//! Payload companions (`*.msgpack`) are verified through their JSON file and are a
//! failure when orphaned. A directory holding `tokenizer_config.json` plus
//! `tokenizer.json[.gz]` is a model directory: its files are assets for chat
//! cases, not cases. Engine-metrics cases (a JSON array of `{file, dialect,
//! expect}`) parse each named body with `kvroute_engines::parse_load`; the bodies
//! they name are verified through them. Documentation and generator scripts
//! (`*.md`, `*.txt`, `*.py`, `*.sh`) are listed, not checked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvroute_core::golden::{GoldenFailure, GoldenReport};
use kvroute_engines::prompt::golden as chat_golden;
use kvroute_engines::prompt::ModelOptions;
use serde_json::Value;

/// The schema tag of chat-case files.
const CHAT_SCHEMA: &str = "kvroute-chat-golden/1";

/// Runs the command; the exit status is non-zero when anything failed or no case
/// was found.
pub fn run(paths: &[PathBuf], model_dir: Option<&Path>, verbose: bool) -> ExitCode {
    let report = check_paths(paths, model_dir);
    for line in &report.lines {
        println!("{line}");
    }
    if verbose {
        for ok in &report.passed_cases {
            println!("ok {ok}");
        }
    }
    if !report.documents.is_empty() {
        println!(
            "note: {} documentation file(s) not checked: {}",
            report.documents.len(),
            report.documents.join(", ")
        );
    }
    println!("{}", report.golden.summary());
    if report.golden.is_clean() && report.golden.passed > 0 {
        ExitCode::SUCCESS
    } else {
        if report.golden.passed == 0 && report.golden.is_clean() {
            eprintln!("kvroute parity: no golden case found under the given paths");
        }
        ExitCode::FAILURE
    }
}

/// Everything `kvroute parity` found.
#[derive(Default)]
pub struct ParityReport {
    /// Cases passed / failed, across every format.
    pub golden: GoldenReport,
    /// Output lines for failures, in walk order.
    pub lines: Vec<String>,
    /// `file case` labels of passing cases (for `--verbose`).
    pub passed_cases: Vec<String>,
    /// Documentation files seen and not checked.
    pub documents: Vec<String>,
}

impl ParityReport {
    fn absorb(&mut self, file: &str, part: GoldenReport) {
        for f in &part.failures {
            self.lines.push(f.to_string());
        }
        if part.passed > 0 {
            self.passed_cases
                .push(format!("{file} ({} case(s))", part.passed));
        }
        self.golden.merge(part);
    }

    fn fail(&mut self, file: &str, case: &str, message: impl Into<String>) {
        let failure = GoldenFailure {
            file: file.to_owned(),
            case: case.to_owned(),
            message: message.into(),
        };
        self.lines.push(failure.to_string());
        self.golden.failures.push(failure);
    }
}

/// Checks every file under `paths`.
pub fn check_paths(paths: &[PathBuf], model_dir: Option<&Path>) -> ParityReport {
    let mut report = ParityReport::default();
    let mut files = Vec::new();
    for p in paths {
        if let Err(e) = collect(p, &mut files) {
            report.fail(&p.display().to_string(), "-", format!("cannot read: {e}"));
        }
    }
    files.sort();
    files.dedup();
    let model_dirs: BTreeSet<PathBuf> = files
        .iter()
        .filter_map(|f| f.parent())
        .filter(|d| is_model_dir(d))
        .map(Path::to_path_buf)
        .collect();
    let json_stems: BTreeSet<PathBuf> = files
        .iter()
        .filter(|f| has_ext(f, "json"))
        .map(|f| f.with_extension(""))
        .collect();
    let metrics_bodies: BTreeSet<PathBuf> = files
        .iter()
        .filter(|f| has_ext(f, "json"))
        .filter_map(|f| {
            let v: Value = serde_json::from_slice(&std::fs::read(f).ok()?).ok()?;
            let dir = f.parent()?.to_path_buf();
            Some(
                metrics_cases(&v)?
                    .into_iter()
                    .map(move |(b, _, _)| dir.join(b)),
            )
        })
        .flatten()
        .collect();

    for file in &files {
        let label = file.display().to_string();
        if file.parent().is_some_and(|d| model_dirs.contains(d)) {
            continue;
        }
        if metrics_bodies.contains(file) {
            continue;
        }
        if has_ext(file, "json") {
            check_json_file(file, &label, model_dir, &model_dirs, &mut report);
        } else if has_ext(file, "msgpack") {
            if !json_stems.contains(&file.with_extension("")) {
                report.fail(&label, "-", "payload file without its JSON fixture");
            }
        } else if ["md", "txt", "py", "sh"].iter().any(|e| has_ext(file, e)) {
            report.documents.push(label);
        } else {
            report.fail(&label, "-", "not a golden file kvroute can interpret");
        }
    }
    report
}

fn check_json_file(
    file: &Path,
    label: &str,
    model_dir: Option<&Path>,
    model_dirs: &BTreeSet<PathBuf>,
    report: &mut ParityReport,
) {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) => return report.fail(label, "-", format!("cannot read: {e}")),
    };
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return report.fail(label, "-", format!("not JSON: {e}")),
    };
    if let Some(part) = kvroute_core::golden::check_value(label, &value) {
        return report.absorb(label, part);
    }
    if kvroute_engines::events::golden::detect(&value).is_some() {
        let part = kvroute_engines::events::golden::check(&value, file);
        let mut problems: Vec<String> = part
            .failures
            .iter()
            .map(|f| format!("{}: expected {} got {}", f.what, f.expected, f.actual))
            .collect();
        if part.checks == 0 {
            problems.push("nothing was checked".to_owned());
        }
        let mut golden = GoldenReport::new();
        golden.record(label, "fixture", &problems);
        return report.absorb(label, golden);
    }
    if let Some(cases) = metrics_cases(&value) {
        return check_metrics_cases(file, &cases, label, report);
    }
    let schema = value
        .get("meta")
        .and_then(|m| m.get("schema"))
        .and_then(Value::as_str);
    if schema == Some(CHAT_SCHEMA) {
        return check_chat_file(&bytes, &value, label, model_dir, model_dirs, report);
    }
    report.fail(
        label,
        "-",
        "unrecognised JSON: not a hash-vector, event-fixture or chat-case file",
    );
}

/// `(body file, dialect, expected report)` of an engine-metrics case file.
fn metrics_cases(value: &Value) -> Option<Vec<(String, String, Value)>> {
    let cases = value.as_array()?;
    if cases.is_empty() {
        return None;
    }
    cases
        .iter()
        .map(|c| {
            Some((
                c.get("file")?.as_str()?.to_owned(),
                c.get("dialect")?.as_str()?.to_owned(),
                c.get("expect")?.clone(),
            ))
        })
        .collect()
}

fn check_metrics_cases(
    file: &Path,
    cases: &[(String, String, Value)],
    label: &str,
    report: &mut ParityReport,
) {
    let dir = file.parent().unwrap_or(Path::new("."));
    let mut golden = GoldenReport::new();
    for (body, dialect, expect) in cases {
        let problems: Vec<String> = match (
            dialect.parse::<kvroute_engines::MetricsDialect>(),
            std::fs::read(dir.join(body)),
        ) {
            (Err(e), _) => vec![format!("dialect {dialect:?}: {e}")],
            (_, Err(e)) => vec![format!("cannot read {body}: {e}")],
            (Ok(d), Ok(bytes)) => match kvroute_engines::parse_load(d, &bytes) {
                Err(e) => vec![format!("parse: {e}")],
                Ok(r) => {
                    let got = serde_json::json!({
                        "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                        "kv_capacity_blocks": r.kv_capacity_blocks, "block_size": r.block_size,
                        "kv_capacity_tokens": r.kv_capacity_tokens,
                        "waiting_prefill_tokens": r.waiting_prefill_tokens, "ranks": r.ranks,
                        "prefill_computed_tokens": r.prefill_computed_tokens,
                        "prefill_seconds": r.prefill_seconds,
                    });
                    expect
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .filter(|(k, want)| !same_number(&got[k.as_str()], want))
                                .map(|(k, want)| {
                                    format!("{k}: expected {want} got {}", got[k.as_str()])
                                })
                                .collect()
                        })
                        .unwrap_or_else(|| vec!["expect is not an object".to_owned()])
                }
            },
        };
        golden.record(label, body, &problems);
    }
    report.absorb(label, golden);
}

/// Equal JSON values, numbers compared as f64 within 1e-9.
fn same_number(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9,
        _ => a == b,
    }
}

fn check_chat_file(
    bytes: &[u8],
    value: &Value,
    label: &str,
    model_dir: Option<&Path>,
    model_dirs: &BTreeSet<PathBuf>,
    report: &mut ParityReport,
) {
    let dir = match model_dir {
        Some(d) => d.to_path_buf(),
        None => match pick_model_dir(value, model_dirs) {
            Ok(d) => d,
            Err(msg) => return report.fail(label, "-", msg),
        },
    };
    match chat_golden::check_chat_cases_in_dir(bytes, &dir, &ModelOptions::default()) {
        Ok(part) => {
            let mut golden = GoldenReport::new();
            golden.passed = part.passed;
            for f in part.failures {
                golden.fail(label, &f.id, f.reason);
            }
            let unaccounted = part
                .total
                .saturating_sub(part.passed + golden.failures.len());
            if unaccounted > 0 {
                golden.fail(
                    label,
                    "-",
                    format!("{unaccounted} case(s) neither passed nor failed"),
                );
            }
            report.absorb(label, golden);
        }
        Err(e) => report.fail(label, "-", format!("model {}: {e}", dir.display())),
    }
}

/// Chooses the model directory whose tokenizer matches the chat file's recorded
/// checksum; with a single model directory and no checksum, that one.
fn pick_model_dir(value: &Value, model_dirs: &BTreeSet<PathBuf>) -> Result<PathBuf, String> {
    let wanted = value
        .get("meta")
        .and_then(|m| m.get("tokenizer"))
        .and_then(|t| t.get("tokenizer.json_sha256"))
        .and_then(Value::as_str);
    let mut candidates = Vec::new();
    for dir in model_dirs {
        match (wanted, tokenizer_sha256(dir)) {
            (Some(w), Some(have)) if w.eq_ignore_ascii_case(&have) => return Ok(dir.clone()),
            (None, _) => candidates.push(dir.clone()),
            _ => {}
        }
    }
    match candidates.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(
            "no model directory matches this chat file's tokenizer; pass --model-dir DIR"
                .to_owned(),
        ),
    }
}

fn tokenizer_sha256(dir: &Path) -> Option<String> {
    use sha2::Digest as _;
    let plain = dir.join("tokenizer.json");
    let bytes = if plain.is_file() {
        std::fs::read(plain).ok()?
    } else {
        let gz = std::fs::File::open(dir.join("tokenizer.json.gz")).ok()?;
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz), &mut out).ok()?;
        out
    };
    Some(hex::encode(sha2::Sha256::digest(&bytes)))
}

fn is_model_dir(dir: &Path) -> bool {
    dir.join("tokenizer_config.json").is_file()
        && (dir.join("tokenizer.json").is_file() || dir.join("tokenizer.json.gz").is_file())
}

fn has_ext(p: &Path, ext: &str) -> bool {
    p.extension().is_some_and(|e| e == ext)
}

fn collect(path: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.is_file() {
        out.push(path.to_path_buf());
        return Ok(());
    }
    for entry in std::fs::read_dir(path)? {
        let p = entry?.path();
        if p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'))
        {
            continue;
        }
        collect(&p, out)?;
    }
    Ok(())
}
