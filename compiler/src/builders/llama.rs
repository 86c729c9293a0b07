//! The Llama-family decoder builder: LlamaForCausalLM, MistralForCausalLM and
//! Qwen2ForCausalLM directly, and, through [`DecoderOptions`], the variants whose
//! builders live beside it (Qwen3, OLMo 2, Granite, Phi-3; the mixture-of-experts
//! decoders, whose sparse layers' MLPs `moe.rs` builds).
//!
//! Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP ->
//! residual), rotate-half RoPE, grouped-query attention, optional q/k/v (and o)
//! biases, optional sliding window, tied or untied lm_head.

use super::{decoder_inputs, scalar, WeightBinder};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::ImportedModel;

/// Where a decoder normalizes q and k before RoPE.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head (`q_norm.weight: [head_dim]`, Qwen3).
    PerHead,
    /// RMSNorm over the whole projection (`q_norm.weight: [heads * head_dim]`, OLMo 2).
    Full,
}

/// The knobs that distinguish the Llama-family variants.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderOptions {
    pub qk_norm: QkNorm,
    /// Norms after attention and MLP (before the residual add) instead of before (OLMo 2).
    pub post_norms: bool,
    pub embedding_multiplier: Option<f32>,
    /// Replaces 1/sqrt(head_dim).
    pub attention_scale: Option<f32>,
    pub residual_multiplier: Option<f32>,
    /// Logits are divided by this.
    pub logits_divisor: Option<f32>,
    /// A learned sink logit per head joins each attention softmax
    /// (`self_attn.sinks`, gpt-oss).
    pub sinks: bool,
}

impl Default for DecoderOptions {
    fn default() -> Self {
        DecoderOptions {
            qk_norm: QkNorm::None,
            post_norms: false,
            embedding_multiplier: None,
            attention_scale: None,
            residual_multiplier: None,
            logits_divisor: None,
            sinks: false,
        }
    }
}

/// Builds a plain Llama / Mistral / Qwen2 decoder graph.
pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    build_decoder(model, w, &DecoderOptions::default())
}

fn scale(g: &mut Graph, x: ValueId, by: Option<f32>, op: BinaryOp) -> ValueId {
    match by {
        Some(m) => {
            let c = scalar(g, m);
            g.add(Op::Binary(op), &[x, c])
        }
        None => x,
    }
}

