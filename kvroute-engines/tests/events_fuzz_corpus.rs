//! Replays the committed fuzz corpora of the event decoders through the same entry
//! points the fuzz targets call.

use std::path::Path;

fn replay(target: &str, run: fn(&[u8]), expected_files: usize) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        run(&bytes);
        n += 1;
    }
    // Seeds are committed; a missing one means the corpus was not checked in.
    assert!(n >= expected_files, "{target}: {n} corpus files");
}

#[test]
fn vllm_events_corpus() {
    replay(
        "vllm_events",
        kvroute_engines::events::fuzzing::vllm_events,
        9,
    );
}

#[test]
fn sglang_events_corpus() {
    replay(
        "sglang_events",
        kvroute_engines::events::fuzzing::sglang_events,
        7,
    );
}

#[test]
fn trtllm_events_corpus() {
    replay(
        "trtllm_events",
        kvroute_engines::events::fuzzing::trtllm_events,
        6,
    );
}
