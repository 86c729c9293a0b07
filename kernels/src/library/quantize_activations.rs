//! Activations quantized to int8 per block of 32, as llama.cpp's `Q8_0` / `Q8_1`
//! activation rows: `d = max |x| / 127`, `q = round(x / d)` in `-127..=127`.
//!
//! Output `q: i8[seq, k]` holds each row's levels in the order of the weights'
//! [`DotForm`] (two blocks per dot, see `ir.rs`), so a dot reads 64 consecutive
//! bytes; output `s: f32[seq, 2 k / 32]` holds per row every block's `d`, then
//! every block's `d * sum(q)` (which multiplies a block's additive minimum, for
//! Q4_0 / Q4_1 / Q4_K), so a dot's two scales are adjacent.
//! A block whose largest magnitude is 0 or below 1e-30 quantizes to zeros with
//! `d = 0` (never a division by zero, never NaN).
//!
//! [`quantize_q16`] is the 16-bit form (`--activation-encoding int16`):
//! `d = max |x| / 32512`, levels in `-32512..=32512`, each stored as two signed
//! bytes in two planes, `255 * high + low` with both in `-127..=127` (the range
//! the byte dot instructions take: never -128), 256 times finer than int8; the
//! interleaved matmul's `DotRows` multiplies both planes with the same unpacked
//! weight levels.

use super::dequant::BLOCK;
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Below this largest magnitude a block is all zeros.
const TINY: f32 = 1e-30;

/// One task per row: `x: f32[seq, k]` -> `q: i8[seq, k]`, `s: f32[seq, 2 k / 32]`.
pub fn quantize_q8(k: u64, form: DotForm, seq: SeqMode) -> Kernel {
    let whole = match form {
        DotForm::Int8 => BLOCK,
        DotForm::NibblePairs => DOT_VALUES,
    };
    assert_eq!(k % whole as u64, 0, "int8 activations in {form:?} order need whole {whole}-value groups ({k} values)");
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let q = b.param("q", ElemType::I8, true);
    let s = b.param("s", ElemType::F32, true);
    let (t, blk, l) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (amax, inv, sum) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    let ki = k as i64;
    let nb = ki / BLOCK;
    let xv = || ld(x, add(v(l), add(mul(v(t), i(ki)), mul(v(blk), i(BLOCK)))));
    let level = || un(UnOp::Floor, add(mul(xv(), v(inv)), f(0.5)));
    // Where value l of block blk goes: `DotForm::position` within its pair of blocks.
    let (pair, half) = (div(v(blk), i(2)), rem(v(blk), i(2)));
    let at = match form {
        DotForm::Int8 => add(v(l), mul(v(blk), i(BLOCK))),
        DotForm::NibblePairs => add(
            rem(v(l), i(16)),
            add(mul(pair, i(DOT_VALUES)), add(mul(div(v(l), i(16)), i(32)), mul(half, i(16)))),
        ),
    };
    let body = vec![for_(
        blk,
        i(0),
        i(nb),
        vec![
            set(amax, f(0.0)),
            for_vec(l, i(0), i(BLOCK), vec![set(amax, max(v(amax), max(xv(), un(UnOp::Neg, xv()))))]),
            set(inv, select(lt(f(TINY), v(amax)), div(f(127.0), v(amax)), f(0.0))),
            set(sum, f(0.0)),
            for_vec(l, i(0), i(BLOCK), vec![store(q, add(mul(v(t), i(ki)), at), un(UnOp::ToI64, level())), set(sum, add(v(sum), level()))]),
            store(s, add(mul(v(t), i(2 * nb)), v(blk)), select(lt(f(TINY), v(amax)), div(v(amax), f(127.0)), f(0.0))),
            store(s, add(add(mul(v(t), i(2 * nb)), v(blk)), i(nb)), mul(select(lt(f(TINY), v(amax)), div(v(amax), f(127.0)), f(0.0)), v(sum))),
        ],
    )];
    let form_tag = match form {
        DotForm::Int8 => "i8",
        DotForm::NibblePairs => "pairs",
    };
    b.finish(format!("quantize_q8_{form_tag}_k{k}_{}", seq.tag()), "quantize", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// Integer activations of the block matmuls: how many bits their levels have.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ActivationLevels {
    /// `-127..=127` in one byte ([`quantize_q8`]), llama.cpp's scheme.
    Int8,
    /// `-32512..=32512` in two byte planes ([`quantize_q16`]).
    Int16,
}

impl ActivationLevels {
    /// Bytes of levels per activation value.
    pub fn bytes(self) -> u64 {
        match self {
            ActivationLevels::Int8 => 1,
            ActivationLevels::Int16 => 2,
        }
    }

    /// The tag kernel names carry.
    pub fn tag(self) -> &'static str {
        match self {
            ActivationLevels::Int8 => "i8",
            ActivationLevels::Int16 => "i16",
        }
    }
}

