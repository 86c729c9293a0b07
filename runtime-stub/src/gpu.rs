//! The CUDA execution path (feature `cuda`, on by default; it links nothing: cudarc
//! loads `libcuda.so` at run time, so maxrun builds and runs without CUDA installed).
//!
//! [`GpuSession`] mirrors the CPU `Session`: it loads the artifact's PTX module
//! for the device, copies every weight to the device once, keeps the KV caches and
//! the activation arenas on the device, runs a plan's launches in order on one
//! stream (thread group `i` of a launch runs task `i`: one thread, a warp or a
//! four-warp block, as each kernel's `gpu_threads_per_task` says;
//! `maxc_kernels::warp` has the mapping), and copies
//! only the logits back; sampling stays on the host.
//!
//! The argument table of each launch is built once per plan: every buffer of a
//! step (arena, weights, caches, tokens, positions) has a fixed device address,
//! and only the contents of `tokens`, `positions` and `dims` change per step.
//!
//! On a sharded artifact (`--devices gpu:0,1`) the session holds one
//! `GpuDevice` per sub-model, each with only its own weights, and the plans'
//! collectives as NCCL all-reduce / all-gather group calls (NCCL, like the driver,
//! is loaded at run time). The one-device path has run every golden fixture on an
//! H100 (docs/gpu.md, "Results on a real GPU"); the mesh path has not run on GPUs.
//!
//! A decode step is hundreds of small launches, each costing a few microseconds
//! of launch overhead on the host. On one device the decode plan is therefore
//! captured once into a CUDA graph and replayed per token: every launch of a
//! decode step has the same grid and the same arguments (the token, its position
//! and the sequence length live in device memory at fixed addresses, and the
//! launch grid of a decode step does not depend on the position), so only the
//! three uploads change between steps. `MAXRUN_CUDA_GRAPHS=0` turns the graph
//! off (launch by launch, as prefill always runs).

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use crate::artifact::Artifact;
use crate::format::{BufferRef, CollectiveOp, Plan, SectionKind, SubModel};
use crate::executor::{RunCounts, RunError};

/// Threads per block of every launch.
pub const BLOCK_THREADS: u32 = 128;

/// Why the GPU path cannot run.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver was found (libcuda.so could not be loaded)")]
    NoDriver,
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    #[error("the artifact has PTX for {archs}, none of which runs on this GPU (compute capability {major}.{minor})", archs = archs.join(", "))]
    NoModuleForDevice { archs: Vec<String>, major: i32, minor: i32 },
    #[error("CUDA: {0}")]
    Driver(String),
}

fn driver_err(e: impl std::fmt::Debug) -> GpuError {
    GpuError::Driver(format!("{e:?}"))
}

/// Whether the CUDA driver library can be loaded (cudarc panics on first use
/// otherwise, so this is checked before anything else).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The PTX module to load on a device of compute capability `cc`: the newest
/// architecture not newer than the device (PTX is JIT-compiled forward).
pub fn pick_module(archs: &[String], cc: (i32, i32)) -> Option<usize> {
    let number = |a: &str| a.strip_prefix("sm_").and_then(|n| n.parse::<i32>().ok());
    let device = cc.0 * 10 + cc.1;
    archs.iter().enumerate().filter_map(|(i, a)| number(a).filter(|&n| n <= device).map(|n| (n, i))).max().map(|(_, i)| i)
}

