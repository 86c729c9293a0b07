//! Matmul / GEMV of int8-quantized activations with block-quantized weights (Q8_0,
//! Q4_0, Q4_1, Q4_K), as llama.cpp computes them: integer dot products per block
//! (`Stmt::DotBlock`, VNNI `vpdpbusd` on x86: 64 multiply-adds per instruction),
//! scaled by the weight block's scale times the activation block's, plus the
//! weight block's minimum times the activation block's `d * sum(q)`.
//!
//! Inputs are [`super::quantize_activations::quantize_q8`]'s outputs for the same
//! [`DotForm`]: `q: i8[seq, k]`, `s: f32[seq, 2 k / 32]`. Tasks, tiling and the
//! epilogue follow the float matmul (`matmul.rs`), with wider column tiles at
//! decode; each output keeps a
//! [`DOT_LANES`]-wide accumulator, reduced once after the last block.

use maxc_format::WeightEncoding;

use super::dequant::{declare, WeightParams, BLOCK};
use super::elementwise::Broadcast;
use super::matmul::{column_tasks, epilogue, matmul_name, COLS_PER_TASK, COL_TILE};
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// The dot form of an encoding's levels in this kernel's block dots (Q8_0,
/// Q4_0, Q4_1, Q4_K). `None` for float encodings and for block encodings
/// without them (fp8; q5_0 and q5_1, which have only `matmul_interleaved`'s
/// row dots: [`has_integer_kernels`]).
pub fn integer_form(encoding: WeightEncoding) -> Option<DotForm> {
    match encoding {
        WeightEncoding::Q8_0 => Some(DotForm::Int8),
        WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q4K => Some(DotForm::NibblePairs),
        _ => None,
    }
}

/// Whether matmuls of `encoding` have integer-activation kernels: this file's
/// block dots ([`integer_form`]) or `matmul_interleaved`'s row dots (the
/// encodings `Layout::Interleaved16` takes). Q5_0 / Q5_1 have the row dots
/// only, so a matrix of them whose rows are not whole groups of 16 multiplies
/// float activations. fp8 has neither.
pub fn has_integer_kernels(encoding: WeightEncoding) -> bool {
    integer_form(encoding).is_some() || encoding.interleaves()
}

/// [`integer_form`] for a matmul over rows of `k` values, or `None` when `k`
/// is not whole pairs of blocks.
pub fn dot_form(encoding: WeightEncoding, k: u64) -> Option<DotForm> {
    integer_form(encoding).filter(|_| k.is_multiple_of(DOT_VALUES as u64))
}

/// A `rows x cols` tile of outputs at row `r0` and column `j0` (variables).
#[allow(clippy::too_many_arguments)]
fn tile(b: &mut KernelBuilder, rows: i64, cols: i64, (r0, j0): (VarId, VarId), (xq, xs): (ParamId, ParamId), w: &WeightParams, form: DotForm, out: ParamId, n: i64, addend: Option<(ParamId, Broadcast)>) -> Vec<Stmt> {
    let k = w.cols;
    let nb = k / BLOCK;
    let acc: Vec<Vec<LocalId>> = (0..rows).map(|_| (0..cols).map(|_| b.local(DOT_LANES as u64)).collect()).collect();
    let (l, p) = (b.var(ValType::I64), b.var(ValType::I64));
    let has_min = w.block_scale(i(0), i(0)).1.is_some();
    let mins: Vec<Vec<VarId>> = (0..rows).map(|_| (0..cols).map(|_| b.var(ValType::F32)).collect()).collect();
    let mut body = Vec::new();
    for (r, row) in acc.iter().enumerate() {
        for (c, &a) in row.iter().enumerate() {
            body.push(for_vec(l, i(0), i(DOT_LANES), vec![store(a, v(l), f(0.0))]));
            body.push(set(mins[r][c], f(0.0)));
        }
    }
    let bytes_per_row = match form {
        DotForm::Int8 => k,
        DotForm::NibblePairs => k / 2,
    };
    // Weight scales are decoded in the block loop: tables of them (as the float
    // block matmul keeps) made LLVM gather the four columns' minimums (slower).
    let mut per_pair = Vec::new();
    for c in 0..cols {
        let col = add(v(j0), i(c));
        let (scale_a, min_a) = w.block_scale(col.clone(), mul(v(p), i(2)));
        let (scale_b, min_b) = w.block_scale(col.clone(), add(mul(v(p), i(2)), i(1)));
        for r in 0..rows {
            let row = add(v(r0), i(r));
            // Activation scales: d of blocks 2p and 2p + 1; their d * sum(q) nb later.
            let s_at = |offset: i64| ld(xs, add(add(mul(row.clone(), i(2 * nb)), mul(v(p), i(2))), i(offset)));
            per_pair.push(Stmt::DotBlock {
                acc: acc[r as usize][c as usize],
                scales: [mul(scale_a.clone(), s_at(0)), mul(scale_b.clone(), s_at(1))],
                weights: w.part("quants"),
                w_start: add(mul(col.clone(), i(bytes_per_row)), mul(v(p), i(form.bytes()))),
                form,
                act: xq,
                act_start: add(mul(row.clone(), i(k)), mul(v(p), i(DOT_VALUES))),
            });
            if let (Some(ma), Some(mb)) = (min_a.clone(), min_b.clone()) {
                let m = mins[r as usize][c as usize];
                per_pair.push(set(m, add(v(m), add(mul(ma, s_at(nb)), mul(mb, s_at(nb + 1))))));
            }
        }
    }
    body.push(for_(p, i(0), i(nb / 2), per_pair));
    let total = b.var(ValType::F32);
    for (r, row_acc) in acc.iter().enumerate() {
        for (c, &a) in row_acc.iter().enumerate() {
            let (row, col) = (add(v(r0), i(r as i64)), add(v(j0), i(c as i64)));
            body.push(set(total, if has_min { v(mins[r][c]) } else { f(0.0) }));
            body.push(for_vec(l, i(0), i(DOT_LANES), vec![set(total, add(v(total), ld(a, v(l))))]));
            body.push(store(out, add(mul(row.clone(), i(n)), col.clone()), epilogue(v(total), row, col, n, addend)));
        }
    }
    body
}

