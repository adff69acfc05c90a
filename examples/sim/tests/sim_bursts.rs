//! The bursty conversation kinds have the statistics they are asked for, and
//! every generator is deterministic per seed (the older kinds byte for byte
//! as pinned below).

use kvroute_sim as sim;

use sim::fleet::ideal_hit_ratio;
use sim::trace::Workload;
use sim::workload::{generate, generate_shaped, GenConfig, Kind, Shape, Spacing};

struct Stats {
    requests: usize,
    span_s: f64,
    min: u32,
    max: u32,
    mean: f64,
    median: f64,
    instants: usize,
    reuse: f64,
    root_shared: bool,
}

fn stats(w: &Workload) -> Stats {
    let r = w.requests();
    let mut lens: Vec<u32> = r.iter().map(|x| x.input_tokens).collect();
    lens.sort_unstable();
    let mut instants: Vec<u64> = r.iter().map(|x| x.arrival_us).collect();
    instants.dedup();
    let first = w.ids(&r[0])[0];
    #[allow(clippy::cast_precision_loss)]
    Stats {
        requests: r.len(),
        span_s: (r[r.len() - 1].arrival_us - r[0].arrival_us) as f64 / 1e6,
        min: lens[0],
        max: lens[lens.len() - 1],
        mean: lens.iter().map(|x| f64::from(*x)).sum::<f64>() / lens.len() as f64,
        median: f64::from(lens[lens.len() / 2]),
        instants: instants.len(),
        reuse: ideal_hit_ratio(w, 16),
        root_shared: r.iter().all(|x| w.ids(x)[0] == first),
    }
}

fn within(got: f64, want: f64, rel: f64) -> bool {
    (got / want - 1.0).abs() <= rel
}

/// The reference trace's figures (Mooncake's `conversation_trace.jsonl`):
/// 12 031 requests over 3 537 s at 1 180 distinct milliseconds 3 s apart,
/// prompts 0.9 K–126 K (mean 12 K, median 6.9 K), 37 % ideal reuse, one root
/// block in every prompt.
#[test]
fn chat_bursts_match_the_reference_trace() {
    let cfg = GenConfig {
        kind: Kind::ChatBursts,
        requests: 12_031,
        seed: 1,
        rate: Kind::ChatBursts.default_rate(),
    };
    let w = generate(&cfg);
    let s = stats(&w);
    assert_eq!(s.requests, 12_031);
    assert!(within(s.span_s, 3537.0, 0.01), "span {}", s.span_s);
    assert!(s.min >= 900 && s.max <= 126_000, "{}..{}", s.min, s.max);
    assert!(within(s.mean, 12_000.0, 0.05), "mean {}", s.mean);
    assert!(within(s.median, 6_900.0, 0.05), "median {}", s.median);
    assert!(s.instants.abs_diff(1_180) <= 1, "instants {}", s.instants);
    assert!((s.reuse - 0.37).abs() <= 0.02, "reuse {}", s.reuse);
    assert!(s.root_shared);
    let mut at: Vec<u64> = w.requests().iter().map(|r| r.arrival_us).collect();
    at.dedup();
    assert!(at
        .windows(2)
        .all(|g| (2_999_000..=3_001_000).contains(&(g[1] - g[0]))));
    assert_eq!(generate(&cfg), w, "same seed, same workload");
    assert_ne!(generate(&GenConfig { seed: 2, ..cfg }), w);
}

#[test]
fn shape_settings_are_followed() {
    let cfg = GenConfig {
        kind: Kind::AgentBursts,
        requests: 6_000,
        seed: 4,
        rate: 24.0,
    };
    for shape in [
        Shape::for_kind(Kind::AgentBursts),
        Shape {
            duration_s: Some(600.0),
            prompt_min: 1_000,
            prompt_max: 60_000,
            prompt_mean: 9_000.0,
            prompt_median: 4_000.0,
            reuse: 0.5,
            burst_mean: 30.0,
            burst_alpha: 1.5,
            spacing: Spacing::Periodic,
            root_tokens: 768,
            ..Shape::for_kind(Kind::AgentBursts)
        },
    ] {
        shape.check().unwrap();
        let w = generate_shaped(&cfg, &shape);
        let s = stats(&w);
        assert_eq!(s.requests, 6_000);
        let span = shape.duration_s.unwrap_or(6_000.0 / 24.0);
        assert!(within(s.span_s, span, 0.02), "span {} vs {span}", s.span_s);
        assert!(s.min >= shape.prompt_min && s.max <= shape.prompt_max);
        assert!(within(s.mean, shape.prompt_mean, 0.06), "mean {}", s.mean);
        assert!(
            within(s.median, shape.prompt_median, 0.05),
            "median {}",
            s.median
        );
        #[allow(clippy::cast_precision_loss)]
        let instants = 6_000.0 / shape.burst_mean;
        #[allow(clippy::cast_precision_loss)]
        let got = s.instants as f64;
        assert!((got - instants).abs() <= 1.0, "instants {got}");
        assert!((s.reuse - shape.reuse).abs() <= 0.02, "reuse {}", s.reuse);
        assert!(s.root_shared);
        assert_eq!(generate_shaped(&cfg, &shape), w);
    }
}

#[test]
fn shapes_out_of_range_are_refused() {
    let ok = Shape::for_kind(Kind::ChatBursts);
    for bad in [
        Shape {
            prompt_median: 200.0,
            ..ok
        },
        Shape { reuse: 1.0, ..ok },
        Shape {
            burst_alpha: 1.0,
            ..ok
        },
        Shape {
            root_tokens: 900,
            ..ok
        },
        Shape {
            duration_s: Some(0.0),
            ..ok
        },
    ] {
        assert!(bad.check().is_err(), "{bad:?}");
    }
}

/// FNV-1a over the JSONL bytes.
fn digest(w: &Workload) -> u64 {
    let mut buf = Vec::new();
    w.write_jsonl(&mut buf).unwrap();
    buf.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The original kinds write the same file for the same seed as they always
/// have (adding kinds must not move their random streams).
#[test]
fn original_kinds_are_unchanged() {
    let pinned = [
        (Kind::Tenants, 0x1c28_8a68_f2d3_54d1),
        (Kind::Multiturn, 0x595d_ebaf_2cbf_9f01),
        (Kind::Rag, 0x8364_b4cf_8c65_e655),
        (Kind::Nosharing, 0x5a5a_945c_73e0_6a54),
    ];
    let got: Vec<(Kind, u64)> = pinned
        .iter()
        .map(|(kind, _)| {
            let w = generate(&GenConfig {
                kind: *kind,
                requests: 3000,
                seed: 2,
                rate: 24.0,
            });
            (*kind, digest(&w))
        })
        .collect();
    assert_eq!(got, pinned);
}
