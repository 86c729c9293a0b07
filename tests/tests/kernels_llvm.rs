//! Differential tests of both backends: every kernel family, compiled by LLVM (for
//! this machine and for x86-64-v3) and by Cranelift, against the kernel-IR reference
//! interpreter on random inputs, with a per-family tolerance.

use maxc_codegen::{llvm::compile_shared, CpuTarget};
use maxc_kernels::interp::{run, Buffer};
use maxc_kernels::library::attention::{attention, attention_combine, attention_partial, kv_store, AttentionShape, KeyLayout};
use maxc_kernels::library::attention_ragged::{attention_ragged, RaggedShape};
use maxc_kernels::library::pooling::{l2_normalize_rows, mean_rows_ragged};
use maxc_kernels::library::copy::slice_columns;
use maxc_kernels::library::elementwise::{binary, swiglu, unary, Binary, Broadcast, Unary};
use maxc_kernels::library::embedding::{embedding, embedding_in};
use maxc_kernels::library::matmul::{matmul, matmul_add, matmul_rowwise};
use maxc_kernels::library::matmul_blocks::{matmul_blocks, matmul_blocks_rowwise};
use maxc_kernels::library::matmul_int8::{dot_form, matmul_int8};
use maxc_kernels::library::matmul_interleaved::matmul_interleaved;
use maxc_kernels::library::matmul_panel::{matmul_panel, PanelWeights};
use maxc_kernels::library::moe::{moe_activation, moe_combine, MoeActivation, moe_gather, moe_group, moe_matmul_interleaved, moe_matmul_panel, moe_matmul_panel_rows, moe_matmul_rows, moe_route, moe_router, MoeRouting};
use maxc_kernels::library::quantize_activations::{level_half_sums, quantize_q16, quantize_q8, quantize_to, round_bf16, ActivationLevels};
use maxc_kernels::library::rms_norm::{layer_norm, rms_norm};
use maxc_kernels::library::rope::rope;
use maxc_kernels::library::{RegisterTile, SeqMode};
use maxc_kernels::ir::DotForm;
use maxc_kernels::{ElemType, Kernel};
use maxrun_runtime::code::{KernelFn, LoadedCode};
use maxrun_runtime::format::{Layout, WeightEncoding};
use maxc_tests::kernel_check::{assert_matches_interpreter, assert_warp_mapping_matches, inputs, interleaved_levels, reduction_tol, Case, Rng};

/// The register tiles a kernel of `seq` is built with: both in prefill (the
/// AVX-512 and the AVX2 one, whatever this machine has), the one decode shape.
fn register_tiles(seq: SeqMode) -> Vec<RegisterTile> {
    if seq.is_decode() {
        vec![RegisterTile::ZMM]
    } else {
        vec![RegisterTile::ZMM, RegisterTile::YMM]
    }
}

/// The tile maxc builds a target's kernels with where it has no AVX-512:
/// x86-64-v3's (AVX2), and Cranelift's (`CompileConfig`: Cranelift emits
/// scalar baseline code, and AVX-512's 8-row tiles, lowered to scalars, take
/// it seconds per kernel to allocate).
fn tiles_without_avx512(_: SeqMode) -> Vec<RegisterTile> {
    vec![RegisterTile::for_cpu(false)]
}

/// The tiles the LLVM differential tests build `spec`'s kernels with: this
/// machine both prefill tiles (each tile's code checked where it runs
/// natively, whichever this machine has), x86-64-v3 the one maxc schedules
/// for it (AVX-512's tile on AVX2 is code maxc never emits).
fn target_tiles(spec: &str) -> &'static dyn Fn(SeqMode) -> Vec<RegisterTile> {
    match spec {
        "cpu:x86-64-v3" => &tiles_without_avx512,
        _ => &register_tiles,
    }
}

fn cases() -> Vec<Case> {
    cases_tiled(&register_tiles)
}

