//! The kernel IR: typed buffer parameters, scalar expressions, loops and stores.
//!
//! Every kernel follows one CPU ABI:
//! `extern "C" fn(args: *const *mut u8, dims: *const i64, task_begin: u64, task_end: u64)`.
//! `args[i]` is the base pointer of parameter `i`; `dims[0]` is the sequence length
//! of this launch. The body runs once per task in `task_begin..task_end` with the
//! task index bound to [`Kernel::task_var`]; tasks never write the same element,
//! so the runtime may run task ranges on any threads.

use serde::{Deserialize, Serialize};

/// A scalar variable of a kernel (index into [`Kernel::vars`]).
pub type VarId = u32;

/// Element types of buffers: the artifact format's [`maxc_format::DType`], one
/// vocabulary for stored tensors and kernel parameters.
pub use maxc_format::DType as ElemType;

/// Types of scalar values. Integer loads widen to `I64`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ValType {
    F32,
    I64,
    Bool,
}

/// A buffer parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Param {
    pub name: String,
    pub elem: ElemType,
    pub writes: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    /// Float division, or integer division rounding toward zero.
    Div,
    /// Integer remainder (operands are non-negative in every kernel).
    Rem,
    Max,
    Min,
    /// Integer shift left.
    Shl,
    /// Logical shift right (operands are non-negative in every kernel).
    Shr,
    /// Bitwise and.
    And,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CmpOp {
    Lt,
    Le,
    Eq,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnOp {
    Neg,
    Exp,
    Sqrt,
    Tanh,
    Cos,
    Sin,
    /// i64 -> f32.
    ToF32,
    /// Round toward negative infinity (f32 -> f32).
    Floor,
    /// f32 -> i64, truncating toward zero; defined for values below 2^31 in
    /// magnitude (block levels, exponents), which lets the backends convert in
    /// 32-bit lanes (`vcvttps2dq`; AVX2 has no vector f32 -> i64).
    ToI64,
    /// The f32 whose bits are the low 32 bits of an i64 (builds powers of two).
    BitsToF32,
    /// The value, as f32, of the IEEE 754 half whose bits are the low 16 bits of
    /// an i64: exact for every half, subnormals included (`vcvtph2ps` on x86 with
    /// F16C; fp8 e4m3 decodes through it, `dequant::e4m3_to_f32`).
    HalfBitsToF32,
}

/// A scalar expression.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Expr {
    F32(f32),
    I64(i64),
    Var(VarId),
    /// `dims[0]`: the launch's sequence length.
    Seq,
    /// Element `index` of parameter `param` (I32 elements widen to I64).
    Load { param: u32, index: Box<Expr> },
    Bin(BinOp, Box<Expr>, Box<Expr>),
    Cmp(CmpOp, Box<Expr>, Box<Expr>),
    Un(UnOp, Box<Expr>),
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// Whether the expression reads variable `var`.
    pub fn mentions(&self, var: VarId) -> bool {
        match self {
            Expr::Var(x) => *x == var,
            Expr::F32(_) | Expr::I64(_) | Expr::Seq => false,
            Expr::Load { index, .. } => index.mentions(var),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => a.mentions(var) || b.mentions(var),
            Expr::Un(_, a) => a.mentions(var),
            Expr::Select(c, a, b) => c.mentions(var) || a.mentions(var) || b.mentions(var),
        }
    }

    /// Whether the expression loads from a parameter for which `param` holds.
    pub fn loads(&self, param: &impl Fn(u32) -> bool) -> bool {
        match self {
            Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => false,
            Expr::Load { param: p, index } => param(*p) || index.loads(param),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => a.loads(param) || b.loads(param),
            Expr::Un(_, a) => a.loads(param),
            Expr::Select(c, a, b) => c.loads(param) || a.loads(param) || b.loads(param),
        }
    }

    /// Whether unary operator `op` occurs in the expression.
    pub fn applies(&self, op: UnOp) -> bool {
        match self {
            Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => false,
            Expr::Load { index, .. } => index.applies(op),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => a.applies(op) || b.applies(op),
            Expr::Un(o, a) => *o == op || a.applies(op),
            Expr::Select(c, a, b) => c.applies(op) || a.applies(op) || b.applies(op),
        }
    }
}

