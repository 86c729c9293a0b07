//! Scheduling: lower the optimized graph to a linear launch plan over kernels from
//! the kernel library, with constants placed in the weights table and activations
//! assigned to one arena by [`memory::plan_arena`].
//!
//! The same graph is scheduled several times: a prefill plan for any sequence
//! length up to `max_seq`, a decode plan specialized to `seq = 1`, a prefill plan
//! that computes only the last row's logits, and the batched engine's plans
//! ([`schedule_batch`]: many sequences per step over a paged KV cache).

pub mod memory;

use std::collections::HashMap;

use maxc_kernels::library::attention::{attention, attention_combine, attention_combine_gpu, attention_paged, attention_partial, kv_store, kv_store_paged, AttentionShape, Paging, DECODE_SPLITS};
use maxc_kernels::library::copy::{gather_rows, last_row, slice_columns, slice_columns_gpu};
use maxc_kernels::library::elementwise::{binary, binary_gpu, l2_normalize, mean_rows, swiglu, swiglu_gpu, unary, unary_gpu, Broadcast};
use maxc_kernels::ir::DotForm;
use maxc_kernels::library::embedding::{embedding_in, embedding_range};
use maxc_kernels::library::matmul::{matmul, matmul_add};
use maxc_kernels::library::matmul_blocks::{matmul_blocks, matmul_blocks_rowwise};
use maxc_kernels::library::matmul_interleaved::matmul_interleaved;
use maxc_kernels::library::quantize_activations::{quantize_q16, quantize_q8, ActivationLevels};
use maxc_kernels::library::matmul_panel::{matmul_panel, matmul_panel_rowwise, PanelWeights};
use maxc_kernels::library::rms_norm::{layer_norm, rms_norm};
use maxc_kernels::library::rope::{rope, rope_gpu};
use maxc_kernels::library::{RegisterTile, SeqMode};
use maxc_kernels::{Kernel, TaskCount};
use maxrun::format::{Layout, WeightEncoding};

use crate::error::{Error, Result};
use crate::graph::rope::inv_freq;
use crate::graph::{Dim, Graph, Op, SymDim, ValueId, WeightShard};

/// Where a constant's bytes come from when the weights section is written.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    /// A checkpoint tensor, decoded to f32.
    Checkpoint(String),
    /// Checkpoint tensors concatenated along axis 0 (stacked projections).
    Stacked(Vec<String>),
    /// Values computed at compile time.
    Values(Vec<f32>),
}

/// One entry of the weights table: one stored part of a tensor (a float tensor
/// has one part; a block-quantized one has its quants, scales, ... as
/// consecutive slots with the same `data`).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSlot {
    /// The tensor's name, with `#PART` appended for parts after the first.
    pub name: String,
    /// The logical shape of the whole tensor.
    pub shape: Vec<u64>,
    pub data: WeightData,
    /// How the values are stored in the artifact.
    pub encoding: WeightEncoding,
    /// Which part of the encoding this slot holds.
    pub part: usize,
    /// How the elements are ordered in the artifact.
    pub layout: Layout,
    /// The device (sub-model) whose weights section holds it.
    pub device: u32,
    /// The slice of each checkpoint tensor in `data` it holds (`shape` is the slice's).
    pub shard: Option<WeightShard>,
}

/// The suffix of a weight's name in `layout` (one tensor may be stored in several).
fn layout_suffix(layout: Layout) -> &'static str {
    match layout {
        Layout::RowMajor => "",
        Layout::Panel16 => "@panel16",
        Layout::Interleaved16 => "@x16",
    }
}

impl WeightSlot {
    /// A float32 tensor (one part).
    fn plain(name: String, shape: Vec<u64>, data: WeightData) -> WeightSlot {
        WeightSlot { name, shape, data, encoding: WeightEncoding::Float32, part: 0, layout: Layout::RowMajor, device: 0, shard: None }
    }

    /// All the slots of a tensor stored in `encoding` and `layout`.
    fn parts(name: &str, shape: Vec<u64>, data: WeightData, encoding: WeightEncoding, layout: Layout, shard: Option<WeightShard>) -> Vec<WeightSlot> {
        let mut name = name.to_string();
        if let Some(sh) = shard {
            name.push_str(&format!("@shard{}/{}", sh.index, sh.devices));
        }
        name.push_str(layout_suffix(layout));
        encoding
            .parts()
            .iter()
            .enumerate()
            .map(|(part, (part_name, _, _))| WeightSlot {
                name: if part == 0 { name.clone() } else { format!("{name}#{part_name}") },
                shape: shape.clone(),
                data: data.clone(),
                encoding,
                part,
                layout,
                device: 0,
                shard,
            })
            .collect()
    }
}

/// The kernel element type that reads a float weight stored as `q`.
fn elem_of(q: WeightEncoding) -> maxc_kernels::ElemType {
    q.parts()[0].1
}

/// The activations of block-quantized matmuls (`compile.activation_encoding`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ActivationEncoding {
    /// Float activations times the decoded weight values (`matmul_blocks`).
    #[default]
    Float32,
    /// Int8 levels per block of 32, llama.cpp's scheme: integer dot products
    /// (`matmul_interleaved`, or `matmul_int8` for rows not in groups of 16).
    Int8,
    /// 16-bit levels per block of 32, float-like error (interleaved weights
    /// only; other matmuls keep float activations): in two byte planes for
    /// nibble weights (the int8 kernels' dot instructions twice), as words for
    /// Q8_0 (one word dot per 16 weights).
    Int16,
}

