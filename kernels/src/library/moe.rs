//! Mixture-of-experts kernels: the router's top-k, the grouping of a step's
//! rows by expert, the expert-gathering matmuls and the weighted sum.

/// How a router's logits over the experts become the chosen experts and their
/// weights: the family's rule (one vocabulary for the graph IR's `moe` op and
/// its kernels).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MoeRouting {
    /// The softmax over every expert's logit, then the `top_k` largest
    /// probabilities; with `renormalize` those divided by their sum (Qwen3-MoE
    /// with `norm_topk_prob`, llama.cpp's `norm_w`), else as they are.
    SoftmaxTopK { renormalize: bool },
    /// The `top_k` largest logits, then the softmax over them (Mixtral,
    /// gpt-oss): the same weights as the renormalized softmax, computed from
    /// the chosen logits only.
    TopKSoftmax,
}

impl MoeRouting {
    /// The name the graph's text form and kernel names use.
    pub fn name(self) -> &'static str {
        match self {
            MoeRouting::SoftmaxTopK { renormalize: false } => "softmax_topk",
            MoeRouting::SoftmaxTopK { renormalize: true } => "softmax_topk_norm",
            MoeRouting::TopKSoftmax => "topk_softmax",
        }
    }

    /// The rule named `name` ([`MoeRouting::name`]).
    pub fn from_name(name: &str) -> Option<MoeRouting> {
        [MoeRouting::SoftmaxTopK { renormalize: false }, MoeRouting::SoftmaxTopK { renormalize: true }, MoeRouting::TopKSoftmax].into_iter().find(|r| r.name() == name)
    }
}
