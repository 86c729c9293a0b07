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
//! weight levels. For byte weights (Q8_0) the same levels are stored as
//! little-endian words instead, which word dot instructions take whole.
//!
//! [`round_bf16`] rounds activations to bfloat16 (nearest, ties to even) for
//! the pair dots of bfloat16 weight panels (`matmul_panel.rs`, `Stmt::PairDot`).

use super::dequant::BLOCK;
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Below this largest magnitude a block is all zeros.
const TINY: f32 = 1e-30;

/// The start of a block's quantization: its largest magnitude `amax` (the
/// values `xv()` for `l` in `0..BLOCK`), `inv = top / amax` and the scale
/// `d = amax / top`, both 0 where `amax` is 0 or below [`TINY`].
fn block_scale(amax: VarId, inv: VarId, d: VarId, l: VarId, xv: &dyn Fn() -> Expr, top: f32) -> Vec<Stmt> {
    vec![
        set(amax, f(0.0)),
        for_vec(l, i(0), i(BLOCK), vec![set(amax, max(v(amax), max(xv(), un(UnOp::Neg, xv()))))]),
        set(inv, select(lt(f(TINY), v(amax)), div(f(top), v(amax)), f(0.0))),
        set(d, select(lt(f(TINY), v(amax)), div(v(amax), f(top)), f(0.0))),
    ]
}

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
    let (amax, inv, d, sum) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
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
    let mut per_block = block_scale(amax, inv, d, l, &xv, 127.0);
    per_block.extend([
        set(sum, f(0.0)),
        for_vec(l, i(0), i(BLOCK), vec![store(q, add(mul(v(t), i(ki)), at), un(UnOp::ToI64, level())), set(sum, add(v(sum), level()))]),
        store(s, add(mul(v(t), i(2 * nb)), v(blk)), v(d)),
        store(s, add(add(mul(v(t), i(2 * nb)), v(blk)), i(nb)), mul(v(d), v(sum))),
    ]);
    let body = vec![for_(blk, i(0), i(nb), per_block)];
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
    /// `-32512..=32512` in two byte planes ([`quantize_q16`]): for weights
    /// whose levels are nibbles, which byte dot instructions take as they are.
    Int16Planes,
    /// The same levels as little-endian 16-bit words ([`quantize_q16`]): for
    /// byte weights (Q8_0), widened to words once and shared by the activation
    /// rows of a register tile, one word dot instruction per 16 weights.
    Int16Words,
    /// The same words with the middle two of every four swapped
    /// ([`ActLevels::WordPairs`]): for nibble weights in prefill tiles without
    /// VNNI, whose levels masked out of 16-bit lanes meet one 32-bit
    /// broadcast per pair of words, and whose rows keep one i32 accumulator
    /// per 8 weight rows instead of two byte planes' i16 sums.
    Int16WordPairs,
}

impl ActivationLevels {
    /// Every kind of integer activation levels.
    pub const ALL: [ActivationLevels; 4] = [ActivationLevels::Int8, ActivationLevels::Int16Planes, ActivationLevels::Int16Words, ActivationLevels::Int16WordPairs];

    /// Bytes of levels per activation value.
    pub fn bytes(self) -> u64 {
        match self {
            ActivationLevels::Int8 => 1,
            ActivationLevels::Int16Planes | ActivationLevels::Int16Words | ActivationLevels::Int16WordPairs => 2,
        }
    }

    /// Whether the levels are 16-bit words (in either order), which meet
    /// widened weight levels in word dots.
    pub fn is_words(self) -> bool {
        matches!(self, ActivationLevels::Int16Words | ActivationLevels::Int16WordPairs)
    }

    /// The tag kernel names carry.
    pub fn tag(self) -> &'static str {
        match self {
            ActivationLevels::Int8 => "i8",
            ActivationLevels::Int16Planes => "i16",
            ActivationLevels::Int16Words => "w16",
            ActivationLevels::Int16WordPairs => "p16",
        }
    }

    /// Where a `RowDot` finds block `blk` of activation row `row` (a row holds
    /// `k` values): its `act_start` and how its levels are stored. The one
    /// statement of the layouts [`quantize_q8`] (natural order) and
    /// [`quantize_q16`] write: int8 `q: i8[seq, k]`; planes `q: i8[seq, 2 k]`, a
    /// row's high bytes then its low bytes; words `q: i8[seq, 2 k]`, a row's
    /// levels as little-endian words.
    pub fn block_start(self, row: Expr, blk: Expr, k: i64) -> (Expr, ActLevels) {
        let row_start = mul(row, i(k * self.bytes() as i64));
        match self {
            ActivationLevels::Int8 => (add(row_start, mul(blk, i(BLOCK))), ActLevels::Bytes),
            ActivationLevels::Int16Planes => {
                let plane_offset = mul(blk, i(BLOCK));
                (add(row_start.clone(), plane_offset.clone()), ActLevels::Planes { low: add(add(row_start, i(k)), plane_offset) })
            }
            ActivationLevels::Int16Words => (add(row_start, mul(blk, i(2 * BLOCK))), ActLevels::Words),
            ActivationLevels::Int16WordPairs => (add(row_start, mul(blk, i(2 * BLOCK))), ActLevels::WordPairs),
        }
    }
}

