//! The dot statements' vocabulary: [`RowDot`] (a row of block-quantized weights
//! against quantized activations, the core of the integer matmuls), how
//! activation levels are stored ([`ActLevels`]), per-row scales and minimums,
//! the weight layouts of a row ([`RowsForm`]) and of a 64-value block
//! ([`DotForm`]).

use serde::{Deserialize, Serialize};

use super::*;

/// A [`Stmt::DotRows`]: for row `g` in `0..DOT_LANES`,
/// `acc[g] += S[g] * act_scales[0] * dot_g + M[g] * act_scales[1]`, where
/// `dot_g = sum over t in 0..32 of W[g][t] * A[act_start + t]` in exact integers
/// (VNNI on x86: one `vpdpbusd` per 4 values of all 16 rows, the activation bytes
/// broadcast), `W[g][t]` is `form`'s unsigned level of row `g`, value `t`, in the
/// bytes of `weights` at `w_start`, `A` the signed bytes of `act`, `S[g]` the
/// row's block scale ([`RowScale`]) and `M[g]` its minimum ([`RowMin`]). With int8
/// activations, `act_scales` are the activation block's `d` and `d * sum(q)`.
/// `A[act_start + t]` stands for level `t` of the block as `act_levels` stores
/// it: a signed byte, or a 16-bit integer in two byte planes or in a
/// little-endian word ([`ActLevels`]); the dot stays exact in i32 (int16
/// activations: `act_scales` are the block's `d` and `d * sum(q)` of the whole
/// 16-bit levels).
/// Contract: `act_scales[1]` is `act_scales[0]` times the sum of the block's
/// activation levels, as `quantize_q8` / `quantize_q16` write them. A lowering may rely on
/// it: with `RowMin::Offset(o)` the term is then `S[g] * act_scales[0] * sum
/// over t of (W[g][t] + o) * A[t]`, and the x86 AVX2 one computes Q8_0's
/// (`o = -128`) that way, on the signed levels, without the activation sum; so
/// does the interpreter for any integer offset (exact: no cancellation of
/// `o * S * act_scales[1]` against a dot of unsigned levels).
/// With [`RowsForm::Nibbles5`] (Q5_0 / Q5_1) a level's fifth bit, with
/// [`RowsForm::Nibbles6`] (Q6_K) its fifth and sixth, come from `high_bits`
/// (see [`RowsForm::high_bit_of`]); `None` with the other forms. A form with
/// two halves ([`RowsForm::halves`]: Q6_K's scale per 16 values) sums
/// `S_h[g] * act_scales[0] * dot_h` over its halves `h` (values `16 h..16 h +
/// 16`), where `S_h[g]` takes its factor at `factors.1 + 16 h + g`; its minimum
/// is an integer `RowMin::Offset(o)` applied exactly, through the half's
/// activation level sum `H_h` ([`RowDot::half_sums`]): `dot_h = sum over the
/// half of W[g][t] * A[t] + o * H_h` (the sum of `(W[g][t] + o) * A[t]` when
/// `H_h` is the sum of the half's levels, as `level_half_sums` writes it), and
/// `act_scales[1]` is not read.
/// `acc` is a local of at least `DOT_LANES` f32. With `prefetch_ahead`, the CPU
/// lowering also prefetches the levels that many bytes past each 64-byte chunk it
/// reads (a hint with no effect on the result; it may point past the weights).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowDot {
    pub acc: LocalId,
    pub weights: ParamId,
    pub w_start: Expr,
    pub form: RowsForm,
    /// The block's high bits ([`RowsForm::high_bits_bytes`] of them, for
    /// [`RowsForm::Nibbles5`] and [`RowsForm::Nibbles6`]): a byte parameter
    /// and the first byte's index.
    pub high_bits: Option<(ParamId, Expr)>,
    /// Forms with two halves: an i32 parameter and the index of the block's
    /// first half's activation level sum `H_0` (`H_1` follows;
    /// `quantize_activations::level_half_sums`). With them no backend sums a
    /// block's activations again for every 16 weight rows. `None` with the
    /// other forms.
    pub half_sums: Option<(ParamId, Expr)>,
    pub act: ParamId,
    pub act_start: Expr,
    /// How the activation levels are stored.
    pub act_levels: ActLevels,
    pub act_scales: [Expr; 2],
    pub row_scales: RowScale,
    pub row_min: RowMin,
    pub prefetch_ahead: Option<i64>,
}

