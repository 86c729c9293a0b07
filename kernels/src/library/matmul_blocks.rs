//! Matmul / GEMV on block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, FP8 e4m3),
//! computed on the packed form: `out[m, n] = x[m, k] @ dequant(w)[n, k]^T`.
//!
//! The weights are never expanded to f32 in memory. For each block of 32 values
//! a [`LANES`]-wide local accumulator takes `scale * (x_lo * q_lo + x_hi * q_hi)`
//! (plus `min * (x_lo + x_hi)` for encodings with a minimum), where lane `l` holds
//! values `l` and `l + 16` of the block, exactly the pair that one byte of a 4-bit
//! block packs. Accumulating per lane instead of per block keeps the horizontal
//! sum out of the block loop: it runs once per output, after the last block.
//! Tasks, tiling and the epilogue follow the float matmul (`matmul.rs`).

use maxc_format::WeightEncoding;

use super::dequant::{declare, WeightParams, BLOCK, HALF};
use super::elementwise::Broadcast;
use super::matmul::{column_tasks, epilogue, matmul_name, GpuColumnRows, COLS_PER_TASK, COL_TILE};
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Accumulator lanes per output (half a block).
pub const LANES: i64 = HALF;

/// A `rows x cols` tile of outputs at row `r0` and column `j0` (variables):
/// zero the lane accumulators, run the block loop, reduce the lanes and store.
#[allow(clippy::too_many_arguments)]
fn tile(b: &mut KernelBuilder, rows: i64, cols: i64, r0: VarId, j0: VarId, x: ParamId, w: &WeightParams, out: ParamId, n: i64, addend: Option<(ParamId, Broadcast)>) -> Vec<Stmt> {
    let k = w.cols;
    // One LANES-wide local per output, each updated by its own lane loop: small
    // loops that LLVM unrolls fully, after which the locals live in registers.
    let acc: Vec<Vec<LocalId>> = (0..rows).map(|_| (0..cols).map(|_| b.local(LANES as u64)).collect()).collect();
    let (l, blk) = (b.var(ValType::I64), b.var(ValType::I64));
    let mut body = Vec::new();
    for &a in acc.iter().flatten() {
        body.push(for_vec(l, i(0), i(LANES), vec![store(a, v(l), f(0.0))]));
    }

    // The scales (and minimums) of the tile's columns, decoded once into local f32
    // arrays by vectorized loops: in the block loop each is then one broadcast
    // load instead of a scalar f16 load, conversion and broadcast.
    let nb = w.blocks_per_row();
    let has_min = w.block_scale(i(0), i(0)).1.is_some();
    let scale_table = b.local((cols * nb) as u64);
    let min_table = has_min.then(|| b.local((cols * nb) as u64));
    for c in 0..cols {
        let (scale, min) = w.block_scale(add(v(j0), i(c)), v(blk));
        let at = add(v(blk), i(c * nb));
        let mut decode = vec![store(scale_table, at.clone(), scale)];
        if let (Some(t), Some(min)) = (min_table, min) {
            decode.push(store(t, at, min));
        }
        body.push(for_vec(blk, i(0), i(nb), decode));
    }
    let scales: Vec<(VarId, Option<VarId>)> = (0..cols).map(|_| (b.var(ValType::F32), has_min.then(|| b.var(ValType::F32)))).collect();
    let mut per_block = Vec::new();
    for (c, (s, m)) in scales.iter().enumerate() {
        let at = add(v(blk), i(c as i64 * nb));
        per_block.push(set(*s, ld(scale_table, at.clone())));
        if let (Some(m), Some(t)) = (m, min_table) {
            per_block.push(set(*m, ld(t, at)));
        }
    }
    let x_base: Vec<VarId> = (0..rows).map(|_| b.var(ValType::I64)).collect();
    for (r, &xb) in x_base.iter().enumerate() {
        per_block.push(set(xb, add(mul(add(v(r0), i(r as i64)), i(k)), mul(v(blk), i(BLOCK)))));
    }
    for (c, (s, m)) in scales.iter().enumerate() {
        for (r, row_acc) in acc.iter().enumerate() {
            let x_lo = ld(x, add(v(l), v(x_base[r])));
            let x_hi = ld(x, add(add(v(l), i(HALF)), v(x_base[r])));
            let (q_lo, q_hi) = w.block_pair(add(v(j0), i(c as i64)), v(blk), v(l));
            let mut update = mul(v(*s), add(mul(x_lo.clone(), q_lo), mul(x_hi.clone(), q_hi)));
            if let Some(m) = m {
                update = add(update, mul(v(*m), add(x_lo, x_hi)));
            }
            let a = row_acc[c];
            per_block.push(for_vec(l, i(0), i(LANES), vec![store(a, v(l), add(ld(a, v(l)), update))]));
        }
    }
    body.push(for_(blk, i(0), i(w.blocks_per_row()), per_block));

    let total = b.var(ValType::F32);
    for (r, row_acc) in acc.iter().enumerate() {
        for (c, &a) in row_acc.iter().enumerate() {
            let (row, col) = (add(v(r0), i(r as i64)), add(v(j0), i(c as i64)));
            body.push(set(total, f(0.0)));
            body.push(for_vec(l, i(0), i(LANES), vec![set(total, add(v(total), ld(a, v(l))))]));
            body.push(store(out, add(mul(row.clone(), i(n)), col.clone()), epilogue(v(total), row, col, n, addend)));
        }
    }
    body
}

