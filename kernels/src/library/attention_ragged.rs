//! Bidirectional attention over a batch step's own rows, for sentence encoders'
//! batch plans: no KV cache. A step holds many sequences, each a contiguous run
//! of its rows (`seqs[r]`: row `r`'s sequence; `starts[s] .. starts[s + 1]`:
//! sequence `s`'s rows, `starts: i32[sequences + 1]`), and every row attends to
//! the keys and values of its own sequence's rows, all of them (BERT attends
//! over the whole sentence), read straight from the step's `k` and `v`
//! activations (`[rows, kv_heads * head_dim]`).
//!
//! One task per (row, KV head) computes the `heads / kv_heads` query heads that
//! share the KV head. Keys are taken four at a time with an online softmax
//! (each block's scores, the running max raised to the block's, the output and
//! the running sum rescaled once per block), so no score row is kept: the
//! kernel needs no scratch memory, and a step's attention costs memory
//! linear in its rows whatever its sequences' lengths. The same kernel is the
//! GPU form: a task's loops over the head dimension are what a warp's lanes
//! share (`warp.rs`).

use crate::ir::dsl::*;
use crate::ir::*;

/// Keys per block of the online softmax: four dot products in flight per
/// query head, one rescale of the output row per four keys.
const BLOCK: usize = 4;

/// The shape attributes of one ragged attention layer.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct RaggedShape {
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub scale: f32,
    /// Scores become `tanh(score / c) * c` (attention logit soft-capping).
    pub softcap: Option<f32>,
}

