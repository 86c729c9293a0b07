//! Weight encodings (MAX's `--quantization-encoding` names): quantizing f32
//! tensors into the artifact's part layout (maxc_format::WeightEncoding), and
//! decoding them back. The quantize pass, the reference interpreter and the
//! artifact writer all go through [`encode`] / [`decode`], so the interpreter sees
//! exactly the values the kernels read.
//!
//! The block quantizers follow llama.cpp's reference implementations
//! (`quantize_row_q8_0_ref`, `_q4_0_ref`, `_q4_1_ref`, `_q4_K_ref` with
//! `make_qkx2_quants`, `_q5_0_ref`, `_q5_1_ref`, `_q5_K_ref`, `_q6_K_ref` with
//! `make_qx_quants`), so a tensor quantized here holds the numbers llama.cpp
//! would store; only the byte layout differs (parts instead of interleaved blocks).

use half::{bf16, f16};
use maxc_format::WeightEncoding;

/// Parses an encoding name; the error lists every supported one.
pub fn parse_encoding(name: &str) -> Result<WeightEncoding, String> {
    WeightEncoding::from_name(name).ok_or_else(|| format!("unknown encoding `{name}`; supported: {}", WeightEncoding::all_names()))
}

/// `--quantization-encoding stored`: every matrix keeps its checkpoint's
/// encoding where maxc has kernels for it, else takes the nearest more precise
/// one (`StorageType::stored_scheme` in `import/weights.rs`).
pub const STORED: &str = "stored";

/// A linear layers' encoding name: `Ok(None)` for [`STORED`], else as
/// [`parse_encoding`].
pub fn parse_linear_encoding(name: &str) -> Result<Option<WeightEncoding>, String> {
    if name == STORED {
        return Ok(None);
    }
    parse_encoding(name).map(Some).map_err(|m| format!("{m}, {STORED}"))
}

/// Bits per value of an encoding (scales included), to pick the most precise
/// of several.
pub fn bits_per_value(q: WeightEncoding) -> f32 {
    // One row of 256 values: a whole block of every encoding.
    q.bytes(&[1, 256]).expect("256 values are whole blocks") as f32 * 8.0 / 256.0
}

/// A tensor in its stored form: one byte array per part of its encoding.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub parts: Vec<Vec<u8>>,
}

impl Encoded {
    /// Part `start .. start + len` along `axis` (0: rows, 1: columns, on whole
    /// blocks) of a tensor of `shape` stored in `encoding`: each part keeps its
    /// own share of every row (per-row scales stay whole).
    pub fn slice(&self, encoding: maxc_format::WeightEncoding, shape: &[u64], axis: usize, start: u64, len: u64) -> Encoded {
        use maxc_format::PerRow;
        let cols = *shape.last().unwrap_or(&1);
        let rows: u64 = shape.iter().rev().skip(1).product();
        // The last axis is the one blocks run along (a vector's only axis).
        let along_rows = axis + 1 < shape.len();
        let parts = encoding
            .parts()
            .iter()
            .zip(&self.parts)
            .map(|((_, dtype, per_row), bytes)| {
                let row_bytes = bytes.len() as u64 / rows.max(1);
                if along_rows {
                    return bytes[(start * row_bytes) as usize..((start + len) * row_bytes) as usize].to_vec();
                }
                let (lo, hi) = match per_row {
                    PerRow::One => (0, row_bytes),
                    PerRow::Every(n) => {
                        assert!(start.is_multiple_of(*n) && len.is_multiple_of(*n) && start.is_multiple_of(encoding.block()), "column slices of whole blocks");
                        (start / n * dtype.size(), (start + len) / n * dtype.size())
                    }
                };
                debug_assert!(hi <= row_bytes, "slice past a row of {cols} values");
                (0..rows).flat_map(|r| bytes[(r * row_bytes + lo) as usize..(r * row_bytes + hi) as usize].iter().copied()).collect()
            })
            .collect();
        Encoded { parts }
    }

    /// Stacks tensors along their first axis (rows): each part concatenates.
    pub fn concat_rows(pieces: Vec<Encoded>) -> Encoded {
        let n = pieces.first().map_or(0, |p| p.parts.len());
        let mut parts = vec![Vec::new(); n];
        for piece in pieces {
            for (dst, src) in parts.iter_mut().zip(piece.parts) {
                dst.extend_from_slice(&src);
            }
        }
        Encoded { parts }
    }

