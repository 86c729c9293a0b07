//! Matmul / GEMV: `out[m, n] = x[m, k] @ w[n, k]^T` (Hugging Face `Linear` layout).
//!
//! One task computes a block of [`COLS_PER_TASK`] output columns for every row, so
//! each weight row is streamed from memory once per launch and reused from cache
//! for all rows of a prefill; at decode (`seq = 1`) it is a GEMV.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Output columns (weight rows) per task.
pub const COLS_PER_TASK: u64 = 8;

/// `x: f32[seq, k]`, `w: f32[n, k]` -> `out: f32[seq, n]`.
pub fn matmul(k: u64, n: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, jj, j, r, kk) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let acc = b.var(ValType::F32);
    let (ki, ni) = (k as i64, n as i64);
    let body = vec![for_(
        jj,
        i(0),
        i(COLS_PER_TASK as i64),
        vec![
            set(j, add(mul(v(t), i(COLS_PER_TASK as i64)), v(jj))),
            if_(
                lt(v(j), i(ni)),
                vec![for_(
                    r,
                    i(0),
                    seq.expr(),
                    vec![
                        set(acc, f(0.0)),
                        for_vec(kk, i(0), i(ki), vec![set(acc, add(v(acc), mul(ld(x, add(mul(v(r), i(ki)), v(kk))), ld(w, add(mul(v(j), i(ki)), v(kk))))))]),
                        store(out, add(mul(v(r), i(ni)), v(j)), v(acc)),
                    ],
                )],
            ),
        ],
    )];
    let tasks = TaskCount { per_seq: 0, fixed: n.div_ceil(COLS_PER_TASK) };
    b.finish(format!("matmul_k{k}_n{n}_{}", seq.tag()), "matmul", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    #[test]
    fn matches_naive_matmul_with_ragged_column_blocks() {
        let (m, k, n) = (3usize, 5usize, 11usize);
        let (x, w) = (rand(m * k, 1), rand(n * k, 2));
        let mut bufs = vec![Buffer::F32(x.clone()), Buffer::F32(w.clone()), Buffer::F32(vec![0.0; m * n])];
        run(&matmul(k as u64, n as u64, SeqMode::Dynamic), &mut bufs, m as u64);
        let mut want = vec![0.0; m * n];
        for r in 0..m {
            for j in 0..n {
                want[r * n + j] = (0..k).map(|q| x[r * k + q] * w[j * k + q]).sum();
            }
        }
        let Buffer::F32(got) = &bufs[2] else { unreachable!() };
        close(got, &want, 1e-6);
    }
}
