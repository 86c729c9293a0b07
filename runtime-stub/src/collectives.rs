//! In-process collectives for a mesh of CPU devices: every device is a group of
//! worker threads in this process, so an all-reduce or all-gather is a read of the
//! other devices' buffers between barriers.
//!
//! Protocol (the same for every collective): each device publishes its input
//! pointer, waits at a barrier, computes its own output from every device's input
//! (all-reduce: each device sums one slice of the elements into a shared scratch,
//! in device order, then a second barrier and every device copies the scratch),
//! and waits at a barrier again before it may overwrite its input. The sums run in
//! device order whatever the thread timing, so every device gets the same bits on
//! every run.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};

/// A barrier for a fixed number of threads that spins (then yields): devices arrive
/// within microseconds of each other, far below the cost of parking a thread.
pub struct SpinBarrier {
    parties: usize,
    arrived: AtomicUsize,
    generation: AtomicU64,
}

impl SpinBarrier {
    pub fn new(parties: usize) -> Self {
        SpinBarrier { parties: parties.max(1), arrived: AtomicUsize::new(0), generation: AtomicU64::new(0) }
    }

    pub fn wait(&self) {
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.parties {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            if spins < 4096 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// The shared state of one mesh: one slot per device and a scratch for sums.
pub struct MeshHub {
    devices: usize,
    barrier: SpinBarrier,
    inputs: Vec<AtomicPtr<f32>>,
    scratch: UnsafeCell<Vec<f32>>,
}

// SAFETY: `scratch` is written only in disjoint slices by different devices
// between two barriers, grown only by device 0 while the others wait at a barrier,
// and read by all only after the barrier that follows the writes.
unsafe impl Sync for MeshHub {}
unsafe impl Send for MeshHub {}

impl std::fmt::Debug for MeshHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MeshHub({} devices)", self.devices)
    }
}

impl MeshHub {
    /// A hub for `devices` devices; `max_elems` sizes the all-reduce scratch.
    pub fn new(devices: usize, max_elems: usize) -> Self {
        MeshHub {
            devices,
            barrier: SpinBarrier::new(devices),
            inputs: (0..devices).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect(),
            scratch: UnsafeCell::new(vec![0.0; max_elems]),
        }
    }

    pub fn devices(&self) -> usize {
        self.devices
    }

    /// `output = sum over devices of input` (`n` f32 each), called by every device.
    ///
    /// # Safety
    /// `input` and `output` must hold `n` f32 and not overlap; every device must call
    /// this with the same `n`, and `n` must not exceed the hub's `max_elems`.
    pub unsafe fn all_reduce_sum(&self, device: usize, input: *const f32, output: *mut f32, n: usize) {
        self.inputs[device].store(input as *mut f32, Ordering::Release);
        self.barrier.wait();
        let scratch = self.scratch.get();
        // SAFETY: see the type's Sync note; slices [lo, hi) are disjoint per device.
        unsafe {
            let sums = (*scratch).as_mut_ptr();
            assert!(n <= (*scratch).len(), "all-reduce of {n} elements beyond the scratch");
            let (lo, hi) = (n * device / self.devices, n * (device + 1) / self.devices);
            for i in lo..hi {
                *sums.add(i) = 0.0;
            }
            for slot in &self.inputs {
                let src = slot.load(Ordering::Acquire);
                for i in lo..hi {
                    *sums.add(i) += *src.add(i);
                }
            }
        }
        self.barrier.wait();
        // SAFETY: every slice of the scratch was written before the barrier.
        // The next all-reduce writes the scratch only after its first barrier, which
        // every device reaches after this copy.
        unsafe { std::ptr::copy_nonoverlapping((*scratch).as_ptr(), output, n) };
    }

    /// `input` is `[rows, cols]` on every device; `output` becomes `[rows, devices * cols]`.
    ///
    /// # Safety
    /// `input` must hold `rows * cols` f32 and `output` `rows * cols * devices`, not
    /// overlapping; every device must call this with the same `rows` and `cols`.
    pub unsafe fn all_gather(&self, device: usize, input: *const f32, output: *mut f32, rows: usize, cols: usize) {
        self.inputs[device].store(input as *mut f32, Ordering::Release);
        self.barrier.wait();
        let width = cols * self.devices;
        for (d, slot) in self.inputs.iter().enumerate() {
            let src = slot.load(Ordering::Acquire);
            for r in 0..rows {
                // SAFETY: sizes as documented; inputs are not written until the barrier below.
                unsafe { std::ptr::copy_nonoverlapping(src.add(r * cols), output.add(r * width + d * cols), cols) };
            }
        }
        // Inputs stay untouched until every device has copied them.
        self.barrier.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_devices<F: Fn(usize) -> Vec<f32> + Sync>(devices: usize, f: F) -> Vec<Vec<f32>> {
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = (0..devices).map(|d| s.spawn(move || f(d))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_device_order_on_every_device() {
        for devices in [1, 2, 3, 4] {
            let hub = MeshHub::new(devices, 1000);
            let n = 37;
            let out = on_devices(devices, |d| {
                let mut result = vec![0.0; n];
                for round in 0..50 {
                    let input: Vec<f32> = (0..n).map(|i| (d * 1000 + i * 7 + round) as f32 * 0.1).collect();
                    unsafe { hub.all_reduce_sum(d, input.as_ptr(), result.as_mut_ptr(), n) };
                    let want: Vec<f32> = (0..n)
                        .map(|i| (0..devices).fold(0.0f32, |acc, e| acc + (e * 1000 + i * 7 + round) as f32 * 0.1))
                        .collect();
                    assert_eq!(result, want, "device {d} round {round}");
                }
                result
            });
            assert!(out.windows(2).all(|w| w[0] == w[1]));
        }
    }

    #[test]
    fn all_gather_concatenates_columns_in_device_order() {
        let devices = 3;
        let hub = MeshHub::new(devices, 0);
        let (rows, cols) = (4, 5);
        let out = on_devices(devices, |d| {
            let input: Vec<f32> = (0..rows * cols).map(|i| (d * 100 + i) as f32).collect();
            let mut output = vec![0.0; rows * cols * devices];
            unsafe { hub.all_gather(d, input.as_ptr(), output.as_mut_ptr(), rows, cols) };
            output
        });
        for o in &out {
            for r in 0..rows {
                for d in 0..devices {
                    for c in 0..cols {
                        assert_eq!(o[r * cols * devices + d * cols + c], (d * 100 + r * cols + c) as f32);
                    }
                }
            }
        }
    }
}