impl ActivationEncoding {
    /// The name `--activation-encoding` takes.
    pub fn name(self) -> &'static str {
        match self {
            ActivationEncoding::Float32 => "float32",
            ActivationEncoding::Int8 => "int8",
            ActivationEncoding::Int16 => "int16",
        }
    }

    /// The integer levels, if the activations are quantized (16-bit ones as
    /// planes; `integer_matmul` takes words where the weights are bytes).
    pub fn levels(self) -> Option<ActivationLevels> {
        match self {
            ActivationEncoding::Float32 => None,
            ActivationEncoding::Int8 => Some(ActivationLevels::Int8),
            ActivationEncoding::Int16 => Some(ActivationLevels::Int16Planes),
        }
    }
}

/// Constants shared by a device's plans; each device of a mesh has its own.
#[derive(Debug, Default)]
pub struct WeightTable {
    pub slots: Vec<WeightSlot>,
    by_name: HashMap<(u32, String), u32>,
    /// The device whose plans are being scheduled: new slots belong to it.
    pub device: u32,
    /// Keep every weight row-major and use the GPU forms of the matmuls: for
    /// artifacts without CPU code, whose GPU kernels read a matmul's rows with a
    /// whole warp (`panel16` and the block matmul's per-lane accumulators suit
    /// the CPU's vector registers, not a warp).
    pub row_major_only: bool,
    /// How block-quantized matmuls take their activations
    /// (`--activation-encoding`): float, or quantized per block to integers and
    /// multiplied with integer dot products.
    pub activations: ActivationEncoding,
    /// The prefill register tile of the panel and interleaved matmuls, sized to
    /// the CPU target's vector registers.
    pub register_tile: RegisterTile,
}

impl WeightTable {
    fn intern(&mut self, mut slot: WeightSlot) -> u32 {
        slot.device = self.device;
        let key = (self.device, slot.name.clone());
        if let Some(&i) = self.by_name.get(&key) {
            return i;
        }
        let i = self.slots.len() as u32;
        self.by_name.insert(key, i);
        self.slots.push(slot);
        i
    }
}

/// A launch argument before arena offsets are known.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Arg {
    /// An activation buffer (index into [`Schedule::buffers`]).
    Buffer(u32),
    Weight(u32),
    Tokens,
    Positions,
    KeyCache(u32),
    ValueCache(u32),
    /// The batch step's inputs (see `maxrun::format::BufferRef`).
    Slots,
    RowSequences,
    BlockTables,
    LogitRows,
}

/// An activation buffer: `bytes` for `max_seq` tokens, live over launches `def..=last_use`.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferInfo {
    pub bytes: u64,
    pub def: usize,
    pub last_use: usize,
}

/// One launch of a kernel (index into the kernel list of the [`KernelSet`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledLaunch {
    pub kernel: u32,
    pub args: Vec<Arg>,
    pub tasks: TaskCount,
    /// f32 elements written to the last argument.
    pub output_elems: TaskCount,
    /// Whether `tasks` and `output_elems` count the step's rows or its rows with logits.
    pub rows: maxrun::format::RowCount,
}

/// A collective between launches: before launch `before_launch`.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledCollective {
    pub before_launch: usize,
    pub op: maxrun::format::CollectiveOp,
    pub input: u32,
    pub output: u32,
}

/// A scheduled plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub max_seq: u64,
    pub launches: Vec<ScheduledLaunch>,
    pub collectives: Vec<ScheduledCollective>,
    pub buffers: Vec<BufferInfo>,
    pub logits: u32,
}

/// The kernels of an artifact, deduplicated by name.
#[derive(Debug, Default)]
pub struct KernelSet {
    pub kernels: Vec<Kernel>,
    by_name: HashMap<String, u32>,
    /// GPU forms of CPU kernels, under the CPU kernel's name (same parameters and
    /// result; tasks the kernel's times a whole number, the kernel table's
    /// `gpu_task_split`): what the PTX runs instead of kernels written for CPU
    /// vector registers or for a CPU thread pool's few, large tasks.
    gpu_forms: HashMap<String, Kernel>,
}

impl KernelSet {
    fn add(&mut self, k: Kernel) -> u32 {
        if let Some(&i) = self.by_name.get(&k.name) {
            return i;
        }
        let i = self.kernels.len() as u32;
        self.by_name.insert(k.name.clone(), i);
        self.kernels.push(k);
        i
    }

    /// Records `gpu` as the GPU form of kernel `cpu` (a kernel-library bug if the
    /// two differ in parameters or the tasks are not a multiple).
    fn set_gpu_form(&mut self, cpu: &Kernel, mut gpu: Kernel) {
        let split = maxc_kernels::warp::task_split(&cpu.tasks, &gpu.tasks);
        assert!(gpu.params == cpu.params && split.is_some(), "`{}` is not a GPU form of `{}`", gpu.name, cpu.name);
        gpu.name = cpu.name.clone();
        self.gpu_forms.insert(cpu.name.clone(), gpu);
    }

    /// The kernels as the GPU compiles them: each replaced by its GPU form, if any.
    pub fn for_gpu(&self) -> Vec<Kernel> {
        self.kernels.iter().map(|k| self.gpu_forms.get(&k.name).unwrap_or(k).clone()).collect()
    }
}

/// Facts about the KV cache that the schedule implies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: u64,
    pub row_elems: u64,
}

fn unsupported(what: String) -> Error {
    Error::Verify(format!("the CPU backend cannot schedule {what}"))
}

