#![no_main]
//! Differential: kvroute-core's hand-written pickle vs its reference tree pickler.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_core::fuzzing::pickle_encoder(data);
});
