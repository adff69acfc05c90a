//! Hostile ZeroMQ peers against a real `ZmqSubscriber`.
//!
//! The attacker is written here with a plain `TcpStream`: it speaks the ZMTP 3.0
//! NULL handshake by hand as a PUB (64-byte greeting, READY with
//! `Socket-Type=PUB`), then sends what no real publisher would:
//!
//! - one long-frame header declaring 2^40 bytes and no body;
//! - a header declaring 2^32 bytes, then the body trickled in;
//! - 8 MiB frames flagged MORE, without end;
//! - a READY command whose frame header declares 2^40 bytes.
//!
//! Each test asserts that the process survives, the peer's connection is closed
//! and counted (`oversized_peers_dropped`), a legitimate pyzmq publisher
//! (tests/python/kv_publisher.py) is applied afterwards, and the peak resident
//! memory (VmHWM) grows by less than a few × `max_message_bytes`. Every scenario
//! runs in a child process of this test binary, so an abort (`memory allocation
//! of … failed`, what the registry `zeromq` 0.7 decoder does) fails the test
//! instead of the runner, and each peak is measured from a fresh baseline.
//!
//! Binding: a subscriber told to bind `tcp://localhost:P` listens on
//! 127.0.0.1:P (checked in /proc/net/tcp), not on every interface.
#![cfg(feature = "zmq")]

mod interop_support;
use interop_support::fault;

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use fault::{synthetic_key, Rig, RigConfig};
use interop_support::{free_port_pair, Peer};
use kvroute_engines::transport::{
    SocketRole, ZmqEndpoint, ZmqSubscriberConfig, DEFAULT_MAX_MESSAGE_BYTES,
};

const T: Duration = Duration::from_secs(10);
const LIMIT: usize = DEFAULT_MAX_MESSAGE_BYTES;
/// Allowed growth of the peak RSS during one attack.
const GROWTH_BOUND: u64 = 3 * LIMIT as u64;
const CHILD: &str = "KVROUTE_HOSTILE_ZMQ_CHILD";

// ---------------------------------------------------------------------------------
// Scenarios, each in its own process.

#[test]
fn frame_header_declaring_2_pow_40_drops_the_peer() {
    isolated("frame_header_declaring_2_pow_40_drops_the_peer", || {
        bound_attack("2^40 header", |s| {
            let _ = s.write_all(&long_header(false, 1 << 40));
        });
    });
}

