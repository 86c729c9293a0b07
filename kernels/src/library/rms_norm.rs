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

/// LayerNorm: `out = (x - mean) * rsqrt(var + eps) * w + b` over each row.
/// `x: f32[seq, width]`, `w, b: f32[width]` -> `out: f32[seq, width]`.
pub fn layer_norm(width: u64, eps: f32, seq: SeqMode) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let w = b.param("w", ElemType::F32, false);
    let bias = b.param("b", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, i_) = (b.var(ValType::I64), b.var(ValType::I64));
    let (sum, mean, var, scale) = (b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32), b.var(ValType::F32));
    let wd = width as i64;
    let xi = || ld(x, add(mul(v(t), i(wd)), v(i_)));
    let body = vec![
        set(sum, f(0.0)),
        for_vec(i_, i(0), i(wd), vec![set(sum, add(v(sum), xi()))]),
        set(mean, div(v(sum), f(width as f32))),
        set(var, f(0.0)),
        for_vec(i_, i(0), i(wd), vec![set(var, add(v(var), mul(sub(xi(), v(mean)), sub(xi(), v(mean)))))]),
        set(scale, div(f(1.0), un(UnOp::Sqrt, add(div(v(var), f(width as f32)), f(eps))))),
        for_vec(i_, i(0), i(wd), vec![store(out, add(mul(v(t), i(wd)), v(i_)), add(mul(mul(sub(xi(), v(mean)), v(scale)), ld(w, v(i_))), ld(bias, v(i_))))]),
    ];
    let name = format!("layer_norm_h{width}_e{:08x}_{}", eps.to_bits(), seq.tag());
    b.finish(name, "layer_norm", TaskCount { per_seq: 1, fixed: 0 }, t, body)
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
    fn layer_norm_centers_scales_and_shifts() {
        let mut bufs = vec![Buffer::F32(vec![1.0, 2.0, 3.0, 4.0]), Buffer::F32(vec![2.0; 4]), Buffer::F32(vec![0.5; 4]), Buffer::F32(vec![0.0; 4])];
        run(&layer_norm(4, 0.0, SeqMode::Fixed(1)), &mut bufs, 1);
        let sd = 1.25f32.sqrt();
        let want: Vec<f32> = [-1.5f32, -0.5, 0.5, 1.5].iter().map(|d| d / sd * 2.0 + 0.5).collect();
        let Buffer::F32(got) = &bufs[3] else { unreachable!() };
        close(got, &want, 1e-6);
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
