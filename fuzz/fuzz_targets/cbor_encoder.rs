#![no_main]
//! Differential: kvroute-core's hand-written canonical CBOR vs ciborium.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvroute_core::fuzzing::cbor_encoder(data);
});
