//! The demo workload: tenants with long shared system prompts and short user
//! questions, driven through the gateway in waves.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::hold::Hold;

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
    /// Time from its wave's release to the first streamed chunk.
    pub ttft: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// The wave it was sent in (from 0).
    pub wave: usize,
    /// The engine that served it (index), as the hold in front of the
    /// engines saw it.
    pub engine: Option<usize>,
}

/// Sends one streamed chat request and reads it to the end: when its first
/// chunk arrived, when it ended, and its usage receipt (`ttft` left zero).
async fn chat(
    client: reqwest::Client,
    url: String,
    model: &'static str,
    req: ChatRequest,
) -> anyhow::Result<(Instant, Instant, Outcome)> {
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
    let mut resp = client.post(&url).json(&body).send().await?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        anyhow::bail!("gateway answered {status}: {text}");
    }
    let mut first = None;
    let mut text = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        first.get_or_insert_with(Instant::now);
        text.extend_from_slice(&chunk);
    }
    let end = Instant::now();
    let mut out = Outcome::default();
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
    Ok((first.unwrap_or(end), end, out))
}

/// Drives the requests in waves of `concurrency`. Within a wave each request
/// is sent once the gateway has forwarded the previous one to `hold`, so
/// every decision sees all earlier ones of the wave charged and none of them
/// answered yet; then the hold releases the wave to the engines and the
/// bodies are read concurrently. Before the next wave `settle` waits until
/// the gateway's view of the engines has caught up. Placement then depends on
/// the seed, not on how fast this machine answered the first requests of a
/// wave while the last were being decided.
///
/// Also returns how many waves had a request end before the wave's last
/// request was admitted by its engine: there the engines' caches, and so
/// later placement, depended on this machine's speed (decode too short).
#[allow(clippy::too_many_arguments)]
pub async fn drive<S, F>(
    client: &reqwest::Client,
    url: &str,
    model: &'static str,
    requests: &[ChatRequest],
    concurrency: usize,
    hold: &Hold,
    mut settle: S,
    mut progress: impl FnMut(usize),
) -> anyhow::Result<(Vec<Outcome>, usize)>
where
    S: FnMut() -> F,
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let mut out = Vec::with_capacity(requests.len());
    let mut raced = 0;
    for (number, wave) in requests.chunks(concurrency.max(1)).enumerate() {
        let mut sent = Vec::with_capacity(wave.len());
        for (i, r) in wave.iter().enumerate() {
            sent.push(tokio::spawn(chat(
                client.clone(),
                url.to_owned(),
                model,
                r.clone(),
            )));
            if let Err(e) = hold.wait_held(i + 1, &sent).await {
                // The request that ended early says why.
                for s in sent
                    .into_iter()
                    .filter(tokio::task::JoinHandle::is_finished)
                {
                    s.await??;
                }
                return Err(e);
            }
        }
        // The hold saw the wave's requests in the order they were sent: each
        // was sent once the previous one was held.
        let (released, engines) = hold.release();
        let mut first_end: Option<Instant> = None;
        for (i, s) in sent.into_iter().enumerate() {
            let (first, end, mut o) = s.await??;
            o.ttft = first.saturating_duration_since(released);
            o.wave = number;
            o.engine = engines.get(i).copied();
            first_end = Some(first_end.map_or(end, |f| f.min(end)));
            out.push(o);
            progress(out.len());
        }
        if let (Some(end), Some(admitted)) = (first_end, hold.last_admitted()) {
            raced += usize::from(end < admitted);
        }
        settle().await?;
    }
    Ok((out, raced))
}
