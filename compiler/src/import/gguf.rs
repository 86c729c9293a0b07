//! A GGUF (v2 / v3) reader: metadata, tensor table, and the mapping of llama.cpp
//! tensor names and hyperparameters onto the Hugging Face ones the builders use.
//!
//! Every length and offset read from the file is checked against the file size
//! before it is used, so a truncated or corrupt file is an error, never a panic
//! or a huge allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::config::{Architecture, BertShape, EncoderParams, GemmaParams, GraniteMultipliers, ModelConfig};
use super::mmap_file;
use super::weights::{StorageType, WeightStore};
use crate::error::{Error, Result};
use crate::graph::RopeScaling;

const MAGIC: &[u8; 4] = b"GGUF";

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            MetaValue::Int(i) if *i >= 0 => Some(*i as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetaValue::Float(f) => Some(*f),
            MetaValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The value as an error message shows it: numbers as they are, strings quoted,
/// arrays by their length and first entries.
impl std::fmt::Display for MetaValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetaValue::Int(i) => write!(f, "{i}"),
            MetaValue::Float(x) => write!(f, "{x}"),
            MetaValue::Bool(b) => write!(f, "{b}"),
            MetaValue::Str(s) => write!(f, "{s:?}"),
            MetaValue::Array(a) => {
                write!(f, "an array of {} [", a.len())?;
                for (i, v) in a.iter().take(3).enumerate() {
                    write!(f, "{}{v}", if i > 0 { ", " } else { "" })?;
                }
                write!(f, "{}]", if a.len() > 3 { ", ..." } else { "" })
            }
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    pub name: String,
    pub storage: StorageType,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<usize>,
    /// Absolute offset of the data in the file.
    pub offset: usize,
    pub len: usize,
}

/// A parsed GGUF file, still mapped.
pub struct GgufFile {
    pub path: PathBuf,
    pub map: Arc<Mmap>,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<GgufTensor>,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.bytes.len() - self.pos < n {
            return Err(Error::invalid(
                self.path,
                what,
                format!(
                    "file is truncated: needs {n} bytes at offset {} but the file has {}; re-download or re-convert it",
                    self.pos,
                    self.bytes.len()
                ),
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    /// A count that must fit in what is left of the file at `min_size` bytes per item.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(min_size as u64) > left {
            return Err(Error::invalid(self.path, what, format!("count {n} does not fit in the rest of the file; the file is truncated or corrupt")));
        }
        Ok(n as usize)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| Error::invalid(self.path, what, "string is not valid UTF-8"))
    }
    fn value(&mut self, ty: u32, what: &str) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::Int(self.take(1, what)?[0] as i64),
            1 => MetaValue::Int(self.take(1, what)?[0] as i8 as i64),
            2 => MetaValue::Int(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()) as i64),
            3 => MetaValue::Int(i16::from_le_bytes(self.take(2, what)?.try_into().unwrap()) as i64),
            4 => MetaValue::Int(self.u32(what)? as i64),
            5 => MetaValue::Int(self.u32(what)? as i32 as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.take(4, what)?.try_into().unwrap()) as f64),
            7 => MetaValue::Bool(self.take(1, what)?[0] != 0),
            8 => MetaValue::Str(self.string(what)?),
            9 => {
                let item = self.u32(what)?;
                let n = self.count(what, 1)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(item, what)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::Int(self.u64(what)? as i64),
            11 => MetaValue::Int(self.u64(what)? as i64),
            12 => MetaValue::Float(f64::from_le_bytes(self.take(8, what)?.try_into().unwrap())),
            other => return Err(Error::invalid(self.path, what, format!("unknown metadata value type {other}"))),
        })
    }
}

fn ggml_type(id: u32) -> std::result::Result<StorageType, &'static str> {
    match id {
        0 => Ok(StorageType::F32),
        1 => Ok(StorageType::F16),
        2 => Ok(StorageType::Q4_0),
        3 => Ok(StorageType::Q4_1),
        8 => Ok(StorageType::Q8_0),
        12 => Ok(StorageType::Q4K),
        30 => Ok(StorageType::BF16),
        6 => Ok(StorageType::Q5_0),
        7 => Ok(StorageType::Q5_1),
        10 => Ok(StorageType::Q2K),
        11 => Ok(StorageType::Q3K),
        13 => Ok(StorageType::Q5K),
        14 => Ok(StorageType::Q6K),
        9 => Err("Q8_1"),
        15 => Err("Q8_K"),
        16 => Err("IQ2_XXS"),
        17 => Err("IQ2_XS"),
        18 => Err("IQ3_XXS"),
        19 => Err("IQ1_S"),
        20 => Err("IQ4_NL"),
        21 => Err("IQ3_S"),
        22 => Err("IQ2_S"),
        23 => Err("IQ4_XS"),
        29 => Err("IQ1_M"),
        34 => Err("TQ1_0"),
        35 => Err("TQ2_0"),
        39 => Ok(StorageType::Mxfp4),
        _ => Err("unknown"),
    }
}

