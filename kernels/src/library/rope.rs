//! Rotary position embedding (rotate-half layout): one task per token, and a GPU
//! form with one task per (token, pair) whose lanes take the heads.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `x: f32[seq, heads*hd]`, `pos: i32[seq]`, `inv_freq: f32[hd/2]` -> `out`.
///
/// For pair `i` of each head: `(x0, x1) = (x[i], x[i + hd/2])`, `a = pos * inv_freq[i]`,
/// `out[i] = x0 cos a - x1 sin a`, `out[i + hd/2] = x1 cos a + x0 sin a`.
pub fn rope(width: u64, head_dim: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let inv_freq = b.param("inv_freq", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, h, p_i) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (p, a, c, s, x0, x1) = (
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
        b.var(ValType::F32),
    );
    let (w, hd, half) = (width as i64, head_dim as i64, head_dim as i64 / 2);
    let lo = || add(add(mul(v(t), i(w)), mul(v(h), i(hd))), v(p_i));
    let hi = || add(lo(), i(half));
    let body = vec![
        set(p, un(UnOp::ToF32, ld(pos, v(t)))),
        for_(
            p_i,
            i(0),
            i(half),
            vec![
                set(a, mul(v(p), ld(inv_freq, v(p_i)))),
                set(c, un(UnOp::Cos, v(a))),
                set(s, un(UnOp::Sin, v(a))),
                for_(
                    h,
                    i(0),
                    i(w / hd),
                    vec![
                        set(x0, ld(x, lo())),
                        set(x1, ld(x, hi())),
                        store(out, lo(), sub(mul(v(x0), v(c)), mul(v(x1), v(s)))),
                        store(out, hi(), add(mul(v(x1), v(c)), mul(v(x0), v(s)))),
                    ],
                ),
            ],
        ),
    ];
    b.finish(format!("rope_w{width}_hd{head_dim}_{}", seq.tag()), "rope", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

/// The GPU form of [`rope`]: task `t` is pair `t % (hd/2)` of token
/// `t / (hd/2)`; it computes the pair's angle and its lanes rotate the pair in
/// the heads. (The CPU form's one task per token, a loop with no lanes, ran a
/// decode step's RoPE on one GPU thread: 69 us for 32 heads on an H100,
/// docs/gpu.md. On a CPU it computes each angle once per token, as here.)
pub fn rope_gpu(width: u64, head_dim: u64, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let pos = b.param("pos", ElemType::I32, false);
    let inv_freq = b.param("inv_freq", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, token, h, p_i) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (a, c, s) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    let (w, hd, half) = (width as i64, head_dim as i64, head_dim as i64 / 2);
    let lo = || add(add(mul(v(token), i(w)), mul(v(h), i(hd))), v(p_i));
    let hi = || add(lo(), i(half));
    let body = vec![
        set(token, div(v(t), i(half))),
        set(p_i, rem(v(t), i(half))),
        set(a, mul(un(UnOp::ToF32, ld(pos, v(token))), ld(inv_freq, v(p_i)))),
        set(c, un(UnOp::Cos, v(a))),
        set(s, un(UnOp::Sin, v(a))),
        // Only stores to the output: the loop is dealt to lanes (no temporaries,
        // which would keep every lane on every head).
        for_vec(
            h,
            i(0),
            i(w / hd),
            vec![
                store(out, lo(), sub(mul(ld(x, lo()), v(c)), mul(ld(x, hi()), v(s)))),
                store(out, hi(), add(mul(ld(x, hi()), v(c)), mul(ld(x, lo()), v(s)))),
            ],
        ),
    ];
    b.finish(format!("rope_w{width}_hd{head_dim}_{}", seq.tag()), "rope", TaskCount { per_seq: half as u64, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    #[test]
    fn rotates_pairs_by_position_times_frequency() {
        // One head of dim 4; position 2; frequencies 1 and 0.5.
        let x = vec![1.0, 0.0, 0.0, 1.0];
        let mut bufs = vec![Buffer::F32(x), Buffer::I32(vec![2]), Buffer::F32(vec![1.0, 0.5]), Buffer::F32(vec![0.0; 4])];
        run(&rope(4, 4, SeqMode::Fixed(1)), &mut bufs, 1);
        let (a0, a1) = (2.0f32, 1.0f32);
        let want = [a0.cos(), -a1.sin(), a0.sin(), a1.cos()];
        let Buffer::F32(got) = &bufs[3] else { unreachable!() };
        close(got, &want, 1e-6);
    }

    #[test]
    fn every_head_of_every_token_is_rotated() {
        // Three tokens of four heads of dim 8, by the CPU form, the GPU form (a task
        // per (token, pair)) and the GPU form as its lanes run it.
        let (heads, hd, seq) = (4usize, 8usize, 3usize);
        let w = heads * hd;
        let x = rand(seq * w, 7);
        let pos = vec![0, 5, 1000];
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
        let mut want = vec![0.0f32; seq * w];
        for t in 0..seq {
            for h in 0..heads {
                for p in 0..hd / 2 {
                    let a = pos[t] as f32 * inv_freq[p];
                    let (lo, hi) = (t * w + h * hd + p, t * w + h * hd + p + hd / 2);
                    want[lo] = x[lo] * a.cos() - x[hi] * a.sin();
                    want[hi] = x[hi] * a.cos() + x[lo] * a.sin();
                }
            }
        }
        let cpu = rope(w as u64, hd as u64, SeqMode::Dynamic);
        let gpu = rope_gpu(w as u64, hd as u64, SeqMode::Dynamic);
        assert_eq!(cpu.tasks.eval(seq as u64), seq as u64);
        assert_eq!(gpu.tasks.eval(seq as u64), (seq * hd / 2) as u64);
        assert_eq!(crate::warp::threads_per_task(&gpu), 32, "the heads are dealt to a warp's lanes");
        for (k, warp) in [(&cpu, false), (&gpu, false), (&gpu, true)] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::I32(pos.clone()), Buffer::F32(inv_freq.clone()), Buffer::F32(vec![f32::NAN; seq * w])];
            run_as(k, &mut bufs, seq as u64, warp);
            let Buffer::F32(got) = &bufs[3] else { unreachable!() };
            close(got, &want, 1e-3);
        }
    }
}
