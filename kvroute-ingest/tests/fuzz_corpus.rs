//! Replays every seed of fuzz/corpus/seq_window, fuzz/corpus/rekey_map and
//! fuzz/corpus/index_walk through their fuzz functions.

use std::path::PathBuf;

/// Runs `target` on every file of `fuzz/corpus/<name>` (at least five).
fn replay(name: &str, target: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(name);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        target(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 5, "corpus at {} has {n} files", dir.display());
}

#[test]
fn seq_window_corpus_replays_cleanly() {
    replay("seq_window", kvroute_ingest::fuzzing::seq_window);
}

#[test]
fn rekey_map_corpus_replays_cleanly() {
    replay("rekey_map", kvroute_ingest::fuzzing::rekey_map);
}

#[test]
fn index_walk_corpus_replays_cleanly() {
    replay("index_walk", kvroute_ingest::fuzzing::index_walk);
}
