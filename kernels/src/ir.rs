//! The kernel IR: typed buffer parameters, scalar expressions, loops and stores.
//!
//! Every kernel follows one CPU ABI:
//! `extern "C" fn(args: *const *mut u8, dims: *const i64, task_begin: u64, task_end: u64)`.
//! `args[i]` is the base pointer of parameter `i`; `dims[0]` is the sequence length
//! of this launch. The body runs once per task in `task_begin..task_end` with the
//! task index bound to [`Kernel::task_var`]; tasks never write the same element,
//! so the runtime may run task ranges on any threads.
//!
//! This file holds the core (types, expressions, statements, [`Kernel`]);
//! `ir/dot.rs` the dot statements' vocabulary, `ir/verify.rs` the checker and
//! its invariants, `ir/build.rs` the builder and its DSL.

use std::fmt;

use serde::{Deserialize, Serialize};

mod build;
mod dot;
mod verify;

pub use build::{dsl, KernelBuilder};
pub use dot::*;
pub use verify::KernelError;

/// A scalar variable of a kernel (index into [`Kernel::vars`]).
pub type VarId = u32;

/// A buffer parameter of a kernel: index into [`Kernel::params`], and argument
/// `i` of the ABI's `args`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ParamId(pub u32);

/// A local f32 array of a kernel: index into [`Kernel::locals`]. Locals are
/// per-invocation scratch on the stack (the lane accumulators of the
/// block-quantized matmul, an attention row's scores).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LocalId(pub u32);

impl ParamId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl LocalId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The buffer a load or store addresses: a parameter or a local.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Buf {
    Param(ParamId),
    Local(LocalId),
}

impl From<ParamId> for Buf {
    fn from(p: ParamId) -> Buf {
        Buf::Param(p)
    }
}

impl From<LocalId> for Buf {
    fn from(l: LocalId) -> Buf {
        Buf::Local(l)
    }
}

impl fmt::Display for ParamId {
    /// `p{n}`, as the text form writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

impl fmt::Display for LocalId {
    /// `l{n}`, as the text form writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "l{}", self.0)
    }
}

