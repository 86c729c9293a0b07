//! Embedding gather: `out[r] = table[ids[r]]`, one row task per token, decoding
//! the table's encoding (float or block-quantized) on the fly.

use maxc_format::{Layout, WeightEncoding};

use super::dequant::{declare, declare_interleaved, e4m3_to_f32};
use super::matmul_panel::PANEL;
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `table: [vocab, hidden]` (stored in `encoding`: one param per part),
/// `ids: i32[seq]` -> `out: f32[seq, hidden]`.
/// Ids are clamped into the vocabulary so that a bad id cannot read out of bounds
/// (the runtime rejects such ids before running).
pub fn embedding(vocab: u64, hidden: u64, encoding: WeightEncoding, seq: SeqMode) -> Kernel {
    embedding_in(vocab, hidden, encoding, Layout::RowMajor, seq)
}

/// [`embedding`] of a table stored in `layout`: a tied lm_head packed for
/// `matmul_interleaved` (`interleaved16`, block encodings) or for
/// `matmul_panel` (`panel16`, float and fp8 encodings: value `(row, col)` at
/// `[row / 16][col][row % 16]`, so a row's values lie 16 apart; a gather reads
/// one row per token, which costs nothing beside the GEMV over the whole table
/// that the layout speeds up).
pub fn embedding_in(vocab: u64, hidden: u64, encoding: WeightEncoding, layout: Layout, seq: SeqMode) -> Kernel {
    assert!(layout.admits(encoding, &[vocab, hidden]), "embedding: {} [{vocab}, {hidden}] cannot be stored in layout {}", encoding.name(), layout.name());
    let mut b = KernelBuilder::new();
    let table = match layout {
        Layout::Interleaved16 => declare_interleaved(&mut b, "table", encoding, vocab, hidden),
        Layout::RowMajor | Layout::Panel16 => declare(&mut b, "table", encoding, hidden),
    };
    let ids = b.param("ids", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, row, col) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let h = hidden as i64;
    let value = match layout {
        Layout::RowMajor | Layout::Interleaved16 => table.value(v(row), v(col)),
        Layout::Panel16 => {
            let lanes = PANEL as i64;
            let at = add(mul(add(mul(div(v(row), i(lanes)), i(h)), v(col)), i(lanes)), rem(v(row), i(lanes)));
            match encoding {
                WeightEncoding::Float8E4M3 => mul(e4m3_to_f32(ld(table.part("quants"), at)), ld(table.part("scales"), v(row))),
                _ => ld(table.part("values"), at),
            }
        }
    };
    let body = vec![
        set(row, min(max(ld(ids, v(t)), i(0)), i(vocab as i64 - 1))),
        for_vec(col, i(0), i(h), vec![store(out, add(mul(v(t), i(h)), v(col)), value)]),
    ];
    let tag = match layout {
        Layout::RowMajor => "",
        Layout::Interleaved16 => "_x16",
        Layout::Panel16 => "_p16",
    };
    let enc = format!("{}{tag}", encoding.name());
    b.finish(format!("embedding_{enc}_v{vocab}_h{hidden}_{}", seq.tag()), "embedding", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// One device's part of a vocabulary-sharded embedding: `table` holds rows
/// `start .. start + rows` of the whole table; ids in that range gather their row,
/// all others give zeros (the devices' results sum to the full embedding).
pub fn embedding_range(rows: u64, start: u64, hidden: u64, encoding: WeightEncoding, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let table = declare(&mut b, "table", encoding, hidden);
    let ids = b.param("ids", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, local, row, col) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let h = hidden as i64;
    let masked = |x: Expr, value: Expr| select(lt(x.clone(), i(0)), f(0.0), select(lt(x, i(rows as i64)), value, f(0.0)));
    let body = vec![
        set(local, sub(ld(ids, v(t)), i(start as i64))),
        // Clamped so that the load stays in bounds; foreign rows select zeros.
        set(row, min(max(v(local), i(0)), i(rows as i64 - 1))),
        for_vec(col, i(0), i(h), vec![store(out, add(mul(v(t), i(h)), v(col)), masked(v(local), table.value(v(row), v(col))))]),
    ];
    let enc = encoding.name();
    b.finish(format!("embedding_{enc}_r{rows}_s{start}_h{hidden}_{}", seq.tag()), "embedding", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};

    #[test]
    fn gathers_rows() {
        let k = embedding(3, 2, WeightEncoding::Float32, SeqMode::Dynamic);
        let mut bufs = vec![
            Buffer::F32(vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]),
            Buffer::I32(vec![2, 0]),
            Buffer::F32(vec![0.0; 4]),
        ];
        run(&k, &mut bufs, 2);
        assert_eq!(bufs[2], Buffer::F32(vec![20.0, 21.0, 0.0, 1.0]));
    }

    /// A table in layout `interleaved16` gathers the same rows as the row-major one.
    #[test]
    fn interleaved_tables_gather_the_same_rows() {
        use crate::library::test_util::*;
        for encoding in [WeightEncoding::Q8_0, WeightEncoding::Q4_0, WeightEncoding::Q4_1, WeightEncoding::Q4K, WeightEncoding::Q5_0, WeightEncoding::Q5_1, WeightEncoding::Q6K, WeightEncoding::Q5K] {
            let (vocab, hidden) = (32usize, if encoding.block() == 256 { 512 } else { 64 });
            let parts = random_parts(encoding, vocab, hidden, 3);
            let packed = interleaved_parts(encoding, &parts, vocab, hidden);
            let ids = Buffer::I32(vec![0, 17, 31, 5, 16]);
            let gather = |interleaved: bool, table: &[Buffer]| {
                let mut bufs = table.to_vec();
                bufs.push(ids.clone());
                bufs.push(Buffer::F32(vec![f32::NAN; 5 * hidden]));
                run(&embedding_in(vocab as u64, hidden as u64, encoding, if interleaved { Layout::Interleaved16 } else { Layout::RowMajor }, SeqMode::Dynamic), &mut bufs, 5);
                bufs.pop().unwrap()
            };
            assert_eq!(gather(true, &packed), gather(false, &parts), "{}", encoding.name());
        }
    }

    /// A table in layout `panel16` (a tied lm_head packed for the panel
    /// matmul) gathers the same rows as the row-major one, in every encoding
    /// that layout admits; rows from several panels and lanes, the last included.
    #[test]
    fn panel_tables_gather_the_same_rows() {
        use crate::library::matmul_panel::pack_panels;
        let (vocab, hidden) = (48usize, 64usize);
        let ids = Buffer::I32(vec![0, 17, 47, 5, 16, 31]);
        let bits: Vec<u16> = (0..vocab * hidden).map(|i| (0x3c00 + (i * 7919 % 0x0800)) as u16 ^ if i % 3 == 0 { 0x8000 } else { 0 }).collect();
        let floats: Vec<f32> = (0..vocab * hidden).map(|i| (i as f32 * 0.37).sin()).collect();
        let codes: Vec<u8> = (0..vocab * hidden).map(|i| (i * 37 % 256) as u8).map(|c| if c & 0x7f == 0x7f { c ^ 1 } else { c }).collect();
        let scales: Vec<f32> = (0..vocab).map(|r| 0.01 + r as f32 / 64.0).collect();
        let bytes16: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let bytes32: Vec<u8> = floats.iter().flat_map(|b| b.to_le_bytes()).collect();
        let halves = |b: &[u8]| b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<u16>>();
        let tables = [
            (WeightEncoding::Float32, vec![Buffer::F32(floats.clone())], vec![Buffer::F32(pack_panels(&bytes32, vocab, hidden, 4).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())]),
            (WeightEncoding::BFloat16, vec![Buffer::BF16(bits.clone())], vec![Buffer::BF16(halves(&pack_panels(&bytes16, vocab, hidden, 2)))]),
            (WeightEncoding::Float16, vec![Buffer::F16(bits.clone())], vec![Buffer::F16(halves(&pack_panels(&bytes16, vocab, hidden, 2)))]),
            (WeightEncoding::Float8E4M3, vec![Buffer::U8(codes.clone()), Buffer::F32(scales.clone())], vec![Buffer::U8(pack_panels(&codes, vocab, hidden, 1)), Buffer::F32(scales.clone())]),
        ];
        for (encoding, row_major, packed) in tables {
            let gather = |layout: Layout, table: &[Buffer]| {
                let mut bufs = table.to_vec();
                bufs.push(ids.clone());
                bufs.push(Buffer::F32(vec![f32::NAN; 6 * hidden]));
                run(&embedding_in(vocab as u64, hidden as u64, encoding, layout, SeqMode::Dynamic), &mut bufs, 6);
                bufs.pop().unwrap()
            };
            let want = gather(Layout::RowMajor, &row_major);
            assert!(matches!(&want, Buffer::F32(v) if v.iter().all(|x| x.is_finite())), "{}", encoding.name());
            assert_eq!(gather(Layout::Panel16, &packed), want, "{}", encoding.name());
        }
    }

    #[test]
    fn a_vocabulary_range_gathers_its_rows_and_zeros_the_rest() {
        // Rows 2..4 of a 6-row table.
        let k = embedding_range(2, 2, 2, WeightEncoding::Float32, SeqMode::Dynamic);
        let mut bufs = vec![Buffer::F32(vec![20.0, 21.0, 30.0, 31.0]), Buffer::I32(vec![3, 0, 2, 5]), Buffer::F32(vec![9.0; 8])];
        run(&k, &mut bufs, 4);
        assert_eq!(bufs[2], Buffer::F32(vec![30.0, 31.0, 0.0, 0.0, 20.0, 21.0, 0.0, 0.0]));
    }
}
