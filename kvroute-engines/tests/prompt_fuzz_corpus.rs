//! Replays the committed cargo-fuzz corpora of `openai_request`,
//! `chat_template` and `byte_bpe` through the same functions the fuzz
//! targets call.

use std::path::PathBuf;

use kvroute_engines::prompt::fuzzing::{byte_bpe, chat_template, openai_request};

fn corpus(name: &str) -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(name);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

#[test]
fn openai_request_corpus_replays() {
    let files = corpus("openai_request");
    assert!(files.len() >= 10);
    for (name, data) in files {
        let rendered = openai_request(&data);
        // Valid chat bodies render; invalid JSON, rule violations and text do not.
        let expect_render = name.starts_with("chat_") || name == "numbers.json";
        assert_eq!(
            rendered > 0,
            expect_render,
            "{name}: rendered {rendered} bytes"
        );
    }
}

#[test]
fn chat_template_corpus_replays() {
    let files = corpus("chat_template");
    assert!(files.len() >= 5);
    let rendered: usize = files
        .iter()
        .map(|(_, d)| chat_template(d))
        .filter(|&n| n > 0)
        .count();
    // The empty seed has no messages (template error); the others render.
    assert_eq!(rendered, files.len() - 1);
}

/// Every seed through kvroute's encode and `tokenizers`' own (the entry
/// point panics on a difference); each has ids.
#[test]
fn byte_bpe_corpus_replays() {
    let files = corpus("byte_bpe");
    assert!(files.len() >= 10);
    for (name, data) in files {
        assert!(byte_bpe(&data) > 0, "{name}: no ids");
    }
}
