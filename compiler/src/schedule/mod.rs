//! Scheduling: lower the optimized graph to a linear launch plan over kernels from
//! the kernel library, with constants placed in the weights table and activations
//! assigned to one arena by [`memory::plan_arena`].
//!
//! The same graph is scheduled several times: a prefill plan for any sequence
//! length up to `max_seq`, a decode plan specialized to `seq = 1`, a prefill plan
//! that computes only the last row's logits, the batched engine's plans
//! ([`schedule_batch`]: many sequences per step over a paged KV cache), and a
//! sentence encoder's batch plan ([`schedule_encode_batch`]: many whole
//! sequences per step, no KV cache, one pooled embedding per sequence).

mod matmul;
pub mod memory;
mod moe;
mod weights;

pub use matmul::ActivationEncoding;
pub use weights::{short_hash, WeightData, WeightSlot, WeightTable};
use weights::constant_slots;

use std::collections::HashMap;

use maxc_kernels::library::attention::{attention, attention_combine, attention_combine_gpu, attention_paged, attention_partial, kv_store, kv_store_paged, AttentionShape, KeyLayout, Paging, DECODE_SPLITS};
use maxc_kernels::library::attention_ragged::{attention_ragged, RaggedShape};
use maxc_kernels::library::copy::{gather_rows, last_row, slice_columns, slice_columns_gpu};
use maxc_kernels::library::elementwise::{binary, binary_gpu, swiglu, swiglu_gpu, unary, unary_gpu, Broadcast};
use maxc_kernels::library::pooling::{l2_normalize, l2_normalize_rows, mean_rows, mean_rows_ragged};
use maxc_kernels::ir::DotForm;
use maxc_kernels::library::embedding::{embedding_in, embedding_range};
use maxc_kernels::library::matmul::{matmul, matmul_add, matmul_rowwise};
use maxc_kernels::library::matmul_blocks::{matmul_blocks, matmul_blocks_rowwise};
use maxc_kernels::library::matmul_interleaved::matmul_interleaved;
use maxc_kernels::library::quantize_activations::{level_half_sums, quantize_to, round_bf16, ActivationLevels};
use maxc_kernels::library::matmul_panel::{matmul_panel, matmul_panel_rowwise, PanelWeights};
use maxc_kernels::library::rms_norm::{layer_norm, rms_norm};
use maxc_kernels::library::rope::{rope, rope_gpu};
use maxc_kernels::library::{RegisterTile, SeqMode};
use maxc_kernels::{Kernel, TaskCount};
use maxc_format::{BufferRef, Layout, WeightEncoding};

use crate::error::{Error, Result};
use crate::graph::rope::inv_freq;
use crate::graph::{Dim, Graph, Op, SymDim, ValueId, WeightShard};

/// A launch argument before arena offsets are known: the artifact's
/// [`BufferRef`] with an activation named by its index into
/// [`Schedule::buffers`] (`Arg::Arena { offset: index }`) until
/// `memory::plan_arena` lays the buffers out.
pub type Arg = BufferRef<u32>;

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
    pub rows: maxc_format::RowCount,
}

