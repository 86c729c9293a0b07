//! The tiny runtime: everything needed to load, check and run a MEF artifact,
//! and nothing that serves, parses a command line, constrains output or
//! exports metrics (those are the crates above it: `maxrun-engine`,
//! `maxrun-server`, `maxrun`). It holds the loader ([`artifact`]), the code
//! loader, the thread pool, the executors of the CPU, a CPU mesh and, with the
//! `cuda` feature (default), an NVIDIA GPU behind one interface
//! ([`executor`], opened by [`runner`]), the KV pool, the sampler, and the
//! tokenizer and chat-template glue. The artifact format is the contract, in
//! its own crate `maxc-format` under this tree, re-exported as [`format`].
//!
//! Architecture invariants: this crate depends on no compiler crate, LLVM or
//! Cranelift, and on no HTTP, async, grammar, CLI or metrics crate
//! (`tests/tests/tidy.rs` runs `cargo tree` to check both).

pub mod artifact;
pub mod chat;
pub mod code;
pub mod collectives;
pub mod cpu;
pub mod executor;
/// The artifact format lives in its own crate (`runtime-stub/format`), which the
/// compiler's crates share without depending on this runtime.
pub use maxc_format as format;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod huge;
pub mod inspect;
pub mod kv_cache;
pub mod mesh_session;
pub mod npy;
pub mod output;
pub mod pool;
pub mod runner;
pub mod sampler;
pub mod session;
pub mod usage;
