//! Reading weights stored in any [`WeightEncoding`]: the kernel parameters one
//! weight takes (one per stored part) and the expressions that decode its values
//! in registers. Block encodings are read as `scale * q + min` per block of
//! [`BLOCK`] values, where `q` is the stored small number as f32; the block
//! matmul keeps `q` and applies the scale once per block, everything else decodes
//! single values with [`value`].

use maxc_format::{Layout, WeightEncoding};

use crate::ir::dsl::*;
use crate::ir::*;

/// Values per block (all block encodings; Q4_K's super-blocks hold 8 of them).
pub const BLOCK: i64 = 32;
/// Half a block: byte `t` of a 4-bit block holds values `t` and `t + HALF`.
pub const HALF: i64 = BLOCK / 2;

/// The parameters of one weight `[rows, cols]`: one per part, in the artifact's part order.
#[derive(Clone, Debug)]
pub struct WeightParams {
    pub encoding: WeightEncoding,
    pub parts: Vec<ParamId>,
    pub cols: i64,
    /// Stored in layout `interleaved16` (blocks of 16 rows, see [`rows_form`]).
    pub interleaved: Option<RowsForm>,
}

/// Rows of one interleaved block group (layout `interleaved16`).
pub const INTERLEAVED_ROWS: i64 = DOT_LANES;

/// The [`RowsForm`] of an encoding stored in layout `interleaved16` (docs/mef.md):
/// Q8_0 (bytes `q + 128`), Q4_0, Q4_1 and Q4_K (nibbles), Q5_0 and Q5_1
/// (nibbles and fifth bits), Q6_K (nibbles and two high bits); every block of
/// 32 values of 16 consecutive rows is stored together, levels in the form's
/// chunks (the high bits in 64 bytes per bit of their own part,
/// [`RowsForm::high_bit_of`]), then every per-block part (scales, minimums;
/// Q4_K's and Q6_K's per-super-block ones, Q6_K's per 16 values) as
/// `[rows / 16][blocks][16]`, blocks of the part's own size. `None` for other encodings or shapes (`rows` not a
/// multiple of 16).
pub fn rows_form(encoding: WeightEncoding, rows: u64, cols: u64) -> Option<RowsForm> {
    if !Layout::Interleaved16.admits(encoding, &[rows, cols]) {
        return None;
    }
    Some(match encoding {
        WeightEncoding::Q8_0 => RowsForm::Bytes,
        WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Q5K => RowsForm::Nibbles5,
        WeightEncoding::Q6K => RowsForm::Nibbles6,
        _ => RowsForm::Nibbles,
    })
}

/// Bit `b` above the nibble of value `t` of a row-major block's `high_bits`
/// (Q5: 4 bytes, bit `t % 8` of byte `t / 8`; Q6_K: 8 bytes, bit `2 (t % 4) +
/// b` of byte `t / 4`): (byte, bit).
pub fn row_major_high_bit(form: RowsForm, t: i64, b: i64) -> (i64, i64) {
    match form.high_bit_count() {
        1 => (t / 8, t % 8),
        _ => (t / 4, 2 * (t % 4) + b),
    }
}

