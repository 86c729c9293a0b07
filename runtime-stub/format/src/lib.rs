//! The MEF artifact format: the contract between `maxc` (writer) and `maxrun` (reader).
//! docs/mef.md describes every field; this file is the source of truth.
//!
//! Layout: a fixed 32-byte prelude (magic, format major, minor, header length,
//! header checksum), the bincode-encoded [`Header`], then sections aligned to
//! [`SECTION_ALIGN`], each with an xxh3-64 checksum in the header.

use serde::{Deserialize, Serialize};

/// The first 8 bytes of every artifact.
pub const MAGIC: [u8; 8] = *b"MAXCMEF\0";
/// Incompatible layout changes bump the major version (9: collectives say
/// which row count they follow, so that batch plans of device meshes can hold
/// them; the KV cache is an encoding with parts, each its own buffer; sentence
/// encoders' batch plans, [`SubModel::encode_batch`], and [`BufferRef::SequenceStarts`];
/// 10: a mixed step's logit rows, [`BatchLimits::max_logit_rows`]; 11: a
/// mixture of experts' routing, [`ModelInfo::experts`]).
pub const FORMAT_MAJOR: u32 = 11;
/// Compatible additions bump the minor version (none yet in format 11).
pub const FORMAT_MINOR: u32 = 0;
/// magic (8) + major (4) + minor (4) + header length (8) + header xxh3-64 (8).
pub const PRELUDE_LEN: usize = 32;
/// Sections start at multiples of this, so weights can be mapped zero-copy.
pub const SECTION_ALIGN: u64 = 4096;
/// Headers larger than this are refused as corrupt.
pub const MAX_HEADER_LEN: u64 = 256 << 20;

/// The bincode configuration of the header.
pub fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_little_endian().with_fixed_int_encoding().with_limit::<{ MAX_HEADER_LEN as usize }>()
}

/// Everything but the bulk data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub model: ModelInfo,
    pub provenance: Provenance,
    pub target: TargetInfo,
    pub sections: Vec<Section>,
    pub kernels: Vec<KernelEntry>,
    pub weights: Vec<WeightEntry>,
    /// The devices the model is split over (`cpu`: one CPU device).
    pub mesh: DeviceMesh,
    /// One sub-model per device of the mesh, in device order.
    pub sub_models: Vec<SubModel>,
    /// The KV cache of one device (every sub-model has the same layout).
    pub kv_cache: KvCacheLayout,
    pub tokenizer: TokenizerInfo,
    pub generation: GenerationDefaults,
    /// The longest sequence (prompt + generated tokens) the artifact supports.
    pub max_length: u64,
    /// NVIDIA architectures (`sm_90`) with a PTX module in the artifact, in the
    /// order of their `Ptx(i)` sections; empty for CPU-only artifacts.
    pub gpu_archs: Vec<String>,
    /// What the batch plans of [`SubModel::batch`] hold (`None` without them:
    /// encoders and device meshes).
    pub batch: Option<BatchLimits>,
    /// The other CPU code variants of a multi-ISA artifact (format 7;
    /// `--target cpu:x86-64-v2,x86-64-v3,...`; empty otherwise). `target`,
    /// `kernels` and `sub_models` above are the first variant; each of these is
    /// another, its code in section [`SectionKind::VariantCode`]`(i)`, all of
    /// them reading the one `weights` table (their layouts are the same). A
    /// reader picks the variant the running CPU supports with the most
    /// features ([`Header::select_cpu_variant`]).
    pub cpu_variants: Vec<CpuVariant>,
}

/// One CPU code variant of a multi-ISA artifact: its target, its kernels and
/// the plans that launch them (register tiles differ by ISA, so kernel names,
/// plans and arenas may too; the weights are shared).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuVariant {
    pub target: TargetInfo,
    pub kernels: Vec<KernelEntry>,
    pub sub_models: Vec<SubModel>,
}

/// The shape of the batched engine's steps (docs/serving.md): how the paged KV
/// cache is cut into blocks and how many rows and sequences a step holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchLimits {
    /// Positions per KV block.
    pub block_size: u64,
    /// Entries of a block table: the most blocks one sequence holds
    /// (`max_length / block_size`, rounded up).
    pub blocks_per_sequence: u64,
    /// Rows of a mixed step (`compile.max_batch_tokens`).
    pub max_rows: u64,
    /// Sequences per step (`compile.max_sequences`): the decode plan's rows,
    /// and the rows whose logits a decode step returns.
    pub max_sequences: u64,
    /// Rows whose logits a mixed step returns (format 10): at least
    /// `max_sequences`, so that a step can verify several drafted tokens of
    /// each sequence (speculative decoding), and at most `max_rows`.
    pub max_logit_rows: u64,
}

impl BatchLimits {
    /// Bytes of one KV block of one layer's keys (or values), all parts.
    pub fn block_bytes(&self, kv: &KvCacheLayout) -> Option<u64> {
        self.block_size.checked_mul(kv.position_bytes()?)
    }
}

