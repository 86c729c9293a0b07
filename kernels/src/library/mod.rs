//! The kernel library: one builder per kernel family, each producing a [`Kernel`]
//! specialized to static shapes (and optionally to a fixed sequence length).
//!
//! Activations are row-major `[seq, width]`; a "row task" kernel runs one task per
//! sequence row.

pub mod attention;
pub mod attention_ragged;
pub mod copy;
pub mod dequant;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod matmul_blocks;
pub mod matmul_int8;
pub mod matmul_interleaved;
pub mod matmul_panel;
pub mod moe;
pub mod pooling;
pub mod quantize_activations;
pub mod rms_norm;
pub mod rope;

use crate::ir::dsl::*;
use crate::ir::{Expr, KernelBuilder, Stmt, ValType, VarId};

/// Elements per task of the GPU form of a row-wise map, tried in order: the
/// largest that divides the row into at least two chunks. One task per row
/// leaves a decode step's maps (one row) to a single thread block on a GPU
/// (swiglu over 8192 elements: 15 us on an H100, docs/gpu.md). The CPU forms
/// keep one task per row: split, a decode step's maps cost SmolLM2 21% of its
/// decode speed in hand-offs to the second thread (390 -> 308 tokens/s).
const MAP_CHUNKS: [u64; 3] = [256, 128, 64];

/// A row-wise map's tasks: `per_row` tasks of `chunk` elements per row, and
/// where task `t` starts: `start = row * width + col`, with `row` and `col`
/// set by `prelude`. CPU forms, and rows too narrow to split, keep one task per
/// row: `row = t`, no column offset, no prelude. Every offset is a multiple of
/// `chunk`, so a GPU lane still reads 16-byte vectors.
pub(crate) struct RowChunks {
    pub per_row: u64,
    pub chunk: u64,
    pub prelude: Vec<Stmt>,
    row: VarId,
    /// The variable holding the chunk's first column (none: whole rows).
    col: Option<VarId>,
}

impl RowChunks {
    /// Chunks of a row when `gpu` (the GPU form), else whole rows.
    pub(crate) fn new(b: &mut KernelBuilder, t: VarId, width: u64, gpu: bool) -> RowChunks {
        let Some(chunk) = MAP_CHUNKS.into_iter().find(|&c| gpu && width > c && width % c == 0) else {
            return RowChunks { per_row: 1, chunk: width, prelude: vec![], row: t, col: None };
        };
        let per_row = width / chunk;
        let (row, col) = (b.var(ValType::I64), b.var(ValType::I64));
        let prelude = vec![set(row, div(v(t), i(per_row as i64))), set(col, mul(rem(v(t), i(per_row as i64)), i(chunk as i64)))];
        RowChunks { per_row, chunk, prelude, row, col: Some(col) }
    }

    /// Index of element `c` of the task's chunk in a `[seq, width]` tensor.
    pub(crate) fn at(&self, width: u64, c: VarId) -> Expr {
        add(self.row_start(width), v(c))
    }

    /// Index of the task's first element in a `[seq, width]` tensor.
    pub(crate) fn row_start(&self, width: u64) -> Expr {
        let row = mul(v(self.row), i(width as i64));
        match self.col {
            Some(col) => add(row, v(col)),
            None => row,
        }
    }

    /// Column of element `c` of the task's chunk (for one row shared by all rows).
    pub(crate) fn column(&self, c: VarId) -> Expr {
        match self.col {
            Some(col) => add(v(col), v(c)),
            None => v(c),
        }
    }
}

/// Whether a kernel is compiled for any sequence length or one fixed length
/// (decode plans fix `seq = 1`, which lets LLVM drop the row loops).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum SeqMode {
    Dynamic,
    Fixed(u64),
}

impl SeqMode {
    /// The sequence length as an expression.
    pub fn expr(self) -> Expr {
        match self {
            SeqMode::Dynamic => Expr::Seq,
            SeqMode::Fixed(n) => Expr::I64(n as i64),
        }
    }

