//! The documentation checked against the code, so it cannot drift:
//! `docs/configuration.md` against the gateway's configuration loader (first
//! test), and every command the README and `docs/` show against the targets
//! and tests that exist (second test, below).
//!
//! The page documents every key in tables whose first column is the key's
//! full dotted path in backticks (`` `rules.cost.affinity_tokens` ``), with
//! `default`, `example` and `needs` columns. This test runs the built
//! `kvroute serve --config FILE` on generated files (it has no check-only
//! mode: every file's proxy `listen` is a port this test holds, so a file the
//! loader accepts ends at "binding proxy listener" and one it refuses at
//! "invalid configuration: FIELD: MESSAGE") and fails, naming the key, when
//!
//! * the page names a key the gateway does not accept, or the gateway accepts
//!   a key the page does not name. The accepted keys are read from the
//!   gateway itself: every table refuses unknown fields, and serde's error
//!   for a probe field lists the known ones (`unknown field `zz_probe`,
//!   expected one of ...`); a field that is itself a table (or an array of
//!   tables) is found the same way and walked;
//! * a key's example (with the keys in its `needs` column), or its default
//!   when the default is a value in backticks, is refused;
//! * a key that takes one of a set of names (the gateway's error for an
//!   unknown name lists them) does not mention every one of them.

mod config_page;

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use config_page::{code_spans, plain, rows, set, toml_value, Row, MODEL_AND_RULE, PAGE};

/// A run that neither refuses the file nor fails to bind within this is
/// killed and reported.
const RUN_LIMIT: Duration = Duration::from_secs(20);
/// The environment variable the page's `admin.token_env` example names.
const TOKEN_ENV: &str = "KVROUTE_ADMIN_TOKEN";
/// The environment variable the page's `replicas.token_env` example names.
const NATS_TOKEN_ENV: &str = "KVROUTE_NATS_TOKEN";
/// A NATS credentials file in the `.creds` layout (the user seed is the
/// example seed of async-nats' documentation): `kvroute serve` parses the
/// file named by `replicas.credentials_file` at start.
const CREDS: &str = "-----BEGIN NATS USER JWT-----
eyJ0eXAiOiJqd3QiLCJhbGciOiJlZDI1NTE5In0.e30.c2lnbmF0dXJl
------END NATS USER JWT------

-----BEGIN USER NKEY SEED-----
SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM
------END USER NKEY SEED------
";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// What `kvroute serve` made of a file.
enum Outcome {
    /// Validated: it went on to bind the listeners (and found the port taken).
    Accepted,
    /// `invalid configuration: ...`, the message.
    Refused(String),
    /// Anything else (exit status, stderr).
    Other(String),
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Accepted => f.write_str("accepted"),
            Outcome::Refused(m) => write!(f, "refused: {m}"),
            Outcome::Other(m) => write!(f, "neither accepted nor refused: {m}"),
        }
    }
}

/// Runs `kvroute serve` on files written into one temporary directory.
struct Gateway {
    dir: tempfile::TempDir,
    base: toml::Table,
    n: AtomicUsize,
    /// Held for the whole test: the base file's listeners, so a valid file
    /// fails at binding instead of serving.
    _busy: (TcpListener, TcpListener),
}

impl Gateway {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("model")).unwrap();
        let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
        let admin = TcpListener::bind("127.0.0.1:0").unwrap();
        // Every table the page documents, minimal and valid.
        let base = format!(
            "listen = \"{}\"\n[admin]\nlisten = \"{}\"\n{MODEL_AND_RULE}",
            proxy.local_addr().unwrap(),
            admin.local_addr().unwrap(),
        );
        Self {
            dir,
            base: toml::from_str(&base).unwrap(),
            n: AtomicUsize::new(0),
            _busy: (proxy, admin),
        }
    }

    fn run(&self, doc: &toml::Table) -> Outcome {
        let i = self.n.fetch_add(1, Ordering::Relaxed);
        let file = self.dir.path().join(format!("c{i}.toml"));
        let (out, err) = (
            self.dir.path().join(format!("c{i}.out")),
            self.dir.path().join(format!("c{i}.err")),
        );
        std::fs::write(&file, toml::to_string(doc).unwrap()).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--config"])
            .arg(&file)
            .env(TOKEN_ENV, "docs-reference-token")
            .env(NATS_TOKEN_ENV, "docs-reference-nats-token")
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("run kvroute serve");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if start.elapsed() > RUN_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        let stdout = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(i) = stderr.find("invalid configuration: ") {
            let msg = &stderr[i + "invalid configuration: ".len()..];
            return Outcome::Refused(msg.lines().next().unwrap_or("").to_owned());
        }
        if stderr.contains("binding proxy listener")
            || stderr.contains("binding admin listener")
            || stdout.contains("kvroute serve: proxy=")
        {
            return Outcome::Accepted;
        }
        Outcome::Other(format!("status {status:?}, stderr: {stderr}"))
    }

    /// The base file with `changes` applied.
    fn doc(&self, changes: &[(String, toml::Value)], arrays: &BTreeSet<String>) -> toml::Table {
        let mut doc = self.base.clone();
        for (path, value) in changes {
            set(&mut doc, path, value.clone(), arrays);
        }
        doc
    }
}

