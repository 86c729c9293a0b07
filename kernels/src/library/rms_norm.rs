//! RMSNorm: `out = x * rsqrt(mean(x^2) + eps) * w`, one row task per token.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `x: f32[seq, h]`, `w: f32[h]` -> `out: f32[seq, h]`.
pub fn rms_norm(hidden: u64, eps: f32, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, i_) = (b.var(ValType::I64), b.var(ValType::I64));
    let (ss, scale) = (b.var(ValType::F32), b.var(ValType::F32));
    let h = hidden as i64;
    let xi = || ld(x, add(mul(v(t), i(h)), v(i_)));
    let body = vec![
        set(ss, f(0.0)),
        for_vec(i_, i(0), i(h), vec![set(ss, add(v(ss), mul(xi(), xi())))]),
        set(scale, div(f(1.0), un(UnOp::Sqrt, add(div(v(ss), f(hidden as f32)), f(eps))))),
        for_vec(i_, i(0), i(h), vec![store(out, add(mul(v(t), i(h)), v(i_)), mul(mul(xi(), v(scale)), ld(w, v(i_))))]),
    ];
    let name = format!("rms_norm_h{hidden}_e{:08x}_{}", eps.to_bits(), seq.tag());
    b.finish(name, "rms_norm", TaskCount { per_seq: 1, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    #[test]
    fn normalizes_each_row() {
        let x = vec![3.0, 4.0, 0.0, 1.0, 1.0, 1.0];
        let w = vec![1.0, 2.0, 1.0];
        let mut bufs = vec![Buffer::F32(x), Buffer::F32(w), Buffer::F32(vec![0.0; 6])];
        run(&rms_norm(3, 0.0, SeqMode::Dynamic), &mut bufs, 2);
        let r = 1.0 / (25.0f32 / 3.0).sqrt();
        let Buffer::F32(got) = &bufs[2] else { unreachable!() };
        close(got, &[3.0 * r, 8.0 * r, 0.0, 1.0, 2.0, 1.0], 1e-6);
    }
}
