//! ModelManifest: the TOML file that tells `maxc compile` what to build (see docs/manifest.md).
//!
//! The manifest is parsed into a `toml::Table` first so that `--model-override`
//! can patch any field before the typed structs are deserialized; unknown keys
//! are rejected by serde's `deny_unknown_fields`, whose message lists the valid
//! keys.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The name of the implicit component formed by `[model]` and `[compile]`.
pub const MAIN_COMPONENT: &str = "transformer";


/// A parsed, validated ModelManifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub model: ModelSection,
    #[serde(default)]
    pub compile: CompileSection,
    #[serde(default)]
    pub generation: GenerationSection,
    #[serde(default)]
    pub components: BTreeMap<String, ComponentSection>,
}

/// `[model]`: where the weights are and what they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// An HF directory or a `.gguf` file, relative to the manifest's directory.
    pub path: PathBuf,
    pub name: Option<String>,
    /// Overrides `architectures[0]` of config.json / `general.architecture` of a GGUF.
    pub architecture: Option<String>,
}

/// `[compile]`: how to build it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompileSection {
    /// `cpu`, `cpu:x86-64-v3`, `cpu:x86-64-v4`, `cuda:sm_90`, ...
    pub target: Option<String>,
    /// The device mesh: `cpu` (default), `cpu:0,1`, `gpu:0,1,2,3`.
    pub devices: Option<String>,
    /// How attention is split over a mesh: `auto` (by KV heads when the device
    /// count divides them, else replicated), `heads` (split or fail), `replicated`.
    pub attention_sharding: Option<String>,
    /// The encoding of the linear layers' weights (default float32).
    pub quantization_encoding: Option<String>,
    /// The encoding of the token embedding table and the lm_head (default: the
    /// linear layers' under float encodings, q8_0 under block encodings).
    pub embedding_encoding: Option<String>,
    /// Activations of block-quantized matmuls: `float32` (default) or `int8`
    /// (quantized per block, integer dot products; CPU code only).
    pub activation_encoding: Option<String>,
    /// The KV cache's element type: `float32` (default, exact) or `float16`
    /// (half the memory and the bytes attention reads; values rounded to
    /// nearest even).
    pub kv_cache_encoding: Option<String>,
    /// The longest sequence (prompt + generated) the artifact supports.
    pub max_length: Option<u32>,
    /// Rows per step of the batched engine's mixed plan (prompt chunks plus
    /// decode rows; default 256).
    pub max_batch_tokens: Option<u32>,
    /// Sequences per step of the batched engine (default 16).
    pub max_sequences: Option<u32>,
}

/// `[generation]`: sampling defaults recorded in the artifact.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationSection {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub max_new_tokens: Option<u32>,
}

/// `[components.<name>]`: one more model of a multi-component artifact.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentSection {
    pub path: Option<PathBuf>,
    pub architecture: Option<String>,
    pub target: Option<String>,
    pub devices: Option<String>,
    pub quantization_encoding: Option<String>,
    pub embedding_encoding: Option<String>,
    pub max_length: Option<u32>,
    pub max_batch_size: Option<u32>,
}

/// A manifest plus the file it came from, with paths resolved.
#[derive(Debug, Clone)]
pub struct LoadedManifest {
    pub manifest: Manifest,
    /// The manifest file, or `None` for `maxc compile --model PATH`.
    pub source: Option<PathBuf>,
    /// The manifest text after overrides (recorded in the artifact's provenance).
    pub text: String,
}

impl LoadedManifest {
    /// Reads and validates a manifest file, then applies `overrides` (`component.key=value`).
    pub fn from_file(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let table: toml::Table = toml::from_str(&text)
            .map_err(|e| Error::invalid(path, "manifest", format!("not valid TOML: {e}")))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_table(table, Some(path), &base, overrides)
    }