struct Scheduler<'g, 'i, 'w> {
    graph: &'g Graph,
    interp: &'i mut crate::interp::Interpreter<'g>,
    weights: &'w mut WeightTable,
    kernels: &'w mut KernelSet,
    loc: Vec<Option<Arg>>,
    /// Every part of each weight placed so far.
    weight_loc: HashMap<(usize, Layout), Vec<Arg>>,
    launches: Vec<ScheduledLaunch>,
    collectives: Vec<ScheduledCollective>,
    buffers: Vec<BufferInfo>,
    max_seq: u64,
    /// The node being scheduled works on one row (the last token), with fixed task counts.
    one_row: bool,
    /// A batch plan: the KV cache's blocks, whether it is the decode plan, and
    /// the most rows with logits a step has.
    batch: Option<BatchMode>,
    /// The node being scheduled works on the batch step's rows with logits.
    logit_rows: bool,
    /// Quantized activations already computed: (value, levels, int8 form) ->
    /// (levels, scales).
    quantized: HashMap<(usize, ActivationLevels, Option<DotForm>), (Arg, Arg)>,
}

/// Arena bytes of a scratch buffer with `per_token` f32 per token of the step.
fn scratch_bytes(max_seq: u64, per_token: u64) -> u64 {
    max_seq * per_token * 4
}

