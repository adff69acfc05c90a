//! Property tests of `parse_load`: random engine states rendered the way each
//! engine renders them (label order, spacing, line endings, timestamps, number
//! spellings, noise metrics, escaped label values, duplicate TP replicas, priority
//! breakdowns, older iterations) parse back to the report a reference model of the
//! state predicts; arbitrary and mutated bodies never panic.

use std::fmt::Write as _;

use kvroute_engines::{load_report_fuzzing, parse_load, EngineLoadReport, MetricsDialect};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Rank {
    running: u32,
    waiting: u32,
    /// Usage in thousandths.
    usage: Option<u16>,
    blocks: Option<u32>,
}

#[derive(Clone, Debug)]
struct Engine {
    dialect: MetricsDialect,
    ranks: Vec<Rank>,
    block_size: Option<u32>,
}

/// How a body is spelled (nothing here may change the report).
#[derive(Clone, Debug)]
struct Style {
    crlf: bool,
    /// Per rendered line: spacing choice, timestamp, number spelling, label order.
    knobs: Vec<u8>,
    shuffle_seed: u64,
    noise: bool,
}

fn rank() -> impl Strategy<Value = Rank> {
    (
        0u32..500,
        0u32..500,
        proptest::option::of(0u16..=1000),
        proptest::option::of(1u32..200_000),
    )
        .prop_map(|(running, waiting, usage, blocks)| Rank {
            running,
            waiting,
            usage,
            blocks,
        })
}

fn engine() -> impl Strategy<Value = Engine> {
    (
        prop_oneof![
            Just(MetricsDialect::Vllm),
            Just(MetricsDialect::Sglang),
            Just(MetricsDialect::Trtllm),
            Just(MetricsDialect::TrtllmPrometheus),
        ],
        proptest::collection::vec(rank(), 1..5),
        proptest::option::of(prop_oneof![Just(16u32), Just(32), Just(64), Just(1)]),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(dialect, mut ranks, block_size, all_usage, all_blocks)| {
            if dialect == MetricsDialect::TrtllmPrometheus {
                ranks.truncate(1);
            }
            // Either every rank reports usage / capacity or none does.
            let usage_default = ranks[0].usage.unwrap_or(500);
            let blocks_default = ranks[0].blocks.unwrap_or(1000);
            for r in &mut ranks {
                r.usage = all_usage.then(|| r.usage.unwrap_or(usage_default));
                r.blocks = all_blocks.then(|| r.blocks.unwrap_or(blocks_default));
            }
            Engine {
                dialect,
                ranks,
                block_size,
            }
        })
}

fn style() -> impl Strategy<Value = Style> {
    (
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 64),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(|(crlf, knobs, shuffle_seed, noise)| Style {
            crlf,
            knobs,
            shuffle_seed,
            noise,
        })
}

/// The reference model: what the engine's state means as a report.
fn expected(e: &Engine) -> EngineLoadReport {
    let n = e.ranks.len();
    let running = e.ranks.iter().map(|r| r.running).sum();
    let waiting = e.ranks.iter().map(|r| r.waiting).sum();
    let blocks: Option<Vec<u64>> = e.ranks.iter().map(|r| r.blocks.map(u64::from)).collect();
    let usage: Option<Vec<f64>> = e
        .ranks
        .iter()
        .map(|r| r.usage.map(|u| f64::from(u) / 1000.0))
        .collect();
    let weights = blocks.clone().filter(|b| b.iter().any(|&x| x > 0));
    let kv_usage = usage.map(|u| match &weights {
        Some(w) => {
            let total: f64 = w.iter().map(|&b| b as f64).sum();
            u.iter().zip(w).map(|(x, &b)| x * b as f64).sum::<f64>() / total
        }
        None => u.iter().sum::<f64>() / n as f64,
    });
    let kv_capacity_blocks = blocks.as_ref().map(|b| b.iter().sum());
    let kv_capacity_tokens = match (kv_capacity_blocks, e.block_size) {
        (Some(b), Some(s)) => Some(b * u64::from(s)),
        _ => None,
    };
    EngineLoadReport {
        running,
        waiting,
        kv_usage,
        kv_capacity_blocks,
        block_size: e.block_size,
        kv_capacity_tokens,
        waiting_prefill_tokens: None,
        // The generated bodies carry no prefill histograms.
        prefill_computed_tokens: None,
        prefill_seconds: None,
        ranks: n as u32,
    }
}

struct Out<'s> {
    lines: Vec<String>,
    style: &'s Style,
    k: usize,
}

