//! Embedding gather: `out[r] = table[ids[r]]`, one row task per token, decoding
//! the table's encoding (float or block-quantized) on the fly.

use maxrun::format::WeightEncoding;

use super::dequant::declare;
use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `table: [vocab, hidden]` (stored in `encoding`: one param per part),
/// `ids: i32[seq]` -> `out: f32[seq, hidden]`.
/// Ids are clamped into the vocabulary so that a bad id cannot read out of bounds
/// (the runtime rejects such ids before running).
pub fn embedding(vocab: u64, hidden: u64, encoding: WeightEncoding, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let table = declare(&mut b, "table", encoding, hidden);
    let ids = b.param("ids", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, row, col) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let h = hidden as i64;
    let body = vec![
        set(row, min(max(ld(ids, v(t)), i(0)), i(vocab as i64 - 1))),
        for_vec(col, i(0), i(h), vec![store(out, add(mul(v(t), i(h)), v(col)), table.value(v(row), v(col)))]),
    ];
    let enc = encoding.name();
    b.finish(format!("embedding_{enc}_v{vocab}_h{hidden}_{}", seq.tag()), "embedding", TaskCount { per_seq: 1, fixed: 0 }, t, body)
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
}
