//! Dead-code elimination: drop nodes that neither reach an output nor have side effects.

use super::Pass;
use crate::error::Result;
use crate::graph::{Graph, ValueId};

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let mut live = vec![false; graph.nodes.len()];
        for (_, v) in &graph.outputs {
            live[v.index()] = true;
        }
        for (i, n) in graph.nodes.iter().enumerate() {
            if n.op.has_side_effects() {
                live[i] = true;
            }
        }
        for i in (0..graph.nodes.len()).rev() {
            if live[i] {
                for v in graph.nodes[i].inputs.clone() {
                    live[v.index()] = true;
                }
            }
        }
        let identity: Vec<ValueId> = graph.ids().collect();
        graph.compact(&live, &identity);
        Ok(())
    }
}