/// `x: f32[seq, k]` times the block-encoded `w: [n, k]` -> `out: f32[seq, n]`;
/// with `addend`, `+ r` broadcast as given. Params: `x`, the weight's parts, `r`?, `out`.
pub fn matmul_blocks(k: u64, n: u64, encoding: WeightEncoding, addend: Option<Broadcast>, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let (x, w, addend, out) = block_params(&mut b, encoding, k, addend);
    let ni = n as i64;
    let (body, tasks, t) = column_tasks(&mut b, n, seq, (COLS_PER_TASK, COL_TILE), &mut |b, rows, cols, r0, j0| tile(b, rows, cols, r0, j0, x, &w, out, ni, addend));
    b.finish(matmul_name("matmul", encoding.name(), addend.map(|(_, bc)| bc), k, n, seq), "matmul", tasks, t, body)
}

/// The parameters of a block matmul: `x`, the weight's parts, `r`?, `out`.
fn block_params(b: &mut KernelBuilder, encoding: WeightEncoding, k: u64, addend: Option<Broadcast>) -> (ParamId, WeightParams, Option<(ParamId, Broadcast)>, ParamId) {
    assert!(encoding.block() > 1, "{} is not a block encoding; use matmul.rs", encoding.name());
    let x = b.param("x", ElemType::F32, false);
    let w = declare(b, "w", encoding, k);
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    (x, w, addend, out)
}

/// Byte pairs (values `l` and `l + HALF` of a block) one GPU lane takes per
/// iteration of [`matmul_blocks_rowwise`]'s k loop: a whole block, whose 4-bit
/// quants are one 16-byte load.
pub const GPU_PAIRS: i64 = HALF;
/// Activation rows one task of [`matmul_blocks_rowwise`] multiplies with each
/// decoded weight at prefill (one at decode).
pub const GPU_ROW_TILE: i64 = 4;