    pub fn bytes(&self) -> usize {
        self.parts.iter().map(Vec::len).sum()
    }
}

/// Values per block.
const QK: usize = 32;
/// Values per Q4_K super-block.
const QK_K: usize = 256;
/// llama.cpp's `GROUP_MAX_EPS`: a group whose largest magnitude is below it is all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

fn put_f16(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn get_f16(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// C's `roundf` (half away from zero), as llama.cpp's Q8_0 quantizer uses it.
fn roundf(x: f32) -> i32 {
    x.round() as i32
}

/// llama.cpp's `nearest_int` (the 1.5 * 2^23 trick: round half to even), as its
/// k-quant quantizers use it.
fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Quantizes `values` (rows of `cols`) into `encoding`'s parts. `cols` must be a
/// whole number of blocks (the quantize pass only picks encodings that fit).
pub fn encode(encoding: WeightEncoding, values: &[f32], cols: usize) -> Encoded {
    assert_eq!(cols % encoding.block() as usize, 0, "{cols} columns are not whole {} blocks", encoding.name());
    let parts = match encoding {
        WeightEncoding::Float32 => vec![values.iter().flat_map(|v| v.to_le_bytes()).collect()],
        WeightEncoding::BFloat16 => vec![values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()],
        WeightEncoding::Float16 => vec![values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()],
        WeightEncoding::Q8_0 => {
            let (mut q, mut d) = (Vec::with_capacity(values.len()), Vec::new());
            for block in values.chunks_exact(QK) {
                let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let scale = amax / 127.0;
                let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                put_f16(&mut d, scale);
                q.extend(block.iter().map(|v| roundf(v * inv) as i8 as u8));
            }
            vec![q, d]
        }
        WeightEncoding::Q4_0 => {
            let (mut q, mut d) = (Vec::with_capacity(values.len() / 2), Vec::new());
            for block in values.chunks_exact(QK) {
                // The signed value of largest magnitude maps to -8. (A least-squares
                // scale search, as llama.cpp's make_qx_quants, lowered SmolLM2's RMS
                // error from 8.5% to 7.5% but not its KL, at 5 s of compile time.)
                let max = block.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let scale = max / -8.0;
                let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                put_f16(&mut d, scale);
                let nib = |v: f32| ((v * inv + 8.5) as i8).min(15) as u8;
                q.extend((0..QK / 2).map(|t| nib(block[t]) | (nib(block[t + QK / 2]) << 4)));
            }
            vec![q, d]
        }
        WeightEncoding::Q4_1 => {
            let (mut q, mut d, mut m) = (Vec::with_capacity(values.len() / 2), Vec::new(), Vec::new());
            for block in values.chunks_exact(QK) {
                let (lo, hi) = min_max(block);
                let scale = (hi - lo) / 15.0;
                let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
                put_f16(&mut d, scale);
                put_f16(&mut m, lo);
                let nib = |v: f32| (((v - lo) * inv + 0.5) as i8).min(15) as u8;
                q.extend((0..QK / 2).map(|t| nib(block[t]) | (nib(block[t + QK / 2]) << 4)));
            }
            vec![q, d, m]
        }
        WeightEncoding::Q4K => encode_k_quant(values, false),
        WeightEncoding::Q5K => encode_k_quant(values, true),
        WeightEncoding::Float8E4M3 => encode_f8_e4m3(values, cols),
        WeightEncoding::Q5_0 => encode_q5(values, false),
        WeightEncoding::Q5_1 => encode_q5(values, true),
        WeightEncoding::Q6K => encode_q6_k(values),
    };
    Encoded { parts }
}

/// Decodes a tensor of `cols` columns back to f32 (exactly the values the kernels compute with).
pub fn decode(scheme: WeightEncoding, e: &Encoded, cols: usize) -> Vec<f32> {
    let p = &e.parts;
    match scheme {
        WeightEncoding::Float32 => p[0].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        WeightEncoding::BFloat16 => p[0].chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        WeightEncoding::Float16 => p[0].chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        WeightEncoding::Q8_0 => p[0].iter().enumerate().map(|(i, &q)| get_f16(&p[1], i / QK) * q as i8 as f32).collect(),
        WeightEncoding::Q4_0 => decode_nibbles(&p[0], |blk| (get_f16(&p[1], blk), -8.0 * get_f16(&p[1], blk))),
        WeightEncoding::Q4_1 => decode_nibbles(&p[0], |blk| (get_f16(&p[1], blk), get_f16(&p[2], blk))),
        WeightEncoding::Q4K => decode_nibbles(&p[0], |blk| {
            let sup = blk / (QK_K / QK);
            (get_f16(&p[3], sup) * p[1][blk] as f32, -(get_f16(&p[4], sup) * p[2][blk] as f32))
        }),
        WeightEncoding::Float8E4M3 => p[0]
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let r = i / cols;
                f32::from_le_bytes([p[1][4 * r], p[1][4 * r + 1], p[1][4 * r + 2], p[1][4 * r + 3]]) * e4m3_to_f32(q)
            })
            .collect(),
        WeightEncoding::Q5_0 => decode_q5(&p[0], &p[1], |blk| (get_f16(&p[2], blk), -16.0 * get_f16(&p[2], blk))),
        WeightEncoding::Q5_1 => decode_q5(&p[0], &p[1], |blk| (get_f16(&p[2], blk), get_f16(&p[3], blk))),
        WeightEncoding::Q6K => decode_q6_k(&p[0], &p[1], &p[2], &p[3]),
        WeightEncoding::Q5K => decode_q5(&p[0], &p[1], |blk| {
            let sup = blk / (QK_K / QK);
            (get_f16(&p[4], sup) * p[2][blk] as f32, -(get_f16(&p[5], sup) * p[3][blk] as f32))
        }),
    }
}