/// The plans of the batched engine: steps of many sequences over a paged KV
/// cache (inputs: tokens, positions, [`BufferRef::Slots`],
/// [`BufferRef::RowSequences`], [`BufferRef::BlockTables`] and
/// [`BufferRef::LogitRows`]), returning `[logit rows, vocab]` logits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchPlans {
    /// Steps that hold prompt rows (chunks of prompts beside decode rows): up to
    /// [`BatchLimits::max_rows`] rows, attention over each row's positions.
    pub mixed: Plan,
    /// Steps of decode rows only: up to [`BatchLimits::max_sequences`] rows,
    /// attention split over chunks of positions (flash-decoding).
    pub decode: Plan,
    /// A step of one decode row (one sequence running): the single-stream decode
    /// plan's kernels, with paged attention.
    pub single: Plan,
}

/// A sentence encoder's batch plan (format 9): one step embeds up to
/// `max_sequences` sequences of together up to `max_rows` rows, each sequence
/// a contiguous run of the step's rows. Its inputs are [`BufferRef::Tokens`],
/// [`BufferRef::Positions`] (each row's position within its sequence),
/// [`BufferRef::RowSequences`] and [`BufferRef::SequenceStarts`]; there is no KV
/// cache (each row attends to its own sequence's rows of the step). Its output
/// (`Plan::logits`) is `[sequences, width]` f32: each sequence pooled and
/// normalized as the single-sequence plans give `[1, width]`. Launches over the
/// sequences (pooling and what follows) have [`RowCount::Logits`]: `dims[1]`
/// is the step's sequence count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EncodeBatch {
    /// Rows per step (`plan.max_seq`), at least the artifact's `max_length`
    /// (a sequence is never split over steps: its attention sees all of it).
    pub max_rows: u64,
    /// Sequences per step (the output's rows), at least 1 and at most `max_rows`.
    pub max_sequences: u64,
    pub plan: Plan,
}

impl Header {
    /// Bytes of every weight as stored, all devices together.
    pub fn total_weight_bytes(&self) -> u64 {
        self.weights.iter().map(|w| w.len).sum()
    }

    /// Bytes of weights one decode step reads, all devices together: every
    /// weight a decode plan's launches read, except those only an embedding
    /// launch reads (one row a token: an untied input table), and of a mixture
    /// of experts only each routed layer's top-k experts
    /// ([`ExpertsInfo::active_expert_bytes`]). The bytes a decode roofline is of.
    pub fn decode_weight_bytes(&self) -> u64 {
        let read = self.weights_read(self.sub_models.iter().map(|m| &m.decode), |family| family != "embedding");
        let dense: u64 = read.iter().filter_map(|&i| self.weights.get(i)).map(|w| w.len).sum();
        match &self.model.experts {
            Some(e) => dense.saturating_sub(e.expert_bytes) + e.active_expert_bytes,
            None => dense,
        }
    }

    /// The weights (indices into [`Header::weights`]) that the launches of
    /// `plans` read whose kernel's family `keep` accepts.
    pub fn weights_read<'a>(&self, plans: impl IntoIterator<Item = &'a Plan>, keep: impl Fn(&str) -> bool) -> std::collections::BTreeSet<usize> {
        plans
            .into_iter()
            .flat_map(|p| &p.launches)
            .filter(|l| self.kernels.get(l.kernel as usize).is_some_and(|k| keep(&k.family)))
            .flat_map(|l| &l.args)
            .filter_map(|a| match a {
                BufferRef::Weight(w) => Some(*w as usize),
                _ => None,
            })
            .collect()
    }

    /// Whether the artifact carries CPU code (a GPU-only artifact does not).
    pub fn has_cpu_code(&self) -> bool {
        self.sections.iter().any(|s| s.kind == SectionKind::Code)
    }

    /// The first sub-model: the whole model on a one-device mesh.
    pub fn main(&self) -> &SubModel {
        &self.sub_models[0]
    }

    /// Every CPU variant's target, the first one's (`target`) first, in the
    /// order of the code sections (`Code`, then `VariantCode(0..)`).
    pub fn cpu_targets(&self) -> impl Iterator<Item = &TargetInfo> {
        std::iter::once(&self.target).chain(self.cpu_variants.iter().map(|v| &v.target))
    }

    /// Makes CPU variant `index` (0: the first, `target` itself; `i + 1`:
    /// `cpu_variants[i]`) the header's `target`, `kernels` and `sub_models`, so
    /// that everything downstream reads the chosen variant (its code is
    /// [`SectionKind::cpu_code`]`(index)`). The first variant takes the chosen
    /// one's place in `cpu_variants` (swapped, nothing lost; read
    /// [`Header::cpu_targets`] before selecting for the order as written).
    pub fn select_cpu_variant(&mut self, index: usize) {
        if index == 0 {
            return;
        }
        let v = &mut self.cpu_variants[index - 1];
        std::mem::swap(&mut self.target, &mut v.target);
        std::mem::swap(&mut self.kernels, &mut v.kernels);
        std::mem::swap(&mut self.sub_models, &mut v.sub_models);
    }
}

/// The kind of device a mesh is made of.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
        }
    }
}

/// A one-dimensional device mesh: `devices` devices of one kind, ordinals
/// `ordinals[i]` (`cpu:0,1` is two CPU devices, each a group of worker threads).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMesh {
    pub kind: DeviceKind,
    pub ordinals: Vec<u32>,
}

impl DeviceMesh {
    /// The number of devices.
    pub fn len(&self) -> usize {
        self.ordinals.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ordinals.is_empty()
    }

