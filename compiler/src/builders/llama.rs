//! The Llama-family decoder builder: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM.
//!
//! Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP ->
//! residual), rotate-half RoPE, grouped-query attention, optional q/k/v (and o)
//! biases, optional sliding window, tied or untied lm_head.

use super::{decoder_inputs, WeightBinder};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::ImportedModel;

/// Builds the decoder graph.
pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    let c = &model.config;
    let mut g = Graph::new(c.architecture.hf_name());
    let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
    let (tokens, positions) = decoder_inputs(&mut g);
    let embed = w.weight(&mut g, "model.embed_tokens.weight", &[v, h])?;
    let mut x = g.add(Op::Embedding, &[embed, tokens]);

    let linear = |g: &mut Graph, x: ValueId, prefix: &str, out: usize, inp: usize, bias: bool| -> Result<ValueId> {
        let weight = w.weight(g, &format!("{prefix}.weight"), &[out, inp])?;
        let y = g.add(Op::MatMul, &[x, weight]);
        Ok(if bias {
            let b = w.weight(g, &format!("{prefix}.bias"), &[out])?;
            g.add(Op::Binary(BinaryOp::Add), &[y, b])
        } else {
            y
        })
    };

    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        let norm_w = w.weight(&mut g, &format!("{p}.input_layernorm.weight"), &[h])?;
        let n = g.add(Op::RmsNorm { eps: c.rms_norm_eps }, &[x, norm_w]);
        let q = linear(&mut g, n, &format!("{p}.self_attn.q_proj"), nh * hd, h, c.qkv_bias)?;
        let k = linear(&mut g, n, &format!("{p}.self_attn.k_proj"), nkv * hd, h, c.qkv_bias)?;
        let vv = linear(&mut g, n, &format!("{p}.self_attn.v_proj"), nkv * hd, h, c.qkv_bias)?;
        let rope = Op::Rope { head_dim: hd as u32, theta: c.rope_theta, scaling: c.rope_scaling.clone() };
        let q = g.add(rope.clone(), &[q, positions]);
        let k = g.add(rope, &[k, positions]);
        let attn = Op::Attention {
            layer: l as u32,
            heads: nh as u32,
            kv_heads: nkv as u32,
            head_dim: hd as u32,
            scale: 1.0 / (hd as f32).sqrt(),
            window: c.sliding_window.map(|s| s as u32),
        };
        let a = g.add(attn, &[q, k, vv, positions]);
        let o = linear(&mut g, a, &format!("{p}.self_attn.o_proj"), h, nh * hd, c.o_bias)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, o]);

        let norm_w = w.weight(&mut g, &format!("{p}.post_attention_layernorm.weight"), &[h])?;
        let n = g.add(Op::RmsNorm { eps: c.rms_norm_eps }, &[x, norm_w]);
        let gate = linear(&mut g, n, &format!("{p}.mlp.gate_proj"), i, h, c.mlp_bias)?;
        let up = linear(&mut g, n, &format!("{p}.mlp.up_proj"), i, h, c.mlp_bias)?;
        let act = g.add(Op::Unary(UnaryOp::Silu), &[gate]);
        let m = g.add(Op::Binary(BinaryOp::Mul), &[act, up]);
        let d = linear(&mut g, m, &format!("{p}.mlp.down_proj"), h, i, c.mlp_bias)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, d]);
    }
    let norm_w = w.weight(&mut g, "model.norm.weight", &[h])?;
    let x = g.add(Op::RmsNorm { eps: c.rms_norm_eps }, &[x, norm_w]);
    let head = if c.tie_word_embeddings {
        // Some tied checkpoints still carry an lm_head copy; the embedding is authoritative.
        embed
    } else {
        w.weight(&mut g, "lm_head.weight", &[v, h])?
    };
    let logits = g.add(Op::MatMul, &[x, head]);
    g.output("logits", logits);
    Ok(g)
}
