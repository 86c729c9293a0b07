//! The GPU executor: an artifact's batch plans on one GPU, over a paged KV
//! pool in device memory, for any [`GpuDevice`].
//!
//! Everything a step needs lives on the device at fixed addresses: the weights
//! (uploaded once), each plan's arena, the KV pool (per layer, `blocks` blocks of
//! keys and of values, key rows as the GPU forms keep them), and the step's
//! inputs (tokens, positions, KV slots, row sequences, block tables, logit rows
//! and the two row counts), which are uploaded per step; each launch's argument
//! table is built and uploaded once per plan. So a decode step of `n` rows runs
//! the same launches with the same arguments every time, and is captured once
//! into a graph per row count (the step-size buckets) and replayed; mixed steps
//! (prompt chunks) launch one by one. Sampling stays on the host: a step copies
//! back only its logit rows.
//!
//! The device is a trait so that the host side (buffers, argument tables, grid
//! sizes, row counts, graphs) is tested without a GPU: `tests/src/sim_gpu.rs`
//! runs every launch through the kernel interpreter's GPU mapping, and the
//! CUDA device (`crate::gpu::CudaDevice`, feature `cuda`) runs it on NVIDIA GPUs.

use std::collections::HashMap;

use super::{BatchStep, Executor, PoolLimits, RunError};
use crate::artifact::Artifact;
use crate::format::{BatchLimits, BufferRef, Plan, RowCount};

/// A GPU as the executor uses it: device memory by address, one stream of
/// work in order, kernels by their index in the artifact's kernel table.
pub trait GpuDevice {
    /// What [`GpuDevice::end_capture`] makes and [`GpuDevice::replay`] runs.
    type Graph;

    /// The device's name, for stats lines.
    fn name(&self) -> String;

    /// Device memory free for the KV pool, if the device can tell.
    fn free_memory(&self) -> Option<u64>;

    /// `bytes` of zeroed device memory, alive as long as the device; its address.
    fn alloc(&mut self, bytes: usize) -> Result<u64, RunError>;

    /// Copies `data` to device address `dst`, in order with the work queued before and after it.
    fn upload(&mut self, dst: u64, data: &[u8]) -> Result<(), RunError>;

    /// Waits for the work queued so far and copies `out.len()` bytes from device address `src`.
    fn download(&mut self, src: u64, out: &mut [u8]) -> Result<(), RunError>;

    /// Queues a launch of kernel `kernel` over `tasks` GPU tasks (the kernel's
    /// `gpu_threads_per_task` threads each) with the ABI's arguments: the device
    /// address of its argument table and of its row count.
    fn launch(&mut self, kernel: u32, args: u64, dims: u64, tasks: u64) -> Result<(), RunError>;

    /// Starts recording the launches queued from now on instead of running them.
    fn begin_capture(&mut self) -> Result<(), RunError>;

    /// Ends the recording started by [`GpuDevice::begin_capture`].
    fn end_capture(&mut self) -> Result<Self::Graph, RunError>;

    /// Queues a recorded graph's launches.
    fn replay(&mut self, graph: &Self::Graph) -> Result<(), RunError>;
}

/// GPU tasks of a launch of `tasks` tasks whose kernel's GPU form splits each
/// into `split` (task `t` of the plan is GPU tasks `t * split ..= t * split +
/// split - 1`, so a launch's range scales with it).
pub fn gpu_tasks(tasks: u64, split: u32) -> u64 {
    tasks.saturating_mul(split as u64)
}

/// Which batch plan a step runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Which {
    Mixed,
    Decode,
    Single,
}

/// One plan's device state.
struct PlanOnDevice {
    arena: u64,
    /// Per launch: the device address of its argument table.
    args: Vec<u64>,
}

/// The step's inputs on the device.
struct Inputs {
    tokens: u64,
    positions: u64,
    slots: u64,
    row_sequences: u64,
    block_tables: u64,
    logit_rows: u64,
    /// `[rows, logit rows]` (i64).
    dims: u64,
}

/// The share of free device memory the default KV pool takes at most (1 / this).
pub const DEFAULT_GPU_KV_SHARE: u64 = 2;

/// An artifact's batch plans on one GPU.
pub struct GpuExecutor<'a, D: GpuDevice> {
    artifact: &'a Artifact,
    device: D,
    mixed: PlanOnDevice,
    decode: PlanOnDevice,
    single: PlanOnDevice,
    inputs: Inputs,
    limits: BatchLimits,
    blocks: u64,
    /// Decode steps' graphs by plan and row count; `None`: graphs are off.
    graphs: Option<HashMap<(Which, usize), D::Graph>>,
    logits: Vec<f32>,
    bytes: Vec<u8>,
}

