//! Phi3ForCausalLM: the Llama decoder with `qkv_proj` and `gate_up_proj` checkpoints
//! kept stacked (one matmul each, split by column slices, as stack-linear would).

use super::llama::{build_decoder, DecoderOptions};
use super::WeightBinder;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    build_decoder(model, w, &DecoderOptions { fused_projections: true, ..Default::default() })
}
