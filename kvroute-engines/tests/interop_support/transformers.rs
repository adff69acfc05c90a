//! The pieces the tests that compare kvroute with transformers (the library
//! vLLM tokenizes and renders with) share: the staged Qwen3 files as JSON, a
//! BOS-adding post-processor, and running one of the `tests/python`
//! scripts on a JSON job.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use super::{golden, python, script};

/// `<|endoftext|>`, the id the BOS-adding post-processor puts first.
pub const BOS: u32 = 151_643;

/// The staged Qwen3 `tokenizer.json` and `tokenizer_config.json`.
pub fn qwen3_tokenizer() -> (Value, Value) {
    let src = golden("tokenizers/qwen3");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(src.join("tokenizer.json.gz")).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let config = std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap();
    (
        serde_json::from_str(&text).unwrap(),
        serde_json::from_str(&config).unwrap(),
    )
}

/// A post-processor that puts [`BOS`] first, as Llama 3's puts its BOS.
pub fn bos_post_processor() -> Value {
    json!({
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}}
        ],
        "pair": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS], "tokens": ["<|endoftext|>"]}
        }
    })
}

/// Runs `tests/python/<name>` with `args` in the test venv, `input` as JSON
/// on its standard input; its standard output, as JSON.
pub fn run_json(name: &str, args: &[&OsStr], input: &Value) -> Value {
    let mut child = Command::new(python())
        .arg(script(name))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{name} failed (is transformers in the venv? run scripts/python-env.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
