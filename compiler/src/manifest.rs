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
pub use maxc_format::GenerationDefaults;

/// The name of the implicit component formed by `[model]` and `[compile]`.
pub const MAIN_COMPONENT: &str = "transformer";


/// A parsed, validated ModelManifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub model: ModelSection,
    #[serde(default)]
    pub compile: CompileSection,
    /// `[generation]`: sampling defaults recorded in the artifact (over the
    /// checkpoint's generation_config.json).
    #[serde(default)]
    pub generation: GenerationDefaults,
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

/// `[compile]`: how to build it. The same struct is `maxc compile`'s and `maxc
/// check`'s flags (each field its `--kebab-case` flag, which lands over the
/// manifest's key: [`CompileSection::flag_settings`]), so a new option is a
/// field here and its use in `compile_config.rs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct CompileSection {
    /// Code target: `cpu` (this machine), `cpu:x86-64-v3`, `cpu:x86-64-v4`, `cpu:NAME+feature,...`;
    /// several CPU variants over one copy of the weights: `cpu:x86-64-v2,x86-64-v3,x86-64-v4` or
    /// `cpu:portable` (docs/portable.md); ARM: `cpu:aarch64`, `cpu:aarch64+dotprod` (docs/aarch64.md);
    /// GPU: `cuda:sm_90` (docs/gpu.md).
    #[arg(long)]
    pub target: Option<String>,
    /// Device mesh: cpu (default), cpu:0,1 (two CPU devices, each with its own
    /// threads and weight shard), gpu:0,1,2,3. One sub-model per device.
    #[arg(long, value_name = "DEVICES")]
    pub devices: Option<String>,
    /// Attention over a mesh: auto (split by KV heads when the device count
    /// divides them, else replicated), heads (split or fail), replicated.
    #[arg(long, value_name = "POLICY")]
    pub attention_sharding: Option<String>,
    /// Storage of the linear layers' weights: float32 (the default for Hugging Face checkpoints),
    /// bfloat16, float16, q8_0, q4_0, q4_1, q4_k, float8_e4m3fn, q5_0, q5_1, q6_k, q5_k; a
    /// GGUF already in that block type keeps its blocks. `stored` (the default for GGUF files):
    /// every weight keeps the checkpoint's encoding where maxc has integer kernels for it, else
    /// the nearest more precise one (GGUF Q2_K / Q3_K: q4_k).
    #[arg(long, value_name = "ENCODING")]
    pub quantization_encoding: Option<String>,
    /// Storage of the embedding table and lm_head (default: the linear layers'
    /// encoding when it is a float one, q8_0 with block encodings).
    #[arg(long, value_name = "ENCODING")]
    pub embedding_encoding: Option<String>,
    /// Activations of block-quantized matmuls, quantized per block of 32 for
    /// integer dot products: int8 (llama.cpp's scheme, VNNI where the CPU has
    /// it; the default for CPU-only artifacts with K-quant, Q5 or Q8_0 weights,
    /// where its quality matches llama.cpp's), int16 (16-bit levels: logits
    /// within float32 tolerance; the default beside Q4_0 / Q4_1 weights) or
    /// float32 (exact float math on the packed weights; the default with GPU
    /// code). Integer activations are CPU code only.
    #[arg(long, value_name = "ENCODING")]
    pub activation_encoding: Option<String>,
    /// The KV cache's element type: float32 (exact) or float16 (half the cache
    /// memory and the bytes attention reads; keys and values rounded to nearest
    /// even). Default: float32 when every weight is float32, else float16 (as
    /// llama.cpp's default cache type).
    #[arg(long, value_name = "ENCODING")]
    pub kv_cache_encoding: Option<String>,
    /// The longest sequence (prompt + generated) the artifact supports
    /// (default: the checkpoint's context length, at most 4096).
    #[arg(long, value_name = "TOKENS")]
    pub max_length: Option<u32>,
    /// Rows per step of the batched engine's mixed plan (prompt chunks plus
    /// decode rows; default 256).
    #[arg(long, value_name = "ROWS")]
    pub max_batch_tokens: Option<u32>,
    /// Sequences per step of the batched engine (default 16).
    #[arg(long, value_name = "SEQUENCES")]
    pub max_sequences: Option<u32>,
    /// Code generator: llvm (default; vectorized, tuned to --target) or
    /// cranelift (fast compiles, baseline x86-64).
    #[arg(long, value_name = "BACKEND")]
    pub backend: Option<String>,
}

