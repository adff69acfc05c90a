//! kvroute's token ids against transformers', the library vLLM 0.33 tokenizes
//! with (`tests/python/transformers_encode.py` calls it as vLLM does).
//!
//! transformers 5 does not take a `tokenizer.json` as it stands: a tokenizer
//! class with its own constructor rebuilds the pipeline from the file's
//! vocabulary and merges, the post-processor is kept, and
//! `tokenizer_config.json` settings apply on top. Each model directory below
//! varies one of the things that decide the ids; each is encoded over a corpus
//! (the Qwen3 chat prompts vLLM rendered for `golden/chat`, and texts with
//! Unicode, whitespace runs, digits, code and special tokens written as text),
//! with and without the tokenizer's special tokens, and twice (the second
//! encode is served by the span cache where it applies).

mod interop_support;

use std::path::{Path, PathBuf};

use interop_support::golden;
use interop_support::transformers::{bos_post_processor, qwen3_tokenizer, run_json};
use kvroute_engines::prompt::{ModelOptions, ModelTokenizer};
use serde_json::{json, Value};

/// A model directory holding `tokenizer` and `config`.
fn model_dir(name: &str, tokenizer: &Value, config: &Value) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

/// The texts every variant encodes.
fn corpus() -> Vec<String> {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(golden("chat/qwen3_cases.json")).unwrap())
            .unwrap();
    let mut texts: Vec<String> = cases["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["rendered_prompt"].as_str().map(str::to_owned))
        .collect();
    assert!(texts.len() >= 10, "golden chat cases lost their prompts");
    texts.extend(
        [
            "hello World",
            " leading space and trailing space ",
            "tabs\tand\n\nnewlines\r\n  indented\n\n\n",
            "many     spaces    between   words",
            "digits 1234567890 and 3.14159 and 1,000,000",
            "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
            "Größe, façade, naïve, Ångström, ﬁne",
            // Decomposed accents: NFC composes them (the normalizer matters).
            "cafe\u{301} and n\u{303}",
            "中文文本，日本語のテキスト、한국어 텍스트",
            "emoji 👩‍👩‍👧‍👦 🇺🇳 ✨ and math ∑∫√",
            "العربية עברית",
            "special tokens as text: <|im_start|>user\nhi<|im_end|> <|endoftext|>",
            "<|im_start|><|im_end|><|im_start|>",
            "almost special <|im_start and <im_end|> and <|endoftext",
            "",
            " ",
            "\n",
        ]
        .map(str::to_owned),
    );
    texts.push("the quick brown fox jumps over the lazy dog. ".repeat(300));
    texts
}

/// transformers' ids for each case, in order.
fn transformers_ids(dir: &Path, cases: &[Value]) -> Vec<Vec<u32>> {
    let out = run_json(
        "transformers_encode.py",
        &[dir.as_os_str()],
        &Value::from(cases.to_vec()),
    );
    serde_json::from_value(out).unwrap()
}

/// Encodes the corpus with kvroute and with transformers and compares;
/// returns how many cases the special tokens changed (for the variants that
/// must add some).
fn compare(name: &str, tokenizer: &Value, config: &Value) -> usize {
    let dir = model_dir(name, tokenizer, config);
    let texts = corpus();
    let cases: Vec<Value> = [false, true]
        .iter()
        .flat_map(|&add| {
            texts
                .iter()
                .map(move |t| json!({"text": t, "add_special_tokens": add, "max_length": null}))
        })
        .collect();
    let expected = transformers_ids(&dir, &cases);
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
    let mut with_specials = 0;
    for (case, want) in cases.iter().zip(&expected) {
        let (text, add) = (
            case["text"].as_str().unwrap(),
            case["add_special_tokens"].as_bool().unwrap(),
        );
        for pass in ["first", "second"] {
            let got = tok.encode(text, add).unwrap();
            assert_eq!(
                &got,
                want,
                "{name}: {pass} encode of {:?} (add_special_tokens {add})",
                &text[..text.len().min(80)]
            );
        }
        if add && tok.encode(text, false).unwrap() != *want {
            with_specials += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    with_specials
}

#[test]
fn qwen3_as_staged() {
    let (tokenizer, config) = qwen3_tokenizer();
    assert_eq!(compare("qwen3", &tokenizer, &config), 0);
}

/// Llama 3's shape: the post-processor puts BOS first, the config has no
/// `add_bos_token`, the class is the generic fast tokenizer.
#[test]
fn a_post_processor_that_adds_bos() {
    let (mut tokenizer, mut config) = qwen3_tokenizer();
    tokenizer["post_processor"] = bos_post_processor();
    let c = config.as_object_mut().unwrap();
    c.remove("add_bos_token");
    c.insert("bos_token".into(), json!("<|endoftext|>"));
    c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    // Every case with special tokens starts with the BOS.
    assert_eq!(
        compare("bos", &tokenizer, &config),
        corpus().len(),
        "the BOS was not added"
    );
}

/// `add_eos_token` in the config does not change a loaded post-processor
/// (transformers rebuilds it only when the tokenizer has none).
#[test]
fn add_eos_token_in_the_config_leaves_the_post_processor() {
    let (tokenizer, mut config) = qwen3_tokenizer();
    config["add_eos_token"] = json!(true);
    assert_eq!(compare("eos", &tokenizer, &config), 0);
}

/// `split_special_tokens`: special tokens written in the text are encoded as
/// text (transformers sets the backend's `encode_special_tokens` from it).
#[test]
fn split_special_tokens_encodes_them_as_text() {
    let (tokenizer, mut config) = qwen3_tokenizer();
    config["split_special_tokens"] = json!(true);
    compare("split", &tokenizer, &config);
    // And it does change ids: the chat prompts' markers are split.
    let dir = model_dir("split-check", &tokenizer, &config);
    let tok = ModelTokenizer::load(&dir, &ModelOptions::default()).unwrap();
    let ids = tok.encode("<|im_start|>user", false).unwrap();
    assert!(!ids.contains(&151_644), "{ids:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
