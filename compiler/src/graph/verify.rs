//! The graph verifier. It checks, for every graph a pass produces:
//!
//! 1. Every input of a node refers to an earlier node (nodes are topologically ordered).
//! 2. Every node's stored type equals the type inferred from its op and inputs.
//! 3. The graph has at least one output, every output refers to an existing node,
//!    and output names are unique.
//! 4. Input names are unique, and each attention layer index appears at most once
//!    (each layer owns one slot of the KV cache).

use std::collections::HashSet;

use super::infer::infer_type;
use super::ir::*;
use crate::error::{Error, Result};

/// Checks every invariant listed in the module docs.
pub fn verify(graph: &Graph) -> Result<()> {
    let fail = |msg: String| Err(Error::Verify(format!("graph `{}`: {msg}", graph.name)));
    let mut input_names = HashSet::new();
    let mut layers = HashSet::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        let id = ValueId(i as u32);
        for &input in &node.inputs {
            if input.index() >= i {
                return fail(format!("{id} ({}) uses {input}, which is not defined before it", node.op.mnemonic()));
            }
        }
        match infer_type(graph, &node.op, &node.inputs) {
            Ok(ty) if ty == node.ty => {}
            Ok(ty) => {
                return fail(format!(
                    "{id} ({}) is typed {:?} but its op and inputs give {:?}",
                    node.op.mnemonic(),
                    node.ty,
                    ty
                ))
            }
            Err(e) => return fail(format!("{id} ({}): {e}", node.op.mnemonic())),
        }
        match &node.op {
            Op::Input { name, .. } if !input_names.insert(name.clone()) => {
                return fail(format!("input `{name}` is declared twice"))
            }
            Op::Attention { layer, .. } if !layers.insert(*layer) => {
                return fail(format!("attention layer {layer} appears twice"))
            }
            _ => {}
        }
    }
    if graph.outputs.is_empty() {
        return fail("the graph has no outputs".into());
    }
    let mut names = HashSet::new();
    for (name, v) in &graph.outputs {
        if v.index() >= graph.nodes.len() {
            return fail(format!("output `{name}` refers to {v}, which does not exist"));
        }
        if !names.insert(name) {
            return fail(format!("output `{name}` is declared twice"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Graph {
        let mut g = Graph::new("t");
        let x = g.add(Op::Input { name: "x".into(), ty: TensorType::fixed(DType::F32, &[2, 4]) }, &[]);
        let w = g.add(Op::Weight { name: "w".into(), ty: TensorType::fixed(DType::F32, &[3, 4]), shard: None }, &[]);
        let y = g.add(Op::MatMul, &[x, w]);
        g.output("y", y);
        g
    }

    #[test]
    fn accepts_a_well_formed_graph() {
        verify(&small()).unwrap();
    }

    #[test]
    fn rejects_use_before_definition() {
        let mut g = small();
        g.nodes[2].inputs[0] = ValueId(2);
        let e = verify(&g).unwrap_err().to_string();
        assert!(e.contains("not defined before"), "{e}");
    }

    #[test]
    fn rejects_a_stale_type() {
        let mut g = small();
        g.nodes[2].ty = TensorType::fixed(DType::F32, &[2, 4]);
        let e = verify(&g).unwrap_err().to_string();
        assert!(e.contains("is typed"), "{e}");
    }

    #[test]
    fn rejects_ill_typed_inputs() {
        let mut g = small();
        g.nodes[1].op = Op::Weight { name: "w".into(), ty: TensorType::fixed(DType::F32, &[3, 5]), shard: None };
        g.nodes[1].ty = TensorType::fixed(DType::F32, &[3, 5]);
        let e = verify(&g).unwrap_err().to_string();
        assert!(e.contains("inner dims differ"), "{e}");
    }

    #[test]
    fn rejects_missing_and_duplicate_outputs() {
        let mut g = small();
        g.outputs.clear();
        assert!(verify(&g).unwrap_err().to_string().contains("no outputs"));
        let mut g = small();
        g.outputs.push(("y".into(), ValueId(1)));
        assert!(verify(&g).unwrap_err().to_string().contains("declared twice"));
        let mut g = small();
        g.outputs[0].1 = ValueId(99);
        assert!(verify(&g).unwrap_err().to_string().contains("does not exist"));
    }

    #[test]
    fn rejects_duplicate_attention_layers() {
        let mut g = Graph::new("t");
        let seq = || vec![Dim::Sym(SymDim::Seq), Dim::Fixed(8)];
        let q = g.add(Op::Input { name: "q".into(), ty: TensorType::new(DType::F32, seq()) }, &[]);
        let p = g.add(Op::Input { name: "p".into(), ty: TensorType::new(DType::I32, vec![Dim::Sym(SymDim::Seq)]) }, &[]);
        let att = Op::Attention { layer: 0, heads: 2, kv_heads: 2, head_dim: 4, scale: 0.5, window: None, softcap: None, causal: true, sinks: false };
        let a = g.add(att.clone(), &[q, q, q, p]);
        let b = g.add(att, &[a, a, a, p]);
        g.output("o", b);
        assert!(verify(&g).unwrap_err().to_string().contains("layer 0 appears twice"));
    }
}
