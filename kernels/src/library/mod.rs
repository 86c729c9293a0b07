//! The kernel library: one builder per kernel family, each producing a [`Kernel`]
//! specialized to static shapes (and optionally to a fixed sequence length).
//!
//! Activations are row-major `[seq, width]`; a "row task" kernel runs one task per
//! sequence row.

pub mod attention;
pub mod copy;
pub mod dequant;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod matmul_blocks;
pub mod matmul_panel;
pub mod rms_norm;
pub mod rope;

use crate::ir::Expr;

/// Whether a kernel is compiled for any sequence length or one fixed length
/// (decode plans fix `seq = 1`, which lets LLVM drop the row loops).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum SeqMode {
    Dynamic,
    Fixed(u64),
}

impl SeqMode {
    /// The sequence length as an expression.
    pub fn expr(self) -> Expr {
        match self {
            SeqMode::Dynamic => Expr::Seq,
            SeqMode::Fixed(n) => Expr::I64(n as i64),
        }
    }

    /// A name suffix: `sN` (dynamic) or `s1`.
    pub fn tag(self) -> String {
        match self {
            SeqMode::Dynamic => "sN".into(),
            SeqMode::Fixed(n) => format!("s{n}"),
        }
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    /// Deterministic pseudo-random values in [-1, 1).
    pub fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    pub fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }
}
