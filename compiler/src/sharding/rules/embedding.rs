//! Sharding rules for `embedding`: the table is split by vocabulary rows
//! (`Sharded { axis: 0 }`); each device looks up the ids in its range and writes
//! zeros for the others, so the result is a partial sum (exactly one device
//! contributes each row). A tied lm_head reads the same split table.

use super::{splits, Decision, RuleCtx};
use crate::graph::{Graph, Placement, ValueId};

pub fn decide(g: &Graph, id: ValueId, _have: &[Placement], ctx: &RuleCtx) -> Decision {
    let table = g.ty(g.node(id).inputs[0]);
    let vocab = table.shape[0].fixed().unwrap_or(0);
    if splits(vocab, ctx.devices) {
        Decision { inputs: vec![Placement::Sharded { axis: 0 }, Placement::Replicated], output: Placement::PartialSum }
    } else {
        Decision::replicated(2)
    }
}