impl Scheduler<'_, '_, '_> {
    /// The argument for value `v`, placing constants in the weights table on first use.
    fn input(&mut self, v: ValueId) -> Result<Arg> {
        if let Some(a) = self.loc[v.index()] {
            return Ok(a);
        }
        Ok(self.weight_parts(v)?[0])
    }

    /// The arguments for every stored part of constant `v` (one for float weights).
    fn weight_parts(&mut self, v: ValueId) -> Result<Vec<Arg>> {
        self.weight_parts_in(v, Layout::RowMajor)
    }

    fn weight_parts_in(&mut self, v: ValueId, layout: Layout) -> Result<Vec<Arg>> {
        let key = (v.index(), layout);
        if let Some(a) = self.weight_loc.get(&key) {
            return Ok(a.clone());
        }
        let a: Vec<Arg> = constant_slots(self.graph, self.interp, v, self.weights, layout)?.into_iter().map(Arg::Weight).collect();
        if layout == Layout::RowMajor {
            self.loc[v.index()] = Some(a[0]);
        }
        self.weight_loc.insert(key, a.clone());
        Ok(a)
    }

    /// `x` then every part of weight `w` (in `layout`) then the rest: a matmul's or embedding's arguments.
    fn weight_args(&mut self, before: &[ValueId], w: ValueId, after: &[ValueId], layout: Layout) -> Result<Vec<Arg>> {
        let mut args = self.inputs(before)?;
        args.extend(self.weight_parts_in(w, layout)?);
        args.extend(self.inputs(after)?);
        Ok(args)
    }

    /// The weight-layout decision, one per weight for every kernel that reads it:
    /// with int8 activations, a Q8_0 / Q4_0 / Q4_1 / Q4_K weight whose rows come in whole
    /// groups of 16 is interleaved for `matmul_interleaved` (a tied embedding table
    /// too: the gather reads that layout, unless the table is sharded by rows); a
    /// float or fp8 matmul weight whose rows come in whole panels, and that nothing
    /// reads row by row, is packed for `matmul_panel`; never in GPU-only artifacts.
    fn weight_layout(&self, w: ValueId) -> Layout {
        let ty = self.graph.ty(w);
        let shape: Vec<u64> = ty.shape.iter().map(|d| d.fixed().unwrap_or(0)).collect();
        let encoding = ty.quant;
        let gathered = self.graph.nodes.iter().any(|node| node.op == Op::Embedding && node.inputs.first() == Some(&w));
        let sharded_gather = gathered && matches!(&self.graph.node(w).op, Op::Weight { shard: Some(_), .. });
        if self.weights.row_major_only || shape.contains(&0) {
            Layout::RowMajor
        } else if self.weights.activations.levels().is_some() && Layout::Interleaved16.admits(encoding, &shape) && !sharded_gather {
            Layout::Interleaved16
        } else if Layout::Panel16.admits(encoding, &shape) && !gathered {
            Layout::Panel16
        } else {
            Layout::RowMajor
        }
    }

    /// Value `v` (`k` wide) quantized per block: to int8 in `form`'s order
    /// (`quantize_q8`), or to 16-bit levels stored as `levels` says
    /// (`quantize_q16`: byte planes or words; `form` unused). One launch per
    /// value and form, shared by every matmul reading it.
    fn quantized_activations(&mut self, v: ValueId, k: u64, (levels, form): (ActivationLevels, DotForm), seq: SeqMode) -> Result<(Arg, Arg)> {
        let key = (v.index(), levels, (levels == ActivationLevels::Int8).then_some(form));
        if let Some(&q) = self.quantized.get(&key) {
            return Ok(q);
        }
        let x = self.input(v)?;
        // Levels (one or two bytes per value); f32 scales (every block's d, then every d * sum).
        let scale_elems = 2 * (k / 32);
        let kernel = match levels {
            ActivationLevels::Int8 => quantize_q8(k, form, seq),
            sixteen => quantize_q16(k, sixteen, seq),
        };
        let outputs = self.launch_outputs(kernel, vec![x], &[k * levels.bytes(), scale_elems * 4], TaskCount { per_seq: scale_elems, fixed: 0 });
        let q = (outputs[0], outputs[1]);
        self.quantized.insert(key, q);
        Ok(q)
    }

    /// The integer-activation form of a matmul of `x` with block weight `w`
    /// (plus `addend`), when enabled and the encoding has integer levels: the
    /// interleaved kernel where the weight has that layout, else (int8 only)
    /// block dots.
    fn integer_matmul(&mut self, x: ValueId, w: ValueId, addend: Option<(ValueId, Broadcast)>, seq: SeqMode) -> Result<Option<Arg>> {
        let ty = self.graph.ty(w);
        let (n, k) = (ty.shape[0].fixed().expect("static"), ty.shape[1].fixed().expect("static"));
        let Some(levels) = self.weights.activations.levels().filter(|_| ty.quant.is_block()) else { return Ok(None) };
        let (encoding, bc) = (ty.quant, addend.map(|(_, bc)| bc));
        // 16-bit levels: in byte planes (byte dots take nibbles as they are), and
        // as words for Q8_0's bytes at decode (widened once, one word dot per
        // 16: int8's instruction count). Prefill keeps Q8_0 on planes: a words
        // tile holds four accumulators per row and takes half the rows, each
        // widened weight vector costing a shuffle-port `vpmovzxbw` for two rows'
        // dots; planes reuse the raw bytes across the full tile. Intel Xeon VM
        // (AVX-512 VNNI), 2 threads, pp512 planes against words: 1.17B Q8_0
        // 139.8 / 107.8 tok/s, Q4_K_M (its Q6_K tensors as q8_0) 161 / 148,
        // SmolLM2 q8_0 1062 / 765.
        let levels = match levels {
            ActivationLevels::Int16Planes if encoding == WeightEncoding::Q8_0 && seq.is_decode() => ActivationLevels::Int16Words,
            other => other,
        };
        let (form, layout, kernel) = match (self.weight_layout(w), levels, maxc_kernels::library::matmul_int8::dot_form(encoding, k)) {
            (Layout::Interleaved16, _, _) => (DotForm::Int8, Layout::Interleaved16, matmul_interleaved(k, n, encoding, bc, seq, self.weights.register_tile, levels)),
            (_, ActivationLevels::Int8, Some(form)) => (form, Layout::RowMajor, maxc_kernels::library::matmul_int8::matmul_int8(k, n, encoding, bc, seq)),
            _ => return Ok(None),
        };
        let (q, scales) = self.quantized_activations(x, k, (levels, form), seq)?;
        let mut args = vec![q, scales];
        args.extend(self.weight_parts_in(w, layout)?);
        if let Some((r, _)) = addend {
            args.push(self.input(r)?);
        }
        Ok(Some(self.launch(kernel, args, n)))
    }

    /// `x @ w^T` (plus `addend`, broadcast as given) for a weight `w`: the int8
    /// form when enabled, else the kernel for the weight's encoding and layout,
    /// with its GPU form recorded where the CPU one suits vector registers.
    fn weight_matmul(&mut self, x: ValueId, w: ValueId, addend: Option<(ValueId, Broadcast)>, seq: SeqMode) -> Result<Arg> {
        if let Some(out) = self.integer_matmul(x, w, addend, seq)? {
            return Ok(out);
        }
        let ty = self.graph.ty(w);
        let (n, k) = (ty.shape[0].fixed().expect("static"), ty.shape[1].fixed().expect("static"));
        let (quant, bc) = (ty.quant, addend.map(|(_, bc)| bc));
        let layout = self.weight_layout(w);
        let after: Vec<ValueId> = addend.map(|(r, _)| r).into_iter().collect();
        let args = self.weight_args(&[x], w, &after, layout)?;
        let (kernel, gpu_form) = match layout {
            Layout::Panel16 => {
                let weights = PanelWeights::of(quant).expect("panel16 weights have a panel form (weight_layout)");
                (matmul_panel(k, n, weights, bc, seq, self.weights.register_tile), Some(matmul_panel_rowwise(k, n, weights, bc, seq)))
            }
            _ if quant.is_block() && self.weights.row_major_only => (matmul_blocks_rowwise(k, n, quant, bc, seq), None),
            _ if quant.is_block() => (matmul_blocks(k, n, quant, bc, seq), Some(matmul_blocks_rowwise(k, n, quant, bc, seq))),
            Layout::RowMajor => match bc {
                None => (matmul(k, n, elem_of(quant), seq), None),
                Some(bc) => (matmul_add(k, n, bc, elem_of(quant), seq), None),
            },
            Layout::Interleaved16 => unreachable!("interleaved weights are read by the integer matmul (integer_matmul)"),
        };
        if let Some(gpu) = gpu_form {
            self.kernels.set_gpu_form(&kernel, gpu);
        }
        Ok(self.launch(kernel, args, n))
    }

    fn inputs(&mut self, vs: &[ValueId]) -> Result<Vec<Arg>> {
        vs.iter().map(|&v| self.input(v)).collect()
    }

    /// A scratch buffer for the next launch only, `per_token` f32 per token.
    fn scratch(&mut self, per_token: u64) -> Arg {
        let b = self.buffers.len() as u32;
        let at = self.launches.len();
        self.buffers.push(BufferInfo { bytes: scratch_bytes(self.max_seq, per_token), def: at, last_use: at });
        Arg::Buffer(b)
    }

    /// Appends a launch of `kernel` on `args` plus a new output buffer of `width` f32 per token.
    fn launch(&mut self, kernel: Kernel, args: Vec<Arg>, width: u64) -> Arg {
        self.launch_rows(kernel, args, width, TaskCount { per_seq: width, fixed: 0 })
    }

    /// [`Scheduler::launch`] of `kernel`, whose PTX runs `gpu` (its GPU form:
    /// same parameters and result, tasks a multiple of the kernel's).
    fn launch_with_gpu_form(&mut self, kernel: Kernel, gpu: Kernel, args: Vec<Arg>, width: u64) -> Arg {
        self.kernels.set_gpu_form(&kernel, gpu);
        self.launch(kernel, args, width)
    }

    /// Like [`Scheduler::launch`] for an output of `written` elements (e.g. one pooled row).
    fn launch_rows(&mut self, kernel: Kernel, args: Vec<Arg>, width: u64, written: TaskCount) -> Arg {
        self.launch_outputs(kernel, args, &[width * 4], written)[0]
    }

    /// Appends a launch of `kernel` on `args` plus one new output buffer per entry
    /// of `bytes_per_row` (bytes per token), in order; `written` counts the f32
    /// elements of the last one.
    fn launch_outputs(&mut self, kernel: Kernel, mut args: Vec<Arg>, bytes_per_row: &[u64], written: TaskCount) -> Vec<Arg> {
        let at = self.launches.len();
        // A one-row value (the last token's, in a last-row plan) needs one row.
        let rows = if self.one_row {
            1
        } else if self.logit_rows {
            self.batch.expect("logit rows are a batch plan's").max_outputs
        } else {
            self.max_seq
        };
        let mut outputs = Vec::with_capacity(bytes_per_row.len());
        for &bytes in bytes_per_row {
            outputs.push(Arg::Buffer(self.buffers.len() as u32));
            self.buffers.push(BufferInfo { bytes: rows * bytes, def: at, last_use: at });
        }
        args.extend(&outputs);
        let (mut tasks, mut written) = (kernel.tasks, written);
        if self.one_row {
            tasks = TaskCount { per_seq: 0, fixed: tasks.eval(1) };
            written = TaskCount { per_seq: 0, fixed: written.eval(1) };
        }
        let rows = if self.logit_rows { maxrun::format::RowCount::Logits } else { maxrun::format::RowCount::Step };
        self.launches.push(ScheduledLaunch { kernel: self.kernels.add(kernel), args, tasks, output_elems: written, rows });
        outputs
    }
}

