//! Qwen3ForCausalLM: the Llama decoder with per-head RMSNorm of q and k before RoPE
//! (and an explicit `head_dim`, read by the config importer).

use super::llama::{build_decoder, DecoderOptions, QkNorm};
use super::WeightBinder;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    build_decoder(model, w, &DecoderOptions { qk_norm: QkNorm::PerHead, ..Default::default() })
}
