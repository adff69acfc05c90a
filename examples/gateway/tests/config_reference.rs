//! `docs/configuration.md` checked against the gateway's configuration
//! loader, so the reference cannot drift from the schema.
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

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const PAGE: &str = "docs/configuration.md";
/// A run that neither refuses the file nor fails to bind within this is
/// killed and reported.
const RUN_LIMIT: Duration = Duration::from_secs(20);
/// The environment variable the page's `admin.token_env` example names.
const TOKEN_ENV: &str = "KVROUTE_ADMIN_TOKEN";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One documented key.
#[derive(Debug)]
struct Row {
    key: String,
    /// The default as a TOML value, when the page gives one in backticks.
    default: Option<String>,
    example: Option<String>,
    /// `(dotted path, TOML value)` the example (and the default) needs.
    needs: Vec<(String, String)>,
    /// The whole table row, for the names check and messages.
    text: String,
}

/// The backticked spans of a cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s.to_owned())
        .collect()
}

/// A cell that is exactly one backticked span: its content.
fn literal(cell: &str) -> Option<String> {
    let c = cell.trim();
    (c.len() >= 2
        && c.starts_with('`')
        && c.ends_with('`')
        && c[1..c.len() - 1].find('`').is_none())
    .then(|| c[1..c.len() - 1].to_owned())
}

fn rows(page: &str) -> Vec<Row> {
    let mut out = Vec::new();
    let mut columns: Option<BTreeMap<String, usize>> = None;
    for line in page.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            columns = None;
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.first() == Some(&"key") {
            columns = Some(
                cells
                    .iter()
                    .enumerate()
                    .map(|(i, c)| ((*c).to_owned(), i))
                    .collect(),
            );
            continue;
        }
        let (Some(cols), Some(key)) = (&columns, cells.first().and_then(|c| literal(c))) else {
            continue;
        };
        let cell = |name: &str| {
            let i = *cols
                .get(name)
                .unwrap_or_else(|| panic!("{PAGE}: a key table without a `{name}` column"));
            cells.get(i).copied().unwrap_or("")
        };
        let needs = code_spans(cell("needs"))
            .into_iter()
            .map(|n| {
                let (path, value) = n
                    .split_once(" = ")
                    .unwrap_or_else(|| panic!("{key}: needs `{n}` is not `path = value`"));
                (path.to_owned(), value.to_owned())
            })
            .collect();
        out.push(Row {
            default: literal(cell("default")),
            example: literal(cell("example")),
            needs,
            text: line.to_owned(),
            key,
        });
    }
    out
}

/// The segments of `rules.endpoints[1].role`: `("rules", 0)`, `("endpoints", 1)`, `("role", 0)`.
fn segments(path: &str) -> Vec<(String, usize)> {
    path.split('.')
        .map(|s| match s.split_once('[') {
            Some((name, rest)) => (
                name.to_owned(),
                rest.trim_end_matches(']')
                    .parse()
                    .unwrap_or_else(|_| panic!("bad index in {path}")),
            ),
            None => (s.to_owned(), 0),
        })
        .collect()
}

/// The dotted path without indices.
fn plain(path: &str) -> String {
    segments(path)
        .into_iter()
        .map(|(s, _)| s)
        .collect::<Vec<_>>()
        .join(".")
}

fn toml_value(text: &str) -> Result<toml::Value, String> {
    let t: toml::Table = toml::from_str(&format!("v = {text}")).map_err(|e| e.to_string())?;
    Ok(t["v"].clone())
}

/// Sets `path` in `doc`: tables are created as needed; a segment in `arrays`
/// (an array of tables) is indexed, grown with empty tables when short.
fn set(doc: &mut toml::Table, path: &str, value: toml::Value, arrays: &BTreeSet<String>) {
    let segs = segments(path);
    let mut table = doc;
    let mut at = String::new();
    for (i, (name, index)) in segs.iter().enumerate() {
        if !at.is_empty() {
            at.push('.');
        }
        at.push_str(name);
        if i + 1 == segs.len() {
            table.insert(name.clone(), value);
            return;
        }
        if arrays.contains(&at) {
            let entry = table
                .entry(name.clone())
                .or_insert_with(|| toml::Value::Array(Vec::new()));
            if !entry.is_array() {
                *entry = toml::Value::Array(Vec::new());
            }
            let list = entry.as_array_mut().unwrap();
            while list.len() <= *index {
                list.push(toml::Value::Table(toml::Table::new()));
            }
            table = list[*index].as_table_mut().expect("an array of tables");
        } else {
            let entry = table
                .entry(name.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if !entry.is_table() {
                *entry = toml::Value::Table(toml::Table::new());
            }
            table = entry.as_table_mut().unwrap();
        }
    }
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
        // Every table the page documents, minimal and valid: one model, one
        // KV-exact rule, a plain endpoint (index 0, which `set` addresses) and
        // one with KV events (so endpoint 0 may change engine or role).
        let base = format!(
            r#"
            listen = "{}"
            [admin]
            listen = "{}"
            [[models]]
            slug = "m"
            dir = "model"
            [[rules]]
            name = "r"
            models = ["m"]
            contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0"
            [[rules.endpoints]]
            url = "http://127.0.0.1:9"
            [[rules.endpoints]]
            url = "http://127.0.0.1:10"
            zmq = "tcp://*:11"
            "#,
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
        // Directories the examples name exist, as a deployment's would.
        if row.key == "models.dir" {
            if let Some(toml::Value::String(d)) =
                row.example.as_deref().map(|e| toml_value(e).unwrap())
            {
                std::fs::create_dir_all(gw.dir.path().join(d)).unwrap();
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
