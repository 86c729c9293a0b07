//! Sharding rules for shape ops (`slice`, `concat`, `transpose`, `swiglu`) and the
//! reshards themselves: they need whole values (the shard pass runs before
//! stack-linear, so the slices and concatenations it later adds are built on
//! already-sharded values and keep their placement through shape inference).

use super::{Decision, RuleCtx};
use crate::graph::{Graph, Placement, ValueId};

pub fn decide(g: &Graph, id: ValueId, _have: &[Placement], _ctx: &RuleCtx) -> Decision {
    Decision::replicated(g.node(id).inputs.len())
}
