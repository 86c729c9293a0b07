//! The GPU mapping of a kernel: a group of threads per task ([`WARP`], or
//! [`GROUP`] = four warps, one thread block, when a split loop is long), or one
//! thread per task for kernels with no loop to deal to lanes ([`GpuMapping`],
//! recorded per kernel in the artifact as `gpu_threads_per_task`).
//!
//! Everything a task does runs on all its threads alike (the same values, so
//! stores outside split loops write the same value to the same place), except
//! the `Vectorize` loops this analysis marks [`LoopMapping::Lanes`]: their
//! iterations are dealt to the task's threads ("lanes"), which is what turns a
//! GEMV row into coalesced loads. A loop qualifies when each iteration only
//!
//! - stores to kernel parameters (global memory; never to the task's local
//!   arrays, which every lane must keep identical), and
//! - updates f32 reduction variables, `acc = acc + e` or `acc = max(acc, e)`,
//!   each variable updated once and read nowhere else in the loop.
//!
//! Lanes take iterations in chunks of `chunk` consecutive ones: [`VECTOR`] when
//! every global access that depends on the loop variable is `var + offset` with
//! the loop start and the offset provably multiples of [`VECTOR`] (so the
//! chunk's loads are one aligned 16-byte vector load, `ld.global.v4.f32`), else
//! one. Lane `l` of `T` runs chunks `l, l + T, ...` of the whole chunks, and the
//! `(end - start) % chunk` iterations left over go to lanes `0, 1, ...`.
//!
//! After such a loop every lane combines its partial results: a butterfly of warp
//! shuffles (so all lanes of a warp hold the warp's total) and, with four warps,
//! the four totals through shared memory, added in warp order. The task's
//! threads synchronize (`bar.warp.sync`, or `bar.sync` for a group) before any
//! lane reads what another lane stored. Nested loops and loops that write locals
//! or other scalars run on all lanes alike ([`LoopMapping::Redundant`]).
//!
//! The LLVM NVPTX lowering and [`crate::interp::run_warp`] (the reference for
//! this mapping) both read [`gpu_mapping`], whose loops are indexed by the
//! pre-order position of each `For` in the kernel body.

use std::collections::HashSet;

use crate::ir::*;

/// Threads per warp.
pub const WARP: i64 = 32;
/// Threads per task when a split loop is long: four warps, one thread block.
pub const GROUP: i64 = 128;
/// A split loop with a constant trip count of at least this gets [`GROUP`] threads.
pub const LONG_LOOP: i64 = 1024;
/// Consecutive iterations per lane in loops whose accesses allow vector loads.
pub const VECTOR: i64 = 4;

/// How one loop runs on a task's threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoopMapping {
    /// Every lane runs every iteration.
    Redundant,
    /// Iterations are dealt to lanes in chunks of `chunk` consecutive ones;
    /// `reductions` are combined across the task after the loop; `stores` says
    /// whether the loop writes memory (then the task's threads synchronize after it).
    Lanes { reductions: Vec<(VarId, BinOp)>, stores: bool, chunk: i64 },
}

/// A kernel's whole GPU mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuMapping {
    /// Threads per task: 1, [`WARP`] or [`GROUP`].
    pub threads: u32,
    /// The mapping of every `For` of the body, in pre-order.
    pub loops: Vec<LoopMapping>,
}

/// The GPU mapping of `kernel`.
pub fn gpu_mapping(kernel: &Kernel) -> GpuMapping {
    let aligned = aligned_vars(kernel);
    let mut loops = Vec::new();
    let mut long = false;
    visit(kernel, &kernel.body, &aligned, &mut loops, &mut long);
    let threads = if !loops.iter().any(|m| matches!(m, LoopMapping::Lanes { .. })) {
        // 32 redundant lanes would only repeat the work (the block and panel matmuls).
        1
    } else if long {
        GROUP as u32
    } else {
        WARP as u32
    };
    GpuMapping { threads, loops }
}