    /// Whether this is a decode kernel: one token per step, where matmuls are
    /// GEMVs that stream their weights (no row tiles, prefetching ahead).
    pub fn is_decode(self) -> bool {
        self == SeqMode::Fixed(1)
    }

    /// A name suffix: `sN` (dynamic) or `s1`.
    pub fn tag(self) -> String {
        match self {
            SeqMode::Dynamic => "sN".into(),
            SeqMode::Fixed(n) => format!("s{n}"),
        }
    }
}

/// The register tile of the panel-shaped matmuls in prefill (`matmul_panel.rs`,
/// `matmul_interleaved.rs`): `rows` activation rows times `panels` panels of 16
/// output columns, each (row, panel) one 16-lane f32 accumulator. Sized to the
/// target's vector registers: an accumulator is one zmm with AVX-512 (32
/// registers) but two ymm with AVX2 (16 registers), where the AVX-512 tile's 16
/// ymm accumulators alone fill the register file and LLVM spills in the inner
/// loop (`llc -mcpu=znver3`: 20 spills and reloads per 16 FMAs in the float
/// panel kernel, 226 in the Q4_1 int8 one). Decode kernels (one row) ignore
/// the tile: the float panel GEMV takes a task's panels together, the
/// interleaved one takes them one after another (its integer accumulators per
/// activation plane and broadcasts overflow AVX2's registers otherwise).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct RegisterTile {
    pub rows: i64,
    pub panels: i64,
}

/// [`RegisterTile::ZMM`], the tile of artifacts without CPU code (whose GPU forms ignore it).
impl Default for RegisterTile {
    fn default() -> Self {
        RegisterTile::ZMM
    }
}

impl RegisterTile {
    /// AVX-512: 4 rows x 2 panels, 8 zmm accumulators.
    pub const ZMM: RegisterTile = RegisterTile { rows: 4, panels: 2 };
    /// AVX2: 4 rows x 1 panel, 8 ymm accumulators, 2 for a panel's weights, 4
    /// broadcast activations (the shape of BLIS's Haswell kernels: one 16-wide
    /// panel, the rest of the registers for rows).
    pub const YMM: RegisterTile = RegisterTile { rows: 4, panels: 1 };
    /// AVX-512, 8 rows x 2 panels: float panels' tile ([`RegisterTile::for_float_panels`])
    /// and Q4_K's with int8 activations on CPUs that run it faster
    /// (`CpuTarget::q4_k_int8_tiles_take_eight_rows`).
    pub const ZMM_EIGHT_ROWS: RegisterTile = RegisterTile { rows: 8, panels: 2 };

    /// The tile for a CPU target: [`RegisterTile::ZMM`] with AVX-512, else [`RegisterTile::YMM`].
    pub fn for_cpu(avx512: bool) -> RegisterTile {
        if avx512 {
            RegisterTile::ZMM
        } else {
            RegisterTile::YMM
        }
    }

    /// The tile of float panel prefill (`matmul_panel.rs`) on this target's
    /// registers: AVX-512's 32 zmm take 8 rows x 2 panels (16 accumulators, 2
    /// weight vectors, one broadcast), so each weight vector, converted from
    /// bf16 / f16 once per k, feeds 8 FMAs instead of 4. Intel Xeon VM
    /// (AVX-512), 2 threads, pp512 against 4 x 2: SmolLM2 float32 1.06-1.08x,
    /// bfloat16 1.10-1.12x; 1.17B float16 pp512 1.13x; 6 x 2 0.93x and 10 x 2
    /// 0.88x of 8 x 2 (at k = 2048 the rows of x lie 8 KiB apart, in one L1
    /// set: with the weights' two lines, 8 rows fill 10 of its 12 ways). AVX2
    /// keeps 4 x 1: 6 x 1 spills (SmolLM2 float32 0.65x on x86-64-v3 code).
    pub fn for_float_panels(self) -> RegisterTile {
        if self == RegisterTile::ZMM {
            RegisterTile::ZMM_EIGHT_ROWS
        } else {
            self
        }
    }