impl CompileSection {
    /// Each key this section sets, with the flag that names it in messages
    /// (`kv_cache_encoding`: `--kv-cache-encoding`): how the flags, parsed into
    /// a section, land over the manifest.
    pub fn flag_settings(&self) -> Vec<FlagSetting> {
        let table = toml::Table::try_from(self).expect("a CompileSection serializes");
        table.into_iter().map(|(key, value)| FlagSetting { flag: format!("--{}", key.replace('_', "-")), key, value }).collect()
    }
}

/// A manifest plus the file it came from, with paths resolved.
#[derive(Debug, Clone)]
pub struct LoadedManifest {
    pub manifest: Manifest,
    /// The manifest file, or `None` for `maxc compile --model PATH`.
    pub source: Option<PathBuf>,
    /// The manifest text after `--model-override`s (recorded in the artifact's
    /// provenance; the flags are recorded beside it).
    pub text: String,
    /// `[compile]` keys set by a command-line flag: key -> flag (for messages).
    pub flag_keys: BTreeMap<String, String>,
}

/// How messages name the manifest: its file, or `<--model>` when there is none.
fn shown_path(source: Option<&Path>) -> PathBuf {
    source.map_or_else(|| PathBuf::from("<--model>"), Path::to_path_buf)
}

/// A `[compile]` key given by a command-line flag (`--target` is `target`):
/// applied over the manifest and its overrides.
#[derive(Debug, Clone)]
pub struct FlagSetting {
    pub key: String,
    pub flag: String,
    pub value: toml::Value,
}

impl LoadedManifest {
    /// The manifest file, or `<--model>` when there is none (for messages).
    pub fn shown(&self) -> PathBuf {
        shown_path(self.source.as_deref())
    }

    /// How messages name `[compile]` key `key`: its flag when a flag set it,
    /// else `compile.<key>`.
    pub fn field_name(&self, key: &str) -> String {
        match self.flag_keys.get(key) {
            Some(flag) => flag.to_string(),
            None => format!("compile.{key}"),
        }
    }

    /// Reads and validates a manifest file, then applies `overrides` (`component.key=value`).
    pub fn from_file(path: &Path, overrides: &[String]) -> Result<Self> {
        Self::from_file_with_flags(path, overrides, &[])
    }

    /// [`LoadedManifest::from_file`], then the flags' settings over it.
    pub fn from_file_with_flags(path: &Path, overrides: &[String], flags: &[FlagSetting]) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            Error::invalid(path, "manifest", format!("is not UTF-8 text (byte {} is not): TOML files are UTF-8; save it as UTF-8", e.utf8_error().valid_up_to()))
        })?;
        let table: toml::Table = toml::from_str(&text)
            .map_err(|e| Error::invalid(path, "manifest", format!("not valid TOML: {e}")))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_table(table, Some(path), &base, overrides, flags)
    }

    /// The manifest `maxc compile --model PATH` implies: that path and every default.
    pub fn from_model_path(model: &Path, overrides: &[String]) -> Result<Self> {
        Self::from_model_path_with_flags(model, overrides, &[])
    }

    /// [`LoadedManifest::from_model_path`], then the flags' settings over it.
    pub fn from_model_path_with_flags(model: &Path, overrides: &[String], flags: &[FlagSetting]) -> Result<Self> {
        let mut table = toml::Table::new();
        let mut model_table = toml::Table::new();
        model_table.insert("path".into(), toml::Value::String(model.to_string_lossy().into_owned()));
        table.insert("model".into(), toml::Value::Table(model_table));
        Self::from_table(table, None, Path::new(""), overrides, flags)
    }

    fn from_table(mut table: toml::Table, source: Option<&Path>, base: &Path, overrides: &[String], flags: &[FlagSetting]) -> Result<Self> {
        for spec in overrides {
            apply_override(&mut table, spec)?;
        }
        let shown = shown_path(source);
        if let Some(components) = table.get("components") {
            let names = components.as_table().map(|t| t.keys().map(|k| format!("[components.{k}]")).collect::<Vec<_>>().join(", "));
            return Err(Error::invalid(
                &shown,
                "components",
                format!(
                    "{}: multi-component artifacts are not supported; maxc compiles the one model of [model] \
                     (a vision or audio tower beside it is not built): remove the table",
                    names.filter(|n| !n.is_empty()).unwrap_or_else(|| "found".into())
                ),
            ));
        }
        let text = toml::to_string(&table).expect("a toml::Table always serializes");
        let mut flag_keys = BTreeMap::new();
        for f in flags {
            debug_assert!(compile_keys().iter().any(|k| *k == f.key), "{} is a [compile] key", f.key);
            if let toml::Value::Table(t) = table.entry("compile").or_insert_with(|| toml::Value::Table(toml::Table::new())) {
                t.insert(f.key.clone(), f.value.clone());
            }
            flag_keys.insert(f.key.clone(), f.flag.clone());
        }
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
        Ok(LoadedManifest { manifest, source: source.map(Path::to_path_buf), text, flag_keys })
    }
}