/// Reorders the row-major parts of a `[rows, cols]` weight in a block encoding
/// into layout `interleaved16` (see [`rows_form`]); `parts` in the encoding's order.
pub fn interleave_rows(encoding: WeightEncoding, parts: &[Vec<u8>], rows: usize, cols: usize) -> Vec<Vec<u8>> {
    let form = rows_form(encoding, rows as u64, cols as u64).unwrap_or_else(|| panic!("{} [{rows}, {cols}] has no interleaved layout", encoding.name()));
    let (g16, nb) = (INTERLEAVED_ROWS as usize, cols / BLOCK as usize);
    let row_bytes = form.bytes() as usize / g16;
    parts
        .iter()
        .enumerate()
        .map(|(p, bytes)| {
            let mut out = vec![0u8; bytes.len()];
            if p == 0 {
                // Levels: row r's block b (row_bytes bytes) spread over the group's chunks.
                for r in 0..rows {
                    for blk in 0..nb {
                        let src = &bytes[(r * nb + blk) * row_bytes..][..row_bytes];
                        let base = ((r / g16) * nb + blk) * form.bytes() as usize;
                        for t in 0..BLOCK {
                            let level = match form {
                                // Row-major nibbles: value t of a block in byte t % 16, high nibble from 16.
                                RowsForm::Nibbles | RowsForm::Nibbles5 | RowsForm::Nibbles6 => (src[(t % HALF) as usize] >> (4 * (t / HALF))) & 15,
                                RowsForm::Bytes => src[t as usize] ^ 0x80,
                            };
                            let (at, high) = form.byte_of((r % g16) as i64, t);
                            out[base + at as usize] |= if high { level << 4 } else { level };
                        }
                    }
                }
            } else if encoding.parts()[p].0 == "high_bits" {
                // Q5's fifth bits, Q6_K's two high bits: row-major per block
                // (`row_major_high_bit`), here by bit in the group block's
                // chunks of 64 (`RowsForm::high_bit_of`).
                let (per_block, group_bytes) = (form.high_bit_count() as usize * 4, form.high_bits_bytes() as usize);
                for r in 0..rows {
                    for blk in 0..nb {
                        let src = &bytes[(r * nb + blk) * per_block..][..per_block];
                        let base = ((r / g16) * nb + blk) * group_bytes;
                        for t in 0..BLOCK {
                            for b in 0..form.high_bit_count() {
                                let (byte, bit) = row_major_high_bit(form, t, b);
                                let value = (src[byte as usize] >> bit) & 1;
                                let (at, shift) = form.high_bit_of((r % g16) as i64, t, b);
                                out[base + at as usize] |= value << shift;
                            }
                        }
                    }
                }
            } else {
                // Per-block scalars (scales, minimums): [rows / 16][blocks][16],
                // blocks of this part's own size (32, or Q4_K's 256).
                let per_row = match encoding.parts()[p].2 {
                    maxc_format::PerRow::Every(n) => cols / n as usize,
                    maxc_format::PerRow::One => 1,
                };
                let size = bytes.len() / (rows * per_row);
                for r in 0..rows {
                    for blk in 0..per_row {
                        let dst = (((r / g16) * per_row + blk) * g16 + r % g16) * size;
                        out[dst..dst + size].copy_from_slice(&bytes[(r * per_row + blk) * size..][..size]);
                    }
                }
            }
            out
        })
        .collect()
}

/// Declares the parameters of weight `name` with `cols` values per row.
pub fn declare(b: &mut KernelBuilder, name: &str, encoding: WeightEncoding, cols: u64) -> WeightParams {
    assert_eq!(cols % encoding.block(), 0, "{name}: {cols} columns are not whole {} blocks", encoding.name());
    let parts = encoding.parts().iter().map(|(part, dtype, _)| b.param(&format!("{name}.{part}"), *dtype, false)).collect();
    WeightParams { encoding, parts, cols: cols as i64, interleaved: None }
}

/// Like [`declare`] for a weight `[rows, cols]` stored in layout `interleaved16`.
pub fn declare_interleaved(b: &mut KernelBuilder, name: &str, encoding: WeightEncoding, rows: u64, cols: u64) -> WeightParams {
    let form = rows_form(encoding, rows, cols).unwrap_or_else(|| panic!("{name}: {} [{rows}, {cols}] has no interleaved layout", encoding.name()));
    WeightParams { interleaved: Some(form), ..declare(b, name, encoding, cols) }
}

/// The fp8 e4m3fn code `code` (an i64 in 0..256) as f32: exponent bias 7, three
/// mantissa bits, subnormals `m * 2^-9`. Codes 0x7f / 0xff (NaN) are never written.
///
/// The code's fields move into a half's (sign bit 7 to 15, exponent and mantissa
/// bits 0..7 to 7..14): that half is the e4m3 value times 2^-8 (exponent bias 15
/// against 7), e4m3 subnormals landing on half subnormals, and the product with
/// 256 is exact. Four integer operations and a `vcvtph2ps` lane on x86, where
/// fields rebiased into an f32 need a select for the subnormals and a sign multiply.
pub fn e4m3_to_f32(code: Expr) -> Expr {
    mul(un(UnOp::HalfBitsToF32, e4m3_half_bits(code)), f(256.0))
}

/// The bits of the half whose value is fp8 e4m3fn code `code`'s times 2^-8
/// (see [`e4m3_to_f32`]).
pub fn e4m3_half_bits(code: Expr) -> Expr {
    add(shl(and(code.clone(), i(0x7f)), i(7)), shl(and(code, i(0x80)), i(8)))
}