/// The largest int16 activation level: `255 * 127 + 127`, where both bytes of
/// the level are 127.
pub const Q16_MAX_LEVEL: f32 = (HIGH_PLANE_WEIGHT * 127 + 127) as f32;

/// The kernel that quantizes `k`-wide activations to `levels`: [`quantize_q8`]
/// in dot form `form` for int8 levels, else [`quantize_q16`] (`form` unused).
pub fn quantize_to(k: u64, levels: ActivationLevels, form: DotForm, seq: SeqMode) -> Kernel {
    match levels {
        ActivationLevels::Int8 => quantize_q8(k, form, seq),
        sixteen => quantize_q16(k, sixteen, seq),
    }
}

/// One task per row: `x: f32[seq, k]` -> `q: i8[seq, 2 k]`,
/// `s: f32[seq, 2 k / 32]` (every block's `d`, then every block's
/// `d * sum(level)`), `level = round(x / d)`, `d = max |x| / 32512`. With
/// [`ActivationLevels::Int16Planes`] a row of `q` holds the `k` high bytes
/// `round(level / 255)`, then the `k` low bytes `level - 255 * high`, both in
/// natural order and in `-127..=127`; with [`ActivationLevels::Int16Words`] the
/// `k` levels as little-endian words (low byte `level mod 256`, high byte
/// `floor(level / 256)`), in natural order; with
/// [`ActivationLevels::Int16WordPairs`] the same words with the middle two of
/// every four swapped ([`word_pair_position`]).
pub fn quantize_q16(k: u64, levels_as: ActivationLevels, seq: SeqMode) -> Kernel {
    assert!(levels_as != ActivationLevels::Int8, "quantize_q16 writes 16-bit levels");
    assert_eq!(k % BLOCK as u64, 0, "int16 activations need whole blocks of {BLOCK} values ({k} values)");
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let q = b.param("q", ElemType::I8, true);
    let s = b.param("s", ElemType::F32, true);
    let (t, blk, l) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (amax, inv, d, sum) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    // A level and its two bytes, per value of a group of four (word pairs).
    let vars: Vec<[VarId; 3]> = (0..4).map(|_| [b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32)]).collect();
    let ki = k as i64;
    let nb = ki / BLOCK;
    let value = add(v(l), mul(v(blk), i(BLOCK)));
    let x_at = |value: Expr| ld(x, add(mul(v(t), i(ki)), value));
    let xv = || x_at(value.clone());
    // Where a value in natural order (planes, words) puts its high and low
    // bytes, and what the high byte weighs.
    let row_start = mul(v(t), i(2 * ki));
    let placed = |value: Expr| match levels_as {
        ActivationLevels::Int16Words => (add(add(row_start.clone(), mul(value.clone(), i(2))), i(1)), add(row_start.clone(), mul(value, i(2))), 256.0),
        _ => (add(row_start.clone(), value.clone()), add(add(row_start.clone(), i(ki)), value), HIGH_PLANE_WEIGHT as f32),
    };
    // One value's level and its two bytes where `high_at` and `low_at` say.
    // Levels, their high bytes and the low remainders are exact integers in
    // f32. Planes: `level / 255` is never within 0.002 of a half (levels are
    // integers), far beyond the product's rounding, so `high` is exact. Words:
    // `level / 256` is exact; the low byte `0..=255` is stored as the signed
    // byte of the same bits.
    let level_steps = |[level, high, low]: [VarId; 3], x_value: Expr, (high_at, low_at, base): (Expr, Expr, f32)| {
        vec![
            set(level, un(UnOp::Floor, add(mul(x_value, v(inv)), f(0.5)))),
            match levels_as {
                ActivationLevels::Int16Words | ActivationLevels::Int16WordPairs => set(high, un(UnOp::Floor, mul(v(level), f(1.0 / 256.0)))),
                _ => set(high, un(UnOp::Floor, add(mul(v(level), f(1.0 / HIGH_PLANE_WEIGHT as f32)), f(0.5)))),
            },
            set(low, sub(v(level), mul(v(high), f(base)))),
            store(q, high_at, un(UnOp::ToI64, v(high))),
            store(q, low_at, un(UnOp::ToI64, select(lt(v(low), f(128.0)), v(low), sub(v(low), f(256.0))))),
        ]
    };
    let scale_at = add(mul(v(t), i(2 * nb)), v(blk));
    let mut per_block = block_scale(amax, inv, d, l, &xv, Q16_MAX_LEVEL);
    per_block.extend([
        set(sum, f(0.0)),
        // Word pairs: value `4 g + j` of a block at word `4 g + [0, 2, 1, 3][j]`
        // (`word_pair_position`), one group of four per iteration and one add
        // of their sum, so that every store is at a stride and the sum a
        // reduction the loop vectorizer takes (a permuted index per value kept
        // the loop scalar: 2.5x quantize_q16's time). The sums are exact
        // integers in f32 (at most 32 * 32512) in any order.
        match levels_as {
            ActivationLevels::Int16WordPairs => {
                // Indices as `l * stride + rest` (the lane first, as the
                // library writes a vector loop's index for the lowering).
                let mut group: Vec<Stmt> = (0..4)
                    .flat_map(|j| {
                        let x_value = ld(x, add(mul(v(l), i(4)), add(mul(v(t), i(ki)), add(mul(v(blk), i(BLOCK)), i(j)))));
                        let word_start = add(row_start.clone(), mul(add(mul(v(blk), i(BLOCK)), i(word_pair_position(j))), i(2)));
                        let (high_at, low_at) = (add(mul(v(l), i(8)), add(word_start.clone(), i(1))), add(mul(v(l), i(8)), word_start));
                        level_steps(vars[j as usize], x_value, (high_at, low_at, 256.0))
                    })
                    .collect();
                let level = |j: usize| v(vars[j][0]);
                group.push(set(sum, add(v(sum), add(add(level(0), level(1)), add(level(2), level(3))))));
                for_vec(l, i(0), i(BLOCK / 4), group)
            }
            _ => {
                let mut steps = level_steps(vars[0], xv(), placed(value.clone()));
                steps.push(set(sum, add(v(sum), v(vars[0][0]))));
                for_vec(l, i(0), i(BLOCK), steps)
            }
        },
        store(s, scale_at.clone(), v(d)),
        store(s, add(scale_at, i(nb)), mul(v(d), v(sum))),
    ]);
    let body = vec![for_(blk, i(0), i(nb), per_block)];
    let name = match levels_as {
        ActivationLevels::Int16Words => "quantize_w16",
        ActivationLevels::Int16WordPairs => "quantize_p16",
        _ => "quantize_q16",
    };
    b.finish(format!("{name}_k{k}_{}", seq.tag()), "quantize", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// One task per row: `x: f32[seq, k]` -> `xb: bf16[seq, k]`, each value
/// rounded to the nearest bfloat16 (ties to even; a NaN stays NaN), the
/// activations of [`matmul_panel`](super::matmul_panel::matmul_panel)'s pair
/// dots.
pub fn round_bf16(k: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("xb", ElemType::BF16, true);
    let (t, l) = (b.var(ValType::I64), b.var(ValType::I64));
    let at = add(v(l), mul(v(t), i(k as i64)));
    let body = vec![for_vec(l, i(0), i(k as i64), vec![store(out, at.clone(), ld(x, at))])];
    b.finish(format!("round_bf16_k{k}_{}", seq.tag()), "quantize", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// One task per row: the integer activation levels `q` of `k` values (as
/// `levels` stores them: [`quantize_q8`]'s bytes, [`quantize_q16`]'s planes or
/// word pairs)
/// -> `h: i32[seq, k / 16]`, the sum of each 16 consecutive levels (at most
/// `16 * 32512` in magnitude). Q6_K's row dots read them
/// ([`RowDot::half_sums`]) to apply their `-32` offset per 16-value half, once
/// per row and block where every 16 weight rows summed the activations again.
pub fn level_half_sums(k: u64, levels: ActivationLevels, seq: SeqMode) -> Kernel {
    assert!(levels != ActivationLevels::Int16Words, "Q6_K's row dots take bytes, planes or word pairs, not words");
    assert_eq!(k % 16, 0, "half sums need whole halves of 16 values ({k} values)");
    let mut b = KernelBuilder::new();
    let q = b.param("q", ElemType::I8, false);
    let h = b.param("h", ElemType::I32, true);
    let (t, half, l, sum) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let ki = k as i64;
    let value = add(v(l), mul(v(half), i(16)));
    let row_start = mul(v(t), i(ki * levels.bytes() as i64));
    let level = match levels {
        ActivationLevels::Int16Planes => add(mul(i(HIGH_PLANE_WEIGHT), ld(q, add(row_start.clone(), value.clone()))), ld(q, add(add(row_start, i(ki)), value))),
        // Little-endian words, the high byte signed and the low one unsigned;
        // word pairs permute within fours, which a sum over 16 does not see.
        ActivationLevels::Int16WordPairs => {
            let at = add(row_start, mul(value, i(2)));
            add(mul(i(256), ld(q, add(at.clone(), i(1)))), bin(BinOp::And, ld(q, at), i(255)))
        }
        _ => ld(q, add(row_start, value)),
    };
    let body = vec![for_(
        half,
        i(0),
        i(ki / 16),
        vec![set(sum, i(0)), for_vec(l, i(0), i(16), vec![set(sum, add(v(sum), level))]), store(h, add(mul(v(t), i(ki / 16)), v(half)), v(sum))],
    )];
    b.finish(format!("level_half_sums_{}_k{k}_{}", levels.tag(), seq.tag()), "quantize", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};

    /// Two rows of `k` activations; in row 1, block 0 is all zero and block 1
    /// all denormal.
    fn rows_with_zero_and_denormal_blocks(k: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..2 * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        x[k..k + 32].fill(0.0);
        x[k + 32..k + 64].fill(1e-41);
        x
    }

    /// [`rows_with_zero_and_denormal_blocks`] where row 0's block 1 reaches
    /// both extremes of the int16 levels exactly.
    fn rows_with_zero_denormal_and_extreme_blocks(k: usize) -> Vec<f32> {
        let mut x = rows_with_zero_and_denormal_blocks(k);
        x[40] = -9.5;
        x[41] = 9.5;
        x
    }

    /// Runs `kernel` on the two rows `x` (`level_bytes` bytes of levels per value)
    /// and checks every block: `d = max |x| / top` (0 below 1e-30), each level
    /// (read by `level_of(q, row, block, t)`) `round(x / d)` within `-top..=top`
    /// and within `d / 2` of the value, and `d * sum(level)`. Returns the levels.
    fn check_blocks(kernel: &Kernel, x: &[f32], level_bytes: usize, top: f32, level_of: impl Fn(&[i8], usize, usize, usize) -> i64) -> Vec<i64> {
        let k = x.len() / 2;
        let mut bufs = vec![Buffer::F32(x.to_vec()), Buffer::I8(vec![99; 2 * level_bytes * k]), Buffer::F32(vec![f32::NAN; 2 * 2 * k / 32])];
        run(kernel, &mut bufs, 2);
        let (Buffer::I8(q), Buffer::F32(s)) = (&bufs[1], &bufs[2]) else { unreachable!() };
        let mut levels = Vec::new();
        for row in 0..2 {
            for blk in 0..k / 32 {
                let xs = &x[row * k + blk * 32..row * k + blk * 32 + 32];
                let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = if amax > 1e-30 { amax / top } else { 0.0 };
                let si = row * 2 * (k / 32) + blk;
                assert_eq!(s[si], d, "{}: row {row} block {blk} scale", kernel.name);
                let mut sum = 0i64;
                for (t, v) in xs.iter().enumerate() {
                    let level = level_of(q, row, blk, t);
                    let want = if d == 0.0 { 0 } else { (v * (top / amax) + 0.5).floor() as i64 };
                    assert_eq!(level, want, "{}: row {row} block {blk} value {t}", kernel.name);
                    assert!(level.abs() as f32 <= top);
                    assert!(d == 0.0 || (v - d * level as f32).abs() <= d * 0.5 + 1e-6 * amax, "{}: {v} vs {}", kernel.name, d * level as f32);
                    sum += level;
                    levels.push(level);
                }
                assert_eq!(s[si + k / 32], d * sum as f32);
                assert!(s[si].is_finite() && s[si + k / 32].is_finite());
            }
        }
        levels
    }

    #[test]
    fn levels_scales_and_sums_like_llama_cpp_including_zero_and_denormal_blocks() {
        let k = 128usize;
        let x = rows_with_zero_and_denormal_blocks(k);
        for form in [DotForm::Int8, DotForm::NibblePairs] {
            // Levels sit in the form's dot order within each pair of blocks.
            check_blocks(&quantize_q8(k as u64, form, SeqMode::Dynamic), &x, 1, 127.0, |q, row, blk, t| q[row * k + (blk / 2) * 64 + form.position((blk % 2) as i64, t as i64) as usize] as i64);
        }
    }

    /// The half sums are the sums of each 16 consecutive levels, as the
    /// levels are stored (int8 bytes; int16 planes as `255 high + low`; word
    /// pairs as little-endian words, each four in `0 2 1 3` order, which a
    /// sum over 16 does not see), for two rows with extreme, zero and
    /// denormal blocks.
    #[test]
    fn half_sums_add_each_16_levels() {
        let k = 128usize;
        let x = rows_with_zero_denormal_and_extreme_blocks(k);
        let sixteen = |levels| (levels, quantize_q16(k as u64, levels, SeqMode::Dynamic));
        for (levels, quantize) in [(ActivationLevels::Int8, quantize_q8(k as u64, DotForm::Int8, SeqMode::Dynamic)), sixteen(ActivationLevels::Int16Planes), sixteen(ActivationLevels::Int16WordPairs)] {
            let width = k * levels.bytes() as usize;
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I8(vec![0; 2 * width]), Buffer::F32(vec![0.0; 2 * 2 * k / 32])];
            run(&quantize, &mut bufs, 2);
            let mut sums = vec![bufs[1].clone(), Buffer::I32(vec![i32::MIN; 2 * k / 16])];
            run(&level_half_sums(k as u64, levels, SeqMode::Dynamic), &mut sums, 2);
            let (Buffer::I8(q), Buffer::I32(h)) = (&sums[0], &sums[1]) else { unreachable!() };
            for row in 0..2 {
                for half in 0..k / 16 {
                    let want: i64 = (16 * half..16 * half + 16)
                        .map(|t| match levels {
                            ActivationLevels::Int8 => q[row * width + t] as i64,
                            ActivationLevels::Int16WordPairs => i16::from_le_bytes([q[row * width + 2 * t] as u8, q[row * width + 2 * t + 1] as u8]) as i64,
                            _ => HIGH_PLANE_WEIGHT * q[row * width + t] as i64 + q[row * width + k + t] as i64,
                        })
                        .sum();
                    assert_eq!(h[row * k / 16 + half] as i64, want, "{levels:?} row {row} half {half}");
                }
            }
            // Some half is far from zero (the test is not vacuous).
            assert!(h.iter().any(|v| v.abs() > 200), "{levels:?}: {h:?}");
        }
    }

    /// Int16 levels: `round(x / d)` with `d = max |x| / 32512`, split into a
    /// high and a low byte, both in -127..=127, `255 high + low`, in two planes
    /// (a row's high bytes, then its low bytes), with the block's `d` and
    /// `d * sum(level)`; zero and denormal blocks give zeros and `d = 0`. The
    /// words layout holds the same levels.
    #[test]
    fn int16_levels_split_into_two_byte_planes_or_words() {
        let k = 128usize;
        let x = rows_with_zero_denormal_and_extreme_blocks(k);
        let levels = check_blocks(&quantize_q16(k as u64, ActivationLevels::Int16Planes, SeqMode::Dynamic), &x, 2, 32512.0, |q, row, blk, t| {
            let at = blk * 32 + t;
            let (high, low) = (q[row * 2 * k + at] as i64, q[row * 2 * k + k + at] as i64);
            assert!((-127..=127).contains(&high) && (-127..=127).contains(&low), "row {row} value {at}: bytes {high} {low}");
            255 * high + low
        });
        assert!(levels.contains(&32512) && levels.contains(&-32512), "the extremes +-32512 were not reached");
        // As little-endian words: a row's `k` levels in natural order, two bytes
        // each, the planes' levels exactly (same `d`, same rounding).
        let words = check_blocks(&quantize_q16(k as u64, ActivationLevels::Int16Words, SeqMode::Dynamic), &x, 2, 32512.0, |q, row, blk, t| {
            let at = row * 2 * k + 2 * (blk * 32 + t);
            i16::from_le_bytes([q[at] as u8, q[at + 1] as u8]) as i64
        });
        assert_eq!(words, levels);
        assert!(words.iter().any(|&l| l < 0 && l % 256 != 0), "no negative level with a nonzero low byte was checked");
        // Word pairs: the same words, value t of a block at word 0 2 1 3 of its four.
        let pairs = check_blocks(&quantize_q16(k as u64, ActivationLevels::Int16WordPairs, SeqMode::Dynamic), &x, 2, 32512.0, |q, row, blk, t| {
            let word = [0, 2, 1, 3][t % 4] + 4 * (t / 4);
            let at = row * 2 * k + 2 * (blk * 32 + word);
            i16::from_le_bytes([q[at] as u8, q[at + 1] as u8]) as i64
        });
        assert_eq!(pairs, levels);
    }
}