/// The differential cases with the register tiles `tiles` gives each sequence mode.
fn cases_tiled(tiles: &dyn Fn(SeqMode) -> Vec<RegisterTile>) -> Vec<Case> {
    let mut v = Vec::new();
    for seq in [SeqMode::Dynamic, SeqMode::Fixed(1)] {
        let s = match seq {
            SeqMode::Dynamic => 5usize,
            SeqMode::Fixed(n) => n as usize,
        };
        v.push(Case { kernel: embedding(7, 13, WeightEncoding::Float32, seq), sizes: vec![7 * 13, s, s * 13], int_max: 7, seq: s as u64, tol: 0.0 });
        v.push(Case { kernel: embedding(7, 13, WeightEncoding::BFloat16, seq), sizes: vec![7 * 13, s, s * 13], int_max: 7, seq: s as u64, tol: 0.0 });
        v.push(Case { kernel: embedding(7, 64, WeightEncoding::Q8_0, seq), sizes: vec![7 * 64, 7 * 2, s, s * 64], int_max: 7, seq: s as u64, tol: 1e-6 });
        v.push(Case { kernel: embedding(7, 64, WeightEncoding::Q4_1, seq), sizes: vec![7 * 32, 7 * 2, 7 * 2, s, s * 64], int_max: 7, seq: s as u64, tol: 1e-6 });
        v.push(Case { kernel: matmul(37, 19, ElemType::F32, seq), sizes: vec![s * 37, 19 * 37, s * 19], int_max: 1, seq: s as u64, tol: reduction_tol(37) });
        v.push(Case { kernel: matmul(256, 64, ElemType::F32, seq), sizes: vec![s * 256, 64 * 256, s * 64], int_max: 1, seq: s as u64, tol: reduction_tol(256) });
        v.push(Case { kernel: matmul(64, 20, ElemType::BF16, seq), sizes: vec![s * 64, 20 * 64, s * 20], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        v.push(Case { kernel: matmul(64, 20, ElemType::F16, seq), sizes: vec![s * 64, 20 * 64, s * 20], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        v.push(Case { kernel: matmul(576, 19, ElemType::F32, seq), sizes: vec![s * 576, 19 * 576, s * 19], int_max: 1, seq: s as u64, tol: reduction_tol(576) });
        v.push(Case { kernel: matmul_add(64, 21, Broadcast::None, ElemType::F32, seq), sizes: vec![s * 64, 21 * 64, s * 21, s * 21], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        v.push(Case { kernel: matmul_add(64, 24, Broadcast::Row, ElemType::BF16, seq), sizes: vec![s * 64, 24 * 64, 24, s * 24], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        // The float GPU form: a task per column, a row tile at prefill, 21 columns (a padded last task).
        v.push(Case { kernel: matmul_rowwise(64, 21, ElemType::BF16, None, seq), sizes: vec![s * 64, 21 * 64, s * 21], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        v.push(Case { kernel: matmul_rowwise(40, 21, ElemType::F32, Some(Broadcast::None), seq), sizes: vec![s * 40, 21 * 40, s * 21, s * 21], int_max: 1, seq: s as u64, tol: reduction_tol(40) });
        // Panel-packed float weights (48 columns: a two-panel task and a single
        // panel), in prefill with each target's register tile.
        for tile in tiles(seq) {
            v.push(Case { kernel: matmul_panel(40, 48, PanelWeights::Float(ElemType::F32), None, seq, tile), sizes: vec![s * 40, 48 * 40, s * 48], int_max: 1, seq: s as u64, tol: reduction_tol(40) });
            v.push(Case { kernel: matmul_panel(40, 32, PanelWeights::Float(ElemType::BF16), Some(Broadcast::Row), seq, tile), sizes: vec![s * 40, 32 * 40, 32, s * 32], int_max: 1, seq: s as u64, tol: reduction_tol(40) });
            v.push(Case { kernel: matmul_panel(40, 16, PanelWeights::Float(ElemType::F32), Some(Broadcast::None), seq, tile), sizes: vec![s * 40, 16 * 40, s * 16, s * 16], int_max: 1, seq: s as u64, tol: reduction_tol(40) });
            // Random fp8 codes decode to magnitudes up to 448 (times the row
            // scale), so a sum near 1 can come from terms near 100: the rounding
            // error follows the terms, 2^5 times the float cases'.
            v.push(Case { kernel: matmul_panel(40, 48, PanelWeights::Float8E4M3, Some(Broadcast::Row), seq, tile), sizes: vec![s * 40, 48 * 40, 48, 48, s * 48], int_max: 1, seq: s as u64, tol: 32.0 * reduction_tol(40) });
            // 19 rows: two full tiles of AVX-512's 8-row float panel tile
            // (`RegisterTile::for_float_panels`) and 3 more, bf16 and f16, as a
            // step of few rows (one panel at a time) and with `FEW_ROWS` more
            // (the prefill tile).
            if !seq.is_decode() {
                let few = maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
                for (elem, rows) in [ElemType::BF16, ElemType::F16].into_iter().flat_map(|e| [(e, 19usize), (e, few + 19)]) {
                    v.push(Case { kernel: matmul_panel(40, 48, PanelWeights::Float(elem), Some(Broadcast::None), seq, tile), sizes: vec![rows * 40, 48 * 40, rows * 48, rows * 48], int_max: 1, seq: rows as u64, tol: reduction_tol(40) });
                }
            }
        }
        // Block-quantized weights: x, every part, [r], out.
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Float8E4M3, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let (k, n) = if encoding.block() == 256 { (512u64, 21u64) } else { (96, 21) };
            for addend in [None, Some(Broadcast::Row), Some(Broadcast::None)] {
                let mut sizes = vec![s * k as usize];
                sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                match addend {
                    Some(Broadcast::Row) => sizes.push(n as usize),
                    Some(_) => sizes.push(s * n as usize),
                    None => {}
                }
                sizes.push(s * n as usize);
                {
                    // The GPU form (a whole block per lane and k iteration, a row tile at prefill).
                    v.push(Case { kernel: matmul_blocks_rowwise(k, n, encoding, addend, seq), sizes: sizes.clone(), int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) });
                }
                v.push(Case { kernel: matmul_blocks(k, n, encoding, addend, seq), sizes, int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) });
            }
        }
        // Int8 activations (DotBlock: VNNI on this machine, the generic form on
        // x86-64-v3, scalar code in Cranelift) and their quantization.
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_1, WeightEncoding::Q4K] {
            let (k, n) = (256u64, 21u64);
            for addend in [None, Some(Broadcast::Row)] {
                let mut sizes = vec![s * k as usize, s * 2 * k as usize / 32];
                sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                if addend.is_some() {
                    sizes.push(n as usize);
                }
                sizes.push(s * n as usize);
                v.push(Case { kernel: matmul_int8(k, n, encoding, addend, seq), sizes, int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) });
            }
            let form = dot_form(encoding, k).unwrap();
            v.push(Case { kernel: quantize_q8(k, form, seq), sizes: vec![s * k as usize, s * k as usize, s * 2 * k as usize / 32], int_max: 1, seq: s as u64, tol: 1e-6 });
        }
        // Weights interleaved by 16 rows (DotRows): 48 columns are one full task
        // and a last single panel; k = 96 is three blocks (Q4_K: one super-block
        // of 256). Their tables gathered.
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let (k, n) = (if encoding.block() == 256 { 256 } else { 96 }, 48u64);
            let parts: Vec<usize> = (0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize).collect();
            for addend in [None, Some(Broadcast::None)] {
                let mut sizes = vec![s * k as usize, s * 2 * k as usize / 32];
                // Q6_K: the activations' sums per 16 values (random here: every
                // backend reads them alike, as the interpreter does).
                if encoding == WeightEncoding::Q6K {
                    sizes.push(s * k as usize / 16);
                }
                sizes.extend(&parts);
                if addend.is_some() {
                    sizes.push(s * n as usize);
                }
                sizes.push(s * n as usize);
                for tile in tiles(seq) {
                    v.push(Case { kernel: matmul_interleaved(k, n, encoding, addend, seq, tile, ActivationLevels::Int8), sizes: sizes.clone(), int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) });
                    // 16-bit activations: two byte planes per row, or words.
                    let mut sizes = sizes.clone();
                    sizes[0] *= 2;
                    // (Q6_K's two halves take planes or word pairs, no words.)
                    for sixteen in [ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs].into_iter().filter(|&l| !(encoding == WeightEncoding::Q6K && l == ActivationLevels::Int16Words)) {
                        v.push(Case { kernel: matmul_interleaved(k, n, encoding, addend, seq, tile, sixteen), sizes: sizes.clone(), int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) });
                    }
                }
            }
            let mut sizes = parts.clone();
            sizes.extend([s, s * k as usize]);
            v.push(Case { kernel: embedding_in(n, k, encoding, Layout::Interleaved16, seq), sizes, int_max: n as i32, seq: s as u64, tol: 0.0 });
        }
        // 15 rows: AVX2's 8-row words tile, then the leftover rows in tiles of
        // 4, 2 and 1 (`row_tiles`); the 4-row planes and word-pairs tiles three
        // times and 2 + 1. Both as a step of few rows (one panel at a time,
        // prefetched) and with `FEW_ROWS` more (the prefill tiles).
        if !seq.is_decode() {
            let few = maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
            for ((encoding, levels), rows) in [(WeightEncoding::Q8_0, ActivationLevels::Int16Words), (WeightEncoding::Q4_1, ActivationLevels::Int16Planes), (WeightEncoding::Q4_0, ActivationLevels::Int16WordPairs)].into_iter().flat_map(|e| [(e, 15usize), (e, few + 15)]) {
                let (k, n) = (96u64, 48u64);
                let mut sizes = vec![rows * 2 * k as usize, rows * 2 * k as usize / 32];
                sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                sizes.push(rows * n as usize);
                for tile in tiles(seq) {
                    v.push(Case { kernel: matmul_interleaved(k, n, encoding, None, seq, tile, levels), sizes: sizes.clone(), int_max: 1, seq: rows as u64, tol: reduction_tol(k * 16) });
                }
            }
            // Q4_K with int8 activations in 8 x 2 (the tile of some Intel
            // CPUs, `CpuTarget::q4_k_int8_tiles_take_eight_rows`) where the
            // AVX-512 tile is built: 19 rows are two whole tiles and 3 rows
            // more, and as a step of few rows its 4 x 1.
            if tiles(seq).contains(&RegisterTile::ZMM) {
                let (encoding, k, n) = (WeightEncoding::Q4K, 256u64, 48u64);
                for rows in [19usize, few + 19] {
                    let mut sizes = vec![rows * k as usize, rows * 2 * k as usize / 32];
                    sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                    sizes.push(rows * n as usize);
                    v.push(Case { kernel: matmul_interleaved(k, n, encoding, None, seq, RegisterTile::ZMM_EIGHT_ROWS, ActivationLevels::Int8), sizes, int_max: 1, seq: rows as u64, tol: reduction_tol(k * 16) });
                }
            }
        }
        v.push(Case { kernel: quantize_q8(96, DotForm::Int8, seq), sizes: vec![s * 96, s * 96, s * 6], int_max: 1, seq: s as u64, tol: 1e-6 });
        for sixteen in [ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs] {
            v.push(Case { kernel: quantize_q16(96, sixteen, seq), sizes: vec![s * 96, s * 2 * 96, s * 6], int_max: 1, seq: s as u64, tol: 1e-6 });
        }
        for (levels, bytes) in [(ActivationLevels::Int8, 1), (ActivationLevels::Int16Planes, 2), (ActivationLevels::Int16WordPairs, 2)] {
            v.push(Case { kernel: level_half_sums(96, levels, seq), sizes: vec![s * 96 * bytes, s * 6], int_max: 1, seq: s as u64, tol: 0.0 });
        }
        v.push(Case { kernel: swiglu(10, seq), sizes: vec![s * 20, s * 10], int_max: 1, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: rms_norm(33, 33, 1e-5, seq), sizes: vec![s * 33, 33, s * 33], int_max: 1, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: layer_norm(40, 1e-5, seq), sizes: vec![s * 40, 40, 40, s * 40], int_max: 1, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: rms_norm(96, 32, 1e-6, seq), sizes: vec![s * 96, 32, s * 96], int_max: 1, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: rope(24, 8, seq), sizes: vec![s * 24, s, 4, s * 24], int_max: 40, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: slice_columns(12, 3, 5, seq), sizes: vec![s * 12, s * 5], int_max: 1, seq: s as u64, tol: 0.0 });
        for cache in [ElemType::F32, ElemType::F16] {
            v.push(Case { kernel: kv_store(2, 4, 64, cache, KeyLayout::Rows, seq), sizes: vec![s * 8, s * 8, s, 64 * 8, 64 * 8], int_max: 64, seq: s as u64, tol: 0.0 });
        }
        for window in [None, Some(3)] {
            for (heads, kv_heads, head_dim, cache) in [(4, 2, 4, ElemType::F32), (6, 2, 32, ElemType::F32), (6, 2, 32, ElemType::F16)] {
                let shape = AttentionShape { heads, kv_heads, head_dim, scale: 0.5, window, max_len: 40, softcap: if head_dim == 4 { Some(3.0) } else { None }, causal: window.is_some() || head_dim == 4, cache, keys: KeyLayout::Rows, sinks: false };
                let (qw, kvw) = ((heads * head_dim) as usize, (kv_heads * head_dim) as usize);
                // Positions are drawn below 40 and the caches hold 40 random positions.
                let sizes = whole_attention_sizes(&shape, s, 40);
                v.push(Case { kernel: attention(shape, seq), sizes, int_max: 40, seq: s as u64, tol: 1e-5 });
                // Flash-decoding's two kernels (positions below 40 make one or two
                // chunks of 32; the partials' unread chunks are never looked at).
                if shape.causal {
                    for splits in [1, 3] {
                        let (scratch, parts) = (shape.split_scratch_per_token(splits) as usize, shape.partials_per_token(splits) as usize);
                        let sizes = vec![s * qw, s, 40 * kvw, 40 * kvw, s * scratch, s * parts];
                        v.push(Case { kernel: attention_partial(shape, splits, seq), sizes, int_max: 40, seq: s as u64, tol: 1e-5 });
                        v.push(Case { kernel: attention_combine(shape, splits, seq), sizes: vec![s * parts, s, s * qw], int_max: 40, seq: s as u64, tol: 1e-5 });
                    }
                }
            }
        }
        for op in [Unary::Neg, Unary::Exp, Unary::Silu, Unary::GeluTanh, Unary::Rsqrt, Unary::Tanh] {
            v.push(Case { kernel: unary(op, 17, seq), sizes: vec![s * 17, s * 17], int_max: 1, seq: s as u64, tol: 1e-5 });
        }
        for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Max] {
            for (bc, blen) in [(Broadcast::None, s * 9), (Broadcast::Row, 9), (Broadcast::Scalar, 1)] {
                v.push(Case { kernel: binary(op, 9, bc, seq), sizes: vec![s * 9, blen, s * 9], int_max: 1, seq: s as u64, tol: 1e-6 });
            }
        }
    }
    // Cases added later go last, so that the random inputs of the ones above
    // stay what they were. (With other draws, a Q6_K word-pairs output had
    // cancelled to -0.359 from terms of about 3e5, and the interpreter's
    // order of the terms rounded it to -0.356: the comparison now allows a few
    // roundings of the terms' magnitude, `kernel_check::term_magnitudes`.)
    for seq in [SeqMode::Dynamic, SeqMode::Fixed(1)] {
        let s = match seq {
            SeqMode::Dynamic => 5usize,
            SeqMode::Fixed(n) => n as usize,
        };
        v.push(Case { kernel: round_bf16(40, seq), sizes: vec![s * 40, s * 40], int_max: 1, seq: s as u64, tol: 0.0 });
        // Tied float tables packed for the panel matmul (rows 16 apart in memory).
        for encoding in [WeightEncoding::Float32, WeightEncoding::BFloat16, WeightEncoding::Float16] {
            v.push(Case { kernel: embedding_in(32, 13, encoding, Layout::Panel16, seq), sizes: vec![32 * 13, s, s * 13], int_max: 32, seq: s as u64, tol: 0.0 });
        }
        v.push(Case { kernel: embedding_in(32, 64, WeightEncoding::Float8E4M3, Layout::Panel16, seq), sizes: vec![32 * 64, 32, s, s * 64], int_max: 32, seq: s as u64, tol: 1e-6 });
        // bfloat16 pair dots (bf16 activations; `vdpbf16ps` where the target
        // has AVX512_BF16, two products per lane elsewhere), each target's
        // register tile; in prefill 19 rows (two of AVX-512's 8-row tiles and
        // 3 more) as a step of few rows and with `FEW_ROWS` more.
        for tile in tiles(seq) {
            v.push(Case { kernel: matmul_panel(40, 48, PanelWeights::BFloat16Pairs, Some(Broadcast::Row), seq, tile), sizes: vec![s * 40, 48 * 40, 48, s * 48], int_max: 1, seq: s as u64, tol: reduction_tol(40) });
            if !seq.is_decode() {
                let few = maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
                for rows in [19usize, few + 19] {
                    v.push(Case { kernel: matmul_panel(40, 48, PanelWeights::BFloat16Pairs, Some(Broadcast::None), seq, tile), sizes: vec![rows * 40, 48 * 40, rows * 48, rows * 48], int_max: 1, seq: rows as u64, tol: reduction_tol(40) });
                }
            }
        }
        // Keys in panels of 16 positions (CPU code): the store, and attention
        // whole and split (flash-decoding's first half) over caches of 48 random
        // positions, windows that start inside a panel included.
        for cache in [ElemType::F32, ElemType::F16] {
            v.push(Case { kernel: kv_store(2, 4, 64, cache, KeyLayout::Panels, seq), sizes: vec![s * 8, s * 8, s, 64 * 8, 64 * 8], int_max: 64, seq: s as u64, tol: 0.0 });
            for (heads, kv_heads, head_dim, window) in [(6, 2, 32, None), (6, 2, 32, Some(21)), (4, 4, 16, None), (8, 2, 24, Some(5))] {
                let shape = AttentionShape { heads, kv_heads, head_dim, scale: 0.5, window, max_len: 48, softcap: None, causal: true, cache, keys: KeyLayout::Panels, sinks: false };
                let (qw, kvw) = ((heads * head_dim) as usize, (kv_heads * head_dim) as usize);
                let sizes = whole_attention_sizes(&shape, s, 48);
                v.push(Case { kernel: attention(shape, seq), sizes, int_max: 48, seq: s as u64, tol: 1e-5 });
                for splits in [1, 3] {
                    let (scratch, parts) = (shape.split_scratch_per_token(splits) as usize, shape.partials_per_token(splits) as usize);
                    let sizes = vec![s * qw, s, 48 * kvw, 48 * kvw, s * scratch, s * parts];
                    v.push(Case { kernel: attention_partial(shape, splits, seq), sizes, int_max: 48, seq: s as u64, tol: 1e-5 });
                }
            }
        }
        // Q6_K's prefill tiles of one panel (AVX-512: 8 rows with int8
        // activations, 4 with int16 planes; `RegisterTile::six_bit_zmm`), the
        // half offsets in the accumulators' start: 15 rows as a step of few
        // rows and `FEW_ROWS` + 15 (five 8-row tiles and 4 + 2 + 1, or eleven
        // 4-row tiles and 2 + 1), a super-block of 256 and one of 512.
        if !seq.is_decode() {
            let few = maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
            let encoding = WeightEncoding::Q6K;
            for (k, rows) in [(256u64, 15usize), (256, few + 15), (512, few + 15)] {
                let n = 48u64;
                for levels in [ActivationLevels::Int8, ActivationLevels::Int16Planes] {
                    let mut sizes = vec![rows * levels.bytes() as usize * k as usize, rows * 2 * k as usize / 32, rows * k as usize / 16];
                    sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                    sizes.push(rows * n as usize);
                    for tile in tiles(seq) {
                        v.push(Case { kernel: matmul_interleaved(k, n, encoding, None, seq, tile, levels), sizes: sizes.clone(), int_max: 1, seq: rows as u64, tol: reduction_tol(k * 16) });
                    }
                }
            }
        }
    }
    v.extend(ragged_cases());
    v.extend(sink_cases());
    v
}

/// The mixture-of-experts kernels: routing (every rule, 8 experts, top 2 and
/// top 8 of 8 experts), the grouping and gathering of a step's slots, the
/// combine, and the grouped matmuls (each layout; decode groups of at most one
/// row, prefill groups of random sizes around `FEW_ROWS`), whose `offsets`
/// `kernel_check::inputs` makes a random partition of the grouped rows.
fn moe_cases() -> Vec<Case> {
    moe_cases_tiled(&register_tiles)
}

/// [`moe_cases`] with the register tiles `tiles` gives each sequence mode.
fn moe_cases_tiled(tiles: &dyn Fn(SeqMode) -> Vec<RegisterTile>) -> Vec<Case> {
    let mut v = Vec::new();
    let (experts, k, n) = (5u64, 64u64, 48u64);
    for (seq, rows) in [(SeqMode::Fixed(1), 3usize), (SeqMode::Dynamic, 11), (SeqMode::Dynamic, 2 * maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize + 7)] {
        let e = experts as usize;
        for tile in tiles(seq) {
            for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float(ElemType::BF16), PanelWeights::Float8E4M3] {
                let mut sizes = vec![rows * k as usize, e + 1, e * (n * k) as usize];
                if weights == PanelWeights::Float8E4M3 {
                    sizes.push(e * n as usize);
                }
                sizes.push(rows * n as usize);
                // fp8 codes decode to magnitudes up to 448 (the dense case's allowance).
                let tol = if weights == PanelWeights::Float8E4M3 { 32.0 * reduction_tol(k) } else { reduction_tol(k) };
                v.push(Case { kernel: moe_matmul_panel(k, n, experts, weights, seq, tile), sizes, int_max: rows as i32, seq: rows as u64, tol });
            }
            for (encoding, levels) in [(WeightEncoding::Q8_0, ActivationLevels::Int16Words), (WeightEncoding::Q8_0, ActivationLevels::Int16Planes), (WeightEncoding::Q4K, ActivationLevels::Int8), (WeightEncoding::Q6K, ActivationLevels::Int16Planes), (WeightEncoding::Q4_1, ActivationLevels::Int16WordPairs)] {
                let k = if encoding.block() == 256 { 256 } else { k };
                let mut sizes = vec![rows * levels.bytes() as usize * k as usize, rows * 2 * k as usize / 32];
                if encoding == WeightEncoding::Q6K {
                    sizes.push(rows * k as usize / 16);
                }
                sizes.push(e + 1);
                sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[experts * n, k]).unwrap() as usize));
                sizes.push(rows * n as usize);
                v.push(Case { kernel: moe_matmul_interleaved(k, n, experts, encoding, seq, tile, levels), sizes, int_max: rows as i32, seq: rows as u64, tol: reduction_tol(k * 16) });
            }
        }
        let s = match seq {
            SeqMode::Fixed(_) => 1,
            SeqMode::Dynamic => rows,
        };
        for routing in [MoeRouting::SoftmaxTopK { renormalize: false }, MoeRouting::SoftmaxTopK { renormalize: true }, MoeRouting::TopKSoftmax] {
            for top_k in [2u64, 8] {
                v.push(Case { kernel: moe_route(8, top_k, routing), sizes: vec![s * 8, s * top_k as usize, s * top_k as usize], int_max: 1, seq: s as u64, tol: 1e-6 });
            }
        }
        for encoding in [WeightEncoding::Float32, WeightEncoding::BFloat16] {
            v.push(Case { kernel: moe_router(64, 8, encoding, false), sizes: vec![s * 64, 8 * 64, s * 8], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
            v.push(Case { kernel: moe_router(64, 8, encoding, true), sizes: vec![s * 64, 8 * 64, 8, s * 8], int_max: 1, seq: s as u64, tol: reduction_tol(64) });
        }
        v.push(Case { kernel: moe_group(experts, 2), sizes: vec![2 * s, e + 1, e, 2 * s, 2 * s], int_max: experts as i32, seq: s as u64, tol: 0.0 });
        v.push(Case { kernel: moe_gather(24, 2), sizes: vec![s * 24, 2 * s, 2 * s * 24], int_max: s as i32, seq: s as u64, tol: 0.0 });
        v.push(Case { kernel: moe_combine(24, 3, None, false), sizes: vec![3 * s * 24, 3 * s, 3 * s, s * 24], int_max: 3 * s as i32, seq: s as u64, tol: 1e-6 });
        // Qwen2-MoE: the shared expert behind its sigmoid gate.
        v.push(Case { kernel: moe_combine(24, 3, None, true), sizes: vec![3 * s * 24, 3 * s, 3 * s, s * 24, 24, s * 24, s * 24], int_max: 3 * s as i32, seq: s as u64, tol: 1e-5 });
        // gpt-oss: the down biases by each slot's expert (ids past the experts are clamped).
        v.push(Case { kernel: moe_combine(24, 3, Some(e as u64), false), sizes: vec![3 * s * 24, 3 * s, 3 * s, 3 * s, e * 24, s * 24], int_max: 3 * s as i32, seq: s as u64, tol: 1e-6 });
        let clamped = MoeActivation::ClampedSwiGlu { alpha: 1.702, limit: 0.5 };
        v.push(Case { kernel: moe_activation(24, 2, clamped, Some(e as u64)), sizes: vec![2 * s * 48, 2 * s, 2 * s, e * 48, 2 * s * 24], int_max: 2 * s as i32, seq: s as u64, tol: 1e-5 });
        v.push(Case { kernel: moe_activation(24, 2, clamped, None), sizes: vec![2 * s * 48, 2 * s * 24], int_max: 1, seq: s as u64, tol: 1e-5 });
    }
    for encoding in [WeightEncoding::Float32, WeightEncoding::BFloat16, WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q6K, WeightEncoding::Q5K] {
        let k = if encoding.block() == 256 { 256 } else { 64u64 };
        let rows = 13usize;
        let mut sizes = vec![rows * k as usize, 5 + 1];
        sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[5 * 40, k]).unwrap() as usize));
        sizes.push(rows * 40);
        v.push(Case { kernel: moe_matmul_rows(k, 40, 5, encoding), sizes, int_max: rows as i32, seq: rows as u64, tol: reduction_tol(k) });
    }
    for weights in [PanelWeights::Float(ElemType::F32), PanelWeights::Float8E4M3] {
        let rows = 9usize;
        let mut sizes = vec![rows * k as usize, 5 + 1, 5 * (n * k) as usize];
        if weights == PanelWeights::Float8E4M3 {
            sizes.push(5 * n as usize);
        }
        sizes.push(rows * n as usize);
        let tol = if weights == PanelWeights::Float8E4M3 { 32.0 * reduction_tol(k) } else { reduction_tol(k) };
        v.push(Case { kernel: moe_matmul_panel_rows(k, n, 5, weights), sizes, int_max: rows as i32, seq: rows as u64, tol });
    }
    v
}