/// [`e4m3_half_bits`] of a code loaded as a signed byte (`I8`: bits 8.. copy
/// the sign): shifted left by 7, the low 16 bits hold the sign in bit 15 and
/// again in bit 14, which the mask clears. Two operations after a sign-extending
/// load (`vpmovsxbw`, `vpsllw`, `vpand` on x86).
pub fn e4m3_half_bits_of_signed(code: Expr) -> Expr {
    and(shl(code, i(7)), i(0xbf80))
}

impl WeightParams {
    /// The parameter of stored part `name` (`quants`, `scales`, ...).
    pub fn part(&self, name: &str) -> ParamId {
        let i = self.encoding.parts().iter().position(|(p, _, _)| *p == name).expect("the encoding has this part");
        self.parts[i]
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> i64 {
        self.cols / BLOCK
    }

    /// The scale of block `blk` of `row`, and its additive minimum if the encoding has one.
    pub fn block_scale(&self, row: Expr, blk: Expr) -> (Expr, Option<Expr>) {
        let nb = self.blocks_per_row();
        let block_index = || self.per_block_index(row.clone(), blk.clone(), nb);
        match self.encoding {
            WeightEncoding::Q8_0 => (ld(self.part("scales"), block_index()), None),
            // q - 8 folded into the minimum: scale * (q - 8) = scale * q - 8 * scale.
            WeightEncoding::Q4_0 => {
                let d = ld(self.part("scales"), block_index());
                (d.clone(), Some(mul(f(-8.0), d)))
            }
            WeightEncoding::Q4_1 | WeightEncoding::Q5_1 => (ld(self.part("scales"), block_index()), Some(ld(self.part("mins"), block_index()))),
            // q - 16 folded into the minimum, as Q4_0's q - 8.
            WeightEncoding::Q5_0 => {
                let d = ld(self.part("scales"), block_index());
                (d.clone(), Some(mul(f(-16.0), d)))
            }
            WeightEncoding::Q4K | WeightEncoding::Q5K => {
                let sub_blocks = BLOCK * 8;
                let super_index = self.per_block_index(row.clone(), div(blk.clone(), i(8)), self.cols / sub_blocks);
                let scale = mul(ld(self.part("scales"), super_index.clone()), to_f32(ld(self.part("sub_scales"), block_index())));
                let min = mul(ld(self.part("mins"), super_index), to_f32(ld(self.part("sub_mins"), block_index())));
                (scale, Some(un(UnOp::Neg, min)))
            }
            // The super-block's scale; the sub-block scales are in the numbers
            // (`block_pair`: `sub_scale * (q - 32)`).
            WeightEncoding::Q6K => {
                let super_index = self.per_block_index(row.clone(), div(blk.clone(), i(8)), self.cols / (BLOCK * 8));
                (ld(self.part("scales"), super_index), None)
            }
            WeightEncoding::Float8E4M3 => (ld(self.part("scales"), row), None),
            WeightEncoding::Float32 | WeightEncoding::BFloat16 | WeightEncoding::Float16 => (f(1.0), None),
        }
    }

    /// Q6_K's signed scale of the 16 values `16 half..16 half + 16` of block
    /// `blk` of `row` (an i64 in -128..128).
    fn q6_k_sub_scale(&self, row: Expr, blk: Expr, half: Expr) -> Expr {
        ld(self.part("sub_scales"), self.per_block_index(row, add(mul(blk, i(2)), half), self.cols / HALF))
    }

    /// The stored numbers `q` (as f32) of values `lane` and `lane + HALF` of block
    /// `blk` of `row`, for `lane` in `0..HALF`.
    pub fn block_pair(&self, row: Expr, blk: Expr, lane: Expr) -> (Expr, Expr) {
        // The lane is the first operand of every index: with it last, LLVM's
        // instcombine turns `base + lane` into `base | lane` (disjoint bits) and the
        // loop vectorizer no longer sees consecutive addresses (it emits gathers).
        let block_start = add(mul(row.clone(), i(self.cols)), mul(blk.clone(), i(BLOCK)));
        let at = |offset: i64| add(add(lane.clone(), i(offset)), block_start.clone());
        match self.encoding {
            WeightEncoding::Q8_0 => {
                let q = self.part("quants");
                (to_f32(ld(q, at(0))), to_f32(ld(q, at(HALF))))
            }
            WeightEncoding::Q4_0 | WeightEncoding::Q4_1 | WeightEncoding::Q4K => {
                let byte_index = add(lane, add(mul(row, i(self.cols / 2)), mul(blk, i(HALF))));
                let byte = ld(self.part("quants"), byte_index);
                (to_f32(and(byte.clone(), i(15))), to_f32(shr(byte, i(4))))
            }
            // The nibbles as Q4_0's, each with its fifth bit (bit `t % 8` of
            // byte `t / 8` of the block's 4 high-bit bytes) as 16.
            WeightEncoding::Q5_0 | WeightEncoding::Q5_1 | WeightEncoding::Q5K => {
                let block = add(mul(row, i(self.blocks_per_row())), blk);
                let byte = ld(self.part("quants"), add(lane.clone(), mul(block.clone(), i(HALF))));
                let high_bits = self.part("high_bits");
                let fifth = |t: Expr| {
                    let bits = ld(high_bits, add(div(t.clone(), i(8)), mul(block.clone(), i(4))));
                    shl(and(shr(bits, rem(t, i(8))), i(1)), i(4))
                };
                let lo = add(and(byte.clone(), i(15)), fifth(lane.clone()));
                let hi = add(shr(byte, i(4)), fifth(add(lane, i(HALF))));
                (to_f32(lo), to_f32(hi))
            }
            // The nibbles with their two high bits (bits `2 (t % 4)..` of byte
            // `t / 4` of the block's 8) as 16 and 32: `sub_scale * (q - 32)`,
            // exact in integers (the super-block scale is `block_scale`'s).
            WeightEncoding::Q6K => {
                let block = add(mul(row.clone(), i(self.blocks_per_row())), blk.clone());
                let byte = ld(self.part("quants"), add(lane.clone(), mul(block.clone(), i(HALF))));
                let high_bits = self.part("high_bits");
                let high = |t: Expr| {
                    let bits = ld(high_bits, add(div(t.clone(), i(4)), mul(block.clone(), i(8))));
                    shl(and(shr(bits, mul(rem(t, i(4)), i(2))), i(3)), i(4))
                };
                let lo = add(and(byte.clone(), i(15)), high(lane.clone()));
                let hi = add(shr(byte, i(4)), high(add(lane, i(HALF))));
                let scaled = |q: Expr, half: i64| to_f32(mul(self.q6_k_sub_scale(row.clone(), blk.clone(), i(half)), sub(q, i(32))));
                (scaled(lo, 0), scaled(hi, 1))
            }
            WeightEncoding::Float8E4M3 => {
                let q = self.part("quants");
                (e4m3_to_f32(ld(q, at(0))), e4m3_to_f32(ld(q, at(HALF))))
            }
            WeightEncoding::Float32 | WeightEncoding::BFloat16 | WeightEncoding::Float16 => {
                let v = self.part("values");
                (ld(v, at(0)), ld(v, at(HALF)))
            }
        }
    }

    /// Where a per-block part (scales, minimums) holds block `blk` of `row`, with
    /// `blocks` of them per row: `[rows][blocks]`, or `[rows / 16][blocks][16]` in
    /// layout `interleaved16`.
    fn per_block_index(&self, row: Expr, blk: Expr, blocks: i64) -> Expr {
        match self.interleaved {
            None => add(mul(row, i(blocks)), blk),
            Some(_) => {
                let g = INTERLEAVED_ROWS;
                add(mul(add(mul(div(row.clone(), i(g)), i(blocks)), blk), i(g)), rem(row, i(g)))
            }
        }
    }

    /// The stored number `q` (as f32) of value `t` of block `blk` of `row` in layout
    /// `interleaved16`: the level at [`RowsForm::byte_of`] (row `row % 16`, value
    /// `t`) of its group block.
    fn interleaved_level(&self, form: RowsForm, row: Expr, blk: Expr, t: Expr) -> Expr {
        let g = INTERLEAVED_ROWS;
        let group_block = add(mul(div(row.clone(), i(g)), i(self.blocks_per_row())), blk.clone());
        let per_chunk = form.values_per_chunk();
        let row_in_group = rem(row.clone(), i(g));
        let within = add(mul(div(t.clone(), i(per_chunk)), i(64)), add(mul(row_in_group.clone(), i(4)), rem(t.clone(), i(4))));
        let byte = ld(self.part("quants"), add(mul(group_block.clone(), i(form.bytes())), within));
        let nibble = |byte: Expr, t: Expr| {
            let high = le(i(4), rem(t, i(per_chunk)));
            select(high, shr(byte.clone(), i(4)), and(byte, i(15)))
        };
        match form {
            RowsForm::Nibbles => to_f32(nibble(byte, t)),
            // Bit t / 4 of byte 4 (row % 16) + t % 4 of the group block's
            // fifth bits is bit 4 of the level.
            RowsForm::Nibbles5 => {
                let at = add(mul(group_block, i(form.high_bits_bytes())), add(mul(row_in_group, i(4)), rem(t.clone(), i(4))));
                let fifth = shl(and(shr(ld(self.part("high_bits"), at), div(t.clone(), i(4))), i(1)), i(4));
                to_f32(add(nibble(byte, t), fifth))
            }
            // Both high bits in byte 64 (t / 16) + 4 (row % 16) + t % 4, from
            // bit 4 - 4 ((t % 8) / 4) + 2 ((t / 8) % 2) (`RowsForm::high_bit_of`);
            // `sub_scale * (q - 32)`, as `block_pair`.
            RowsForm::Nibbles6 => {
                let at = add(mul(group_block, i(form.high_bits_bytes())), add(mul(div(t.clone(), i(HALF)), i(64)), add(mul(row_in_group, i(4)), rem(t.clone(), i(4)))));
                let base = add(sub(i(4), mul(div(rem(t.clone(), i(8)), i(4)), i(4))), mul(rem(div(t.clone(), i(8)), i(2)), i(2)));
                let bits = shl(and(shr(ld(self.part("high_bits"), at), base), i(3)), i(4));
                let q = add(nibble(byte, t.clone()), bits);
                to_f32(mul(self.q6_k_sub_scale(row, blk, div(t.clone(), i(HALF))), sub(q, i(32))))
            }
            // q + 128 stored in a signed byte: (byte & 255) - 128.
            RowsForm::Bytes => to_f32(sub(and(byte, i(255)), i(128))),
        }
    }

    /// The value at (`row`, `col`), decoded.
    pub fn value(&self, row: Expr, col: Expr) -> Expr {
        match self.encoding {
            WeightEncoding::Float32 | WeightEncoding::BFloat16 | WeightEncoding::Float16 => {
                ld(self.part("values"), add(mul(row, i(self.cols)), col))
            }
            _ => {
                let blk = div(col.clone(), i(BLOCK));
                let t = rem(col, i(BLOCK));
                let q = match self.interleaved {
                    Some(form) => self.interleaved_level(form, row.clone(), blk.clone(), t),
                    None => {
                        let (lo, hi) = self.block_pair(row.clone(), blk.clone(), rem(t.clone(), i(HALF)));
                        select(lt(t, i(HALF)), lo, hi)
                    }
                };
                let (scale, min) = self.block_scale(row, blk);
                match min {
                    Some(m) => add(mul(scale, q), m),
                    None => mul(scale, q),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_every_code_like_the_reference() {
        let mut b = KernelBuilder::new();
        let codes = b.param("codes", ElemType::U8, false);
        let out = b.param("out", ElemType::F32, true);
        let t = b.var(ValType::I64);
        let k = b.finish("e4m3".into(), "test", TaskCount { per_seq: 0, fixed: 256 }, t, vec![store(out, v(t), e4m3_to_f32(ld(codes, v(t))))]);
        let mut bufs = vec![crate::interp::Buffer::U8((0..=255).collect()), crate::interp::Buffer::F32(vec![0.0; 256])];
        crate::interp::run(&k, &mut bufs, 1);
        let crate::interp::Buffer::F32(got) = &bufs[1] else { unreachable!() };
        for code in 0..256u32 {
            if code & 0x7f == 0x7f {
                continue; // NaN codes are never produced
            }
            let (s, e, m) = ((code >> 7) & 1, ((code >> 3) & 15) as i32, (code & 7) as f32);
            let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
            let want = if s == 1 { -mag } else { mag };
            assert_eq!(got[code as usize], want, "code {code:#04x}");
        }
        assert_eq!(got[0x7e], 448.0, "largest finite e4m3");
    }
}