impl GgufFile {
    /// Maps and parses a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        let map = Arc::new(mmap_file(path)?);
        let (version, metadata, tensors) = Self::parse(path, &map)?;
        Ok(GgufFile { path: path.to_path_buf(), map, version, metadata, tensors })
    }

    /// Parses GGUF bytes (`path` names them in errors): version, metadata, tensor table,
    /// with every tensor's data range checked against `bytes`.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<(u32, BTreeMap<String, MetaValue>, Vec<GgufTensor>)> {
        let map = bytes;
        let mut r = Reader { bytes: map, pos: 0, path };
        let magic = r.take(4, "magic").map_err(|_| Error::invalid(path, "magic", "file is too short to be GGUF"))?;
        if magic != MAGIC {
            return Err(Error::invalid(path, "magic", format!("expected \"GGUF\", found {magic:?}; this is not a GGUF file")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::invalid(path, "version", format!("GGUF version {version} is not supported; supported: 2, 3")));
        }
        let tensor_count = r.count("tensor_count", 24)?;
        let kv_count = r.count("kv_count", 12)?;
        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&key)?;
            let value = r.value(ty, &key)?;
            if metadata.contains_key(&key) {
                return Err(Error::invalid(path, &key, "metadata key appears twice; the file is corrupt (llama.cpp refuses it too): convert the model again"));
            }
            metadata.insert(key, value);
        }
        let mut infos: Vec<(String, Vec<usize>, u32, usize)> = Vec::with_capacity(tensor_count);
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&name)? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(Error::invalid(path, &name, format!("{n_dims} dimensions; GGUF tensors have 1 to 4")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64(&name)? as usize);
            }
            let type_id = r.u32(&name)?;
            let offset = r.u64(&name)? as usize;
            if !seen.insert(name.clone()) {
                return Err(Error::invalid(path, &name, "tensor name appears twice in the tensor table; the file is corrupt (llama.cpp refuses it too): convert the model again"));
            }
            infos.push((name, dims, type_id, offset));
        }
        let alignment = metadata.get("general.alignment").and_then(MetaValue::as_u64).unwrap_or(32) as usize;
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::invalid(path, "general.alignment", format!("{alignment} is not a power of two")));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        // Every tensor of an unsupported type is reported at once, not just the first.
        let unsupported: Vec<String> = infos
            .iter()
            .filter_map(|(name, _, type_id, _)| ggml_type(*type_id).err().map(|kind| format!("{name} (type {type_id}, {kind})")))
            .collect();
        if let Some(first) = unsupported.first() {
            let name = first.split(' ').next().unwrap_or_default().to_string();
            // The first few, and how many in all (a model-wide type names every layer).
            const LISTED: usize = 6;
            let more = match unsupported.len() {
                1 => String::new(),
                n if n <= LISTED => format!(" {n} tensors in all: {}", unsupported.join(", ")),
                n => format!(" {n} tensors in all: {}, and {} more", unsupported[..LISTED].join(", "), n - LISTED),
            };
            return Err(Error::invalid(
                path,
                name,
                format!(
                    "{first}: tensor type is not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K (kept as they are), MXFP4 (kept as Q5_0 blocks, without loss), Q2_K, Q3_K (dequantized, then encoded as the compile asks); requantize the file to one of them (llama-quantize --allow-requantize) or compile the Hugging Face checkpoint.{more}"
                ),
            ));
        }
        let mut tensors: Vec<GgufTensor> = Vec::with_capacity(infos.len());
        // As ggml lays the data section out (and its reader requires): each tensor
        // starts where the one before it ends, padded to the alignment. A table
        // that says otherwise (an offset moved, a type or shape changed) would
        // read some tensor's bytes as another's, so it is refused.
        let mut expected = 0usize;
        for (name, dims, type_id, rel) in infos {
            let storage = ggml_type(type_id).expect("unsupported types were reported above");
            let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let len = n.and_then(|n| storage.bytes_for(n)).ok_or_else(|| {
                Error::invalid(path, &name, format!("shape {dims:?} is not a whole number of {} blocks", storage.name()))
            })?;
            let offset = data_start.checked_add(rel).filter(|o| o.checked_add(len).is_some_and(|end| end <= map.len()));
            let offset = offset.ok_or_else(|| {
                Error::invalid(
                    path,
                    &name,
                    format!(
                        "tensor data ({len} bytes at offset {}) runs past the end of the file ({} bytes); the file is truncated",
                        data_start + rel,
                        map.len()
                    ),
                )
            })?;
            if rel != expected {
                let before = match tensors.last() {
                    Some(t) => format!(
                        "where the tensor before it, {} ({} {:?}, {} bytes), ends",
                        t.name,
                        t.storage.name(),
                        t.dims,
                        t.len
                    ),
                    None => "at the start of the data section".to_string(),
                };
                return Err(Error::invalid(
                    path,
                    &name,
                    format!(
                        "tensor data starts at offset {rel} of the data section, but it must start at {expected}, {before} (padded to the alignment of {alignment}); the tensor table is inconsistent (llama.cpp refuses it too): convert the model again"
                    ),
                ));
            }
            expected = len
                .checked_next_multiple_of(alignment)
                .and_then(|padded| expected.checked_add(padded))
                .ok_or_else(|| Error::invalid(path, &name, "tensor data size overflows"))?;
            tensors.push(GgufTensor { name, storage, dims, offset, len });
        }
        Ok((version, metadata, tensors))
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require_u64(&self, key: &str) -> Result<u64> {
        let value = self.get(key).ok_or_else(|| Error::invalid(&self.path, key, "required metadata key is missing"))?;
        value.as_u64().filter(|&n| n > 0).ok_or_else(|| Error::invalid(&self.path, key, format!("{value}: expected a positive integer")))
    }

    /// An optional positive integer key.
    fn optional_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.require_u64(key).map(Some),
        }
    }

    /// The model configuration implied by the metadata (llama.cpp key names).
    pub fn model_config(&self, architecture: Option<&str>) -> Result<ModelConfig> {
        let arch_key = self
            .get("general.architecture")
            .and_then(MetaValue::as_str)
            .ok_or_else(|| Error::invalid(&self.path, "general.architecture", "required metadata key is missing"))?
            .to_string();
        let name = architecture.unwrap_or(&arch_key);
        // llama.cpp writes Mixtral as `llama` with experts.
        let expert_count = self.metadata.iter().find_map(|(key, v)| key.ends_with(".expert_count").then(|| (key.clone(), v.as_u64())).filter(|(_, n)| *n != Some(0)));
        let name = if name == "llama" && expert_count.is_some() { "mixtral" } else { name };
        // Every architecture maxc builds is read from GGUF too; the list in the
        // message is llama.cpp's spelling of them.
        let Ok(architecture) = Architecture::parse(name, &self.path) else {
            return Err(Error::UnsupportedArchitecture {
                path: self.path.clone(),
                architecture: format!("{name} from GGUF"),
                supported: format!("{} (GGUF)", GGUF_ARCHITECTURES.join(", ")),
            });
        };
        if let Some((key, n)) = expert_count.filter(|_| !architecture.is_moe()) {
            return Err(Error::invalid(
                &self.path,
                key.as_str(),
                format!(
                    "{}: a mixture-of-experts {arch_key} model; maxc builds experts for qwen3moe, qwen2moe, olmoe, gpt-oss and llama (Mixtral) files only",
                    n.map_or("set".to_string(), |n| n.to_string())
                ),
            ));
        }
        if architecture == Architecture::Bert {
            return self.bert_config(&arch_key);
        }
        let k = |s: &str| format!("{arch_key}.{s}");
        let hidden_size = self.require_u64(&k("embedding_length"))? as usize;
        let num_layers = self.require_u64(&k("block_count"))? as usize;
        let num_heads = self.require_u64(&k("attention.head_count"))? as usize;
        let num_kv_heads = self.optional_u64(&k("attention.head_count_kv"))?.map_or(num_heads, |n| n as usize);
        let head_dim = match self.optional_u64(&k("attention.key_length"))? {
            Some(d) => d as usize,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => {
                return Err(Error::invalid(
                    &self.path,
                    k("embedding_length"),
                    format!(
                        "{hidden_size} is not a multiple of {} = {num_heads}, and there is no {} to give the head size",
                        k("attention.head_count"),
                        k("attention.key_length")
                    ),
                ))
            }
        };
        let vocab_size = match self.optional_u64(&k("vocab_size"))? {
            Some(n) => n as usize,
            None => self.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array).map_or(0, <[_]>::len),
        };
        if vocab_size == 0 {
            return Err(Error::invalid(&self.path, k("vocab_size"), "missing, and there is no tokenizer.ggml.tokens to count"));
        }
        // The embedding table fixes both sizes (llama.cpp creates it as
        // {embedding_length, vocabulary} and refuses any other shape).
        if let Some(t) = self.tensors.iter().find(|t| t.name == "token_embd.weight") {
            let (width, rows) = (t.dims[0], t.dims.get(1).copied().unwrap_or(1));
            if width != hidden_size {
                return Err(Error::invalid(
                    &self.path,
                    k("embedding_length"),
                    format!("{hidden_size}, but token_embd.weight holds {width} values per token (dims {:?}); the metadata and the tensors disagree", t.dims),
                ));
            }
            if rows != vocab_size {
                let key = if self.get(&k("vocab_size")).is_some() { k("vocab_size") } else { "tokenizer.ggml.tokens".to_string() };
                return Err(Error::invalid(
                    &self.path,
                    key,
                    format!("{vocab_size} tokens, but token_embd.weight has rows for {rows} (dims {:?}); the metadata and the tensors disagree", t.dims),
                ));
            }
        }
        // llama.cpp rotates every dimension of a head for these architectures
        // (and refuses a file that says otherwise); so does maxc.
        if let Some(rotated) = self.optional_u64(&k("rope.dimension_count"))? {
            if rotated as usize != head_dim {
                return Err(Error::invalid(
                    &self.path,
                    k("rope.dimension_count"),
                    format!("{rotated}: rotary embeddings over part of a head are not supported for {arch_key}; it must equal the head size, {head_dim}"),
                ));
            }
        }
        let rope_scaling = match self.get(&k("rope.scaling.type")).and_then(MetaValue::as_str) {
            None | Some("none") => match self.tensors.iter().find(|t| t.name == "rope_freqs.weight") {
                Some(t) => RopeScaling::FreqFactors(super::weights::dequantize(
                    t.storage,
                    &self.map[t.offset..t.offset + t.len],
                    t.dims.iter().product(),
                )),
                None => RopeScaling::None,
            },
            Some("linear") => match self.f64_or(&k("rope.scaling.factor"), 1.0)? {
                factor if factor.is_finite() && factor > 0.0 => RopeScaling::Linear { factor: factor as f32 },
                factor => return Err(Error::invalid(&self.path, k("rope.scaling.factor"), format!("{factor}: must be a number > 0"))),
            },
            Some("yarn") => self.yarn_scaling(&arch_key, architecture)?,
            Some(other) => {
                return Err(Error::invalid(&self.path, k("rope.scaling.type"), format!("`{other}` is not supported; supported: none, linear, yarn")))
            }
        };
        let gpt2 = architecture == Architecture::Gpt2;
        // GPT-2's LayerNorm epsilon; the RMSNorm one elsewhere.
        let eps_key = if gpt2 { "attention.layer_norm_epsilon" } else { "attention.layer_norm_rms_epsilon" };
        let has_output = self.tensors.iter().any(|t| t.name == "output.weight");
        let has_q_bias = self.tensors.iter().any(|t| t.name == "blk.0.attn_q.bias");
        let has_o_bias = self.tensors.iter().any(|t| t.name == "blk.0.attn_output.bias");
        let config = ModelConfig {
            architecture,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: self.require_u64(&k("feed_forward_length"))? as usize,
            vocab_size,
            rms_norm_eps: self.f64_or(&k(eps_key), 1e-5)? as f32,
            rope_theta: self.f64_or(&k("rope.freq_base"), 10000.0)? as f32,
            rope_scaling,
            tie_word_embeddings: !has_output,
            // GPT-2's projections all have biases (llama.cpp's loader requires them).
            qkv_bias: has_q_bias || gpt2,
            o_bias: has_o_bias || gpt2,
            mlp_bias: gpt2,
            sliding_window: match (architecture, self.get(&k("attention.sliding_window"))) {
                // llama.cpp's converter writes 0 for Phi-3 models without a
                // window; llama.cpp reads 0 as none for Gemma 3 too, and gives
                // Gemma 2 a window of 4096 when the key is absent.
                (Architecture::Phi3 | Architecture::Gemma3, Some(MetaValue::Int(0))) => None,
                (Architecture::Gemma2, None) => Some(4096),
                _ => self.optional_u64(&k("attention.sliding_window"))?.map(|v| v as usize),
            },
            // gpt-oss slides on every even layer (llama.cpp's pattern of 2, as
            // the checkpoints' `layer_types` say).
            sliding_layers: match architecture {
                Architecture::GptOss => Some(self.sliding_pattern(&arch_key, num_layers, 2)?),
                _ => None,
            },
            max_position_embeddings: match self.get(&k("context_length")) {
                Some(MetaValue::Int(0)) => {
                    return Err(Error::invalid(
                        &self.path,
                        k("context_length"),
                        "is 0: the model would have no positions to run a prompt in; fix the file's metadata",
                    ))
                }
                Some(_) => self.require_u64(&k("context_length"))? as usize,
                None => {
                    return Err(Error::invalid(
                        &self.path,
                        k("context_length"),
                        "required metadata key is missing (llama.cpp refuses such a file too): convert the checkpoint again with a current llama.cpp",
                    ))
                }
            },
            bos_token_id: self.token_id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: self.end_of_generation_ids()?,
            dtype: "gguf".into(),
            granite: match architecture {
                Architecture::Granite => Some(self.granite_multipliers(&arch_key, head_dim)?),
                _ => None,
            },
            gemma: match architecture {
                Architecture::Gemma2 => Some(self.gemma2_params(&arch_key, num_layers, head_dim, hidden_size / num_heads)?),
                Architecture::Gemma3 => Some(self.gemma3_params(&arch_key, num_layers, head_dim, hidden_size / num_heads)?),
                _ => None,
            },
            encoder: None,
            moe: self.moe_params(&arch_key, architecture, num_layers)?,
        };
        let has_key_length = self.get(&k("attention.key_length")).is_some();
        config.validate_named(&self.path, &|field| match field {
            "num_key_value_heads" => k("attention.head_count_kv"),
            "num_attention_heads" => k("attention.head_count"),
            "head_dim" if has_key_length => k("attention.key_length"),
            "head_dim" => format!("{} / {}", k("embedding_length"), k("attention.head_count")),
            "rms_norm_eps" => k(eps_key),
            "rope_theta" => k("rope.freq_base"),
            other => other.to_string(),
        })?;
        Ok(config)
    }

    /// A BERT sentence encoder as llama.cpp's converter describes it: LayerNorm
    /// epsilon `attention.layer_norm_epsilon`, non-causal attention (a causal
    /// one is refused), `pooling_type` 1 (mean; the default) or 2 (the [CLS]
    /// token), the token-type count of the `token_types` table. Embeddings are
    /// L2-normalized, as llama.cpp's embedding tools and server do by default.
    fn bert_config(&self, arch: &str) -> Result<ModelConfig> {
        let k = |s: &str| format!("{arch}.{s}");
        if let Some(MetaValue::Bool(true)) = self.get(&k("attention.causal")) {
            return Err(Error::invalid(&self.path, k("attention.causal"), "true: maxc reads BERT encoders with bidirectional attention only"));
        }
        let mean_pooling = match self.get(&k("pooling_type")).map(|v| (v, v.as_u64())) {
            None | Some((_, Some(1))) => true,
            Some((_, Some(2))) => false,
            Some((v, _)) => return Err(Error::invalid(&self.path, k("pooling_type"), format!("{v}: supported: 1 (mean), 2 (the [CLS] token)"))),
        };
        let type_vocab_size = match self.tensors.iter().find(|t| t.name == "token_types.weight") {
            Some(t) => t.dims.get(1).copied().unwrap_or(1) as usize,
            None => self.optional_u64("tokenizer.ggml.token_type_count")?.unwrap_or(2) as usize,
        };
        let shape = BertShape {
            hidden_size: self.require_u64(&k("embedding_length"))? as usize,
            num_layers: self.require_u64(&k("block_count"))? as usize,
            num_heads: self.require_u64(&k("attention.head_count"))? as usize,
            intermediate_size: self.require_u64(&k("feed_forward_length"))? as usize,
            vocab_size: self.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array).map_or(0, <[_]>::len),
            layer_norm_eps: self.f64_or(&k("attention.layer_norm_epsilon"), 1e-12)? as f32,
            max_position_embeddings: self.require_u64(&k("context_length"))? as usize,
        };
        let config = ModelConfig::bert(shape, "gguf", EncoderParams { mean_pooling, normalize: true, type_vocab_size });
        config.validate_named(&self.path, &|field| match field {
            "num_attention_heads" => k("attention.head_count"),
            "vocab_size" => "tokenizer.ggml.tokens".to_string(),
            "rms_norm_eps" => k("attention.layer_norm_epsilon"),
            other => other.to_string(),
        })?;
        Ok(config)
    }

    /// Granite's four multipliers as llama.cpp reads them: `logit_scale`
    /// (logits are divided by it) is required; `attention.scale`,
    /// `embedding_scale` and `residual_scale` are optional, and absent or 0
    /// means not applied (the converter leaves out a multiplier the config
    /// does not set): attention then scales by 1/sqrt(head size).
    fn granite_multipliers(&self, arch: &str, head_dim: usize) -> Result<GraniteMultipliers> {
        let get = |name: &str, required: bool| -> Result<Option<f32>> {
            let key = format!("{arch}.{name}");
            let Some(value) = self.get(&key) else {
                return if required { Err(Error::invalid(&self.path, &key, "required for granite but missing: convert the checkpoint again with a current llama.cpp")) } else { Ok(None) };
            };
            match value.as_f64() {
                Some(x) if x.is_finite() && x != 0.0 => Ok(Some(x as f32)),
                Some(x) if x == 0.0 && !required => Ok(None),
                _ => Err(Error::invalid(&self.path, &key, format!("{value}: expected a finite, non-zero number"))),
            }
        };
        Ok(GraniteMultipliers {
            logits_scaling: get("logit_scale", true)?.expect("required"),
            embedding_multiplier: get("embedding_scale", false)?.unwrap_or(1.0),
            attention_multiplier: get("attention.scale", false)?.unwrap_or(1.0 / (head_dim as f32).sqrt()),
            residual_multiplier: get("residual_scale", false)?.unwrap_or(1.0),
        })
    }

    /// Gemma 2's parameters as llama.cpp reads them: soft-capping from
    /// `attn_logit_softcapping` / `final_logit_softcapping` (50 and 30 when
    /// absent, llama.cpp's defaults), sliding-window attention on every even
    /// layer (its pattern of 2), and queries scaled by the head size, or by
    /// hidden / heads for the 46-layer 27B model (the converter writes no
    /// `query_pre_attn_scalar`; llama.cpp decides by the layer count).
    fn gemma2_params(&self, arch: &str, layers: usize, head_dim: usize, width_per_head: usize) -> Result<GemmaParams> {
        let capping = |key: &str, default: f64| -> Result<Option<f32>> {
            let key = format!("{arch}.{key}");
            match self.f64_or(&key, default)? {
                x if x.is_finite() && x > 0.0 => Ok(Some(x as f32)),
                x => Err(Error::invalid(&self.path, &key, format!("{x}: expected a number > 0"))),
            }
        };
        Ok(GemmaParams {
            attn_logit_softcapping: capping("attn_logit_softcapping", 50.0)?,
            final_logit_softcapping: capping("final_logit_softcapping", 30.0)?,
            query_pre_attn_scalar: if layers == 46 { width_per_head } else { head_dim } as f32,
            sliding_layers: (0..layers).map(|l| l % 2 == 0).collect(),
            local_rope_theta: None,
            qk_norm: false,
        })
    }

    /// Gemma 3's parameters as llama.cpp reads them: with a sliding window,
    /// the layers of `attention.sliding_window_pattern` (an array of flags, or
    /// every N-th layer global, N = 6 when absent) slide and use RoPE base
    /// `rope.freq_base_swa` (10000 when absent, llama.cpp's default) without scaling;
    /// optional final soft-capping, no attention soft-capping; queries scaled
    /// by the head size, or by hidden / heads for the 62-layer 27B model;
    /// per-head Q/K norms.
    fn gemma3_params(&self, arch: &str, layers: usize, head_dim: usize, width_per_head: usize) -> Result<GemmaParams> {
        let key = |s: &str| format!("{arch}.{s}");
        let window = self.get(&key("attention.sliding_window")).and_then(MetaValue::as_u64).unwrap_or(0);
        let sliding_layers = if window == 0 { vec![false; layers] } else { self.sliding_pattern(arch, layers, 6)? };
        let final_capping = match self.get(&key("final_logit_softcapping")) {
            None => None,
            Some(_) => match self.f64_or(&key("final_logit_softcapping"), 0.0)? {
                x if x == 0.0 => None,
                x if x.is_finite() && x > 0.0 => Some(x as f32),
                x => return Err(Error::invalid(&self.path, key("final_logit_softcapping"), format!("{x}: expected a number > 0"))),
            },
        };
        Ok(GemmaParams {
            attn_logit_softcapping: None,
            final_logit_softcapping: final_capping,
            query_pre_attn_scalar: if layers == 62 { width_per_head } else { head_dim } as f32,
            sliding_layers,
            local_rope_theta: Some(self.f64_or(&key("rope.freq_base_swa"), 10000.0)? as f32),
            qk_norm: true,
        })
    }

    /// Which of `layers` layers use the sliding window, as llama.cpp's
    /// `load_swa_pattern` reads `attention.sliding_window_pattern`: an array of
    /// flags, or a period N (every N-th layer global, the others sliding;
    /// `period` when absent).
    fn sliding_pattern(&self, arch: &str, layers: usize, period: usize) -> Result<Vec<bool>> {
        let pattern_key = format!("{arch}.attention.sliding_window_pattern");
        match self.get(&pattern_key) {
            Some(MetaValue::Array(flags)) => {
                if flags.len() != layers {
                    return Err(Error::invalid(&self.path, &pattern_key, format!("{} flags for {layers} layers: there must be one per layer", flags.len())));
                }
                flags
                    .iter()
                    .enumerate()
                    .map(|(i, f)| match f {
                        MetaValue::Bool(b) => Ok(*b),
                        other => Err(Error::invalid(&self.path, &pattern_key, format!("entry {i} is {other}, not a bool"))),
                    })
                    .collect()
            }
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| Error::invalid(&self.path, &pattern_key, format!("{v}: expected a layer count or an array of flags")))? as usize;
                Ok((0..layers).map(|l| n == 0 || l % n < n - 1).collect())
            }
            None => Ok((0..layers).map(|l| l % period < period - 1).collect()),
        }
    }

    /// YaRN as llama.cpp's converter writes it: `rope.scaling.factor`,
    /// `rope.scaling.original_context_length`, and `rope.scaling.yarn_beta_fast`
    /// / `yarn_beta_slow` (32 and 1 when absent, transformers' defaults). The
    /// correction range is truncated to whole dimensions, as transformers does
    /// by default and ggml always does, except for gpt-oss, whose checkpoints
    /// say `truncate: false` (the file has no key for it). An explicit
    /// attention or extrapolation factor is refused (maxc computes YaRN's own).
    fn yarn_scaling(&self, arch: &str, architecture: Architecture) -> Result<RopeScaling> {
        let k = |s: &str| format!("{arch}.rope.scaling.{s}");
        for key in ["yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"] {
            if self.get(&k(key)).is_some() {
                return Err(Error::invalid(&self.path, k(key), "YaRN with an explicit attention or extrapolation factor is not supported; convert without it if it is the default"));
            }
        }
        let positive = |key: &str, default: Option<f64>| -> Result<f64> {
            let value = match default {
                Some(d) => self.f64_or(&k(key), d)?,
                None => {
                    let v = self.get(&k(key)).ok_or_else(|| Error::invalid(&self.path, k(key), "required metadata key is missing for YaRN scaling"))?;
                    v.as_f64().ok_or_else(|| Error::invalid(&self.path, k(key), format!("{v}: expected a number")))?
                }
            };
            if value.is_finite() && value > 0.0 {
                Ok(value)
            } else {
                Err(Error::invalid(&self.path, k(key), format!("{value}: must be a number > 0")))
            }
        };
        Ok(RopeScaling::Yarn {
            factor: positive("factor", None)? as f32,
            original_max_position: positive("original_context_length", None)? as u32,
            beta_fast: positive("yarn_beta_fast", Some(32.0))? as f32,
            beta_slow: positive("yarn_beta_slow", Some(1.0))? as f32,
            truncate: architecture != Architecture::GptOss,
        })
    }

    /// The routed experts as llama.cpp describes them: `expert_count`,
    /// `expert_used_count`, each expert's width (`expert_feed_forward_length`;
    /// Mixtral's experts are `feed_forward_length` wide), the layers whose
    /// router (`blk.N.ffn_gate_inp.weight`) is in the file (the others dense, as
    /// Qwen3-MoE's `mlp_only_layers` convert), and the routing llama.cpp's
    /// graph gives the architecture: Qwen3-MoE the softmax over all experts,
    /// renormalized unless `expert_weights_norm` says false; Mixtral the
    /// softmax over the chosen logits (the same weights); gpt-oss that with a
    /// router bias, expert biases and the clamped SwiGLU at llama.cpp's
    /// constants (alpha 1.702, limit 7: the file has no key for them); OLMoE
    /// and Qwen2-MoE the softmax over all, not renormalized unless
    /// `expert_weights_norm` says so (llama.cpp's graphs pass false), Qwen2-MoE
    /// with its shared expert (`expert_shared_feed_forward_length`, else
    /// `feed_forward_length`, as llama.cpp reads it).
    fn moe_params(&self, arch: &str, architecture: Architecture, layers: usize) -> Result<Option<super::config::MoeParams>> {
        if !architecture.is_moe() {
            return Ok(None);
        }
        let k = |s: &str| format!("{arch}.{s}");
        let experts = self.require_u64(&k("expert_count"))? as usize;
        if self.get(&k("expert_used_count")).is_none() {
            let why = format!("required metadata key is missing: {} = {experts} makes this file a mixture of experts, which needs the number of experts each token uses", k("expert_count"));
            return Err(Error::invalid(&self.path, k("expert_used_count"), why));
        }
        let top_k = self.require_u64(&k("expert_used_count"))? as usize;
        // Qwen3-MoE renormalizes by default; OLMoE and Qwen2-MoE do not.
        let renormalize = match self.get(&k("expert_weights_norm")) {
            None => architecture == Architecture::Qwen3Moe,
            Some(MetaValue::Bool(b)) => *b,
            Some(v) => return Err(Error::invalid(&self.path, k("expert_weights_norm"), format!("{v}: expected true or false"))),
        };
        let (expert_intermediate, routing) = match architecture {
            Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
                (self.require_u64(&k("expert_feed_forward_length"))? as usize, crate::graph::MoeRouting::SoftmaxTopK { renormalize })
            }
            Architecture::Olmoe => {
                let width = match self.optional_u64(&k("expert_feed_forward_length"))? {
                    Some(n) => n,
                    None => self.require_u64(&k("feed_forward_length"))?,
                };
                (width as usize, crate::graph::MoeRouting::SoftmaxTopK { renormalize })
            }
            Architecture::GptOss => (self.require_u64(&k("expert_feed_forward_length"))? as usize, crate::graph::MoeRouting::TopKSoftmax),
            _ => (self.require_u64(&k("feed_forward_length"))? as usize, crate::graph::MoeRouting::TopKSoftmax),
        };
        let sparse_layers = (0..layers).map(|l| self.tensors.iter().any(|t| t.name == format!("blk.{l}.ffn_gate_inp.weight"))).collect();
        let (activation, biases) = match architecture {
            Architecture::GptOss => (crate::graph::MoeActivation::ClampedSwiGlu { alpha: 1.702, limit: 7.0 }, true),
            _ => (crate::graph::MoeActivation::SwiGlu, false),
        };
        let shared_expert = match architecture {
            Architecture::Qwen2Moe => Some(match self.optional_u64(&k("expert_shared_feed_forward_length"))? {
                Some(n) => n as usize,
                None => self.require_u64(&k("feed_forward_length"))? as usize,
            }),
            _ => None,
        };
        let moe = super::config::MoeParams { experts, top_k, expert_intermediate, routing, activation, biases, shared_expert, sparse_layers };
        moe.validate(&self.path, &|key| match key {
            "num_experts" => k("expert_count"),
            "num_experts_per_tok" => k("expert_used_count"),
            other => other.to_string(),
        })?;
        Ok(Some(moe))
    }

    /// A number-valued key, `default` when absent; any other type is refused.
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| Error::invalid(&self.path, key, format!("{v}: expected a number"))),
        }
    }

    /// The tokens that end generation: EOS and, where the file names them,
    /// end of turn (`eot_token_id`: Llama 3's `<|eot_id|>` when EOS is
    /// `<|end_of_text|>`) and end of message (`eom_token_id`), as llama.cpp
    /// stops at each.
    fn end_of_generation_ids(&self) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = self.token_id(key)? {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        Ok(ids)
    }

    /// A token id key (absent: None); a non-integer is refused.
    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .map(Some)
                .ok_or_else(|| Error::invalid(&self.path, key, format!("{v}: expected a token id"))),
        }
    }

    /// MXFP4 blocks are kept as Q5_0 blocks with an f16 scale
    /// (`StorageType::native_scheme`): a block whose E8M0 scale is past what
    /// f16 holds (2^16 and up: values of 100000 and more, which no trained
    /// model has) is refused, naming the tensor and the block.
    fn check_mxfp4_scales(&self, t: &GgufTensor) -> Result<()> {
        let bytes = &self.map[t.offset..t.offset + t.len];
        if let Some((block, e)) = bytes.chunks_exact(17).map(|b| b[0]).enumerate().find(|(_, e)| *e > super::weights::MXFP4_MAX_SCALE_BYTE) {
            return Err(Error::invalid(
                &self.path,
                &t.name,
                format!(
                    "MXFP4 block {block} has scale 2^{}: maxc keeps MXFP4 blocks as Q5_0 blocks, whose f16 scale (half the MXFP4 one) holds at most 2^15, so MXFP4 scales up to 2^16; requantize the tensor (llama-quantize to Q8_0)",
                    e as i32 - 127
                ),
            ));
        }
        Ok(())
    }

    /// Registers every tensor under its Hugging Face name, marking the Q/K
    /// projections whose rows llama.cpp permuted (Llama-family conversions only).
    pub fn register_weights(&self, config: &ModelConfig, store: &mut WeightStore) -> Result<()> {
        let file = store.add_file(&self.path, self.map.clone());
        let architecture = config.architecture;
        store.name_as_in_file(move |hf| gguf_name(architecture, hf), "the GGUF's metadata");
        // llama.cpp's converter permutes the Q/K rows of LlamaModel and its
        // subclasses (Granite) for its interleaved RoPE; the others keep
        // Hugging Face's rotate-half layout.
        let permuted = matches!(architecture, Architecture::Llama | Architecture::Mistral | Architecture::Granite | Architecture::Mixtral);
        for t in &self.tensors {
            if t.name == "rope_freqs.weight" {
                continue;
            }
            let Some(hf) = hf_name(architecture, &t.name) else {
                return Err(Error::invalid(&self.path, &t.name, "tensor name is not one of llama.cpp's names for this architecture"));
            };
            if t.storage == StorageType::Mxfp4 {
                self.check_mxfp4_scales(t)?;
            }
            let shape: Vec<usize> = t.dims.iter().rev().copied().collect();
            store.insert(hf.clone(), t.storage, shape, file, t.offset, t.len);
            if matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3) && t.name.ends_with("norm.weight") {
                store.get_mut(&hf).expect("just inserted").stored_plus_one = true;
            }
            if permuted {
                let heads = if hf.contains("self_attn.q_proj.") {
                    Some(config.num_heads)
                } else if hf.contains("self_attn.k_proj.") {
                    Some(config.num_kv_heads)
                } else {
                    None
                };
                store.get_mut(&hf).expect("just inserted").unpermute_heads = heads;
            }
        }
        Ok(())
    }
}

