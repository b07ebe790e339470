//! `haltd::fuzz::responses_request` under libFuzzer (see the function for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| haltd::fuzz::responses_request(data));
