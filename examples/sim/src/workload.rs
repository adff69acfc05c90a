//! Synthetic workloads in the Mooncake format.
//!
//! A prompt is built from *segments* (a system prompt, a document, one chat
//! turn, a question), each a run of tokens identified by a segment id. The
//! 512-token `hash_ids` are assigned the way a real trace's are: block `i`'s id
//! names the content of tokens `[512·i, 512·(i+1))` *and* everything before it
//! (a hash chained over the segment runs in the block and the previous block's
//! hash, interned to small integers). Two prompts therefore share ids exactly
//! where they share a token prefix, at 512-token granularity.
//!
//! | kind | sharing |
//! |---|---|
//! | `tenants` | 128 tenants, each with its own 1–6 K-token system prompt, Zipf(0.8) popularity; a unique 100–1500-token user message |
//! | `multiturn` | conversations of 2–12 turns over one shared 1 K-token system prompt; turn `k+1` repeats turn `k`'s prompt and answer; 30 s mean think time |
//! | `rag` | a shared 512-token system prompt, then 4 of 4096 documents (300–1500 tokens, Zipf(1.0) popularity) and a unique question |
//! | `nosharing` | every prompt unique, 500–4000 tokens |
//! | `chat-bursts` | one shared root block, then conversations whose turns grow; prompt lengths, reuse and bursts set by [`Shape`] (defaults: a real one-hour conversation trace, batches of ~10 requests every 3 s) |
//! | `agent-bursts` | the same generator with short prompts, a two-block root, more reuse and heavy-tailed bursts at random instants, 24 requests/s |
//!
//! Arrivals are Poisson at `rate` requests per second (conversation *starts* in
//! `multiturn`, scaled so the request rate matches), except in the two bursty
//! kinds, where requests arrive in bursts at distinct millisecond instants
//! (see [`Shape`]). Everything derives from the seed: the same seed gives the
//! same file.

use std::collections::{BinaryHeap, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::trace::{Workload, MOONCAKE_BLOCK_TOKENS};

mod shaped;

pub use shaped::{BurstSizes, Shape, ShapeError, Spacing};

/// Which synthetic workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Shared system prompts × tenants.
    Tenants,
    /// Multi-turn conversations.
    Multiturn,
    /// Retrieval-augmented prompts over a document corpus.
    Rag,
    /// No prefix sharing at all.
    Nosharing,
    /// Bursty conversations over one shared root block, statistics as set by
    /// [`Shape`] (defaults: a real one-hour conversation trace).
    #[serde(rename = "chat-bursts")]
    ChatBursts,
    /// Bursty short agent turns over a shared root: [`Shape::for_kind`].
    #[serde(rename = "agent-bursts")]
    AgentBursts,
}

impl Kind {
    /// The CLI name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Kind::Tenants => "tenants",
            Kind::Multiturn => "multiturn",
            Kind::Rag => "rag",
            Kind::Nosharing => "nosharing",
            Kind::ChatBursts => "chat-bursts",
            Kind::AgentBursts => "agent-bursts",
        }
    }

    /// The arrival rate a kind is generated at when none is given, requests
    /// per second: 24 (sized for 8 workers), and for `chat-bursts` the
    /// reference trace's 12 031 requests in 3 537 s.
    #[must_use]
    pub fn default_rate(self) -> f64 {
        match self {
            Kind::ChatBursts => 12_031.0 / 3_537.0,
            _ => 24.0,
        }
    }

    /// Whether the kind reads [`Shape`].
    #[must_use]
    pub fn is_shaped(self) -> bool {
        matches!(self, Kind::ChatBursts | Kind::AgentBursts)
    }
}

/// Generator settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenConfig {
    /// Workload kind.
    pub kind: Kind,
    /// Requests to generate.
    pub requests: usize,
    /// RNG seed.
    pub seed: u64,
    /// Mean arrival rate, requests per second.
    pub rate: f64,
}

const TENANTS: usize = 128;
const TENANT_PROMPT: (u32, u32) = (1024, 6144);
const TENANT_USER: (u32, u32) = (100, 1500);
const TENANT_ZIPF: f64 = 0.8;

const CHAT_SYSTEM: u32 = 1024;
const CHAT_TURNS: (u32, u32) = (2, 12);
const CHAT_FIRST_USER: (u32, u32) = (200, 1500);
const CHAT_NEXT_USER: (u32, u32) = (20, 400);
const CHAT_ANSWER: (u32, u32) = (50, 500);
const CHAT_THINK_MS: f64 = 30_000.0;
const CHAT_MAX_PROMPT: u32 = 32_768;

const RAG_SYSTEM: u32 = 512;
const RAG_DOCS: usize = 4096;
const RAG_DOC_LEN: (u32, u32) = (300, 1500);
const RAG_PER_PROMPT: usize = 4;
const RAG_QUESTION: (u32, u32) = (30, 200);
const RAG_ZIPF: f64 = 1.0;