/// `q, s` (int8 activations of `x: f32[seq, k]`) times the block-encoded
/// `w: [n, k]` -> `out: f32[seq, n]`; with `addend`, `+ r` broadcast as given.
/// Params: `q`, `s`, the weight's parts, `r`?, `out`.
pub fn matmul_int8(k: u64, n: u64, encoding: WeightEncoding, addend: Option<Broadcast>, seq: SeqMode) -> Kernel {
    let form = dot_form(encoding, k).unwrap_or_else(|| panic!("{} with k = {k} has no int8 dot form", encoding.name()));
    let mut b = KernelBuilder::new();
    let xq = b.param("q", ElemType::I8, false);
    let xs = b.param("s", ElemType::F32, false);
    let w = declare(&mut b, "w", encoding, k);
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    let ni = n as i64;
    // (columns per task, column tile): at decode a tile of 8 columns shares each
    // activation load and halves the tasks (SmolLM2 q4_1 decode +15% over 8 / 4,
    // no change for the float block matmul; 32 / 16 spills); prefill's 4-row
    // tiles keep 4 columns.
    let tiling = if seq.is_decode() { (16, 8) } else { (COLS_PER_TASK, COL_TILE) };
    let (body, tasks, t) = column_tasks(&mut b, n, seq, tiling, &mut |b, rows, cols, r0, j0| tile(b, rows, cols, (r0, j0), (xq, xs), &w, form, out, ni, addend));
    b.finish(matmul_name("matmul_i8", encoding.name(), addend.map(|(_, bc)| bc), k, n, seq), "matmul", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::matmul_blocks::matmul_blocks;
    use crate::library::quantize_activations::quantize_q8;
    use crate::library::test_util::*;

    /// Quantizing the activations then the int8 matmul equals the float block
    /// matmul on the dequantized activations (exactly the same math up to
    /// summation order), and is within int8 rounding of the float activations.
    #[test]
    fn int8_matmul_matches_the_block_matmul_on_dequantized_activations() {
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K] {
            let (k, n) = (256usize, 11usize);
            let form = dot_form(encoding, k as u64).unwrap();
            let parts = random_parts(encoding, n, k, 7);
            for (m, seq, addend) in [(6usize, SeqMode::Dynamic, None), (1, SeqMode::Fixed(1), Some(Broadcast::Row)), (3, SeqMode::Dynamic, Some(Broadcast::None))] {
                let x = rand(m * k, 3);
                let mut qbufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![0; m * k]), Buffer::F32(vec![0.0; m * 2 * k / 32])];
                run(&quantize_q8(k as u64, form, seq), &mut qbufs, m as u64);
                let (Buffer::I8(q), Buffer::F32(s)) = (&qbufs[1], &qbufs[2]) else { unreachable!() };
                // The activations the int8 path computes with, back in natural order.
                let mut xd = vec![0.0f32; m * k];
                for row in 0..m {
                    for blk in 0..k / 32 {
                        for t in 0..32 {
                            let pos = row * k + (blk / 2) * 64 + form.position((blk % 2) as i64, t as i64) as usize;
                            xd[row * k + blk * 32 + t] = s[row * 2 * (k / 32) + blk] * q[pos] as f32;
                        }
                    }
                }
                let r_values = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 4);
                let r = addend.map(|_| &r_values[..]);
                let got = run_matmul(&matmul_int8(k as u64, n as u64, encoding, addend, seq), vec![qbufs[1].clone(), qbufs[2].clone()], &parts, r, (m, n));
                let want = run_matmul(&matmul_blocks(k as u64, n as u64, encoding, addend, seq), vec![Buffer::F32(xd)], &parts, r, (m, n));
                let float = run_matmul(&matmul_blocks(k as u64, n as u64, encoding, addend, seq), vec![Buffer::F32(x.clone())], &parts, r, (m, n));
                let scale = want.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                for ((g, w), fl) in got.iter().zip(&want).zip(&float) {
                    assert!((g - w).abs() <= 2e-5 * scale, "{}: int8 {g} vs dequantized {w}", encoding.name());
                    // int8 activations: about 1/254 of each block's range per value.
                    assert!((g - fl).abs() <= 0.02 * scale, "{}: int8 {g} vs float activations {fl}", encoding.name());
                }
            }
        }
    }
}
