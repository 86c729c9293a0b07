//! A persistent thread pool for kernel launches: workers spin briefly, then park.
//! Each launch splits its task range into one contiguous share per thread; a
//! thread takes chunks of its own share from a counter only it touches (no cache
//! line moves between cores per chunk, and each thread streams one contiguous part
//! of the weights), then takes chunks from the other shares (so threads that finish
//! early take more work: causal attention rows grow with position). One barrier
//! ends the launch. Launches with a single task run on the calling thread.

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
}

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

/// Chunks per thread: small enough to balance uneven tasks, large enough that
/// the shared counter is touched rarely.
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

fn worker(s: Arc<Shared>, index: usize) {
    let mut seen = 0u64;
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

    static HITS: [AtomicU64; 64] = [const { AtomicU64::new(0) }; 64];

    unsafe extern "C" fn count(_: *const *mut u8, _: *const i64, b: u64, e: u64) {
        for t in b..e {
            HITS[t as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_task_runs_exactly_once_per_launch() {
        let pool = ThreadPool::new(3);
        for _ in 0..100 {
            // SAFETY: `count` ignores its pointers.
            unsafe { pool.launch(count, std::ptr::null(), std::ptr::null(), 64) };
        }
        // Task counts that do not divide among the threads, and fewer tasks than threads.
        for tasks in [2, 3, 5, 7, 11] {
            // SAFETY: as above.
            unsafe { pool.launch(count, std::ptr::null(), std::ptr::null(), tasks) };
        }
        for (t, h) in HITS.iter().enumerate() {
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
