//! Linking an object file into a shared object with the system C compiler driver.

use std::process::Command;

use crate::CodegenError;

/// Links `object` (a PIC ELF object) into a shared object and returns its bytes.
/// `--build-id=none` and a fixed file name keep the output byte-reproducible.
pub fn link_shared(object: &[u8]) -> Result<Vec<u8>, CodegenError> {
    let dir = tempfile::tempdir().map_err(|e| CodegenError::Link(format!("temporary directory: {e}")))?;
    let obj = dir.path().join("kernels.o");
    let so = dir.path().join("kernels.so");
    std::fs::write(&obj, object).map_err(|e| CodegenError::Link(format!("writing the object: {e}")))?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-nostartfiles", "-Wl,--build-id=none", "-Wl,-z,noexecstack", "-o"])
        .arg(&so)
        .arg(&obj)
        .arg("-lm")
        .output()
        .map_err(|e| CodegenError::Link(format!("running `{cc}`: {e}; install a C toolchain (gcc)")))?;
    if !out.status.success() {
        return Err(CodegenError::Link(format!("`{cc}` failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    std::fs::read(&so).map_err(|e| CodegenError::Link(format!("reading the shared object: {e}")))
}
