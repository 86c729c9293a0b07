//! The compile configuration, resolved once.
//!
//! `maxc compile`'s flags arrive as overrides of the manifest's `[compile]`
//! section (`manifest::LoadedManifest` applies them and remembers which key
//! came from which flag). [`CompileConfig::resolve`] turns that section into
//! typed values and holds every check that needs no model;
//! [`CompileConfig::plan_for`] holds the checks that need the imported model
//! (its encodings, its sizes against the mesh). `maxc compile` and `maxc check`
//! both go through these two functions, so they cannot disagree about what is
//! refused. A new compile option is a `CompileSection` field (which is also its
//! flag) and its use here: two places.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use maxc_format::{BatchLimits, DeviceKind, DeviceMesh, KvEncoding};

use crate::error::Error;
use crate::graph::WeightEncoding;
use crate::import::ImportedModel;
use crate::manifest::LoadedManifest;
use crate::schedule::ActivationEncoding;

/// The code generator for CPU code (GPU code always goes through LLVM's NVPTX backend).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    Llvm,
    Cranelift,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Llvm => "llvm",
            Backend::Cranelift => "cranelift",
        }
    }
}

/// The default `max_length` cap when the manifest sets none.
pub const DEFAULT_MAX_LENGTH: u64 = 4096;
/// Positions per block of the batched engine's paged KV cache (vLLM's default).
pub const KV_BLOCK_SIZE: u64 = 16;
/// The batched engine's rows per step when `compile.max_batch_tokens` is not set.
pub const DEFAULT_MAX_BATCH_TOKENS: u64 = 256;
/// The batched engine's sequences per step when `compile.max_sequences` is not set.
pub const DEFAULT_MAX_SEQUENCES: u64 = 16;
/// Rows with logits a mixed step returns per sequence it holds: a decode row
/// and up to 4 drafted tokens to verify (speculative decoding; docs/serving.md).
/// SmolLM2's mixed plan keeps 15.7 MB of logits at 16 sequences, against 3.1 MB
/// with one row per sequence.
pub const LOGIT_ROWS_PER_SEQUENCE: u64 = 5;
/// A sentence encoder's sequences per step when `compile.max_sequences` is not
/// set: an embeddings request of many inputs takes a step per 32 of them.
pub const DEFAULT_ENCODER_MAX_SEQUENCES: u64 = 32;
/// A sentence encoder's rows per step when `compile.max_batch_tokens` is not set
/// (raised to `max_length` where that is longer, so that any one input fits a
/// step): 32 inputs of 64 tokens. Its activations are linear in the rows (the
/// ragged attention keeps no score rows): all-MiniLM-L6-v2's plan's arena is
/// 27 MiB at 2048 rows (docs/serving.md, Embeddings).
pub const DEFAULT_ENCODER_MAX_ROWS: u64 = 2048;

/// `[compile]` resolved: every value typed, every default applied that does
/// not depend on the model.
#[derive(Debug, Clone)]
pub struct CompileConfig {
    /// The manifest file, or `<--model>` (for messages).
    pub shown: PathBuf,
    /// The linear layers' encoding as named (`stored` included).
    pub encoding_name: String,
    /// `None`: `stored` (each weight keeps the checkpoint's encoding).
    pub linear_encoding: Option<WeightEncoding>,
    pub embedding_encoding: Option<WeightEncoding>,
    /// The activation encoding when one is named (else chosen in [`CompileConfig::plan_for`]).
    pub activations: Option<ActivationEncoding>,
    /// The KV cache's element type when one is named (else chosen in [`CompileConfig::plan_for`]).
    pub kv_encoding: Option<KvEncoding>,
    /// The target as written (`cpu` when none is given).
    pub target_spec: String,
    pub targets: maxc_codegen::TargetSpec,
    /// The CPU part of `target_spec` (`cpu:x86-64-v3+avx512f`).
    pub cpu_spec: String,
    pub backend: Backend,
    /// The mesh: the one named, else one device of the kind the code targets.
    pub mesh: DeviceMesh,
    pub attention: crate::sharding::AttentionSharding,
    pub max_length: Option<u64>,
    pub max_sequences: u64,
    pub max_rows: u64,
    /// `compile.max_sequences` and `compile.max_batch_tokens` as set (an
    /// encoder's defaults differ from a decoder's).
    pub max_sequences_set: Option<u64>,
    pub max_rows_set: Option<u64>,
}

