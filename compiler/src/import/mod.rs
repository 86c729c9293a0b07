//! Model import: a Hugging Face directory or a GGUF file into one [`ImportedModel`].

pub mod config;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod hf;
pub mod safetensors;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{Architecture, ModelConfig};
pub use weights::{StorageType, WeightStore};

use crate::error::{Error, Result};

/// Sampling defaults from generation_config.json (the artifact's own type).
pub use maxc_format::GenerationDefaults;

/// Everything the compiler knows about a model after import.
#[derive(Debug)]
pub struct ImportedModel {
    pub name: String,
    /// The HF directory or GGUF file.
    pub source: PathBuf,
    pub config: ModelConfig,
    pub weights: WeightStore,
    /// A complete Hugging Face tokenizer.json (rebuilt for GGUF input).
    pub tokenizer_json: String,
    pub chat_template: Option<String>,
    pub generation: GenerationDefaults,
    /// Every file read (for provenance).
    pub input_files: Vec<PathBuf>,
}

/// Whether `path` names a GGUF file (by its extension, as [`import`] reads it).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Imports the model at `path`: an HF directory or a `.gguf` file.
pub fn import(path: &Path, architecture: Option<&str>) -> Result<ImportedModel> {
    if !path.exists() {
        return Err(Error::invalid(
            path,
            "model.path",
            "does not exist; point [model] path (or --model) at an HF directory or a .gguf file",
        ));
    }
    let mut model = if path.is_dir() {
        hf::import_dir(path, architecture)?
    } else if is_gguf(path) {
        import_gguf(path, architecture)?
    } else {
        return Err(Error::invalid(path, "model.path", "is neither a directory nor a .gguf file"));
    };
    if model.config.architecture == Architecture::Phi3 {
        split_fused_projections(&mut model);
    }
    if model.config.architecture == Architecture::GptOss {
        view_gpt_oss_experts(&mut model);
    }
    if model.config.moe.is_some() {
        split_stacked_experts(&mut model)?;
    }
    Ok(model)
}

