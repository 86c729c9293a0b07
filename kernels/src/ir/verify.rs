//! The kernel IR's checker: [`Kernel::type_of`] and [`Kernel::validate`], whose
//! doc lists the invariants every kernel of the library keeps.

use super::*;

/// Errors found by [`Kernel::validate`] (kernel-library bugs).
#[derive(Debug, thiserror::Error)]
#[error("kernel `{kernel}`: {message}")]
pub struct KernelError {
    pub kernel: String,
    pub message: String,
}

impl Kernel {
    /// The type of an expression, or an error when it is ill-typed.
    pub fn type_of(&self, e: &Expr) -> Result<ValType, String> {
        use ValType::*;
        Ok(match e {
            Expr::F32(_) => F32,
            Expr::I64(_) | Expr::Seq => I64,
            Expr::Var(v) => *self.vars.get(*v as usize).ok_or(format!("variable {v} is not declared"))?,
            Expr::Load { buf, index } => {
                if self.type_of(index)? != I64 {
                    return Err("load index must be i64".into());
                }
                match self.buffer(*buf).ok_or(format!("buffer {buf} does not exist"))?.elem {
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
            Expr::MulAdd(a, b, c) => {
                for e in [a, b, c] {
                    if self.type_of(e)? != F32 {
                        return Err("a multiply-add takes f32 operands".into());
                    }
                }
                F32
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
    /// - every buffer a load, store or prefetch names is declared (a parameter
    ///   in `params`, a local in `locals`);
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
    ///   6-bit ones) a byte parameter, each with an `i64` start; a `DotRows`
    ///   has high bits (a byte parameter, an `i64` start) exactly when its
    ///   form has them (`Nibbles5`, `Nibbles6`); a form with two halves
    ///   (`Nibbles6`) has row factors, an integer offset as its minimum and
    ///   activations as bytes, planes or word pairs.
    pub fn validate(&self) -> Result<(), KernelError> {
        let err = |message: String| KernelError { kernel: self.name.clone(), message };
        if self.vars.get(self.task_var as usize) != Some(&ValType::I64) {
            return Err(err("the task variable must be an i64".into()));
        }
        self.validate_block(&self.body).map_err(err)
    }

    /// The element type of parameter `p` that a dot instruction reads as `what`.
    fn dot_param(&self, p: ParamId, what: &str) -> Result<ElemType, String> {
        self.params.get(p.index()).map(|p| p.elem).ok_or(format!("dot {what} {p} is not a declared parameter"))
    }

    /// The operands every dot instruction has: an accumulator local of
    /// [`DOT_LANES`], weight and I8 activation parameters with i64 starts, f32
    /// scales. Returns the weights' element type for the form's own check.
    fn validate_dot(&self, acc: LocalId, (weights, w_start): (ParamId, &Expr), (act, act_start): (ParamId, &Expr), scales: &[Expr]) -> Result<ElemType, String> {
        if self.locals.get(acc.index()).is_none_or(|&n| n < DOT_LANES as u64) {
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
                Stmt::Store { buf, index, value } => {
                    let p = self.buffer(*buf).ok_or(format!("buffer {buf} does not exist"))?;
                    if !p.writes {
                        return Err(format!("store to read-only parameter `{}`", p.name));
                    }
                    if self.type_of(index)? != ValType::I64 {
                        return Err("store index must be i64".into());
                    }
                    let want = match p.elem {
                        ElemType::F32 | ElemType::F16 | ElemType::BF16 => ValType::F32,
                        ElemType::I32 | ElemType::I8 => ValType::I64,
                        ElemType::U8 => {
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
                    self.buffer(Buf::Param(*param)).ok_or(format!("buffer {param} does not exist"))?;
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
                Stmt::PairDot { acc, weights, w_start, act, act_start } => {
                    if self.locals.get(acc.index()).copied().unwrap_or(0) < DOT_LANES as u64 {
                        return Err(format!("pair dot accumulator {acc} needs {DOT_LANES} elements"));
                    }
                    for (p, what) in [(*weights, "weights"), (*act, "activations")] {
                        if self.dot_param(p, what)? != ElemType::BF16 {
                            return Err(format!("pair dot {what} {p} must be a bf16 parameter"));
                        }
                    }
                    if self.type_of(w_start)? != ValType::I64 || self.type_of(act_start)? != ValType::I64 {
                        return Err("dot starts must be i64".into());
                    }
                }
                Stmt::WidenBf16 { dst, weights, start } => {
                    if self.locals.get(dst.index()).copied().unwrap_or(0) < DOT_LANES as u64 {
                        return Err(format!("widened bf16 row {dst} needs {DOT_LANES} elements"));
                    }
                    if self.dot_param(*weights, "weights")? != ElemType::BF16 {
                        return Err(format!("widened weights {weights} must be a bf16 parameter"));
                    }
                    if self.type_of(start)? != ValType::I64 {
                        return Err("a widened row's start must be i64".into());
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
                    match (&d.high_bits, d.form.high_bit_count() > 0) {
                        (Some((p, start)), true) => {
                            if !matches!(self.dot_param(*p, "high bits")?, ElemType::U8 | ElemType::I8) || self.type_of(start)? != ValType::I64 {
                                return Err(format!("high bits {p} must be a byte parameter with an i64 start"));
                            }
                        }
                        (None, true) => return Err(format!("a {:?} row dot needs its high bits", d.form)),
                        (Some(_), false) => return Err(format!("a {:?} row dot has no high bits", d.form)),
                        (None, false) => {}
                    }
                    // Two halves: each with its own factor, the minimum an
                    // exact integer offset, activations as bytes, planes or
                    // word pairs, and the halves' activation sums.
                    if d.form.halves() > 1 {
                        if !matches!(d.row_min, RowMin::Offset(o) if o.fract() == 0.0) || d.row_scales.factors.is_none() || matches!(d.act_levels, ActLevels::Words) {
                            return Err(format!("a {:?} row dot takes per-half factors, an integer offset and byte, plane or word-pair activations", d.form));
                        }
                    }
                    match (&d.half_sums, d.form.halves() > 1) {
                        (Some((p, start)), true) => {
                            if self.dot_param(*p, "half sums")? != ElemType::I32 || self.type_of(start)? != ValType::I64 {
                                return Err(format!("half sums {p} must be an i32 parameter with an i64 start"));
                            }
                        }
                        (None, true) => return Err(format!("a {:?} row dot needs its halves' activation sums", d.form)),
                        (Some(_), false) => return Err(format!("a {:?} row dot has no halves to sum", d.form)),
                        (None, false) => {}
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