/// The grid of a launch of `tasks` tasks of `per_task` threads each (the
/// kernel's `gpu_threads_per_task`: one thread, a warp, or four warps, which
/// are then the whole block).
pub fn launch_config(tasks: u64, per_task: u32) -> LaunchConfig {
    let threads = tasks.saturating_mul(per_task as u64);
    LaunchConfig { grid_dim: (threads.div_ceil(BLOCK_THREADS as u64).max(1) as u32, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
}

pub use crate::executor::gpu::gpu_tasks;

/// Which of a sub-model's plans a step runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Which {
    Prefill,
    Decode,
    /// The prefill plan that computes only the last token's logits.
    PrefillLast,
}

impl Which {
    fn plan(self, m: &SubModel) -> &Plan {
        match self {
            Which::Prefill => &m.prefill,
            Which::Decode => &m.decode,
            Which::PrefillLast => m.prefill_last.as_ref().expect("chosen only when the artifact has it"),
        }
    }
}

struct GpuPlan {
    arena: CudaSlice<u8>,
    /// Per launch: the device array of argument pointers.
    args: Vec<CudaSlice<u64>>,
    functions: Vec<CudaFunction>,
    /// Per launch: GPU threads per task of its kernel.
    threads_per_task: Vec<u32>,
    /// Per launch: GPU tasks per task of the plan (the kernel's `gpu_task_split`).
    task_split: Vec<u32>,
}

impl GpuPlan {
    /// The device address of `offset` in the plan's arena.
    fn arena_address(&self, stream: &CudaStream, offset: u64) -> u64 {
        self.arena.device_ptr(stream).0 + offset
    }
}

/// One device's share of a run: its context and stream, the PTX module's
/// functions, its sub-model's weights, KV caches and plan arenas.
struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    prefill: GpuPlan,
    decode: GpuPlan,
    prefill_last: Option<GpuPlan>,
    /// The decode plan's launches captured as one graph (made at the first decode step).
    decode_graph: Option<CudaGraph>,
    _weights: Vec<CudaSlice<u8>>,
    _caches: Vec<CudaSlice<u8>>,
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    dims: CudaSlice<i64>,
    name: String,
}

/// Checks that a driver and at least one device are present.
fn probe() -> Result<(), GpuError> {
    if !driver_present() {
        return Err(GpuError::NoDriver);
    }
    if CudaContext::device_count().map_err(driver_err)? < 1 {
        return Err(GpuError::NoDevice);
    }
    Ok(())
}

