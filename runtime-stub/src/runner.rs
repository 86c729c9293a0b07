//! Where an artifact runs (`--device auto|cpu|gpu[:N]`) and one interface over the
//! CPU [`Session`] and, with the `cuda` feature, the GPU session.
//!
//! `auto` (the default) uses the GPU when the artifact has PTX and a CUDA driver
//! and device are present, and the CPU code otherwise, saying why on stderr when
//! the artifact had GPU code. A GPU-only artifact on a machine without a usable
//! GPU is an error that says what is missing and how to add a CPU fallback.

use std::path::PathBuf;

use crate::artifact::{Artifact, ArtifactError};
use crate::executor::{DraftExecutor, EncodeExecutor, Executor, ProfileRow, RunCounts, RunError, SequenceExecutor};
use crate::session::Session;

/// The device a run asks for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Gpu(usize),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu(0)),
            _ => match s.strip_prefix("gpu:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Gpu(n)),
                _ => Err(format!("`{s}` is not a device; use auto, cpu, gpu or gpu:N")),
            },
        }
    }
}

/// Why no session could be opened.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(
        "{path}: {reason}, and the artifact has no CPU code (it was compiled for cuda:{archs} only); run it on a \
         machine with an NVIDIA GPU and driver, or recompile with a CPU fallback: --target cpu,cuda:{first}",
        archs = archs.join(","), first = archs.first().map(String::as_str).unwrap_or("sm_90")
    )]
    NoGpuNoCpu { path: PathBuf, reason: String, archs: Vec<String> },
    #[error("{path}: --device gpu: {reason}; the artifact also has CPU code: run it with --device cpu (or auto)")]
    NoGpu { path: PathBuf, reason: String },
    #[error("{path}: --device gpu: the artifact has no GPU code; recompile with --target cpu,cuda:sm_90 (or run it with --device cpu)")]
    NoGpuCode { path: PathBuf },
    #[error("{path}: the artifact is split over the device mesh `{mesh}`: {reason}")]
    Mesh { path: PathBuf, mesh: String, reason: String },
}

/// A session on the CPU or the GPU.
// One runner per process: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Runner<'a> {
    Cpu(Session<'a>),
    /// A sharded artifact on a mesh of CPU devices.
    Mesh(crate::mesh_session::MeshSession<'a>),
    #[cfg(feature = "cuda")]
    Gpu(crate::gpu::GpuSession<'a>),
}

impl std::fmt::Debug for Runner<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Why the GPU path is unavailable here, or `Ok` with a GPU session.
#[cfg(feature = "cuda")]
fn open_gpu<'a>(artifact: &'a Artifact, ordinal: usize) -> Result<Runner<'a>, String> {
    crate::gpu::GpuSession::new(artifact, ordinal).map(Runner::Gpu).map_err(|e| e.to_string())
}

/// A session over a mesh of GPUs, or why there is none here.
#[cfg(feature = "cuda")]
fn open_gpu_mesh<'a>(artifact: &'a Artifact) -> Result<Runner<'a>, String> {
    crate::gpu::GpuSession::new_mesh(artifact).map(Runner::Gpu).map_err(|e| e.to_string())
}

/// Why a build without `cuda` cannot run GPU devices.
#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this maxrun was built without the `cuda` feature, which GPU devices need; rebuild it with `cargo build -p maxrun --features cuda`";

#[cfg(not(feature = "cuda"))]
fn open_gpu_mesh<'a>(_artifact: &'a Artifact) -> Result<Runner<'a>, String> {
    Err(NO_CUDA.into())
}

#[cfg(not(feature = "cuda"))]
fn open_gpu<'a>(_artifact: &'a Artifact, _ordinal: usize) -> Result<Runner<'a>, String> {
    Err("this maxrun was built without the `cuda` feature".into())
}

