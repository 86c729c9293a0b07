//! Constant folding: evaluate pure ops whose inputs are all constants, and drop
//! `x * 1` and `x + 0` (and `x - 0`, `x / 1`) when the constant only broadcasts.

use std::collections::HashMap;

use super::{copy_node, rewrite, Pass};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, ValueId};
use crate::interp::{Interpreter, Tensor};

pub struct ConstantFold;

/// Folded results larger than this stay as ops (weights are not duplicated as constants).
const MAX_FOLDED_ELEMENTS: u64 = 1 << 16;

impl Pass for ConstantFold {
    fn name(&self) -> &'static str {
        "constant-fold"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let constant = |g: &Graph, v: ValueId| match &g.node(v).op {
            Op::Constant { values, .. } => Some(values.clone()),
            _ => None,
        };
        *graph = rewrite(graph, |g, _, node, inputs| {
            let consts: Option<Vec<Vec<f32>>> = inputs.iter().map(|&v| constant(g, v)).collect();
            let foldable = matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::Concat { .. } | Op::Slice { .. });
            if let (true, Some(_), Some(n)) = (foldable && !inputs.is_empty(), &consts, node.ty.num_elements()) {
                if n <= MAX_FOLDED_ELEMENTS {
                    return Ok(fold(g, node, &inputs));
                }
            }
            if let Op::Binary(op) = node.op {
                if let Some(c) = constant(g, inputs[1]) {
                    let neutral = match op {
                        BinaryOp::Add | BinaryOp::Sub => c.iter().all(|&x| x == 0.0),
                        BinaryOp::Mul | BinaryOp::Div => c.iter().all(|&x| x == 1.0),
                        BinaryOp::Max => false,
                    };
                    if neutral && g.ty(inputs[0]) == &node.ty {
                        return Ok(inputs[0]);
                    }
                }
            }
            Ok(copy_node(g, node, inputs))
        })?;
        Ok(())
    }
}

/// Evaluates `node` on constant inputs with the reference interpreter.
fn fold(g: &mut Graph, node: &crate::graph::Node, inputs: &[ValueId]) -> ValueId {
    let mut sub = Graph::new("fold");
    let args: Vec<ValueId> = inputs.iter().map(|&v| copy_node(&mut sub, g.node(v), vec![])).collect();
    let out = copy_node(&mut sub, node, args);
    sub.output("out", out);
    let weights: HashMap<String, Vec<f32>> = HashMap::new();
    let mut interp = Interpreter::new(&sub, &weights);
    let result: Tensor = interp.run(&HashMap::new()).expect("constant subgraphs evaluate").remove("out").unwrap();
    g.push_typed(Op::Constant { values: result.as_f32().to_vec(), ty: node.ty.clone() }, vec![], node.ty.clone())
}