impl GpuDevice {
    /// Opens GPU `ordinal` for sub-model `sub`: loads the matching PTX module and
    /// uploads the sub-model's weights.
    fn open(artifact: &Artifact, ordinal: usize, sub: usize) -> Result<Self, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        // SAFETY: every buffer of this device is used on its one stream only, so
        // the ordering cudarc's per-buffer events would enforce holds anyway; and
        // those events (recorded at each launch) cannot be waited on across a
        // graph capture's boundary.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(driver_err)?;
        let h = &artifact.header;
        let m = &h.sub_models[sub];
        let module_index = pick_module(&h.gpu_archs, cc).ok_or_else(|| GpuError::NoModuleForDevice { archs: h.gpu_archs.clone(), major: cc.0, minor: cc.1 })?;
        let ptx = std::str::from_utf8(artifact.section(SectionKind::Ptx(module_index as u32))).map_err(driver_err)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver_err)?;
        let functions: Vec<CudaFunction> = h.kernels.iter().map(|k| module.load_function(&k.symbol)).collect::<Result<_, _>>().map_err(driver_err)?;
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(driver_err)?;

        // Only this sub-model's weights; the others' entries get no device copy.
        let mine: Vec<usize> = (0..h.weights.len()).filter(|&i| h.weights[i].device as usize == sub).collect();
        let weights: Vec<CudaSlice<u8>> = mine.iter().map(|&i| stream.clone_htod(artifact.weight_bytes(i))).collect::<Result<_, _>>().map_err(driver_err)?;
        let mut weight_ptrs = vec![0u64; h.weights.len()];
        for (&i, w) in mine.iter().zip(&weights) {
            weight_ptrs[i] = w.device_ptr(&stream).0;
        }
        // Per part of the KV encoding, per layer, keys then values.
        let (layers, parts) = (h.kv_cache.layers as usize, h.kv_cache.encoding.parts().len());
        let mut caches: Vec<CudaSlice<u8>> = Vec::with_capacity(2 * layers * parts);
        for part in 0..parts {
            let bytes = h.kv_cache.part_layer_bytes(part, h.max_length).unwrap_or(u64::MAX).max(1) as usize;
            for _ in 0..2 * layers {
                caches.push(stream.alloc_zeros::<u8>(bytes).map_err(driver_err)?);
            }
        }
        let max_seq = m.prefill.max_seq.max(1) as usize;
        let tokens = stream.alloc_zeros::<i32>(max_seq).map_err(driver_err)?;
        let positions = stream.alloc_zeros::<i32>(max_seq).map_err(driver_err)?;
        let dims = stream.alloc_zeros::<i64>(1).map_err(driver_err)?;

        let cache_ptrs: Vec<u64> = caches.iter().map(|c| c.device_ptr(&stream).0).collect();
        let (tokens_ptr, positions_ptr) = (tokens.device_ptr(&stream).0, positions.device_ptr(&stream).0);
        let plan = |plan: &Plan| -> Result<GpuPlan, GpuError> {
            let arena = stream.alloc_zeros::<u8>(plan.arena_bytes.max(1) as usize).map_err(driver_err)?;
            let base = arena.device_ptr(&stream).0;
            let mut args = Vec::with_capacity(plan.launches.len());
            for l in &plan.launches {
                let table: Vec<u64> = l
                    .args
                    .iter()
                    .map(|a| match *a {
                        BufferRef::Arena { offset } => base + offset,
                        BufferRef::Weight(i) => weight_ptrs[i as usize],
                        BufferRef::Tokens => tokens_ptr,
                        BufferRef::Positions => positions_ptr,
                        BufferRef::KeyCache { layer, part } => cache_ptrs[part as usize * 2 * layers + layer as usize],
                        BufferRef::ValueCache { layer, part } => cache_ptrs[part as usize * 2 * layers + layers + layer as usize],
                        BufferRef::Slots | BufferRef::RowSequences | BufferRef::BlockTables | BufferRef::LogitRows | BufferRef::SequenceStarts => {
                            unreachable!("batch steps' inputs are in batch plans, which the GPU session does not run")
                        }
                    })
                    .collect();
                args.push(stream.clone_htod(&table).map_err(driver_err)?);
            }
            let functions = plan.launches.iter().map(|l| functions[l.kernel as usize].clone()).collect();
            let threads_per_task = plan.launches.iter().map(|l| h.kernels[l.kernel as usize].gpu_threads_per_task).collect();
            let task_split = plan.launches.iter().map(|l| h.kernels[l.kernel as usize].gpu_task_split).collect();
            Ok(GpuPlan { arena, args, functions, threads_per_task, task_split })
        };
        let (prefill, decode) = (plan(&m.prefill)?, plan(&m.decode)?);
        let prefill_last = m.prefill_last.as_ref().map(plan).transpose()?;
        stream.synchronize().map_err(driver_err)?;
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        Ok(GpuDevice { ctx, stream, prefill, decode, prefill_last, decode_graph: None, _weights: weights, _caches: caches, tokens, positions, dims, name })
    }

    /// Enqueues every launch of a step of `seq` tokens (asynchronous).
    fn launch_all(&self, plan: &Plan, which: Which, seq: u64) -> Result<(), GpuError> {
        (0..plan.launches.len()).try_for_each(|index| self.launch(plan, which, index, seq))
    }

    /// Captures the launches of a step of `seq` tokens into a graph without
    /// running them. The capture is always ended, also when a launch fails.
    fn capture(&self, plan: &Plan, which: Which, seq: u64) -> Result<CudaGraph, GpuError> {
        self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(driver_err)?;
        let enqueued = self.launch_all(plan, which, seq);
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(driver_err);
        enqueued?;
        let graph = graph?.ok_or_else(|| GpuError::Driver("the decode plan's capture gave no graph".into()))?;
        graph.upload().map_err(driver_err)?;
        Ok(graph)
    }

    /// Runs one decode step of the plan: replays its graph, capturing it first.
    fn replay_decode(&mut self, plan: &Plan) -> Result<(), GpuError> {
        if self.decode_graph.is_none() {
            self.decode_graph = Some(self.capture(plan, Which::Decode, 1)?);
        }
        self.decode_graph.as_ref().expect("captured just above").launch().map_err(driver_err)
    }

    /// Device-to-device copy bandwidth in GB/s, counting the bytes read and the
    /// bytes written (what a decode step's weight reads can at best approach):
    /// the best of five copies of 256 MiB, timed with events.
    fn copy_bandwidth(&self) -> Result<f64, GpuError> {
        const BYTES: usize = 256 << 20;
        let s = &self.stream;
        let src = s.alloc_zeros::<u8>(BYTES).map_err(driver_err)?;
        let mut dst = s.alloc_zeros::<u8>(BYTES).map_err(driver_err)?;
        s.memcpy_dtod(&src, &mut dst).map_err(driver_err)?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (self.ctx.new_event(timing).map_err(driver_err)?, self.ctx.new_event(timing).map_err(driver_err)?);
        let mut best = 0.0f64;
        for _ in 0..5 {
            start.record(s).map_err(driver_err)?;
            s.memcpy_dtod(&src, &mut dst).map_err(driver_err)?;
            end.record(s).map_err(driver_err)?;
            let ms = start.elapsed_ms(&end).map_err(driver_err)? as f64;
            best = best.max(2.0 * BYTES as f64 / (ms / 1e3) / 1e9);
        }
        Ok(best)
    }

    fn state(&self, which: Which) -> &GpuPlan {
        match which {
            Which::Prefill => &self.prefill,
            Which::Decode => &self.decode,
            Which::PrefillLast => self.prefill_last.as_ref().expect("chosen only when the artifact has it"),
        }
    }

    /// Copies a step's token ids, positions and length to the device.
    fn upload(&mut self, ids: &[u32], position: u64) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let seq = ids.len() as u64;
        let tokens: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let positions: Vec<i32> = (position..position + seq).map(|p| p as i32).collect();
        let s = &self.stream;
        s.memcpy_htod(&tokens, &mut self.tokens.slice_mut(..tokens.len())).map_err(driver_err)?;
        s.memcpy_htod(&positions, &mut self.positions.slice_mut(..positions.len())).map_err(driver_err)?;
        s.memcpy_htod(&[seq as i64], &mut self.dims).map_err(driver_err)
    }

    /// Enqueues launch `index` of the step's plan (asynchronous).
    fn launch(&self, plan: &Plan, which: Which, index: usize, seq: u64) -> Result<(), GpuError> {
        let state = self.state(which);
        let tasks = gpu_tasks(plan.launches[index].tasks.eval(seq), state.task_split[index]);
        if tasks == 0 {
            return Ok(());
        }
        let (begin, end) = (0u64, tasks);
        let mut builder = self.stream.launch_builder(&state.functions[index]);
        builder.arg(&state.args[index]).arg(&self.dims).arg(&begin).arg(&end);
        // SAFETY: the kernel's ABI is (args, dims, task_begin, task_end); the
        // compiler sized every buffer in the table for this plan and step.
        unsafe { builder.launch(launch_config(tasks, state.threads_per_task[index])) }.map_err(driver_err)?;
        Ok(())
    }

    /// Waits for the step and copies `n` f32 of the plan's logits to the host.
    fn read_logits(&self, plan: &Plan, which: Which, n: usize) -> Result<Vec<f32>, GpuError> {
        let BufferRef::Arena { offset } = plan.logits else { unreachable!("the compiler places logits in the arena") };
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let mut bytes = vec![0u8; n * 4];
        self.stream.memcpy_dtoh(&self.state(which).arena.slice(offset as usize..offset as usize + n * 4), &mut bytes).map_err(driver_err)?;
        self.stream.synchronize().map_err(driver_err)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

/// f32 logits a step of `seq` tokens returns.
fn logits_len(h: &crate::format::Header, seq: u64) -> usize {
    match h.model.embedding_width {
        Some(width) => width as usize,
        None => (seq * h.model.vocab_size) as usize,
    }
}

/// Whether NCCL (`libnccl.so`) can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn nccl_err(e: impl std::fmt::Debug) -> GpuError {
    GpuError::Driver(format!("NCCL: {e:?}"))
}