impl Out<'_> {
    fn knob(&mut self) -> u8 {
        let v = self.style.knobs[self.k % self.style.knobs.len()];
        self.k += 1;
        v
    }

    fn num(&mut self, v: f64) -> String {
        match self.knob() % 4 {
            0 => format!("{v}"),
            1 => format!("{v:?}"),
            2 => format!("{v:e}"),
            _ if v.fract() == 0.0 => format!("{v:.1}"),
            _ => format!("{v}"),
        }
    }

    fn sample(&mut self, name: &str, labels: &[(&str, String)], value: f64) {
        let mut labels: Vec<(&str, String)> = labels.to_vec();
        if self.knob().is_multiple_of(2) {
            labels.reverse();
        }
        let sep = match self.knob() % 3 {
            0 => " ",
            1 => "  ",
            _ => "\t",
        };
        let mut line = String::from(name);
        if !labels.is_empty() || self.knob().is_multiple_of(5) {
            line.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                let esc = v
                    .replace('\\', "\\\\")
                    .replace('"', "\\\"")
                    .replace('\n', "\\n");
                let _ = write!(line, "{k}=\"{esc}\"");
            }
            if !labels.is_empty() && self.knob().is_multiple_of(7) {
                line.push(',');
            }
            line.push('}');
        }
        line.push_str(sep);
        let v = self.num(value);
        line.push_str(&v);
        if self.knob().is_multiple_of(6) {
            line.push_str(" 1733045000000");
        }
        self.lines.push(line);
    }

    fn noise(&mut self, prefix: &str) {
        if !self.style.noise {
            return;
        }
        self.lines.push(format!(
            "# HELP {prefix}num_requests_running {{odd}} \"help\" text"
        ));
        self.lines.push(format!(
            "# TYPE {prefix}time_to_first_token_seconds histogram"
        ));
        for le in ["0.001", "0.5", "+Inf"] {
            self.sample(
                &format!("{prefix}time_to_first_token_seconds_bucket"),
                &[("le", le.into()), ("model_name", "m".into())],
                3.0,
            );
        }
        // Names that merely start like a used one are other metrics.
        self.sample(&format!("{prefix}num_requests_running_total"), &[], 99.0);
        self.sample(&format!("{prefix}num_queue_reqs_created"), &[], 1.7e9);
        self.lines.push(String::new());
        self.lines.push("   ".into());
    }

    fn finish(mut self) -> Vec<u8> {
        // Deterministic shuffle of whole lines keeps every sample intact.
        let mut seed = self.style.shuffle_seed | 1;
        for i in (1..self.lines.len()).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            self.lines.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        let eol = if self.style.crlf { "\r\n" } else { "\n" };
        let mut body = self.lines.join(eol);
        body.push_str(eol);
        if self.knob().is_multiple_of(3) {
            body.push_str("# EOF\n");
        }
        body.into_bytes()
    }
}

fn escaped_value() -> String {
    "['a, b=c', \"quoted\" \\ {x}]\nnext".into()
}

fn render_vllm(e: &Engine, out: &mut Out<'_>) {
    for (i, r) in e.ranks.iter().enumerate() {
        let l = [
            ("engine", i.to_string()),
            ("model_name", "Qwen/Qwen3-8B".into()),
        ];
        out.sample("vllm:num_requests_running", &l, f64::from(r.running));
        out.sample("vllm:num_requests_waiting", &l, f64::from(r.waiting));
        if let Some(u) = r.usage {
            out.sample("vllm:kv_cache_usage_perc", &l, f64::from(u) / 1000.0);
            // The deprecated name, when present too, must not win.
            out.sample("vllm:gpu_cache_usage_perc", &l, 0.999);
        }
        let info = [
            (
                "block_size",
                e.block_size.map_or("None".into(), |b| b.to_string()),
            ),
            ("engine", i.to_string()),
            ("kv_cache_dtype_skip_layers", escaped_value()),
            (
                "num_gpu_blocks",
                r.blocks.map_or("None".into(), |b| b.to_string()),
            ),
        ];
        out.sample("vllm:cache_config_info", &info, 1.0);
        out.sample(
            "vllm:num_requests_waiting_by_reason",
            &[("engine", i.to_string()), ("reason", "capacity".into())],
            12345.0,
        );
    }
    out.noise("vllm:");
}

fn render_sglang(e: &Engine, out: &mut Out<'_>) {
    for (i, r) in e.ranks.iter().enumerate() {
        // Two TP schedulers export rank i: the same batch twice.
        for tp in [2 * i, 2 * i + 1] {
            let mut l = vec![
                ("model_name", "m".to_owned()),
                ("tp_rank", tp.to_string()),
                ("priority", String::new()),
            ];
            if e.ranks.len() > 1 {
                l.push(("dp_rank", i.to_string()));
            }
            out.sample("sglang:num_running_reqs", &l, f64::from(r.running));
            out.sample("sglang:num_queue_reqs", &l, f64::from(r.waiting));
            if let Some(u) = r.usage {
                out.sample("sglang:token_usage", &l, f64::from(u) / 1000.0);
            }
            if let Some(b) = e.block_size {
                out.sample("sglang:page_size", &l, f64::from(b));
            }
            if let Some(blocks) = r.blocks {
                out.sample("sglang:num_pages", &l, f64::from(blocks));
                if let Some(b) = e.block_size {
                    out.sample(
                        "sglang:max_total_num_tokens",
                        &l,
                        f64::from(blocks) * f64::from(b),
                    );
                }
            }
            // A per-priority breakdown is not added to the total.
            let mut p = l.clone();
            p[2].1 = "3".into();
            out.sample("sglang:num_running_reqs", &p, 777.0);
            out.sample("sglang:num_queue_reqs", &p, 777.0);
        }
    }
    out.noise("sglang:");
}