/// GPT-2's whole-model tensors (Hugging Face's names without the
/// `transformer.` prefix, which maxc's GPT-2 builder accepts either way).
const GPT2_MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "wte.weight"),
    ("position_embd.weight", "wpe.weight"),
    ("output_norm.weight", "ln_f.weight"),
    ("output_norm.bias", "ln_f.bias"),
    ("output.weight", "lm_head.weight"),
];

/// GPT-2's layer parts (`h.N.PART`): LayerNorms with biases, the fused
/// `c_attn`, and the Conv1D projections (which llama.cpp stores transposed:
/// the GPT-2 builder reads them as `[out, in]` from GGUF).
const GPT2_PARTS: &[(&str, &str)] = &[
    ("attn_norm", "ln_1"),
    ("attn_qkv", "attn.c_attn"),
    ("attn_output", "attn.c_proj"),
    ("ffn_norm", "ln_2"),
    ("ffn_up", "mlp.c_fc"),
    ("ffn_down", "mlp.c_proj"),
];

/// BERT's whole-model tensors (BertModel's names, as maxc's builder reads them).
const BERT_MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "embeddings.word_embeddings.weight"),
    ("position_embd.weight", "embeddings.position_embeddings.weight"),
    ("token_types.weight", "embeddings.token_type_embeddings.weight"),
    ("token_embd_norm.weight", "embeddings.LayerNorm.weight"),
    ("token_embd_norm.bias", "embeddings.LayerNorm.bias"),
];

