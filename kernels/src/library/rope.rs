//! Rotary position embedding (rotate-half layout), one row task per token.

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
}
