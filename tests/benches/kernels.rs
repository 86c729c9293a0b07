//! Criterion benches of the decode GEMVs at SmolLM2's gate/up shape (k = 576,
//! n = 3072), compiled by LLVM for this machine and run on one thread, with the
//! weights' bytes as throughput (so criterion reports GB/s): float32 row-major
//! and panel-packed, q4_1 and q8_0 with float activations, and q4_1 / q8_0 with
//! int8 activations (the quantization launch included), row-major and
//! interleaved by 16 rows, and with int16 activations interleaved (q8_0: as
//! words, the default, and in byte planes). The weights (1-7 MB) stay
//! in this machine's L3 cache between iterations, so these figures are the
//! kernels' compute throughput, the ceiling under the memory-bound decode
//! figures of `maxrun bench`; `gemm_cold` streams the weights from memory
//! instead, as the engine's steps do. `gemm_prefill` runs the K-quant prefill
//! tiles at a 1B model's down projection (Q4_K against Q6_K), with operations
//! as throughput (elements: multiply-adds). `MAXC_BENCH_TILES=4x2,6x2,8x1`
//! runs those register tiles (rows x panels) instead of the target's own and
//! Q6_K's list, to choose a tile on a new CPU.
//!
//! `cargo bench -p maxc-tests --bench kernels` (docs/performance.md has figures).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use maxc_codegen::{llvm::compile_shared, CpuTarget};
use maxc_kernels::interp::Buffer;
use maxc_kernels::library::matmul::matmul;
use maxc_kernels::library::matmul_blocks::matmul_blocks;
use maxc_kernels::ir::DotForm;
use maxc_kernels::library::matmul_int8::{dot_form, matmul_int8};
use maxc_kernels::library::matmul_interleaved::matmul_interleaved;
use maxc_kernels::library::matmul_panel::{matmul_panel, PanelWeights};
use maxc_kernels::library::quantize_activations::{quantize_q16, quantize_q8, ActivationLevels};
use maxc_kernels::library::{RegisterTile, SeqMode};
use maxc_kernels::{ElemType, Kernel};
use maxrun_runtime::code::LoadedCode;
use maxrun_runtime::format::WeightEncoding;

const K: u64 = 576;
const N: u64 = 3072;

/// Deterministic bytes for a buffer of `n` elements of `elem` (values do not
/// matter to the speed; f32 / f16 ones are kept finite and small).
fn buffer(elem: ElemType, n: usize) -> Buffer {
    match elem {
        ElemType::F32 => Buffer::F32((0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 5000.0).collect()),
        ElemType::F16 => Buffer::F16((0..n).map(|i| half::f16::from_f32(((i % 97) as f32) / 1000.0).to_bits()).collect()),
        ElemType::BF16 => Buffer::BF16((0..n).map(|i| half::bf16::from_f32(((i % 97) as f32) / 1000.0).to_bits()).collect()),
        ElemType::I8 => Buffer::I8((0..n).map(|i| (i * 31 % 255) as i8).collect()),
        ElemType::U8 => Buffer::U8((0..n).map(|i| (i * 31 % 256) as u8).collect()),
        ElemType::I32 => Buffer::I32(vec![0; n]),
    }
}

/// The elements of a weight part in `encoding` for `[N, K]`.
fn part_sizes(encoding: WeightEncoding) -> Vec<(ElemType, usize)> {
    encoding
        .parts()
        .iter()
        .enumerate()
        .map(|(p, (_, elem, _))| (*elem, encoding.part_elems(p, &[N, K]).unwrap() as usize))
        .collect()
}

/// One benchmark: a sequence of kernel launches over shared buffers.
struct Case {
    name: &'static str,
    weight_bytes: u64,
    /// (kernel, indices of its arguments in `buffers`)
    launches: Vec<(Kernel, Vec<usize>)>,
    buffers: Vec<Buffer>,
}

