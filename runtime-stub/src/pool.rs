//! A persistent thread pool for kernel launches: workers spin briefly, then park.
//! Each launch splits its task range into one contiguous share per thread; a
//! thread takes chunks of its own share from a counter only it touches (no cache
//! line moves between cores per chunk, and each thread streams one contiguous part
//! of the weights), then takes chunks from the other shares (so threads that finish
//! early take more work: causal attention rows grow with position). One barrier
//! ends the launch. Launches with a single task run on the calling thread.
//!
//! Between launches (and during the single-task ones, which leave the workers
//! idle) a worker prefetches the start of its own share of the weights the next
//! launches will read, as [`ThreadPool::prefetch_ahead`] names them, so that
//! memory bandwidth the idle core would leave unused goes to the next GEMV.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::code::KernelFn;

#[derive(Copy, Clone)]
struct Job {
    kernel: Option<KernelFn>,
    args: *const *mut u8,
    dims: *const i64,
}

/// One thread's share of a launch: the next task not yet handed out and the end,
/// on a cache line of its own.
#[repr(align(128))]
struct Share {
    next: AtomicU64,
    end: AtomicU64,
}

struct Shared {
    job: UnsafeCell<Job>,
    /// Per thread (the caller is 0): its share of the current launch's tasks.
    shares: Vec<Share>,
    /// Tasks per hand-out.
    chunk: AtomicU64,
    generation: AtomicU64,
    remaining: AtomicUsize,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    threads: usize,
    /// The weights the next launches will read, for idle workers to prefetch:
    /// up to [`AHEAD_PARTS`] (address, length) pairs, and a sequence number that
    /// changes with them.
    ahead: [(AtomicUsize, AtomicUsize); AHEAD_PARTS],
    ahead_seq: AtomicU64,
}

/// How many separate memory ranges a prefetch hint may name (a quantized
/// weight's parts: levels, scales, minimums).
pub const AHEAD_PARTS: usize = 4;

/// Bytes a worker prefetches per hint: half of this machine's 1 MiB L2.
/// Measured on SmolLM2 q4_1+int8 decode, two threads, turn about with and
/// without in one process: 128 KiB +5%, 256 KiB +6%, 512 KiB +3 to +10% (mean
/// +4.5% over five runs), 1 MiB +2%; q8_0+int8 +2% (docs/performance.md).
const AHEAD_BYTES: usize = 512 << 10;

/// Bytes prefetched between two looks at the job generation.
const PREFETCH_STEP: usize = 4096;

// SAFETY: `job` is written only by the launching thread while no worker reads it
// (between barriers), and read by workers only after they observe the new generation.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// The pool. `threads` counts the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({})", self.shared.threads)
    }
}

const SPINS: u32 = 20_000;

/// Chunks per thread's share: small enough that other threads can take over the
/// end of a slow share (uneven tasks), large enough that a share's counter is
/// touched rarely.
const CHUNKS_PER_THREAD: u64 = 8;

/// Runs chunks of thread `me`'s share of the current job, then of the others'
/// shares, until none are left.
///
/// # Safety
/// The job's pointers must satisfy the kernel's ABI for every task.
unsafe fn drain(s: &Shared, job: &Job, me: usize) {
    let kernel = job.kernel.expect("a published job has a kernel");
    let chunk = s.chunk.load(Ordering::Relaxed);
    let n = s.shares.len();
    for share in (0..n).map(|k| &s.shares[(me + k) % n]) {
        let end = share.end.load(Ordering::Relaxed);
        loop {
            let b = share.next.fetch_add(chunk, Ordering::Relaxed);
            if b >= end {
                break;
            }
            // SAFETY: forwarded from the caller.
            unsafe { kernel(job.args, job.dims, b, (b + chunk).min(end)) };
        }
    }
}

