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
//!
//! This file holds the core (kernels, statements, loops, expressions, memory);
//! `lower/dots.rs` the dot-product idioms of the integer and float matmuls,
//! `lower/nvptx.rs` what only the GPU lowers (tasks and lanes, shuffles, shared
//! memory, barriers, PTX math).

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

mod dots;
mod nvptx;

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
    /// The variables of the loops hinted `Vectorize` being lowered (CPU).
    vector_loops: Vec<VarId>,
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
            vector_loops: vec![],
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
            if matches!(self.flavor, Flavor::Nvptx) {
                // Every GPU buffer starts 16-byte aligned (device allocations, and
                // arena offsets the loader checks): said to LLVM, its load/store
                // vectorizer joins consecutive accesses at offsets it can prove
                // aligned (a GPU lane's 8 quant bytes into one 64-bit load).
                let align = self.context.metadata_node(&[i64t.const_int(16, false).into()]);
                let load = p.as_instruction_value().expect("a load is an instruction");
                load.set_metadata(align, self.context.get_kind_id("align")).map_err(|_| CodegenError::Llvm("align metadata on a buffer pointer".into()))?;
            }
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
            Flavor::Nvptx => self.lower_gpu_task(begin, end)?,
        }
        self.builder.build_return(None).map_err(llvm_err)?;
        Ok(())
    }

    /// The module's declaration of function `name` of type `ty`, added on first use
    /// (NVVM and x86 intrinsics, libm).
    fn declared(&self, name: &str, ty: inkwell::types::FunctionType<'ctx>, linkage: Option<Linkage>) -> FunctionValue<'ctx> {
        self.module.get_function(name).unwrap_or_else(|| self.module.add_function(name, ty, linkage))
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

    fn block(&mut self, stmts: &[Stmt]) -> Result<(), CodegenError> {
        let mut at = 0;
        while at < stmts.len() {
            // A register tile's word-pair row dots of one block: lowered chunk
            // by chunk across its rows (`word_pair_tile`).
            if let Stmt::DotRows(first) = &stmts[at] {
                let mut run = vec![first];
                while let Some(Stmt::DotRows(next)) = stmts.get(at + run.len()) {
                    if !self.word_pairs_share_levels(first, next) {
                        break;
                    }
                    run.push(next);
                }
                if run.len() > 1 {
                    at += run.len();
                    self.word_pair_tile(&run)?;
                    continue;
                }
            }
            self.stmt(&stmts[at])?;
            at += 1;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), CodegenError> {
        match s {
            Stmt::Set { var, value } => {
                let v = self.expr(value)?;
                self.builder.build_store(self.slots[*var as usize], v).map_err(llvm_err)?;
            }
            Stmt::Store { buf, index, value } => {
                let elem = self.kernel.buffer(*buf).expect("validated").elem;
                let v = self.expr(value)?;
                let v: BasicValueEnum = match elem {
                    ElemType::F32 => v,
                    ElemType::I32 | ElemType::I8 => self.builder.build_int_truncate(v.into_int_value(), self.elem(elem).into_int_type(), "trunc").map_err(llvm_err)?.into(),
                    // Round to nearest even: vcvtps2ph with F16C, cvt.rn.f16.f32 on NVPTX.
                    ElemType::F16 => self.builder.build_float_trunc(v.into_float_value(), self.context.f16_type(), "fptrunc").map_err(llvm_err)?.into(),
                    ElemType::BF16 => self.f32_to_bf16_bits(v.into_float_value())?.into(),
                    ElemType::U8 => unreachable!("weight-only parameters are never stored (validated)"),
                };
                let p = self.element_ptr(*buf, index)?;
                let st = self.builder.build_store(p, v).map_err(llvm_err)?;
                self.mark_alignment(Some(st), *buf, index)?;
            }
            Stmt::For { .. } => self.lower_loop(s, None)?,
            Stmt::DotBlock { acc, scales, weights, w_start, form, act, act_start } => self.dot_block(*acc, scales, (*weights, w_start), *form, (*act, act_start))?,
            Stmt::DotRows(d) => self.dot_rows(d)?,
            Stmt::PairDot { acc, weights, w_start, act, act_start } => self.pair_dot(*acc, (*weights, w_start), (*act, act_start))?,
            Stmt::WidenBf16 { dst, weights, start } => self.widen_bf16(*dst, (*weights, start))?,
            Stmt::Prefetch { param, index } => {
                if let Flavor::Cpu(_) = self.flavor {
                    let idx = self.expr(index)?.into_int_value();
                    let (elem, base) = self.buffer_base(Buf::Param(*param));
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
        let Stmt::For { hint, .. } = s else { unreachable!() };
        let vector_loop = *hint == LoopHint::Vectorize;
        if vector_loop {
            self.vector_loops.push(*var);
        }
        self.block(body)?;
        if vector_loop {
            self.vector_loops.pop();
        }
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
    fn mark_alignment(&self, inst: Option<InstructionValue<'ctx>>, buf: Buf, index: &Expr) -> Result<(), CodegenError> {
        let Buf::Param(param) = buf else { return Ok(()) };
        if let Some(inst) = inst {
            self.tag_alias(inst, param)?;
        }
        let (Some(inst), Some((var, u))) = (inst, self.chunk_copy) else { return Ok(()) };
        if !index.mentions(var) {
            return Ok(());
        }
        let size = self.kernel.params[param.index()].elem.size() as u32;
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
    fn tag_alias(&self, inst: InstructionValue<'ctx>, param: ParamId) -> Result<(), CodegenError> {
        let Some(&(scope, others)) = self.alias.get(param.index()) else { return Ok(()) };
        inst.set_metadata(scope, self.context.get_kind_id("alias.scope")).map_err(llvm_err)?;
        inst.set_metadata(others, self.context.get_kind_id("noalias")).map_err(llvm_err)
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

    fn element_ptr(&mut self, buf: impl Into<Buf>, index: &Expr) -> Result<PointerValue<'ctx>, CodegenError> {
        let (elem, base) = self.buffer_base(buf.into());
        // `lane + rest` (the library puts a vector loop's variable first): the
        // element of `rest` first, then the lane, as two GEPs. One GEP of the sum
        // loses the lane's stride when `rest` is a multiple of a power of two
        // that covers the lane's range: InstCombine turns the add into an
        // `or disjoint`, which the loop vectorizer's dependence analysis does not
        // read as an add, and each lane is then loaded alone (bf16 and f16 panels
        // at k = 2048: 16 scalar loads and inserts per vector).
        if let Expr::Bin(BinOp::Add, lane, rest) = index {
            // A strided lane of a vector loop (`var * stride + rest`: one group
            // of values per iteration, quantize_p16's fours) splits the same way.
            let strided = matches!(&**lane, Expr::Bin(BinOp::Mul, var, stride) if matches!((&**var, &**stride), (Expr::Var(v), Expr::I64(_)) if self.vector_loops.contains(v)));
            if matches!(**lane, Expr::Var(_)) || strided {
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
    fn buffer_base(&self, buf: Buf) -> (BasicTypeEnum<'ctx>, PointerValue<'ctx>) {
        let elem = self.elem(self.kernel.buffer(buf).expect("validated").elem);
        let base = match buf {
            Buf::Local(l) => self.locals[l.index()],
            Buf::Param(p) => self.params[p.index()],
        };
        (elem, base)
    }

    fn fast(&self, v: BasicValueEnum<'ctx>) -> BasicValueEnum<'ctx> {
        if let Some(inst) = v.as_instruction_value() {
            set_fast(inst, self.kernel.float_order);
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
            Expr::Load { buf, index } => {
                let p = self.element_ptr(*buf, index)?;
                let elem = self.kernel.buffer(*buf).expect("validated").elem;
                let v = self.builder.build_load(self.elem(elem), p, "ld").map_err(llvm_err)?;
                self.mark_alignment(v.as_instruction_value(), *buf, index)?;
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
            // `llvm.fma` without fast-math flags: fused on every target the
            // code runs on (FMA is in every x86-64 level from v3 and in AArch64).
            Expr::MulAdd(x, y, z) => {
                let (x, y, z) = (self.expr(x)?, self.expr(y)?, self.expr(z)?);
                self.intrinsic_typed("llvm.fma", &[x, y, z], &[x.get_type()])?
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
    /// The bits (an i16) of the bfloat16 nearest `x`, ties to even (as
    /// `vcvtneps2bf16`): the f32's upper half rounded by its lower one, in
    /// integer operations that vectorize on every target (no libcall); a NaN
    /// keeps its sign and upper mantissa bits and is made quiet.
    fn f32_to_bf16_bits(&mut self, x: inkwell::values::FloatValue<'ctx>) -> Result<inkwell::values::IntValue<'ctx>, CodegenError> {
        let (b, i32t) = (&self.builder, self.context.i32_type());
        let c = |v: u64| i32t.const_int(v, false);
        let bits = b.build_bit_cast(x, i32t, "f32_bits").map_err(llvm_err)?.into_int_value();
        let upper = b.build_right_shift(bits, c(16), false, "upper").map_err(llvm_err)?;
        let lsb = b.build_and(upper, c(1), "lsb").map_err(llvm_err)?;
        let rounded = b.build_int_add(bits, c(0x7fff), "bias").map_err(llvm_err)?;
        let rounded = b.build_int_add(rounded, lsb, "ties_even").map_err(llvm_err)?;
        let rounded = b.build_right_shift(rounded, c(16), false, "rounded").map_err(llvm_err)?;
        let quiet = b.build_or(upper, c(0x40), "quiet_nan").map_err(llvm_err)?;
        let is_nan = b.build_float_compare(inkwell::FloatPredicate::UNO, x, x, "is_nan").map_err(llvm_err)?;
        let chosen = b.build_select(is_nan, quiet, rounded, "bf16").map_err(llvm_err)?.into_int_value();
        b.build_int_truncate(chosen, self.context.i16_type(), "bf16_bits").map_err(llvm_err)
    }

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
            Expr::Load { buf, index } => {
                let elem = self.kernel.buffer(*buf).expect("validated").elem;
                let p = self.element_ptr(*buf, index)?;
                let raw = self.builder.build_load(self.context.i8_type(), p, "byte").map_err(llvm_err)?;
                self.mark_alignment(raw.as_instruction_value(), *buf, index)?;
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
            Expr::Load { buf, .. } => matches!(self.kernel.buffer(*buf).map(|b| b.elem), Some(ElemType::I8 | ElemType::U8)),
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
            Expr::Load { buf, .. } => matches!(self.kernel.buffer(*buf).map(|b| b.elem), Some(ElemType::U8)),
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

/// Fast-math flags for a float instruction: no signed zeros; and unless the
/// kernel keeps its float order ([`FloatOrder::Ordered`]), reassociation and
/// contraction (a multiply feeding an add fuses into one FMA). An ordered
/// kernel fuses exactly where it says so (`Expr::MulAdd`): whether LLVM
/// contracts a multiply and an add depends on where both land after its other
/// passes, which differs between kernels that share the statements (an
/// attention row differed in the last bit between prefill and decode).
fn set_fast(inst: InstructionValue<'_>, order: FloatOrder) {
    if inst.can_use_fast_math_flags() {
        let flags = match order {
            FloatOrder::Reassociable => FastMathFlags::AllowReassoc | FastMathFlags::AllowContract | FastMathFlags::NoSignedZeros,
            FloatOrder::Ordered => FastMathFlags::NoSignedZeros,
        };
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
    let half = |b: Buf| kernel.buffer(b).is_some_and(|b| b.elem == ElemType::F16);
    let converts = |e: &Expr| e.applies(UnOp::HalfBitsToF32) || e.loads(&half);
    body.iter().any(|s| match s {
        Stmt::Set { value, .. } => converts(value),
        Stmt::Store { buf, index, value } => half(*buf) || converts(index) || converts(value),
        Stmt::For { body, .. } | Stmt::If { then: body, .. } => converts_halves(kernel, body),
        Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } | Stmt::Prefetch { .. } => false,
    })
}