/// A sentence encoder's batch limits ([`maxc_format::EncodeBatch`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct EncodeLimits {
    /// Rows per step, at least `max_length`.
    pub max_rows: u64,
    /// Sequences per step.
    pub max_sequences: u64,
}

/// What the configuration gives for one imported model.
#[derive(Debug, Clone)]
pub struct ModelPlan {
    /// `stored`: each weight's encoding from its storage in the checkpoint.
    pub stored: Option<Arc<HashMap<String, WeightEncoding>>>,
    /// The linear layers' encoding (`WeightEncoding::Float32` under `stored`).
    pub encoding: WeightEncoding,
    pub activations: ActivationEncoding,
    /// The KV cache's element type: the one named, else float32 with float32
    /// weights and float16 with anything narrower.
    pub kv_encoding: KvEncoding,
    pub mesh: DeviceMesh,
    /// Attention split by heads over the mesh (else replicated).
    pub split_attention: bool,
    pub max_length: u64,
    /// The batched engine's limits; `None` without batch plans (an encoder).
    pub batch: Option<BatchLimits>,
    /// A sentence encoder's batch limits (one device; `None` for decoders).
    pub encode_batch: Option<EncodeLimits>,
    /// Decisions the user should know about.
    pub notes: Vec<String>,
}