/// Q6_K's parts back to f32 as the kernels compute them: `d * (sub_scale * (q -
/// 32))`, the integer product first (exact), `q` the nibble with its two high
/// bits (bits `2 (t % 4)..` of byte `t / 4` of the block's 8).
fn decode_q6_k(q: &[u8], high: &[u8], sub: &[u8], d: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.len() * 2);
    for (blk, bytes) in q.chunks_exact(QK / 2).enumerate() {
        let scale = get_f16(d, blk / (QK_K / QK));
        let level = |t: usize| {
            let nibble = if t < QK / 2 { bytes[t] & 15 } else { bytes[t - QK / 2] >> 4 };
            (nibble | ((high[8 * blk + t / 4] >> (2 * (t % 4))) & 3) << 4) as i32
        };
        out.extend((0..QK).map(|t| scale * ((sub[2 * blk + t / 16] as i8 as i32) * (level(t) - 32)) as f32));
    }
    out
}

/// Q5_0 / Q5_1 (llama.cpp's `quantize_row_q5_0_ref` / `quantize_row_q5_1_ref`):
/// per block of 32, Q5_0 maps the signed value of largest magnitude to -16
/// (`q = x / scale + 16`), Q5_1 spans the block's minimum to maximum in 31
/// steps (`q = (x - min) / scale`); the low 4 bits of each `q` as Q4_0's nibbles,
/// the fifth bits as 4 bytes (`high_bits`, GGUF's `qh`).
fn encode_q5(values: &[f32], with_min: bool) -> Vec<Vec<u8>> {
    let n = values.len();
    let (mut q, mut high, mut d, mut m) = (Vec::with_capacity(n / 2), Vec::with_capacity(n / 8), Vec::new(), Vec::new());
    for block in values.chunks_exact(QK) {
        let level: Box<dyn Fn(f32) -> u8> = if with_min {
            let (lo, hi) = min_max(block);
            let scale = (hi - lo) / 31.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            put_f16(&mut d, scale);
            put_f16(&mut m, lo);
            Box::new(move |v| (((v - lo) * inv + 0.5) as u8).min(31))
        } else {
            let max = block.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let scale = max / -16.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            put_f16(&mut d, scale);
            Box::new(move |v| ((v * inv + 16.5) as i8).min(31) as u8)
        };
        let levels: Vec<u8> = block.iter().map(|&v| level(v)).collect();
        q.extend((0..QK / 2).map(|t| (levels[t] & 15) | ((levels[t + QK / 2] & 15) << 4)));
        let bits = levels.iter().enumerate().fold(0u32, |acc, (t, l)| acc | (((l >> 4) as u32 & 1) << t));
        high.extend(bits.to_le_bytes());
    }
    if with_min {
        vec![q, high, d, m]
    } else {
        vec![q, high, d]
    }
}

