//! The normalized model configuration, read from config.json (both hub styles) or GGUF metadata.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::graph::{MoeActivation, MoeRouting, RopeScaling};

/// Architectures with a graph builder.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Olmo2,
    Granite,
    Phi3,
    Gemma2,
    Gemma3,
    Gpt2,
    Bert,
    Qwen3Moe,
    Mixtral,
    GptOss,
    Olmoe,
    Qwen2Moe,
}

impl Architecture {
    pub const ALL: [Architecture; 16] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Olmo2,
        Architecture::Granite,
        Architecture::Phi3,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Gpt2,
        Architecture::Bert,
        Architecture::Qwen3Moe,
        Architecture::Mixtral,
        Architecture::GptOss,
        Architecture::Olmoe,
        Architecture::Qwen2Moe,
    ];

    /// Whether the architecture routes its MLPs to experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Architecture::Qwen3Moe | Architecture::Qwen2Moe | Architecture::Mixtral | Architecture::GptOss | Architecture::Olmoe)
    }

    /// The Hugging Face class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Olmo2 => "Olmo2ForCausalLM",
            Architecture::Granite => "GraniteForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Gpt2 => "GPT2LMHeadModel",
            Architecture::Bert => "BertModel",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
            Architecture::Olmoe => "OlmoeForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }

    /// Accepts the HF class name or the GGUF `general.architecture` spelling.
    pub fn parse(name: &str, path: &Path) -> Result<Self> {
        let found = Self::ALL.into_iter().find(|a| a.hf_name() == name).or(match name {
            "llama" => Some(Architecture::Llama),
            "mistral" => Some(Architecture::Mistral),
            "qwen2" => Some(Architecture::Qwen2),
            "qwen3" => Some(Architecture::Qwen3),
            "olmo2" => Some(Architecture::Olmo2),
            "granite" => Some(Architecture::Granite),
            "phi3" => Some(Architecture::Phi3),
            "gemma2" => Some(Architecture::Gemma2),
            "gemma3" | "gemma3_text" => Some(Architecture::Gemma3),
            "gpt2" => Some(Architecture::Gpt2),
            "bert" => Some(Architecture::Bert),
            "qwen3moe" | "qwen3_moe" => Some(Architecture::Qwen3Moe),
            "mixtral" => Some(Architecture::Mixtral),
            "gpt-oss" | "gpt_oss" => Some(Architecture::GptOss),
            "olmoe" => Some(Architecture::Olmoe),
            "qwen2moe" | "qwen2_moe" => Some(Architecture::Qwen2Moe),
            _ => None,
        });
        found.ok_or_else(|| Error::UnsupportedArchitecture {
            path: path.to_path_buf(),
            architecture: name.to_string(),
            supported: Self::ALL.map(|a| a.hf_name()).join(", "),
        })
    }
}

/// Everything the graph builders need to know about a decoder model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2 always, Llama when `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama `attention_bias`).
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub sliding_window: Option<usize>,
    /// Per layer, whether it uses `sliding_window` (`layer_types` of gpt-oss,
    /// which alternates sliding and full layers); `None`: every layer does.
    /// Gemma keeps its own in [`GemmaParams::sliding_layers`].
    pub sliding_layers: Option<Vec<bool>>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's declared dtype (`torch_dtype` / `dtype`), informational.
    pub dtype: String,
    /// Granite's scalar multipliers (`None` for other architectures).
    pub granite: Option<GraniteMultipliers>,
    /// Gemma 2's extras (`None` for other architectures).
    pub gemma: Option<GemmaParams>,
    /// Sentence-embedding settings of encoders (`None` for decoders).
    pub encoder: Option<EncoderParams>,
    /// The routed experts of a mixture-of-experts decoder (`None` for dense models).
    pub moe: Option<MoeParams>,
}

/// A mixture-of-experts decoder's MLP settings (Qwen3-MoE, Mixtral): which
/// layers route each token to `top_k` of `experts` SwiGLU MLPs, and how the
/// router's logits become the experts' weights.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeParams {
    pub experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub expert_intermediate: usize,
    pub routing: MoeRouting,
    /// The experts' activation between their gate-and-up and down projections.
    pub activation: MoeActivation,
    /// gpt-oss: the router and every expert projection have a bias.
    pub biases: bool,
    /// Qwen2-MoE: the width of a shared expert every token goes through, its
    /// output times `sigmoid(shared_expert_gate . x)`.
    pub shared_expert: Option<usize>,
    /// Per layer: whether its MLP is the routed experts (else a dense MLP
    /// `intermediate_size` wide: Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
}