/// The names of layer `layer`'s experts in `architecture`'s Hugging Face
/// checkpoints: the prefix their tensors share (`...mlp.experts.`), and the
/// gate, up and down projections' names (Mixtral's `w1`, `w3`, `w2`), then
/// the fused gate-and-up one (transformers 5, llama.cpp's `ffn_gate_up_exps`).
pub fn expert_names(architecture: Architecture, layer: usize) -> (String, [&'static str; 4]) {
    match architecture {
        Architecture::Mixtral => (format!("model.layers.{layer}.block_sparse_moe.experts."), ["w1", "w3", "w2", "w13"]),
        _ => (format!("model.layers.{layer}.mlp.experts."), ["gate_proj", "up_proj", "down_proj", "gate_up_proj"]),
    }
}

/// Experts stored stacked, `[experts, rows, cols]` per projection (GGUF files,
/// transformers 5's fused checkpoints, named `...experts.gate_proj.weight` or
/// `...experts.gate_proj`), become one tensor per expert
/// (`...experts.E.gate_proj.weight`), the names the builder binds: views, no
/// copy. A fused gate-and-up tensor splits into each expert's gate rows, then
/// its up rows. A stack of another expert count than the configuration's is
/// an error naming the tensor.
pub fn split_stacked_experts(model: &mut ImportedModel) -> Result<()> {
    let Some(moe) = model.config.moe.clone() else { return Ok(()) };
    let w = &mut model.weights;
    for layer in 0..model.config.num_layers {
        let (prefix, [gate, up, down, fused]) = expert_names(model.config.architecture, layer);
        for proj in [gate, up, down, fused] {
            for stacked in [format!("{prefix}{proj}.weight"), format!("{prefix}{proj}")] {
                let Some(entry) = w.get(&stacked) else { continue };
                if entry.shape.len() != 3 || entry.shape[0] != moe.experts {
                    let file = w.file_of(&stacked).unwrap_or(&model.source).to_path_buf();
                    return Err(Error::invalid(
                        file,
                        w.shown_name(&stacked),
                        format!(
                            "has shape {:?}, but the model has {} experts (the expert count in {}): expected [{}, rows, cols]; the configuration and the tensors disagree",
                            entry.shape,
                            moe.experts,
                            w.config_source(),
                            moe.experts
                        ),
                    ));
                }
                let parts: Vec<String> = (0..moe.experts).map(|e| format!("{prefix}{e}.{proj}.weight")).collect();
                w.split_stacked(&stacked, &parts);
                if proj == fused {
                    for (e, part) in parts.iter().enumerate() {
                        let rows = w.get(part).map_or(0, |t| t.shape[0]);
                        w.split_rows(part, &[(format!("{prefix}{e}.{gate}.weight"), rows / 2), (format!("{prefix}{e}.{up}.weight"), rows - rows / 2)]);
                    }
                }
            }
        }
    }
    Ok(())
}

/// gpt-oss multiplies its experts as `x @ w`: `gate_up_proj` is `[experts,
/// hidden, 2 * intermediate]` with the gate's and the up projection's columns
/// alternating, `down_proj` `[experts, intermediate, hidden]`, and
/// `gate_up_proj_bias` `[experts, 2 * intermediate]` alternates the same way.
/// Read through views ([`weights::MatrixView`]) they are the `[out, in]`
/// stacks the builder binds, each expert's gate rows before its up rows, as
/// [`split_stacked_experts`] then splits them (llama.cpp's converter
/// de-interleaves and transposes the same way, into `ffn_gate_exps` and
/// `ffn_up_exps`). A tensor of another shape is left for the builder's
/// shape check to name.
pub fn view_gpt_oss_experts(model: &mut ImportedModel) {
    for layer in 0..model.config.num_layers {
        let (prefix, _) = expert_names(model.config.architecture, layer);
        let w = &mut model.weights;
        w.set_view(&format!("{prefix}gate_up_proj"), true, true);
        w.set_view(&format!("{prefix}down_proj"), true, false);
        w.set_view(&format!("{prefix}gate_up_proj_bias"), false, true);
    }
}

/// Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: their
/// row ranges become the separate projections the Llama builder reads (views, no
/// copy). A checkpoint that already has them separately is left as it is.
pub fn split_fused_projections(model: &mut ImportedModel) {
    let c = &model.config;
    let (q, kv, inter) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        for suffix in ["weight", "bias"] {
            let parts = [(format!("{p}.self_attn.q_proj.{suffix}"), q), (format!("{p}.self_attn.k_proj.{suffix}"), kv), (format!("{p}.self_attn.v_proj.{suffix}"), kv)];
            model.weights.split_rows(&format!("{p}.self_attn.qkv_proj.{suffix}"), &parts);
            let parts = [(format!("{p}.mlp.gate_proj.{suffix}"), inter), (format!("{p}.mlp.up_proj.{suffix}"), inter)];
            model.weights.split_rows(&format!("{p}.mlp.gate_up_proj.{suffix}"), &parts);
        }
    }
}

fn import_gguf(path: &Path, architecture: Option<&str>) -> Result<ImportedModel> {
    let file = gguf::GgufFile::open(path)?;
    let config = file.model_config(architecture)?;
    let mut weights = WeightStore::default();
    file.register_weights(&config, &mut weights)?;
    let tokenizer_json = gguf_tokenizer::tokenizer_json(&file, config.vocab_size)?;
    let chat_template = file.get("tokenizer.chat_template").and_then(gguf::MetaValue::as_str).map(str::to_string);
    let name = file
        .get("general.name")
        .and_then(gguf::MetaValue::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| file_stem(path));
    Ok(ImportedModel {
        name,
        source: path.to_path_buf(),
        config,
        weights,
        tokenizer_json,
        chat_template,
        generation: GenerationDefaults::default(),
        input_files: vec![path.to_path_buf()],
    })
}

