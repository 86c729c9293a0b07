//! Matmul / GEMV of int8-quantized activations with block weights stored
//! interleaved by 16 rows (layout `interleaved16`: Q8_0, Q4_0, Q4_1, Q4_K, Q5_0,
//! Q5_1; see
//! [`super::dequant::rows_form`]), as llama.cpp's repacked CPU kernels compute:
//! each 64-byte load of levels holds four values of 16 output rows, multiplied by
//! four activation bytes broadcast to every row (`Stmt::DotRows`, VNNI
//! `vpdpbusd` on x86). The 16 rows' sums of a block come out in 16 lanes, so a
//! block costs one conversion and one multiply-add by the 16 rows' scales (one
//! contiguous load of f16): no horizontal sums, no per-row scale broadcasts.
//!
//! Inputs are [`super::quantize_activations::quantize_q8`]'s outputs in natural
//! order ([`DotForm::Int8`]): `q: i8[seq, k]`, `s: f32[seq, 2 k / 32]` (each
//! block's `d`, then each block's `d * sum(q)`). Per block of row `j`:
//! `d_w[j] d_a dot(W[j], q) + m_w[j] d_a sum(q)`, where the minimum `m_w` is
//! Q4_1's and Q5_1's stored one, `-8 d_w` for Q4_0, `-16 d_w` for Q5_0 and
//! `-128 d_w` for Q8_0 (its levels are stored as `q + 128`, unsigned, as the
//! instruction wants them); Q4_K's scale and minimum are its super-block's f16
//! ones times the block's 6-bit ones. Q5's levels are Q4's nibbles with a fifth
//! bit each from a 64-byte chunk per block, ORed in per dot step
//! ([`RowsForm::Nibbles5`]): one more load per block and a shift and mask per
//! step, where the float-activation block kernels decoded every value. Q6_K's
//! have two such bits ([`RowsForm::Nibbles6`]) and a signed scale per 16
//! values: two dots per block, each with its `q - 32` applied exactly.
//! Tasks own panels of 16 output columns (`matmul_panel.rs`'s task structure);
//! decode runs a task's panels one after another, prefill in register tiles.
//!
//! With 16-bit activations in two byte planes ([`ActivationLevels::Int16Planes`],
//! `quantize_q16`'s outputs: `q: i8[seq, 2 k]`, per row the high bytes then the
//! low bytes) each `DotRows` multiplies both planes with the same unpacked
//! levels (`ActLevels::Planes`): twice the dot instructions of int8, the same
//! weight loads and unpacking, one conversion and scaling per block. With the
//! levels as words ([`ActivationLevels::Int16Words`], for Q8_0) the weight
//! bytes are widened to words once per chunk and each 16 of them meet the
//! activation words in one word dot (`ActLevels::Words`): int8's instruction
//! count. Each activation row of a words tile keeps four accumulators (pairs
//! of values per row, folded once per block); the tile's rows are
//! [`RegisterTile::for_word_dots`]'s. Nibble levels (also Q5's five-bit and
//! Q6_K's six-bit ones, and Q8_0's bytes) in prefill tiles on AVX2 without
//! VNNI take the levels as word pairs
//! ([`ActivationLevels::Int16WordPairs`], `ActLevels::WordPairs`): the
//! nibbles masked out of 16-bit lanes meet a broadcast pair of activation
//! words in one word dot per 16 products, one i32 accumulator per 8 weight
//! rows, no planes to combine (the tile's rows lowered chunk by chunk
//! together: `word_pair_tile` in the LLVM backend).

use maxc_format::WeightEncoding;

use super::dequant::{declare_interleaved, WeightParams, INTERLEAVED_ROWS};
use super::elementwise::Broadcast;
use super::matmul::{epilogue, matmul_name};
use super::quantize_activations::ActivationLevels;
use super::matmul_panel::{panel_tasks_by_rows, tile_tag};
use super::{RegisterTile, SeqMode};
use crate::ir::dsl::*;
use crate::ir::*;

