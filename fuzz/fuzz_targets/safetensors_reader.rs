//! Fuzzes the safetensors reader: header JSON, dtypes, shapes and data ranges.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = maxc::import::safetensors::parse(std::path::Path::new("fuzz.safetensors"), data);
});