impl<'a> Runner<'a> {
    /// Opens a session on `device`; also returns a note for stderr when `auto`
    /// fell back from GPU code to CPU code.
    pub fn open(artifact: &'a Artifact, threads: usize, device: Device) -> Result<(Self, Option<String>), RunnerError> {
        let h = &artifact.header;
        let has_gpu = !h.gpu_archs.is_empty();
        let path = artifact.path.clone();
        if h.sub_models.len() > 1 {
            return Self::open_mesh(artifact, threads, device);
        }
        match device {
            Device::Cpu => Ok((Runner::Cpu(Session::new(artifact, threads)?), None)),
            Device::Gpu(_) if !has_gpu => Err(RunnerError::NoGpuCode { path }),
            Device::Gpu(n) => open_gpu(artifact, n).map(|r| (r, None)).map_err(|reason| {
                if h.has_cpu_code() {
                    RunnerError::NoGpu { path, reason }
                } else {
                    RunnerError::NoGpuNoCpu { path, reason, archs: h.gpu_archs.clone() }
                }
            }),
            Device::Auto if !has_gpu => Ok((Runner::Cpu(Session::new(artifact, threads)?), None)),
            Device::Auto => match open_gpu(artifact, 0) {
                Ok(r) => Ok((r, None)),
                Err(reason) if h.has_cpu_code() => {
                    Ok((Runner::Cpu(Session::new(artifact, threads)?), Some(format!("{reason}; running the artifact's CPU code"))))
                }
                Err(reason) => Err(RunnerError::NoGpuNoCpu { path, reason, archs: h.gpu_archs.clone() }),
            },
        }
    }

    /// A session over every sub-model of a sharded artifact.
    fn open_mesh(artifact: &'a Artifact, threads: usize, device: Device) -> Result<(Self, Option<String>), RunnerError> {
        use crate::format::DeviceKind;
        let h = &artifact.header;
        let error = |reason: String| RunnerError::Mesh { path: artifact.path.clone(), mesh: h.mesh.spec(), reason };
        match (h.mesh.kind, device) {
            (DeviceKind::Cpu, Device::Cpu | Device::Auto) => Ok((Runner::Mesh(crate::mesh_session::MeshSession::new(artifact, threads)?), None)),
            (DeviceKind::Cpu, Device::Gpu(_)) => {
                Err(error("its sub-models are CPU devices; run it with --device cpu (or auto), or recompile with --devices gpu:0,1".into()))
            }
            (DeviceKind::Gpu, Device::Cpu) => Err(error(
                "its sub-models are GPU devices; run it on a machine with that many GPUs, or recompile with --devices cpu:0,1 for CPU devices".into(),
            )),
            (DeviceKind::Gpu, _) => open_gpu_mesh(artifact).map(|r| (r, None)).map_err(error),
        }
    }

    /// Appends `ids` and returns their logits.
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        match self {
            Runner::Cpu(s) => s.forward(ids),
            Runner::Mesh(s) => s.forward(ids),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => s.forward(ids),
        }
    }

    /// Appends `ids` and returns the last token's logits only (what generation needs).
    pub fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        match self {
            Runner::Cpu(s) => s.forward_last(ids),
            Runner::Mesh(s) => s.forward_last(ids),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => s.forward_last(ids),
        }
    }

    pub fn reset(&mut self) {
        match self {
            Runner::Cpu(s) => s.reset(),
            Runner::Mesh(s) => s.reset(),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => s.reset(),
        }
    }

    pub fn truncate(&mut self, len: u64) {
        match self {
            Runner::Cpu(s) => s.truncate(len),
            Runner::Mesh(s) => s.truncate(len),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => s.truncate(len),
        }
    }

    pub fn counts(&self) -> RunCounts {
        match self {
            Runner::Cpu(s) => s.counts,
            Runner::Mesh(s) => s.counts(),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => s.counts,
        }
    }

    /// CPU worker threads (all devices together; 1 on a GPU).
    pub fn threads(&self) -> usize {
        match self {
            Runner::Cpu(s) => s.threads(),
            Runner::Mesh(s) => s.threads(),
            #[cfg(feature = "cuda")]
            Runner::Gpu(_) => 1,
        }
    }

    /// `threads: N` or `GPU: NAME`, for the stats line.
    pub fn describe(&self) -> String {
        match self {
            Runner::Cpu(s) => format!("threads: {}", s.threads()),
            Runner::Mesh(s) => format!("devices: {}, threads: {}", s.devices(), s.threads()),
            #[cfg(feature = "cuda")]
            Runner::Gpu(s) => format!("GPU: {}", s.device_name),
        }
    }

    /// The CPU session, for what only it has (`--profile`, `--check-nan`).
    pub fn cpu(&mut self) -> Option<&mut Session<'a>> {
        match self {
            Runner::Cpu(s) => Some(s),
            Runner::Mesh(_) => None,
            #[cfg(feature = "cuda")]
            Runner::Gpu(_) => None,
        }
    }
}