    /// `cpu`, `cpu:0,1`, `gpu:0,1,2,3`.
    pub fn spec(&self) -> String {
        match (self.kind, self.ordinals.as_slice()) {
            (DeviceKind::Cpu, [0]) => "cpu".into(),
            (kind, ords) => format!("{}:{}", kind.name(), ords.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

/// The part of the model one device runs: its plans over its own weights (the
/// entries of [`Header::weights`] whose `device` is this sub-model's index, in
/// section `Weights(index)`), with collectives where the devices exchange data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SubModel {
    /// `model`, or `shard0`, `shard1`, ... on a mesh of several devices.
    pub name: String,
    /// The device it runs on: `cpu:0`, `gpu:1`.
    pub device: String,
    pub prefill: Plan,
    pub decode: Plan,
    /// A prefill plan whose logits are the last token's only (`f32[1, vocab]`):
    /// what generation needs from a prompt. `None` when the model has no such cut
    /// (encoders).
    pub prefill_last: Option<Plan>,
    /// The batched engine's plans ([`Header::batch`] says their limits).
    pub batch: Option<BatchPlans>,
    /// A sentence encoder's batch plan with its limits (format 9; `None` for
    /// decoders, device meshes and encoders compiled without it).
    pub encode_batch: Option<EncodeBatch>,
    /// Bytes of this device's weights section.
    pub weight_bytes: u64,
    /// KV-cache bytes per token on this device.
    pub kv_bytes_per_token: u64,
}

impl SubModel {
    /// The largest activation arena of its plans.
    pub fn arena_bytes(&self) -> u64 {
        self.plans().map(|p| p.arena_bytes).max().unwrap_or(0)
    }

    /// Every plan: prefill, decode, the last-token prefill, the batch plans
    /// and the encoder's batch plan where present.
    pub fn plans(&self) -> impl Iterator<Item = &Plan> {
        let batch = self.batch.as_ref().map(|b| [&b.mixed, &b.decode, &b.single]).into_iter().flatten();
        let encode = self.encode_batch.as_ref().map(|e| &e.plan);
        [Some(&self.prefill), Some(&self.decode), self.prefill_last.as_ref()].into_iter().flatten().chain(batch).chain(encode)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub architecture: String,
    pub vocab_size: u64,
    pub num_layers: u64,
    /// `Some(width)` for encoders: a step outputs one `f32[1, width]` sentence
    /// embedding instead of `[seq, vocab]` logits.
    pub embedding_width: Option<u64>,
    /// The routed experts of a mixture-of-experts model (format 11).
    pub experts: Option<ExpertsInfo>,
}

/// A mixture of experts as the artifact computes it, for `maxrun inspect`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertsInfo {
    /// Experts per routed layer.
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// The router's rule (`softmax_topk`, `softmax_topk_norm`, `topk_softmax`).
    pub routing: String,
    /// Layers whose MLP is the routed experts (the others are dense).
    pub routed_layers: u64,
    /// Bytes of every routed layer's experts' weights as stored.
    pub expert_bytes: u64,
    /// Of those, the bytes one token reads: its `top_k` experts in each routed
    /// layer (`expert_bytes * top_k / experts`).
    pub active_expert_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    pub maxc_version: String,
    /// The git revision maxc was built from (`unknown` outside a checkout).
    pub maxc_git_revision: String,
    /// The `--target` spec as given.
    pub target_spec: String,
    /// xxh3-128 (hex) of everything above and below: the same inputs, flags and
    /// compiler give the same id; no time or machine state enters it.
    pub build_id: String,
    /// The manifest after overrides, as TOML text.
    pub manifest: String,
    /// The command-line flags that shaped the artifact.
    pub flags: Vec<String>,
    pub inputs: Vec<InputFile>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputFile {
    pub path: String,
    pub bytes: u64,
    /// xxh3-64 of the file's contents.
    pub xxh3: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// LLVM target triple of the code section (empty when there is no CPU code).
    pub triple: String,
    /// LLVM CPU name the code was tuned for.
    pub cpu: String,
    /// CPU features the code may use (LLVM spelling); checked before loading it.
    pub required_features: Vec<String>,
    /// Which backend produced the code.
    pub backend: String,
    /// The CPU target as written in `--target` (`cpu`, `cpu:x86-64-v3`,
    /// `cpu:x86-64-v4+avx512vnni`; one item of a multi-ISA list), empty
    /// without CPU code (format 7).
    pub spec: String,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SectionKind {
    /// A shared object exporting every kernel.
    Code,
    /// The weights of sub-model `i` (device `i` of the mesh), each entry 64-byte
    /// aligned within the section.
    Weights(u32),
    /// A Hugging Face tokenizer.json.
    Tokenizer,
    /// The chat template (Jinja text).
    ChatTemplate,
    /// A PTX module (text) for GPU architecture `Header::gpu_archs[i]`: the same
    /// kernels and symbols as the CPU code.
    Ptx(u32),
    /// The shared object of `Header::cpu_variants[i]` (multi-ISA artifacts).
    VariantCode(u32),
}

impl SectionKind {
    /// The section of CPU variant `index` in the order written
    /// ([`Header::cpu_targets`]): `Code` for the first, then `VariantCode(i)`.
    pub fn cpu_code(index: usize) -> SectionKind {
        match index {
            0 => SectionKind::Code,
            i => SectionKind::VariantCode(i as u32 - 1),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub kind: SectionKind,
    /// Absolute file offset, a multiple of [`SECTION_ALIGN`].
    pub offset: u64,
    pub len: u64,
    /// xxh3-64 of the section's bytes.
    pub checksum: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelEntry {
    /// The exported symbol in the code section.
    pub symbol: String,
    pub family: String,
    pub num_params: u32,
    /// The backend that produced the kernel (`llvm` or `cranelift`).
    pub backend: String,
    /// GPU threads per task in the PTX: 32 (a warp, whose lanes share the task's
    /// loops), 128 (four warps, one thread block: a split loop is long) or 1
    /// (kernels none of whose loops split across lanes).
    pub gpu_threads_per_task: u32,
    /// GPU tasks per task of a launch (at least 1): the PTX's form of the kernel
    /// may deal a task's work to several (a row of a map in chunks, a token's
    /// heads), so a launch of `n` tasks runs `n * gpu_task_split` on a GPU.
    pub gpu_task_split: u32,
}

/// Element types of stored tensors and of kernel buffers (`maxc_kernels::ElemType`
/// is this type).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    I32,
    /// bfloat16, little-endian; kernel loads widen to f32 (weights only, never stored).
    BF16,
    /// IEEE half, little-endian; kernel loads widen to f32, stores round an f32 to
    /// nearest even (f16 weights, and the KV cache with `--kv-cache-encoding float16`).
    F16,
    /// Signed bytes; kernel loads sign-extend to i64, stores truncate an i64
    /// (quantized weights, and activations quantized to int8 at run time).
    I8,
    /// Unsigned bytes (packed 4-bit pairs, fp8 codes, 6-bit scales); kernel loads
    /// zero-extend to i64, never stored.
    U8,
}

impl DType {
    /// Every element type, in the order the text forms list them.
    pub const ALL: [DType; 6] = [DType::F32, DType::I32, DType::BF16, DType::F16, DType::I8, DType::U8];

    /// The name the graph and kernel IR text forms use (`f32`, `bf16`, `u8`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I8 => "i8",
            DType::U8 => "u8",
        }
    }

    /// Whether elements are floating point (loads widen to f32).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }
}

/// Element order of a stored weight ([`WeightEntry::layout`] holds its name).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Row after row, each row's blocks or values in order.
    RowMajor,
    /// `[n/16][k][16]` for the panel matmul (float and fp8 encodings, `n` a
    /// multiple of 16; fp8's per-row scales stay as they are).
    Panel16,
    /// Blocks of 32 values of 16 consecutive rows stored together for the
    /// interleaved integer matmul (Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1); docs/mef.md.
    Interleaved16,
}

impl Layout {
    /// Every layout, in the order docs/mef.md lists them.
    pub const ALL: [Layout; 3] = [Layout::RowMajor, Layout::Panel16, Layout::Interleaved16];

    /// The name an artifact records.
    pub fn name(self) -> &'static str {
        match self {
            Layout::RowMajor => "row_major",
            Layout::Panel16 => "panel16",
            Layout::Interleaved16 => "interleaved16",
        }
    }

    /// The layout an artifact's name stands for.
    pub fn from_name(name: &str) -> Option<Layout> {
        Layout::ALL.into_iter().find(|l| l.name() == name)
    }

    /// Whether a weight in `encoding` of logical `shape` may be stored in this
    /// layout: the one statement of the rule that the compiler's layout decision,
    /// the kernels' packed forms and the loader's check share. Packed layouts take
    /// matrices whose rows come in whole groups of 16 (and, interleaved, whose
    /// rows are whole blocks).
    pub fn admits(self, encoding: WeightEncoding, shape: &[u64]) -> bool {
        let rows_of_16 = shape.len() == 2 && shape[0].is_multiple_of(16);
        match self {
            Layout::RowMajor => true,
            Layout::Panel16 => rows_of_16 && matches!(encoding, WeightEncoding::Float32 | WeightEncoding::BFloat16 | WeightEncoding::Float16 | WeightEncoding::Float8E4M3),
            Layout::Interleaved16 => rows_of_16 && encoding.interleaves() && shape[1].is_multiple_of(encoding.block()),
        }
    }
}

/// One stored array of a weight tensor (a plain tensor has one part, `values`;
/// a block-quantized one has its quants and scales as separate parts, each its
/// own [`WeightEntry`], so kernels read every part as a typed array).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightEntry {
    /// The tensor's name; parts after the first are named `NAME#PART`.
    pub name: String,
    /// The tensor's storage encoding (a [`WeightEncoding`] name). Kept as text so
    /// that a newer encoding in an artifact is refused by name, not as corruption.
    pub encoding: String,
    /// Which part of the encoding this entry holds (`values`, `quants`, `scales`, ...).
    pub part: String,
    /// The element type of this part.
    pub dtype: DType,
    /// How the elements are ordered: `row_major`, `panel16` (a float matrix
    /// `[n, k]`, or fp8's codes, stored as `[n/16][k][16]` for the panel matmul), or
    /// `interleaved16` (Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 blocks of 16 rows stored
    /// together for the int8 matmul); see docs/mef.md.
    pub layout: String,
    /// The logical shape of the whole tensor (the last axis is the one blocks run along).
    pub shape: Vec<u64>,
    /// The sub-model (device) whose weights section holds it.
    pub device: u32,
    /// Offset within that weights section (64-byte aligned).
    pub offset: u64,
    pub len: u64,
}

/// Element orders a weight may have.
pub const LAYOUTS: [&str; 3] = ["row_major", "panel16", "interleaved16"];

/// How many elements of a part each logical row of `cols` values has.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PerRow {
    /// `cols / n` elements (`n` = 1: one element per value).
    Every(u64),
    /// One element per row (per-output-channel scales).
    One,
}

/// Weight storage encodings (MAX's `--quantization-encoding` names). Each is a
/// list of parts, row-major over `[rows, cols]` with `cols` the last axis; block
/// encodings cut every row into blocks along `cols`. docs/mef.md gives the layouts.
/// The compiler's graph IR marks every value with the one it is stored in
/// (`TensorType::quant`): `Float32`, the default, is "unquantized", also for
/// values that are not float32 (token ids), whose dtype says what they are.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum WeightEncoding {
    #[default]
    Float32,
    BFloat16,
    Float16,
    /// Blocks of 32: `quants: i8[32]`, `scales: f16` (value = scale * q), as GGUF Q8_0.
    Q8_0,
    /// Blocks of 32: `quants: u8[16]` (element `t` in the low nibble of byte `t`,
    /// element `16 + t` in the high nibble), `scales: f16`; value = scale * (q - 8).
    Q4_0,
    /// As Q4_0 plus `mins: f16`; value = scale * q + min.
    Q4_1,
    /// Super-blocks of 256 in 8 sub-blocks of 32: nibbles as Q4_0 per sub-block,
    /// 6-bit `sub_scales` and `sub_mins` (one byte each per sub-block), and f16
    /// `scales` / `mins` per super-block; value = scale * sub_scale * q - min * sub_min.
    Q4K,
    /// `quants: u8` fp8 e4m3fn codes (no infinities; 0x7f/0xff unused), one f32
    /// `scales` per row; value = scale * e4m3(q).
    Float8E4M3,
    /// Blocks of 32, as GGUF Q5_0: 5-bit `q` as Q4_0's nibbles (`quants`) plus
    /// their fifth bits (`high_bits: u8[4]`, bit `t % 8` of byte `t / 8` for
    /// element `t`, GGUF's little-endian `qh`), `scales: f16`; value = scale * (q - 16).
    Q5_0,
    /// As Q5_0 plus `mins: f16` (GGUF Q5_1); value = scale * q + min.
    Q5_1,
    /// Super-blocks of 256, as GGUF Q6_K: 6-bit `q` as Q4_0's nibbles per block of
    /// 32 (`quants`) plus their two high bits (`high_bits: u8[8]` per block, bits
    /// `2 (t % 4)..` of byte `t / 4` for element `t`), a signed byte scale per 16
    /// elements (`sub_scales: i8`), an f16 `scales` per super-block; value =
    /// scale * (sub_scale * (q - 32)).
    Q6K,
    /// Super-blocks of 256, as GGUF Q5_K: Q4_K's parts with 5-bit `q`, its
    /// fifth bits as Q5_0's (`high_bits` after `quants`); value = scale *
    /// sub_scale * q - min * sub_min.
    Q5K,
}

