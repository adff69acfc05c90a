//! `kvroute bench prompt`: what the gateway's own work on a fresh chat request
//! costs beside the tokenization the engine does anyway.
//!
//! For each size, fresh chat bodies (a new user document every run, the span
//! cache emptied before each measurement) go body → block keys through the
//! gateway's pipeline, timed step by step: parse (`json.loads` + request
//! fields), render (chat template), tokenize (span-cached encode), hash
//! (vLLM `sha256_cbor`, 16-token blocks) and score (the early-stopping prefix
//! walk against 64 endpoints). Beside it, in the same run and on the same
//! rendered text, a plain single-threaded `tokenizers::Tokenizer::encode`.
//! With `--threads N` the tokenize step also runs on an N-thread
//! [`ParallelEncoder`], once followed by the hash step (`parallel`) and once
//! pipelined with it (`pipelined`: each piece's blocks hashed on the caller's
//! thread as the piece arrives, while later pieces still encode). For the
//! pipelined pass the report also gives the hash work no encode overlapped
//! (`tail`: from the arrival of the document's last piece) and keys → decision with the whole prompt cached on
//! one of the 64 endpoints (`score_hit`: the longest prefix walk, plus the
//! argmax). Every figure is the median of `--runs` runs.
//!
//! ```text
//! kvroute bench prompt --threads 1,2 --json prompt.json
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use kvroute_core::{BlockKey, EndpointId, HashContract, Medium, RequestExtras};
use kvroute_engines::prompt::{
    extract_request, parse_json, render_chat, ApiKind, ModelOptions, ModelTokenizer, OpenAiRequest,
    ParallelConfig, ParallelEncoder,
};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
use serde::Serialize;

/// The mock engines' and the gateway's default contract.
const CONTRACT: &str = "vllm@0.33.0:sha256_cbor:block=16:seed=0";

/// `kvroute bench prompt`.
#[derive(Args, Debug, Clone)]
pub struct PromptBenchArgs {
    /// Prompt sizes in tokens (approximate: the document is sized by a
    /// calibration encode; the report gives the exact count).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768,131072")]
    pub sizes: Vec<usize>,
    /// Tokenizer worker threads to measure the parallel path with (a list).
    #[arg(long, value_delimiter = ',', default_value = "2")]
    pub threads: Vec<usize>,
    /// Runs per measurement (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Model directory (tokenizer, chat template); defaults to the repo's
    /// golden/tokenizers/qwen3.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Keep the pre-token cache of the fast byte-level BPE path between runs
    /// (a gateway's steady state: a fresh document's words were mostly seen
    /// before); by default every run starts with both caches empty.
    #[arg(long)]
    pub warm_pre_tokens: bool,
}