impl SequenceExecutor for Runner<'_> {
    fn forward(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        Runner::forward(self, ids)
    }

    fn forward_last(&mut self, ids: &[u32]) -> Result<&[f32], RunError> {
        Runner::forward_last(self, ids)
    }

    fn truncate(&mut self, len: u64) {
        Runner::truncate(self, len)
    }

    fn reset(&mut self) {
        Runner::reset(self)
    }

    fn counts(&self) -> RunCounts {
        Runner::counts(self)
    }

    fn threads(&self) -> usize {
        Runner::threads(self)
    }

    fn describe(&self) -> String {
        Runner::describe(self)
    }

    fn enable_profile(&mut self) {
        if let Some(cpu) = self.cpu() {
            cpu.enable_profile();
        }
    }

    fn profile(&self) -> Vec<ProfileRow> {
        match self {
            Runner::Cpu(s) => s.profile(),
            _ => Vec::new(),
        }
    }
}

/// Opens the batched executor of `artifact` on `device` with a KV pool of
/// `kv_bytes` bytes (`None`: the executor's default): the CPU, a CPU mesh for a
/// sharded artifact, or the GPU. `auto` takes the GPU when the artifact has GPU
/// code and a GPU is usable, as [`Runner::open`] does, and then also returns
/// a note for stderr when it fell back to the CPU code.
pub fn open_executor<'a>(artifact: &'a Artifact, threads: usize, device: Device, kv_bytes: Option<u64>) -> Result<(Box<dyn Executor + 'a>, Option<String>), RunnerError> {
    let h = &artifact.header;
    let path = artifact.path.clone();
    let has_gpu = !h.gpu_archs.is_empty();
    if h.sub_models.len() > 1 {
        use crate::format::DeviceKind;
        let error = |reason: String| RunnerError::Mesh { path: path.clone(), mesh: h.mesh.spec(), reason };
        return match (h.mesh.kind, device) {
            (DeviceKind::Cpu, Device::Cpu | Device::Auto) => Ok((Box::new(crate::executor::mesh::MeshExecutor::new(artifact, threads, kv_bytes)?), None)),
            (DeviceKind::Cpu, Device::Gpu(_)) => Err(error("its sub-models are CPU devices; run it with --device cpu (or auto), or recompile with --devices gpu:0,1".into())),
            (DeviceKind::Gpu, _) => Err(error("batched steps on a GPU mesh are not supported by this maxrun; serve it one request at a time".into())),
        };
    }
    let cpu = || -> Result<Box<dyn Executor + 'a>, RunnerError> { Ok(Box::new(crate::executor::cpu::CpuExecutor::new(artifact, threads, kv_bytes)?)) };
    match device {
        Device::Cpu => Ok((cpu()?, None)),
        Device::Gpu(_) if !has_gpu => Err(RunnerError::NoGpuCode { path }),
        Device::Gpu(n) => open_gpu_executor(artifact, n, kv_bytes).map(|e| (e, None)).map_err(|reason| {
            if h.has_cpu_code() {
                RunnerError::NoGpu { path, reason }
            } else {
                RunnerError::NoGpuNoCpu { path, reason, archs: h.gpu_archs.clone() }
            }
        }),
        Device::Auto if !has_gpu => Ok((cpu()?, None)),
        Device::Auto => match open_gpu_executor(artifact, 0, kv_bytes) {
            Ok(e) => Ok((e, None)),
            Err(reason) if h.has_cpu_code() => Ok((cpu()?, Some(format!("{reason}; running the artifact's CPU code")))),
            Err(reason) => Err(RunnerError::NoGpuNoCpu { path, reason, archs: h.gpu_archs.clone() }),
        },
    }
}