impl MoeParams {
    /// Checks the settings against each other: experts and top-k positive, top-k
    /// at most the experts. `name` maps a config.json key to the file's own.
    pub fn validate(&self, path: &Path, name: &dyn Fn(&str) -> String) -> Result<()> {
        if self.experts == 0 {
            return Err(Error::invalid(path, name("num_experts"), "is 0: a mixture-of-experts model needs at least one expert"));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(Error::invalid(
                path,
                name("num_experts_per_tok"),
                format!("{}: each token is routed to between 1 and {} = {} experts", self.top_k, name("num_experts"), self.experts),
            ));
        }
        Ok(())
    }
}

/// How an encoder turns token states into one embedding (sentence-transformers'
/// `1_Pooling/config.json` and `Normalize` module).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct EncoderParams {
    /// Mean over tokens (otherwise the first, [CLS], token).
    pub mean_pooling: bool,
    pub normalize: bool,
    pub type_vocab_size: usize,
}

/// Gemma 2 / Gemma 3 settings beyond the Llama ones.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaParams {
    pub attn_logit_softcapping: Option<f32>,
    pub final_logit_softcapping: Option<f32>,
    /// The attention scale is `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f32,
    /// Which layers use the sliding window (`layer_types`; else Gemma 2: every
    /// even layer, Gemma 3: all but every `sliding_window_pattern`-th).
    pub sliding_layers: Vec<bool>,
    /// Gemma 3: sliding layers use RoPE with this base and no scaling
    /// (`rope_local_base_freq`); global layers use `rope_theta` and `rope_scaling`.
    pub local_rope_theta: Option<f32>,
    /// Gemma 3: per-head RMSNorm of queries and keys (`(1 + weight)`, before RoPE).
    pub qk_norm: bool,
}

/// GraniteForCausalLM's scaling constants, as named in its config.json.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GraniteMultipliers {
    pub embedding_multiplier: f32,
    /// Replaces 1/sqrt(head_dim) as the attention scale.
    pub attention_multiplier: f32,
    pub residual_multiplier: f32,
    /// Logits are divided by this.
    pub logits_scaling: f32,
}

/// Typed access to config.json fields with errors that name the field.
pub(super) struct Fields<'a> {
    pub(super) json: &'a Value,
    pub(super) path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(Error::invalid(self.path, key, "required field is missing; the config.json is incomplete")),
            Some(v) => self.as_usize(key, v),
        }
    }
    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.as_usize(key, v)).transpose()
    }
    fn as_usize(&self, key: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| Error::invalid(self.path, key, format!("expected a positive integer, found {v}")))
    }
    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| Error::invalid(self.path, key, format!("expected a number, found {v}"))))
            .transpose()
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| Error::invalid(self.path, key, format!("expected true or false, found {v}"))),
        }
    }
    pub(super) fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| Error::invalid(self.path, key, format!("expected a token id or a list of them, found {v}"));
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().map(|n| n as u32).ok_or_else(|| bad(v))).collect(),
            Some(v) => Ok(vec![v.as_u64().ok_or_else(|| bad(v))? as u32]),
        }
    }
}

