//! GraniteForCausalLM: the Llama decoder with embedding, attention, residual and
//! logits multipliers from config.json.

use super::llama::{build_decoder, DecoderOptions};
use super::WeightBinder;
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    let m = model.config.granite.ok_or_else(|| Error::invalid(&model.source, "embedding_multiplier", "Granite multipliers are missing"))?;
    let opts = DecoderOptions {
        embedding_multiplier: Some(m.embedding_multiplier),
        attention_scale: Some(m.attention_multiplier),
        residual_multiplier: Some(m.residual_multiplier),
        logits_divisor: Some(m.logits_scaling),
        ..Default::default()
    };
    build_decoder(model, w, &opts)
}
