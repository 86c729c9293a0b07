//! The CUDA execution path (feature `cuda`, on by default; it links nothing: cudarc
//! loads `libcuda.so` at run time, so maxrun builds and runs without CUDA installed).
//!
//! [`GpuSession`] mirrors the CPU `Session`: it loads the artifact's PTX module
//! for the device, copies every weight to the device once, keeps the KV caches and
//! the activation arenas on the device, runs a plan's launches in order on one
//! stream (GPU thread `i` of a launch runs task `i`, the kernels' ABI), and copies
//! only the logits back; sampling stays on the host.
//!
//! The argument table of each launch is built once per plan: every buffer of a
//! step (arena, weights, caches, tokens, positions) has a fixed device address,
//! and only the contents of `tokens`, `positions` and `dims` change per step.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use crate::artifact::Artifact;
use crate::format::{BufferRef, Plan, SectionKind};
use crate::session::{RunCounts, SessionError};

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

/// The grid of a launch of `tasks` tasks (one thread each).
pub fn launch_config(tasks: u64) -> LaunchConfig {
    LaunchConfig { grid_dim: (tasks.div_ceil(BLOCK_THREADS as u64).max(1) as u32, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 }
}

struct GpuPlan {
    arena: CudaSlice<u8>,
    /// Per launch: the device array of argument pointers.
    args: Vec<CudaSlice<u64>>,
    functions: Vec<CudaFunction>,
}

/// One running sequence on the GPU.
pub struct GpuSession<'a> {
    artifact: &'a Artifact,
    stream: Arc<CudaStream>,
    prefill: GpuPlan,
    decode: GpuPlan,
    _weights: Vec<CudaSlice<u8>>,
    _caches: Vec<CudaSlice<f32>>,
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    dims: CudaSlice<i64>,
    pub position: u64,
    pub counts: RunCounts,
    logits: Vec<f32>,
    /// The device's name, for the stats line.
    pub device_name: String,
}

impl std::fmt::Debug for GpuSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSession").field("device", &self.device_name).field("position", &self.position).finish()
    }
}