const UNIQUE_PROMPT: (u32, u32) = (500, 4000);
const OUTPUT: (u32, u32) = (50, 400);

/// A run of tokens with an identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    id: u64,
    len: u32,
}

use kvroute_core::mix::splitmix64 as mix;

fn chain(parent: u64, v: u64) -> u64 {
    mix(parent ^ mix(v))
}

/// Turns segment lists into Mooncake ids: content hashes chained block to block,
/// interned to 0, 1, 2, ... in order of first appearance.
#[derive(Default)]
struct IdAssigner {
    ids: HashMap<u64, u64>,
}

impl IdAssigner {
    fn assign(&mut self, segments: &[Segment], out: &mut Vec<u64>) -> u32 {
        out.clear();
        let block = MOONCAKE_BLOCK_TOKENS;
        // The running hash: every block's hash chains through all before it.
        let mut h = 0u64;
        let mut in_block = 0u32;
        let mut total = 0u32;
        for seg in segments {
            let mut offset = 0u32;
            while offset < seg.len {
                let run = (seg.len - offset).min(block - in_block);
                h = chain(chain(chain(h, seg.id), u64::from(offset)), u64::from(run));
                offset += run;
                in_block += run;
                total = total.saturating_add(run);
                if in_block == block {
                    out.push(self.intern(h));
                    in_block = 0;
                }
            }
        }
        if in_block > 0 {
            out.push(self.intern(h));
        }
        total
    }

    fn intern(&mut self, h: u64) -> u64 {
        let next = self.ids.len() as u64;
        *self.ids.entry(h).or_insert(next)
    }
}

/// Zipf(s) over `0..n` by inverse CDF.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        #[allow(clippy::cast_precision_loss)]
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Self { cdf }
    }

    fn sample(&self, rng: &mut StdRng) -> usize {
        let u: f64 = rng.gen();
        self.cdf
            .partition_point(|c| *c < u)
            .min(self.cdf.len().saturating_sub(1))
    }
}

fn uniform(rng: &mut StdRng, (lo, hi): (u32, u32)) -> u32 {
    rng.gen_range(lo..=hi)
}

/// Exponential inter-arrival gap in µs for `rate` events per second.
fn exp_gap_us(rng: &mut StdRng, rate: f64) -> f64 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    -u.ln() / rate * 1e6
}

/// Millisecond-rounded µs (the published traces use integer milliseconds).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn to_ms_us(t_us: f64) -> u64 {
    (t_us / 1000.0).round() as u64 * 1000
}

/// Generates a workload; the bursty kinds with their default [`Shape`].
#[must_use]
pub fn generate(cfg: &GenConfig) -> Workload {
    generate_shaped(cfg, &Shape::for_kind(cfg.kind))
}

/// Generates a workload; the bursty kinds follow `shape` (the other kinds
/// ignore it). A shape that [`Shape::check`] refuses is generated with its
/// values clamped into range.
#[must_use]
pub fn generate_shaped(cfg: &GenConfig, shape: &Shape) -> Workload {
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let rate = if cfg.rate.is_finite() && cfg.rate > 0.0 {
        cfg.rate
    } else {
        1.0
    };
    let mut g = Gen {
        rng: &mut rng,
        ids: IdAssigner::default(),
        out: Workload::new(),
        scratch: Vec::new(),
        next_segment: 1 << 32,
    };
    match cfg.kind {
        Kind::Tenants => g.tenants(cfg.requests, rate),
        Kind::Multiturn => g.multiturn(cfg.requests, rate),
        Kind::Rag => g.rag(cfg.requests, rate),
        Kind::Nosharing => g.nosharing(cfg.requests, rate),
        Kind::ChatBursts | Kind::AgentBursts => g.shaped(cfg.requests, rate, shape),
    }
    g.out
}

struct Gen<'r> {
    rng: &'r mut StdRng,
    ids: IdAssigner,
    out: Workload,
    scratch: Vec<u64>,
    next_segment: u64,
}

