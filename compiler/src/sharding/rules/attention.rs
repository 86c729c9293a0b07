//! Sharding rules for `rope` and `attention`: heads are independent, so a mesh of
//! N devices gives each `heads / N` query heads and `kv_heads / N` KV heads (whole
//! GQA groups), with a KV cache of its own heads only. RoPE rotates within a head
//! and follows its input. Attention that cannot be split (the policy, or KV heads
//! that do not divide) runs replicated on every device.

use super::{splits, width, Decision, RuleCtx, COLUMNS};
use crate::graph::{Graph, Op, Placement, ValueId};

/// Whether a `[seq, heads * head_dim]` value of node `v`'s input splits on head boundaries.
fn whole_heads(g: &Graph, id: ValueId, ctx: &RuleCtx) -> bool {
    let node = g.node(id);
    match node.op {
        Op::Rope { head_dim, .. } => {
            let w = width(g, node.inputs[0]);
            splits(w, ctx.devices) && (w / ctx.devices).is_multiple_of(head_dim as u64)
        }
        // The sinks are one per head and would need splitting too: not yet.
        Op::Attention { heads, kv_heads, sinks: false, .. } => {
            ctx.split_attention && splits(kv_heads as u64, ctx.devices) && splits(heads as u64, ctx.devices)
        }
        _ => false,
    }
}

pub fn decide(g: &Graph, id: ValueId, have: &[Placement], ctx: &RuleCtx) -> Decision {
    let node = g.node(id);
    match node.op {
        Op::Rope { .. } if have[0] == COLUMNS && whole_heads(g, id, ctx) => {
            Decision { inputs: vec![COLUMNS, Placement::Replicated], output: COLUMNS }
        }
        Op::Attention { .. } if have[..3].iter().all(|p| *p == COLUMNS) && whole_heads(g, id, ctx) => {
            Decision { inputs: vec![COLUMNS, COLUMNS, COLUMNS, Placement::Replicated], output: COLUMNS }
        }
        _ => Decision::replicated(node.inputs.len()),
    }
}

pub fn accepts_columns(g: &Graph, id: ValueId, slot: usize, out_ok: bool, ctx: &RuleCtx) -> bool {
    let node = g.node(id);
    match node.op {
        Op::Rope { .. } => slot == 0 && out_ok && whole_heads(g, id, ctx),
        // Attention splits only if q, k and v all can: a v split alone would be
        // gathered straight back (OLMo-2 normalizes q and k over the whole width).
        _ => slot < 3 && out_ok && whole_heads(g, id, ctx) && node.inputs[..3].iter().all(|&x| splittable_heads(g, x, ctx)),
    }
}

/// Whether `v` comes from a matmul through head-local ops only (bias adds,
/// per-head norms, RoPE), so that it can be computed split by heads.
fn splittable_heads(g: &Graph, mut v: ValueId, ctx: &RuleCtx) -> bool {
    loop {
        let node = g.node(v);
        match node.op {
            Op::MatMul | Op::MatMulAdd => return super::splits(super::width(g, v), ctx.devices),
            Op::Rope { .. } => v = node.inputs[0],
            Op::RmsNorm { .. } if super::width(g, node.inputs[1]) < super::width(g, node.inputs[0]) => v = node.inputs[0],
            Op::Binary(_) if g.ty(node.inputs[1]).rank() <= 1 => v = node.inputs[0],
            _ => return false,
        }
    }
}

/// The attention op of one device: its share of the heads.
pub fn local_attention(op: &Op, devices: u32) -> Op {
    match op {
        Op::Attention { layer, heads, kv_heads, head_dim, scale, window, softcap, causal, sinks } => Op::Attention {
            layer: *layer,
            heads: heads / devices,
            kv_heads: kv_heads / devices,
            head_dim: *head_dim,
            scale: *scale,
            window: *window,
            softcap: *softcap,
            causal: *causal,
            sinks: *sinks,
        },
        other => other.clone(),
    }
}
