//! Core graph IR data structures: values, types, ops and the graph arena.
//!
//! Every node produces exactly one value, so a [`ValueId`] names both the node
//! and its result. Nodes are stored in topological order: a node's inputs always
//! have smaller ids (the verifier checks it), which makes every pass a single
//! forward or backward sweep.

use std::fmt;

/// How a weight is stored (the logical dtype stays the value's `dtype`): the
/// artifact's encoding, one vocabulary from the graph to the file.
pub use maxc_format::WeightEncoding;

/// Index of a node (and of the value it produces) in [`Graph::nodes`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Element types: the artifact format's, one vocabulary for graph values,
/// stored tensors and kernel buffers. A graph value is one of [`GRAPH_DTYPES`]
/// (bytes appear only as parts of quantized weights, below the graph).
pub use maxc_format::DType;

/// The element types a graph value may have.
pub const GRAPH_DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];

/// Symbolic dimensions: known only when the artifact runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum SymDim {
    /// The number of new tokens processed by this step (prompt length at prefill, 1 at decode).
    Seq,
    /// The number of positions in the KV cache after this step (past + seq).
    Ctx,
    /// The batch size.
    Batch,
}

impl SymDim {
    pub fn name(self) -> &'static str {
        match self {
            SymDim::Seq => "seq",
            SymDim::Ctx => "ctx",
            SymDim::Batch => "batch",
        }
    }
}

/// One dimension of a shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(u64),
    Sym(SymDim),
}

impl Dim {
    pub fn fixed(self) -> Option<u64> {
        match self {
            Dim::Fixed(n) => Some(n),
            Dim::Sym(_) => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(s) => f.write_str(s.name()),
        }
    }
}

/// How a value is distributed over the device mesh.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum Placement {
    /// Every device holds the whole value (the only placement before sharding).
    #[default]
    Replicated,
    /// Each device holds a slice along `axis`.
    Sharded { axis: u32 },
    /// Each device holds a partial sum; the true value is the sum over devices.
    PartialSum,
}

/// The full type of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<Dim>,
    pub placement: Placement,
    pub quant: WeightEncoding,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<Dim>) -> Self {
        TensorType { dtype, shape, placement: Placement::Replicated, quant: WeightEncoding::Float32 }
    }

    /// A type with static dims only.
    pub fn fixed(dtype: DType, dims: &[u64]) -> Self {
        Self::new(dtype, dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The last dim, which every op here requires to be static.
    pub fn last_dim(&self) -> Option<u64> {
        self.shape.last().and_then(|d| d.fixed())
    }

    /// Product of all dims when they are all static.
    pub fn num_elements(&self) -> Option<u64> {
        self.shape.iter().map(|d| d.fixed()).product()
    }
}

/// Elementwise unary functions, and binary ones (the second operand broadcasts
/// over leading dims): one vocabulary with the kernels' elementwise library, so
/// the scheduler hands a node's op to its kernel as it is.
pub use maxc_kernels::library::elementwise::{Binary as BinaryOp, Unary as UnaryOp};

/// A router's rule from logits to the chosen experts and their weights: the
/// kernels' vocabulary, so the scheduler hands the `moe` op's rule on as it is.
pub use maxc_kernels::library::moe::MoeRouting;

/// The experts' activation: the kernels' vocabulary, as [`MoeRouting`] is.
pub use maxc_kernels::library::moe::MoeActivation;

/// Rotary position embedding frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3's piecewise frequency scaling.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: u32 },
    /// One divisor per frequency (GGUF `rope_freqs.weight`).
    FreqFactors(Vec<f32>),
    /// YaRN (transformers' `_compute_yarn_parameters`): frequencies blend from
    /// kept (fast rotations) to divided by `factor` (slow ones) along a linear
    /// ramp between the correction dims of `beta_fast` and `beta_slow` rotations
    /// over `original_max_position` positions; `truncate` rounds the ramp's ends
    /// outward. Its attention factor ([`super::rope::attention_factor`]) scales
    /// cos and sin in transformers; `Rope` leaves it out and the builders fold
    /// its square into the attention scale (q and k both carry it).
    Yarn { factor: f32, original_max_position: u32, beta_fast: f32, beta_slow: f32, truncate: bool },
}

