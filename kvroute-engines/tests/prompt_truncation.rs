//! `truncate_prompt_tokens` on a tokenizer that adds a BOS, against
//! transformers loaded and called as vLLM loads and calls it
//! (`tests/python/transformers_encode.py`).
//!
//! vLLM truncates inside the tokenizer when the request names no
//! `truncation_side` (`renderers/params.py`, `get_encode_kwargs`: truncation
//! on, `max_length` N, its generation tokenizers cutting from the left): the
//! text's own tokens are cut to fit beside the BOS, which stays. With a side
//! named it encodes in full and slices the ids, BOS included. The Qwen3
//! tokenizer adds no BOS, so the test gives a copy of it a BOS-adding
//! post-processor (as Llama 3's has).

mod interop_support;

use std::path::Path;

use interop_support::transformers::{bos_post_processor, qwen3_tokenizer, run_json, BOS};
use kvroute_engines::prompt::{parse_json, prompt_tokens, ApiKind, ModelOptions, ModelTokenizer};

/// A copy of the Qwen3 tokenizer whose post-processor puts BOS first.
fn bos_tokenizer(dir: &Path) {
    let (mut tokenizer, config) = qwen3_tokenizer();
    tokenizer["post_processor"] = bos_post_processor();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// The ids vLLM's tokenizer gives `text` (transformers, loaded and called as
/// vLLM does: `tests/python/transformers_encode.py`), truncated to
/// `max_length` when given.
fn hf_ids(dir: &Path, text: &str, max_length: Option<usize>) -> Vec<u32> {
    let cases = serde_json::json!([
        {"text": text, "add_special_tokens": true, "max_length": max_length}
    ]);
    let out = run_json("transformers_encode.py", &[dir.as_os_str()], &cases);
    serde_json::from_value(out[0].clone()).unwrap()
}

fn ids(tok: &ModelTokenizer, body: serde_json::Value) -> Vec<u32> {
    let body = parse_json(body.to_string().as_bytes()).unwrap();
    let p = prompt_tokens(tok, ApiKind::Completions, &body).unwrap();
    p.engine_prompts[0].token_ids.clone()
}

#[test]
fn truncation_keeps_the_bos_the_tokenizer_adds_unless_a_side_is_named() {
    let dir = std::env::temp_dir().join(format!("kvroute-bos-{}", std::process::id()));
    bos_tokenizer(&dir);
    let tok = ModelTokenizer::load(
        &dir,
        &ModelOptions {
            max_model_len: Some(40),
            ..ModelOptions::default()
        },
    )
    .unwrap();
    assert_eq!(tok.added_special_tokens(), (1, 0));
    let text: String = (0..60).map(|i| format!("word{i} ")).collect();
    let full = hf_ids(&dir, &text, None);
    assert_eq!(full[0], BOS);
    assert!(full.len() > 60);

    // No side: as the tokenizer truncates, BOS kept.
    let cut = hf_ids(&dir, &text, Some(16));
    assert_eq!((cut.len(), cut[0]), (16, BOS));
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": 16});
    assert_eq!(ids(&tok, body), cut);
    // -1: max_model_len less one, the same way.
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": -1});
    assert_eq!(ids(&tok, body), hf_ids(&dir, &text, Some(39)));
    // `max_tokens: 0` leaves no room to hold back; `max_completion_tokens`
    // is not a completions field, so it changes nothing.
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": -1,
        "max_tokens": 0});
    assert_eq!(ids(&tok, body), hf_ids(&dir, &text, Some(40)));
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": -1,
        "max_completion_tokens": 0});
    assert_eq!(ids(&tok, body), hf_ids(&dir, &text, Some(39)));
    // Room for the BOS alone: the BOS alone, as the tokenizer cuts.
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": 1});
    assert_eq!(ids(&tok, body), hf_ids(&dir, &text, Some(1)));
    // No room even for it: the tokenizer's bound less its BOS wraps, it does
    // not cut, and vLLM slices the ids to nothing, which it refuses.
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": 0});
    let parsed = parse_json(body.to_string().as_bytes()).unwrap();
    assert!(prompt_tokens(&tok, ApiKind::Completions, &parsed).is_err());
    // Longer than the context: the engine refuses it.
    let body = serde_json::json!({"model": "m", "prompt": "short", "truncate_prompt_tokens": 41});
    let parsed = parse_json(body.to_string().as_bytes()).unwrap();
    let err = prompt_tokens(&tok, ApiKind::Completions, &parsed).unwrap_err();
    assert!(err.is_request_error(), "{err}");
    // A side named: the full ids sliced, BOS cut with the rest.
    let body = serde_json::json!({"model": "m", "prompt": text, "truncate_prompt_tokens": 16,
        "truncation_side": "left"});
    assert_eq!(ids(&tok, body), full[full.len() - 16..].to_vec());
    // Ids given: sliced, nothing added.
    let body = serde_json::json!({"model": "m", "prompt": full, "truncate_prompt_tokens": 16});
    assert_eq!(ids(&tok, body), full[full.len() - 16..].to_vec());
    let _ = std::fs::remove_dir_all(&dir);
}
