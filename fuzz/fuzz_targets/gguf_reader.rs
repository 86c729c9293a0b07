//! Fuzzes the GGUF reader: header, metadata values, tensor table and data bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = maxc::import::gguf::GgufFile::parse(std::path::Path::new("fuzz.gguf"), data);
});