impl<'a, D: GpuDevice> GpuExecutor<'a, D> {
    /// Uploads `artifact`'s weights to `device` and lays out its batch plans
    /// and a KV pool of `kv_bytes` bytes (`None`: every sequence at the full
    /// context, at most [`DEFAULT_GPU_KV_SHARE`] of the device's free memory);
    /// `graphs`: replay decode steps from graphs.
    pub fn new(artifact: &'a Artifact, mut device: D, kv_bytes: Option<u64>, graphs: bool) -> Result<Self, RunError> {
        let h = &artifact.header;
        if h.sub_models.len() > 1 {
            return Err(RunError::Gpu(format!("the artifact is split over {}; the GPU executor runs one device", h.mesh.spec())));
        }
        if h.gpu_archs.is_empty() {
            return Err(RunError::Gpu(format!("{}: the artifact has no GPU code; recompile with --target cpu,cuda:sm_90", artifact.path.display())));
        }
        let limits = super::batch_limits(artifact)?;
        let per_block = super::block_bytes_all_layers(h, &limits);
        let kv_bytes = kv_bytes.unwrap_or_else(|| {
            let all = limits.blocks_per_sequence.saturating_mul(per_block).saturating_mul(limits.max_sequences);
            let one = limits.blocks_per_sequence.saturating_mul(per_block);
            device.free_memory().map_or(all, |free| all.min(free / DEFAULT_GPU_KV_SHARE)).max(one)
        });
        let blocks = super::pool_blocks(h, &limits, Some(kv_bytes))?;

        // The weights of this device (a one-device artifact: all of them).
        let mut weights = vec![0u64; h.weights.len()];
        for (i, w) in h.weights.iter().enumerate() {
            if w.device != 0 {
                continue;
            }
            let bytes = artifact.weight_bytes(i);
            weights[i] = device.alloc(bytes.len().max(1))?;
            device.upload(weights[i], bytes)?;
        }
        // Per part of the KV encoding, per layer, keys then values.
        let (layers, parts) = (h.kv_cache.layers as usize, h.kv_cache.encoding.parts().len());
        let positions = blocks.saturating_mul(limits.block_size);
        let mut caches = vec![[0u64; 2]; parts * layers];
        for part in 0..parts {
            let bytes = h.kv_cache.part_layer_bytes(part, positions).and_then(|b| usize::try_from(b).ok());
            let bytes = bytes.ok_or(RunError::KvCacheMemory { bytes: kv_bytes, max_length: h.max_length })?;
            for layer in 0..layers {
                caches[part * layers + layer] = [device.alloc(bytes.max(1))?, device.alloc(bytes.max(1))?];
            }
        }
        let rows = limits.max_rows as usize;
        let sequences = limits.max_sequences as usize;
        let inputs = Inputs {
            tokens: device.alloc(4 * rows)?,
            positions: device.alloc(4 * rows)?,
            slots: device.alloc(4 * rows)?,
            row_sequences: device.alloc(4 * rows)?,
            block_tables: device.alloc(4 * sequences * limits.blocks_per_sequence as usize)?,
            logit_rows: device.alloc(4 * limits.max_logit_rows as usize)?,
            dims: device.alloc(16)?,
        };
        let plans = h.main().batch.as_ref().expect("batch_limits checked the plans");
        let mut lay_out = |plan: &Plan| -> Result<PlanOnDevice, RunError> {
            let arena = device.alloc(plan.arena_bytes.max(1) as usize)?;
            let mut args = Vec::with_capacity(plan.launches.len());
            for l in &plan.launches {
                let table: Vec<u8> = l
                    .args
                    .iter()
                    .map(|a| match *a {
                        BufferRef::Arena { offset } => arena + offset,
                        BufferRef::Weight(i) => weights[i as usize],
                        BufferRef::Tokens => inputs.tokens,
                        BufferRef::Positions => inputs.positions,
                        BufferRef::KeyCache { layer, part } => caches[part as usize * layers + layer as usize][0],
                        BufferRef::ValueCache { layer, part } => caches[part as usize * layers + layer as usize][1],
                        BufferRef::Slots => inputs.slots,
                        BufferRef::RowSequences => inputs.row_sequences,
                        BufferRef::BlockTables => inputs.block_tables,
                        BufferRef::LogitRows => inputs.logit_rows,
                        BufferRef::SequenceStarts => unreachable!("the loader admits SequenceStarts in encoder batch plans only"),
                    })
                    .flat_map(u64::to_le_bytes)
                    .collect();
                let at = device.alloc(table.len().max(8))?;
                device.upload(at, &table)?;
                args.push(at);
            }
            Ok(PlanOnDevice { arena, args })
        };
        let (mixed, decode, single) = (lay_out(&plans.mixed)?, lay_out(&plans.decode)?, lay_out(&plans.single)?);
        Ok(GpuExecutor {
            artifact,
            device,
            mixed,
            decode,
            single,
            inputs,
            limits,
            blocks,
            graphs: graphs.then(HashMap::new),
            logits: Vec::new(),
            bytes: Vec::new(),
        })
    }

