//! Quantize: choose the storage encoding of each weight (`--quantization-encoding`
//! for the linear layers, `--embedding-encoding` for the token embedding table
//! and the lm_head, which are one tensor when tied). Norm weights, biases and
//! other small tensors always stay float32.
//!
//! Defaults: the embedding and lm_head take the linear layers' encoding under
//! float encodings (bfloat16 / float16: measured to keep every fixture's top-1 and
//! KL the same as with a float32 lm_head) and q8_0 under block encodings, as in
//! llama.cpp's quantized files (4-bit vocabulary projections flip top tokens). A weight whose row length is not
//! a whole number of the encoding's blocks falls back: q4_k to q4_1 (rows that are
//! whole 32-blocks but not 256-blocks, e.g. SmolLM2's 576-wide projections; llama.cpp
//! falls back to q5_0 there), q6_k to q8_0 (as llama.cpp), anything else to float32.
//!
//! `--quantization-encoding stored` instead keeps each weight's checkpoint
//! encoding where there are integer kernels for it (F16, BF16, Q8_0, Q4_0,
//! Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K), and the nearest more precise one
//! otherwise (GGUF Q2_K / Q3_K: q4_k; F32: float32); a stacked projection takes its most precise part's.
//!
//! Only the types' `quant` changes; the interpreter, the scheduler and the writer
//! all read values through it, so the reference interpreter remains the oracle.

use super::Pass;
use crate::error::Result;
use crate::graph::{Graph, Op, WeightEncoding, ValueId};

pub struct Quantize {
    /// The encoding of the linear layers' weights.
    pub encoding: WeightEncoding,
    /// The encoding of the embedding table and lm_head; `None` picks the default.
    pub embedding: Option<WeightEncoding>,
    /// `--quantization-encoding stored`: each weight's encoding by name, for
    /// every weight (the embedding and lm_head too, unless `embedding` names one);
    /// a stack of weights takes its most precise part's.
    pub stored: Option<std::sync::Arc<std::collections::HashMap<String, WeightEncoding>>>,
}

/// Under `stored`, the encoding of weight `w` (a stack: its most precise part's).
fn stored_encoding(graph: &Graph, w: ValueId, stored: &std::collections::HashMap<String, WeightEncoding>) -> WeightEncoding {
    match &graph.node(w).op {
        Op::Weight { name, .. } => stored.get(name).copied().unwrap_or(WeightEncoding::Float32),
        Op::Concat { .. } => graph
            .node(w)
            .inputs
            .iter()
            .map(|&i| stored_encoding(graph, i, stored))
            // The first of the most precise.
            .reduce(|best, q| if crate::quant::bits_per_value(q) > crate::quant::bits_per_value(best) { q } else { best })
            .unwrap_or(WeightEncoding::Float32),
        _ => WeightEncoding::Float32,
    }
}

/// The encoding a weight with rows of `cols` values gets when `wanted` is asked for.
pub fn fitting(wanted: WeightEncoding, cols: u64) -> WeightEncoding {
    let fits = |q: WeightEncoding| cols.is_multiple_of(q.block());
    if fits(wanted) {
        wanted
    } else if wanted == WeightEncoding::Q4K && fits(WeightEncoding::Q4_1) {
        WeightEncoding::Q4_1
    } else if wanted == WeightEncoding::Q6K && fits(WeightEncoding::Q8_0) {
        // As llama.cpp falls back from Q6_K (never less precise).
        WeightEncoding::Q8_0
    } else {
        WeightEncoding::Float32
    }
}

/// Marks a weight (or every weight of a stacked concat) with `q`.
fn mark(graph: &mut Graph, v: ValueId, q: WeightEncoding) {
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
        let embedding = self.embedding.unwrap_or(if self.encoding.is_block() { WeightEncoding::Q8_0 } else { self.encoding });
        if self.encoding == WeightEncoding::Float32 && embedding == WeightEncoding::Float32 && self.stored.is_none() {
            return Ok(());
        }
        // The lm_head is the weight of the matmul that produces the logits.
        let logits = graph.outputs.iter().find(|(n, _)| n == "logits").map(|(_, v)| *v);
        let lm_head = logits.and_then(|v| match graph.node(v).op {
            Op::MatMul | Op::MatMulAdd => Some(graph.node(v).inputs[1]),
            _ => None,
        });
        let tables: Vec<ValueId> = graph.nodes.iter().filter(|n| n.op == Op::Embedding).map(|n| n.inputs[0]).collect();
        // A weight is encoded only when every use reads it through a kernel that
        // decodes encodings: as a matmul's right operand or an embedding table.
        let mut other_use = vec![false; graph.nodes.len()];
        for node in &graph.nodes {
            for (slot, input) in node.inputs.iter().enumerate() {
                let decoded = match node.op {
                    Op::MatMul | Op::MatMulAdd | Op::Embedding => slot == if node.op == Op::Embedding { 0 } else { 1 },
                    // The experts' stacked projections; the router stays
                    // float32, as llama.cpp keeps it (`ffn_gate_inp`): the
                    // choice of experts compares its logits.
                    Op::Moe { .. } => slot == 2 || slot == 3,
                    _ => false,
                };
                if !decoded {
                    other_use[input.index()] = true;
                }
            }
        }
        let mut chosen: Vec<(ValueId, WeightEncoding)> = Vec::new();
        for id in graph.ids() {
            let node = graph.node(id);
            let ws: Vec<ValueId> = match node.op {
                Op::MatMul | Op::MatMulAdd => vec![node.inputs[1]],
                Op::Embedding => vec![node.inputs[0]],
                Op::Moe { .. } => node.inputs[2..4].to_vec(),
                _ => continue,
            };
            for w in ws {
                if other_use[w.index()] || chosen.iter().any(|(v, _)| *v == w) {
                    continue;
                }
                let table = Some(w) == lm_head || tables.contains(&w);
                let wanted = match &self.stored {
                    Some(_) if table && self.embedding.is_some() => embedding,
                    Some(stored) => stored_encoding(graph, w, stored),
                    None if table => embedding,
                    None => self.encoding,
                };
                let cols = graph.ty(w).last_dim().unwrap_or(1);
                chosen.push((w, fitting(wanted, cols)));
            }
        }
        for (w, q) in chosen {
            if q != WeightEncoding::Float32 {
                mark(graph, w, q);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_falls_back_to_q4_1_then_float32() {
        assert_eq!(fitting(WeightEncoding::Q4K, 1536), WeightEncoding::Q4K);
        assert_eq!(fitting(WeightEncoding::Q4K, 576), WeightEncoding::Q4_1);
        assert_eq!(fitting(WeightEncoding::Q8_0, 40), WeightEncoding::Float32);
        assert_eq!(fitting(WeightEncoding::BFloat16, 40), WeightEncoding::BFloat16);
    }
}
