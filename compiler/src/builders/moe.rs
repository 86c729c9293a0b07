//! Mixture-of-experts decoders: Qwen3MoeForCausalLM (Qwen3's attention, per-head
//! q/k norms), Qwen2MoeForCausalLM (Qwen2's attention; a shared expert behind
//! a sigmoid gate), OlmoeForCausalLM (q/k norms over the whole projections),
//! MixtralForCausalLM (Mistral's) and GptOssForCausalLM (attention
//! sinks, q/k/v/o biases, sliding and full layers alternating, YaRN; a router
//! and experts with biases, the clamped SwiGLU): the Llama decoder whose sparse
//! layers replace the MLP by routed experts, one `moe` node each.
//!
//! The router (`[experts, hidden]`) is the `moe` node's second input, kept in
//! float32 as llama.cpp keeps it (no kernel decodes it: the quantize pass
//! leaves it); a shared expert beside the routed ones is ordinary nodes around
//! the `moe` node, a router bias a further input to add to the op. The
//! experts' projections are stacked along their rows, gate then up for each
//! expert in `gate_up` (`[experts * 2f, hidden]`) and the downs in `down`
//! (`[experts * hidden, f]`): concatenations of checkpoint weights, which the
//! weights table stores as one tensor each without copying at import.

use super::llama::{build_decoder, DecoderOptions, QkNorm};
use super::WeightBinder;
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use crate::import::{expert_names, Architecture, ImportedModel};

pub fn build(model: &ImportedModel, w: &WeightBinder<'_>) -> Result<Graph> {
    // Qwen2-MoE's attention is Qwen2's (q/k/v biases, from the config).
    let qk_norm = match model.config.architecture {
        Architecture::Qwen3Moe => QkNorm::PerHead,
        // OLMoE normalizes the whole q and k projections, as OLMo 2 does (but before the blocks).
        Architecture::Olmoe => QkNorm::Full,
        _ => QkNorm::None,
    };
    let sinks = model.config.architecture == Architecture::GptOss;
    build_decoder(model, w, &DecoderOptions { qk_norm, sinks, ..Default::default() })
}

/// Layer `layer`'s routed MLP applied to the normalized `x`: the `moe` node
/// over its router and stacked experts.
pub fn routed_mlp(g: &mut Graph, w: &WeightBinder<'_>, x: ValueId, model: &ImportedModel, layer: usize) -> Result<ValueId> {
    let c = &model.config;
    let moe = c.moe.as_ref().expect("a mixture-of-experts config");
    let (h, f, experts) = (c.hidden_size, moe.expert_intermediate, moe.experts);
    let (prefix, [gate, up, down, _]) = expert_names(c.architecture, layer);
    let router = match c.architecture {
        Architecture::Mixtral => format!("model.layers.{layer}.block_sparse_moe.gate.weight"),
        Architecture::GptOss => format!("model.layers.{layer}.mlp.router.weight"),
        _ => format!("model.layers.{layer}.mlp.gate.weight"),
    };
    let router = w.weight(g, &router, &[experts, h])?;
    // An expert past the configured count: the configuration and the
    // checkpoint disagree (the unused-tensor check would say so too, less
    // plainly).
    let extra = format!("{prefix}{experts}.{gate}.weight");
    if model.weights.get(&extra).is_some() {
        let file = model.weights.file_of(&extra).unwrap_or(&model.source).to_path_buf();
        let e = crate::error::Error::invalid(
            file,
            model.weights.shown_name(&extra),
            format!("the checkpoint has expert {experts} (and maybe more), but {} gives {experts} experts per layer; fix the expert count (num_experts / num_local_experts, or expert_count in a GGUF)", model.weights.config_source()),
        );
        w.problem(e)?;
    }
    let (mut gate_up, mut downs) = (Vec::with_capacity(2 * experts), Vec::with_capacity(experts));
    for e in 0..experts {
        gate_up.push(w.weight(g, &format!("{prefix}{e}.{gate}.weight"), &[f, h])?);
        gate_up.push(w.weight(g, &format!("{prefix}{e}.{up}.weight"), &[f, h])?);
        downs.push(w.weight(g, &format!("{prefix}{e}.{down}.weight"), &[h, f])?);
    }
    let gate_up = g.add(Op::Concat { axis: 0 }, &gate_up);
    let stacked_down = g.add(Op::Concat { axis: 0 }, &downs);
    let mut inputs = vec![x, router, gate_up, stacked_down];
    if moe.biases {
        // gpt-oss: the checkpoints' `gate_up_proj_bias` is read de-interleaved,
        // gate then up per expert (import's view_gpt_oss_experts); a GGUF holds
        // the gate's and the up projection's biases apart (`ffn_gate_exps.bias`,
        // `ffn_up_exps.bias`), joined here per expert (folded at compile time).
        inputs.push(w.weight(g, &format!("model.layers.{layer}.mlp.router.bias"), &[experts])?);
        let (fused, gate_bias) = (format!("{prefix}gate_up_proj_bias"), format!("{prefix}{gate}.bias"));
        if model.weights.get(&fused).is_none() && model.weights.get(&gate_bias).is_some() {
            let parts = [w.weight(g, &gate_bias, &[experts, f])?, w.weight(g, &format!("{prefix}{up}.bias"), &[experts, f])?];
            inputs.push(g.add(Op::Concat { axis: 1 }, &parts));
            inputs.push(w.weight(g, &format!("{prefix}{down}.bias"), &[experts, h])?);
        } else {
            inputs.push(w.weight(g, &fused, &[experts, 2 * f])?);
            inputs.push(w.weight(g, &format!("{prefix}down_proj_bias"), &[experts, h])?);
        }
    }
    if let Some(width) = moe.shared_expert {
        // Qwen2-MoE: the shared expert, an ordinary SwiGLU MLP beside the op,
        // and the gate of its sigmoid, both inputs of the op.
        let p = format!("model.layers.{layer}.mlp");
        let (gate, up) = (w.linear(g, x, &format!("{p}.shared_expert.gate_proj"), width, h, false)?, w.linear(g, x, &format!("{p}.shared_expert.up_proj"), width, h, false)?);
        let act = g.add(Op::Unary(UnaryOp::Silu), &[gate]);
        let m = g.add(Op::Binary(BinaryOp::Mul), &[act, up]);
        let out = w.linear(g, m, &format!("{p}.shared_expert.down_proj"), h, width, false)?;
        inputs.push(w.weight(g, &format!("{p}.shared_expert_gate.weight"), &[1, h])?);
        inputs.push(out);
    }
    let op = Op::Moe { experts: experts as u32, top_k: moe.top_k as u32, routing: moe.routing, activation: moe.activation, biases: moe.biases, shared: moe.shared_expert.is_some() };
    Ok(g.add(op, &inputs))
}