    /// The manifest `maxc compile --model PATH` implies: that path and every default.
    pub fn from_model_path(model: &Path, overrides: &[String]) -> Result<Self> {
        let mut table = toml::Table::new();
        let mut model_table = toml::Table::new();
        model_table.insert("path".into(), toml::Value::String(model.to_string_lossy().into_owned()));
        table.insert("model".into(), toml::Value::Table(model_table));
        Self::from_table(table, None, Path::new(""), overrides)
    }

    fn from_table(
        mut table: toml::Table,
        source: Option<&Path>,
        base: &Path,
        overrides: &[String],
    ) -> Result<Self> {
        for spec in overrides {
            apply_override(&mut table, spec)?;
        }
        let shown = source.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("<--model>"));
        let text = toml::to_string(&table).expect("a toml::Table always serializes");
        let mut manifest: Manifest = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| {
                let field = e.path().to_string();
                let field = if field == "." { "manifest".to_string() } else { field };
                // toml appends "in `section`" on a second line; the field already says where.
                let message = e.inner().to_string();
                let message = message.lines().next().unwrap_or_default().trim().to_string();
                Error::invalid(&shown, field, format!("{message}; see docs/manifest.md"))
            })?;
        manifest.validate(&shown)?;
        if manifest.model.path.is_relative() {
            manifest.model.path = base.join(&manifest.model.path);
        }
        for component in manifest.components.values_mut() {
            if let Some(p) = &component.path {
                if p.is_relative() {
                    component.path = Some(base.join(p));
                }
            }
        }
        Ok(LoadedManifest { manifest, source: source.map(Path::to_path_buf), text })
    }
}

impl Manifest {
    fn validate(&self, path: &Path) -> Result<()> {
        check_encoding(path, "compile.quantization_encoding", &self.compile.quantization_encoding)?;
        check_encoding(path, "compile.embedding_encoding", &self.compile.embedding_encoding)?;
        if let Some(a) = &self.compile.activation_encoding {
            parse_activation_encoding(a).map_err(|m| Error::invalid(path, "compile.activation_encoding", m))?;
        }
        if let Some(k) = &self.compile.kv_cache_encoding {
            parse_kv_cache_encoding(k).map_err(|m| Error::invalid(path, "compile.kv_cache_encoding", m))?;
        }
        if self.compile.max_length == Some(0) {
            return Err(Error::invalid(path, "compile.max_length", "must be at least 1"));
        }
        for (field, value) in [("compile.max_batch_tokens", self.compile.max_batch_tokens), ("compile.max_sequences", self.compile.max_sequences)] {
            if value == Some(0) {
                return Err(Error::invalid(path, field, "must be at least 1"));
            }
        }
        for (name, c) in &self.components {
            check_encoding(path, &format!("components.{name}.quantization_encoding"), &c.quantization_encoding)?;
            check_encoding(path, &format!("components.{name}.embedding_encoding"), &c.embedding_encoding)?;
        }
        let g = &self.generation;
        if let Some(t) = g.temperature {
            if !(t >= 0.0 && t.is_finite()) {
                return Err(Error::invalid(path, "generation.temperature", format!("{t} must be a finite number >= 0")));
            }
        }
        for (field, value) in [("generation.top_p", g.top_p), ("generation.min_p", g.min_p)] {
            if let Some(p) = value {
                if !(0.0..=1.0).contains(&p) {
                    return Err(Error::invalid(path, field, format!("{p} must be between 0 and 1")));
                }
            }
        }
        Ok(())
    }
}

fn check_encoding(path: &Path, field: &str, value: &Option<String>) -> Result<()> {
    // The linear layers may also keep the checkpoint's own encodings.
    let linear = field.ends_with("quantization_encoding");
    match value {
        Some(v) if linear && v == crate::quant::STORED => Ok(()),
        Some(v) if maxrun::format::WeightEncoding::from_name(v).is_none() => Err(Error::invalid(
            path,
            field,
            format!(
                "unknown encoding `{v}`; valid encodings: {}{}",
                maxrun::format::WeightEncoding::all_names(),
                if linear { format!(", {}", crate::quant::STORED) } else { String::new() }
            ),
        )),
        _ => Ok(()),
    }
}

