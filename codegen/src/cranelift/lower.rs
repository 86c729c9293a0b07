//! Lowering of kernel IR to Cranelift IR: one exhaustive `match` per IR enum (no
//! `_ =>` arm), so a new kernel-IR op does not compile until this backend handles it.
//! Scalars are Cranelift variables (SSA is built by the frontend); loops are
//! header / body / exit blocks; libm supplies tanh, sin, cos and exp.
//!
//! Loops hinted `Vectorize` whose body is plain f32 arithmetic on unit-stride or
//! loop-invariant f32 data (stores, and `acc = acc + e` sums) run four lanes at a
//! time in 128-bit `f32x4` registers (SSE2, part of the x86-64 baseline), with a
//! scalar loop for the remainder; anything else (integer lane math, 16-bit or byte
//! loads, temporaries) stays scalar. See [`VectorLoop`].

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, AbiParam, Block, InstBuilder, MemFlagsData, StackSlotData, StackSlotKind, Type, Value};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext, Variable};
use cranelift_module::{FuncId, Linkage, Module};
use cranelift_object::ObjectModule;
use maxc_kernels::ir::*;

use crate::CodegenError;

fn err(e: impl std::fmt::Display) -> CodegenError {
    CodegenError::Llvm(format!("cranelift: {e}"))
}

fn val_type(t: ValType) -> Type {
    match t {
        ValType::F32 => types::F32,
        ValType::I64 => types::I64,
        ValType::Bool => types::I8,
    }
}

/// The libm functions kernels may call, declared on first use.
#[derive(Default)]
struct Libm {
    funcs: Vec<(&'static str, FuncId)>,
}

impl Libm {
    fn get(&mut self, module: &mut ObjectModule, name: &'static str) -> Result<FuncId, CodegenError> {
        if let Some((_, id)) = self.funcs.iter().find(|(n, _)| *n == name) {
            return Ok(*id);
        }
        let mut sig = module.make_signature();
        sig.params.push(AbiParam::new(types::F32));
        sig.returns.push(AbiParam::new(types::F32));
        let id = module.declare_function(name, Linkage::Import, &sig).map_err(err)?;
        self.funcs.push((name, id));
        Ok(id)
    }
}

struct Lowering<'a, 'b> {
    b: FunctionBuilder<'b>,
    module: &'a mut ObjectModule,
    libm: Libm,
    kernel: &'a Kernel,
    params: Vec<Value>,
    /// Addresses of the kernel's local arrays (stack slots).
    locals: Vec<Value>,
    vars: Vec<Variable>,
    seq: Value,
}

/// Declares and defines one kernel with the CPU kernel ABI.
pub fn lower_kernel(module: &mut ObjectModule, kernel: &Kernel) -> Result<(), CodegenError> {
    let ptr = module.target_config().pointer_type();
    let mut sig = module.make_signature();
    for t in [ptr, ptr, types::I64, types::I64] {
        sig.params.push(AbiParam::new(t));
    }
    let id = module.declare_function(&kernel.name, Linkage::Export, &sig).map_err(err)?;
    let mut ctx = module.make_context();
    ctx.func.signature = sig;
    let mut fctx = FunctionBuilderContext::new();
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        b.seal_block(entry);
        let [args, dims, begin, end] = [0, 1, 2, 3].map(|i| b.block_params(entry)[i]);
        let flags = MemFlagsData::trusted();
        let params = (0..kernel.params.len()).map(|i| b.ins().load(ptr, flags, args, (i * 8) as i32)).collect();
        let seq = b.ins().load(types::I64, flags, dims, 0);
        let locals = kernel
            .locals
            .iter()
            .map(|&len| {
                let slot = b.create_sized_stack_slot(StackSlotData::new(StackSlotKind::ExplicitSlot, (len * 4) as u32, 6));
                b.ins().stack_addr(ptr, slot, 0)
            })
            .collect();
        let vars = kernel.vars.iter().map(|t| b.declare_var(val_type(*t))).collect();
        let mut l = Lowering { b, module, libm: Libm::default(), kernel, params, locals, vars, seq };
        l.lower_loop(kernel.task_var, begin, end, &kernel.body)?;
        l.b.ins().return_(&[]);
        let config = l.module.target_config();
        l.b.finalize(config);
    }
    module.define_function(id, &mut ctx).map_err(|e| err(format!("{}: {e:?}", kernel.name)))?;
    Ok(())
}

impl Lowering<'_, '_> {
    fn block(&mut self, stmts: &[Stmt]) -> Result<(), CodegenError> {
        for s in stmts {
            match s {
                Stmt::Set { var, value } => {
                    let v = self.expr(value)?;
                    self.b.def_var(self.vars[*var as usize], v);
                }
                // A hint Cranelift has no instruction for.
                Stmt::Prefetch { .. } => {}
                Stmt::Store { buf, index, value } => {
                    let v = self.expr(value)?;
                    let addr = self.address(*buf, index)?;
                    let flags = MemFlagsData::trusted();
                    match self.kernel.buffer(*buf).expect("validated").elem {
                        ElemType::F32 => {
                            self.b.ins().store(flags, v, addr, 0);
                        }
                        ElemType::I32 => {
                            self.b.ins().istore32(flags, v, addr, 0);
                        }
                        ElemType::I8 => {
                            self.b.ins().istore8(flags, v, addr, 0);
                        }
                        ElemType::F16 => {
                            let h = self.f32_to_f16(v);
                            self.b.ins().istore16(flags, h, addr, 0);
                        }
                        ElemType::BF16 => {
                            let h = self.f32_to_bf16(v);
                            self.b.ins().istore16(flags, h, addr, 0);
                        }
                        ElemType::U8 => {
                            unreachable!("weight-only parameters are never stored (validated)")
                        }
                    }
                }
                Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => self.dot_block(*acc, scales, (*weights, w_start), *form, (*act, act_start))?,
                Stmt::DotRows(d) => self.dot_rows(d)?,
                Stmt::PairDot { acc, weights, w_start, act, act_start } => self.pair_dot(*acc, (*weights, w_start), (*act, act_start))?,
                Stmt::WidenBf16 { dst, weights, start } => self.widen_bf16(*dst, (*weights, start))?,
                Stmt::For { var, start, end, body, hint } => {
                    let (lo, hi) = (self.expr(start)?, self.expr(end)?);
                    let plan = if *hint == LoopHint::Vectorize { VectorLoop::analyze(self.kernel, *var, body) } else { None };
                    match plan {
                        Some(plan) => self.lower_vector_loop(*var, lo, hi, body, &plan)?,
                        None => self.lower_loop(*var, lo, hi, body)?,
                    }
                }
                Stmt::If { cond, then } => {
                    let c = self.expr(cond)?;
                    let (then_bb, done) = (self.b.create_block(), self.b.create_block());
                    self.b.ins().brif(c, then_bb, &[], done, &[]);
                    self.b.switch_to_block(then_bb);
                    self.b.seal_block(then_bb);
                    self.block(then)?;
                    self.b.ins().jump(done, &[]);
                    self.b.switch_to_block(done);
                    self.b.seal_block(done);
                }
            }
        }
        Ok(())
    }