/// A collective between launches: before launch `before_launch`.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledCollective {
    pub before_launch: usize,
    pub op: maxc_format::CollectiveOp,
    pub input: u32,
    pub output: u32,
    /// Whether the op's counts follow the step's rows or its rows with logits.
    pub rows: maxc_format::RowCount,
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
    pub head_dim: u64,
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
    /// Per quantized activation value and levels: its sums per 16 values
    /// (`level_half_sums`, for Q6_K's row dots), one launch shared by its readers.
    half_sums: HashMap<(usize, ActivationLevels), Arg>,
    /// Values already rounded to bfloat16 for pair-dot matmuls (`round_bf16`).
    rounded_bf16: HashMap<usize, Arg>,
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
    fn inputs(&mut self, vs: &[ValueId]) -> Result<Vec<Arg>> {
        vs.iter().map(|&v| self.input(v)).collect()
    }

    /// A scratch buffer for the next launch only, `per_token` f32 per token.
    fn scratch(&mut self, per_token: u64) -> Arg {
        let b = self.buffers.len() as u32;
        let at = self.launches.len();
        self.buffers.push(BufferInfo { bytes: scratch_bytes(self.max_seq, per_token), def: at, last_use: at });
        Arg::Arena { offset: b }
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
            self.batch.expect("logit rows are a batch plan's").max_outputs()
        } else {
            self.max_seq
        };
        let mut outputs = Vec::with_capacity(bytes_per_row.len());
        for &bytes in bytes_per_row {
            outputs.push(Arg::Arena { offset: self.buffers.len() as u32 });
            self.buffers.push(BufferInfo { bytes: rows * bytes, def: at, last_use: at });
        }
        args.extend(&outputs);
        let (mut tasks, mut written) = (kernel.tasks, written);
        if self.one_row {
            tasks = TaskCount { per_seq: 0, fixed: tasks.eval(1) };
            written = TaskCount { per_seq: 0, fixed: written.eval(1) };
        }
        let rows = if self.logit_rows { maxc_format::RowCount::Logits } else { maxc_format::RowCount::Step };
        self.launches.push(ScheduledLaunch { kernel: self.kernels.add(kernel), args, tasks, output_elems: written, rows });
        outputs
    }
}

/// The KV cache the kernels address: positions, the encoding, and whether
/// the artifact has CPU code (whose kernels keep the keys in panels).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub max_len: u64,
    /// `float32`, or `float16` (`--kv-cache-encoding float16`).
    pub encoding: maxc_format::KvEncoding,
    /// The element type the attention kernels read and write: a one-part
    /// encoding's ([`maxc_format::KvEncoding::element`]).
    pub elem: maxc_kernels::ElemType,
    /// CPU code: its kernels lay the keys out in panels of 16 positions where
    /// the encoding allows it and whole panels fit ([`KeyLayout::for_cpu`]);
    /// the GPU forms, and every kernel of an artifact without CPU code, keep rows.
    pub cpu_code: bool,
}

impl KvCacheSpec {
    pub fn new(max_len: u64, encoding: maxc_format::KvEncoding, cpu_code: bool) -> Self {
        let elem = match encoding.element() {
            Some(maxc_format::DType::F32) => maxc_kernels::ElemType::F32,
            Some(maxc_format::DType::F16) => maxc_kernels::ElemType::F16,
            other => unreachable!("the attention kernels take float caches; {} has parts {other:?}", encoding.name()),
        };
        KvCacheSpec { max_len, encoding, elem, cpu_code }
    }

