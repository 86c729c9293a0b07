//! maxc: the ahead-of-time model compiler (library half; `main.rs` is the CLI).
//!
//! Flow: [`manifest`] -> [`import`] -> [`builders`] (graph IR, [`graph`]) ->
//! [`passes`] -> (scheduling, codegen and the MEF writer). The reference
//! interpreter ([`interp`]) is the oracle every pass is tested against.

pub mod builders;
pub mod cache;
pub mod compile_config;
pub mod driver;
pub mod error;
pub mod graph;
pub mod import;
pub mod interp;
pub mod manifest;
pub mod mef_writer;
pub mod passes;
pub mod progress;
pub mod provenance;
pub mod quant;
pub mod resident;
pub mod schedule;
pub mod sharding;
pub mod summary;

pub use error::{Error, Result};
