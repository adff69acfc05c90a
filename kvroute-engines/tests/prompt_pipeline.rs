//! Pipelined tokenize + hash (`prompt::pipeline`, `encode_each`) with the real
//! Qwen3 tokenizer and the vLLM contracts: the parts a long text arrives in
//! concatenate to one full encode, and the keys hashed part by part (parent
//! digest and partial tail block carried across parts) equal the one-shot
//! keys of those ids — on random adversarial texts, with EAGLE lookahead, with
//! span-cache hits and misses; a sink error stops the pipeline; and scoring
//! the keys of a 128 K-token prompt allocates nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvroute_core::{BlockHasher, BlockKey, EndpointId, HashContract, Medium, RequestExtras};
use kvroute_engines::prompt::{
    encode_and_hash, ModelOptions, ModelTokenizer, ParallelConfig, ParallelEncoder, PromptError,
    SeamPolicy,
};
use kvroute_ingest::{IndexConfig, InventoryView, Overlap, SharedIndex};
use proptest::prelude::*;

/// Counts allocations made by the current thread (other test threads do not
/// disturb a measurement).
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as for `dealloc`, and `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCS.with(Cell::get)
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/tokenizers/qwen3")
}

fn load(parallel: Option<ParallelConfig>) -> ModelTokenizer {
    let opts = ModelOptions {
        max_model_len: Some(1 << 20),
        ..ModelOptions::default()
    };
    let mut tok = ModelTokenizer::load(&dir(), &opts).unwrap();
    tok.set_parallel(parallel.map(|c| Arc::new(ParallelEncoder::new(c).unwrap())));
    tok
}

/// Splits anything over 64 bytes into up to 6 pieces on 3 workers.
fn parallel_tok() -> &'static ModelTokenizer {
    static T: OnceLock<ModelTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        load(Some(ParallelConfig {
            threads: 3,
            min_bytes: 64,
            pieces_per_thread: 2,
            window_bytes: 64,
        }))
    })
}

fn reference(text: &str) -> Vec<u32> {
    parallel_tok()
        .tokenizer()
        .encode_fast(text, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn hasher(contract: &str) -> BlockHasher {
    contract.parse::<HashContract>().unwrap().hasher().unwrap()
}

fn one_shot(h: &BlockHasher, ids: &[u32]) -> Vec<BlockKey> {
    let mut keys = Vec::new();
    h.hash_prompt(ids, &RequestExtras::NONE, &mut keys).unwrap();
    keys
}

const FRAGMENTS: &[&str] = &[
    "hello",
    "The",
    "x",
    "word",
    "a",
    " ",
    "   \t ",
    "\n",
    "\n\n",
    "\r\n",
    "0",
    "42",
    "3.14",
    "漢字",
    "テスト",
    "😀",
    "👨‍👩‍👧",
    "e\u{301}",
    "'s",
    "don't",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "<think>",
    "{\"k\": [1]}",
    ".",
    ",",
];

fn text_from(picks: &[usize]) -> String {
    let mut s = String::new();
    for (i, p) in picks.iter().enumerate() {
        s.push_str(FRAGMENTS[p % FRAGMENTS.len()]);
        if i % 3 == 0 {
            s.push_str(" and ");
        }
    }
    s
}

const CONTRACTS: [&str; 3] = [
    "vllm@0.33.0:sha256_cbor:block=16:seed=0",
    "vllm@0.33.0:sha256_cbor:block=16:seed=0:lookahead=3",
    "sglang@0.5.23:sha256_page_chain:page=4",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// Parts concatenate to one full encode; keys hashed part by part equal
    /// the one-shot keys of those ids, whatever the block size, the lookahead
    /// and where the parts end inside a block.
    #[test]
    fn parts_and_keys_match_one_full_encode(
        picks in proptest::collection::vec(any::<usize>(), 0..400),
        contract in 0usize..CONTRACTS.len(),
        threads in 2usize..5,
        pieces in 1usize..5,
    ) {
        let text = text_from(&picks);
        let tok = parallel_tok().tokenizer();
        let enc = ParallelEncoder::new(ParallelConfig {
            threads, min_bytes: 0, pieces_per_thread: pieces, window_bytes: 32,
        }).unwrap();
        let mut parts: Vec<Vec<u32>> = Vec::new();
        enc.encode_each(tok, SeamPolicy::for_tokenizer(tok).as_ref(), &text, |ids| {
            parts.push(ids.to_vec());
            Ok::<_, PromptError>(())
        }).unwrap();
        let want = reference(&text);
        prop_assert_eq!(parts.concat(), want.clone());

        let h = hasher(CONTRACTS[contract]);
        parallel_tok().clear_span_cache();
        let (mut ids, mut keys) = (Vec::new(), Vec::new());
        encode_and_hash(parallel_tok(), &text, false, &h, &RequestExtras::NONE, &mut ids, &mut keys)
            .unwrap();
        prop_assert_eq!(&ids, &want);
        prop_assert_eq!(keys, one_shot(&h, &want));
    }
}

/// A long chat-shaped text really arrives in several parts (the proptest
/// would pass vacuously with one), on a fresh and on a span-cached second
/// pass, with the same keys each time and the same as without an encoder.
#[test]
fn long_text_is_hashed_over_many_parts_with_and_without_the_cache() {
    let doc = "The router keeps the prefix of every prompt, and sends it on. ".repeat(1_500);
    let text = format!("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{doc}<|im_end|>\n<|im_start|>assistant\n");
    let h = hasher(CONTRACTS[0]);
    let want = reference(&text);
    let keys_want = one_shot(&h, &want);
    assert!(keys_want.len() > 1_000);
    let tok = parallel_tok();
    tok.clear_span_cache();
    let (mut ids, mut keys) = (Vec::new(), Vec::new());
    let fresh = encode_and_hash(
        tok,
        &text,
        false,
        &h,
        &RequestExtras::NONE,
        &mut ids,
        &mut keys,
    )
    .unwrap();
    // Template segments, then the document's 6 pieces, then the tail segments.
    assert!(fresh >= 6 + 2, "{fresh} parts");
    assert_eq!(ids, want);
    assert_eq!(keys, keys_want);
    let cached = encode_and_hash(
        tok,
        &text,
        false,
        &h,
        &RequestExtras::NONE,
        &mut ids,
        &mut keys,
    )
    .unwrap();
    assert!(cached < fresh, "cache hits arrive whole: {cached} parts");
    assert_eq!(ids, want);
    assert_eq!(keys, keys_want);

    let single = load(None);
    let n = encode_and_hash(
        &single,
        &text,
        false,
        &h,
        &RequestExtras::NONE,
        &mut ids,
        &mut keys,
    )
    .unwrap();
    assert!(n < fresh, "{n} parts without an encoder");
    assert_eq!(keys, keys_want);
    // No span cache at all: the encoder's pieces straight through.
    let mut nocache = ModelTokenizer::load(
        &dir(),
        &ModelOptions {
            span_cache_bytes: 0,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    nocache.set_parallel(Some(Arc::new(
        ParallelEncoder::new(ParallelConfig {
            threads: 2,
            min_bytes: 64,
            ..ParallelConfig::default()
        })
        .unwrap(),
    )));
    let n = encode_and_hash(
        &nocache,
        &text,
        false,
        &h,
        &RequestExtras::NONE,
        &mut ids,
        &mut keys,
    )
    .unwrap();
    assert_eq!(n, 4, "2 threads x 2 pieces");
    assert_eq!(keys, keys_want);
}

/// A sink error ends the pipeline with that error, after the first part.
#[test]
fn a_sink_error_stops_the_pipeline() {
    let text = "The router keeps the prefix of every prompt. ".repeat(500);
    let tok = parallel_tok().tokenizer();
    let enc = ParallelEncoder::new(ParallelConfig {
        threads: 2,
        min_bytes: 0,
        pieces_per_thread: 4,
        window_bytes: 32,
    })
    .unwrap();
    let mut calls = 0;
    let r = enc.encode_each(tok, SeamPolicy::for_tokenizer(tok).as_ref(), &text, |_| {
        calls += 1;
        Err(PromptError::Tokenize("enough".into()))
    });
    assert_eq!(r, Err(PromptError::Tokenize("enough".into())));
    assert_eq!(calls, 1);
    // The same through the span-cached path, and the failed segment is not
    // cached. A tokenizer of its own: the other tests running beside this
    // one use the shared one's cache, and its counters with it.
    let tok = &load(Some(ParallelConfig {
        threads: 3,
        min_bytes: 64,
        pieces_per_thread: 2,
        window_bytes: 64,
    }));
    let misses = tok.span_cache_stats().unwrap().misses;
    let r = tok.encode_each(&text, false, |_| Err(PromptError::NoModel));
    assert_eq!(r, Err(PromptError::NoModel));
    let mut n = 0;
    tok.encode_each(&text, false, |_| {
        n += 1;
        Ok::<_, PromptError>(())
    })
    .unwrap();
    assert!(
        n > 1,
        "tokenized again in pieces, not served whole from the cache"
    );
    assert_eq!(tok.span_cache_stats().unwrap().misses, misses + 2);
}

/// Keys → decision does not allocate: scoring a 128 K-token prompt's 8 192
/// keys against 64 endpoints, one of which holds all of them.
#[test]
fn scoring_a_128k_prompt_allocates_nothing() {
    let index = SharedIndex::new(64, IndexConfig::default());
    let keys: Vec<BlockKey> = (0..8_192u64)
        .map(|i| BlockKey(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1))
        .collect();
    for e in 0..64u32 {
        let other: Vec<BlockKey> = (0..2_000u64)
            .map(|i| BlockKey((u64::from(e) << 40 | i).wrapping_mul(0xD6E8_FEB8_6659_FD93)))
            .collect();
        index.store(EndpointId(e), Medium::Gpu, &other).unwrap();
    }
    index.store(EndpointId(17), Medium::Gpu, &keys).unwrap();
    let mut out = [Overlap::default(); 64];
    index.score_prefix(&keys, &mut out);
    let before = allocations();
    for _ in 0..3 {
        index.score_prefix(&keys, &mut out);
        index.score(&keys, &mut out);
    }
    let after = allocations();
    assert_eq!(after - before, 0, "allocations while scoring");
    assert_eq!(out[17].prefix, 8_192);
    assert!(out
        .iter()
        .enumerate()
        .all(|(e, o)| e == 17 || o.prefix == 0));
}