/// How a backend should treat a loop.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LoopHint {
    Serial,
    /// Iterations are independent or a reduction that may be reassociated.
    Vectorize,
}

/// A statement.
// `DotRows` is the largest variant by far; statements are built a few hundred
// per kernel at compile time, so its size is not worth a box at every match.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Stmt {
    /// Assigns a scalar variable (declared in [`Kernel::vars`]).
    Set { var: VarId, value: Expr },
    /// Stores to element `index` of parameter `param`.
    Store { param: u32, index: Expr, value: Expr },
    /// `for var in start..end` (I64, step 1).
    For { var: VarId, start: Expr, end: Expr, hint: LoopHint, body: Vec<Stmt> },
    If { cond: Expr, then: Vec<Stmt> },
    /// The int8 dot product of two quantized blocks (one fixed-shape tensor
    /// instruction, VNNI `vpdpbusd` on x86): for lane `g` in `0..DOT_LANES`,
    /// `acc[g] += scales[block_of_lane(form, g)] * (sum over t in 0..4 of
    /// W[4g + t] * A[act_start + 4g + t])`, the sum in exact integers. `W` is the
    /// [`DOT_VALUES`] weight levels that `form` unpacks from the bytes of `weights`
    /// at `w_start` (two blocks of 32 values); `A` the signed bytes of `act`.
    /// `acc` is a local of at least `DOT_LANES` elements.
    DotBlock { acc: u32, scales: [Expr; 2], weights: u32, w_start: Expr, form: DotForm, act: u32, act_start: Expr },
    /// One block step of a GEMV over [`DOT_LANES`] weight rows stored interleaved
    /// (layout `interleaved16`): integer dot products of the rows' block with one
    /// activation block, scaled per row and added to a local (see [`RowDot`]).
    DotRows(RowDot),
    /// A hint that element `index` of parameter `param` is read soon: the CPU
    /// backend prefetches its cache line (`prefetcht0`), the others do nothing.
    /// Never faults, so `index` may lie past the buffer.
    Prefetch { param: u32, index: Expr },
}

/// A [`Stmt::DotRows`]: for row `g` in `0..DOT_LANES`,
/// `acc[g] += S[g] * act_scales[0] * dot_g + M[g] * act_scales[1]`, where
/// `dot_g = sum over t in 0..32 of W[g][t] * A[act_start + t]` in exact integers
/// (VNNI on x86: one `vpdpbusd` per 4 values of all 16 rows, the activation bytes
/// broadcast), `W[g][t]` is `form`'s unsigned level of row `g`, value `t`, in the
/// bytes of `weights` at `w_start`, `A` the signed bytes of `act`, `S[g]` the
/// row's block scale ([`RowScale`]) and `M[g]` its minimum ([`RowMin`]). With int8
/// activations, `act_scales` are the activation block's `d` and `d * sum(q)`.
/// `A[act_start + t]` stands for level `t` of the block as `act_levels` stores
/// it: a signed byte, or a 16-bit integer in two byte planes or in a
/// little-endian word ([`ActLevels`]); the dot stays exact in i32 (int16
/// activations: `act_scales` are the block's `d` and `d * sum(q)` of the whole
/// 16-bit levels).
/// Contract: `act_scales[1]` is `act_scales[0]` times the sum of the block's
/// activation levels, as `quantize_q8` / `quantize_q16` write them. A lowering may rely on
/// it: with `RowMin::Offset(o)` the term is then `S[g] * act_scales[0] * sum
/// over t of (W[g][t] + o) * A[t]`, and the x86 AVX2 one computes Q8_0's
/// (`o = -128`) that way, on the signed levels, without the activation sum; so
/// does the interpreter for any integer offset (exact: no cancellation of
/// `o * S * act_scales[1]` against a dot of unsigned levels).
/// `acc` is a local of at least `DOT_LANES` f32. With `prefetch_ahead`, the CPU
/// lowering also prefetches the levels that many bytes past each 64-byte chunk it
/// reads (a hint with no effect on the result; it may point past the weights).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowDot {
    pub acc: u32,
    pub weights: u32,
    pub w_start: Expr,
    pub form: RowsForm,
    pub act: u32,
    pub act_start: Expr,
    /// How the activation levels are stored.
    pub act_levels: ActLevels,
    pub act_scales: [Expr; 2],
    pub row_scales: RowScale,
    pub row_min: RowMin,
    pub prefetch_ahead: Option<i64>,
}

