//! A persistent thread pool for kernel launches, built to keep its speed when the
//! CPUs are shared (another process, more threads than cores, a container's quota).
//!
//! Each launch splits its task range into one contiguous share per thread; a
//! thread takes chunks of its own share from a counter only it touches (no cache
//! line moves between cores per chunk, and each thread streams one contiguous part
//! of the weights), then takes chunks from the other shares. A launch ends when
//! its last task is done, not when every thread has checked in: a worker the OS
//! has descheduled holds up a launch only by the one chunk it may be running, and
//! the threads that are running take its share. Launches with a single task run
//! on the calling thread.
//!
//! Waiting is a short spin, then a park (a futex: `std::thread::park`), both for
//! workers waiting for the next launch and for the launcher waiting for the last
//! chunk, so that a waiting thread gives its core to the thread it waits for.
//! A launch wakes only the workers that are parked (no system call while they
//! spin), and the worker that finishes the last chunk wakes a parked launcher.
//!
//! Job publication is a sequence lock: the generation is odd while the launcher
//! writes the next job, and a worker counts itself `inside` before reading the
//! job and checks the generation again, so a worker that wakes late never reads
//! a half-written job, and the launcher never rewrites the shares under a worker
//! still draining the previous launch.
//!
//! Between launches (and during the single-task ones, which leave the workers
//! idle) a worker prefetches the start of its own share of the weights the next
//! launches will read, as [`ThreadPool::prefetch_ahead`] names them, so that
//! memory bandwidth the idle core would leave unused goes to the next GEMV.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

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

/// A flag on a cache line of its own.
#[repr(align(128))]
struct Flag(AtomicBool);

struct Shared {
    job: UnsafeCell<Job>,
    /// Per thread (the caller is 0): its share of the current launch's tasks.
    shares: Vec<Share>,
    /// Tasks per hand-out.
    chunk: AtomicU64,
    /// Even: the job of launch `generation / 2` is published; odd: the launcher
    /// is writing the next one.
    generation: AtomicU64,
    /// Workers between reading a published generation and the end of their drain.
    inside: AtomicUsize,
    /// Tasks of the current launch not yet finished.
    pending: AtomicU64,
    shutdown: AtomicBool,
    /// Per worker (index - 1): parked, waiting for a launch to unpark it.
    parked: Vec<Flag>,
    /// The launcher is parked until `pending` reaches zero; the thread to unpark.
    launcher_parked: AtomicBool,
    launcher: Mutex<Option<Thread>>,
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

/// How long a worker spins for the next launch before it parks. Longer than the
/// gap between two launches of a step (about a microsecond), so that a worker
/// with a core of its own parks only between steps (measured on SmolLM2 decode,
/// 2 threads: about 2 parks per token); short, because a spinning worker takes
/// the core from whatever else wants it: two processes of 2 threads on 2 cores
/// kept 40% of their solo decode speed each with 200 us, 43% with 50 us, 50-53%
/// with 5 us; 3 threads on 2 cores 53%, 62%, 75-86% (docs/performance.md).
const WORKER_SPIN: Duration = Duration::from_micros(5);

/// How long the launcher spins for the last chunks of a launch before it parks:
/// a few decode launches' length, so that a worker that was descheduled holding
/// a chunk gets the launcher's core soon (20, 50 and 100 us measured alike).
const LAUNCHER_SPIN: Duration = Duration::from_micros(20);

/// Spin iterations between two looks at the clock.
const SPINS_PER_CLOCK: u32 = 64;

// SAFETY: `job` and the shares are written only by the launching thread while the
// generation is odd and no worker is inside (see the module's doc), and read by
// workers only inside a published generation.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// The CPUs this process may run on: its affinity mask and its cgroup's CPU
/// quota (a container's `--cpus`), as the standard library reads them, not the
/// machine's count. The default thread count.
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Threads per usable CPU above which `--threads` is refused: every launch
/// splits its tasks between all threads, so most would wait for a core.
pub const MAX_THREADS_PER_CPU: usize = 8;

/// The thread count for a thread-count flag (`flag`: `--threads`, `--jobs`;
/// `None`: the usable CPUs), and a warning to print when it asks for more
/// threads than there are CPUs.
pub fn thread_count(flag: &str, requested: Option<usize>) -> Result<(usize, Option<String>), String> {
    let cpus = usable_cpus();
    match requested {
        None => Ok((cpus, None)),
        Some(0) => Err(format!("{flag} must be at least 1")),
        Some(n) if n > cpus * MAX_THREADS_PER_CPU => Err(format!(
            "{flag} {n}: this process may use {cpus} CPU(s) (its affinity mask and CPU quota), and threads beyond \
             {} only wait for a core; give at most that, or leave {flag} out to use {cpus}",
            cpus * MAX_THREADS_PER_CPU
        )),
        Some(n) if n > cpus => Ok((
            n,
            Some(format!(
                "{flag} {n} is more than the {cpus} CPU(s) this process may use (its affinity mask and CPU quota); \
                 the extra threads share cores, which costs speed"
            )),
        )),
        Some(n) => Ok((n, None)),
    }
}

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

/// Chunks per thread's share: small enough that other threads can take over the
/// end of a slow share (uneven tasks, a descheduled thread), large enough that a
/// share's counter is touched rarely.
const CHUNKS_PER_THREAD: u64 = 8;

/// Spins until `done` holds or `budget` has passed; true if it holds.
fn spin_until(budget: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        for _ in 0..SPINS_PER_CLOCK {
            if done() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= budget {
            return done();
        }
    }
}

/// Runs chunks of thread `me`'s share of the current job, then of the others'
/// shares, until none are left. True if this thread finished the launch's last
/// task (it then wakes a parked launcher, after leaving: see [`worker`]).
///
/// # Safety
/// The job's pointers must satisfy the kernel's ABI for every task.
unsafe fn drain(s: &Shared, job: &Job, me: usize) -> bool {
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
            let e = (b + chunk).min(end);
            // SAFETY: forwarded from the caller.
            unsafe { kernel(job.args, job.dims, b, e) };
            if s.pending.fetch_sub(e - b, Ordering::SeqCst) == e - b {
                return true;
            }
        }
    }
    false
}