/// How a [`RowDot`] finds activation level `A[t]` (`t` in `0..32`) in the bytes
/// of `act`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActLevels {
    /// One signed byte each (int8): byte `act_start + t`.
    Bytes,
    /// 16-bit levels in two signed byte planes: byte `act_start + t` counts
    /// [`HIGH_PLANE_WEIGHT`]s and byte `low + t` adds to that. Both planes meet
    /// the weights' byte levels in byte dot instructions.
    Planes { low: Expr },
    /// 16-bit levels as little-endian words: bytes `act_start + 2t` (the low
    /// byte, unsigned) and `act_start + 2t + 1` (the high byte, signed). The
    /// weights' levels are widened to 16 bits and meet them in word dot
    /// instructions (x86 `vpmaddwd`).
    Words,
    /// 16-bit levels as little-endian words with the middle two of every four
    /// swapped: level `t` at word [`word_pair_position`]`(t)` (`a0 a2 a1 a3`),
    /// bytes `act_start + 2 p` (low, unsigned) and `act_start + 2 p + 1` (high,
    /// signed). Nibble levels masked out of 16-bit lanes pair a row's values
    /// `0, 2` and `1, 3` of each four (x86: three shifts and four masks per 32
    /// bytes of nibbles, no byte shuffles), and each such pair of activation
    /// words is then one 32-bit broadcast.
    WordPairs,
}

/// Where [`ActLevels::WordPairs`] stores level `t` of a block: the middle two
/// of every four swapped (`0 2 1 3`; its own inverse).
pub const fn word_pair_position(t: i64) -> i64 {
    (t & !3) | ((t & 1) << 1) | ((t >> 1) & 1)
}

/// Per-row values of a [`RowDot`]: for row `g`, element `values.1 + g` of the
/// float parameter `values.0`, times element `factors.1 + g` of the byte
/// parameter `factors.0` when there are factors (Q4_K: a super-block's f16
/// scale times the block's 6-bit scale, unsigned bytes; Q6_K: times each
/// half's scale, `i8`: read signed). A byte parameter is read as its element
/// type says: `u8` unsigned, `i8` signed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RowScale {
    pub values: (ParamId, Expr),
    pub factors: Option<(ParamId, Expr)>,
}

/// The per-row minimum `M[g]` of a [`RowDot`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowMin {
    /// `M[g] = offset * S[g]` (Q4_0: -8, Q8_0 stored as `q + 128`: -128).
    Offset(f32),
    /// `M[g]` is the stored value (Q4_1's minimums).
    Stored(RowScale),
    /// `M[g]` is minus the stored value (Q4_K: `value = scale * q - min`).
    Subtracted(RowScale),
}

impl RowDot {
    /// The per-row values it reads: its scales, and its minimums if stored.
    pub fn per_row(&self) -> Vec<&RowScale> {
        match &self.row_min {
            RowMin::Offset(_) => vec![&self.row_scales],
            RowMin::Stored(m) | RowMin::Subtracted(m) => vec![&self.row_scales, m],
        }
    }
}

/// How a [`Stmt::DotRows`] finds the unsigned level `W[g][t]` (row `g` in
/// `0..16`, value `t` in `0..32`) in the `16 * bytes per block` bytes `w` of one
/// block of 16 interleaved rows: in chunks of 64 bytes, each chunk holding four
/// values of every row (row `g` in bytes `4g..4g + 4`), so one 512-bit load
/// feeds one dot step of all 16 rows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RowsForm {
    /// Q4_0 / Q4_1 / Q4_K levels: `W[g][t]` is the low nibble of byte
    /// `64 (t / 8) + 4 g + t % 4` for `t % 8 < 4`, else its high nibble (4 chunks).
    Nibbles,
    /// Q5_0 / Q5_1 levels (`0..32`): the low four bits as [`RowsForm::Nibbles`],
    /// bit 4 from a 64-byte chunk of their own ([`RowDot::high_bits`]),
    /// ordered so that each dot step finds its bits by one shift: bit `t / 4`
    /// of byte `4 g + t % 4` ([`RowsForm::high_bit_of`]). Lane `g` of the
    /// chunk is row `g`'s, byte `j` of it the fifth bits of values `j, j + 4,
    /// ..., j + 28`, so step `s` (values `4 s..4 s + 4`) takes bit `s` of each
    /// byte.
    Nibbles5,
    /// Q6_K levels (`0..64`): nibbles as [`RowsForm::Nibbles`], bits 4 and 5
    /// side by side in 128 bytes ([`RowsForm::high_bit_of`]), and two halves
    /// (values `0..16`, `16..32`: steps `0..4`, `4..8`) with a scale each.
    Nibbles6,
    /// Byte levels: `W[g][t]` is byte `64 (t / 4) + 4 g + t % 4` read as unsigned
    /// (8 chunks; Q8_0 stores `q + 128`).
    Bytes,
}