/// The names after "expected" in a serde message (`one of `a`, `b``, `` `a` ``,
/// `a, b or c`).
fn expected_names(message: &str) -> Vec<String> {
    let Some(i) = message.find("expected ") else {
        return Vec::new();
    };
    let mut list = &message[i + "expected ".len()..];
    if let Some(p) = list.find(" (line ") {
        list = &list[..p];
    }
    let list = list.strip_prefix("one of ").unwrap_or(list);
    list.split(", ")
        .flat_map(|s| s.split(" or "))
        .map(|s| s.trim().trim_matches('`').trim_matches('"').to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

const PROBE: &str = "zz_probe";

fn is_probe_error(outcome: &Outcome) -> Option<Vec<String>> {
    match outcome {
        Outcome::Refused(m) if m.contains(&format!("unknown field `{PROBE}`")) => {
            Some(expected_names(m))
        }
        _ => None,
    }
}

/// Every key the gateway accepts, walked from the root by probing: leaf keys
/// (dotted paths) and the paths that are arrays of tables.
fn schema(gw: &Gateway) -> (BTreeSet<String>, BTreeSet<String>) {
    let probe = || toml::Value::Integer(1);
    let probe_table = || {
        let mut t = toml::Table::new();
        t.insert(PROBE.to_owned(), probe());
        toml::Value::Table(t)
    };
    let (mut leaves, mut arrays) = (BTreeSet::new(), BTreeSet::new());
    let mut tables = vec![String::new()];
    while let Some(table) = tables.pop() {
        let at = |f: &str| {
            if table.is_empty() {
                f.to_owned()
            } else {
                format!("{table}.{f}")
            }
        };
        let outcome = gw.run(&gw.doc(&[(at(PROBE), probe())], &arrays));
        let fields = is_probe_error(&outcome)
            .unwrap_or_else(|| panic!("table `{table}` did not refuse a probe field: {outcome:?}"));
        assert!(
            !fields.is_empty(),
            "table `{table}`: no fields in {outcome:?}"
        );
        for f in fields {
            let path = at(&f);
            let as_table = gw.run(&gw.doc(&[(path.clone(), probe_table())], &arrays));
            if is_probe_error(&as_table).is_some() {
                tables.push(path);
                continue;
            }
            let as_array = gw.run(&gw.doc(
                &[(path.clone(), toml::Value::Array(vec![probe_table()]))],
                &arrays,
            ));
            if is_probe_error(&as_array).is_some() {
                arrays.insert(path.clone());
                tables.push(path);
                continue;
            }
            leaves.insert(path);
        }
    }
    (leaves, arrays)
}

#[test]
fn the_configuration_reference_matches_the_gateway() {
    let page = std::fs::read_to_string(repo().join(PAGE)).unwrap();
    let rows = rows(&page);
    assert!(
        rows.len() > 20,
        "{PAGE}: only {} key rows found",
        rows.len()
    );
    let gw = Gateway::new();

    // The harness itself: the base file is accepted, a bad value refused.
    let none = BTreeSet::new();
    let base = gw.run(&gw.doc(&[], &none));
    assert!(matches!(base, Outcome::Accepted), "base file: {base:?}");
    let zero = gw.run(&gw.doc(
        &[("limits.max_body_bytes".into(), toml::Value::Integer(0))],
        &none,
    ));
    assert!(
        matches!(&zero, Outcome::Refused(m) if m.starts_with("limits.max_body_bytes")),
        "{zero:?}"
    );

    let (schema, arrays) = schema(&gw);
    let mut failures = Vec::new();
    let mut documented = BTreeSet::new();
    for row in &rows {
        if !documented.insert(row.key.clone()) {
            failures.push(format!("`{}` is documented twice", row.key));
        }
        if !schema.contains(&row.key) {
            failures.push(format!(
                "`{}` is documented but `kvroute serve` does not accept it",
                row.key
            ));
        }
        for (path, _) in &row.needs {
            if !schema.contains(&plain(path)) {
                failures.push(format!("`{}` needs unknown key `{path}`", row.key));
            }
        }
    }
    for key in schema.difference(&documented) {
        failures.push(format!(
            "`{key}` is accepted by `kvroute serve` but not documented in {PAGE}"
        ));
    }

    // Examples, defaults and names, several files at a time.
    type Changes = Vec<(String, toml::Value)>;
    type Check<'a> = (&'a Row, &'static str, Changes, Option<Changes>);
    let mut checks: Vec<Check> = Vec::new();
    for row in rows.iter().filter(|r| schema.contains(&r.key)) {
        let mut needs = Vec::new();
        for (path, value) in &row.needs {
            match toml_value(value) {
                Ok(v) => needs.push((path.clone(), v)),
                Err(e) => failures.push(format!("`{}`: needs `{path} = {value}`: {e}", row.key)),
            }
        }
        for (what, value) in [("example", &row.example), ("default", &row.default)] {
            let Some(value) = value else {
                if what == "example" {
                    failures.push(format!("`{}` has no example in backticks", row.key));
                }
                continue;
            };
            match toml_value(value) {
                Ok(v) => {
                    let mut changes = needs.clone();
                    changes.push((row.key.clone(), v.clone()));
                    // A default holds without the example's context (an
                    // absent key means it) or within it.
                    let alone = (what == "default" && !needs.is_empty())
                        .then(|| vec![(row.key.clone(), v)]);
                    checks.push((row, what, changes, alone));
                }
                Err(e) => {
                    failures.push(format!("`{}`: {what} `{value}` is not TOML: {e}", row.key))
                }
            }
        }
        // Directories and files the examples name exist, as a deployment's
        // would (relative paths are relative to the configuration file).
        if row.key == "models.dir" {
            if let Some(toml::Value::String(d)) =
                row.example.as_deref().map(|e| toml_value(e).unwrap())
            {
                std::fs::create_dir_all(gw.dir.path().join(d)).unwrap();
            }
        }
        let example = row
            .example
            .as_deref()
            .map(|e| (row.key.clone(), e.to_owned()));
        for (path, value) in example.into_iter().chain(row.needs.iter().cloned()) {
            if !path.ends_with("_file") {
                continue;
            }
            if let Ok(toml::Value::String(f)) = toml_value(&value) {
                let contents = if path.ends_with("credentials_file") {
                    CREDS
                } else {
                    ""
                };
                std::fs::write(gw.dir.path().join(f), contents).unwrap();
            }
        }
    }
    let next = AtomicUsize::new(0);
    let found: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut found = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((row, what, changes, alone)) = checks.get(i) else {
                            break;
                        };
                        match gw.run(&gw.doc(changes, &arrays)) {
                            Outcome::Accepted => {}
                            _ if alone.as_ref().is_some_and(|a| {
                                matches!(gw.run(&gw.doc(a, &arrays)), Outcome::Accepted)
                            }) => {}
                            other => found.push(format!(
                                "`{}`: the documented {what} is refused: {other:?} (file changes: {changes:?})",
                                row.key
                            )),
                        }
                    }
                    found
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    failures.extend(found);

    for row in rows.iter().filter(|r| schema.contains(&r.key)) {
        let bogus = toml::Value::String("zz_no_such_name".into());
        if let Outcome::Refused(m) = gw.run(&gw.doc(&[(row.key.clone(), bogus)], &arrays)) {
            if !m.contains(": unknown ") || m.contains("unknown field") {
                continue;
            }
            for name in expected_names(&m) {
                if !row.text.contains(&format!("`\"{name}\"`"))
                    && !row.text.contains(&format!("`{name}`"))
                {
                    failures.push(format!(
                        "`{}` takes \"{name}\" but its row does not list it ({m})",
                        row.key
                    ));
                }
            }
        }
    }

    assert!(
        failures.is_empty(),
        "{PAGE} and the gateway's configuration disagree:\n  {}",
        failures.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// The documentation's commands.
//
// A fenced `sh` block in README.md or docs/*.md is either run by a test or
// says what it needs with a first line `# needs: ...` (a GPU, a real engine,
// a release build and a quiet machine for a benchmark). Unmarked `kvroute`
// lines are cheap and run here, from the repository root, with the built
// binary; the README's quickstart is run by `quickstart.rs`; the few other
// unmarked lines are listed below with the test that covers them. Every
// `cargo test|bench|run -p PACKAGE --test|--bench|--example NAME [FILTER]` the
// pages name, in a block or inline, must still point at an existing target
// (and its filter at an existing test), so a moved crate or a renamed test
// shows here.

/// Unmarked commands run elsewhere, and where.
const RUN_ELSEWHERE: [(&str, &str); 3] = [
    (
        "bash scripts/test.sh",
        "the test command itself (`.ci/run`)",
    ),
    (
        "cargo run --release -p kvroute-gateway -- demo",
        "`demo_cli.rs` runs `kvroute demo` (fewer requests, debug build)",
    ),
    (
        "cargo build --release -p kvroute-gateway",
        "the test command builds the same package",
    ),
];

/// A command and its line number.
type Numbered = (usize, String);

/// `(line number, command)` of every unmarked `sh` line, and the
/// marked ones' commands separately (they are still checked for targets).
fn shell_lines(file: &str, text: &str) -> (Vec<Numbered>, Vec<Numbered>) {
    let (mut unmarked, mut marked) = (Vec::new(), Vec::new());
    let mut block: Option<(String, Vec<Numbered>)> = None;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if let Some((lang, lines)) = &mut block {
            if t == "```" {
                if lang == "sh" {
                    let needs = lines
                        .iter()
                        .find(|(_, l)| !l.trim().is_empty())
                        .is_some_and(|(_, l)| l.trim_start().starts_with("# needs:"));
                    let mut joined: Vec<Numbered> = Vec::new();
                    let mut cont = false;
                    for (ln, l) in lines.drain(..) {
                        let piece = l.trim().trim_end_matches('\\').trim().to_owned();
                        if cont {
                            let last = joined.last_mut().unwrap();
                            last.1.push(' ');
                            last.1.push_str(&piece);
                        } else if !piece.is_empty() && !piece.starts_with('#') {
                            joined.push((ln + 1, piece));
                        }
                        cont = l.trim_end().ends_with('\\');
                    }
                    if needs { &mut marked } else { &mut unmarked }.extend(joined);
                }
                block = None;
            } else {
                lines.push((n, line.to_owned()));
            }
        } else if let Some(lang) = t.strip_prefix("```") {
            block = Some((lang.trim().to_owned(), Vec::new()));
        }
    }
    assert!(block.is_none(), "{file}: a code fence is not closed");
    (unmarked, marked)
}

/// Package name → directory, from the repository's manifests.
fn packages() -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![repo()];
    for d in [repo(), repo().join("examples")] {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            dirs.push(e.path());
        }
    }
    for d in dirs {
        let Ok(m) = std::fs::read_to_string(d.join("Cargo.toml")) else {
            continue;
        };
        let Ok(t) = toml::from_str::<toml::Table>(&m) else {
            continue;
        };
        if let Some(name) = t
            .get("package")
            .and_then(|p| p.get("name"))
            .and_then(|n| n.as_str())
        {
            out.insert(name.to_owned(), d);
        }
    }
    out
}

