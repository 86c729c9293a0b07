//! maxrun: the runtime half of maxc. It owns the MEF artifact format (the contract
//! between compiler and runtime, in its own crate `maxc-format` under this tree,
//! re-exported as [`format`]) and everything needed to run an artifact: the
//! loader, the code loader, the thread pool, the executor with its KV cache, and
//! the sampler; with the `cuda` feature (default), the same plans on an NVIDIA GPU.
//!
//! Architecture invariant: this crate depends on no compiler crate, LLVM or Cranelift.

pub mod artifact;
pub mod bench;
pub mod bench_speculation;
pub mod chat;
pub mod code;
pub mod collectives;
pub mod constrain;
pub mod cpu;
pub mod engine;
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
pub mod perplexity;
pub mod pool;
pub mod runner;
pub mod sampler;
#[cfg(feature = "serve")]
pub mod serve;
pub mod session;
pub mod usage;