    /// A [`Stmt::PairDot`] in scalar code: per lane, the two products (exact in
    /// f32: bfloat16 significands have 8 bits) added to the accumulator, the
    /// first activation's first.
    fn pair_dot(&mut self, acc: LocalId, (weights, w_start): (ParamId, &Expr), (act, act_start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let flags = MemFlagsData::trusted();
        let w_base = self.address(weights, w_start)?;
        let a_base = self.address(act, act_start)?;
        let acc_base = self.locals[acc.index()];
        let x = [self.bf16_at(a_base, 0), self.bf16_at(a_base, 1)];
        for l in 0..DOT_LANES {
            let mut sum = self.b.ins().load(types::F32, flags, acc_base, (4 * l) as i32);
            for (pair, &xp) in x.iter().enumerate() {
                let w = self.bf16_at(w_base, pair as i64 * DOT_LANES + l);
                let product = self.b.ins().fmul(xp, w);
                sum = self.b.ins().fadd(sum, product);
            }
            self.b.ins().store(flags, sum, acc_base, (4 * l) as i32);
        }
        Ok(())
    }

    /// A [`Stmt::WidenBf16`] in scalar code: per lane, the 16 bits moved to
    /// the top of an f32.
    fn widen_bf16(&mut self, dst: LocalId, (weights, start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let flags = MemFlagsData::trusted();
        let w_base = self.address(weights, start)?;
        let dst_base = self.locals[dst.index()];
        for l in 0..DOT_LANES {
            let value = self.bf16_at(w_base, l);
            self.b.ins().store(flags, value, dst_base, (4 * l) as i32);
        }
        Ok(())
    }

    /// The bfloat16 element `at` past `base` as an f32 (its 16 bits moved to the top).
    fn bf16_at(&mut self, base: Value, at: i64) -> Value {
        let h = self.b.ins().uload16(types::I32, MemFlagsData::trusted(), base, (2 * at) as i32);
        let bits = self.b.ins().ishl_imm_u(h, 16);
        self.b.ins().bitcast(types::F32, MemFlagsData::new(), bits)
    }

    /// A [`Stmt::DotBlock`] in scalar code (this backend's baseline x86-64 has no
    /// VNNI): per lane, four byte loads of each operand, integer multiply-adds,
    /// one conversion and one scaled add to the accumulator.
    fn dot_block(&mut self, acc: LocalId, scales: &[Expr; 2], (weights, w_start): (ParamId, &Expr), form: DotForm, (act, act_start): (ParamId, &Expr)) -> Result<(), CodegenError> {
        let flags = MemFlagsData::trusted();
        let scales = [self.expr(&scales[0])?, self.expr(&scales[1])?];
        let w_base = self.address(weights, w_start)?;
        let a_base = self.address(act, act_start)?;
        let acc_base = self.locals[acc.index()];
        for g in 0..DOT_LANES {
            let mut sum = self.b.ins().iconst(types::I32, 0);
            for i in 4 * g..4 * g + 4 {
                let w = match form {
                    DotForm::Int8 => self.b.ins().sload8(types::I32, flags, w_base, i as i32),
                    DotForm::NibblePairs => {
                        let (q, j) = (i / 16, i % 16);
                        let byte = self.b.ins().uload8(types::I32, flags, w_base, (16 * (q % 2) + j) as i32);
                        if q < 2 {
                            self.b.ins().band_imm_u(byte, 15)
                        } else {
                            self.b.ins().ushr_imm_u(byte, 4)
                        }
                    }
                };
                let a = self.b.ins().sload8(types::I32, flags, a_base, i as i32);
                let p = self.b.ins().imul(w, a);
                sum = self.b.ins().iadd(sum, p);
            }
            let f = self.b.ins().fcvt_from_sint(types::F32, sum);
            let scaled = self.b.ins().fmul(f, scales[form.block_of_lane(g)]);
            let old = self.b.ins().load(types::F32, flags, acc_base, (4 * g) as i32);
            let new = self.b.ins().fadd(old, scaled);
            self.b.ins().store(flags, new, acc_base, (4 * g) as i32);
        }
        Ok(())
    }

    /// A [`Stmt::DotRows`] in scalar code: per row, 32 unsigned levels (bytes,
    /// nibbles, or nibbles with a fifth bit, as the form places them) times
    /// signed activation bytes, summed in i32, converted, scaled by the row's
    /// scale and the activation scale, plus the row's minimum times the
    /// activation sum, added to the accumulator. 16-bit activations multiply
    /// `255 * high + low` bytes (`ActLevels::Planes`) or little-endian words
    /// (`ActLevels::Words`; `ActLevels::WordPairs` in their `0 2 1 3` order).
    ///
    /// The 16 rows are a loop, not unrolled: every row reads the same bytes
    /// [`RowsForm::ROW_STRIDE`] further on (its levels, high bits, scales and
    /// accumulator), so one body of 32 unrolled values serves all of them.
    /// Unrolled, a tile kernel's dots came to 1.5-2.7 MB of code and 2-7 s of
    /// Cranelift's register allocation per kernel.
    fn dot_rows(&mut self, d: &RowDot) -> Result<(), CodegenError> {
        let flags = MemFlagsData::trusted();
        let w_base = self.address(d.weights, &d.w_start)?;
        let a_base = self.address(d.act, &d.act_start)?;
        let low_base = match &d.act_levels {
            ActLevels::Planes { low } => Some(self.address(d.act, low)?),
            _ => None,
        };
        let (act_scale, act_sum) = (self.expr(&d.act_scales[0])?, self.expr(&d.act_scales[1])?);
        let high_base = match &d.high_bits {
            Some((p, start)) => Some(self.address(*p, start)?),
            None => None,
        };
        // Two halves (Q6_K): each half's dot with the integer offset applied
        // through the half's activation sum, scaled by its own factor.
        let halves = d.form.halves();
        let half_offset = match d.row_min {
            RowMin::Offset(o) if halves > 1 => o as i64,
            _ => 0,
        };
        // (The verifier gives every form with two halves its sums.)
        let mut offset_terms = Vec::new();
        if let (Some((p, start)), true) = (&d.half_sums, half_offset != 0) {
            let base = self.address(*p, start)?;
            for h in 0..halves {
                let sum = self.b.ins().load(types::I32, flags, base, (4 * h) as i32);
                offset_terms.push(self.b.ins().imul_imm_s(sum, half_offset));
            }
        }
        let scales = RowBases::new(self, &d.row_scales, halves)?;
        let mins = match &d.row_min {
            RowMin::Offset(_) => None,
            RowMin::Stored(m) | RowMin::Subtracted(m) => Some(RowBases::new(self, m, 1)?),
        };
        let acc_base = self.locals[d.acc.index()];

        // for g in 0..16: the body below with row g's bases.
        let (header, body, exit) = (self.b.create_block(), self.b.create_block(), self.b.create_block());
        let g = self.b.append_block_param(header, types::I64);
        let first = self.b.ins().iconst(types::I64, 0);
        self.b.ins().jump(header, &[first.into()]);
        self.b.switch_to_block(header);
        let more = self.b.ins().icmp_imm_s(IntCC::SignedLessThan, g, DOT_LANES);
        self.b.ins().brif(more, body, &[], exit, &[]);
        self.b.switch_to_block(body);
        self.b.seal_block(body);
        let row_bytes = self.b.ins().imul_imm_s(g, RowsForm::ROW_STRIDE);
        let w_row = self.b.ins().iadd(w_base, row_bytes);
        let high_row = high_base.map(|base| self.b.ins().iadd(base, row_bytes));
        let acc_offset = self.b.ins().imul_imm_s(g, 4);
        let acc_row = self.b.ins().iadd(acc_base, acc_offset);

        let mut sums = Vec::new();
        let mut sum = self.b.ins().iconst(types::I32, 0);
        for t in 0..RowsForm::VALUES {
            if t > 0 && t % (RowsForm::VALUES / halves) == 0 {
                sums.push(sum);
                sum = self.b.ins().iconst(types::I32, 0);
            }
            let (at, high) = d.form.byte_of(0, t);
            let byte = self.b.ins().uload8(types::I32, flags, w_row, at as i32);
            let mut w = match (d.form, high) {
                (RowsForm::Bytes, _) => byte,
                (_, false) => self.b.ins().band_imm_u(byte, 15),
                (_, true) => self.b.ins().ushr_imm_u(byte, 4),
            };
            // Bits 4 and up from the high bits (RowsForm::high_bit_of).
            if let Some(high_row) = high_row {
                for b in 0..d.form.high_bit_count() {
                    let (at, bit) = d.form.high_bit_of(0, t, b);
                    let bits = self.b.ins().uload8(types::I32, flags, high_row, at as i32);
                    let to = 4 + b;
                    let moved = if bit <= to { self.b.ins().ishl_imm_u(bits, to - bit) } else { self.b.ins().ushr_imm_u(bits, bit - to) };
                    let one = self.b.ins().band_imm_u(moved, 1 << to);
                    w = self.b.ins().bor(w, one);
                }
            }
            let mut a = match d.act_levels {
                ActLevels::Words => self.b.ins().sload16(types::I32, flags, a_base, 2 * t as i32),
                ActLevels::WordPairs => self.b.ins().sload16(types::I32, flags, a_base, 2 * word_pair_position(t) as i32),
                _ => self.b.ins().sload8(types::I32, flags, a_base, t as i32),
            };
            if let Some(low_base) = low_base {
                let high = self.b.ins().imul_imm_s(a, HIGH_PLANE_WEIGHT);
                let low = self.b.ins().sload8(types::I32, flags, low_base, t as i32);
                a = self.b.ins().iadd(high, low);
            }
            let p = self.b.ins().imul(w, a);
            sum = self.b.ins().iadd(sum, p);
        }
        let term = if halves > 1 {
            sums.push(sum);
            for (sum, offset) in sums.iter_mut().zip(&offset_terms) {
                *sum = self.b.ins().iadd(*sum, *offset);
            }
            // act_scale * (S_0 * dot_0 + S_1 * dot_1)
            let mut total = None;
            for (h, sum) in sums.into_iter().enumerate() {
                let dot = self.b.ins().fcvt_from_sint(types::F32, sum);
                let scale = scales.value(self, g, h)?;
                let term = self.b.ins().fmul(scale, dot);
                total = Some(match total {
                    None => term,
                    Some(t) => self.b.ins().fadd(t, term),
                });
            }
            self.b.ins().fmul(total.expect("two halves"), act_scale)
        } else {
            let dot = self.b.ins().fcvt_from_sint(types::F32, sum);
            let row_scale = scales.value(self, g, 0)?;
            let min = match (&d.row_min, &mins) {
                (RowMin::Offset(o), _) => {
                    let o = self.b.ins().f32const(*o);
                    self.b.ins().fmul(o, row_scale)
                }
                (RowMin::Stored(_), Some(m)) => m.value(self, g, 0)?,
                (RowMin::Subtracted(_), Some(m)) => {
                    let m = m.value(self, g, 0)?;
                    self.b.ins().fneg(m)
                }
                (RowMin::Stored(_) | RowMin::Subtracted(_), None) => unreachable!("stored minimums have their bases"),
            };
            let scaled = self.b.ins().fmul(dot, act_scale);
            let left = self.b.ins().fmul(row_scale, scaled);
            let right = self.b.ins().fmul(min, act_sum);
            self.b.ins().fadd(left, right)
        };
        let old = self.b.ins().load(types::F32, flags, acc_row, 0);
        let new = self.b.ins().fadd(old, term);
        self.b.ins().store(flags, new, acc_row, 0);
        let next = self.b.ins().iadd_imm_s(g, 1);
        self.b.ins().jump(header, &[next.into()]);
        self.b.seal_block(header);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
        Ok(())
    }

    /// The element of buffer `buf` at address `addr`, as the kernel IR
    /// reads it (floats widened to f32, integers to i32 or i64).
    fn load_elem(&mut self, buf: Buf, addr: Value) -> Value {
        let flags = MemFlagsData::trusted();
        match self.kernel.buffer(buf).expect("validated").elem {
            ElemType::F32 => self.b.ins().load(types::F32, flags, addr, 0),
            ElemType::I32 => self.b.ins().sload32(flags, addr, 0),
            ElemType::BF16 => {
                let h = self.b.ins().uload16(types::I32, flags, addr, 0);
                let bits = self.b.ins().ishl_imm_u(h, 16);
                self.b.ins().bitcast(types::F32, MemFlagsData::new(), bits)
            }
            ElemType::F16 => {
                let h = self.b.ins().uload16(types::I32, flags, addr, 0);
                self.f16_to_f32(h)
            }
            ElemType::I8 => self.b.ins().sload8(types::I64, flags, addr, 0),
            ElemType::U8 => self.b.ins().uload8(types::I64, flags, addr, 0),
        }
    }

    /// `for var in lo..hi { body }` with bounds evaluated once.
    fn lower_loop(&mut self, var: VarId, lo: Value, hi: Value, body: &[Stmt]) -> Result<(), CodegenError> {
        let v = self.vars[var as usize];
        self.b.def_var(v, lo);
        let (header, body_bb, exit): (Block, Block, Block) = (self.b.create_block(), self.b.create_block(), self.b.create_block());
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let i = self.b.use_var(v);
        let c = self.b.ins().icmp(IntCC::SignedLessThan, i, hi);
        self.b.ins().brif(c, body_bb, &[], exit, &[]);
        self.b.switch_to_block(body_bb);
        self.b.seal_block(body_bb);
        self.block(body)?;
        let i = self.b.use_var(v);
        let next = self.b.ins().iadd_imm_s(i, 1);
        self.b.def_var(v, next);
        self.b.ins().jump(header, &[]);
        self.b.seal_block(header);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
        Ok(())
    }

    /// A `Vectorize` loop as an `f32x4` loop over `lo..lo + 4*((hi-lo)/4)` (reductions
    /// in vector accumulators, summed into their variables after it), then the
    /// scalar loop over what is left.
    fn lower_vector_loop(&mut self, var: VarId, lo: Value, hi: Value, body: &[Stmt], plan: &VectorLoop) -> Result<(), CodegenError> {
        let v = self.vars[var as usize];
        let count = self.b.ins().isub(hi, lo);
        let none = self.b.ins().iconst(types::I64, 0);
        let count = self.b.ins().smax(count, none);
        let whole = self.b.ins().band_imm_u(count, !3);
        let vec_end = self.b.ins().iadd(lo, whole);
        let zero = self.b.ins().f32const(0.0);
        let zero4 = self.b.ins().splat(types::F32X4, zero);
        let accs: Vec<Variable> = plan
            .reductions
            .iter()
            .map(|_| {
                let a = self.b.declare_var(types::F32X4);
                self.b.def_var(a, zero4);
                a
            })
            .collect();
        self.b.def_var(v, lo);
        let (header, body_bb, exit) = (self.b.create_block(), self.b.create_block(), self.b.create_block());
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let i = self.b.use_var(v);
        let c = self.b.ins().icmp(IntCC::SignedLessThan, i, vec_end);
        self.b.ins().brif(c, body_bb, &[], exit, &[]);
        self.b.switch_to_block(body_bb);
        self.b.seal_block(body_bb);
        for s in body {
            match s {
                Stmt::Set { var: acc, value } => {
                    let slot = plan.reductions.iter().position(|r| r == acc).expect("analyzed");
                    let term = plan.term(*acc, value);
                    let x = self.vexpr(term, var)?;
                    let sum = self.b.use_var(accs[slot]);
                    let sum = self.b.ins().fadd(sum, x);
                    self.b.def_var(accs[slot], sum);
                }
                Stmt::Store { buf, index, value } => {
                    let x = self.vexpr(value, var)?;
                    let addr = self.address(*buf, index)?;
                    self.b.ins().store(MemFlagsData::new().with_notrap(), x, addr, 0);
                }
                Stmt::For { .. } | Stmt::If { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } | Stmt::Prefetch { .. } => unreachable!("VectorLoop::analyze admits sets and stores only"),
            }
        }
        let i = self.b.use_var(v);
        let next = self.b.ins().iadd_imm_s(i, 4);
        self.b.def_var(v, next);
        self.b.ins().jump(header, &[]);
        self.b.seal_block(header);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
        for (slot, &acc) in plan.reductions.iter().enumerate() {
            let vsum = self.b.use_var(accs[slot]);
            let mut total = self.b.use_var(self.vars[acc as usize]);
            for lane in 0..4u8 {
                let x = self.b.ins().extractlane(vsum, lane);
                total = self.b.ins().fadd(total, x);
            }
            self.b.def_var(self.vars[acc as usize], total);
        }
        let rest_start = self.b.use_var(v);
        self.lower_loop(var, rest_start, hi, body)
    }

    /// An f32 expression as an `f32x4` of lanes `i..i+4` (`var` = `i`).
    fn vexpr(&mut self, e: &Expr, var: VarId) -> Result<Value, CodegenError> {
        Ok(match e {
            Expr::Load { buf, index } if stride(index, var) == Some(1) => {
                let addr = self.address(*buf, index)?;
                // Not `aligned`: lanes i..i+4 of a row start anywhere (movups, not movaps).
                self.b.ins().load(types::F32X4, MemFlagsData::new().with_notrap(), addr, 0)
            }
            Expr::Bin(op, x, y) => {
                let (x, y) = (self.vexpr(x, var)?, self.vexpr(y, var)?);
                let i = self.b.ins();
                match op {
                    BinOp::Add => i.fadd(x, y),
                    BinOp::Sub => i.fsub(x, y),
                    BinOp::Mul => i.fmul(x, y),
                    BinOp::Div => i.fdiv(x, y),
                    BinOp::Max => i.fmax(x, y),
                    BinOp::Min => i.fmin(x, y),
                    BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::And => unreachable!("VectorLoop::analyze admits f32 operators only"),
                }
            }
            Expr::MulAdd(x, y, z) => {
                let (x, y, z) = (self.vexpr(x, var)?, self.vexpr(y, var)?, self.vexpr(z, var)?);
                let product = self.b.ins().fmul(x, y);
                self.b.ins().fadd(product, z)
            }
            Expr::Un(UnOp::Neg, x) => {
                let x = self.vexpr(x, var)?;
                self.b.ins().fneg(x)
            }
            Expr::Un(UnOp::Sqrt, x) => {
                let x = self.vexpr(x, var)?;
                self.b.ins().sqrt(x)
            }
            // Loop-invariant scalars (constants, variables, invariant loads): broadcast.
            _ => {
                let x = self.expr(e)?;
                self.b.ins().splat(types::F32X4, x)
            }
        })
    }

    fn address(&mut self, buf: impl Into<Buf>, index: &Expr) -> Result<Value, CodegenError> {
        let buf = buf.into();
        let idx = self.expr(index)?;
        let size = self.kernel.buffer(buf).expect("validated").elem.size() as i64;
        let offset = self.b.ins().imul_imm_s(idx, size);
        let base = match buf {
            Buf::Local(l) => self.locals[l.index()],
            Buf::Param(p) => self.params[p.index()],
        };
        Ok(self.b.ins().iadd(base, offset))
    }

    fn call_libm(&mut self, name: &'static str, x: Value) -> Result<Value, CodegenError> {
        let id = self.libm.get(self.module, name)?;
        let f = self.module.declare_func_in_func(id, self.b.func);
        let call = self.b.ins().call(f, &[x]);
        Ok(self.b.inst_results(call)[0])
    }

    /// IEEE half bits (in an i32) to f32, subnormals and specials included.
    /// The bits of the half nearest to f32 `x` (ties to even), in the low 16
    /// bits of an i32: overflow to infinity, NaN stays NaN, subnormal halves
    /// rounded like normal ones. Computed in integers: Cranelift has no
    /// portable f32 -> f16 conversion.
    /// The bits of the bfloat16 nearest `x` (ties to even, as `vcvtneps2bf16`),
    /// in an I32: the f32's upper half rounded by its lower one; a NaN keeps
    /// its sign and upper mantissa bits and is made quiet.
    fn f32_to_bf16(&mut self, x: Value) -> Value {
        let bits = self.b.ins().bitcast(types::I32, MemFlagsData::new(), x);
        let upper = self.b.ins().ushr_imm_u(bits, 16);
        let lsb = self.b.ins().band_imm_u(upper, 1);
        let rounded = self.b.ins().iadd_imm_s(bits, 0x7fff);
        let rounded = self.b.ins().iadd(rounded, lsb);
        let rounded = self.b.ins().ushr_imm_u(rounded, 16);
        let quiet = self.b.ins().bor_imm_u(upper, 0x40);
        let abs = self.b.ins().band_imm_u(bits, 0x7fff_ffff);
        let is_nan = self.b.ins().icmp_imm_u(IntCC::UnsignedGreaterThan, abs, 0x7f80_0000);
        self.b.ins().select(is_nan, quiet, rounded)
    }

    fn f32_to_f16(&mut self, x: Value) -> Value {
        let i = self.b.ins();
        let bits = i.bitcast(types::I32, MemFlagsData::new(), x);
        let sign = self.b.ins().ushr_imm_u(bits, 16);
        let sign = self.b.ins().band_imm_u(sign, 0x8000);
        let abs = self.b.ins().band_imm_u(bits, 0x7fff_ffff);
        // Normal halves (|x| >= 2^-14): drop 13 mantissa bits with rounding,
        // rebias the exponent by 127 - 15; a carry out of the mantissa bumps the
        // exponent, up to infinity (0x7c00) at 65520 and above.
        let lsb = self.b.ins().ushr_imm_u(abs, 13);
        let lsb = self.b.ins().band_imm_u(lsb, 1);
        let rounded = self.b.ins().iadd_imm_s(abs, 0x0fff);
        let rounded = self.b.ins().iadd(rounded, lsb);
        let normal = self.b.ins().ushr_imm_u(rounded, 13);
        let normal = self.b.ins().iadd_imm_s(normal, -((127 - 15) << 10));
        let inf = self.b.ins().iconst(types::I32, 0x7c00);
        let too_big = self.b.ins().icmp_imm_s(IntCC::SignedGreaterThan, normal, 0x7c00);
        let normal = self.b.ins().select(too_big, inf, normal);
        // Subnormal halves (|x| < 2^-14): |x| * 2^24 rounded to an integer is
        // the half's bits (exact in f32, and f32 rounds ties to even).
        let abs_f = self.b.ins().bitcast(types::F32, MemFlagsData::new(), abs);
        let scale = self.b.ins().f32const(2f32.powi(24));
        let scaled = self.b.ins().fmul(abs_f, scale);
        let scaled = self.b.ins().nearest(scaled);
        let sub = self.b.ins().fcvt_to_sint_sat(types::I32, scaled);
        let is_sub = self.b.ins().icmp_imm_u(IntCC::UnsignedLessThan, abs, 0x3880_0000);
        let finite = self.b.ins().select(is_sub, sub, normal);
        // Infinity and NaN (a quiet NaN keeps a mantissa bit).
        let is_nan = self.b.ins().icmp_imm_u(IntCC::UnsignedGreaterThan, abs, 0x7f80_0000);
        let nan = self.b.ins().iconst(types::I32, 0x7e00);
        let special = self.b.ins().select(is_nan, nan, inf);
        let is_special = self.b.ins().icmp_imm_u(IntCC::UnsignedGreaterThanOrEqual, abs, 0x7f80_0000);
        let magnitude = self.b.ins().select(is_special, special, finite);
        self.b.ins().bor(sign, magnitude)
    }

    fn f16_to_f32(&mut self, h: Value) -> Value {
        let e = self.b.ins().ushr_imm_u(h, 10);
        let e = self.b.ins().band_imm_u(e, 0x1f);
        let m = self.b.ins().band_imm_u(h, 0x3ff);
        let s = self.b.ins().ushr_imm_u(h, 15);
        let s = self.b.ins().ishl_imm_u(s, 31);
        let e_norm = self.b.ins().iadd_imm_s(e, 112);
        let e_norm = self.b.ins().ishl_imm_u(e_norm, 23);
        let m_sh = self.b.ins().ishl_imm_u(m, 13);
        let normal = self.b.ins().bor(s, e_norm);
        let normal = self.b.ins().bor(normal, m_sh);
        let special = self.b.ins().bor_imm_u(s, 0x7f80_0000);
        let special = self.b.ins().bor(special, m_sh);
        let is_special = self.b.ins().icmp_imm_s(IntCC::Equal, e, 31);
        let bits = self.b.ins().select(is_special, special, normal);
        let as_float = self.b.ins().bitcast(types::F32, MemFlagsData::new(), bits);
        // Subnormals and zero: m * 2^-24 with the sign.
        let mf = self.b.ins().fcvt_from_sint(types::F32, m);
        let scale = self.b.ins().f32const(2f32.powi(-24));
        let sub = self.b.ins().fmul(mf, scale);
        let neg = self.b.ins().fneg(sub);
        let negative = self.b.ins().icmp_imm_s(IntCC::NotEqual, s, 0);
        let sub = self.b.ins().select(negative, neg, sub);
        let is_sub = self.b.ins().icmp_imm_s(IntCC::Equal, e, 0);
        self.b.ins().select(is_sub, sub, as_float)
    }

    fn expr(&mut self, e: &Expr) -> Result<Value, CodegenError> {
        Ok(match e {
            Expr::F32(x) => self.b.ins().f32const(*x),
            Expr::I64(x) => self.b.ins().iconst(types::I64, *x),
            Expr::Var(v) => self.b.use_var(self.vars[*v as usize]),
            Expr::Seq => self.seq,
            Expr::Load { buf, index } => {
                let addr = self.address(*buf, index)?;
                self.load_elem(*buf, addr)
            }
            Expr::Bin(op, x, y) => {
                let float = self.kernel.type_of(x).map_err(err)? == ValType::F32;
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                let i = self.b.ins();
                match (op, float) {
                    (BinOp::Add, true) => i.fadd(x, y),
                    (BinOp::Sub, true) => i.fsub(x, y),
                    (BinOp::Mul, true) => i.fmul(x, y),
                    (BinOp::Div, true) => i.fdiv(x, y),
                    (BinOp::Max, true) => i.fmax(x, y),
                    (BinOp::Min, true) => i.fmin(x, y),
                    (BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::And, true) => unreachable!("integer-only (validated)"),
                    (BinOp::Add, false) => i.iadd(x, y),
                    (BinOp::Sub, false) => i.isub(x, y),
                    (BinOp::Mul, false) => i.imul(x, y),
                    (BinOp::Div, false) => i.sdiv(x, y),
                    (BinOp::Rem, false) => i.srem(x, y),
                    (BinOp::Max, false) => i.smax(x, y),
                    (BinOp::Min, false) => i.smin(x, y),
                    (BinOp::Shl, false) => i.ishl(x, y),
                    (BinOp::Shr, false) => i.ushr(x, y),
                    (BinOp::And, false) => i.band(x, y),
                }
            }
            Expr::Cmp(op, x, y) => {
                let float = self.kernel.type_of(x).map_err(err)? == ValType::F32;
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                if float {
                    let cc = match op {
                        CmpOp::Lt => FloatCC::LessThan,
                        CmpOp::Le => FloatCC::LessThanOrEqual,
                        CmpOp::Eq => FloatCC::Equal,
                    };
                    self.b.ins().fcmp(cc, x, y)
                } else {
                    let cc = match op {
                        CmpOp::Lt => IntCC::SignedLessThan,
                        CmpOp::Le => IntCC::SignedLessThanOrEqual,
                        CmpOp::Eq => IntCC::Equal,
                    };
                    self.b.ins().icmp(cc, x, y)
                }
            }
            Expr::Un(op, x) => {
                let float = self.kernel.type_of(x).map_err(err)? == ValType::F32;
                let x = self.expr(x)?;
                match op {
                    UnOp::Neg if float => self.b.ins().fneg(x),
                    UnOp::Neg => self.b.ins().ineg(x),
                    UnOp::Exp => self.call_libm("expf", x)?,
                    UnOp::Sqrt => self.b.ins().sqrt(x),
                    UnOp::Tanh => self.call_libm("tanhf", x)?,
                    UnOp::Cos => self.call_libm("cosf", x)?,
                    UnOp::Sin => self.call_libm("sinf", x)?,
                    UnOp::ToF32 => self.b.ins().fcvt_from_sint(types::F32, x),
                    UnOp::Floor => self.b.ins().floor(x),
                    UnOp::ToI64 => self.b.ins().fcvt_to_sint_sat(types::I64, x),
                    UnOp::BitsToF32 => {
                        let low = self.b.ins().ireduce(types::I32, x);
                        self.b.ins().bitcast(types::F32, MemFlagsData::new(), low)
                    }
                    UnOp::HalfBitsToF32 => {
                        let low = self.b.ins().ireduce(types::I32, x);
                        let half_bits = self.b.ins().band_imm_u(low, 0xffff);
                        self.f16_to_f32(half_bits)
                    }
                }
            }
            // Cranelift's baseline x86-64 has no FMA: a multiply, then an add
            // (rounded twice, the same in every kernel Cranelift compiles).
            Expr::MulAdd(x, y, z) => {
                let (x, y, z) = (self.expr(x)?, self.expr(y)?, self.expr(z)?);
                let product = self.b.ins().fmul(x, y);
                self.b.ins().fadd(product, z)
            }
            Expr::Select(c, x, y) => {
                let c = self.expr(c)?;
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                self.b.ins().select(c, x, y)
            }
        })
    }
}

/// Where a [`RowScale`]'s values start for row 0 of a [`Stmt::DotRows`] (and
/// its factors for each half): row `g`'s are `g` elements further on.
struct RowBases {
    values: (Buf, Value, i64),
    factors: Option<(Vec<Value>, bool)>,
}

impl RowBases {
    fn new(l: &mut Lowering<'_, '_>, r: &RowScale, halves: i64) -> Result<RowBases, CodegenError> {
        let values = Buf::Param(r.values.0);
        let size = l.kernel.buffer(values).expect("validated").elem.size() as i64;
        let values = (values, l.address(r.values.0, &r.values.1)?, size);
        let factors = match &r.factors {
            None => None,
            Some((param, start)) => {
                let half = |h: i64| Expr::Bin(BinOp::Add, Box::new(start.clone()), Box::new(Expr::I64(DOT_LANES * h)));
                let bases = (0..halves).map(|h| l.address(*param, &half(h))).collect::<Result<_, _>>()?;
                Some((bases, l.kernel.params[param.index()].elem == ElemType::I8))
            }
        };
        Ok(RowBases { values, factors })
    }

    /// Row `g`'s value: the float value, times half `half`'s byte factor if
    /// any (read as its element type: `u8` unsigned, `i8` signed).
    fn value(&self, l: &mut Lowering<'_, '_>, g: Value, half: usize) -> Result<Value, CodegenError> {
        let (buf, base, size) = self.values;
        let offset = l.b.ins().imul_imm_s(g, size);
        let at = l.b.ins().iadd(base, offset);
        let value = l.load_elem(buf, at);
        let Some((bases, signed)) = &self.factors else { return Ok(value) };
        let at = l.b.ins().iadd(bases[half], g);
        let flags = MemFlagsData::trusted();
        let factor = if *signed {
            let byte = l.b.ins().sload8(types::I32, flags, at, 0);
            l.b.ins().fcvt_from_sint(types::F32, byte)
        } else {
            let byte = l.b.ins().uload8(types::I32, flags, at, 0);
            l.b.ins().fcvt_from_uint(types::F32, byte)
        };
        Ok(l.b.ins().fmul(value, factor))
    }
}

/// How an index expression moves with loop variable `var`: `Some(k)` when it is
/// `k * var + (something invariant)`, `None` when it is not affine in `var` or
/// reads memory or variables that could change inside the loop.
fn stride(e: &Expr, var: VarId) -> Option<i64> {
    match e {
        Expr::Var(v) if *v == var => Some(1),
        Expr::Var(_) | Expr::I64(_) | Expr::Seq => Some(0),
        Expr::Bin(BinOp::Add, a, b) => Some(stride(a, var)? + stride(b, var)?),
        Expr::Bin(BinOp::Sub, a, b) => Some(stride(a, var)? - stride(b, var)?),
        Expr::Bin(BinOp::Mul, a, b) => match (stride(a, var)?, stride(b, var)?) {
            (0, 0) => Some(0),
            (s, 0) => if let Expr::I64(c) = **b { Some(s * c) } else { None },
            (0, s) => if let Expr::I64(c) = **a { Some(s * c) } else { None },
            _ => None,
        },
        _ => None,
    }
}

/// A `Vectorize` loop the Cranelift backend runs four lanes at a time.
#[derive(Debug, PartialEq)]
pub struct VectorLoop {
    /// Variables updated as `acc = acc + e` (f32 sums; the order of the sum changes,
    /// as with LLVM's reassociating vectorizer).
    pub reductions: Vec<VarId>,
}

impl VectorLoop {
    /// The loop's plan, or `None` when its body does not fit the f32x4 scheme: only
    /// sums and f32 stores at unit stride, of expressions built from f32 arithmetic
    /// (`+ - * / min max`, negation, square root), unit-stride f32 loads, and values
    /// that do not change in the loop. A buffer the loop stores to may be loaded only
    /// at the very index it is stored at (element-wise updates).
    pub fn analyze(kernel: &Kernel, var: VarId, body: &[Stmt]) -> Option<VectorLoop> {
        let mut reductions = Vec::new();
        let mut stored: Vec<(Buf, &Expr)> = Vec::new();
        for s in body {
            match s {
                Stmt::Set { var: acc, value } if kernel.vars.get(*acc as usize) == Some(&ValType::F32) => {
                    let term = Self::sum_term(*acc, value)?;
                    if reductions.contains(acc) || term.mentions(*acc) {
                        return None;
                    }
                    reductions.push(*acc);
                }
                Stmt::Store { buf, index, .. } if kernel.buffer(*buf).map(|b| b.elem) == Some(ElemType::F32) && stride(index, var) == Some(1) => {
                    stored.push((*buf, index));
                }
                _ => return None,
            }
        }
        let plan = VectorLoop { reductions };
        for s in body {
            let value = match s {
                Stmt::Set { var: acc, value } => plan.term(*acc, value),
                Stmt::Store { value, .. } => value,
                _ => unreachable!("checked above"),
            };
            if !Self::lane_expr(kernel, value, var, &plan.reductions, &stored) {
                return None;
            }
        }
        Some(plan)
    }

    /// `e` of `acc = acc + e` (or `e + acc`).
    fn sum_term(acc: VarId, value: &Expr) -> Option<&Expr> {
        match value {
            Expr::Bin(BinOp::Add, a, b) if **a == Expr::Var(acc) => Some(b),
            Expr::Bin(BinOp::Add, a, b) if **b == Expr::Var(acc) => Some(a),
            _ => None,
        }
    }

    fn term<'e>(&self, acc: VarId, value: &'e Expr) -> &'e Expr {
        Self::sum_term(acc, value).expect("analyzed as a sum")
    }

