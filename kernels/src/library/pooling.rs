//! Pooling of sentence encoders: the mean over a step's rows (one sequence) or
//! over each sequence's rows of a batch step (`mean_rows_ragged`), and L2
//! normalization of rows (a fixed number, or one per sequence of a batch step,
//! `l2_normalize_rows`).
//!
//! A batch step's sequences are contiguous runs of its rows: sequence `s` is
//! rows `starts[s] .. starts[s + 1]` (`starts: i32[sequences + 1]`, the
//! artifact's `SequenceStarts`). The ragged kernels run one task per sequence
//! and are launched over the step's sequences (the launch's sequence length is
//! their count, `dims[1]`), so their outputs are `[sequences, width]`.
//!
//! No GPU forms: the loops over a row's columns are what a GPU deals to lanes,
//! and a task per row (or per sequence) leaves enough tasks.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `out[0, c] = mean_r x[r, c]` for `x: f32[seq, width]` (one task).
pub fn mean_rows(width: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, r, c) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let w = width as i64;
    let body = vec![
        for_vec(c, i(0), i(w), vec![store(out, v(c), f(0.0))]),
        for_(r, i(0), seq.expr(), vec![for_vec(c, i(0), i(w), vec![store(out, v(c), add(ld(out, v(c)), ld(x, add(mul(v(r), i(w)), v(c)))))])]),
        for_vec(c, i(0), i(w), vec![store(out, v(c), div(ld(out, v(c)), un(UnOp::ToF32, seq.expr())))]),
    ];
    b.finish(format!("mean_rows_w{width}_{}", seq.tag()), "pooling", TaskCount { per_seq: 0, fixed: 1 }, t, body)
}