/// `q: f32[rows, heads*hd]`, `k, v: f32[rows, kv_heads*hd]`, `seqs: i32[rows]`,
/// `starts: i32[sequences + 1]` -> `out: f32[rows, heads*hd]`: for every row
/// and query head, softmax attention over the rows of the row's sequence.
pub fn attention_ragged(shape: RaggedShape) -> Kernel {
    assert!(shape.kv_heads > 0 && shape.heads.is_multiple_of(shape.kv_heads), "{} query heads over {} KV heads", shape.heads, shape.kv_heads);
    let mut b = KernelBuilder::new();
    let q = b.param("q", ElemType::F32, false);
    let k = b.param("k", ElemType::F32, false);
    let vv = b.param("v", ElemType::F32, false);
    let seqs = b.param("seqs", ElemType::I32, false);
    let starts = b.param("starts", ElemType::I32, false);
    let out = b.param("out", ElemType::F32, true);
    let ivar = |b: &mut KernelBuilder| b.var(ValType::I64);
    let fvar = |b: &mut KernelBuilder| b.var(ValType::F32);
    let t = ivar(&mut b);
    let (row, g, sq, first, end, blocks, jj, j, d) = (ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b));
    let (nh, nkv, hd) = (shape.heads as i64, shape.kv_heads as i64, shape.head_dim as i64);
    let group = (nh / nkv) as usize;
    let kvw = nkv * hd;
    // Per query head of the group: its q / output row offset, the running max,
    // the running sum of exponentials, and a block's rescale factor.
    let qo: Vec<VarId> = (0..group).map(|_| ivar(&mut b)).collect();
    let (m, l, corr): (Vec<VarId>, Vec<VarId>, Vec<VarId>) = ((0..group).map(|_| fvar(&mut b)).collect(), (0..group).map(|_| fvar(&mut b)).collect(), (0..group).map(|_| fvar(&mut b)).collect());
    // Per (query head, key of the block): the dot product, then the score,
    // then its exponential.
    let p: Vec<Vec<VarId>> = (0..group).map(|_| (0..BLOCK).map(|_| fvar(&mut b)).collect()).collect();
    // Per key of the block: where its row of this KV head starts in `k` and `v`.
    let rows: Vec<VarId> = (0..BLOCK).map(|_| ivar(&mut b)).collect();
    let top = fvar(&mut b);
    let o = |h: usize| add(v(qo[h]), v(d));

    // One block of keys at `keys` (1 or BLOCK positions).
    let block = |keys: &[Expr]| -> Vec<Stmt> {
        let n = keys.len();
        let mut s: Vec<Stmt> = keys.iter().zip(&rows).map(|(key, &r)| set(r, add(mul(key.clone(), i(kvw)), mul(v(g), i(hd))))).collect();
        s.extend(p.iter().flat_map(|ph| ph[..n].iter().map(|&x| set(x, f(0.0)))));
        let dots = (0..group).flat_map(|h| (0..n).map(move |u| (h, u))).map(|(h, u)| set(p[h][u], add(v(p[h][u]), mul(ld(q, o(h)), ld(k, add(v(rows[u]), v(d))))))).collect();
        s.push(for_vec(d, i(0), i(hd), dots));
        for h in 0..group {
            for u in 0..n {
                s.push(set(p[h][u], mul(v(p[h][u]), f(shape.scale))));
                if let Some(c) = shape.softcap {
                    s.push(set(p[h][u], mul(un(UnOp::Tanh, div(v(p[h][u]), f(c))), f(c))));
                }
            }
            let block_max = p[h][..n].iter().fold(v(m[h]), |acc, &x| max(acc, v(x)));
            s.push(set(top, block_max));
            s.push(set(corr[h], fast_exp(sub(v(m[h]), v(top)))));
            s.push(set(m[h], v(top)));
            for u in 0..n {
                s.push(set(p[h][u], fast_exp(sub(v(p[h][u]), v(m[h])))));
            }
            let sum = p[h][..n].iter().fold(mul(v(l[h]), v(corr[h])), |acc, &x| add(acc, v(x)));
            s.push(set(l[h], sum));
        }
        let lanes = (0..group)
            .map(|h| {
                let acc = (0..n).fold(mul(ld(out, o(h)), v(corr[h])), |acc, u| add(acc, mul(v(p[h][u]), ld(vv, add(v(rows[u]), v(d))))));
                store(out, o(h), acc)
            })
            .collect();
        s.push(for_vec(d, i(0), i(hd), lanes));
        s
    };

    let mut body = vec![
        set(row, div(v(t), i(nkv))),
        set(g, rem(v(t), i(nkv))),
        set(sq, ld(seqs, v(row))),
        set(first, ld(starts, v(sq))),
        set(end, ld(starts, add(v(sq), i(1)))),
    ];
    for h in 0..group {
        body.push(set(qo[h], mul(add(mul(v(row), i(nh)), add(mul(v(g), i(group as i64)), i(h as i64))), i(hd))));
        // Below any score: the first block's rescale of the (zero) output and
        // sum is exp(-87.3) times zero.
        body.push(set(m[h], f(-3.0e38)));
        body.push(set(l[h], f(0.0)));
    }
    body.push(for_vec(d, i(0), i(hd), (0..group).map(|h| store(out, o(h), f(0.0))).collect()));
    body.push(set(blocks, div(sub(v(end), v(first)), i(BLOCK as i64))));
    let keys: Vec<Expr> = (0..BLOCK).map(|u| add(add(v(first), mul(v(jj), i(BLOCK as i64))), i(u as i64))).collect();
    body.push(for_(jj, i(0), v(blocks), block(&keys)));
    body.push(for_(j, add(v(first), mul(v(blocks), i(BLOCK as i64))), v(end), block(&[v(j)])));
    for h in 0..group {
        body.push(set(l[h], div(f(1.0), v(l[h]))));
    }
    body.push(for_vec(d, i(0), i(hd), (0..group).map(|h| store(out, o(h), mul(ld(out, o(h)), v(l[h])))).collect()));
    let cap = shape.softcap.map_or(String::new(), |c| format!("_c{:08x}", c.to_bits()));
    let name = format!("attention_ragged_h{nh}_kv{nkv}_d{hd}_s{:08x}{cap}_sN", shape.scale.to_bits());
    b.finish(name, "attention", TaskCount { per_seq: shape.kv_heads, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// Softmax attention of one query over `keys` / `vals`, in f64.
    fn naive(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32, softcap: Option<f32>) -> Vec<f32> {
        let cap = |x: f64| softcap.map_or(x, |c| (x / c as f64).tanh() * c as f64);
        let s: Vec<f64> = keys.iter().map(|k| cap(q.iter().zip(*k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64)).collect();
        let mx = s.iter().copied().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..q.len()).map(|d| (e.iter().zip(vals).map(|(w, v)| w / z * v[d] as f64).sum::<f64>()) as f32).collect()
    }

    /// A step of sequences of `lens` rows: its `seqs` and `starts`.
    fn ragged(lens: &[usize]) -> (Vec<i32>, Vec<i32>) {
        let mut starts = vec![0i32];
        let mut seqs = Vec::new();
        for (s, &n) in lens.iter().enumerate() {
            starts.push(starts[s] + n as i32);
            seqs.extend(std::iter::repeat_n(s as i32, n));
        }
        (seqs, starts)
    }

    /// Runs the kernel over a step of `lens`; returns (q, k, v, out).
    fn step(shape: RaggedShape, lens: &[usize], seed: u64, lanes: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (qw, kvw) = ((shape.heads * shape.head_dim) as usize, (shape.kv_heads * shape.head_dim) as usize);
        let rows: usize = lens.iter().sum();
        let (q, k, v) = (rand(rows * qw, seed), rand(rows * kvw, seed + 1), rand(rows * kvw, seed + 2));
        let (seqs, starts) = ragged(lens);
        let mut bufs = vec![Buffer::F32(q.clone()), Buffer::F32(k.clone()), Buffer::F32(v.clone()), Buffer::I32(seqs), Buffer::I32(starts), Buffer::F32(vec![f32::NAN; rows * qw])];
        run_as(&attention_ragged(shape), &mut bufs, rows as u64, lanes);
        let Buffer::F32(out) = bufs.pop().unwrap() else { unreachable!() };
        (q, k, v, out)
    }

    /// Sequences of 1, 2, 17 and 40 rows (blocks of four keys and the rest,
    /// and none but the rest), with grouped query heads and with soft-capping:
    /// every row and head equals naive softmax attention over its own
    /// sequence's rows (all of them, before and after it), serially and as a
    /// warp's lanes run it.
    #[test]
    fn each_row_attends_to_every_row_of_its_own_sequence() {
        let lens = [1usize, 2, 17, 40];
        for shape in [
            RaggedShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, softcap: None },
            RaggedShape { heads: 4, kv_heads: 4, head_dim: 12, scale: 0.5, softcap: Some(2.5) },
        ] {
            let (qw, kvw, hd) = ((shape.heads * shape.head_dim) as usize, (shape.kv_heads * shape.head_dim) as usize, shape.head_dim as usize);
            let group = (shape.heads / shape.kv_heads) as usize;
            for lanes in [false, true] {
                let (q, k, v, out) = step(shape, &lens, 5, lanes);
                let (_, starts) = ragged(&lens);
                for (s, &n) in lens.iter().enumerate() {
                    let mine = starts[s] as usize..starts[s] as usize + n;
                    for r in mine.clone() {
                        for h in 0..shape.heads as usize {
                            let g = h / group;
                            let keys: Vec<&[f32]> = mine.clone().map(|j| &k[j * kvw + g * hd..j * kvw + (g + 1) * hd]).collect();
                            let vals: Vec<&[f32]> = mine.clone().map(|j| &v[j * kvw + g * hd..j * kvw + (g + 1) * hd]).collect();
                            let want = naive(&q[r * qw + h * hd..r * qw + (h + 1) * hd], &keys, &vals, shape.scale, shape.softcap);
                            close(&out[r * qw + h * hd..r * qw + (h + 1) * hd], &want, 2e-5);
                        }
                    }
                }
            }
        }
    }

    /// A sequence's rows come out with the same bits in a step of its own and
    /// beside others: nothing of another sequence reaches them.
    #[test]
    fn a_sequence_gets_the_same_bits_alone_and_in_a_step() {
        let shape = RaggedShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, softcap: None };
        let qw = (shape.heads * shape.head_dim) as usize;
        let kvw = (shape.kv_heads * shape.head_dim) as usize;
        let lens = [3usize, 9, 5];
        let (q, k, v, out) = step(shape, &lens, 11, false);
        let (_, starts) = ragged(&lens);
        for (s, &n) in lens.iter().enumerate() {
            let r0 = starts[s] as usize;
            let mut bufs = vec![
                Buffer::F32(q[r0 * qw..(r0 + n) * qw].to_vec()),
                Buffer::F32(k[r0 * kvw..(r0 + n) * kvw].to_vec()),
                Buffer::F32(v[r0 * kvw..(r0 + n) * kvw].to_vec()),
                Buffer::I32(vec![0; n]),
                Buffer::I32(vec![0, n as i32]),
                Buffer::F32(vec![0.0; n * qw]),
            ];
            run(&attention_ragged(shape), &mut bufs, n as u64);
            assert_eq!(bufs[5], Buffer::F32(out[r0 * qw..(r0 + n) * qw].to_vec()), "sequence {s}");
        }
    }
}