    fn lane_expr(kernel: &Kernel, e: &Expr, var: VarId, reductions: &[VarId], stored: &[(Buf, &Expr)]) -> bool {
        let ok = |x: &Expr| Self::lane_expr(kernel, x, var, reductions, stored);
        match e {
            Expr::F32(_) => true,
            Expr::Var(v) => *v != var && !reductions.contains(v) && kernel.vars.get(*v as usize) == Some(&ValType::F32),
            Expr::Load { buf, index } => {
                let f32_data = kernel.buffer(*buf).map(|b| b.elem) == Some(ElemType::F32);
                let unaliased = stored.iter().all(|(b, at)| b != buf || *at == &**index);
                let st = stride(index, var);
                f32_data && unaliased && (st == Some(1) || (st == Some(0) && stored.iter().all(|(b, _)| b != buf)))
            }
            Expr::Bin(BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Max | BinOp::Min, a, b) => ok(a) && ok(b),
            Expr::Un(UnOp::Neg | UnOp::Sqrt, a) => ok(a),
            Expr::MulAdd(a, b, c) => ok(a) && ok(b) && ok(c),
            _ => false,
        }
    }
}

/// Whether `e` reads variable `v`.
#[cfg(test)]
mod tests {
    use super::*;
    use maxc_kernels::library::elementwise::{unary, Unary};
    use maxc_kernels::library::matmul::matmul;
    use maxc_kernels::library::SeqMode;