#[test]
fn trickled_body_of_a_2_pow_32_frame_is_never_buffered() {
    isolated(
        "trickled_body_of_a_2_pow_32_frame_is_never_buffered",
        || {
            // Allocated before the baseline: the attacker's own buffer is not growth.
            let chunk = vec![0x5au8; 1 << 20];
            bound_attack("2^32 header + trickle", move |s| {
                if s.write_all(&long_header(false, 1 << 32)).is_err() {
                    return;
                }
                // 1 MiB every 10 ms, at most 96 MiB: enough to exceed the bound
                // if it were buffered; ends at the first failed write.
                for _ in 0..96 {
                    if s.write_all(&chunk).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            });
        },
    );
}

#[test]
fn endless_more_frames_are_refused_at_the_message_limit() {
    isolated(
        "endless_more_frames_are_refused_at_the_message_limit",
        || {
            let body = vec![0xa5u8; 8 << 20];
            bound_attack("endless 8 MiB MORE frames", move |s| {
                // At most 24 × 8 MiB = 192 MiB; ends at the first failed write.
                for _ in 0..24 {
                    if s.write_all(&long_header(true, body.len() as u64)).is_err()
                        || s.write_all(&body).is_err()
                    {
                        return;
                    }
                }
            });
        },
    );
}

#[test]
fn oversized_ready_command_is_refused_during_the_handshake() {
    isolated(
        "oversized_ready_command_is_refused_during_the_handshake",
        || {
            let port = free_port_pair();
            let rig = bound_rig(port);
            let hwm = vm_hwm_bytes();
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            s.write_all(&greeting()).unwrap();
            // A command frame (flags: command | long) declaring 2^40 bytes.
            let mut header = vec![0b0000_0110u8];
            header.extend_from_slice(&(1u64 << 40).to_be_bytes());
            let _ = s.write_all(&header);
            assert_closed_by_peer(&mut s, "oversized READY");
            rig.wait_for("the refused handshake counted", T, |r| {
                r.metrics.snapshot().oversized_peers_dropped == 1
            });
            let growth = vm_hwm_bytes().saturating_sub(hwm);
            println!("HOSTILE oversized READY: VmHWM growth {growth} bytes");
            assert!(growth < GROWTH_BOUND, "peak RSS grew by {growth} bytes");
            legitimate_publisher_is_applied(&rig, port);
        },
    );
}

#[test]
fn connected_subscriber_drops_a_hostile_engine_and_redials() {
    isolated(
        "connected_subscriber_drops_a_hostile_engine_and_redials",
        || {
            // A fake engine the subscriber dials (connect role).
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let rig = Rig::start(RigConfig::new(
                ZmqSubscriberConfig::new(ZmqEndpoint::connect(format!("tcp://{addr}")))
                    .retry(Duration::from_millis(10), Duration::from_millis(50)),
            ));
            let hwm = vm_hwm_bytes();
            let (mut s, _) = listener.accept().unwrap();
            handshake_as_pub(&mut s);
            let _ = s.write_all(&long_header(false, 1 << 40));
            assert_closed_by_peer(&mut s, "2^40 header from the dialled engine");
            rig.wait_for("the refused engine counted", T, |r| {
                r.metrics.snapshot().oversized_peers_dropped == 1
            });
            // The subscriber keeps following its engine: it dials again.
            listener.set_nonblocking(true).unwrap();
            let deadline = Instant::now() + T;
            let redial = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => panic!("no redial after the refused engine: {e}"),
                }
            };
            drop(redial);
            let growth = vm_hwm_bytes().saturating_sub(hwm);
            println!("HOSTILE dialled engine 2^40 header: VmHWM growth {growth} bytes");
            assert!(growth < GROWTH_BOUND, "peak RSS grew by {growth} bytes");
            let (m, _) = rig.finish();
            assert_eq!(m.oversized_peers_dropped, 1);
            assert!(m.oversized_frames >= 1);
        },
    );
}

/// A peer that connects to a bound subscriber and never completes the ZMTP
/// handshake is disconnected after `handshake_timeout`; so is one that stops
/// after its greeting. A real publisher is applied afterwards.
#[test]
fn silent_peers_of_a_bound_subscriber_are_disconnected() {
    let port = free_port_pair();
    let rig = Rig::start(RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::bind(format!("tcp://127.0.0.1:{port}")))
            .handshake_timeout(Duration::from_millis(300)),
    ));
    wait_listening(port);
    let mut silent: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let mut greeted = TcpStream::connect(("127.0.0.1", port)).unwrap();
    greeted.write_all(&greeting()).unwrap();
    silent.push(greeted);
    for (i, s) in silent.iter_mut().enumerate() {
        assert_closed_by_peer(s, &format!("silent peer {i}"));
    }
    legitimate_publisher_is_applied(&rig, port);
}

/// Bind only what the operator said: `tcp://localhost:P` (how the subscriber
/// side of an engine that dials `localhost` is derived) listens on loopback.
#[test]
fn binding_a_host_name_listens_on_its_addresses_not_the_wildcard() {
    let port = free_port_pair();
    let endpoint =
        ZmqEndpoint::for_engine(&format!("tcp://localhost:{port}"), "127.0.0.1", 0).unwrap();
    assert_eq!(endpoint.role, SocketRole::Bind);
    assert_eq!(endpoint.address, format!("tcp://localhost:{port}"));
    let rig = Rig::start(RigConfig::new(ZmqSubscriberConfig::new(endpoint)));
    let listening = wait_listening(port);
    println!("HOSTILE bind tcp://localhost:{port}: listening on {listening:?}");
    assert!(
        listening.iter().all(|ip| ip.is_loopback()),
        "tcp://localhost:{port} must listen on loopback only, listens on {listening:?}"
    );
    assert!(listening.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)));
    // An engine dialling the name it was configured with reaches us.
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--mode",
            "connect",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://localhost:{port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":3},{"op":"serve","ms":3000}]"#,
    );
    publisher.expect("PUBLISHED", T);
    rig.wait_for("the batches over localhost", T, |r| {
        (0..3).all(|s| r.has(synthetic_key(0, s)))
    });
}

