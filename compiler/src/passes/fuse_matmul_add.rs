//! Fuse matmul + add: `add(matmul(x, w), r)` (or `add(r, matmul(x, w))` with `r` of
//! the same shape) becomes `matmul_add(x, w, r)` when the matmul has no other use:
//! the residual (or bias) is added as the matmul's epilogue, saving a kernel and a
//! pass over the activations.

use super::{copy_node, rewrite, use_counts, Pass};
use crate::error::Result;
use crate::graph::{BinaryOp, Graph, Op};

pub struct FuseMatMulAdd;

impl Pass for FuseMatMulAdd {
    fn name(&self) -> &'static str {
        "fuse-matmul-add"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let uses = use_counts(graph);
        let old = graph.clone();
        *graph = rewrite(&old, |g, _, node, inputs| {
            if node.op == Op::Binary(BinaryOp::Add) {
                for (mm_at, other_at) in [(0, 1), (1, 0)] {
                    let (mm_old, mm) = (node.inputs[mm_at], inputs[mm_at]);
                    let addend = inputs[other_at];
                    let single_use = uses[mm_old.index()] == 1;
                    // Swapping the operands is only valid when no broadcast is involved.
                    let same_shape = g.ty(addend) == g.ty(mm);
                    if g.node(mm).op == Op::MatMul && single_use && (mm_at == 0 || same_shape) {
                        let (x, w) = (g.node(mm).inputs[0], g.node(mm).inputs[1]);
                        if crate::graph::infer::infer_type(g, &Op::MatMulAdd, &[x, w, addend]).as_ref() == Ok(&node.ty) {
                            return Ok(g.add(Op::MatMulAdd, &[x, w, addend]));
                        }
                    }
                }
            }
            Ok(copy_node(g, node, inputs))
        })?;
        Ok(())
    }
}