/// The largest int16 activation level: `255 * 127 + 127`, where both bytes of
/// the level are 127.
pub const Q16_MAX_LEVEL: f32 = (HIGH_PLANE_WEIGHT * 127 + 127) as f32;

/// One task per row: `x: f32[seq, k]` -> `q: i8[seq, 2 k]` (per row the `k`
/// high bytes `round(level / 255)`, then the `k` low bytes
/// `level - 255 * high`, both in natural order and in `-127..=127`),
/// `s: f32[seq, 2 k / 32]` (every block's `d`, then every block's
/// `d * sum(level)`), `level = round(x / d)`, `d = max |x| / 32512`.
pub fn quantize_q16(k: u64, seq: SeqMode) -> Kernel {
    assert_eq!(k % BLOCK as u64, 0, "int16 activations need whole blocks of {BLOCK} values ({k} values)");
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let q = b.param("q", ElemType::I8, true);
    let s = b.param("s", ElemType::F32, true);
    let (t, blk, l) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (amax, inv, d, sum, level, high) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    let ki = k as i64;
    let nb = ki / BLOCK;
    let value = add(v(l), mul(v(blk), i(BLOCK)));
    let xv = || ld(x, add(mul(v(t), i(ki)), value.clone()));
    let high_at = add(mul(v(t), i(2 * ki)), value.clone());
    let low_at = add(add(mul(v(t), i(2 * ki)), i(ki)), value.clone());
    let scale_at = add(mul(v(t), i(2 * nb)), v(blk));
    let body = vec![for_(
        blk,
        i(0),
        i(nb),
        vec![
            set(amax, f(0.0)),
            for_vec(l, i(0), i(BLOCK), vec![set(amax, max(v(amax), max(xv(), un(UnOp::Neg, xv()))))]),
            set(inv, select(lt(f(TINY), v(amax)), div(f(Q16_MAX_LEVEL), v(amax)), f(0.0))),
            set(d, select(lt(f(TINY), v(amax)), div(v(amax), f(Q16_MAX_LEVEL)), f(0.0))),
            set(sum, f(0.0)),
            // Levels, their high bytes and the low remainders are exact integers
            // in f32. `level / 255` is never within 0.002 of a half (levels are
            // integers), far beyond the product's rounding, so `high` is exact.
            for_vec(
                l,
                i(0),
                i(BLOCK),
                vec![
                    set(level, un(UnOp::Floor, add(mul(xv(), v(inv)), f(0.5)))),
                    set(high, un(UnOp::Floor, add(mul(v(level), f(1.0 / HIGH_PLANE_WEIGHT as f32)), f(0.5)))),
                    store(q, high_at, un(UnOp::ToI64, v(high))),
                    store(q, low_at, un(UnOp::ToI64, sub(v(level), mul(v(high), f(HIGH_PLANE_WEIGHT as f32))))),
                    set(sum, add(v(sum), v(level))),
                ],
            ),
            store(s, scale_at.clone(), v(d)),
            store(s, add(scale_at, i(nb)), mul(v(d), v(sum))),
        ],
    )];
    b.finish(format!("quantize_q16_k{k}_{}", seq.tag()), "quantize", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};

    #[test]
    fn levels_scales_and_sums_like_llama_cpp_including_zero_and_denormal_blocks() {
        let k = 128usize;
        let mut x: Vec<f32> = (0..2 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        // Row 1: block 0 all zero, block 1 all denormal.
        for v in &mut x[k..k + 32] {
            *v = 0.0;
        }
        for v in &mut x[k + 32..k + 64] {
            *v = 1e-41;
        }
        for form in [DotForm::Int8, DotForm::NibblePairs] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![99; 2 * k]), Buffer::F32(vec![f32::NAN; 2 * 2 * k / 32])];
            run(&quantize_q8(k as u64, form, SeqMode::Dynamic), &mut bufs, 2);
            let (Buffer::I8(q), Buffer::F32(s)) = (&bufs[1], &bufs[2]) else { unreachable!() };
            for row in 0..2 {
                for blk in 0..k / 32 {
                    let xs = &x[row * k + blk * 32..row * k + blk * 32 + 32];
                    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let d = if amax > 1e-30 { amax / 127.0 } else { 0.0 };
                    let si = row * 2 * (k / 32) + blk;
                    assert_eq!(s[si], d, "{form:?} row {row} block {blk} scale");
                    let mut sum = 0i64;
                    for (t, v) in xs.iter().enumerate() {
                        let want = if d == 0.0 { 0 } else { (v * (127.0 / amax) + 0.5).floor() as i64 };
                        let pos = row * k + (blk / 2) * 64 + form.position((blk % 2) as i64, t as i64) as usize;
                        assert_eq!(q[pos] as i64, want, "{form:?} row {row} block {blk} value {t}");
                        assert!((-127..=127).contains(&want));
                        sum += want;
                    }
                    assert_eq!(s[si + k / 32], d * sum as f32);
                    assert!(s[si].is_finite() && s[si + k / 32].is_finite());
                }
            }
        }
    }

    /// Int16 levels: `round(x / d)` with `d = max |x| / 32512`, split into a
    /// high and a low byte, both in -127..=127, `255 high + low`, in two planes, with the
    /// block's `d` and `d * sum(level)`; zero and denormal blocks give zeros and
    /// `d = 0`; every other value is within `d / 2` of `d * level`.
    #[test]
    fn fifteen_bit_levels_split_into_two_byte_planes() {
        let k = 128usize;
        let mut x: Vec<f32> = (0..2 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        // Row 0 block 1 reaches both extremes exactly; row 1: block 0 all zero, block 1 all denormal.
        x[40] = -9.5;
        x[41] = 9.5;
        for v in &mut x[k..k + 32] {
            *v = 0.0;
        }
        for v in &mut x[k + 32..k + 64] {
            *v = 1e-41;
        }
        let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![99; 2 * 2 * k]), Buffer::F32(vec![f32::NAN; 2 * 2 * k / 32])];
        run(&quantize_q16(k as u64, SeqMode::Dynamic), &mut bufs, 2);
        let (Buffer::I8(q), Buffer::F32(s)) = (&bufs[1], &bufs[2]) else { unreachable!() };
        let (mut saw_max, mut saw_min) = (false, false);
        for row in 0..2 {
            for blk in 0..k / 32 {
                let xs = &x[row * k + blk * 32..row * k + blk * 32 + 32];
                let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = if amax > 1e-30 { amax / 32512.0 } else { 0.0 };
                let si = row * 2 * (k / 32) + blk;
                assert_eq!(s[si], d, "row {row} block {blk} scale");
                let mut sum = 0i64;
                for (t, v) in xs.iter().enumerate() {
                    let at = blk * 32 + t;
                    let (high, low) = (q[row * 2 * k + at] as i64, q[row * 2 * k + k + at] as i64);
                    assert!((-127..=127).contains(&high) && (-127..=127).contains(&low), "row {row} value {at}: bytes {high} {low}");
                    let level = 255 * high + low;
                    let want = if d == 0.0 { 0 } else { (v * (32512.0 / amax) + 0.5).floor() as i64 };
                    assert_eq!(level, want, "row {row} value {at}");
                    assert!(d == 0.0 || (v - d * level as f32).abs() <= d * 0.5 + 1e-6 * amax, "row {row} value {at}: {v} vs {}", d * level as f32);
                    saw_max |= level == 32512;
                    saw_min |= level == -32512;
                    sum += level;
                }
                assert_eq!(s[si + k / 32], d * sum as f32);
            }
        }
        assert!(saw_max && saw_min, "the extremes +-32512 were not reached");
    }
}
