//! Mooncake trace parsing (a hand-written golden trace and bad lines), block-key
//! derivation at several block sizes, and generator round trips.

use kvroute_sim as sim;

use std::path::PathBuf;

use sim::trace::{block_keys, parse_jsonl, TraceError, Workload};
use sim::workload::{generate, GenConfig, Kind};

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("workloads/mooncake-golden.jsonl")
}

fn golden() -> Workload {
    sim::load_trace(&golden_path()).unwrap()
}

fn keys(w: &Workload, i: usize, bs: u32) -> Vec<kvroute_core::BlockKey> {
    let r = w.requests()[i];
    let mut out = Vec::new();
    block_keys(w.ids(&r), r.input_tokens, bs, &mut out);
    out
}

#[test]
fn golden_trace_fields() {
    let w = golden();
    assert_eq!(w.len(), 5, "the blank line is skipped");
    let r = w.requests();
    let arrivals: Vec<u64> = r.iter().map(|r| r.arrival_us).collect();
    assert_eq!(arrivals, [0, 150_000, 150_000, 2_000_000, 2_500_500]);
    assert_eq!(
        r.iter().map(|r| r.input_tokens).collect::<Vec<_>>(),
        [1200, 1100, 600, 1536, 512]
    );
    assert_eq!(
        r.iter().map(|r| r.output_tokens).collect::<Vec<_>>(),
        [20, 8, 1, 100, 0]
    );
    assert_eq!(w.ids(&r[0]), [0, 1, 2]);
    assert_eq!(w.ids(&r[2]), [4, 5]);
    assert_eq!(w.ids(&r[4]), [0]);
    assert_eq!(w.prompt_tokens(), 4948);
}

#[test]
fn golden_keys_share_exactly_the_shared_ids() {
    let w = golden();
    // Block size 512: one key per full Mooncake block.
    let k: Vec<_> = (0..5).map(|i| keys(&w, i, 512)).collect();
    assert_eq!(k.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 1, 3, 1]);
    assert_eq!(k[0], k[1]);
    assert_eq!(k[0][..], k[3][..2]);
    assert_eq!(k[4][0], k[0][0]);
    assert!(!k[0].contains(&k[2][0]));
    // Block size 16: ids 0 and 1 cover 1024 tokens = 64 shared keys, then they differ.
    let a = keys(&w, 0, 16);
    let b = keys(&w, 1, 16);
    assert_eq!((a.len(), b.len()), (75, 68));
    assert_eq!(a[..64], b[..64]);
    assert_ne!(a[64], b[64]);
    // Block size 1024 straddles ids: request 4's only key covers ids 0 and 1.
    assert_eq!(keys(&w, 3, 1024).len(), 1);
    assert_eq!(keys(&w, 3, 1024), keys(&w, 0, 1024));
}

#[test]
fn golden_ideal_hit_ratio_by_hand() {
    // See workloads/README.md: 2 × 1024 of 4948 prompt tokens.
    let ideal = sim::fleet::ideal_hit_ratio(&golden(), 512);
    assert!((ideal - 2048.0 / 4948.0).abs() < 1e-12, "{ideal}");
}

fn parse_err(text: &str) -> (usize, String) {
    match parse_jsonl(text.as_bytes()) {
        Err(TraceError::Line { line, message }) => (line, message),
        other => panic!("expected a line error, got {other:?}"),
    }
}

#[test]
fn bad_lines_name_their_line() {
    let ok = r#"{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#;
    let cases = [
        (
            format!("{ok}\n{{\"timestamp\": 2, \"input_length\": 10\n"),
            2,
            "EOF",
        ),
        (
            format!("{ok}\n\n{{\"timestamp\": 2, \"input_length\": 10, \"output_length\": 1}}\n"),
            3,
            "missing field `hash_ids`",
        ),
        (
            r#"{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#
                .to_owned(),
            1,
            "timestamp must be a non-negative",
        ),
        (
            format!(
                "{ok}\n{ok}\n{}",
                r#"{"timestamp": 3, "input_length": 0, "output_length": 1, "hash_ids": []}"#
            ),
            3,
            "input_length must be between 1",
        ),
        (
            format!(
                "{ok}\n{}",
                r#"{"timestamp": 3, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}"#
            ),
            2,
            "3 hash_ids for input_length 600",
        ),
        (
            format!(
                "{ok}\n{}",
                r#"{"timestamp": 3, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]}"#
            ),
            2,
            "invalid value",
        ),
        (format!("{ok}\nnot json\n"), 2, "expected"),
    ];
    for (text, line, needle) in cases {
        let (got_line, message) = parse_err(&text);
        assert_eq!(got_line, line, "{text:?}: {message}");
        assert!(message.contains(needle), "{text:?}: {message}");
    }
    assert!(matches!(
        parse_jsonl("\n\n".as_bytes()),
        Err(TraceError::Empty)
    ));
}

#[test]
fn unsorted_traces_replay_in_time_order() {
    let text = "{\"timestamp\": 9, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n\
                {\"timestamp\": 3, \"input_length\": 20, \"output_length\": 1, \"hash_ids\": [2]}\n";
    let w = parse_jsonl(text.as_bytes()).unwrap();
    let got: Vec<(u64, u32)> = w
        .requests()
        .iter()
        .map(|r| (r.arrival_us, r.input_tokens))
        .collect();
    assert_eq!(got, [(3000, 20), (9000, 10)]);
}

#[test]
fn generated_workloads_round_trip_through_jsonl() {
    for kind in [Kind::Tenants, Kind::Multiturn, Kind::Rag, Kind::Nosharing] {
        let cfg = GenConfig {
            kind,
            requests: 300,
            seed: 7,
            rate: 24.0,
        };
        let w = generate(&cfg);
        assert_eq!(w.len(), 300, "{kind:?}");
        assert_eq!(generate(&cfg), w, "{kind:?}: same seed, same workload");
        let mut buf = Vec::new();
        w.write_jsonl(&mut buf).unwrap();
        let back = parse_jsonl(buf.as_slice()).unwrap();
        assert_eq!(back, w, "{kind:?}");
        for r in w.requests() {
            assert_eq!(
                w.ids(r).len(),
                r.input_tokens.div_ceil(512) as usize,
                "{kind:?}: one id per 512-token block"
            );
        }
    }
}

#[test]
fn generators_share_as_described() {
    let ratio = |kind| {
        let w = generate(&GenConfig {
            kind,
            requests: 2000,
            seed: 3,
            rate: 24.0,
        });
        sim::fleet::ideal_hit_ratio(&w, 16)
    };
    assert_eq!(ratio(Kind::Nosharing), 0.0);
    let tenants = ratio(Kind::Tenants);
    let rag = ratio(Kind::Rag);
    assert!(tenants > 0.5, "{tenants}");
    assert!(rag > 0.05 && rag < tenants, "{rag} vs {tenants}");
    // Multi-turn: a later turn's ids start with the previous turn's full blocks.
    let w = generate(&GenConfig {
        kind: Kind::Multiturn,
        requests: 2000,
        seed: 3,
        rate: 24.0,
    });
    let r = w.requests();
    let extended = r.iter().enumerate().any(|(i, a)| {
        let full = (a.input_tokens / 512) as usize;
        full >= 3
            && r[i + 1..]
                .iter()
                .any(|b| b.input_tokens > a.input_tokens && w.ids(b)[..full] == w.ids(a)[..full])
    });
    assert!(extended);
}
