//! The graph IR: an arena of nodes with typed ids, a closed op enum, static shapes
//! with a few symbolic dims, inference, a verifier and a text form.

pub mod infer;
pub mod ir;
pub mod rope;
pub mod text;
pub mod verify;

pub use ir::*;
