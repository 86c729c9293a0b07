//! Lowering of kernel IR to LLVM IR: one exhaustive `match` per IR enum, shared
//! by the CPU and the NVPTX (GPU) backends. Only three things differ between the
//! two ([`Flavor`]): the function's attributes and calling convention, where the
//! task index comes from (a loop over `task_begin..task_end` on the CPU, one GPU
//! thread per task from `ctaid * ntid + tid` on NVPTX), and the transcendental
//! functions (libm / LLVM intrinsics on the CPU; PTX `ex2` / `sin` / `cos.approx`
//! with range reduction on the GPU, which has no libm).
//!
//! Scalars live in stack slots (`alloca`) that `mem2reg` promotes; loops become
//! header / body / latch blocks. Float arithmetic carries the `reassoc`,
//! `contract` and `nsz` fast-math flags (FMA formation and vectorized reductions)
//! but not `nnan` / `ninf`: attention relies on `exp(-huge) == 0`.

use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::targets::TargetMachine;
use inkwell::types::BasicTypeEnum;
use inkwell::values::{BasicValue, BasicValueEnum, FastMathFlags, FunctionValue, InstructionValue, MetadataValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use maxc_kernels::ir::*;

use crate::{CodegenError, CpuTarget};

fn llvm_err(e: impl std::fmt::Display) -> CodegenError {
    CodegenError::Llvm(e.to_string())
}

/// What the emitter produces code for.
#[derive(Copy, Clone, Debug)]
pub enum Flavor<'t> {
    /// x86-64 or aarch64: the kernel runs a loop over its task range.
    Cpu(&'t CpuTarget),
    /// NVPTX: the kernel is a `ptx_kernel`; each GPU thread runs one task.
    Nvptx,
}

/// How a CPU target computes four-byte dot products (unsigned bytes times signed
/// bytes, each i32 lane the sum of four products), the core of the int8 matmuls.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum ByteDots {
    /// VNNI `vpdpbusd`, exact for any unsigned byte: one instruction on zmm
    /// (AVX-512 VNNI) or two on ymm halves (AVX-VNNI, Intel's cores without
    /// AVX-512 since Alder Lake).
    Vnni { zmm: bool },
    /// `vpmaddubsw` then `vpmaddwd` by ones, on zmm (AVX-512BW) or two ymm halves
    /// (AVX2), as llama.cpp does without VNNI: pairs of products are summed in
    /// i16 with saturation, so the unsigned bytes must stay at most 128.
    Madd { zmm: bool },
    /// aarch64 (NEON), signed bytes by signed bytes on 128-bit parts: with
    /// FEAT_DotProd one `sdot` per 16 bytes, without it `smull` / `smull2`
    /// (byte products in i16), `saddlp` (pairs in i32) and `addp` (fours), as
    /// llama.cpp does on such cores. The levels that are unsigned elsewhere go
    /// in as they are where they are below 128 (nibbles), and Q8_0's as its
    /// signed `w` (the -128 minimum folded, as on the `Madd` form). No `usdot`
    /// (unsigned by signed) without i8mm, which not every dotprod core has.
    Arm { sdot: bool },
    /// Widened i32 multiplies (x86-64 without AVX2, and the GPU).
    Widened,
}

/// How the weight bytes of a four-byte dot read (see [`KernelLowering::dot_fours`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum WeightBytes {
    /// Signed (Q8_0's `w`): `sdot` takes them; x86 moves their sign first.
    Signed,
    /// Unsigned, any value (Q8_0's stored levels `w + 128`): `vpdpbusd`.
    Unsigned,
    /// Unsigned and below 128 (nibbles): both readings agree, so every
    /// instruction takes them.
    Small,
}

/// The PTX kernel calling convention (LLVM's `CallingConv::PTX_Kernel`).
const PTX_KERNEL_CC: u32 = 71;

/// Lowers every kernel into one module and optimizes it.
pub fn lower_module<'ctx>(
    context: &'ctx Context,
    kernels: &[Kernel],
    flavor: Flavor<'_>,
    tm: &TargetMachine,
) -> Result<Module<'ctx>, CodegenError> {
    let module = context.create_module("maxc_kernels");
    module.set_triple(&tm.get_triple());
    module.set_data_layout(&tm.get_target_data().get_data_layout());
    for k in kernels {
        KernelLowering::new(context, &module, k, flavor)?.lower()?;
    }
    module.verify().map_err(|e| CodegenError::Llvm(format!("invalid module: {e}")))?;
    super::optimize(&module, tm)?;
    Ok(module)
}

struct KernelLowering<'a, 'ctx> {
    context: &'ctx Context,
    module: &'a Module<'ctx>,
    builder: Builder<'ctx>,
    kernel: &'a Kernel,
    flavor: Flavor<'a>,
    function: FunctionValue<'ctx>,
    params: Vec<PointerValue<'ctx>>,
    /// Stack arrays for the kernel's locals.
    locals: Vec<PointerValue<'ctx>>,
    slots: Vec<PointerValue<'ctx>>,
    seq: Option<BasicValueEnum<'ctx>>,
    /// NVPTX: how each loop (in pre-order) runs on the task's threads, and this
    /// thread's lane among them (`maxc_kernels::warp`).
    warp: maxc_kernels::warp::GpuMapping,
    lane: Option<inkwell::values::IntValue<'ctx>>,
    /// Inside copy `u` of a vector chunk of the loop over this variable: global
    /// accesses at `var + offset` are `VECTOR`-aligned when `u` is 0.
    chunk_copy: Option<(VarId, i64)>,
    /// NVPTX with four warps per task: the shared array the warps' partial
    /// reductions meet in.
    shared: Option<PointerValue<'ctx>>,
    /// Loops lowered so far (the pre-order index of the next one).
    loops_seen: usize,
    /// Per parameter: its alias scope list and the list of every other
    /// parameter's scope (`!alias.scope`, `!noalias`), see [`Self::tag_alias`].
    alias: Vec<(MetadataValue<'ctx>, MetadataValue<'ctx>)>,
}

/// One alias scope per kernel parameter, in one domain per kernel: the lists
/// [`KernelLowering::tag_alias`] attaches.
fn alias_scopes<'ctx>(context: &'ctx Context, kernel: &Kernel) -> Vec<(MetadataValue<'ctx>, MetadataValue<'ctx>)> {
    let domain = context.metadata_node(&[context.metadata_string(&format!("maxc {} parameters", kernel.name)).into()]);
    let scopes: Vec<MetadataValue<'ctx>> = (0..kernel.params.len())
        .map(|p| context.metadata_node(&[context.metadata_string(&format!("maxc {} parameter {p}", kernel.name)).into(), domain.into()]))
        .collect();
    (0..scopes.len())
        .map(|p| {
            let others: Vec<_> = scopes.iter().enumerate().filter(|&(q, _)| q != p).map(|(_, s)| (*s).into()).collect();
            (context.metadata_node(&[scopes[p].into()]), context.metadata_node(&others))
        })
        .collect()
}

impl<'a, 'ctx> KernelLowering<'a, 'ctx> {
    fn new(context: &'ctx Context, module: &'a Module<'ctx>, kernel: &'a Kernel, flavor: Flavor<'a>) -> Result<Self, CodegenError> {
        let ptr = context.ptr_type(AddressSpace::default());
        let i64t = context.i64_type();
        let fn_type = context.void_type().fn_type(&[ptr.into(), ptr.into(), i64t.into(), i64t.into()], false);
        let function = module.add_function(&kernel.name, fn_type, Some(Linkage::External));
        let attr = |k: &str, v: &str| context.create_string_attribute(k, v);
        use inkwell::attributes::AttributeLoc;
        match flavor {
            Flavor::Cpu(target) if target.has_avx512() => function.add_attribute(AttributeLoc::Function, attr("prefer-vector-width", "512")),
            Flavor::Cpu(_) => {}
            Flavor::Nvptx => function.set_call_conventions(PTX_KERNEL_CC),
        }
        // An x86-64 level names an ISA, not a microarchitecture: schedule for
        // LLVM's `generic` x86-64 model, as clang does for `-march=x86-64-v4`
        // without `-mtune`. LLVM would otherwise tune `x86-64-v4` for its
        // Skylake-SP model: SmolLM2's x86-64-v4+avx512vnni artifact decoded
        // 2.5-7.8% and prefilled 0.8-1.7% faster tuned generic (4 alternating
        // `maxrun bench --compare` runs, Intel Xeon VM; docs/portable.md).
        // `cpu` (this machine) keeps its own tuning.
        if let Flavor::Cpu(target) = flavor {
            if target.cpu.starts_with("x86-64") {
                function.add_attribute(AttributeLoc::Function, attr("tune-cpu", "generic"));
            }
        }
        let nounwind = context.create_enum_attribute(inkwell::attributes::Attribute::get_named_enum_kind_id("nounwind"), 0);
        function.add_attribute(AttributeLoc::Function, nounwind);
        let warp = match flavor {
            Flavor::Nvptx => maxc_kernels::warp::gpu_mapping(kernel),
            Flavor::Cpu(_) => maxc_kernels::warp::GpuMapping { threads: 1, loops: vec![] },
        };
        Ok(KernelLowering {
            alias: alias_scopes(context, kernel),
            context,
            module,
            builder: context.create_builder(),
            kernel,
            flavor,
            function,
            params: vec![],
            locals: vec![],
            slots: vec![],
            seq: None,
            warp,
            lane: None,
            chunk_copy: None,
            shared: None,
            loops_seen: 0,
        })
    }

