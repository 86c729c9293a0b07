//! Building kernels: [`KernelBuilder`] declares parameters, variables and
//! locals and validates the finished kernel; [`dsl`] has the expression and
//! statement helpers kernel builders are written in.

use super::*;

/// Builds kernels: declares variables and parameters; expression helpers below.
#[derive(Debug, Default)]
pub struct KernelBuilder {
    pub params: Vec<Param>,
    pub vars: Vec<ValType>,
    pub locals: Vec<u64>,
    pub float_order: FloatOrder,
}

impl KernelBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares a parameter.
    pub fn param(&mut self, name: &str, elem: ElemType, writes: bool) -> ParamId {
        self.params.push(Param { name: name.into(), elem, writes });
        ParamId(self.params.len() as u32 - 1)
    }

    /// Declares a local f32 array of `len` elements.
    pub fn local(&mut self, len: u64) -> LocalId {
        self.locals.push(len);
        LocalId(self.locals.len() as u32 - 1)
    }

    /// Declares a variable.
    pub fn var(&mut self, ty: ValType) -> VarId {
        self.vars.push(ty);
        self.vars.len() as VarId - 1
    }

    /// Makes the kernel keep its float arithmetic in the IR's order
    /// ([`FloatOrder::Ordered`]).
    pub fn keep_float_order(&mut self) {
        self.float_order = FloatOrder::Ordered;
    }

    /// Finishes the kernel and validates it (a failure is a kernel-library bug).
    pub fn finish(self, name: String, family: &str, tasks: TaskCount, task_var: VarId, body: Vec<Stmt>) -> Kernel {
        let k = Kernel { name, family: family.into(), params: self.params, tasks, task_var, vars: self.vars, locals: self.locals, body, float_order: self.float_order };
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
    pub fn ld(buf: impl Into<Buf>, index: Expr) -> Expr {
        Expr::Load { buf: buf.into(), index: Box::new(index) }
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
    pub fn le(a: Expr, b: Expr) -> Expr {
        Expr::Cmp(CmpOp::Le, Box::new(a), Box::new(b))
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
        // Written with explicit multiply-adds, so that it is the same function
        // in a kernel that keeps its float order as in one that does not.
        let n = un(UnOp::Floor, mul_add(x.clone(), f(std::f32::consts::LOG2_E), f(0.5)));
        let r = mul_add(un(UnOp::Neg, n.clone()), f(1.428_606_8e-6), mul_add(un(UnOp::Neg, n.clone()), f(0.693_145_75), x));
        let mut p = f(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = mul_add(p, r.clone(), f(c));
        }
        let two_n = un(UnOp::BitsToF32, shl(add(un(UnOp::ToI64, n), i(127)), i(23)));
        mul(p, two_n)
    }
    /// `a * b + c`, rounded once ([`Expr::MulAdd`]).
    pub fn mul_add(a: Expr, b: Expr, c: Expr) -> Expr {
        Expr::MulAdd(Box::new(a), Box::new(b), Box::new(c))
    }
    pub fn select(c: Expr, a: Expr, b: Expr) -> Expr {
        Expr::Select(Box::new(c), Box::new(a), Box::new(b))
    }
    pub fn set(var: VarId, value: Expr) -> Stmt {
        Stmt::Set { var, value }
    }
    pub fn store(buf: impl Into<Buf>, index: Expr, value: Expr) -> Stmt {
        Stmt::Store { buf: buf.into(), index, value }
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
    pub fn prefetch(param: ParamId, index: Expr) -> Stmt {
        Stmt::Prefetch { param, index }
    }
}
