//! The README's quickstart, run as written: its `kvroute` lines start the two
//! mock engines and `kvroute serve` with the shipped config (fixed ports 8080,
//! 9090, 8001/8002, 5557/5558, 5567/5568, as the README says), its `curl` lines
//! run through `sh` from the repository root, and what the README shows must
//! be what comes back: the decision headers of both answers (the second a
//! KV-exact hit confirmed by the engine's own `cached_tokens`), `/readyz`,
//! `/admin/endpoints`, the second decision explained by `/admin/decisions/2`,
//! `/metrics`, and the proxy's 404 naming the admin port.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Upper bound of every wait (debug builds load the tokenizer in seconds).
const WAIT: Duration = Duration::from_secs(90);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The README's quickstart section: its shell lines (comments and line
/// continuations resolved) and its `text` blocks, in order.
struct Quickstart {
    lines: Vec<String>,
    shown: Vec<String>,
}

fn quickstart(readme: &str) -> Quickstart {
    let start = readme
        .find("## Quickstart")
        .expect("README has a '## Quickstart' section");
    let rest = &readme[start + 3..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let (mut lines, mut shown) = (Vec::new(), Vec::new());
    let mut blocks = section.split("```");
    blocks.next();
    while let (Some(block), _) = (blocks.next(), blocks.next()) {
        let (lang, body) = block.split_once('\n').unwrap_or((block, ""));
        match lang.trim() {
            "sh" => {
                let joined = body.replace("\\\n", " ");
                lines.extend(
                    joined
                        .lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty() && !l.starts_with('#'))
                        .map(str::to_owned),
                );
            }
            "text" => shown.push(body.to_owned()),
            _ => {}
        }
    }
    Quickstart { lines, shown }
}