impl fmt::Display for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Buf::Param(p) => p.fmt(f),
            Buf::Local(l) => l.fmt(f),
        }
    }
}

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
    /// Element `index` of buffer `buf` (I32 elements widen to I64).
    Load { buf: Buf, index: Box<Expr> },
    Bin(BinOp, Box<Expr>, Box<Expr>),
    Cmp(CmpOp, Box<Expr>, Box<Expr>),
    Un(UnOp, Box<Expr>),
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `a * b + c` on f32 with one rounding (a fused multiply-add), whatever
    /// the kernel's [`FloatOrder`]: what an ordered kernel writes where it
    /// wants an FMA.
    MulAdd(Box<Expr>, Box<Expr>, Box<Expr>),
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
            Expr::Select(c, a, b) | Expr::MulAdd(c, a, b) => c.mentions(var) || a.mentions(var) || b.mentions(var),
        }
    }

    /// Whether the expression loads from a buffer for which `which` holds.
    pub fn loads(&self, which: &impl Fn(Buf) -> bool) -> bool {
        match self {
            Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => false,
            Expr::Load { buf, index } => which(*buf) || index.loads(which),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => a.loads(which) || b.loads(which),
            Expr::Un(_, a) => a.loads(which),
            Expr::Select(c, a, b) | Expr::MulAdd(c, a, b) => c.loads(which) || a.loads(which) || b.loads(which),
        }
    }

    /// Whether unary operator `op` occurs in the expression.
    pub fn applies(&self, op: UnOp) -> bool {
        match self {
            Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => false,
            Expr::Load { index, .. } => index.applies(op),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => a.applies(op) || b.applies(op),
            Expr::Un(o, a) => *o == op || a.applies(op),
            Expr::Select(c, a, b) | Expr::MulAdd(c, a, b) => c.applies(op) || a.applies(op) || b.applies(op),
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
    /// Stores to element `index` of buffer `buf`.
    Store { buf: Buf, index: Expr, value: Expr },
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
    DotBlock { acc: LocalId, scales: [Expr; 2], weights: ParamId, w_start: Expr, form: DotForm, act: ParamId, act_start: Expr },
    /// One block step of a GEMV over [`DOT_LANES`] weight rows stored interleaved
    /// (layout `interleaved16`): integer dot products of the rows' block with one
    /// activation block, scaled per row and added to a local (see [`RowDot`]).
    DotRows(RowDot),
    /// One bfloat16 pair step of a weight panel (x86 AVX512_BF16 `vdpbf16ps`):
    /// for lane `l` in `0..`[`DOT_LANES`], `acc[l] += A[0] * W[l] + A[1] *
    /// W[16 + l]`, where `W` is the 32 bfloat16 weights of `weights` from
    /// `w_start` (two consecutive k rows of a `panel16` panel) and `A` the two
    /// bfloat16 activations of `act` at `act_start` and `act_start + 1`. Each
    /// product is exact in f32 (8-bit significands); the two additions round as
    /// the backend does them (the interpreter: `A[0]`'s first, each a fused
    /// multiply-add; `vdpbf16ps` flushes subnormals), so backends agree within
    /// a reduction's tolerance, and every tile of one target gives the same bits.
    /// `acc` is a local of at least [`DOT_LANES`] f32.
    PairDot { acc: LocalId, weights: ParamId, w_start: Expr, act: ParamId, act_start: Expr },
    /// One k row of a bfloat16 weight panel widened to f32 (exact): for lane
    /// `l` in `0..`[`DOT_LANES`], `dst[l] = W[start + l]`, `W` the bfloat16
    /// parameter `weights`. The CPU backend widens the row as the target's
    /// registers do it cheapest: on 256-bit AVX2 by one `vpermq` and two
    /// unpacks with zero (shuffle-port work), not `vpmovzxwd` and a shift per
    /// 8 values, whose shifts take the FMA ports. `dst` is a local of at
    /// least [`DOT_LANES`] f32.
    WidenBf16 { dst: LocalId, weights: ParamId, start: Expr },
    /// A hint that element `index` of parameter `param` is read soon: the CPU
    /// backend prefetches its cache line (`prefetcht0`), the others do nothing.
    /// Never faults, so `index` may lie past the buffer.
    Prefetch { param: ParamId, index: Expr },
}

pub use maxc_format::TaskCount;

/// What a buffer (parameter or local) is.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferDecl<'a> {
    pub name: std::borrow::Cow<'a, str>,
    pub elem: ElemType,
    pub writes: bool,
}

/// How closely a backend keeps a kernel's float arithmetic in the IR's order.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FloatOrder {
    /// Float additions and multiplications may be reassociated (LLVM's
    /// `reassoc`), so that loops with float sums vectorize; the bits then
    /// depend on the choices the backend makes for each kernel.
    #[default]
    Reassociable,
    /// Every float addition and multiplication is done in the IR's order (a
    /// multiply feeding an add may still fuse into one rounding, and max / min
    /// reductions, which are exact, still vectorize): the same statements give
    /// the same bits in every kernel they appear in, which batch invariance
    /// rests on. Float sums over a loop are written with explicit lanes.
    Ordered,
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
    /// Local f32 arrays (element counts), indexed by [`LocalId`]; their
    /// contents are undefined on entry to each task range.
    pub locals: Vec<u64>,
    pub body: Vec<Stmt>,
    #[serde(default)]
    pub float_order: FloatOrder,
}

impl Kernel {
    /// The parameter or local that `buf` names, if the kernel declares it.
    pub fn buffer(&self, buf: Buf) -> Option<BufferDecl<'_>> {
        match buf {
            Buf::Local(l) => self.locals.get(l.index()).map(|_| BufferDecl { name: l.to_string().into(), elem: ElemType::F32, writes: true }),
            Buf::Param(p) => self.params.get(p.index()).map(|p| BufferDecl { name: p.name.as_str().into(), elem: p.elem, writes: p.writes }),
        }
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
