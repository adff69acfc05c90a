//! Replays the committed `engine_metrics` fuzz corpus through the entry point the
//! fuzz target calls (every dialect, with its invariants).

use std::path::Path;

#[test]
fn engine_metrics_corpus() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/engine_metrics");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        kvroute_engines::load_report_fuzzing::engine_metrics(&bytes);
        n += 1;
    }
    // Seeds are committed; fewer means the corpus was not checked in.
    assert!(n >= 12, "engine_metrics: {n} corpus files");
}
