//! Elementwise kernels: unary functions and binary ops with broadcasting, swiglu;
//! one task per row, and GPU forms (`*_gpu`) with one task per chunk of a row
//! ([`RowChunks`]).

use super::{RowChunks, SeqMode};
use crate::ir::dsl::*;
use crate::ir::*;

/// Unary functions; the graph IR's `UnaryOp` is this type.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Neg,
    Exp,
    Silu,
    GeluTanh,
    /// GELU with the error function.
    Gelu,
    Rsqrt,
    Tanh,
}

/// Binary ops; the graph IR's `BinaryOp` is this type (the second operand
/// broadcasts over leading dims, as [`Broadcast`] says).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Max,
}

/// How the second operand of a binary op is indexed.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Broadcast {
    /// Same `[seq, width]` shape as the first operand.
    None,
    /// One row `[width]` shared by every token (biases).
    Row,
    /// One scalar.
    Scalar,
}

fn apply_unary(op: Unary, x: Expr) -> Expr {
    match op {
        Unary::Neg => un(UnOp::Neg, x),
        Unary::Exp => fast_exp(x),
        Unary::Silu => div(x.clone(), add(f(1.0), fast_exp(un(UnOp::Neg, x)))),
        Unary::GeluTanh => {
            let inner = mul(f((2.0 / std::f32::consts::PI).sqrt()), add(x.clone(), mul(f(0.044715), mul(x.clone(), mul(x.clone(), x.clone())))));
            mul(mul(f(0.5), x), add(f(1.0), un(UnOp::Tanh, inner)))
        }
        Unary::Gelu => mul(mul(f(0.5), x.clone()), add(f(1.0), erf(mul(x, f(std::f32::consts::FRAC_1_SQRT_2))))),
        Unary::Rsqrt => div(f(1.0), un(UnOp::Sqrt, x)),
        Unary::Tanh => un(UnOp::Tanh, x),
    }
}

/// `erf(x)` by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), odd-extended.
fn erf(x: Expr) -> Expr {
    let ax = max(x.clone(), un(UnOp::Neg, x.clone()));
    let t = div(f(1.0), add(f(1.0), mul(f(0.327_591_1), ax.clone())));
    let mut poly = f(1.061_405_4);
    for c in [-1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6] {
        poly = add(mul(poly, t.clone()), f(c));
    }
    poly = mul(poly, t);
    let e = sub(f(1.0), mul(poly, fast_exp(un(UnOp::Neg, mul(ax.clone(), ax)))));
    select(lt(x, f(0.0)), un(UnOp::Neg, e.clone()), e)
}

/// `out = op(x)` over `f32[seq, width]`.
pub fn unary(op: Unary, width: u64, seq: SeqMode) -> Kernel {
    unary_in(op, width, seq, false)
}

/// The GPU form of [`unary`]: a task per chunk of a row.
pub fn unary_gpu(op: Unary, width: u64, seq: SeqMode) -> Kernel {
    unary_in(op, width, seq, true)
}

fn unary_in(op: Unary, width: u64, seq: SeqMode, gpu: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let rc = RowChunks::new(&mut b, t, width, gpu);
    let idx = || rc.at(width, c);
    let mut body = rc.prelude.clone();
    body.push(for_vec(c, i(0), i(rc.chunk as i64), vec![store(out, idx(), apply_unary(op, ld(x, idx())))]));
    let name = format!("{}_w{width}_{}", format!("{op:?}").to_lowercase(), seq.tag());
    b.finish(name, "elementwise", TaskCount { per_seq: rc.per_row, fixed: 0 }, t, body)
}

/// `out = a op b` over `f32[seq, width]`, `b` broadcast as given.
pub fn binary(op: Binary, width: u64, broadcast: Broadcast, seq: SeqMode) -> Kernel {
    binary_in(op, width, broadcast, seq, false)
}

/// The GPU form of [`binary`]: a task per chunk of a row.
pub fn binary_gpu(op: Binary, width: u64, broadcast: Broadcast, seq: SeqMode) -> Kernel {
    binary_in(op, width, broadcast, seq, true)
}

