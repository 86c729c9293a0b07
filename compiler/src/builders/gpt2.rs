//! GPT2LMHeadModel: learned position embeddings, pre-LayerNorm blocks with biases,
//! Conv1D weights (stored `[in, out]`, transposed at compile time), a fused
//! `c_attn` projection split into q/k/v, GELU (tanh) MLP, no rotary embedding.

use super::{decoder_inputs, standard_attention, WeightBinder};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::ImportedModel;

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    let c = &model.config;
    let mut g = Graph::new(c.architecture.hf_name());
    let (h, v, i, hd, nh) = (c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim, c.num_heads);
    // Checkpoints saved from GPT2LMHeadModel prefix names with `transformer.`; older ones do not.
    let prefix = if model.weights.get("transformer.wte.weight").is_some() { "transformer." } else { "" };
    let (tokens, positions) = decoder_inputs(&mut g);
    let wte = w.weight(&mut g, &format!("{prefix}wte.weight"), &[v, h])?;
    let wpe = w.weight(&mut g, &format!("{prefix}wpe.weight"), &[c.max_position_embeddings, h])?;
    let te = g.add(Op::Embedding, &[wte, tokens]);
    let pe = g.add(Op::Embedding, &[wpe, positions]);
    let mut x = g.add(Op::Binary(BinaryOp::Add), &[te, pe]);
    let layer_norm = |g: &mut Graph, x: ValueId, name: &str| w.layer_norm(g, x, name, h, c.rms_norm_eps);
    // Conv1D: y = x @ W + b with W stored [in, out]; llama.cpp's converter
    // stores it transposed, [out, in], as a Linear weight (the layout MatMul takes).
    let from_gguf = crate::import::is_gguf(&model.source);
    let conv1d = |g: &mut Graph, x: ValueId, name: &str, inp: usize, out: usize| -> Result<ValueId> {
        let wt = if from_gguf {
            w.weight(g, &format!("{name}.weight"), &[out, inp])?
        } else {
            let weight = w.weight(g, &format!("{name}.weight"), &[inp, out])?;
            g.add(Op::Transpose, &[weight])
        };
        let y = g.add(Op::MatMul, &[x, wt]);
        let bias = w.weight(g, &format!("{name}.bias"), &[out])?;
        Ok(g.add(Op::Binary(BinaryOp::Add), &[y, bias]))
    };
    for l in 0..c.num_layers {
        let p = format!("{prefix}h.{l}");
        let n = layer_norm(&mut g, x, &format!("{p}.ln_1"))?;
        let qkv = conv1d(&mut g, n, &format!("{p}.attn.c_attn"), h, 3 * h)?;
        let q = g.add(Op::Slice { axis: 1, start: 0, len: h as u64 }, &[qkv]);
        let k = g.add(Op::Slice { axis: 1, start: h as u64, len: h as u64 }, &[qkv]);
        let vv = g.add(Op::Slice { axis: 1, start: 2 * h as u64, len: h as u64 }, &[qkv]);
        let a = g.add(standard_attention(l, nh, nh, hd, true), &[q, k, vv, positions]);
        let o = conv1d(&mut g, a, &format!("{p}.attn.c_proj"), h, h)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, o]);
        let n = layer_norm(&mut g, x, &format!("{p}.ln_2"))?;
        let up = conv1d(&mut g, n, &format!("{p}.mlp.c_fc"), h, i)?;
        let act = g.add(Op::Unary(UnaryOp::GeluTanh), &[up]);
        let d = conv1d(&mut g, act, &format!("{p}.mlp.c_proj"), i, h)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, d]);
    }
    let x = layer_norm(&mut g, x, &format!("{prefix}ln_f"))?;
    let head = if c.tie_word_embeddings { wte } else { w.weight(&mut g, "lm_head.weight", &[v, h])? };
    let logits = g.add(Op::MatMul, &[x, head]);
    g.output("logits", logits);
    Ok(g)
}
