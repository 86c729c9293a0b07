//! The NVPTX-only part of the lowering: the GPU's task and lane indices, loops
//! dealt to a task's lanes (`maxc_kernels::warp`), their reductions by warp
//! shuffles and shared memory, barriers, and the transcendental functions from
//! PTX's approximate instructions (the GPU has no libm).

use super::*;

impl<'a, 'ctx> KernelLowering<'a, 'ctx> {
    /// The kernel's body as one GPU task's share: `T` threads per task (1, a
    /// warp, or a block of four warps, as the mapping says), task =
    /// `task_begin + (ctaid.x * ntid.x + tid.x) / T`, lane = `tid.x % T` (blocks
    /// hold whole tasks); threads past `task_end` return.
    pub(super) fn lower_gpu_task(&mut self, begin: inkwell::values::IntValue<'ctx>, end: inkwell::values::IntValue<'ctx>) -> Result<(), CodegenError> {
        let i64t = self.context.i64_type();
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
        Ok(())
    }

    /// An NVVM intrinsic taking and returning f32 (`llvm.nvvm.ex2.approx.f`, ...).
    pub(super) fn nvvm(&self, name: &str, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let f32t = self.context.f32_type();
        let f = self.declared(name, f32t.fn_type(&[f32t.into()], false), None);
        let call = self.builder.build_call(f, &[x.into()], "nvvm").map_err(llvm_err)?;
        let inkwell::values::ValueKind::Basic(v) = call.try_as_basic_value() else { unreachable!("nvvm math returns f32") };
        Ok(v)
    }

    /// `exp(x)`: `2^(x log2 e)` with PTX `ex2.approx` (relative error about 2^-22).
    pub(super) fn gpu_exp(&self, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let scaled = self.fop(BinOp::Mul, x, self.f32c(std::f32::consts::LOG2_E))?;
        self.nvvm("llvm.nvvm.ex2.approx.f", scaled)
    }

    /// `sin` / `cos` with the argument reduced to [-pi, pi] first: PTX `sin.approx`
    /// is accurate there (about 2^-21) and loses accuracy beyond; RoPE angles reach
    /// thousands of radians.
    pub(super) fn gpu_trig(&self, name: &str, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        use std::f32::consts::TAU;
        let turns = self.fop(BinOp::Mul, x, self.f32c(1.0 / TAU))?;
        let rounded = self.intrinsic("llvm.rint", &[turns])?;
        let reduced = self.fop(BinOp::Sub, x, self.fop(BinOp::Mul, rounded, self.f32c(TAU))?)?;
        self.nvvm(name, reduced)
    }

    /// `tanh(x) = sign(x) (1 - e) / (1 + e)` with `e = exp(-2 |x|)` (no overflow).
    pub(super) fn gpu_tanh(&self, x: BasicValueEnum<'ctx>) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let ax = self.intrinsic("llvm.fabs", &[x])?;
        let e = self.gpu_exp(self.fop(BinOp::Mul, ax, self.f32c(-2.0))?)?;
        let t = self.fop(BinOp::Div, self.fop(BinOp::Sub, self.f32c(1.0), e)?, self.fop(BinOp::Add, self.f32c(1.0), e)?)?;
        self.intrinsic("llvm.copysign", &[t, x])
    }

    /// A loop dealt to the task's lanes (`maxc_kernels::warp`): lane `l` runs chunks
    /// `l, l + T, ...` of `chunk` consecutive iterations (the chunk's body emitted
    /// `chunk` times, its first global accesses marked 16-byte aligned so that they
    /// become vector loads), then leftover iteration `l` if any; each lane has its
    /// own partial of the reductions, combined across the task afterwards.
    pub(super) fn lower_lane_loop(
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

    /// Synchronizes the task's threads: `bar.warp.sync` for a warp, `bar.sync 0`
    /// for a block of warps (a task is then the whole block).
    pub(super) fn task_barrier(&self) -> Result<(), CodegenError> {
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
    pub(super) fn task_reduce(&self, r: VarId, op: BinOp) -> Result<inkwell::values::FloatValue<'ctx>, CodegenError> {
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
    pub(super) fn warp_reduce(&self, r: VarId, op: BinOp) -> Result<inkwell::values::FloatValue<'ctx>, CodegenError> {
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
}
