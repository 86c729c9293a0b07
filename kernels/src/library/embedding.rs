//! Embedding gather: `out[r] = table[ids[r]]`, one row task per token, decoding
//! the table's encoding (float or block-quantized) on the fly.

use maxc_format::WeightEncoding;

use super::dequant::{declare, declare_interleaved};
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `table: [vocab, hidden]` (stored in `encoding`: one param per part),
/// `ids: i32[seq]` -> `out: f32[seq, hidden]`.
/// Ids are clamped into the vocabulary so that a bad id cannot read out of bounds
/// (the runtime rejects such ids before running).
pub fn embedding(vocab: u64, hidden: u64, encoding: WeightEncoding, seq: SeqMode) -> Kernel {
    embedding_in(vocab, hidden, encoding, false, seq)
}

/// [`embedding`] of a table stored in layout `interleaved16` when `interleaved`
/// (a tied lm_head packed for `matmul_interleaved`).
pub fn embedding_in(vocab: u64, hidden: u64, encoding: WeightEncoding, interleaved: bool, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let table = if interleaved { declare_interleaved(&mut b, "table", encoding, vocab, hidden) } else { declare(&mut b, "table", encoding, hidden) };
    let ids = b.param("ids", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, row, col) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let h = hidden as i64;
    let body = vec![
        set(row, min(max(ld(ids, v(t)), i(0)), i(vocab as i64 - 1))),
        for_vec(col, i(0), i(h), vec![store(out, add(mul(v(t), i(h)), v(col)), table.value(v(row), v(col)))]),
    ];
    let enc = format!("{}{}", encoding.name(), if interleaved { "_x16" } else { "" });
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
                run(&embedding_in(vocab as u64, hidden as u64, encoding, interleaved, SeqMode::Dynamic), &mut bufs, 5);
                bufs.pop().unwrap()
            };
            assert_eq!(gather(true, &packed), gather(false, &parts), "{}", encoding.name());
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
