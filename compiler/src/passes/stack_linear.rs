//! Stack-linear: matmuls that share their left operand (Q/K/V, gate/up) become one
//! matmul against the concatenated weights, followed by one slice per original.
//!
//! Expects canonicalized input (all weights defined before any compute node), so the
//! stacked matmul can be emitted where the first member of each group stood.

use std::collections::HashMap;

use super::{copy_node, rewrite, Pass};
use crate::error::Result;
use crate::graph::{Graph, Op, ValueId};

pub struct StackLinear;

impl Pass for StackLinear {
    fn name(&self) -> &'static str {
        "stack-linear"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        // Group matmuls by (lhs, weight dtype); members keep their original order.
        let mut groups: HashMap<(ValueId, String), Vec<ValueId>> = HashMap::new();
        for id in graph.ids() {
            let n = graph.node(id);
            if n.op == Op::MatMul && matches!(graph.node(n.inputs[1]).op, Op::Weight { .. }) {
                let key = (n.inputs[0], graph.ty(n.inputs[1]).dtype.name().to_string());
                groups.entry(key).or_default().push(id);
            }
        }
        let mut leader: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
        let mut member = HashMap::new();
        // Only weights defined before the first member can be stacked there.
        let defined_before = |members: &Vec<ValueId>| members.iter().all(|m| graph.node(*m).inputs[1] < members[0]);
        for members in groups.into_values().filter(|m| m.len() > 1 && defined_before(m)) {
            for &m in &members {
                member.insert(m, members[0]);
            }
            leader.insert(members[0], members);
        }
        if leader.is_empty() {
            return Ok(());
        }
        let old = graph.clone();
        let mut stacked: HashMap<ValueId, ValueId> = HashMap::new();
        let mut new_of_old: Vec<ValueId> = Vec::with_capacity(old.nodes.len());
        *graph = rewrite(&old, |g, id, node, inputs| {
            let v = if let Some(members) = leader.get(&id) {
                // Every member's weight is a leaf, defined earlier (canonical order).
                let weights: Vec<ValueId> = members.iter().map(|m| new_of_old[old.node(*m).inputs[1].index()]).collect();
                let concat = g.add(Op::Concat { axis: 0 }, &weights);
                let mm = g.add(Op::MatMul, &[inputs[0], concat]);
                let mut start = 0;
                for &m in members {
                    let len = old.ty(old.node(m).inputs[1]).shape[0].fixed().expect("weights are static");
                    let s = g.add(Op::Slice { axis: 1, start, len }, &[mm]);
                    stacked.insert(m, s);
                    start += len;
                }
                stacked[&id]
            } else if member.contains_key(&id) {
                stacked[&id]
            } else {
                copy_node(g, node, inputs)
            };
            new_of_old.push(v);
            Ok(v)
        })?;
        Ok(())
    }
}
