//! RMSNorm: `out = x * rsqrt(mean(x^2) + eps) * w` over groups of `group` elements
//! of each row (the whole row, or each head for per-head q/k norms), one row task per token.

use super::SeqMode;
use crate::ir::dsl::*;
use crate::ir::*;

/// `x: f32[seq, width]`, `w: f32[group]` -> `out: f32[seq, width]`.
pub fn rms_norm(width: u64, group: u64, eps: f32, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, gi, base, i_) = (b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64), b.var(ValType::I64));
    let (ss, scale) = (b.var(ValType::F32), b.var(ValType::F32));
    let (wd, g) = (width as i64, group as i64);
    let xi = || ld(x, add(v(base), v(i_)));
    let body = vec![for_(
        gi,
        i(0),
        i(wd / g),
        vec![
            set(base, add(mul(v(t), i(wd)), mul(v(gi), i(g)))),
            set(ss, f(0.0)),
            for_vec(i_, i(0), i(g), vec![set(ss, add(v(ss), mul(xi(), xi())))]),
            set(scale, div(f(1.0), un(UnOp::Sqrt, add(div(v(ss), f(group as f32)), f(eps))))),
            for_vec(i_, i(0), i(g), vec![store(out, add(v(base), v(i_)), mul(mul(xi(), v(scale)), ld(w, v(i_))))]),
        ],
    )];
    let grouping = if group == width { String::new() } else { format!("_g{group}") };
    let name = format!("rms_norm_h{width}{grouping}_e{:08x}_{}", eps.to_bits(), seq.tag());
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
        run(&rms_norm(3, 3, 0.0, SeqMode::Dynamic), &mut bufs, 2);
        let r = 1.0 / (25.0f32 / 3.0).sqrt();
        let Buffer::F32(got) = &bufs[2] else { unreachable!() };
        close(got, &[3.0 * r, 8.0 * r, 0.0, 1.0, 2.0, 1.0], 1e-6);
    }

    #[test]
    fn normalizes_each_group_separately() {
        // One row, two heads of 2: [3, 4] and [0, 2].
        let mut bufs = vec![Buffer::F32(vec![3.0, 4.0, 0.0, 2.0]), Buffer::F32(vec![1.0, 1.0]), Buffer::F32(vec![0.0; 4])];
        run(&rms_norm(4, 2, 0.0, SeqMode::Fixed(1)), &mut bufs, 1);
        let (r0, r1) = (1.0 / 12.5f32.sqrt(), 1.0 / 2.0f32.sqrt());
        let Buffer::F32(got) = &bufs[2] else { unreachable!() };
        close(got, &[3.0 * r0, 4.0 * r0, 0.0, 2.0 * r1], 1e-6);
    }
}