/// Children killed (and reaped) on drop, also when an assertion fails.
struct Procs(Vec<(String, Child, PathBuf)>);

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Procs {
    /// The tail of every child's output, for a failure message.
    fn logs(&self) -> String {
        self.0
            .iter()
            .map(|(cmd, _, log)| {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {cmd}\n{}", tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Runs one README `curl` line as written (through `sh`, from the repo root).
fn sh(line: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(line)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| panic!("sh -c {line:?}: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn port_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Every `host:port` the quickstart lines and config use.
fn ports_in(lines: &[String]) -> Vec<u16> {
    let mut ports = vec![8080, 9090];
    for l in lines
        .iter()
        .filter(|l| l.starts_with("kvroute mock-engine"))
    {
        let words: Vec<&str> = l.split_whitespace().collect();
        for w in words.windows(2) {
            if w[0].ends_with("-port") {
                ports.push(w[1].parse().expect("a port number"));
            }
        }
    }
    ports
}

/// Headers of a `curl -si` output (lower-cased names) and its JSON body.
fn response(out: &str) -> (Vec<(String, String)>, Value) {
    let (head, body) = out
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {out:?}"));
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let json = serde_json::from_str(body).unwrap_or_else(|e| panic!("body {body:?}: {e}"));
    (headers, json)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn readme_quickstart_reaches_a_cache_hit() {
    assert!(
        Command::new("curl").arg("--version").output().is_ok(),
        "the quickstart uses curl: install it (e.g. apt-get install curl)"
    );
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let qs = quickstart(&readme);
    let kvroute: Vec<&String> = qs
        .lines
        .iter()
        .filter(|l| l.starts_with("kvroute "))
        .collect();
    assert_eq!(
        kvroute
            .iter()
            .filter(|l| l.starts_with("kvroute mock-engine "))
            .count(),
        2,
        "two mock engines in {kvroute:?}"
    );
    assert!(
        kvroute
            .iter()
            .any(|l| l.starts_with("kvroute serve --config examples/gateway/config/converged.toml")),
        "serve with the shipped config in {kvroute:?}"
    );
    for p in ports_in(&qs.lines) {
        assert!(
            port_free(p),
            "port {p} on 127.0.0.1 is taken: the quickstart needs it free"
        );
    }

    let logs = tempfile::tempdir().unwrap();
    let mut procs = Procs(Vec::new());
    for (i, line) in kvroute.iter().enumerate() {
        let args: Vec<&str> = line
            .trim_end_matches('&')
            .split_whitespace()
            .skip(1)
            .collect();
        let log = logs.path().join(format!("{i}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(&args)
            .current_dir(repo())
            .env("RUST_LOG", "info")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{line}: {e}"));
        procs.0.push(((*line).clone(), child, log));
    }

    // The README's readiness check, polled until both engines pass their health
    // probe and both event streams are up (the README's first answer names the
    // first endpoint: with only the second one healthy yet, it would go there).
    let readyz = qs
        .lines
        .iter()
        .find(|l| l.starts_with("curl") && l.contains("/readyz"))
        .expect("a /readyz line");
    let deadline = Instant::now() + WAIT;
    let ready = loop {
        let v: Value = serde_json::from_str(&sh(readyz)).unwrap_or(Value::Null);
        let rule = &v["rules"][0];
        if v["ready"] == true
            && rule["endpoints_available"] == 2
            && rule["subscribers_connected"] == 2
        {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "not ready within {WAIT:?}: {v}\n{}",
            procs.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(ready["tokenizers"]["qwen3"]["state"], "loaded", "{ready}");
    assert_eq!(ready["rules"][0]["rule"], "qwen3", "{ready}");

    let chats: Vec<&String> = qs
        .lines
        .iter()
        .filter(|l| l.starts_with("curl -si") && l.contains("/v1/chat/completions"))
        .collect();
    assert_eq!(chats.len(), 2, "the request twice: {chats:?}");
    let answers: Vec<_> = chats.iter().map(|l| response(&sh(l))).collect();
    assert_eq!(qs.shown.len(), 2, "the README shows both answers' headers");
    for (i, ((headers, body), shown)) in answers.iter().zip(&qs.shown).enumerate() {
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "answer {i}: {body}"
        );
        let kv: Vec<_> = headers
            .iter()
            .filter(|(k, _)| k.starts_with("x-kvroute-"))
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let expected: Vec<&str> = shown.lines().filter(|l| !l.is_empty()).collect();
        assert_eq!(
            kv,
            expected,
            "answer {i}: the README shows other headers\n{}",
            procs.logs()
        );
    }
    let (second, body) = &answers[1];
    assert_eq!(header(second, "x-kvroute-tier"), Some("kv_exact"));
    let predicted: u64 = header(second, "x-kvroute-predicted-cached-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Delivery evidence: the engine itself reports what the decision predicted.
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(predicted),
        "{body}"
    );
    assert!(predicted > 0);
    assert!(
        readme.contains(&format!("\"cached_tokens\": {predicted}")),
        "the README quotes the delivered cached tokens ({predicted})"
    );

    let admin_endpoints = qs
        .lines
        .iter()
        .find(|l| l.contains("/admin/endpoints"))
        .expect("an /admin/endpoints line");
    let eps: Value = serde_json::from_str(&sh(admin_endpoints)).expect("endpoints JSON");
    let first = &eps["endpoints"][0];
    assert_eq!(first["url"], "http://127.0.0.1:8001", "{first}");
    assert_eq!(first["hits"], 1, "{first}");
    assert_eq!(first["inventory_blocks"], 7, "{first}");
    assert_eq!(first["contract_status"], "verified", "{first}");
    assert_eq!(first["delivered_cached_tokens"], predicted, "{first}");
    let decision_line = qs
        .lines
        .iter()
        .find(|l| l.contains("/admin/decisions/2"))
        .expect("an /admin/decisions/2 line");
    let d: Value = serde_json::from_str(&sh(decision_line)).expect("decision JSON");
    assert_eq!(d["id"], 2, "{d}");
    assert_eq!(d["tier"], "kv_exact", "{d}");
    assert_eq!(d["endpoint"], "http://127.0.0.1:8001", "{d}");
    assert_eq!(
        d["endpoints"][0]["confirmed_prefix_blocks"], 7,
        "the explanation shows the 7 blocks the engine holds: {d}"
    );
    let metrics_line = qs
        .lines
        .iter()
        .find(|l| l.contains("/metrics"))
        .expect("a /metrics line");
    let metrics = sh(metrics_line);
    assert!(
        metrics.contains("kvroute_decisions_total{rule=\"qwen3\",tier=\"kv_exact\"} 1"),
        "{metrics}"
    );
    assert!(
        readme.contains("kvroute_decisions_total{rule=\"qwen3\",tier=\"kv_exact\"} 1"),
        "the README quotes the metric it promises"
    );

    // Where operators look first: the proxy port names the admin one.
    let not_here = sh("curl -s http://127.0.0.1:8080/metrics");
    assert!(not_here.contains("http://127.0.0.1:9090"), "{not_here}");
    let log = std::fs::read_to_string(&procs.0[2].2).unwrap();
    assert!(
        log.contains("decision") && log.contains("miss_reason=\"zero_overlap\""),
        "the first decision is logged at INFO:\n{log}"
    );
    assert!(!log.contains('\u{1b}'), "ANSI colours in a redirected log");
    let banner = std::fs::read_to_string(&procs.0[0].2).unwrap();
    assert!(
        banner.contains("mock-engine: http://127.0.0.1:8001 zmq=5557 replay=5558"),
        "{banner}"
    );
    drop(procs);
    assert!(Path::new(&repo().join("examples/requests/chat.json")).is_file());
}