/// The kernels of sentence encoders' batch steps: whole sequences as runs of
/// the step's rows, of random lengths (`kernel_check::inputs` partitions
/// `int_max` rows into the `starts` parameter's sequences): one row alone, 17
/// rows in 3 sequences, 60 in 4 (lengths such as 1, 2, 17, 40), 97 in 9.
/// Attention is launched over the rows; pooling and normalization over the
/// sequences.
fn ragged_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (rows, sequences) in [(1usize, 1usize), (17, 3), (60, 4), (97, 9)] {
        // all-MiniLM-L6-v2's heads; grouped heads with soft-capping.
        for shape in [RaggedShape { heads: 12, kv_heads: 12, head_dim: 32, scale: 0.176_776_7, softcap: None }, RaggedShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, softcap: Some(2.5) }] {
            let (qw, kvw) = ((shape.heads * shape.head_dim) as usize, (shape.kv_heads * shape.head_dim) as usize);
            let sizes = vec![rows * qw, rows * kvw, rows * kvw, rows, sequences + 1, rows * qw];
            v.push(Case { kernel: attention_ragged(shape), sizes, int_max: rows as i32, seq: rows as u64, tol: reduction_tol(shape.head_dim * rows as u64) });
        }
        for width in [24u64, 384] {
            let w = width as usize;
            v.push(Case { kernel: mean_rows_ragged(width), sizes: vec![rows * w, sequences + 1, sequences * w], int_max: rows as i32, seq: sequences as u64, tol: reduction_tol(rows as u64) });
            v.push(Case { kernel: l2_normalize_rows(width), sizes: vec![sequences * w, sequences * w], int_max: 1, seq: sequences as u64, tol: reduction_tol(width) });
        }
    }
    v
}

/// Kernels compiled in one or more shared objects, found by name.
struct Compiled {
    code: Vec<LoadedCode>,
    /// Each kernel's IR and the object that holds it.
    kernels: std::collections::HashMap<String, (Kernel, usize)>,
}

impl Compiled {
    /// `kernels` (distinct names) compiled by `compile` in `parts` shared
    /// objects, each on a thread of its own.
    fn new(kernels: &[Kernel], parts: usize, compile: &(dyn Fn(&[Kernel]) -> Vec<u8> + Sync)) -> Compiled {
        let chunks: Vec<Vec<Kernel>> = (0..parts).map(|p| kernels.iter().skip(p).step_by(parts).cloned().collect()).filter(|c: &Vec<Kernel>| !c.is_empty()).collect();
        let objects: Vec<Vec<u8>> = std::thread::scope(|s| {
            let running: Vec<_> = chunks.iter().map(|c| s.spawn(move || compile(c))).collect();
            running.into_iter().map(|t| t.join().expect("a compile thread panicked")).collect()
        });
        let code = objects.iter().map(|o| LoadedCode::load(o).unwrap()).collect();
        let kernels = chunks.into_iter().enumerate().flat_map(|(i, c)| c.into_iter().map(move |k| (k.name.clone(), (k, i)))).collect();
        Compiled { code, kernels }
    }

