//! Replays every seed of fuzz/corpus/seq_window and fuzz/corpus/rekey_map
//! through their fuzz functions.

use std::path::PathBuf;

#[test]
fn seq_window_corpus_replays_cleanly() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/seq_window");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        kvroute_ingest::fuzzing::seq_window(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus at {} has {n} files", dir.display());
}

#[test]
fn rekey_map_corpus_replays_cleanly() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/rekey_map");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        kvroute_ingest::fuzzing::rekey_map(&data);
        n += 1;
    }
    assert!(n >= 5, "corpus at {} has {n} files", dir.display());
}
