//! What the GPU check covers: the golden fixtures, the encodings, the two artifact
//! forms, and the budget each (fixture, encoding) is judged by.

use std::path::{Path, PathBuf};

/// Every weight encoding the GPU path is checked with.
pub const ENCODINGS: [&str; 5] = ["float32", "bfloat16", "q8_0", "q4_1", "q4_k"];

/// GPU-only (`cuda:ARCH`) or fat (`cpu,cuda:ARCH`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Form {
    Gpu,
    Fat,
}

impl Form {
    pub fn name(self) -> &'static str {
        match self {
            Form::Gpu => "gpu",
            Form::Fat => "fat",
        }
    }

    pub fn parse(s: &str) -> Option<Form> {
        match s {
            "gpu" => Some(Form::Gpu),
            "fat" => Some(Form::Fat),
            _ => None,
        }
    }

    /// The `--target` of `maxc compile`.
    pub fn target(self, arch: &str) -> String {
        match self {
            Form::Gpu => format!("cuda:{arch}"),
            Form::Fat => format!("cpu,cuda:{arch}"),
        }
    }
}

/// A text generator, or a sentence encoder (its golden is embeddings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Generator,
    Encoder,
}

/// One fixture: where its model and its goldens are.
#[derive(Clone, Debug)]
pub struct Fixture {
    pub name: String,
    /// What `maxc compile --model` reads: an HF directory or a GGUF file.
    pub model: PathBuf,
    /// The folder of golden.json (and the logits files).
    pub golden: PathBuf,
    pub kind: Kind,
    /// Greedy decoding never picks an end-of-sequence token: the arch-* goldens
    /// were generated so (their random models can end at a near tie).
    pub ignore_eos: bool,
}

/// The fixtures under `fixtures` (the layout of ../shared/fixtures), SmolLM2 from
/// its GGUF and all-MiniLM-L6-v2 from its folder where those are given.
pub fn fixtures(fixtures: &Path, smollm2_gguf: Option<&Path>, minilm: Option<&Path>) -> Vec<Fixture> {
    let mut out = Vec::new();
    for name in ["tiny-llama", "tiny-qwen2", "arch-qwen3", "arch-gemma2", "arch-phi3", "arch-granite", "arch-olmo2", "arch-gpt2", "arch-qwen3-moe", "arch-mixtral"] {
        let dir = fixtures.join(name);
        out.push(Fixture { name: name.into(), model: dir.clone(), golden: dir, kind: Kind::Generator, ignore_eos: name.starts_with("arch-") });
    }
    if let Some(gguf) = smollm2_gguf {
        out.push(Fixture { name: "smollm2-135m".into(), model: gguf.into(), golden: fixtures.join("smollm2-135m"), kind: Kind::Generator, ignore_eos: false });
    }
    if let Some(dir) = minilm {
        out.push(Fixture { name: "all-minilm-l6-v2".into(), model: dir.into(), golden: fixtures.join("all-minilm-l6-v2"), kind: Kind::Encoder, ignore_eos: false });
    }
    out
}

/// How a run is judged against the golden (docs/quantization.md's budgets).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Logits within the fixtures README tolerance on every case and the first
    /// 16 greedy ids identical (embeddings: cosine >= 0.9999 on every sentence).
    Exact,
    /// Top-1 agreement and mean KL against the golden logits; `near_ties_agree`
    /// counts flips at near ties as agreement (random tiny models).
    Statistical { min_top1: f64, max_kl: f64, near_ties_agree: bool },
    /// No golden budget (4-bit error on a random model says nothing): the run is
    /// judged only against the CPU code's logits of the same weights.
    CpuOnly,
}

/// The budget of `encoding` on `fixture`, as tests/tests/quantization.rs applies them.
pub fn budget(fixture: &str, encoding: &str) -> Budget {
    let tiny = fixture.starts_with("tiny-");
    let budgeted = tiny || fixture == "smollm2-135m";
    match encoding {
        "float32" => Budget::Exact,
        "bfloat16" if budgeted => Budget::Statistical { min_top1: 0.99, max_kl: 1e-3, near_ties_agree: tiny },
        "q8_0" if budgeted => Budget::Statistical { min_top1: 0.98, max_kl: 5e-3, near_ties_agree: tiny },
        "q4_1" | "q4_k" if fixture == "smollm2-135m" => Budget::Statistical { min_top1: 0.90, max_kl: 5e-2, near_ties_agree: false },
        _ => Budget::CpuOnly,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_follow_the_quantization_tests() {
        assert_eq!(budget("arch-gemma2", "float32"), Budget::Exact);
        assert_eq!(budget("tiny-llama", "q8_0"), Budget::Statistical { min_top1: 0.98, max_kl: 5e-3, near_ties_agree: true });
        assert_eq!(budget("smollm2-135m", "q4_k"), Budget::Statistical { min_top1: 0.90, max_kl: 5e-2, near_ties_agree: false });
        assert_eq!(budget("tiny-llama", "q4_1"), Budget::CpuOnly);
        assert_eq!(budget("arch-phi3", "bfloat16"), Budget::CpuOnly);
        assert_eq!(Form::Fat.target("sm_90"), "cpu,cuda:sm_90");
    }
}
