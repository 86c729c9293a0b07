//! The GPU mapping of a kernel: one warp ([`WARP`] threads) per task, or one
//! thread per task for kernels with no loop to deal to lanes
//! ([`threads_per_task`], recorded per kernel in the artifact).
//!
//! Everything a task does runs on all lanes of its warp alike (the same values,
//! so stores outside split loops write the same value to the same place), except
//! the `Vectorize` loops this analysis marks [`LoopMapping::Lanes`]: their
//! iterations are dealt to the lanes (iteration `start + lane + 32 m`), which is
//! what turns a GEMV row into coalesced loads. A loop qualifies when each
//! iteration only
//!
//! - stores to kernel parameters (global memory; never to the task's local
//!   arrays, which every lane must keep identical), and
//! - updates f32 reduction variables, `acc = acc + e` or `acc = max(acc, e)`,
//!   each variable updated once and read nowhere else in the loop.
//!
//! After such a loop every lane combines its partial results with a butterfly of
//! warp shuffles (so all lanes hold the total), and the warp synchronizes before
//! any lane reads what another lane stored. Nested loops and loops that write
//! locals or other scalars run on all lanes alike ([`LoopMapping::Redundant`]).
//!
//! The LLVM NVPTX lowering and [`crate::interp::run_warp`] (the reference for
//! this mapping) both read [`loop_mappings`], indexed by the pre-order position of
//! each `For` in the kernel body.

use crate::ir::*;

/// Threads per warp, and so per task on the GPU.
pub const WARP: i64 = 32;

/// How one loop runs on a warp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoopMapping {
    /// Every lane runs every iteration.
    Redundant,
    /// Iterations are dealt to lanes; `reductions` are combined across the warp
    /// after the loop; `stores` says whether the loop writes memory (then the warp
    /// synchronizes after it).
    Lanes { reductions: Vec<(VarId, BinOp)>, stores: bool },
}

/// The mapping of every `For` of `kernel`'s body, in pre-order.
pub fn loop_mappings(kernel: &Kernel) -> Vec<LoopMapping> {
    let mut out = Vec::new();
    visit(kernel, &kernel.body, &mut out);
    out
}

fn visit(kernel: &Kernel, stmts: &[Stmt], out: &mut Vec<LoopMapping>) {
    for s in stmts {
        match s {
            Stmt::For { hint, body, var, .. } => {
                out.push(if *hint == LoopHint::Vectorize { classify(kernel, *var, body) } else { LoopMapping::Redundant });
                visit(kernel, body, out);
            }
            Stmt::If { then, .. } => visit(kernel, then, out),
            Stmt::Set { .. } | Stmt::Store { .. } => {}
        }
    }
}

/// Whether the loop over `var` with `body` can be dealt to lanes, and how.
fn classify(kernel: &Kernel, _var: VarId, body: &[Stmt]) -> LoopMapping {
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
    LoopMapping::Lanes { reductions, stores }
}

fn scan(kernel: &Kernel, stmts: &[Stmt], reductions: &mut Vec<(VarId, BinOp)>, stores: &mut bool) -> bool {
    for s in stmts {
        match s {
            Stmt::For { .. } => return false,
            Stmt::Store { param, .. } => {
                if *param >= LOCAL_BASE {
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
        Expr::Select(c, a, b) => {
            count_expr(c, var, n);
            count_expr(a, var, n);
            count_expr(b, var, n);
        }
    }
}

/// GPU threads per task: a warp when some loop is dealt to lanes, else one thread
/// (32 redundant lanes would only repeat the work: the block and panel matmuls).
pub fn threads_per_task(kernel: &Kernel) -> u32 {
    if loop_mappings(kernel).iter().any(|m| matches!(m, LoopMapping::Lanes { .. })) {
        WARP as u32
    } else {
        1
    }
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
        assert!(lanes.iter().all(|l| matches!(l, LoopMapping::Lanes { reductions, stores: false } if !reductions.is_empty())));
        let n = loop_mappings(&rms_norm(64, 64, 1e-5, SeqMode::Fixed(1)));
        // The sum of squares is a reduction; the scaled store is a map.
        assert!(n.contains(&LoopMapping::Lanes { reductions: vec![], stores: true }), "{n:?}");
        assert!(n.iter().any(|l| matches!(l, LoopMapping::Lanes { reductions, .. } if reductions.len() == 1)), "{n:?}");
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
