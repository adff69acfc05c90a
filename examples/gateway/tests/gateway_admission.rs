//! Tokenization admission control over real sockets: the
//! real `kvroute serve` binary in front of an in-test echo upstream, flooded
//! with parallel distinct ~1 M-character prompts (each within `max_body_bytes`
//! and `max_prompt_chars`). Every request must be answered 200; the ones that
//! found no tokenization room skip KV routing and are counted; the gateway's
//! peak RSS (VmHWM in `/proc/PID/status`) grows within a bound derived from the
//! configured limits, not with the number of prompts.

mod gateway_support;

use std::net::SocketAddr;

use gateway_support::*;
use serde_json::{json, Value};

/// Tokenizer memory per prompt byte, generously above the measured ~175–280 B
/// (RELIABILITY.md attack 8): the bound below must hold on any prompt text.
const TOKENIZER_BYTES_PER_BYTE: u64 = 400;

/// Prompt characters per flood request: just under the default
/// `max_prompt_chars` (1 Mi), so every prompt is one the gateway tokenizes.
const PROMPT_CHARS: usize = 1_000_000;

fn config(echo: SocketAddr, limits: &str) -> String {
    format!(
        "{}[[rules]]\nname = \"kv\"\nmodels = [\"{MODEL}\"]\ndefault = true\nchoice = \"kv_exact\"\ncontract = \"{CONTRACT}\"\n\
         [[rules.endpoints]]\nurl = \"http://{echo}\"\nzmq = \"tcp://*:{}\"\n\n",
        config_head(&format!(
            "[limits]\nmax_prompt_tokens = 2000000\n{limits}\n[health]\ninterval_ms = 0\n"
        )),
        closed_port(),
    )
}

/// A distinct prompt of exactly `chars` characters (words the tokenizer
/// splits finely, as an attacker would choose).
fn long_prompt(seed: usize, chars: usize) -> String {
    let mut s = String::with_capacity(chars + 16);
    let mut i = 0u64;
    while s.len() < chars {
        s.push_str(&format!(
            "s{seed}w{} ",
            i.wrapping_mul(2_654_435_761) % 1_000_003
        ));
        i += 1;
    }
    s.truncate(chars);
    s
}

/// `VmHWM` (peak resident set) of process `pid`, in bytes.
fn vm_hwm(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"));
    kb * 1024
}

/// Sends `bodies` at once; every answer must be 200 with the body intact.
async fn flood(gw: &Gateway, bodies: Vec<String>) {
    let url = gw.url("/v1/completions");
    // The test bounds memory, not latency: admitted 1 M-character prompts
    // tokenize in a debug build, and on a loaded 2-core runner that took
    // longer than the shared client's 60 s.
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(600))
        .build()
        .unwrap();
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let url = url.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let n = body.len();
                let resp = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = resp.status().as_u16();
                let v: Value = resp.json().await.unwrap_or(Value::Null);
                (status, n, v)
            })
        })
        .collect();
    for t in tasks {
        let (status, n, v) = t.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["len"], n, "the echo upstream got the whole body: {v}");
    }
}

fn bodies(count: usize, chars: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            json!({"model": MODEL, "prompt": long_prompt(i, chars), "max_tokens": 1}).to_string()
        })
        .collect()
}