impl ModelConfig {
    /// Reads a Hugging Face config.json; `architecture` overrides `architectures[0]`.
    pub fn from_hf_json(json: &Value, path: &Path, architecture: Option<&str>) -> Result<Self> {
        if !json.is_object() {
            let found = match json {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            };
            return Err(Error::invalid(path, "config", format!("the file holds {found}, not a JSON object of model settings; take the config.json that came with the checkpoint")));
        }
        let f = Fields { json, path };
        let arch_name = match (architecture, json.get("architectures")) {
            (Some(a), _) => a.to_string(),
            (None, None | Some(Value::Null)) => {
                return Err(Error::invalid(path, "architectures", "required field is missing (or set [model] architecture in the manifest)"))
            }
            (None, Some(list)) => match list.as_array().and_then(|a| a.first()).and_then(Value::as_str) {
                Some(name) => name.to_string(),
                None => {
                    return Err(Error::invalid(
                        path,
                        "architectures",
                        format!("{list}: expected a list of class names such as [\"LlamaForCausalLM\"] (or set [model] architecture in the manifest)"),
                    ))
                }
            },
        };
        let architecture = Architecture::parse(&arch_name, path)?;
        check_unhonoured_keys(json, architecture, &arch_name, path)?;
        check_prequantized(json, path)?;
        if architecture == Architecture::Gpt2 {
            return gpt2_config(&f);
        }
        if architecture == Architecture::Bert {
            return bert_config(&f);
        }
        // The MLP's activation: the one maxc lowers for the architecture, or refused
        // (never another function computed silently).
        let gemma = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
        let lowered = if gemma { "gelu_pytorch_tanh" } else { "silu" };
        for key in ["hidden_act", "hidden_activation"] {
            match json.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(a)) if a == lowered || (!gemma && a == "swish") => {}
                Some(other) => {
                    return Err(Error::invalid(
                        path,
                        key,
                        format!("{other} is not supported for {arch_name}: maxc lowers its MLP with `{lowered}` only"),
                    ))
                }
            }
        }
        let hidden_size = f.usize("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = f.usize_opt("head_dim")?.unwrap_or(hidden_size / num_heads);

        // The newer style nests rope settings in `rope_parameters`; the older one
        // has `rope_theta` at top level and `rope_scaling` beside it.
        let rope_params = json.get("rope_parameters").filter(|v| v.is_object());
        let theta_field = if rope_params.is_some() { "rope_parameters.rope_theta" } else { "rope_theta" };
        let theta = match rope_params {
            Some(p) => Fields { json: p, path }.f64_opt("rope_theta").map_err(|_| Error::invalid(path, theta_field, "expected a number"))?,
            None => f.f64_opt("rope_theta")?,
        }
        .unwrap_or(10000.0);
        if let Some(other) = json.get("rope_scaling").filter(|v| !v.is_object() && !v.is_null()) {
            return Err(Error::invalid(path, "rope_scaling", format!("{other} is not an object such as {{\"rope_type\": \"linear\", \"factor\": 2.0}} (or null)")));
        }
        let scaling_json = rope_params.or_else(|| json.get("rope_scaling").filter(|v| v.is_object()));
        let scaling_field = if rope_params.is_some() { "rope_parameters" } else { "rope_scaling" };
        let rope_scaling = match scaling_json {
            None => RopeScaling::None,
            Some(s) => parse_rope_scaling(s, json, path, scaling_field)?,
        };

        let qkv_bias = match architecture {
            Architecture::Qwen2 => true,
            Architecture::Qwen2Moe => f.bool_or("qkv_bias", true)?,
            _ => f.bool_or("attention_bias", false)?,
        };
        let o_bias = !matches!(architecture, Architecture::Qwen2 | Architecture::Qwen2Moe) && f.bool_or("attention_bias", false)?;
        let sliding_window = match architecture {
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Qwen2Moe if !f.bool_or("use_sliding_window", false)? => None,
            // transformers slides layers `max_window_layers..` only: all of them
            // (0), none (>= the layer count), or a mix maxc does not build.
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Qwen2Moe => match f.usize_opt("max_window_layers")? {
                Some(m) if m >= f.usize("num_hidden_layers")? => None,
                None | Some(0) => f.usize_opt("sliding_window")?,
                Some(m) => {
                    return Err(Error::invalid(
                        path,
                        "max_window_layers",
                        format!("{m}: a sliding window on layers {m} and up only is not supported; maxc slides all layers or none"),
                    ))
                }
            },
            _ => f.usize_opt("sliding_window")?,
        };
        // gpt-oss alternates sliding and full layers (`layer_types`).
        let sliding_layers = match json.get("layer_types").and_then(Value::as_array) {
            Some(types) if architecture == Architecture::GptOss => {
                let kinds = types.iter().enumerate().map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(Error::invalid(path, format!("layer_types[{i}]"), format!("is {t}; expected \"sliding_attention\" or \"full_attention\""))),
                });
                let kinds = kinds.collect::<Result<Vec<bool>>>()?;
                if kinds.len() != f.usize("num_hidden_layers")? {
                    return Err(Error::invalid(path, "layer_types", format!("lists {} layers, but num_hidden_layers is {}", kinds.len(), f.usize("num_hidden_layers")?)));
                }
                if kinds.contains(&true) && sliding_window.is_none() {
                    return Err(Error::invalid(path, "sliding_window", "is missing, but layer_types has sliding_attention layers"));
                }
                Some(kinds)
            }
            _ => None,
        };
        // `layer_types` (newer configs) must agree with the one window every layer uses.
        if !matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3 | Architecture::GptOss) {
            if let Some(types) = json.get("layer_types").and_then(Value::as_array) {
                let want = if sliding_window.is_some() { "sliding_attention" } else { "full_attention" };
                if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| t.as_str() != Some(want)) {
                    return Err(Error::invalid(
                        path,
                        format!("layer_types[{i}]"),
                        format!("is {t}, but the other settings give every layer {want}; per-layer attention kinds are supported for Gemma only"),
                    ));
                }
            }
        }
        let eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32;
        let granite = if architecture == Architecture::Granite {
            let m = |k: &str| -> Result<f32> {
                f.f64_opt(k)?.map(|x| x as f32).ok_or_else(|| Error::invalid(path, k, "required by GraniteForCausalLM but missing"))
            };
            Some(GraniteMultipliers {
                embedding_multiplier: m("embedding_multiplier")?,
                attention_multiplier: m("attention_multiplier")?,
                residual_multiplier: m("residual_multiplier")?,
                logits_scaling: m("logits_scaling")?,
            })
        } else {
            None
        };
        let num_layers = f.usize("num_hidden_layers")?;
        let (mut theta, mut rope_scaling) = (theta, rope_scaling);
        let gemma = if matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3) {
            let gemma3 = architecture == Architecture::Gemma3;
            let pattern = f.usize_opt("sliding_window_pattern")?.unwrap_or(6);
            let sliding_layers = match json.get("layer_types").and_then(Value::as_array) {
                Some(types) => types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect(),
                None if gemma3 => (0..num_layers).map(|l| (l + 1) % pattern != 0).collect(),
                None => (0..num_layers).map(|l| l % 2 == 0).collect(),
            };
            // Gemma 3's RoPE per layer type: `rope_local_base_freq` (older configs) or
            // `rope_parameters.{full,sliding}_attention` (newer ones).
            let mut local_rope_theta = None;
            if gemma3 {
                let per_type = rope_params.filter(|p| p.get("full_attention").is_some());
                match per_type {
                    Some(p) => {
                        let field = |kind: &str| -> Result<(f64, RopeScaling)> {
                            let sub = p.get(kind).filter(|v| v.is_object()).ok_or_else(|| Error::invalid(path, format!("rope_parameters.{kind}"), "missing"))?;
                            let t = Fields { json: sub, path }.f64_opt("rope_theta")?.unwrap_or(10000.0);
                            Ok((t, parse_rope_scaling(sub, json, path, &format!("rope_parameters.{kind}"))?))
                        };
                        let (full_theta, full_scaling) = field("full_attention")?;
                        (theta, rope_scaling) = (full_theta, full_scaling);
                        local_rope_theta = Some(field("sliding_attention")?.0 as f32);
                    }
                    None => local_rope_theta = Some(f.f64_opt("rope_local_base_freq")?.unwrap_or(10000.0) as f32),
                }
            }
            Some(GemmaParams {
                attn_logit_softcapping: f.f64_opt("attn_logit_softcapping")?.map(|x| x as f32),
                final_logit_softcapping: f.f64_opt("final_logit_softcapping")?.map(|x| x as f32),
                query_pre_attn_scalar: f.f64_opt("query_pre_attn_scalar")?.map_or(head_dim as f32, |x| x as f32),
                sliding_layers,
                local_rope_theta,
                qk_norm: gemma3,
            })
        } else {
            None
        };
        let moe = moe_params(&f, architecture, num_layers)?;
        let config = ModelConfig {
            architecture,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: f.usize("intermediate_size")?,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: eps,
            rope_theta: theta as f32,
            rope_scaling,
            // transformers' default differs by class (Gemma configs tie unless told otherwise).
            tie_word_embeddings: f.bool_or("tie_word_embeddings", matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3))?,
            qkv_bias,
            o_bias,
            mlp_bias: f.bool_or("mlp_bias", false)?,
            sliding_window,
            sliding_layers,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(2048),
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            dtype: json
                .get("dtype")
                .or_else(|| json.get("torch_dtype"))
                .and_then(Value::as_str)
                .unwrap_or("float32")
                .to_string(),
            granite,
            gemma,
            encoder: None,
            moe,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Checks the relations between fields that every builder relies on.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.validate_named(path, &|field| field.to_string())
    }

    /// [`Self::validate`] for a file that names the fields otherwise: `name` maps
    /// a config.json field to the file's own key (a GGUF's metadata key).
    pub fn validate_named(&self, path: &Path, name: &dyn Fn(&str) -> String) -> Result<()> {
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::invalid(
                path,
                name("num_key_value_heads"),
                format!("{} does not divide {} = {}", self.num_kv_heads, name("num_attention_heads"), self.num_heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::invalid(path, name("head_dim"), format!("{} must be even for rotary embeddings", self.head_dim)));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps < 0.0 {
            return Err(Error::invalid(path, name("rms_norm_eps"), format!("{}: must be >= 0", self.rms_norm_eps)));
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 0.0 {
            return Err(Error::invalid(path, name("rope_theta"), format!("{}: must be > 0", self.rope_theta)));
        }
        Ok(())
    }
}

/// The routed experts of Qwen3-MoE, OLMoE, Mixtral and gpt-oss configs
/// (`None` for the other architectures, which are dense), with transformers'
/// rules: Qwen3-MoE routes layer `i` unless it is in `mlp_only_layers` or `(i +
/// 1) % decoder_sparse_step` is not 0, takes the softmax over all experts and
/// renormalizes the chosen ones' probabilities when `norm_topk_prob`; OLMoE
/// routes every layer the same way (`norm_topk_prob` false by default);
/// Mixtral and gpt-oss route every layer, the softmax over the chosen logits
/// (gpt-oss with biases and its clamped SwiGLU). The expert count may be
/// spelled `num_experts` or `num_local_experts`.
fn moe_params(f: &Fields<'_>, architecture: Architecture, num_layers: usize) -> Result<Option<MoeParams>> {
    if !architecture.is_moe() {
        return Ok(None);
    }
    let experts = match (f.usize_opt("num_experts")?, f.usize_opt("num_local_experts")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(Error::invalid(f.path, "num_local_experts", format!("{b}, but num_experts is {a}: the two spellings of the expert count disagree; keep one")))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => return Err(Error::invalid(f.path, "num_local_experts", "required field is missing (or num_experts): the number of experts per layer")),
    };
    let top_k = f.usize("num_experts_per_tok")?;
    let (expert_intermediate, routing, sparse_layers) = match architecture {
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            if let Some(n) = f.usize_opt("shared_expert_intermediate_size")?.filter(|_| architecture == Architecture::Qwen3Moe) {
                return Err(Error::invalid(f.path, "shared_expert_intermediate_size", format!("{n}: Qwen3-MoE has no shared expert; this config describes another model (Qwen2-MoE)")));
            }
            let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
            let dense: Vec<usize> = match f.get("mlp_only_layers") {
                None => vec![],
                Some(Value::Array(list)) => list
                    .iter()
                    .map(|v| v.as_u64().map(|n| n as usize).ok_or_else(|| Error::invalid(f.path, "mlp_only_layers", format!("{v} is not a layer index"))))
                    .collect::<Result<_>>()?,
                Some(v) => return Err(Error::invalid(f.path, "mlp_only_layers", format!("{v}: expected a list of layer indices"))),
            };
            if let Some(&l) = dense.iter().find(|&&l| l >= num_layers) {
                return Err(Error::invalid(f.path, "mlp_only_layers", format!("names layer {l}, but num_hidden_layers is {num_layers}")));
            }
            let sparse = (0..num_layers).map(|l| !dense.contains(&l) && (l + 1) % step == 0).collect();
            let renormalize = f.bool_or("norm_topk_prob", false)?;
            (f.usize("moe_intermediate_size")?, MoeRouting::SoftmaxTopK { renormalize }, sparse)
        }
        // OLMoE: every layer routed, the softmax over all experts, renormalized
        // only with `norm_topk_prob` (false by default).
        Architecture::Olmoe => (f.usize("intermediate_size")?, MoeRouting::SoftmaxTopK { renormalize: f.bool_or("norm_topk_prob", false)? }, vec![true; num_layers]),
        _ => (f.usize("intermediate_size")?, MoeRouting::TopKSoftmax, vec![true; num_layers]),
    };
    let (activation, biases) = match architecture {
        Architecture::GptOss => {
            let alpha = f.f64_opt("swiglu_alpha")?.unwrap_or(1.702) as f32;
            let limit = f.f64_opt("swiglu_limit")?.unwrap_or(7.0) as f32;
            if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                return Err(Error::invalid(f.path, "swiglu_limit", format!("swiglu_alpha {alpha} and swiglu_limit {limit}: both must be finite, the limit > 0")));
            }
            (MoeActivation::ClampedSwiGlu { alpha, limit }, true)
        }
        _ => (MoeActivation::SwiGlu, false),
    };
    // Qwen2-MoE's shared expert (transformers builds it whatever the width).
    let shared_expert = match architecture {
        Architecture::Qwen2Moe => Some(f.usize("shared_expert_intermediate_size")?),
        _ => None,
    };
    let moe = MoeParams { experts, top_k, expert_intermediate, routing, activation, biases, shared_expert, sparse_layers };
    moe.validate(f.path, &|key| match key {
        "num_experts" if f.get("num_experts").is_none() => "num_local_experts".to_string(),
        other => other.to_string(),
    })?;
    Ok(Some(moe))
}