/// One running sequence on one GPU, or on a mesh of GPUs with one sub-model per
/// device, driven from one host thread: every launch is enqueued on each device's
/// stream in turn, and each collective is one NCCL group call (an all-reduce, or
/// an all-gather that a strided copy lays out as `[rows, devices * cols]` when
/// `rows > 1`).
pub struct GpuSession<'a> {
    artifact: &'a Artifact,
    devices: Vec<GpuDevice>,
    /// One NCCL communicator per device (none on one device).
    comms: Vec<cudarc::nccl::sys::ncclComm_t>,
    /// Per device: room for one gathered activation, `[devices][rows][cols]`.
    gather_scratch: Vec<CudaSlice<f32>>,
    pub position: u64,
    pub counts: RunCounts,
    logits: Vec<f32>,
    pub device_name: String,
    /// Whether decode steps replay a CUDA graph (one device, no collectives).
    graphs: bool,
}

/// Whether `MAXRUN_CUDA_GRAPHS` leaves CUDA graphs on (anything but `0`, `off`, `false`).
pub fn graphs_enabled(setting: Option<&str>) -> bool {
    !matches!(setting.map(str::trim), Some("0" | "off" | "false"))
}

impl std::fmt::Debug for GpuSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSession").field("device", &self.device_name).field("position", &self.position).finish()
    }
}