    /// The object holding `kernel`, if compiled (its IR must be the one
    /// compiled under its name).
    fn object_of(&self, kernel: &Kernel) -> Option<usize> {
        let (compiled, at) = self.kernels.get(&kernel.name)?;
        assert!(compiled == kernel, "two different kernels are named {}", kernel.name);
        Some(*at)
    }

    /// The compiled `kernel`, if compiled.
    fn get(&self, kernel: &Kernel) -> Option<KernelFn> {
        self.object_of(kernel).map(|at| self.code[at].kernel(&kernel.name).unwrap())
    }
}

/// The kernels of [`cases`] (with [`target_tiles`]) compiled by LLVM for `spec` ("cpu" or
/// "cpu:x86-64-v3") once per run, on two threads: the differential test runs
/// them, and the tests of extreme bytes and batch invariance take the
/// kernels they share with it from here (LLVM's O3 over the 600-odd
/// kernels takes minutes per target).
fn llvm_cases(spec: &str) -> &'static Compiled {
    static HOST: std::sync::OnceLock<Compiled> = std::sync::OnceLock::new();
    static V3: std::sync::OnceLock<Compiled> = std::sync::OnceLock::new();
    let cell = match spec {
        "cpu" => &HOST,
        "cpu:x86-64-v3" => &V3,
        other => unreachable!("no shared compile for {other}"),
    };
    cell.get_or_init(|| {
        let target = CpuTarget::parse(spec).unwrap();
        Compiled::new(&distinct_kernels(&cases_tiled(target_tiles(spec))), 2, &|kernels| compile_shared(kernels, &target).unwrap().shared_object)
    })
}

/// Compiled kernels for an LLVM target: [`llvm_cases`]'s, and the others
/// compiled for the test that asked.
struct LlvmCode {
    shared: &'static Compiled,
    own: Compiled,
}

impl LlvmCode {
    fn new(spec: &str, kernels: &[Kernel]) -> LlvmCode {
        let shared = llvm_cases(spec);
        let missing: Vec<Kernel> = kernels.iter().filter(|k| shared.object_of(k).is_none()).cloned().collect();
        let target = CpuTarget::parse(spec).unwrap();
        LlvmCode { shared, own: Compiled::new(&missing, 1, &|kernels| compile_shared(kernels, &target).unwrap().shared_object) }
    }
}

/// A backend's compiled kernels, found by their IR.
trait Code {
    fn kernel(&self, kernel: &Kernel) -> KernelFn;
}

impl Code for Compiled {
    fn kernel(&self, kernel: &Kernel) -> KernelFn {
        self.get(kernel).unwrap_or_else(|| panic!("{} was not compiled", kernel.name))
    }
}

impl Code for LlvmCode {
    fn kernel(&self, kernel: &Kernel) -> KernelFn {
        self.shared.get(kernel).unwrap_or_else(|| self.own.kernel(kernel))
    }
}

/// The kernels of `all`, each name once.
fn distinct_kernels(all: &[Case]) -> Vec<Kernel> {
    let mut seen = std::collections::HashSet::new();
    all.iter().filter(|c| seen.insert(c.kernel.name.clone())).map(|c| c.kernel.clone()).collect()
}

fn check_target(spec: &str) {
    run_cases(spec, llvm_cases(spec), cases_tiled(target_tiles(spec)), 0x1234_5678);
}

/// Compiles `all` with `compile` and checks them ([`run_cases`]).
fn check_cases(spec: &str, compile: impl Fn(&[Kernel]) -> Vec<u8> + Sync, all: Vec<Case>, seed: u64) {
    let code = Compiled::new(&distinct_kernels(&all), 1, &compile);
    run_cases(spec, &code, all, seed);
}

/// Runs each case's compiled kernel (from `code`) three times on random
/// inputs and compares every output element with the interpreter.
fn run_cases(spec: &str, code: &dyn Code, all: Vec<Case>, seed: u64) {
    let mut rng = Rng(seed | 1);
    for case in &all {
        let f = code.kernel(&case.kernel);
        for trial in 0..3 {
            assert_matches_interpreter(spec, f, case, inputs(case, &mut rng), trial);
        }
    }
}

/// The GPU's mapping (one warp per task, some loops dealt to lanes, reductions
/// combined by a butterfly) gives what the sequential interpreter gives, for every
/// kernel family: the reference for the NVPTX lowering, checked here without a GPU.
/// Kernels whose split loops are long enough for a four-warp task: a 1536-long
/// GEMV row (vector chunks), and a 1027-long sum and map at offsets that are
/// multiples of 4 (vector chunks with three iterations left over).
fn long_loop_cases() -> Vec<Case> {
    use maxc_kernels::ir::{dsl::*, KernelBuilder, TaskCount, ValType};
    let mut out = Vec::new();
    for (seq, s) in [(SeqMode::Fixed(1), 1usize), (SeqMode::Dynamic, 3)] {
        out.push(Case { kernel: matmul(1536, 9, ElemType::F32, seq), sizes: vec![s * 1536, 9 * 1536, s * 9], int_max: 1, seq: s as u64, tol: reduction_tol(1536) });
        // Its GPU form: four warps per column, five rows (a row tile and one more) at prefill.
        let s = if s == 1 { 1 } else { 5 };
        out.push(Case { kernel: matmul_rowwise(1536, 9, ElemType::F32, None, seq), sizes: vec![s * 1536, 9 * 1536, s * 9], int_max: 1, seq: s as u64, tol: reduction_tol(1536) });
    }
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let sums = b.param("sums", ElemType::F32, true);
    let doubled = b.param("doubled", ElemType::F32, true);
    let (t, l, acc) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::F32));
    let at = || add(mul(v(t), i(1028)), v(l));
    let body = vec![
        set(acc, f(0.0)),
        for_vec(l, i(0), i(1027), vec![set(acc, add(v(acc), ld(x, at())))]),
        store(sums, v(t), v(acc)),
        for_vec(l, i(0), i(1027), vec![store(doubled, at(), mul(ld(x, at()), f(2.0)))]),
    ];
    let kernel = b.finish("ragged_long".into(), "test", TaskCount { per_seq: 0, fixed: 3 }, t, body);
    let m = maxc_kernels::warp::gpu_mapping(&kernel);
    assert_eq!(m.threads, maxc_kernels::warp::GROUP as u32);
    assert!(m.loops.iter().all(|l| matches!(l, maxc_kernels::warp::LoopMapping::Lanes { chunk: maxc_kernels::warp::VECTOR, .. })), "{m:?}");
    out.push(Case { kernel, sizes: vec![3 * 1028, 3, 3 * 1028], int_max: 1, seq: 1, tol: reduction_tol(1027) });
    out
}

#[test]
fn warp_mapping_matches_interpreter() {
    let mut rng = Rng(0x9e37_79b9);
    let mut split = 0;
    let mut groups = 0;
    for case in cases().into_iter().chain(long_loop_cases()) {
        groups += (maxc_kernels::warp::threads_per_task(&case.kernel) == maxc_kernels::warp::GROUP as u32) as usize;
        split += maxc_kernels::warp::loop_mappings(&case.kernel).iter().filter(|m| matches!(m, maxc_kernels::warp::LoopMapping::Lanes { .. })).count();
        let inputs = inputs(&case, &mut rng);
        assert_warp_mapping_matches(&case.kernel.name, &case, inputs);
    }
    assert!(split >= 20, "only {split} loops are dealt to lanes");
    assert!(groups >= 3, "only {groups} kernels run on four-warp tasks");
}

/// The mixture-of-experts kernels (`moe_cases`) on LLVM for this machine and
/// for x86-64-v3, Cranelift, and the GPU's warp mapping, against the interpreter.
#[test]
fn moe_kernels_match_interpreter_on_every_backend() {
    for spec in ["cpu", "cpu:x86-64-v3"] {
        let target = CpuTarget::parse(spec).unwrap();
        check_cases(spec, |kernels| compile_shared(kernels, &target).unwrap().shared_object, moe_cases_tiled(target_tiles(spec)), 0x51ed_270b);
    }
    check_cases("cranelift", |kernels| maxc_codegen::cranelift::compile_shared(kernels).unwrap().shared_object, moe_cases_tiled(&tiles_without_avx512), 0x51ed_270b);
    let mut rng = Rng(0x9e37_79b9);
    for case in moe_cases() {
        let inputs = inputs(&case, &mut rng);
        assert_warp_mapping_matches(&case.kernel.name, &case, inputs);
    }
}

#[test]
fn llvm_host_matches_interpreter() {
    check_target("cpu");
}

#[test]
fn llvm_x86_64_v3_matches_interpreter() {
    check_target("cpu:x86-64-v3");
}

#[test]
fn cranelift_matches_interpreter() {
    check_cases("cranelift", |kernels| maxc_codegen::cranelift::compile_shared(kernels).unwrap().shared_object, cases_tiled(&tiles_without_avx512), 0x1234_5678);
}

#[test]
fn avx512_kernels_prefer_512_bit_vectors() {
    let k = vec![matmul(256, 64, ElemType::F32, SeqMode::Fixed(1))];
    let v4 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v4").unwrap()).unwrap();
    assert!(v4.contains("\"prefer-vector-width\"=\"512\""), "missing prefer-vector-width");
    assert!(v4.contains("<16 x float>"), "the GEMV reduction is not vectorized to 512 bits");
    let v3 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap();
    assert!(v3.contains("<8 x float>") && !v3.contains("<16 x float>"), "x86-64-v3 must use 256-bit vectors");
}

/// bfloat16 panel rows are widened by a quadword permute and unpacks with zero
/// on x86-64-v3 (shuffle-port work beside the FMAs, `Stmt::WidenBf16`), by a
/// zero extension and shift on x86-64-v4; the kernels' values are the
/// interpreter's on both (`llvm_x86_64_v3_matches_interpreter`).
#[test]
fn bf16_panel_rows_widen_by_unpacks_on_avx2() {
    let k = vec![matmul_panel(256, 32, PanelWeights::Float(ElemType::BF16), None, SeqMode::Dynamic, RegisterTile::YMM)];
    let permute = "shufflevector <4 x i64>";
    let v3 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap();
    assert!(v3.contains(permute) && v3.contains("<i32 0, i32 2, i32 1, i32 3>"), "x86-64-v3 does not permute bf16 rows' quadwords");
    let v4 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v4").unwrap()).unwrap();
    assert!(!v4.contains(permute) && v4.contains("zext <16 x i16>"), "x86-64-v4 widens bf16 rows otherwise");
}

