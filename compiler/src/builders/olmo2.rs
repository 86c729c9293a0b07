//! Olmo2ForCausalLM: norms after attention and MLP (no pre-norms), and RMSNorm of
//! the whole q and k projections before RoPE.

use super::llama::{build_decoder, DecoderOptions, QkNorm};
use super::WeightBinder;
use crate::error::Result;
use crate::graph::Graph;
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    build_decoder(model, w, &DecoderOptions { qk_norm: QkNorm::Full, post_norms: true, ..Default::default() })
}