fn binary_in(op: Binary, width: u64, broadcast: Broadcast, seq: SeqMode, gpu: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    let a = b.param("a", ElemType::F32, false);
    let bb = b.param("b", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let rc = RowChunks::new(&mut b, t, width, gpu);
    let idx = || rc.at(width, c);
    let b_idx = match broadcast {
        Broadcast::None => idx(),
        Broadcast::Row => rc.column(c),
        Broadcast::Scalar => i(0),
    };
    let value = match op {
        Binary::Add => add(ld(a, idx()), ld(bb, b_idx)),
        Binary::Sub => sub(ld(a, idx()), ld(bb, b_idx)),
        Binary::Mul => mul(ld(a, idx()), ld(bb, b_idx)),
        Binary::Div => div(ld(a, idx()), ld(bb, b_idx)),
        Binary::Max => max(ld(a, idx()), ld(bb, b_idx)),
    };
    let mut body = rc.prelude.clone();
    body.push(for_vec(c, i(0), i(rc.chunk as i64), vec![store(out, idx(), value)]));
    let name = format!("{}_{}_w{width}_{}", format!("{op:?}").to_lowercase(), format!("{broadcast:?}").to_lowercase(), seq.tag());
    b.finish(name, "elementwise", TaskCount { per_seq: rc.per_row, fixed: 0 }, t, body)
}

/// SwiGLU: `out[r, c] = silu(x[r, c]) * x[r, h + c]` for `x: f32[seq, 2h]`.
pub fn swiglu(h: u64, seq: SeqMode) -> Kernel {
    swiglu_in(h, seq, false)
}

/// The GPU form of [`swiglu`]: a task per chunk of a row.
pub fn swiglu_gpu(h: u64, seq: SeqMode) -> Kernel {
    swiglu_in(h, seq, true)
}

fn swiglu_in(h: u64, seq: SeqMode, gpu: bool) -> Kernel {
    let mut b = KernelBuilder::new();
    let x = b.param("x", ElemType::F32, false);
    let out = b.param("out", ElemType::F32, true);
    let (t, c) = (b.var(ValType::I64), b.var(ValType::I64));
    let rc = RowChunks::new(&mut b, t, h, gpu);
    // The gate is column `col + c` of a row of 2h, the up projection h further.
    let gate = ld(x, rc.at(2 * h, c));
    let up = ld(x, add(add(rc.row_start(2 * h), i(h as i64)), v(c)));
    let mut body = rc.prelude.clone();
    body.push(for_vec(c, i(0), i(rc.chunk as i64), vec![store(out, rc.at(h, c), mul(apply_unary(Unary::Silu, gate), up))]));
    b.finish(format!("swiglu_h{h}_{}", seq.tag()), "elementwise", TaskCount { per_seq: rc.per_row, fixed: 0 }, t, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Buffer};
    use crate::library::test_util::*;

    /// Runs `k` serially and as the GPU deals its loops to lanes; both must give
    /// `want` within `tol`.
    fn both_ways(k: &Kernel, inputs: Vec<Buffer>, out_len: usize, seq: u64, want: &[f32], tol: f32) {
        for warp in [false, true] {
            let mut bufs = inputs.clone();
            bufs.push(Buffer::F32(vec![f32::NAN; out_len]));
            run_as(k, &mut bufs, seq, warp);
            let Buffer::F32(got) = bufs.last().unwrap() else { unreachable!() };
            close(got, want, tol);
        }
    }

    #[test]
    fn gpu_forms_map_wide_rows_in_chunks() {
        // 1536 = 6 chunks of 256 (SmolLM2's MLP), 576 = 9 of 64 (its width), 1000 unsplit.
        let seq = 3u64;
        for (width, per_row) in [(1536u64, 6u64), (576, 9), (1000, 1)] {
            let n = (width * seq) as usize;
            let (a, bias) = (rand(n, 1), rand(width as usize, 2));
            assert_eq!(binary(Binary::Add, width, Broadcast::Row, SeqMode::Dynamic).tasks.eval(seq), seq, "CPU forms: a task per row");
            let k = binary_gpu(Binary::Add, width, Broadcast::Row, SeqMode::Dynamic);
            assert_eq!(k.tasks.eval(seq), seq * per_row, "width {width}");
            let want: Vec<f32> = a.iter().enumerate().map(|(j, x)| x + bias[j % width as usize]).collect();
            both_ways(&k, vec![Buffer::F32(a.clone()), Buffer::F32(bias.clone())], n, seq, &want, 1e-6);
            let want: Vec<f32> = a.iter().map(|x| -x).collect();
            both_ways(&unary_gpu(Unary::Neg, width, SeqMode::Dynamic), vec![Buffer::F32(a.clone())], n, seq, &want, 1e-6);
            // swiglu over rows of 2 * width: gate then up.
            let x = rand(2 * n, 3);
            let want: Vec<f32> = (0..n)
                .map(|j| {
                    let (r, c) = (j / width as usize, j % width as usize);
                    let (g, u) = (x[r * 2 * width as usize + c], x[r * 2 * width as usize + width as usize + c]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let k = swiglu_gpu(width, SeqMode::Dynamic);
            assert_eq!(k.tasks.eval(seq), seq * per_row);
            both_ways(&k, vec![Buffer::F32(x.clone())], n, seq, &want, 1e-4);
        }
    }

    #[test]
    fn silu_and_gelu_match_their_definitions() {
        let x = rand(8, 9);
        for (op, func) in [
            (Unary::Silu, (|x: f32| x / (1.0 + (-x).exp())) as fn(f32) -> f32),
            (Unary::GeluTanh, |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh())),
        ] {
            let mut bufs = vec![Buffer::F32(x.clone()), Buffer::F32(vec![0.0; 8])];
            run(&unary(op, 4, SeqMode::Dynamic), &mut bufs, 2);
            let Buffer::F32(got) = &bufs[1] else { unreachable!() };
            close(got, &x.iter().map(|&v| func(v)).collect::<Vec<_>>(), 1e-6);
        }
    }

    #[test]
    fn erf_gelu_matches_the_definition() {
        // Reference values of GELU(x) = x/2 (1 + erf(x / sqrt 2)).
        let x = vec![-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0];
        let want = [-0.004049694, -0.15865526, -0.15426877, 0.0, 0.34573123, 0.8413447, 1.9544997, 3.9998734];
        let mut bufs = vec![Buffer::F32(x), Buffer::F32(vec![0.0; 8])];
        run(&unary(Unary::Gelu, 8, SeqMode::Fixed(1)), &mut bufs, 1);
        let Buffer::F32(got) = &bufs[1] else { unreachable!() };
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 2e-6, "{g} vs {w}");
        }
    }

    #[test]
    fn swiglu_multiplies_silu_of_gate_by_up() {
        let x = vec![1.0, -2.0, 3.0, 4.0];
        let mut bufs = vec![Buffer::F32(x), Buffer::F32(vec![0.0; 2])];
        run(&swiglu(2, SeqMode::Fixed(1)), &mut bufs, 1);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        let Buffer::F32(got) = &bufs[1] else { unreachable!() };
        close(got, &[silu(1.0) * 3.0, silu(-2.0) * 4.0], 1e-6);
    }

    #[test]
    fn binary_broadcasts_rows_and_scalars() {
        let a = vec![1.0, 2.0, 3.0, 4.0];
        for (bc, bv, want) in [
            (Broadcast::None, vec![1.0, 1.0, 2.0, 2.0], vec![2.0, 3.0, 5.0, 6.0]),
            (Broadcast::Row, vec![10.0, 20.0], vec![11.0, 22.0, 13.0, 24.0]),
            (Broadcast::Scalar, vec![0.5], vec![1.5, 2.5, 3.5, 4.5]),
        ] {
            let mut bufs = vec![Buffer::F32(a.clone()), Buffer::F32(bv), Buffer::F32(vec![0.0; 4])];
            run(&binary(Binary::Add, 2, bc, SeqMode::Dynamic), &mut bufs, 2);
            assert_eq!(bufs[2], Buffer::F32(want));
        }
    }
}