    /// Every `Vectorize` loop of a kernel and whether the f32x4 scheme takes it.
    fn plans(k: &Kernel) -> Vec<Option<VectorLoop>> {
        fn walk(k: &Kernel, body: &[Stmt], out: &mut Vec<Option<VectorLoop>>) {
            for s in body {
                match s {
                    Stmt::For { var, body, hint, .. } => {
                        if *hint == LoopHint::Vectorize {
                            out.push(VectorLoop::analyze(k, *var, body));
                        }
                        walk(k, body, out);
                    }
                    Stmt::If { then, .. } => walk(k, then, out),
                    _ => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(k, &k.body, &mut out);
        out
    }

    #[test]
    fn matmul_reductions_and_elementwise_loops_vectorize() {
        // The k loops of the register tile: 16 sums of unit-stride products.
        let k = matmul(64, 16, ElemType::F32, SeqMode::Dynamic);
        let p = plans(&k);
        assert!(!p.is_empty() && p.iter().all(Option::is_some), "{p:?}");
        assert!(p.iter().flatten().any(|v| v.reductions.len() == 16));
        // A plain elementwise map vectorizes; one needing integer lane math (the
        // polynomial exp's exponent bits) stays scalar.
        assert!(plans(&unary(Unary::Neg, 17, SeqMode::Dynamic)).iter().all(Option::is_some));
        assert!(plans(&unary(Unary::Exp, 17, SeqMode::Dynamic)).iter().all(Option::is_none));
    }

    #[test]
    fn a_sum_read_inside_its_loop_or_a_strided_store_is_not_vectorized() {
        let mut b = KernelBuilder::new();
        let x = b.param("x", ElemType::F32, false);
        let out = b.param("out", ElemType::F32, true);
        let (t, lane, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
        use maxc_kernels::ir::dsl::*;
        let prefix = vec![set(acc, add(v(acc), ld(x, v(lane)))), store(out, v(lane), v(acc))];
        let strided = vec![store(out, mul(v(lane), i(2)), ld(x, v(lane)))];
        let k = b.finish("t".into(), "test", TaskCount { per_seq: 0, fixed: 1 }, t, vec![]);
        assert_eq!(VectorLoop::analyze(&k, lane, &prefix), None, "a running sum stored every step is a scan");
        assert_eq!(VectorLoop::analyze(&k, lane, &strided), None);
    }
}