/// One (size, threads) line of the report; times in ms, medians.
#[derive(Debug, Clone, Serialize)]
pub struct PromptBenchRow {
    /// Prompt tokens (of the median-sized run's rendered text).
    pub tokens: usize,
    /// Workers of the parallel tokenize step.
    pub threads: usize,
    /// Plain single-threaded `Tokenizer::encode` of the rendered text.
    pub plain_encode_ms: f64,
    /// kvroute path, one thread: parse + render + tokenize + hash.
    pub single_ms: f64,
    /// kvroute path with the tokenize step on `threads` workers.
    pub parallel_ms: f64,
    /// Steps of the single-threaded path.
    pub parse_ms: f64,
    /// Chat template rendering.
    pub render_ms: f64,
    /// Span-cached encode (every segment a miss: fresh text).
    pub tokenize_ms: f64,
    /// The parallel encode of the same text.
    pub parallel_tokenize_ms: f64,
    /// Block keys from the ids.
    pub hash_ms: f64,
    /// Scoring the keys against 64 endpoints (not part of `single_ms`).
    pub score_ms: f64,
    /// `single_ms / plain_encode_ms`.
    pub single_ratio: f64,
    /// `parallel_ms / plain_encode_ms`.
    pub parallel_ratio: f64,
    /// parse + render + tokenize on `threads` workers with each piece's
    /// blocks hashed as it arrives.
    pub pipelined_ms: f64,
    /// `pipelined_ms / plain_encode_ms`.
    pub pipelined_ratio: f64,
    /// Parts the ids of the pipelined pass arrived in (span-cache segments,
    /// the long one split into pieces).
    pub pipeline_parts: usize,
    /// Of the pipelined pass: the hash work no encode overlapped (from the
    /// arrival of the document's last piece to the last key).
    pub tail_hash_ms: f64,
    /// Keys → decision: the prefix walk over 64 endpoints, one of which
    /// holds every key of the prompt, and the argmax.
    pub score_hit_ms: f64,
    /// `tail_hash_ms + score_hit_ms`: the decision's latency after the
    /// tokenizer's last id.
    pub decision_after_ids_ms: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct PromptBenchReport {
    /// Runs per median.
    pub runs: usize,
    /// Hash contract of the hash step.
    pub contract: String,
    /// One row per (size, threads).
    pub results: Vec<PromptBenchRow>,
}

const WORDS: [&str; 48] = [
    "the",
    "router",
    "keeps",
    "a",
    "prefix",
    "of",
    "every",
    "prompt",
    "and",
    "sends",
    "it",
    "to",
    "engine",
    "that",
    "already",
    "holds",
    "cache",
    "blocks",
    "for",
    "long",
    "documents",
    "when",
    "tenants",
    "share",
    "system",
    "instructions",
    "latency",
    "drops",
    "because",
    "prefill",
    "is",
    "skipped",
    "on",
    "hit",
    "but",
    "fresh",
    "context",
    "must",
    "be",
    "tokenized",
    "first",
    "model",
    "answers",
    "questions",
    "about",
    "retrieval",
    "quarterly",
    "report",
];

/// A document of `words` words drawn from `seed`: sentences, commas, numbers,
/// paragraphs — text shaped like a RAG document.
fn document(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        let r = next();
        let w = WORDS.get((r % WORDS.len() as u64) as usize).unwrap_or(&"x");
        if i % 12 == 0 {
            if i > 0 {
                out.push('.');
            }
            out.push_str(if i % 120 == 0 && i > 0 { "\n\n" } else { " " });
            let mut cap = w.chars();
            if let Some(c) = cap.next() {
                out.extend(c.to_uppercase());
                out.push_str(cap.as_str());
            }
        } else {
            out.push(' ');
            if r % 29 == 0 {
                out.push_str(&format!("{}", (r >> 20) % 10_000));
                out.push(' ');
            }
            out.push_str(w);
            if r % 17 == 0 {
                out.push(',');
            }
        }
    }
    out.push('.');
    out
}

fn body(seed: u64, words: usize) -> Vec<u8> {
    serde_json::json!({
        "model": "qwen3",
        "messages": [
            {"role": "system", "content": format!("You answer questions about the document. Session {seed}.")},
            {"role": "user", "content": document(seed, words)},
        ],
        "max_tokens": 1,
    })
    .to_string()
    .into_bytes()
}

/// Fresh chat bodies of about a given number of tokens (`bench gateway
/// --fresh`), and what a single-threaded tokenization of them costs.
pub struct Calibrated {
    tok: ModelTokenizer,
    words: usize,
    /// Tokens of a calibrated body's rendered prompt.
    pub tokens: usize,
}

impl Calibrated {
    /// Loads the tokenizer and sizes the document to about `tokens` tokens.
    pub fn new(model_dir: &Path, tokens: usize) -> anyhow::Result<Self> {
        let tok = ModelTokenizer::load(model_dir, &ModelOptions::default())
            .with_context(|| format!("loading the tokenizer from {}", model_dir.display()))?;
        let probe = Self::encode(&tok, &body(1, tokens))?.1;
        let words = (tokens as f64 * tokens as f64 / probe.max(1) as f64).round() as usize;
        let tokens = Self::encode(&tok, &body(2, words.max(1)))?.1;
        Ok(Self {
            tok,
            words: words.max(1),
            tokens,
        })
    }

    /// Body number `seed` (its document is new for every seed).
    #[must_use]
    pub fn body(&self, seed: u64) -> Vec<u8> {
        body(seed, self.words)
    }

