//! The sharding rule table: for every op, which placements its inputs must have
//! and which placement its result then has, given the placements its inputs
//! arrive with. One file per op family; [`decide`] dispatches on the op.
//!
//! Rules see the global (unsharded) graph. Where an input arrives in another
//! placement than its rule needs, the shard pass inserts the reshard
//! (`all_reduce`, `all_gather`, `shard_slice`, or a sharded copy of a weight).
//! `graph/infer.rs` (`output_placement`) is the same table read the other way, on the
//! per-device graph: type inference uses it, so every later pass keeps
//! placements right.

pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod norm;
pub mod shape;

use crate::graph::{Graph, Op, Placement, ValueId};

/// What the rules know beyond the op and its inputs.
#[derive(Copy, Clone, Debug)]
pub struct RuleCtx {
    /// Devices in the mesh.
    pub devices: u64,
    /// Whether the result may stay `Sharded { axis: 1 }` for all its readers
    /// (from the shard pass's demand analysis): a matmul is split by columns only
    /// then.
    pub want_sharded: bool,
    /// Whether attention may be split by heads (the policy, and the head counts).
    pub split_attention: bool,
}

/// A rule's answer: the placement each input must have, and the result's.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub inputs: Vec<Placement>,
    pub output: Placement,
}

impl Decision {
    /// Every input and the result replicated: the rule every op can fall back to.
    pub fn replicated(inputs: usize) -> Decision {
        Decision { inputs: vec![Placement::Replicated; inputs], output: Placement::Replicated }
    }
}

/// The columns axis of a `[seq, width]` activation, the one tensor parallelism splits.
pub const COLUMNS: Placement = Placement::Sharded { axis: 1 };

/// The rule for node `id` of the global graph, whose inputs arrive as `have`.
pub fn decide(g: &Graph, id: ValueId, have: &[Placement], ctx: &RuleCtx) -> Decision {
    let node = g.node(id);
    match &node.op {
        Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => Decision::replicated(0),
        Op::Embedding => embedding::decide(g, id, have, ctx),
        Op::MatMul | Op::MatMulAdd => matmul::decide(g, id, have, ctx),
        Op::Unary(_) | Op::Binary(_) => elementwise::decide(g, id, have, ctx),
        Op::RmsNorm { .. } | Op::LayerNorm { .. } | Op::L2Normalize | Op::MeanRows => norm::decide(g, id, have, ctx),
        Op::Rope { .. } | Op::Attention { .. } => attention::decide(g, id, have, ctx),
        Op::SwiGlu | Op::Slice { .. } | Op::Concat { .. } | Op::Transpose | Op::AllReduce | Op::AllGather { .. } | Op::ShardSlice { .. } => {
            shape::decide(g, id, have, ctx)
        }
        // Expert parallelism is a later issue's: every device runs every expert.
        Op::Moe { .. } => Decision::replicated(node.inputs.len()),
    }
}

/// Whether the reader `id` can take input `slot` as `Sharded { axis: 1 }` without
/// a reshard, given whether its own result may stay sharded (`out_ok`).
pub fn accepts_columns(g: &Graph, id: ValueId, slot: usize, out_ok: bool, ctx: &RuleCtx) -> bool {
    match &g.node(id).op {
        Op::MatMul => matmul::accepts_columns(g, id, slot, ctx),
        Op::Unary(_) | Op::Binary(_) => elementwise::accepts_columns(g, id, slot, out_ok),
        Op::RmsNorm { .. } => norm::accepts_columns(g, id, slot, out_ok, ctx),
        Op::Rope { .. } | Op::Attention { .. } => attention::accepts_columns(g, id, slot, out_ok, ctx),
        _ => false,
    }
}

/// The width (last dim) of a value, when static.
pub(crate) fn width(g: &Graph, v: ValueId) -> u64 {
    g.ty(v).last_dim().unwrap_or(0)
}

/// Whether `n` splits into `devices` equal parts.
pub(crate) fn splits(n: u64, devices: u64) -> bool {
    n > 0 && n.is_multiple_of(devices)
}