/// The operations of the graph IR. The payload holds every attribute; inputs are in [`Node::inputs`].
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A runtime input (token ids, positions); its type is the declared one.
    Input { name: String, ty: TensorType },
    /// A named weight of the checkpoint; with `shard`, this device's slice of it
    /// (`ty` is then the slice's type, placed `Sharded { axis }`).
    Weight { name: String, ty: TensorType, shard: Option<WeightShard> },
    /// A small literal tensor, row-major.
    Constant { values: Vec<f32>, ty: TensorType },
    /// `table[ids]`: inputs (table `[vocab, hidden]`, ids `[seq]`).
    Embedding,
    /// `x @ w^T`: inputs (x `[m, k]`, w `[n, k]`), result `[m, n]` (HF `Linear` layout).
    MatMul,
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// `x * rsqrt(mean(x^2) + eps) * w` over groups of `len(w)` elements of the last
    /// dim (the whole dim, or one head): inputs (x, w).
    RmsNorm { eps: f32 },
    /// Rotate-half RoPE on each head of x `[seq, heads * head_dim]`: inputs (x, positions).
    Rope { head_dim: u32, theta: f32, scaling: RopeScaling },
    /// Causal attention over this layer's KV cache after appending this step's k and v:
    /// inputs (q `[seq, heads*hd]`, k `[seq, kv_heads*hd]`, v `[seq, kv_heads*hd]`, positions).
    /// `softcap`: scores become `tanh(score / c) * c` before the softmax (Gemma 2).
    /// `sinks`: see the field.
    /// `causal = false` (encoders): every token attends to every token of the sequence.
    Attention {
        layer: u32,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        scale: f32,
        window: Option<u32>,
        softcap: Option<f32>,
        causal: bool,
        /// gpt-oss: a fifth input, one learned logit per head `[heads]`, joins
        /// each softmax's denominator (it carries no value), so a row's weights
        /// sum to less than one.
        sinks: bool,
    },
    /// The mean over rows: `[seq, h] -> [1, h]` (sentence-embedding pooling).
    MeanRows,
    /// Each row divided by its L2 norm.
    L2Normalize,
    /// `(x - mean) * rsqrt(var + eps) * w + b` over the last dim: inputs (x, w, b).
    LayerNorm { eps: f32 },
    /// The transpose of a 2-D tensor (evaluated at compile time on weights, e.g. GPT-2's Conv1D).
    Transpose,
    /// Concatenation of the inputs along `axis`.
    Concat { axis: u32 },
    /// `silu(x[:, :h]) * x[:, h:]` for x `[seq, 2h]` (gate and up stacked): the SwiGLU MLP activation.
    SwiGlu,
    /// `x @ w^T + r`: inputs (x `[m, k]`, w `[n, k]`, r `[m, n]` or `[n]`); a matmul with
    /// the residual (or bias) add as its epilogue.
    MatMulAdd,
    /// `len` entries from `start` along `axis`.
    Slice { axis: u32, start: u64, len: u64 },
    /// A mixture-of-experts MLP: inputs (x `[seq, h]`, router `[experts, h]`,
    /// gate_up `[experts * 2f, h]`, down `[experts * h, f]`). Each row's router
    /// logits `router @ x` choose the `top_k` experts by `routing` (ties to the
    /// lowest expert index) with their weights `p`, and its result is `sum over
    /// its chosen experts, in rank order, of p * down_e @ (silu(g) * u)`, where
    /// `[g; u] = gate_up_e @ x` and `gate_up_e` is rows `e * 2f .. (e + 1) * 2f`
    /// of gate_up (the expert's gate projection, then its up projection) and
    /// `down_e` rows `e * h .. (e + 1) * h` of down. The router is part of the
    /// op so that its logits, which the choice of experts compares, are the
    /// same bits for a row in every plan (one kernel per row, whatever the step).
    /// `activation` replaces `silu(g) * u` (gpt-oss's clamped SwiGLU); with
    /// `biases` three more inputs follow (gpt-oss): the router's bias
    /// `[experts]` (added to its logits), the experts' gate-and-up biases
    /// `[experts, 2f]` (added to `[g; u]`) and down biases `[experts, h]`.
    /// With `shared` two more follow (Qwen2-MoE's shared expert): its gate
    /// `[1, h]` and its output `[seq, h]`, added to the routed experts' sum
    /// times `sigmoid(gate . x)` (computed by ordinary nodes beside the op).
    Moe { experts: u32, top_k: u32, routing: MoeRouting, activation: MoeActivation, biases: bool, shared: bool },
    /// Sum of a `PartialSum` value over the devices of the mesh (result replicated).
    AllReduce,
    /// Concatenation of every device's `Sharded { axis }` slice (result replicated).
    AllGather { axis: u32, devices: u32 },
    /// This device's slice (`index` of `devices` equal parts along `axis`) of a
    /// replicated value: a local copy, no communication.
    ShardSlice { axis: u32, index: u32, devices: u32 },
}

/// Which slice of a checkpoint tensor a sharded weight holds: part `index` of
/// `devices` equal parts along `axis`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct WeightShard {
    pub axis: u32,
    pub index: u32,
    pub devices: u32,
}