impl ThreadPool {
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(Job { kernel: None, args: std::ptr::null(), dims: std::ptr::null() }),
            shares: (0..threads).map(|_| Share { next: AtomicU64::new(0), end: AtomicU64::new(0) }).collect(),
            chunk: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            remaining: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            threads,
            ahead: std::array::from_fn(|_| (AtomicUsize::new(0), AtomicUsize::new(0))),
            ahead_seq: AtomicU64::new(0),
        });
        let workers = (1..threads)
            .map(|index| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("maxrun-{index}")).spawn(move || worker(s, index)).expect("spawn a worker")
            })
            .collect();
        ThreadPool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Names the memory the next launches will read (the next GEMV's weight
    /// parts, as (address, length)): each idle worker prefetches the start of its
    /// own share of every part, [`AHEAD_BYTES`] in all, split between the parts
    /// by size. A hint: prefetching never faults, so the ranges need not stay valid.
    pub fn prefetch_ahead(&self, parts: &[(usize, usize)]) {
        let s = &*self.shared;
        if s.threads == 1 {
            return;
        }
        for (k, slot) in s.ahead.iter().enumerate() {
            let (start, len) = parts.get(k).copied().unwrap_or((0, 0));
            slot.0.store(start, Ordering::Relaxed);
            slot.1.store(len, Ordering::Relaxed);
        }
        s.ahead_seq.fetch_add(1, Ordering::Release);
    }

    /// Runs `kernel` over tasks `0..tasks` and returns when all are done.
    ///
    /// # Safety
    /// `args` and `dims` must satisfy the kernel's ABI for every task.
    pub unsafe fn launch(&self, kernel: KernelFn, args: *const *mut u8, dims: *const i64, tasks: u64) {
        let s = &*self.shared;
        if s.threads == 1 || tasks <= 1 {
            // SAFETY: forwarded from the caller.
            unsafe { kernel(args, dims, 0, tasks) };
            return;
        }
        // SAFETY: all workers finished the previous job (barrier below), so none reads `job`.
        unsafe { *s.job.get() = Job { kernel: Some(kernel), args, dims } };
        let threads = s.threads as u64;
        for (t, share) in s.shares.iter().enumerate() {
            share.next.store(tasks * t as u64 / threads, Ordering::Relaxed);
            share.end.store(tasks * (t as u64 + 1) / threads, Ordering::Relaxed);
        }
        s.chunk.store((tasks / (threads * CHUNKS_PER_THREAD)).max(1), Ordering::Relaxed);
        s.remaining.store(s.threads - 1, Ordering::Release);
        {
            let _g = s.lock.lock().unwrap();
            s.generation.fetch_add(1, Ordering::AcqRel);
            s.wake.notify_all();
        }
        // SAFETY: forwarded from the caller.
        unsafe { drain(s, &*s.job.get(), 0) };
        let mut spins = 0u32;
        while s.remaining.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A worker's progress through the current prefetch hint.
struct AheadCursor {
    /// The worker's index: which share of each part is its own.
    index: usize,
    seq: u64,
    part: usize,
    offset: usize,
}

impl AheadCursor {
    /// Prefetches the next step of this worker's share of the hint; false when
    /// all of it is done.
    fn step(&mut self, s: &Shared) -> bool {
        let seq = s.ahead_seq.load(Ordering::Acquire);
        if seq != self.seq {
            *self = AheadCursor { index: self.index, seq, part: 0, offset: 0 };
        }
        let total: usize = s.ahead.iter().map(|p| p.1.load(Ordering::Relaxed)).sum();
        while self.part < AHEAD_PARTS {
            let (start, len) = (s.ahead[self.part].0.load(Ordering::Relaxed), s.ahead[self.part].1.load(Ordering::Relaxed));
            // This worker's share of the part (shares follow the task split, and
            // the weight parts are laid out in task order), and its part of the budget.
            let share = start + len * self.index / s.threads;
            let budget = (len as u128 * AHEAD_BYTES as u128 / total.max(1) as u128) as usize;
            let want = budget.min(len / s.threads);
            if self.offset >= want {
                self.part += 1;
                self.offset = 0;
                continue;
            }
            let end = (self.offset + PREFETCH_STEP).min(want);
            for at in (share + self.offset..share + end).step_by(64) {
                prefetch(at);
            }
            self.offset = end;
            return true;
        }
        false
    }
}

/// Asks for the cache line at `address` (into L1 and L2 on x86-64; nothing elsewhere).
#[inline(always)]
fn prefetch(address: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint and never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

fn worker(s: Arc<Shared>, index: usize) {
    let mut seen = 0u64;
    let mut ahead = AheadCursor { index, seq: 0, part: AHEAD_PARTS, offset: 0 };
    loop {
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if ahead.step(&s) {
                spins = 0;
                continue;
            }
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                let guard = s.lock.lock().unwrap();
                if s.generation.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Acquire) {
                    drop(s.wake.wait(guard).unwrap());
                }
                spins = 0;
            }
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the generation bump published this job; the launcher waits for us,
        // and the launcher guarantees the ABI for every task.
        unsafe {
            let job = *s.job.get();
            drain(&s, &job, index);
        }
        s.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self.shared.lock.lock().unwrap();
            self.shared.shutdown.store(true, Ordering::Release);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Per test (`S`): how often each task ran (tests run in parallel).
    static HITS: [[AtomicU64; 64]; 2] = [const { [const { AtomicU64::new(0) }; 64] }; 2];

    unsafe extern "C" fn count<const S: usize>(_: *const *mut u8, _: *const i64, b: u64, e: u64) {
        for t in b..e {
            HITS[S][t as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_task_runs_exactly_once_per_launch() {
        let pool = ThreadPool::new(3);
        for _ in 0..100 {
            // SAFETY: `count` ignores its pointers.
            unsafe { pool.launch(count::<0>, std::ptr::null(), std::ptr::null(), 64) };
        }
        // Task counts that do not divide among the threads, and fewer tasks than threads.
        for tasks in [2, 3, 5, 7, 11] {
            // SAFETY: as above.
            unsafe { pool.launch(count::<0>, std::ptr::null(), std::ptr::null(), tasks) };
        }
        for (t, h) in HITS[0].iter().enumerate() {
            let extra = [2, 3, 5, 7, 11].iter().filter(|&&n| t < n).count() as u64;
            assert_eq!(h.load(Ordering::Relaxed), 100 + extra, "task {t}");
        }
    }

    /// Which thread ran each task of the last launch.
    static RAN_ON: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];

    unsafe extern "C" fn slow_first(_: *const *mut u8, _: *const i64, b: u64, e: u64) {
        let me = if std::thread::current().name().is_some_and(|n| n.starts_with("maxrun-")) { 2 } else { 1 };
        for t in b..e {
            RAN_ON[t as usize].store(me, Ordering::Relaxed);
            if t == 0 {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    /// Prefetch hints never fault and never hold up launches, whatever memory
    /// they name (here: unmapped addresses and a huge range).
    #[test]
    fn prefetch_hints_are_only_hints() {
        let pool = ThreadPool::new(2);
        pool.prefetch_ahead(&[(16, 1 << 40), (usize::MAX - 4096, 4096), (0, 0)]);
        for _ in 0..50 {
            // SAFETY: `count` ignores its pointers.
            unsafe { pool.launch(count::<1>, std::ptr::null(), std::ptr::null(), 16) };
        }
        assert!(HITS[1][..16].iter().all(|h| h.load(Ordering::Relaxed) == 50));
    }

    /// A thread held up in its own share does not hold up the launch: the other
    /// thread takes the rest of that share once its own is done.
    #[test]
    fn idle_threads_take_work_from_a_slow_share() {
        let pool = ThreadPool::new(2);
        // SAFETY: `slow_first` ignores its pointers.
        unsafe { pool.launch(slow_first, std::ptr::null(), std::ptr::null(), 16) };
        let ran: Vec<u64> = RAN_ON.iter().map(|r| r.load(Ordering::Relaxed)).collect();
        assert!(ran.iter().all(|&r| r != 0), "{ran:?}");
        // The caller's share is tasks 0..8 and it sleeps in task 0: the worker ran the rest.
        assert!(ran[1..8].iter().all(|&r| r == 2), "{ran:?}");
    }
}