impl CompileConfig {
    /// Resolves `[compile]` (flags applied). Every problem found is returned,
    /// not only the first.
    pub fn resolve(manifest: &LoadedManifest) -> Result<CompileConfig, Vec<Error>> {
        let shown = manifest.shown();
        let c = &manifest.manifest.compile;
        let mut problems = Vec::new();
        let invalid = |key: &str, message: String| Error::invalid(&shown, manifest.field_name(key), message);
        // A GGUF keeps its blocks unless told otherwise (as MAX infers the
        // encoding from GGUF weights); other checkpoints compile to float32.
        let gguf = crate::import::is_gguf(&manifest.manifest.model.path);
        let encoding_name = c.quantization_encoding.clone().unwrap_or_else(|| if gguf { crate::quant::STORED.into() } else { "float32".into() });
        let linear_encoding = keep(&mut problems, crate::quant::parse_linear_encoding(&encoding_name).map_err(|m| invalid("quantization_encoding", m)));
        let embedding_encoding =
            keep(&mut problems, c.embedding_encoding.as_deref().map(crate::quant::parse_encoding).transpose().map_err(|m| invalid("embedding_encoding", m)));
        let activations = keep(
            &mut problems,
            c.activation_encoding.as_deref().map(crate::manifest::parse_activation_encoding).transpose().map_err(|m| invalid("activation_encoding", m)),
        );
        let kv_encoding = keep(
            &mut problems,
            c.kv_cache_encoding.as_deref().map(crate::manifest::parse_kv_cache_encoding).transpose().map_err(|m| invalid("kv_cache_encoding", m)),
        );
        let target_spec = c.target.clone().unwrap_or_else(|| "cpu".into());
        let targets = keep(
            &mut problems,
            maxc_codegen::TargetSpec::parse(&target_spec).map_err(|e| match e {
                maxc_codegen::CodegenError::Target { spec, message } => invalid("target", format!("`{spec}`: {message}")),
                e => e.into(),
            }),
        );
        let backend = keep(
            &mut problems,
            match c.backend.as_deref().unwrap_or("llvm") {
                "llvm" => Ok(Backend::Llvm),
                "cranelift" => Ok(Backend::Cranelift),
                other => Err(invalid("backend", format!("`{other}` is not a backend; backends: llvm, cranelift"))),
            },
        );
        // Without a mesh, one device of the kind the code targets.
        let devices = c.devices.clone().or_else(|| (!target_spec.split(',').any(|t| t.trim().starts_with("cpu"))).then(|| "gpu:0".to_string()));
        let mesh = keep(&mut problems, crate::sharding::parse_mesh(devices.as_deref().unwrap_or("cpu")).map_err(|m| invalid("devices", m)));
        let attention = keep(
            &mut problems,
            crate::sharding::AttentionSharding::parse(c.attention_sharding.as_deref().unwrap_or("auto")).map_err(|m| invalid("attention_sharding", m)),
        );
        for (key, value) in [("max_length", c.max_length), ("max_batch_tokens", c.max_batch_tokens), ("max_sequences", c.max_sequences)] {
            if value == Some(0) {
                problems.push(invalid(key, "0 must be at least 1".into()));
            }
        }
        let max_sequences = c.max_sequences.map_or(DEFAULT_MAX_SEQUENCES, u64::from);
        let max_rows = c.max_batch_tokens.map_or(DEFAULT_MAX_BATCH_TOKENS.max(max_sequences), u64::from);
        if max_rows < max_sequences && max_rows > 0 {
            problems.push(invalid(
                "max_batch_tokens",
                format!("{max_rows} rows per step cannot hold a decode row for each of {} = {max_sequences} sequences; raise it to at least {max_sequences}", manifest.field_name("max_sequences")),
            ));
        }
        let (Some(linear_encoding), Some(embedding_encoding), Some(activations), Some(kv_encoding), Some(targets), Some(backend), Some(mesh), Some(attention), true) =
            (linear_encoding, embedding_encoding, activations, kv_encoding, targets, backend, mesh, attention, problems.is_empty())
        else {
            return Err(problems);
        };
        // The first CPU variant as written (`cpu:x86-64-v3+avx512f` of
        // `cpu:x86-64-v3+avx512f,x86-64-v4,cuda:sm_90`); `other_cpu_variants`
        // gives the others'.
        let cpu_spec = targets.cpu_specs.first().cloned().unwrap_or_default();
        let mut config = CompileConfig {
            shown,
            encoding_name,
            linear_encoding,
            embedding_encoding,
            activations,
            kv_encoding,
            target_spec,
            targets,
            cpu_spec,
            backend,
            mesh,
            attention,
            max_length: c.max_length.map(u64::from),
            max_sequences,
            max_rows,
            max_sequences_set: c.max_sequences.map(u64::from),
            max_rows_set: c.max_batch_tokens.map(u64::from),
        };
        let problems = config.cross_checks(manifest);
        if problems.is_empty() {
            // Cranelift emits baseline x86-64 scalar code, so the kernels are
            // chosen for baseline x86-64 too, not for the host's vector units:
            // AVX-512's 8-row register tiles, lowered to scalars, gave Cranelift
            // functions of 128 live accumulators that took it 9-17 s each to
            // allocate registers for (docs/performance-log.md, 2026-12-03).
            if config.backend == Backend::Cranelift {
                if let Some(cpu) = config.targets.cpu.as_mut() {
                    *cpu = maxc_codegen::target::CpuTarget::parse("cpu:x86-64").expect("baseline x86-64 is a known target");
                }
            }
            Ok(config)
        } else {
            Err(problems)
        }
    }

    /// The configuration of each further CPU variant of a multi-ISA target
    /// (`cpu:x86-64-v2,x86-64-v3`: one, for x86-64-v3): the same in every
    /// field but the CPU target and its spec. Empty for one CPU target.
    pub fn other_cpu_variants(&self) -> Vec<CompileConfig> {
        let specs = self.targets.cpu_specs.iter().skip(1);
        self.targets
            .cpu_variants
            .iter()
            .zip(specs)
            .map(|(cpu, spec)| {
                let mut c = self.clone();
                c.targets.cpu = Some(cpu.clone());
                c.targets.cpu_variants.clear();
                c.targets.cpu_specs = vec![spec.clone()];
                c.cpu_spec = spec.clone();
                c
            })
            .collect()
    }