impl ThreadPool {
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(Job { kernel: None, args: std::ptr::null(), dims: std::ptr::null() }),
            shares: (0..threads).map(|_| Share { next: AtomicU64::new(0), end: AtomicU64::new(0) }).collect(),
            chunk: AtomicU64::new(1),
            generation: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            pending: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            parked: (1..threads).map(|_| Flag(AtomicBool::new(false))).collect(),
            launcher_parked: AtomicBool::new(false),
            launcher: Mutex::new(None),
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
        // Close the previous generation (odd), then wait for workers still
        // draining it (they find nothing left and leave).
        s.generation.fetch_add(1, Ordering::SeqCst);
        if !spin_until(LAUNCHER_SPIN, || s.inside.load(Ordering::SeqCst) == 0) {
            while s.inside.load(Ordering::SeqCst) != 0 {
                std::thread::yield_now();
            }
        }
        // SAFETY: the generation is odd and no worker is inside: none reads `job`.
        unsafe { *s.job.get() = Job { kernel: Some(kernel), args, dims } };
        let threads = s.threads as u64;
        for (t, share) in s.shares.iter().enumerate() {
            share.next.store(tasks * t as u64 / threads, Ordering::Relaxed);
            share.end.store(tasks * (t as u64 + 1) / threads, Ordering::Relaxed);
        }
        s.chunk.store((tasks / (threads * CHUNKS_PER_THREAD)).max(1), Ordering::Relaxed);
        s.pending.store(tasks, Ordering::Relaxed);
        // Publish (even), then wake the workers that parked.
        s.generation.fetch_add(1, Ordering::SeqCst);
        for (flag, w) in s.parked.iter().zip(&self.workers) {
            if flag.0.load(Ordering::SeqCst) && flag.0.swap(false, Ordering::SeqCst) {
                w.thread().unpark();
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { drain(s, &*s.job.get(), 0) };
        if spin_until(LAUNCHER_SPIN, || s.pending.load(Ordering::Acquire) == 0) {
            return;
        }
        *s.launcher.lock().unwrap() = Some(std::thread::current());
        loop {
            s.launcher_parked.store(true, Ordering::SeqCst);
            if s.pending.load(Ordering::SeqCst) == 0 {
                s.launcher_parked.store(false, Ordering::Relaxed);
                return;
            }
            std::thread::park();
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

/// Asks for the cache line at `address` (into L1 and L2 on x86-64, `prfm pldl1keep`
/// on aarch64, whose `_prefetch` intrinsic is not stable; nothing elsewhere).
#[inline(always)]
fn prefetch(address: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint and never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address as *const i8)
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint and never faults, whatever the address.
    unsafe {
        std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) address, options(nostack, readonly, preserves_flags))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = address;
}

fn worker(s: Arc<Shared>, index: usize) {
    let mut seen = 0u64;
    let mut ahead = AheadCursor { index, seq: 0, part: AHEAD_PARTS, offset: 0 };
    let parked = &s.parked[index - 1].0;
    loop {
        // Wait for a published generation newer than the last one drained.
        let fresh = |g: u64| g != seen && g.is_multiple_of(2);
        let mut waited = Instant::now();
        let mut spins = 0u32;
        let g = loop {
            let g = s.generation.load(Ordering::Acquire);
            if fresh(g) {
                break g;
            }
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if ahead.step(&s) {
                continue;
            }
            std::hint::spin_loop();
            spins += 1;
            if !spins.is_multiple_of(SPINS_PER_CLOCK) || waited.elapsed() < WORKER_SPIN {
                continue;
            }
            // Park; the launcher unparks every worker whose flag it finds set
            // after publishing, and this thread looks once more after setting it.
            parked.store(true, Ordering::SeqCst);
            if !fresh(s.generation.load(Ordering::SeqCst)) && !s.shutdown.load(Ordering::SeqCst) {
                std::thread::park();
            }
            parked.store(false, Ordering::SeqCst);
            waited = Instant::now();
        };
        s.inside.fetch_add(1, Ordering::SeqCst);
        if s.generation.load(Ordering::SeqCst) != g {
            // The launcher closed this generation meanwhile: its job may be
            // being rewritten. Leave, and wait for the next one.
            s.inside.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        seen = g;
        // SAFETY: inside a published generation the job and shares are not written;
        // the launcher guarantees the ABI for every task.
        let finished = unsafe {
            let job = *s.job.get();
            drain(&s, &job, index)
        };
        // Leave before waking the launcher: a woken launcher may take this core
        // at once, and its next launch waits for no worker to be inside.
        s.inside.fetch_sub(1, Ordering::SeqCst);
        if finished && s.launcher_parked.swap(false, Ordering::SeqCst) {
            if let Some(t) = s.launcher.lock().unwrap().as_ref() {
                t.unpark();
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
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

    static STRESS: [AtomicU64; 97] = [const { AtomicU64::new(0) }; 97];

    unsafe extern "C" fn count_stress(_: *const *mut u8, _: *const i64, b: u64, e: u64) {
        for t in b..e {
            STRESS[t as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Many more threads than cores (most are descheduled at any time, some in
    /// the middle of a launch): every task of every launch still runs exactly once,
    /// launches of different sizes following each other at once.
    #[test]
    fn every_task_runs_exactly_once_with_more_threads_than_cores() {
        let pool = ThreadPool::new(12);
        let mut expected = [0u64; 97];
        for i in 0..3000u64 {
            let tasks = 2 + (i * 37) % 96;
            // SAFETY: `count_stress` ignores its pointers.
            unsafe { pool.launch(count_stress, std::ptr::null(), std::ptr::null(), tasks) };
            for e in &mut expected[..tasks as usize] {
                *e += 1;
            }
        }
        let got: Vec<u64> = STRESS.iter().map(|h| h.load(Ordering::Relaxed)).collect();
        assert_eq!(got, expected.to_vec());
    }

    static PARKED_HITS: [AtomicU64; 32] = [const { AtomicU64::new(0) }; 32];

    unsafe extern "C" fn count_parked(_: *const *mut u8, _: *const i64, b: u64, e: u64) {
        for t in b..e {
            PARKED_HITS[t as usize].fetch_add(1, Ordering::Relaxed);
            // A worker's task that outlasts the launcher's spin: the launcher
            // parks and the worker must wake it.
            if t == 16 {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Idle workers park (no core spent waiting), the next launch wakes them, and
    /// a launcher parked on a slow task is woken by the thread that finishes it.
    #[test]
    fn idle_workers_park_and_wake_for_the_next_launch() {
        let pool = ThreadPool::new(3);
        for round in 1..=3 {
            // Idle for far longer than the spin (a second at most: the tests
            // beside this one may hold the cores).
            let parked = || pool.shared.parked.iter().filter(|f| f.0.load(Ordering::SeqCst)).count();
            let start = Instant::now();
            while parked() < 2 && start.elapsed() < Duration::from_secs(1) {
                std::thread::sleep(WORKER_SPIN * 20);
            }
            assert_eq!(parked(), 2, "round {round}: both workers parked while idle");
            // SAFETY: `count_parked` ignores its pointers.
            unsafe { pool.launch(count_parked, std::ptr::null(), std::ptr::null(), 32) };
            assert!(PARKED_HITS.iter().all(|h| h.load(Ordering::Relaxed) == round), "round {round}");
        }
    }

    #[test]
    fn thread_counts_follow_the_usable_cpus() {
        let cpus = usable_cpus();
        assert_eq!(thread_count("--threads", None).unwrap(), (cpus, None));
        assert_eq!(thread_count("--threads", Some(cpus)).unwrap(), (cpus, None));
        let (n, warning) = thread_count("--threads", Some(cpus + 1)).unwrap();
        assert_eq!(n, cpus + 1);
        assert!(warning.unwrap().contains(&format!("more than the {cpus} CPU(s)")));
        assert!(thread_count("--threads", Some(0)).unwrap_err().contains("at least 1"));
        let e = thread_count("--threads", Some(cpus * MAX_THREADS_PER_CPU + 1)).unwrap_err();
        assert!(e.contains(&format!("give at most that")) && e.contains(&(cpus * MAX_THREADS_PER_CPU).to_string()), "{e}");
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
        // Share 0 is tasks 0..8; whichever thread took task 0 (the caller, or the
        // worker done with its own share first) sleeps in it, and the other ran
        // the rest of that share.
        let other = 3 - ran[0];
        assert!(ran[1..8].iter().all(|&r| r == other), "{ran:?}");
    }
}
