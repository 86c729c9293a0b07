//! Sharding rules for normalizations and reductions over the last axis
//! (`rms_norm`, `layer_norm`, `l2_normalize`, `mean_rows`).
//!
//! A norm over groups of one head (Qwen 3 / Gemma 3 q/k norms, OLMo-2 style)
//! works on whole heads, so it runs on column-sharded heads as they are when
//! every device holds whole heads. A norm over the full width needs the whole
//! row: its input is reduced or gathered first.

use super::{splits, width, Decision, RuleCtx, COLUMNS};
use crate::graph::{Graph, Op, Placement, ValueId};

/// Whether rms_norm `id` normalizes groups that never straddle two devices' columns.
fn per_group(g: &Graph, id: ValueId, ctx: &RuleCtx) -> bool {
    let node = g.node(id);
    let (w, group) = (width(g, node.inputs[0]), width(g, node.inputs[1]));
    group > 0 && group < w && splits(w, ctx.devices) && (w / ctx.devices).is_multiple_of(group)
}

pub fn decide(g: &Graph, id: ValueId, have: &[Placement], ctx: &RuleCtx) -> Decision {
    let node = g.node(id);
    match node.op {
        Op::RmsNorm { .. } if have[0] == COLUMNS && per_group(g, id, ctx) => {
            Decision { inputs: vec![COLUMNS, Placement::Replicated], output: COLUMNS }
        }
        _ => Decision::replicated(node.inputs.len()),
    }
}

pub fn accepts_columns(g: &Graph, id: ValueId, slot: usize, out_ok: bool, ctx: &RuleCtx) -> bool {
    slot == 0 && out_ok && matches!(g.node(id).op, Op::RmsNorm { .. }) && per_group(g, id, ctx)
}