/// Builds the decoder graph with the given variant options.
pub fn build_decoder(model: &ImportedModel, w: &WeightBinder<'_>, opts: &DecoderOptions) -> Result<Graph> {
    let c = &model.config;
    let mut g = Graph::new(c.architecture.hf_name());
    let (h, v, i) = (c.hidden_size, c.vocab_size, c.intermediate_size);
    let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
    let (tokens, positions) = decoder_inputs(&mut g);
    let embed = w.weight(&mut g, "model.embed_tokens.weight", &[v, h])?;
    let x0 = g.add(Op::Embedding, &[embed, tokens]);
    let mut x = scale(&mut g, x0, opts.embedding_multiplier, BinaryOp::Mul);

    let linear = |g: &mut Graph, x: ValueId, prefix: &str, out: usize, inp: usize, bias: bool| w.linear(g, x, prefix, out, inp, bias);
    let norm = |g: &mut Graph, x: ValueId, name: &str, len: usize| -> Result<ValueId> {
        let weight = w.weight(g, name, &[len])?;
        Ok(g.add(Op::RmsNorm { eps: c.rms_norm_eps }, &[x, weight]))
    };

    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        let n = if opts.post_norms { x } else { norm(&mut g, x, &format!("{p}.input_layernorm.weight"), h)? };
        let (q, k, vv) = (
            linear(&mut g, n, &format!("{p}.self_attn.q_proj"), nh * hd, h, c.qkv_bias)?,
            linear(&mut g, n, &format!("{p}.self_attn.k_proj"), nkv * hd, h, c.qkv_bias)?,
            linear(&mut g, n, &format!("{p}.self_attn.v_proj"), nkv * hd, h, c.qkv_bias)?,
        );
        let (q, k) = match opts.qk_norm {
            QkNorm::None => (q, k),
            QkNorm::PerHead => (
                norm(&mut g, q, &format!("{p}.self_attn.q_norm.weight"), hd)?,
                norm(&mut g, k, &format!("{p}.self_attn.k_norm.weight"), hd)?,
            ),
            QkNorm::Full => (
                norm(&mut g, q, &format!("{p}.self_attn.q_norm.weight"), nh * hd)?,
                norm(&mut g, k, &format!("{p}.self_attn.k_norm.weight"), nkv * hd)?,
            ),
        };
        let rope = Op::Rope { head_dim: hd as u32, theta: c.rope_theta, scaling: c.rope_scaling.clone() };
        let q = g.add(rope.clone(), &[q, positions]);
        let k = g.add(rope, &[k, positions]);
        let attn = Op::Attention {
            layer: l as u32,
            heads: nh as u32,
            kv_heads: nkv as u32,
            head_dim: hd as u32,
            // YaRN's attention factor scales cos and sin in transformers, so q and
            // k both carry it: the scores carry its square (1 for other scalings).
            scale: opts.attention_scale.unwrap_or(1.0 / (hd as f32).sqrt())
                * crate::graph::rope::attention_factor(&c.rope_scaling).powi(2),
            // Every layer, or those `layer_types` slides (gpt-oss).
            window: c.sliding_window.filter(|_| c.sliding_layers.as_ref().is_none_or(|s| s[l])).map(|s| s as u32),
            softcap: None,
            causal: true,
            sinks: opts.sinks,
        };
        let a = if opts.sinks {
            let sinks = w.weight(&mut g, &format!("{p}.self_attn.sinks"), &[nh])?;
            g.add(attn, &[q, k, vv, positions, sinks])
        } else {
            g.add(attn, &[q, k, vv, positions])
        };
        let mut o = linear(&mut g, a, &format!("{p}.self_attn.o_proj"), h, nh * hd, c.o_bias)?;
        if opts.post_norms {
            o = norm(&mut g, o, &format!("{p}.post_attention_layernorm.weight"), h)?;
        }
        let o = scale(&mut g, o, opts.residual_multiplier, BinaryOp::Mul);
        x = g.add(Op::Binary(BinaryOp::Add), &[x, o]);

        let n = if opts.post_norms { x } else { norm(&mut g, x, &format!("{p}.post_attention_layernorm.weight"), h)? };
        let mut d = if c.moe.as_ref().is_some_and(|m| m.sparse_layers[l]) {
            super::moe::routed_mlp(&mut g, w, n, model, l)?
        } else {
            let (gate, up) = (linear(&mut g, n, &format!("{p}.mlp.gate_proj"), i, h, c.mlp_bias)?, linear(&mut g, n, &format!("{p}.mlp.up_proj"), i, h, c.mlp_bias)?);
            let act = g.add(Op::Unary(UnaryOp::Silu), &[gate]);
            let m = g.add(Op::Binary(BinaryOp::Mul), &[act, up]);
            linear(&mut g, m, &format!("{p}.mlp.down_proj"), h, i, c.mlp_bias)?
        };
        if opts.post_norms {
            d = norm(&mut g, d, &format!("{p}.post_feedforward_layernorm.weight"), h)?;
        }
        let d = scale(&mut g, d, opts.residual_multiplier, BinaryOp::Mul);
        x = g.add(Op::Binary(BinaryOp::Add), &[x, d]);
    }
    let x = norm(&mut g, x, "model.norm.weight", h)?;
    let head = if c.tie_word_embeddings {
        // Some tied checkpoints still carry an lm_head copy; the embedding is authoritative.
        embed
    } else {
        w.weight(&mut g, "lm_head.weight", &[v, h])?
    };
    let logits = g.add(Op::MatMul, &[x, head]);
    let logits = scale(&mut g, logits, opts.logits_divisor, BinaryOp::Div);
    g.output("logits", logits);
    Ok(g)
}
