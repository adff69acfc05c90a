//! The demo workload: tenants with long shared system prompts and short user
//! questions, driven through the gateway with bounded concurrency.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Words the generated system prompts are made of.
const WORDS: &[&str] = &[
    "policy",
    "customer",
    "account",
    "refund",
    "shipping",
    "invoice",
    "support",
    "ticket",
    "priority",
    "escalate",
    "verify",
    "identity",
    "order",
    "product",
    "warranty",
    "return",
    "window",
    "days",
    "manager",
    "approval",
    "discount",
    "loyalty",
    "member",
    "tier",
    "billing",
    "address",
    "payment",
    "card",
    "declined",
    "retry",
    "schedule",
    "delivery",
    "courier",
    "tracking",
    "number",
    "status",
    "delayed",
    "apology",
    "credit",
    "voucher",
    "always",
    "never",
    "politely",
    "confirm",
    "summarize",
    "answer",
    "briefly",
    "clearly",
];

/// A small deterministic generator (the demo must not depend on RNG versions).
pub struct SplitMix(u64);

impl SplitMix {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Next value below `n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z % n.max(1) as u64) as usize
    }

    fn words(&mut self, count: usize) -> String {
        (0..count)
            .map(|_| WORDS[self.below(WORDS.len())])
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// One chat request of the workload.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// Tenant's system prompt (shared by all its requests).
    pub system: String,
    /// The user's question (unique).
    pub user: String,
}

/// `requests` chat requests over `tenants` tenants, in a seeded random order.
pub fn generate(tenants: usize, requests: usize, seed: u64) -> Vec<ChatRequest> {
    let mut rng = SplitMix::new(seed);
    let systems: Vec<String> = (0..tenants)
        .map(|t| {
            format!(
                "Tenant {t} {} assistant rules: {}",
                rng.words(12),
                rng.words(450)
            )
        })
        .collect();
    (0..requests)
        .map(|i| {
            let t = rng.below(tenants);
            ChatRequest {
                system: systems[t].clone(),
                user: format!("Question {i}: what about the {}?", rng.words(4)),
            }
        })
        .collect()
}

/// What one request observed.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Time to the first streamed chunk.
    pub ttft: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

/// Sends one streamed chat request; returns once the response headers are in
/// (the gateway has made its decision and charged the endpoint's load).
pub async fn start(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    req: &ChatRequest,
) -> anyhow::Result<(reqwest::Response, Instant)> {
    let body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": req.system},
            {"role": "user", "content": req.user},
        ],
        "max_tokens": 8,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let resp = client.post(url).json(&body).send().await?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        anyhow::bail!("gateway answered {status}: {text}");
    }
    Ok((resp, start))
}

/// Reads a started response to the end: TTFT and the usage receipt.
pub async fn finish(mut resp: reqwest::Response, start: Instant) -> anyhow::Result<Outcome> {
    let mut ttft = None;
    let mut text = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        ttft.get_or_insert_with(|| start.elapsed());
        text.extend_from_slice(&chunk);
    }
    let mut out = Outcome {
        ttft: ttft.unwrap_or_else(|| start.elapsed()),
        ..Outcome::default()
    };
    for line in String::from_utf8_lossy(&text).lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(data.trim()) else {
            continue;
        };
        if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
            out.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            out.cached_tokens = usage
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0);
        }
    }
    Ok(out)
}

/// Drives the requests in waves of `concurrency`: within a wave each request
/// is sent once the previous one's headers are back (so every decision sees
/// the load of the ones before it, in a fixed order), the bodies are read
/// concurrently, and before the next wave `settle` waits until the gateway's
/// view of the engines has caught up. Placement then depends on the seed, not
/// on which of eight racing requests the gateway happened to read first.
pub async fn drive<S, F>(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    requests: &[ChatRequest],
    concurrency: usize,
    mut settle: S,
    mut progress: impl FnMut(usize),
) -> anyhow::Result<Vec<Outcome>>
where
    S: FnMut() -> F,
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut out = Vec::with_capacity(requests.len());
    for wave in requests.chunks(concurrency.max(1)) {
        let mut bodies = Vec::with_capacity(wave.len());
        for r in wave {
            let (resp, t0) = start(client, url, model, r).await?;
            bodies.push(tokio::spawn(finish(resp, t0)));
        }
        for b in bodies {
            out.push(b.await??);
            progress(out.len());
        }
        settle().await?;
    }
    Ok(out)
}