pub(crate) fn file_stem(path: &Path) -> String {
    path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

/// Maps a file read-only. The mapping stays valid while the file is not truncated
/// under us, which maxc assumes of its inputs as every mmap-based loader does.
pub(crate) fn mmap_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only mapping of an input file; see the function docs.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// The component types of a tokenizer.json that the tokenizers library knows,
/// by JSON pointer of the component (`Sequence`s are looked into).
const TOKENIZER_TYPES: &[(&str, &[&str])] = &[
    ("/model", &["BPE", "WordPiece", "WordLevel", "Unigram"]),
    (
        "/pre_tokenizer",
        &["BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Metaspace", "Whitespace", "Sequence", "Split", "Punctuation", "WhitespaceSplit", "Digits", "UnicodeScripts", "FixedLength"],
    ),
    (
        "/normalizer",
        &["BertNormalizer", "StripNormalizer", "StripAccents", "NFC", "NFD", "NFKC", "NFKD", "Sequence", "Lowercase", "Nmt", "Precompiled", "Replace", "Prepend", "ByteLevel", "Strip"],
    ),
    ("/post_processor", &["RobertaProcessing", "BertProcessing", "ByteLevel", "TemplateProcessing", "Sequence"]),
    ("/decoder", &["BPEDecoder", "ByteLevel", "WordPiece", "Metaspace", "CTC", "Sequence", "Replace", "Fuse", "Strip", "ByteFallback"]),
];

/// The first component whose `type` the tokenizers library does not know:
/// (JSON pointer, type found, known types).
fn unknown_tokenizer_component(json: &serde_json::Value) -> Option<(String, String, &'static [&'static str])> {
    fn walk(v: &serde_json::Value, at: String, known: &'static [&'static str]) -> Option<(String, String, &'static [&'static str])> {
        let ty = v.get("type")?.as_str()?;
        if !known.contains(&ty) {
            return Some((format!("{at}/type"), ty.to_string(), known));
        }
        ["pretokenizers", "normalizers", "processors", "decoders"].iter().find_map(|list| {
            v.get(*list)?.as_array()?.iter().enumerate().find_map(|(i, c)| walk(c, format!("{at}/{list}/{i}"), known))
        })
    }
    TOKENIZER_TYPES.iter().find_map(|(at, known)| walk(json.pointer(at)?, at.to_string(), known))
}

/// Checks that a tokenizer.json loads with the same library the runtime uses,
/// has a vocabulary, and gives no token an id the model's `vocab_size`
/// embedding rows do not have.
pub(crate) fn check_tokenizer(text: &str, path: &Path, vocab_size: usize) -> Result<()> {
    let tokenizer = text.parse::<tokenizers::Tokenizer>().map_err(|e| {
        // The library's message for an unknown component ("did not match any
        // variant of untagged enum ...") names neither the field nor the value.
        let unknown = serde_json::from_str(text).ok().and_then(|json| unknown_tokenizer_component(&json));
        match unknown {
            Some((at, ty, known)) => Error::invalid(path, at.trim_start_matches('/').replace('/', "."), format!("`{ty}` is not a type the tokenizers library knows; known: {}", known.join(", "))),
            None => Error::invalid(path, "tokenizer", format!("the tokenizer does not load: {e}")),
        }
    })?;
    // The library takes an added token's id from the vocabulary when the token is
    // there (warning only), so a file whose ids disagree is refused, not guessed at.
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::invalid(path, "tokenizer", format!("not valid JSON: {e}")))?;
    for (i, added) in json.get("added_tokens").and_then(serde_json::Value::as_array).into_iter().flatten().enumerate() {
        let (Some(content), Some(id)) = (added.get("content").and_then(serde_json::Value::as_str), added.get("id").and_then(serde_json::Value::as_u64)) else { continue };
        match tokenizer.token_to_id(content) {
            Some(actual) if actual as u64 != id => {
                return Err(Error::invalid(
                    path,
                    format!("added_tokens[{i}].id"),
                    format!("{content:?} is given id {id}, but the vocabulary has it as {actual}: the file contradicts itself; take the one that came with the checkpoint"),
                ))
            }
            _ => {}
        }
    }
    if tokenizer.get_vocab_size(false) == 0 {
        return Err(Error::invalid(path, "model.vocab", "the vocabulary is empty: the tokenizer.json is damaged; take the one that came with the checkpoint"));
    }
    if let Some((token, id)) = tokenizer.get_vocab(true).into_iter().max_by_key(|(_, id)| *id) {
        if id as usize >= vocab_size {
            return Err(Error::invalid(
                path,
                "tokenizer",
                format!("token {token:?} has id {id}, but the model's embedding has rows for {vocab_size} tokens (0 to {}): the tokenizer belongs to another model; take the one that came with the checkpoint", vocab_size.saturating_sub(1)),
            ));
        }
    }
    Ok(())
}