    fn ty(&self, t: ValType) -> BasicTypeEnum<'ctx> {
        match t {
            ValType::F32 => self.context.f32_type().into(),
            ValType::I64 => self.context.i64_type().into(),
            ValType::Bool => self.context.bool_type().into(),
        }
    }

    fn elem(&self, e: ElemType) -> BasicTypeEnum<'ctx> {
        match e {
            ElemType::F32 => self.context.f32_type().into(),
            ElemType::I32 => self.context.i32_type().into(),
            ElemType::BF16 => self.context.i16_type().into(),
            ElemType::F16 => self.context.f16_type().into(),
            ElemType::I8 | ElemType::U8 => self.context.i8_type().into(),
        }
    }

    fn lower(mut self) -> Result<(), CodegenError> {
        let b = &self.builder;
        let entry = self.context.append_basic_block(self.function, "entry");
        b.position_at_end(entry);
        let ptr = self.context.ptr_type(AddressSpace::default());
        let i64t = self.context.i64_type();
        let args = self.function.get_nth_param(0).unwrap().into_pointer_value();
        let dims = self.function.get_nth_param(1).unwrap().into_pointer_value();
        for i in 0..self.kernel.params.len() {
            // SAFETY: `args` holds one pointer per parameter (the ABI).
            let slot = unsafe { b.build_in_bounds_gep(ptr, args, &[i64t.const_int(i as u64, false)], "argp") }.map_err(llvm_err)?;
            // On the GPU every buffer is device (global) memory: loading the pointer
            // as one in the global address space makes the accesses `ld.global` /
            // `st.global` rather than generic ones.
            let space = match self.flavor {
                Flavor::Nvptx => AddressSpace::from(1u16),
                Flavor::Cpu(_) => AddressSpace::default(),
            };
            let p = b.build_load(self.context.ptr_type(space), slot, &self.kernel.params[i].name).map_err(llvm_err)?.into_pointer_value();
            self.params.push(p);
        }
        self.seq = Some(b.build_load(i64t, dims, "seq").map_err(llvm_err)?);
        for (i, &len) in self.kernel.locals.iter().enumerate() {
            let array = self.context.f32_type().array_type(len as u32);
            let slot = b.build_alloca(array, &format!("local{i}")).map_err(llvm_err)?;
            slot.as_instruction().expect("alloca is an instruction").set_alignment(64).map_err(llvm_err)?;
            self.locals.push(slot);
        }
        for (i, t) in self.kernel.vars.iter().enumerate() {
            let slot = b.build_alloca(self.ty(*t), &format!("v{i}")).map_err(llvm_err)?;
            self.slots.push(slot);
        }
        let begin = self.function.get_nth_param(2).unwrap().into_int_value();
        let end = self.function.get_nth_param(3).unwrap().into_int_value();
        match self.flavor {
            Flavor::Cpu(_) => {
                let task_loop =
                    Stmt::For { var: self.kernel.task_var, start: Expr::I64(0), end: Expr::I64(0), hint: LoopHint::Serial, body: self.kernel.body.clone() };
                self.lower_loop(&task_loop, Some((begin, end)))?;
            }
            Flavor::Nvptx => {
                let per_task = self.warp.threads as u64;
                if per_task > maxc_kernels::warp::WARP as u64 {
                    // One f32 per warp for the cross-warp step of reductions.
                    let warps = (per_task / maxc_kernels::warp::WARP as u64) as u32;
                    let array = self.context.f32_type().array_type(warps);
                    let g = self.module.add_global(array, Some(AddressSpace::from(3u16)), &format!("{}_partials", self.kernel.name));
                    g.set_linkage(Linkage::Internal);
                    g.set_initializer(&array.get_undef());
                    g.set_alignment(16);
                    self.shared = Some(g.as_pointer_value());
                }
                // T threads per task (1, a warp, or a block of four warps): task =
                // task_begin + (ctaid.x * ntid.x + tid.x) / T, lane = tid.x % T (blocks
                // hold whole tasks); threads past the end return.
                let sreg = |name: &str| -> Result<inkwell::values::IntValue<'ctx>, CodegenError> {
                    let i32t = self.context.i32_type();
                    let f = self.declared(name, i32t.fn_type(&[], false), None);
                    let call = self.builder.build_call(f, &[], "sreg").map_err(llvm_err)?;
                    let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else { unreachable!("special registers return i32") };
                    let v = v.into_int_value();
                    self.builder.build_int_z_extend(v, i64t, "sreg64").map_err(llvm_err)
                };
                let (block, width, thread) =
                    (sreg("llvm.nvvm.read.ptx.sreg.ctaid.x")?, sreg("llvm.nvvm.read.ptx.sreg.ntid.x")?, sreg("llvm.nvvm.read.ptx.sreg.tid.x")?);
                let b = &self.builder;
                let global = b.build_int_nuw_add(b.build_int_nuw_mul(block, width, "base").map_err(llvm_err)?, thread, "global").map_err(llvm_err)?;
                let width = i64t.const_int(per_task, false);
                let index = b.build_int_unsigned_div(global, width, "warp").map_err(llvm_err)?;
                if per_task > 1 {
                    self.lane = Some(b.build_int_unsigned_rem(thread, width, "lane").map_err(llvm_err)?);
                }
                let task = b.build_int_nuw_add(begin, index, "task").map_err(llvm_err)?;
                let inside = b.build_int_compare(IntPredicate::ULT, task, end, "inside").map_err(llvm_err)?;
                let run = self.context.append_basic_block(self.function, "run");
                let done = self.context.append_basic_block(self.function, "done");
                b.build_conditional_branch(inside, run, done).map_err(llvm_err)?;
                b.position_at_end(run);
                b.build_store(self.slots[self.kernel.task_var as usize], task).map_err(llvm_err)?;
                self.block(&self.kernel.body.clone())?;
                self.builder.build_unconditional_branch(done).map_err(llvm_err)?;
                self.builder.position_at_end(done);
            }
        }
        self.builder.build_return(None).map_err(llvm_err)?;
        Ok(())
    }

    /// The module's declaration of function `name` of type `ty`, added on first use
    /// (NVVM and x86 intrinsics, libm).
    fn declared(&self, name: &str, ty: inkwell::types::FunctionType<'ctx>, linkage: Option<Linkage>) -> FunctionValue<'ctx> {
        self.module.get_function(name).unwrap_or_else(|| self.module.add_function(name, ty, linkage))
    }

    /// An NVVM intrinsic taking and returning f32 (`llvm.nvvm.ex2.approx.f`, ...).
    fn nvvm(&self, name: &str, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let f32t = self.context.f32_type();
        let f = self.declared(name, f32t.fn_type(&[f32t.into()], false), None);
        let call = self.builder.build_call(f, &[x.into()], "nvvm").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else { unreachable!("nvvm math returns f32") };
        Ok(v)
    }

    /// A fast f32 operation on two values (for the GPU math expansions).
    fn fop(&self, op: BinOp, x: BasicValueEnum<'ctx>, y: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let (x, y) = (x.into_float_value(), y.into_float_value());
        let b = &self.builder;
        let v: BasicValueEnum = match op {
            BinOp::Add => b.build_float_add(x, y, "fadd").map_err(llvm_err)?.into(),
            BinOp::Sub => b.build_float_sub(x, y, "fsub").map_err(llvm_err)?.into(),
            BinOp::Mul => b.build_float_mul(x, y, "fmul").map_err(llvm_err)?.into(),
            BinOp::Div => b.build_float_div(x, y, "fdiv").map_err(llvm_err)?.into(),
            _ => unreachable!("the GPU math expansions use + - * / only"),
        };
        Ok(self.fast(v))
    }

    fn f32c(&self, x: f32) -> BasicValueEnum<'ctx> {
        self.context.f32_type().const_float(x as f64).into()
    }

    /// `exp(x)`: `2^(x log2 e)` with PTX `ex2.approx` (relative error about 2^-22).
    fn gpu_exp(&self, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let scaled = self.fop(BinOp::Mul, x, self.f32c(std::f32::consts::LOG2_E))?;
        self.nvvm("llvm.nvvm.ex2.approx.f", scaled)
    }

    /// `sin` / `cos` with the argument reduced to [-pi, pi] first: PTX `sin.approx`
    /// is accurate there (about 2^-21) and loses accuracy beyond; RoPE angles reach
    /// thousands of radians.
    fn gpu_trig(&self, name: &str, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        use std::f32::consts::TAU;
        let turns = self.fop(BinOp::Mul, x, self.f32c(1.0 / TAU))?;
        let rounded = self.intrinsic("llvm.rint", &[turns])?;
        let reduced = self.fop(BinOp::Sub, x, self.fop(BinOp::Mul, rounded, self.f32c(TAU))?)?;
        self.nvvm(name, reduced)
    }

    /// `tanh(x) = sign(x) (1 - e) / (1 + e)` with `e = exp(-2 |x|)` (no overflow).
    fn gpu_tanh(&self, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let ax = self.intrinsic("llvm.fabs", &[x])?;
        let e = self.gpu_exp(self.fop(BinOp::Mul, ax, self.f32c(-2.0))?)?;
        let t = self.fop(BinOp::Div, self.fop(BinOp::Sub, self.f32c(1.0), e)?, self.fop(BinOp::Add, self.f32c(1.0), e)?)?;
        self.intrinsic("llvm.copysign", &[t, x])
    }

    fn block(&mut self, stmts: &[Stmt]) -> Result<(), CodegenError> {
        for s in stmts {
            self.stmt(s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), CodegenError> {
        match s {
            Stmt::Set { var, value } => {
                let v = self.expr(value)?;
                self.builder.build_store(self.slots[*var as usize], v).map_err(llvm_err)?;
            }
            Stmt::Store { param, index, value } => {
                let elem = self.kernel.buffer(*param).expect("validated").elem;
                let v = self.expr(value)?;
                let v: BasicValueEnum = match elem {
                    ElemType::F32 => v,
                    ElemType::I32 | ElemType::I8 => self.builder.build_int_truncate(v.into_int_value(), self.elem(elem).into_int_type(), "trunc").map_err(llvm_err)?.into(),
                    // Round to nearest even: vcvtps2ph with F16C, cvt.rn.f16.f32 on NVPTX.
                    ElemType::F16 => self.builder.build_float_trunc(v.into_float_value(), self.context.f16_type(), "fptrunc").map_err(llvm_err)?.into(),
                    ElemType::BF16 | ElemType::U8 => unreachable!("weight-only parameters are never stored (validated)"),
                };
                let p = self.element_ptr(*param, index)?;
                let st = self.builder.build_store(p, v).map_err(llvm_err)?;
                self.mark_alignment(Some(st), *param, index)?;
            }
            Stmt::For { .. } => self.lower_loop(s, None)?,
            Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => self.dot_block(*acc, scales, (*weights, w_start), *form, (*act, act_start))?,
            Stmt::DotRows(d) => self.dot_rows(d)?,
            Stmt::Prefetch { param, index } => {
                if let Flavor::Cpu(_) = self.flavor {
                    let idx = self.expr(index)?.into_int_value();
                    let (elem, base) = self.buffer_base(*param);
                    // SAFETY: a plain (not inbounds) GEP; the pointer is only prefetched.
                    let at = unsafe { self.builder.build_gep(elem, base, &[idx], "prefetch_at") }.map_err(llvm_err)?;
                    self.prefetch(at, 0)?;
                }
            }
            Stmt::If { cond, then } => {
                let c = self.expr(cond)?.into_int_value();
                let then_bb = self.context.append_basic_block(self.function, "then");
                let done = self.context.append_basic_block(self.function, "endif");
                self.builder.build_conditional_branch(c, then_bb, done).map_err(llvm_err)?;
                self.builder.position_at_end(then_bb);
                self.block(then)?;
                self.builder.build_unconditional_branch(done).map_err(llvm_err)?;
                self.builder.position_at_end(done);
            }
        }
        Ok(())
    }

    /// Lowers a `For` (bounds evaluated once, before the loop); `bounds` overrides them.
    fn lower_loop(&mut self, s: &Stmt, bounds: Option<(inkwell::values::IntValue<'ctx>, inkwell::values::IntValue<'ctx>)>) -> Result<(), CodegenError> {
        let Stmt::For { var, start, end, body, .. } = s else { unreachable!("lower_loop takes loops") };
        let (lo, hi) = match bounds {
            Some(b) => b,
            None => (self.expr(start)?.into_int_value(), self.expr(end)?.into_int_value()),
        };
        let slot = self.slots[*var as usize];
        let i64t = self.context.i64_type();
        // On the GPU, a loop dealt to lanes is lowered by `lower_lane_loop`.
        let mapping = match bounds {
            None if matches!(self.flavor, Flavor::Nvptx) => self.warp.loops.get(self.loops_seen).cloned(),
            _ => None,
        };
        if bounds.is_none() {
            self.loops_seen += 1;
        }
        if let Some(maxc_kernels::warp::LoopMapping::Lanes { reductions, stores, chunk }) = mapping {
            return self.lower_lane_loop(s, (lo, hi), &reductions, stores, chunk);
        }
        self.builder.build_store(slot, lo).map_err(llvm_err)?;
        let header = self.context.append_basic_block(self.function, "loop");
        let body_bb = self.context.append_basic_block(self.function, "body");
        let exit = self.context.append_basic_block(self.function, "exit");
        self.builder.build_unconditional_branch(header).map_err(llvm_err)?;
        self.builder.position_at_end(header);
        let i = self.builder.build_load(i64t, slot, "i").map_err(llvm_err)?.into_int_value();
        let c = self.builder.build_int_compare(IntPredicate::SLT, i, hi, "cond").map_err(llvm_err)?;
        self.builder.build_conditional_branch(c, body_bb, exit).map_err(llvm_err)?;
        self.builder.position_at_end(body_bb);
        self.block(body)?;
        let i = self.builder.build_load(i64t, slot, "i").map_err(llvm_err)?.into_int_value();
        let next = self.builder.build_int_nsw_add(i, i64t.const_int(1, false), "next").map_err(llvm_err)?;
        self.builder.build_store(slot, next).map_err(llvm_err)?;
        let latch = self.builder.build_unconditional_branch(header).map_err(llvm_err)?;
        // A loop that holds a loop hinted `Vectorize` is not vectorized itself:
        // LLVM would otherwise unroll the inner (lane) loop away first and then
        // vectorize the outer one with gathers.
        let Stmt::For { hint, .. } = s else { unreachable!() };
        if *hint == LoopHint::Serial && body.iter().any(|b| matches!(b, Stmt::For { hint: LoopHint::Vectorize, .. })) {
            self.forbid_vectorization(latch);
        }
        // Half conversions (fp8 panels, f16 weights, an f16 KV cache): LLVM 19's
        // cost model prices a vector `fpext half` above its `vcvtph2ps` and picks
        // 4 lanes, with the rest of the loop on xmm quarters (fp8 panels: a third
        // of the speed; f16 KV cache attention: prefill at depth 0.8x the f32
        // cache's); ask for 16 lanes, a panel's width (the integer work in one
        // ymm; two f32 ymm on AVX2, one zmm on AVX-512).
        if let (LoopHint::Vectorize, Flavor::Cpu(target)) = (*hint, self.flavor) {
            if target.has_feature("f16c") && converts_halves(self.kernel, body) {
                self.vectorize_width(latch, 16);
            }
        }
        self.builder.position_at_end(exit);
        Ok(())
    }

    /// A loop dealt to the task's lanes (`maxc_kernels::warp`): lane `l` runs chunks
    /// `l, l + T, ...` of `chunk` consecutive iterations (the chunk's body emitted
    /// `chunk` times, its first global accesses marked 16-byte aligned so that they
    /// become vector loads), then leftover iteration `l` if any; each lane has its
    /// own partial of the reductions, combined across the task afterwards.
    fn lower_lane_loop(
        &mut self,
        s: &Stmt,
        (lo, hi): (inkwell::values::IntValue<'ctx>, inkwell::values::IntValue<'ctx>),
        reductions: &[(VarId, BinOp)],
        stores: bool,
        chunk: i64,
    ) -> Result<(), CodegenError> {
        let Stmt::For { var, body, .. } = s else { unreachable!("lower_lane_loop takes loops") };
        let lane = self.lane.expect("a kernel with lane loops has more than one thread per task");
        let i64t = self.context.i64_type();
        let f32t = self.context.f32_type();
        let mut before = Vec::new();
        for &(r, op) in reductions {
            before.push(self.builder.build_load(f32t, self.slots[r as usize], "before").map_err(llvm_err)?.into_float_value());
            self.builder.build_store(self.slots[r as usize], f32t.const_float(maxc_kernels::warp::identity(op) as f64)).map_err(llvm_err)?;
        }
        let b = &self.builder;
        let chunk_c = i64t.const_int(chunk as u64, false);
        let len = b.build_int_nsw_sub(hi, lo, "len").map_err(llvm_err)?;
        let whole = b.build_int_signed_div(len, chunk_c, "whole").map_err(llvm_err)?;
        let counter = self.entry_alloca(i64t.into(), "chunk")?;
        let b = &self.builder;
        b.build_store(counter, lane).map_err(llvm_err)?;
        let header = self.context.append_basic_block(self.function, "lanes");
        let body_bb = self.context.append_basic_block(self.function, "lanes_body");
        let tail = self.context.append_basic_block(self.function, "lanes_tail");
        let exit = self.context.append_basic_block(self.function, "lanes_exit");
        b.build_unconditional_branch(header).map_err(llvm_err)?;
        b.position_at_end(header);
        let c = b.build_load(i64t, counter, "c").map_err(llvm_err)?.into_int_value();
        let more = b.build_int_compare(IntPredicate::SLT, c, whole, "more").map_err(llvm_err)?;
        b.build_conditional_branch(more, body_bb, tail).map_err(llvm_err)?;
        b.position_at_end(body_bb);
        let first = b.build_int_nsw_add(lo, b.build_int_nsw_mul(c, chunk_c, "offset").map_err(llvm_err)?, "first").map_err(llvm_err)?;
        for u in 0..chunk {
            let it = self.builder.build_int_nsw_add(first, i64t.const_int(u as u64, false), "it").map_err(llvm_err)?;
            self.builder.build_store(self.slots[*var as usize], it).map_err(llvm_err)?;
            self.chunk_copy = (chunk > 1).then_some((*var, u));
            self.block(body)?;
            self.chunk_copy = None;
        }
        let b = &self.builder;
        let next = b.build_int_nsw_add(c, i64t.const_int(self.warp.threads as u64, false), "next").map_err(llvm_err)?;
        b.build_store(counter, next).map_err(llvm_err)?;
        b.build_unconditional_branch(header).map_err(llvm_err)?;
        b.position_at_end(tail);
        if chunk > 1 {
            // The `len % chunk` leftover iterations: one each for the first lanes.
            let left = b.build_int_signed_rem(len, chunk_c, "left").map_err(llvm_err)?;
            let mine = b.build_int_compare(IntPredicate::SLT, lane, left, "mine").map_err(llvm_err)?;
            let leftover = self.context.append_basic_block(self.function, "lanes_leftover");
            b.build_conditional_branch(mine, leftover, exit).map_err(llvm_err)?;
            b.position_at_end(leftover);
            let it = b.build_int_nsw_add(lo, b.build_int_nsw_add(b.build_int_nsw_mul(whole, chunk_c, "done").map_err(llvm_err)?, lane, "at").map_err(llvm_err)?, "it").map_err(llvm_err)?;
            b.build_store(self.slots[*var as usize], it).map_err(llvm_err)?;
            self.block(body)?;
        }
        self.builder.build_unconditional_branch(exit).map_err(llvm_err)?;
        self.builder.position_at_end(exit);
        for (&(r, op), before) in reductions.iter().zip(before) {
            let total = self.task_reduce(r, op)?;
            let joined = self.float_op(op, before, total)?;
            self.builder.build_store(self.slots[r as usize], joined).map_err(llvm_err)?;
        }
        if stores {
            // What one lane stored is read by others after the loop.
            self.task_barrier()?;
        }
        Ok(())
    }

    /// A [`Stmt::DotBlock`] as vector code: the 64 weight levels and activations as
    /// `<64 x i8>`, the 16 four-byte dot products by [`ByteDots`] (Q8_0's signed
    /// weights through `|w|` and `a * sign(w)` where the instructions multiply
    /// unsigned by signed bytes; activations are never -128); then converted,
    /// scaled per block and added to the f32 accumulator.
    fn dot_block(&mut self, acc: u32, scales: &[Expr; 2], (weights, w_start): (u32, &Expr), form: DotForm, (act, act_start): (u32, &Expr)) -> Result<(), CodegenError> {
        let (i8t, i32t, f32t) = (self.context.i8_type(), self.context.i32_type(), self.context.f32_type());
        let lanes = DOT_LANES as u32;
        let values = DOT_VALUES as u32;
        let scale_a = self.expr(&scales[0])?.into_float_value();
        let scale_b = self.expr(&scales[1])?.into_float_value();
        let w_ptr = self.element_ptr(weights, w_start)?;
        let a_ptr = self.element_ptr(act, act_start)?;
        let w = match form {
            DotForm::Int8 => self.byte_load(i8t.vec_type(values), w_ptr)?,
            DotForm::NibblePairs => {
                let (low, high) = self.nibbles(self.byte_load(i8t.vec_type(values / 2), w_ptr)?)?;
                self.builder.build_shuffle_vector(low, high, shuffle_mask(self.context, &|i| i, values), "levels").map_err(llvm_err)?
            }
        };
        let a = self.byte_load(i8t.vec_type(values), a_ptr)?;
        let zero = i32t.vec_type(lanes).const_zero();
        let sums = match form {
            DotForm::Int8 if matches!(self.byte_dots(), ByteDots::Vnni { .. } | ByteDots::Madd { .. }) => {
                let (abs, signed) = self.sign_moved(w, a)?;
                self.dot_fours(zero, abs, signed, WeightBytes::Unsigned)?
            }
            DotForm::Int8 => self.dot_fours(zero, w, a, WeightBytes::Signed)?,
            DotForm::NibblePairs => self.dot_fours(zero, w, a, WeightBytes::Small)?,
        };
        let b = &self.builder;
        let sums = b.build_signed_int_to_float(sums, f32t.vec_type(lanes), "sums").map_err(llvm_err)?;
        let pair = f32t.vec_type(2).get_undef();
        let pair = b.build_insert_element(pair, scale_a, i32t.const_zero(), "scale_a").map_err(llvm_err)?;
        let pair = b.build_insert_element(pair, scale_b, i32t.const_int(1, false), "scale_b").map_err(llvm_err)?;
        let scale = b.build_shuffle_vector(pair, pair, shuffle_mask(self.context, &|g| form.block_of_lane(g as i64) as u32, lanes), "scales").map_err(llvm_err)?;
        // Without fast-math flags, as in `dot_rows`: a row's sum must not
        // depend on how the rows beside it let LLVM contract or reorder it.
        let scaled = b.build_float_mul(sums, scale, "scaled").map_err(llvm_err)?;
        let old = self.load_local(acc, scaled.get_type())?;
        let new = self.builder.build_float_add(old, scaled, "acc").map_err(llvm_err)?;
        self.store_local(acc, new)
    }

    /// How this target computes four-byte dot products.
    fn byte_dots(&self) -> ByteDots {
        match self.flavor {
            Flavor::Cpu(t) if t.has_avx512_vnni() => ByteDots::Vnni { zmm: true },
            Flavor::Cpu(t) if t.has_avx_vnni() => ByteDots::Vnni { zmm: false },
            Flavor::Cpu(t) if t.has_avx512_bw() => ByteDots::Madd { zmm: true },
            Flavor::Cpu(t) if t.has_avx2() => ByteDots::Madd { zmm: false },
            Flavor::Cpu(t) if t.is_aarch64() => ByteDots::Arm { sdot: t.has_dotprod() },
            _ => ByteDots::Widened,
        }
    }

    /// Signed weight bytes `w` and signed activations `a` as `(|w|, a * sign(w))`:
    /// the same products, with the weights unsigned (at most 128) as `vpdpbusd`
    /// and `vpmaddubsw` want them. Exact while no activation is -128 (quantized
    /// activations never are).
    ///
    /// On AVX2 (`ByteDots::Madd` on ymm) `a * sign(w)` is one `vpsignb` per 32
    /// bytes; elsewhere (AVX-512 has no zmm `vpsignb`) a compare, a negation and
    /// a select, which LLVM makes three instructions.
    fn sign_moved(&self, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<(inkwell::values::VectorValue<'ctx>, inkwell::values::VectorValue<'ctx>), CodegenError> {
        let abs = self.intrinsic_typed("llvm.abs", &[w.into(), self.context.bool_type().const_zero().into()], &[w.get_type().into()])?.into_vector_value();
        if self.byte_dots() == (ByteDots::Madd { zmm: false }) && matches!(w.get_type().get_size(), 32 | 64) {
            let bytes = self.context.i8_type().vec_type(32);
            let f = self.declared("llvm.x86.avx2.psign.b", bytes.fn_type(&[bytes.into(), bytes.into()], false), None);
            let parts = self.lane_parts(&[a, w], 32)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
            return Ok((abs, self.joined(parts)?));
        }
        let b = &self.builder;
        let negative = b.build_int_compare(IntPredicate::SLT, w, w.get_type().const_zero(), "negative").map_err(llvm_err)?;
        let minus_a = b.build_int_neg(a, "minus_a").map_err(llvm_err)?;
        let signed = b.build_select(negative, minus_a, a, "signed").map_err(llvm_err)?.into_vector_value();
        Ok((abs, signed))
    }

    /// The low and high nibbles of a vector of bytes.
    fn nibbles(&self, packed: inkwell::values::VectorValue<'ctx>) -> Result<(inkwell::values::VectorValue<'ctx>, inkwell::values::VectorValue<'ctx>), CodegenError> {
        let i8t = self.context.i8_type();
        let splat = |x: u64| inkwell::types::VectorType::const_vector(&vec![i8t.const_int(x, false); packed.get_type().get_size() as usize]);
        let b = &self.builder;
        Ok((b.build_and(packed, splat(15), "low").map_err(llvm_err)?, b.build_right_shift(packed, splat(4), false, "high").map_err(llvm_err)?))
    }

    /// `acc` plus, per i32 lane `g`, the sum of the products of bytes `4g..4g + 4`
    /// of `w` (read as `w_bytes` says) with the signed bytes of `a`: by
    /// [`ByteDots`] where the instruction reads `w` that way (x86: unsigned, on
    /// the `Madd` form at most 128, so that no pair of products saturates;
    /// NEON: signed), otherwise widened multiplies and a sum of each lane's
    /// four products.
    fn dot_fours(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>, w_bytes: WeightBytes) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let full = w.get_type().get_size() == DOT_VALUES as u32;
        let unsigned = w_bytes != WeightBytes::Signed;
        match self.byte_dots() {
            ByteDots::Vnni { zmm } if unsigned && full => return self.vpdpbusd(acc, w, a, zmm),
            ByteDots::Madd { zmm } if unsigned && full => return self.pmadd_fours(acc, w, a, zmm),
            ByteDots::Arm { sdot } if w_bytes != WeightBytes::Unsigned && full => return if sdot { self.sdot(acc, w, a) } else { self.smull_fours(acc, w, a) },
            _ => {}
        }
        let wide = self.context.i32_type().vec_type(w.get_type().get_size());
        let b = &self.builder;
        let ww = if unsigned { b.build_int_z_extend(w, wide, "w32") } else { b.build_int_s_extend(w, wide, "w32") }.map_err(llvm_err)?;
        let aw = b.build_int_s_extend(a, wide, "a32").map_err(llvm_err)?;
        let products = b.build_int_mul(ww, aw, "products").map_err(llvm_err)?;
        let sums = self.sum_fours(products)?;
        self.builder.build_int_add(acc, sums, "acc").map_err(llvm_err)
    }

    /// `acc` plus the four-byte dot products of 64 unsigned bytes `u` (at most 128)
    /// with 64 signed bytes `s` without VNNI: [`Self::pair_products`] then
    /// [`Self::pair_sums`].
    fn pmadd_fours(&self, acc: inkwell::values::VectorValue<'ctx>, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let fours = self.pair_sums(self.pair_products(u, s, zmm)?, zmm)?;
        self.builder.build_int_add(acc, fours, "acc").map_err(llvm_err)
    }

    /// `vpmaddubsw` of 64 unsigned bytes `u` with 64 signed bytes `s` (on one zmm
    /// register or two ymm halves): `<32 x i16>`, lane `j` the products of bytes
    /// `2j` and `2j + 1` summed with signed saturation (exact while `u` is at
    /// most 128: 2 * 128 * 128 fits).
    fn pair_products(&self, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let name = if zmm { "llvm.x86.avx512.pmaddubs.w.512" } else { "llvm.x86.avx2.pmadd.ub.sw" };
        self.pairwise_in_parts(name, self.context.i8_type(), self.context.i16_type(), &[u, s], zmm)
    }

    /// An x86 instruction `name` that sums adjacent pairs of its inputs' lanes
    /// (elements `from`) into lanes of twice their width (elements `to`), on
    /// 512-bit parts of `args` (`zmm`) or 256-bit ones, the results laid end to end.
    fn pairwise_in_parts(&self, name: &str, from: inkwell::types::IntType<'ctx>, to: inkwell::types::IntType<'ctx>, args: &[inkwell::values::VectorValue<'ctx>], zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let width = (if zmm { 512 } else { 256 }) / from.get_bit_width();
        let (input, output) = (from.vec_type(width), to.vec_type(width / 2));
        let f = self.declared(name, output.fn_type(&vec![input.into(); args.len()], false), None);
        let parts = self.lane_parts(args, width)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// `vpmaddwd` of 32 i16 lanes by ones: 16 i32 lanes, lane `g` the sum of
    /// lanes `2g` and `2g + 1` (so, after [`Self::pair_products`], of the
    /// products of bytes `4g..4g + 4`).
    fn pair_sums(&self, pairs: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let ones = inkwell::types::VectorType::const_vector(&vec![self.context.i16_type().const_int(1, false); pairs.get_type().get_size() as usize]);
        self.word_pair_products(pairs, ones, zmm)
    }

    /// The vectors `of` cut into parts of `width` lanes, part by part (one part
    /// when they are that wide already).
    fn lane_parts(&self, of: &[inkwell::values::VectorValue<'ctx>], width: u32) -> Result<Vec<Vec<inkwell::values::VectorValue<'ctx>>>, CodegenError> {
        let size = of[0].get_type().get_size();
        (0..size / width)
            .map(|h| {
                of.iter()
                    .map(|&v| if size == width { Ok(v) } else { self.builder.build_shuffle_vector(v, v, shuffle_mask(self.context, &|i| h * width + i, width), "part").map_err(llvm_err) })
                    .collect()
            })
            .collect()
    }

    /// Vectors of equal width laid end to end (a power of two of them).
    fn joined(&self, mut parts: Vec<inkwell::values::VectorValue<'ctx>>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        assert!(parts.len().is_power_of_two(), "{} parts", parts.len());
        while parts.len() > 1 {
            parts = parts
                .chunks(2)
                .map(|p| self.builder.build_shuffle_vector(p[0], p[1], shuffle_mask(self.context, &|i| i, 2 * p[0].get_type().get_size()), "joined").map_err(llvm_err))
                .collect::<Result<_, _>>()?;
        }
        Ok(parts[0])
    }

    /// A call of `f` on vector arguments that returns a vector.
    fn call_vector(&self, f: FunctionValue<'ctx>, args: &[inkwell::values::VectorValue<'ctx>]) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let args: Vec<_> = args.iter().map(|&a| a.into()).collect();
        let call = self.builder.build_call(f, &args, "call").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else { unreachable!("returns a vector") };
        Ok(v.into_vector_value())
    }

    /// A dot instruction's f32 accumulator, `local[0..16]`, as a vector.
    fn load_local(&self, local: u32, ty: inkwell::types::VectorType<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let old = self.builder.build_load(ty, self.locals[(local - LOCAL_BASE) as usize], "acc").map_err(llvm_err)?;
        old.as_instruction_value().expect("a load").set_alignment(4).map_err(llvm_err)?;
        Ok(old.into_vector_value())
    }

    /// Stores `value` to a dot instruction's accumulator `local[0..16]`.
    fn store_local(&self, local: u32, value: inkwell::values::VectorValue<'ctx>) -> Result<(), CodegenError> {
        let st = self.builder.build_store(self.locals[(local - LOCAL_BASE) as usize], value).map_err(llvm_err)?;
        st.set_alignment(4).map_err(llvm_err)?;
        Ok(())
    }

    /// A [`Stmt::DotRows`] as vector code: per 64-byte chunk of levels (16 rows x
    /// 4 values; nibbles give two, low and high), one dot step against the four
    /// activation bytes of those values broadcast to all 16 rows, chained into one
    /// i32 accumulator by [`ByteDots`] (levels unsigned, activations signed, as
    /// the instructions want; Q8_0's levels, `w + 128`, are too large for
    /// `vpmaddubsw`, so there the dot runs on the signed `w`, and with their
    /// `-128 S` minimum that signed dot is the whole term (the activation sums'
    /// contract, see [`RowDot`]); nibbles
    /// there keep their pair products in i16 over the whole block and widen them
    /// once). Byte planes take one such chain each ([`Self::byte_level_dots`]);
    /// words take word dots instead ([`Self::word_dots`]). Then, in 16-lane f32 vectors:
    /// converted, times the rows' scales (one vector load) and the activation
    /// scale, plus the rows' minimums times the activation sum, added to `acc`.
    /// With `prefetch_ahead` (CPU only), each chunk's load is preceded by a
    /// `prefetcht0` that many bytes further on.
    fn dot_rows(&mut self, d: &RowDot) -> Result<(), CodegenError> {
        let (i32t, f32t) = (self.context.i32_type(), self.context.f32_type());
        let lanes = DOT_LANES as u32;
        let (acc, folded_offset) = match d.act_levels {
            ActLevels::Words => {
                // Q8_0's minimum folded exactly where byte planes fold it (the
                // same `folds_offset`): a row decoded alone (words) and in a
                // batch (planes) then take the same float steps.
                let folded = self.folds_offset(d);
                (self.word_dots(d, folded)?, folded)
            }
            _ => self.byte_level_dots(d)?,
        };
        let f32v = f32t.vec_type(lanes);
        let splat = |b: &Builder<'ctx>, x: inkwell::values::FloatValue<'ctx>, name: &str| -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
            let one = b.build_insert_element(f32v.get_undef(), x, i32t.const_zero(), name).map_err(llvm_err)?;
            b.build_shuffle_vector(one, one, i32t.vec_type(lanes).const_zero(), name).map_err(llvm_err)
        };
        let act_scale = self.expr(&d.act_scales[0])?.into_float_value();
        let act_sum = self.expr(&d.act_scales[1])?.into_float_value();
        let row_scales = self.row_values(&d.row_scales, lanes)?;
        let mins = match &d.row_min {
            RowMin::Stored(m) | RowMin::Subtracted(m) => Some(self.row_values(m, lanes)?),
            RowMin::Offset(_) => None,
        };
        // No fast-math flags here: with them LLVM contracted and reassociated
        // this epilogue differently in a one-row GEMV and in a row tile (a
        // multiply whose result has one use fuses into an FMA, a shared one does
        // not), so a sequence decoded alone got other logits than the same
        // sequence in a batch step (about 1e-5 relative, enough to change
        // sampled tokens). The integer dots are exact; the fused steps are
        // spelled out as `llvm.fmuladd` (an FMA wherever the target has one, in
        // every loop shape alike), so a row's result is independent of the
        // rows beside it, at the operation count contraction gave before.
        let b = &self.builder;
        let dots = b.build_signed_int_to_float(acc, f32v, "dots").map_err(llvm_err)?;
        let (scale, sum) = (splat(b, act_scale, "act_scale")?, splat(b, act_sum, "act_sum")?);
        let scaled = b.build_float_mul(dots, scale, "scaled").map_err(llvm_err)?;
        let term = match (&d.row_min, mins) {
            // S * d * (signed dot)
            (RowMin::Offset(_), _) if folded_offset => b.build_float_mul(row_scales, scaled, "term").map_err(llvm_err)?,
            // S * (d * dot + offset * s)
            (RowMin::Offset(o), _) => {
                let inner = self.mul_add(sum, splat(b, f32t.const_float(*o as f64), "offset")?, scaled)?;
                self.builder.build_float_mul(row_scales, inner, "term").map_err(llvm_err)?
            }
            // S * d * dot +- M * s
            (RowMin::Stored(_) | RowMin::Subtracted(_), Some(mins)) => {
                let left = b.build_float_mul(row_scales, scaled, "left").map_err(llvm_err)?;
                let mins = match d.row_min {
                    RowMin::Subtracted(_) => b.build_float_neg(mins, "neg_mins").map_err(llvm_err)?,
                    _ => mins,
                };
                self.mul_add(mins, sum, left)?
            }
            (_, None) => unreachable!("loaded above"),
        };
        // One add on the accumulator's chain from block to block (fusing the
        // term's last product into it measured slower: two dependent FMAs per
        // block, SmolLM2 pp512 650-760 against 840-870 tok/s).
        let old = self.load_local(d.acc, f32v)?;
        let new = self.builder.build_float_add(old, term, "acc").map_err(llvm_err)?;
        self.store_local(d.acc, new)
    }

    /// `a * b + c` as `llvm.fmuladd` without fast-math flags: fused where the
    /// target has FMA, the same way in every loop shape.
    fn mul_add(&self, a: inkwell::values::VectorValue<'ctx>, b: inkwell::values::VectorValue<'ctx>, c: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        Ok(self.intrinsic_typed("llvm.fmuladd", &[a.into(), b.into(), c.into()], &[a.get_type().into()])?.into_vector_value())
    }

    /// Chunk `c` of a [`RowDot`]'s 64-byte chunks of levels (prefetched ahead if
    /// asked, on the CPU) as its dot steps: (the 64 unsigned levels, 16 rows x
    /// 4 values, and the position of the step's first activation value). Bytes
    /// are one step, nibbles two (low, then high).
    fn chunk_steps(&mut self, d: &RowDot, c: i64) -> Result<Vec<(inkwell::values::VectorValue<'ctx>, i64)>, CodegenError> {
        let w_ptr = self.element_ptr(d.weights, &dsl::add(d.w_start.clone(), dsl::i(64 * c)))?;
        if let (Some(ahead), Flavor::Cpu(_)) = (d.prefetch_ahead, &self.flavor) {
            self.prefetch(w_ptr, ahead)?;
        }
        let chunk = self.byte_load(self.context.i8_type().vec_type(64), w_ptr)?;
        Ok(match d.form {
            RowsForm::Bytes => vec![(chunk, 4 * c)],
            RowsForm::Nibbles => {
                let (low, high) = self.nibbles(chunk)?;
                vec![(low, 8 * c), (high, 8 * c + 4)]
            }
        })
    }

    /// The 16 rows' integer dots of a [`RowDot`] whose activations are words:
    /// per dot step the 64 levels widened to i16 (x86: `vpmovzxbw`) and the
    /// step's four activation words broadcast to every row. On x86, `vpmaddwd`
    /// (zmm or ymm parts) gives 32 i32 lanes, lane `2g + h` row `g`'s products
    /// of values `2h, 2h + 1` of the step, summed over the block (at most 16
    /// products of 255 * 32512: exact) and folded into the 16 rows once at its
    /// end; on NEON each lane's widened products summed over the block and
    /// folded once; elsewhere widened multiplies summed per step. The levels are the
    /// stored unsigned ones (Q8_0's minimum stays a term of its own), or with
    /// `signed_levels` Q8_0's signed `u - 128`, sign-extended (its minimum folded
    /// into the dot, as byte planes fold it without VNNI).
    fn word_dots(&mut self, d: &RowDot, signed_levels: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i16t, i32t) = (self.context.i16_type(), self.context.i32_type());
        let zmm = match self.byte_dots() {
            ByteDots::Vnni { zmm } | ByteDots::Madd { zmm } => Some(zmm),
            ByteDots::Arm { .. } | ByteDots::Widened => None,
        };
        // NEON: the products (`smull` / `smlal` on 4-lane parts) summed per lane
        // over the block (at most 8 of 255 * 32512: exact) and folded into the
        // 16 rows once at its end, instead of a row fold per step.
        let arm = matches!(self.byte_dots(), ByteDots::Arm { .. });
        let mut pairs = i32t.vec_type(2 * DOT_LANES as u32).const_zero();
        let mut fours = i32t.vec_type(DOT_LANES as u32).const_zero();
        let mut products_sum = i32t.vec_type(4 * DOT_LANES as u32).const_zero();
        for c in 0..d.form.chunks() {
            for (levels, first) in self.chunk_steps(d, c)? {
                let a_ptr = self.element_ptr(d.act, &dsl::add(d.act_start.clone(), dsl::i(2 * first)))?;
                let four = self.builder.build_load(i16t.vec_type(4), a_ptr, "act_words").map_err(llvm_err)?;
                four.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
                let four = four.into_vector_value();
                let b = &self.builder;
                let broadcast = b.build_shuffle_vector(four, four, shuffle_mask(self.context, &|i| i % 4, 64), "acts").map_err(llvm_err)?;
                let words = if signed_levels {
                    let bias = inkwell::types::VectorType::const_vector(&vec![self.context.i8_type().const_int(0x80, false); 64]);
                    let signed = b.build_xor(levels, bias, "signed_levels").map_err(llvm_err)?;
                    b.build_int_s_extend(signed, i16t.vec_type(64), "level_words").map_err(llvm_err)?
                } else {
                    b.build_int_z_extend(levels, i16t.vec_type(64), "level_words").map_err(llvm_err)?
                };
                match zmm {
                    Some(zmm) => {
                        let products = self.word_pair_products(words, broadcast, zmm)?;
                        pairs = self.builder.build_int_add(pairs, products, "pairs").map_err(llvm_err)?;
                    }
                    None => {
                        let wide = i32t.vec_type(64);
                        let ww = if signed_levels { b.build_int_s_extend(words, wide, "w32") } else { b.build_int_z_extend(words, wide, "w32") }.map_err(llvm_err)?;
                        let aw = b.build_int_s_extend(broadcast, wide, "a32").map_err(llvm_err)?;
                        let products = b.build_int_mul(ww, aw, "products").map_err(llvm_err)?;
                        if arm {
                            products_sum = b.build_int_add(products_sum, products, "products_sum").map_err(llvm_err)?;
                            continue;
                        }
                        let sums = self.sum_fours(products)?;
                        fours = self.builder.build_int_add(fours, sums, "fours").map_err(llvm_err)?;
                    }
                }
            }
        }
        if arm {
            return self.sum_fours(products_sum);
        }
        if zmm.is_none() {
            return Ok(fours);
        }
        let b = &self.builder;
        let even = b.build_shuffle_vector(pairs, pairs, shuffle_mask(self.context, &|g| 2 * g, DOT_LANES as u32), "even").map_err(llvm_err)?;
        let odd = b.build_shuffle_vector(pairs, pairs, shuffle_mask(self.context, &|g| 2 * g + 1, DOT_LANES as u32), "odd").map_err(llvm_err)?;
        b.build_int_add(even, odd, "dots").map_err(llvm_err)
    }

    /// `vpmaddwd` of 64 i16 lanes `a` and `b` (one zmm per 32 or two ymm per 16
    /// lanes): 32 i32 lanes, lane `j` the sum of the products of lanes `2j` and
    /// `2j + 1`.
    fn word_pair_products(&self, a: inkwell::values::VectorValue<'ctx>, b: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let name = if zmm { "llvm.x86.avx512.pmaddw.d.512" } else { "llvm.x86.avx2.pmadd.wd" };
        self.pairwise_in_parts(name, self.context.i16_type(), self.context.i32_type(), &[a, b], zmm)
    }

    /// Whether a [`RowDot`]'s Q8_0 bytes go in as signed levels `u - 128` on
    /// this target: where the dot instructions multiply them as signed
    /// (`vpmaddubsw` without VNNI, with its 128 bound; NEON's `sdot` / `smull`).
    fn takes_signed_levels(&self, d: &RowDot) -> bool {
        d.form == RowsForm::Bytes && matches!(self.byte_dots(), ByteDots::Madd { .. } | ByteDots::Arm { .. })
    }

    /// Whether the signed levels' dot already holds Q8_0's -128 minimum: with
    /// the activation sums `act_scales[1]` are (RowDot's contract),
    /// `S * (d * sum u * a - 128 * d * sum a)` is `S * d * sum (u - 128) * a`,
    /// the signed dot itself, so neither the 128 * sum a added back nor the
    /// offset term is needed. Byte planes and words decide it here alike.
    fn folds_offset(&self, d: &RowDot) -> bool {
        self.takes_signed_levels(d) && d.row_min == RowMin::Offset(-128.0)
    }

    /// The 16 rows' integer dots of a [`RowDot`] whose activations are bytes or
    /// byte planes (see [`Self::dot_rows`]), and whether they already hold
    /// Q8_0's -128 minimum (`folded_offset`: the signed levels' dot).
    fn byte_level_dots(&mut self, d: &RowDot) -> Result<(inkwell::values::VectorValue<'ctx>, bool), CodegenError> {
        let (i8t, i32t) = (self.context.i8_type(), self.context.i32_type());
        let lanes = DOT_LANES as u32;
        // Without VNNI (`Some(zmm)`): Q8_0 as sum u * a = sum (u - 128) * a + 128 * sum a
        // (the second term cancels against the -128 minimum: `folded_offset`);
        // nibbles with their pair products summed in i16 over the whole block
        // (8 steps of at most 2 * 15 * 128: below 2^15), widened once after it.
        let madd = match self.byte_dots() {
            ByteDots::Madd { zmm } => Some(zmm),
            _ => None,
        };
        let arm = matches!(self.byte_dots(), ByteDots::Arm { .. });
        let signed_levels = self.takes_signed_levels(d);
        let folded_offset = self.folds_offset(d);
        // One accumulator per activation byte plane (16-bit activations have a
        // high and a low one), each fed the same unpacked levels.
        let low = match &d.act_levels {
            ActLevels::Planes { low } => Some(low),
            _ => None,
        };
        let planes: Vec<&Expr> = std::iter::once(&d.act_start).chain(low).collect();
        let mut accs = Vec::with_capacity(planes.len());
        for &start in &planes {
            accs.push(if signed_levels && !folded_offset { self.splat_act_sum(d.act, start, 128)? } else { i32t.vec_type(lanes).const_zero() });
        }
        let bias = inkwell::types::VectorType::const_vector(&vec![i8t.const_int(0x80, false); 64]);
        let mut nibble_pairs: Vec<Option<inkwell::values::VectorValue<'ctx>>> = vec![None; planes.len()];
        for c in 0..d.form.chunks() {
            for (levels, first) in self.chunk_steps(d, c)? {
                // Q8_0's signed levels, once for both planes.
                let signed = if signed_levels { Some(self.builder.build_xor(levels, bias, "signed_levels").map_err(llvm_err)?) } else { None };
                for (p, &start) in planes.iter().enumerate() {
                    let a_ptr = self.element_ptr(d.act, &dsl::add(start.clone(), dsl::i(first)))?;
                    let four = self.byte_load(i8t.vec_type(4), a_ptr)?;
                    let broadcast = self.builder.build_shuffle_vector(four, four, shuffle_mask(self.context, &|i| i % 4, 64), "acts").map_err(llvm_err)?;
                    if let (RowsForm::Nibbles, Some(zmm)) = (d.form, madd) {
                        let products = self.pair_products(levels, broadcast, zmm)?;
                        nibble_pairs[p] = Some(match nibble_pairs[p] {
                            None => products,
                            Some(w) => self.builder.build_int_add(w, products, "pairs").map_err(llvm_err)?,
                        });
                        continue;
                    }
                    accs[p] = match signed {
                        Some(signed) if arm => self.dot_fours(accs[p], signed, broadcast, WeightBytes::Signed)?,
                        Some(signed) => {
                            let (abs, moved) = self.sign_moved(signed, broadcast)?;
                            self.dot_fours(accs[p], abs, moved, WeightBytes::Unsigned)?
                        }
                        None if d.form == RowsForm::Nibbles => self.dot_fours(accs[p], levels, broadcast, WeightBytes::Small)?,
                        None => self.dot_fours(accs[p], levels, broadcast, WeightBytes::Unsigned)?,
                    };
                }
            }
        }
        if let Some(zmm) = madd {
            for (acc, words) in accs.iter_mut().zip(nibble_pairs) {
                if let Some(words) = words {
                    *acc = self.pair_sums(words, zmm)?;
                }
            }
        }
        // 16-bit activations: 255 times the high plane's dots plus the low one's
        // (at most 32 * 255 * 32512 in magnitude: exact in i32).
        let acc = match accs[..] {
            [acc] => acc,
            [high, low] => {
                let weight = inkwell::types::VectorType::const_vector(&vec![i32t.const_int(HIGH_PLANE_WEIGHT as u64, false); lanes as usize]);
                let scaled = self.builder.build_int_mul(high, weight, "high").map_err(llvm_err)?;
                self.builder.build_int_add(scaled, low, "dots16").map_err(llvm_err)?
            }
            _ => unreachable!("one or two activation planes"),
        };
        Ok((acc, folded_offset))
    }

    /// `times` the sum of the [`RowsForm::VALUES`] activation bytes from `start`, in all
    /// 16 i32 lanes.
    fn splat_act_sum(&mut self, act: u32, start: &Expr, times: u64) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i8t, i32t) = (self.context.i8_type(), self.context.i32_type());
        let ptr = self.element_ptr(act, start)?;
        let bytes = self.byte_load(i8t.vec_type(RowsForm::VALUES as u32), ptr)?;
        let wide = self.builder.build_int_s_extend(bytes, i32t.vec_type(RowsForm::VALUES as u32), "act32").map_err(llvm_err)?;
        let sum = self.intrinsic_typed("llvm.vector.reduce.add", &[wide.into()], &[wide.get_type().into()])?.into_int_value();
        let b = &self.builder;
        let sum = b.build_int_mul(sum, i32t.const_int(times, false), "act_sum").map_err(llvm_err)?;
        let one = b.build_insert_element(i32t.vec_type(DOT_LANES as u32).get_undef(), sum, i32t.const_zero(), "act_sum").map_err(llvm_err)?;
        b.build_shuffle_vector(one, one, i32t.vec_type(DOT_LANES as u32).const_zero(), "act_sums").map_err(llvm_err)
    }

    /// A [`RowScale`]'s `lanes` values as f32: the float values, times the byte
    /// factors (unsigned) if any.
    fn row_values(&mut self, r: &RowScale, lanes: u32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let values = self.float_vector(r.values.0, &r.values.1, lanes)?;
        let Some((param, start)) = &r.factors else { return Ok(values) };
        let ptr = self.element_ptr(*param, start)?;
        let bytes = self.byte_load(self.context.i8_type().vec_type(lanes), ptr)?;
        let b = &self.builder;
        let factors = b.build_unsigned_int_to_float(bytes, self.context.f32_type().vec_type(lanes), "factors").map_err(llvm_err)?;
        Ok(self.fast(b.build_float_mul(values, factors, "row_values").map_err(llvm_err)?.into()).into_vector_value())
    }

    /// `lanes` consecutive elements of float parameter `param` from `start`, as f32.
    fn float_vector(&mut self, param: u32, start: &Expr, lanes: u32) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let elem = self.kernel.buffer(param).expect("validated").elem;
        let ptr = self.element_ptr(param, start)?;
        let (i32t, f32v) = (self.context.i32_type(), self.context.f32_type().vec_type(lanes));
        let b = &self.builder;
        let raw = match elem {
            ElemType::F32 => f32v,
            ElemType::F16 => self.context.f16_type().vec_type(lanes),
            ElemType::BF16 => self.context.i16_type().vec_type(lanes),
            other => unreachable!("{other:?} is not a float element (validated)"),
        };
        let v = b.build_load(raw, ptr, "row_values").map_err(llvm_err)?;
        v.as_instruction_value().expect("a load").set_alignment(2).map_err(llvm_err)?;
        let v = v.into_vector_value();
        Ok(match elem {
            ElemType::F16 => b.build_float_ext(v, f32v, "fpext").map_err(llvm_err)?,
            // bfloat16 is the top half of an f32: zero-extend, shift, reinterpret.
            ElemType::BF16 => {
                let wide = b.build_int_z_extend(v, i32t.vec_type(lanes), "zext").map_err(llvm_err)?;
                let shift = inkwell::types::VectorType::const_vector(&vec![i32t.const_int(16, false); lanes as usize]);
                let shifted = b.build_left_shift(wide, shift, "shl").map_err(llvm_err)?;
                b.build_bit_cast(shifted, f32v, "bf16").map_err(llvm_err)?.into_vector_value()
            }
            _ => v,
        })
    }

    /// A vector of bytes loaded from `ptr` (no alignment assumed).
    fn byte_load(&self, ty: inkwell::types::VectorType<'ctx>, ptr: PointerValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let v = self.builder.build_load(ty, ptr, "bytes").map_err(llvm_err)?;
        v.as_instruction_value().expect("a load").set_alignment(1).map_err(llvm_err)?;
        Ok(v.into_vector_value())
    }

    /// VNNI `vpdpbusd`: 16 i32 lanes, lane `g` of `acc` plus the sum of the products
    /// of unsigned bytes `4g..4g + 4` of `u` with the signed bytes of `s`, on one
    /// zmm register or two ymm halves.
    fn vpdpbusd(&self, acc: inkwell::values::VectorValue<'ctx>, u: inkwell::values::VectorValue<'ctx>, s: inkwell::values::VectorValue<'ctx>, zmm: bool) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (width, name) = if zmm { (DOT_LANES as u32, "llvm.x86.avx512.vpdpbusd.512") } else { (DOT_LANES as u32 / 2, "llvm.x86.avx512.vpdpbusd.256") };
        let (part, whole) = (self.context.i32_type().vec_type(width), acc.get_type());
        let f = self.declared(name, part.fn_type(&[part.into(), part.into(), part.into()], false), None);
        let b = &self.builder;
        let (u, s) = (b.build_bit_cast(u, whole, "u").map_err(llvm_err)?, b.build_bit_cast(s, whole, "s").map_err(llvm_err)?);
        let parts = self.lane_parts(&[acc, u.into_vector_value(), s.into_vector_value()], width)?.into_iter().map(|h| self.call_vector(f, &h)).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// aarch64 `sdot` (FEAT_DotProd): 16 i32 lanes, lane `g` of `acc` plus the sum
    /// of the products of signed bytes `4g..4g + 4` of `w` and `a`, in four
    /// 128-bit parts (the same lane order as [`Self::vpdpbusd`]).
    fn sdot(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (quad, bytes) = (self.context.i32_type().vec_type(4), self.context.i8_type().vec_type(16));
        let f = self.declared("llvm.aarch64.neon.sdot.v4i32.v16i8", quad.fn_type(&[quad.into(), bytes.into(), bytes.into()], false), None);
        let accs = self.lane_parts(&[acc], 4)?;
        let operands = self.lane_parts(&[w, a], 16)?;
        let parts = accs.into_iter().zip(operands).map(|(acc, wa)| self.call_vector(f, &[acc[0], wa[0], wa[1]])).collect::<Result<Vec<_>, _>>()?;
        self.joined(parts)
    }

    /// NEON without dotprod: the same sums as [`Self::sdot`] (signed bytes; every
    /// product fits i16, at most 128 * 128 in magnitude), per 16 bytes `smull` /
    /// `smull2` into i16 products, `saddlp` into i32 pair sums and `addp` of the
    /// two halves' pairs into the four sums.
    fn smull_fours(&self, acc: inkwell::values::VectorValue<'ctx>, w: inkwell::values::VectorValue<'ctx>, a: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let (i8t, i16t, i32t) = (self.context.i8_type(), self.context.i16_type(), self.context.i32_type());
        let (eight, words, quad) = (i8t.vec_type(8), i16t.vec_type(8), i32t.vec_type(4));
        let smull = self.declared("llvm.aarch64.neon.smull.v8i16", words.fn_type(&[eight.into(), eight.into()], false), None);
        let saddlp = self.declared("llvm.aarch64.neon.saddlp.v4i32.v8i16", quad.fn_type(&[words.into()], false), None);
        let addp = self.declared("llvm.aarch64.neon.addp.v4i32", quad.fn_type(&[quad.into(), quad.into()], false), None);
        let halves = self.lane_parts(&[w, a], 8)?;
        let pairs = halves.iter().map(|wa| self.call_vector(smull, wa).and_then(|p| self.call_vector(saddlp, &[p]))).collect::<Result<Vec<_>, _>>()?;
        let fours = pairs.chunks(2).map(|p| self.call_vector(addp, p)).collect::<Result<Vec<_>, _>>()?;
        let sums = self.joined(fours)?;
        self.builder.build_int_add(acc, sums, "acc").map_err(llvm_err)
    }

    /// `<64 x i32>` products -> 16 lanes, lane `g` the sum of products `4g..4g + 4`.
    fn sum_fours(&self, products: inkwell::values::VectorValue<'ctx>) -> Result<inkwell::values::VectorValue<'ctx>, CodegenError> {
        let b = &self.builder;
        let mut sum: Option<inkwell::values::VectorValue<'ctx>> = None;
        for t in 0..4 {
            let part = b.build_shuffle_vector(products, products, shuffle_mask(self.context, &|g| 4 * g + t, DOT_LANES as u32), "part").map_err(llvm_err)?;
            sum = Some(match sum {
                None => part,
                Some(s) => b.build_int_add(s, part, "sum").map_err(llvm_err)?,
            });
        }
        Ok(sum.expect("four parts"))
    }

    /// An overloaded intrinsic with explicit overload types.
    fn intrinsic_typed(&self, name: &str, args: &[BasicValueEnum<'ctx>], types: &[BasicTypeEnum<'ctx>]) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let intr = Intrinsic::find(name).ok_or_else(|| CodegenError::Llvm(format!("no intrinsic {name}")))?;
        let f = intr.get_declaration(self.module, types).ok_or_else(|| CodegenError::Llvm(format!("no declaration for {name}")))?;
        let args: Vec<_> = args.iter().map(|a| (*a).into()).collect();
        let call = self.builder.build_call(f, &args, "call").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else {
            return Err(CodegenError::Llvm(format!("{name} returns nothing")));
        };
        Ok(v)
    }

    /// A stack slot in the entry block (where `mem2reg` promotes it).
    fn entry_alloca(&self, ty: BasicTypeEnum<'ctx>, name: &str) -> Result<PointerValue<'ctx>, CodegenError> {
        let entry = self.function.get_first_basic_block().expect("the entry block exists");
        let at = self.context.create_builder();
        match entry.get_first_instruction() {
            Some(first) => at.position_before(&first),
            None => at.position_at_end(entry),
        }
        at.build_alloca(ty, name).map_err(llvm_err)
    }

    /// Inside a vector chunk's copy `u`, marks a global access at `var + offset`
    /// with the alignment the chunk guarantees: `VECTOR` elements for copy 0 (the
    /// buffers start 64-byte aligned and the offset is a multiple of `VECTOR`), so
    /// that LLVM's load/store vectorizer joins the chunk's accesses.
    fn mark_alignment(&self, inst: Option<InstructionValue<'ctx>>, param: u32, index: &Expr) -> Result<(), CodegenError> {
        if let Some(inst) = inst {
            self.tag_alias(inst, param)?;
        }
        let (Some(inst), Some((var, u))) = (inst, self.chunk_copy) else { return Ok(()) };
        if param >= LOCAL_BASE || !index.mentions(var) {
            return Ok(());
        }
        let size = self.kernel.buffer(param).expect("validated").elem.size() as u32;
        let elems = if u == 0 { maxc_kernels::warp::VECTOR as u32 } else { 1 << (u as u32).trailing_zeros() };
        inst.set_alignment(size * elems).map_err(llvm_err)
    }

    /// Marks an access to parameter `param` as one that no access to another
    /// parameter aliases. The runtime and the tests pass disjoint buffers: a
    /// launch's outputs are placed clear of its inputs (`schedule/memory.rs`),
    /// weights, caches, tokens and positions are separate allocations, and two
    /// parameters that share a buffer are both read-only, which no reordering
    /// can break. Without it LLVM guards each vector loop with run-time overlap
    /// checks, or gives up on vectorizing loops that touch many parameters.
    fn tag_alias(&self, inst: InstructionValue<'ctx>, param: u32) -> Result<(), CodegenError> {
        let Some(&(scope, others)) = self.alias.get(param as usize) else { return Ok(()) };
        inst.set_metadata(scope, self.context.get_kind_id("alias.scope")).map_err(llvm_err)?;
        inst.set_metadata(others, self.context.get_kind_id("noalias")).map_err(llvm_err)
    }

    /// Synchronizes the task's threads: `bar.warp.sync` for a warp, `bar.sync 0`
    /// for a block of warps (a task is then the whole block).
    fn task_barrier(&self) -> Result<(), CodegenError> {
        let i32t = self.context.i32_type();
        if self.shared.is_some() {
            let f = self.declared("llvm.nvvm.barrier0", self.context.void_type().fn_type(&[], false), None);
            self.builder.build_call(f, &[], "").map_err(llvm_err)?;
        } else {
            let sync = self.declared("llvm.nvvm.bar.warp.sync", self.context.void_type().fn_type(&[i32t.into()], false), None);
            self.builder.build_call(sync, &[i32t.const_all_ones().into()], "").map_err(llvm_err)?;
        }
        Ok(())
    }

    /// Reduction `r` combined across the task: the warp butterfly, then with four
    /// warps each warp's lane 0 writes its total to shared memory and every thread
    /// adds the totals in warp order (a barrier before the writes, so no thread is
    /// still reading the previous reduction's totals, and one after).
    fn task_reduce(&self, r: VarId, op: BinOp) -> Result<inkwell::values::FloatValue<'ctx>, CodegenError> {
        let x = self.warp_reduce(r, op)?;
        let Some(shared) = self.shared else { return Ok(x) };
        let (f32t, i64t) = (self.context.f32_type(), self.context.i64_type());
        let lane = self.lane.expect("a group has lanes");
        let warp_size = i64t.const_int(maxc_kernels::warp::WARP as u64, false);
        let warps = self.warp.threads as u64 / maxc_kernels::warp::WARP as u64;
        let array = f32t.array_type(warps as u32);
        self.task_barrier()?;
        let b = &self.builder;
        let warp = b.build_int_unsigned_div(lane, warp_size, "warp_index").map_err(llvm_err)?;
        let leader = b.build_int_compare(IntPredicate::EQ, b.build_int_unsigned_rem(lane, warp_size, "warp_lane").map_err(llvm_err)?, i64t.const_zero(), "leader").map_err(llvm_err)?;
        let write = self.context.append_basic_block(self.function, "write_partial");
        let written = self.context.append_basic_block(self.function, "partial_written");
        b.build_conditional_branch(leader, write, written).map_err(llvm_err)?;
        b.position_at_end(write);
        // SAFETY: `warp` < warps, the array's length.
        let slot = unsafe { b.build_in_bounds_gep(array, shared, &[i64t.const_zero(), warp], "partial") }.map_err(llvm_err)?;
        b.build_store(slot, x).map_err(llvm_err)?;
        b.build_unconditional_branch(written).map_err(llvm_err)?;
        b.position_at_end(written);
        self.task_barrier()?;
        let mut total = None;
        for w in 0..warps {
            let b = &self.builder;
            // SAFETY: w < warps.
            let slot = unsafe { b.build_in_bounds_gep(array, shared, &[i64t.const_zero(), i64t.const_int(w, false)], "partial") }.map_err(llvm_err)?;
            let v = b.build_load(f32t, slot, "warp_total").map_err(llvm_err)?.into_float_value();
            total = Some(match total {
                None => v,
                Some(t) => self.float_op(op, t, v)?,
            });
        }
        Ok(total.expect("at least one warp"))
    }

    /// Every lane's partial of reduction `r` combined across the warp: a butterfly
    /// of `shfl.sync.bfly` (offsets 16, 8, 4, 2, 1), after which all lanes hold it.
    fn warp_reduce(&self, r: VarId, op: BinOp) -> Result<inkwell::values::FloatValue<'ctx>, CodegenError> {
        let (f32t, i32t) = (self.context.f32_type(), self.context.i32_type());
        let name = "llvm.nvvm.shfl.sync.bfly.f32";
        let shfl = self.declared(name, f32t.fn_type(&[i32t.into(), f32t.into(), i32t.into(), i32t.into()], false), None);
        let mut x = self.builder.build_load(f32t, self.slots[r as usize], "partial").map_err(llvm_err)?.into_float_value();
        let mut offset = maxc_kernels::warp::WARP as u64 / 2;
        while offset > 0 {
            let args = [i32t.const_all_ones().into(), x.into(), i32t.const_int(offset, false).into(), i32t.const_int(31, false).into()];
            let call = self.builder.build_call(shfl, &args, "shfl").map_err(llvm_err)?;
            let inkwell::values::ValueKind::Basic(y) = call.try_as_basic_value() else { unreachable!("shfl returns f32") };
            x = self.float_op(op, x, y.into_float_value())?;
            offset /= 2;
        }
        Ok(x)
    }

    /// `a op b` for a reduction's operator.
    fn float_op(&self, op: BinOp, a: inkwell::values::FloatValue<'ctx>, b: inkwell::values::FloatValue<'ctx>) -> Result<inkwell::values::FloatValue<'ctx>, CodegenError> {
        Ok(match op {
            BinOp::Max => self.min_max("llvm.maxnum", a, b)?.into_float_value(),
            _ => self.fast(self.builder.build_float_add(a, b, "sum").map_err(llvm_err)?.into()).into_float_value(),
        })
    }

    /// `llvm.maxnum` / `llvm.minnum` of two floats, flagged `nnan` (and the other
    /// fast-math flags): LLVM 19 vectorizes a loop's max reduction (an attention
    /// row's maximum score, a block's largest magnitude before quantization) only
    /// on that promise, and turns a NaN-aware one into a serial chain of `vmaxss`
    /// with NaN tests. A NaN operand makes the result unspecified instead of the
    /// other operand; the NaN itself still reaches the outputs through the other
    /// uses of the value that held it (`maxrun --check-nan` names the launch that
    /// produced it first).
    fn min_max(&self, name: &str, a: inkwell::values::FloatValue<'ctx>, b: inkwell::values::FloatValue<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let v = self.intrinsic(name, &[a.into(), b.into()])?;
        if let Some(inst) = v.as_instruction_value() {
            let flags = FastMathFlags::AllowReassoc | FastMathFlags::AllowContract | FastMathFlags::NoSignedZeros | FastMathFlags::NoNaNs;
            inst.set_fast_math_flags(flags).expect("a float intrinsic call takes fast-math flags");
        }
        Ok(v)
    }

    /// Attaches `!llvm.loop !{self, !{"llvm.loop.vectorize.enable", i1 false}}` to
    /// a loop's back edge.
    fn forbid_vectorization(&self, latch: InstructionValue<'ctx>) {
        self.loop_options(latch, &[("llvm.loop.vectorize.enable", 1, 0)]);
    }

    /// Asks the loop vectorizer for `lanes` lanes in the loop of `latch`.
    fn vectorize_width(&self, latch: InstructionValue<'ctx>, lanes: u64) {
        self.loop_options(latch, &[("llvm.loop.vectorize.enable", 1, 1), ("llvm.loop.vectorize.width", 32, lanes)]);
    }

    /// Attaches `!llvm.loop !{self, !{key, iBITS value}, ...}` to a loop's back
    /// edge (a self-referential loop ID, built with a temporary node).
    fn loop_options(&self, latch: InstructionValue<'ctx>, options: &[(&str, u32, u64)]) {
        use inkwell::llvm_sys::core::*;
        use inkwell::llvm_sys::debuginfo::{LLVMMetadataReplaceAllUsesWith, LLVMTemporaryMDNode};
        use inkwell::values::AsValueRef;
        // SAFETY: plain metadata construction in this context; the temporary node is
        // replaced (and so freed by LLVM) before anything else can see it.
        unsafe {
            let ctx = self.context.raw();
            let temporary = LLVMTemporaryMDNode(ctx, std::ptr::null_mut(), 0);
            let mut operands = vec![temporary];
            for &(key, bits, value) in options {
                let name = LLVMMDStringInContext2(ctx, key.as_ptr() as *const _, key.len());
                let value = LLVMValueAsMetadata(LLVMConstInt(LLVMIntTypeInContext(ctx, bits), value, 0));
                let mut option = [name, value];
                operands.push(LLVMMDNodeInContext2(ctx, option.as_mut_ptr(), 2));
            }
            let id = LLVMMDNodeInContext2(ctx, operands.as_mut_ptr(), operands.len());
            LLVMMetadataReplaceAllUsesWith(temporary, id);
            let kind = LLVMGetMDKindIDInContext(ctx, "llvm.loop".as_ptr() as *const _, 9);
            LLVMSetMetadata(latch.as_value_ref(), kind, LLVMMetadataAsValue(ctx, id));
        }
    }

    /// `llvm.prefetch` (read, keep in every cache level) of the byte `bytes` past
    /// `at`. The address is formed without `inbounds`: it may lie past the buffer,
    /// which a prefetch allows (it never faults).
    fn prefetch(&self, at: PointerValue<'ctx>, bytes: i64) -> Result<(), CodegenError> {
        let (i8t, i32t) = (self.context.i8_type(), self.context.i32_type());
        // SAFETY: a plain (not inbounds) byte offset; the pointer is only prefetched.
        let ahead = unsafe { self.builder.build_gep(i8t, at, &[self.context.i64_type().const_int(bytes as u64, true)], "ahead") }.map_err(llvm_err)?;
        let ptr_t = self.context.ptr_type(AddressSpace::default());
        let ty = self.context.void_type().fn_type(&[ptr_t.into(), i32t.into(), i32t.into(), i32t.into()], false);
        let f = self.declared("llvm.prefetch.p0", ty, None);
        // (address, read, locality 3: all cache levels, data cache)
        let args = [ahead.into(), i32t.const_zero().into(), i32t.const_int(3, false).into(), i32t.const_int(1, false).into()];
        self.builder.build_call(f, &args, "").map_err(llvm_err)?;
        Ok(())
    }

    fn element_ptr(&mut self, param: u32, index: &Expr) -> Result<PointerValue<'ctx>, CodegenError> {
        let (elem, base) = self.buffer_base(param);
        // `lane + rest` (the library puts a vector loop's variable first): the
        // element of `rest` first, then the lane, as two GEPs. One GEP of the sum
        // loses the lane's stride when `rest` is a multiple of a power of two
        // that covers the lane's range: InstCombine turns the add into an
        // `or disjoint`, which the loop vectorizer's dependence analysis does not
        // read as an add, and each lane is then loaded alone (bf16 and f16 panels
        // at k = 2048: 16 scalar loads and inserts per vector).
        if let Expr::Bin(BinOp::Add, lane, rest) = index {
            if matches!(**lane, Expr::Var(_)) {
                let rest = self.expr(rest)?.into_int_value();
                let lane = self.expr(lane)?.into_int_value();
                // SAFETY: kernels index within their buffers (checked by the kernel interpreter in tests).
                let row = unsafe { self.builder.build_in_bounds_gep(elem, base, &[rest], "elem_base") }.map_err(llvm_err)?;
                return unsafe { self.builder.build_in_bounds_gep(elem, row, &[lane], "elem") }.map_err(llvm_err);
            }
        }
        let idx = self.expr(index)?.into_int_value();
        // SAFETY: kernels index within their buffers (checked by the kernel interpreter in tests).
        unsafe { self.builder.build_in_bounds_gep(elem, base, &[idx], "elem") }.map_err(llvm_err)
    }

    /// A parameter's or local's element type and start.
    fn buffer_base(&self, param: u32) -> (BasicTypeEnum<'ctx>, PointerValue<'ctx>) {
        let elem = self.elem(self.kernel.buffer(param).expect("validated").elem);
        let base = if param >= LOCAL_BASE { self.locals[(param - LOCAL_BASE) as usize] } else { self.params[param as usize] };
        (elem, base)
    }

    fn fast(&self, v: BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx> {
        if let Some(inst) = v.as_instruction_value() {
            set_fast(inst);
        }
        v
    }

    /// An LLVM intrinsic overloaded on its first argument's type, with fast-math flags.
    fn intrinsic(&self, name: &str, args: &[BasicValueEnum<'ctx>]) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        Ok(self.fast(self.intrinsic_typed(name, args, &[args[0].get_type()])?))
    }

    fn libm(&self, name: &str, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let f32t = self.context.f32_type();
        let f = self.declared(name, f32t.fn_type(&[f32t.into()], false), Some(Linkage::External));
        let call = self.builder.build_call(f, &[x.into()], name).map_err(llvm_err)?;
        match call.try_as_basic_value() {
            inkwell::values::ValueKind::Basic(v) => Ok(v),
            inkwell::values::ValueKind::Instruction(_) => unreachable!("libm functions return f32"),
        }
    }

    fn expr(&mut self, e: &Expr) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let b = &self.builder;
        Ok(match e {
            Expr::F32(x) => self.context.f32_type().const_float(*x as f64).into(),
            Expr::I64(x) => self.context.i64_type().const_int(*x as u64, true).into(),
            Expr::Var(v) => b.build_load(self.ty(self.kernel.vars[*v as usize]), self.slots[*v as usize], "var").map_err(llvm_err)?,
            Expr::Seq => self.seq.expect("seq is loaded in the entry block"),
            Expr::Load { param, index } => {
                let p = self.element_ptr(*param, index)?;
                let elem = self.kernel.buffer(*param).expect("validated").elem;
                let v = self.builder.build_load(self.elem(elem), p, "ld").map_err(llvm_err)?;
                self.mark_alignment(v.as_instruction_value(), *param, index)?;
                match elem {
                    ElemType::F32 => v,
                    ElemType::I32 => self.builder.build_int_s_extend(v.into_int_value(), self.context.i64_type(), "sext").map_err(llvm_err)?.into(),
                    // bfloat16 is the top half of an f32: zero-extend, shift, reinterpret.
                    ElemType::BF16 => {
                        let wide = self.builder.build_int_z_extend(v.into_int_value(), self.context.i32_type(), "zext").map_err(llvm_err)?;
                        let shifted = self.builder.build_left_shift(wide, self.context.i32_type().const_int(16, false), "shl").map_err(llvm_err)?;
                        self.builder.build_bit_cast(shifted, self.context.f32_type(), "bf16").map_err(llvm_err)?
                    }
                    ElemType::F16 => self.builder.build_float_ext(v.into_float_value(), self.context.f32_type(), "fpext").map_err(llvm_err)?.into(),
                    ElemType::I8 => self.builder.build_int_s_extend(v.into_int_value(), self.context.i64_type(), "sext").map_err(llvm_err)?.into(),
                    ElemType::U8 => self.builder.build_int_z_extend(v.into_int_value(), self.context.i64_type(), "zext").map_err(llvm_err)?.into(),
                }
            }
            Expr::Bin(op, x, y) => {
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                let b = &self.builder;
                if x.is_float_value() {
                    let (x, y) = (x.into_float_value(), y.into_float_value());
                    let v: BasicValueEnum = match op {
                        BinOp::Add => b.build_float_add(x, y, "fadd").map_err(llvm_err)?.into(),
                        BinOp::Sub => b.build_float_sub(x, y, "fsub").map_err(llvm_err)?.into(),
                        BinOp::Mul => b.build_float_mul(x, y, "fmul").map_err(llvm_err)?.into(),
                        BinOp::Div => b.build_float_div(x, y, "fdiv").map_err(llvm_err)?.into(),
                        BinOp::Max => return self.min_max("llvm.maxnum", x, y),
                        BinOp::Min => return self.min_max("llvm.minnum", x, y),
                        BinOp::Rem | BinOp::Shl | BinOp::Shr | BinOp::And => unreachable!("integer-only (validated)"),
                    };
                    self.fast(v)
                } else {
                    let (x, y) = (x.into_int_value(), y.into_int_value());
                    match op {
                        BinOp::Add => b.build_int_nsw_add(x, y, "add").map_err(llvm_err)?.into(),
                        BinOp::Sub => b.build_int_nsw_sub(x, y, "sub").map_err(llvm_err)?.into(),
                        BinOp::Mul => b.build_int_nsw_mul(x, y, "mul").map_err(llvm_err)?.into(),
                        BinOp::Div => b.build_int_signed_div(x, y, "div").map_err(llvm_err)?.into(),
                        BinOp::Rem => b.build_int_signed_rem(x, y, "rem").map_err(llvm_err)?.into(),
                        BinOp::Shl => b.build_left_shift(x, y, "shl").map_err(llvm_err)?.into(),
                        BinOp::Shr => b.build_right_shift(x, y, false, "lshr").map_err(llvm_err)?.into(),
                        BinOp::And => b.build_and(x, y, "and").map_err(llvm_err)?.into(),
                        BinOp::Max | BinOp::Min => {
                            let pred = if *op == BinOp::Max { IntPredicate::SGT } else { IntPredicate::SLT };
                            let c = b.build_int_compare(pred, x, y, "cmp").map_err(llvm_err)?;
                            b.build_select(c, x, y, "sel").map_err(llvm_err)?
                        }
                    }
                }
            }
            Expr::Cmp(op, x, y) => {
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                let b = &self.builder;
                if x.is_float_value() {
                    let pred = match op {
                        CmpOp::Lt => FloatPredicate::OLT,
                        CmpOp::Le => FloatPredicate::OLE,
                        CmpOp::Eq => FloatPredicate::OEQ,
                    };
                    b.build_float_compare(pred, x.into_float_value(), y.into_float_value(), "fcmp").map_err(llvm_err)?.into()
                } else {
                    let pred = match op {
                        CmpOp::Lt => IntPredicate::SLT,
                        CmpOp::Le => IntPredicate::SLE,
                        CmpOp::Eq => IntPredicate::EQ,
                    };
                    b.build_int_compare(pred, x.into_int_value(), y.into_int_value(), "icmp").map_err(llvm_err)?.into()
                }
            }
            // Integer work on bytes (4-bit and fp8 decoding) in 32-bit lanes rather than
            // the IR's 64-bit integers: four times the vector width.
            Expr::Un(UnOp::ToF32, x) if self.narrow(x, false)?.is_some() => {
                let (v, nonneg) = self.narrow(x, false)?.expect("checked");
                let f32t = self.context.f32_type();
                if nonneg {
                    self.builder.build_unsigned_int_to_float(v, f32t, "uitofp").map_err(llvm_err)?.into()
                } else {
                    self.builder.build_signed_int_to_float(v, f32t, "sitofp").map_err(llvm_err)?.into()
                }
            }
            Expr::Un(UnOp::BitsToF32, x) if self.narrow(x, true)?.is_some() => {
                let (v, _) = self.narrow(x, true)?.expect("checked");
                self.builder.build_bit_cast(v, self.context.f32_type(), "bits").map_err(llvm_err)?
            }
            Expr::Un(UnOp::HalfBitsToF32, x) if self.narrow(x, true)?.is_some() => {
                let (v, _) = self.narrow(x, true)?.expect("checked");
                self.half_bits_to_f32(v)?
            }
            Expr::Un(op, x) => {
                let x = self.expr(x)?;
                match op {
                    UnOp::Neg if x.is_float_value() => self.fast(self.builder.build_float_neg(x.into_float_value(), "fneg").map_err(llvm_err)?.into()),
                    UnOp::Neg => self.builder.build_int_neg(x.into_int_value(), "neg").map_err(llvm_err)?.into(),
                    UnOp::Exp if matches!(self.flavor, Flavor::Nvptx) => self.gpu_exp(x)?,
                    UnOp::Cos if matches!(self.flavor, Flavor::Nvptx) => self.gpu_trig("llvm.nvvm.cos.approx.f", x)?,
                    UnOp::Sin if matches!(self.flavor, Flavor::Nvptx) => self.gpu_trig("llvm.nvvm.sin.approx.f", x)?,
                    UnOp::Tanh if matches!(self.flavor, Flavor::Nvptx) => self.gpu_tanh(x)?,
                    UnOp::Exp => self.intrinsic("llvm.exp", &[x])?,
                    UnOp::Sqrt => self.intrinsic("llvm.sqrt", &[x])?,
                    UnOp::Cos => self.intrinsic("llvm.cos", &[x])?,
                    UnOp::Sin => self.intrinsic("llvm.sin", &[x])?,
                    UnOp::Tanh => self.libm("tanhf", x)?,
                    UnOp::ToF32 => self.builder.build_signed_int_to_float(x.into_int_value(), self.context.f32_type(), "sitofp").map_err(llvm_err)?.into(),
                    UnOp::Floor => self.intrinsic("llvm.floor", &[x])?,
                    // In 32-bit lanes (defined below 2^31, `UnOp::ToI64`): `vcvttps2dq`.
                    UnOp::ToI64 => {
                        let narrow = self.builder.build_float_to_signed_int(x.into_float_value(), self.context.i32_type(), "fptosi").map_err(llvm_err)?;
                        self.builder.build_int_s_extend(narrow, self.context.i64_type(), "sext").map_err(llvm_err)?.into()
                    }
                    UnOp::BitsToF32 => {
                        let low = self.builder.build_int_truncate(x.into_int_value(), self.context.i32_type(), "low").map_err(llvm_err)?;
                        self.builder.build_bit_cast(low, self.context.f32_type(), "bits").map_err(llvm_err)?
                    }
                    UnOp::HalfBitsToF32 => self.half_bits_to_f32(x.into_int_value())?,
                }
            }
            Expr::Select(c, x, y) => {
                let c = self.expr(c)?.into_int_value();
                let (x, y) = (self.expr(x)?, self.expr(y)?);
                self.builder.build_select(c, x, y, "select").map_err(llvm_err)?
            }
        })
    }
}