/// Opens a sentence encoder's executor on `device`: its encoder batch plan on
/// the CPU (many inputs per step) where the artifact has one and the CPU runs
/// it, else the single-sequence plans of [`Runner::open`]'s session, one input
/// per step (the GPU, a mesh, an artifact without the plan). Also returns
/// [`Runner::open`]'s note when `auto` fell back from GPU code to CPU code.
pub fn open_encoder<'a>(artifact: &'a Artifact, threads: usize, device: Device) -> Result<(Box<dyn EncodeExecutor + 'a>, Option<String>), RunnerError> {
    let h = &artifact.header;
    let batched_on_cpu = h.sub_models.len() == 1 && h.main().encode_batch.is_some() && h.has_cpu_code();
    let cpu = || -> Result<Box<dyn EncodeExecutor + 'a>, RunnerError> { Ok(Box::new(crate::executor::cpu_encoder::CpuEncoder::new(artifact, threads)?)) };
    let cpu_chosen = match device {
        Device::Cpu => true,
        Device::Auto => h.gpu_archs.is_empty(),
        Device::Gpu(_) => false,
    };
    if batched_on_cpu && cpu_chosen {
        return Ok((cpu()?, None));
    }
    let (runner, note) = Runner::open(artifact, threads, device)?;
    if batched_on_cpu && matches!(runner, Runner::Cpu(_)) {
        // `auto` found no usable GPU and fell back to the CPU code.
        drop(runner);
        return Ok((cpu()?, note));
    }
    Ok((Box::new(crate::executor::OnePerStep::new(runner, h.max_length)), note))
}

/// The executor of a draft model of speculative decoding for `target`:
/// `draft`'s batched executor on `device` (the engine's `DraftModel::of`). Refused, naming the draft's file and what differs,
/// when its vocabulary or tokenizer is not the target's (its drafts would be
/// other tokens), or when it has no batch plans or cannot run here.
pub fn open_draft_executor<'a>(target: &Artifact, draft: &'a Artifact, threads: usize, device: Device, kv_bytes: Option<u64>) -> Result<DraftExecutor<'a>, String> {
    let (t, d) = (&target.header, &draft.header);
    let path = draft.path.display();
    if d.model.embedding_width.is_some() {
        return Err(format!("--draft {path}: a sentence encoder cannot draft tokens; give a text generator with the target's vocabulary"));
    }
    if t.model.vocab_size != d.model.vocab_size {
        return Err(format!("--draft {path}: its vocabulary has {} tokens and the target's ({}) has {}; a draft model must share the target's tokenizer", d.model.vocab_size, target.path.display(), t.model.vocab_size));
    }
    let fingerprint = |a: &Artifact| a.tokenizer_json().map(crate::artifact::tokenizer_fingerprint).ok();
    if fingerprint(target) != fingerprint(draft) {
        return Err(format!("--draft {path}: its tokenizer differs from the target's ({}), so the same ids would be other tokens; draft with a model of the same tokenizer", target.path.display()));
    }
    let (executor, _) = open_executor(draft, threads, device, kv_bytes).map_err(|e| format!("--draft {path}: {e}"))?;
    // Decode steps are bound by reading the weights: their bytes compare the two models' steps.
    let bytes = |a: &Artifact| a.header.total_weight_bytes().max(1) as f64;
    Ok(DraftExecutor { executor, vocab: d.model.vocab_size, relative_cost: bytes(draft) / bytes(target) })
}

/// The GPU executor on GPU `ordinal`, or why there is none here.
#[cfg(feature = "cuda")]
fn open_gpu_executor<'a>(artifact: &'a Artifact, ordinal: usize, kv_bytes: Option<u64>) -> Result<Box<dyn Executor + 'a>, String> {
    let device = crate::gpu::CudaDevice::open(artifact, ordinal).map_err(|e| e.to_string())?;
    let graphs = crate::gpu::graphs_enabled(std::env::var("MAXRUN_CUDA_GRAPHS").ok().as_deref());
    Ok(Box::new(crate::executor::gpu::GpuExecutor::new(artifact, device, kv_bytes, graphs).map_err(|e| e.to_string())?))
}

