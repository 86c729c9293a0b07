//! Graph builders: one per architecture family, turning an [`ImportedModel`] into a graph.
//!
//! The graph has two runtime inputs, `tokens: i32[seq]` and `positions: i32[seq]`,
//! and one output, `logits: f32[seq, vocab]`. The symbolic `seq` dim lets the same
//! graph serve prefill (the whole prompt) and decode (one token): attention appends
//! to and reads from the per-layer KV cache, so decode costs O(1) tokens of compute.

pub mod bert;
pub mod gemma2;
pub mod gpt2;
pub mod granite;
pub mod llama;
pub mod moe;
pub mod olmo2;
pub mod phi3;
pub mod qwen3;

use crate::error::{Error, Result};
use crate::graph::{DType, Dim, Graph, Op, SymDim, TensorType, ValueId};
use crate::import::{Architecture, ImportedModel};

/// Builds the graph for `model`, dispatching on its architecture.
pub fn build_graph(model: &ImportedModel) -> Result<Graph> {
    let graph = build_with(model, &WeightBinder::strict(model))?;
    match unused_weights(model, &graph).into_iter().next() {
        Some(e) => Err(e),
        None => Ok(graph),
    }
}

/// Checkpoint tensors the graph does not read: each is an error, because a
/// tensor left out means the checkpoint describes another model than the one
/// built (a `q_proj.bias` with `attention_bias: false`, a layer past
/// `num_hidden_layers`, a tensor of another architecture). Left alone are what
/// transformers itself ignores: cached buffers (RoPE `inv_freq`, GPT-2's causal
/// masks, BERT's `position_ids`), BERT's pooler (mean pooling does not use it)
/// and an lm_head copy beside tied embeddings (transformers ties it to the embedding).
fn unused_weights(model: &ImportedModel, graph: &Graph) -> Vec<Error> {
    let used: std::collections::HashSet<&str> = graph
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Weight { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    let ignored = |name: &str| {
        name.ends_with(".rotary_emb.inv_freq")
            || name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias")
            || name.ends_with("embeddings.position_ids")
            || name.starts_with("pooler.")
            || (name == "lm_head.weight" && model.config.tie_word_embeddings)
    };
    let arch = model.config.architecture.hf_name();
    model
        .weights
        .names()
        .filter(|name| !used.contains(name) && !ignored(name))
        .map(|name| {
            let file = model.weights.file_of(name).unwrap_or(&model.source);
            let keys = match model.weights.config_source() {
                "config.json" => "a config.json key disagrees with the weights (e.g. attention_bias, num_hidden_layers, tie_word_embeddings)",
                _ => "a metadata key disagrees with the weights (e.g. the block count)",
            };
            Error::invalid(
                file,
                model.weights.shown_name(name),
                format!(
                    "the checkpoint has this tensor, but {arch} with this configuration does not use it; \
                     {keys} or the tensor belongs to another model: fix the configuration or remove the tensor"
                ),
            )
        })
        .collect()
}

/// Builds the graph while collecting every missing or misshapen weight instead of
/// stopping at the first (for `maxc check`). Returns the problems found.
pub fn check_weights(model: &ImportedModel) -> Vec<Error> {
    let binder = WeightBinder { model, problems: Some(std::cell::RefCell::new(Vec::new())) };
    match build_with(model, &binder) {
        Ok(graph) => binder.problems.as_ref().expect("collecting").borrow_mut().extend(unused_weights(model, &graph)),
        Err(e) => binder.problems.as_ref().expect("collecting").borrow_mut().push(e),
    }
    binder.problems.expect("collecting").into_inner()
}

fn build_with(model: &ImportedModel, binder: &WeightBinder<'_>) -> Result<Graph> {
    match model.config.architecture {
        Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 => llama::build(model, binder),
        Architecture::Qwen3 => qwen3::build(model, binder),
        Architecture::Olmo2 => olmo2::build(model, binder),
        Architecture::Granite => granite::build(model, binder),
        Architecture::Phi3 => phi3::build(model, binder),
        Architecture::Gemma2 | Architecture::Gemma3 => gemma2::build(model, binder),
        Architecture::Gpt2 => gpt2::build(model, binder),
        Architecture::Bert => bert::build(model, binder),
        Architecture::Qwen3Moe | Architecture::Qwen2Moe | Architecture::Mixtral | Architecture::GptOss | Architecture::Olmoe => moe::build(model, binder),
    }
}

/// Adds weights to a graph after checking that the checkpoint has them with the expected shape.
pub struct WeightBinder<'a> {
    pub model: &'a ImportedModel,
    /// When set, problems are recorded here and building goes on.
    problems: Option<std::cell::RefCell<Vec<Error>>>,
}