#[test]
fn int8_dots_use_vnni_where_the_target_has_it() {
    let k = vec![matmul_int8(256, 16, WeightEncoding::Q4_1, None, SeqMode::Fixed(1)), matmul_int8(256, 16, WeightEncoding::Q8_0, None, SeqMode::Fixed(1))];
    let rows = vec![matmul_interleaved(256, 32, WeightEncoding::Q4_1, None, SeqMode::Fixed(1), RegisterTile::ZMM, ActivationLevels::Int8), matmul_interleaved(256, 32, WeightEncoding::Q8_0, None, SeqMode::Fixed(1), RegisterTile::ZMM, ActivationLevels::Int8)];
    let vnni = maxc_codegen::llvm::emit_llvm_ir(&rows, &CpuTarget::parse("cpu:x86-64-v4+avx512vnni").unwrap()).unwrap();
    assert!(vnni.contains("@llvm.x86.avx512.vpdpbusd.512"), "no vpdpbusd for interleaved rows with avx512vnni");
    let vnni = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v4+avx512vnni").unwrap()).unwrap();
    assert!(vnni.contains("@llvm.x86.avx512.vpdpbusd.512"), "no vpdpbusd with avx512vnni");
    let v3 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap();
    assert!(!v3.contains("vpdpbusd"), "x86-64-v3 has no VNNI");
}

/// Int16 activations as words meet Q8_0's levels in word dots (`vpmaddwd`),
/// ymm on x86-64-v3 and zmm on x86-64-v4, with no byte dots and no activation
/// planes; decode and prefill.
#[test]
fn int16_words_use_word_dots() {
    for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
        let k = vec![matmul_interleaved(256, 32, WeightEncoding::Q8_0, None, seq, RegisterTile::YMM, ActivationLevels::Int16Words)];
        for (spec, dot) in [("cpu:x86-64-v3", "@llvm.x86.avx2.pmadd.wd"), ("cpu:x86-64-v4", "@llvm.x86.avx512.pmaddw.d.512")] {
            let ir = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse(spec).unwrap()).unwrap();
            assert!(ir.contains(dot) && !ir.contains("pmadd.ub.sw") && !ir.contains("pmaddubs"), "{spec} {seq:?}: words do not take {dot} alone");
        }
    }
}

/// fp8 panels convert their codes as halves a panel (16 lanes) at a time
/// (`vcvtph2ps`), decode and prefill; left to itself, LLVM 19 picks 4 lanes
/// with the integer work on xmm quarters (a third of the speed).
#[test]
fn float8_panels_convert_whole_vectors_of_halves() {
    for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
        let k = vec![matmul_panel(256, 32, PanelWeights::Float8E4M3, None, seq, RegisterTile::YMM)];
        for spec in ["cpu:x86-64-v3", "cpu:x86-64-v4"] {
            let ir = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse(spec).unwrap()).unwrap();
            assert!(ir.contains("fpext <16 x half>"), "{spec} {seq:?}: no 16-lane half conversion");
        }
    }
}

#[test]
fn int8_dots_use_byte_multiply_adds_without_vnni() {
    let k = vec![matmul_int8(256, 16, WeightEncoding::Q8_0, None, SeqMode::Fixed(1)), matmul_interleaved(256, 32, WeightEncoding::Q4_1, None, SeqMode::Fixed(1), RegisterTile::ZMM, ActivationLevels::Int8), matmul_interleaved(256, 32, WeightEncoding::Q8_0, None, SeqMode::Fixed(1), RegisterTile::ZMM, ActivationLevels::Int8)];
    let v3 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap();
    assert!(v3.contains("@llvm.x86.avx2.pmadd.ub.sw") && v3.contains("@llvm.x86.avx2.pmadd.wd"), "x86-64-v3 int8 dots are not vpmaddubsw / vpmaddwd");
    // Q8_0's signed weights move their sign onto the activations with one vpsignb.
    assert!(v3.contains("@llvm.x86.avx2.psign.b"), "x86-64-v3 signed int8 dots do not use vpsignb");
    let v4 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v4").unwrap()).unwrap();
    assert!(v4.contains("@llvm.x86.avx512.pmaddubs.w.512") && !v4.contains("vpdpbusd"), "x86-64-v4 without VNNI must use 512-bit vpmaddubsw");
    // AVX-VNNI (no AVX-512): vpdpbusd on ymm halves, and LLVM selects it for that target.
    let avx_vnni = CpuTarget::parse("cpu:x86-64-v3+avxvnni").unwrap();
    let ir = maxc_codegen::llvm::emit_llvm_ir(&k, &avx_vnni).unwrap();
    assert!(ir.contains("@llvm.x86.avx512.vpdpbusd.256") && !ir.contains("pmadd"), "x86-64-v3+avxvnni must use vpdpbusd on ymm");
    assert!(!compile_shared(&k, &avx_vnni).unwrap().shared_object.is_empty());
}

/// aarch64 code (cross-compiled; tests/tests/aarch64.rs runs it under qemu
/// against the goldens) holds no x86 intrinsic behind an ARM target; with
/// dotprod the integer dots of every form (int8 blocks, interleaved rows with
/// int8, byte-plane and, at decode, word activations; Q8_0 and Q4_1) are
/// `sdot`, without it NEON widening multiplies; float GEMVs are NEON vectors.
#[test]
fn aarch64_dots_use_sdot_with_dotprod_and_no_x86_intrinsics() {
    let mut dots = vec![matmul_int8(256, 16, WeightEncoding::Q8_0, None, SeqMode::Fixed(1)), matmul_int8(256, 16, WeightEncoding::Q4_1, None, SeqMode::Fixed(1))];
    for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_1] {
        for levels in [ActivationLevels::Int8, ActivationLevels::Int16Planes] {
            for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
                dots.push(matmul_interleaved(256, 32, encoding, None, seq, RegisterTile::YMM, levels));
            }
        }
    }
    let words = vec![matmul_interleaved(256, 32, WeightEncoding::Q8_0, None, SeqMode::Fixed(1), RegisterTile::YMM, ActivationLevels::Int16Words)];
    let floats = vec![matmul_panel(256, 32, PanelWeights::Float(ElemType::F32), None, SeqMode::Fixed(1), RegisterTile::YMM), quantize_q16(576, ActivationLevels::Int16Planes, SeqMode::Fixed(1))];
    for spec in ["cpu:aarch64", "cpu:aarch64+dotprod"] {
        let target = CpuTarget::parse(spec).unwrap();
        for kernels in [&dots, &words, &floats] {
            let ir = maxc_codegen::llvm::emit_llvm_ir(kernels, &target).unwrap();
            assert!(ir.contains("target triple = \"aarch64-unknown-linux-gnu\"") && !ir.contains("llvm.x86"), "{spec}: x86 intrinsics or another triple in aarch64 code");
        }
        for kernel in &dots {
            let asm = maxc_codegen::llvm::emit_assembly(std::slice::from_ref(kernel), &target).unwrap();
            let sdots = asm.lines().filter(|l| l.trim_start().starts_with("sdot\t")).count();
            if target.has_dotprod() {
                assert!(sdots > 0, "{spec} {}: no sdot", kernel.name);
            } else {
                assert!(sdots == 0 && asm.contains("smull"), "{spec} {}: {sdots} sdot, or no NEON widening multiplies", kernel.name);
            }
        }
        let asm = maxc_codegen::llvm::emit_assembly(&floats[..1], &target).unwrap();
        assert!(asm.lines().any(|l| l.trim_start().starts_with("fmla\t") && l.contains(".4s")), "{spec}: the float GEMV is not NEON fmla on 4 lanes");
    }
}

/// Activation quantization vectorizes on AVX2: its block maximum is a vector max
/// reduction (`maxnum` flagged `nnan`; without the flag LLVM 19 keeps a serial
/// chain), its levels convert in 32-bit lanes (AVX2 has no vector f32 -> i64)
/// and its level bytes are stored as vectors, word pairs' permuted order
/// included (a permuted index per value kept that loop scalar).
#[test]
fn activation_quantization_vectorizes_its_max_and_conversions() {
    let sixteen = [ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs].map(|levels| quantize_q16(576, levels, SeqMode::Fixed(1)));
    for kernel in [quantize_q8(576, DotForm::Int8, SeqMode::Fixed(1))].into_iter().chain(sixteen) {
        let ir = maxc_codegen::llvm::emit_llvm_ir(std::slice::from_ref(&kernel), &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap();
        assert!(ir.contains("@llvm.vector.reduce.fmax"), "{}: the block maximum is not a vector reduction", kernel.name);
        let conversions: Vec<&str> = ir.lines().filter(|l| l.contains("fptosi")).collect();
        let in_i32_lanes = |l: &str| (l.contains("fptosi <8 x float>") || l.contains("fptosi <16 x float>")) && l.trim_end().ends_with("x i32>");
        assert!(!conversions.is_empty() && conversions.iter().all(|l| in_i32_lanes(l)), "{}: levels do not convert as <8 or 16 x float> -> i32 lanes: {conversions:?}", kernel.name);
        let byte_stores: Vec<&str> = ir.lines().filter(|l| l.contains("store i8 ")).collect();
        assert!(byte_stores.is_empty(), "{}: level bytes stored one at a time: {byte_stores:?}", kernel.name);
    }
}

/// Decode GEMVs on interleaved blocks prefetch their levels a fixed distance
/// ahead (`DECODE_PREFETCH_BYTES`), those on float panels their weights, and so
/// do both matmuls' steps of few rows (`FEW_ROWS`: the batched
/// engine's decode steps, which stream their weights as a GEMV does); prefill
/// of more rows, which reuses each level vector for several rows, does not.
/// (That a prefetch past the end of the weights is harmless is
/// `int8_dots_are_exact_at_extreme_bytes`'s decode cases: their weights are
/// smaller than the distance.)
#[test]
fn decode_gemvs_and_few_row_steps_prefetch_their_levels_and_prefill_does_not() {
    use maxc_kernels::library::matmul_interleaved::{DECODE_PREFETCH_BYTES, FEW_ROWS};
    let ahead = format!("i64 {DECODE_PREFETCH_BYTES}");
    // (row count, whether its kernel prefetches)
    let row_counts = [(SeqMode::Fixed(1), true), (SeqMode::Fixed(FEW_ROWS as u64), true), (SeqMode::Dynamic, true), (SeqMode::Fixed(FEW_ROWS as u64 + 1), false)];
    for spec in ["cpu:x86-64-v3", "cpu:x86-64-v4+avx512vnni"] {
        let target = CpuTarget::parse(spec).unwrap();
        let tile = RegisterTile::for_cpu(target.has_avx512());
        for (encoding, levels) in [(WeightEncoding::Q8_0, ActivationLevels::Int8), (WeightEncoding::Q4_1, ActivationLevels::Int8), (WeightEncoding::Q4_1, ActivationLevels::Int16Planes), (WeightEncoding::Q4_1, ActivationLevels::Int16WordPairs)] {
            let ir = |seq| maxc_codegen::llvm::emit_llvm_ir(&[matmul_interleaved(256, 32, encoding, None, seq, tile, levels)], &target).unwrap();
            let what = format!("{spec} {} {levels:?}", encoding.name());
            for (seq, prefetches) in row_counts {
                let ir = ir(seq);
                if prefetches {
                    assert!(ir.contains("@llvm.prefetch.p0") && ir.contains(&ahead), "{what} at {seq:?}: does not prefetch {ahead} ahead");
                } else {
                    assert!(!ir.contains("@llvm.prefetch"), "{what} at {seq:?} (more rows than FEW_ROWS): prefetches");
                }
            }
        }
    }
    // The float panel GEMVs and steps of few rows too (and their prefill not).
    let target = CpuTarget::parse("cpu:x86-64-v3").unwrap();
    for elem in [ElemType::F32, ElemType::BF16, ElemType::F16] {
        for (seq, prefetches) in row_counts {
            let ir = maxc_codegen::llvm::emit_llvm_ir(&[matmul_panel(256, 32, PanelWeights::Float(elem), None, seq, RegisterTile::ZMM)], &target).unwrap();
            assert_eq!(ir.contains("@llvm.prefetch.p0"), prefetches, "{elem:?} panels at {seq:?}: prefetch {}expected", if prefetches { "" } else { "not " });
        }
    }
}

/// bfloat16 and float16 panels load each panel row as one vector, decode and
/// prefill, at a k that is a power of two as at one that is not: at k = 2048 the
/// element index `lane + (panel * k + kk) * 16` became an `or disjoint` that the
/// loop vectorizer did not read as consecutive, and every lane was loaded alone
/// (1.17B bfloat16 decode at 25% of the bandwidth roofline, prefill 0.15x
/// llama.cpp). x86-64-v3 loads a bfloat16 row as the four quadwords it permutes
/// (`bf16_panel_rows_widen_by_unpacks_on_avx2`).
#[test]
fn half_panels_load_whole_vectors_at_power_of_two_k() {
    for (elem, scalar, vectors) in [(ElemType::BF16, "load i16,", &[" x i16>, ptr", "<4 x i64>, ptr"][..]), (ElemType::F16, "load half,", &[" x half>, ptr"][..])] {
        for k in [576, 2048] {
            for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
                for spec in ["cpu:x86-64-v3", "cpu:x86-64-v4"] {
                    let kernel = matmul_panel(k, 64, PanelWeights::Float(elem), None, seq, RegisterTile::ZMM);
                    let ir = maxc_codegen::llvm::emit_llvm_ir(&[kernel], &CpuTarget::parse(spec).unwrap()).unwrap();
                    let scalars = ir.matches(scalar).count();
                    let whole = ir.lines().filter(|l| l.contains("= load <") && vectors.iter().any(|v| l.contains(v))).count();
                    assert!(scalars == 0 && whole > 0, "{elem:?} k {k} {seq:?} {spec}: {scalars} element loads (`{scalar}`), loads: {:?}", ir.lines().filter(|l| l.contains(" load ")).collect::<Vec<_>>());
                }
            }
        }
    }
}