impl<'ctx> KernelLowering<'_, 'ctx> {
    /// The half whose bits are the low 16 bits of `bits` (any integer width),
    /// widened to f32: `vcvtph2ps` on x86 with F16C, `cvt.f32.f16` on NVPTX.
    fn half_bits_to_f32(&mut self, bits: inkwell::values::IntValue<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let low = self.builder.build_int_truncate(bits, self.context.i16_type(), "half_bits").map_err(llvm_err)?;
        let half = self.builder.build_bit_cast(low, self.context.f16_type(), "half").map_err(llvm_err)?;
        Ok(self.builder.build_float_ext(half.into_float_value(), self.context.f32_type(), "fpext").map_err(llvm_err)?.into())
    }

    /// `e` computed in i32 when that gives the same result as the IR's i64:
    /// byte loads and, for non-negative values, `and` / `shr` by constants; when
    /// only the low 32 bits matter (`low_bits`: a bitcast to f32 follows), also
    /// `shl` / `add` / `sub` / `mul`, whose low bits depend only on low bits.
    /// Returns the value and whether it is known non-negative; `None` when `e`
    /// is not of that form. Builds no instructions unless it succeeds.
    fn narrow(&mut self, e: &Expr, low_bits: bool) -> Result<Option<(inkwell::values::IntValue<'ctx>, bool)>, CodegenError> {
        if !self.narrowable(e, low_bits) {
            return Ok(None);
        }
        let i32t = self.context.i32_type();
        Ok(Some(match e {
            Expr::I64(c) => (i32t.const_int(*c as u64, true), *c >= 0),
            Expr::Load { param, index } => {
                let elem = self.kernel.buffer(*param).expect("validated").elem;
                let p = self.element_ptr(*param, index)?;
                let raw = self.builder.build_load(self.context.i8_type(), p, "byte").map_err(llvm_err)?;
                self.mark_alignment(raw.as_instruction_value(), *param, index)?;
                let raw = raw.into_int_value();
                match elem {
                    ElemType::I8 => (self.builder.build_int_s_extend(raw, i32t, "sext").map_err(llvm_err)?, false),
                    _ => (self.builder.build_int_z_extend(raw, i32t, "zext").map_err(llvm_err)?, true),
                }
            }
            Expr::Un(UnOp::ToI64, x) => {
                let x = self.expr(x)?.into_float_value();
                (self.builder.build_float_to_signed_int(x, i32t, "fptosi").map_err(llvm_err)?, false)
            }
            Expr::Bin(op, a, b) => {
                let high_bits_matter = matches!(op, BinOp::Shr);
                let (x, xn) = self.narrow(a, low_bits && !high_bits_matter)?.expect("checked");
                let (y, yn) = self.narrow(b, low_bits && !high_bits_matter)?.expect("checked");
                let bld = &self.builder;
                match op {
                    BinOp::And => (bld.build_and(x, y, "and").map_err(llvm_err)?, xn || yn),
                    BinOp::Shr => (bld.build_right_shift(x, y, false, "lshr").map_err(llvm_err)?, true),
                    BinOp::Shl => (bld.build_left_shift(x, y, "shl").map_err(llvm_err)?, false),
                    BinOp::Add => (bld.build_int_add(x, y, "add").map_err(llvm_err)?, false),
                    BinOp::Sub => (bld.build_int_sub(x, y, "sub").map_err(llvm_err)?, false),
                    BinOp::Mul => (bld.build_int_mul(x, y, "mul").map_err(llvm_err)?, false),
                    _ => unreachable!("narrowable checked the operator"),
                }
            }
            _ => unreachable!("narrowable checked the form"),
        }))
    }

    /// Whether [`KernelLowering::narrow`] applies to `e`.
    fn narrowable(&self, e: &Expr, low_bits: bool) -> bool {
        match e {
            Expr::I64(c) => low_bits || i32::try_from(*c).is_ok(),
            Expr::Load { param, .. } => matches!(self.kernel.buffer(*param).map(|b| b.elem), Some(ElemType::I8 | ElemType::U8)),
            // Exact in i32 (`UnOp::ToI64` is defined below 2^31 only).
            Expr::Un(UnOp::ToI64, _) => true,
            Expr::Bin(BinOp::And, a, b) => self.narrowable(a, low_bits) && self.narrowable(b, low_bits),
            // A logical shift of a non-negative value that fits in i32 is the same in
            // both widths; the shifted value's high bits matter, so it must fit.
            Expr::Bin(BinOp::Shr, a, b) => self.nonneg_narrow(a) && matches!(**b, Expr::I64(0..=31)),
            Expr::Bin(BinOp::Shl | BinOp::Add | BinOp::Sub | BinOp::Mul, a, b) => low_bits && self.narrowable(a, true) && self.narrowable(b, true),
            _ => false,
        }
    }

    /// Narrowable without truncation and known non-negative.
    fn nonneg_narrow(&self, e: &Expr) -> bool {
        match e {
            Expr::Load { param, .. } => matches!(self.kernel.buffer(*param).map(|b| b.elem), Some(ElemType::U8)),
            Expr::Bin(BinOp::And, a, b) => {
                // A non-negative constant mask is itself `nonneg_narrow`.
                (self.nonneg_narrow(a) && self.narrowable(b, false)) || (self.nonneg_narrow(b) && self.narrowable(a, false))
            }
            Expr::Bin(BinOp::Shr, ..) => self.narrowable(e, false),
            Expr::I64(c) => (0..=i32::MAX as i64).contains(c),
            _ => false,
        }
    }
}

