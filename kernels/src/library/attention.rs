//! Attention over the KV cache: `kv_store` writes this step's keys and values at
//! their positions, then `attention` runs causal (optionally sliding-window)
//! attention with an online softmax, one task per (token, head), reading each
//! cached key and value once.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// Shape attributes of one attention layer.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AttentionShape {
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub scale: f32,
    pub window: Option<u64>,
}

impl AttentionShape {
    fn tag(&self) -> String {
        let w = self.window.map_or("full".to_string(), |w| format!("w{w}"));
        format!("h{}_kv{}_d{}_s{:08x}_{w}", self.heads, self.kv_heads, self.head_dim, self.scale.to_bits())
    }
}

/// `k, v: f32[seq, kv_heads*hd]`, `pos: i32[seq]` -> `k_cache[pos], v_cache[pos]`
/// (caches are `f32[max_len, kv_heads*hd]`; the runtime checks positions < max_len).
pub fn kv_store(kv_width: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let k = b.param("k", ElemType::F32, false);
    let v_ = b.param("v", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let kc = b.param("k_cache", ElemType::F32, true);
    let vc = b.param("v_cache", ElemType::F32, true);
    let (t, p, d) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let w = kv_width as i64;
    let body = vec![
        set(p, ld(pos, v(t))),
        for_vec(
            d,
            i(0),
            i(w),
            vec![
                store(kc, add(mul(v(p), i(w)), v(d)), ld(k, add(mul(v(t), i(w)), v(d)))),
                store(vc, add(mul(v(p), i(w)), v(d)), ld(v_, add(mul(v(t), i(w)), v(d)))),
            ],
        ),
    ];
    b.finish(format!("kv_store_w{kv_width}_{}", seq.tag()), "kv_store", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// `q: f32[seq, heads*hd]`, `pos: i32[seq]`, caches -> `out: f32[seq, heads*hd]`.
pub fn attention(shape: AttentionShape, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let q = b.param("q", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let kc = b.param("k_cache", ElemType::F32, false);
    let vc = b.param("v_cache", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let t = b.var(ValType::I64);
    let (s, h, kvh, p, start, j, d, qo, ko) = (
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
        b.var(ValType::I64),
    );
    let (m, l, score, m_new, corr, e) = (
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
    );
    let (nh, hd) = (shape.heads as i64, shape.head_dim as i64);
    let kvw = shape.kv_heads as i64 * hd;
    let group = nh / shape.kv_heads as i64;
    // A finite "minus infinity": kernels may be compiled with no-infs assumptions
    // off, but exp(m_old - m_new) must be exactly 0 on the first key either way.
    let neg_big = -3.0e38f32;
    let start_expr = match shape.window {
        None => i(0),
        Some(w) => max(sub(add(v(p), i(1)), i(w as i64)), i(0)),
    };
    let body = vec![
        set(s, div(v(t), i(nh))),
        set(h, rem(v(t), i(nh))),
        set(kvh, div(v(h), i(group))),
        set(p, ld(pos, v(s))),
        set(start, start_expr),
        set(qo, mul(add(mul(v(s), i(nh)), v(h)), i(hd))),
        set(m, f(neg_big)),
        set(l, f(0.0)),
        for_vec(d, i(0), i(hd), vec![store(out, add(v(qo), v(d)), f(0.0))]),
        for_(
            j,
            v(start),
            add(v(p), i(1)),
            vec![
                set(ko, add(mul(v(j), i(kvw)), mul(v(kvh), i(hd)))),
                set(score, f(0.0)),
                for_vec(d, i(0), i(hd), vec![set(score, add(v(score), mul(ld(q, add(v(qo), v(d))), ld(kc, add(v(ko), v(d))))))]),
                set(score, mul(v(score), f(shape.scale))),
                set(m_new, max(v(m), v(score))),
                set(corr, un(UnOp::Exp, sub(v(m), v(m_new)))),
                set(e, un(UnOp::Exp, sub(v(score), v(m_new)))),
                set(l, add(mul(v(l), v(corr)), v(e))),
                for_vec(
                    d,
                    i(0),
                    i(hd),
                    vec![store(
                        out,
                        add(v(qo), v(d)),
                        add(mul(ld(out, add(v(qo), v(d))), v(corr)), mul(v(e), ld(vc, add(v(ko), v(d))))),
                    )],
                ),
                set(m, v(m_new)),
            ],
        ),
        for_vec(d, i(0), i(hd), vec![store(out, add(v(qo), v(d)), div(ld(out, add(v(qo), v(d))), v(l)))]),
    ];
    let tasks = TaskCount { per_seq: shape.heads, fixed: 0 };
    b.finish(format!("attention_{}_{}", shape.tag(), seq.tag()), "attention", tasks, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// Naive softmax attention for one query row against keys 0..=p.
    fn naive(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32) -> Vec<f32> {
        let s: Vec<f32> = keys.iter().map(|k| q.iter().zip(*k).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
        let mx = s.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - mx).exp()).collect();
        let z: f32 = e.iter().sum();
        (0..q.len()).map(|d| e.iter().zip(vals).map(|(w, v)| w / z * v[d]).sum()).collect()
    }

    #[test]
    fn grouped_query_attention_with_window_matches_naive_softmax() {
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 4, scale: 0.5, window: Some(2) };
        let (seq, kvw, qw) = (3usize, 8usize, 16usize);
        let (q, k, v) = (rand(seq * qw, 3), rand(seq * kvw, 4), rand(seq * kvw, 5));
        let pos = vec![0, 1, 2];
        let mut store_bufs = vec![
            Buffer::F32(k.clone()),
            Buffer::F32(v.clone()),
            Buffer::I32(pos.clone()),
            Buffer::F32(vec![0.0; 8 * kvw]),
            Buffer::F32(vec![0.0; 8 * kvw]),
        ];
        run(&kv_store(kvw as u64, SeqMode::Dynamic), &mut store_bufs, seq as u64);
        let (kc, vc) = (store_bufs[3].clone(), store_bufs[4].clone());
        let mut bufs = vec![Buffer::F32(q.clone()), Buffer::I32(pos), kc, vc, Buffer::F32(vec![0.0; seq * qw])];
        run(&attention(shape, SeqMode::Dynamic), &mut bufs, seq as u64);
        let Buffer::F32(got) = &bufs[4] else { unreachable!() };
        for s in 0..seq {
            for h in 0..4 {
                let kvh = h / 2;
                let js: Vec<usize> = (s.saturating_sub(1)..=s).collect();
                let keys: Vec<&[f32]> = js.iter().map(|&j| &k[j * kvw + kvh * 4..j * kvw + kvh * 4 + 4]).collect();
                let vals: Vec<&[f32]> = js.iter().map(|&j| &v[j * kvw + kvh * 4..j * kvw + kvh * 4 + 4]).collect();
                let want = naive(&q[s * qw + h * 4..s * qw + h * 4 + 4], &keys, &vals, 0.5);
                close(&got[s * qw + h * 4..s * qw + h * 4 + 4], &want, 1e-5);
            }
        }
    }
}