/// How a [`RowDot`] finds activation level `A[t]` (`t` in `0..32`) in the bytes
/// of `act`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActLevels {
    /// One signed byte each (int8): byte `act_start + t`.
    Bytes,
    /// 16-bit levels in two signed byte planes: byte `act_start + t` counts
    /// [`HIGH_PLANE_WEIGHT`]s and byte `low + t` adds to that. Both planes meet
    /// the weights' byte levels in byte dot instructions.
    Planes { low: Expr },
    /// 16-bit levels as little-endian words: bytes `act_start + 2t` (the low
    /// byte, unsigned) and `act_start + 2t + 1` (the high byte, signed). The
    /// weights' levels are widened to 16 bits and meet them in word dot
    /// instructions (x86 `vpmaddwd`).
    Words,
}

/// Per-row values of a [`RowDot`]: for row `g`, element `values.1 + g` of the
/// float parameter `values.0`, times element `factors.1 + g` of the byte
/// parameter `factors.0` (read unsigned) when there are factors (Q4_K: a
/// super-block's f16 scale times the block's 6-bit scale).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowScale {
    pub values: (u32, Expr),
    pub factors: Option<(u32, Expr)>,
}

/// The per-row minimum `M[g]` of a [`RowDot`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowMin {
    /// `M[g] = offset * S[g]` (Q4_0: -8, Q8_0 stored as `q + 128`: -128).
    Offset(f32),
    /// `M[g]` is the stored value (Q4_1's minimums).
    Stored(RowScale),
    /// `M[g]` is minus the stored value (Q4_K: `value = scale * q - min`).
    Subtracted(RowScale),
}

impl RowDot {
    /// The per-row values it reads: its scales, and its minimums if stored.
    pub fn per_row(&self) -> Vec<&RowScale> {
        match &self.row_min {
            RowMin::Offset(_) => vec![&self.row_scales],
            RowMin::Stored(m) | RowMin::Subtracted(m) => vec![&self.row_scales, m],
        }
    }
}

/// How a [`Stmt::DotRows`] finds the unsigned level `W[g][t]` (row `g` in
/// `0..16`, value `t` in `0..32`) in the `16 * bytes per block` bytes `w` of one
/// block of 16 interleaved rows: in chunks of 64 bytes, each chunk holding four
/// values of every row (row `g` in bytes `4g..4g + 4`), so one 512-bit load
/// feeds one dot step of all 16 rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RowsForm {
    /// Q4_0 / Q4_1 / Q4_K levels: `W[g][t]` is the low nibble of byte
    /// `64 (t / 8) + 4 g + t % 4` for `t % 8 < 4`, else its high nibble (4 chunks).
    Nibbles,
    /// Byte levels: `W[g][t]` is byte `64 (t / 4) + 4 g + t % 4` read as unsigned
    /// (8 chunks; Q8_0 stores `q + 128`).
    Bytes,
}

impl RowsForm {
    /// Values of one row per block.
    pub const VALUES: i64 = 32;

    /// Byte index (within the block of 16 rows) holding `W[g][t]`, and whether it
    /// is the high nibble.
    pub fn byte_of(self, g: i64, t: i64) -> (i64, bool) {
        let per_chunk = self.values_per_chunk();
        (64 * (t / per_chunk) + 4 * g + t % 4, t % per_chunk >= 4)
    }

    /// Values of each row one 64-byte chunk holds (the high nibbles hold values
    /// 4..8 of a chunk of nibbles).
    pub fn values_per_chunk(self) -> i64 {
        match self {
            RowsForm::Nibbles => 8,
            RowsForm::Bytes => 4,
        }
    }

    /// `W[g][t]` from the bytes `w` of the block.
    pub fn level(self, w: &dyn Fn(i64) -> i64, g: i64, t: i64) -> i64 {
        let (at, high) = self.byte_of(g, t);
        let byte = w(at) as u8;
        match (self, high) {
            (RowsForm::Nibbles, false) => (byte & 15) as i64,
            (RowsForm::Nibbles, true) => (byte >> 4) as i64,
            (RowsForm::Bytes, _) => byte as i64,
        }
    }