impl RowsForm {
    /// Values of one row per block.
    pub const VALUES: i64 = 32;

    /// Bytes from row `g`'s levels (and high bits) to row `g + 1`'s in every
    /// form: `byte_of(g, t)` is `byte_of(0, t) + 4 g`, and `high_bit_of`'s byte
    /// alike (so a backend may loop over the rows with one body).
    pub const ROW_STRIDE: i64 = 4;

    /// Byte index (within the block of 16 rows) holding `W[g][t]`, and whether it
    /// is the high nibble.
    pub fn byte_of(self, g: i64, t: i64) -> (i64, bool) {
        let per_chunk = self.values_per_chunk();
        (64 * (t / per_chunk) + 4 * g + t % 4, t % per_chunk >= 4)
    }

    /// Values of each row one 64-byte chunk holds (the high nibbles hold values
    /// 4..8 of a chunk of nibbles).
    pub fn values_per_chunk(self) -> i64 {
        match self {
            RowsForm::Nibbles | RowsForm::Nibbles5 | RowsForm::Nibbles6 => 8,
            RowsForm::Bytes => 4,
        }
    }

    /// Byte (within a block's [`RowsForm::high_bits_bytes`]) and bit holding
    /// bit `4 + b` of `W[g][t]`. [`RowsForm::Nibbles5`]: bit `t / 4` of byte
    /// `4 g + t % 4`. [`RowsForm::Nibbles6`]: a level's two bits side by side
    /// in byte `64 p + 4 g + t % 4` for the pair `p` of nibble chunks (values
    /// `16 p..16 p + 16`), at bits 4-5 for the first chunk's low-nibble step,
    /// 0-1 for its high-nibble step, 6-7 and 2-3 for the second chunk's: so a
    /// step's two bits come to bits 4-5 by one byte shift (none for the first
    /// low step) and a mask, where the nibble is extracted anyway.
    pub fn high_bit_of(self, g: i64, t: i64, b: i64) -> (i64, i64) {
        match self {
            RowsForm::Nibbles6 => {
                let (pair, second, high) = (t / 16, (t / 8) % 2, (t % 8) >= 4);
                (64 * pair + 4 * g + t % 4, Self::six_bit_base(second == 1, high) + b)
            }
            // Nibbles5's one bit (b = 0).
            _ => {
                debug_assert_eq!(b, 0, "{self:?} has one high bit");
                (4 * g + t % 4, t / 4)
            }
        }
    }

    /// Where a [`RowsForm::Nibbles6`] step's two high bits sit in its byte:
    /// the first or second chunk of a pair, its low- or high-nibble step.
    pub fn six_bit_base(second: bool, high: bool) -> i64 {
        match (second, high) {
            (false, false) => 4,
            (false, true) => 0,
            (true, false) => 6,
            (true, true) => 2,
        }
    }

    /// How many high bits above the nibble a level has (0 for nibbles and bytes).
    pub fn high_bit_count(self) -> i64 {
        match self {
            RowsForm::Nibbles | RowsForm::Bytes => 0,
            RowsForm::Nibbles5 => 1,
            RowsForm::Nibbles6 => 2,
        }
    }

    /// Bytes of high bits per block of 16 rows ([`RowDot::high_bits`]).
    pub fn high_bits_bytes(self) -> i64 {
        64 * self.high_bit_count()
    }

    /// Parts of a block with a scale of their own (values `16 h..16 h + 16` of
    /// each row for half `h` when there are two).
    pub fn halves(self) -> i64 {
        match self {
            RowsForm::Nibbles6 => 2,
            _ => 1,
        }
    }

    /// `W[g][t]` from the bytes `w` of the block (and `high` of its high bits,
    /// read by the forms that have them).
    pub fn level(self, w: &dyn Fn(i64) -> i64, high: &dyn Fn(i64) -> i64, g: i64, t: i64) -> i64 {
        let (at, high_nibble) = self.byte_of(g, t);
        let byte = w(at) as u8;
        if self == RowsForm::Bytes {
            return byte as i64;
        }
        let nibble = (if high_nibble { byte >> 4 } else { byte & 15 }) as i64;
        (0..self.high_bit_count()).fold(nibble, |level, b| {
            let (at, bit) = self.high_bit_of(g, t, b);
            level | ((((high(at) as u8) >> bit) & 1) as i64) << (4 + b)
        })
    }

