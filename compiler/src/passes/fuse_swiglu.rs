//! Fuse SwiGLU: `silu(slice(x, 0, h)) * slice(x, h, h)` over a stacked gate/up
//! projection `x: [seq, 2h]` becomes one `swiglu(x)`: four kernels (two slices, the
//! activation and the product) become one pass over the matmul's output.

use super::{copy_node, rewrite, Pass};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op, UnaryOp, ValueId};

pub struct FuseSwiGlu;

/// `Some((x, start, len))` when `v` is a column slice of `x`.
fn column_slice(g: &Graph, v: ValueId) -> Option<(ValueId, u64, u64)> {
    match g.node(v).op {
        Op::Slice { axis: 1, start, len } => Some((g.node(v).inputs[0], start, len)),
        _ => None,
    }
}

impl Pass for FuseSwiGlu {
    fn name(&self) -> &'static str {
        "fuse-swiglu"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        *graph = rewrite(graph, |g, _, node, inputs| {
            if node.op == Op::Binary(BinaryOp::Mul) {
                let (a, b) = (inputs[0], inputs[1]);
                if g.node(a).op == Op::Unary(UnaryOp::Silu) {
                    let gate = column_slice(g, g.node(a).inputs[0]);
                    let up = column_slice(g, b);
                    if let (Some((x, 0, h)), Some((x2, h2, h3))) = (gate, up) {
                        let width = g.ty(x).last_dim();
                        if x == x2 && h2 == h && h3 == h && width == Some(2 * h) {
                            return Ok(g.add(Op::SwiGlu, &[x]));
                        }
                    }
                }
            }
            Ok(copy_node(g, node, inputs))
        })?;
        Ok(())
    }
}