    /// The CPU kernels' key layout for caches of runs of `run` positions.
    fn keys(&self, run: u64) -> KeyLayout {
        if self.cpu_code && self.encoding.keys_in_panels() {
            KeyLayout::for_cpu(run)
        } else {
            KeyLayout::Rows
        }
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
pub enum BatchMode {
    /// The batched engine's plans over a paged KV cache.
    Paged {
        paging: Paging,
        /// The decode plan (every row its sequence's last token: split
        /// attention), or the mixed one (prompt chunks too).
        decode: bool,
        /// Rows with logits per step (the step's sequences at most).
        max_outputs: u64,
    },
    /// A sentence encoder's batch plan: whole sequences, each a run of the
    /// step's rows (`SequenceStarts`), attending to their own rows (no KV
    /// cache); from the pooling on, one row per sequence.
    Encode {
        /// Sequences per step: the pooled rows.
        max_sequences: u64,
    },
}

impl BatchMode {
    /// The most rows a step has from the cut (the gather of the rows with
    /// logits, or an encoder's pooling) on.
    pub fn max_outputs(&self) -> u64 {
        match *self {
            BatchMode::Paged { max_outputs, .. } => max_outputs,
            BatchMode::Encode { max_sequences } => max_sequences,
        }
    }

    fn paging(&self) -> Option<Paging> {
        match *self {
            BatchMode::Paged { paging, .. } => Some(paging),
            BatchMode::Encode { .. } => None,
        }
    }
}

/// A batch plan ([`maxc_format::BatchPlans`]): steps of up to `max_rows` rows
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

/// A sentence encoder's batch plan ([`maxc_format::EncodeBatch`]): steps of
/// up to `max_rows` rows holding up to `max_sequences` whole sequences, each a
/// run of rows (inputs tokens, positions within the sequence, `RowSequences`,
/// `SequenceStarts`). Attention is over each row's own sequence's rows of the
/// step (`attention_ragged`: no KV cache), `mean_rows` pools each sequence
/// (`mean_rows_ragged`), and what follows the pooling runs over the step's
/// sequences: the output is `[sequences, width]`.
pub fn schedule_encode_batch<'g>(
    graph: &'g Graph,
    interp: &mut crate::interp::Interpreter<'g>,
    max_rows: u64,
    max_sequences: u64,
    cache: KvCacheSpec,
    weights: &mut WeightTable,
    kernels: &mut KernelSet,
) -> Result<Schedule> {
    let mode = BatchMode::Encode { max_sequences };
    schedule_impl(graph, interp, SeqMode::Dynamic, max_rows, cache, weights, kernels, None, Some(mode))
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
        half_sums: HashMap::new(),
        rounded_bf16: HashMap::new(),
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
                    _ => embedding_in(vocab, hidden, t.quant, layout, seq),
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
            Op::Attention { heads, kv_heads, head_dim, scale, window, softcap, causal, sinks, .. } if matches!(s.batch, Some(BatchMode::Encode { .. })) => {
                // No KV cache: each row attends to its own sequence's rows of the step.
                if *sinks {
                    return Err(unsupported("attention sinks in an encoder's batch plan".into()));
                }
                if *causal || window.is_some() {
                    return Err(unsupported("causal or sliding-window attention in an encoder's batch plan".into()));
                }
                let a = s.inputs(&node.inputs)?;
                let shape = RaggedShape { heads: *heads as u64, kv_heads: *kv_heads as u64, head_dim: *head_dim as u64, scale: *scale, softcap: *softcap };
                s.launch(attention_ragged(shape), vec![a[0], a[1], a[2], Arg::RowSequences, Arg::SequenceStarts], out_width()?)
            }
            Op::Attention { layer, heads, kv_heads, head_dim, scale, window, softcap, causal, sinks } => {
                let a = s.inputs(&node.inputs)?;
                let (q, k, v, pos) = (a[0], a[1], a[2], a[3]);
                // gpt-oss's sinks (one logit per query head, f32): whole attention
                // and the merge take them after the caches (split attention's
                // chunks do not).
                let sink: Vec<Arg> = a.get(4).copied().filter(|_| *sinks).into_iter().collect();
                let with_sinks = |head: &[Arg], tail: &[Arg]| [head, &sink[..], tail].concat();
                // A float cache's one part (KvCacheSpec::new admits only those).
                let (kc, vc) = (Arg::KeyCache { layer: *layer, part: 0 }, Arg::ValueCache { layer: *layer, part: 0 });
                // CPU code keeps the keys in panels of 16 positions where whole
                // panels fit (scores without horizontal sums); the GPU forms keep
                // rows (a warp's lanes share a key row's dot product).
                let paging = s.batch.and_then(|b| b.paging());
                let keys = cache.keys(paging.map_or(max_len, |p| p.block_size));
                let store_in = |keys| match paging {
                    Some(p) => kv_store_paged(*kv_heads as u64, *head_dim as u64, p, cache.elem, keys),
                    None => kv_store(*kv_heads as u64, *head_dim as u64, max_len, cache.elem, keys, seq),
                };
                let (store, store_gpu) = (store_in(keys), store_in(KeyLayout::Rows));
                let store_args = match paging {
                    Some(_) => vec![k, v, Arg::Slots, kc, vc],
                    None => vec![k, v, pos, kc, vc],
                };
                let tasks = store.tasks;
                s.kernels.set_gpu_form(&store, store_gpu);
                let kernel = s.kernels.add(store);
                let none = TaskCount { per_seq: 0, fixed: 0 };
                s.launches.push(ScheduledLaunch { kernel, args: store_args, tasks, output_elems: none, rows: maxc_format::RowCount::Step });
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
                    keys,
                    sinks: *sinks,
                };
                let rows = AttentionShape { keys: KeyLayout::Rows, ..shape };
                if let Some(BatchMode::Paged { paging, decode, .. }) = s.batch {
                    if !shape.causal {
                        return Err(unsupported("bidirectional attention in a batch plan over the KV cache".into()));
                    }
                    let paged = [q, pos, Arg::RowSequences, Arg::BlockTables, kc, vc];
                    if decode {
                        // Decode rows: flash-decoding, as the single-stream decode plan.
                        let splits = DECODE_SPLITS;
                        let scratch = s.scratch(shape.split_scratch_per_token(splits));
                        let per_token = shape.partials_per_token(splits);
                        let written = TaskCount { per_seq: per_token, fixed: 0 };
                        let kernel = attention_paged(shape, paging, Some(splits));
                        s.kernels.set_gpu_form(&kernel, attention_paged(rows, paging, Some(splits)));
                        let partials = s.launch_outputs(kernel, [&paged[..], &[scratch]].concat(), &[per_token * 4], written)[0];
                        s.launch_with_gpu_form(attention_combine(shape, splits, seq), attention_combine_gpu(shape, splits, seq), with_sinks(&[partials, pos], &[]), out_width()?)
                    } else {
                        // The decode plans' chunks one after another, each into a
                        // partial row of its own (batch invariance, docs/serving.md).
                        let scratch = s.scratch(shape.kv_heads * shape.scratch_per_task());
                        s.launch_with_gpu_form(attention_paged(shape, paging, None), attention_paged(rows, paging, None), with_sinks(&paged, &[scratch]), out_width()?)
                    }
                } else if seq.is_decode() && shape.causal {
                    // Flash-decoding: a task per (KV head, chunk of positions),
                    // then a merge (docs/performance-log.md, Decisions).
                    let splits = DECODE_SPLITS;
                    let scratch = s.scratch(shape.split_scratch_per_token(splits));
                    let per_token = shape.partials_per_token(splits);
                    let written = TaskCount { per_seq: per_token, fixed: 0 };
                    let kernel = attention_partial(shape, splits, seq);
                    s.kernels.set_gpu_form(&kernel, attention_partial(rows, splits, seq));
                    let partials = s.launch_outputs(kernel, vec![q, pos, kc, vc, scratch], &[per_token * 4], written)[0];
                    s.launch_with_gpu_form(attention_combine(shape, splits, seq), attention_combine_gpu(shape, splits, seq), with_sinks(&[partials, pos], &[]), out_width()?)
                } else {
                    let scratch = s.scratch(shape.kv_heads * shape.scratch_per_task());
                    s.launch_with_gpu_form(attention(shape, seq), attention(rows, seq), with_sinks(&[q, pos, kc, vc], &[scratch]), out_width()?)
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
            Op::AllReduce | Op::AllGather { axis: 1, .. } => {
                let src = match s.input(node.inputs[0])? {
                    Arg::Arena { offset: b } => b,
                    other => return Err(unsupported(format!("a collective over {other:?}"))),
                };
                let width = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let rows = if s.one_row { TaskCount { per_seq: 0, fixed: 1 } } else { TaskCount { per_seq: 1, fixed: 0 } };
                let (op, out_width) = match node.op {
                    Op::AllGather { devices, .. } => (maxc_format::CollectiveOp::AllGather { rows, cols: width }, width * devices as u64),
                    _ => (maxc_format::CollectiveOp::AllReduceSum { elems: TaskCount { per_seq: rows.per_seq * width, fixed: rows.fixed * width } }, width),
                };
                let at = s.launches.len();
                let out = s.buffers.len() as u32;
                // In a batch plan, the exchanges after the gather of the rows with
                // logits (the vocabulary's all-gather) count those rows.
                let (rows_held, row_count) = match (s.one_row, s.logit_rows) {
                    (true, _) => (1, maxc_format::RowCount::Step),
                    (false, true) => (s.batch.expect("logit rows are a batch plan's").max_outputs(), maxc_format::RowCount::Logits),
                    (false, false) => (s.max_seq, maxc_format::RowCount::Step),
                };
                s.buffers.push(BufferInfo { bytes: rows_held * out_width * 4, def: at, last_use: at });
                let input = &mut s.buffers[src as usize];
                input.last_use = input.last_use.max(at);
                s.collectives.push(ScheduledCollective { before_launch: at, op, input: src, output: out, rows: row_count });
                Arg::Arena { offset: out }
            }
            Op::AllGather { axis, .. } => return Err(unsupported(format!("an all-gather along axis {axis}"))),
            Op::LayerNorm { eps } => {
                let w = out_width()?;
                let args = s.inputs(&node.inputs)?;
                s.launch(layer_norm(w, *eps, seq), args, w)
            }
            Op::MeanRows if matches!(s.batch, Some(BatchMode::Encode { .. })) => {
                // Each sequence's rows pooled: from here on a row per sequence.
                let w = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let args = s.inputs(&node.inputs)?;
                s.logit_rows = true;
                single[id.index()] = true;
                s.launch(mean_rows_ragged(w), vec![args[0], Arg::SequenceStarts], w)
            }
            Op::MeanRows => {
                let w = graph.ty(node.inputs[0]).last_dim().expect("static width");
                let args = s.inputs(&node.inputs)?;
                s.launch_rows(mean_rows(w, seq), args, w, TaskCount { per_seq: 0, fixed: w })
            }
            Op::L2Normalize if s.logit_rows && matches!(s.batch, Some(BatchMode::Encode { .. })) => {
                // The step's pooled sequences, one task each.
                let w = node.ty.last_dim().expect("static width");
                let args = s.inputs(&node.inputs)?;
                s.launch(l2_normalize_rows(w), args, w)
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
            Op::Moe { experts, top_k, routing, activation, biases, shared } => s.moe(node, (*experts as u64, *top_k as u64, *routing), (*activation, *biases, *shared), seq)?,
        };
        s.loc[id.index()] = Some(out);
    }
    // Liveness: a buffer lives until its last reader; the logits live to the end.
    let Scheduler { mut buffers, launches, collectives, loc, .. } = s;
    for (i, l) in launches.iter().enumerate() {
        for a in &l.args {
            if let Arg::Arena { offset: b } = a {
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
    let Some(Arg::Arena { offset: logits }) = loc[logits_value.index()] else {
        return Err(unsupported("logits that are not computed by a kernel".into()));
    };
    buffers[logits as usize].last_use = launches.len();
    // A collective's output is read by later launches (above) or is the logits; the
    // liveness sweep above only saw launches, so a buffer read by a collective
    // already had its last use moved to the collective's slot.
    Ok(Schedule { max_seq, launches, collectives, buffers, logits })
}

/// The KV-cache shape of a graph: all attention layers must share one row width.
pub fn kv_shape(graph: &Graph) -> Result<KvShape> {
    let mut row = None;
    let mut layers = 0u64;
    for n in &graph.nodes {
        if let Op::Attention { layer, kv_heads, head_dim, .. } = n.op {
            let w = (kv_heads as u64 * head_dim as u64, head_dim as u64);
            if row.is_some_and(|r| r != w) {
                return Err(unsupported("attention layers with different KV widths or head sizes".into()));
            }
            row = Some(w);
            layers = layers.max(layer as u64 + 1);
        }
    }
    let (row_elems, head_dim) = row.unwrap_or((0, 0));
    Ok(KvShape { layers, row_elems, head_dim })
}