/// GPT2LMHeadModel's config.json uses its own field names.
fn gpt2_config(f: &Fields<'_>) -> Result<ModelConfig> {
    let hidden_size = f.usize("n_embd")?;
    let heads = f.usize("n_head")?;
    let config = ModelConfig {
        architecture: Architecture::Gpt2,
        hidden_size,
        num_layers: f.usize("n_layer")?,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: hidden_size / heads,
        intermediate_size: f.usize_opt("n_inner")?.unwrap_or(4 * hidden_size),
        vocab_size: f.usize("vocab_size")?,
        rms_norm_eps: f.f64_opt("layer_norm_epsilon")?.unwrap_or(1e-5) as f32,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        sliding_window: None,
        sliding_layers: None,
        max_position_embeddings: f.usize_opt("n_positions")?.unwrap_or(1024),
        bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
        eos_token_ids: f.token_ids("eos_token_id")?,
        dtype: "float32".into(),
        granite: None,
        gemma: None,
        encoder: None,
        moe: None,
    };
    if let Some(act) = f.get("activation_function").and_then(Value::as_str) {
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(Error::invalid(f.path, "activation_function", format!("`{act}` is not supported; supported: gelu_new")));
        }
    }
    config.validate(f.path)?;
    Ok(config)
}

/// BertModel's config.json (an encoder: no RoPE, LayerNorm, GELU with erf).
fn bert_config(f: &Fields<'_>) -> Result<ModelConfig> {
    let hidden_size = f.usize("hidden_size")?;
    let heads = f.usize("num_attention_heads")?;
    if let Some(act) = f.get("hidden_act").and_then(Value::as_str) {
        if act != "gelu" {
            return Err(Error::invalid(f.path, "hidden_act", format!("`{act}` is not supported for BertModel; supported: gelu")));
        }
    }
    if let Some(kind) = f.get("position_embedding_type").and_then(Value::as_str) {
        if kind != "absolute" {
            return Err(Error::invalid(f.path, "position_embedding_type", format!("`{kind}` is not supported; supported: absolute")));
        }
    }
    let shape = BertShape {
        hidden_size,
        num_layers: f.usize("num_hidden_layers")?,
        num_heads: heads,
        intermediate_size: f.usize("intermediate_size")?,
        vocab_size: f.usize("vocab_size")?,
        layer_norm_eps: f.f64_opt("layer_norm_eps")?.unwrap_or(1e-12) as f32,
        max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(512),
    };
    let encoder = EncoderParams { mean_pooling: true, normalize: false, type_vocab_size: f.usize_opt("type_vocab_size")?.unwrap_or(2) };
    let config = ModelConfig::bert(shape, "float32", encoder);
    config.validate(f.path)?;
    Ok(config)
}

