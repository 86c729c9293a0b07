//! Fuzzes the artifact reader: prelude, header decoding, section table and all checks.
//!
//! Inputs starting with byte 0 are taken as a whole file. Others are taken as a
//! header body and wrapped in a valid prelude with the right checksum, so the
//! fuzzer explores the header decoder and validation instead of the checksum.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maxrun_runtime::format::{checksum, FORMAT_MAJOR, FORMAT_MINOR, MAGIC};

fuzz_target!(|data: &[u8]| {
    let bytes = match data.split_first() {
        Some((0, rest)) => rest.to_vec(),
        Some((_, body)) => {
            let mut v = Vec::with_capacity(32 + body.len() + 8192);
            v.extend(MAGIC);
            v.extend(FORMAT_MAJOR.to_le_bytes());
            v.extend(FORMAT_MINOR.to_le_bytes());
            v.extend((body.len() as u64).to_le_bytes());
            v.extend(checksum(body).to_le_bytes());
            v.extend(body);
            v.resize(v.len() + 8192, 0);
            v
        }
        None => return,
    };
    if let Ok(a) = maxrun_runtime::artifact::Artifact::from_bytes(std::path::Path::new("fuzz.mef"), bytes) {
        let _ = a.verify_weights(&mut |_, _| {});
        let _ = maxrun_runtime::inspect::report(&a);
        for i in 0..a.header.weights.len() {
            let _ = a.weight_bytes(i);
        }
    }
});
