//! maxrun: the runtime half of maxc. It owns the MEF artifact format (the contract
//! between compiler and runtime) and everything needed to run an artifact.
//!
//! Architecture invariant: this crate depends on no compiler crate, LLVM or Cranelift.

pub mod npy;
