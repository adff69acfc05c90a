//! Parallel exact tokenization (`prompt::parallel`) with the real Qwen3
//! tokenizer: ids identical to one full `encode_fast` on random texts built
//! from adversarial fragments (whitespace runs, digits, CJK, emoji, combining
//! marks, contractions, added tokens and look-alikes), on every golden chat
//! prompt, and through `ModelTokenizer::encode_parallel` with the span cache;
//! plus the guard that refuses tokenizers the seam rule is not proven for.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_engines::prompt::{seams, ParallelConfig, ParallelEncoder, SeamPolicy};
use kvroute_engines::prompt::{ModelOptions, ModelTokenizer};
use proptest::prelude::*;
use tokenizers::Tokenizer;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn qwen3() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let opts = ModelOptions {
            max_model_len: Some(1 << 20),
            ..ModelOptions::default()
        };
        ModelTokenizer::load(&repo().join("golden/tokenizers/qwen3"), &opts).unwrap()
    })
}

fn reference(text: &str) -> Vec<u32> {
    qwen3()
        .tokenizer()
        .encode_fast(text, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn encoder(threads: usize, pieces_per_thread: usize, window_bytes: usize) -> ParallelEncoder {
    ParallelEncoder::new(ParallelConfig {
        threads,
        min_bytes: 0,
        pieces_per_thread,
        window_bytes,
    })
    .unwrap()
}

const FRAGMENTS: &[&str] = &[
    "hello",
    "The",
    "x",
    "word",
    "Routing",
    "a",
    "I",
    "s",
    " ",
    "  ",
    "   \t ",
    "\n",
    "\n\n",
    " \n ",
    "\r\n",
    "\t",
    "0",
    "42",
    "12345678",
    "3.14",
    "漢字",
    "テスト",
    "한국어",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "e\u{301}",
    "\u{301}",
    "—",
    "'s",
    "'LL",
    "'t",
    "don't",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "im_start|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    "<tool_call>",
    "{\"k\": [1, 2]}",
    "fn main() {}",
    "   ",
    ".",
    ",",
    "!?",
    "__init__",
    "URL",
    "https://x.y/z",
];

fn text_from(picks: &[usize]) -> String {
    let mut s = String::new();
    for (i, p) in picks.iter().enumerate() {
        s.push_str(FRAGMENTS[p % FRAGMENTS.len()]);
        // Plenty of `letter space letter` candidates between the fragments.
        if i % 3 == 0 {
            s.push_str(" and ");
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_texts_match_one_full_encode(
        picks in proptest::collection::vec(any::<usize>(), 0..500),
        threads in 2usize..5,
        pieces in 1usize..9,
        window in prop_oneof![Just(1usize), 8usize..200],
    ) {
        let text = text_from(&picks);
        let tok = qwen3().tokenizer();
        let policy = SeamPolicy::for_tokenizer(tok);
        prop_assert!(policy.is_some());
        let got = encoder(threads, pieces, window).encode(tok, policy.as_ref(), &text).unwrap();
        prop_assert_eq!(got, reference(&text));
    }
}

/// Every `letter space letter` position of an adversarial text is a seam
/// whose halves encode to the whole: checked one by one, not only the few the
/// splitter picks.
#[test]
fn every_candidate_seam_of_adversarial_text_is_exact() {
    let mut text = String::new();
    for (i, f) in FRAGMENTS.iter().enumerate() {
        let g = FRAGMENTS[(i * 7 + 3) % FRAGMENTS.len()];
        text.push_str(&format!("{f}a b{g}zz yy{f}{g} q r"));
    }
    let whole = reference(&text);
    let bytes = text.as_bytes();
    let mut checked = 0;
    for p in 1..bytes.len().saturating_sub(1) {
        let seam = bytes[p] == b' '
            && bytes[p - 1].is_ascii_alphabetic()
            && bytes[p + 1].is_ascii_alphabetic();
        if !seam {
            continue;
        }
        let mut ids = reference(&text[..p]);
        ids.extend(reference(&text[p..]));
        assert_eq!(
            ids,
            whole,
            "seam at byte {p}: {:?}",
            &text[p.saturating_sub(20)..p + 20]
        );
        checked += 1;
    }
    assert!(checked > 100, "only {checked} candidate seams");
}

/// A long English-like text really is split (the test above and the
/// proptests would pass vacuously if no seam were ever found).
#[test]
fn long_text_splits_into_many_pieces() {
    let text = "The router keeps the prefix of every prompt. ".repeat(2_000);
    let tok = qwen3().tokenizer();
    let cuts = seams(tok, &text, 8, 64);
    assert_eq!(cuts.len(), 7, "{cuts:?}");
    assert!(cuts.windows(2).all(|w| w[0] < w[1]));
    let policy = SeamPolicy::for_tokenizer(tok);
    let got = encoder(2, 4, 64)
        .encode(tok, policy.as_ref(), &text)
        .unwrap();
    assert_eq!(got, reference(&text));
}

/// Text without a single seam (CJK only) still encodes exactly, in one piece.
#[test]
fn text_without_seams_is_encoded_whole() {
    let text = "漢字テスト한국어😀".repeat(500);
    let tok = qwen3().tokenizer();
    assert!(seams(tok, &text, 8, 64).is_empty());
    let policy = SeamPolicy::for_tokenizer(tok);
    let got = encoder(2, 4, 64)
        .encode(tok, policy.as_ref(), &text)
        .unwrap();
    assert_eq!(got, reference(&text));
}

#[derive(serde::Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    id: String,
    /// Absent (null) for the error cases.
    #[serde(default)]
    engine_prompts: Option<Vec<EnginePromptCase>>,
}

#[derive(serde::Deserialize)]
struct EnginePromptCase {
    #[serde(default)]
    rendered_prompt: Option<String>,
    token_ids: Vec<u32>,
}

/// Every golden prompt's rendered text, through `encode_parallel` (span cache
/// included) with a tiny threshold so even short prompts are split, and
/// repeated 40 times into one long text.
#[test]
fn every_golden_prompt_encodes_to_its_ids() {
    let raw = std::fs::read(repo().join("golden/chat/qwen3_cases.json")).unwrap();
    let cases: Cases = serde_json::from_slice(&raw).unwrap();
    let enc = encoder(3, 4, 32);
    let tok = qwen3();
    assert!(tok.splits_in_parallel());
    let mut checked = 0;
    for case in &cases.cases {
        for p in case.engine_prompts.iter().flatten() {
            let Some(text) = &p.rendered_prompt else {
                continue;
            };
            let got = tok.encode_parallel(text, false, &enc).unwrap();
            assert_eq!(got, reference(text), "case {}", case.id);
            // The golden ids are the engine's, after any truncation.
            if !case.id.contains("truncat") {
                assert_eq!(got, p.token_ids, "case {}", case.id);
            }
            let long = text.repeat(40);
            let got = enc
                .encode(
                    tok.tokenizer(),
                    SeamPolicy::for_tokenizer(tok.tokenizer()).as_ref(),
                    &long,
                )
                .unwrap();
            assert_eq!(got, reference(&long), "case {} ×40", case.id);
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} golden prompts");
}

/// A tokenizer whose pipeline the proof does not cover (no pre-tokenizer:
/// BPE could merge across spaces) gets no seam policy and is encoded whole.
#[test]
fn unproven_tokenizers_get_no_seam_policy() {
    let raw = std::fs::read(repo().join("golden/tokenizers/qwen3/tokenizer.json.gz")).unwrap();
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(raw.as_slice()), &mut json)
        .unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&json).unwrap();
    assert!(SeamPolicy::for_tokenizer(&Tokenizer::from_bytes(&json).unwrap()).is_some());
    v["pre_tokenizer"] = serde_json::Value::Null;
    let bare = Tokenizer::from_bytes(serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(SeamPolicy::for_tokenizer(&bare).is_none());
    let mut v2: serde_json::Value = serde_json::from_slice(&json).unwrap();
    v2["added_tokens"][0]["rstrip"] = true.into();
    let stripping = Tokenizer::from_bytes(serde_json::to_vec(&v2).unwrap()).unwrap();
    assert!(SeamPolicy::for_tokenizer(&stripping).is_none());
}

/// A pool with a parallel encoder attached gives every request the same ids
/// as one without (a 40 K-character chat body, split on 3 threads).
#[test]
fn tokenizer_pool_with_a_parallel_encoder_gives_the_same_prompt() {
    use kvroute_engines::prompt::{ApiKind, TokenizerPool};
    let dir = repo().join("golden/tokenizers/qwen3");
    let plain = TokenizerPool::new();
    plain.register("q", &dir);
    let par = TokenizerPool::new();
    par.register("q", &dir);
    par.set_parallel(Some(std::sync::Arc::new(
        ParallelEncoder::new(ParallelConfig {
            threads: 3,
            min_bytes: 1024,
            ..ParallelConfig::default()
        })
        .unwrap(),
    )));
    let doc = text_from(&(0..4000).collect::<Vec<_>>());
    let body = serde_json::json!({
        "model": "q",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": doc}],
    })
    .to_string();
    let a = plain.prompt_tokens(ApiKind::Chat, body.as_bytes()).unwrap();
    let b = par.prompt_tokens(ApiKind::Chat, body.as_bytes()).unwrap();
    assert!(a.engine_prompts[0].token_ids.len() > 5_000);
    assert_eq!(a, b);
    let cuts = seams(
        par.get("q").unwrap().tokenizer(),
        a.engine_prompts[0].rendered.as_deref().unwrap(),
        6,
        64,
    );
    assert!(cuts.len() >= 3, "{cuts:?}");
}