    /// The tile of the interleaved matmul with int16 activations as words
    /// (`matmul_interleaved.rs`), whose rows keep four accumulators each and
    /// whose weight bytes are widened to words once per tile (`vpmovzxbw`, a
    /// shuffle-port instruction per 16 bytes). AVX-512 halves the rows (2 x 2).
    /// AVX2 takes 8 x 1 although its accumulators spill: the widening shared by
    /// 8 rows instead of 2 is worth more than the stack traffic. Zen 3 VM
    /// (AVX2), 2 threads, SmolLM2 Q8_0 GGUF, `bench --compare` against 2 x 1:
    /// pp512 1.21x (4 x 1 1.08-1.31x, 6 x 1 1.23x; 8 x 1 against 4 x 1 1.12x,
    /// 16 x 1 against 8 x 1 0.95-1.08x), and the batched step at 8 sequences
    /// 1.40-1.49x (236 / 264 against 172 / 177 tok/s). On x86-64-v3 code an
    /// earlier measurement had found 4 x 1 no faster than 2 x 1 (0.97-1.04x).
    /// (The schedule no longer gives AVX2 without VNNI words in prefill: Q8_0
    /// takes word pairs there in the target's 4 x 1 tile, which does not spill;
    /// 1.17B Q8_0 pp256 1.31x against this 8 x 1 words tile.)
    pub fn for_word_dots(self) -> RegisterTile {
        if self == RegisterTile::YMM {
            RegisterTile { rows: 8, panels: 1 }
        } else {
            RegisterTile { rows: (self.rows / 2).max(1), ..self }
        }
    }

    /// The tile of Q6_K's int16 byte planes (`matmul_interleaved.rs`) without
    /// AVX-512: 2 x 1. Six-bit levels widen their i16 pair sums every two dot
    /// steps instead of eight, and each row keeps two halves' sums per plane,
    /// so AVX2's 4 x 1 tile spills half again as much as Q4_K's (`llc
    /// -mcpu=znver3` on `maxc compile --emit-llvm`: 190 stack accesses per 128
    /// `vpmaddubsw` in the block loop against 107). Zen 3 VM (AVX2), 2 threads,
    /// 1.17B Q4_K_M pp256 `--profile`, the Q6_K down projection's time over the
    /// Q4_K one's (the same k8192 x n2048 shape, in the same run): 4 x 1 1.61 /
    /// 1.79, 2 x 1 1.45 / 1.52, 3 x 1 1.59 (about 2.5% of prefill; `bench
    /// --compare` cannot resolve it: A/A gave 1.09x that hour). AVX-512 keeps
    /// its planes tile (2 x 2). Since Q6_K takes word pairs on AVX2 without
    /// VNNI (the nibbles' 4 x 1 tile; docs/performance-log.md, "Five- and six-bit
    /// levels as word pairs"), this tile serves 256-bit targets with VNNI
    /// (AVX-VNNI).
    pub fn for_six_bit_planes(self) -> RegisterTile {
        if self == RegisterTile::YMM {
            RegisterTile { rows: 2, panels: 1 }
        } else {
            self
        }
    }

    /// The prefill tile of Q6_K's interleaved matmul on AVX-512: one panel of
    /// 8 rows with int8 activations, 4 with int16 byte planes (two
    /// accumulators per cell), instead of the other encodings' 4 x 2 and 2 x 2.
    /// A six-bit block keeps two halves' integer sums per cell and plane, each
    /// with its own scale, and its levels take a shift, a mask and a merge more
    /// per step than nibbles; with two panels LLVM spilled the tile (the int8
    /// 4 x 2 block loop: 28 stack stores and 22 reloads per 64 `vpdpbusd`,
    /// 341 instructions against Q4_K's 203), with one panel it does not (8 x
    /// 1: 3.3 instructions per `vpdpbusd`, Q4_K's 4 x 2 rate). The rows stop
    /// at 8 activation lines per step: at k = 8192 (the down projection) the
    /// rows, and a row's two planes, lie 8 KiB apart, in one L1 set, which
    /// has 8 ways on Zen 4 (12 on Zen 5). Zen 5 VM, one thread, 128 rows, k
    /// 8192 x n 2048 (`cargo bench -p maxc-tests --bench kernels --
    /// gemm_prefill`), GOP/s: int8 8 x 1 472, 4 x 1 470, 6 x 1 466, 10 x 1
    /// 461 (the 4 x 2 tile had run 267-417 in a probe of the same shape, 8 x 1
    /// 416-470 beside it); int16 planes 4 x 1 307, 5 x 1 302, 3 x 1 285, 2 x 1
    /// 273 (2 x 2: 188 in the probe). Q4_K's own tiles: int8 652, int16 382.
    pub fn six_bit_zmm(planes: bool) -> RegisterTile {
        RegisterTile { rows: if planes { 4 } else { 8 }, panels: 1 }
    }