    /// The checks between fields that need no model.
    fn cross_checks(&self, manifest: &LoadedManifest) -> Vec<Error> {
        let (shown, spec, field) = (&self.shown, &self.target_spec, |key: &str| manifest.field_name(key));
        let mut problems = Vec::new();
        if self.activations.is_some_and(|a| a != ActivationEncoding::Float32) && !self.targets.gpus.is_empty() {
            let a = self.activations.expect("checked").name();
            problems.push(Error::invalid(
                shown,
                field("activation_encoding"),
                format!("{a} activations have CPU kernels only and `{spec}` has GPU code; use float32 (the default), or a cpu target"),
            ));
        }
        if self.backend == Backend::Cranelift {
            if self.targets.cpu.is_none() {
                problems.push(Error::invalid(
                    shown,
                    field("backend"),
                    format!("cranelift compiles CPU code and `{spec}` has no CPU part (GPU code always goes through LLVM's NVPTX backend); use --backend llvm, or --target cpu,{spec}"),
                ));
            } else if self.targets.cpu.as_ref().is_some_and(|c| c.is_aarch64()) {
                problems.push(Error::invalid(
                    shown,
                    field("backend"),
                    format!("`{spec}`: the cranelift backend emits x86-64 code only; aarch64 code goes through LLVM's AArch64 backend: use --backend llvm"),
                ));
            } else if !self.targets.cpu_variants.is_empty() {
                problems.push(Error::invalid(
                    shown,
                    field("target"),
                    format!("`{spec}`: the cranelift backend emits one baseline x86-64 variant; several CPU variants need --backend llvm"),
                ));
            } else if self.cpu_spec != "cpu" && self.cpu_spec != "cpu:x86-64" {
                problems.push(Error::invalid(
                    shown,
                    field("target"),
                    format!("`{spec}`: the cranelift backend emits baseline x86-64 code; use --target cpu or cpu:x86-64, or --backend llvm"),
                ));
            }
        }
        if !self.targets.gpus.is_empty() && !self.targets.cpu_variants.is_empty() {
            // The PTX modules are the first variant's kernels, and a GPU run reads
            // the kernels and plans of the CPU variant the machine picked.
            problems.push(Error::invalid(
                shown,
                field("target"),
                format!("`{spec}`: an artifact with GPU code takes one CPU variant (its CPU code is the GPU's fallback and shares its kernel table); compile a multi-ISA CPU artifact and a GPU one separately"),
            ));
        }
        if self.mesh.kind == DeviceKind::Gpu && self.targets.gpus.is_empty() {
            problems.push(Error::invalid(shown, field("devices"), format!("`{}` needs GPU code; add it with --target cuda:sm_90 (or cpu,cuda:sm_90)", self.mesh.spec())));
        }
        if self.mesh.kind == DeviceKind::Cpu && self.targets.cpu.is_none() {
            problems.push(Error::invalid(shown, field("devices"), format!("`{}` needs CPU code but the target `{spec}` has none; add cpu, or use --devices gpu:0", self.mesh.spec())));
        }
        problems
    }