/// Decode attention prefetches each value row while it scores the key row of
/// the same position (one prefetch per cache line of the row), on the CPU only;
/// prefill attention does not. (`llvm_host_matches_interpreter` runs the decode
/// kernel against the interpreter.)
#[test]
fn decode_attention_prefetches_value_rows() {
    let shape = AttentionShape { heads: 9, kv_heads: 3, head_dim: 64, scale: 0.125, window: None, max_len: 64, softcap: None, causal: true, cache: ElemType::F32, keys: KeyLayout::Rows, sinks: false };
    let target = CpuTarget::parse("cpu:x86-64-v3").unwrap();
    let decode = maxc_codegen::llvm::emit_llvm_ir(&[attention(shape, SeqMode::Fixed(1))], &target).unwrap();
    // Four per scored key (LLVM may unroll the key loop).
    let prefetches = decode.matches("call void @llvm.prefetch.p0").count();
    assert!(prefetches > 0 && prefetches.is_multiple_of(4), "{prefetches} prefetches: want one per 64-byte line of a 64-float value row");
    let prefill = maxc_codegen::llvm::emit_llvm_ir(&[attention(shape, SeqMode::Dynamic)], &target).unwrap();
    assert!(!prefill.contains("@llvm.prefetch"), "prefill attention prefetches");
}

/// The int8 dots of [`int8_dots_are_exact_at_extreme_bytes`], with the
/// register tiles `tiles` gives each sequence mode.
fn extreme_byte_cases(tiles: &dyn Fn(SeqMode) -> Vec<RegisterTile>) -> Vec<Case> {
    let mut all = Vec::new();
    for seq in [SeqMode::Fixed(1), SeqMode::Dynamic] {
        let s = if seq == SeqMode::Dynamic { 3usize } else { 1 };
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let k = if encoding.block() == 256 { 256 } else { 96 };
            // Activations, their scales, the weight parts, the output.
            let case = |kernel: Kernel, k: u64, n: u64| {
                let mut sizes = vec![s * k as usize, s * 2 * k as usize / 32];
                // Q6_K: the activations' sums per 16 values.
                if takes_half_sums(&kernel) {
                    sizes.push(s * k as usize / 16);
                }
                sizes.extend((0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize));
                sizes.push(s * n as usize);
                Case { kernel, sizes, int_max: 1, seq: s as u64, tol: reduction_tol(k * 16) }
            };
            for tile in tiles(seq) {
                all.push(case(matmul_interleaved(k, 48, encoding, None, seq, tile, ActivationLevels::Int8), k, 48));
                for sixteen in [ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs].into_iter().filter(|&l| !(encoding == WeightEncoding::Q6K && l == ActivationLevels::Int16Words)) {
                    let mut wide = case(matmul_interleaved(k, 48, encoding, None, seq, tile, sixteen), k, 48);
                    wide.sizes[0] *= 2;
                    all.push(wide);
                }
            }
            if matches!(encoding, WeightEncoding::Q8_0 | WeightEncoding::Q4_1) {
                all.push(case(matmul_int8(256, 21, encoding, None, seq), 256, 21));
            }
        }
    }
    all
}

/// Int8 dots with every weight and activation byte at an extreme (weight bytes
/// read as 0 / 255 or -128 / 127, activations -127 / 127, nibbles 0 / 15, five-bit
/// levels 0 / 31, six-bit 0 / 63 with signed scales -128 / 127): where a pair of
/// products can exceed i16 (`vpmaddubsw` saturates), the result must still be
/// the interpreter's, on this machine and on x86-64-v3.
#[test]
fn int8_dots_are_exact_at_extreme_bytes() {
    for spec in ["cpu", "cpu:x86-64-v3"] {
        let all = extreme_byte_cases(target_tiles(spec));
        let code = LlvmCode::new(spec, &distinct_kernels(&all));
        let mut rng = Rng(0x5eed);
        for case in &all {
            let f = code.kernel(&case.kernel);
            for trial in 0..6 {
                // Activations (parameter 0) at +-127; weight bytes at 0xff (255 unsigned,
                // both nibbles 15) in trial 0, 0x7f (127 signed) in trial 1, then drawn
                // from 0x80, 0xff, 0x00, 0x7f (the extremes read signed or unsigned).
                let weight = |rng: &mut Rng| match trial {
                    0 => 0xffu8,
                    1 => 0x7f,
                    _ => [0x80, 0xff, 0x00, 0x7f][((rng.f() + 1.0) * 2.0) as usize % 4],
                };
                let extremes = inputs(case, &mut rng)
                    .into_iter()
                    .enumerate()
                    .map(|(p, b)| match b {
                        Buffer::I8(v) if p == 0 => Buffer::I8(v.iter().map(|_| if trial < 2 || rng.f() > 0.0 { 127 } else { -127 }).collect()),
                        Buffer::I8(v) => Buffer::I8(v.iter().map(|_| weight(&mut rng) as i8).collect()),
                        Buffer::U8(v) => Buffer::U8(v.iter().map(|_| weight(&mut rng)).collect()),
                        // Q6_K's half sums at the largest 16 int16 levels give (16 * 32512).
                        Buffer::I32(v) => Buffer::I32(v.iter().map(|_| if rng.f() > 0.0 { 520_192 } else { -520_192 }).collect()),
                        // Scales of one sign (the activations' and the weights'):
                        // the blocks' terms of an output never cancel, so the
                        // float epilogue's rounding stays within the tolerance.
                        // (With VNNI, Q8_0's minimum is a float term of its
                        // own, 128 times the unsigned dot's rounding; terms of
                        // both signs once cancelled to an output 2% off the
                        // interpreter's exact one.) The integer dots are what
                        // this test is about.
                        Buffer::F32(v) if p == 1 => Buffer::F32(v.iter().map(|x| x.abs()).collect()),
                        Buffer::F16(v) => Buffer::F16(v.iter().map(|h| h & 0x7fff).collect()),
                        other => other,
                    })
                    .collect();
                assert_matches_interpreter(spec, f, case, extremes, trial);
            }
        }
    }
}

/// Random shapes (property test): every family with random sizes, both backends.
mod random_shapes {
    use super::*;
    use proptest::prelude::*;

    fn random_cases(k: u64, n: u64, s: u64, heads: u64, group: u64, hd2: u64, window: u64) -> Vec<Case> {
        let s_ = s as usize;
        let hd = 2 * hd2;
        let kv = heads;
        let qh = heads * group;
        let (qw, kvw) = ((qh * hd) as usize, (kv * hd) as usize);
        let max_len = 32u64;
        let shape = AttentionShape {
            heads: qh,
            kv_heads: kv,
            head_dim: hd,
            scale: 0.3,
            // Sliding windows only ever come with causal attention (decoders); the
            // bidirectional case (encoders) attends to the whole sequence.
            window: (window > 0 && window != 3).then_some(window),
            max_len,
            softcap: (window % 2 == 1).then_some(2.5),
            causal: window != 3,
            cache: if window.is_multiple_of(2) { ElemType::F16 } else { ElemType::F32 },
            keys: if hd2.is_multiple_of(2) { KeyLayout::Panels } else { KeyLayout::Rows },
            sinks: false,
        };
        let seq = SeqMode::Dynamic;
        vec![
            Case { kernel: matmul(k, n, ElemType::F32, seq), sizes: vec![s_ * k as usize, (n * k) as usize, s_ * n as usize], int_max: 1, seq: s, tol: reduction_tol(k) },
            Case { kernel: matmul(k, n, ElemType::BF16, seq), sizes: vec![s_ * k as usize, (n * k) as usize, s_ * n as usize], int_max: 1, seq: s, tol: reduction_tol(k) },
            Case { kernel: rms_norm(n * 2, n, 1e-5, seq), sizes: vec![s_ * 2 * n as usize, n as usize, s_ * 2 * n as usize], int_max: 1, seq: s, tol: reduction_tol(n) },
            Case { kernel: layer_norm(k, 1e-5, seq), sizes: vec![s_ * k as usize, k as usize, k as usize, s_ * k as usize], int_max: 1, seq: s, tol: reduction_tol(k) },
            Case { kernel: rope(qw as u64, hd, seq), sizes: vec![s_ * qw, s_, hd2 as usize, s_ * qw], int_max: 30, seq: s, tol: 1e-5 },
            Case {
                kernel: attention(shape, seq),
                sizes: super::whole_attention_sizes(&shape, s_, max_len as usize),
                int_max: max_len as i32,
                seq: s,
                tol: reduction_tol(hd * max_len),
            },
            Case { kernel: swiglu(n, seq), sizes: vec![s_ * 2 * n as usize, s_ * n as usize], int_max: 1, seq: s, tol: 1e-5 },
            // An encoder's batch step: the s rows in 1..=s sequences of random lengths.
            Case {
                kernel: attention_ragged(RaggedShape { heads: qh, kv_heads: kv, head_dim: hd, scale: 0.3, softcap: shape.softcap }),
                sizes: vec![s_ * qw, s_ * kvw, s_ * kvw, s_, 2 + k as usize % s_, s_ * qw],
                int_max: s as i32,
                seq: s,
                tol: reduction_tol(hd * s),
            },
        ]
    }

