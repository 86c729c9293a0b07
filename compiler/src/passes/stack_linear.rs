//! Stack-linear: matmuls that share their left operand (Q/K/V, gate/up) become one
//! matmul against the concatenated weights, followed by one slice per original.
//!
//! Expects canonicalized input (all weights defined before any compute node), so the
//! stacked matmul can be emitted where the first member of each group stood.
//!
//! Under `--quantization-encoding stored` only weights that keep one encoding
//! stack: a stack has one encoding, and a llama.cpp mixture's Q / K (Q5_0) and V
//! (Q8_0) stacked would all be widened to the most precise (SmolLM2's Q4_K_M:
//! 2.2 MiB more, in a 101 MiB artifact), where an unstacked V costs one launch
//! per layer.

use std::collections::HashMap;
use std::sync::Arc;

use super::{copy_node, rewrite, Pass};
use crate::error::Result;
use crate::graph::{Graph, Op, ValueId, WeightEncoding};

#[derive(Default)]
pub struct StackLinear {
    /// `--quantization-encoding stored`: each weight's encoding by name (as the
    /// quantize pass reads it); weights stack only with weights of their own.
    pub stored: Option<Arc<HashMap<String, WeightEncoding>>>,
}

impl Pass for StackLinear {
    fn name(&self) -> &'static str {
        "stack-linear"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        // Group matmuls by (lhs, weight dtype, stored encoding); members keep
        // their original order.
        let mut groups: HashMap<(ValueId, String, Option<WeightEncoding>), Vec<ValueId>> = HashMap::new();
        for id in graph.ids() {
            let n = graph.node(id);
            if n.op != Op::MatMul {
                continue;
            }
            if let Op::Weight { name, .. } = &graph.node(n.inputs[1]).op {
                let stored = self.stored.as_ref().map(|s| s.get(name).copied().unwrap_or(WeightEncoding::Float32));
                let key = (n.inputs[0], graph.ty(n.inputs[1]).dtype.name().to_string(), stored);
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