/// The mapping of every `For` of `kernel`'s body, in pre-order.
pub fn loop_mappings(kernel: &Kernel) -> Vec<LoopMapping> {
    gpu_mapping(kernel).loops
}

fn visit(kernel: &Kernel, stmts: &[Stmt], aligned: &HashSet<VarId>, out: &mut Vec<LoopMapping>, long: &mut bool) {
    for s in stmts {
        match s {
            Stmt::For { hint, body, var, start, end } => {
                let mapping = if *hint == LoopHint::Vectorize { classify(kernel, *var, start, body, aligned) } else { LoopMapping::Redundant };
                if let (LoopMapping::Lanes { .. }, Expr::I64(a), Expr::I64(b)) = (&mapping, start, end) {
                    *long |= b - a >= LONG_LOOP;
                }
                out.push(mapping);
                visit(kernel, body, aligned, out, long);
            }
            Stmt::If { then, .. } => visit(kernel, then, aligned, out, long),
            Stmt::Set { .. } | Stmt::Store { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } | Stmt::Prefetch { .. } => {}
        }
    }
}

/// Whether the loop over `var` with `body` can be dealt to lanes, and how.
fn classify(kernel: &Kernel, var: VarId, start: &Expr, body: &[Stmt], aligned: &HashSet<VarId>) -> LoopMapping {
    let mut reductions: Vec<(VarId, BinOp)> = Vec::new();
    let mut stores = false;
    if !scan(kernel, body, &mut reductions, &mut stores) {
        return LoopMapping::Redundant;
    }
    // A reduction variable must not be read anywhere else in the loop.
    for &(r, _) in &reductions {
        let mut reads = 0;
        count_reads(body, r, &mut reads);
        if reads != 1 {
            return LoopMapping::Redundant;
        }
    }
    let chunk = if multiple_of_vector(start, aligned) && accesses_allow_vectors(body, var, aligned) { VECTOR } else { 1 };
    LoopMapping::Lanes { reductions, stores, chunk }
}

/// Integer variables that provably hold multiples of [`VECTOR`]: every `Set` of
/// them assigns such a multiple (an optimistic fixed point; loop and task
/// variables are excluded, they step by one).
fn aligned_vars(kernel: &Kernel) -> HashSet<VarId> {
    let mut sets = Vec::new();
    let mut excluded = HashSet::from([kernel.task_var]);
    collect_sets(&kernel.body, &mut sets, &mut excluded);
    let mut known: HashSet<VarId> = sets.iter().map(|(v, _)| *v).filter(|v| !excluded.contains(v) && kernel.vars[*v as usize] == ValType::I64).collect();
    loop {
        let before = known.len();
        for (v, e) in &sets {
            if known.contains(v) && !multiple_of_vector(e, &known) {
                known.remove(v);
            }
        }
        if known.len() == before {
            return known;
        }
    }
}

fn collect_sets<'k>(stmts: &'k [Stmt], sets: &mut Vec<(VarId, &'k Expr)>, loop_vars: &mut HashSet<VarId>) {
    for s in stmts {
        match s {
            Stmt::Set { var, value } => sets.push((*var, value)),
            Stmt::For { var, body, .. } => {
                loop_vars.insert(*var);
                collect_sets(body, sets, loop_vars);
            }
            Stmt::If { then, .. } => collect_sets(then, sets, loop_vars),
            Stmt::Store { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } | Stmt::Prefetch { .. } => {}
        }
    }
}

/// Whether integer expression `e` is provably a multiple of [`VECTOR`].
fn multiple_of_vector(e: &Expr, aligned: &HashSet<VarId>) -> bool {
    match e {
        Expr::I64(c) => c % VECTOR == 0,
        Expr::Var(x) => aligned.contains(x),
        Expr::Bin(BinOp::Mul, a, b) => multiple_of_vector(a, aligned) || multiple_of_vector(b, aligned),
        Expr::Bin(BinOp::Add | BinOp::Sub, a, b) => multiple_of_vector(a, aligned) && multiple_of_vector(b, aligned),
        Expr::Bin(BinOp::Shl, a, b) => multiple_of_vector(a, aligned) || matches!(**b, Expr::I64(2..=62)),
        _ => false,
    }
}