/// The sizes of a BertModel, from config.json or GGUF metadata.
pub(crate) struct BertShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub layer_norm_eps: f32,
    pub max_position_embeddings: usize,
}

impl ModelConfig {
    /// A BertModel of `shape`: bidirectional attention without RoPE, biases on
    /// every projection, LayerNorms (their epsilon in `rms_norm_eps`), no
    /// special tokens to generate with; `dtype` as the checkpoint stores it.
    pub(crate) fn bert(shape: BertShape, dtype: &str, encoder: EncoderParams) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Bert,
            hidden_size: shape.hidden_size,
            num_layers: shape.num_layers,
            num_heads: shape.num_heads,
            num_kv_heads: shape.num_heads,
            head_dim: if shape.num_heads > 0 { shape.hidden_size / shape.num_heads } else { 0 },
            intermediate_size: shape.intermediate_size,
            vocab_size: shape.vocab_size,
            rms_norm_eps: shape.layer_norm_eps,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: false,
            qkv_bias: true,
            o_bias: true,
            mlp_bias: true,
            sliding_window: None,
            sliding_layers: None,
            max_position_embeddings: shape.max_position_embeddings,
            bos_token_id: None,
            eos_token_ids: vec![],
            dtype: dtype.into(),
            granite: None,
            gemma: None,
            encoder: Some(encoder),
            moe: None,
        }
    }
}