/// The KV cache the kernels address: positions, and the element type.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub max_len: u64,
    /// `F32`, or `F16` (`--kv-cache-encoding float16`).
    pub elem: maxc_kernels::ElemType,
}

impl KvCacheSpec {
    pub fn new(max_len: u64, encoding: maxrun::format::KvEncoding) -> Self {
        let elem = match encoding {
            maxrun::format::KvEncoding::Float32 => maxc_kernels::ElemType::F32,
            maxrun::format::KvEncoding::Float16 => maxc_kernels::ElemType::F16,
        };
        KvCacheSpec { max_len, elem }
    }
}

/// Schedules `graph` for `seq` with plans sized for `max_seq` tokens per step and
/// the KV cache `cache`.
pub fn schedule<'g>(
    graph: &'g Graph,
    interp: &mut crate::interp::Interpreter<'g>,
    seq: SeqMode,
    max_seq: u64,
    cache: KvCacheSpec,
    weights: &mut WeightTable,
    kernels: &mut KernelSet,
) -> Result<Schedule> {
    schedule_impl(graph, interp, seq, max_seq, cache, weights, kernels, None, None)
}

/// What a batch plan is scheduled for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BatchMode {
    pub paging: Paging,
    /// The decode plan (every row its sequence's last token: split attention),
    /// or the mixed one (prompt chunks too).
    pub decode: bool,
    /// Rows with logits per step (the step's sequences at most).
    pub max_outputs: u64,
}

/// A batch plan ([`maxrun::format::BatchPlans`]): steps of up to `max_rows` rows
/// of many sequences over a paged KV cache; from the value `cut` (see
/// [`last_row_cut`]) on, only the rows whose logits the step returns.
#[allow(clippy::too_many_arguments)]
pub fn schedule_batch<'g>(
    graph: &'g Graph,
    interp: &mut crate::interp::Interpreter<'g>,
    cut: ValueId,
    mode: BatchMode,
    max_rows: u64,
    cache: KvCacheSpec,
    weights: &mut WeightTable,
    kernels: &mut KernelSet,
) -> Result<Schedule> {
    // One row: the single-stream decode plan's kernels (GEMVs that stream their
    // weights), only attention and the KV store paged.
    let seq = if max_rows == 1 { SeqMode::Fixed(1) } else { SeqMode::Dynamic };
    schedule_impl(graph, interp, seq, max_rows, cache, weights, kernels, Some(cut), Some(mode))
}

/// Where a prefill plan that returns only the last token's logits can drop to one
/// row: the residual stream feeding the final norm, when everything from that norm
/// to the logits is row-local (norms, matmuls with weights, element-wise ops with
/// constants). `None` when the graph has another shape (encoders have no logits).
pub fn last_row_cut(graph: &Graph, interp: &crate::interp::Interpreter<'_>) -> Option<ValueId> {
    let (_, mut v) = graph.outputs.iter().find(|(n, _)| n == "logits")?.clone();
    loop {
        let node = graph.node(v);
        let constant_rest = node.inputs[1..].iter().all(|&i| interp.is_constant(i));
        match node.op {
            Op::RmsNorm { .. } | Op::LayerNorm { .. } if constant_rest => return Some(node.inputs[0]),
            Op::MatMul | Op::MatMulAdd | Op::Binary(_) | Op::Unary(_) if constant_rest => v = node.inputs[0],
            // Row-local exchanges: each row's result depends on that row only.
            Op::AllReduce | Op::AllGather { axis: 1, .. } => v = node.inputs[0],
            _ => return None,
        }
    }
}

/// [`schedule`] for a prefill plan whose logits are the last token's only: from the
/// value `cut` (see [`last_row_cut`]) on, one row is computed.
pub fn schedule_last_row<'g>(
    graph: &'g Graph,
    interp: &mut crate::interp::Interpreter<'g>,
    cut: ValueId,
    max_seq: u64,
    cache: KvCacheSpec,
    weights: &mut WeightTable,
    kernels: &mut KernelSet,
) -> Result<Schedule> {
    schedule_impl(graph, interp, SeqMode::Dynamic, max_seq, cache, weights, kernels, Some(cut), None)
}