/// `compile.activation_encoding`: how block-quantized matmuls take their activations.
pub fn parse_activation_encoding(name: &str) -> std::result::Result<crate::schedule::ActivationEncoding, String> {
    use crate::schedule::ActivationEncoding as A;
    [A::Float32, A::Int8, A::Int16].into_iter().find(|a| a.name() == name).ok_or_else(|| format!("unknown activation encoding `{name}`; valid: float32, int8, int16"))
}

/// `compile.kv_cache_encoding`: the KV cache's element type.
pub fn parse_kv_cache_encoding(name: &str) -> std::result::Result<maxrun::format::KvEncoding, String> {
    maxrun::format::KvEncoding::from_name(name).ok_or_else(|| format!("unknown KV cache encoding `{name}`; valid: float32, float16"))
}

/// Keys of `[compile]` that `transformer.<key>` overrides address.
const COMPILE_KEYS: &[&str] = &[
    "target",
    "devices",
    "attention_sharding",
    "quantization_encoding",
    "embedding_encoding",
    "activation_encoding",
    "kv_cache_encoding",
    "max_length",
    "max_batch_tokens",
    "max_sequences",
];
const MODEL_KEYS: &[&str] = &["path", "name", "architecture"];

/// Applies one `--model-override KEY=VALUE`.
///
/// `KEY` is a dotted path. It may start with a section (`model`, `compile`,
/// `generation`, `components`) or with a component name: `transformer.<key>`
/// addresses the main component (`[model]` / `[compile]`), any other name
/// `[components.<name>]`. `VALUE` is parsed as a TOML value when it is one
/// (`512`, `0.7`, `true`) and taken as a string otherwise.
pub fn apply_override(table: &mut toml::Table, spec: &str) -> Result<()> {
    let flag = "--model-override";
    let (key, raw) = spec.split_once('=').ok_or_else(|| Error::Flag {
        flag: flag.into(),
        message: format!("`{spec}` is not of the form component.key=value"),
    })?;
    let segments: Vec<&str> = key.trim().split('.').collect();
    if segments.len() < 2 || segments.iter().any(|s| s.is_empty()) {
        return Err(Error::Flag {
            flag: flag.into(),
            message: format!("`{key}` is not of the form component.key (e.g. transformer.max_length)"),
        });
    }
    let path: Vec<String> = match segments[0] {
        "model" | "compile" | "generation" | "components" => segments.iter().map(|s| s.to_string()).collect(),
        MAIN_COMPONENT if segments.len() == 2 && MODEL_KEYS.contains(&segments[1]) => {
            vec!["model".into(), segments[1].into()]
        }
        MAIN_COMPONENT if segments.len() == 2 && COMPILE_KEYS.contains(&segments[1]) => {
            vec!["compile".into(), segments[1].into()]
        }
        MAIN_COMPONENT => {
            let valid: Vec<&str> = MODEL_KEYS.iter().chain(COMPILE_KEYS).copied().collect();
            return Err(Error::Flag {
                flag: flag.into(),
                message: format!("unknown key `{key}`; valid keys of `{MAIN_COMPONENT}`: {}", valid.join(", ")),
            });
        }
        component => {
            let mut p = vec!["components".to_string(), component.to_string()];
            p.extend(segments[1..].iter().map(|s| s.to_string()));
            p
        }
    };
    let value = parse_override_value(raw.trim());
    let mut cursor = table;
    for segment in &path[..path.len() - 1] {
        let entry = cursor.entry(segment.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cursor = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(Error::Flag {
                    flag: flag.into(),
                    message: format!("`{key}`: `{segment}` is a value, not a section"),
                })
            }
        };
    }
    cursor.insert(path[path.len() - 1].clone(), value);
    Ok(())
}