    /// A kernel-name suffix: empty for [`RegisterTile::ZMM`] (the names kernels
    /// had before tiles were chosen per target), `_t{rows}x{panels}` otherwise.
    pub fn tag(self) -> String {
        if self == RegisterTile::ZMM {
            String::new()
        } else {
            format!("_t{}x{}", self.rows, self.panels)
        }
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use crate::interp::Buffer;
    use crate::ir::Kernel;
    use maxc_format::WeightEncoding;

    /// Runs `kernel` over `bufs` serially, or with `lanes` as the GPU deals its
    /// loops to lanes (`run_warp`, the reference of the NVPTX mapping).
    pub fn run_as(kernel: &Kernel, bufs: &mut [Buffer], seq: u64, lanes: bool) {
        if lanes {
            crate::interp::run_warp(kernel, bufs, seq);
        } else {
            crate::interp::run(kernel, bufs, seq);
        }
    }

    /// Deterministic pseudo-random values in [-1, 1).
    pub fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Random parts for `rows x cols` in `encoding` (any bytes are valid codes except fp8 NaNs).
    pub fn random_parts(encoding: WeightEncoding, rows: usize, cols: usize, seed: u64) -> Vec<Buffer> {
        let shape = [rows as u64, cols as u64];
        encoding
            .parts()
            .iter()
            .enumerate()
            .map(|(p, (name, dtype, _))| {
                let n = encoding.part_elems(p, &shape).unwrap() as usize;
                let r = rand(n, seed + p as u64);
                match dtype {
                    maxc_format::DType::I8 => Buffer::I8(r.iter().map(|v| (v * 127.0) as i8).collect()),
                    maxc_format::DType::U8 if encoding == WeightEncoding::Float8E4M3 => Buffer::U8(r.iter().map(|v| ((v + 1.0) * 127.0) as u8 & 0xf7).collect()),
                    // Levels and Q5's fifth bits: every byte value.
                    maxc_format::DType::U8 if p == 0 || *name == "high_bits" => Buffer::U8(r.iter().map(|v| ((v + 1.0) * 127.9) as u8).collect()),
                    maxc_format::DType::U8 => Buffer::U8(r.iter().map(|v| ((v + 1.0) * 31.9) as u8).collect()),
                    maxc_format::DType::F16 => Buffer::F16(r.iter().map(|v| half::f16::from_f32(v * 0.1).to_bits()).collect()),
                    maxc_format::DType::F32 => Buffer::F32(r.iter().map(|v| v * 0.1).collect()),
                    other => panic!("no test data for {other:?}"),
                }
            })
            .collect()
    }

    /// The little-endian bytes of a buffer (as the artifact stores them).
    fn buffer_bytes(b: &Buffer) -> Vec<u8> {
        match b {
            Buffer::I8(v) => v.iter().map(|&x| x as u8).collect(),
            Buffer::U8(v) => v.clone(),
            Buffer::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            other => panic!("no bytes for {other:?}"),
        }
    }

    /// A buffer of `like`'s element type from little-endian `bytes`.
    fn buffer_from_bytes(like: &Buffer, bytes: &[u8]) -> Buffer {
        match like {
            Buffer::I8(_) => Buffer::I8(bytes.iter().map(|&x| x as i8).collect()),
            Buffer::U8(_) => Buffer::U8(bytes.to_vec()),
            Buffer::F16(_) => Buffer::F16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
            Buffer::F32(_) => Buffer::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            other => panic!("no bytes for {other:?}"),
        }
    }

    /// Row-major `parts` of a `rows x cols` weight in `encoding`, reordered into
    /// layout `interleaved16` by the packing function the compiler uses.
    pub fn interleaved_parts(encoding: WeightEncoding, parts: &[Buffer], rows: usize, cols: usize) -> Vec<Buffer> {
        let bytes: Vec<Vec<u8>> = parts.iter().map(buffer_bytes).collect();
        crate::library::dequant::interleave_rows(encoding, &bytes, rows, cols).iter().zip(parts).map(|(p, like)| buffer_from_bytes(like, p)).collect()
    }

    /// Runs a matmul-family kernel on `first` (its activation inputs), then the
    /// weight parts, the addend if any, and an `m x n` output; returns the output.
    pub fn run_matmul(kernel: &crate::ir::Kernel, first: Vec<Buffer>, weights: &[Buffer], addend: Option<&[f32]>, (m, n): (usize, usize)) -> Vec<f32> {
        let mut bufs = first;
        bufs.extend(weights.iter().cloned());
        if let Some(r) = addend {
            bufs.push(Buffer::F32(r.to_vec()));
        }
        bufs.push(Buffer::F32(vec![f32::NAN; m * n]));
        crate::interp::run(kernel, &mut bufs, m as u64);
        let Some(Buffer::F32(got)) = bufs.pop() else { unreachable!("the output is f32") };
        got
    }

    /// One panel-shaped matmul test case: activation rows, sequence mode, addend.
    pub type PanelCase = (usize, super::SeqMode, Option<super::elementwise::Broadcast>);

    /// The cases of the panel-shaped matmul tests, each with both register
    /// tiles: (activation rows, seq mode, addend): 11 rows in prefill (a full
    /// 8-row tile of the AVX-512 float panels and 3 more; two 4-row tiles and 3
    /// more), one token in decode with a per-column addend, 3 rows with a full one.
    pub fn panel_cases() -> Vec<(PanelCase, super::RegisterTile)> {
        use super::elementwise::Broadcast;
        use super::{RegisterTile, SeqMode};
        // Steps of few rows, decode, and more rows than `FEW_ROWS` (the prefill tiles).
        let many = super::matmul_interleaved::FEW_ROWS as usize + 9;
        let cases = [(11usize, SeqMode::Dynamic, None), (1, SeqMode::Fixed(1), Some(Broadcast::Row)), (3, SeqMode::Dynamic, Some(Broadcast::None)), (many, SeqMode::Dynamic, Some(Broadcast::None))];
        cases.into_iter().flat_map(|c| [(c, RegisterTile::ZMM), (c, RegisterTile::YMM)]).collect()
    }

    /// A matmul's buffers: `x`, the weight's parts, `r` when there is an addend,
    /// and an output of `out_len` NaNs.
    pub fn matmul_buffers(x: &[f32], parts: &[Buffer], r: &[f32], addend: Option<super::elementwise::Broadcast>, out_len: usize) -> Vec<Buffer> {
        let mut bufs = vec![Buffer::F32(x.to_vec())];
        bufs.extend(parts.iter().cloned());
        if addend.is_some() {
            bufs.push(Buffer::F32(r.to_vec()));
        }
        bufs.push(Buffer::F32(vec![f32::NAN; out_len]));
        bufs
    }

    /// The naive `x[m, k] @ w[n, k]^T` plus `r` broadcast as `addend` says: every
    /// matmul test's reference.
    pub fn naive_matmul(x: &[f32], w: &[f32], r: &[f32], (m, k, n): (usize, usize, usize), addend: Option<super::elementwise::Broadcast>) -> Vec<f32> {
        use super::elementwise::Broadcast;
        let mut want = vec![0.0; m * n];
        for row in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|q| x[row * k + q] * w[j * k + q]).sum();
                want[row * n + j] = dot
                    + match addend {
                        None => 0.0,
                        Some(Broadcast::Row) => r[j],
                        Some(Broadcast::Scalar) => r[0],
                        Some(Broadcast::None) => r[row * n + j],
                    };
            }
        }
        want
    }

    pub fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }
}