    /// Bytes of one block of 16 rows.
    pub fn bytes(self) -> i64 {
        match self {
            RowsForm::Nibbles => 256,
            RowsForm::Bytes => 512,
        }
    }

    /// 64-byte chunks of one block of 16 rows (dot steps per chunk: 2 for
    /// nibbles, low then high, 1 for bytes).
    pub fn chunks(self) -> i64 {
        self.bytes() / 64
    }
}

/// What a high activation byte counts in a [`RowDot`] with two planes: 255, not
/// 256, so that both bytes of a level in `-32512..=32512` stay in `-127..=127`
/// (the byte dot instructions never see -128; see `quantize_activations.rs`).
pub const HIGH_PLANE_WEIGHT: i64 = 255;

/// Lanes of a [`Stmt::DotBlock`] accumulator (one 512-bit register of i32 / f32).
pub const DOT_LANES: i64 = 16;
/// Values of a [`Stmt::DotBlock`]: two blocks of 32.
pub const DOT_VALUES: i64 = 64;

/// How a [`Stmt::DotBlock`] unpacks its 64 weight levels `W[i]` from the bytes `w`
/// at its start (block A's values, then block B's, as each form orders them).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DotForm {
    /// `W[i] = w[i]` as a signed byte (Q8_0: A is bytes 0..32, B 32..64).
    Int8,
    /// Two 4-bit blocks of 16 bytes (Q4_0, Q4_1, and Q4_K as maxc stores it):
    /// `W[i]` for `i = 16 q + j` is the low nibble of byte `16 (q % 2) + j` for
    /// `q < 2`, else its high nibble. So `W` holds A's values 0..16, B's 0..16,
    /// A's 16..32, B's 16..32 (activations are quantized in that order).
    NibblePairs,
}

impl DotForm {
    /// Which of the two blocks (0: A, 1: B) lane `g` of a [`Stmt::DotBlock`] sums.
    pub fn block_of_lane(self, g: i64) -> usize {
        match self {
            DotForm::Int8 => (g / 8) as usize,
            DotForm::NibblePairs => ((g / 4) % 2) as usize,
        }
    }

    /// Position in `W` (and so in the activations) of value `t` of block `b`.
    pub fn position(self, b: i64, t: i64) -> i64 {
        match self {
            DotForm::Int8 => 32 * b + t,
            DotForm::NibblePairs => 32 * (t / 16) + 16 * b + t % 16,
        }
    }

    /// `W[i]` from the bytes `w` (starting at the form's first byte).
    pub fn level(self, w: &dyn Fn(i64) -> i64, i: i64) -> i64 {
        match self {
            DotForm::Int8 => w(i) as u8 as i8 as i64,
            DotForm::NibblePairs => {
                let (q, j) = (i / 16, i % 16);
                let byte = w(16 * (q % 2) + j) as u8;
                (if q < 2 { byte & 15 } else { byte >> 4 }) as i64
            }
        }
    }

    /// Bytes of weights one dot reads.
    pub fn bytes(self) -> i64 {
        match self {
            DotForm::Int8 => 64,
            DotForm::NibblePairs => 32,
        }
    }
}

pub use maxc_format::TaskCount;

/// Buffer indices at or above this name the kernel's local f32 arrays
/// ([`Kernel::locals`]): per-invocation scratch on the stack, e.g. the lane
/// accumulators of the block-quantized matmul. Below it, indices name parameters.
pub const LOCAL_BASE: u32 = 1 << 20;

/// What a buffer index (parameter or local) refers to.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferDecl<'a> {
    pub name: std::borrow::Cow<'a, str>,
    pub elem: ElemType,
    pub writes: bool,
}

