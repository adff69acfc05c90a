//! Shared helpers of the real-peer interop tests: the venv Python that runs the
//! pyzmq/msgspec publishers and the HTTP drain server, port picking, and a
//! recording sink.
#![allow(dead_code)]

pub mod fault;
pub mod transformers;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_engines::transport::{
    Frame, FrameReport, FrameSink, FrameSource, ReplayOutcome, SinkAction,
};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn golden(rel: &str) -> PathBuf {
    repo_root().join("golden").join(rel)
}

/// The venv interpreter; fails (never skips) when it is missing.
pub fn python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/python-env.sh (creates the venv with pyzmq + msgspec) \
         before the interop tests",
        python.display()
    );
    python
}

pub fn script(name: &str) -> PathBuf {
    repo_root().join("tests/python").join(name)
}

/// A free TCP port `p` on 127.0.0.1 such that `p + 1` is free too (DP rank 1).
pub fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let a = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no free port pair");
}

/// A Python peer process with its stdout lines on a channel; killed on drop.
pub struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Peer {
    pub fn spawn(script_name: &str, args: &[&str]) -> Peer {
        let mut child = Command::new(python())
            .arg(script(script_name))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn python peer");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Peer {
            child,
            stdin,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// A publisher running `steps` (JSON) with `args`.
    pub fn publisher(args: &[&str], steps: &str) -> Peer {
        let mut peer = Peer::spawn("kv_publisher.py", args);
        // The script is read as one stdin line.
        peer.send_line(&steps.replace('\n', " "));
        peer
    }

    pub fn send_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for a stdout line starting with `prefix`; panics on timeout, on an
    /// `ERROR` line, or when the peer exits.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    assert!(!line.starts_with("ERROR"), "peer failed: {line}");
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "no {prefix:?} line from peer within {timeout:?} ({e:?}); seen: {:?}",
                    self.seen
                ),
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a [`Recorder`] saw, shared with the test while the subscriber runs.
#[derive(Debug, Default)]
pub struct Record {
    /// Applied frames per epoch (an epoch starts at each detected restart).
    pub applied: Vec<BTreeMap<u64, Vec<u8>>>,
    pub live: u64,
    pub replayed: u64,
    pub gaps: Vec<(u64, u64)>,
    pub restarts: u64,
    pub connected: u64,
    pub disconnected: u64,
    pub replays: Vec<ReplayOutcome>,
    pub topics: BTreeSet<Vec<u8>>,
}

impl Record {
    pub fn epoch_seqs(&self, epoch: usize) -> Vec<u64> {
        self.applied
            .get(epoch)
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }
}

/// A minimal stand-in for the ingest state machine: tracks the next expected seq,
/// asks for a bootstrap replay on connect and a replay from 0 after a restart,
/// deduplicates by seq inside an epoch, and records everything.
#[derive(Clone, Default)]
pub struct Recorder {
    pub record: Arc<Mutex<Record>>,
    next: Arc<Mutex<Option<u64>>>,
    /// Ask for a replay on connect / restart.
    pub replay: bool,
}

impl Recorder {
    pub fn new(replay: bool) -> Self {
        let r = Recorder {
            replay,
            ..Recorder::default()
        };
        r.record.lock().unwrap().applied.push(BTreeMap::new());
        r
    }

    pub fn snapshot<T>(&self, f: impl FnOnce(&Record) -> T) -> T {
        f(&self.record.lock().unwrap())
    }

    /// Polls until `cond` holds; panics after `timeout`.
    pub fn wait_for(&self, what: &str, timeout: Duration, cond: impl Fn(&Record) -> bool) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if cond(&self.record.lock().unwrap()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!(
            "timed out waiting for {what}: {:#?}",
            self.record.lock().unwrap()
        );
    }
}

impl FrameSink for Recorder {
    fn on_frame(&mut self, frame: Frame<'_>) -> FrameReport {
        let mut rec = self.record.lock().unwrap();
        let mut next = self.next.lock().unwrap();
        let mut report = FrameReport::default();
        rec.topics.insert(frame.topic.to_vec());
        match frame.source {
            FrameSource::Live => rec.live += 1,
            FrameSource::Replay => rec.replayed += 1,
        }
        if let Some(n) = *next {
            if frame.seq < n && frame.source == FrameSource::Live {
                rec.restarts += 1;
                rec.applied.push(BTreeMap::new());
                report.restart = true;
                report.cleared = true;
                if self.replay {
                    report.action = SinkAction::Replay { from_seq: 0 };
                }
            } else if frame.seq > n {
                rec.gaps.push((n, frame.seq));
                report.gap = true;
            }
        }
        let epoch = rec.applied.last_mut().unwrap();
        if epoch.insert(frame.seq, frame.payload.to_vec()).is_some() {
            report.ignored = true;
        } else {
            report.events_applied = 1;
        }
        *next = Some(next.map_or(frame.seq + 1, |n| n.max(frame.seq + 1)));
        if report.restart {
            *next = Some(frame.seq + 1);
        }
        report
    }

    fn on_connected(&mut self) -> SinkAction {
        self.record.lock().unwrap().connected += 1;
        if self.replay {
            SinkAction::Replay {
                from_seq: self.next.lock().unwrap().unwrap_or(0),
            }
        } else {
            SinkAction::Continue
        }
    }

    fn on_disconnected(&mut self) {
        self.record.lock().unwrap().disconnected += 1;
    }

    fn on_replay_done(&mut self, outcome: &ReplayOutcome) -> FrameReport {
        self.record.lock().unwrap().replays.push(*outcome);
        FrameReport::default()
    }
}

/// Runs `fut` on a fresh current-thread-free multi-thread runtime owned by the test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
