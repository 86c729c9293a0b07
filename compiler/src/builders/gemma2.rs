//! Gemma2ForCausalLM and Gemma3ForCausalLM (text): RMSNorm with `(1 + weight)`,
//! the embedding scaled by sqrt(hidden), four norms per layer (pre and post
//! attention, pre and post MLP), a GELU-tanh gated MLP, sliding-window attention on
//! the layers `layer_types` marks, and `query_pre_attn_scalar^-0.5` as the
//! attention scale. Gemma 2 adds attention and final logit soft-capping; Gemma 3
//! adds per-head q/k RMSNorm before RoPE and a RoPE base of its own for the
//! sliding layers (`GemmaParams` carries both differences).

use super::{decoder_inputs, scalar, WeightBinder};
use crate::error::{Error, Result};
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::ImportedModel;

/// `tanh(x / cap) * cap`.
fn softcap(g: &mut Graph, x: ValueId, cap: f32) -> ValueId {
    let c = scalar(g, cap);
    let d = g.add(Op::Binary(BinaryOp::Div), &[x, c]);
    let t = g.add(Op::Unary(UnaryOp::Tanh), &[d]);
    g.add(Op::Binary(BinaryOp::Mul), &[t, c])
}

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    let c = &model.config;
    let gp = c.gemma.as_ref().ok_or_else(|| Error::invalid(&model.source, "query_pre_attn_scalar", "Gemma settings are missing"))?;
    let mut g = Graph::new(c.architecture.hf_name());
    let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
    let (tokens, positions) = decoder_inputs(&mut g);
    let embed = w.weight(&mut g, "model.embed_tokens.weight", &[v, h])?;
    let e = g.add(Op::Embedding, &[embed, tokens]);
    let normalizer = scalar(&mut g, (h as f32).sqrt());
    let mut x = g.add(Op::Binary(BinaryOp::Mul), &[e, normalizer]);
    // Gemma's RMSNorm scales by (1 + weight); the sum is a constant, folded at compile
    // time. Over the hidden state (`len` = hidden), or over each head (Gemma 3's q/k
    // norms, `len` = head_dim).
    let norm = |g: &mut Graph, x: ValueId, name: &str, len: usize| -> Result<ValueId> {
        let weight = w.weight(g, name, &[len])?;
        let one = scalar(g, 1.0);
        let scale = g.add(Op::Binary(BinaryOp::Add), &[weight, one]);
        Ok(g.add(Op::RmsNorm { eps: c.rms_norm_eps }, &[x, scale]))
    };
    let linear = |g: &mut Graph, x: ValueId, name: &str, out: usize, inp: usize| w.linear(g, x, name, out, inp, false);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        let n = norm(&mut g, x, &format!("{p}.input_layernorm.weight"), h)?;
        let mut q = linear(&mut g, n, &format!("{p}.self_attn.q_proj"), nh * hd, h)?;
        let mut k = linear(&mut g, n, &format!("{p}.self_attn.k_proj"), nkv * hd, h)?;
        let vv = linear(&mut g, n, &format!("{p}.self_attn.v_proj"), nkv * hd, h)?;
        if gp.qk_norm {
            q = norm(&mut g, q, &format!("{p}.self_attn.q_norm.weight"), hd)?;
            k = norm(&mut g, k, &format!("{p}.self_attn.k_norm.weight"), hd)?;
        }
        let sliding = gp.sliding_layers.get(l).copied().unwrap_or(false);
        let (rope, rope_factor) = match gp.local_rope_theta {
            Some(theta) if sliding => (Op::Rope { head_dim: hd as u32, theta, scaling: crate::graph::RopeScaling::None }, 1.0),
            _ => (
                Op::Rope { head_dim: hd as u32, theta: c.rope_theta, scaling: c.rope_scaling.clone() },
                crate::graph::rope::attention_factor(&c.rope_scaling),
            ),
        };
        let q = g.add(rope.clone(), &[q, positions]);
        let k = g.add(rope, &[k, positions]);
        let attn = Op::Attention {
            layer: l as u32,
            heads: nh as u32,
            kv_heads: nkv as u32,
            head_dim: hd as u32,
            // YaRN's attention factor, carried by q and k both (see llama.rs).
            scale: rope_factor * rope_factor / gp.query_pre_attn_scalar.sqrt(),
            window: if sliding { c.sliding_window.map(|s| s as u32) } else { None },
            softcap: gp.attn_logit_softcapping,
            causal: true,
            sinks: false,
        };
        let a = g.add(attn, &[q, k, vv, positions]);
        let o = linear(&mut g, a, &format!("{p}.self_attn.o_proj"), h, nh * hd)?;
        let o = norm(&mut g, o, &format!("{p}.post_attention_layernorm.weight"), h)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, o]);

        let n = norm(&mut g, x, &format!("{p}.pre_feedforward_layernorm.weight"), h)?;
        let gate = linear(&mut g, n, &format!("{p}.mlp.gate_proj"), i, h)?;
        let up = linear(&mut g, n, &format!("{p}.mlp.up_proj"), i, h)?;
        let act = g.add(Op::Unary(UnaryOp::GeluTanh), &[gate]);
        let m = g.add(Op::Binary(BinaryOp::Mul), &[act, up]);
        let d = linear(&mut g, m, &format!("{p}.mlp.down_proj"), h, i)?;
        let d = norm(&mut g, d, &format!("{p}.post_feedforward_layernorm.weight"), h)?;
        x = g.add(Op::Binary(BinaryOp::Add), &[x, d]);
    }
    let x = norm(&mut g, x, "model.norm.weight", h)?;
    let head = if c.tie_word_embeddings { embed } else { w.weight(&mut g, "lm_head.weight", &[v, h])? };
    let mut logits = g.add(Op::MatMul, &[x, head]);
    if let Some(cap) = gp.final_logit_softcapping {
        logits = softcap(&mut g, logits, cap);
    }
    g.output("logits", logits);
    Ok(g)
}