fn parse_override_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => t.remove("v").expect("the key was just written"),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, overrides: &[&str]) -> Result<LoadedManifest> {
        let dir = std::env::temp_dir().join(format!("maxc-manifest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A file per call: tests run in parallel, and texts of one length would
        // otherwise share a name (a race that failed a test once).
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = dir.join(format!("m{}.toml", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        std::fs::write(&path, text).unwrap();
        let ov: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        LoadedManifest::from_file(&path, &ov)
    }

    #[test]
    fn minimal_manifest_resolves_path_relative_to_file() {
        let m = load("[model]\npath = \"models/smollm2\"\n", &[]).unwrap();
        assert!(m.manifest.model.path.ends_with("models/smollm2"));
        assert!(m.manifest.model.path.is_absolute() || m.manifest.model.path.components().count() > 2);
        assert_eq!(m.manifest.compile, CompileSection::default());
    }

    #[test]
    fn unknown_key_is_named_with_valid_keys() {
        let err = load("[model]\npath = \"x\"\n[compile]\nmax_lenght = 5\n", &[]).unwrap_err().to_string();
        assert!(err.contains("max_lenght"), "{err}");
        assert!(err.contains("max_length") && err.contains("quantization_encoding"), "{err}");
    }

    #[test]
    fn wrong_type_is_an_error_naming_the_field() {
        let err = load("[model]\npath = \"x\"\n[compile]\nmax_length = \"long\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("compile.max_length") && err.contains("invalid type"), "{err}");
    }

    #[test]
    fn stored_is_a_linear_encoding_only() {
        assert!(load("[model]\npath = \"x\"\n[compile]\nquantization_encoding = \"stored\"\n", &[]).is_ok());
        let err = load("[model]\npath = \"x\"\n[compile]\nembedding_encoding = \"stored\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("compile.embedding_encoding") && err.contains("stored") && err.contains("q8_0"), "{err}");
        let err = load("[model]\npath = \"x\"\n[compile]\nquantization_encoding = \"q3\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("q4_k, float8_e4m3fn, stored"), "the linear encodings list `stored`: {err}");
    }

    #[test]
    fn unparsable_manifest_is_an_error() {
        let err = load("[model\npath = ", &[]).unwrap_err().to_string();
        assert!(err.contains("not valid TOML"), "{err}");
    }

    #[test]
    fn missing_model_section_is_an_error() {
        let err = load("[compile]\nmax_length = 5\n", &[]).unwrap_err().to_string();
        assert!(err.contains("missing field `model`"), "{err}");
    }

    #[test]
    fn unknown_encoding_lists_valid_ones() {
        let err = load("[model]\npath = \"x\"\n[compile]\nquantization_encoding = \"q3\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("compile.quantization_encoding") && err.contains("q4_k"), "{err}");
    }

    #[test]
    fn overrides_patch_main_component_sections_and_other_components() {
        let m = load(
            "[model]\npath = \"x\"\n",
            &["transformer.max_length=512", "transformer.quantization_encoding=q8_0", "generation.temperature=0.5", "vision.path=v"],
        )
        .unwrap();
        assert_eq!(m.manifest.compile.max_length, Some(512));
        assert_eq!(m.manifest.compile.quantization_encoding.as_deref(), Some("q8_0"));
        assert_eq!(m.manifest.generation.temperature, Some(0.5));
        assert!(m.manifest.components["vision"].path.as_ref().unwrap().ends_with("v"));
    }

    #[test]
    fn bad_overrides_are_errors() {
        assert!(load("[model]\npath = \"x\"\n", &["nonsense"]).is_err());
        let err = load("[model]\npath = \"x\"\n", &["transformer.colour=red"]).unwrap_err().to_string();
        assert!(err.contains("colour") && err.contains("max_length"), "{err}");
        let err = load("[model]\npath = \"x\"\n", &["compile.max_length=abc"]).unwrap_err().to_string();
        assert!(err.contains("compile.max_length") && err.contains("invalid type"), "{err}");
    }

    #[test]
    fn model_path_manifest_uses_defaults() {
        let m = LoadedManifest::from_model_path(Path::new("some/dir"), &[]).unwrap();
        assert_eq!(m.manifest.model.path, PathBuf::from("some/dir"));
        assert!(m.source.is_none());
    }
}
