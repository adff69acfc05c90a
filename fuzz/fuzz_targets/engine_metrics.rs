#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_engines::load_report_fuzzing::engine_metrics(data);
});
