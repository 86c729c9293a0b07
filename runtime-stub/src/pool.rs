//! A persistent thread pool for kernel launches: workers spin briefly, then park;
//! each launch hands out its task range in chunks from a shared counter (so threads
//! that finish early take more work: causal attention rows grow with position) and
//! ends with one barrier. Launches with a single task run on the calling thread.

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
    tasks: u64,
}

struct Shared {
    job: UnsafeCell<Job>,
    /// The next task not yet handed out.
    next: AtomicU64,
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

/// Runs chunks of the current job until none are left.
///
/// # Safety
/// The job's pointers must satisfy the kernel's ABI for every task.
unsafe fn drain(s: &Shared, job: &Job) {
    let kernel = job.kernel.expect("a published job has a kernel");
    let chunk = s.chunk.load(Ordering::Relaxed);
    loop {
        let b = s.next.fetch_add(chunk, Ordering::Relaxed);
        if b >= job.tasks {
            break;
        }
        // SAFETY: forwarded from the caller.
        unsafe { kernel(job.args, job.dims, b, (b + chunk).min(job.tasks)) };
    }
}

impl ThreadPool {
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(Job { kernel: None, args: std::ptr::null(), dims: std::ptr::null(), tasks: 0 }),
            next: AtomicU64::new(0),
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
        unsafe { *s.job.get() = Job { kernel: Some(kernel), args, dims, tasks } };
        s.next.store(0, Ordering::Relaxed);
        s.chunk.store((tasks / (s.threads as u64 * CHUNKS_PER_THREAD)).max(1), Ordering::Relaxed);
        s.remaining.store(s.threads - 1, Ordering::Release);
        {
            let _g = s.lock.lock().unwrap();
            s.generation.fetch_add(1, Ordering::AcqRel);
            s.wake.notify_all();
        }
        // SAFETY: forwarded from the caller.
        unsafe { drain(s, &*s.job.get()) };
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

fn worker(s: Arc<Shared>, _index: usize) {
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
            drain(&s, &job);
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
        for h in &HITS {
            assert_eq!(h.load(Ordering::Relaxed), 100);
        }
    }
}