impl WeightEncoding {
    /// Whether the encoding is quantized into several parts with rows taken in
    /// blocks of [`WeightEncoding::block`] values: the integer blocks, and fp8,
    /// whose one scale per row is a part of its own. Matmuls on them run the
    /// block kernels (`matmul_blocks`, `matmul_int8`, the interleaved ones;
    /// fp8 in layout `panel16` the panel matmul instead), and an embedding table
    /// under them defaults to q8_0.
    pub fn is_block(self) -> bool {
        self.block() > 1
    }

    /// Whether matrices in this encoding may be stored in layout
    /// `interleaved16` (the interleaved integer matmul's: Q8_0, Q4_0, Q4_1,
    /// Q4_K, Q5_0, Q5_1, Q5_K, Q6_K); [`Layout::admits`] adds the shape's conditions.
    pub fn interleaves(self) -> bool {
        matches!(self, WeightEncoding::Q8_0 | WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q4K | WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Q6K | WeightEncoding::Q5K)
    }

    pub const ALL: [WeightEncoding; 12] = [
        WeightEncoding::Float32,
        WeightEncoding::BFloat16,
        WeightEncoding::Float16,
        WeightEncoding::Q8_0,
        WeightEncoding::Q4_0,
        WeightEncoding::Q4_1,
        WeightEncoding::Q4K,
        WeightEncoding::Float8E4M3,
        WeightEncoding::Q5_0,
        WeightEncoding::Q5_1,
        WeightEncoding::Q6K,
        WeightEncoding::Q5K,
    ];

