//! Replays every seed of fuzz/corpus/seq_window through the fuzz function.

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