async fn tokenize_counters(gw: &Gateway) -> Value {
    get_json(&gw.admin_url("/admin/counters"), None).await["tokenize"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_long_prompts_is_bounded_by_the_tokenization_limits() {
    const FLOOD: usize = 16;
    let max_count = 2u64;
    let max_bytes: u64 = 2 << 20;
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(
        echo,
        &format!(
            "max_concurrent_tokenizations = {max_count}\nmax_tokenize_bytes_in_flight = {max_bytes}\ntokenize_overload = \"skip\"\n"
        ),
    ));
    // Warm-up (until the tokenizer has loaded and a request is routed): the
    // baseline includes the loaded tokenizer.
    eventually("a routed warm-up request", || async {
        let (status, _) = complete(&gw, &prompt("warm", 40), 1).await;
        (status == 200).then_some(())
    })
    .await;
    let pid = gw.proc.child.id();
    let before = vm_hwm(pid);

    let flood_bodies = bodies(FLOOD, PROMPT_CHARS);
    let body_bytes: u64 = flood_bodies.iter().map(|b| b.len() as u64).sum();
    flood(&gw, flood_bodies).await;

    let after = vm_hwm(pid);
    let grew = after.saturating_sub(before);
    let t = tokenize_counters(&gw).await;
    eprintln!(
        "attack 8, {FLOOD} × {PROMPT_CHARS}-char prompts, cap {max_count} / {max_bytes} B: \
         VmHWM {} MB → {} MB (+{} MB); tokenize {t}",
        before >> 20,
        after >> 20,
        grew >> 20
    );
    let admitted = t["admitted"].as_u64().unwrap();
    let overloaded = t["overloaded"].as_u64().unwrap();
    // Every completion request was either tokenized or counted as skipped.
    assert_eq!(admitted + overloaded, FLOOD as u64 + 1, "{t}");
    assert!(
        overloaded >= 1,
        "{FLOOD} parallel prompts, room for {max_count}: {t}"
    );
    assert!(t["peak_in_flight"].as_u64().unwrap() <= max_count, "{t}");
    assert!(
        t["peak_bytes_in_flight"].as_u64().unwrap() <= max_bytes,
        "{t}"
    );
    assert_eq!(t["in_flight"], 0, "{t}");
    assert_eq!(t["bytes_in_flight"], 0, "{t}");
    // Skipped requests are the rule's tokenize_overloaded misses, and /metrics
    // shows the same counts.
    let rule = counters(&gw, "kv").await;
    assert_eq!(rule["misses"]["tokenize_overloaded"], overloaded, "{rule}");
    let text = metrics_text(&gw).await;
    for line in [
        format!("kvroute_tokenize_overloaded_total {overloaded}"),
        format!("kvroute_tokenize_admitted_total {admitted}"),
        format!("kvroute_tokenize_max_concurrent {max_count}"),
        format!("kvroute_tokenize_max_bytes_in_flight {max_bytes}"),
        format!(
            "kvroute_kv_misses_total{{rule=\"kv\",reason=\"tokenize_overloaded\"}} {overloaded}"
        ),
    ] {
        assert!(text.contains(&line), "no {line:?} in /metrics");
    }
    // Memory: the tokenizers' share is bounded by the byte budget; every
    // body is held a few times over (client connection, request, upstream
    // copy) whether tokenized or not. Without the cap the 16 prompts
    // tokenize at once (the blocking pool has 512 threads): ~16 × 175 MB.
    let bound = TOKENIZER_BYTES_PER_BYTE * max_bytes + 4 * body_bytes + (256 << 20);
    assert!(
        grew <= bound,
        "VmHWM grew {} MB under the flood, bound {} MB",
        grew >> 20,
        bound >> 20
    );
    // A normal request is served afterwards.
    let (status, v) = complete(&gw, &prompt("after", 40), 1).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_policy_admits_in_turn_and_gives_up_after_the_bound() {
    // Long enough that nothing gives up: every request is tokenized, one at a
    // time, the later ones after waiting.
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(
        echo,
        "max_concurrent_tokenizations = 1\ntokenize_overload = \"wait\"\ntokenize_wait_ms = 120000\n",
    ));
    flood(&gw, bodies(4, 200_000)).await;
    let t = tokenize_counters(&gw).await;
    assert_eq!(t["admitted"], 4, "{t}");
    assert_eq!(t["overloaded"], 0, "{t}");
    assert!(t["admitted_after_wait"].as_u64().unwrap() >= 1, "{t}");
    assert_eq!(t["peak_in_flight"], 1, "{t}");
    assert_eq!(
        counters(&gw, "kv").await["misses"]["tokenize_overloaded"],
        0
    );

    // A 1 ms bound: requests that find the slot taken give up almost at once
    // and skip KV routing, still answered.
    let echo = echo_upstream().await;
    let gw = Gateway::start(&config(
        echo,
        "max_concurrent_tokenizations = 1\ntokenize_overload = \"wait\"\ntokenize_wait_ms = 1\n",
    ));
    flood(&gw, bodies(6, 500_000)).await;
    let t = tokenize_counters(&gw).await;
    let overloaded = t["overloaded"].as_u64().unwrap();
    assert_eq!(t["admitted"].as_u64().unwrap() + overloaded, 6, "{t}");
    assert!(overloaded >= 1, "{t}");
    assert_eq!(
        counters(&gw, "kv").await["misses"]["tokenize_overloaded"],
        overloaded
    );
}
