//! Canonicalize: put leaves (inputs, weights, constants) first, in their original order.
//!
//! Leaves have no inputs, so moving them to the front keeps the graph topologically
//! ordered; afterwards every weight is defined before any compute node, which lets
//! later passes (stack-linear) combine weights at the first consumer.

use super::{copy_node, Pass};
use crate::error::Result;
use crate::graph::{Graph, ValueId};

pub struct Canonicalize;

impl Pass for Canonicalize {
    fn name(&self) -> &'static str {
        "canonicalize"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let leaves = graph.nodes.iter().enumerate().filter(|(_, n)| n.inputs.is_empty() && n.op.arity() == Some(0));
        let order: Vec<usize> = leaves
            .map(|(i, _)| i)
            .chain(graph.nodes.iter().enumerate().filter(|(_, n)| !(n.inputs.is_empty() && n.op.arity() == Some(0))).map(|(i, _)| i))
            .collect();
        let mut map = vec![ValueId(u32::MAX); graph.nodes.len()];
        let mut out = Graph::new(graph.name.clone());
        for i in order {
            let node = &graph.nodes[i];
            let inputs = node.inputs.iter().map(|v| map[v.index()]).collect();
            map[i] = copy_node(&mut out, node, inputs);
        }
        out.outputs = graph.outputs.iter().map(|(n, v)| (n.clone(), map[v.index()])).collect();
        *graph = out;
        Ok(())
    }
}
