//! Replays the committed `select_ladder`, `outlier` and `replica_sync` fuzz
//! corpora through the fuzzed functions.

/// Runs every file of `fuzz/corpus/{target}` through `fuzzed`; a corpus of
/// fewer than five files is a packaging error, not a pass.
fn replay(target: &str, fuzzed: fn(&[u8])) {
    let dir = format!("{}/../fuzz/corpus/{target}", env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        fuzzed(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 5, "{dir} has {n} files");
}

#[test]
fn select_ladder_corpus_replays() {
    replay("select_ladder", kvroute_select::fuzzing::select_ladder);
}

#[test]
fn outlier_corpus_replays() {
    replay("outlier", kvroute_select::fuzzing::outlier);
}

#[test]
fn replica_sync_corpus_replays() {
    replay("replica_sync", kvroute_select::fuzzing::replica_sync);
}
