//! Sharding rules for `matmul` / `matmul_add` (`x[m, k] @ w[n, k]^T`): tensor
//! parallelism's two cuts.
//!
//! - Column-parallel: `x` replicated, `w` split by rows (`Sharded { axis: 0 }`,
//!   output features): the result is `Sharded { axis: 1 }`. Chosen when the
//!   result can stay sharded for all its readers (Q/K/V, gate/up, lm_head).
//! - Row-parallel: `x` arrives `Sharded { axis: 1 }`, `w` split by columns
//!   (`Sharded { axis: 1 }`, input features): each device holds a partial sum of
//!   the result (o_proj, down_proj), reduced where a reader needs the whole.

use super::{splits, width, Decision, RuleCtx, COLUMNS};
use crate::graph::{Graph, Op, Placement, ValueId};

pub fn decide(g: &Graph, id: ValueId, have: &[Placement], ctx: &RuleCtx) -> Decision {
    let node = g.node(id);
    let w = g.ty(node.inputs[1]);
    let (n, k) = (w.shape[0].fixed().unwrap_or(0), w.shape[1].fixed().unwrap_or(0));
    let add = node.op == Op::MatMulAdd;
    if have[0] == COLUMNS && splits(k, ctx.devices) && !add {
        return Decision { inputs: vec![COLUMNS, Placement::Sharded { axis: 1 }], output: Placement::PartialSum };
    }
    if ctx.want_sharded && splits(n, ctx.devices) {
        let mut inputs = vec![Placement::Replicated, Placement::Sharded { axis: 0 }];
        if add {
            // The residual or bias is split like the result.
            inputs.push(if g.ty(node.inputs[2]).rank() == 1 { Placement::Sharded { axis: 0 } } else { COLUMNS });
        }
        return Decision { inputs, output: COLUMNS };
    }
    Decision::replicated(node.inputs.len())
}

/// Row-parallel matmuls read a column-sharded `x` as it is.
pub fn accepts_columns(g: &Graph, id: ValueId, slot: usize, ctx: &RuleCtx) -> bool {
    slot == 0 && splits(width(g, g.node(id).inputs[0]), ctx.devices)
}