/// Whether every global access in `stmts` that depends on `var` is at
/// `var + offset` with `offset` a multiple of [`VECTOR`] not depending on `var`.
fn accesses_allow_vectors(stmts: &[Stmt], var: VarId, aligned: &HashSet<VarId>) -> bool {
    let access = |buf: Buf, index: &Expr| -> bool {
        if matches!(buf, Buf::Local(_)) || !index.mentions(var) {
            return true;
        }
        match index {
            Expr::Var(x) => *x == var,
            Expr::Bin(BinOp::Add, a, b) => {
                let is_var = |e: &Expr| matches!(e, Expr::Var(x) if *x == var);
                (is_var(a) && !b.mentions(var) && multiple_of_vector(b, aligned)) || (is_var(b) && !a.mentions(var) && multiple_of_vector(a, aligned))
            }
            _ => false,
        }
    };
    fn expr_ok(e: &Expr, access: &dyn Fn(Buf, &Expr) -> bool) -> bool {
        match e {
            Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => true,
            Expr::Load { buf, index } => access(*buf, index) && expr_ok(index, access),
            Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => expr_ok(a, access) && expr_ok(b, access),
            Expr::Un(_, a) => expr_ok(a, access),
            Expr::Select(c, a, b) | Expr::MulAdd(c, a, b) => expr_ok(c, access) && expr_ok(a, access) && expr_ok(b, access),
        }
    }
    stmts.iter().all(|s| match s {
        Stmt::Set { value, .. } => expr_ok(value, &access),
        Stmt::Store { buf, index, value } => access(*buf, index) && expr_ok(index, &access) && expr_ok(value, &access),
        Stmt::If { cond, then } => expr_ok(cond, &access) && accesses_allow_vectors(then, var, aligned),
        // Emits nothing on the GPU.
        Stmt::Prefetch { .. } => true,
        Stmt::For { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } => false,
    })
}

fn scan(kernel: &Kernel, stmts: &[Stmt], reductions: &mut Vec<(VarId, BinOp)>, stores: &mut bool) -> bool {
    for s in stmts {
        match s {
            // A dot writes a local, which every lane must keep identical.
            Stmt::For { .. } | Stmt::DotBlock { .. } | Stmt::DotRows(_) | Stmt::PairDot { .. } | Stmt::WidenBf16 { .. } => return false,
            Stmt::Store { buf, .. } => {
                if matches!(buf, Buf::Local(_)) {
                    return false;
                }
                *stores = true;
            }
            Stmt::Set { var, value } => {
                let Expr::Bin(op @ (BinOp::Add | BinOp::Max), a, b) = value else { return false };
                let is_acc = |e: &Expr| matches!(e, Expr::Var(x) if x == var);
                if !(is_acc(a) || is_acc(b)) || kernel.vars[*var as usize] != ValType::F32 || reductions.iter().any(|(r, _)| r == var) {
                    return false;
                }
                reductions.push((*var, *op));
            }
            Stmt::If { then, .. } => {
                if !scan(kernel, then, reductions, stores) {
                    return false;
                }
            }
            Stmt::Prefetch { .. } => {}
        }
    }
    true
}