/// The GPU form of [`matmul_blocks`] (and the kernel itself in artifacts without
/// CPU code): one task per output column, whose k loop runs over blocks (of
/// [`GPU_PAIRS`] byte pairs), a plain reduction that the GPU mapping deals to a
/// warp's lanes (`crate::warp`). Each iteration loads its block's scale (and
/// minimum) once and decodes the block, so a warp reads 32 consecutive blocks
/// (512 bytes of 4-bit quants) per step, as llama.cpp's mmvq reads whole
/// blocks per lane, instead of decoding one value and loading its block's
/// scales per iteration. One column per task gives a decode GEMV thousands of
/// warps, enough loads in flight for HBM. At prefill each decoded weight is
/// multiplied with [`GPU_ROW_TILE`] activation rows. The CPU form's per-lane
/// local accumulators would keep every thread of a warp doing the same work.
/// Same parameters and result as [`matmul_blocks`]; its tasks are
/// [`COLS_PER_TASK`] times as many (the launch's GPU task split), the last
/// ones past `n` idle.
pub fn matmul_blocks_rowwise(k: u64, n: u64, encoding: WeightEncoding, addend: Option<Broadcast>, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let (x, w, addend, out) = block_params(&mut b, encoding, k, addend);
    let (t, it) = (b.var(ValType::I64), b.var(ValType::I64));
    let ki = k as i64;
    let rows = GpuColumnRows::new(&mut b, seq, GPU_ROW_TILE);
    let j = v(t);
    let steps_per_block = HALF / GPU_PAIRS;
    let blk = div(v(it), i(steps_per_block));
    let first_pair = mul(rem(v(it), i(steps_per_block)), i(GPU_PAIRS));
    let (scale, min_value) = w.block_scale(j.clone(), blk.clone());
    let pairs: Vec<(Expr, Expr)> = (0..GPU_PAIRS).map(|p| w.block_pair(j.clone(), blk.clone(), add(first_pair.clone(), i(p)))).collect();
    let mut step = Vec::new();
    for (&a, &x_row) in rows.acc.iter().zip(&rows.x_row) {
        let x_at = |offset: i64, p: i64| ld(x, add(add(first_pair.clone(), i(offset + p)), add(mul(v(x_row), i(ki)), mul(blk.clone(), i(BLOCK)))));
        let mut dot = None;
        let mut sum = None;
        for (p, (q_lo, q_hi)) in pairs.iter().enumerate() {
            let (x_lo, x_hi) = (x_at(0, p as i64), x_at(HALF, p as i64));
            let term = add(mul(x_lo.clone(), q_lo.clone()), mul(x_hi.clone(), q_hi.clone()));
            dot = Some(match dot { None => term, Some(d) => add(d, term) });
            let pair_sum = add(x_lo, x_hi);
            sum = Some(match sum { None => pair_sum, Some(s) => add(s, pair_sum) });
        }
        let mut update = mul(scale.clone(), dot.expect("GPU_PAIRS > 0"));
        if let Some(m) = &min_value {
            update = add(update, mul(m.clone(), sum.expect("GPU_PAIRS > 0")));
        }
        step.push(set(a, add(v(a), update)));
    }
    let (body, tasks) = rows.task(t, n, seq, for_vec(it, i(0), i(steps_per_block * w.blocks_per_row()), step), out, addend);
    b.finish(matmul_name("matmul_rows", encoding.name(), addend.map(|(_, bc)| bc), k, n, seq), "matmul", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// The weights decoded one value at a time by [`WeightParams::value`].
    fn decode_all(encoding: WeightEncoding, parts: &[Buffer], rows: usize, cols: usize) -> Vec<f32> {
        let mut b = KernelBuilder::new();
        let w = declare(&mut b, "w", encoding, cols as u64);
        let out = b.param("out", ElemType::F32, true);
        let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
        let body = vec![for_(c, i(0), i(cols as i64), vec![store(out, add(mul(v(t), i(cols as i64)), v(c)), w.value(v(t), v(c)))])];
        let k = b.finish("decode".into(), "test", TaskCount { per_seq: 0, fixed: rows as u64 }, t, body);
        let mut bufs = parts.to_vec();
        bufs.push(Buffer::F32(vec![0.0; rows * cols]));
        run(&k, &mut bufs, 1);
        let Some(Buffer::F32(v)) = bufs.pop() else { unreachable!() };
        v
    }

    #[test]
    fn the_gpu_form_deals_blocks_to_a_warp() {
        use crate::warp::{gpu_mapping, LoopMapping, WARP};
        for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
            let kernel = matmul_blocks_rowwise(2048, 3000, WeightEncoding::Q4K, None, seq);
            let mapping = gpu_mapping(&kernel);
            assert_eq!(mapping.threads, WARP as u32, "{}", kernel.name);
            let dealt: Vec<_> = mapping.loops.iter().filter(|m| matches!(m, LoopMapping::Lanes { .. })).collect();
            let rows = if seq.is_decode() { 1 } else { GPU_ROW_TILE as usize };
            assert!(matches!(dealt.as_slice(), [LoopMapping::Lanes { reductions, stores: false, .. }] if reductions.len() == rows), "{}: {:?}", kernel.name, mapping.loops);
            // One task per column, padded to the CPU form's whole tasks.
            assert_eq!(crate::warp::task_split(&matmul_blocks(2048, 3000, WeightEncoding::Q4K, None, seq).tasks, &kernel.tasks), Some(COLS_PER_TASK as u32));
        }
    }

    #[test]
    fn every_block_encoding_matches_the_decoded_matmul() {
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Float8E4M3, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            // 11 columns: two full column tiles and 3 ragged; 6 rows: a row tile and 2 more.
            let (k, n) = (256usize, 11usize);
            let parts = random_parts(encoding, n, k, 7);
            let w = decode_all(encoding, &parts, n, k);
            for (m, seq, addend) in [(6usize, SeqMode::Dynamic, None), (1, SeqMode::Fixed(1), Some(Broadcast::Row)), (3, SeqMode::Dynamic, Some(Broadcast::None))] {
                let x = rand(m * k, 3);
                let r = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 4);
                let mut bufs = matmul_buffers(&x, &parts, &r, addend, m * n);
                let mut rowwise = bufs.clone();
                run(&matmul_blocks(k as u64, n as u64, encoding, addend, seq), &mut bufs, m as u64);
                run(&matmul_blocks_rowwise(k as u64, n as u64, encoding, addend, seq), &mut rowwise, m as u64);
                let Some(Buffer::F32(got)) = bufs.pop() else { unreachable!() };
                let Some(Buffer::F32(got_rowwise)) = rowwise.pop() else { unreachable!() };
                let want = naive_matmul(&x, &w, &r, (m, k, n), addend);
                let scale = want.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                for (form, got) in [("lanes", &got), ("rowwise", &got_rowwise)] {
                    let err = got.iter().zip(&want).fold(0.0f32, |a, (g, w)| a.max((g - w).abs()));
                    assert!(err <= 1e-5 * scale, "{} ({form}): m={m} max error {err} (scale {scale})", encoding.name());
                }
            }
        }
    }
}