/// BERT's layer parts (`encoder.layer.N.PART`): post-norm LayerNorms after
/// attention and after the MLP.
const BERT_PARTS: &[(&str, &str)] = &[
    ("attn_q", "attention.self.query"),
    ("attn_k", "attention.self.key"),
    ("attn_v", "attention.self.value"),
    ("attn_output", "attention.output.dense"),
    ("attn_output_norm", "attention.output.LayerNorm"),
    ("ffn_up", "intermediate.dense"),
    ("ffn_down", "output.dense"),
    ("layer_output_norm", "output.LayerNorm"),
];

/// llama.cpp's names of the whole-model tensors and the Hugging Face ones.
const MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

// llama.cpp's names of a decoder layer's parts (`blk.N.PART.SUFFIX`) and the
// Hugging Face ones (`model.layers.N.PART.SUFFIX`), in groups that each
// architecture combines (`layer_parts`).

/// Separate Q, K, V and output projections.
const ATTENTION: &[(&str, &str)] = &[
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
];

/// RMSNorms of the queries and keys (Qwen3, Gemma 3: per head; OLMo 2: over
/// the whole projection).
const QK_NORMS: &[(&str, &str)] = &[("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")];

/// The gated MLP.
const MLP: &[(&str, &str)] = &[("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")];

