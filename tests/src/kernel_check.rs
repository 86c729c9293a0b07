//! Running one kernel on every backend against the kernel-IR interpreter: the
//! random inputs a kernel takes (by element type, keeping the dot contracts),
//! and the element-by-element comparison with a tolerance. Used by the
//! differential tests (tests/kernels_llvm.rs) and the kernel filetests
//! (tests/kernel_filetests.rs).

use maxc_kernels::interp::{run, run_warp, Buffer};
use maxc_kernels::library::quantize_activations::ActivationLevels;
use maxc_kernels::{ElemType, Kernel};

/// A xorshift generator of floats in [-1, 1).
pub struct Rng(pub u64);
impl Rng {
    pub fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A kernel with buffer sizes (elements) and the range of its integer inputs.
pub struct Case {
    pub kernel: Kernel,
    /// Element counts, one per parameter.
    pub sizes: Vec<usize>,
    /// Integer inputs are drawn from `0..int_max`; for ragged batch kernels
    /// (an `i32` parameter named `starts`) the step's rows, see [`inputs`].
    pub int_max: i32,
    /// The launch's sequence length (`dims[0]`).
    pub seq: u64,
    /// Floats may differ by `tol * (1 + |expected|)`.
    pub tol: f32,
}

/// Tolerance of a length-k reduction: reassociated sums of k products (inputs in
/// [-2, 2]) differ from the sequential order by up to about k * eps times the sum
/// of the magnitudes, which cancellation can make larger than the result itself.
pub fn reduction_tol(k: u64) -> f32 {
    (4e-7 * k as f32).max(1e-5)
}

/// Random inputs of a case: every parameter by its element type.
///
/// A ragged batch kernel's sequences are made consistent: an `i32` parameter
/// named `starts` (`[sequences + 1]`) becomes a random partition of `int_max`
/// rows into its nonempty runs (`starts[0] = 0`, the last entry `int_max`),
/// and one named `seqs` each row's sequence in that partition; one named
/// `offsets` (`[experts + 1]`, the grouped expert matmuls') a random partition
/// of `int_max` rows into groups, some empty.
pub fn inputs(case: &Case, rng: &mut Rng) -> Vec<Buffer> {
    let mut inputs = plain_inputs(case, rng);
    let param = |name: &str| case.kernel.params.iter().position(|p| p.name == name && p.elem == ElemType::I32);
    if let Some(at) = param("starts") {
        let Buffer::I32(starts) = &inputs[at] else { unreachable!("an i32 parameter") };
        let (sequences, rows) = (starts.len().saturating_sub(1), case.int_max.max(0) as usize);
        assert!(sequences >= 1 && rows >= sequences, "{}: {rows} rows cannot hold {sequences} nonempty sequences", case.kernel.name);
        let mut lens = vec![1usize; sequences];
        for _ in sequences..rows {
            lens[(((rng.f() + 1.0) / 2.0 * sequences as f32) as usize).min(sequences - 1)] += 1;
        }
        let starts: Vec<i32> = std::iter::once(0).chain(lens.iter().scan(0, |end, &n| {
            *end += n as i32;
            Some(*end)
        })).collect();
        if let Some(s) = param("seqs") {
            let Buffer::I32(seqs) = &mut inputs[s] else { unreachable!("an i32 parameter") };
            for (r, seq) in seqs.iter_mut().enumerate() {
                *seq = starts.partition_point(|&st| st as usize <= r) as i32 - 1;
            }
        }
        inputs[at] = Buffer::I32(starts);
    }
    // The grouped expert matmuls' groups: a random partition of `int_max` rows
    // into the experts, empty groups included.
    if let Some(at) = param("offsets") {
        let Buffer::I32(offsets) = &inputs[at] else { unreachable!("an i32 parameter") };
        let (experts, rows) = (offsets.len() - 1, case.int_max.max(0) as usize);
        let mut counts = vec![0i32; experts];
        for _ in 0..rows {
            counts[(((rng.f() + 1.0) / 2.0 * experts as f32) as usize).min(experts - 1)] += 1;
        }
        inputs[at] = Buffer::I32(std::iter::once(0).chain(counts.iter().scan(0, |end, &n| {
            *end += n;
            Some(*end)
        })).collect());
    }
    inputs
}

/// [`inputs`] before the ragged batch kernels' sequences are made consistent.
fn plain_inputs(case: &Case, rng: &mut Rng) -> Vec<Buffer> {
    case.kernel
        .params
        .iter()
        .zip(&case.sizes)
        .map(|(p, &n)| match p.elem {
            // Rsqrt needs positive inputs, and so do the combine's sums of
            // exponentials (random signs could cancel them to nothing); everything
            // else takes any sign.
            ElemType::F32 if case.kernel.name.starts_with("rsqrt") || case.kernel.name.starts_with("attention_combine") => {
                Buffer::F32((0..n).map(|_| rng.f().abs() + 0.1).collect())
            }
            ElemType::F32 => Buffer::F32((0..n).map(|_| rng.f() * 2.0).collect()),
            ElemType::I32 => Buffer::I32((0..n).map(|_| ((rng.f() + 1.0) / 2.0 * case.int_max as f32) as i32 % case.int_max.max(1)).collect()),
            // Random 16-bit patterns of finite values in about [-2, 2].
            ElemType::BF16 => Buffer::BF16((0..n).map(|_| ((rng.f() * 2.0).to_bits() >> 16) as u16).collect()),
            ElemType::F16 => Buffer::F16((0..n).map(|_| {
                let x = rng.f();
                let e = ((x.abs() * 1024.0) as u16).min(0x3bff);
                e | if x < 0.0 { 0x8000 } else { 0 }
            }).collect()),
            ElemType::I8 => Buffer::I8((0..n).map(|_| (rng.f() * 127.0) as i8).collect()),
            // Any byte but the fp8 NaN codes (0x7f, 0xff), which no encoder writes.
            ElemType::U8 => Buffer::U8((0..n).map(|_| match ((rng.f() + 1.0) * 127.9) as u8 { c if c & 0x7f == 0x7f => c ^ 1, c => c }).collect()),
        })
        .collect()
}

/// The activation levels an interleaved matmul takes, by its name
/// (`matmul[_add]_{i8,i16,w16,p16}x16_*`); `None` for other kernels.
pub fn interleaved_levels(name: &str) -> Option<ActivationLevels> {
    match name {
        name if name.contains("_i16x16_") => Some(ActivationLevels::Int16Planes),
        name if name.contains("_w16x16_") => Some(ActivationLevels::Int16Words),
        name if name.contains("_p16x16_") => Some(ActivationLevels::Int16WordPairs),
        name if name.contains("_i8x16_") => Some(ActivationLevels::Int8),
        _ => None,
    }
}

/// Random inputs of an interleaved matmul (`matmul[_add]_{i8,i16,w16,p16}x16_*`:
/// parameter 0 the activation levels, 1 their scales) made to keep
/// `RowDot`'s contract, as `quantize_q8` / `quantize_q16` do: each block's
/// second scale is its first times the sum of the block's levels (a lowering may
/// fold Q8_0's -128 minimum into the dot on the strength of it). Other kernels'
/// inputs are returned as they are.
fn with_activation_sums(case: &Case, mut inputs: Vec<Buffer>) -> Vec<Buffer> {
    let Some(levels) = interleaved_levels(&case.kernel.name) else { return inputs };
    let Buffer::I8(q) = inputs[0].clone() else { panic!("{}: parameter 0 is not i8 levels", case.kernel.name) };
    let Buffer::F32(s) = &mut inputs[1] else { panic!("{}: parameter 1 is not f32 scales", case.kernel.name) };
    let rows = case.seq as usize;
    let k = q.len() / rows / levels.bytes() as usize;
    let nb = k / 32;
    for r in 0..rows {
        for b in 0..nb {
            let level = |t: usize| match levels {
                ActivationLevels::Int8 => q[r * k + t] as i64,
                ActivationLevels::Int16Planes => maxc_kernels::ir::HIGH_PLANE_WEIGHT * q[r * 2 * k + t] as i64 + q[r * 2 * k + k + t] as i64,
                // (Word `t`, not level `t`, for word pairs: the block's sum is the same.)
                ActivationLevels::Int16Words | ActivationLevels::Int16WordPairs => i16::from_le_bytes([q[r * 2 * k + 2 * t] as u8, q[r * 2 * k + 2 * t + 1] as u8]) as i64,
            };
            let sum: i64 = (32 * b..32 * b + 32).map(level).sum();
            s[r * 2 * nb + nb + b] = s[r * 2 * nb + b] * sum as f32;
        }
    }
    inputs
}

/// Runs compiled kernel `f` and the interpreter on the same `inputs` and
/// compares every parameter afterwards (floats within the case's tolerance).
///
/// An interleaved matmul's outputs may also differ by a few float roundings of
/// the magnitude of their terms ([`term_magnitudes`]): their blocks' terms are
/// far larger than 1 (16-bit levels times six-bit weights), and random signs
/// can cancel an output to near 0, where the backends' order of the terms and
/// the interpreter's round differently. (A Q6_K word-pairs output of -0.359
/// from terms of about 3e5 came out -0.356 in the interpreter: a difference
/// of 1e-8 of the terms' magnitude. A wrong level or scale is off by a whole
/// term.)
pub fn assert_matches_interpreter(spec: &str, f: maxrun_runtime::code::KernelFn, case: &Case, inputs: Vec<Buffer>, trial: usize) {
    let magnitudes = term_magnitudes(case, &inputs);
    let mut expected = with_activation_sums(case, inputs);
    let mut actual = expected.clone();
    run(&case.kernel, &mut expected, case.seq);
    let ptrs: Vec<*mut u8> = actual.iter_mut().map(Buffer::as_mut_ptr).collect();
    let dims = [case.seq as i64];
    let tasks = case.kernel.tasks.eval(case.seq);
    // SAFETY: buffers are sized for the kernel (the interpreter just ran it with bounds checks).
    unsafe { f(ptrs.as_ptr(), dims.as_ptr(), 0, tasks) };
    let slack = magnitudes.map(|m| m.into_iter().map(|x| ROUNDINGS_OF_TERMS * f32::EPSILON * x.abs()).collect::<Vec<f32>>());
    assert_same_outputs_with_slack(&format!("{spec} {} trial {trial}", case.kernel.name), ("interpreter", spec), &expected, &actual, case.tol, slack.as_deref());
}

/// How many float roundings (`f32::EPSILON`) of its terms' magnitude an
/// interleaved matmul's output may differ by, beyond the case's tolerance (the
/// largest difference seen in 3000 random Q6_K word-pairs runs was 0.8).
const ROUNDINGS_OF_TERMS: f32 = 8.0;

/// The magnitude of each output's terms of an interleaved matmul
/// (`matmul[_add]_{i8,i16,w16,p16}x16_*`): the interpreter's output on the same
/// inputs made non-negative (activation levels in their own format, signed
/// weight bytes and sub-scales, float scales and half sums; the activation
/// sums recomputed). Where the weights' levels are unsigned this bounds the
/// sum of the terms' absolute values; with a level offset (Q4_0's -8) it is of
/// the same order. `None` for other kernels.
pub fn term_magnitudes(case: &Case, inputs: &[Buffer]) -> Option<Vec<f32>> {
    let levels = interleaved_levels(&case.kernel.name)?;
    let rows = case.seq as usize;
    let mut all: Vec<Buffer> = inputs
        .iter()
        .enumerate()
        .map(|(p, b)| match b {
            Buffer::I8(q) if p == 0 => {
                let mut q = q.clone();
                match levels {
                    ActivationLevels::Int8 => q.iter_mut().for_each(|x| *x = x.saturating_abs()),
                    // Level = 255 * high + low, both signed: negate both bytes of a negative level.
                    ActivationLevels::Int16Planes => {
                        let k = q.len() / rows / 2;
                        for r in 0..rows {
                            for t in 0..k {
                                let (hi, lo) = (r * 2 * k + t, r * 2 * k + k + t);
                                if maxc_kernels::ir::HIGH_PLANE_WEIGHT * q[hi] as i64 + (q[lo] as i64) < 0 {
                                    (q[hi], q[lo]) = (-q[hi], -q[lo]);
                                }
                            }
                        }
                    }
                    ActivationLevels::Int16Words | ActivationLevels::Int16WordPairs => {
                        for w in q.chunks_mut(2) {
                            let [lo, hi] = i16::from_le_bytes([w[0] as u8, w[1] as u8]).saturating_abs().to_le_bytes();
                            (w[0], w[1]) = (lo as i8, hi as i8);
                        }
                    }
                }
                Buffer::I8(q)
            }
            Buffer::I8(v) => Buffer::I8(v.iter().map(|x| x.saturating_abs()).collect()),
            Buffer::I32(v) => Buffer::I32(v.iter().map(|x| x.saturating_abs()).collect()),
            Buffer::F32(v) => Buffer::F32(v.iter().map(|x| x.abs()).collect()),
            Buffer::F16(v) => Buffer::F16(v.iter().map(|h| h & 0x7fff).collect()),
            other => other.clone(),
        })
        .collect();
    all = with_activation_sums(case, all);
    run(&case.kernel, &mut all, case.seq);
    match all.pop() {
        Some(Buffer::F32(out)) => Some(out),
        _ => None,
    }
}

/// Runs `case` on `inputs` through the interpreter sequentially and under the
/// GPU's warp mapping (one warp per task, loops dealt to lanes, reductions by
/// butterfly: the NVPTX lowering's reference) and compares the two, floats
/// within the case's tolerance (at least 1e-6: lanes reassociate every sum).
pub fn assert_warp_mapping_matches(what: &str, case: &Case, inputs: Vec<Buffer>) {
    let mut expected = inputs;
    let mut actual = expected.clone();
    run(&case.kernel, &mut expected, case.seq);
    run_warp(&case.kernel, &mut actual, case.seq);
    assert_same_outputs(what, ("sequential", "warp"), &expected, &actual, case.tol.max(1e-6));
}

/// Every parameter after two runs of one kernel (`reference` gave `expected`,
/// `other` gave `actual`): floats within `tol * (1 + |expected|)`, other element
/// types equal.
pub fn assert_same_outputs(what: &str, names: (&str, &str), expected: &[Buffer], actual: &[Buffer], tol: f32) {
    assert_same_outputs_with_slack(what, names, expected, actual, tol, None);
}

/// [`assert_same_outputs`], the last parameter's floats allowed `slack[i]` more.
fn assert_same_outputs_with_slack(what: &str, (reference, other): (&str, &str), expected: &[Buffer], actual: &[Buffer], tol: f32, slack: Option<&[f32]>) {
    let last = expected.len().saturating_sub(1);
    for (p, (e, a)) in expected.iter().zip(actual).enumerate() {
        match (e, a) {
            (Buffer::F32(e), Buffer::F32(a)) => {
                for (i, (x, y)) in e.iter().zip(a).enumerate() {
                    let extra = slack.filter(|_| p == last).map_or(0.0, |s| s[i]);
                    assert!((x - y).abs() <= tol * (1.0 + x.abs()) + extra, "{what}: param {p}[{i}]: {reference} {x}, {other} {y} (allowed {})", tol * (1.0 + x.abs()) + extra);
                }
            }
            _ => assert_eq!(e, a, "{what}: param {p}"),
        }
    }
}

