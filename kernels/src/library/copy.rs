//! Copies: a column slice of `[seq, width]` activations (the split after a stacked
//! matmul), the last row of a step (for plans that need only the last token's
//! logits), and chosen rows of a step (for batch plans, each sequence's row
//! whose logits it needs).

use super::{RowChunks, SeqMode};
use crate::ir::dsl::*;
use crate::ir::*;

/// `out[r, c] = x[r, start + c]` for `c < len`; `x: f32[seq, width]`.
pub fn slice_columns(width: u64, start: u64, len: u64, seq: SeqMode) -> Kernel {
    slice_columns_in(width, start, len, seq, false)
}

/// The GPU form of [`slice_columns`]: a task per chunk of a row's slice.
pub fn slice_columns_gpu(width: u64, start: u64, len: u64, seq: SeqMode) -> Kernel {
    slice_columns_in(width, start, len, seq, true)
}

fn slice_columns_in(width: u64, start: u64, len: u64, seq: SeqMode, gpu: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let rc = RowChunks::new(&mut b, t, len, gpu);
    let from = add(add(rc.row_start(width), i(start as i64)), v(c));
    let mut body = rc.prelude.clone();
    body.push(for_vec(c, i(0), i(rc.chunk as i64), vec![store(out, rc.at(len, c), ld(x, from))]));
    let name = format!("slice_w{width}_o{start}_l{len}_{}", seq.tag());
    b.finish(name, "copy", TaskCount { per_seq: rc.per_row, fixed: 0 }, t, body)
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
    use crate::library::test_util::run_as;

    #[test]
    fn slices_columns_of_every_row() {
        let mut bufs = vec![Buffer::F32((0..8).map(|x| x as f32).collect()), Buffer::F32(vec![0.0; 4])];
        run(&slice_columns(4, 1, 2, SeqMode::Dynamic), &mut bufs, 2);
        assert_eq!(bufs[1], Buffer::F32(vec![1.0, 2.0, 5.0, 6.0]));
    }

    #[test]
    fn the_gpu_form_copies_wide_slices_in_chunks_alike_by_threads_and_by_lanes() {
        // A 512-wide slice at column 256 of rows of 1024: two tasks of 256 per row,
        // run serially and as the GPU deals the chunk loop to lanes.
        let (width, start, len, seq) = (1024u64, 256u64, 512u64, 3u64);
        assert_eq!(slice_columns(width, start, len, SeqMode::Dynamic).tasks.eval(seq), seq, "the CPU form: a task per row");
        let k = slice_columns_gpu(width, start, len, SeqMode::Dynamic);
        assert_eq!(k.tasks.eval(seq), seq * 2);
        let x: Vec<f32> = (0..width * seq).map(|v| v as f32).collect();
        let want: Vec<f32> = (0..seq).flat_map(|r| (0..len).map(move |c| (r * width + start + c) as f32)).collect();
        for warp in [false, true] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::F32(vec![f32::NAN; (len * seq) as usize])];
            run_as(&k, &mut bufs, seq, warp);
            assert_eq!(bufs[1], Buffer::F32(want.clone()), "warp {warp}");
        }
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