/// llama.cpp's `make_qx_quants` with `rmse_type` 1 and no importance weights
/// (as `quantize_row_q6_K_ref` calls it): a scale for the `x.len()` values
/// (levels `l + nmax` in `levels`), refined over 18 trial scales around
/// `-nmax / max` by the weighted least-squares fit (weights `x^2`).
fn make_qx_quants(x: &[f32], nmax: i32, levels: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels.iter_mut().for_each(|l| *l = 0);
        return 0.0;
    }
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
            let w = v * v;
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    let set = |levels: &mut [i8], iscale: f32| {
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as i8;
        }
    };
    set(levels, iscale);
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set(levels, iscale);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K (llama.cpp's `quantize_row_q6_K_ref`): per super-block of 256, a scale
/// per 16 values by [`make_qx_quants`] (levels -32..31), the scales quantized
/// to signed bytes against the super-block's f16 `d` (the scale of largest
/// magnitude maps to -128, capped at 127), then every value requantized against
/// its sub-block's `d * scale`. Stored as maxc's parts: the low 4 bits of each
/// `q = l + 32` as Q4_0's nibbles, its two high bits 2 per value (`high_bits`,
/// bits `2 (t % 4)` of byte `t / 4` of a block's 8), the sub-block scales
/// (`sub_scales`, i8) and the f16 `scales`.
fn encode_q6_k(values: &[f32]) -> Vec<Vec<u8>> {
    let n = values.len();
    let (mut q, mut high, mut sub, mut d) = (Vec::with_capacity(n / 2), Vec::with_capacity(n / 4), Vec::with_capacity(n / 16), Vec::new());
    for x in values.chunks_exact(QK_K) {
        let mut levels = [0i8; QK_K];
        let mut scales = [0.0f32; QK_K / 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for (ib, scale) in scales.iter_mut().enumerate() {
            *scale = make_qx_quants(&x[16 * ib..16 * ib + 16], 32, &mut levels[16 * ib..16 * ib + 16]);
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = *scale;
            }
        }
        let mut sub_scales = [0i8; QK_K / 16];
        if max_abs_scale < GROUP_MAX_EPS {
            levels = [0; QK_K];
            put_f16(&mut d, 0.0);
        } else {
            let iscale = -128.0 / max_scale;
            put_f16(&mut d, 1.0 / iscale);
            let d16 = f16::from_f32(1.0 / iscale).to_f32();
            for (s, scale) in sub_scales.iter_mut().zip(&scales) {
                *s = nearest_int(iscale * scale).min(127) as i8;
            }
            for (j, &s) in sub_scales.iter().enumerate() {
                let dj = d16 * s as f32;
                if dj == 0.0 {
                    continue;
                }
                for ii in 0..16 {
                    levels[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-32, 31) + 32) as i8;
                }
            }
        }
        sub.extend(sub_scales.map(|s| s as u8));
        for block in levels.chunks_exact(QK) {
            let l = |t: usize| block[t] as u8;
            q.extend((0..QK / 2).map(|t| (l(t) & 15) | ((l(t + QK / 2) & 15) << 4)));
            high.extend((0..QK / 4).map(|b| (0..4).fold(0u8, |acc, i| acc | ((l(4 * b + i) >> 4) & 3) << (2 * i))));
        }
    }
    vec![q, high, sub, d]
}

/// A block's smallest and largest value.
fn min_max(block: &[f32]) -> (f32, f32) {
    block.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// 5-bit blocks: as [`decode_nibbles`], each value's fifth bit from the block's
/// 4 `high` bytes (bit `t % 8` of byte `t / 8` for value `t`).
fn decode_q5(q: &[u8], high: &[u8], scale_min: impl Fn(usize) -> (f32, f32)) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.len() * 2);
    for (blk, bytes) in q.chunks_exact(QK / 2).enumerate() {
        let (d, m) = scale_min(blk);
        let fifth = |t: usize| ((high[4 * blk + t / 8] >> (t % 8)) & 1) << 4;
        out.extend(bytes.iter().enumerate().map(|(t, b)| d * ((b & 15) | fifth(t)) as f32 + m));
        out.extend(bytes.iter().enumerate().map(|(t, b)| d * ((b >> 4) | fifth(t + QK / 2)) as f32 + m));
    }
    out
}

