//! Attention over the KV cache. `kv_store` writes this step's keys and values at
//! their positions; `attention` then runs causal (optionally sliding-window)
//! attention for one (token, KV head) per task, covering the query heads that
//! share that KV head.
//!
//! Both caches are laid out `[kv_heads, max_len, head_dim]`: one KV head's keys
//! (and values) for every position are one contiguous run, so a task streams two
//! runs of `positions * head_dim` floats, and a decode step's store is one
//! contiguous head row per KV head in each cache (`2 * kv_heads * head_dim`
//! floats on adjacent cache lines). Scores are dot products over the head
//! dimension (a vector reduction per key position); the weighted sum of values is
//! vectorized over the head dimension. Scores live in a scratch row of `max_len`
//! floats per query head of the task.

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
    /// Positions in the cache (the artifact's maximum length).
    pub max_len: u64,
    /// Scores become `tanh(score / c) * c` (Gemma 2's attention logit soft-capping).
    pub softcap: Option<f32>,
    /// `false` for encoders: every token sees every token of the step.
    pub causal: bool,
}

impl AttentionShape {
    fn tag(&self) -> String {
        let w = self.window.map_or("full".to_string(), |w| format!("w{w}"));
        let cap = self.softcap.map_or(String::new(), |c| format!("_c{:08x}", c.to_bits()));
        let cap = if self.causal { cap } else { format!("{cap}_bidi") };
        format!("h{}_kv{}_d{}_s{:08x}_{w}_l{}{cap}", self.heads, self.kv_heads, self.head_dim, self.scale.to_bits(), self.max_len)
    }

    /// Scratch floats per task: a score row for each query head of the group.
    pub fn scratch_per_task(&self) -> u64 {
        self.heads / self.kv_heads * self.max_len
    }
}

/// Where element `d` of KV head `h` at position `p` lives in a cache laid out
/// `[kv_heads, max_len, head_dim]`.
fn cache_index(h: Expr, p: Expr, d: Expr, head_dim: i64, max_len: i64) -> Expr {
    add(mul(add(mul(h, i(max_len)), p), i(head_dim)), d)
}