/// One rope-scaling object `s` (at `field` of config `json`) as a [`RopeScaling`].
fn parse_rope_scaling(s: &Value, json: &Value, path: &Path, field: &str) -> Result<RopeScaling> {
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    // Every factor and frequency of these scalings is a positive number.
    let num = |k: &str| -> Result<f32> {
        let v = s.get(k).ok_or_else(|| Error::invalid(path, format!("{field}.{k}"), format!("required for rope type `{kind}`")))?;
        v.as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(|x| x as f32)
            .ok_or_else(|| Error::invalid(path, format!("{field}.{k}"), format!("{v}: must be a number > 0")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")? as u32,
        }),
        "yarn" => {
            for k in ["attention_factor", "mscale", "mscale_all_dim"] {
                if s.get(k).is_some_and(|v| !v.is_null()) {
                    return Err(Error::invalid(
                        path,
                        format!("{field}.{k}"),
                        "YaRN with an explicit attention factor or mscale is not supported; remove the key if it is the default",
                    ));
                }
            }
            let max_positions = json.get("max_position_embeddings").and_then(Value::as_f64).filter(|x| *x > 0.0);
            let beta = |k: &str, default: f32| if s.get(k).is_some_and(|v| !v.is_null()) { num(k) } else { Ok(default) };
            // As transformers does: with `original_max_position_embeddings` given,
            // the factor is the ratio of the two context lengths (DeepSeek-V3
            // raises `max_position_embeddings` and keeps the pretrained one there);
            // without it, the original context is `max_position_embeddings`.
            let (factor, original) = match s.get("original_max_position_embeddings").filter(|v| !v.is_null()) {
                Some(_) => {
                    let original = num("original_max_position_embeddings")?;
                    let factor = match max_positions {
                        Some(m) => (m / original as f64) as f32,
                        None => num("factor")?,
                    };
                    (factor, original)
                }
                None => (
                    num("factor")?,
                    max_positions.ok_or_else(|| {
                        Error::invalid(path, "max_position_embeddings", "required for YaRN without original_max_position_embeddings")
                    })? as f32,
                ),
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position: original as u32,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            })
        }
        other => Err(Error::invalid(
            path,
            format!("{field}.rope_type"),
            format!("rope type `{other}` is not supported; supported: default, linear, llama3, yarn"),
        )),
    }
}