impl Gen<'_> {
    fn fresh(&mut self, len: u32) -> Segment {
        self.next_segment += 1;
        Segment {
            id: self.next_segment,
            len,
        }
    }

    fn emit(&mut self, t_us: f64, segments: &[Segment], output: u32) {
        let input = self.ids.assign(segments, &mut self.scratch);
        self.out.push(to_ms_us(t_us), input, output, &self.scratch);
    }

    fn tenants(&mut self, n: usize, rate: f64) {
        let prompts: Vec<Segment> = (0..TENANTS as u64)
            .map(|t| Segment {
                id: t,
                len: uniform(self.rng, TENANT_PROMPT),
            })
            .collect();
        let zipf = Zipf::new(TENANTS, TENANT_ZIPF);
        let mut t = 0.0;
        for _ in 0..n {
            t += exp_gap_us(self.rng, rate);
            let tenant = prompts[zipf.sample(self.rng)];
            let user = uniform(self.rng, TENANT_USER);
            let user = self.fresh(user);
            let out = uniform(self.rng, OUTPUT);
            self.emit(t, &[tenant, user], out);
        }
    }

    fn multiturn(&mut self, n: usize, rate: f64) {
        struct Conversation {
            segments: Vec<Segment>,
            turns_left: u32,
        }
        let system = Segment {
            id: 0,
            len: CHAT_SYSTEM,
        };
        let mean_turns = f64::from(CHAT_TURNS.0 + CHAT_TURNS.1) / 2.0;
        let start_rate = rate / mean_turns;
        let mut conversations: Vec<Conversation> = Vec::new();
        // (Reverse time in µs, conversation): the next turn due.
        let mut due: BinaryHeap<std::cmp::Reverse<(u64, usize)>> = BinaryHeap::new();
        let mut next_start = exp_gap_us(self.rng, start_rate);
        let mut emitted = 0;
        while emitted < n {
            let next_turn = due.peek().map(|r| r.0);
            #[allow(clippy::cast_precision_loss)]
            let start_first = next_turn.is_none_or(|(t, _)| next_start <= t as f64);
            let (t, c) = if start_first {
                let t = next_start;
                next_start += exp_gap_us(self.rng, start_rate);
                let first = uniform(self.rng, CHAT_FIRST_USER);
                let first = self.fresh(first);
                conversations.push(Conversation {
                    segments: vec![system, first],
                    turns_left: uniform(self.rng, CHAT_TURNS),
                });
                (t, conversations.len() - 1)
            } else {
                let Some(std::cmp::Reverse((t, c))) = due.pop() else {
                    break;
                };
                let next = uniform(self.rng, CHAT_NEXT_USER);
                let seg = self.fresh(next);
                if let Some(conv) = conversations.get_mut(c) {
                    conv.segments.push(seg);
                }
                #[allow(clippy::cast_precision_loss)]
                (t as f64, c)
            };
            let answer = uniform(self.rng, CHAT_ANSWER);
            let Some(conv) = conversations.get_mut(c) else {
                break;
            };
            self.emit(t, &conv.segments, answer);
            emitted += 1;
            conv.turns_left = conv.turns_left.saturating_sub(1);
            // The answer becomes part of the next prompt.
            self.next_segment += 1;
            conv.segments.push(Segment {
                id: self.next_segment,
                len: answer,
            });
            let len: u32 = conv.segments.iter().map(|s| s.len).sum();
            if conv.turns_left > 0 && len + CHAT_NEXT_USER.1 <= CHAT_MAX_PROMPT {
                let think = exp_gap_us(self.rng, 1e6 / (CHAT_THINK_MS * 1000.0));
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                due.push(std::cmp::Reverse(((t + think) as u64, c)));
            } else {
                conv.segments = Vec::new();
            }
        }
        self.out.sort();
    }

    fn rag(&mut self, n: usize, rate: f64) {
        let system = Segment {
            id: 0,
            len: RAG_SYSTEM,
        };
        let docs: Vec<Segment> = (0..RAG_DOCS as u64)
            .map(|d| Segment {
                id: 1 + d,
                len: uniform(self.rng, RAG_DOC_LEN),
            })
            .collect();
        let zipf = Zipf::new(RAG_DOCS, RAG_ZIPF);
        let mut t = 0.0;
        let mut segments = Vec::with_capacity(RAG_PER_PROMPT + 2);
        let mut picked = Vec::with_capacity(RAG_PER_PROMPT);
        for _ in 0..n {
            t += exp_gap_us(self.rng, rate);
            segments.clear();
            picked.clear();
            segments.push(system);
            while picked.len() < RAG_PER_PROMPT {
                let d = zipf.sample(self.rng);
                if !picked.contains(&d) {
                    picked.push(d);
                    segments.push(docs[d]);
                }
            }
            let q = uniform(self.rng, RAG_QUESTION);
            segments.push(self.fresh(q));
            let out = uniform(self.rng, OUTPUT);
            self.emit(t, &segments, out);
        }
    }

    fn nosharing(&mut self, n: usize, rate: f64) {
        let mut t = 0.0;
        for _ in 0..n {
            t += exp_gap_us(self.rng, rate);
            let len = uniform(self.rng, UNIQUE_PROMPT);
            let seg = self.fresh(len);
            let out = uniform(self.rng, OUTPUT);
            self.emit(t, &[seg], out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_shared_prefixes() {
        let mut a = IdAssigner::default();
        let mut x = Vec::new();
        let mut y = Vec::new();
        let sys = Segment { id: 1, len: 1100 };
        a.assign(&[sys, Segment { id: 2, len: 100 }], &mut x);
        a.assign(&[sys, Segment { id: 3, len: 100 }], &mut y);
        assert_eq!(x.len(), 3);
        assert_eq!(x[..2], y[..2]);
        assert_ne!(x[2], y[2]);
    }
}
