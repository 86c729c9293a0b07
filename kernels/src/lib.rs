//! maxc-kernels: the kernel IR, its text form ([`ir_text`]: print and parse), the
//! kernel library (one builder per kernel family) and a reference interpreter for
//! kernel IR.
//!
//! A kernel is described once here and lowered by every backend in `maxc-codegen`.
//! Shapes are compile-time constants except the sequence length, which kernels read
//! as `dims[0]` ([`ir::Expr::Seq`]).

pub mod interp;
pub mod ir;
pub mod ir_text;
pub mod library;
pub mod warp;

pub use ir::*;