    /// (ms, tokens) of a plain single-threaded `Tokenizer::encode` of one
    /// rendered body.
    fn encode(tok: &ModelTokenizer, body: &[u8]) -> anyhow::Result<(f64, usize)> {
        let value = parse_json(body).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let req = extract_request(ApiKind::Chat, &value).map_err(|e| anyhow::anyhow!("{e}"))?;
        let OpenAiRequest::Chat(chat) = &req else {
            anyhow::bail!("the bench body is not a chat request");
        };
        let (_, rendered) = render_chat(tok, chat).map_err(|e| anyhow::anyhow!("{e}"))?;
        let t = Instant::now();
        let enc = tok
            .tokenizer()
            .encode(rendered.as_str(), false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((ms(t), enc.get_ids().len()))
    }

    /// Median (ms, tokens) of single-threaded encodes of the bodies `seeds`.
    pub fn single_thread_encode_ms(
        &self,
        seeds: impl Iterator<Item = u64>,
    ) -> anyhow::Result<(f64, usize)> {
        let (mut times, mut tokens) = (Vec::new(), Vec::new());
        for seed in seeds {
            let (t, n) = Self::encode(&self.tok, &self.body(seed))?;
            times.push(t);
            tokens.push(n as f64);
        }
        Ok((median(times), median(tokens) as usize))
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Times of one pass over one body.
struct Pass {
    parse: f64,
    render: f64,
    tokenize: f64,
    hash: f64,
    score: f64,
    tokens: usize,
    rendered: String,
}

/// Times of one pipelined pass.
struct Pipelined {
    total: f64,
    tail: f64,
    score_hit: f64,
    parts: usize,
    tokens: usize,
}

/// 64 endpoints of 20 K unrelated keys each: a fresh prompt misses
/// everywhere, as a new document does.
fn background_index() -> anyhow::Result<SharedIndex> {
    let index = SharedIndex::new(64, IndexConfig::default());
    for e in 0..64u32 {
        let keys: Vec<BlockKey> = (0..20_000u64)
            .map(|i| BlockKey((u64::from(e) << 40 | i).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        index
            .store(EndpointId(e), Medium::Gpu, &keys)
            .context("filling the index")?;
    }
    Ok(index)
}

struct Fixture {
    tok: ModelTokenizer,
    hasher: kvroute_core::BlockHasher,
    index: SharedIndex,
    warm_pre_tokens: bool,
}

impl Fixture {
    fn new(model_dir: &Path) -> anyhow::Result<Self> {
        let tok = ModelTokenizer::load(model_dir, &ModelOptions::default())
            .with_context(|| format!("loading the tokenizer from {}", model_dir.display()))?;
        let contract: HashContract = CONTRACT.parse().context("the bench contract")?;
        let hasher = contract.hasher().context("the bench contract's hasher")?;
        let index = background_index()?;
        Ok(Self {
            tok,
            hasher,
            index,
            warm_pre_tokens: false,
        })
    }

    /// Empties the span cache, and the pre-token cache unless kept warm.
    fn fresh(&self) {
        self.tok.clear_span_cache();
        if !self.warm_pre_tokens {
            self.tok.clear_pre_token_cache();
        }
    }

    /// Body → keys, step by step; `encoder` `None`: the span-cached
    /// single-threaded encode.
    fn pass(&self, body: &[u8], encoder: Option<&ParallelEncoder>) -> anyhow::Result<Pass> {
        self.fresh();
        let t = Instant::now();
        let value = parse_json(body).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let req = extract_request(ApiKind::Chat, &value).map_err(|e| anyhow::anyhow!("{e}"))?;
        let parse = ms(t);
        let OpenAiRequest::Chat(chat) = &req else {
            anyhow::bail!("the bench body is not a chat request");
        };
        let add_special = req.common().add_special_tokens;
        let t = Instant::now();
        let (_, rendered) = render_chat(&self.tok, chat).map_err(|e| anyhow::anyhow!("{e}"))?;
        let render = ms(t);
        let t = Instant::now();
        let ids = match encoder {
            Some(enc) => self.tok.encode_parallel(&rendered, add_special, enc),
            None => self.tok.encode(&rendered, add_special),
        }
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let tokenize = ms(t);
        let t = Instant::now();
        let mut keys = Vec::with_capacity(ids.len() / 16 + 1);
        self.hasher
            .hash_prompt(&ids, &RequestExtras::default(), &mut keys)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let hash = ms(t);
        let t = Instant::now();
        let mut out = [Overlap::default(); 64];
        self.index.score_prefix(&keys, &mut out);
        let score = ms(t);
        std::hint::black_box(&out);
        Ok(Pass {
            parse,
            render,
            tokenize,
            hash,
            score,
            tokens: ids.len(),
            rendered,
        })
    }

    /// Body → keys with `encoder` attached to the tokenizer and each part's
    /// blocks hashed as it arrives; then keys → decision against an index
    /// where endpoint 63 holds all of them.
    fn pipelined(
        &mut self,
        body: &[u8],
        encoder: &Arc<ParallelEncoder>,
    ) -> anyhow::Result<Pipelined> {
        self.tok.set_parallel(Some(Arc::clone(encoder)));
        let out = self.pipelined_pass(body);
        self.tok.set_parallel(None);
        out
    }

    fn pipelined_pass(&self, body: &[u8]) -> anyhow::Result<Pipelined> {
        self.fresh();
        let t = Instant::now();
        let value = parse_json(body).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let req = extract_request(ApiKind::Chat, &value).map_err(|e| anyhow::anyhow!("{e}"))?;
        let OpenAiRequest::Chat(chat) = &req else {
            anyhow::bail!("the bench body is not a chat request");
        };
        let add_special = req.common().add_special_tokens;
        let (_, rendered) = render_chat(&self.tok, chat).map_err(|e| anyhow::anyhow!("{e}"))?;
        let extras = RequestExtras::default();
        let mut chain = self.hasher.prompt(&extras)?;
        let mut ids = Vec::with_capacity(rendered.len() / 3);
        let mut keys = Vec::with_capacity(rendered.len() / 40 + 1);
        // Where the document's last part arrived (parts of 256 ids or more
        // are the document's pieces; the template's segments are a few
        // tokens): what follows is the hash work no encode overlapped (that
        // piece's blocks, the short template segments after it).
        let mut last_hashing = Instant::now();
        let mut parts = 0;
        self.tok
            .encode_each(&rendered, add_special, |part: &[u32]| {
                let arrived = Instant::now();
                parts += 1;
                ids.extend_from_slice(part);
                if part.len() >= 256 {
                    last_hashing = arrived;
                }
                chain.extend(&ids, &mut keys).map_err(anyhow::Error::from)?;
                Ok::<(), anyhow::Error>(())
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let total = ms(t);
        let tail = ms(last_hashing);
        let mut check = Vec::with_capacity(keys.len());
        self.hasher
            .hash_prompt(&ids, &extras, &mut check)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        anyhow::ensure!(check == keys, "pipelined keys differ from one-shot keys");
        // A new index per measurement (the same 64 × 20 K unrelated keys,
        // the prompt on endpoint 63): no removals left behind by earlier runs.
        let holder = EndpointId(63);
        let index = background_index()?;
        // Stored as the engines' events arrive through `EndpointIngest`:
        // 16-block events chained through their parent.
        let mut parent = None;
        for event in keys.chunks(16) {
            index.store_chain(holder, Medium::Gpu, parent, event)?;
            parent = event.last().copied();
        }
        let mut out = [Overlap::default(); 64];
        let t = Instant::now();
        index.score_prefix(&keys, &mut out);
        let best = out
            .iter()
            .enumerate()
            .max_by_key(|(e, o)| (o.prefix, std::cmp::Reverse(*e)))
            .map(|(e, _)| e);
        let score_hit = ms(t);
        anyhow::ensure!(
            best == Some(63) && out[63].prefix as usize == keys.len(),
            "the holder of every key did not win: {:?}",
            out.get(63)
        );
        Ok(Pipelined {
            total,
            tail,
            score_hit,
            parts,
            tokens: ids.len(),
        })
    }

    fn plain(&self, text: &str) -> anyhow::Result<(f64, Vec<u32>)> {
        let t = Instant::now();
        let enc = self
            .tok
            .tokenizer()
            .encode(text, false)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((ms(t), enc.get_ids().to_vec()))
    }
}

/// Runs the benchmark and returns the report (also written to `--json`).
pub fn run_prompt_bench(args: &PromptBenchArgs) -> anyhow::Result<PromptBenchReport> {
    let model_dir = args.model_dir.clone().unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../golden/tokenizers/qwen3")
    });
    let mut fx = Fixture::new(&model_dir)?;
    fx.warm_pre_tokens = args.warm_pre_tokens;
    let runs = args.runs.max(1);
    let mut encoders = Vec::new();
    for &n in &args.threads {
        let enc = ParallelEncoder::new(ParallelConfig {
            threads: n.max(1),
            ..ParallelConfig::default()
        })
        .context("building the tokenizer pool")?;
        encoders.push(Arc::new(enc));
    }
    let mut results = Vec::new();
    for &size in &args.sizes {
        // Calibrate the document length once: ~1.2 tokens per word here.
        let probe = fx.pass(&body(1, size), None)?;
        let words = (size as f64 * size as f64 / probe.tokens.max(1) as f64).round() as usize;
        for enc in &encoders {
            let (mut plain, mut single, mut parallel) = (Vec::new(), Vec::new(), Vec::new());
            let (mut parse, mut render, mut tokenize, mut ptok, mut hash, mut score) = (
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
                Vec::new(),
            );
            let mut tokens = Vec::new();
            let (mut piped, mut tail, mut hit, mut parts, mut decision) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for run in 0..runs {
                let b = body(1_000 + run as u64 * 7919 + size as u64, words);
                let s = fx.pass(&b, None)?;
                let p = fx.pass(&b, Some(enc))?;
                let q = fx.pipelined(&b, enc)?;
                let (plain_ms, plain_ids) = fx.plain(&s.rendered)?;
                // The paths must agree before their times mean anything.
                anyhow::ensure!(
                    s.tokens == plain_ids.len() && p.tokens == s.tokens && q.tokens == s.tokens,
                    "token counts differ: span-cached {}, parallel {}, pipelined {}, plain {}",
                    s.tokens,
                    p.tokens,
                    q.tokens,
                    plain_ids.len()
                );
                piped.push(q.total);
                decision.push(q.tail + q.score_hit);
                tail.push(q.tail);
                hit.push(q.score_hit);
                parts.push(q.parts as f64);
                plain.push(plain_ms);
                single.push(s.parse + s.render + s.tokenize + s.hash);
                parallel.push(p.parse + p.render + p.tokenize + p.hash);
                parse.push(s.parse);
                render.push(s.render);
                tokenize.push(s.tokenize);
                ptok.push(p.tokenize);
                hash.push(s.hash);
                score.push(s.score);
                tokens.push(s.tokens as f64);
            }
            let plain_encode_ms = median(plain);
            let single_ms = median(single);
            let parallel_ms = median(parallel);
            let pipelined_ms = median(piped);
            let ratio = |x: f64| {
                if plain_encode_ms > 0.0 {
                    x / plain_encode_ms
                } else {
                    0.0
                }
            };
            results.push(PromptBenchRow {
                tokens: median(tokens) as usize,
                threads: enc.threads(),
                plain_encode_ms,
                single_ms,
                parallel_ms,
                parse_ms: median(parse),
                render_ms: median(render),
                tokenize_ms: median(tokenize),
                parallel_tokenize_ms: median(ptok),
                hash_ms: median(hash),
                score_ms: median(score),
                single_ratio: ratio(single_ms),
                parallel_ratio: ratio(parallel_ms),
                pipelined_ms,
                pipelined_ratio: ratio(pipelined_ms),
                pipeline_parts: median(parts) as usize,
                tail_hash_ms: median(tail),
                score_hit_ms: median(hit),
                decision_after_ids_ms: median(decision),
            });
        }
    }
    let report = PromptBenchReport {
        runs,
        contract: CONTRACT.to_owned(),
        results,
    };
    if let Some(path) = &args.json {
        let s = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report)
}

/// The report as a table.
#[must_use]
pub fn render_prompt_report(r: &PromptBenchReport) -> String {
    let mut s = format!(
        "fresh chat body -> block keys ({}, medians of {} runs, ms)\n\
         {:>7} {:>3} {:>9} {:>7} {:>7} {:>9} {:>7} {:>7} | {:>9} {:>8} {:>7} | {:>9} {:>7} | {:>9} {:>7} {:>5} {:>7} {:>9} {:>9}\n",
        r.contract,
        r.runs,
        "tokens",
        "thr",
        "plain",
        "parse",
        "render",
        "tokenize",
        "hash",
        "score",
        "single",
        "x plain",
        "par.tok",
        "parallel",
        "x plain",
        "pipelined",
        "x plain",
        "parts",
        "tail",
        "score hit",
        "decision",
    );
    for x in &r.results {
        s.push_str(&format!(
            "{:>7} {:>3} {:>9.2} {:>7.3} {:>7.3} {:>9.2} {:>7.3} {:>7.4} | {:>9.2} {:>8.2} {:>7.2} | {:>9.2} {:>7.2} | {:>9.2} {:>7.2} {:>5} {:>7.3} {:>9.4} {:>9.3}\n",
            x.tokens,
            x.threads,
            x.plain_encode_ms,
            x.parse_ms,
            x.render_ms,
            x.tokenize_ms,
            x.hash_ms,
            x.score_ms,
            x.single_ms,
            x.single_ratio,
            x.parallel_tokenize_ms,
            x.parallel_ms,
            x.parallel_ratio,
            x.pipelined_ms,
            x.pipelined_ratio,
            x.pipeline_parts,
            x.tail_hash_ms,
            x.score_hit_ms,
            x.decision_after_ids_ms,
        ));
    }
    s
}
