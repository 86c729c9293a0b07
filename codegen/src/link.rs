//! Linking an object file into a shared object with a C compiler driver: the
//! system's `cc` (or `$CC`) for this machine's architecture, the cross driver
//! (`aarch64-linux-gnu-gcc`, or `$CC_aarch64_unknown_linux_gnu` as the `cc` crate
//! spells it) for another one.

use std::process::Command;

use crate::CodegenError;

/// Links `object` (a PIC ELF object for this machine) into a shared object and
/// returns its bytes. `--build-id=none` and a fixed file name keep the output
/// byte-reproducible.
pub fn link_shared(object: &[u8]) -> Result<Vec<u8>, CodegenError> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    link_with(object, &cc, "install a C toolchain (gcc)")
}

/// Links `object`, a PIC ELF object for `triple` (`x86_64-unknown-linux-gnu`,
/// `aarch64-unknown-linux-gnu`), into a shared object: with the system's driver
/// when `triple` is this machine's architecture, else with the cross driver
/// for it (Debian's `gcc-aarch64-linux-gnu`, which scripts/setup.sh installs).
pub fn link_shared_for(object: &[u8], triple: &str) -> Result<Vec<u8>, CodegenError> {
    let arch = triple.split('-').next().unwrap_or_default();
    if arch == std::env::consts::ARCH {
        return link_shared(object);
    }
    let cc = std::env::var(format!("CC_{}", triple.replace('-', "_"))).unwrap_or_else(|_| format!("{arch}-linux-gnu-gcc"));
    let hint = format!("linking code for {triple} on this {} machine needs its cross C compiler: install gcc-{arch}-linux-gnu (scripts/setup.sh does on Debian) or set CC_{}", std::env::consts::ARCH, triple.replace('-', "_"));
    link_with(object, &cc, &hint)
}

fn link_with(object: &[u8], cc: &str, hint: &str) -> Result<Vec<u8>, CodegenError> {
    let dir = tempfile::tempdir().map_err(|e| CodegenError::Link(format!("temporary directory: {e}")))?;
    let obj = dir.path().join("kernels.o");
    let so = dir.path().join("kernels.so");
    std::fs::write(&obj, object).map_err(|e| CodegenError::Link(format!("writing the object: {e}")))?;
    let out = Command::new(cc)
        .args(["-shared", "-nostartfiles", "-Wl,--build-id=none", "-Wl,-z,noexecstack", "-o"])
        .arg(&so)
        .arg(&obj)
        .arg("-lm")
        .output()
        .map_err(|e| CodegenError::Link(format!("running `{cc}`: {e}; {hint}")))?;
    if !out.status.success() {
        return Err(CodegenError::Link(format!("`{cc}` failed: {}", String::from_utf8_lossy(&out.stderr))));
    }
    std::fs::read(&so).map_err(|e| CodegenError::Link(format!("reading the shared object: {e}")))
}
