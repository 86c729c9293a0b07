//! Phi3ForCausalLM: the Llama decoder. Its checkpoints store `qkv_proj` and
//! `gate_up_proj` stacked; the importer exposes their row ranges as `q_proj`,
//! `k_proj`, `v_proj`, `gate_proj` and `up_proj` (`import::split_fused_projections`),
//! so stack-linear stacks them again into the same matmuls, and a device mesh can
//! split them by heads and features like Llama's.

use super::llama::{build_decoder, DecoderOptions};
use super::WeightBinder;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    build_decoder(model, w, &DecoderOptions::default())
}