fn count_reads(stmts: &[Stmt], var: VarId, n: &mut usize) {
    for s in stmts {
        match s {
            Stmt::Set { value, .. } => count_expr(value, var, n),
            Stmt::Store { index, value, .. } => {
                count_expr(index, var, n);
                count_expr(value, var, n);
            }
            Stmt::For { start, end, body, .. } => {
                count_expr(start, var, n);
                count_expr(end, var, n);
                count_reads(body, var, n);
            }
            Stmt::If { cond, then } => {
                count_expr(cond, var, n);
                count_reads(then, var, n);
            }
            Stmt::Prefetch { .. } => {}
            Stmt::DotBlock { scales, w_start, act_start, .. } => {
                for e in scales.iter().chain([w_start, act_start]) {
                    count_expr(e, var, n);
                }
            }
            Stmt::PairDot { w_start, act_start, .. } => {
                count_expr(w_start, var, n);
                count_expr(act_start, var, n);
            }
            Stmt::WidenBf16 { start, .. } => count_expr(start, var, n),
            Stmt::DotRows(d) => {
                let low = match &d.act_levels {
                    ActLevels::Planes { low } => Some(low),
                    _ => None,
                };
                for e in d.act_scales.iter().chain([&d.w_start, &d.act_start]).chain(low).chain(d.half_sums.as_ref().map(|(_, e)| e)) {
                    count_expr(e, var, n);
                }
                for r in d.per_row() {
                    for (_, e) in std::iter::once(&r.values).chain(&r.factors) {
                        count_expr(e, var, n);
                    }
                }
            }
        }
    }
}

fn count_expr(e: &Expr, var: VarId, n: &mut usize) {
    match e {
        Expr::Var(v) if *v == var => *n += 1,
        Expr::F32(_) | Expr::I64(_) | Expr::Var(_) | Expr::Seq => {}
        Expr::Load { index, .. } => count_expr(index, var, n),
        Expr::Bin(_, a, b) | Expr::Cmp(_, a, b) => {
            count_expr(a, var, n);
            count_expr(b, var, n);
        }
        Expr::Un(_, a) => count_expr(a, var, n),
        Expr::Select(c, a, b) | Expr::MulAdd(c, a, b) => {
            count_expr(c, var, n);
            count_expr(a, var, n);
            count_expr(b, var, n);
        }
    }
}

/// GPU threads per task (see [`GpuMapping::threads`]).
pub fn threads_per_task(kernel: &Kernel) -> u32 {
    gpu_mapping(kernel).threads
}

/// How many tasks of a GPU form with `gpu` tasks make one task of the kernel
/// with `cpu` tasks: the `m >= 1` with `gpu = m * cpu` (every sequence length),
/// or `None` when there is no such whole number. A launch of the kernel then runs
/// `m` times its tasks on the GPU (the kernel table's `gpu_task_split`).
pub fn task_split(cpu: &TaskCount, gpu: &TaskCount) -> Option<u32> {
    let m = match (cpu.per_seq, cpu.fixed) {
        (0, 0) => return (gpu.per_seq == 0 && gpu.fixed == 0).then_some(1),
        (0, f) => gpu.fixed / f,
        (p, _) => gpu.per_seq / p,
    };
    (m >= 1 && m <= u32::MAX as u64 && gpu.per_seq == m * cpu.per_seq && gpu.fixed == m * cpu.fixed).then_some(m as u32)
}