    /// The `--quantization-encoding` spelling.
    pub fn name(self) -> &'static str {
        match self {
            WeightEncoding::Float32 => "float32",
            WeightEncoding::BFloat16 => "bfloat16",
            WeightEncoding::Float16 => "float16",
            WeightEncoding::Q8_0 => "q8_0",
            WeightEncoding::Q4_0 => "q4_0",
            WeightEncoding::Q4_1 => "q4_1",
            WeightEncoding::Q4K => "q4_k",
            WeightEncoding::Float8E4M3 => "float8_e4m3fn",
            WeightEncoding::Q5_0 => "q5_0",
            WeightEncoding::Q5_1 => "q5_1",
            WeightEncoding::Q6K => "q6_k",
            WeightEncoding::Q5K => "q5_k",
        }
    }

    pub fn from_name(name: &str) -> Option<WeightEncoding> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The names of all encodings, comma-separated (for error messages).
    pub fn all_names() -> String {
        Self::ALL.map(|e| e.name()).join(", ")
    }

    /// Values per block along a row (the row length must be a multiple). fp8
    /// stores no per-block values (its scale is per row), but its kernels take a
    /// row 32 codes at a time as the integer encodings' do.
    pub fn block(self) -> u64 {
        match self {
            WeightEncoding::Float32 | WeightEncoding::BFloat16 | WeightEncoding::Float16 => 1,
            WeightEncoding::Q8_0 | WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Float8E4M3 => 32,
            WeightEncoding::Q4K | WeightEncoding::Q6K | WeightEncoding::Q5K => 256,
        }
    }

    /// The parts, in storage order.
    pub fn parts(self) -> &'static [(&'static str, DType, PerRow)] {
        use PerRow::*;
        match self {
            WeightEncoding::Float32 => &[("values", DType::F32, Every(1))],
            WeightEncoding::BFloat16 => &[("values", DType::BF16, Every(1))],
            WeightEncoding::Float16 => &[("values", DType::F16, Every(1))],
            WeightEncoding::Q8_0 => &[("quants", DType::I8, Every(1)), ("scales", DType::F16, Every(32))],
            WeightEncoding::Q4_0 => &[("quants", DType::U8, Every(2)), ("scales", DType::F16, Every(32))],
            WeightEncoding::Q4_1 => &[("quants", DType::U8, Every(2)), ("scales", DType::F16, Every(32)), ("mins", DType::F16, Every(32))],
            WeightEncoding::Q4K => &[
                ("quants", DType::U8, Every(2)),
                ("sub_scales", DType::U8, Every(32)),
                ("sub_mins", DType::U8, Every(32)),
                ("scales", DType::F16, Every(256)),
                ("mins", DType::F16, Every(256)),
            ],
            WeightEncoding::Float8E4M3 => &[("quants", DType::U8, Every(1)), ("scales", DType::F32, One)],
            WeightEncoding::Q5_0 => &[("quants", DType::U8, Every(2)), ("high_bits", DType::U8, Every(8)), ("scales", DType::F16, Every(32))],
            WeightEncoding::Q5_1 => &[("quants", DType::U8, Every(2)), ("high_bits", DType::U8, Every(8)), ("scales", DType::F16, Every(32)), ("mins", DType::F16, Every(32))],
            WeightEncoding::Q6K => &[("quants", DType::U8, Every(2)), ("high_bits", DType::U8, Every(4)), ("sub_scales", DType::I8, Every(16)), ("scales", DType::F16, Every(256))],
            WeightEncoding::Q5K => &[
                ("quants", DType::U8, Every(2)),
                ("high_bits", DType::U8, Every(8)),
                ("sub_scales", DType::U8, Every(32)),
                ("sub_mins", DType::U8, Every(32)),
                ("scales", DType::F16, Every(256)),
                ("mins", DType::F16, Every(256)),
            ],
        }
    }

    /// Elements of part `index` for a tensor of `shape`, or `None` when the row
    /// length is not a whole number of blocks.
    pub fn part_elems(self, index: usize, shape: &[u64]) -> Option<u64> {
        let cols = *shape.last().unwrap_or(&1);
        let rows: u64 = shape.iter().rev().skip(1).product();
        if !cols.is_multiple_of(self.block()) {
            return None;
        }
        Some(match self.parts()[index].2 {
            PerRow::Every(n) => rows * (cols / n),
            PerRow::One => rows,
        })
    }

    /// Total stored bytes of a tensor of `shape` (all parts, without alignment).
    pub fn bytes(self, shape: &[u64]) -> Option<u64> {
        (0..self.parts().len()).map(|i| self.part_elems(i, shape).map(|n| n * self.parts()[i].1.size())).sum()
    }
}