fn render_trtllm_prometheus(e: &Engine, out: &mut Out<'_>) {
    let r = &e.ranks[0];
    let l = [
        ("engine_type", "undefined".to_owned()),
        ("model_name", "undefined".into()),
    ];
    out.sample("trtllm_num_requests_running", &l, f64::from(r.running));
    out.sample("trtllm_num_requests_waiting", &l, f64::from(r.waiting));
    if let Some(u) = r.usage {
        out.sample("trtllm_kv_cache_utilization", &l, f64::from(u) / 1000.0);
    }
    if let Some(b) = r.blocks {
        out.sample("trtllm_kv_cache_max_blocks", &l, f64::from(b));
    }
    if let Some(b) = e.block_size {
        out.sample("trtllm_kv_cache_tokens_per_block", &l, f64::from(b));
    }
    out.noise("trtllm_");
}

fn render_trtllm_json(e: &Engine, style: &Style) -> Vec<u8> {
    use serde_json::json;
    let mut rows = Vec::new();
    for (i, r) in e.ranks.iter().enumerate() {
        // An older iteration of the same rank, with other numbers.
        rows.push(
            json!({"iter": 10, "attentionDpRank": i, "numActiveRequests": 1000,
                         "numQueuedRequests": 1000}),
        );
        let mut kv = serde_json::Map::new();
        if let Some(b) = r.blocks {
            kv.insert("maxNumBlocks".into(), json!(b));
        }
        if let Some(s) = e.block_size {
            kv.insert("tokensPerBlock".into(), json!(s));
        }
        let mut row = json!({"iter": 11, "attentionDpRank": i,
                             "numActiveRequests": r.running, "numQueuedRequests": r.waiting,
                             "timestamp": "12-01-2026 09:30:00"});
        if !kv.is_empty() {
            row["kvCacheStats"] = serde_json::Value::Object(kv);
        }
        rows.push(row);
    }
    if style.shuffle_seed.is_multiple_of(2) {
        rows.reverse();
    }
    serde_json::to_vec_pretty(&rows).unwrap()
}

/// TensorRT-LLM's JSON carries usage only as used/max blocks: the model keeps
/// blocks and derives usage from them.
fn trtllm_json_engine(mut e: Engine) -> Engine {
    for r in &mut e.ranks {
        r.usage = None;
    }
    e
}

fn render(e: &Engine, style: &Style) -> Vec<u8> {
    let mut out = Out {
        lines: Vec::new(),
        style,
        k: 0,
    };
    match e.dialect {
        MetricsDialect::Vllm => render_vllm(e, &mut out),
        MetricsDialect::Sglang => render_sglang(e, &mut out),
        MetricsDialect::TrtllmPrometheus => render_trtllm_prometheus(e, &mut out),
        _ => return render_trtllm_json(e, style),
    }
    out.finish()
}

fn close(a: &EngineLoadReport, b: &EngineLoadReport) -> bool {
    let usage = match (a.kv_usage, b.kv_usage) {
        (Some(x), Some(y)) => (x - y).abs() < 1e-9,
        (None, None) => true,
        _ => false,
    };
    usage
        && EngineLoadReport {
            kv_usage: None,
            ..*a
        } == EngineLoadReport {
            kv_usage: None,
            ..*b
        }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn rendered_engine_state_round_trips(e in engine(), style in style()) {
        let e = if e.dialect == MetricsDialect::Trtllm { trtllm_json_engine(e) } else { e };
        let body = render(&e, &style);
        let got = parse_load(e.dialect, &body);
        let want = expected(&e);
        prop_assert!(got.is_ok(), "{:?}\n{}", got, String::from_utf8_lossy(&body));
        let got = got.unwrap();
        prop_assert!(close(&got, &want), "got {:?}\nwant {:?}\n{}", got, want,
                     String::from_utf8_lossy(&body));
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        load_report_fuzzing::engine_metrics(&data);
    }

    #[test]
    fn mutated_bodies_never_panic(
        e in engine(),
        style in style(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..16),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut body = render(&e, &style);
        for (at, byte) in edits {
            let i = at.index(body.len());
            body[i] = byte;
        }
        let keep = cut.index(body.len() + 1);
        body.truncate(keep);
        load_report_fuzzing::engine_metrics(&body);
    }
}

#[test]
fn usage_of_trtllm_json_is_used_over_max_blocks() {
    let body = br#"[{"iter": 3, "numActiveRequests": 1, "numQueuedRequests": 0,
        "kvCacheStats": {"maxNumBlocks": 200, "freeNumBlocks": 150, "tokensPerBlock": 16}}]"#;
    let r = parse_load(MetricsDialect::Trtllm, body).unwrap();
    assert_eq!(r.kv_usage, Some(0.25));
    assert_eq!(r.kv_capacity_tokens, Some(3200));
}