    /// The device it runs on.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Queues every launch of `plan` for a step of `rows` rows and `logit_rows` rows with logits.
    fn launch_all(&mut self, plan: &Plan, which: Which, rows: u64, logit_rows: u64) -> Result<(), RunError> {
        let h = &self.artifact.header;
        let state = match which {
            Which::Mixed => &self.mixed,
            Which::Decode => &self.decode,
            Which::Single => &self.single,
        };
        for (launch, &args) in plan.launches.iter().zip(&state.args) {
            // A launch over the rows with logits sees `dims[1]` as its length.
            let (count, dims) = match launch.rows {
                RowCount::Step => (rows, self.inputs.dims),
                RowCount::Logits => (logit_rows, self.inputs.dims + 8),
            };
            let tasks = gpu_tasks(launch.tasks.eval(count), h.kernels[launch.kernel as usize].gpu_task_split);
            if tasks > 0 {
                self.device.launch(launch.kernel, args, dims, tasks)?;
            }
        }
        Ok(())
    }
}

/// `values` as little-endian bytes.
fn le_bytes<T: Copy, const N: usize>(values: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to(v)).collect()
}

impl<D: GpuDevice> Executor for GpuExecutor<'_, D> {
    fn limits(&self) -> PoolLimits {
        super::pool_limits(&self.limits, self.blocks)
    }

    fn step(&mut self, step: &BatchStep<'_>) -> Result<&[f32], RunError> {
        step.check_adapters()?;
        let artifact = self.artifact;
        let plans = artifact.header.main().batch.as_ref().expect("checked at start");
        let rows = step.rows();
        let (which, plan) = match (step.decode_only, rows) {
            (true, 1) => (Which::Single, &plans.single),
            (true, n) if n as u64 <= plans.decode.max_seq => (Which::Decode, &plans.decode),
            _ => (Which::Mixed, &plans.mixed),
        };
        let logit_rows = if which == Which::Mixed { self.limits.max_logit_rows } else { self.limits.max_sequences };
        assert!(rows as u64 <= plan.max_seq && step.logit_rows.len() as u64 <= logit_rows, "the scheduler keeps to the plan's rows");
        let i32s = |v: &[i32]| le_bytes(v, i32::to_le_bytes);
        let uploads = [
            (self.inputs.tokens, i32s(step.tokens)),
            (self.inputs.positions, i32s(step.positions)),
            (self.inputs.slots, i32s(step.slots)),
            (self.inputs.row_sequences, i32s(step.row_sequences)),
            (self.inputs.block_tables, i32s(step.block_tables)),
            (self.inputs.logit_rows, i32s(step.logit_rows)),
            (self.inputs.dims, le_bytes(&[rows as i64, step.logit_rows.len() as i64], i64::to_le_bytes)),
        ];
        for (at, bytes) in &uploads {
            if !bytes.is_empty() {
                self.device.upload(*at, bytes)?;
            }
        }
        let logit_rows = step.logit_rows.len() as u64;
        // Decode steps replay their row count's graph (captured at their first
        // step); every argument and count they read is at a fixed address.
        let key = (which, rows);
        match &self.graphs {
            Some(graphs) if step.decode_only => {
                if !graphs.contains_key(&key) {
                    self.device.begin_capture()?;
                    let queued = self.launch_all(plan, which, rows as u64, logit_rows);
                    let graph = self.device.end_capture();
                    queued?;
                    let graph = graph?;
                    self.graphs.as_mut().expect("graphs are on").insert(key, graph);
                }
                let graph = &self.graphs.as_ref().expect("graphs are on")[&key];
                self.device.replay(graph)?;
            }
            _ => self.launch_all(plan, which, rows as u64, logit_rows)?,
        }
        let BufferRef::Arena { offset } = plan.logits else { unreachable!("the compiler places logits in the arena") };
        let arena = match which {
            Which::Mixed => self.mixed.arena,
            Which::Decode => self.decode.arena,
            Which::Single => self.single.arena,
        };
        let n = step.logit_rows.len() * artifact.header.model.vocab_size as usize;
        self.bytes.resize(4 * n, 0);
        self.device.download(arena + offset, &mut self.bytes)?;
        self.logits.clear();
        self.logits.extend(self.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        Ok(&self.logits)
    }

    /// The host thread that queues the launches.
    fn threads(&self) -> usize {
        1
    }

    fn describe(&self) -> String {
        format!("GPU: {}", self.device.name())
    }
}