/// `out[s, c] = mean over rows r of sequence s of x[r, c]`: `x: f32[rows,
/// width]`, `starts: i32[sequences + 1]` -> `out: f32[sequences, width]`. One
/// task per sequence, launched over the step's sequences. The rows are summed
/// in order and the sum divided by their count, as [`mean_rows`] does for one
/// sequence (the same bits for the same rows).
pub fn mean_rows_ragged(width: u64) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let starts = b.param("starts", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, r, c, first, end, o) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let w = width as i64;
    let at = || add(v(o), v(c));
    let body = vec![
        set(first, ld(starts, v(t))),
        set(end, ld(starts, add(v(t), i(1)))),
        set(o, mul(v(t), i(w))),
        for_vec(c, i(0), i(w), vec![store(out, at(), f(0.0))]),
        for_(r, v(first), v(end), vec![for_vec(c, i(0), i(w), vec![store(out, at(), add(ld(out, at()), ld(x, add(mul(v(r), i(w)), v(c)))))])]),
        // A sequence has at least one row (the runtime refuses empty inputs);
        // the guard keeps a malformed table from dividing by zero.
        for_vec(c, i(0), i(w), vec![store(out, at(), div(ld(out, at()), un(UnOp::ToF32, max(sub(v(end), v(first)), i(1)))))]),
    ];
    b.finish(format!("mean_rows_ragged_w{width}_sN"), "pooling", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// Each row of `x: f32[rows, width]` divided by its L2 norm (at least 1e-12), one task per row.
pub fn l2_normalize(width: u64, rows: u64) -> Kernel {
    l2_normalize_in(width, format!("l2_normalize_w{width}_r{rows}"), TaskCount { per_seq: 0, fixed: rows })
}

/// [`l2_normalize`] over the launch's rows: a batch step's sequences
/// (`[sequences, width]`, launched over them), one task each.
pub fn l2_normalize_rows(width: u64) -> Kernel {
    l2_normalize_in(width, format!("l2_normalize_w{width}_sN"), TaskCount { per_seq: 1, fixed: 0 })
}

fn l2_normalize_in(width: u64, name: String, tasks: TaskCount) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let (ss, inv) = (b.var(ValType::F32), b.var(ValType::F32));
    let w = width as i64;
    let xi = || ld(x, add(mul(v(t), i(w)), v(c)));
    let body = vec![
        set(ss, f(0.0)),
        for_vec(c, i(0), i(w), vec![set(ss, add(v(ss), mul(xi(), xi())))]),
        set(inv, div(f(1.0), max(un(UnOp::Sqrt, v(ss)), f(1e-12)))),
        for_vec(c, i(0), i(w), vec![store(out, add(mul(v(t), i(w)), v(c)), mul(xi(), v(inv)))]),
    ];
    b.finish(name, "pooling", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    #[test]
    fn mean_and_l2_normalize() {
        let mut bufs = vec![Buffer::F32(vec![1.0, 2.0, 3.0, 6.0]), Buffer::F32(vec![0.0; 4])];
        run(&mean_rows(2, SeqMode::Dynamic), &mut bufs, 2);
        let Buffer::F32(m) = bufs[1].clone() else { unreachable!() };
        assert_eq!(&m[..2], &[2.0, 4.0]);
        let mut bufs = vec![Buffer::F32(vec![3.0, 4.0]), Buffer::F32(vec![0.0; 2])];
        run(&l2_normalize(2, 1), &mut bufs, 1);
        assert_eq!(bufs[1], Buffer::F32(vec![0.6, 0.8]));
    }

    /// Sequences of 1, 2, 17 and 40 rows in one step: each sequence's mean is
    /// the mean of its own rows (worked out here in f64), serially and as the
    /// GPU deals the column loops to lanes; and it has the bits `mean_rows`
    /// gives that sequence alone. Rows outside every sequence are never read.
    #[test]
    fn ragged_means_pool_each_sequences_own_rows() {
        let (w, lens) = (24usize, [1usize, 2, 17, 40]);
        let mut starts = vec![0i32];
        for n in lens {
            starts.push(starts.last().unwrap() + n as i32);
        }
        let rows = *starts.last().unwrap() as usize;
        // Two poisoned rows past the last sequence.
        let mut x = rand(rows * w, 7);
        x.extend(vec![f32::NAN; 2 * w]);
        let k = mean_rows_ragged(w as u64);
        assert_eq!(k.tasks.eval(lens.len() as u64), lens.len() as u64);
        for lanes in [false, true] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I32(starts.clone()), Buffer::F32(vec![f32::NAN; lens.len() * w])];
            run_as(&k, &mut bufs, lens.len() as u64, lanes);
            let Buffer::F32(got) = &bufs[2] else { unreachable!() };
            for (s, n) in lens.iter().enumerate() {
                let first = starts[s] as usize;
                let want: Vec<f32> = (0..w).map(|c| ((first..first + n).map(|r| x[r * w + c] as f64).sum::<f64>() / *n as f64) as f32).collect();
                close(&got[s * w..(s + 1) * w], &want, 1e-6);
                if !lanes {
                    let mut alone = vec![Buffer::F32(x[first * w..(first + n) * w].to_vec()), Buffer::F32(vec![0.0; w])];
                    run(&mean_rows(w as u64, SeqMode::Dynamic), &mut alone, *n as u64);
                    assert_eq!(alone[1], Buffer::F32(got[s * w..(s + 1) * w].to_vec()), "sequence {s}: the bits of mean_rows");
                }
            }
        }
    }

    /// One task per row of the launch: every row comes out with norm 1 and
    /// its direction, as the fixed-row kernel gives.
    #[test]
    fn l2_normalize_rows_normalizes_every_launched_row() {
        let (w, rows) = (10usize, 5usize);
        let x = rand(rows * w, 3);
        let k = l2_normalize_rows(w as u64);
        assert_eq!(k.tasks.eval(rows as u64), rows as u64);
        for lanes in [false, true] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::F32(vec![f32::NAN; rows * w])];
            run_as(&k, &mut bufs, rows as u64, lanes);
            let Buffer::F32(got) = &bufs[1] else { unreachable!() };
            for r in 0..rows {
                let norm = x[r * w..(r + 1) * w].iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                let want: Vec<f32> = x[r * w..(r + 1) * w].iter().map(|v| (*v as f64 / norm) as f32).collect();
                close(&got[r * w..(r + 1) * w], &want, 1e-6);
            }
        }
        let mut fixed = vec![Buffer::F32(x.clone()), Buffer::F32(vec![0.0; rows * w])];
        run(&l2_normalize(w as u64, rows as u64), &mut fixed, 1);
        let mut dynamic = vec![Buffer::F32(x), Buffer::F32(vec![0.0; rows * w])];
        run(&l2_normalize_rows(w as u64), &mut dynamic, rows as u64);
        assert_eq!(fixed[1], dynamic[1]);
    }
}