/// The Llama family's norms, before attention and before the MLP.
const LLAMA_NORMS: &[(&str, &str)] = &[("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")];

/// OLMo 2's norms, after attention and after the MLP (llama.cpp's
/// `post_attention_norm` / `post_ffw_norm`, not `ffn_norm`), none before.
const OLMO2_NORMS: &[(&str, &str)] = &[("post_attention_norm", "post_attention_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm")];

/// Gemma's norms before and after both attention and the MLP; the one before
/// the MLP is llama.cpp's `ffn_norm`.
const GEMMA_NORMS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// Phi-3: the fused Q/K/V projection (`attn_qkv`) and gate/up projection
/// (`ffn_up` holds both, gate first), as Hugging Face's Phi3 stores them.
const PHI3_PARTS: &[(&str, &str)] = &[
    ("attn_qkv", "self_attn.qkv_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_up", "mlp.gate_up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// Qwen3-MoE's router and experts: llama.cpp stacks each projection's experts
/// in one `[experts, rows, cols]` tensor (`ffn_gate_up_exps`: gate and up
/// rows of each expert together, when converted with `--fuse-gate-up-exps`),
/// named here as transformers 5's fused checkpoints name them; the importer
/// then exposes each expert as a tensor of its own
/// (`crate::import::split_stacked_experts`).
const QWEN3_MOE_PARTS: &[(&str, &str)] = &[
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_exps", "mlp.experts.gate_proj"),
    ("ffn_up_exps", "mlp.experts.up_proj"),
    ("ffn_down_exps", "mlp.experts.down_proj"),
    ("ffn_gate_up_exps", "mlp.experts.gate_up_proj"),
];

/// Mixtral's router and experts (`w1` the gate, `w3` the up, `w2` the down
/// projection), stacked by llama.cpp as Qwen3-MoE's are.
const MIXTRAL_PARTS: &[(&str, &str)] = &[
    ("ffn_gate_inp", "block_sparse_moe.gate"),
    ("ffn_gate_exps", "block_sparse_moe.experts.w1"),
    ("ffn_up_exps", "block_sparse_moe.experts.w3"),
    ("ffn_down_exps", "block_sparse_moe.experts.w2"),
    ("ffn_gate_up_exps", "block_sparse_moe.experts.w13"),
];

/// gpt-oss's layers: its norms before attention and before the MLP (llama.cpp's
/// `post_attention_norm`, not `ffn_norm`), the sinks (`attn_sinks.weight`, the
/// checkpoints' `self_attn.sinks`, which has no suffix: [`rename`] drops and
/// adds it), the router and the experts stacked with their biases (gate and
/// up separate, de-interleaved by the converter).
const GPT_OSS_PARTS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("attn_sinks", "self_attn.sinks"),
    ("ffn_gate_inp", "mlp.router"),
    ("ffn_gate_exps", "mlp.experts.gate_proj"),
    ("ffn_up_exps", "mlp.experts.up_proj"),
    ("ffn_down_exps", "mlp.experts.down_proj"),
];

/// Qwen2-MoE's shared expert beside the routed ones (named by transformers'
/// `Qwen2MoeSparseMoeBlock`), and the gate of its sigmoid.
const QWEN2_MOE_SHARED: &[(&str, &str)] = &[
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];

/// The architectures maxc reads from GGUF, as `general.architecture` spells them.
pub const GGUF_ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3", "gpt2", "bert", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss"];