    /// Bytes of levels of one block of 16 rows (the high bits of the forms
    /// with them are in their own part).
    pub fn bytes(self) -> i64 {
        match self {
            RowsForm::Nibbles | RowsForm::Nibbles5 | RowsForm::Nibbles6 => 256,
            RowsForm::Bytes => 512,
        }
    }

    /// 64-byte chunks of one block of 16 rows (dot steps per chunk: 2 for
    /// nibbles, low then high, 1 for bytes).
    pub fn chunks(self) -> i64 {
        self.bytes() / 64
    }
}

/// What a high activation byte counts in a [`RowDot`] with two planes: 255, not
/// 256, so that both bytes of a level in `-32512..=32512` stay in `-127..=127`
/// (the byte dot instructions never see -128; see `quantize_activations.rs`).
pub const HIGH_PLANE_WEIGHT: i64 = 255;

/// Lanes of a [`Stmt::DotBlock`] accumulator (one 512-bit register of i32 / f32).
pub const DOT_LANES: i64 = 16;
/// Values of a [`Stmt::DotBlock`]: two blocks of 32.
pub const DOT_VALUES: i64 = 64;

/// How a [`Stmt::DotBlock`] unpacks its 64 weight levels `W[i]` from the bytes `w`
/// at its start (block A's values, then block B's, as each form orders them).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DotForm {
    /// `W[i] = w[i]` as a signed byte (Q8_0: A is bytes 0..32, B 32..64).
    Int8,
    /// Two 4-bit blocks of 16 bytes (Q4_0, Q4_1, and Q4_K as maxc stores it):
    /// `W[i]` for `i = 16 q + j` is the low nibble of byte `16 (q % 2) + j` for
    /// `q < 2`, else its high nibble. So `W` holds A's values 0..16, B's 0..16,
    /// A's 16..32, B's 16..32 (activations are quantized in that order).
    NibblePairs,
}

impl DotForm {
    /// Which of the two blocks (0: A, 1: B) lane `g` of a [`Stmt::DotBlock`] sums.
    pub fn block_of_lane(self, g: i64) -> usize {
        match self {
            DotForm::Int8 => (g / 8) as usize,
            DotForm::NibblePairs => ((g / 4) % 2) as usize,
        }
    }

    /// Position in `W` (and so in the activations) of value `t` of block `b`.
    pub fn position(self, b: i64, t: i64) -> i64 {
        match self {
            DotForm::Int8 => 32 * b + t,
            DotForm::NibblePairs => 32 * (t / 16) + 16 * b + t % 16,
        }
    }

    /// `W[i]` from the bytes `w` (starting at the form's first byte).
    pub fn level(self, w: &dyn Fn(i64) -> i64, i: i64) -> i64 {
        match self {
            DotForm::Int8 => w(i) as u8 as i8 as i64,
            DotForm::NibblePairs => {
                let (q, j) = (i / 16, i % 16);
                let byte = w(16 * (q % 2) + j) as u8;
                (if q < 2 { byte & 15 } else { byte >> 4 }) as i64
            }
        }
    }

    /// Bytes of weights one dot reads.
    pub fn bytes(self) -> i64 {
        match self {
            DotForm::Int8 => 64,
            DotForm::NibblePairs => 32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`RowsForm::ROW_STRIDE`] holds for every form, row and value: the
    /// Cranelift backend's one loop body over the rows relies on it.
    #[test]
    fn every_row_is_the_first_one_row_stride_bytes_further_on() {
        for form in [RowsForm::Nibbles, RowsForm::Nibbles5, RowsForm::Nibbles6, RowsForm::Bytes] {
            for g in 0..DOT_LANES {
                for t in 0..RowsForm::VALUES {
                    let ((first, first_high), (at, high)) = (form.byte_of(0, t), form.byte_of(g, t));
                    assert_eq!((at, high), (first + RowsForm::ROW_STRIDE * g, first_high), "{form:?} row {g} value {t}");
                    for b in 0..form.high_bit_count() {
                        let ((first, first_bit), (at, bit)) = (form.high_bit_of(0, t, b), form.high_bit_of(g, t, b));
                        assert_eq!((at, bit), (first + RowsForm::ROW_STRIDE * g, first_bit), "{form:?} row {g} value {t} bit {b}");
                    }
                }
            }
        }
    }
}
