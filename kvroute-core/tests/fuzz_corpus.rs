//! Replays the committed fuzz corpora through the fuzz entry points.

use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        run(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 5, "{target}: only {n} corpus files");
}

#[test]
fn cbor_encoder_corpus() {
    replay("cbor_encoder", kvroute_core::fuzzing::cbor_encoder);
}

#[test]
fn pickle_encoder_corpus() {
    replay("pickle_encoder", kvroute_core::fuzzing::pickle_encoder);
}

#[test]
fn corpus_seed_reproduces_golden_hash_input() {
    // The lora_salt seed decodes to the exact block of the golden pickle case.
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus/pickle_encoder/pickle_lora_salt"),
    )
    .unwrap();
    let block = kvroute_core::fuzzing::FuzzBlock::from_bytes(&data);
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/vllm/hash_vectors_v0.33.0.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let case = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "sha256-bs16-seed0-lora_salt")
        .unwrap();
    let want = case["blocks"][0]["hash_input_hex"].as_str().unwrap();
    let got: String = block
        .encode_pickle()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, want);
}