/// How many tasks a launch has: `per_seq * seq + fixed`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskCount {
    pub per_seq: u64,
    pub fixed: u64,
}

impl TaskCount {
    /// `per_seq * seq + fixed`, saturating (a corrupt artifact cannot overflow it).
    pub fn eval(self, seq: u64) -> u64 {
        self.per_seq.saturating_mul(seq).saturating_add(self.fixed)
    }
}

/// A buffer a launch argument refers to. In an artifact an activation is
/// located by its byte offset in the plan's arena (`A = u64`); the compiler's
/// schedule uses the same vocabulary with `A` the index of an activation buffer,
/// before memory planning gives each its offset ([`BufferRef::map_arena`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BufferRef<A = u64> {
    /// Bytes at `offset` in the plan's activation arena.
    Arena { offset: A },
    /// A weight (index into [`Header::weights`]).
    Weight(u32),
    /// The token ids of this step, `i32[seq]`.
    Tokens,
    /// The positions of this step, `i32[seq]`.
    Positions,
    /// Part `part` of layer `layer`'s key cache (the KV encoding's parts,
    /// [`KvEncoding::parts`]: a float cache's one part holds `kv_width *
    /// max_length` elements, laid out by the artifact's kernels; maxc's are
    /// `[kv_heads, max_length, head_dim]`, CPU kernels' keys in panels of 16
    /// positions, `[kv_heads, max_length / 16, head_dim, 16]`).
    KeyCache { layer: u32, part: u32 },
    /// Part `part` of layer `layer`'s value cache, the same size and layout as
    /// the key cache's (in batch plans both are pools of blocks: `[blocks,
    /// kv_heads, block_size, head_dim]`).
    ValueCache { layer: u32, part: u32 },
    /// A batch step's KV slot for each row, `i32[rows]`: block `slot / block_size`,
    /// offset `slot % block_size`.
    Slots,
    /// A batch step's sequence of each row (its index among the step's sequences), `i32[rows]`.
    RowSequences,
    /// A batch step's block tables, `i32[sequences, blocks_per_sequence]`.
    BlockTables,
    /// The rows of a batch step whose logits it returns, `i32[logit rows]`.
    LogitRows,
    /// An encoder batch step's sequences as runs of its rows, `i32[sequences +
    /// 1]`: sequence `s` is rows `starts[s] .. starts[s + 1]` (`starts[0] = 0`,
    /// the last entry the step's rows). Only in [`EncodeBatch`] plans.
    SequenceStarts,
}