#[cfg(not(feature = "cuda"))]
fn open_gpu_executor<'a>(_artifact: &'a Artifact, _ordinal: usize, _kv_bytes: Option<u64>) -> Result<Box<dyn Executor + 'a>, String> {
    Err(NO_CUDA.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid artifact split over `mesh` (two sub-models, empty plans,
    /// one PTX section), built from the format types as the writer lays them out.
    fn mesh_artifact(mesh: crate::format::DeviceMesh) -> Artifact {
        mesh_artifact_with(mesh, |_| {}).expect("a valid artifact")
    }

    /// [`mesh_artifact`] with the header changed by `edit` before it is written.
    fn mesh_artifact_with(mesh: crate::format::DeviceMesh, edit: impl Fn(&mut crate::format::Header)) -> Result<Artifact, crate::artifact::ArtifactError> {
        use crate::format::*;
        let plan = Plan { max_seq: 1, arena_bytes: 64, launches: vec![], collectives: vec![], logits: BufferRef::Arena { offset: 0 } };
        let sub = |d: usize| SubModel {
            name: format!("shard{d}"),
            device: format!("{}:{d}", mesh.kind.name()),
            prefill: plan.clone(),
            decode: plan.clone(),
            prefill_last: None,
            batch: None,
            encode_batch: None,
            weight_bytes: 0,
            kv_bytes_per_token: 0,
        };
        let contents: Vec<(SectionKind, Vec<u8>)> =
            vec![(SectionKind::Weights(0), vec![]), (SectionKind::Weights(1), vec![]), (SectionKind::Tokenizer, b"{}".to_vec()), (SectionKind::Ptx(0), b".version 8.0".to_vec())];
        let mut header = Header {
            model: ModelInfo { name: "m".into(), architecture: "LlamaForCausalLM".into(), vocab_size: 8, num_layers: 0, embedding_width: None, experts: None },
            provenance: Provenance {
                maxc_version: String::new(),
                maxc_git_revision: String::new(),
                target_spec: String::new(),
                build_id: String::new(),
                manifest: String::new(),
                flags: vec![],
                inputs: vec![],
            },
            target: TargetInfo { triple: String::new(), cpu: String::new(), required_features: vec![], backend: "llvm".into(), spec: String::new() },
            sections: contents.iter().map(|(kind, bytes)| Section { kind: *kind, offset: 0, len: bytes.len() as u64, checksum: checksum(bytes) }).collect(),
            kernels: vec![],
            weights: vec![],
            sub_models: vec![sub(0), sub(1)],
            mesh,
            kv_cache: KvCacheLayout { layers: 0, row_elems: 0, head_dim: 0, encoding: KvEncoding::Float32 },
            tokenizer: TokenizerInfo { bos_token_id: None, eos_token_ids: vec![] },
            generation: GenerationDefaults::default(),
            max_length: 8,
            gpu_archs: vec!["sm_90".into()],
            batch: None,
            cpu_variants: vec![],
        };
        edit(&mut header);
        let mut at = align_section(encode_header(&header).len() as u64);
        for s in &mut header.sections {
            s.offset = at;
            at = align_section(at + s.len);
        }
        let mut file = encode_header(&header);
        for ((_, bytes), s) in contents.iter().zip(&header.sections) {
            file.resize(s.offset as usize, 0);
            file.extend(bytes);
        }
        file.resize(at as usize, 0);
        Artifact::from_bytes(std::path::Path::new("mesh.mef"), file)
    }

    /// Collectives are checked against the arena at load: a buffer that would run
    /// past it (even through an overflowing count) or an input that is also the
    /// output is refused as corrupt instead of trusted.
    #[test]
    fn collectives_outside_the_arena_are_refused() {
        use crate::format::*;
        let mesh = DeviceMesh { kind: DeviceKind::Cpu, ordinals: vec![0, 1] };
        let step = |op: CollectiveOp, input: u64, output: u64| CollectiveStep { before_launch: 0, op, input: BufferRef::Arena { offset: input }, output: BufferRef::Arena { offset: output }, rows: RowCount::Step };
        let with = |c: CollectiveStep| move |h: &mut Header| h.sub_models[1].decode.collectives = vec![c.clone()];
        let fits = step(CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: 0, fixed: 8 } }, 0, 32);
        assert!(mesh_artifact_with(mesh.clone(), with(fits)).is_ok(), "8 + 8 f32 in a 64-byte arena");
        for bad in [
            step(CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: 0, fixed: 9 } }, 0, 32),
            step(CollectiveOp::AllGather { rows: TaskCount { per_seq: 1, fixed: 0 }, cols: 5 }, 0, 32),
            step(CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: u64::MAX, fixed: 1 } }, 0, 32),
            step(CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: 0, fixed: 1 } }, 8, 8),
        ] {
            let e = mesh_artifact_with(mesh.clone(), with(bad.clone())).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains("collective"), "{bad:?}: {e}");
        }
    }

    /// Launch arguments in the arena must start 16-byte aligned (GPU kernels use
    /// 16-byte vector accesses from a buffer's start), and a kernel's GPU threads
    /// per task must be 1, a warp or four warps; anything else is corrupt.
    #[test]
    fn misaligned_arena_arguments_and_odd_thread_counts_are_refused() {
        use crate::format::*;
        let mesh = DeviceMesh { kind: DeviceKind::Cpu, ordinals: vec![0, 1] };
        let with = |offset: u64, threads: u32| {
            move |h: &mut Header| {
                h.kernels = vec![KernelEntry { symbol: "k".into(), family: "copy".into(), num_params: 1, backend: "llvm".into(), gpu_threads_per_task: threads, gpu_task_split: 1 }];
                let launch = Launch { kernel: 0, args: vec![BufferRef::Arena { offset }], tasks: TaskCount { per_seq: 0, fixed: 1 }, output_elems: TaskCount { per_seq: 0, fixed: 0 }, rows: RowCount::Step };
                h.sub_models[0].decode.launches = vec![launch];
            }
        };
        for (offset, threads) in [(16, 1), (0, 32), (48, 128)] {
            assert!(mesh_artifact_with(mesh.clone(), with(offset, threads)).is_ok(), "offset {offset}, {threads} threads");
        }
        for (offset, threads, what) in [(8, 1, "argument"), (4, 32, "argument"), (0, 64, "threads per task"), (0, 0, "threads per task")] {
            let e = mesh_artifact_with(mesh.clone(), with(offset, threads)).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains(what), "offset {offset}, {threads} threads: {e}");
        }
    }

    /// A GPU mesh on a CPU-only runner (or any runner here: no GPU) is refused
    /// with the mesh named; a build without `cuda` names the missing feature
    /// (scripts/test.sh runs this test in both builds).
    #[test]
    fn gpu_meshes_are_refused_with_the_reason() {
        use crate::format::{DeviceKind, DeviceMesh};
        let a = mesh_artifact(DeviceMesh { kind: DeviceKind::Gpu, ordinals: vec![0, 1] });
        let message = Runner::open(&a, 1, Device::Auto).map(|_| ()).unwrap_err().to_string();
        assert!(message.contains("mesh.mef") && message.contains("`gpu:0,1`"), "{message}");
        if cfg!(feature = "cuda") {
            assert!(message.contains("CUDA") || message.contains("NCCL") || message.contains("GPU"), "{message}");
        } else {
            assert!(message.contains("without the `cuda` feature") && message.contains("--features cuda"), "{message}");
        }
        let message = Runner::open(&a, 1, Device::Cpu).map(|_| ()).unwrap_err().to_string();
        assert!(message.contains("GPU devices") && message.contains("--devices cpu:0,1"), "{message}");
    }

    #[test]
    fn devices_parse() {
        assert_eq!("auto".parse::<Device>(), Ok(Device::Auto));
        assert_eq!("gpu".parse::<Device>(), Ok(Device::Gpu(0)));
        assert_eq!("gpu:3".parse::<Device>(), Ok(Device::Gpu(3)));
        assert!("tpu".parse::<Device>().unwrap_err().contains("auto, cpu, gpu"));
    }
}