/// Panels of 16 output columns per task.
pub const PANELS_PER_TASK: i64 = 2;

/// How far ahead of its loads a decode GEMV prefetches its levels (bytes): one
/// token's GEMV reads every weight once, from memory. A task's levels are
/// contiguous and a thread takes consecutive tasks, so 4 KiB ahead lies in the
/// same or the thread's next task. SmolLM2 q4_1+int8 decode on a Zen 3 VM (AVX2,
/// 23-28 GB/s), `bench --compare`, both on huge pages: 1.06-1.12x at 4 KiB, 1.07-1.09x
/// at 8 KiB, 0.99-1.03x at 2 KiB; `prefetchnta` no different; A/A 0.96-1.01x.
/// (On a Zen 5 VM at 50-70 GB/s, 1-4 KiB ahead had gained nothing.) Rechecked
/// after the eleventh session's faster GEMVs, SmolLM2 q8_0 (int16 words) decode
/// against 4 KiB: 8 KiB 1.04x then 0.98x, 16 KiB 0.99x, A/A 1.01x. Prefill
/// reuses each level vector for a register tile's rows and does not prefetch,
/// except in steps of few rows ([`FEW_ROWS`]). The float panel GEMVs
/// (`matmul_panel.rs`) prefetch as far: SmolLM2 decode on an Intel Xeon VM
/// (AVX-512, 24-26 GB/s), `bench --compare` against no prefetch, 2026-11-26:
/// float32 1.06x, bfloat16 1.21x, float16 1.12x; bfloat16 at 4 KiB against 8
/// KiB 1.08x, against 2 KiB 1.00x.
pub const DECODE_PREFETCH_BYTES: i64 = 4096;

/// Steps of at most this many activation rows (the batched engine's decode
/// steps, up to `compile.max_sequences` rows, and small mixed ones) read each
/// weight from memory for few multiplies, so the weights' stream bounds them as
/// it bounds a GEMV: they run one panel at a time ([`few_rows_tile`])
/// with the levels prefetched [`DECODE_PREFETCH_BYTES`] ahead, as the GEMVs do.
/// Two panels side by side (AVX-512's 2 x 2 planes tile) are two streams 4.6
/// KiB apart at SmolLM2's k = 576, and prefetching either ahead mostly fetches
/// the other: no prefetch distance tried (2-18 KiB) helped them. Zen 5 VM
/// (AVX-512 VNNI), one thread, q4_1 int16 planes at k 576 x n 3072, the weights
/// streamed from memory (`cargo bench -p maxc-tests --bench kernels --
/// gemm_cold`) against in cache (`gemm_k`): 2 x 2 without prefetch 143-160 us
/// against 77 in cache at 8 rows; 4 x 1 with it 92 us against 84 at 8 rows, 184
/// against 223 at 16, 376 against 390 at 32, 707 against 702 at 64 (so 32 is
/// the bound). More rows reuse each level vector enough that the 2 x 2 tile's
/// fewer instructions per product win. The float panels (`matmul_panel.rs`)
/// take the same bound: their 8 x 2 tile lost alike (docs/performance-log.md,
/// "Steps of few rows").
pub const FEW_ROWS: i64 = 32;