impl<A: Copy> BufferRef<A> {
    /// The same reference with the activation located by `f(self's location)`.
    pub fn map_arena<B>(self, f: impl FnOnce(A) -> B) -> BufferRef<B> {
        match self {
            BufferRef::Arena { offset } => BufferRef::Arena { offset: f(offset) },
            BufferRef::Weight(w) => BufferRef::Weight(w),
            BufferRef::Tokens => BufferRef::Tokens,
            BufferRef::Positions => BufferRef::Positions,
            BufferRef::KeyCache { layer, part } => BufferRef::KeyCache { layer, part },
            BufferRef::ValueCache { layer, part } => BufferRef::ValueCache { layer, part },
            BufferRef::Slots => BufferRef::Slots,
            BufferRef::RowSequences => BufferRef::RowSequences,
            BufferRef::BlockTables => BufferRef::BlockTables,
            BufferRef::LogitRows => BufferRef::LogitRows,
            BufferRef::SequenceStarts => BufferRef::SequenceStarts,
        }
    }
}

/// Which of a step's row counts a launch's tasks and outputs follow.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RowCount {
    /// The step's rows: the kernel sees `dims[0]`.
    #[default]
    Step,
    /// The rows whose logits a batch step returns: the kernel gets a `dims`
    /// pointer one element on, so its sequence length is `dims[1]` (the launches
    /// after a batch plan's gather of those rows; in an encoder's batch plan,
    /// the step's sequences: the pooling and what follows it).
    Logits,
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    /// Index into [`Header::kernels`].
    pub kernel: u32,
    pub args: Vec<BufferRef>,
    pub tasks: TaskCount,
    /// f32 elements the launch writes to its last argument (`per_seq * seq + fixed`;
    /// zero when it writes only the KV cache). `maxrun --check-nan` scans them.
    pub output_elems: TaskCount,
    /// What `seq` is for `tasks` and `output_elems`, and which `dims` the kernel sees.
    pub rows: RowCount,
}

/// A linear launch plan for steps of up to `max_seq` tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub max_seq: u64,
    /// Activation arena size for `max_seq` tokens.
    pub arena_bytes: u64,
    pub launches: Vec<Launch>,
    /// Data exchanged with the other devices of the mesh, in order (empty on one device).
    pub collectives: Vec<CollectiveStep>,
    /// Where the output is when the plan ends: `[seq, vocab]` f32 logits, or an
    /// encoder's `[1, width]` embedding.
    pub logits: BufferRef,
}

/// One collective of a plan: every device of the mesh runs it at the same point
/// (before launch `before_launch`; `launches.len()` means after the last one).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollectiveStep {
    pub before_launch: u32,
    pub op: CollectiveOp,
    /// An arena buffer of this device.
    pub input: BufferRef,
    /// An arena buffer of this device (never the input).
    pub output: BufferRef,
    /// Which of a step's row counts the op's counts follow: the step's rows, or
    /// after a batch plan's gather the rows with logits (format 9).
    pub rows: RowCount,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CollectiveOp {
    /// `output = sum over devices of input`, `elems` f32 (`per_seq * seq + fixed`);
    /// summed in device order, so every device gets the same bits.
    AllReduceSum { elems: TaskCount },
    /// `input` is `[rows, cols]` on every device; `output` is `[rows, devices * cols]`
    /// with device `d`'s columns at `d * cols`.
    AllGather { rows: TaskCount, cols: u64 },
}

impl CollectiveOp {
    /// f32 elements read from the input for a step of `seq` tokens.
    pub fn input_elems(&self, seq: u64) -> u64 {
        match self {
            CollectiveOp::AllReduceSum { elems } => elems.eval(seq),
            CollectiveOp::AllGather { rows, cols } => rows.eval(seq).saturating_mul(*cols),
        }
    }

    /// f32 elements written to the output on a mesh of `devices`.
    pub fn output_elems(&self, seq: u64, devices: u64) -> u64 {
        match self {
            CollectiveOp::AllReduceSum { elems } => elems.eval(seq),
            CollectiveOp::AllGather { rows, cols } => rows.eval(seq).saturating_mul(*cols).saturating_mul(devices),
        }
    }
}