fn set_fast(inst: InstructionValue<'_>) {
    if inst.can_use_fast_math_flags() {
        let flags = FastMathFlags::AllowReassoc | FastMathFlags::AllowContract | FastMathFlags::NoSignedZeros;
        inst.set_fast_math_flags(flags).expect("checked can_use_fast_math_flags");
    }
}

/// A constant `<n x i32>` shuffle mask with element `i` equal to `f(i)`.
fn shuffle_mask<'ctx>(context: &'ctx Context, f: &dyn Fn(u32) -> u32, n: u32) -> inkwell::values::VectorValue<'ctx> {
    let i32t = context.i32_type();
    inkwell::types::VectorType::const_vector(&(0..n).map(|i| i32t.const_int(f(i) as u64, false)).collect::<Vec<_>>())
}

/// Whether statements `body` (and the loops in them) convert halves to f32.
fn converts_halves(kernel: &Kernel, body: &[Stmt]) -> bool {
    let half = |p: u32| kernel.buffer(p).is_some_and(|b| b.elem == ElemType::F16);
    let converts = |e: &Expr| e.applies(UnOp::HalfBitsToF32) || e.loads(&half);
    body.iter().any(|s| match s {
        Stmt::Set { value, .. } => converts(value),
        Stmt::Store { param, index, value } => half(*param) || converts(index) || converts(value),
        Stmt::For { body, .. } | Stmt::If { then: body, .. } => converts_halves(kernel, body),
        Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::Prefetch { .. } => false,
    })
}