/// An explicit wildcard stays a wildcard.
#[test]
fn binding_an_explicit_wildcard_listens_on_every_interface() {
    let port = free_port_pair();
    let rig = Rig::start(RigConfig::new(ZmqSubscriberConfig::new(ZmqEndpoint::bind(
        format!("tcp://*:{port}"),
    ))));
    let listening = wait_listening(port);
    assert_eq!(listening, [IpAddr::V4(Ipv4Addr::UNSPECIFIED)]);
    drop(rig);
}

// ---------------------------------------------------------------------------------
// The attack harness.

/// A bound subscriber with the default limit; the attacker handshakes as PUB,
/// runs `attack`, and must see its connection closed; then the checks of the
/// module docs.
fn bound_attack(what: &str, attack: impl FnOnce(&mut TcpStream)) {
    let port = free_port_pair();
    let rig = bound_rig(port);
    let hwm = vm_hwm_bytes();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    handshake_as_pub(&mut s);
    rig.wait_for("the attacker accepted as a peer", T, |r| {
        r.metrics.snapshot().connected
    });
    attack(&mut s);
    assert_closed_by_peer(&mut s, what);
    rig.wait_for("the dropped peer counted", T, |r| {
        let m = r.metrics.snapshot();
        m.oversized_peers_dropped == 1 && !m.connected
    });
    let growth = vm_hwm_bytes().saturating_sub(hwm);
    println!(
        "HOSTILE {what}: VmHWM growth {growth} bytes (bound {GROWTH_BOUND}, max_message_bytes {LIMIT})"
    );
    assert!(
        growth < GROWTH_BOUND,
        "{what}: peak RSS grew by {growth} bytes, more than {GROWTH_BOUND}"
    );
    legitimate_publisher_is_applied(&rig, port);
    let (m, _) = rig.finish();
    assert_eq!(m.oversized_peers_dropped, 1, "{m:?}");
    assert_eq!(m.oversized_frames, 1, "{m:?}");
}

fn bound_rig(port: u16) -> Rig {
    let rig = Rig::start(RigConfig::new(
        ZmqSubscriberConfig::new(ZmqEndpoint::bind(format!("tcp://127.0.0.1:{port}")))
            .max_message_bytes(LIMIT),
    ));
    wait_listening(port);
    rig
}

fn legitimate_publisher_is_applied(rig: &Rig, port: u16) {
    let mut publisher = Peer::publisher(
        &[
            "--engine",
            "vllm",
            "--mode",
            "connect",
            "--socket",
            "xpub",
            "--endpoint",
            &format!("tcp://127.0.0.1:{port}"),
        ],
        r#"[{"op":"wait_subscriber"},{"op":"publish","count":5},{"op":"serve","ms":3000}]"#,
    );
    publisher.expect("PUBLISHED", T);
    rig.wait_for("the legitimate publisher's batches", T, |r| {
        (0..5).all(|s| r.has(synthetic_key(0, s)))
    });
}

