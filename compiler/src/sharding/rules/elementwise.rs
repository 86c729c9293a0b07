//! Sharding rules for element-wise ops (`neg`, `exp`, `silu`, ..., `add`, `mul`, ...).
//!
//! A column-sharded left operand keeps its placement; the right operand is split
//! to match (a `[width]` row of constants by `axis 0`, an activation by columns,
//! a scalar stays replicated). Partial sums stay partial through linear ops only:
//! the sum or difference of two partial sums, negation, and scaling by a constant.
//! Everything else needs whole values.

use super::{Decision, RuleCtx, COLUMNS};
use crate::graph::{BinaryOp, Graph, Op, Placement, UnaryOp, ValueId};

pub fn decide(g: &Graph, id: ValueId, have: &[Placement], _ctx: &RuleCtx) -> Decision {
    let node = g.node(id);
    match &node.op {
        Op::Unary(u) => match have[0] {
            Placement::PartialSum if *u != UnaryOp::Neg => Decision::replicated(1),
            p => Decision { inputs: vec![p], output: p },
        },
        Op::Binary(b) => {
            let rhs = g.ty(node.inputs[1]);
            let width = node.ty.last_dim().unwrap_or(0);
            let scalar = rhs.num_elements() == Some(1);
            let row = !scalar && rhs.rank() == 1;
            let constant_rhs = is_constant(g, node.inputs[1]);
            match (have[0], have[1]) {
                (COLUMNS, _) => {
                    let rhs_placement = if scalar {
                        Placement::Replicated
                    } else if row && rhs.last_dim() == Some(width) {
                        Placement::Sharded { axis: 0 }
                    } else {
                        COLUMNS
                    };
                    Decision { inputs: vec![COLUMNS, rhs_placement], output: COLUMNS }
                }
                (Placement::PartialSum, Placement::PartialSum) if matches!(b, BinaryOp::Add | BinaryOp::Sub) => {
                    Decision { inputs: vec![Placement::PartialSum; 2], output: Placement::PartialSum }
                }
                (Placement::PartialSum, _) if matches!(b, BinaryOp::Mul | BinaryOp::Div) && constant_rhs && (scalar || row) => {
                    Decision { inputs: vec![Placement::PartialSum, Placement::Replicated], output: Placement::PartialSum }
                }
                _ => Decision::replicated(2),
            }
        }
        _ => unreachable!("dispatched by the rule table"),
    }
}

/// Element-wise readers keep columns sharded when their result may stay so.
pub fn accepts_columns(g: &Graph, id: ValueId, _slot: usize, out_ok: bool) -> bool {
    match &g.node(id).op {
        Op::Unary(_) => out_ok,
        // The left operand sets the placement; a sharded right operand alone would
        // make the left one be sliced, which is only worth it on the way to a
        // sharded reader.
        Op::Binary(_) => out_ok,
        _ => false,
    }
}

/// Whether `v` depends on weights and literals only.
fn is_constant(g: &Graph, v: ValueId) -> bool {
    let node = g.node(v);
    match node.op {
        Op::Weight { .. } | Op::Constant { .. } => true,
        Op::Input { .. } => false,
        _ => !node.op.has_side_effects() && node.inputs.iter().all(|&i| is_constant(g, i)),
    }
}