/// 4-bit blocks: byte `t` of block `b` holds values `t` (low nibble) and `t + 16`;
/// `scale_min(b)` gives the block's `(scale, min)`.
fn decode_nibbles(q: &[u8], scale_min: impl Fn(usize) -> (f32, f32)) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.len() * 2);
    for (blk, bytes) in q.chunks_exact(QK / 2).enumerate() {
        let (d, m) = scale_min(blk);
        out.extend(bytes.iter().map(|b| d * (b & 15) as f32 + m));
        out.extend(bytes.iter().map(|b| d * (b >> 4) as f32 + m));
    }
    out
}

/// llama.cpp's `make_qkx2_quants`: a scale and (non-positive) minimum for one
/// sub-block, refined by trying `nstep + 1` nearby scales and solving the weighted
/// least-squares fit for each. Returns `(scale, -min)` and fills `levels`.
fn make_qkx2_quants(x: &[f32], weights: &[f32], nmax: i32, (rmin, rdelta, nstep): (f32, f32, i32), levels: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let mut min = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let sum_w: f32 = weights.iter().sum();
    let sum_x: f32 = x.iter().zip(weights).map(|(v, w)| v * w).sum();
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0.0;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        levels[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best += weights[i] * (diff * diff);
    }
    let mut aux = vec![0u8; n];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mad: f32 = (0..n)
                .map(|i| {
                    let diff = this_scale * aux[i] as f32 + this_min - x[i];
                    weights[i] * (diff * diff)
                })
                .sum();
            if mad < best {
                levels.copy_from_slice(&aux);
                best = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K (`quantize_row_q4_K_ref`) and, with `five_bits`, Q5_K
/// (`quantize_row_q5_K_ref`): per super-block of 256, eight sub-block scales
/// and minimums fitted by [`make_qkx2_quants`] (Q4_K: 15 levels, trial scales
/// from -1 in 20 steps of 0.1; Q5_K: 31 levels, from -0.5 in 15), quantized to 6
/// bits against the super-block's largest, then the levels recomputed with the
/// rounded scales. Q5_K's fifth bits as Q5_0's (`high_bits`, 4 bytes per 32).
fn encode_k_quant(values: &[f32], five_bits: bool) -> Vec<Vec<u8>> {
    let (nmax, search) = if five_bits { (31, (-0.5, 0.1, 15)) } else { (15, (-1.0, 0.1, 20)) };
    let mut high = Vec::new();
    let n = values.len();
    let (mut q, mut sub_scales, mut sub_mins, mut d, mut dmin) = (Vec::with_capacity(n / 2), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut levels = [0u8; QK_K];
    for sup in values.chunks_exact(QK_K) {
        let mut scales = [0.0f32; 8];
        let mut mins = [0.0f32; 8];
        for (j, x) in sup.chunks_exact(QK).enumerate() {
            let av_x = (x.iter().map(|v| v * v).sum::<f32>() / QK as f32).sqrt();
            let weights: Vec<f32> = x.iter().map(|v| av_x + v.abs()).collect();
            (scales[j], mins[j]) = make_qkx2_quants(x, &weights, nmax, search, &mut levels[j * QK..(j + 1) * QK]);
        }
        let max_scale = scales.iter().fold(0.0f32, |a, &v| a.max(v));
        let max_min = mins.iter().fold(0.0f32, |a, &v| a.max(v));
        let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let ls: Vec<u8> = scales.iter().map(|s| nearest_int(inv_scale * s).min(63) as u8).collect();
        let lm: Vec<u8> = mins.iter().map(|m| nearest_int(inv_min * m).min(63) as u8).collect();
        put_f16(&mut d, max_scale / 63.0);
        put_f16(&mut dmin, max_min / 63.0);
        let (dd, dm) = (get_f16(&d, d.len() / 2 - 1), get_f16(&dmin, dmin.len() / 2 - 1));
        for (j, x) in sup.chunks_exact(QK).enumerate() {
            let scale = dd * ls[j] as f32;
            if scale == 0.0 {
                continue;
            }
            let min = dm * lm[j] as f32;
            for (l, v) in levels[j * QK..(j + 1) * QK].iter_mut().zip(x) {
                *l = nearest_int((v + min) / scale).clamp(0, nmax) as u8;
            }
        }
        for blk in levels.chunks_exact(QK) {
            q.extend((0..QK / 2).map(|t| (blk[t] & 15) | ((blk[t + QK / 2] & 15) << 4)));
            if five_bits {
                let bits = blk.iter().enumerate().fold(0u32, |acc, (t, l)| acc | (((l >> 4) as u32 & 1) << t));
                high.extend(bits.to_le_bytes());
            }
        }
        sub_scales.extend_from_slice(&ls);
        sub_mins.extend_from_slice(&lm);
    }
    if five_bits {
        vec![q, high, sub_scales, sub_mins, d, dmin]
    } else {
        vec![q, sub_scales, sub_mins, d, dmin]
    }
}

/// The largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// fp8 e4m3fn code to f32 (exponent bias 7, 3 mantissa bits, subnormals `m * 2^-9`).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let (e, m) = (((code >> 3) & 15) as i32, (code & 7) as f32);
    let mag = if e == 0 { m / 512.0 } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    if code & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// f32 to the nearest e4m3fn code (ties to even), saturating at +-448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0; // never produced: the scale maps every finite row into range
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormal: m * 2^-9, m in 0..=8 (8 is the smallest normal, code 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: keep 3 of the 23 mantissa bits, rounding to nearest even; a carry
    // out of the mantissa moves into the exponent, which is the right result.
    let bits = a.to_bits();
    let rounded = bits + 0x7_ffff + ((bits >> 20) & 1);
    let exponent = (rounded >> 23) as i32 - 127 + 7;
    let mantissa = (rounded >> 20) & 7;
    sign | ((exponent as u32) << 3 | mantissa).min(0x7e) as u8
}

/// FP8 e4m3 weight-only with one f32 scale per row (output channel): the row's
/// largest magnitude maps to at most 448. A row whose largest magnitude is zero, or so
/// small that the scale would be subnormal, stores scale 0 and all-zero codes:
/// exact zeros, never a division by zero (the NaN/inf bug MAX shipped).
fn encode_f8_e4m3(values: &[f32], cols: usize) -> Vec<Vec<u8>> {
    let decoded: [f32; 256] = std::array::from_fn(|c| e4m3_to_f32(c as u8));
    let (mut q, mut scales) = (Vec::with_capacity(values.len()), Vec::new());
    for row in values.chunks_exact(cols) {
        let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let base = amax / E4M3_MAX;
        if !base.is_normal() {
            scales.extend_from_slice(&0.0f32.to_le_bytes());
            q.extend(std::iter::repeat_n(0u8, cols));
            continue;
        }
        // e4m3 is a floating grid, so the scale only shifts where values fall
        // between its points: try 16 scales across one octave above the one that
        // maps the largest magnitude to 448, keep the smallest squared error.
        let squared_error = |scale: f32| -> f32 { row.iter().map(|v| (v - scale * decoded[f32_to_e4m3(v / scale) as usize]).powi(2)).sum() };
        let mut best = (squared_error(base), base);
        for k in 1..16 {
            let scale = base * 2f32.powf(k as f32 / 16.0);
            let e = squared_error(scale);
            if e < best.0 {
                best = (e, scale);
            }
        }
        let scale = best.1;
        scales.extend_from_slice(&scale.to_le_bytes());
        q.extend(row.iter().map(|v| f32_to_e4m3(v / scale)));
    }
    vec![q, scales]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(scheme: WeightEncoding, values: &[f32], cols: usize) -> Vec<f32> {
        let e = encode(scheme, values, cols);
        let shape = [(values.len() / cols) as u64, cols as u64];
        for (i, part) in e.parts.iter().enumerate() {
            assert_eq!(part.len() as u64, scheme.part_elems(i, &shape).unwrap() * scheme.parts()[i].1.size(), "{} part {i}", scheme.name());
        }
        decode(scheme, &e, cols)
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0 + (i % 3) as f32 * 0.01).collect()
    }

    #[test]
    fn rounding_is_to_nearest_even_and_encoding_agrees() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
        let got = roundtrip(WeightEncoding::BFloat16, &[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], 2);
        assert_eq!(got, vec![1.0, 1.0 + 4.0 / 256.0]);
        assert_eq!(roundtrip(WeightEncoding::Float16, &[65504.0], 1), vec![65504.0]);
        assert_eq!(encode(WeightEncoding::BFloat16, &[1.5, -2.0], 2).parts[0], vec![0xc0, 0x3f, 0x00, 0xc0]);
        assert!(parse_encoding("q3_k").unwrap_err().contains("q4_k"));
    }

    /// Every block encoding's error stays within half a quantization step of its block.
    #[test]
    fn block_encodings_round_trip_within_half_a_step() {
        let x = values(512 * 3);
        for (scheme, levels) in [(WeightEncoding::Q8_0, 254.0), (WeightEncoding::Q4_0, 15.0), (WeightEncoding::Q4_1, 15.0), (WeightEncoding::Q4K, 15.0)] {
            let y = roundtrip(scheme, &x, 512);
            for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
                let range = bx.iter().fold(0.0f32, |a, v| a.max(v.abs())) * 2.0;
                // Q4_0 maps the largest magnitude to -8, so the other extreme clamps
                // at +7: one full step. Q4_K's 6-bit scales and fitted minimums add
                // about one more step.
                let step = range / levels * if scheme == WeightEncoding::Q4_1 || scheme == WeightEncoding::Q8_0 { 1.0 } else { 2.0 };
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= step * 0.51 + 1e-3, "{scheme:?}: {a} -> {b} (step {step})");
                }
            }
        }
    }

    #[test]
    fn q4_0_and_q8_0_match_llama_cpp_on_a_known_block() {
        // Values on the q4_0 grid of scale 0.125 (levels -8..7): the reference
        // scale is exact and no other scale beats it.
        let block: Vec<f32> = (0..32).map(|i| (i % 16) as f32 * 0.125 - 1.0).collect();
        let e = encode(WeightEncoding::Q4_0, &block, 32);
        assert_eq!(f16::from_le_bytes([e.parts[1][0], e.parts[1][1]]).to_f32(), 0.125);
        assert_eq!(e.parts[0][0] & 15, 0, "-1.0 / 0.125 + 8 = 0");
        assert_eq!(decode(WeightEncoding::Q4_0, &e, 32), block);
        let block: Vec<f32> = (0..32).map(|i| -1.0 + i as f32 / 32.0).collect();
        let e = encode(WeightEncoding::Q8_0, &block, 32);
        assert_eq!(e.parts[0][0] as i8, -127);
        assert_eq!(e.parts[0][16] as i8, -64, "-0.5 * 127 = -63.5 rounds away from zero");
    }

    #[test]
    fn e4m3_round_trips_every_code_and_rounds_ties_to_even() {
        for code in 0..=255u8 {
            if code & 0x7f == 0x7f {
                continue;
            }
            let x = e4m3_to_f32(code);
            let back = f32_to_e4m3(x);
            assert_eq!(e4m3_to_f32(back), x, "code {code:#04x}");
        }
        // 1.0625 is halfway between 1.0 (mantissa 0) and 1.125 (mantissa 1): even wins.
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.0625)), 1.0);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1.1875)), 1.25);
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1000.0)), 448.0);
    }

    /// The near-zero guard: an all-zero row and an all-denormal row quantize to
    /// exact zeros (never NaN or inf), next to a normal row that is unaffected.
    #[test]
    fn f8_zero_and_denormal_rows_quantize_to_exact_zeros() {
        let cols = 32;
        let mut x = vec![0.0f32; cols];
        x.extend((0..cols).map(|i| f32::from_bits(1 + i as u32 * 1000))); // all subnormal
        x.extend(values(cols));
        assert!(x[cols..2 * cols].iter().all(|v| *v != 0.0 && !v.is_normal()));
        let y = roundtrip(WeightEncoding::Float8E4M3, &x, cols);
        assert!(y.iter().all(|v| v.is_finite()));
        assert!(y[..2 * cols].iter().all(|v| *v == 0.0), "zero and denormal rows must decode to exact zeros");
        let amax = x[2 * cols..].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (a, b) in x[2 * cols..].iter().zip(&y[2 * cols..]) {
            assert!((a - b).abs() <= amax / 16.0, "{a} -> {b}");
        }
    }

}
