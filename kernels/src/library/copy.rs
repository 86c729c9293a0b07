//! Copies: a column slice of `[seq, width]` activations (the split after a stacked
//! matmul), the last row of a step (for plans that need only the last token's
//! logits), and chosen rows of a step (for batch plans, each sequence's row
//! whose logits it needs).

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `out[r, c] = x[r, start + c]` for `c < len`; `x: f32[seq, width]`.
pub fn slice_columns(width: u64, start: u64, len: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let body = vec![for_vec(
        c,
        i(0),
        i(len as i64),
        vec![store(out, add(mul(v(t), i(len as i64)), v(c)), ld(x, add(mul(v(t), i(width as i64)), add(v(c), i(start as i64)))))],
    )];
    let name = format!("slice_w{width}_o{start}_l{len}_{}", seq.tag());
    b.finish(name, "copy", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// `out[0, c] = x[seq - 1, c]`; `x: f32[seq, width]`, `out: f32[1, width]`.
pub fn last_row(width: u64) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let w = width as i64;
    let body = vec![for_vec(c, i(0), i(w), vec![store(out, v(c), ld(x, add(mul(sub(seq(), i(1)), i(w)), v(c))))])];
    b.finish(format!("last_row_w{width}"), "copy", TaskCount { per_seq: 0, fixed: 1 }, t, body)
}

/// `out[t, c] = x[rows[t], c]`; `x: f32[rows of the step, width]`, `rows:
/// i32[n]`, `out: f32[n, width]`: the rows whose logits a batch step returns.
/// Launched over those `n` rows (the launch's sequence length is `n`), one task each.
pub fn gather_rows(width: u64) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let rows = b.param("rows", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, r, c) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let w = width as i64;
    let body = vec![set(r, ld(rows, v(t))), for_vec(c, i(0), i(w), vec![store(out, add(mul(v(t), i(w)), v(c)), ld(x, add(mul(v(r), i(w)), v(c))))])];
    b.finish(format!("gather_rows_w{width}"), "copy", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};

    #[test]
    fn slices_columns_of_every_row() {
        let mut bufs = vec![Buffer::F32((0..8).map(|x| x as f32).collect()), Buffer::F32(vec![0.0; 4])];
        run(&slice_columns(4, 1, 2, SeqMode::Dynamic), &mut bufs, 2);
        assert_eq!(bufs[1], Buffer::F32(vec![1.0, 2.0, 5.0, 6.0]));
    }

    #[test]
    fn gather_rows_copies_the_chosen_rows_in_order() {
        let mut bufs = vec![Buffer::F32((0..12).map(|x| x as f32).collect()), Buffer::I32(vec![3, 0, 3]), Buffer::F32(vec![f32::NAN; 9])];
        run(&gather_rows(3), &mut bufs, 3);
        assert_eq!(bufs[2], Buffer::F32(vec![9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 9.0, 10.0, 11.0]));
    }

    #[test]
    fn last_row_copies_the_final_token() {
        let mut bufs = vec![Buffer::F32((0..9).map(|x| x as f32).collect()), Buffer::F32(vec![0.0; 3])];
        run(&last_row(3), &mut bufs, 3);
        assert_eq!(bufs[1], Buffer::F32(vec![6.0, 7.0, 8.0]));
    }
}