fn cases() -> Vec<Case> {
    let seq = SeqMode::Fixed(1);
    let (k, n) = (K as usize, N as usize);
    let mut out = vec![Case {
        name: "f32_row_major",
        weight_bytes: N * K * 4,
        launches: vec![(matmul(K, N, ElemType::F32, seq), vec![0, 1, 2])],
        buffers: vec![buffer(ElemType::F32, k), buffer(ElemType::F32, n * k), buffer(ElemType::F32, n)],
    }];
    out.push(Case {
        name: "f32_panel16",
        weight_bytes: N * K * 4,
        launches: vec![(matmul_panel(K, N, PanelWeights::Float(ElemType::F32), None, seq, RegisterTile::ZMM), vec![0, 1, 2])],
        buffers: vec![buffer(ElemType::F32, k), buffer(ElemType::F32, n * k), buffer(ElemType::F32, n)],
    });
    out.push(Case {
        name: "bf16_panel16",
        weight_bytes: N * K * 2,
        launches: vec![(matmul_panel(K, N, PanelWeights::Float(ElemType::BF16), None, seq, RegisterTile::ZMM), vec![0, 1, 2])],
        buffers: vec![buffer(ElemType::F32, k), buffer(ElemType::BF16, n * k), buffer(ElemType::F32, n)],
    });
    // fp8 codes (as signed bytes) and one scale per column.
    out.push(Case {
        name: "float8_e4m3fn_panel16",
        weight_bytes: N * K + N * 4,
        launches: vec![(matmul_panel(K, N, PanelWeights::Float8E4M3, None, seq, RegisterTile::ZMM), vec![0, 1, 2, 3])],
        buffers: vec![buffer(ElemType::F32, k), buffer(ElemType::I8, n * k), buffer(ElemType::F32, n), buffer(ElemType::F32, n)],
    });
    for encoding in [WeightEncoding::Q4_1, WeightEncoding::Q8_0] {
        let parts = part_sizes(encoding);
        let weight_bytes: u64 = parts.iter().map(|(e, n)| e.size() * *n as u64).sum();
        // Float activations: x, parts, out.
        let mut buffers = vec![buffer(ElemType::F32, k)];
        buffers.extend(parts.iter().map(|&(e, n)| buffer(e, n)));
        buffers.push(buffer(ElemType::F32, n));
        let args: Vec<usize> = (0..buffers.len()).collect();
        out.push(Case {
            name: if encoding == WeightEncoding::Q4_1 { "q4_1_float_activations" } else { "q8_0_float_activations" },
            weight_bytes,
            launches: vec![(matmul_blocks(K, N, encoding, None, seq), args)],
            buffers,
        });
        // Int8 activations: x -> (q, s), then q, s, parts, out.
        let form = dot_form(encoding, K).unwrap();
        let mut buffers = vec![buffer(ElemType::F32, k), buffer(ElemType::I8, k), buffer(ElemType::F32, 2 * k / 32)];
        buffers.extend(parts.iter().map(|&(e, n)| buffer(e, n)));
        buffers.push(buffer(ElemType::F32, n));
        let matmul_args: Vec<usize> = (1..buffers.len()).collect();
        out.push(Case {
            name: if encoding == WeightEncoding::Q4_1 { "q4_1_int8_activations" } else { "q8_0_int8_activations" },
            weight_bytes,
            launches: vec![(quantize_q8(K, form, seq), vec![0, 1, 2]), (matmul_int8(K, N, encoding, None, seq), matmul_args.clone())],
            buffers: buffers.clone(),
        });
        // The same with weights interleaved by 16 rows (activations in natural order).
        out.push(Case {
            name: if encoding == WeightEncoding::Q4_1 { "q4_1_int8_interleaved16" } else { "q8_0_int8_interleaved16" },
            weight_bytes,
            launches: vec![(quantize_q8(K, DotForm::Int8, seq), vec![0, 1, 2]), (matmul_interleaved(K, N, encoding, None, seq, RegisterTile::ZMM, ActivationLevels::Int8), matmul_args.clone())],
            buffers: buffers.clone(),
        });
        // Int16 activations on the interleaved weights: two byte planes (what
        // nibble weights take), and words (what Q8_0 takes).
        buffers[1] = buffer(ElemType::I8, 2 * k);
        let sixteens: &[(ActivationLevels, &'static str)] = match encoding {
            WeightEncoding::Q4_1 => &[(ActivationLevels::Int16Planes, "q4_1_int16_interleaved16")],
            _ => &[(ActivationLevels::Int16Planes, "q8_0_int16_planes_interleaved16"), (ActivationLevels::Int16Words, "q8_0_int16_interleaved16")],
        };
        for &(sixteen, name) in sixteens {
            out.push(Case {
                name,
                weight_bytes,
                launches: vec![(quantize_q16(K, sixteen, seq), vec![0, 1, 2]), (matmul_interleaved(K, N, encoding, None, seq, RegisterTile::ZMM, sixteen), matmul_args.clone())],
                buffers: buffers.clone(),
            });
        }
    }
    out
}

fn gemv(c: &mut Criterion) {
    let target = CpuTarget::host();
    let mut group = c.benchmark_group(format!("gemv_k{K}_n{N}_1thread"));
    for mut case in cases() {
        let kernels: Vec<Kernel> = case.launches.iter().map(|(k, _)| k.clone()).collect();
        let code = LoadedCode::load(&compile_shared(&kernels, &target).unwrap().shared_object).unwrap();
        let fns: Vec<_> = case.launches.iter().map(|(k, _)| code.kernel(&k.name).unwrap()).collect();
        let ptrs: Vec<*mut u8> = case.buffers.iter_mut().map(Buffer::as_mut_ptr).collect();
        let tables: Vec<Vec<*mut u8>> = case.launches.iter().map(|(_, args)| args.iter().map(|&a| ptrs[a]).collect()).collect();
        let tasks: Vec<u64> = case.launches.iter().map(|(k, _)| k.tasks.eval(1)).collect();
        let dims = [1i64];
        group.throughput(Throughput::Bytes(case.weight_bytes));
        group.bench_function(case.name, |b| {
            b.iter(|| {
                for ((f, table), &t) in fns.iter().zip(&tables).zip(&tasks) {
                    // SAFETY: each buffer is sized for its kernel's parameters at seq = 1.
                    unsafe { f(table.as_ptr(), dims.as_ptr(), 0, t) };
                }
            })
        });
    }
    group.finish();
}

/// The batched engine's step at 8 sequences: the int16 interleaved matmuls on
/// 8 activation rows (`SeqMode::Dynamic`), one thread, per register tile, with
/// the weights' bytes as throughput. Weights stay in cache: this is the
/// kernels' compute rate; `gemm_cold` adds the weights' stream from memory.
fn gemm_rows(c: &mut Criterion) {
    const ROWS: usize = 8;
    let target = CpuTarget::host();
    let mut group = c.benchmark_group(format!("gemm_k{K}_n{N}_{ROWS}rows_1thread"));
    let (k, n) = (K as usize, N as usize);
    // The target's tile and narrower ones (AVX2: one 16-wide panel, fewer rows).
    let tiles = if target.has_avx512() {
        [RegisterTile::ZMM, RegisterTile { rows: 2, panels: 2 }, RegisterTile { rows: 1, panels: 2 }]
    } else {
        [RegisterTile::YMM, RegisterTile { rows: 3, panels: 1 }, RegisterTile { rows: 2, panels: 1 }]
    };
    let mut seen = Vec::new();
    for (encoding, levels) in [(WeightEncoding::Q4_1, ActivationLevels::Int16Planes), (WeightEncoding::Q8_0, ActivationLevels::Int16Words)] {
        let parts = part_sizes(encoding);
        let weight_bytes: u64 = parts.iter().map(|(e, n)| e.size() * *n as u64).sum();
        for tile in tiles {
            let mut buffers = vec![buffer(ElemType::F32, ROWS * k), buffer(ElemType::I8, ROWS * 2 * k), buffer(ElemType::F32, ROWS * 2 * k / 32)];
            buffers.extend(parts.iter().map(|&(e, n)| buffer(e, n)));
            buffers.push(buffer(ElemType::F32, ROWS * n));
            let kernel = matmul_interleaved(K, N, encoding, None, SeqMode::Dynamic, tile, levels);
            // (Tiles the kernel maps to the same one are run once.)
            if seen.contains(&kernel.name) {
                continue;
            }
            seen.push(kernel.name.clone());
            let quantize = quantize_q16(K, levels, SeqMode::Dynamic);
            let code = LoadedCode::load(&compile_shared(&[quantize.clone(), kernel.clone()], &target).unwrap().shared_object).unwrap();
            let (fq, fm) = (code.kernel(&quantize.name).unwrap(), code.kernel(&kernel.name).unwrap());
            let ptrs: Vec<*mut u8> = buffers.iter_mut().map(Buffer::as_mut_ptr).collect();
            let (tq, tm) = (quantize.tasks.eval(ROWS as u64), kernel.tasks.eval(ROWS as u64));
            let (aq, am): (Vec<*mut u8>, Vec<*mut u8>) = (ptrs[..3].to_vec(), ptrs[1..].to_vec());
            let dims = [ROWS as i64];
            group.throughput(Throughput::Bytes(weight_bytes));
            // The kernel's name says the tile its 8 rows take (`_f..`: a step
            // of few rows, `matmul_interleaved::FEW_ROWS`).
            group.bench_function(kernel.name.clone(), |b| {
                b.iter(|| {
                    // SAFETY: each buffer is sized for its kernel's parameters at seq = ROWS.
                    unsafe {
                        fq(aq.as_ptr(), dims.as_ptr(), 0, tq);
                        fm(am.as_ptr(), dims.as_ptr(), 0, tm);
                    }
                })
            });
        }
    }
    group.finish();
}

/// The int16 interleaved matmul of the engine's steps with its weights streamed
/// from memory, as a step reads them: 64 copies of the weights (70 MB, beyond the
/// L3 cache) taken in turn, one thread, at 1 row (the decode GEMV), 8 and 16
/// (the batched engine's decode steps, `FEW_ROWS`: one panel at a time, the
/// levels prefetched ahead) and 64 (the prefill tiles). Beside `gemm_k`'s figure
/// of the same kernel in cache, the difference is the time the weights' stream
/// adds (docs/performance-log.md, "Steps of few rows").
fn gemm_rows_cold(c: &mut Criterion) {
    const COPIES: usize = 64;
    const MOST_ROWS: usize = 64;
    let target = CpuTarget::host();
    let mut group = c.benchmark_group(format!("gemm_cold_k{K}_n{N}_1thread"));
    let (k, n) = (K as usize, N as usize);
    let (encoding, levels) = (WeightEncoding::Q4_1, ActivationLevels::Int16Planes);
    let parts = part_sizes(encoding);
    let weight_bytes: u64 = parts.iter().map(|(e, n)| e.size() * *n as u64).sum();
    let tile = RegisterTile::for_cpu(target.has_avx512());
    let mut activations = vec![buffer(ElemType::F32, MOST_ROWS * k), buffer(ElemType::I8, MOST_ROWS * 2 * k), buffer(ElemType::F32, MOST_ROWS * 2 * k / 32), buffer(ElemType::F32, MOST_ROWS * n)];
    let mut copies: Vec<Vec<Buffer>> = (0..COPIES).map(|_| parts.iter().map(|&(e, n)| buffer(e, n)).collect()).collect();
    for rows in [1usize, 8, 16, MOST_ROWS] {
        let seq = if rows == 1 { SeqMode::Fixed(1) } else { SeqMode::Dynamic };
        let kernel = matmul_interleaved(K, N, encoding, None, seq, tile, levels);
        let quantize = quantize_q16(K, levels, seq);
        let code = LoadedCode::load(&compile_shared(&[quantize.clone(), kernel.clone()], &target).unwrap().shared_object).unwrap();
        let (fq, fm) = (code.kernel(&quantize.name).unwrap(), code.kernel(&kernel.name).unwrap());
        // x, q, s, out; each copy's arguments: q, s, its weight parts, out.
        let ptrs: Vec<*mut u8> = activations.iter_mut().map(Buffer::as_mut_ptr).collect();
        let args: Vec<Vec<*mut u8>> = copies
            .iter_mut()
            .map(|weights| ptrs[1..3].iter().copied().chain(weights.iter_mut().map(Buffer::as_mut_ptr)).chain([ptrs[3]]).collect())
            .collect();
        let (tq, tm) = (quantize.tasks.eval(rows as u64), kernel.tasks.eval(rows as u64));
        let dims = [rows as i64];
        let mut at = 0;
        group.throughput(Throughput::Bytes(weight_bytes));
        group.bench_function(format!("{}_{}_{rows}rows", encoding.name(), levels.tag()), |b| {
            b.iter(|| {
                at = (at + 1) % COPIES;
                // SAFETY: each buffer is sized for its kernel's parameters at MOST_ROWS rows.
                unsafe {
                    fq(ptrs[..3].as_ptr(), dims.as_ptr(), 0, tq);
                    fm(args[at].as_ptr(), dims.as_ptr(), 0, tm);
                }
            })
        });
    }
    group.finish();
}

/// The tiles of `MAXC_BENCH_TILES` (`ROWSxPANELS,...`), when set.
fn tile_list() -> Option<Vec<RegisterTile>> {
    let list = std::env::var("MAXC_BENCH_TILES").ok()?;
    let parse = |t: &str| -> Option<RegisterTile> {
        let (rows, panels) = t.trim().split_once('x')?;
        Some(RegisterTile { rows: rows.parse().ok()?, panels: panels.parse().ok()? })
    };
    Some(list.split(',').map(|t| parse(t).unwrap_or_else(|| panic!("MAXC_BENCH_TILES: `{t}` is not ROWSxPANELS (such as 4x2)"))).collect())
}

/// Prefill register tiles of the K-quants at the 1.17B model's down
/// projection (k 8192 x n 2048, 128 activation rows, one thread; weights and
/// activations in cache): Q4_K and Q6_K with int8 activations and int16 byte
/// planes, the target's tile (what `matmul_interleaved` makes of
/// [`RegisterTile::for_cpu`]: Q6_K's `six_bit_zmm` on AVX-512) and, on
/// AVX-512, Q6_K in one-panel tiles of other heights, with multiply-adds as
/// throughput (criterion's elements/s: half the operations per second).
/// docs/performance-log.md, "Q6_K's prefill tile", has figures.
fn gemm_prefill(c: &mut Criterion) {
    const ROWS: usize = 128;
    const PK: u64 = 8192;
    const PN: u64 = 2048;
    let target = CpuTarget::host();
    let mut group = c.benchmark_group(format!("gemm_prefill_k{PK}_n{PN}_{ROWS}rows_1thread"));
    group.sample_size(20);
    let (k, n) = (PK as usize, PN as usize);
    let own = RegisterTile::for_cpu(target.has_avx512());
    let chosen = tile_list();
    for (encoding, levels) in [WeightEncoding::Q4K, WeightEncoding::Q6K].into_iter().flat_map(|e| [(e, ActivationLevels::Int8), (e, ActivationLevels::Int16Planes)]) {
        let mut tiles = vec![own];
        if let Some(list) = &chosen {
            tiles = list.clone();
        } else if encoding == WeightEncoding::Q6K && target.has_avx512() {
            let rows: &[i64] = if levels == ActivationLevels::Int8 { &[4, 6, 10] } else { &[2, 3, 5] };
            tiles.extend(rows.iter().map(|&rows| RegisterTile { rows, panels: 1 }));
        }
        for tile in tiles {
            let kernel = matmul_interleaved(PK, PN, encoding, None, SeqMode::Dynamic, tile, levels);
            let width = k * levels.bytes() as usize;
            let mut buffers: Vec<Buffer> = kernel
                .params
                .iter()
                .map(|p| match p.name.as_str() {
                    "q" => buffer(ElemType::I8, ROWS * width),
                    "s" => buffer(ElemType::F32, ROWS * 2 * k / 32),
                    "h" => buffer(ElemType::I32, ROWS * k / 16),
                    "out" => buffer(ElemType::F32, ROWS * n),
                    // A weight part: at most a byte per weight.
                    _ => buffer(p.elem, k * n),
                })
                .collect();
            let code = LoadedCode::load(&compile_shared(std::slice::from_ref(&kernel), &target).unwrap().shared_object).unwrap();
            let f = code.kernel(&kernel.name).unwrap();
            let ptrs: Vec<*mut u8> = buffers.iter_mut().map(Buffer::as_mut_ptr).collect();
            let tasks = kernel.tasks.eval(ROWS as u64);
            let dims = [ROWS as i64];
            group.throughput(Throughput::Elements((ROWS * k * n) as u64));
            group.bench_function(kernel.name.clone(), |b| {
                // SAFETY: each buffer is sized for the kernel's parameters at ROWS rows.
                b.iter(|| unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, tasks) })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, gemv, gemm_rows, gemm_rows_cold, gemm_prefill);
criterion_main!(benches);