impl Drop for GpuSession<'_> {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: each communicator was created by comm_init_all and is freed once.
            let _ = unsafe { cudarc::nccl::result::comm_destroy(c) };
        }
    }
}

impl<'a> GpuSession<'a> {
    /// Opens GPU `ordinal` for a one-device artifact: loads the matching PTX
    /// module and uploads the weights.
    pub fn new(artifact: &'a Artifact, ordinal: usize) -> Result<Self, GpuError> {
        probe()?;
        let device = GpuDevice::open(artifact, ordinal, 0)?;
        let device_name = device.name.clone();
        let graphs = graphs_enabled(std::env::var("MAXRUN_CUDA_GRAPHS").ok().as_deref());
        Ok(GpuSession { artifact, devices: vec![device], comms: vec![], gather_scratch: vec![], position: 0, counts: RunCounts::default(), logits: Vec::new(), device_name, graphs })
    }

    /// Opens the mesh's GPUs (the ordinals the artifact names), one sub-model each,
    /// and one NCCL communicator per device.
    pub fn new_mesh(artifact: &'a Artifact) -> Result<Self, GpuError> {
        probe()?;
        if !nccl_present() {
            return Err(GpuError::Driver("NCCL (libnccl.so) was not found; GPU meshes exchange activations through it: install NCCL, or recompile with --devices cpu:0,1".into()));
        }
        let h = &artifact.header;
        let ordinals: Vec<usize> = h.mesh.ordinals.iter().map(|&o| o as usize).collect();
        let available = CudaContext::device_count().map_err(driver_err)? as usize;
        if let Some(&missing) = ordinals.iter().find(|&&o| o >= available) {
            return Err(GpuError::Driver(format!("the mesh names GPU {missing} but this machine has {available}")));
        }
        let first = &h.sub_models[0];
        for m in &h.sub_models[1..] {
            let steps = |p: &Plan| p.collectives.iter().map(|c| (c.before_launch, c.op.clone())).collect::<Vec<_>>();
            let last = |m: &SubModel| m.prefill_last.as_ref().map(steps);
            if steps(&m.prefill) != steps(&first.prefill) || steps(&m.decode) != steps(&first.decode) || last(m) != last(first) {
                return Err(GpuError::Driver("the sub-models' collectives differ; recompile the artifact".into()));
            }
        }
        let devices: Vec<GpuDevice> = ordinals.iter().enumerate().map(|(d, &o)| GpuDevice::open(artifact, o, d)).collect::<Result<_, _>>()?;
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        let list: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        // SAFETY: `comms` has room for one communicator per listed device.
        unsafe { cudarc::nccl::result::comm_init_all(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) }.map_err(nccl_err)?;
        let largest = [Some(&first.prefill), Some(&first.decode), first.prefill_last.as_ref()]
            .into_iter()
            .flatten()
            .flat_map(|p| p.collectives.iter().map(|c| c.op.output_elems(p.max_seq, h.sub_models.len() as u64)))
            .max()
            .unwrap_or(0)
            .max(1) as usize;
        let gather_scratch = devices.iter().map(|d| d.stream.alloc_zeros::<f32>(largest)).collect::<Result<_, _>>().map_err(driver_err)?;
        let device_name = format!("{} x {}", devices.len(), devices[0].name);
        // Collectives are NCCL group calls between the launches: a mesh runs eagerly.
        Ok(GpuSession { artifact, devices, comms, gather_scratch, position: 0, counts: RunCounts::default(), logits: Vec::new(), device_name, graphs: false })
    }

