//! Loading the code section: the shared object is written to an anonymous memfd
//! and opened with `dlopen("/proc/self/fd/N")`, so no file is left on disk.
//! Kernel symbols are resolved once, at load.

use std::ffi::CString;

/// The CPU kernel ABI (see the kernel IR docs).
pub type KernelFn = unsafe extern "C" fn(args: *const *mut u8, dims: *const i64, task_begin: u64, task_end: u64);

/// Errors while loading code.
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    #[error("cannot create an in-memory file for the code: {0}")]
    Memfd(std::io::Error),
    #[error("the dynamic loader refused the code section: {0}")]
    Dlopen(String),
    #[error("kernel `{0}` is listed in the header but missing from the code section; the artifact is corrupt")]
    MissingSymbol(String),
}

/// A loaded shared object; unloaded on drop.
pub struct LoadedCode {
    handle: *mut libc::c_void,
    /// The memfd stays open while the code is loaded: the dynamic loader identifies
    /// libraries by path, and a reused `/proc/self/fd/N` would otherwise make a
    /// second artifact's dlopen return the first one's library.
    _memfd: std::fs::File,
}

// SAFETY: the handle is only used for dlsym/dlclose, which are thread-safe.
unsafe impl Send for LoadedCode {}
unsafe impl Sync for LoadedCode {}

impl std::fmt::Debug for LoadedCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadedCode")
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null dlerror results are NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl LoadedCode {
    /// Loads a shared object from memory.
    pub fn load(shared_object: &[u8]) -> Result<Self, CodeError> {
        use std::io::Write;
        use std::os::fd::{AsRawFd, FromRawFd};
        let name = CString::new("maxc-kernels").unwrap();
        // SAFETY: memfd_create with a valid name; the fd is owned by `file` below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(CodeError::Memfd(std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a fresh, owned descriptor.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(shared_object).map_err(CodeError::Memfd)?;
        let path = CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
        // SAFETY: dlopen of a complete ELF shared object; its constructors are none of ours.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(CodeError::Dlopen(dlerror()));
        }
        Ok(LoadedCode { handle, _memfd: file })
    }

    /// Resolves a kernel symbol.
    pub fn kernel(&self, symbol: &str) -> Result<KernelFn, CodeError> {
        let name = CString::new(symbol).map_err(|_| CodeError::MissingSymbol(symbol.into()))?;
        // SAFETY: valid handle and NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        if p.is_null() {
            return Err(CodeError::MissingSymbol(symbol.into()));
        }
        // SAFETY: every exported kernel has the KernelFn ABI (the compiler emits it so).
        Ok(unsafe { std::mem::transmute::<*mut libc::c_void, KernelFn>(p) })
    }
}

impl Drop for LoadedCode {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and no kernel runs after drop.
        unsafe { libc::dlclose(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two different shared objects loaded one after the other, the first dropped in
    /// between (so its fd number is free again), must each resolve their own symbols.
    #[test]
    fn successive_loads_do_not_alias() {
        let dir = std::env::temp_dir().join(format!("maxrun-code-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let build = |name: &str, body: &str| -> Vec<u8> {
            let c = dir.join(format!("{name}.c"));
            let so = dir.join(format!("{name}.so"));
            std::fs::write(&c, body).unwrap();
            let ok = std::process::Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&c).status().unwrap().success();
            assert!(ok, "cc failed");
            std::fs::read(&so).unwrap()
        };
        let a = build("a", "int only_in_a(void) { return 1; }");
        let b = build("b", "int only_in_b(void) { return 2; }");
        let first = LoadedCode::load(&a).unwrap();
        assert!(first.kernel("only_in_a").is_ok());
        drop(first);
        let held = LoadedCode::load(&a).unwrap();
        let second = LoadedCode::load(&b).unwrap();
        assert!(second.kernel("only_in_b").is_ok(), "the second load must not return the first library");
        assert!(second.kernel("only_in_a").is_err());
        assert!(held.kernel("only_in_a").is_ok());
    }
}