    /// The checks and choices that need the model: integer activations need
    /// block weights, the mesh must split the model, the batch limits.
    pub fn plan_for(&self, manifest: &LoadedManifest, model: &ImportedModel) -> Result<ModelPlan, Vec<Error>> {
        let field = |key: &str| manifest.field_name(key);
        let mut problems = Vec::new();
        let stored: Option<Arc<HashMap<String, WeightEncoding>>> = self.linear_encoding.is_none().then(|| {
            let w = &model.weights;
            Arc::new(w.names().map(|n| (n.to_string(), w.get(n).expect("a listed tensor").storage.stored_scheme())).collect())
        });
        let encoding = self.linear_encoding.unwrap_or(WeightEncoding::Float32);
        // Whether any weight's encoding (the linear layers', the embedding's,
        // or under `stored` each checkpoint tensor's) satisfies `test`.
        let any_weight = |test: &dyn Fn(WeightEncoding) -> bool| {
            test(encoding) || self.embedding_encoding.is_some_and(test) || stored.as_ref().is_some_and(|s| s.values().any(|&q| test(q)))
        };
        let block_weights = any_weight(&|e| e.is_block());
        let bf16_weights = any_weight(&|e| e == WeightEncoding::BFloat16);
        // The default: integer activations where they can apply (block weights,
        // CPU code only): int16 beside Q4_0 / Q4_1 blocks, whose logits they keep
        // within the float32 tolerance (the README artifact), int8 beside every
        // other block encoding, whose mean KL against the float32 model stays
        // within 5% of llama.cpp's own on the same file (SmolLM2's Q4_K_M,
        // Q5_K_M, Q6_K and Q8_0: 0.96x, 0.99x, 0.83x, 1.00x; docs/quantization.md,
        // "Activation encodings by measurement"). Else bfloat16 activations
        // beside bfloat16 weights where the CPU multiplies bfloat16 pairs faster
        // than FMAs (AMD Zen 4 / 5), else float32.
        let cpu_only = self.targets.gpus.is_empty();
        let pairs_outrun_fmas = self.targets.cpu.as_ref().is_some_and(|t| t.bf16_pairs_outrun_fmas());
        let activations = self.activations.unwrap_or(if block_weights && cpu_only {
            ActivationEncoding::default_for_blocks(any_weight(&ActivationEncoding::keeps_int16))
        } else if bf16_weights && cpu_only && pairs_outrun_fmas {
            ActivationEncoding::BFloat16
        } else {
            ActivationEncoding::Float32
        });
        if activations == ActivationEncoding::BFloat16 && !bf16_weights {
            problems.push(Error::invalid(
                &self.shown,
                field("activation_encoding"),
                format!("bfloat16 activations multiply bfloat16 weights, and `{}` has none; use --quantization-encoding bfloat16, or drop the setting", self.encoding_name),
            ));
        }
        if matches!(activations, ActivationEncoding::Int8 | ActivationEncoding::Int16) && !block_weights {
            problems.push(Error::invalid(
                &self.shown,
                field("activation_encoding"),
                format!(
                    "{} activations multiply block-quantized weights, and `{}` is not a block encoding; use --quantization-encoding q8_0, q4_0, q4_1 or q4_k",
                    activations.name(),
                    self.encoding_name
                ),
            ));
        }
        // The default cache: exact (float32) beside float32 weights; halves, as
        // llama.cpp's default cache, beside anything narrower, whose rounding
        // is far larger than the halves' (docs/quantization.md, KV cache).
        let kv_encoding = self.kv_encoding.unwrap_or(if any_weight(&|e| e != WeightEncoding::Float32) { KvEncoding::Float16 } else { KvEncoding::Float32 });
        let mut notes = Vec::new();
        // Asked for integer activations with weights whose matmuls have no
        // integer kernels (fp8): said, not silently dropped.
        if self.activations.is_some_and(|a| matches!(a, ActivationEncoding::Int8 | ActivationEncoding::Int16)) && encoding.is_block() && !maxc_kernels::library::matmul_int8::has_integer_kernels(encoding) {
            notes.push(format!(
                "{} = {}: `{}` matmuls have no integer kernels, so the linear layers multiply float activations (only a block-encoded embedding / lm_head takes {} ones)",
                field("activation_encoding"),
                activations.name(),
                encoding.name(),
                activations.name()
            ));
        }
        // Asked for bfloat16 activations where they are not the default: on a
        // CPU without pair dots the same sums in two multiply-adds per pair
        // (SmolLM2 bfloat16 on x86-64-v3 code: prefill 0.63x float32
        // activations', docs/performance.md); with AVX512_BF16 on a CPU not
        // known to run it faster than FMAs, a measurement to make.
        if self.activations == Some(ActivationEncoding::BFloat16) && bf16_weights && cpu_only && !pairs_outrun_fmas {
            let has_pairs = self.targets.cpu.as_ref().is_some_and(|t| t.has_avx512_bf16());
            let why = if has_pairs {
                "`vdpbf16ps` is not known to outrun FMAs there (it does on AMD Zen 4 / 5; on an Intel Xeon VM it ran 0.54x their rate), so float32 activations are the default; compare the two with maxrun bench --compare"
            } else {
                "it has no AVX512_BF16, so each bfloat16 pair is two multiply-adds, slower than float32 activations (the default there), with the same rounding of the activations as on a CPU with it"
            };
            notes.push(format!("{} = bfloat16 on `{}`: {why}", field("activation_encoding"), self.cpu_spec));
        }
        let mut split_attention = false;
        match plan_mesh(&self.shown, &self.mesh, self.attention, &model.config, &field("devices")) {
            Ok((split, mesh_notes)) => {
                split_attention = split;
                notes.extend(mesh_notes);
            }
            Err(e) => problems.push(e),
        }
        notes.extend(block_storage_notes(&manifest.manifest.model.path, &model.weights, &self.encoding_name));
        let cfg = &model.config;
        let max_length = self.max_length.unwrap_or_else(|| (cfg.max_position_embeddings as u64).min(DEFAULT_MAX_LENGTH));
        if self.targets.cpu.is_some() && cfg.encoder.is_none() && !max_length.is_multiple_of(KV_BLOCK_SIZE) {
            notes.push(format!(
                "{} = {max_length} is not a multiple of {KV_BLOCK_SIZE}: the single-stream plans keep the keys in rows, so a serial run and a batched one (and speculative decoding against plain decoding) agree within float rounding rather than to the bit (docs/serving.md, Batch invariance); a multiple of {KV_BLOCK_SIZE} keeps them identical",
                field("max_length")
            ));
        }
        // An encoder's batch step holds whole sentences: attention sees all of
        // one, so a sentence is never split over steps, and every input must fit
        // one step.
        let encode_batch = (self.mesh.len() < 2 && cfg.encoder.is_some()).then(|| EncodeLimits {
            max_rows: self.max_rows_set.unwrap_or(DEFAULT_ENCODER_MAX_ROWS.max(max_length)),
            max_sequences: self.max_sequences_set.unwrap_or(DEFAULT_ENCODER_MAX_SEQUENCES),
        });
        if let Some(e) = encode_batch {
            if e.max_rows < max_length {
                problems.push(Error::invalid(
                    &self.shown,
                    field("max_batch_tokens"),
                    format!(
                        "{} rows per step cannot hold a whole input of {} = {max_length} tokens ({} is a sentence encoder: its attention sees a whole input, so an input is never split over steps); raise it to at least {max_length}, or lower the maximum length",
                        e.max_rows,
                        field("max_length"),
                        cfg.architecture.hf_name()
                    ),
                ));
            } else if e.max_rows < e.max_sequences {
                problems.push(Error::invalid(
                    &self.shown,
                    field("max_sequences"),
                    format!("{} sequences per step cannot each have a row of the {} rows per step ({}); lower it to at most {}", e.max_sequences, e.max_rows, field("max_batch_tokens"), e.max_rows),
                ));
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        let batch = cfg.encoder.is_none().then_some(BatchLimits {
            block_size: KV_BLOCK_SIZE,
            blocks_per_sequence: max_length.div_ceil(KV_BLOCK_SIZE),
            max_rows: self.max_rows,
            max_sequences: self.max_sequences,
            max_logit_rows: (self.max_sequences * LOGIT_ROWS_PER_SEQUENCE).min(self.max_rows).max(self.max_sequences),
        });
        Ok(ModelPlan { stored, encoding, activations, kv_encoding, mesh: self.mesh.clone(), split_attention, max_length, batch, encode_batch, notes })
    }
}

/// The value of `result`, or `None` with its error added to `problems` (so
/// that every independent problem is reported, not only the first).
fn keep<T>(problems: &mut Vec<Error>, result: Result<T, Error>) -> Option<T> {
    result.map_err(|e| problems.push(e)).ok()
}

/// Checks `mesh` and the attention policy against the model: a mesh that cannot
/// split it is an error naming `field` (the devices key or flag), the config
/// field, its value and the device count. Returns whether attention is split
/// by heads, and notes for the user.
pub(crate) fn plan_mesh(
    shown: &Path,
    mesh: &maxc_format::DeviceMesh,
    policy: crate::sharding::AttentionSharding,
    cfg: &crate::import::ModelConfig,
    field: &str,
) -> crate::Result<(bool, Vec<String>)> {
    use crate::error::Error;
    use crate::sharding::AttentionSharding;
    let n = mesh.len() as u64;
    let mut notes = Vec::new();
    if n < 2 {
        return Ok((false, notes));
    }
    let field = |m: String| Err(Error::invalid(shown, field, m));
    if cfg.encoder.is_some() {
        return field(format!("`{}` splits decoder models; {} is an encoder, compile it for one device (--devices cpu)", mesh.spec(), cfg.architecture.hf_name()));
    }
    let inter = cfg.intermediate_size as u64;
    if !inter.is_multiple_of(n) {
        return field(format!(
            "{} devices do not divide the MLP: intermediate_size is {inter} ({inter} % {n} = {}); use a device count that divides {inter}",
            n,
            inter % n
        ));
    }
    let (heads, kv) = (cfg.num_heads as u64, cfg.num_kv_heads as u64);
    let divides = kv.is_multiple_of(n) && heads.is_multiple_of(n);
    let split = match policy {
        AttentionSharding::Replicated => false,
        AttentionSharding::Heads if !divides => {
            return field(format!(
                "attention_sharding = \"heads\" needs the device count to divide the KV heads: num_key_value_heads is {kv} and the mesh has {n} devices; use a device count that divides {kv}, or attention_sharding = \"auto\" to replicate attention"
            ))
        }
        AttentionSharding::Heads => true,
        AttentionSharding::Auto if !divides => {
            notes.push(format!(
                "num_key_value_heads is {kv}, which {n} devices do not divide: attention runs replicated on every device (the MLP, embedding and lm_head are split); --attention-sharding heads makes this an error"
            ));
            false
        }
        AttentionSharding::Auto => true,
    };
    Ok((split, notes))
}

/// What becomes of a checkpoint's matrices stored in GGUF block types whose
/// blocks the compile does not keep, for the user: under `stored`, those
/// without integer kernels (widened to the nearest more precise encoding with
/// them); under a named encoding, those maxc has no kernels for at all (which
/// a user might expect to be kept).
pub(crate) fn block_storage_notes(path: &Path, weights: &crate::import::WeightStore, named: &str) -> Vec<String> {
    use crate::import::StorageType;
    let stored = named == crate::quant::STORED;
    let noted = |t: StorageType| t != StorageType::F32 && if stored { Some(t.stored_scheme()) != t.native_scheme() } else { t.native_scheme().is_none() };
    let mut counts: std::collections::BTreeMap<&'static str, (StorageType, usize)> = Default::default();
    for name in weights.names() {
        let entry = weights.get(name).expect("a listed tensor");
        if entry.shape.len() == 2 && noted(entry.storage) {
            counts.entry(entry.storage.name()).or_insert((entry.storage, 0)).1 += 1;
        }
    }
    if counts.is_empty() {
        return Vec::new();
    }
    let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
    let listed = counts.iter().map(|(name, (_, n))| format!("{n} {name}")).collect::<Vec<_>>().join(", ");
    if !stored {
        return vec![format!("{file}: {listed} matrices have no kernels in maxc; they are dequantized exactly, then encoded as {named}")];
    }
    // Each encoding the noted types widen to, with those types.
    let mut fates: std::collections::BTreeMap<&'static str, Vec<&'static str>> = Default::default();
    for (name, (t, _)) in &counts {
        fates.entry(t.stored_scheme().name()).or_default().push(name);
    }
    let fates: Vec<String> = fates.iter().map(|(q, from)| format!("{q} ({})", from.join(", "))).collect();
    vec![format!(
        "{file}: {listed} matrices are in GGUF blocks without integer kernels in maxc; they are dequantized exactly, then encoded as {}, the nearest more precise encoding with them (--quantization-encoding names another)",
        fates.join(" and ")
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(compile: &str) -> Result<CompileConfig, Vec<Error>> {
        let dir = std::env::temp_dir().join(format!("maxc-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = dir.join(format!("m{}.toml", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        std::fs::write(&path, format!("[model]\npath = \"x\"\n[compile]\n{compile}\n")).unwrap();
        CompileConfig::resolve(&LoadedManifest::from_file(&path, &[]).unwrap())
    }

    fn messages(r: Result<CompileConfig, Vec<Error>>) -> Vec<String> {
        r.unwrap_err().iter().map(ToString::to_string).collect()
    }

    #[test]
    fn stored_is_a_linear_encoding_only() {
        assert!(resolve("quantization_encoding = \"stored\"").is_ok());
        let err = messages(resolve("embedding_encoding = \"stored\""));
        assert!(err[0].contains("compile.embedding_encoding") && err[0].contains("stored") && err[0].contains("q8_0"), "{err:?}");
        let err = messages(resolve("quantization_encoding = \"q3\""));
        assert!(err[0].contains("compile.quantization_encoding") && err[0].contains("q4_k, float8_e4m3fn, q5_0, q5_1, q6_k, q5_k, stored"), "{err:?}");
    }

    #[test]
    fn every_independent_problem_is_reported() {
        let err = messages(resolve("quantization_encoding = \"q3\"\nkv_cache_encoding = \"int4\"\nbackend = \"gcc\"\ndevices = \"tpu:0\""));
        assert_eq!(err.len(), 4, "{err:?}");
        for (e, field) in err.iter().zip(["compile.quantization_encoding", "compile.kv_cache_encoding", "compile.backend", "compile.devices"]) {
            assert!(e.contains(field), "{e}");
        }
    }

    /// Cranelift's kernels are chosen for the baseline x86-64 code it emits,
    /// whatever vector units the host has (checked on any host with AVX2).
    #[test]
    fn cranelift_schedules_for_baseline_x86_64() {
        let config = resolve("backend = \"cranelift\"").unwrap();
        let cpu = config.targets.cpu.as_ref().unwrap();
        assert!(!cpu.has_avx2() && !cpu.has_avx512() && !cpu.multiplies_q8_0_bytes_directly(), "{cpu:?}");
        let llvm = resolve("backend = \"llvm\"").unwrap();
        assert_eq!(llvm.targets.cpu, Some(maxc_codegen::target::CpuTarget::host()));
    }

    #[test]
    fn cross_field_checks() {
        let err = messages(resolve("target = \"cuda:sm_90\"\nactivation_encoding = \"int8\""));
        assert!(err.iter().any(|e| e.contains("compile.activation_encoding") && e.contains("CPU kernels only")), "{err:?}");
        let err = messages(resolve("target = \"cpu:x86-64-v3\"\nbackend = \"cranelift\""));
        assert!(err[0].contains("compile.target") && err[0].contains("baseline x86-64"), "{err:?}");
        let err = messages(resolve("target = \"cpu:aarch64+dotprod\"\nbackend = \"cranelift\""));
        assert!(err[0].contains("compile.backend") && err[0].contains("x86-64 code only") && err[0].contains("--backend llvm"), "{err:?}");
        let err = messages(resolve("devices = \"gpu:0,1\""));
        assert!(err[0].contains("compile.devices") && err[0].contains("needs GPU code"), "{err:?}");
        let err = messages(resolve("max_batch_tokens = 4\nmax_sequences = 8"));
        assert!(err[0].contains("compile.max_batch_tokens") && err[0].contains("at least 8"), "{err:?}");
        let ok = resolve("target = \"cuda:sm_90\"").unwrap();
        assert_eq!(ok.mesh.spec(), "gpu:0", "a GPU-only target gets one GPU");
    }
}