/// The KV cache: its shape and its encoding (format 9: the encoding has
/// parts, as weights do, so that quantized caches keep their scales beside
/// their levels).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvCacheLayout {
    pub layers: u64,
    /// Values per position per layer (kv_heads * head_dim) for keys, and again for values.
    pub row_elems: u64,
    /// Values per head row: the run an encoding's blocks lie along.
    pub head_dim: u64,
    pub encoding: KvEncoding,
}

impl KvCacheLayout {
    /// Bytes of part `part` for one position of one layer's keys (or values),
    /// `None` where the head rows are not whole blocks or it overflows.
    pub fn part_bytes(&self, part: usize) -> Option<u64> {
        let (_, dtype, per) = self.encoding.parts()[part];
        let hd = self.head_dim.max(1);
        if !self.row_elems.is_multiple_of(hd) || !hd.is_multiple_of(self.encoding.block()) {
            return None;
        }
        let heads = self.row_elems / hd;
        let elems = match per {
            PerRow::Every(n) => heads.checked_mul(hd / n)?,
            PerRow::One => heads,
        };
        elems.checked_mul(dtype.size())
    }

    /// Bytes of every part for one position of one layer's keys (or values).
    pub fn position_bytes(&self) -> Option<u64> {
        (0..self.encoding.parts().len()).try_fold(0u64, |sum, p| sum.checked_add(self.part_bytes(p)?))
    }

    pub fn bytes_per_token(&self) -> u64 {
        2 * self.layers * self.position_bytes().unwrap_or(u64::MAX / 4)
    }

    /// Bytes of part `part` of one layer's keys (or values) for `positions`
    /// positions, `None` where that overflows.
    pub fn part_layer_bytes(&self, part: usize, positions: u64) -> Option<u64> {
        positions.checked_mul(self.part_bytes(part)?)
    }
}

/// The KV cache's encoding (`maxc compile --kv-cache-encoding`): a list of
/// parts along each head row of `head_dim` values, as [`WeightEncoding::parts`]
/// lists a weight's along its rows. Every part is a buffer of its own per layer
/// and for keys and values ([`BufferRef::KeyCache`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEncoding {
    Float32,
    /// IEEE half: keys and values rounded to nearest even when stored.
    Float16,
}

impl KvEncoding {
    pub const ALL: [KvEncoding; 2] = [KvEncoding::Float32, KvEncoding::Float16];

    pub fn name(self) -> &'static str {
        match self {
            KvEncoding::Float32 => "float32",
            KvEncoding::Float16 => "float16",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }

    /// The names of all encodings, comma-separated (for error messages).
    pub fn all_names() -> String {
        Self::ALL.map(|e| e.name()).join(", ")
    }

    /// The parts, in storage order: name, element type, elements per head row.
    pub fn parts(self) -> &'static [(&'static str, DType, PerRow)] {
        match self {
            KvEncoding::Float32 => &[("values", DType::F32, PerRow::Every(1))],
            KvEncoding::Float16 => &[("values", DType::F16, PerRow::Every(1))],
        }
    }

    /// Values per block along a head row (`head_dim` must be a multiple).
    pub fn block(self) -> u64 {
        match self {
            KvEncoding::Float32 | KvEncoding::Float16 => 1,
        }
    }

    /// Whether the CPU kernels may keep the keys of each 16 positions
    /// transposed (key panels: a panel's 16 scores are one register tile);
    /// GPU forms keep key rows whatever the encoding.
    pub fn keys_in_panels(self) -> bool {
        match self {
            KvEncoding::Float32 | KvEncoding::Float16 => true,
        }
    }

    /// The element type of a one-part encoding (the float caches), which the
    /// attention kernels read and write directly.
    pub fn element(self) -> Option<DType> {
        match self.parts() {
            [(_, dtype, PerRow::Every(1))] => Some(*dtype),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Sampling defaults: the artifact's, a manifest's `[generation]` section, a
/// checkpoint's generation_config.json.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub max_new_tokens: Option<u32>,
    /// The checkpoint's `repetition_penalty` (applied as `--repeat-penalty` is).
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Each of these values, or `fallback`'s where this has none.
    pub fn or(&self, fallback: &GenerationDefaults) -> GenerationDefaults {
        GenerationDefaults {
            temperature: self.temperature.or(fallback.temperature),
            top_k: self.top_k.or(fallback.top_k),
            top_p: self.top_p.or(fallback.top_p),
            min_p: self.min_p.or(fallback.min_p),
            max_new_tokens: self.max_new_tokens.or(fallback.max_new_tokens),
            repetition_penalty: self.repetition_penalty.or(fallback.repetition_penalty),
        }
    }
}

/// Encodes the prelude and header.
pub fn encode_header(header: &Header) -> Vec<u8> {
    let body = bincode::serde::encode_to_vec(header, bincode_config()).expect("headers always encode");
    let mut out = Vec::with_capacity(PRELUDE_LEN + body.len());
    out.extend(MAGIC);
    out.extend(FORMAT_MAJOR.to_le_bytes());
    out.extend(FORMAT_MINOR.to_le_bytes());
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(checksum(&body).to_le_bytes());
    out.extend(body);
    out
}

/// The checksum of headers and sections: xxh3-64.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// A streaming xxh3-64 for large sections and input files.
pub type ChecksumState = xxhash_rust::xxh3::Xxh3;

/// Rounds `n` up to the section alignment.
pub fn align_section(n: u64) -> u64 {
    n.div_ceil(SECTION_ALIGN) * SECTION_ALIGN
}