impl Op {
    /// The mnemonic used by the text form.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Weight { .. } => "weight",
            Op::Constant { .. } => "constant",
            Op::Embedding => "embedding",
            Op::MatMul => "matmul",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Silu => "silu",
                UnaryOp::GeluTanh => "gelu_tanh",
                UnaryOp::Gelu => "gelu",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Tanh => "tanh",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Max => "max",
            },
            Op::RmsNorm { .. } => "rms_norm",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::SwiGlu => "swiglu",
            Op::LayerNorm { .. } => "layer_norm",
            Op::MeanRows => "mean_rows",
            Op::L2Normalize => "l2_normalize",
            Op::Transpose => "transpose",
            Op::MatMulAdd => "matmul_add",
            Op::AllReduce => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::ShardSlice { .. } => "shard_slice",
            Op::Moe { .. } => "moe",
        }
    }

    /// Ops whose effect is more than their result (the KV-cache write of attention;
    /// collectives, which every device must reach).
    pub fn has_side_effects(&self) -> bool {
        matches!(self, Op::Attention { .. } | Op::AllReduce | Op::AllGather { .. })
    }

    /// Collectives: ops that exchange data between the devices of a mesh.
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllReduce | Op::AllGather { .. })
    }

    /// The number of inputs the op takes, or `None` when variadic.
    pub fn arity(&self) -> Option<usize> {
        match self {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => Some(0),
            Op::Unary(_) | Op::Slice { .. } | Op::SwiGlu | Op::Transpose | Op::MeanRows | Op::L2Normalize => Some(1),
            Op::AllReduce | Op::AllGather { .. } | Op::ShardSlice { .. } => Some(1),
            Op::MatMulAdd | Op::LayerNorm { .. } => Some(3),
            Op::Embedding | Op::MatMul | Op::Binary(_) | Op::RmsNorm { .. } | Op::Rope { .. } => Some(2),
            Op::Attention { sinks: true, .. } => Some(5),
            Op::Moe { biases, shared, .. } => Some(4 + 3 * *biases as usize + 2 * *shared as usize),
            Op::Attention { .. } => Some(4),
            Op::Concat { .. } => None,
        }
    }
}

/// One node: an op, its inputs, and the type of the value it produces.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub ty: TensorType,
}

/// A graph: nodes in topological order plus named outputs.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub outputs: Vec<(String, ValueId)>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), nodes: Vec::new(), outputs: Vec::new() }
    }

    pub fn node(&self, id: ValueId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn ty(&self, id: ValueId) -> &TensorType {
        &self.nodes[id.index()].ty
    }

    /// Appends a node, inferring its type; panics on an ill-typed node (a builder bug).
    pub fn add(&mut self, op: Op, inputs: &[ValueId]) -> ValueId {
        let ty = crate::graph::infer::infer_type(self, &op, inputs)
            .unwrap_or_else(|e| panic!("ill-typed {} node: {e}", op.mnemonic()));
        self.push_typed(op, inputs.to_vec(), ty)
    }

    /// Appends a node with a type already known (used by the parser and by passes).
    pub fn push_typed(&mut self, op: Op, inputs: Vec<ValueId>, ty: TensorType) -> ValueId {
        let id = ValueId(u32::try_from(self.nodes.len()).expect("graph larger than u32::MAX nodes"));
        self.nodes.push(Node { op, inputs, ty });
        id
    }

    pub fn output(&mut self, name: impl Into<String>, value: ValueId) {
        self.outputs.push((name.into(), value));
    }

    pub fn ids(&self) -> impl Iterator<Item = ValueId> {
        (0..self.nodes.len() as u32).map(ValueId)
    }

    /// Counts nodes with the given mnemonic (used by tests and `--dump-ir` summaries).
    pub fn count(&self, mnemonic: &str) -> usize {
        self.nodes.iter().filter(|n| n.op.mnemonic() == mnemonic).count()
    }

    /// Rebuilds the graph keeping only `keep`ed nodes (in order) and remapping inputs
    /// through `replace` (a value id -> the value that stands for it).
    pub fn compact(&mut self, keep: &[bool], replace: &[ValueId]) {
        let mut new_id = vec![u32::MAX; self.nodes.len()];
        let mut nodes = Vec::with_capacity(self.nodes.len());
        let resolve = |mut v: ValueId| {
            while replace[v.index()] != v {
                v = replace[v.index()];
            }
            v
        };
        for (i, node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if !keep[i] {
                continue;
            }
            let mut node = node;
            for input in &mut node.inputs {
                let r = resolve(*input);
                assert!(new_id[r.index()] != u32::MAX, "compact: {r} is used but was removed");
                *input = ValueId(new_id[r.index()]);
            }
            new_id[i] = nodes.len() as u32;
            nodes.push(node);
        }
        self.nodes = nodes;
        for (_, v) in &mut self.outputs {
            let r = resolve(*v);
            assert!(new_id[r.index()] != u32::MAX, "compact: output {r} was removed");
            *v = ValueId(new_id[r.index()]);
        }
    }
}