/// How `arch`'s GGUF names map to Hugging Face's: the whole-model tensors, the
/// layer prefix (`model.layers.`, GPT-2's `h.`, BERT's `encoder.layer.`) and
/// the layer parts.
struct Naming {
    model: &'static [(&'static str, &'static str)],
    layer_prefix: &'static str,
    parts: &'static [&'static [(&'static str, &'static str)]],
}

fn naming(arch: Architecture) -> Naming {
    let (model, layer_prefix) = match arch {
        Architecture::Gpt2 => (GPT2_MODEL_TENSORS, "h."),
        Architecture::Bert => (BERT_MODEL_TENSORS, "encoder.layer."),
        _ => (MODEL_TENSORS, "model.layers."),
    };
    Naming { model, layer_prefix, parts: layer_parts(arch) }
}

/// The layer-part groups of `arch`'s GGUF files (the same string, `ffn_norm`,
/// means a different Hugging Face tensor in different architectures).
fn layer_parts(arch: Architecture) -> &'static [&'static [(&'static str, &'static str)]] {
    match arch {
        Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 | Architecture::Granite => &[LLAMA_NORMS, ATTENTION, MLP],
        Architecture::Qwen3 => &[LLAMA_NORMS, ATTENTION, QK_NORMS, MLP],
        Architecture::Qwen3Moe => &[LLAMA_NORMS, ATTENTION, QK_NORMS, MLP, QWEN3_MOE_PARTS],
        Architecture::Mixtral => &[LLAMA_NORMS, ATTENTION, MLP, MIXTRAL_PARTS],
        Architecture::Olmo2 => &[OLMO2_NORMS, ATTENTION, QK_NORMS, MLP],
        Architecture::Phi3 => &[LLAMA_NORMS, PHI3_PARTS],
        Architecture::Gemma2 => &[GEMMA_NORMS, ATTENTION, MLP],
        Architecture::Gemma3 => &[GEMMA_NORMS, ATTENTION, QK_NORMS, MLP],
        Architecture::Gpt2 => &[GPT2_PARTS],
        Architecture::Bert => &[BERT_PARTS],
        Architecture::GptOss => &[ATTENTION, GPT_OSS_PARTS],
        // OLMoE's q/k norms are over the whole projections (the builder's
        // choice); its router and experts are named as Qwen3-MoE's.
        Architecture::Olmoe => &[LLAMA_NORMS, ATTENTION, QK_NORMS, QWEN3_MOE_PARTS],
        Architecture::Qwen2Moe => &[LLAMA_NORMS, ATTENTION, QWEN3_MOE_PARTS, QWEN2_MOE_SHARED],
    }
}