    proptest! {
        // A fixed seed keeps CI deterministic; change it locally to explore further.
        #![proptest_config(ProptestConfig {
            cases: 10,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x6d61_7863),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]
        #[test]
        fn both_backends_match_the_interpreter(k in 1u64..80, n in 1u64..40, s in 1u64..6, heads in 1u64..3, group in 1u64..3, hd2 in 1u64..9, window in 0u64..5, seed in any::<u64>()) {
            let target = CpuTarget::parse("cpu").unwrap();
            check_cases("llvm", |ks| compile_shared(ks, &target).unwrap().shared_object, random_cases(k, n, s, heads, group, hd2, window), seed);
            check_cases("cranelift", |ks| maxc_codegen::cranelift::compile_shared(ks).unwrap().shared_object, random_cases(k, n, s, heads, group, hd2, window), seed);
        }
    }
}

/// Stores to an f16 buffer (the `--kv-cache-encoding float16` cache) round to
/// the nearest half, ties to even, on every backend: LLVM's `fptrunc`
/// (`vcvtps2ph` with F16C, a libgcc call without), Cranelift's integer
/// rounding, and the interpreter, all bit for bit against the `half` crate, at
/// the edges (ties at both ends of the normal range and among subnormals,
/// overflow to infinity, the largest half, signed zeros, NaN) and on random values.
#[test]
fn f16_stores_round_to_nearest_even_on_every_backend() {
    let mut values: Vec<f32> = vec![
        0.0, -0.0, 1.0, -1.0, 65504.0, 65519.9, 65520.0, -65520.0, 1e6, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE,
        2f32.powi(-14), 2f32.powi(-24), 2f32.powi(-25), 3.0 * 2f32.powi(-25), 5.0 * 2f32.powi(-25), 2f32.powi(-26), 1023.5 * 2f32.powi(-24),
        1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 2048.0 + 1.0, 2048.0 + 3.0, -(1.0 + 2f32.powi(-11)), 0.1, 1.0 / 3.0,
    ];
    let mut rng = Rng(0xf16);
    // Random magnitudes over every exponent a half has and some beyond.
    values.extend((0..4000).map(|_| rng.f() * 2f32.powf(rng.f() * 24.0)));
    values.push(f32::NAN);
    stores_round_like_the_half_crate(ElemType::F16, &values, &|x| half::f16::from_f32(x).to_bits(), &|h| h & 0x7c00 == 0x7c00 && h & 0x3ff != 0);
}

/// Stores to a bf16 buffer (`round_bf16`, the activations of bfloat16 pair
/// dots) round to the nearest bfloat16, ties to even, on every backend (the
/// integer rounding of the LLVM and Cranelift lowerings, the interpreter), bit
/// for bit against the `half` crate: ties with an even and an odd upper half,
/// values just beside ties, overflow of the largest finite f32 to infinity,
/// subnormals, signed zeros, infinities and NaN (kept a NaN), and random values
/// over the whole exponent range.
#[test]
fn bf16_stores_round_to_nearest_even_on_every_backend() {
    let bits = |b: u32| f32::from_bits(b);
    let mut values: Vec<f32> = vec![
        0.0, -0.0, 1.0, -1.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -f32::MAX, f32::MIN_POSITIVE, 1e-40, -1e-45,
        bits(0x3f80_8000), bits(0x3f81_8000), bits(0x3f80_7fff), bits(0x3f80_8001), bits(0xbf81_8000), bits(0x7f7f_8000), bits(0x0000_8000), bits(0x0001_8000),
        0.1, 1.0 / 3.0, 65504.0,
    ];
    let mut rng = Rng(0xbf16);
    values.extend((0..4000).map(|_| rng.f() * 2f32.powf(rng.f() * 250.0 - 125.0)));
    values.extend([f32::NAN, -f32::NAN, bits(0x7f80_0001), bits(0xffc0_1234)]);
    stores_round_like_the_half_crate(ElemType::BF16, &values, &|x| half::bf16::from_f32(x).to_bits(), &|h| h & 0x7f80 == 0x7f80 && h & 0x7f != 0);
}

/// One kernel storing `values` to an `elem` (f16 or bf16) buffer, run by the
/// interpreter and compiled by LLVM (this machine, x86-64-v3, x86-64) and by
/// Cranelift: every result equals `want`'s bits (any NaN for a NaN, as `nan` says).
fn stores_round_like_the_half_crate(elem: ElemType, values: &[f32], want: &dyn Fn(f32) -> u16, nan: &dyn Fn(u16) -> bool) {
    use maxc_kernels::ir::dsl::*;
    use maxc_kernels::{KernelBuilder, TaskCount, ValType};
    let n = values.len();
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", elem, true);
    let (t, j) = (b.var(ValType::I64), b.var(ValType::I64));
    let name = format!("store_{elem:?}").to_lowercase();
    let kernel = b.finish(name.clone(), "test", TaskCount { per_seq: 0, fixed: 1 }, t, vec![for_vec(j, i(0), i(n as i64), vec![store(out, v(j), ld(x, v(j)))])]);
    let want: Vec<u16> = values.iter().map(|&x| want(x)).collect();
    let check = |spec: &str, got: &[u16]| {
        for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w || (nan(g) && nan(w)), "{spec}: {elem:?} of {:e} ({:08x}) is {g:04x}, want {w:04x}", values[k], values[k].to_bits());
        }
    };
    let mut bufs = vec![Buffer::F32(values.to_vec()), if elem == ElemType::F16 { Buffer::F16(vec![0; n]) } else { Buffer::BF16(vec![0; n]) }];
    run(&kernel, &mut bufs, 1);
    let (Buffer::F16(got) | Buffer::BF16(got)) = &bufs[1] else { unreachable!() };
    check("interpreter", got);
    let objects = [
        ("cpu", compile_shared(std::slice::from_ref(&kernel), &CpuTarget::parse("cpu").unwrap()).unwrap().shared_object),
        ("cpu:x86-64-v3", compile_shared(std::slice::from_ref(&kernel), &CpuTarget::parse("cpu:x86-64-v3").unwrap()).unwrap().shared_object),
        ("cpu:x86-64", compile_shared(std::slice::from_ref(&kernel), &CpuTarget::parse("cpu:x86-64").unwrap()).unwrap().shared_object),
        ("cranelift", maxc_codegen::cranelift::compile_shared(std::slice::from_ref(&kernel)).unwrap().shared_object),
    ];
    for (spec, object) in objects {
        let loaded = LoadedCode::load(&object).unwrap();
        let f = loaded.kernel(&name).unwrap();
        let mut x = values.to_vec();
        let mut got = vec![0u16; n];
        let ptrs = [x.as_mut_ptr() as *mut u8, got.as_mut_ptr() as *mut u8];
        let dims = [1i64];
        // SAFETY: both buffers hold `n` elements, as the kernel reads and writes.
        unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, 1) };
        check(spec, &got);
    }
}

/// A backend's compiler: kernels to their compiled code.
type Compile = dyn Fn(&[Kernel]) -> Box<dyn Code>;

/// An integer matmul as the engine builds it twice: the one-row decode kernel
/// (`s1`, the GEMV a sequence decoding alone runs) and the batch kernel (`sN`,
/// row tiles), with how each takes its activations.
struct RowPair {
    alone: Kernel,
    batch: Kernel,
    /// The kernels that turn f32 rows into each one's activation parameters
    /// (levels and scales), run by the interpreter.
    quantize: (Kernel, Kernel),
    k: u64,
    n: u64,
    /// The elements of each weight parameter.
    weight_sizes: Vec<usize>,
    /// A per-row addend (`Broadcast::None`) before the output.
    row_addend: bool,
}

/// The elements of each part of an `n x k` weight in `encoding`.
fn parts(encoding: WeightEncoding, n: u64, k: u64) -> Vec<usize> {
    (0..encoding.parts().len()).map(|p| encoding.part_elems(p, &[n, k]).unwrap() as usize).collect()
}

/// The activation parameters (levels, scales) of `rows` f32 rows `x` made by `q`.
fn activations(q: &Kernel, consumer: &Kernel, x: &[f32], k: u64, rows: usize) -> Vec<Buffer> {
    let level_bytes = if q.name.starts_with("quantize_q8") { 1 } else { 2 };
    let mut bufs = vec![Buffer::F32(x.to_vec()), Buffer::I8(vec![0; rows * level_bytes * k as usize]), Buffer::F32(vec![0.0; rows * 2 * k as usize / 32])];
    run(q, &mut bufs, rows as u64);
    let mut out = bufs.split_off(1);
    // Q6_K's row dots also read the levels' sums per 16 values.
    if takes_half_sums(consumer) {
        let levels = interleaved_levels(&consumer.name).expect("half sums are read by interleaved matmuls");
        let mut sums = vec![out[0].clone(), Buffer::I32(vec![0; rows * k as usize / 16])];
        run(&level_half_sums(k, levels, SeqMode::Dynamic), &mut sums, rows as u64);
        out.push(sums.pop().expect("the sums"));
    }
    out
}

/// Whether an integer matmul reads the activations' sums per 16 values (its `h`).
fn takes_half_sums(kernel: &Kernel) -> bool {
    kernel.params.get(2).is_some_and(|p| p.name == "h")
}

/// The buffers of whole attention over `rows` rows and caches of `positions`:
/// q, pos, the caches, the score rows, for causal attention the chunks'
/// partial rows, and the output.
fn whole_attention_sizes(shape: &AttentionShape, rows: usize, positions: usize) -> Vec<usize> {
    let (qw, kvw, kv) = ((shape.heads * shape.head_dim) as usize, (shape.kv_heads * shape.head_dim) as usize, shape.kv_heads as usize);
    let mut sizes = vec![rows * qw, rows, positions * kvw, positions * kvw];
    if shape.sinks {
        sizes.push(shape.heads as usize);
    }
    sizes.extend([rows * kv * shape.scratch_per_task() as usize, rows * qw]);
    sizes
}

/// Attention sinks (gpt-oss): whole attention with key rows (the GPU forms)
/// and panels (CPU code), causal with and without a window, and the combine
/// that adds the sinks to flash-decoding's chunks.
fn sink_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for seq in [SeqMode::Dynamic, SeqMode::Fixed(1)] {
        let s = if seq.is_decode() { 1usize } else { 5 };
        for (keys, window) in [(KeyLayout::Rows, None), (KeyLayout::Rows, Some(7)), (KeyLayout::Panels, None), (KeyLayout::Panels, Some(21))] {
            let shape = AttentionShape { heads: 8, kv_heads: 2, head_dim: 16, scale: 0.25, window, max_len: 48, softcap: None, causal: true, cache: ElemType::F32, keys, sinks: true };
            v.push(Case { kernel: attention(shape, seq), sizes: whole_attention_sizes(&shape, s, 48), int_max: 48, seq: s as u64, tol: 1e-5 });
            if keys == KeyLayout::Rows {
                let parts = shape.partials_per_token(3) as usize;
                v.push(Case { kernel: attention_combine(shape, 3, seq), sizes: vec![s * parts, s, 8, s * 128], int_max: 48, seq: s as u64, tol: 1e-5 });
            }
        }
    }
    v
}

