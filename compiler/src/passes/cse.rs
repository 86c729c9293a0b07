//! Common-subexpression elimination: identical pure nodes on identical inputs become one.

use std::collections::HashMap;

use super::{copy_node, rewrite, Pass};
use crate::error::Result;
use crate::graph::Graph;

pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let mut seen = HashMap::new();
        *graph = rewrite(graph, |g, _, node, inputs| {
            if node.op.has_side_effects() {
                return Ok(copy_node(g, node, inputs));
            }
            // The op's Debug form covers every attribute, floats included (bit-exact
            // for the values that print the same).
            let key = (format!("{:?}", node.op), inputs.clone(), node.ty.clone());
            if let Some(&v) = seen.get(&key) {
                return Ok(v);
            }
            let v = copy_node(g, node, inputs);
            seen.insert(key, v);
            Ok(v)
        })?;
        Ok(())
    }
}