/// `k, v: f32[seq, kv_heads*hd]`, `pos: i32[seq]` -> `k_cache`, `v_cache`, both
/// `[kv_heads, max_len, head_dim]` (the runtime checks positions < max_len). One
/// task per token: it writes one contiguous head row per KV head in each cache.
pub fn kv_store(kv_heads: u64, head_dim: u64, max_len: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let k = b.param("k", ElemType::F32, false);
    let v_ = b.param("v", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let kc = b.param("k_cache", ElemType::F32, true);
    let vc = b.param("v_cache", ElemType::F32, true);
    let (t, h, p, d) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (hd, len, w) = (head_dim as i64, max_len as i64, (kv_heads * head_dim) as i64);
    let at = cache_index(v(h), v(p), v(d), hd, len);
    let from = add(add(mul(v(t), i(w)), mul(v(h), i(hd))), v(d));
    let body = vec![
        set(p, ld(pos, v(t))),
        for_(h, i(0), i(kv_heads as i64), vec![for_vec(d, i(0), i(hd), vec![store(kc, at.clone(), ld(k, from.clone())), store(vc, at, ld(v_, from))])]),
    ];
    let name = format!("kv_store_kv{kv_heads}_d{head_dim}_l{max_len}_{}", seq.tag());
    b.finish(name, "kv_store", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// `q: f32[seq, heads*hd]`, `pos: i32[seq]`, caches,
/// `scratch: f32[seq*kv_heads, group*max_len]` -> `out: f32[seq, heads*hd]`.
///
/// One task is one (token, KV head) and computes all `group = heads / kv_heads`
/// query heads that share that KV head together, so each key and value row is
/// read once per task, not once per query head. Scores: one key row per step,
/// dotted with every query head of the group; output: four key positions per
/// sweep over the output rows (the remainders one at a time).
pub fn attention(shape: AttentionShape, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let q = b.param("q", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let kc = b.param("k_cache", ElemType::F32, false);
    let vc = b.param("v_cache", ElemType::F32, false);
    let sc = b.param("scratch", ElemType::F32, true);
    let out = b.param("out", ElemType::F32, true);
    let ivar = |b: &mut KernelBuilder| b.var(ValType::I64);
    let t = ivar(&mut b);
    let (s, g, p, start, end, j, d, jb, jj) =
        (ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b), ivar(&mut b));
    let (nh, nkv, hd, len) = (shape.heads as i64, shape.kv_heads as i64, shape.head_dim as i64, shape.max_len as i64);
    let group = (nh / nkv) as usize;
    let fvars = |b: &mut KernelBuilder, n: usize| -> Vec<VarId> { (0..n).map(|_| b.var(ValType::F32)).collect() };
    let ivars = |b: &mut KernelBuilder, n: usize| -> Vec<VarId> { (0..n).map(|_| b.var(ValType::I64)).collect() };
    // Per query head of the group: its q row offset, score row offset, max, sum
    // and running dot product.
    let (qo, so) = (ivars(&mut b, group), ivars(&mut b, group));
    let (m, l, dot) = (fvars(&mut b, group), fvars(&mut b, group), fvars(&mut b, group));
    // Per (head, unrolled step): a probability; per step: a row offset.
    let coef: Vec<Vec<VarId>> = (0..group).map(|_| fvars(&mut b, 4)).collect();
    let rows = ivars(&mut b, 4);
    let pj = b.var(ValType::F32);
    let start_expr = match shape.window {
        None => i(0),
        Some(w) => max(sub(add(v(p), i(1)), i(w as i64)), i(0)),
    };
    let score = |h: usize, j: Expr| add(j, v(so[h]));
    let o = |h: usize, d: Expr| add(d, v(qo[h]));
    // The start of KV head g's row at position j in either cache.
    let row = |j: Expr| cache_index(v(g), j, i(0), hd, len);

    let mut body = vec![
        set(s, div(v(t), i(nkv))),
        set(g, rem(v(t), i(nkv))),
        set(p, ld(pos, v(s))),
        set(start, start_expr),
        // Causal: keys up to this token; bidirectional: up to the step's last token.
        set(end, if shape.causal { add(v(p), i(1)) } else { add(ld(pos, sub(seq.expr(), i(1))), i(1)) }),
    ];
    for h in 0..group {
        let head = add(mul(v(g), i(group as i64)), i(h as i64));
        body.push(set(qo[h], mul(add(mul(v(s), i(nh)), head), i(hd))));
        body.push(set(so[h], mul(add(mul(v(t), i(group as i64)), i(h as i64)), i(len))));
    }

    // Scores: s_h[j] = scale * sum_d q_h[d] K[g, j, d], every head of the group
    // against one key row.
    let mut per_key = vec![set(rows[0], row(v(j)))];
    // Decode: while key row j is scored, its value row is fetched for the output
    // sweep (one prefetch per cache line), so the value run streams beside the
    // key run instead of after it.
    if seq.is_decode() {
        per_key.extend((0..(hd * 4 + 63) / 64).map(|c| prefetch(vc, add(v(rows[0]), i(c * 16)))));
    }
    per_key.extend((0..group).map(|h| set(dot[h], f(0.0))));
    let lanes = (0..group).map(|h| set(dot[h], add(v(dot[h]), mul(ld(q, o(h, v(d))), ld(kc, add(v(rows[0]), v(d))))))).collect();
    per_key.push(for_vec(d, i(0), i(hd), lanes));
    per_key.extend((0..group).map(|h| store(sc, score(h, v(j)), mul(v(dot[h]), f(shape.scale)))));
    body.push(for_(j, v(start), v(end), per_key));

    for h in 0..group {
        // Soft-capping (Gemma 2): s = tanh(s / c) * c.
        if let Some(c) = shape.softcap {
            body.push(for_vec(j, v(start), v(end), vec![store(sc, score(h, v(j)), mul(un(UnOp::Tanh, div(ld(sc, score(h, v(j))), f(c))), f(c)))]));
        }
        // Softmax over the row.
        body.push(set(m[h], f(-3.0e38)));
        body.push(for_vec(j, v(start), v(end), vec![set(m[h], max(v(m[h]), ld(sc, score(h, v(j)))))]));
        body.push(set(l[h], f(0.0)));
        body.push(for_vec(
            j,
            v(start),
            v(end),
            vec![set(pj, fast_exp(sub(ld(sc, score(h, v(j))), v(m[h])))), store(sc, score(h, v(j)), v(pj)), set(l[h], add(v(l[h]), v(pj)))],
        ));
        body.push(for_vec(d, i(0), i(hd), vec![store(out, o(h, v(d)), f(0.0))]));
    }

    // out_h = sum_j p_h[j] V[g, j] / l_h, four key positions per sweep.
    let out_sweep = |positions: &[Expr], coef: &[Vec<VarId>], rows: &[VarId]| -> Vec<Stmt> {
        let mut sweep = Vec::new();
        for (u, j_u) in positions.iter().enumerate() {
            for h in 0..group {
                sweep.push(set(coef[h][u], ld(sc, score(h, j_u.clone()))));
            }
            sweep.push(set(rows[u], row(j_u.clone())));
        }
        let mut lanes = Vec::new();
        for h in 0..group {
            let mut sum = ld(out, o(h, v(d)));
            for u in 0..positions.len() {
                sum = add(sum, mul(v(coef[h][u]), ld(vc, add(v(d), v(rows[u])))));
            }
            lanes.push(store(out, o(h, v(d)), sum));
        }
        sweep.push(for_vec(d, i(0), i(hd), lanes));
        sweep
    };
    body.push(set(jb, div(sub(v(end), v(start)), i(4))));
    let four: Vec<Expr> = (0..4).map(|u| add(add(v(start), mul(v(jj), i(4))), i(u))).collect();
    body.push(for_(jj, i(0), v(jb), out_sweep(&four, &coef, &rows)));
    body.push(for_(j, add(v(start), mul(v(jb), i(4))), v(end), out_sweep(&[v(j)], &coef, &rows)));
    for h in 0..group {
        body.push(set(l[h], div(f(1.0), v(l[h]))));
        body.push(for_vec(d, i(0), i(hd), vec![store(out, o(h, v(d)), mul(ld(out, o(h, v(d))), v(l[h])))]));
    }
    let tasks = TaskCount { per_seq: shape.kv_heads, fixed: 0 };
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

    /// Stores `seq` tokens at positions 0.. with `kv_store` (prefill or decode, token
    /// by token) and runs attention over them: the output of every query head
    /// equals naive softmax attention over its window.
    fn check_attention(shape: AttentionShape, seq: usize, decode: bool) {
        let (kvw, qw) = ((shape.kv_heads * shape.head_dim) as usize, (shape.heads * shape.head_dim) as usize);
        let (hd, group, len) = (shape.head_dim as usize, (shape.heads / shape.kv_heads) as usize, shape.max_len as usize);
        let (q, k, v) = (rand(seq * qw, 3), rand(seq * kvw, 4), rand(seq * kvw, 5));
        let (mut kc, mut vc) = (Buffer::F32(vec![0.0; len * kvw]), Buffer::F32(vec![0.0; len * kvw]));
        let steps: Vec<(usize, usize)> = if decode { (0..seq).map(|s| (s, s + 1)).collect() } else { vec![(0, seq)] };
        let mode = if decode { SeqMode::Fixed(1) } else { SeqMode::Dynamic };
        for &(a, b) in &steps {
            let pos: Vec<i32> = (a as i32..b as i32).collect();
            let mut bufs = vec![Buffer::F32(k[a * kvw..b * kvw].to_vec()), Buffer::F32(v[a * kvw..b * kvw].to_vec()), Buffer::I32(pos), kc, vc];
            run(&kv_store(shape.kv_heads, shape.head_dim, len as u64, mode), &mut bufs, (b - a) as u64);
            vc = bufs.pop().unwrap();
            kc = bufs.pop().unwrap();
        }
        // Both caches are [kv_heads, max_len, head_dim]: head h's row at position p
        // holds that token's elements h * hd .. (h + 1) * hd.
        let (Buffer::F32(keys), Buffer::F32(values)) = (&kc, &vc) else { unreachable!() };
        for h in 0..shape.kv_heads as usize {
            for p in 0..len {
                for d in 0..hd {
                    let at = (h * len + p) * hd + d;
                    let want = |x: &[f32]| if p < seq { x[p * kvw + h * hd + d] } else { 0.0 };
                    assert_eq!((keys[at], values[at]), (want(&k), want(&v)), "head {h} position {p} element {d}");
                }
            }
        }
        let pos: Vec<i32> = (0..seq as i32).collect();
        let scratch = Buffer::F32(vec![f32::NAN; seq * shape.kv_heads as usize * shape.scratch_per_task() as usize]);
        let mut bufs = vec![Buffer::F32(q.clone()), Buffer::I32(pos), kc, vc, scratch, Buffer::F32(vec![0.0; seq * qw])];
        run(&attention(shape, SeqMode::Dynamic), &mut bufs, seq as u64);
        let Buffer::F32(got) = &bufs[5] else { unreachable!() };
        for s in 0..seq {
            for h in 0..shape.heads as usize {
                let kvh = h / group;
                let from = shape.window.map_or(0, |w| (s + 1).saturating_sub(w as usize));
                let keys: Vec<&[f32]> = (from..=s).map(|j| &k[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                let vals: Vec<&[f32]> = (from..=s).map(|j| &v[j * kvw + kvh * hd..j * kvw + kvh * hd + hd]).collect();
                let want = naive(&q[s * qw + h * hd..s * qw + h * hd + hd], &keys, &vals, shape.scale);
                close(&got[s * qw + h * hd..s * qw + h * hd + hd], &want, 1e-5);
            }
        }
    }

    #[test]
    fn grouped_query_attention_with_window_matches_naive_softmax() {
        let shape = AttentionShape { heads: 4, kv_heads: 2, head_dim: 4, scale: 0.5, window: Some(2), max_len: 8, softcap: None, causal: true };
        check_attention(shape, 3, false);
    }

    /// Longer caches with windows that start past position 0, a cache that the
    /// sequence fills (max_len 16), and a cache longer than the sequence; prefill
    /// and token-by-token decode stores.
    #[test]
    fn attention_over_longer_caches_prefill_and_decode() {
        for (max_len, seq, window) in [(37, 37, None), (37, 30, Some(20)), (48, 40, Some(17)), (16, 16, None)] {
            let shape = AttentionShape { heads: 6, kv_heads: 2, head_dim: 8, scale: 0.3, window, max_len, softcap: None, causal: true };
            for decode in [false, true] {
                check_attention(shape, seq, decode);
            }
        }
    }
}