/// One kernel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// The exported symbol name (unique within an artifact).
    pub name: String,
    /// The kernel family (`matmul`, `rms_norm`, ...), for profiles and the kernel table.
    pub family: String,
    pub params: Vec<Param>,
    pub tasks: TaskCount,
    /// The variable holding the task index.
    pub task_var: VarId,
    /// The type of every variable.
    pub vars: Vec<ValType>,
    /// Local f32 arrays (element counts), indexed from [`LOCAL_BASE`]; their
    /// contents are undefined on entry to each task range.
    pub locals: Vec<u64>,
    pub body: Vec<Stmt>,
}

/// Errors found by [`Kernel::validate`] (kernel-library bugs).
#[derive(Debug, thiserror::Error)]
#[error("kernel `{kernel}`: {message}")]
pub struct KernelError {
    pub kernel: String,
    pub message: String,
}

impl Kernel {
    /// The parameter or local that buffer index `index` names.
    pub fn buffer(&self, index: u32) -> Option<BufferDecl<'_>> {
        if index >= LOCAL_BASE {
            let i = index - LOCAL_BASE;
            self.locals.get(i as usize).map(|_| BufferDecl { name: format!("local{i}").into(), elem: ElemType::F32, writes: true })
        } else {
            self.params.get(index as usize).map(|p| BufferDecl { name: p.name.as_str().into(), elem: p.elem, writes: p.writes })
        }
    }

    /// The type of an expression, or an error when it is ill-typed.
    pub fn type_of(&self, e: &Expr) -> Result<ValType, String> {
        use ValType::*;
        Ok(match e {
            Expr::F32(_) => F32,
            Expr::I64(_) | Expr::Seq => I64,
            Expr::Var(v) => *self.vars.get(*v as usize).ok_or(format!("variable {v} is not declared"))?,
            Expr::Load { param, index } => {
                if self.type_of(index)? != I64 {
                    return Err("load index must be i64".into());
                }
                match self.buffer(*param).ok_or(format!("buffer {param} does not exist"))?.elem {
                    ElemType::F32 | ElemType::BF16 | ElemType::F16 => F32,
                    ElemType::I32 | ElemType::I8 | ElemType::U8 => I64,
                }
            }
            Expr::Bin(op, a, b) => {
                let (ta, tb) = (self.type_of(a)?, self.type_of(b)?);
                if ta != tb || ta == Bool {
                    return Err(format!("{op:?} operands have types {ta:?} and {tb:?}"));
                }
                if matches!(op, BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::And) && ta != I64 {
                    return Err(format!("{op:?} is integer-only"));
                }
                ta
            }
            Expr::Cmp(_, a, b) => {
                let (ta, tb) = (self.type_of(a)?, self.type_of(b)?);
                if ta != tb || ta == Bool {
                    return Err(format!("comparison operands have types {ta:?} and {tb:?}"));
                }
                Bool
            }
            Expr::Un(op, a) => {
                let t = self.type_of(a)?;
                match op {
                    UnOp::ToF32 | UnOp::BitsToF32 | UnOp::HalfBitsToF32 if t == I64 => F32,
                    UnOp::ToF32 | UnOp::BitsToF32 | UnOp::HalfBitsToF32 => return Err(format!("{op:?} takes an i64")),
                    UnOp::ToI64 if t == F32 => I64,
                    UnOp::ToI64 => return Err("to_i64 takes an f32".into()),
                    UnOp::Neg if t != Bool => t,
                    _ if t == F32 => F32,
                    _ => return Err(format!("{op:?} takes an f32, got {t:?}")),
                }
            }
            Expr::Select(c, a, b) => {
                if self.type_of(c)? != Bool {
                    return Err("select condition must be bool".into());
                }
                let (ta, tb) = (self.type_of(a)?, self.type_of(b)?);
                if ta != tb {
                    return Err("select arms differ in type".into());
                }
                ta
            }
        })
    }

    /// The kernel verifier. Its invariants, each refused with a message naming
    /// the kernel:
    /// - the task variable is a declared `i64` variable;
    /// - every variable a `set` assigns is declared, and the value has its type;
    /// - every buffer a statement names exists (a parameter index, or a local at
    ///   `LOCAL_BASE` and above);
    /// - stores go to writable buffers only, never to weight-only element types
    ///   (`bf16`, `u8`); an `f32` / `f16` buffer takes an `f32`, an `i32` / `i8`
    ///   one an `i64`; indices, prefetch indices, loop variables and loop bounds
    ///   are `i64`; `if` and `select` conditions are `bool`, and both arms of a
    ///   `select` have one type;
    /// - expressions type-check (`type_of`): binary operators on operands of one
    ///   type as the operator allows, conversions from the type they take;
    /// - a dot statement's accumulator is a local of at least `DOT_LANES`
    ///   elements; its weights, activations and per-row scales are parameters;
    ///   activations are `i8`; scales are `f32`, starts `i64`; `DotBlock` weights
    ///   match the form (`i8` for int8, `u8` for nibble pairs), `DotRows` weights
    ///   are bytes, its row scales a float parameter and its row factors (Q4_K's
    ///   6-bit ones) a byte parameter, each with an `i64` start.
    pub fn validate(&self) -> Result<(), KernelError> {
        let err = |message: String| KernelError { kernel: self.name.clone(), message };
        if self.vars.get(self.task_var as usize) != Some(&ValType::I64) {
            return Err(err("the task variable must be an i64".into()));
        }
        self.validate_block(&self.body).map_err(err)
    }

    /// The element type of parameter `p` that a dot instruction reads as `what`.
    fn dot_param(&self, p: u32, what: &str) -> Result<ElemType, String> {
        self.buffer(p).filter(|_| p < LOCAL_BASE).map(|b| b.elem).ok_or(format!("dot {what} {p} is not a parameter"))
    }

    /// The operands every dot instruction has: an accumulator local of
    /// [`DOT_LANES`], weight and I8 activation parameters with i64 starts, f32
    /// scales. Returns the weights' element type for the form's own check.
    fn validate_dot(&self, acc: u32, (weights, w_start): (u32, &Expr), (act, act_start): (u32, &Expr), scales: &[Expr]) -> Result<ElemType, String> {
        if acc < LOCAL_BASE || self.locals.get((acc - LOCAL_BASE) as usize).is_none_or(|&n| n < DOT_LANES as u64) {
            return Err(format!("dot accumulator {acc} is not a local of {DOT_LANES} elements"));
        }
        let (w_elem, a_elem) = (self.dot_param(weights, "weights")?, self.dot_param(act, "activations")?);
        if a_elem != ElemType::I8 {
            return Err(format!("dots take I8 activations, got {a_elem:?}"));
        }
        for e in scales {
            if self.type_of(e)? != ValType::F32 {
                return Err("dot scales must be f32".into());
            }
        }
        if self.type_of(w_start)? != ValType::I64 || self.type_of(act_start)? != ValType::I64 {
            return Err("dot starts must be i64".into());
        }
        Ok(w_elem)
    }

    fn validate_block(&self, block: &[Stmt]) -> Result<(), String> {
        for s in block {
            match s {
                Stmt::Set { var, value } => {
                    let want = *self.vars.get(*var as usize).ok_or(format!("variable {var} is not declared"))?;
                    if self.type_of(value)? != want {
                        return Err(format!("variable {var} is {want:?}, assigned {:?}", self.type_of(value)?));
                    }
                }
                Stmt::Store { param, index, value } => {
                    let p = self.buffer(*param).ok_or(format!("buffer {param} does not exist"))?;
                    if !p.writes {
                        return Err(format!("store to read-only parameter `{}`", p.name));
                    }
                    if self.type_of(index)? != ValType::I64 {
                        return Err("store index must be i64".into());
                    }
                    let want = match p.elem {
                        ElemType::F32 | ElemType::F16 => ValType::F32,
                        ElemType::I32 | ElemType::I8 => ValType::I64,
                        ElemType::BF16 | ElemType::U8 => {
                            return Err(format!("store to weight-only parameter `{}` ({:?})", p.name, p.elem))
                        }
                    };
                    if self.type_of(value)? != want {
                        return Err(format!("store of {:?} to `{}`", self.type_of(value)?, p.name));
                    }
                }
                Stmt::For { var, start, end, body, .. } => {
                    if self.vars.get(*var as usize) != Some(&ValType::I64) {
                        return Err(format!("loop variable {var} must be i64"));
                    }
                    if self.type_of(start)? != ValType::I64 || self.type_of(end)? != ValType::I64 {
                        return Err("loop bounds must be i64".into());
                    }
                    self.validate_block(body)?;
                }
                Stmt::Prefetch { param, index } => {
                    self.buffer(*param).ok_or(format!("buffer {param} does not exist"))?;
                    if self.type_of(index)? != ValType::I64 {
                        return Err("prefetch index must be i64".into());
                    }
                }
                Stmt::If { cond, then } => {
                    if self.type_of(cond)? != ValType::Bool {
                        return Err("if condition must be bool".into());
                    }
                    self.validate_block(then)?;
                }
                Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => {
                    let w_elem = self.validate_dot(*acc, (*weights, w_start), (*act, act_start), scales)?;
                    let want_w = if *form == DotForm::Int8 { ElemType::I8 } else { ElemType::U8 };
                    if w_elem != want_w {
                        return Err(format!("dot {form:?} takes {want_w:?} weights, got {w_elem:?}"));
                    }
                }
                Stmt::DotRows(d) => {
                    let w_elem = self.validate_dot(d.acc, (d.weights, &d.w_start), (d.act, &d.act_start), &d.act_scales)?;
                    if matches!(&d.act_levels, ActLevels::Planes { low } if self.type_of(low) != Ok(ValType::I64)) {
                        return Err("dot starts must be i64".into());
                    }
                    // Weight bytes are read as unsigned whatever the part's declared type.
                    if !matches!(w_elem, ElemType::U8 | ElemType::I8) {
                        return Err(format!("row dots take byte weights, got {w_elem:?}"));
                    }
                    for r in d.per_row() {
                        let (p, start) = &r.values;
                        if !matches!(self.dot_param(*p, "row scales")?, ElemType::F32 | ElemType::F16 | ElemType::BF16) || self.type_of(start)? != ValType::I64 {
                            return Err(format!("row scales {p} must be a float parameter with an i64 start"));
                        }
                        if let Some((p, start)) = &r.factors {
                            if !matches!(self.dot_param(*p, "row factors")?, ElemType::U8 | ElemType::I8) || self.type_of(start)? != ValType::I64 {
                                return Err(format!("row factors {p} must be a byte parameter with an i64 start"));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Builds kernels: declares variables and parameters; expression helpers below.
#[derive(Debug, Default)]
pub struct KernelBuilder {
    pub params: Vec<Param>,
    pub vars: Vec<ValType>,
    pub locals: Vec<u64>,
}

impl KernelBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares a parameter and returns its index.
    pub fn param(&mut self, name: &str, elem: ElemType, writes: bool) -> u32 {
        self.params.push(Param { name: name.into(), elem, writes });
        self.params.len() as u32 - 1
    }

    /// Declares a local f32 array of `len` elements and returns its buffer index.
    pub fn local(&mut self, len: u64) -> u32 {
        self.locals.push(len);
        LOCAL_BASE + self.locals.len() as u32 - 1
    }

    /// Declares a variable.
    pub fn var(&mut self, ty: ValType) -> VarId {
        self.vars.push(ty);
        self.vars.len() as VarId - 1
    }

    /// Finishes the kernel and validates it (a failure is a kernel-library bug).
    pub fn finish(self, name: String, family: &str, tasks: TaskCount, task_var: VarId, body: Vec<Stmt>) -> Kernel {
        let k = Kernel { name, family: family.into(), params: self.params, tasks, task_var, vars: self.vars, locals: self.locals, body };
        if let Err(e) = k.validate() {
            panic!("{e}");
        }
        k
    }
}

/// Expression helpers, so kernel builders read like the math they implement.
pub mod dsl {
    use super::*;

    pub fn f(x: f32) -> Expr {
        Expr::F32(x)
    }
    pub fn i(x: i64) -> Expr {
        Expr::I64(x)
    }
    pub fn v(var: VarId) -> Expr {
        Expr::Var(var)
    }
    pub fn seq() -> Expr {
        Expr::Seq
    }
    pub fn ld(param: u32, index: Expr) -> Expr {
        Expr::Load { param, index: Box::new(index) }
    }
    pub fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }
    pub fn add(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Add, a, b)
    }
    pub fn sub(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Sub, a, b)
    }
    pub fn mul(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Mul, a, b)
    }
    pub fn div(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Div, a, b)
    }
    pub fn rem(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Rem, a, b)
    }
    pub fn max(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Max, a, b)
    }
    pub fn min(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Min, a, b)
    }
    pub fn lt(a: Expr, b: Expr) -> Expr {
        Expr::Cmp(CmpOp::Lt, Box::new(a), Box::new(b))
    }
    pub fn un(op: UnOp, a: Expr) -> Expr {
        Expr::Un(op, Box::new(a))
    }
    pub fn shl(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Shl, a, b)
    }
    pub fn shr(a: Expr, b: Expr) -> Expr {
        bin(BinOp::Shr, a, b)
    }
    pub fn and(a: Expr, b: Expr) -> Expr {
        bin(BinOp::And, a, b)
    }
    pub fn to_f32(a: Expr) -> Expr {
        un(UnOp::ToF32, a)
    }
    pub fn eq(a: Expr, b: Expr) -> Expr {
        Expr::Cmp(CmpOp::Eq, Box::new(a), Box::new(b))
    }

    /// `exp(x)` as inline, vectorizable arithmetic (no libm call): range reduction
    /// `x = n ln2 + r` with a two-part ln2, a degree-6 polynomial for `e^r` on
    /// `|r| <= ln2/2` (relative error below 2e-7), and `2^n` built from exponent bits.
    /// Inputs are clamped to [-87.3, 88.7], so very negative inputs give ~1e-38, not 0.
    pub fn fast_exp(x: Expr) -> Expr {
        let x = min(max(x, f(-87.3)), f(88.7));
        let n = un(UnOp::Floor, add(mul(x.clone(), f(std::f32::consts::LOG2_E)), f(0.5)));
        let r = sub(sub(x, mul(n.clone(), f(0.693_145_75))), mul(n.clone(), f(1.428_606_8e-6)));
        let mut p = f(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = add(mul(p, r.clone()), f(c));
        }
        let two_n = un(UnOp::BitsToF32, shl(add(un(UnOp::ToI64, n), i(127)), i(23)));
        mul(p, two_n)
    }
    pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    pub fn set(var: VarId, value: Expr) -> Stmt {
        Stmt::Set { var, value }
    }
    pub fn store(param: u32, index: Expr, value: Expr) -> Stmt {
        Stmt::Store { param, index, value }
    }
    pub fn for_(var: VarId, start: Expr, end: Expr, body: Vec<Stmt>) -> Stmt {
        Stmt::For { var, start, end, hint: LoopHint::Serial, body }
    }
    pub fn for_vec(var: VarId, start: Expr, end: Expr, body: Vec<Stmt>) -> Stmt {
        Stmt::For { var, start, end, hint: LoopHint::Vectorize, body }
    }
    pub fn if_(cond: Expr, then: Vec<Stmt>) -> Stmt {
        Stmt::If { cond, then }
    }
    pub fn prefetch(param: u32, index: Expr) -> Stmt {
        Stmt::Prefetch { param, index }
    }
}

#[cfg(test)]
mod tests {
    use super::dsl::*;
    use super::*;

    /// fast_exp against std's exp over the whole useful range.
    #[test]
    fn fast_exp_is_accurate_to_float_rounding() {
        let mut b = KernelBuilder::new();
        let x = b.param("x", ElemType::F32, false);
        let out = b.param("out", ElemType::F32, true);
        let t = b.var(ValType::I64);
        let k = b.finish("exp".into(), "test", TaskCount { per_seq: 1, fixed: 0 }, t, vec![store(out, v(t), fast_exp(ld(x, v(t))))]);
        let xs: Vec<f32> = (0..4001).map(|i| -87.0 + i as f32 * 0.04375).collect();
        let mut bufs = vec![crate::interp::Buffer::F32(xs.clone()), crate::interp::Buffer::F32(vec![0.0; xs.len()])];
        crate::interp::run(&k, &mut bufs, xs.len() as u64);
        let crate::interp::Buffer::F32(got) = &bufs[1] else { unreachable!() };
        for (x, y) in xs.iter().zip(got) {
            let want = (*x as f64).exp();
            assert!(((*y as f64 - want) / want).abs() < 3e-7, "exp({x}) = {y}, want {want}");
        }
    }
}