impl<'a> GpuSession<'a> {
    /// Opens GPU `ordinal`, loads the matching PTX module and uploads the weights.
    pub fn new(artifact: &'a Artifact, ordinal: usize) -> Result<Self, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        if CudaContext::device_count().map_err(driver_err)? < 1 {
            return Err(GpuError::NoDevice);
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err)?;
        let cc = ctx.compute_capability().map_err(driver_err)?;
        let h = &artifact.header;
        let module_index = pick_module(&h.gpu_archs, cc).ok_or_else(|| GpuError::NoModuleForDevice { archs: h.gpu_archs.clone(), major: cc.0, minor: cc.1 })?;
        let ptx = std::str::from_utf8(artifact.section(SectionKind::Ptx(module_index as u32))).map_err(driver_err)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver_err)?;
        let functions: Vec<CudaFunction> = h.kernels.iter().map(|k| module.load_function(&k.symbol)).collect::<Result<_, _>>().map_err(driver_err)?;
        let stream = ctx.default_stream();

        let weights: Vec<CudaSlice<u8>> =
            (0..h.weights.len()).map(|i| stream.clone_htod(artifact.weight_bytes(i))).collect::<Result<_, _>>().map_err(driver_err)?;
        let cache_len = (h.max_length * h.kv_cache.row_elems).max(1) as usize;
        let layers = h.kv_cache.layers as usize;
        let caches: Vec<CudaSlice<f32>> = (0..2 * layers).map(|_| stream.alloc_zeros::<f32>(cache_len)).collect::<Result<_, _>>().map_err(driver_err)?;
        let max_seq = h.main().prefill.max_seq.max(1) as usize;
        let tokens = stream.alloc_zeros::<i32>(max_seq).map_err(driver_err)?;
        let positions = stream.alloc_zeros::<i32>(max_seq).map_err(driver_err)?;
        let dims = stream.alloc_zeros::<i64>(1).map_err(driver_err)?;

        let address = |s: &CudaSlice<u8>| s.device_ptr(&stream).0;
        let weight_ptrs: Vec<u64> = weights.iter().map(address).collect();
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
                        BufferRef::KeyCache(layer) => cache_ptrs[layer as usize],
                        BufferRef::ValueCache(layer) => cache_ptrs[layers + layer as usize],
                    })
                    .collect();
                args.push(stream.clone_htod(&table).map_err(driver_err)?);
            }
            let functions = plan.launches.iter().map(|l| functions[l.kernel as usize].clone()).collect();
            Ok(GpuPlan { arena, args, functions })
        };
        let (prefill, decode) = (plan(&h.main().prefill)?, plan(&h.main().decode)?);
        stream.synchronize().map_err(driver_err)?;
        let device_name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        Ok(GpuSession {
            artifact,
            stream,
            prefill,
            decode,
            _weights: weights,
            _caches: caches,
            tokens,
            positions,
            dims,
            position: 0,
            counts: RunCounts::default(),
            logits: Vec::new(),
            device_name,
        })
    }

    /// Forgets the sequence.
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Keeps only the first `len` tokens of the sequence.
    pub fn truncate(&mut self, len: u64) {
        self.position = self.position.min(len);
    }

    /// Appends `ids` and returns their logits (as `Session::forward`).
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32], SessionError> {
        let h = &self.artifact.header;
        crate::session::check_tokens(h, self.position, ids)?;
        self.logits.clear();
        if ids.len() == 1 {
            self.step(ids, false).map_err(|e| SessionError::Gpu(e.to_string()))?;
        } else {
            for chunk in ids.chunks(h.main().prefill.max_seq as usize) {
                self.step(chunk, true).map_err(|e| SessionError::Gpu(e.to_string()))?;
            }
        }
        Ok(&self.logits)
    }

    fn step(&mut self, ids: &[u32], prefill: bool) -> Result<(), GpuError> {
        let header = &self.artifact.header;
        let (plan, state) = if prefill { (&header.main().prefill, &self.prefill) } else { (&header.main().decode, &self.decode) };
        let seq = ids.len() as u64;
        let tokens: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let positions: Vec<i32> = (self.position..self.position + seq).map(|p| p as i32).collect();
        let s = &self.stream;
        s.memcpy_htod(&tokens, &mut self.tokens.slice_mut(..tokens.len())).map_err(driver_err)?;
        s.memcpy_htod(&positions, &mut self.positions.slice_mut(..positions.len())).map_err(driver_err)?;
        s.memcpy_htod(&[seq as i64], &mut self.dims).map_err(driver_err)?;
        for ((launch, function), args) in plan.launches.iter().zip(&state.functions).zip(&state.args) {
            let tasks = launch.tasks.eval(seq);
            if tasks == 0 {
                continue;
            }
            let (begin, end) = (0u64, tasks);
            let mut builder = s.launch_builder(function);
            builder.arg(args).arg(&self.dims).arg(&begin).arg(&end);
            // SAFETY: the kernel's ABI is (args, dims, task_begin, task_end); the
            // compiler sized every buffer in the table for this plan and step.
            unsafe { builder.launch(launch_config(tasks)) }.map_err(driver_err)?;
        }
        let n = match header.model.embedding_width {
            Some(width) => width as usize,
            None => (seq * header.model.vocab_size) as usize,
        };
        let BufferRef::Arena { offset } = plan.logits else { unreachable!("the compiler places logits in the arena") };
        let mut bytes = vec![0u8; n * 4];
        s.memcpy_dtoh(&state.arena.slice(offset as usize..offset as usize + n * 4), &mut bytes).map_err(driver_err)?;
        s.synchronize().map_err(driver_err)?;
        self.logits.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        self.position += seq;
        if prefill {
            self.counts.prefill += 1;
        } else {
            self.counts.decode += 1;
        }
        Ok(())
    }
}

/// Why a mesh of `devices` GPUs does not run in this maxrun: the single-GPU
/// session runs one sub-model; see docs/sharding.md for the NCCL plan.
pub fn mesh_unavailable(devices: usize) -> String {
    format!("running a mesh of {devices} GPU devices (NCCL collectives) is not implemented in this maxrun yet; recompile with --devices cpu:0,1 to run the shards on CPU devices, or --devices gpu:0 for one GPU")
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
    fn every_task_gets_one_thread() {
        let c = launch_config(1000);
        assert_eq!(c.block_dim.0, BLOCK_THREADS);
        assert!(c.grid_dim.0 as u64 * BLOCK_THREADS as u64 >= 1000);
        assert!((c.grid_dim.0 as u64 - 1) * (BLOCK_THREADS as u64) < 1000);
        assert_eq!(launch_config(0).grid_dim.0, 1);
    }
}