/// Runs compiled `kernel` over `rows` rows of `bufs`.
fn call(code: &dyn Code, kernel: &Kernel, bufs: &mut [Buffer], rows: u64) {
    let f = code.kernel(kernel);
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(Buffer::as_mut_ptr).collect();
    let dims = [rows as i64];
    // SAFETY: every buffer is sized for `rows` rows of this kernel's shapes.
    unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, kernel.tasks.eval(rows)) };
}

/// The backends the batch-invariance tests compile for, each with its
/// register tile: LLVM for this machine and for x86-64-v3, and Cranelift.
/// (LLVM's kernels come from [`llvm_cases`] where it has them.)
fn batch_backends() -> [(&'static str, RegisterTile, &'static Compile); 3] {
    [
        ("llvm cpu", RegisterTile::for_cpu(CpuTarget::host().has_avx512()), &|kernels| Box::new(LlvmCode::new("cpu", kernels))),
        ("llvm x86-64-v3", RegisterTile::YMM, &|kernels| Box::new(LlvmCode::new("cpu:x86-64-v3", kernels))),
        ("cranelift", RegisterTile::for_cpu(false), &|kernels| Box::new(Compiled::new(kernels, 1, &|k| maxc_codegen::cranelift::compile_shared(k).unwrap().shared_object))),
    ]
}

/// bfloat16 pair dots (`--activation-encoding bfloat16`) give a row the same
/// bits alone (the decode GEMV) and in a batch step of few rows (one panel at
/// a time) or of many (the prefill tile): every cell sums its pairs in k
/// order, and a pair's products are exact, so neither the tile shape nor a
/// fused multiply-add can change them. With `vdpbf16ps` on this machine where
/// it has AVX512_BF16, two products per lane on x86-64-v3 and in Cranelift.
#[test]
fn bf16_pair_rows_alone_and_in_a_batch_give_the_same_bits() {
    const ROWS: usize = 11 + maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
    let (k, n) = (96usize, 48usize);
    for (backend, tile, compile) in batch_backends() {
        let alone = matmul_panel(k as u64, n as u64, PanelWeights::BFloat16Pairs, Some(Broadcast::None), SeqMode::Fixed(1), tile);
        let batch = matmul_panel(k as u64, n as u64, PanelWeights::BFloat16Pairs, Some(Broadcast::None), SeqMode::Dynamic, tile);
        let code = compile(&[alone.clone(), batch.clone()]);
        let mut rng = Rng(0xbf16_5eed);
        let case = Case { kernel: batch.clone(), sizes: vec![ROWS * k, n * k, ROWS * n, ROWS * n], int_max: 1, seq: ROWS as u64, tol: 0.0 };
        let bufs = inputs(&case, &mut rng);
        let (Buffer::BF16(x), Buffer::F32(addend)) = (&bufs[0], &bufs[2]) else { unreachable!("bf16 activations, f32 addend") };
        let run_rows = |kernel: &Kernel, x: &[u16], addend: &[f32], rows: usize| -> Vec<u32> {
            let mut bufs = vec![Buffer::BF16(x.to_vec()), bufs[1].clone(), Buffer::F32(addend.to_vec()), Buffer::F32(vec![0.0; rows * n])];
            call(&*code, kernel, &mut bufs, rows as u64);
            let Some(Buffer::F32(out)) = bufs.pop() else { unreachable!("the output is f32") };
            out.iter().map(|v| v.to_bits()).collect()
        };
        let alone_rows: Vec<Vec<u32>> = (0..ROWS).map(|r| run_rows(&alone, &x[r * k..(r + 1) * k], &addend[r * n..(r + 1) * n], 1)).collect();
        for rows in [11, ROWS] {
            let out = run_rows(&batch, &x[..rows * k], &addend[..rows * n], rows);
            for (r, want) in alone_rows.iter().enumerate().take(rows) {
                let differ = (0..n).filter(|&j| want[j] != out[r * n + j]).count();
                assert_eq!(differ, 0, "{backend}: row {r} of {rows} differs from the row alone in {differ} of {n} outputs");
            }
        }
    }
}

/// bfloat16 pair dots are one `vdpbf16ps` where the target has AVX512_BF16,
/// and no such instruction where it has not (the same sums in FMAs' stead).
#[test]
fn bf16_pair_dots_use_vdpbf16ps_where_the_target_has_it() {
    let k = vec![
        matmul_panel(64, 32, PanelWeights::BFloat16Pairs, None, SeqMode::Fixed(1), RegisterTile::ZMM),
        matmul_panel(64, 32, PanelWeights::BFloat16Pairs, None, SeqMode::Dynamic, RegisterTile::ZMM),
    ];
    let bf16 = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse("cpu:x86-64-v4+avx512bf16").unwrap()).unwrap();
    assert!(bf16.contains("@llvm.x86.avx512bf16.dpbf16ps.512"), "no vdpbf16ps with avx512bf16");
    for spec in ["cpu:x86-64-v4", "cpu:x86-64-v3"] {
        let ir = maxc_codegen::llvm::emit_llvm_ir(&k, &CpuTarget::parse(spec).unwrap()).unwrap();
        assert!(!ir.contains("dpbf16ps"), "{spec} has no AVX512_BF16");
    }
}

/// A sequence's logits must not depend on the sequences beside it in a batch
/// step: the engine runs one sequence through the decode GEMVs and several
/// through the row-tiled kernels, and a request's `n` sampled choices are
/// promised the tokens each seed gives alone. With integer activations (the CPU
/// default: int16, and int8) the weights interleaved by 16 rows give each of
/// 11 rows (full tiles and a remainder) bit for bit what the one-row kernel
/// gives that row alone, compiled by LLVM for this machine and for x86-64-v3
/// (each with its own register tile and dot instructions) and by Cranelift.
/// Two bugs this caught: the dot epilogue's fast-math flags let LLVM fuse the
/// GEMV's scale multiply into an FMA and not the tile's (int16 Q4_1 rows
/// differed in half their outputs, about one sampled token in two hundred
/// changed), and without VNNI Q8_0's words kept its -128 minimum as a term of
/// its own where the byte planes fold it into a signed dot.
/// Float activations are not held to this: their GEMV and tiles sum a row's
/// products in different orders (within the float32 tolerance of the
/// differential cases above; docs/serving.md).
#[test]
fn integer_rows_alone_and_in_a_batch_give_the_same_bits() {
    // A step of few rows (one panel at a time, prefetched) and one of more
    // (the prefill tiles): both give each row its bits alone.
    const ROWS: usize = 11 + maxc_kernels::library::matmul_interleaved::FEW_ROWS as usize;
    let (one, many) = (SeqMode::Fixed(1), SeqMode::Dynamic);
    for (backend, tile, compile) in batch_backends() {
        let mut pairs = Vec::new();
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let k = if encoding.block() == 256 { 256 } else { 96 };
            for addend in [None, Some(Broadcast::None)] {
                // 16-bit levels as the scheduler picks them: byte planes, and
                // Q8_0's words at decode beside planes (VNNI), words (AVX-512
                // without VNNI) or word pairs (AVX2 without either) in a
                // batch; nibbles' planes at decode beside planes or (AVX2
                // without VNNI) word pairs in a batch, and Q5's five-bit and
                // Q6_K's six-bit levels alike.
                let alone16 = if encoding == WeightEncoding::Q8_0 { ActivationLevels::Int16Words } else { ActivationLevels::Int16Planes };
                let mut forms = vec![(alone16, ActivationLevels::Int16Planes), (ActivationLevels::Int8, ActivationLevels::Int8)];
                match encoding {
                    WeightEncoding::Q8_0 => forms.extend([(alone16, ActivationLevels::Int16Words), (alone16, ActivationLevels::Int16WordPairs)]),
                    WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q4K | WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Q5K | WeightEncoding::Q6K => forms.push((alone16, ActivationLevels::Int16WordPairs)),
                    _ => {}
                }
                let quantize_as = |levels: ActivationLevels, seq: SeqMode| quantize_to(k, levels, DotForm::Int8, seq);
                for (alone, batch) in forms {
                    let quantize = (quantize_as(alone, one), quantize_as(batch, many));
                    pairs.push(RowPair {
                        alone: matmul_interleaved(k, 48, encoding, addend, one, tile, alone),
                        batch: matmul_interleaved(k, 48, encoding, addend, many, tile, batch),
                        quantize,
                        k,
                        n: 48,
                        weight_sizes: parts(encoding, 48, k),
                        row_addend: addend.is_some(),
                    });
                }
            }
        }
        // (A GEMV paired with two batch forms is compiled once.)
        let mut kernels: Vec<Kernel> = Vec::new();
        for kernel in pairs.iter().flat_map(|p| [&p.alone, &p.batch]) {
            if !kernels.iter().any(|k| k.name == kernel.name) {
                kernels.push(kernel.clone());
            }
        }
        let code = compile(&kernels);
        let mut rng = Rng(0x0bad_5eed);
        for p in &pairs {
            let (k, n) = (p.k as usize, p.n as usize);
            let x: Vec<f32> = (0..ROWS * k).map(|_| rng.f() * 3.0).collect();
            let addend: Vec<f32> = (0..ROWS * n).map(|_| rng.f()).collect();
            // Weights drawn as the differential cases draw them (`inputs`).
            let activation_params = if takes_half_sums(&p.batch) { 3 } else { 2 };
            let sizes: Vec<usize> = vec![0; activation_params].into_iter().chain(p.weight_sizes.iter().copied()).collect();
            let weights = inputs(&Case { kernel: p.batch.clone(), sizes, int_max: 1, seq: 1, tol: 0.0 }, &mut rng).split_off(activation_params);
            let run_rows = |kernel: &Kernel, quantize: &Kernel, x: &[f32], addend: &[f32], rows: usize| -> Vec<u32> {
                let mut bufs = activations(quantize, kernel, x, p.k, rows);
                bufs.extend(weights.iter().cloned());
                if p.row_addend {
                    bufs.push(Buffer::F32(addend.to_vec()));
                }
                bufs.push(Buffer::F32(vec![0.0; rows * n]));
                call(&*code, kernel, &mut bufs, rows as u64);
                let Some(Buffer::F32(out)) = bufs.pop() else { unreachable!("the output is f32") };
                out.iter().map(|v| v.to_bits()).collect()
            };
            let alone: Vec<Vec<u32>> = (0..ROWS).map(|r| run_rows(&p.alone, &p.quantize.0, &x[r * k..(r + 1) * k], &addend[r * n..(r + 1) * n], 1)).collect();
            for rows in [11, ROWS] {
                let batch = run_rows(&p.batch, &p.quantize.1, &x[..rows * k], &addend[..rows * n], rows);
                for (r, alone) in alone.iter().enumerate().take(rows) {
                    let differ = (0..n).filter(|&j| alone[j] != batch[r * n + j]).count();
                    assert_eq!(differ, 0, "{backend}: row {r} of {rows} in {} differs from {} in {differ} of {n} outputs", p.batch.name, p.alone.name);
                }
            }
        }
    }
}