/// The identity of a reduction: what each lane's partial starts from.
pub fn identity(op: BinOp) -> f32 {
    match op {
        BinOp::Max => f32::NEG_INFINITY,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn task_splits_are_whole_multiples_at_every_length() {
        use super::task_split;
        use crate::ir::TaskCount;
        let t = |per_seq, fixed| TaskCount { per_seq, fixed };
        assert_eq!(task_split(&t(1, 0), &t(1, 0)), Some(1));
        assert_eq!(task_split(&t(1, 0), &t(32, 0)), Some(32));
        assert_eq!(task_split(&t(0, 3), &t(0, 12)), Some(4));
        assert_eq!(task_split(&t(2, 1), &t(8, 4)), Some(4));
        // Not a multiple at every length, fewer tasks, or a fraction.
        assert_eq!(task_split(&t(2, 1), &t(8, 3)), None);
        assert_eq!(task_split(&t(4, 0), &t(2, 0)), None);
        assert_eq!(task_split(&t(2, 0), &t(3, 0)), None);
        assert_eq!(task_split(&t(1, 0), &t(0, 1)), None);
    }

    use super::*;
    use crate::ir::dsl::*;
    use crate::library::matmul::matmul;
    use crate::library::rms_norm::rms_norm;
    use crate::library::SeqMode;

    #[test]
    fn gemv_rows_and_norm_sums_are_dealt_to_lanes() {
        let k = matmul(64, 16, ElemType::F32, SeqMode::Fixed(1));
        let m = loop_mappings(&k);
        assert_eq!(threads_per_task(&k), WARP as u32);
        let lanes: Vec<_> = m.iter().filter(|l| matches!(l, LoopMapping::Lanes { .. })).collect();
        assert!(!lanes.is_empty(), "the k loop of a row-major GEMV is split: {m:?}");
        assert!(lanes.iter().all(|l| matches!(l, LoopMapping::Lanes { reductions, stores: false, chunk: VECTOR } if !reductions.is_empty())), "{m:?}");
        let n = loop_mappings(&rms_norm(64, 64, 1e-5, SeqMode::Fixed(1)));
        // The sum of squares is a reduction; the scaled store is a map.
        assert!(n.contains(&LoopMapping::Lanes { reductions: vec![], stores: true, chunk: VECTOR }), "{n:?}");
        assert!(n.iter().any(|l| matches!(l, LoopMapping::Lanes { reductions, .. } if reductions.len() == 1)), "{n:?}");
    }

    #[test]
    fn vector_chunks_need_provably_aligned_offsets_and_long_loops_get_a_group() {
        // k = 6: row offsets j * 6 are not multiples of 4, so no vector loads.
        let odd = gpu_mapping(&matmul(6, 16, ElemType::F32, SeqMode::Fixed(1)));
        assert_eq!(odd.threads, WARP as u32);
        assert!(odd.loops.iter().all(|l| !matches!(l, LoopMapping::Lanes { chunk, .. } if *chunk != 1)), "{odd:?}");
        // A 1536-long row: four warps per task, vector chunks.
        let long = gpu_mapping(&matmul(1536, 16, ElemType::F32, SeqMode::Fixed(1)));
        assert_eq!(long.threads, GROUP as u32);
        assert!(long.loops.iter().any(|l| matches!(l, LoopMapping::Lanes { chunk: VECTOR, .. })), "{long:?}");
        // An access at 2 * var is not contiguous: chunk 1.
        let mut b = KernelBuilder::new();
        let x = b.param("x", ElemType::F32, false);
        let out = b.param("out", ElemType::F32, true);
        let (t, l, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
        let body = vec![set(acc, f(0.0)), for_vec(l, i(0), i(64), vec![set(acc, add(v(acc), ld(x, mul(v(l), i(2)))))]), store(out, v(t), v(acc))];
        let k = b.finish("strided".into(), "test", TaskCount { per_seq: 0, fixed: 1 }, t, body);
        assert_eq!(loop_mappings(&k), vec![LoopMapping::Lanes { reductions: vec![(acc, BinOp::Add)], stores: false, chunk: 1 }]);
    }

    #[test]
    fn loops_that_write_locals_or_read_their_accumulator_stay_redundant() {
        let mut b = KernelBuilder::new();
        let out = b.param("out", ElemType::F32, true);
        let (t, l, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
        let local = b.local(8);
        let body = vec![
            for_vec(l, i(0), i(8), vec![store(local, v(l), f(1.0))]),
            set(acc, f(0.0)),
            // Reads the accumulator in the store too: not a pure reduction.
            for_vec(l, i(0), i(8), vec![set(acc, add(v(acc), f(1.0))), store(out, v(l), v(acc))]),
            for_(l, i(0), i(8), vec![set(acc, add(v(acc), f(1.0)))]),
        ];
        let k = b.finish("k".into(), "test", TaskCount { per_seq: 0, fixed: 1 }, t, body);
        assert_eq!(loop_mappings(&k), vec![LoopMapping::Redundant; 3]);
        assert_eq!(threads_per_task(&k), 1, "nothing to share: one thread per task");
    }
}
