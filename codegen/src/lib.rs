//! maxc-codegen: backends that lower kernel IR to machine code.
//!
//! Architecture invariant: codegen sees kernel IR only, never the graph IR.
//! The LLVM backend (`llvm/`) emits an x86-64 or aarch64 object per artifact
//! (`link.rs` turns it into a shared object the runtime loads from memory) and PTX modules
//! for NVIDIA GPUs from the same emitter; `ptxas.rs` validates PTX.

pub mod cranelift;
pub mod link;
pub mod llvm;
pub mod target;

pub use target::{CpuTarget, GpuTarget, TargetSpec};

/// Errors of code generation.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("--target `{spec}`: {message}")]
    Target { spec: String, message: String },
    #[error("LLVM: {0}")]
    Llvm(String),
    #[error("linking the kernels into a shared object failed: {0}")]
    Link(String),
}

/// Machine code for a set of kernels.
#[derive(Debug, Clone)]
pub struct CompiledCode {
    /// A shared object exporting one symbol per kernel.
    pub shared_object: Vec<u8>,
    /// The exported symbols, in the order of the kernels given.
    pub symbols: Vec<String>,
}