/// The tile `rows x panels` at activation row `r0` and first panel `p0`
/// (variables; the weights' panels counted from `wp` when set, an expert's first).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile(b: &mut KernelBuilder, rows: i64, panels: i64, (r0, wp, p0): (VarId, Option<VarId>, VarId), (xq, xs, xh, levels): (ParamId, ParamId, Option<ParamId>, ActivationLevels), w: &WeightParams, form: RowsForm, out: ParamId, n: i64, addend: Option<(ParamId, Broadcast)>, prefetch_ahead: Option<i64>) -> Vec<Stmt> {
    let lanes = INTERLEAVED_ROWS;
    let (k, nb) = (w.cols, w.blocks_per_row());
    let acc: Vec<Vec<LocalId>> = (0..rows).map(|_| (0..panels).map(|_| b.local(lanes as u64)).collect()).collect();
    let (l, blk) = (b.var(ValType::I64), b.var(ValType::I64));
    let group_blocks: Vec<VarId> = (0..panels).map(|_| b.var(ValType::I64)).collect();
    let row = |r: i64| add(v(r0), i(r));
    // Weight panel `p0 + p`, of the whole tensor or of the expert from `wp` on.
    let w_panel = |p: i64| match wp {
        None => add(v(p0), i(p)),
        Some(wp) => add(v(wp), add(v(p0), i(p))),
    };
    let mut body = Vec::new();
    for &a in acc.iter().flatten() {
        body.push(for_vec(l, i(0), i(lanes), vec![store(a, v(l), f(0.0))]));
    }
    let mut per_block = Vec::new();
    for (p, &gb) in group_blocks.iter().enumerate() {
        per_block.push(set(gb, add(mul(w_panel(p as i64), i(nb)), v(blk))));
    }
    for r in 0..rows {
        let s_at = add(mul(row(r), i(2 * nb)), v(blk));
        let (act_start, act_levels) = levels.block_start(row(r), v(blk), k);
        for (p, &gb) in group_blocks.iter().enumerate() {
            // The 16 rows' scales (and minimums) of a block are consecutive.
            let per_row = |part: &str| (w.part(part), mul(v(gb), i(lanes)));
            // Q4_K: a super-block's f16 scale and minimum times the block's 6-bit ones.
            let per_super = |part: &str| (w.part(part), mul(add(mul(w_panel(p as i64), i(nb / 8)), div(v(blk), i(8))), i(lanes)));
            let (row_scales, row_min) = match w.encoding {
                WeightEncoding::Q4_1 => (RowScale { values: per_row("scales"), factors: None }, RowMin::Stored(RowScale { values: per_row("mins"), factors: None })),
                WeightEncoding::Q4_0 => (RowScale { values: per_row("scales"), factors: None }, RowMin::Offset(-8.0)),
                WeightEncoding::Q5_0 => (RowScale { values: per_row("scales"), factors: None }, RowMin::Offset(-16.0)),
                WeightEncoding::Q5_1 => (RowScale { values: per_row("scales"), factors: None }, RowMin::Stored(RowScale { values: per_row("mins"), factors: None })),
                WeightEncoding::Q8_0 => (RowScale { values: per_row("scales"), factors: None }, RowMin::Offset(-128.0)),
                WeightEncoding::Q4K | WeightEncoding::Q5K => (
                    RowScale { values: per_super("scales"), factors: Some(per_row("sub_scales")) },
                    RowMin::Subtracted(RowScale { values: per_super("mins"), factors: Some(per_row("sub_mins")) }),
                ),
                // A super-block's f16 scale times each half's signed one (the
                // 16 rows' first halves, then their second halves), q - 32
                // applied exactly.
                WeightEncoding::Q6K => (RowScale { values: per_super("scales"), factors: Some((w.part("sub_scales"), mul(v(gb), i(2 * lanes)))) }, RowMin::Offset(-32.0)),
                e => unreachable!("{} has no interleaved layout", e.name()),
            };
            per_block.push(Stmt::DotRows(RowDot {
                acc: acc[r as usize][p],
                weights: w.part("quants"),
                w_start: mul(v(gb), i(form.bytes())),
                form,
                high_bits: (form.high_bit_count() > 0).then(|| (w.part("high_bits"), mul(v(gb), i(form.high_bits_bytes())))),
                // The row's two half sums of this block.
                half_sums: xh.map(|h| (h, add(mul(row(r), i(2 * nb)), mul(v(blk), i(2))))),
                act: xq,
                act_start: act_start.clone(),
                act_levels: act_levels.clone(),
                act_scales: [ld(xs, s_at.clone()), ld(xs, add(s_at.clone(), i(nb)))],
                row_scales,
                row_min,
                prefetch_ahead,
            }));
        }
    }
    body.push(for_(blk, i(0), i(nb), per_block));
    for (r, row_acc) in acc.iter().enumerate() {
        for (p, &a) in row_acc.iter().enumerate() {
            let first_col = mul(add(v(p0), i(p as i64)), i(lanes));
            let value = epilogue(ld(a, v(l)), row(r as i64), add(v(l), first_col.clone()), n, addend);
            // The lane is the first operand of the index (see dequant.rs).
            body.push(for_vec(l, i(0), i(lanes), vec![store(out, add(v(l), add(mul(row(r as i64), i(n)), first_col)), value)]));
        }
    }
    body
}