impl Manifest {
    /// The checks of single values outside `[compile]` (the model's
    /// architecture, `[generation]`'s numbers); every `[compile]` value is
    /// resolved and checked by `compile_config`, which names the flag that set it.
    fn validate(&self, path: &Path) -> Result<()> {
        if let Some(name) = &self.model.architecture {
            if let Err(Error::UnsupportedArchitecture { supported, .. }) = crate::import::Architecture::parse(name, path) {
                return Err(Error::invalid(path, "model.architecture", format!("`{name}` is not supported; supported architectures: {supported}")));
            }
        }
        if self.generation.max_new_tokens == Some(0) {
            return Err(Error::invalid(path, "generation.max_new_tokens", "0 must be at least 1 (a default that generates nothing)"));
        }
        let g = &self.generation;
        if let Some(r) = g.repetition_penalty {
            if !(r > 0.0 && r.is_finite()) {
                return Err(Error::invalid(path, "generation.repetition_penalty", format!("{r} must be a number above 0 (1 turns it off)")));
            }
        }
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

/// `compile.activation_encoding`: how block-quantized and bfloat16 matmuls take their activations.
pub fn parse_activation_encoding(name: &str) -> std::result::Result<crate::schedule::ActivationEncoding, String> {
    use crate::schedule::ActivationEncoding as A;
    [A::Float32, A::Int8, A::Int16, A::BFloat16].into_iter().find(|a| a.name() == name).ok_or_else(|| format!("unknown activation encoding `{name}`; valid: float32, int8, int16, bfloat16"))
}

/// `compile.kv_cache_encoding`: the KV cache's element type.
pub fn parse_kv_cache_encoding(name: &str) -> std::result::Result<maxc_format::KvEncoding, String> {
    maxc_format::KvEncoding::from_name(name).ok_or_else(|| format!("unknown KV cache encoding `{name}`; valid: {}", maxc_format::KvEncoding::all_names()))
}

/// Keys of `[compile]` (that `transformer.<key>` overrides address): the
/// fields of [`CompileSection`], read from its serialization so the list
/// cannot fall behind the struct.
pub fn compile_keys() -> Vec<String> {
    let v = serde_json::to_value(CompileSection::default()).expect("CompileSection serializes");
    v.as_object().expect("a struct serializes to an object").keys().cloned().collect()
}

const MODEL_KEYS: &[&str] = &["path", "name", "architecture"];

/// Applies one `--model-override KEY=VALUE`.
///
/// `KEY` is a dotted path. It may start with a section (`model`, `compile`,
/// `generation`) or with the component name `transformer`, whose `<key>`
/// addresses `[model]` or `[compile]` (MAX's naming). `VALUE` is parsed as a
/// TOML value when it is one (`512`, `0.7`, `true`) and taken as a string otherwise.
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
        "model" | "compile" | "generation" => segments.iter().map(|s| s.to_string()).collect(),
        MAIN_COMPONENT if segments.len() == 2 && MODEL_KEYS.contains(&segments[1]) => {
            vec!["model".into(), segments[1].into()]
        }
        MAIN_COMPONENT if segments.len() == 2 && compile_keys().iter().any(|k| k == segments[1]) => {
            vec!["compile".into(), segments[1].into()]
        }
        MAIN_COMPONENT => {
            let valid: Vec<String> = MODEL_KEYS.iter().map(|k| k.to_string()).chain(compile_keys()).collect();
            return Err(Error::Flag {
                flag: flag.into(),
                message: format!("unknown key `{key}`; valid keys of `{MAIN_COMPONENT}`: {}", valid.join(", ")),
            });
        }
        other => {
            return Err(Error::Flag {
                flag: flag.into(),
                message: format!(
                    "`{key}`: unknown component or section `{other}`; an artifact has one component, \
                     `{MAIN_COMPONENT}`, and the sections model, compile and generation"
                ),
            });
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
    fn overrides_patch_the_main_component_and_sections() {
        let m = load(
            "[model]\npath = \"x\"\n",
            &["transformer.max_length=512", "transformer.quantization_encoding=q8_0", "generation.temperature=0.5"],
        )
        .unwrap();
        assert_eq!(m.manifest.compile.max_length, Some(512));
        assert_eq!(m.manifest.compile.quantization_encoding.as_deref(), Some("q8_0"));
        assert_eq!(m.manifest.generation.temperature, Some(0.5));
    }

    /// A component maxc would not build is refused, never parsed and dropped.
    #[test]
    fn components_are_refused_by_name() {
        let err = load("[model]\npath = \"x\"\n[components.vision]\npath = \"v\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("components") && err.contains("[components.vision]") && err.contains("remove the table"), "{err}");
        let err = load("[model]\npath = \"x\"\n", &["vision.path=v"]).unwrap_err().to_string();
        assert!(err.contains("`vision`") && err.contains("transformer"), "{err}");
        let err = load("[model]\npath = \"x\"\n", &["components.vision.path=v"]).unwrap_err().to_string();
        assert!(err.contains("`components`"), "{err}");
    }

    #[test]
    fn bad_overrides_are_errors() {
        assert!(load("[model]\npath = \"x\"\n", &["nonsense"]).is_err());
        let err = load("[model]\npath = \"x\"\n", &["transformer.colour=red"]).unwrap_err().to_string();
        assert!(err.contains("colour") && err.contains("max_length"), "{err}");
        let err = load("[model]\npath = \"x\"\n", &["compile.max_length=abc"]).unwrap_err().to_string();
        assert!(err.contains("compile.max_length") && err.contains("invalid type"), "{err}");
    }

    /// Flags land in `[compile]` over the manifest, and messages name the flag.
    #[test]
    fn flags_override_the_manifest_and_are_named() {
        let dir = std::env::temp_dir().join(format!("maxc-manifest-flags-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.toml");
        std::fs::write(&path, "[model]\npath = \"x\"\n[compile]\ntarget = \"cpu\"\n").unwrap();
        let flag = FlagSetting { key: "target".into(), flag: "--target".into(), value: "cpu:x86-64-v3".into() };
        let m = LoadedManifest::from_file_with_flags(&path, &[], &[flag]).unwrap();
        assert_eq!(m.manifest.compile.target.as_deref(), Some("cpu:x86-64-v3"));
        assert_eq!(m.field_name("target"), "--target");
        assert_eq!(m.field_name("devices"), "compile.devices");
        assert!(!m.text.contains("x86-64-v3"), "the recorded manifest is the file's, the flags are recorded apart");
    }

    #[test]
    fn compile_keys_are_the_section_fields() {
        let keys = compile_keys();
        for k in ["target", "devices", "quantization_encoding", "kv_cache_encoding", "max_sequences", "backend"] {
            assert!(keys.iter().any(|x| x == k), "{k} in {keys:?}");
        }
        assert_eq!(keys.len(), 11);
    }

    /// Every `[compile]` key is a flag named after it in kebab case, and
    /// `flag_settings` names the flag that clap parses (so a renamed flag
    /// cannot drift from the key it sets or from the messages).
    #[test]
    fn every_compile_key_is_its_kebab_case_flag() {
        use clap::Args;
        let cmd = CompileSection::augment_args(clap::Command::new("maxc"));
        for key in compile_keys() {
            let arg = cmd.get_arguments().find(|a| a.get_id() == key.as_str()).unwrap_or_else(|| panic!("`{key}` is not a flag"));
            assert_eq!(arg.get_long(), Some(key.replace('_', "-").as_str()), "{key}");
        }
        let set = CompileSection { max_length: Some(64), backend: Some("cranelift".into()), ..Default::default() };
        let flags: Vec<(String, String, toml::Value)> = set.flag_settings().into_iter().map(|f| (f.key, f.flag, f.value)).collect();
        assert_eq!(
            flags,
            [("backend".to_string(), "--backend".to_string(), toml::Value::String("cranelift".into())), ("max_length".to_string(), "--max-length".to_string(), toml::Value::Integer(64))]
        );
    }

    #[test]
    fn model_path_manifest_uses_defaults() {
        let m = LoadedManifest::from_model_path(Path::new("some/dir"), &[]).unwrap();
        assert_eq!(m.manifest.model.path, PathBuf::from("some/dir"));
        assert!(m.source.is_none());
    }
}