#[allow(clippy::too_many_arguments)]
fn schedule_impl<'g>(
    graph: &'g Graph,
    interp: &mut crate::interp::Interpreter<'g>,
    step_seq: SeqMode,
    max_seq: u64,
    cache: KvCacheSpec,
    weights: &mut WeightTable,
    kernels: &mut KernelSet,
    cut: Option<ValueId>,
    batch: Option<BatchMode>,
) -> Result<Schedule> {
    let max_len = cache.max_len;
    let mut s = Scheduler {
        graph,
        interp,
        weights,
        kernels,
        loc: vec![None; graph.nodes.len()],
        weight_loc: HashMap::new(),
        launches: vec![],
        collectives: vec![],
        buffers: vec![],
        max_seq,
        one_row: false,
        batch,
        logit_rows: false,
        quantized: HashMap::new(),
    };
    let static_dim = |d: Dim| d.fixed().expect("non-leading dims are static");
    // Values that hold one row (the last token's) in a last-row plan.
    let mut single = vec![false; graph.nodes.len()];
    for id in graph.ids() {
        let node = graph.node(id);
        if s.interp.is_constant(id) {
            // Constants are placed in the weights table when an operation first uses them.
            continue;
        }
        // In a last-row plan, the first reader of `cut` takes the last row of it; from
        // there on, kernels for one row (decode's) with fixed task counts. In a batch
        // plan it takes the rows whose logits the step returns, and the kernels
        // from there on run over those rows.
        if let Some(c) = cut {
            if node.inputs.first() == Some(&c) && !single[c.index()] {
                let width = graph.ty(c).last_dim().expect("static width");
                let src = s.input(c)?;
                let rows = if s.batch.is_some() {
                    s.logit_rows = true;
                    s.launch(gather_rows(width), vec![src, Arg::LogitRows], width)
                } else {
                    s.one_row = true;
                    s.launch_rows(last_row(width), vec![src], width, TaskCount { per_seq: 0, fixed: width })
                };
                s.loc[c.index()] = Some(rows);
                single[c.index()] = true;
            }
        }
        let after_cut = node.inputs.iter().any(|i| single[i.index()]);
        single[id.index()] = after_cut;
        s.one_row = after_cut && s.batch.is_none();
        s.logit_rows = after_cut && s.batch.is_some();
        let seq = if s.one_row { SeqMode::Fixed(1) } else { step_seq };
        let out_width = || -> Result<u64> {
            match node.ty.shape.as_slice() {
                [Dim::Sym(SymDim::Seq), Dim::Fixed(w)] => Ok(*w),
                other => Err(unsupported(format!("a {} result of shape {other:?}", node.op.mnemonic()))),
            }
        };
        let out = match &node.op {
            Op::Input { name, .. } => match name.as_str() {
                "tokens" => Arg::Tokens,
                "positions" => Arg::Positions,
                other => return Err(unsupported(format!("graph input `{other}`"))),
            },
            Op::Weight { .. } | Op::Constant { .. } => unreachable!("constants are skipped above"),
            Op::Embedding => {
                let t = graph.ty(node.inputs[0]);
                let (vocab, hidden) = (static_dim(t.shape[0]), static_dim(t.shape[1]));
                let layout = s.weight_layout(node.inputs[0]);
                let args = s.weight_args(&[], node.inputs[0], &node.inputs[1..], layout)?;
                let kernel = match (&graph.node(node.inputs[0]).op, t.placement) {
                    (Op::Weight { shard: Some(sh), .. }, _) if sh.axis == 0 => embedding_range(vocab, sh.index as u64 * vocab, hidden, t.quant, seq),
                    (_, crate::graph::Placement::Sharded { .. }) => return Err(unsupported("a sharded embedding table that is not a checkpoint weight".into())),
                    _ => embedding_in(vocab, hidden, t.quant, layout == Layout::Interleaved16, seq),
                };
                s.launch(kernel, args, hidden)
            }
            Op::MatMul | Op::MatMulAdd => {
                if !s.interp.is_constant(node.inputs[1]) {
                    return Err(unsupported("a matmul whose right operand is not a weight".into()));
                }
                let addend = (node.op == Op::MatMulAdd).then(|| {
                    let bc = if graph.ty(node.inputs[2]).shape.len() == 1 { Broadcast::Row } else { Broadcast::None };
                    (node.inputs[2], bc)
                });
                s.weight_matmul(node.inputs[0], node.inputs[1], addend, seq)?
            }
            Op::SwiGlu => {
                let w = out_width()?;
                let args = s.inputs(&node.inputs)?;
                s.launch_with_gpu_form(swiglu(w, seq), swiglu_gpu(w, seq), args, w)
            }
            Op::Unary(u) => {
                let op = *u;
                let w = out_width()?;
                let args = s.inputs(&node.inputs)?;
                s.launch_with_gpu_form(unary(op, w, seq), unary_gpu(op, w, seq), args, w)
            }
            Op::Binary(b) => {
                let op = *b;
                let w = out_width()?;
                if s.interp.is_constant(node.inputs[0]) {
                    return Err(unsupported("a binary op whose left operand is constant".into()));
                }
                let rhs = graph.ty(node.inputs[1]);
                let bc = if rhs.num_elements() == Some(1) {
                    Broadcast::Scalar
                } else if rhs.num_elements() == Some(w) {
                    Broadcast::Row
                } else {
                    Broadcast::None
                };
                let args = s.inputs(&node.inputs)?;
                s.launch_with_gpu_form(binary(op, w, bc, seq), binary_gpu(op, w, bc, seq), args, w)
            }
            Op::RmsNorm { eps } => {
                let w = out_width()?;
                let group = graph.ty(node.inputs[1]).last_dim().expect("static weight");
                let args = s.inputs(&node.inputs)?;
                s.launch(rms_norm(w, group, *eps, seq), args, w)
            }
            Op::Rope { head_dim, theta, scaling } => {
                let w = out_width()?;
                let freqs = inv_freq(*head_dim, *theta, scaling);
                let bits: Vec<String> = freqs.iter().map(|f| format!("{:08x}", f.to_bits())).collect();
                let name = format!("rope.inv_freq.hd{head_dim}.{}", short_hash(&bits.concat()));
                let slot = WeightSlot::plain(name, vec![freqs.len() as u64], WeightData::Values(freqs));
                let table = s.weights.intern(slot);
                let mut args = s.inputs(&node.inputs)?;
                args.push(Arg::Weight(table));
                s.launch_with_gpu_form(rope(w, *head_dim as u64, seq), rope_gpu(w, *head_dim as u64, seq), args, w)
            }
            Op::Attention { layer, heads, kv_heads, head_dim, scale, window, softcap, causal } => {
                let a = s.inputs(&node.inputs)?;
                let (q, k, v, pos) = (a[0], a[1], a[2], a[3]);
                let (kc, vc) = (Arg::KeyCache(*layer), Arg::ValueCache(*layer));
                let (store, store_args) = match s.batch {
                    Some(b) => (kv_store_paged(*kv_heads as u64, *head_dim as u64, b.paging, cache.elem), vec![k, v, Arg::Slots, kc, vc]),
                    None => (kv_store(*kv_heads as u64, *head_dim as u64, max_len, cache.elem, seq), vec![k, v, pos, kc, vc]),
                };
                let tasks = store.tasks;
                let kernel = s.kernels.add(store);
                let none = TaskCount { per_seq: 0, fixed: 0 };
                s.launches.push(ScheduledLaunch { kernel, args: store_args, tasks, output_elems: none, rows: maxrun::format::RowCount::Step });
                let shape = AttentionShape {
                    heads: *heads as u64,
                    kv_heads: *kv_heads as u64,
                    head_dim: *head_dim as u64,
                    scale: *scale,
                    window: window.map(u64::from),
                    max_len,
                    softcap: *softcap,
                    causal: *causal,
                    cache: cache.elem,
                };
                if let Some(b) = s.batch {
                    if !shape.causal {
                        return Err(unsupported("bidirectional attention in a batch plan".into()));
                    }
                    let paged = [q, pos, Arg::RowSequences, Arg::BlockTables, kc, vc];
                    if b.decode {
                        // Decode rows: flash-decoding, as the single-stream decode plan.
                        let splits = DECODE_SPLITS;
                        let scratch = s.scratch(shape.split_scratch_per_token(splits));
                        let per_token = shape.partials_per_token(splits);
                        let written = TaskCount { per_seq: per_token, fixed: 0 };
                        let partials = s.launch_outputs(attention_paged(shape, b.paging, Some(splits)), [&paged[..], &[scratch]].concat(), &[per_token * 4], written)[0];
                        s.launch_with_gpu_form(attention_combine(shape, splits, seq), attention_combine_gpu(shape, splits, seq), vec![partials, pos], out_width()?)
                    } else {
                        let scratch = s.scratch(shape.kv_heads * shape.scratch_per_task());
                        s.launch(attention_paged(shape, b.paging, None), [&paged[..], &[scratch]].concat(), out_width()?)
                    }
                } else if seq.is_decode() && shape.causal {
                    // Flash-decoding: a task per (KV head, chunk of positions),
                    // then a merge (docs/performance.md, Decisions).
                    let splits = DECODE_SPLITS;
                    let scratch = s.scratch(shape.split_scratch_per_token(splits));
                    let per_token = shape.partials_per_token(splits);
                    let written = TaskCount { per_seq: per_token, fixed: 0 };
                    let partials = s.launch_outputs(attention_partial(shape, splits, seq), vec![q, pos, kc, vc, scratch], &[per_token * 4], written)[0];
                    s.launch_with_gpu_form(attention_combine(shape, splits, seq), attention_combine_gpu(shape, splits, seq), vec![partials, pos], out_width()?)
                } else {
                    let scratch = s.scratch(shape.kv_heads * shape.scratch_per_task());
                    s.launch(attention(shape, seq), vec![q, pos, kc, vc, scratch], out_width()?)
                }
            }
            Op::Slice { axis: 1, start, len } => {
                let width = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let args = s.inputs(&node.inputs)?;
                s.launch_with_gpu_form(slice_columns(width, *start, *len, seq), slice_columns_gpu(width, *start, *len, seq), args, *len)
            }
            Op::Slice { axis, .. } => return Err(unsupported(format!("a slice along axis {axis} of activations"))),
            Op::ShardSlice { axis: 1, index, devices } => {
                let width = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let len = width / *devices as u64;
                let args = s.inputs(&node.inputs)?;
                s.launch_with_gpu_form(slice_columns(width, *index as u64 * len, len, seq), slice_columns_gpu(width, *index as u64 * len, len, seq), args, len)
            }
            Op::ShardSlice { axis, .. } => return Err(unsupported(format!("a shard slice along axis {axis} of activations"))),
            Op::AllReduce | Op::AllGather { axis: 1, .. } if s.batch.is_some() => return Err(unsupported("a collective in a batch plan (batch plans are for one device)".into())),
            Op::AllReduce | Op::AllGather { axis: 1, .. } => {
                let src = match s.input(node.inputs[0])? {
                    Arg::Buffer(b) => b,
                    other => return Err(unsupported(format!("a collective over {other:?}"))),
                };
                let width = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let rows = if s.one_row { TaskCount { per_seq: 0, fixed: 1 } } else { TaskCount { per_seq: 1, fixed: 0 } };
                let (op, out_width) = match node.op {
                    Op::AllGather { devices, .. } => (maxrun::format::CollectiveOp::AllGather { rows, cols: width }, width * devices as u64),
                    _ => (maxrun::format::CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: rows.per_seq * width, fixed: rows.fixed * width } }, width),
                };
                let at = s.launches.len();
                let out = s.buffers.len() as u32;
                let rows_held = if s.one_row { 1 } else { s.max_seq };
                s.buffers.push(BufferInfo { bytes: rows_held * out_width * 4, def: at, last_use: at });
                let input = &mut s.buffers[src as usize];
                input.last_use = input.last_use.max(at);
                s.collectives.push(ScheduledCollective { before_launch: at, op, input: src, output: out });
                Arg::Buffer(out)
            }
            Op::AllGather { axis, .. } => return Err(unsupported(format!("an all-gather along axis {axis}"))),
            Op::LayerNorm { eps } => {
                let w = out_width()?;
                let args = s.inputs(&node.inputs)?;
                s.launch(layer_norm(w, *eps, seq), args, w)
            }
            Op::MeanRows => {
                let w = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let args = s.inputs(&node.inputs)?;
                s.launch_rows(mean_rows(w, seq), args, w, TaskCount { per_seq: 0, fixed: w })
            }
            Op::L2Normalize => {
                let ty = &node.ty;
                let w = ty.last_dim().expect("static width");
                let rows = match ty.shape[0] {
                    Dim::Fixed(r) => r,
                    Dim::Sym(_) => return Err(unsupported("an l2_normalize over a dynamic number of rows".into())),
                };
                let args = s.inputs(&node.inputs)?;
                s.launch_rows(l2_normalize(w, rows), args, w, TaskCount { per_seq: 0, fixed: rows * w })
            }
            Op::Transpose => return Err(unsupported("a transpose of activations (only weights are transposed, at compile time)".into())),
            Op::Concat { .. } => return Err(unsupported("a concatenation of activations".into())),
        };
        s.loc[id.index()] = Some(out);
    }
    // Liveness: a buffer lives until its last reader; the logits live to the end.
    let Scheduler { mut buffers, launches, collectives, loc, .. } = s;
    for (i, l) in launches.iter().enumerate() {
        for a in &l.args {
            if let Arg::Buffer(b) = a {
                let info = &mut buffers[*b as usize];
                info.last_use = info.last_use.max(i);
            }
        }
    }
    let (_, logits_value) = graph
        .outputs
        .iter()
        .find(|(n, _)| n == "logits" || n == "embedding")
        .ok_or_else(|| unsupported("a graph without `logits` or `embedding`".into()))?;
    let Some(Arg::Buffer(logits)) = loc[logits_value.index()] else {
        return Err(unsupported("logits that are not computed by a kernel".into()));
    };
    buffers[logits as usize].last_use = launches.len();
    // A collective's output is read by later launches (above) or is the logits; the
    // liveness sweep above only saw launches, so a buffer read by a collective
    // already had its last use moved to the collective's slot.
    Ok(Schedule { max_seq, launches, collectives, buffers, logits })
}