/// The register tile of steps of few rows ([`FEW_ROWS`]), given the tile of
/// many rows: one panel at a time, so that each panel's levels are one stream
/// to prefetch; AVX-512's byte planes in 4 rows (the accumulators of its 2 x 2
/// planes tile) and int8's 8 x 2 (the Q4_K tile of some Intel CPUs,
/// `CpuTarget::q4_k_int8_tiles_take_eight_rows`) as AVX-512's 4 x 2 would have
/// it, the other tiles' rows as they are.
fn few_rows_tile(many: RegisterTile, levels: ActivationLevels) -> RegisterTile {
    match levels {
        ActivationLevels::Int16Planes if many == (RegisterTile { rows: 2, panels: 2 }) => RegisterTile { rows: 4, panels: 1 },
        ActivationLevels::Int8 if many == RegisterTile::ZMM_EIGHT_ROWS => RegisterTile { rows: 4, panels: 1 },
        _ => RegisterTile { panels: 1, ..many },
    }
}

/// The register tiles of an interleaved matmul of `form` levels with
/// `levels` activations on a target whose tile is `register_tile`: the tile of
/// steps of many rows, then of few rows ([`FEW_ROWS`]).
pub(super) fn interleaved_tiles(register_tile: RegisterTile, levels: ActivationLevels, form: RowsForm) -> (RegisterTile, RegisterTile) {
    // Planes keep two accumulators per tile cell: AVX-512's 4 x 2 tile spilled
    // (30 stack accesses per 128 `vpdpbusd` in the 1.17B q4_k loop), 2 x 2 does
    // not. Intel Xeon VM, 2 threads, prefill 2 x 2 against 4 x 2: SmolLM2 q4_1
    // pp512 1.16x, 1.17B Q4_K_M pp256 1.08x, Q8_0 1.05-1.17x (3 x 2 0.89x, 4 x 1
    // 0.97x, 8 x 1 1.03x). AVX2's 4 x 1 stays: 2 x 1 was 0.88-0.98x on x86-64-v3 code,
    // except for Q6_K's six-bit levels, whose sums widen every two steps
    // ([`RegisterTile::for_six_bit_planes`]: 2 x 1).
    let six_bit_zmm = form == RowsForm::Nibbles6 && register_tile == RegisterTile::ZMM;
    let register_tile = match levels {
        ActivationLevels::Int16Words => register_tile.for_word_dots(),
        ActivationLevels::Int16Planes if register_tile == RegisterTile::ZMM => RegisterTile { rows: 2, panels: 2 },
        ActivationLevels::Int16Planes if form == RowsForm::Nibbles6 => register_tile.for_six_bit_planes(),
        _ => register_tile,
    };
    // Steps of few rows: one panel at a time, the levels prefetched ahead ([`FEW_ROWS`]).
    let few_tile = few_rows_tile(register_tile, levels);
    // Q6_K's prefill on AVX-512: one panel, more rows ([`RegisterTile::six_bit_zmm`]).
    let register_tile = if six_bit_zmm { RegisterTile::six_bit_zmm(levels == ActivationLevels::Int16Planes) } else { register_tile };
    (register_tile, few_tile)
}

/// Whether [`matmul_interleaved`] of `encoding` weights `[n, k]` reads `h`,
/// each activation row's level sums per 16 values: the forms with two halves
/// (Q6_K), whose offset applies per half through them.
pub fn reads_half_sums(encoding: WeightEncoding, n: u64, k: u64) -> bool {
    super::dequant::rows_form(encoding, n, k).is_some_and(|f| f.halves() > 1)
}

