//! The compile's own memory, for its phase table: the peak resident set
//! (`VmHWM`, which counts the mapped checkpoint's pages too) and the peak
//! anonymous memory of each phase (what the compile itself allocates: the
//! memory a machine must have), sampled from `/proc/self/status` by a
//! background thread, since the kernel keeps no high-water mark of
//! anonymous memory alone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the sampler reads the anonymous resident size.
const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// A field of `/proc/self/status` in bytes (its values are in kB); `None`
/// where /proc is unavailable.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    Some(line[field.len()..].split_whitespace().next()?.parse::<u64>().ok()? * 1024)
}

/// The process's peak resident set size (VmHWM), 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:").unwrap_or(0)
}

/// The process's anonymous resident memory now (RssAnon), 0 where /proc is unavailable.
pub fn anon_bytes() -> u64 {
    status_bytes("RssAnon:").unwrap_or(0)
}

/// Samples the anonymous resident size every [`SAMPLE_EVERY`] while it lives.
pub struct AnonPeak {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AnonPeak {
    pub fn start() -> Self {
        let peak = Arc::new(AtomicU64::new(anon_bytes()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peak, stop) = (peak.clone(), stop.clone());
            std::thread::Builder::new()
                .name("maxc-anon-peak".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        peak.fetch_max(anon_bytes(), Ordering::Relaxed);
                        std::thread::sleep(SAMPLE_EVERY);
                    }
                })
                .ok()
        };
        AnonPeak { peak, stop, thread }
    }

    /// The largest anonymous resident size seen since the previous call (or
    /// since the start), in bytes; the next phase starts from what is resident now.
    pub fn phase_peak(&self) -> u64 {
        let now = anon_bytes();
        self.peak.swap(now, Ordering::Relaxed).max(now)
    }
}

impl Drop for AnonPeak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer touched and freed within a phase shows up in its peak.
    #[test]
    fn a_phase_peak_sees_memory_freed_before_it_ends() {
        if anon_bytes() == 0 {
            return; // no /proc
        }
        let sampler = AnonPeak::start();
        let _ = sampler.phase_peak();
        let before = anon_bytes();
        let size = 256 << 20;
        let buffer = vec![1u8; size];
        std::thread::sleep(SAMPLE_EVERY * 10);
        std::hint::black_box(&buffer);
        drop(buffer);
        let peak = sampler.phase_peak();
        assert!(peak >= before + size as u64 * 9 / 10, "peak {peak} after {before} + {size}");
    }
}
