//! Replays the committed `select_ladder` and `outlier` fuzz corpora through
//! the fuzzed functions.

#[test]
fn select_ladder_corpus_replays() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/select_ladder");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        kvroute_select::fuzzing::select_ladder(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 5, "corpus has {n} files");
}

#[test]
fn outlier_corpus_replays() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/outlier");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).expect("corpus dir") {
        let path = entry.unwrap().path();
        kvroute_select::fuzzing::outlier(&std::fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n >= 5, "corpus has {n} files");
}
