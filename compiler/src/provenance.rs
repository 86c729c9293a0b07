//! Provenance: input file hashes and the time-free build id recorded in every artifact.

use std::io::Read;
use std::path::{Path, PathBuf};

use maxc_format::{ChecksumState, InputFile, Provenance};

use crate::error::{Error, Result};

/// The git revision maxc was built from (`-dirty` when the checkout had changes).
pub const GIT_REVISION: &str = env!("MAXC_GIT_REVISION");

/// Size and xxh3-64 of an input file, streamed.
pub fn hash_file(path: &Path) -> Result<InputFile> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut state = ChecksumState::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        state.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(InputFile { path: path.display().to_string(), bytes, xxh3: state.digest() })
}

/// xxh3-128 over every provenance field except the id itself.
pub fn build_id(p: &Provenance) -> String {
    let mut p = p.clone();
    p.build_id.clear();
    let bytes = bincode::serde::encode_to_vec(&p, maxc_format::bincode_config()).expect("provenance encodes");
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes))
}

/// The provenance of a compile, build id included: maxc's version and git
/// revision, the target as written, the manifest text (after overrides and
/// flags), the provenance flags and the hash of every input file. The compile
/// cache (`cache::Key`) computes it before compiling from the same values that
/// `driver::build_header` records, so a cache key's build id is the build id
/// of the artifact it names (`tests/tests/ci.rs` checks that they agree).
pub fn provenance(manifest_text: &str, target_spec: &str, flags: &[String], input_files: &[PathBuf]) -> Result<Provenance> {
    let mut provenance = Provenance {
        maxc_version: env!("CARGO_PKG_VERSION").into(),
        maxc_git_revision: GIT_REVISION.into(),
        target_spec: target_spec.into(),
        build_id: String::new(),
        manifest: manifest_text.into(),
        flags: flags.to_vec(),
        inputs: input_files.iter().map(|p| hash_file(p)).collect::<Result<_>>()?,
    };
    provenance.build_id = build_id(&provenance);
    Ok(provenance)
}
