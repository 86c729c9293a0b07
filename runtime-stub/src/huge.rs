//! Zeroed, writable memory backed by transparent huge pages where the kernel
//! offers them (Linux `madvise(MADV_HUGEPAGE)`; elsewhere ordinary pages).
//!
//! Decode streams every weight once per token: with 4 KiB pages that is a TLB
//! miss every 4 KiB (and the hardware prefetchers stop at every page boundary).
//! `maxrun --huge-pages` reads the artifact into such a buffer (`Artifact::open_resident`).
//! The CPU KV cache lives in such buffers too where it is small beside the
//! machine's memory (`kv_cache.rs` says when and why).

/// The huge page size the buffers are aligned to.
const HUGE_PAGE: usize = 2 << 20;

/// A zeroed buffer of `len` bytes, 2 MiB aligned, on huge pages where possible.
pub struct HugeBuf {
    ptr: *mut u8,
    /// The mapped length (a whole number of huge pages), 0 for an empty buffer.
    mapped: usize,
    len: usize,
}

// SAFETY: the buffer is owned memory like a `Vec<u8>`; sharing follows `&` / `&mut`.
unsafe impl Send for HugeBuf {}
unsafe impl Sync for HugeBuf {}

impl HugeBuf {
    /// Allocates `len` zeroed bytes on huge pages where possible; `None` if the
    /// system has no memory for them.
    pub fn zeroed(len: usize) -> Option<Self> {
        Self::zeroed_on(len, true)
    }

    /// Allocates `len` zeroed bytes, 2 MiB aligned, asking for huge pages only with
    /// `huge_pages` (otherwise ordinary pages, each faulted in on first touch).
    pub fn zeroed_on(len: usize, huge_pages: bool) -> Option<Self> {
        if len == 0 {
            return Some(HugeBuf { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, mapped: 0, len });
        }
        let mapped = len.checked_add(HUGE_PAGE - 1)? / HUGE_PAGE * HUGE_PAGE;
        // Over-map by one huge page so the start can be moved to a 2 MiB boundary.
        let over = mapped.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe { libc::mmap(std::ptr::null_mut(), over, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as *mut u8;
        let skew = raw.align_offset(HUGE_PAGE);
        // SAFETY: both trims lie inside the mapping made above.
        unsafe {
            if skew > 0 {
                libc::munmap(raw as *mut libc::c_void, skew);
            }
            // The tail past the aligned buffer (never empty: `skew < HUGE_PAGE`).
            libc::munmap(raw.add(skew + mapped) as *mut libc::c_void, HUGE_PAGE - skew);
        }
        // SAFETY: `skew < HUGE_PAGE`, inside the mapping.
        let ptr = unsafe { raw.add(skew) };
        #[cfg(target_os = "linux")]
        if huge_pages {
            // SAFETY: advice on our own mapping; failure (no THP) leaves ordinary pages.
            unsafe {
                libc::madvise(ptr as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = huge_pages;
        Some(HugeBuf { ptr, mapped, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of our mapping (or a dangling pointer for 0 bytes).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        if self.mapped > 0 {
            // SAFETY: unmaps exactly what `zeroed` kept mapped.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.mapped) };
        }
    }
}

/// The memory the system reports available (`MemAvailable` of /proc/meminfo),
/// `None` where it does not say.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_writable() {
        for (len, huge_pages) in [0, 1, 4096, HUGE_PAGE - 1, HUGE_PAGE, HUGE_PAGE + 3].into_iter().flat_map(|l| [(l, true), (l, false)]) {
            let mut b = HugeBuf::zeroed_on(len, huge_pages).unwrap();
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0), "{len}");
            if len > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0, "{len}");
                b.as_mut_slice()[len - 1] = 7;
                assert_eq!(b.as_slice()[len - 1], 7);
            }
        }
    }
}