impl<'a> WeightBinder<'a> {
    /// A binder that fails at the first problem.
    pub fn strict(model: &'a ImportedModel) -> Self {
        WeightBinder { model, problems: None }
    }

    /// A `weight` node for `name`, which must have `shape`.
    pub fn weight(&self, g: &mut Graph, name: &str, shape: &[usize]) -> Result<ValueId> {
        let problem = match self.model.weights.get(name) {
            None if self.model.weights.skipped_error(name).is_some() => self.model.weights.skipped_error(name),
            None => Some(self.model.weights.missing(&self.model.source, name, self.model.config.architecture.hf_name())),
            Some(entry) if entry.shape != shape => Some(Error::WeightShape {
                path: self.model.weights.file_of(name).unwrap_or(&self.model.source).to_path_buf(),
                name: self.model.weights.shown_name(name),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
                config: self.model.weights.config_source().to_string(),
            }),
            Some(_) => None,
        };
        if let Some(e) = problem {
            match &self.problems {
                Some(list) => list.borrow_mut().push(e),
                None => return Err(e),
            }
        }
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        Ok(g.add(Op::Weight { name: name.to_string(), ty: TensorType::fixed(DType::F32, &dims), shard: None }, &[]))
    }

    /// Reports `e`: an error now, or (for `maxc check`) one more problem.
    pub fn problem(&self, e: Error) -> Result<()> {
        match &self.problems {
            Some(list) => {
                list.borrow_mut().push(e);
                Ok(())
            }
            None => Err(e),
        }
    }

    /// Like [`WeightBinder::weight`], but `None` when the weight is absent.
    pub fn optional(&self, g: &mut Graph, name: &str, shape: &[usize]) -> Result<Option<ValueId>> {
        if self.model.weights.get(name).is_none() {
            return Ok(None);
        }
        self.weight(g, name, shape).map(Some)
    }
}

/// Multi-head attention with the usual 1/sqrt(head_dim) scale, no window and no soft-cap.
pub fn standard_attention(layer: usize, heads: usize, kv_heads: usize, head_dim: usize, causal: bool) -> Op {
    Op::Attention {
        layer: layer as u32,
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: None,
        softcap: None,
        causal,
        sinks: false,
    }
}

/// A scalar f32 constant.
pub fn scalar(g: &mut Graph, value: f32) -> ValueId {
    g.add(Op::Constant { values: vec![value], ty: TensorType::fixed(DType::F32, &[1]) }, &[])
}

impl WeightBinder<'_> {
    /// `LayerNorm(x)` with `{prefix}.weight` and `{prefix}.bias` of length `width`.
    pub fn layer_norm(&self, g: &mut Graph, x: ValueId, prefix: &str, width: usize, eps: f32) -> Result<ValueId> {
        let weight = self.weight(g, &format!("{prefix}.weight"), &[width])?;
        let bias = self.weight(g, &format!("{prefix}.bias"), &[width])?;
        Ok(g.add(Op::LayerNorm { eps }, &[x, weight, bias]))
    }

    /// `x @ W^T + b` with `{prefix}.weight: [out, in]` and, when `bias`, `{prefix}.bias: [out]`.
    pub fn linear(&self, g: &mut Graph, x: ValueId, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<ValueId> {
        let weight = self.weight(g, &format!("{prefix}.weight"), &[out, inp])?;
        let y = g.add(Op::MatMul, &[x, weight]);
        if !bias {
            return Ok(y);
        }
        let b = self.weight(g, &format!("{prefix}.bias"), &[out])?;
        Ok(g.add(Op::Binary(crate::graph::BinaryOp::Add), &[y, b]))
    }
}

/// The `tokens` and `positions` inputs every decoder graph starts with.
pub fn decoder_inputs(g: &mut Graph) -> (ValueId, ValueId) {
    let seq = || TensorType::new(DType::I32, vec![Dim::Sym(SymDim::Seq)]);
    let tokens = g.add(Op::Input { name: "tokens".into(), ty: seq() }, &[]);
    let positions = g.add(Op::Input { name: "positions".into(), ty: seq() }, &[]);
    (tokens, positions)
}
