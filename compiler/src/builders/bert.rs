//! BertModel (and sentence-transformers encoders such as all-MiniLM-L6-v2): word,
//! position and token-type embeddings with LayerNorm, post-LayerNorm blocks with
//! bidirectional attention and an erf GELU MLP, then the pooling (mean over tokens
//! or the [CLS] token) and L2 normalization of the model's sentence-transformers
//! config. The output is `embedding: f32[1, hidden]`.

use super::{decoder_inputs, standard_attention, WeightBinder};
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    let c = &model.config;
    let enc = c.encoder.ok_or_else(|| Error::invalid(&model.source, "architectures", "BertModel settings are missing"))?;
    let mut g = Graph::new(c.architecture.hf_name());
    let (h, v, i, hd, nh) = (c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim, c.num_heads);
    // BertModel checkpoints use bare names; BertFor* ones prefix `bert.`.
    let p0 = if model.weights.get("bert.embeddings.word_embeddings.weight").is_some() { "bert." } else { "" };
    let (tokens, positions) = decoder_inputs(&mut g);
    let layer_norm = |g: &mut Graph, x: ValueId, name: &str| w.layer_norm(g, x, name, h, c.rms_norm_eps);
    let linear = |g: &mut Graph, x: ValueId, name: &str, out: usize, inp: usize| w.linear(g, x, name, out, inp, true);
    let e = format!("{p0}embeddings");
    let words = w.weight(&mut g, &format!("{e}.word_embeddings.weight"), &[v, h])?;
    let pos_table = w.weight(&mut g, &format!("{e}.position_embeddings.weight"), &[c.max_position_embeddings, h])?;
    let types = w.weight(&mut g, &format!("{e}.token_type_embeddings.weight"), &[enc.type_vocab_size, h])?;
    let we = g.add(Op::Embedding, &[words, tokens]);
    let pe = g.add(Op::Embedding, &[pos_table, positions]);
    // Every token of a single sentence has token type 0.
    let type0 = g.add(Op::Slice { axis: 0, start: 0, len: 1 }, &[types]);
    let x = g.add(Op::Binary(BinaryOp::Add), &[we, pe]);
    let x = g.add(Op::Binary(BinaryOp::Add), &[x, type0]);
    let mut x = layer_norm(&mut g, x, &format!("{e}.LayerNorm"))?;
    for l in 0..c.num_layers {
        let p = format!("{p0}encoder.layer.{l}");
        let q = linear(&mut g, x, &format!("{p}.attention.self.query"), h, h)?;
        let k = linear(&mut g, x, &format!("{p}.attention.self.key"), h, h)?;
        let vv = linear(&mut g, x, &format!("{p}.attention.self.value"), h, h)?;
        let a = g.add(standard_attention(l, nh, nh, hd, false), &[q, k, vv, positions]);
        let o = linear(&mut g, a, &format!("{p}.attention.output.dense"), h, h)?;
        let r = g.add(Op::Binary(BinaryOp::Add), &[o, x]);
        x = layer_norm(&mut g, r, &format!("{p}.attention.output.LayerNorm"))?;
        let up = linear(&mut g, x, &format!("{p}.intermediate.dense"), i, h)?;
        let act = g.add(Op::Unary(UnaryOp::Gelu), &[up]);
        let d = linear(&mut g, act, &format!("{p}.output.dense"), h, i)?;
        let r = g.add(Op::Binary(BinaryOp::Add), &[d, x]);
        x = layer_norm(&mut g, r, &format!("{p}.output.LayerNorm"))?;
    }
    if !enc.mean_pooling {
        return Err(Error::invalid(&model.source, "1_Pooling/config.json", "[CLS] pooling is not supported yet; supported: pooling_mode_mean_tokens"));
    }
    let mut pooled = g.add(Op::MeanRows, &[x]);
    if enc.normalize {
        pooled = g.add(Op::L2Normalize, &[pooled]);
    }
    g.output("embedding", pooled);
    Ok(g)
}
