//! Quantize: choose the storage encoding of the weights of the linear layers
//! (`--quantization-encoding`). The embedding table and the lm_head (which the
//! embedding is when tied) stay float32 by default, as do norm weights, biases and
//! other small tensors: the vocabulary projection decides the top token, and keeping
//! it exact is what keeps top-1 agreement with the float32 model above 99%.
//! Only the type's `quant` changes; the interpreter, the scheduler and the writer
//! all read values through it, so the reference interpreter remains the oracle.

use super::Pass;
use crate::error::Result;
use crate::graph::{Graph, Op, QuantScheme, ValueId};

pub struct Quantize {
    pub encoding: QuantScheme,
}

/// Marks a weight (or every weight of a stacked concat) with `q`.
fn mark(graph: &mut Graph, v: ValueId, q: QuantScheme) {
    let inputs = graph.node(v).inputs.clone();
    let all_weights = inputs.iter().all(|i| matches!(graph.node(*i).op, Op::Weight { .. }));
    let node = &mut graph.nodes[v.index()];
    match &mut node.op {
        Op::Weight { ty, .. } => {
            ty.quant = q;
            node.ty.quant = q;
        }
        Op::Concat { .. } if all_weights => {
            node.ty.quant = q;
            for i in inputs {
                mark(graph, i, q);
            }
        }
        _ => {}
    }
}

impl Pass for Quantize {
    fn name(&self) -> &'static str {
        "quantize"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        if self.encoding == QuantScheme::None {
            return Ok(());
        }
        // The lm_head is the weight of the matmul that produces the logits.
        let logits = graph.outputs.iter().find(|(n, _)| n == "logits").map(|(_, v)| *v);
        let lm_head = logits.and_then(|v| match graph.node(v).op {
            Op::MatMul | Op::MatMulAdd => Some(graph.node(v).inputs[1]),
            _ => None,
        });
        let tables: Vec<ValueId> = graph.nodes.iter().filter(|n| n.op == Op::Embedding).map(|n| n.inputs[0]).collect();
        for id in graph.ids().collect::<Vec<_>>() {
            let node = graph.node(id);
            if let Op::MatMul | Op::MatMulAdd = node.op {
                let w = node.inputs[1];
                if Some(w) != lm_head && !tables.contains(&w) {
                    mark(graph, w, self.encoding);
                }
            }
        }
        Ok(())
    }
}