/// Keys that change the computation in some checkpoint family, the
/// architectures that honour them, and the values that leave a model unchanged.
/// A key with another value on an architecture that does not honour it is
/// refused: ignoring it would build a different model than the checkpoint's.
const MATH_KEYS: &[(&str, &[Architecture], &[&str])] = &[
    ("attn_logit_softcapping", &[Architecture::Gemma2, Architecture::Gemma3], &["null"]),
    ("final_logit_softcapping", &[Architecture::Gemma2, Architecture::Gemma3], &["null"]),
    ("query_pre_attn_scalar", &[Architecture::Gemma2, Architecture::Gemma3], &["null"]),
    ("embedding_multiplier", &[Architecture::Granite], &["null", "1", "1.0"]),
    ("residual_multiplier", &[Architecture::Granite], &["null", "1", "1.0"]),
    ("attention_multiplier", &[Architecture::Granite], &["null"]),
    ("logits_scaling", &[Architecture::Granite], &["null", "1", "1.0"]),
    ("partial_rotary_factor", &[], &["null", "1", "1.0"]),
    ("rotary_pct", &[], &["null", "1", "1.0"]),
    ("use_qk_norm", &[], &["null", "false"]),
    ("qk_layernorm", &[], &["null", "false"]),
    ("use_parallel_residual", &[], &["null", "false"]),
    ("clip_qkv", &[], &["null"]),
    ("scale_embedding", &[], &["null", "false"]),
    ("use_bidirectional_attention", &[], &["null", "false"]),
    ("scale_attn_by_inverse_layer_idx", &[], &["null", "false"]),
    ("scale_attn_weights", &[], &["null", "true"]),
];

/// A checkpoint that is already quantized (`quantization_config`) holds
/// tensors maxc's Hugging Face reader does not decode (MXFP4 blocks and scales,
/// GPTQ / AWQ packed integers, ...): refused before any tensor is read, with
/// the way to compile it where there is one (gpt-oss's MXFP4: llama.cpp's
/// converter keeps it in a GGUF, which maxc reads).
fn check_prequantized(json: &Value, path: &Path) -> Result<()> {
    let Some(q) = json.get("quantization_config").filter(|v| !v.is_null()) else { return Ok(()) };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
    let why = match method {
        "mxfp4" => "mxfp4: the checkpoint's experts are MXFP4 blocks (`*_blocks`, `*_scales`), which maxc reads from GGUF files; convert it with llama.cpp's convert_hf_to_gguf.py (it keeps them MXFP4) and compile the .gguf".to_string(),
        other => format!("{other}: pre-quantized Hugging Face checkpoints are not read; compile the unquantized checkpoint (maxc quantizes it, --quantization-encoding) or a GGUF of it"),
    };
    Err(Error::invalid(path, "quantization_config.quant_method", why))
}