/// `q, s` (integer activations of `x: f32[seq, k]` with `levels`, natural
/// order) times `w: [n, k]` in `encoding` and layout `interleaved16` ->
/// `out: f32[seq, n]`; with `addend`, `+ r` broadcast as given; prefill in
/// register tiles of `register_tile`. Params: `q`, `s`, `h` (Q6_K: the
/// activations' sums per 16 values, [`super::quantize_activations::level_half_sums`]),
/// the weight's parts, `r`?, `out`.
pub fn matmul_interleaved(k: u64, n: u64, encoding: WeightEncoding, addend: Option<Broadcast>, seq: SeqMode, register_tile: RegisterTile, levels: ActivationLevels) -> Kernel {
    let mut b = KernelBuilder::new();
    let xq = b.param("q", ElemType::I8, false);
    let xs = b.param("s", ElemType::F32, false);
    let xh = reads_half_sums(encoding, n, k).then(|| b.param("h", ElemType::I32, false));
    let w = declare_interleaved(&mut b, "w", encoding, n, k);
    let form = w.interleaved.expect("declared interleaved");
    let addend = addend.map(|bc| (b.param("r", ElemType::F32, false), bc));
    let out = b.param("out", ElemType::F32, true);
    let ni = n as i64;
    let prefetch = seq.is_decode().then_some(DECODE_PREFETCH_BYTES);
    let (register_tile, few_tile) = interleaved_tiles(register_tile, levels, form);
    let (body, tasks, t) = panel_tasks_by_rows(
        &mut b,
        n,
        seq,
        PANELS_PER_TASK,
        (register_tile, few_tile),
        &mut |b, rows, panels, r0, p0| {
            if !seq.is_decode() {
                return tile(b, rows, panels, (r0, None, p0), (xq, xs, xh, levels), &w, form, out, ni, addend, prefetch);
            }
            // Decode: the task's panels one after another, each with its own block
            // loop, not side by side in one: two panels' accumulators (per plane) and
            // the block's activation broadcasts, which LLVM keeps for both, are more
            // than AVX2's 16 ymm registers (the q4_1 int16 block loop moved 56
            // vectors to and from the stack per block on x86-64-v3, 2 after), and one
            // panel's levels are one contiguous stream; the broadcasts reloaded per
            // panel cost load slots only. Zen 3 VM, criterion turn about: q4_1 int16
            // +8-13%, q8_0 int16 +15-40%, q8_0 int8 +17-48%; `bench --compare` decode
            // q4_1 1.12x, q8_0 1.05x (docs/performance.md).
            let mut all = Vec::new();
            for p in 0..panels {
                let at = b.var(ValType::I64);
                all.push(set(at, add(v(p0), i(p))));
                all.extend(tile(b, rows, 1, (r0, None, at), (xq, xs, xh, levels), &w, form, out, ni, addend, prefetch));
            }
            all
        },
        &mut |b, rows, panels, r0, p0| tile(b, rows, panels, (r0, None, p0), (xq, xs, xh, levels), &w, form, out, ni, addend, Some(DECODE_PREFETCH_BYTES)),
    );
    let name = matmul_name(&format!("matmul_{}x16", levels.tag()), encoding.name(), addend.map(|(_, bc)| bc), k, n, seq) + &tile_tag(seq, register_tile, few_tile);
    b.finish(name, "matmul", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::matmul_blocks::matmul_blocks;
    use crate::library::quantize_activations::{level_half_sums, quantize_to};
    use crate::library::test_util::*;

    /// A decode GEMV's name carries no register tile (`tile_tag`), so its IR
    /// must not depend on one: an artifact's symbols, and the tests' shared
    /// compiles, find a kernel by its name.
    #[test]
    fn decode_kernels_are_the_same_for_every_register_tile() {
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let k = if encoding.block() == 256 { 256 } else { 96 };
            // (Q6_K's two halves take planes or word pairs, no words.)
            for levels in [ActivationLevels::Int8, ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs].into_iter().filter(|&l| !(encoding == WeightEncoding::Q6K && l == ActivationLevels::Int16Words)) {
                for addend in [None, Some(Broadcast::None)] {
                    let zmm = matmul_interleaved(k, 48, encoding, addend, SeqMode::Fixed(1), RegisterTile::ZMM, levels);
                    let ymm = matmul_interleaved(k, 48, encoding, addend, SeqMode::Fixed(1), RegisterTile::YMM, levels);
                    assert!(zmm == ymm, "{} differs between the AVX-512 and the AVX2 tile", zmm.name);
                }
            }
        }
    }

    /// The interleaved int8 and int16 (planes, words, word pairs) matmuls equal the float block matmul
    /// (row-major weights) on the dequantized activations, up to summation order;
    /// 48 columns make one full task and a last single panel, 6 rows a row tile
    /// and two more.
    #[test]
    fn interleaved_matmul_matches_the_block_matmul_on_dequantized_activations() {
        let encodings = [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K];
        // Q6_K's halves take no words (the scheduler gives words to Q8_0, word
        // pairs to nibbles, six-bit levels and Q8_0 without VNNI).
        for (encoding, levels) in encodings.into_iter().flat_map(|e| ActivationLevels::ALL.map(|l| (e, l))).filter(|&(e, l)| !(e == WeightEncoding::Q6K && l == ActivationLevels::Int16Words)) {
            // Q4_K's super-blocks need whole 256s.
            let (k, n) = (if encoding.block() == 256 { 512usize } else { 96 }, 48usize);
            let parts = random_parts(encoding, n, k, 7);
            let packed = interleaved_parts(encoding, &parts, n, k);
            for ((m, seq, addend), register_tile) in panel_cases() {
                let x = rand(m * k, 3);
                let width = k * levels.bytes() as usize;
                let mut qbufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![0; m * width]), Buffer::F32(vec![0.0; m * 2 * k / 32])];
                let quantize = quantize_to(k as u64, levels, DotForm::Int8, seq);
                run(&quantize, &mut qbufs, m as u64);
                let (Buffer::I8(q), Buffer::F32(s)) = (&qbufs[1], &qbufs[2]) else { unreachable!() };
                let level = |at: usize| match levels {
                    ActivationLevels::Int8 => q[at] as f32,
                    ActivationLevels::Int16Planes => (HIGH_PLANE_WEIGHT as i32 * q[(at / k) * width + at % k] as i32 + q[(at / k) * width + k + at % k] as i32) as f32,
                    words => {
                        let word = if words == ActivationLevels::Int16WordPairs { word_pair_position((at % k) as i64) as usize } else { at % k };
                        i16::from_le_bytes([q[(at / k) * width + 2 * word] as u8, q[(at / k) * width + 2 * word + 1] as u8]) as f32
                    }
                };
                let xd: Vec<f32> = (0..m * k).map(|at| s[(at / k) * 2 * (k / 32) + (at % k) / 32] * level(at)).collect();
                let r_values = rand(if addend == Some(Broadcast::Row) { n } else { m * n }, 4);
                let r = addend.map(|_| &r_values[..]);
                let mut acts = vec![qbufs[1].clone(), qbufs[2].clone()];
                // Q6_K: the levels' sums per 16 values.
                if encoding == WeightEncoding::Q6K {
                    let mut sums = vec![qbufs[1].clone(), Buffer::I32(vec![0; m * k / 16])];
                    run(&level_half_sums(k as u64, levels, seq), &mut sums, m as u64);
                    acts.push(sums.pop().expect("the sums"));
                }
                let got = run_matmul(&matmul_interleaved(k as u64, n as u64, encoding, addend, seq, register_tile, levels), acts, &packed, r, (m, n));
                let want = run_matmul(&matmul_blocks(k as u64, n as u64, encoding, addend, seq), vec![Buffer::F32(xd)], &parts, r, (m, n));
                let scale = want.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 2e-5 * scale, "{} {levels:?}: interleaved {g} vs row-major {w}", encoding.name());
                }
            }
        }
    }
}