    /// The first device's copy bandwidth in GB/s (bytes read plus bytes written).
    pub fn copy_bandwidth(&self) -> Result<f64, GpuError> {
        self.devices[0].copy_bandwidth()
    }

    /// Forgets the sequence.
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Keeps only the first `len` tokens of the sequence.
    pub fn truncate(&mut self, len: u64) {
        self.position = self.position.min(len);
    }

    /// Appends `ids` (on every device) and returns their logits (as `Session::forward`).
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        let h = &self.artifact.header;
        crate::session::check_tokens(h, self.position, ids)?;
        self.logits.clear();
        if ids.len() == 1 {
            self.step(ids, Which::Decode).map_err(|e| RunError::Gpu(e.to_string()))?;
        } else {
            for chunk in ids.chunks(h.main().prefill.max_seq as usize) {
                self.step(chunk, Which::Prefill).map_err(|e| RunError::Gpu(e.to_string()))?;
            }
        }
        Ok(&self.logits)
    }

    /// Appends `ids` and returns the last token's logits only (as
    /// `Session::forward_last`): prompts run the last-token plan when the artifact
    /// has one.
    pub fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        let h = &self.artifact.header;
        if ids.len() <= 1 || h.main().prefill_last.is_none() || h.model.embedding_width.is_some() {
            let vocab = h.model.vocab_size as usize;
            let all = self.forward(ids)?.len();
            return Ok(&self.logits[all.saturating_sub(vocab)..]);
        }
        crate::session::check_tokens(h, self.position, ids)?;
        for chunk in ids.chunks(h.main().prefill.max_seq as usize) {
            self.logits.clear();
            self.step(chunk, Which::PrefillLast).map_err(|e| RunError::Gpu(e.to_string()))?;
        }
        Ok(&self.logits)
    }

    fn step(&mut self, ids: &[u32], which: Which) -> Result<(), GpuError> {
        let h = &self.artifact.header;
        let plans: Vec<&Plan> = h.sub_models.iter().map(|m| which.plan(m)).collect();
        let seq = ids.len() as u64;
        for d in &mut self.devices {
            d.upload(ids, self.position)?;
        }
        let launches = plans[0].launches.len();
        if which == Which::Decode && self.graphs && self.devices.len() == 1 && plans[0].collectives.is_empty() {
            self.devices[0].replay_decode(plans[0])?;
            return self.finish_step(&plans, which, seq);
        }
        let mut next = 0;
        for index in 0..=launches {
            while plans[0].collectives.get(next).is_some_and(|c| c.before_launch as usize == index) {
                self.exchange(&plans, which, next, seq)?;
                next += 1;
            }
            if index < launches {
                for (d, dev) in self.devices.iter().enumerate() {
                    dev.ctx.bind_to_thread().map_err(driver_err)?;
                    dev.launch(plans[d], which, index, seq)?;
                }
            }
        }
        self.finish_step(&plans, which, seq)
    }

    /// Reads the step's logits back and counts the step.
    fn finish_step(&mut self, plans: &[&Plan], which: Which, seq: u64) -> Result<(), GpuError> {
        let h = &self.artifact.header;
        let n = if which == Which::PrefillLast { h.model.vocab_size as usize } else { logits_len(h, seq) };
        self.logits.extend(self.devices[0].read_logits(plans[0], which, n)?);
        self.position += seq;
        if which != Which::Decode {
            self.counts.prefill += 1;
        } else {
            self.counts.decode += 1;
        }
        Ok(())
    }

    /// Collective `which` of the step's plans on every device: one NCCL group.
    fn exchange(&self, plans: &[&Plan], plan: Which, which: usize, seq: u64) -> Result<(), GpuError> {
        use cudarc::nccl::{result, sys};
        let n = self.devices.len();
        let address = |d: usize, r: &BufferRef| match *r {
            BufferRef::Arena { offset } => self.devices[d].state(plan).arena_address(&self.devices[d].stream, offset),
            other => unreachable!("collectives use arena buffers, not {other:?}"),
        };
        let op = &plans[0].collectives[which].op;
        let gather_rows = match *op {
            CollectiveOp::AllGather { rows, .. } => rows.eval(seq),
            CollectiveOp::AllReduceSum { .. } => 0,
        };
        result::group_start().map_err(nccl_err)?;
        for d in 0..n {
            let c = &plans[d].collectives[which];
            let (src, dst) = (address(d, &c.input), address(d, &c.output));
            let stream = self.devices[d].stream.cu_stream() as sys::cudaStream_t;
            // SAFETY: the compiler sized both arena buffers for this plan's steps;
            // the scratch holds a whole gathered activation.
            unsafe {
                match c.op {
                    CollectiveOp::AllReduceSum { elems } => result::all_reduce(
                        src as *const _,
                        dst as *mut _,
                        elems.eval(seq) as usize,
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclSum,
                        self.comms[d],
                        stream,
                    ),
                    CollectiveOp::AllGather { rows, cols } => {
                        // One row: NCCL's rank-major result is already `[1, devices * cols]`.
                        let target = if gather_rows == 1 { dst } else { self.gather_scratch[d].device_ptr(&self.devices[d].stream).0 };
                        result::all_gather(src as *const _, target as *mut _, (rows.eval(seq) * cols) as usize, sys::ncclDataType_t::ncclFloat32, self.comms[d], stream)
                    }
                }
            }
            .map_err(nccl_err)?;
        }
        result::group_end().map_err(nccl_err)?;
        if let CollectiveOp::AllGather { cols, .. } = *op {
            if gather_rows > 1 {
                // `[devices][rows][cols]` -> `[rows][devices * cols]`, one row piece at a time.
                for (d, dev) in self.devices.iter().enumerate() {
                    dev.ctx.bind_to_thread().map_err(driver_err)?;
                    let dst = address(d, &plans[d].collectives[which].output);
                    let scratch = self.gather_scratch[d].device_ptr(&dev.stream).0;
                    let piece = cols as usize * 4;
                    for from in 0..n {
                        for r in 0..gather_rows as usize {
                            let src = scratch + ((from * gather_rows as usize + r) * piece) as u64;
                            let to = dst + ((r * n + from) * piece) as u64;
                            // SAFETY: both ranges lie in buffers sized above.
                            unsafe { cudarc::driver::result::memcpy_dtod_async(to, src, piece, dev.stream.cu_stream()) }.map_err(driver_err)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}


/// One GPU as the batched executor's device (`crate::executor::gpu`): the
/// artifact's PTX module loaded, one stream, device memory that lives as long
/// as the device, and decode steps captured into CUDA graphs.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: Vec<CudaFunction>,
    /// Per kernel: GPU threads per task.
    threads_per_task: Vec<u32>,
    allocations: Vec<CudaSlice<u8>>,
    name: String,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and loads the artifact's PTX module for it.
    pub fn open(artifact: &Artifact, ordinal: usize) -> Result<Self, GpuError> {
        probe()?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        // SAFETY: every buffer is used on this device's one stream only (see `GpuDevice::open`).
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().map_err(driver_err)?;
        let h = &artifact.header;
        let module_index = pick_module(&h.gpu_archs, cc).ok_or_else(|| GpuError::NoModuleForDevice { archs: h.gpu_archs.clone(), major: cc.0, minor: cc.1 })?;
        let ptx = std::str::from_utf8(artifact.section(SectionKind::Ptx(module_index as u32))).map_err(driver_err)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver_err)?;
        let functions = h.kernels.iter().map(|k| module.load_function(&k.symbol)).collect::<Result<_, _>>().map_err(driver_err)?;
        let stream = ctx.new_stream().map_err(driver_err)?;
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        Ok(CudaDevice { ctx, stream, functions, threads_per_task: h.kernels.iter().map(|k| k.gpu_threads_per_task).collect(), allocations: vec![], name })
    }
}

fn run_err(e: impl std::fmt::Debug) -> RunError {
    RunError::Gpu(format!("{e:?}"))
}

impl crate::executor::gpu::GpuDevice for CudaDevice {
    type Graph = CudaGraph;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn free_memory(&self) -> Option<u64> {
        self.ctx.bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn alloc(&mut self, bytes: usize) -> Result<u64, RunError> {
        self.ctx.bind_to_thread().map_err(run_err)?;
        let a = self.stream.alloc_zeros::<u8>(bytes).map_err(run_err)?;
        let at = a.device_ptr(&self.stream).0;
        self.allocations.push(a);
        Ok(at)
    }

    fn upload(&mut self, dst: u64, data: &[u8]) -> Result<(), RunError> {
        self.ctx.bind_to_thread().map_err(run_err)?;
        // SAFETY: `dst` lies in an allocation of this device at least `data.len()` long (the executor's layout).
        // From pageable memory the driver stages the data before the call
        // returns (CUDA's API synchronization behavior), so `data` may go away
        // after it, while the copy stays in order on the stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }.map_err(run_err)
    }

    fn download(&mut self, src: u64, out: &mut [u8]) -> Result<(), RunError> {
        self.ctx.bind_to_thread().map_err(run_err)?;
        // SAFETY: `src` lies in an allocation of this device at least `out.len()` long.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }.map_err(run_err)?;
        self.stream.synchronize().map_err(run_err)
    }

    fn launch(&mut self, kernel: u32, args: u64, dims: u64, tasks: u64) -> Result<(), RunError> {
        let (begin, end) = (0u64, tasks);
        let mut builder = self.stream.launch_builder(&self.functions[kernel as usize]);
        builder.arg(&args).arg(&dims).arg(&begin).arg(&end);
        // SAFETY: the kernel's ABI is (args, dims, task_begin, task_end), the
        // argument table at `args` holds its buffers' device addresses, sized by
        // the compiler for this plan's steps.
        unsafe { builder.launch(launch_config(tasks, self.threads_per_task[kernel as usize])) }.map_err(run_err)?;
        Ok(())
    }

    fn begin_capture(&mut self) -> Result<(), RunError> {
        self.ctx.bind_to_thread().map_err(run_err)?;
        self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(run_err)
    }

    fn end_capture(&mut self) -> Result<CudaGraph, RunError> {
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(run_err)?;
        let graph = graph.ok_or_else(|| RunError::Gpu("the capture of a decode step gave no graph".into()))?;
        graph.upload().map_err(run_err)?;
        Ok(graph)
    }

    fn replay(&mut self, graph: &CudaGraph) -> Result<(), RunError> {
        graph.launch().map_err(run_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_module_not_newer_than_the_device_is_loaded() {
        let archs = vec!["sm_80".to_string(), "sm_90".to_string()];
        assert_eq!(pick_module(&archs, (9, 0)), Some(1));
        assert_eq!(pick_module(&archs, (8, 9)), Some(0), "an Ada GPU JIT-compiles the sm_80 PTX");
        assert_eq!(pick_module(&archs, (12, 0)), Some(1));
        assert_eq!(pick_module(&archs, (7, 5)), None);
    }

    #[test]
    fn cuda_graphs_are_on_unless_turned_off() {
        assert!(graphs_enabled(None));
        assert!(graphs_enabled(Some("1")));
        for off in ["0", "off", "false", " 0 "] {
            assert!(!graphs_enabled(Some(off)), "{off}");
        }
    }

    #[test]
    fn a_split_kernel_launches_its_share_of_tasks_per_plan_task() {
        assert_eq!(gpu_tasks(3, 1), 3);
        assert_eq!(gpu_tasks(3, 32), 96);
        assert_eq!(gpu_tasks(0, 32), 0);
        assert_eq!(gpu_tasks(u64::MAX, 2), u64::MAX, "a corrupt count saturates");
    }

    #[test]
    fn every_task_gets_its_threads() {
        for per_task in [1u32, 32, 128] {
            let c = launch_config(1000, per_task);
            assert_eq!(c.block_dim.0, BLOCK_THREADS);
            // Blocks hold whole tasks: a four-warp task synchronizes with `bar.sync`,
            // which waits for the whole block.
            assert_eq!(BLOCK_THREADS % per_task, 0, "blocks hold whole tasks");
            let want = 1000 * per_task as u64;
            assert!(c.grid_dim.0 as u64 * BLOCK_THREADS as u64 >= want);
            assert!((c.grid_dim.0 as u64 - 1) * (BLOCK_THREADS as u64) < want);
        }
        assert_eq!(launch_config(0, 32).grid_dim.0, 1);
    }
}

