//! In-process collectives for a mesh of CPU devices: every device is a group of
//! worker threads in this process, so an all-reduce or all-gather is a read of the
//! other devices' buffers between barriers.
//!
//! All-reduce: each device copies its input into its slot of a shared buffer,
//! waits at one barrier, and sums every device's slot into its own output, in
//! device order, so every device gets the same bits on every run. The shared
//! buffer alternates between two halves from one all-reduce to the next: a device
//! can only start writing a half again after the next barrier, which every device
//! passes only once it has finished reading that half. One barrier per all-reduce.
//!
//! All-gather (once per step, the logits): each device publishes its input
//! pointer, waits at a barrier, copies every device's piece, and waits at a second
//! barrier before it may overwrite its input.

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

/// The shared state of one mesh: input pointers for all-gathers, and the two
/// halves of the all-reduce buffer (one slot of `max_elems` per device in each).
pub struct MeshHub {
    devices: usize,
    max_elems: usize,
    barrier: SpinBarrier,
    inputs: Vec<AtomicPtr<f32>>,
    halves: [UnsafeCell<Vec<f32>>; 2],
    /// All-reduces each device has run (its parity picks the half).
    reduces: Vec<AtomicU64>,
}

// SAFETY: a device writes only its own slot of a half, before the barrier of that
// all-reduce, and all devices read the half only after it; the half is written
// again two all-reduces later, after a barrier every reader has passed.
unsafe impl Sync for MeshHub {}
unsafe impl Send for MeshHub {}

impl std::fmt::Debug for MeshHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MeshHub({} devices)", self.devices)
    }
}

impl MeshHub {
    /// A hub for every sub-model of `h`, its all-reduce scratch sized for the
    /// largest all-reduce of any plan (single-stream and batch).
    pub fn for_artifact(h: &crate::format::Header) -> Self {
        use crate::format::CollectiveOp;
        let plans = h.sub_models.iter().flat_map(|m| {
            let batch = m.batch.iter().flat_map(|b| [&b.mixed, &b.decode, &b.single]);
            [Some(&m.prefill), Some(&m.decode), m.prefill_last.as_ref()].into_iter().flatten().chain(batch)
        });
        let largest = plans
            .flat_map(|p| p.collectives.iter().map(move |c| (c, p.max_seq)))
            .map(|(c, max_seq)| match c.op {
                CollectiveOp::AllReduceSum { elems } => elems.eval(max_seq),
                CollectiveOp::AllGather { .. } => 0,
            })
            .max()
            .unwrap_or(0);
        MeshHub::new(h.sub_models.len(), largest as usize)
    }

    /// A hub for `devices` devices; `max_elems` sizes the all-reduce scratch.
    pub fn new(devices: usize, max_elems: usize) -> Self {
        MeshHub {
            devices,
            max_elems,
            barrier: SpinBarrier::new(devices),
            inputs: (0..devices).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect(),
            halves: [UnsafeCell::new(vec![0.0; devices * max_elems]), UnsafeCell::new(vec![0.0; devices * max_elems])],
            reduces: (0..devices).map(|_| AtomicU64::new(0)).collect(),
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
        assert!(n <= self.max_elems, "all-reduce of {n} elements beyond the hub's {}", self.max_elems);
        let half = (self.reduces[device].fetch_add(1, Ordering::Relaxed) % 2) as usize;
        let buf = self.halves[half].get();
        // SAFETY: see the type's Sync note; this device's slot is [device * max, + n).
        unsafe {
            let base = (*buf).as_mut_ptr();
            std::ptr::copy_nonoverlapping(input, base.add(device * self.max_elems), n);
            self.barrier.wait();
            for i in 0..n {
                *output.add(i) = 0.0;
            }
            for d in 0..self.devices {
                let slot = base.add(d * self.max_elems);
                for i in 0..n {
                    *output.add(i) += *slot.add(i);
                }
            }
        }
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