/// Runs `scenario` in a child process (this binary, filtered to `name`);
/// the parent asserts it exited cleanly.
fn isolated(name: &str, scenario: impl FnOnce()) {
    if std::env::var(CHILD).as_deref() == Ok(name) {
        scenario();
        println!("SCENARIO-DONE {name}");
        return;
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .output()
        .expect("run the scenario's child process");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // libtest may put "test NAME ... " in front of the child's first line.
    for line in stdout
        .lines()
        .filter_map(|l| l.find("HOSTILE").map(|i| &l[i..]))
    {
        println!("{line}");
    }
    assert!(
        output.status.success() && stdout.contains(&format!("SCENARIO-DONE {name}")),
        "scenario {name} failed in its child process: {} (killed by a signal = the \
         process died, e.g. an allocation abort)\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
}

// ---------------------------------------------------------------------------------
// ZMTP 3.0 by hand (rfc.zeromq.org/spec/23).

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff; // signature: 0xff, 8 bytes padding, 0x7f
    g[9] = 0x7f;
    g[10] = 3; // version 3.0
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL"); // mechanism, zero-padded to 20 bytes
                                        // as-server = 0, filler: zeros
    g
}

fn ready_pub() -> Vec<u8> {
    let mut body = vec![5u8];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut frame = vec![0b0000_0100u8, u8::try_from(body.len()).unwrap()];
    frame.extend_from_slice(&body);
    frame
}

/// Greeting + READY both ways; the peer's READY must name a SUB.
fn handshake_as_pub(s: &mut TcpStream) {
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&greeting()).unwrap();
    s.write_all(&ready_pub()).unwrap();
    let mut peer_greeting = [0u8; 64];
    s.read_exact(&mut peer_greeting).unwrap();
    assert_eq!((peer_greeting[0], peer_greeting[9]), (0xff, 0x7f));
    let mut header = [0u8; 2];
    s.read_exact(&mut header).unwrap();
    assert_eq!(header[0], 0b0000_0100, "a short command frame");
    let mut ready = vec![0u8; usize::from(header[1])];
    s.read_exact(&mut ready).unwrap();
    assert!(ready.starts_with(b"\x05READY"));
    assert!(ready.windows(3).any(|w| w == b"SUB"));
}

fn long_header(more: bool, len: u64) -> Vec<u8> {
    let mut h = vec![0b0000_0010 | u8::from(more)];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

/// Reads (and discards the subscription the SUB sent) until the peer closes
/// the connection; panics if it is still open after `T`.
fn assert_closed_by_peer(s: &mut TcpStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let deadline = Instant::now() + T;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return, // reset by the peer
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the subscriber kept the hostile connection open for {T:?}"
        );
    }
}

// ---------------------------------------------------------------------------------
// /proc readers.

/// Peak resident set of this process (VmHWM), bytes.
fn vm_hwm_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in /proc/self/status");
    kb * 1024
}

/// Addresses with a TCP socket in LISTEN on `port` (/proc/net/tcp and tcp6).
fn listening(port: u16) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(table) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in table.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state)) = (cols.get(1), cols.get(3)) else {
                continue;
            };
            let Some((ip_hex, port_hex)) = local.split_once(':') else {
                continue;
            };
            if *state != "0A" || u16::from_str_radix(port_hex, 16).ok() != Some(port) {
                continue;
            }
            // The kernel prints each 32-bit word of the address as a host-order
            // integer: its native-endian bytes are the address bytes.
            let words: Vec<u32> = (0..ip_hex.len() / 8)
                .filter_map(|i| u32::from_str_radix(&ip_hex[i * 8..i * 8 + 8], 16).ok())
                .collect();
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            if v6 {
                if let Ok(b) = <[u8; 16]>::try_from(bytes.as_slice()) {
                    out.push(IpAddr::V6(Ipv6Addr::from(b)));
                }
            } else if let Ok(b) = <[u8; 4]>::try_from(bytes.as_slice()) {
                out.push(IpAddr::V4(Ipv4Addr::from(b)));
            }
        }
    }
    out
}

fn wait_listening(port: u16) -> Vec<IpAddr> {
    let deadline = Instant::now() + T;
    loop {
        let found = listening(port);
        if !found.is_empty() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "nothing listens on port {port} after {T:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