/// Maps a llama.cpp tensor name of an `arch` file to the Hugging Face one.
fn hf_name(arch: Architecture, gguf: &str) -> Option<String> {
    rename(&naming(arch), gguf, true)
}

/// Maps a Hugging Face tensor name to llama.cpp's for `arch` (the inverse of
/// [`hf_name`]), so that errors about a GGUF name its own tensors. One
/// expert's projection (`...experts.3.up_proj.weight`) is named as the
/// stacked tensor that holds it, with the expert: `blk.N.ffn_up_exps.weight
/// (expert 3)`.
pub fn gguf_name(arch: Architecture, hf: &str) -> Option<String> {
    if let Some((before, after)) = hf.split_once(".experts.") {
        if let Some((expert, rest)) = after.split_once('.').filter(|(e, _)| e.parse::<usize>().is_ok()) {
            let stacked = rename(&naming(arch), &format!("{before}.experts.{rest}"), false)?;
            return Some(format!("{stacked} (expert {expert})"));
        }
    }
    rename(&naming(arch), hf, false)
}

/// `name` in the other naming: llama.cpp's to Hugging Face's when `to_hf`, else back.
fn rename(naming: &Naming, name: &str, to_hf: bool) -> Option<String> {
    let from = |p: &(&'static str, &'static str)| if to_hf { p.0 } else { p.1 };
    let to = |p: &(&'static str, &'static str)| if to_hf { p.1 } else { p.0 };
    if let Some(pair) = naming.model.iter().find(|p| from(p) == name) {
        return Some(to(pair).to_string());
    }
    let (from_prefix, to_prefix) = if to_hf { ("blk.", naming.layer_prefix) } else { (naming.layer_prefix, "blk.") };
    let (layer, rest) = name.strip_prefix(from_prefix)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // gpt-oss's sinks have no suffix in Hugging Face's checkpoints.
    const SUFFIXLESS: &str = "self_attn.sinks";
    let rest = if !to_hf && rest == SUFFIXLESS { format!("{rest}.weight") } else { rest.to_string() };
    let (part, suffix) = rest.rsplit_once('.')?;
    let pair = naming.parts.iter().flat_map(|group| group.iter()).find(|p| from(p) == part)?;
    if to_hf && to(pair) == SUFFIXLESS {
        return (suffix == "weight").then(|| format!("{to_prefix}{layer}.{SUFFIXLESS}"));
    }
    Some(format!("{to_prefix}{layer}.{}.{suffix}", to(pair)))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a minimal GGUF with one metadata string and the given tensors.
    pub(crate) fn tiny_gguf(tensors: &[(&str, &[u64], u32, usize)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(MAGIC);
        b.extend(3u32.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend(1u64.to_le_bytes());
        let key = "general.architecture";
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(5u64.to_le_bytes());
        b.extend(b"llama");
        let mut offset = 0u64;
        for (name, dims, ty, bytes) in tensors {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
            offset += (*bytes as u64).div_ceil(32) * 32;
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, offset as usize));
        b
    }

    fn write(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("maxc-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let p = write("ok.gguf", &tiny_gguf(&[("token_embd.weight", &[32, 2], 8, 68), ("output_norm.weight", &[32], 0, 128)]));
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.get("general.architecture").unwrap().as_str(), Some("llama"));
        assert_eq!(g.tensors.len(), 2);
        assert_eq!(g.tensors[0].storage, StorageType::Q8_0);
        assert_eq!(g.tensors[0].len, 68);
        assert_eq!(g.tensors[1].offset - g.tensors[0].offset, 96);
    }

    #[test]
    fn bad_magic_is_an_error() {
        let mut bytes = tiny_gguf(&[]);
        bytes[0] = b'X';
        let e = GgufFile::open(&write("magic.gguf", &bytes)).err().unwrap().to_string();
        assert!(e.contains("magic.gguf") && e.contains("magic") && e.contains("not a GGUF file"), "{e}");
    }

    #[test]
    fn unknown_tensor_type_is_named() {
        // IQ4_XS: super-blocks of 256 in 136 bytes.
        let p = write("k.gguf", &tiny_gguf(&[("blk.0.attn_q.weight", &[256, 2], 23, 272)]));
        let e = GgufFile::open(&p).err().unwrap().to_string();
        assert!(e.contains("blk.0.attn_q.weight") && e.contains("IQ4_XS") && e.contains("not supported") && e.contains("llama-quantize"), "{e}");
    }

    #[test]
    fn truncated_data_is_an_error() {
        let mut bytes = tiny_gguf(&[("output_norm.weight", &[64], 0, 256)]);
        bytes.truncate(bytes.len() - 100);
        let e = GgufFile::open(&write("t.gguf", &bytes)).err().unwrap().to_string();
        assert!(e.contains("t.gguf") && e.contains("output_norm.weight") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn truncated_header_is_an_error() {
        let bytes = tiny_gguf(&[("output_norm.weight", &[64], 0, 256)]);
        let e = GgufFile::open(&write("h.gguf", &bytes[..40])).err().unwrap().to_string();
        assert!(e.contains("h.gguf") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn names_map_both_ways() {
        use Architecture::*;
        for (arch, name) in [(Llama, "token_embd.weight"), (Llama, "output.weight"), (Qwen2, "blk.3.attn_k.bias"), (Llama, "blk.12.ffn_down.weight"), (Qwen3, "blk.1.attn_q_norm.weight"), (Olmo2, "blk.0.post_ffw_norm.weight"), (Gpt2, "blk.1.attn_qkv.bias"), (Gpt2, "position_embd.weight"), (Phi3, "blk.0.ffn_up.weight")] {
            assert_eq!(gguf_name(arch, &hf_name(arch, name).unwrap()).as_deref(), Some(name));
        }
        assert_eq!(gguf_name(Llama, "model.layers.0.mlp.gate_proj.weight").as_deref(), Some("blk.0.ffn_gate.weight"));
        assert_eq!(gguf_name(Llama, "model.layers.0.self_attn.q_norm.weight"), None);
        // The same Hugging Face norm has different llama.cpp names by architecture.
        assert_eq!(gguf_name(Llama, "model.layers.2.post_attention_layernorm.weight").as_deref(), Some("blk.2.ffn_norm.weight"));
        assert_eq!(gguf_name(Olmo2, "model.layers.2.post_attention_layernorm.weight").as_deref(), Some("blk.2.post_attention_norm.weight"));
        assert_eq!(hf_name(Olmo2, "blk.0.attn_norm.weight"), None, "OLMo 2 has no norm before attention");
        assert_eq!(hf_name(Gpt2, "blk.4.ffn_down.weight").as_deref(), Some("h.4.mlp.c_proj.weight"));
        assert_eq!(hf_name(Phi3, "blk.0.ffn_up.weight").as_deref(), Some("model.layers.0.mlp.gate_up_proj.weight"));
        assert_eq!(hf_name(Gemma2, "blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.pre_feedforward_layernorm.weight"));
        // gpt-oss: the sinks have no suffix in Hugging Face's names; the
        // experts' biases stay stacked.
        for name in ["blk.0.attn_sinks.weight", "blk.1.ffn_gate_exps.bias", "blk.1.ffn_down_exps.weight", "blk.0.ffn_gate_inp.bias", "blk.1.post_attention_norm.weight", "blk.0.attn_output.bias"] {
            assert_eq!(gguf_name(GptOss, &hf_name(GptOss, name).unwrap()).as_deref(), Some(name));
        }
        assert_eq!(hf_name(GptOss, "blk.3.attn_sinks.weight").as_deref(), Some("model.layers.3.self_attn.sinks"));
        assert_eq!(hf_name(GptOss, "blk.3.attn_sinks.bias"), None);
        assert_eq!(hf_name(GptOss, "blk.0.ffn_up_exps.bias").as_deref(), Some("model.layers.0.mlp.experts.up_proj.bias"));
        assert_eq!(hf_name(GptOss, "blk.0.ffn_norm.weight"), None, "gpt-oss's norm before the MLP is post_attention_norm");
    }

    #[test]
    fn maps_llama_cpp_names() {
        use Architecture::Llama;
        assert_eq!(hf_name(Llama, "blk.3.attn_q.weight").unwrap(), "model.layers.3.self_attn.q_proj.weight");
        assert_eq!(hf_name(Llama, "blk.0.ffn_down.weight").unwrap(), "model.layers.0.mlp.down_proj.weight");
        assert_eq!(hf_name(Llama, "output.weight").unwrap(), "lm_head.weight");
        assert!(hf_name(Llama, "blk.x.attn_q.weight").is_none());
        assert_eq!(hf_name(Architecture::Bert, "blk.1.layer_output_norm.bias").as_deref(), Some("encoder.layer.1.output.LayerNorm.bias"));
    }
}