fn check_unhonoured_keys(json: &Value, architecture: Architecture, arch_name: &str, path: &Path) -> Result<()> {
    for (key, honoured_by, neutral) in MATH_KEYS {
        let Some(v) = json.get(*key) else { continue };
        if honoured_by.contains(&architecture) || neutral.contains(&v.to_string().as_str()) {
            continue;
        }
        let honoured = if honoured_by.is_empty() {
            "no architecture maxc builds".to_string()
        } else {
            honoured_by.iter().map(|a| a.hf_name()).collect::<Vec<_>>().join(", ")
        };
        return Err(Error::invalid(
            path,
            *key,
            format!("{v} changes the computation, and maxc honours it for {honoured}, not {arch_name}; leaving it out would build another model (neutral values: {})", neutral.join(", ")),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<ModelConfig> {
        let text = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
                "vocab_size": 100 {extra}}}"#
        );
        let json: Value = serde_json::from_str(&text).unwrap();
        ModelConfig::from_hf_json(&json, Path::new("config.json"), None)
    }

    #[test]
    fn yarn_reads_its_ramp_and_takes_the_factor_from_the_context_ratio() {
        // gpt-oss's rope parameters; the factor is max / original positions.
        let c = cfg(r#", "max_position_embeddings": 131072, "rope_parameters": {"rope_theta": 150000.0, "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false}"#).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Yarn { factor: 32.0, original_max_position: 4096, beta_fast: 32.0, beta_slow: 1.0, truncate: false });
        let c = cfg(r#", "max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Yarn { factor: 4.0, original_max_position: 32768, beta_fast: 32.0, beta_slow: 1.0, truncate: true });
        let e = cfg(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707}"#).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.mscale"), "{e}");
    }

    /// gpt-oss's per-layer attention kinds and clamped SwiGLU are read; a
    /// layer list of the wrong length, an unknown kind or a bad limit is
    /// refused by its field.
    #[test]
    fn gpt_oss_reads_its_layer_kinds_and_activation() {
        let gpt_oss = |extra: &str| {
            let text = format!(
                r#"{{"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 100, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "attention_bias": true, "sliding_window": 8 {extra}}}"#
            );
            ModelConfig::from_hf_json(&serde_json::from_str(&text).unwrap(), Path::new("config.json"), None)
        };
        let c = gpt_oss(r#", "layer_types": ["sliding_attention", "full_attention"], "swiglu_alpha": 1.5, "swiglu_limit": 6.0"#).unwrap();
        assert_eq!(c.sliding_layers, Some(vec![true, false]));
        assert!(c.qkv_bias && c.o_bias);
        let moe = c.moe.unwrap();
        assert_eq!((moe.experts, moe.top_k, moe.routing, moe.biases), (4, 2, MoeRouting::TopKSoftmax, true));
        assert_eq!(moe.activation, MoeActivation::ClampedSwiGlu { alpha: 1.5, limit: 6.0 });
        let e = gpt_oss(r#", "layer_types": ["sliding_attention"]"#).unwrap_err().to_string();
        assert!(e.contains("layer_types") && e.contains("num_hidden_layers is 2"), "{e}");
        let e = gpt_oss(r#", "layer_types": ["sliding_attention", "chunked_attention"]"#).unwrap_err().to_string();
        assert!(e.contains("layer_types[1]") && e.contains("chunked_attention"), "{e}");
        let e = gpt_oss(r#", "swiglu_limit": -1.0"#).unwrap_err().to_string();
        assert!(e.contains("swiglu_limit"), "{e}");
    }

    #[test]
    fn older_and_newer_rope_styles_agree() {
        let old = cfg(r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#).unwrap();
        let new = cfg(r#", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#).unwrap();
        assert_eq!(old, new);
        assert_eq!(old.rope_theta, 500000.0);
        assert!(matches!(old.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        assert_eq!(old.head_dim, 16);
    }

    #[test]
    fn missing_required_field_is_named() {
        let json: Value = serde_json::from_str(r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#).unwrap();
        let e = ModelConfig::from_hf_json(&json, Path::new("m/config.json"), None).unwrap_err().to_string();
        assert!(e.contains("m/config.json") && e.contains("num_attention_heads") && e.contains("missing"), "{e}");
    }

    #[test]
    fn wrong_field_type_is_named() {
        let e = cfg(r#", "rope_theta": "big""#).unwrap_err().to_string();
        assert!(e.contains("rope_theta") && e.contains("expected a number"), "{e}");
    }

    #[test]
    fn unsupported_architecture_lists_supported_ones() {
        let json: Value = serde_json::from_str(r#"{"architectures": ["MambaForCausalLM"]}"#).unwrap();
        let e = ModelConfig::from_hf_json(&json, Path::new("config.json"), None).unwrap_err().to_string();
        assert!(e.contains("MambaForCausalLM") && e.contains("LlamaForCausalLM") && e.contains("Qwen2ForCausalLM"), "{e}");
    }

    #[test]
    fn kv_heads_must_divide_heads() {
        let e = cfg(r#", "num_key_value_heads": 3"#).unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads") && e.contains('3') && e.contains('4'), "{e}");
    }

    /// Pre-quantized checkpoints are refused by `quantization_config`: MXFP4
    /// (gpt-oss as released) with the way through a GGUF, others plainly.
    #[test]
    fn prequantized_checkpoints_are_refused_with_the_way_to_compile_them() {
        let e = cfg(r#", "quantization_config": {"quant_method": "mxfp4"}"#).unwrap_err().to_string();
        assert!(e.contains("quantization_config.quant_method") && e.contains("MXFP4") && e.contains("convert_hf_to_gguf"), "{e}");
        let e = cfg(r#", "quantization_config": {"quant_method": "gptq", "bits": 4}"#).unwrap_err().to_string();
        assert!(e.contains("gptq") && e.contains("unquantized"), "{e}");
        assert!(cfg(r#", "quantization_config": null"#).is_ok());
    }
}