/// Places a constant node in the weights table: one slot per stored part.
fn constant_slots(graph: &Graph, interp: &mut crate::interp::Interpreter<'_>, v: ValueId, weights: &mut WeightTable, layout: Layout) -> Result<Vec<u32>> {
    let node = graph.node(v);
    let shape: Vec<u64> = node.ty.shape.iter().map(|d| d.fixed().expect("constants are static")).collect();
    let slots = match &node.op {
        Op::Weight { name, shard, .. } => WeightSlot::parts(name, shape, WeightData::Checkpoint(name.clone()), node.ty.quant, layout, *shard),
        Op::Concat { axis: 0 } if same_shard_weights(graph, &node.inputs).is_some() => {
            let names: Vec<String> = node
                .inputs
                .iter()
                .map(|i| match &graph.node(*i).op {
                    Op::Weight { name, .. } => name.clone(),
                    _ => unreachable!("checked above"),
                })
                .collect();
            let shard = same_shard_weights(graph, &node.inputs).flatten();
            WeightSlot::parts(&format!("stack({})", names.join(",")), shape, WeightData::Stacked(names), node.ty.quant, layout, shard)
        }
        _ => {
            let t = interp.constant_value(v)?;
            let values = t.as_f32().to_vec();
            let bits: String = values.iter().map(|f| format!("{:08x}", f.to_bits())).collect();
            let mut slot = WeightSlot::plain(format!("const.{}", short_hash(&bits)), shape, WeightData::Values(values));
            if layout == Layout::Panel16 {
                slot.name.push_str(layout_suffix(layout));
                slot.layout = layout;
            }
            vec![slot]
        }
    };
    Ok(slots.into_iter().map(|slot| weights.intern(slot)).collect())
}

/// `Some(shard)` when every input is a checkpoint weight with the same shard (or none).
fn same_shard_weights(graph: &Graph, inputs: &[ValueId]) -> Option<Option<WeightShard>> {
    let shard_of = |v: &ValueId| match &graph.node(*v).op {
        Op::Weight { shard, .. } => Some(*shard),
        _ => None,
    };
    let first = shard_of(inputs.first()?)?;
    inputs.iter().all(|v| shard_of(v) == Some(first)).then_some(first)
}

/// A stable 64-bit FNV-1a hash in hex (names must not depend on hash-map order or process).
pub fn short_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// The KV-cache shape of a graph: all attention layers must share one row width.
pub fn kv_shape(graph: &Graph) -> Result<KvShape> {
    let mut row = None;
    let mut layers = 0u64;
    for n in &graph.nodes {
        if let Op::Attention { layer, kv_heads, head_dim, .. } = n.op {
            let w = kv_heads as u64 * head_dim as u64;
            if row.is_some_and(|r| r != w) {
                return Err(unsupported("attention layers with different KV widths".into()));
            }
            row = Some(w);
            layers = layers.max(layer as u64 + 1);
        }
    }
    Ok(KvShape { layers, row_elems: row.unwrap_or(0) })
}