fn rs_files(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `path` relative to the repository root, for messages.
fn rel(path: &std::path::Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn mentions(files: &[PathBuf], word: &str) -> bool {
    files
        .iter()
        .any(|f| std::fs::read_to_string(f).is_ok_and(|t| t.contains(word)))
}

/// Whether a `cargo test|bench|run` command names targets that exist; `None`
/// when it is no such command.
fn cargo_target_problem(cmd: &str, packages: &BTreeMap<String, PathBuf>) -> Option<String> {
    let (dir_prefix, cmd) = match cmd.split_once(" && ") {
        Some((cd, rest)) => (cd.strip_prefix("cd ").map(|d| repo().join(d)), rest),
        None => (None, cmd),
    };
    let words: Vec<&str> = cmd
        .split_whitespace()
        .skip_while(|w| w.contains('=') && !w.starts_with('-'))
        .collect();
    if words.first() != Some(&"cargo") || !matches!(words.get(1), Some(&("test" | "bench" | "run")))
    {
        return None;
    }
    let args: Vec<&str> = words[2..]
        .iter()
        .copied()
        .take_while(|w| *w != "--")
        .collect();
    let flag = |f: &str| {
        args.iter()
            .position(|w| *w == f)
            .and_then(|i| args.get(i + 1))
            .copied()
    };
    let dir = match (flag("-p"), dir_prefix) {
        (Some(p), _) => match packages.get(p) {
            Some(d) => d.clone(),
            None => return Some(format!("no package `{p}`")),
        },
        (None, Some(d)) => d,
        (None, None) => return None,
    };
    let mut problem = None;
    for (kind, sub) in [
        ("--test", "tests"),
        ("--bench", "benches"),
        ("--example", "examples"),
    ] {
        if let Some(name) = flag(kind) {
            let file = dir.join(sub).join(format!("{name}.rs"));
            if !file.is_file() && !dir.join(sub).join(name).is_dir() {
                problem = Some(format!(
                    "no {kind} target `{name}` ({} missing)",
                    rel(&file)
                ));
            } else if kind == "--test" {
                // The filter after the target, if any: a test in that file.
                let i = args.iter().position(|w| *w == kind).unwrap() + 2;
                if let Some(filter) = args.get(i).filter(|f| !f.starts_with('-')) {
                    let mut files = Vec::new();
                    rs_files(&dir.join(sub), &mut files);
                    let word = filter.trim_end_matches('_').trim_end_matches('…');
                    if !mentions(&files, word) {
                        problem = Some(format!("no test matching `{filter}` in {}", rel(&file)));
                    }
                }
            }
        }
    }
    for kind in ["--lib", "--bin"] {
        if let Some(i) = args.iter().position(|w| *w == kind) {
            let skip = usize::from(kind == "--bin") + 1;
            if let Some(filter) = args.get(i + skip).filter(|f| !f.starts_with('-')) {
                let mut files = Vec::new();
                rs_files(&dir.join("src"), &mut files);
                let word = filter.rsplit("::").next().unwrap_or(filter);
                if !mentions(&files, word) {
                    problem = Some(format!(
                        "no test matching `{filter}` in {}",
                        rel(&dir.join("src"))
                    ));
                }
            }
        }
    }
    problem
}

#[test]
fn every_documented_command_runs_in_a_test_or_says_what_it_needs() {
    let mut pages = vec!["README.md".to_owned()];
    for e in std::fs::read_dir(repo().join("docs")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    pages.sort();
    let packages = packages();
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let qs_start = readme
        .find("## Quickstart")
        .expect("README has a quickstart");
    let qs_end = readme[qs_start + 3..]
        .find("\n## ")
        .map_or(readme.len(), |i| qs_start + 3 + i);
    let qs_lines = (
        readme[..qs_start].lines().count(),
        readme[..qs_end].lines().count(),
    );
    let mut failures = Vec::new();
    let mut ran = 0;
    for page in &pages {
        let text = std::fs::read_to_string(repo().join(page)).unwrap();
        let (unmarked, marked) = shell_lines(page, &text);
        for (n, cmd) in unmarked.iter().chain(&marked) {
            if let Some(p) = cargo_target_problem(cmd, &packages) {
                failures.push(format!("{page}:{n}: `{cmd}`: {p}"));
            }
        }
        // Inline `cargo ...` commands (tables of tests and benchmarks).
        for (n, line) in text.lines().enumerate() {
            for span in code_spans(line) {
                if let Some(p) = cargo_target_problem(&span, &packages) {
                    failures.push(format!("{page}:{}: `{span}`: {p}", n + 1));
                }
            }
        }
        for (n, cmd) in unmarked {
            if page == "README.md" && n > qs_lines.0 && n <= qs_lines.1 {
                continue; // quickstart.rs runs these as written
            }
            if RUN_ELSEWHERE.iter().any(|(c, _)| *c == cmd) {
                continue;
            }
            let Some(args) = cmd.strip_prefix("kvroute ") else {
                failures.push(format!(
                    "{page}:{n}: `{cmd}` is run by no test: run it in one, or start its block with `# needs: ...`"
                ));
                continue;
            };
            let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
                .args(args.split_whitespace())
                .current_dir(repo())
                .output()
                .unwrap();
            ran += 1;
            if !out.status.success() {
                failures.push(format!(
                    "{page}:{n}: `{cmd}` failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    assert!(ran > 0, "no documented `kvroute` command ran");
    assert!(
        failures.is_empty(),
        "documented commands:\n  {}",
        failures.join("\n  ")
    );
}
