//! Lowering of kernel IR to Cranelift IR: one exhaustive `match` per IR enum (no
//! `_ =>` arm), so a new kernel-IR op does not compile until this backend handles it.
//! Scalars are Cranelift variables (SSA is built by the frontend); loops are
//! header / body / exit blocks; libm supplies tanh, sin, cos and exp.

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
                Stmt::Store { param, index, value } => {
                    let v = self.expr(value)?;
                    let addr = self.address(*param, index)?;
                    let flags = MemFlagsData::trusted();
                    match self.kernel.buffer(*param).expect("validated").elem {
                        ElemType::F32 => {
                            self.b.ins().store(flags, v, addr, 0);
                        }
                        ElemType::I32 => {
                            self.b.ins().istore32(flags, v, addr, 0);
                        }
                        ElemType::BF16 | ElemType::F16 | ElemType::I8 | ElemType::U8 => {
                            unreachable!("weight-only parameters are never stored (validated)")
                        }
                    }
                }
                Stmt::For { var, start, end, body, hint: _ } => {
                    let (lo, hi) = (self.expr(start)?, self.expr(end)?);
                    self.lower_loop(*var, lo, hi, body)?;
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

    fn address(&mut self, param: u32, index: &Expr) -> Result<Value, CodegenError> {
        let idx = self.expr(index)?;
        let size = self.kernel.buffer(param).expect("validated").elem.size() as i64;
        let offset = self.b.ins().imul_imm_s(idx, size);
        let base = if param >= LOCAL_BASE { self.locals[(param - LOCAL_BASE) as usize] } else { self.params[param as usize] };
        Ok(self.b.ins().iadd(base, offset))
    }

    fn call_libm(&mut self, name: &'static str, x: Value) -> Result<Value, CodegenError> {
        let id = self.libm.get(self.module, name)?;
        let f = self.module.declare_func_in_func(id, self.b.func);
        let call = self.b.ins().call(f, &[x]);
        Ok(self.b.inst_results(call)[0])
    }

    /// IEEE half bits (in an i32) to f32, subnormals and specials included.
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
            Expr::Load { param, index } => {
                let addr = self.address(*param, index)?;
                let flags = MemFlagsData::trusted();
                match self.kernel.buffer(*param).expect("validated").elem {
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
                }
            }
            Expr::Select(c, x, y) => {
                let c = self.expr(c)?;
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                self.b.ins().select(c, x, y)
            }
        })
    }
}
