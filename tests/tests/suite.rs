//! The integration tests, one binary: each module is a file beside this one,
//! named for what it covers (docs/ARCHITECTURE.md, `tests/`). One binary keeps
//! both test threads busy from the first file to the last and links once.
//! Run a file's tests with its name as the filter:
//! `cargo test -p maxc-tests --test suite serve::`.

mod aarch64;
mod artifact_trust;
mod bad_input;
mod bad_input_table;
mod batch_invariance;
mod batching;
mod chat;
mod check_parity;
mod ci;
mod deploy;
mod encoder_batch;
mod end_to_end;
mod engine;
mod gguf_architectures;
mod gpu;
mod gpu_executor;
mod graph_passes;
mod kernel_filetests;
mod kernels_llvm;
mod manifests;
mod perplexity;
mod portable;
mod quantization;
mod reference_golden;
mod serve;
mod sharding;
mod speculation;
mod tidy;
